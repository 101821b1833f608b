"""A small reverse-mode autograd engine on NumPy, shaped like PyTorch's.

    from minipar.autograd import Tensor, Function, no_grad
    from minipar.autograd import functional as F

The engine: `Tensor` (tensor.py), `Function` and its graph node `Context` (function.py),
the backward pass (engine.py). ops.py holds the elementary ops,
functional.py the fused ones GPT-2 needs; checkpoint.py activation checkpointing;
gradcheck.py finite-difference checks; precision.py the number formats; tracking.py how
costs are reported to the current (virtual) device.
"""

from minipar.autograd import functional, ops
from minipar.autograd.checkpoint import checkpoint
from minipar.autograd.function import Context, Function
from minipar.autograd.grad_mode import enable_grad, is_grad_enabled, no_grad
from minipar.autograd.gradcheck import GradcheckError, gradcheck
from minipar.autograd.ops import concat
from minipar.autograd.precision import POLICIES, PrecisionPolicy, bfloat16, get_policy
from minipar.autograd.tensor import Tensor
from minipar.autograd.tracking import current_device, use_device

__all__ = [
    "POLICIES",
    "Context",
    "Function",
    "GradcheckError",
    "PrecisionPolicy",
    "Tensor",
    "bfloat16",
    "checkpoint",
    "concat",
    "current_device",
    "enable_grad",
    "functional",
    "get_policy",
    "gradcheck",
    "is_grad_enabled",
    "no_grad",
    "ops",
    "use_device",
]
