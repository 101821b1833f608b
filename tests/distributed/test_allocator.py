"""The ranks' freed arrays stay in the process (minipar/distributed/allocator.py)."""

import platform
import resource

import pytest

from minipar.distributed.allocator import keep_freed_memory
from minipar.train import train


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_step_reuses_the_memory_the_last_step_freed():
    settings = dict(d_model=128, n_layer=2, seq_len=64, micro_batch_size=4, grad_accum_steps=2)

    def faults(steps: int) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        train(steps=steps, **settings)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults(1)
    assert keep_freed_memory()  # set by the launch, once per process
    # glibc's defaults gave back the freed activations at the end of each backward: ~2000
    # page faults per step of this model; kept, ~300
    assert (faults(5) - faults(1)) / 4 < 1000
