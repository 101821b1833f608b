"""Whether the engine records a graph: `no_grad()`, `enable_grad()`, `is_grad_enabled()`.

The flag lives in a contextvar, so every virtual rank (one thread each) has its own:
evaluating under `no_grad` on rank 0 never stops rank 1 from recording its graph.
"""

from __future__ import annotations

import contextvars
import functools

_grad_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "minipar_grad_enabled", default=True
)


def is_grad_enabled() -> bool:
    """True when ops record the graph needed by `Tensor.backward()` (the default)."""
    return _grad_enabled.get()


class _GradMode:
    """Context manager and decorator that sets the grad flag, like `torch.no_grad`."""

    enabled: bool

    def __enter__(self):
        self._token = _grad_enabled.set(self.enabled)
        return self

    def __exit__(self, *exc_info):
        _grad_enabled.reset(self._token)
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with type(self)():
                return fn(*args, **kwargs)

        return wrapper


class no_grad(_GradMode):  # noqa: N801 - named like torch.no_grad
    """Run ops without recording a graph: no saved activations, outputs need no grad."""

    enabled = False


class enable_grad(_GradMode):  # noqa: N801 - named like torch.enable_grad
    """Record a graph again inside a `no_grad` block (activation checkpointing uses it)."""

    enabled = True
