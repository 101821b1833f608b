"""Checker of exercise 07: `linear_backward_input`, `linear_backward_weight` and
`zb_h1_compute_order(pp, m, rank)`.

The gradients are compared, in fp64, with minipar's own Linear backward (one unsplit
backward of `minipar.autograd.functional.linear` on the same x, W, b and dL/dy). The
expected ZB-H1 order is derived here from the rules of the exercise (Qi et al. 2024,
section 3.1): 1F1B's warm-up, then F / I in turn with stage r's W's delayed by r, the rest
at the end. The orders of all stages, with their messages, are then
- validated and timed on paper by `minipar.parallel.pipeline.simulator.simulate_step` (every I
  after its F and after its output gradient arrived, every W after its I, no deadlock);
- measured: micro-batches between F and W per stage (at most p, 1F1B's peak), and the
  idle time per stage with T_F = T_B = T_W = 1 (the paper's (p-1)(T_F+T_B-T_W) = p - 1).
"""

from __future__ import annotations

import numpy as np

from minipar.autograd import Tensor
from minipar.autograd import functional as F
from minipar.errors import ScheduleError
from minipar.parallel.pipeline.schedules.orders import from_compute_orders
from minipar.parallel.pipeline.simulator import in_flight_peak, simulate_step

from .harness import CheckFailed, check_building_blocks, expect, start_report

NUMBER, TITLE = "07", "zero bubble: B/W split of a Linear and ZB-H1 action lists"
SHAPES = (((2, 3, 4), 4), ((5, 3), 4), ((2, 3, 4), 6), ((2, 2, 3, 5), 1))  # x, out
CASES = ((2, 2), (2, 4), (3, 3), (4, 4), (4, 8))  # (p, m), m >= p
FORBIDDEN = {name: "the library's split backward and schedules are the answer key"
             for name in ("backward_input", "WeightGradient", "zb_h1", "zb_h2",
                          "make_schedule", "from_compute_orders", "_delayed_w", "linear",
                          "Linear")}


def reference(shape, out_features, seed=0):
    """x, weight, bias, grad_out and minipar's unsplit gradients of y = x @ W + b."""
    rng = np.random.default_rng(seed)
    x = Tensor(rng.standard_normal(shape), requires_grad=True)
    weight = Tensor(rng.standard_normal((shape[-1], out_features)), requires_grad=True)
    bias = Tensor(rng.standard_normal(out_features), requires_grad=True)
    grad_out = rng.standard_normal((*shape[:-1], out_features))
    F.linear(x, weight, bias).backward(grad_out)
    return x.data, weight.data, grad_out, x.grad, weight.grad, bias.grad


def _close(got, want) -> bool:
    return (isinstance(got, np.ndarray) and got.shape == want.shape
            and np.allclose(got, want, rtol=1e-12, atol=1e-12))


def check_backward_input(impl) -> None:
    for shape, out in SHAPES:
        x, weight, grad_out, want, _, _ = reference(shape, out)
        got = impl.linear_backward_input(grad_out.copy(), weight.copy())
        if isinstance(got, np.ndarray) and got.shape == x.shape and not _close(got, want) \
                and shape[-1] == out:
            raise CheckFailed(f"x {shape}: dL/dx differs; with W stored (in, out), "
                              "dL/dx = g @ W^T (not g @ W)")
        expect(isinstance(got, np.ndarray) and got.shape == x.shape,
               f"x {shape}, W {weight.shape}: dL/dx must have x's shape {x.shape}, got "
               f"{getattr(got, 'shape', type(got).__name__)} (dL/dx = g @ W^T on the last "
               "axis; keep the leading axes)")
        expect(_close(got, want), f"x {shape}: dL/dx differs from the unsplit backward's by "
                                  f"{np.abs(got - want).max():.3g} (expected g @ W^T)")


def check_backward_weight(impl) -> None:
    for shape, out in SHAPES:
        x, weight, grad_out, _, want_w, want_b = reference(shape, out)
        got = impl.linear_backward_weight(x.copy(), grad_out.copy())
        expect(isinstance(got, tuple) and len(got) == 2,
               f"linear_backward_weight returned {type(got).__name__}; return the pair "
               "(dL/dweight, dL/dbias)")
        grad_w, grad_b = got
        expect(isinstance(grad_w, np.ndarray) and grad_w.shape == weight.shape,
               f"x {shape}: dL/dweight must have the weight's shape {weight.shape}, got "
               f"{getattr(grad_w, 'shape', type(grad_w).__name__)}: flatten x and g to rows "
               "(x.reshape(-1, in)) and take x^T @ g")
        expect(_close(grad_w, want_w), f"x {shape}: dL/dweight differs from the unsplit "
                                       "backward's (expected x^T @ g over all rows)")
        expect(isinstance(grad_b, np.ndarray) and grad_b.shape == (out,),
               f"x {shape}: dL/dbias must have shape ({out},), got "
               f"{getattr(grad_b, 'shape', type(grad_b).__name__)}: sum g over every "
               "axis but the last")
        expect(_close(grad_b, want_b), f"x {shape}: dL/dbias differs (expected the sum of g "
                                       "over the rows)")


