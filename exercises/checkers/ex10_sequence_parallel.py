"""Checker of exercise 10: g and g-bar of sequence parallelism, the MLP block between
them, and the all-reduce of the replicated parameters' gradients.

For t = 2 and 4, each rank runs `sequence_parallel_mlp` on its sequence piece of one
(B, T, d) fp64 batch, backward of sum(out * grad_out) under dist.phase("forward") /
("backward"), then `allreduce_sequence_parallel_grads` on ln_weight, ln_bias and b2.
The reference is the same block on one device, on the whole batch (minipar's own
layer_norm, linear and gelu). Checks: g and g-bar on their own (shapes, values, one
collective each way); the block's output and every gradient; the communication by phase.
A bias added before the reduce-scatter, a gather whose backward keeps only my piece,
TP's all-reduce in place of the reduce-scatter and replicated gradients left partial are
named.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar import distributed as dist
from minipar.autograd import Tensor
from minipar.autograd import functional as F

from .harness import CheckFailed, expect, start_report
from .source_check import check_building_blocks

NUMBER, TITLE = "10", "sequence parallelism: g and g-bar around the MLP"
BUILDING_BLOCKS = "builds g and g-bar from the collectives (no library sequence parallelism)"
FORBIDDEN = {"minipar.parallel": "the library's sequence parallelism is the answer key"}
WORLDS = (2, 4)
B, T, D = 2, 8, 8  # 4D = 32 hidden units: splits over 2 and 4
SEQ = 1
RTOL, ATOL = 1e-10, 1e-12
NAMES = ("ln_weight", "ln_bias", "w1", "b1", "w2", "b2")
REPLICATED = ("ln_weight", "ln_bias", "b2")


def weights(seed: int = 10) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"ln_weight": 1 + 0.1 * rng.standard_normal(D), "ln_bias": rng.standard_normal(D),
            "w1": rng.standard_normal((D, 4 * D)) / D ** 0.5,
            "b1": rng.standard_normal(4 * D),
            "w2": rng.standard_normal((4 * D, D)) / (2 * D), "b2": rng.standard_normal(D)}


def block(x: Tensor, p: dict) -> Tensor:
    """The MLP block on one device."""
    h = F.layer_norm(x, p["ln_weight"], p["ln_bias"])
    h = F.gelu(F.linear(h, p["w1"], p["b1"]))
    return x + F.linear(h, p["w2"], p["b2"])


def reference(x: np.ndarray, grad_out: np.ndarray, mask=None) -> dict:
    """Output and gradients on one device; `mask` keeps grad_out on some tokens only
    (what one rank's tokens contribute to a replicated parameter's gradient)."""
    xt = Tensor(x, requires_grad=True)
    p = {k: Tensor(v, requires_grad=True) for k, v in weights().items()}
    out = block(xt, p)
    out.backward(grad_out if mask is None else grad_out * mask)
    return {"out": out.data, "x": xt.grad, **{k: v.grad for k, v in p.items()}}


def shards(full: dict, rank: int, t: int) -> dict:
    width = 4 * D // t
    cols = slice(rank * width, (rank + 1) * width)
    return {"ln_weight": full["ln_weight"].copy(), "ln_bias": full["ln_bias"].copy(),
            "w1": full["w1"][:, cols].copy(), "b1": full["b1"][cols].copy(),
            "w2": full["w2"][cols].copy(), "b2": full["b2"].copy()}


def piece(x: np.ndarray, rank: int, t: int) -> np.ndarray:
    n = x.shape[SEQ] // t
    return x[:, rank * n:(rank + 1) * n].copy()


def data(t: int):
    rng = np.random.default_rng([10, t])
    return rng.standard_normal((B, T, D)), rng.standard_normal((B, T, D))


def _records(device, start: int) -> list:
    return [(r.op, r.phase, r.sent_bytes) for r in device.comm.records[start:]]


# ------------------------------------------------------------------ operators alone
def _operators(impl, t: int, x: np.ndarray, full: np.ndarray):
    group = dist.new_group(range(t), kind="tp")
    rank, device = dist.get_rank(), dist.get_device()
    out = {}
    mine = Tensor(piece(x, rank, t), requires_grad=True)
    with dist.phase("forward"):
        gathered = impl.GatherFromSequenceParallelRegion.apply(mine, group)
    _expect_tensor(gathered, "GatherFromSequenceParallelRegion")
    with dist.phase("backward"):  # a rank-dependent gradient: a partial one on each
        gathered.backward(_fitting(full * (rank + 1), gathered))
    out["gather"] = (np.array(gathered.data), np.array(mine.grad), _records(device, 0))
    start = len(device.comm.records)
    whole = Tensor(full * (rank + 1), requires_grad=True)
    with dist.phase("forward"):
        scattered = impl.ReduceScatterToSequenceParallelRegion.apply(whole, group)
    _expect_tensor(scattered, "ReduceScatterToSequenceParallelRegion")
    with dist.phase("backward"):
        scattered.backward(_fitting(piece(x, rank, t), scattered))
    out["scatter"] = (np.array(scattered.data), np.array(whole.grad),
                      _records(device, start))
    return out


def _expect_tensor(out, name: str) -> None:
    expect(isinstance(out, Tensor), f"{name}.apply returned {type(out).__name__}; return a "
                                    "Tensor (forward returns an array, which apply wraps)")


def _fitting(grad: np.ndarray, out: Tensor) -> np.ndarray:
    """grad, or zeros when the output has the wrong shape (reported by the shape check)."""
    return grad if grad.shape == out.shape else np.zeros(out.shape)


def check_gather(impl) -> None:
    for t in WORLDS:
        x, full = data(t)
        ranks = dist.launch(_operators, t, impl, t, x, full)
        summed = full * sum(range(1, t + 1))
        for rank, result in enumerate(ranks):
            value, grad, records = result["gather"]
            where = f"t={t}, rank {rank}, g"
            expect(value.shape == (B, T, D), f"{where}: forward returned shape {value.shape}; "
                   f"all-gathering my (B, T/t, d) = {(B, T // t, D)} along the sequence "
                   f"gives (B, T, d) = {(B, T, D)}")
            expect(np.allclose(value, x, rtol=RTOL, atol=ATOL),
                   f"{where}: forward is not the pieces concatenated in rank order along the "
                   "sequence (dim 1)")
            expect(grad.shape == (B, T // t, D) and np.allclose(
                       grad, piece(summed, rank, t), rtol=RTOL, atol=ATOL),
                   f"{where}: backward must return my tokens' gradient summed over the ranks "
                   "(each rank's is a partial sum): reduce-scatter with op='sum' along dim 1"
                   + (": it kept only this rank's own gradient, with no communication"
                      if grad.shape == (B, T // t, D) and np.allclose(
                          grad, piece(full * (rank + 1), rank, t)) else ""))
            _expect_ops(f"{where}", records, {"forward": ["all_gather"],
                                              "backward": ["reduce_scatter"]})


def check_scatter(impl) -> None:
    for t in WORLDS:
        x, full = data(t)
        ranks = dist.launch(_operators, t, impl, t, x, full)
        summed = full * sum(range(1, t + 1))
        for rank, result in enumerate(ranks):
            value, grad, records = result["scatter"]
            where = f"t={t}, rank {rank}, g-bar"
            expect(value.shape == (B, T // t, D),
                   f"{where}: forward returned shape {value.shape}; the sum over the ranks, "
                   f"scattered along the sequence, is my (B, T/t, d) = {(B, T // t, D)} piece"
                   + (" (an all-reduce is TP's g: here each rank keeps only its tokens)"
                      if value.shape == (B, T, D) else ""))
            expect(np.allclose(value, piece(summed, rank, t), rtol=RTOL, atol=ATOL),
                   f"{where}: forward is not my tokens' piece of the sum over the ranks")
            expect(grad.shape == (B, T, D) and np.allclose(grad, x, rtol=RTOL, atol=ATOL),
                   f"{where}: backward must all-gather the pieces' gradients along the "
                   "sequence into (B, T, d)")
            _expect_ops(where, records, {"forward": ["reduce_scatter"],
                                         "backward": ["all_gather"]})


def _expect_ops(where: str, records, expected: dict) -> None:
    for phase, ops in expected.items():
        got = [op for op, ph, _ in records if ph == phase]
        expect(got == ops, f"{where}: {phase} called {got or 'no collective'}; expected "
                           f"{ops}")


# ------------------------------------------------------------------ the block
def _block(impl, t: int, x: np.ndarray, grad_out: np.ndarray) -> dict:
    group = dist.new_group(range(t), kind="tp")
    rank, device = dist.get_rank(), dist.get_device()
    p = {k: Tensor(v, requires_grad=True) for k, v in shards(weights(), rank, t).items()}
    xt = Tensor(piece(x, rank, t), requires_grad=True)
    with dist.phase("forward"):
        out = impl.sequence_parallel_mlp(xt, *(p[k] for k in NAMES), group)
    expect(isinstance(out, Tensor), f"sequence_parallel_mlp returned {type(out).__name__}; "
                                    "return a Tensor")
    result = {"out": np.array(out.data)}
    grad = (piece(grad_out, rank, t) if out.shape == (B, T // t, D)
            else np.zeros(out.shape))
    with dist.phase("backward"):
        out.backward(grad)
    marker = len(device.comm.records)
    with dist.phase("optimizer"):
        impl.allreduce_sequence_parallel_grads([p[k] for k in REPLICATED], group)
    result.update({"x": np.array(xt.grad), "records": _records(device, 0)[:marker],
                   "sync": _records(device, marker)},
                  **{k: None if p[k].grad is None else np.array(p[k].grad) for k in NAMES})
    return result


@dataclass
class Run:
    t: int
    x: np.ndarray
    grad_out: np.ndarray
    ranks: list
    ref: dict

    def __str__(self) -> str:
        return f"t={self.t}"


def check_block_runs(impl) -> list[Run]:
    runs = []
    for t in WORLDS:
        x, grad_out = data(t)
        try:
            ranks = dist.launch(_block, t, impl, t, x, grad_out)
        except Exception as error:  # noqa: BLE001 - name the case, keep the error
            error.add_note(f"(t={t})")
            raise
        runs.append(Run(t, x, grad_out, ranks, reference(x, grad_out)))
    return runs


def check_output(runs: list[Run]) -> None:
    for run in runs:
        for rank, result in enumerate(run.ranks):
            got, want = result["out"], piece(run.ref["out"], rank, run.t)
            where = f"{run}, rank {rank}"
            expect(got.shape == want.shape,
                   f"{where}: the block returned shape {got.shape}; my tokens' piece is "
                   f"(B, T/t, d) = {want.shape}"
                   + (": after the row-parallel matmul, reduce-scatter (g-bar), not "
                      "all-reduce (TP's g)" if got.shape == (B, T, D) else ""))
            if np.allclose(got, want, rtol=RTOL, atol=ATOL):
                continue
            b2 = weights()["b2"]
            if np.allclose(got - want, (run.t - 1) * b2, rtol=1e-8, atol=1e-10):
                raise CheckFailed(f"{where}: the output is off by (t - 1) x b2: b2 was added "
                                  "on every rank before the reduce-scatter, which sums it t "
                                  "times; add it once, after g-bar")
            raise CheckFailed(f"{where}: the output differs from one device's block by "
                              f"{np.abs(got - want).max():.3g}")


def check_gradients(runs: list[Run]) -> None:
    for run in runs:
        for rank, result in enumerate(run.ranks):
            full = shards(run.ref, rank, run.t)
            want = {"x": piece(run.ref["x"], rank, run.t), **full}
            for name in ("x",) + NAMES:
                got = result[name]
                where = f"{run}, rank {rank}: the gradient of {name}"
                expect(got is not None and got.shape == want[name].shape,
                       f"{where} has shape {None if got is None else got.shape}, expected "
                       f"{want[name].shape}")
                if np.allclose(got, want[name], rtol=RTOL, atol=ATOL):
                    continue
                if name in REPLICATED:
                    mask = np.zeros((1, T, 1))
                    n = T // run.t
                    mask[:, rank * n:(rank + 1) * n] = 1
                    partial = reference(run.x, run.grad_out, mask)[name]
                    if np.allclose(got, partial, rtol=RTOL, atol=ATOL):
                        raise CheckFailed(
                            f"{where} holds only this rank's tokens' share: the replicated "
                            "parameters (ln_weight, ln_bias, b2) see my tokens only, so "
                            "their gradients must be all-reduced over the TP group after "
                            "backward (allreduce_sequence_parallel_grads; Megatron's "
                            "param.sequence_parallel)")
                raise CheckFailed(f"{where} differs from one device's by "
                                  f"{np.abs(got - want[name]).max():.3g}")


def check_communication(runs: list[Run]) -> None:
    for run in runs:
        t = run.t
        each = (t - 1) * B * T * D * 8 // t  # (t-1)/t of one (B, T, d) fp64 tensor
        for rank, result in enumerate(run.ranks):
            where = f"{run}, rank {rank}"
            for phase, ops in (("forward", ["all_gather", "reduce_scatter"]),
                               ("backward", ["all_gather", "reduce_scatter"])):
                got = [(op, sent) for op, ph, sent in result["records"] if ph == phase]
                expect([op for op, _ in got] == ops,
                       f"{where}: {phase} called {[op for op, _ in got] or 'nothing'}; "
                       f"sequence parallelism makes {' then '.join(ops)} ("
                       f"{'g-bar then g' if phase == 'backward' else 'g then g-bar'})")
                expect(all(sent == each for _, sent in got),
                       f"{where}: {phase}'s collectives sent {[s for _, s in got]} bytes; each "
                       f"moves (t-1)/t of one (B, T, d) tensor = {each}: together the "
                       f"{4 * each} bytes of TP's two all-reduces")
            sync = [op for op, _, _ in result["sync"]]
            expect(sync and set(sync) == {"all_reduce"},
                   f"{where}: allreduce_sequence_parallel_grads called {sync or 'nothing'}; "
                   "it all-reduces the replicated parameters' gradients")


def check(impl, *, show_traceback: bool = False):
    report = start_report(NUMBER, TITLE, impl, show_traceback)
    report.run(BUILDING_BLOCKS, check_building_blocks, impl, FORBIDDEN)
    report.run("g: all-gather along the sequence forward, reduce-scatter backward (t = 2, 4)",
               check_gather, impl)
    report.run("g-bar: reduce-scatter along the sequence forward, all-gather backward",
               check_scatter, impl)
    runs = report.run("the MLP block runs on t = 2 and 4 ranks", check_block_runs, impl)
    checks = [("output: my (B, T/t, d) piece of one device's x + MLP(LN(x))", check_output),
              ("gradients: x piece, w1/b1/w2 shards, replicated ln_weight, ln_bias, b2",
               check_gradients),
              ("communication: all-gather + reduce-scatter each way (TP's bytes), then "
               "all-reduce of the replicated gradients", check_communication)]
    for name, fn in checks:
        if runs is None:
            report.skip(name, "needs the run above")
        else:
            report.run(name, fn, runs)
    return report
