"""Expert data parallelism (Megatron-LM's layout, parallel_state.py): two data-parallel
engines as one. Non-expert parameters are replicas over the whole DP group; an expert's
gradient already sums the tokens of the ep ranks that sent to it (dispatch.py), so the
experts are reduced over the expert-data-parallel group only (dp / ep ranks).
"""

from __future__ import annotations

import math

from minipar.nn.optim import scale_grads_
from minipar.parallel.data.ddp import sum_over_groups


class ExpertDataParallel:
    """Two data-parallel engines as one: `dense` over the DP group (non-expert
    parameters), `experts` over the expert-data-parallel group. The training loop sees
    one engine (a `minipar.parallel.engine.GradientEngine`); the gradient norm is the
    whole model's (both engines' squares).

    experts None: this rank's pipeline stage holds no MoE layer (--moe-layer-freq > 1),
    so it has only the dense engine. The stages that do hold experts sum the experts'
    squared norm over their pipeline group too, so this rank still joins those
    all-reduces over `expert_norm_groups`, adding 0 (staying out would leave them
    waiting)."""

    def __init__(self, dense, experts, expert_norm_groups=()) -> None:
        self.engines = (dense,) if experts is None else (dense, experts)
        self.dense, self._expert_norm_groups = dense, tuple(expert_norm_groups)
        self.stage = dense.stage

    @property
    def require_backward_grad_sync(self) -> bool:
        return self.dense.require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        for engine in self.engines:
            engine.require_backward_grad_sync = value

    def defer_reduction(self, params) -> None:
        """A pipeline's late-reduced parameters (a tied wte's copies) are dense ones."""
        self.dense.defer_reduction(params)

    def synchronize_gradients(self) -> None:
        for engine in self.engines:
            engine.synchronize_gradients()

    def finish_gradient_synchronization(self) -> None:
        for engine in self.engines:
            engine.finish_gradient_synchronization()

    def main_grads(self, params) -> list:
        """Sequence parallelism's LayerNorms and biases (sequence.py's one TP all-reduce
        per step) are dense parameters, the experts run on the gathered sequence: the
        dense engine holds their gradients."""
        return self.dense.main_grads(params)

    def local_gradients(self) -> list:
        return [g for engine in self.engines for g in engine.local_gradients()]

    def clip_grad_norm_(self, max_norm: float) -> float:
        """sqrt(dense^2 + experts^2): each engine's norm (one all-reduce of its sum of
        squares, over its own groups), then both scale their local gradients by the
        same coefficient, as Megatron's clip_grad_norm_fp32 does over all parameters:
        no second all-reduce."""
        norms = [engine.clip_grad_norm_(0.0) for engine in self.engines]
        if len(self.engines) == 1:  # no experts here: add 0 to the experts' norm
            norms.append(math.sqrt(sum_over_groups(0.0, self._expert_norm_groups)))
        norm = math.sqrt(sum(n * n for n in norms))
        if max_norm > 0:
            coefficient = max_norm / (norm + 1e-6)
            for engine in self.engines:
                scale_grads_(engine.local_gradients(), coefficient)
        return norm

    def step(self, lr: float) -> None:
        for engine in self.engines:
            engine.step(lr)

    def zero_grad(self) -> None:
        for engine in self.engines:
            engine.zero_grad()

    @property
    def step_count(self) -> int:
        return self.dense.step_count

    def load_optimizer_state(self, step: int, state) -> None:
        for engine in self.engines:
            engine.load_optimizer_state(step, state)