def zb_h1(p: int, m: int, rank: int) -> list[tuple[str, int]]:
    """The ZB-H1 order of `rank`, from the exercise's rules."""
    warmup = min(p - rank - 1, m)
    order = [("F", i) for i in range(warmup)]
    queued = []
    for i in range(m):
        if warmup + i < m:
            order.append(("F", warmup + i))
        order += [("I", i)]
        queued.append(i)
        if len(queued) > rank:
            order.append(("W", queued.pop(0)))
    return order + [("W", i) for i in queued]


def _text(order) -> str:
    return " ".join(f"{kind}{i}" for kind, i in order)


def _explain(p, m, rank, got, expected) -> str:
    k = next((k for k, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
             min(len(got), len(expected)))
    why = ""
    got_w = [i for kind, i in got if kind == "W"]
    if got_w and got.index(("W", got_w[0])) == got.index(("I", got_w[0])) + 1 and rank > 0:
        why = (f"\n  (W right after its I is 1F1B with a split backward: stage {rank} "
               f"delays its W's by r = {rank} micro-batches)")
    elif got and all(kind == "W" for kind, _ in got[-m:]) and rank < p - 1:
        why = ("\n  (all W's at the end hold m micro-batches of W inputs: run the oldest "
               "queued W once more than r are queued)")
    return (f"p={p}, m={m}, stage {rank}: the order differs at position {k}\n"
            f"  got      {_text(got)}\n  expected {_text(expected)}{why}")


def check_order(impl) -> dict:
    orders = {}
    for p, m in CASES:
        per_rank = []
        for rank in range(p):
            got = impl.zb_h1_compute_order(p, m, rank)
            try:
                got = [(str(kind), int(i)) for kind, i in got]
            except (TypeError, ValueError):
                raise CheckFailed(f"zb_h1_compute_order({p}, {m}, {rank}) returned {got!r}; "
                                  "return a list of ('F' | 'I' | 'W', micro-batch) "
                                  "pairs") from None
            expected = zb_h1(p, m, rank)
            if got != expected:
                raise CheckFailed(_explain(p, m, rank, got, expected))
            per_rank.append([(kind, i, 0) for kind, i in got])
        orders[(p, m)] = per_rank
    return orders


def _schedules(orders: dict) -> dict:
    return {(p, m): from_compute_orders("zb-h1 (yours)", p, m, 1, per_rank)
            for (p, m), per_rank in orders.items()}


def check_runs(orders: dict) -> None:
    for (p, m), schedule in _schedules(orders).items():
        try:
            simulate_step(schedule)
        except ScheduleError as error:
            raise CheckFailed(f"p={p}, m={m}: {error}") from None


def check_memory(orders: dict) -> None:
    for (p, m), schedule in _schedules(orders).items():
        for rank in range(p):
            peak = in_flight_peak(schedule, rank)
            expect(peak <= p, f"p={p}, m={m}: stage {rank} holds {peak} micro-batches between "
                              f"F and W; 1F1B's peak is p = {p}: run W's earlier")


def check_bubble(orders: dict) -> None:
    for (p, m), schedule in _schedules(orders).items():
        run = simulate_step(schedule, 1.0, 2.0, weight=1.0)  # T_F = T_B = T_W = 1
        idle = max(run.finish) - 3 * m
        expect(abs(idle - (p - 1)) < 1e-9,
               f"p={p}, m={m}: {idle:g} units idle per stage; ZB-H1 leaves "
               f"(p-1)(T_F+T_B-T_W) = {p - 1} (1F1B: (p-1)(T_F+T_B+T_W) = {3 * (p - 1)})")


def check(impl, *, show_traceback: bool = False):
    report = start_report(NUMBER, TITLE, impl, show_traceback)
    report.run("builds it itself (not the library's split backward or schedules)",
               check_building_blocks, impl, FORBIDDEN)
    report.run("B: dL/dx = g @ W^T equals the unsplit backward's (fp64)",
               check_backward_input, impl)
    report.run("W: dL/dW = x^T g and dL/db = sum g equal the unsplit backward's (fp64)",
               check_backward_weight, impl)
    orders = report.run("zb_h1_compute_order follows ZB-H1 (1F1B's F/I, W delayed by r)",
                        check_order, impl)
    for name, fn in (
            ("the stages' lists run on paper: no deadlock, every W after its I", check_runs),
            ("at most p micro-batches between F and W (1F1B's peak)", check_memory),
            ("(p-1)(T_F+T_B-T_W) idle per stage at T_F = T_B = T_W", check_bubble)):
        if orders is None:
            report.skip(name, "needs zb_h1_compute_order's orders")
        else:
            report.run(name, fn, orders)
    return report
