"""no_grad / enable_grad / is_grad_enabled, per thread."""

from __future__ import annotations

import threading

import numpy as np

from minipar.autograd import Tensor, enable_grad, is_grad_enabled, no_grad


def test_no_grad_context_and_decorator():
    x = Tensor(np.ones(2), requires_grad=True)
    assert is_grad_enabled()
    with no_grad():
        assert not is_grad_enabled()
        assert not (x * 2.0).requires_grad
        with enable_grad():
            assert (x * 2.0).requires_grad
    assert is_grad_enabled() and (x * 2.0).requires_grad

    @no_grad()
    def evaluate():
        return x * 2.0

    assert not evaluate().requires_grad


def test_grad_mode_is_per_thread():
    seen = {}
    inside = threading.Event()
    release = threading.Event()

    def worker():
        with no_grad():
            inside.set()
            release.wait(timeout=5)
            seen["worker"] = is_grad_enabled()

    thread = threading.Thread(target=worker)
    thread.start()
    inside.wait(timeout=5)
    seen["main"] = is_grad_enabled()  # the worker's no_grad must not leak here
    release.set()
    thread.join()
    assert seen == {"main": True, "worker": False}
