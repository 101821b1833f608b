"""Stop a run whose numbers stopped being numbers, at the step where it happened.

A NaN or inf loss or gradient norm never recovers: AdamW turns it into NaN weights on
the next update and every later step is noise that still exits 0. So each rank checks,
after backward and the global gradient norm and before the optimizer step (so the
weights it would save are still the last finite ones), and raises TrainingDiverged
naming the step and the first non-finite tensor it holds, in the model's order:
parameters first (an earlier update that overflowed), then gradients (this step's
forward or backward overflowed). The gradient norm is all-reduced, so every rank
stops at the same step. (Megatron-LM checks the same thing in its optimizer step:
`found_inf` from the grad norm, and `--check-for-nan-in-loss-and-grad`.)
"""

from __future__ import annotations

import math

import numpy as np

from minipar.errors import TrainingDiverged
from minipar.parallel.state import parameter_pieces


def check_finite(step: int, loss: float, grad_norm: float, rank_model) -> None:
    """Raise TrainingDiverged if the loss or gradient norm of `step` is not finite.

    rank_model: this rank's build.RankModel (the parameter pieces its engine holds, its
    named parameters' gradients), only searched once something is not finite."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    culprit = first_non_finite(parameter_pieces(rank_model.engine),
                               rank_model.named_parameters())
    raise TrainingDiverged(
        f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm}; the "
        f"first non-finite tensor is {culprit}. Lower --lr, keep --grad-clip on, or use "
        "--precision fp32 / fp64", step=step, tensor=culprit)


def first_non_finite(pieces, named) -> str:
    """'parameter NAME' or 'gradient of NAME' of the first non-finite one, in order."""
    for piece in pieces:
        if not np.isfinite(np.asarray(piece.values, dtype=np.float64)).all():
            return f"parameter {piece.name}"
    for name, param in named:
        grad = getattr(param, "grad", None)
        if grad is not None and not np.isfinite(np.asarray(grad, dtype=np.float64)).all():
            return f"gradient of {name}"
    return "the loss (every parameter and gradient this rank holds is finite)"
