"""Checker of exercise 02: Megatron's f and g, column- and row-parallel linear.

For t = 2 and 4 TP ranks, in float64: the shards of a full weight; f and g alone; each
layer alone; and the column -> row pair (the MLP of Shoeybi et al. 2019, figure 3a,
without the GELU), all against two single-device `minipar.nn.Linear` layers run by
minipar's autograd in this process: forward values, gradients of the input, the weights
and the biases, and the all-reduces each phase made (count, size and bytes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from minipar import distributed as dist
from minipar.autograd import Tensor
from minipar.nn import Linear, Parameter

from .harness import CheckFailed, expect, expect_close, start_report
from .source_check import check_building_blocks

NUMBER, TITLE = "02", "column- and row-parallel linear with f and g"
# The check of the file's text, which the grader also runs on its own copy (grader.py).
BUILDING_BLOCKS = "uses its own f, g and layers (not minipar.parallel)"
WORLDS = (2, 4)
B, T, D_IN, D_HIDDEN, D_OUT = 2, 3, 6, 8, 5  # D_HIDDEN splits over 2 and 4 ranks
RTOL = 1e-12

FORBIDDEN = {"minipar.parallel": "the library's tensor parallelism is the answer key; "
                                 "write f, g and the layers yourself",
             "copy_to_tensor_parallel_region": "the library's f; write your own",
             "reduce_from_tensor_parallel_region": "the library's g; write your own",
             "ColumnParallelLinear": "the library's layer; write your own",
             "RowParallelLinear": "the library's layer; write your own"}


@dataclass(frozen=True)
class Data:
    x: np.ndarray  # (B, T, D_IN) input of the column-parallel layer
    w1: np.ndarray  # (D_IN, D_HIDDEN), b1 (D_HIDDEN,): the column-parallel Linear
    b1: np.ndarray
    w2: np.ndarray  # (D_HIDDEN, D_OUT), b2 (D_OUT,): the row-parallel Linear
    b2: np.ndarray
    h: np.ndarray  # (B, T, D_HIDDEN) input of the row-parallel layer alone
    grad_hidden: np.ndarray  # (B, T, D_HIDDEN) upstream gradient of the column layer alone
    grad_out: np.ndarray  # (B, T, D_OUT) upstream gradient of the output
    per_rank: np.ndarray  # (4, B, T, D_IN) different arrays per rank (for f and g)


def make_data(seed: int = 0) -> Data:
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal
    return Data(normal((B, T, D_IN)), normal((D_IN, D_HIDDEN)), normal(D_HIDDEN),
                normal((D_HIDDEN, D_OUT)), normal(D_OUT), normal((B, T, D_HIDDEN)),
                normal((B, T, D_HIDDEN)), normal((B, T, D_OUT)),
                normal((max(WORLDS), B, T, D_IN)))


def linear(weight: np.ndarray, bias: np.ndarray) -> Linear:
    """A single-device minipar.nn.Linear holding these weights."""
    layer = Linear(*weight.shape)
    layer.weight.data[...] = weight
    layer.bias.data[...] = bias
    return layer


def reference(d: Data) -> dict[str, np.ndarray]:
    """Single-device values and gradients, from minipar.nn.Linear and its autograd."""
    out = {}
    lin1, lin2 = linear(d.w1, d.b1), linear(d.w2, d.b2)
    x = Tensor(d.x.copy(), requires_grad=True)
    hidden = lin1(x)
    hidden.backward(d.grad_hidden)
    out.update(column_y=hidden.data, column_dx=x.grad, column_dw=lin1.weight.grad,
               column_db=lin1.bias.grad)
    lin1, lin2 = linear(d.w1, d.b1), linear(d.w2, d.b2)
    h = Tensor(d.h.copy(), requires_grad=True)
    y = lin2(h)
    y.backward(d.grad_out)
    out.update(row_y=y.data, row_dx=h.grad, row_dw=lin2.weight.grad, row_db=lin2.bias.grad)
    lin1, lin2 = linear(d.w1, d.b1), linear(d.w2, d.b2)
    x = Tensor(d.x.copy(), requires_grad=True)
    y = lin2(lin1(x))
    y.backward(d.grad_out)
    out.update(pair_y=y.data, pair_dx=x.grad, pair_dw1=lin1.weight.grad,
               pair_db1=lin1.bias.grad, pair_dw2=lin2.weight.grad, pair_db2=lin2.bias.grad)
    return out


def columns(rank: int, t: int, width: int = D_HIDDEN) -> slice:
    return slice(rank * width // t, (rank + 1) * width // t)


# ------------------------------------------------------------------ running on t ranks
def _tensor(result, what: str) -> Tensor:
    if not isinstance(result, Tensor):
        raise CheckFailed(f"{what} returned {type(result).__name__}; it must return a "
                          "minipar Tensor (build it with F.linear, Tensor ops or "
                          "Function.apply) so that backward can run through it")
    return result


def _comm(device) -> dict[str, Counter]:
    """{phase: Counter of ops} of one rank's communication."""
    calls = {"forward": Counter(), "backward": Counter()}
    for record in device.comm.records:
        calls.setdefault(record.phase, Counter())[record.op] += 1
    return calls


