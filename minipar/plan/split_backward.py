"""What a zero-bubble schedule's I keeps for its W, and what the I adds while it runs.

The zero-bubble schedules (ZB-H1, ZB-H2, ZB-V, Qi et al. 2024) and DualPipe-V split a
chunk's backward in two: I computes the input gradients the previous stage waits for, W
later the weight gradients. Between the two, the emulator keeps what W will need
(minipar/autograd/engine.py, `WeightGradient`, as PyTorch's `stage_backward_weight`):

    a linear layer       its saved input and its output gradient (W forms x^T dy then)
    a bias added apart   its output gradient (a row-parallel bias under TP: its sum)
    a norm               nothing saved: its backward forms the weight gradients anyway,
                         and those (weight and bias, (h,) each) wait for W instead
    any other op         nothing: I frees what it saved (GELU's input, attention's
                         Q, K, V and probabilities, the loss's softmax and targets)
    a checkpointed layer nothing: its I recomputes it and runs its whole backward,
                         weight gradients included (autograd/checkpoint.py)
    below the input      the embedding's saved ids and the gradient that reached it

This replays one I as the ledger sees it, op by op from the head down to the chunk's
input, as a list of signed byte amounts: releases of forward-saved arrays, holds of
gradients kept for W, and a recomputation's activations born and freed. Their sum is
what the I frees net (what W then frees is the chunk's held bytes plus that sum), and
their largest running sum is what the I adds above what was held before it
(walked_activations.py uses both).

Exact against the emulator's ledger (tests/plan/test_walked_activations.py, and the 54
zero-bubble draws of benchmarks/fuzz_layouts.py --draws 300 --seed 3 --plan) for
minipar's GPT: GELU or SwiGLU, grouped-query attention, tied or untied head, dropout,
TP with and without sequence parallelism, context parallelism (ring attention's saved
log-sum-exp), MoE layers with and without expert parallelism, fp64 / fp32 /
bf16-mixed, and no, selective, full (uniform) and full block recomputation. What the
emulator does not run is replayed by the same rules, unmeasured: RMSNorm (one weight
gradient), linear layers without biases (a row-parallel projection under sequence
parallelism then keeps only the all-gathered gradient), rotary or ALiBi positions (no
saved bytes of their own), FlashAttention's log-sum-exp in place of the
probabilities, and FP8's smaller saved inputs (which I does not free: they are W's).
"""

from __future__ import annotations

from minipar.plan.experts import dispatch_rows
from minipar.plan.layout import ParallelConfig
from minipar.plan.shapes import ModelShape, padded_vocab


def input_backward(shape: ModelShape, config: ParallelConfig, layers: range, layer: int,
                   *, head: bool, embeds: bool, moe: int = 0) -> tuple[int, int]:
    """(what one micro-batch's I of a chunk frees net: negative, or above 0 when what W
    keeps outweighs what I frees; the most the I adds above what was held before it).

    layers: the model's indices of the chunk's layers, each saving `layer` bytes in
    forward (memory.py's count); `shape` the local one (context parallelism's s/cp
    tokens); head / embeds: the chunk holds the head / the embedding; moe: what an MoE
    layer saves beyond a dense one (module docstring)."""
    now = top = 0
    for change in _events(shape, config, layers, layer, head, embeds, moe):
        now += change
        top = max(top, now)
    return now, top


def _events(shape: ModelShape, config: ParallelConfig, layers: range, layer: int,
            head: bool, embeds: bool, moe: int):
    """The ledger's changes during the I, in order (module docstring)."""
    b, t, sp = config.micro_batch_size, config.tp, config.sequence_parallel
    a, c = config.bytes.activation, config.bytes.compute
    h, tokens = shape.d_model, b * shape.seq_len
    stream = tokens // t if sp else tokens  # the residual stream's tokens on my rank
    layer_input = stream * h * a  # a (b, s, h) activation or gradient of the stream
    norm_weights = shape.norm_params() * a  # a norm's weight gradients, in the grad's dtype
    norm_saved = stream * h * a + stream * c  # a norm's normalised input and 1/std
    # The gradient arriving at the chunk's top layer: the head's (new), or received from
    # the next stage or handed over by the V's tip (a buffer already, nothing more).
    fresh_gradient = head
    if head:
        vocab_share = padded_vocab(shape.vocab_size, t) // t * tokens * a  # my softmax
        targets = tokens * 8 + (tokens if t > 1 else 0)
        yield -(vocab_share + targets)  # the loss frees its softmax and targets
        yield vocab_share  # the logits' gradient, kept for the head's weight gradient
        yield norm_weights
        yield -norm_saved  # ln_f
    first = layers.start
    for start, end, checkpointed in reversed(config.recompute.segments(len(layers))):
        if checkpointed:  # (backward runs top down)
            # the segment's forward again (its layers' saved bytes), its backward, then
            # its input goes; the first segment's input is a buffer on a received chunk
            recomputed = ((end - start) * layer
                          + moe * shape.moe_layers_in(first + start, first + end))
            yield recomputed
            yield -recomputed
            if start or embeds:
                yield -layer_input
            fresh_gradient = True  # the checkpoint returns a new input gradient
            continue
        for i in reversed(range(first + start, first + end)):
            yield from _layer_events(shape, config, fresh_gradient, layer_input,
                                     norm_weights, norm_saved, shape.is_moe_layer(i))
            fresh_gradient = True
    if embeds:  # the input's gradient waits at the embedding for W
        yield layer_input


