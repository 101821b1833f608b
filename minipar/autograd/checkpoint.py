"""Activation checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"; Megatron's `checkpoint` of a transformer layer).

`checkpoint(fn, *inputs)` runs `fn` without recording a graph and keeps only its inputs.
When backward reaches it, it runs `fn` again with grad enabled and backpropagates
through that fresh graph. Activations inside `fn` then exist only during its own
backward: one block's worth at a time instead of every block's, for the price of a
second forward (about +33% compute for a transformer). The second forward runs inside
`tracking.recomputing()`, so the device books its FLOPs as recomputation too.
Which calls to checkpoint (whole blocks, or only the attention core) is
minipar.nn.recompute's choice.
"""

from __future__ import annotations

import copy

import numpy as np

from minipar.autograd.function import Function
from minipar.autograd.grad_mode import enable_grad, no_grad
from minipar.autograd.tensor import Tensor
from minipar.autograd.tracking import recomputing


class Checkpoint(Function):
    """The graph node standing for a checkpointed call; see `checkpoint`."""

    @staticmethod
    def forward(ctx, fn, is_tensor, generator, *args):
        # Dropout inside fn must draw the same masks when recomputed, so remember the
        # generator's state (as torch.utils.checkpoint's preserve_rng_state does).
        ctx.rng_state = None if generator is None else copy.deepcopy(
            generator.bit_generator.state)
        with no_grad():
            out = fn(*_as_inputs(args, is_tensor, requires_grad=None))
        if not isinstance(out, Tensor):
            raise TypeError(f"checkpoint: the function must return one Tensor, got {type(out)}")
        ctx.save_for_backward(*(a if t else None for a, t in zip(args, is_tensor, strict=True)))
        ctx.fn, ctx.is_tensor, ctx.generator = fn, is_tensor, generator
        ctx.other_args = tuple(None if t else a for a, t in zip(args, is_tensor, strict=True))
        return out.data

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        args = tuple(s if t else o
                     for s, o, t in zip(saved, ctx.other_args, ctx.is_tensor, strict=True))
        needs = ctx.needs_input_grad[3:]
        inputs = _as_inputs(args, ctx.is_tensor, requires_grad=needs)
        generator = ctx.generator
        if generator is not None:
            state_after_forward = copy.deepcopy(generator.bit_generator.state)
            generator.bit_generator.state = ctx.rng_state
        with enable_grad(), recomputing():
            out = ctx.fn(*inputs)
        if generator is not None:
            generator.bit_generator.state = state_after_forward
        if out.requires_grad:
            out.backward(grad)
        grads = []
        for x in inputs:
            if isinstance(x, Tensor) and x.requires_grad:
                g = x.grad
                x.release_grad()  # handed to the outer backward, no longer a leaf's .grad
                grads.append(g)
            else:
                grads.append(None)
        return (None, None, None, *grads)


def _as_inputs(args, is_tensor, requires_grad):
    inputs = []
    for i, (a, t) in enumerate(zip(args, is_tensor, strict=True)):
        if not t:
            inputs.append(a)
        else:
            needs = requires_grad is not None and requires_grad[i]
            inputs.append(Tensor(a, requires_grad=bool(needs)))
    return inputs


def checkpoint(fn, *inputs, generator: np.random.Generator | None = None):
    """`fn(*inputs)`, keeping only `inputs` for backward and recomputing the rest.

    Parameters used inside `fn` get their gradients as usual (their post-accumulate
    hooks fire during the recomputed backward). Pass the `generator` that dropout inside
    `fn` draws from, so the recomputation sees the same masks.
    """
    is_tensor = tuple(isinstance(a, Tensor) for a in inputs)
    return Checkpoint.apply(fn, is_tensor, generator, *inputs)