def _run(program, t: int, *args):
    def rank_program():
        group = dist.new_group(range(t), kind="tp")
        return program(group, dist.get_rank(), *args)

    return dist.launch(rank_program, t, return_devices=True)


def _f_program(group, rank, impl, d: Data):
    x = Tensor(d.x.copy(), requires_grad=True)
    with dist.phase("forward"):
        y = _tensor(impl.f(x, group), "f(x, group)")
    with dist.phase("backward"):
        y.backward(d.per_rank[rank, :, :, :])
    return y.data.copy(), x.grad


def _g_program(group, rank, impl, d: Data):
    x = Tensor(d.per_rank[rank].copy(), requires_grad=True)
    with dist.phase("forward"):
        y = _tensor(impl.g(x, group), "g(x, group)")
    with dist.phase("backward"):
        y.backward(d.x)  # the same upstream gradient on every rank, as after a real g
    return y.data.copy(), x.grad


def _column_program(group, rank, impl, d: Data):
    t = group.size
    cols = columns(rank, t)
    x = Tensor(d.x.copy(), requires_grad=True)
    weight, bias = Parameter(d.w1[:, cols].copy()), Parameter(d.b1[cols].copy())
    with dist.phase("forward"):
        y = _tensor(impl.column_parallel_linear(x, weight, bias, group),
                    "column_parallel_linear")
    with dist.phase("backward"):
        y.backward(d.grad_hidden[..., cols].copy())
    return y.data.copy(), x.grad, weight.grad, bias.grad


def _row_program(group, rank, impl, d: Data):
    rows = columns(rank, group.size)
    x = Tensor(d.h[..., rows].copy(), requires_grad=True)
    weight, bias = Parameter(d.w2[rows].copy()), Parameter(d.b2.copy())
    with dist.phase("forward"):
        y = _tensor(impl.row_parallel_linear(x, weight, bias, group), "row_parallel_linear")
    with dist.phase("backward"):
        y.backward(d.grad_out.copy())
    return y.data.copy(), x.grad, weight.grad, bias.grad


def _pair_program(group, rank, impl, d: Data):
    cols = columns(rank, group.size)
    x = Tensor(d.x.copy(), requires_grad=True)
    w1, b1 = Parameter(d.w1[:, cols].copy()), Parameter(d.b1[cols].copy())
    w2, b2 = Parameter(d.w2[cols].copy()), Parameter(d.b2.copy())
    with dist.phase("forward"):
        hidden = _tensor(impl.column_parallel_linear(x, w1, b1, group),
                         "column_parallel_linear")
        y = _tensor(impl.row_parallel_linear(hidden, w2, b2, group), "row_parallel_linear")
    with dist.phase("backward"):
        y.backward(d.grad_out.copy())
    return y.data.copy(), x.grad, w1.grad, b1.grad, w2.grad, b2.grad


def _grad(value, what: str):
    expect(value is not None, f"{what} is None: no gradient reached it (is the output "
                              "built from it with minipar Tensor ops?)")
    return value