def _layer_events(shape: ModelShape, config: ParallelConfig, fresh_gradient: bool,
                  layer_input: int, norm_weights: int, norm_saved: int, moe: bool):
    """One layer without recomputation, or with selective recomputation: its MLP's
    backward, then its attention's."""
    b, t = config.micro_batch_size, config.tp
    a, c = config.bytes.activation, config.bytes.compute
    mask = layer_input // a if shape.dropout > 0 else 0  # a residual dropout's mask
    if moe:  # (an MoE layer's MLP has no dropout)
        yield from _moe_events(shape, config)
    else:
        yield -mask  # (and its backward makes a new gradient of a received one)
        yield _output_gradient(shape, config, fresh_gradient or mask > 0, layer_input)
    # (GELU / SwiGLU frees its input; c_fc keeps an output gradient of its size: net 0)
    yield norm_weights
    yield -norm_saved  # ln_2
    yield -mask
    # attention's c_proj: the stream's gradient there is new (ln_2's input gradient
    # added to the layer's output gradient)
    yield _output_gradient(shape, config, True, layer_input)
    # what the core saved beyond Q, K, V: the probabilities, or FlashAttention's and
    # ring attention's log-sum-exp (memory.py's choice)
    flash = config.flash_attention or config.cp > 1
    core = shape.attention_core_bytes(b, t, a, c, flash)
    if config.recompute.selective:
        yield core  # the checkpointed core recomputes its probabilities, then frees them
    yield -core
    # (the core frees Q, K and V; c_attn keeps their gradient, as large: net 0)
    yield norm_weights
    yield -norm_saved  # ln_1


def _moe_events(shape: ModelShape, config: ParallelConfig):
    """An MoE layer's MLP (minipar/nn/moe.py), from its output down to its input."""
    a = config.bytes.activation
    n, h = config.micro_batch_size * shape.seq_len, shape.d_model
    e, k = shape.moe_num_experts, shape.moe_top_k
    # the combine frees what it saved (gates, the gathered outputs, the softmax of the
    # aux loss and its counts); the router's matmul forms its weight gradient (d, E)
    # anyway, kept for W, and frees the layer's input it saved (all-gathered under
    # sequence parallelism: the whole (N, d))
    yield -(3 * n * k + n * k * h + n * e + e + 1) * a
    yield shape.router_params * a
    yield -n * h * a
    # the experts' output projections keep their output gradient: one array over
    # every slot of the dispatch buffer, and on one device the combine's padding row
    # (with expert parallelism the array is the combine's all-to-all of the slots)
    yield (dispatch_rows(shape, config.micro_batch_size) + (config.ep == 1)) * h * a
    # (each expert's GELU frees its input, its c_fc keeps a gradient as large: net 0)


def _output_gradient(shape: ModelShape, config: ParallelConfig, new: bool,
                     layer_input: int) -> int:
    """What a row-parallel output projection keeps of its output gradient: the stream's
    gradient, unless already held (a received one); with sequence parallelism also the
    all-gathered whole it multiplies (and my tokens' piece only for its bias, added
    apart: minipar/parallel/tensor/sequence.py)."""
    if config.sequence_parallel and config.tp > 1:
        whole = config.micro_batch_size * shape.seq_len * shape.d_model * config.bytes.activation
        return (layer_input if new and shape.bias else 0) + whole
    return layer_input if new else 0
