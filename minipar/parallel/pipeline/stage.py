"""What one pipeline stage holds: the model cut into pp x v pieces of consecutive layers.

The layers are cut into pp * v contiguous pieces (Huang et al. 2019, GPipe; Megatron-LM's
`get_model` with pre_process / post_process), v the virtual stages per rank (1 unless
the schedule is interleaved or a V). Each is a `minipar.nn.GPT` built over its layers
(`stage_part`):

    first virtual stage   wte, wpe (+ dropout)   then its blocks
    every virtual stage   blocks h.{i}, registered under their *global* index i
    last virtual stage    its blocks, then ln_f and the LM head and the loss

So `named_parameters()` of a stage yields the single-device (Hugging Face) names, and
consolidation is a union of dictionaries (`minipar.train.checkpoint.assemble`). A tied
LM head keeps its own copy of wte on the last stage (tied_embedding.py).
"""

from __future__ import annotations

import numpy as np

from minipar.autograd import Tensor


def split_layers(n_layer: int, num_stages: int, layer_split=None) -> list[range]:
    """The global layer indices of each of `num_stages` virtual stages, contiguous:
    `layer_split` layers each (model.check_layer_split), or balanced, n_layer // num_stages
    each and the first n_layer % num_stages one more (the last also runs the head)."""
    if layer_split is None:
        base, extra = divmod(n_layer, num_stages)
        layer_split = [base + (s < extra) for s in range(num_stages)]
    starts = np.cumsum([0] + [int(c) for c in layer_split])
    return [range(int(starts[s]), int(starts[s + 1])) for s in range(num_stages)]


def stage_part(stage: int, num_stages: int, layers: range) -> dict:
    """What virtual stage `stage` of `num_stages` builds, as GPT's keyword arguments:
    its layers, the embedding on the first, ln_f + head + loss on the last."""
    return dict(layers=layers, pre_process=stage == 0, post_process=stage == num_stages - 1,
                stage=stage)


class StageInput(Tensor):
    """A received activation: a leaf whose gradient is sent back to the previous stage.
    Its .grad is a transient "buffers" array, not a parameter gradient."""

    __slots__ = ()
    grad_category = "buffers"
