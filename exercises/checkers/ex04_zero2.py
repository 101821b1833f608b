"""Checker of exercise 04: `Zero2AdamW(params, group, ...)`, a ZeRO-2 step.

On N = 2 and 4 ranks (Ψ = 66 parameters: padding 2 on 4 ranks), each rank trains a
small fp64 MLP on its own data for 3 steps with the student's optimizer; the reference is
the same MLP trained on the whole batch with the replicated `minipar.nn.AdamW`. Checks:
- equivalence: parameters after every step equal the replicated AdamW's (fp64), and
  every replica equals the others after the all-gather;
- memory, read from each rank's ledger: 2 Ψ'/N elements of optimizer state and Ψ'/N of
  gradients after the step, no full gradient left;
- bytes: reduce-scatter + all-gather send 2(N-1)/N Ψ' * 8 per rank per step (ZeRO paper,
  section 7.2.1), and no all-reduce.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from minipar import distributed as dist
from minipar.autograd import Tensor
from minipar.nn import AdamW, Linear, Module

from .harness import CheckFailed, expect, scale_factor, start_report
from .source_check import check_building_blocks

NUMBER, TITLE = "04", "ZeRO's sharded optimizer step (after backward)"
# The check of the file's text, which the grader also runs on its own copy (grader.py).
BUILDING_BLOCKS = "builds on adamw_update and the collectives (no ready-made optimizer)"
WORLDS = (2, 4)
D_IN, D_HIDDEN, D_OUT, ROWS = 5, 7, 3, 4  # Ψ = 5*7 + 7 + 7*3 + 3 = 66
STEPS, LR, BETAS, EPS, WEIGHT_DECAY = 3, 1e-2, (0.9, 0.95), 1e-8, 0.1
RTOL = 1e-10
ITEMSIZE = 8

FORBIDDEN = {"minipar.parallel": "the library's ZeRO is the answer key",
             "ZeroOptimizer": "the library's ZeRO is the answer key",
             "AdamW": "the replicated optimizer; update your shard with adamw_update",
             "all_reduce": "ZeRO-2 never all-reduces the gradient: reduce-scatter it"}


class MLP(Module):
    """Linear -> tanh -> Linear, the same initial weights on every rank."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(4)
        self.fc1 = Linear(D_IN, D_HIDDEN, generator=rng)
        self.fc2 = Linear(D_HIDDEN, D_OUT, generator=rng)
        # non-zero biases, so that a wrong weight decay on them shows
        self.fc1.bias.data[...] = rng.standard_normal(D_HIDDEN)
        self.fc2.bias.data[...] = rng.standard_normal(D_OUT)

    def forward(self, x, target):
        error = self.fc2(self.fc1(Tensor(x)).tanh()) - Tensor(target)
        return (error * error).mean()


def numel() -> int:
    return sum(p.size for p in MLP().parameters())


