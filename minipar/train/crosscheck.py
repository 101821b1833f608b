"""The two engines on the same config: the same ledgers, the same numbers up to summation order.

    result = cross_check(config, engine)      # threads, then `engine` (torch processes)
    result.ledgers_equal, result.identical, result.max_rel_diff, result.passed

The thread engine and the torch engine run the same rank program and book it in the same
ledgers by the same rules (minipar/distributed/engine.py), so every ledger figure must be
equal: each rank's memory, bytes sent and received by op and group, simulated times,
FLOPs; the traffic matrix; the timelines and transfers on the simulated clock; the step
ends. The numbers (losses, gradient norms, parameters) are computed by the same NumPy
code, and differ only where gloo reduces: its ring adds a chunk's terms starting at
another rank than rank 0 (gloo/allreduce.cc), so with 3 or more ranks in a group a sum
can round differently, by ~1e-16 of its terms' magnitudes per step; with 2 ranks a + b
= b + a and the runs are bit-identical. Training amplifies rounding (Adam's first step
is a sign: equivalence.py), so the parameters are held to TOLERANCE = 1e-12 relative to
each tensor's largest value, losses and norms to the same relative to their own size.

`minipar check --engine torch` runs CASES, a subset of the equivalence grid (one case per
strategy: DP, ZeRO-1/2/3, TP+SP, PP 1F1B and a zero-bubble schedule, CP, EP, a 3D mix),
each checked against single-device training on the torch engine and cross-checked
against the thread engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from minipar.distributed.engines import get_engine
from minipar.train.config import TrainConfig
from minipar.train.equivalence import relative_difference, scales
from minipar.train.grid import GRID, Case
from minipar.train.loop import train

TOLERANCE = 1e-12
# One grid case per strategy, on 2 to 8 processes.
CASES = ("dp2", "dp4 zero1", "dp4 zero2 accum2", "dp3 zero3 (padded shards)",
         "tp4 sequence-parallel", "pp4 1f1b", "pp2 zb-h1", "cp2 load-balanced",
         "moe E4 top2 dp4 ep2 zero1", "dp2 tp2 pp2 zero1 (8 ranks)")
# The figures that must be equal (the report's, without what only a real engine measures).
LEDGER_FIELDS = ("steps_shape", "ranks", "traffic", "step_end_s", "timelines", "transfers",
                 "layout", "pipeline", "moe", "device", "n_params", "warnings")


@dataclass
class CrossCheck:
    """One config on both engines. differing: the ledger fields that differ (none, when
    the engines book alike); max_rel_diff: the largest relative difference of a loss, a
    gradient norm or a parameter; identical: every number bit for bit."""

    name: str
    world_size: int
    differing: list[str] = field(default_factory=list)
    max_rel_diff: float = 0.0
    identical: bool = False
    equivalence: dict | None = None  # the torch run's check against one device
    seconds: dict = field(default_factory=dict)  # wall seconds of each engine's run

    @property
    def ledgers_equal(self) -> bool:
        return not self.differing

    @property
    def passed(self) -> bool:
        return (self.ledgers_equal and self.max_rel_diff <= TOLERANCE
                and (self.equivalence is None or bool(self.equivalence["passed"])))


def ledger(report) -> dict:
    """A report's figures that do not depend on the engine (LEDGER_FIELDS)."""
    ranks = [{k: v for k, v in r.items() if k != "measured"} for r in report.ranks]
    return {"steps_shape": [(s["step"], s["lr"]) for s in report.steps], "ranks": ranks,
            "traffic": report.traffic, "step_end_s": report.step_end_s,
            "timelines": report.timelines, "transfers": report.transfers,
            "layout": report.layout, "pipeline": report.pipeline, "moe": report.moe,
            "device": report.device, "n_params": report.n_params,
            "warnings": report.warnings}


def compare(name: str, threads, torch) -> CrossCheck:
    """CrossCheck of two reports of one config (threads', then torch's)."""
    mine, theirs = ledger(threads), ledger(torch)
    result = CrossCheck(name, threads.world_size,
                        differing=[k for k in LEDGER_FIELDS if mine[k] != theirs[k]],
                        equivalence=torch.equivalence)
    diffs = []
    for key in ("loss", "grad_norm"):
        a = np.array([s[key] for s in threads.steps])
        b = np.array([s[key] for s in torch.steps])
        diffs.append(float(np.max(np.abs(a - b) / np.maximum(np.abs(a), 1e-300))))
    divide = scales(threads.state_dict, "tensor")
    diffs += [relative_difference(torch.state_dict[k], v, divide[k])
              for k, v in threads.state_dict.items()]
    result.max_rel_diff = max(diffs)
    result.identical = (threads.losses == torch.losses and all(
        np.array_equal(v, torch.state_dict[k]) for k, v in threads.state_dict.items()))
    return result


def cross_check(config: TrainConfig, engine, name: str = "",
                references: dict | None = None) -> CrossCheck:
    """Train `config` on threads, then on `engine` with its check against one device
    (references: shared between runs, as `train`'s)."""
    began = time.perf_counter()
    threads = train(config.replace(check=False))
    middle = time.perf_counter()
    torch = train(config.replace(check=True), engine=engine, references=references)
    result = compare(name or repr(config), threads, torch)
    result.seconds = {"threads": middle - began, "torch": time.perf_counter() - middle}
    return result


def run_cases(cases=CASES, nproc_per_node: int | None = None, progress=None,
              **overrides) -> list[CrossCheck]:
    """cross_check each named grid case on the torch engine, one set of processes per
    world size (only the cases of `nproc_per_node` ranks, if given)."""
    chosen = [next(c for c in GRID if c.name == name) for name in cases]
    by_size: dict[int, list[Case]] = {}
    for case in chosen:
        size = case.config(**overrides).world_size
        if nproc_per_node is None or size == nproc_per_node:
            by_size.setdefault(size, []).append(case)
    results, references = [], {}
    for size, group in sorted(by_size.items()):
        with get_engine("torch", nproc_per_node=size) as engine:
            for case in group:
                result = cross_check(case.config(**overrides), engine, case.name, references)
                results.append(result)
                if progress is not None:
                    progress(result)
    return results