# ------------------------------------------------------------------ the checks
def check_shards(impl, d: Data) -> None:
    for t in WORLDS:
        for rank in range(t):
            cols = columns(rank, t)
            weight, bias = impl.column_shard(d.w1, d.b1, rank, t)
            expect(np.shape(weight) == (D_IN, D_HIDDEN // t),
                   f"column_shard(rank={rank}, world={t}) returned a weight of shape "
                   f"{np.shape(weight)} for a full ({D_IN}, {D_HIDDEN}); expected "
                   f"({D_IN}, {D_HIDDEN // t}): column-parallel splits the output dimension "
                   "(axis 1 of the (in, out) weight)")
            expect_close(weight, d.w1[:, cols], f"column_shard(rank={rank}, world={t}) weight "
                         f"(expected columns {cols.start}..{cols.stop - 1})", RTOL, 0)
            expect_close(bias, d.b1[cols], f"column_shard(rank={rank}, world={t}) bias "
                         f"(expected entries {cols.start}..{cols.stop - 1})", RTOL, 0)
            rows = columns(rank, t)
            weight, bias = impl.row_shard(d.w2, d.b2, rank, t)
            expect(np.shape(weight) == (D_HIDDEN // t, D_OUT),
                   f"row_shard(rank={rank}, world={t}) returned a weight of shape "
                   f"{np.shape(weight)} for a full ({D_HIDDEN}, {D_OUT}); expected "
                   f"({D_HIDDEN // t}, {D_OUT}): row-parallel splits the input dimension "
                   "(axis 0 of the (in, out) weight)")
            expect_close(weight, d.w2[rows], f"row_shard(rank={rank}, world={t}) weight "
                         f"(expected rows {rows.start}..{rows.stop - 1})", RTOL, 0)
            expect_close(bias, d.b2, f"row_shard(rank={rank}, world={t}) bias (replicated: "
                         "the whole bias on every rank)", RTOL, 0)


def check_f(impl, d: Data) -> None:
    for t in WORLDS:
        results, devices = _run(_f_program, t, impl, d)
        total = d.per_rank[:t].sum(axis=0)
        for rank, (y, dx) in enumerate(results):
            expect_close(y, d.x, f"t={t}: f's forward on rank {rank} (must be the identity)")
            dx = _grad(dx, f"t={t}: x.grad on rank {rank} after f")
            if np.allclose(dx, d.per_rank[rank]) and not np.allclose(dx, total):
                raise CheckFailed(f"t={t}: x.grad on rank {rank} is this rank's own gradient; "
                                  "f's backward must all-reduce (sum) it over the group: "
                                  "every rank used the same x")
            expect_close(dx, total, f"t={t}: x.grad on rank {rank} after f (the sum of the "
                         "ranks' upstream gradients)")
            _expect_calls(devices[rank], t, rank, "f", forward=0, backward=1)


def check_g(impl, d: Data) -> None:
    for t in WORLDS:
        results, devices = _run(_g_program, t, impl, d)
        total = d.per_rank[:t].sum(axis=0)
        for rank, (y, dx) in enumerate(results):
            expect_close(y, total, f"t={t}: g's forward on rank {rank} (the sum of the ranks' "
                         "inputs)")
            dx = _grad(dx, f"t={t}: x.grad on rank {rank} after g")
            if np.allclose(dx, t * d.x):
                raise CheckFailed(f"t={t}: x.grad on rank {rank} is t={t} times the upstream "
                                  "gradient: g's backward must be the identity (every rank "
                                  "already holds the gradient of the same, summed output)")
            expect_close(dx, d.x, f"t={t}: x.grad on rank {rank} after g (the upstream "
                         "gradient, unchanged)")
            _expect_calls(devices[rank], t, rank, "g", forward=1, backward=0)


def _expect_calls(device, t: int, rank: int, what: str, *, forward: int, backward: int) -> None:
    calls = _comm(device)
    for phase, wanted in (("forward", forward), ("backward", backward)):
        ops = calls.get(phase, Counter())
        got = ops["all_reduce"]
        others = {op: n for op, n in ops.items() if op != "all_reduce"}
        expect(not others, f"t={t}: {what} called {dict(others)} in {phase} on rank {rank}; "
                           "f and g need all_reduce only")
        expect(got == wanted, f"t={t}: {what} made {got} all-reduce(s) in {phase} on rank "
                              f"{rank}, expected {wanted}")


def check_column(impl, d: Data, ref: dict) -> None:
    for t in WORLDS:
        results, _ = _run(_column_program, t, impl, d)
        for rank, (y, dx, dw, db) in enumerate(results):
            cols = columns(rank, t)
            where = f"t={t}, rank {rank}"
            expect_close(y, ref["column_y"][..., cols],
                         f"{where}: output (expected columns {cols.start}..{cols.stop - 1} of "
                         "X A + b)")
            dx = _grad(dx, f"{where}: x.grad")
            partial = d.grad_hidden[..., cols] @ d.w1[:, cols].T
            if np.allclose(dx, partial) and not np.allclose(dx, ref["column_dx"]):
                raise CheckFailed(f"{where}: x.grad is only this rank's share "
                                  "dY_i A_i^T: x must enter through f, whose backward sums "
                                  "the shares of all ranks")
            expect_close(dx, ref["column_dx"], f"{where}: x.grad (dL/dX of the single-device "
                         "Linear)")
            expect_close(_grad(dw, f"{where}: weight.grad"), ref["column_dw"][:, cols],
                         f"{where}: weight.grad (my columns of the single-device gradient)")
            expect_close(_grad(db, f"{where}: bias.grad"), ref["column_db"][cols],
                         f"{where}: bias.grad (my entries of the single-device gradient)")


def check_row(impl, d: Data, ref: dict) -> None:
    for t in WORLDS:
        results, _ = _run(_row_program, t, impl, d)
        for rank, (y, dx, dw, db) in enumerate(results):
            rows = columns(rank, t)
            where = f"t={t}, rank {rank}"
            if np.allclose(y, ref["row_y"] + (t - 1) * d.b2):
                raise CheckFailed(f"{where}: the output is X A + t*b: the bias was added on "
                                  "every rank before the sum; add it once, after g")
            if np.allclose(y, d.h[..., rows] @ d.w2[rows] + d.b2):
                raise CheckFailed(f"{where}: the output is only this rank's partial product "
                                  "X_i A_i + b: sum the partial products over the group with "
                                  "g before adding the bias")
            expect_close(y, ref["row_y"], f"{where}: output (X A + b of the single-device "
                         "Linear)")
            expect_close(_grad(dx, f"{where}: x.grad"), ref["row_dx"][..., rows],
                         f"{where}: x.grad (my slice of the single-device dL/dX)")
            expect_close(_grad(dw, f"{where}: weight.grad"), ref["row_dw"][rows],
                         f"{where}: weight.grad (my rows of the single-device gradient)")
            expect_close(_grad(db, f"{where}: bias.grad"), ref["row_db"],
                         f"{where}: bias.grad (the full single-device gradient)")


def check_pair(impl, d: Data, ref: dict) -> None:
    for t in WORLDS:
        results, _ = _run(_pair_program, t, impl, d)
        for rank, (y, dx, dw1, db1, dw2, db2) in enumerate(results):
            cols = columns(rank, t)
            where = f"t={t}, rank {rank}"
            expect_close(y, ref["pair_y"], f"{where}: output of column -> row")
            for got, expected, name in (
                    (dx, ref["pair_dx"], "x.grad"),
                    (dw1, ref["pair_dw1"][:, cols], "column weight.grad"),
                    (db1, ref["pair_db1"][cols], "column bias.grad"),
                    (dw2, ref["pair_dw2"][cols], "row weight.grad"),
                    (db2, ref["pair_db2"], "row bias.grad")):
                expect_close(_grad(got, f"{where}: {name}"), expected, f"{where}: {name}")


def check_pair_communication(impl, d: Data) -> None:
    for t in WORLDS:
        _, devices = _run(_pair_program, t, impl, d)
        for rank, device in enumerate(devices):
            for phase, numel, who in (("forward", B * T * D_OUT, "g's, of the (B, T, out) "
                                                                "output"),
                                      ("backward", B * T * D_IN, "f's, of the (B, T, in) "
                                                                 "input gradient")):
                records = [r for r in device.comm.records if r.phase == phase]
                others = sorted({r.op for r in records} - {"all_reduce"})
                expect(not others, f"t={t}, rank {rank}: {phase} called {', '.join(others)}; "
                                   "column -> row needs all-reduces only")
                sizes = [r.sent_bytes for r in records]
                expected = dist.all_reduce_bytes(numel, 8, t, rank)[0]
                if len(records) != 1:
                    sending = f" (sending {sizes} bytes)" if records else ""
                    raise CheckFailed(
                        f"t={t}, rank {rank}: {phase} made {len(records)} all-reduces{sending}; "
                        f"column -> row needs exactly one, {who} "
                        f"({numel} elements): the column-parallel output stays split and "
                        "goes straight into the row-parallel layer")
                expect(sizes[0] == expected,
                       f"t={t}, rank {rank}: the {phase} all-reduce sent {sizes[0]} bytes; "
                       f"{who} ({numel} float64 elements) sends 2(t-1)/t*S = {expected}")


def check(impl, *, show_traceback: bool = False):
    report = start_report(NUMBER, TITLE, impl, show_traceback)
    d = make_data()
    ref = reference(d)
    report.run(BUILDING_BLOCKS, check_building_blocks, impl, FORBIDDEN)
    report.run("column_shard / row_shard give each rank its columns / rows",
               check_shards, impl, d)
    report.run("f: identity forward, all-reduce of the gradient backward", check_f, impl, d)
    report.run("g: all-reduce forward, identity backward", check_g, impl, d)
    report.run("column-parallel linear: my columns of X A + b; gradients of x, A_i, b_i",
               check_column, impl, d, ref)
    report.run("row-parallel linear: X A + b from my rows; gradients of x_i, A_i, b",
               check_row, impl, d, ref)
    report.run("column -> row equals two single-device Linears (values and all gradients)",
               check_pair, impl, d, ref)
    report.run("column -> row communicates: 1 all-reduce forward (g), 1 backward (f)",
               check_pair_communication, impl, d)
    return report
