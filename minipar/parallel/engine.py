"""The contract of a gradient engine: what the training step asks of the strategy that
owns a rank's gradients and optimizer state (DDP, ZeRO-1/2/3, their offloaded forms, the
expert-data-parallel pair).

    engine.require_backward_grad_sync = k == grad_accum_steps - 1   # DDP's no_sync
    loss.backward(); engine.finish_gradient_synchronization()       # every micro-batch
    norm = engine.clip_grad_norm_(max_norm); engine.step(lr); engine.zero_grad()

A pipeline runs the backwards inside its schedule and then calls
`synchronize_gradients()`; tensor parallelism's sequence-parallel all-reduce finishes
`main_grads(params)` in place. What each engine keeps is read by
`minipar.parallel.state` (parameter and state pieces, holdings, the sharding
description), not by the engine: it needs `stage` from every engine and the engine's
own layout (DataParallel's `names`, `params`, `optimizer` and `buckets`; a ZeRO engine's
`shards`, `rank`, `world`, `param_dtype` and `partition_gradients`; the expert pair's
`engines`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class GradientEngine(Protocol):
    """What every gradient engine provides, from one rank's point of view.

    stage: the ZeRO stage (0 for DDP); step_count: optimizer steps taken.
    """

    stage: int
    # DDP's flag: False inside `no_sync` (reduce nothing, accumulate locally). ZeRO-2/3
    # reduce every backward anyway: they keep no full gradient to accumulate into.
    require_backward_grad_sync: bool

    @property
    def step_count(self) -> int: ...

    def defer_reduction(self, params) -> None:
        """Reduce the buckets holding `params` only in `synchronize_gradients` (a tied
        embedding whose gradient is final only after a pipeline sums its copies)."""

    def synchronize_gradients(self) -> None:
        """After a pipeline flush: reduce what no hook has reduced yet, and wait."""

    def finish_gradient_synchronization(self) -> None:
        """At the end of a backward: wait for the reductions its hooks started."""

    def main_grads(self, params) -> list[np.ndarray]:
        """The reduced gradient the optimizer will read for each of `params` (the part
        of it this rank keeps), to be finished in place (Megatron's `main_grad`)."""

    def local_gradients(self) -> list[np.ndarray]:
        """The gradient arrays this rank's optimizer reads (clipping scales them)."""

    def clip_grad_norm_(self, max_norm: float) -> float:
        """The global gradient norm (every rank gets the same); scale the gradients to
        `max_norm` when it is > 0 and exceeded."""

    def step(self, lr: float) -> None:
        """One AdamW step at learning rate `lr` on what this rank keeps."""

    def zero_grad(self) -> None:
        """Drop the gradients (set-to-none) before the next step's backward."""

    def load_optimizer_state(self, step: int, state: dict[str, dict[str, np.ndarray]]) -> None:
        """Restore the optimizer from full local tensors, state[kind][name] (kind:
        exp_avg, exp_avg_sq and, with mixed precision, master), at step `step`."""
