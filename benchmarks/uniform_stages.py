"""Uniform pipeline stages, as the schedules' papers assume them: every stage costs exactly
its transformer blocks.

    pipe = Pipeline(config, schedule="zb-h1", micro_batches=8)
    for chunk in pipe.chunks:
        charge_blocks_only(chunk)        # embedding, final LayerNorm, head, loss: free
    pipe.forward_backward(batches)       # the measured bubble is the formula's

The bubble formulas ((p - 1)/(m + p - 1) for 1F1B, Narayanan et al. 2021 section 2.2;
the zero-bubble and DualPipe ones, Qi et al. 2024 and DeepSeek-AI 2024) count only the
blocks. A real first stage also runs the embedding and a real last one the head and the
loss, so measured bubbles differ from the formulas by that imbalance
(docs/pipeline-parallel.md). Making those parts free on the simulated clock, forward and
backward, while their arrays stay in the memory ledger, measures the papers' case:
tests/parallel/pipeline/test_executor.py checks each schedule's formula this way, and
benchmarks/zero_bubble_tables.py prints both cases.
"""

from __future__ import annotations

import contextlib

from minipar import distributed as dist
from minipar.autograd.function import Context
from minipar.autograd.tracking import use_device


class NoCompute:
    """A device that keeps the rank's memory ledger and charges no time."""

    def __init__(self, device):
        self.memory = device.memory

    def compute(self, flops, kind, kernels=None):
        pass


def zero_backward_flops(output, stop=None) -> None:
    """Make the backward of the graph nodes between `output` and `stop` cost nothing."""
    stack, seen = [output._ctx], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or (stop is not None and node is stop._ctx):
            continue
        seen.add(id(node))
        node.flops_backward = 0
        stack += [e[0] for e in node.edges if e is not None and type(e[0]) is Context]


def charge_blocks_only(chunk) -> None:
    """Make a pipeline chunk's embedding, final LayerNorm, head and loss free (forward and
    backward), so that the chunk costs exactly its blocks. Call it on every chunk of a
    `Pipeline` before `forward_backward`, on the rank that owns the chunk: forward hooks
    around GPT's `embed` and `head` run them on a device that charges no time."""
    for method in ("embed", "head"):
        free = contextlib.ExitStack()

        def enter(module, args, free=free):
            free.enter_context(use_device(NoCompute(dist.get_device())))

        def leave(module, args, output, free=free, stop_at_input=method == "head"):
            free.close()
            zero_backward_flops(output, stop=args[0] if stop_at_input else None)

        chunk.register_forward_pre_hook(enter, method=method)
        chunk.register_forward_hook(leave, method=method)
