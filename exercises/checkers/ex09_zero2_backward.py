"""Checker of exercise 09: `Zero2Gradients(buckets, group)`, ZeRO-2's reduce-scatter
during backward.

On N = 2 and 4 ranks (bucket of 42 elements: padded on 4), with A = 1 and 2
micro-batches, each rank runs 2 steps of an fp64 MLP of L = 4 layers (one bucket each)
on its own data, each micro-batch's loss scaled by 1/A, backward under
`dist.phase("backward")`. The reference is the same MLP on the whole batch, on one
device. Checks:
- values: grad_shards[b] = this rank's piece of bucket b's gradient averaged over the
  ranks and the micro-batches (a sum over the ranks, or only the last micro-batch, is
  named);
- when and what: every bucket reduce-scattered inside backward, once per micro-batch
  (ZeRO-2 has no full gradient to accumulate into), (N-1)/N of the padded bucket each,
  no all-reduce;
- the gradient PEAK, read from each rank's ledger over the whole run: at most the
  shards plus one bucket's full gradients; after each backward no p.grad is left and the
  ledger holds only the shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar import distributed as dist
from minipar.autograd import Tensor
from minipar.nn import Linear, Module

from .harness import CheckFailed, expect, scale_factor, start_report
from .source_check import check_building_blocks

NUMBER, TITLE = "09", "a true ZeRO-2: reduce-scatter during backward"
BUILDING_BLOCKS = "builds on reduce_scatter and the hooks (no ready-made ZeRO)"
FORBIDDEN = {"minipar.parallel": "the library's ZeRO is the answer key",
             "ZeroOptimizer": "the library's ZeRO is the answer key",
             "all_reduce": "ZeRO-2 never all-reduces the gradient: reduce-scatter it"}
LAYERS, D, ROWS, STEPS, ITEMSIZE = 4, 6, 3, 2, 8  # a bucket: 6 x 6 + 6 = 42 elements
CASES = ((2, 1), (2, 2), (4, 1), (4, 2))  # (N, A)
RTOL = 1e-10


class MLP(Module):
    """L tanh layers of (D, D), the same initial weights on every rank."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(9)
        self.layers = [Linear(D, D, generator=rng) for _ in range(LAYERS)]
        for i, layer in enumerate(self.layers):
            setattr(self, f"fc{i}", layer)

    def forward(self, x, target):
        h = Tensor(x)
        for layer in self.layers:
            h = layer(h).tanh()
        error = h - Tensor(target)
        return (error * error).mean()

    def buckets(self):
        """One bucket per layer, the last layer's first (backward finishes it first)."""
        return [[layer.weight, layer.bias] for layer in reversed(self.layers)]


def make_data(n: int, a: int):
    rng = np.random.default_rng([9, n, a])
    return (rng.standard_normal((STEPS, n, a, ROWS, D)),
            rng.standard_normal((STEPS, n, a, ROWS, D)))


def reference(x, y) -> list[list[np.ndarray]]:
    """Per step, per bucket: the flat (unpadded) gradient of the global batch's mean loss
    (the parameters stay fixed: this exercise stops before the optimizer)."""
    model = MLP()
    grads = []
    for step in range(STEPS):
        rows = x.shape[1] * x.shape[2] * ROWS
        model(x[step].reshape(rows, D), y[step].reshape(rows, D)).backward()
        grads.append([np.concatenate([p.grad.reshape(-1) for p in bucket])
                      for bucket in model.buckets()])
        for p in model.parameters():
            p.grad = None
    return grads


def _program(impl, n: int, a: int, x, y) -> list[dict]:
    group = dist.new_group(range(n), kind="dp")
    rank, device = dist.get_rank(), dist.get_device()
    model = MLP()
    reducer = impl.Zero2Gradients(model.buckets(), group)
    steps = []
    for step in range(STEPS):
        start = len(device.comm.records)
        for micro in range(a):
            with dist.phase("backward"):
                loss = model(x[step, rank, micro], y[step, rank, micro])
                loss.backward(np.asarray(1.0 / a))
        shards = getattr(reducer, "grad_shards", None) or []
        steps.append({
            "shards": [None if s is None else np.array(s, copy=True) for s in shards],
            "grads_left": [name for name, p in model.named_parameters() if p.grad is not None],
            "grads_held": device.memory.current["grads"],
            "records": [(r.op, r.phase, r.sent_bytes) for r in device.comm.records[start:]]})
        reducer.zero_grad()
    return {"steps": steps, "peak": device.memory.peak["grads"]}


