"""The exercises and their checkers.

Each checker module has `check(impl, *, show_traceback=False) -> Report`: it takes the
implementation under test (the student's module, the reference solution, or any object
with the same attributes), runs it under `minipar.distributed.launch` and returns a Report of
which checks pass, which fail and why (harness.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    number: str  # "01"
    slug: str  # "ring_allreduce": also accepted on the command line
    title: str
    module: str  # file name of the student file and of its solution, without .py
    minutes: int  # estimated time for a student who has read the paper section
    teaches: str

    @property
    def checker(self):
        return importlib.import_module(f"exercises.checkers.{self.module}")

    def check(self, impl, *, show_traceback: bool = False):
        return self.checker.check(impl, show_traceback=show_traceback)


EXERCISES = (
    Exercise("01", "ring_allreduce", "ring all-reduce from send/recv", "ex01_ring_allreduce",
             45, "how NCCL's all-reduce works; 2(n-1)/n*S bytes per rank; deadlock"),
    Exercise("02", "tensor_parallel", "column- and row-parallel linear with f and g",
             "ex02_tensor_parallel", 60,
             "Megatron's f/g operators as autograd Functions; 1 all-reduce forward, 1 "
             "backward per column->row pair"),
    Exercise("03", "data_parallel", "data parallelism with gradient accumulation",
             "ex03_data_parallel", 45,
             "DDP from one rank's view; no_sync: one all-reduce per step, not per "
             "micro-batch; equivalence with single-device training"),
    Exercise("04", "zero2", "ZeRO's sharded optimizer step (after backward)", "ex04_zero2",
             60,
             "reduce-scatter, sharded AdamW, all-gather; the same bytes as DP, 1/N of the "
             "optimizer state (and of the gradients once the step has run)"),
    Exercise("05", "one_f_one_b", "the 1F1B pipeline schedule as action lists",
             "ex05_one_f_one_b", 45,
             "PipeDream-Flush: warm-up, steady 1F1B, cool-down; matching sends and "
             "receives; at most p - s micro-batches in flight"),
    Exercise("06", "predict_bytes", "predict per-rank bytes of a training run",
             "ex06_predict_bytes", 75,
             "the ZeRO paper's memory accounting, DP and TP traffic, checked against "
             "minipar's measured report"),
    Exercise("07", "zero_bubble", "zero bubble: B/W split of a Linear and ZB-H1 action lists",
             "ex07_zero_bubble", 50,
             "a backward split in B (input gradient) and W (weight gradients); W delayed "
             "into the bubble: ZB-H1's (p-1)(T_F+T_B-T_W) at 1F1B's memory"),
    Exercise("08", "zero3_prefetch", "ZeRO-3 gather and free, with prefetch, as actions",
             "ex08_zero3_prefetch", 45,
             "ZeRO-3's all-gather before a unit's forward and backward, free after; "
             "prefetch hides the transfer for a second unit's buffer"),
    Exercise("09", "zero2_backward", "a true ZeRO-2: reduce-scatter during backward",
             "ex09_zero2_backward", 45,
             "gradient hooks reduce-scatter each bucket as backward completes it: the "
             "gradient peak is one bucket plus the shards; one reduce-scatter per "
             "micro-batch"),
    Exercise("10", "sequence_parallel", "sequence parallelism: g and g-bar around the MLP",
             "ex10_sequence_parallel", 60,
             "TP's all-reduces split into all-gather and reduce-scatter along the "
             "sequence: LayerNorm on T/t tokens, the same bytes, replicated gradients "
             "all-reduced"),
    Exercise("11", "predict_activations", "predict the activation bytes (core mode)",
             "ex11_predict_activations", 50,
             "Korthikanti's saved activations per layer with TP and SP, the 1F1B first "
             "stage's p micro-batches, full recomputation; minipar's own terms given"),
    Exercise("12", "port_recipe", "port a one-GPU recipe to N GPUs", "ex12_port_recipe",
             30,
             "keep the global batch, and the learning rate stays; when it must grow, the "
             "square-root rule and the token budget; accumulation within the memory limit"),
    Exercise("13", "choose_layout", "choose a layout for a cluster, and justify it",
             "ex13_choose_layout", 60,
             "dp x tp x pp x ZeRO for a model and a cluster, with the claims of a short "
             "justification checked by the planner and the emulator"),
)


def find(key: str) -> Exercise:
    """The exercise called `key`: "01", "1", "ex01", "ring_allreduce" or a file name."""
    key = key.strip().lower().removesuffix(".py")
    key = key.rsplit("/", 1)[-1].removeprefix("ex")
    for exercise in EXERCISES:
        names = {exercise.number, str(int(exercise.number)), exercise.slug,
                 exercise.module.removeprefix("ex")}
        if key in names or key.lstrip("0") == exercise.number.lstrip("0"):
            return exercise
    choices = ", ".join(f"{e.number} ({e.slug})" for e in EXERCISES)
    raise KeyError(f"no exercise {key!r}; choose one of {choices}, or 'all'")