def make_data(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step and rank: inputs (STEPS, n, ROWS, D_IN), targets (STEPS, n, ROWS, D_OUT)."""
    rng = np.random.default_rng([4, n])
    return rng.standard_normal((STEPS, n, ROWS, D_IN)), rng.standard_normal((STEPS, n, ROWS,
                                                                             D_OUT))


def reference(x: np.ndarray, y: np.ndarray) -> tuple[list[dict], list[np.ndarray]]:
    """Replicated AdamW on the whole batch (mean over all ranks' rows): parameters after
    each step, and each step's flat gradient (unpadded)."""
    model = MLP()
    optimizer = AdamW(model.named_parameters(), lr=LR, betas=BETAS, eps=EPS,
                      weight_decay=WEIGHT_DECAY)
    params, grads = [], []
    for step in range(STEPS):
        model(x[step].reshape(-1, D_IN), y[step].reshape(-1, D_OUT)).backward()
        grads.append(np.concatenate([p.grad.reshape(-1) for p in model.parameters()]))
        optimizer.step()
        optimizer.zero_grad()
        params.append({name: p.data.copy() for name, p in model.named_parameters()})
    return params, grads


def _program(impl, n: int, x: np.ndarray, y: np.ndarray) -> list[dict]:
    group = dist.new_group(range(n), kind="dp")
    rank, device = dist.get_rank(), dist.get_device()
    model = MLP()
    names = [name for name, _ in model.named_parameters()]
    optimizer = impl.Zero2AdamW(list(model.parameters()), group, lr=LR, betas=BETAS, eps=EPS,
                                weight_decay=WEIGHT_DECAY)
    steps = []
    for step in range(STEPS):
        with dist.phase("backward"):
            model(x[step, rank], y[step, rank]).backward()
        start = len(device.comm.records)
        with dist.phase("optimizer"):
            optimizer.step()
        steps.append({
            "params": {name: p.data.copy() for name, p in zip(names, model.parameters(),
                                                               strict=True)},
            "grads_left": [name for name, p in zip(names, model.parameters(), strict=True)
                           if p.grad is not None],
            "memory": dict(device.memory.current),
            "shapes": {attr: np.shape(getattr(optimizer, attr, None))
                       for attr in ("exp_avg", "exp_avg_sq", "grad_shard")},
            "grad_shard": np.array(getattr(optimizer, "grad_shard", None), copy=True),
            "records": device.comm.records[start:]})
    return steps


@dataclass
class Run:
    n: int
    ranks: list  # per rank, per step: dict
    ref: list  # per step: {name: params}
    ref_grads: list  # per step: the flat averaged gradient (Ψ,)

    @property
    def shard(self) -> int:
        return -(-numel() // self.n)

    def __str__(self) -> str:
        return f"N={self.n}"


# ------------------------------------------------------------------ the checks
def check_runs(impl) -> list[Run]:
    runs = []
    for n in WORLDS:
        x, y = make_data(n)
        try:
            ranks = dist.launch(_program, n, impl, n, x, y)
        except Exception as error:  # noqa: BLE001 - name the case, keep the error
            error.add_note(f"(on N={n} ranks)")
            raise
        runs.append(Run(n, ranks, *reference(x, y)))
    return runs


def check_state_sharded(runs: list[Run]) -> None:
    for run in runs:
        for rank, steps in enumerate(run.ranks):
            s = steps[-1]
            for attr in ("exp_avg", "exp_avg_sq"):
                expect(s["shapes"][attr] == (run.shard,),
                       f"{run}, rank {rank}: {attr} has shape {s['shapes'][attr]}; ZeRO keeps "
                       f"Adam's moments for this rank's shard only: ({run.shard},) = Ψ'/N = "
                       f"{run.shard * run.n}/{run.n}")
            held, expected = s["memory"]["optimizer"], 2 * run.shard * ITEMSIZE
            expect(held == expected,
                   f"{run}, rank {rank}: the ledger holds {held} bytes of optimizer state; "
                   f"ZeRO-2 holds 2 moments of Ψ'/N = {run.shard} fp64 elements = {expected}: "
                   "hold exp_avg and exp_avg_sq as 'optimizer' (and nothing else)")


def check_gradient_shard(runs: list[Run]) -> None:
    for run in runs:
        for rank, steps in enumerate(run.ranks):
            for step, s in enumerate(steps):
                where = f"{run}, rank {rank}, after step {step}"
                left = s["grads_left"]
                expect(not left, f"{where}: p.grad is still set for {', '.join(left)}; drop the "
                                 "full gradients with p.release_grad() once they are "
                                 "reduce-scattered")
                expect(s["shapes"]["grad_shard"] == (run.shard,),
                       f"{where}: grad_shard has shape {s['shapes']['grad_shard']}, expected "
                       f"({run.shard},) = Ψ'/N")
                held, expected = s["memory"]["grads"], run.shard * ITEMSIZE
                expect(held == expected,
                       f"{where}: the ledger holds {held} bytes of gradients; ZeRO-2 keeps "
                       f"only the gradient shard, Ψ'/N = {run.shard} fp64 elements = "
                       f"{expected} bytes (hold grad_shard as 'grads'; p.release_grad() "
                       "drops a full gradient from the ledger)")


def _on_track(run: Run, rank: int, step: int) -> bool:
    """Did rank start `step` with the reference's parameters? (Else its gradients differ
    for a reason the equivalence check reports.)"""
    if step == 0:
        return True
    params = run.ranks[rank][step - 1]["params"]
    return all(np.allclose(params[name], expected, rtol=RTOL, atol=0)
               for name, expected in run.ref[step - 1].items())


def check_gradient_values(runs: list[Run]) -> None:
    for run in runs:
        for rank, steps in enumerate(run.ranks):
            for step, s in enumerate(steps):
                if not _on_track(run, rank, step):
                    break
                flat = np.zeros(run.shard * run.n)
                flat[:numel()] = run.ref_grads[step]
                expected = flat[rank * run.shard:(rank + 1) * run.shard]
                got = s["grad_shard"]
                if got.shape != expected.shape:
                    continue  # reported by check_gradient_shard
                if not np.allclose(got, expected, rtol=RTOL, atol=1e-14):
                    raise CheckFailed(
                        f"{run}, rank {rank}, step {step}: grad_shard is not shard {rank} of "
                        "the gradient averaged over the ranks (elements "
                        f"{rank * run.shard}..{(rank + 1) * run.shard - 1} of the padded flat "
                        f"gradient){_scale_hint(got, expected, run.n)}")




def _scale_hint(got: np.ndarray, expected: np.ndarray, n: int) -> str:
    """Name a gradient off by a factor of N (summed, or averaged twice)."""
    c = scale_factor(got, expected)
    if c is None:
        return ""
    if abs(c - n) < 1e-6 * n:
        why = ("N times the average: it was summed; reduce with op='avg' (each rank's loss "
               "is already a mean over its own data)")
    elif abs(c * n - 1) < 1e-6:
        why = ("1/N of the average: it was averaged twice; reduce_scatter(op='avg') "
               "already divides the sum by N, so do not divide again")
    else:
        return f"; it is {c:g} x the average"
    return (f"; off by a factor of N = {n}: {why}. (The parameters barely show it: Adam's "
            "step m / (sqrt(v) + eps) is almost the same for a gradient scaled by any "
            "constant, so only eps and the weight decay feel the factor.)")


def _first_difference(run: Run):
    """(step, rank, name, relative difference, names that differ, only vectors differ) of
    the first step whose parameters differ from the replicated AdamW's, or None."""
    for step in range(STEPS):
        wrong = []
        for rank, steps in enumerate(run.ranks):
            for name, expected in run.ref[step].items():
                got = steps[step]["params"][name]
                scale = max(float(np.max(np.abs(expected))), 1e-300)
                diff = float(np.max(np.abs(got - expected))) / scale
                if not diff <= RTOL:
                    wrong.append((rank, name, diff, got.ndim))
        if wrong:
            rank, name, diff, _ = wrong[0]
            names = sorted({name for _, name, _, _ in wrong})
            return step, rank, name, diff, names, all(ndim < 2 for *_, ndim in wrong)
    return None


def _gradient_scale(run: Run) -> float | None:
    """c if every rank's first grad_shard is c times the right one (c != 1), else None."""
    scales = set()
    for rank, steps in enumerate(run.ranks):
        flat = np.zeros(run.shard * run.n)
        flat[:numel()] = run.ref_grads[0]
        got = steps[0]["grad_shard"]
        expected = flat[rank * run.shard:(rank + 1) * run.shard]
        c = scale_factor(got, expected) if got.shape == expected.shape else None
        scales.add(None if c is None else round(c, 9))
    (c,) = scales if len(scales) == 1 else (None,)
    return None if c is None or abs(c - 1) < 1e-9 else c


def check_equivalence(runs: list[Run]) -> None:
    found = {run.n: _first_difference(run) for run in runs}
    for run in runs:
        if found[run.n] is None:
            continue
        step, rank, name, diff, names, only_vectors = found[run.n]
        hint = ""
        if only_vectors:
            hint = (" (only biases differ: weight decay applies to matrices only; "
                    "use self.weight_decay)")
        padded = run.shard * run.n != numel()
        exact = [other for other in runs if other.shard * other.n == numel()]
        c = _gradient_scale(run)
        if c is not None:
            hint = (f" (the gradient shard is {c:g} x the right one, see above; Adam's "
                    "update hardly depends on the gradient's scale, so the parameters "
                    "differ only this little)")
        elif padded and exact and all(found[other.n] is None for other in exact):
            hint = (f" (only the run whose flat buffer is padded differs: Ψ = {numel()} "
                    f"is padded to Ψ' = {run.shard * run.n} on N={run.n}. Shard offsets "
                    "count the padding: rank i owns flat[i Ψ'/N : (i+1) Ψ'/N] = "
                    "flat[self.start:self.stop], not flat[i Ψ/N : ...])")
        raise CheckFailed(f"{run}: after step {step}, {name} on rank {rank} differs from "
                          f"the replicated AdamW by {diff:.3g} (relative; fp64 runs agree "
                          f"to {RTOL:g}); parameters that differ: {', '.join(names)}"
                          + hint)


def check_replicas(runs: list[Run]) -> None:
    for run in runs:
        for step in range(STEPS):
            first = run.ranks[0][step]["params"]
            for rank, steps in enumerate(run.ranks[1:], start=1):
                for name, value in steps[step]["params"].items():
                    expect(np.array_equal(value, first[name]),
                           f"{run}, after step {step}: rank {rank}'s {name} differs from "
                           "rank 0's: the all-gather must give every rank all updated shards")


def check_bytes(runs: list[Run]) -> None:
    for run in runs:
        padded = run.shard * run.n
        each = (run.n - 1) * run.shard * ITEMSIZE  # (N-1)/N of the padded flat buffer
        for rank, steps in enumerate(run.ranks):
            for step, s in enumerate(steps):
                where = f"{run}, rank {rank}, step {step}"
                sent = Counter()
                for record in s["records"]:
                    sent[record.op] += record.sent_bytes
                expect("all_reduce" not in sent,
                       f"{where}: all_reduce in the step; ZeRO-2 reduce-scatters the gradient "
                       "so each rank receives only its shard")
                other = sorted(set(sent) - {"reduce_scatter", "all_gather"})
                expect(not other, f"{where}: the step called {', '.join(other)}; ZeRO-2 "
                                  "needs one reduce-scatter and one all-gather")
                for op in ("reduce_scatter", "all_gather"):
                    expect(sent[op] == each,
                           f"{where}: {op} sent {sent[op]} bytes; ZeRO-2 sends (N-1)/N*Ψ'*8 = "
                           f"{run.n - 1}/{run.n}*{padded}*8 = {each} in each of reduce-scatter "
                           f"and all-gather: 2(N-1)/N*Ψ'*8 = {2 * each} per step in all, "
                           "the same as DP's all-reduce")


def check(impl, *, show_traceback: bool = False):
    report = start_report(NUMBER, TITLE, impl, show_traceback)
    report.run(BUILDING_BLOCKS, check_building_blocks, impl, FORBIDDEN)
    runs = report.run(f"runs on N = 2 and 4 ranks (Ψ = {numel()}, padded on 4), {STEPS} steps",
                      check_runs, impl)
    checks = [
        ("optimizer state: m and v of my shard only (2 Ψ'/N elements in the ledger)",
         check_state_sharded),
        ("each rank keeps only its gradient shard (Ψ'/N elements; p.grad released)",
         check_gradient_shard),
        ("grad_shard = my shard of the gradient averaged over the ranks",
         check_gradient_values),
        ("parameters after every step = replicated AdamW (fp64)", check_equivalence),
        ("every replica holds the same parameters after the all-gather", check_replicas),
        ("bytes: reduce-scatter + all-gather = 2(N-1)/N*Ψ'*8 per rank, no all-reduce",
         check_bytes),
    ]
    for name, fn in checks:
        if runs is None:
            report.skip(name, "needs the runs above")
        else:
            report.run(name, fn, runs)
    return report
