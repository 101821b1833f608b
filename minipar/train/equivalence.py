"""Equivalence checking: a parallel run against single-device training, step by step.

`minipar train --check` first trains the single-device reference: the same seed (so the
same initial weights), the same global batch cut into the same micro-batches, the same
AdamW settings, one rank. It keeps the reference's parameters after every step. Then, in
the parallel run, every rank compares after every step the parameter values it holds (a
replica, or its ZeRO shard) with the reference's values of the same elements. So a
mismatch names the first step, tensor and rank that differ (at that step, the piece that
differs most: with clipping, one wrong gradient moves every tensor a little through the
global norm): that is where the bug is.
At the end the losses of every step and the consolidated parameters are compared too.

Differences are relative to a scale: max |x - x_ref| / max |x_ref| over the tensor (an
element near zero would make an elementwise ratio meaningless).

Tolerances. A parallel run adds the same numbers in a different order (per-rank partial
sums, then the reduction), so it agrees with the reference up to rounding, which training
amplifies: Adam's first update is m / sqrt(v) = sign(g), so an element whose gradient is
at the level of rounding noise can move by +lr or -lr. fp64 rounding is 1e-16 and the
runs agree to ~1e-13; the tolerance 1e-10 shows the arithmetic is the same. fp32 agrees
to ~1e-4 after 100 steps of the default model (measured: 7e-4 at most; tolerance 1e-2).
bf16 keeps 8 mantissa bits: one rounding of a gradient differs by 2^-8 relative, enough
to flip the sign of Adam's first step for many small gradients, so a zero-initialised
bias can differ by 100% of its own tiny scale. bf16 parameters are therefore compared on
the scale of the whole model (its largest |parameter|), with tolerance 5e-2 (measured:
1.6e-2 at most after 100 steps). The per-step gradient norms are compared as well, with
the same tolerance: a gradient summed instead of averaged over DP moves Adam's update
very little (m / sqrt(v) does not see a constant factor, and clipping rescales it), but it
multiplies the norm by dp. A real bug (a missing average, a shifted shard) makes
differences of order 1 in the norm or the parameters in every precision.

Quantised collectives round on purpose (ZeRO++'s qwZ: int8 weights in the all-gathers;
qgZ: int4 gradients in the reduce-scatter; minipar/parallel/zero/quantize.py), so such a
run cannot match the reference to rounding: its check is judged against a tolerance
stated for quantisation, and the section says so (`quantized`: what rounds, and how the
norms compare). What to expect: a dequantised weight is within m/256 of its value (m:
its block's largest |w|; the largest itself loses a full step, m/128, to the clamp), a
gradient within m/16 at each of qgZ's two quantisations, and training amplifies these
as it amplifies any rounding. Measured on the demo-sized model (4 layers, d_model 192,
bf16-mixed, 8 ranks on 2 nodes, 20 steps): the loss within 1.1% of the reference at
every step, the parameters within 1.2% of the model's largest |parameter|, with qwZ,
qgZ or hpZ + qwZ + qgZ; the grid's fp64 cases (3 steps) within 0.5%. Tolerance 5e-2 on
the model's scale. The gradient norm of one step moves much more (up to 73% on those
steps where the norm spikes early in training), but a real bug (gradients summed, not
averaged) moves it by a constant factor at every step, so the quantised check compares
the geometric mean over the steps of norm / reference norm (measured: within 4.4%;
tolerance 0.25, where a factor of 2 is 1.0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar.autograd.placement import Replicate, shard
from minipar.parallel.zero.quantize import GRADIENT_BLOCK, WEIGHT_BLOCK
from minipar.train.config import TrainConfig

TOLERANCES = {"fp64": 1e-10, "fp32": 1e-2, "bf16-mixed": 5e-2}
# What a parameter difference is measured against: the tensor's own largest |value|, or
# for bf16 the largest |value| of the whole model (see the module docstring).
SCALES = {"fp64": "tensor", "fp32": "tensor", "bf16-mixed": "model"}
# Runs whose collectives quantise (the module docstring): the loss and parameters on the
# model's scale, and the geometric mean of the gradient norms' ratios.
QUANTIZED_TOLERANCE = 5e-2
QUANTIZED_NORM_TOLERANCE = 0.25


@dataclass(frozen=True)
class Judging:
    """How a checked run is compared with its reference: the tolerance on parameters,
    losses and gradient norms, what a parameter difference is divided by ("tensor" or
    "model"), and for a quantised run what rounds (None: the arithmetic is exact up to
    the precision's rounding)."""

    tolerance: float
    scale: str
    quantized: dict | None = None


def judging(config: TrainConfig) -> Judging:
    """The precision's tolerance, or the quantisation's when a collective rounds."""
    rounds = {}
    if config.zero_quantized_weights:
        rounds["weights"] = f"int8 blocks of {WEIGHT_BLOCK} in every parameter all-gather (qwZ)"
    if config.zero_quantized_gradients:
        rounds["gradients"] = (f"int4 blocks of {GRADIENT_BLOCK} in the gradient "
                               "reduce-scatter (qgZ)")
    if not rounds:
        return Judging(TOLERANCES[config.precision], SCALES[config.precision])
    return Judging(max(QUANTIZED_TOLERANCE, TOLERANCES[config.precision]), "model", rounds)


def reference_config(config: TrainConfig) -> TrainConfig:
    """The single-device run a parallel run must match: one rank, the same micro-batches
    (micro_batch_size x grad_accum_steps x dp of them per step), everything else equal."""
    return config.replace(dp=1, tp=1, pp=1, cp=1, ep=1, zero=0, sequence_parallel=False,
                          check=False, offload_optimizer="none", offload_param="none",
                          hsdp_shard_size=None, zero_hpz_partition_size=1,
                          zero_quantized_weights=False, zero_quantized_gradients=False,
                          reshard_after_forward=True,
                          schedule="1f1b", virtual_stages=1,
                          micro_batch_size=config.micro_batch_size,
                          grad_accum_steps=config.grad_accum_steps * config.dp,
                          global_batch_size=config.global_batch_size)


def relative_difference(value: np.ndarray, reference: np.ndarray, scale: float) -> float:
    """max |value - reference| / scale, in fp64."""
    difference = np.abs(np.asarray(value, np.float64) - np.asarray(reference, np.float64))
    return float(difference.max(initial=0.0)) / scale


def scales(state: dict[str, np.ndarray], kind: str) -> dict[str, float]:
    """What each tensor's differences are divided by: its own largest |value| ("tensor"),
    or the largest |value| of any tensor ("model"); 1 for an all-zero scale."""
    largest = {name: float(np.abs(np.asarray(a, np.float64)).max(initial=0.0))
               for name, a in state.items()}
    if kind == "model":
        top = max(largest.values(), default=0.0)
        largest = dict.fromkeys(largest, top)
    return {name: value if value > 0 else 1.0 for name, value in largest.items()}


class StepChecker:
    """One rank's comparison with the reference after every optimizer step.

    reference_states[s]: the reference's {name: full parameter} after step s;
    tolerance: the largest relative difference accepted; coords, sizes: this rank's mesh
    coordinates and the mesh sizes (to cut the reference like a tensor-parallel shard)."""

    def __init__(self, reference_states: dict[int, dict], tolerance: float, rank: int,
                 coords: dict | None = None, sizes: dict | None = None,
                 scale: str = "tensor"):
        self.reference_states = reference_states
        self.tolerance, self.scale = tolerance, scale
        self._scales: dict[int, dict[str, float]] = {}
        self.rank = rank
        self.coords, self.sizes = coords or {}, sizes or {}
        self.max_rel_param_diff = 0.0
        self.first_mismatch = None

    def compare(self, step: int, owned, replicas=()) -> None:
        """Compare the parameter pieces this rank holds after `step` with the reference.

        owned: the pieces this rank updates itself (a DP replica, a ZeRO shard);
        replicas: copies it received from others (ZeRO-1/2's all-gathered parameters).
        A mismatch in an owned piece is reported before one in a replica: with ZeRO-1/2
        a wrong shard reaches every rank through the all-gather, and the rank to blame
        is its owner."""
        for is_owned, pieces in ((True, owned), (False, replicas)):
            for piece in pieces:
                diff = self._difference(step, piece)
                self.max_rel_param_diff = max(self.max_rel_param_diff, diff)
                if not diff <= self.tolerance and self._earlier(step, is_owned, diff):
                    self.first_mismatch = {"step": step, "tensor": piece.name,
                                           "rank": self.rank, "owned": is_owned,
                                           "rel_diff": diff}

    def _difference(self, step: int, piece) -> float:
        if step not in self._scales:
            self._scales[step] = scales(self.reference_states[step], self.scale)
        full = self.reference_states[step][piece.name]
        local = full
        if not isinstance(piece.placement, Replicate):
            group = piece.placement_group
            local = shard(full, piece.placement, self.coords[group], self.sizes[group])
        expected = local.reshape(-1)[piece.start:piece.stop]
        return relative_difference(piece.values, expected, self._scales[step][piece.name])

    def _earlier(self, step: int, owned: bool, diff: float) -> bool:
        """Is this mismatch a better culprit than the one kept: an earlier step, then an
        owned piece, then the larger difference (with gradient clipping, one wrong
        gradient changes the global norm and so, slightly, every tensor: the one that
        differs most is where the bug is)."""
        first = self.first_mismatch
        return first is None or (step, not owned, -diff) < (
            first["step"], not first["owned"], -first["rel_diff"])

    def summary(self) -> dict:
        return {"max_rel_param_diff": self.max_rel_param_diff,
                "first_mismatch": self.first_mismatch}


def compare_runs(steps: list[dict], reference_steps: list[dict], state_dict: dict,
                 reference_state_dict: dict, rank_summaries: list[dict],
                 tolerance: float, scale: str = "tensor", quantized: dict | None = None
                 ) -> dict:
    """The report's `equivalence` section.

    steps / reference_steps: the two runs' step records; state_dict /
    reference_state_dict: final consolidated parameters; rank_summaries: each rank's
    StepChecker.summary(). `first_mismatch` is None or {"step", "tensor", "rank",
    "rel_diff", ...}: the earliest step at which a rank held a parameter (or the run a
    loss or gradient norm) off by more than the tolerance; the loss counts as tensor
    "loss", the norm as "grad_norm", both with rank None. quantized: what rounds on
    purpose (`Judging.quantized`): the norms are then judged by their geometric mean
    ratio (tensor "grad_norm", at the last step), and the section has a `quantized`
    entry saying so."""
    loss = np.array([s["loss"] for s in steps])
    reference_loss = np.array([s["loss"] for s in reference_steps])
    loss_diff = np.abs(loss - reference_loss)
    rel_loss_diff = loss_diff / np.maximum(np.abs(reference_loss), 1e-30)
    divide = scales(reference_state_dict, scale)
    param_diffs = {name: relative_difference(state_dict[name], value, divide[name])
                   for name, value in reference_state_dict.items()}
    max_rel_param_diff = max(param_diffs.values(), default=0.0)

    candidates = [s["first_mismatch"] for s in rank_summaries if s["first_mismatch"]]
    bad_loss = np.flatnonzero(~(rel_loss_diff <= tolerance))
    if bad_loss.size:
        i = int(bad_loss[0])
        candidates.append({"step": steps[i]["step"], "tensor": "loss", "rank": None,
                           "rel_diff": float(rel_loss_diff[i])})
    # The gradient norm, too: a gradient scaled by a constant (summed instead of averaged
    # over DP) barely moves Adam's update, m / sqrt(v), and clipping rescales it anyway, so
    # the parameters alone can hide it; the norm shows it as a factor of dp.
    norm = np.array([s.get("grad_norm", np.nan) for s in steps])
    reference_norm = np.array([s.get("grad_norm", np.nan) for s in reference_steps])
    rel_norm_diff = np.abs(norm - reference_norm) / np.maximum(np.abs(reference_norm), 1e-30)
    rel_norm_diff = np.where(np.isnan(norm) & np.isnan(reference_norm), 0.0, rel_norm_diff)
    if quantized is None:
        bad_norm = np.flatnonzero(~(rel_norm_diff <= tolerance))
        if bad_norm.size:
            i = int(bad_norm[0])
            candidates.append({"step": steps[i]["step"], "tensor": "grad_norm", "rank": None,
                               "rel_diff": float(rel_norm_diff[i])})
    else:  # one step's norm moves a lot; a bug's constant factor stays at every step
        ratio = float(np.exp(np.mean(np.log(norm / reference_norm)))) if len(norm) else 1.0
        quantized = {**quantized, "grad_norm_ratio": ratio,
                     "grad_norm_tolerance": QUANTIZED_NORM_TOLERANCE,
                     "judged": "against the quantisation tolerance (rounding on purpose), "
                               "not the exact arithmetic's"}
        if not abs(ratio - 1) <= QUANTIZED_NORM_TOLERANCE:
            candidates.append({"step": steps[-1]["step"], "tensor": "grad_norm",
                               "rank": None, "rel_diff": abs(ratio - 1)})
    for name, diff in param_diffs.items():
        if not diff <= tolerance:  # only the final comparison saw it
            candidates.append({"step": steps[-1]["step"], "tensor": name, "rank": None,
                               "rel_diff": diff})
    # Earliest step first; at one step, a rank's own piece, then a received copy, then
    # the loss and the final comparison; then the largest difference, the lowest rank.
    first = min(candidates, key=lambda c: (c["step"], not c.get("owned", False),
                                           c["rank"] is None, -c["rel_diff"], c["rank"] or 0),
                default=None)
    per_rank = max((s["max_rel_param_diff"] for s in rank_summaries), default=0.0)
    section = {
        "reference": "single-device",
        "max_abs_loss_diff": float(loss_diff.max(initial=0.0)),
        "max_rel_loss_diff": float(rel_loss_diff.max(initial=0.0)),
        "max_rel_grad_norm_diff": float(rel_norm_diff.max(initial=0.0)),
        "max_rel_param_diff": max_rel_param_diff,
        "max_rel_param_diff_per_step": max(per_rank, max_rel_param_diff),
        "tolerance": tolerance,
        "relative_to": scale,
        "passed": first is None,
        "first_mismatch": first,
    }
    if quantized is not None:
        section["quantized"] = quantized
    return section
