"""Gradient checking by central finite differences, in fp64.

For f: R^n -> R^m and a fixed random cotangent c, compare the analytic vector-Jacobian
product c^T J (one backward pass) with the numerical one, element by element:
    d(c . f)/dx_i ~ (c . f(x + eps e_i) - c . f(x - eps e_i)) / (2 eps),
whose error is O(eps^2) plus rounding O(1e-16 / eps). With eps = 1e-6 in fp64 the two
agree to ~1e-8 relative for smooth ops.
"""

from __future__ import annotations

import numpy as np

from minipar.autograd.grad_mode import no_grad
from minipar.autograd.tensor import Tensor


class GradcheckError(AssertionError):
    """The analytic gradient disagrees with finite differences."""


def gradcheck(fn, inputs, eps: float = 1e-6, rtol: float = 1e-5, atol: float = 1e-8,
              seed: int = 0) -> bool:
    """Check the gradients `fn` computes for each floating-point input.

    fn: takes Tensors (one per entry of `inputs`), returns a Tensor or a tuple of them.
    inputs: ndarrays or Tensors; floating ones are converted to fp64 leaves that require
    grad, anything else (int index arrays, ...) is passed through unchanged.
    Returns True, or raises GradcheckError naming the input and the worst element.
    """
    args = []
    for x in inputs:
        array = x.data if isinstance(x, Tensor) else x
        if isinstance(array, np.ndarray) and array.dtype.kind == "f":
            args.append(Tensor(array.astype(np.float64), requires_grad=True))
        else:
            args.append(x)
    outputs = fn(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    rng = np.random.default_rng(seed)
    cotangents = [rng.standard_normal(o.shape) for o in outputs]

    total = None
    for out, c in zip(outputs, cotangents, strict=True):
        term = (out * Tensor(c)).sum()
        total = term if total is None else total + term
    total.backward()

    def objective() -> float:
        with no_grad():
            outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(float(np.sum(o.data * c)) for o, c in zip(outs, cotangents, strict=True))

    for position, t in enumerate(args):
        if not isinstance(t, Tensor) or not t.requires_grad:
            continue
        analytic = np.zeros_like(t.data) if t.grad is None else t.grad
        numeric = np.zeros_like(t.data)
        for i in np.ndindex(t.data.shape):
            original = t.data[i]
            t.data[i] = original + eps
            plus = objective()
            t.data[i] = original - eps
            minus = objective()
            t.data[i] = original
            numeric[i] = (plus - minus) / (2 * eps)
        if not np.allclose(analytic, numeric, rtol=rtol, atol=atol):
            error = np.abs(analytic - numeric)
            worst = np.unravel_index(np.argmax(error), error.shape)
            raise GradcheckError(
                f"gradient of input {position} (shape {t.shape}) is wrong: at {worst} "
                f"analytic {analytic[worst]:.10g} vs numeric {numeric[worst]:.10g} "
                f"(max abs error {error.max():.3g}, rtol={rtol}, atol={atol})"
            )
    return True