@dataclass
class Run:
    n: int
    a: int
    ranks: list
    ref: list  # per step, per bucket: flat gradient

    @property
    def bucket(self) -> int:
        return D * D + D

    @property
    def padded(self) -> int:
        return -(-self.bucket // self.n) * self.n

    @property
    def shard(self) -> int:
        return self.padded // self.n

    def __str__(self) -> str:
        return f"N={self.n}, A={self.a}"


# ------------------------------------------------------------------ the checks
def check_runs(impl) -> list[Run]:
    runs = []
    for n, a in CASES:
        x, y = make_data(n, a)
        try:
            ranks = dist.launch(_program, n, impl, n, a, x, y)
        except Exception as error:  # noqa: BLE001 - name the case, keep the error
            error.add_note(f"(on N={n} ranks, A={a} micro-batches)")
            raise
        runs.append(Run(n, a, ranks, reference(x, y)))
    return runs


def check_values(runs: list[Run]) -> None:
    for run in runs:
        for rank, result in enumerate(run.ranks):
            for step, s in enumerate(result["steps"]):
                expect(len(s["shards"]) == LAYERS and all(g is not None for g in s["shards"]),
                       f"{run}, rank {rank}, step {step}: grad_shards is "
                       f"{[None if g is None else g.shape for g in s['shards']]} after "
                       f"backward; every one of the {LAYERS} buckets needs its piece")
                for b, got in enumerate(s["shards"]):
                    flat = np.zeros(run.padded)
                    flat[:run.bucket] = run.ref[step][b]
                    want = flat[rank * run.shard:(rank + 1) * run.shard]
                    where = f"{run}, rank {rank}, step {step}, bucket {b}"
                    expect(got.shape == want.shape,
                           f"{where}: grad_shards[{b}] has shape {got.shape}, expected "
                           f"({run.shard},) = the padded bucket / N")
                    if not np.allclose(got, want, rtol=RTOL, atol=1e-14):
                        raise CheckFailed(f"{where}: grad_shards[{b}] is not piece {rank} of "
                                          "the bucket's gradient averaged over the ranks and "
                                          "summed over the micro-batches"
                                          + _hint(got, want, run, rank, step, b))


def _hint(got, want, run: Run, rank: int, step: int, b: int) -> str:
    c = scale_factor(got, want)
    if c is not None and abs(c - run.n) < 1e-6 * run.n:
        return (f"; it is N = {run.n} times that: summed over the ranks. Reduce with "
                "op='avg' (each rank's loss is a mean over its own data)")
    if run.a > 1:
        return ("; with A = 2 micro-batches, is only one micro-batch's piece kept? The "
                "first reduction of a step becomes the shard, the later ones are added "
                "into it (+=), not assigned")
    return ""


def check_during_backward(runs: list[Run]) -> None:
    for run in runs:
        each = (run.n - 1) * run.shard * ITEMSIZE
        for rank, result in enumerate(run.ranks):
            for step, s in enumerate(result["steps"]):
                where = f"{run}, rank {rank}, step {step}"
                ops = {op for op, _, _ in s["records"]}
                expect("all_reduce" not in ops,
                       f"{where}: an all_reduce; ZeRO-2 reduce-scatters each bucket so that "
                       "each rank receives only its piece")
                scatters = [(phase, sent) for op, phase, sent in s["records"]
                            if op == "reduce_scatter"]
                expect(len(scatters) == LAYERS * run.a,
                       f"{where}: {len(scatters)} reduce-scatters; expected one per bucket and "
                       f"micro-batch, {LAYERS} x {run.a} = {LAYERS * run.a}: ZeRO-2 has no full "
                       "gradient to accumulate into, so every micro-batch reduces")
                expect(all(phase == "backward" for phase, _ in scatters),
                       f"{where}: a reduce-scatter ran outside backward")
                expect(all(sent == each for _, sent in scatters),
                       f"{where}: reduce-scatters sent {sorted({b for _, b in scatters})} "
                       f"bytes; one of a padded bucket sends (N-1)/N x {run.padded} x 8 = {each}")


def check_peak(runs: list[Run]) -> None:
    for run in runs:
        shards = LAYERS * run.shard * ITEMSIZE
        allowed = shards + run.bucket * ITEMSIZE
        full = LAYERS * run.bucket * ITEMSIZE
        for rank, result in enumerate(run.ranks):
            peak = result["peak"]
            if peak <= allowed:
                continue
            hint = ""
            if peak >= full:
                hint = (f" That is the whole gradient, Ψ = {LAYERS * run.bucket} elements = "
                        f"{full} bytes, at once: a bucket must be reduced in its hook as soon "
                        "as its own gradients are complete, and its full gradients released "
                        "then, before backward produces the next bucket's (reducing after "
                        "backward is ZeRO-1's gradient peak).")
            raise CheckFailed(
                f"{run}, rank {rank}: the ledger's gradient peak is {peak} bytes; ZeRO-2 "
                f"holds at most the shards ({LAYERS} x {run.shard} x 8 = {shards}) plus one "
                f"bucket's full gradients ({run.bucket} x 8 = {run.bucket * ITEMSIZE}): "
                f"{allowed}." + hint)


def check_left(runs: list[Run]) -> None:
    for run in runs:
        shards = LAYERS * run.shard * ITEMSIZE
        for rank, result in enumerate(run.ranks):
            for step, s in enumerate(result["steps"]):
                where = f"{run}, rank {rank}, after step {step}'s backward"
                left = s["grads_left"]
                expect(not left, f"{where}: p.grad is still set for {', '.join(left)}; drop "
                                 "each bucket's full gradients with p.release_grad() once "
                                 "it is reduce-scattered")
                expect(s["grads_held"] == shards,
                       f"{where}: the ledger holds {s['grads_held']} bytes of gradients; "
                       f"ZeRO-2 keeps only the shards, {shards} (hold each shard once as "
                       "'grads'; p.grad = None does not take a gradient out of the ledger: "
                       "p.release_grad() does)")


def check(impl, *, show_traceback: bool = False):
    report = start_report(NUMBER, TITLE, impl, show_traceback)
    report.run(BUILDING_BLOCKS, check_building_blocks, impl, FORBIDDEN)
    runs = report.run(f"runs on N = 2 and 4 ranks, A = 1 and 2 micro-batches, {STEPS} steps "
                      f"of {LAYERS} buckets", check_runs, impl)
    checks = [
        ("grad_shards[b] = my piece of bucket b's gradient, averaged over ranks and "
         "micro-batches", check_values),
        ("each bucket reduce-scattered inside backward, once per micro-batch, no all-reduce",
         check_during_backward),
        ("gradient PEAK <= the shards + one bucket's full gradients (the ledger)", check_peak),
        ("after backward: no p.grad left, only the shards in the ledger", check_left),
    ]
    for name, fn in checks:
        if runs is None:
            report.skip(name, "needs the runs above")
        else:
            report.run(name, fn, runs)
    return report
