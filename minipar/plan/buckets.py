"""Gradient buckets as backward completes them: which parameters each bucket reduces and
when its last gradient is made (plan/overlap.py prices their reductions).

DDP, ZeRO-1/2 (Li et al. 2020, "PyTorch Distributed", VLDB, section 3.2.3; DeepSpeed's
`reduce_bucket_size`; minipar.parallel.data.buckets.build_buckets): the parameters, in
reverse registration order (about the order backward finishes their gradients), fill
buckets of at most `bucket_size_mb`, a larger parameter alone; 0 = one bucket. ZeRO-3:
one bucket per gather unit (zero3.gpt_units), complete when its module's backward ends.

Inside a module (a transformer layer, the embedding, the head) a parameter's gradient
is complete when backward has run the op that uses it: its share of the module's
backward is that of the ops before it and its own (plan/parameter_order.py). A bucket is
complete when its last parameter is.

A chunk's layers are one Module met once per layer, and a 4096-layer model has 50,000
parameters: the layers that fit whole in a bucket are added at once (their elements
summed, the latest of their ends taken), and a layer the cap cuts is cut once for each
way the bucket can meet it. Every figure is the one the tensor-by-tensor rule gives, to
the bit (tests/plan/test_overlap.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import groupby
from typing import NamedTuple

from minipar.plan.layout import ParallelConfig
from minipar.plan.memory import shard

MIB = 2**20


@dataclass(frozen=True)
class Module:
    """One module of a rank's chunk, as backward meets it: name (embedding, h.<i>, head),
    one micro-batch's forward and backward seconds, its parameters' elements in
    registration order, and which of them are reduced only after the flush (a tied
    embedding's copies under pipeline parallelism)."""

    name: str
    forward_s: float
    backward_s: float
    tensors: tuple[int, ...]
    late: tuple[bool, ...]
    # share of the module's backward run when each tensor's gradient is complete (None:
    # all at its end)
    ready: tuple[float, ...] | None = None
    # seconds of its backward that recompute its forward first (full recomputation: the
    # checkpoint's forward runs again before any gradient, and its output's hooks fire)
    recompute_s: float = 0.0


@dataclass(frozen=True)
class GradientBucket:
    """numel: elements reduced (padded to a multiple of N for ZeRO); after_s: seconds of
    backward compute before the bucket is complete; late: reduced only after the flush."""

    numel: int
    after_s: float
    late: bool


def gradient_buckets(modules: list[Module], config: ParallelConfig,
                     begins: list[float] | None = None) -> list[GradientBucket]:
    """Buckets in the order backward completes them (minipar.parallel.data.buckets.
    build_buckets: reverse registration order, at most bucket_size_mb of parameters
    each, a larger parameter alone; 0 = one bucket); ZeRO-3: one per module (its gather
    unit, zero3.gpt_units), complete when the module's backward ends; a bucket is
    complete when its last parameter is (Module.ready). begins: when each module's
    backward begins (a pipeline rank's chunks have theirs at different times; default:
    one backward, the modules back to back from 0)."""
    n = config.replicas
    backward = list(reversed(modules))
    if config.zero == 3:
        ends, done = [], 0.0
        for mod in backward:
            done += mod.backward_s
            ends.append(done)
        units = alike(backward, lambda mod: (shard(sum(mod.tensors), n) * n, any(mod.late)))
        return [GradientBucket(numel, end, late) for mod, (numel, late), end
                in zip(backward, units, ends, strict=True) if mod.tensors]
    cap = config.bucket_size_mb * MIB
    itemsize = config.bytes.param  # DDP's bucket_cap_mb counts parameter bytes
    if begins is None:
        begins = back_to_back(modules, 0.0)
    starts = begins[::-1]  # when each module of `backward` begins its backward
    shards = 1 if config.zero == 0 else n
    buckets: list[GradientBucket] = []
    numel, after, late = 0, 0.0, False  # the bucket being filled
    size, filling = 0, False  # its bytes; whether it holds a tensor
    # How a module's tensors fall into buckets depends only on the module, whether the
    # bucket holds a tensor and, if the module does not fit in what is left of it, the
    # bytes it holds: alike layers are cut once, not once per layer.
    cuts: dict[tuple[int, bool, int | None], tuple[list[_Piece], int]] = {}
    i = 0  # the first module of a run of the same one (a chunk's layers)
    for run in [len(list(group)) for _, group in groupby(backward, key=id)]:
        mod = backward[i]
        nbytes = sum(mod.tensors) * itemsize
        done = 0
        while done < run:
            # one module, tensor by tensor (it may start a bucket or be cut by the cap)
            fits = cap <= 0 or size + nbytes <= cap
            key = (id(mod), filling, None if fits else size)
            if key not in cuts:
                cuts[key] = _cut(mod, size, filling, cap, itemsize)
            pieces, left = cuts[key]
            size = size + nbytes if fits else left
            begin = starts[i + done]
            for elements, share, piece_late, new_bucket in pieces:
                if new_bucket and filling:
                    buckets.append(GradientBucket(shard(numel, shards) * shards, after, late))
                    numel, late = 0, False
                filling = True
                # its last tensor is complete at begin + backward_s x its largest share
                # (the same float as the largest over its tensors: rounding is monotone)
                end = begin + mod.backward_s * share
                after = end if new_bucket else max(after, end)
                numel += elements
                late = late or piece_late
            done += 1
            # then the alike modules that fit whole in the bucket, at once: one piece
            # each, the last complete at the latest begin (rounding is monotone again)
            whole = _whole(run - done, size, nbytes, cap) if filling else 0
            if whole and mod.tensors:
                key = (id(mod), True, None)
                if key not in cuts:
                    cuts[key] = _cut(mod, size, True, cap, itemsize)
                (elements, share, piece_late, _), = cuts[key][0]
                numel += whole * elements
                latest = max(starts[i + done:i + done + whole])
                after = max(after, latest + mod.backward_s * share)
                late = late or piece_late
            size += whole * nbytes
            done += whole
        i += run
    if filling:
        buckets.append(GradientBucket(shard(numel, shards) * shards, after, late))
    return buckets


def _whole(count: int, size: int, nbytes: int, cap: float) -> int:
    """How many of `count` modules of `nbytes` each fit whole, one after the other, in a
    bucket holding `size` bytes of at most `cap` (cap 0: no limit)."""
    if cap <= 0 or nbytes == 0:
        return count
    fit = max(0, min(count, int((cap - size) // nbytes)))
    # the float division may round across a boundary: settle it with exact comparisons
    while fit > 0 and size + fit * nbytes > cap:
        fit -= 1
    while fit < count and size + (fit + 1) * nbytes <= cap:
        fit += 1
    return fit


def alike(modules: list[Module], f) -> list:
    """f(module) for each module, computed once per distinct module (a chunk's layers are
    one Module, met once per layer)."""
    seen: dict[int, object] = {}
    for mod in modules:
        if id(mod) not in seen:
            seen[id(mod)] = f(mod)
    return [seen[id(mod)] for mod in modules]


class _Piece(NamedTuple):
    """The tensors of one module that fall in one bucket: their elements, the largest
    share of the module's backward any of them waits for, whether one is late, and
    whether they start a new bucket."""

    numel: int
    share: float
    late: bool
    new_bucket: bool


def _cut(mod: Module, size: int, filling: bool, cap: int, itemsize: int
         ) -> tuple[list[_Piece], int]:
    """build_buckets' rule over one module's tensors in backward order, entered with a
    bucket of `size` bytes (`filling`: it holds a tensor): the module's pieces, and the
    bytes of the bucket it leaves (cap 0: no cut)."""
    ready = mod.ready if mod.ready is not None else (1.0,) * len(mod.tensors)
    pieces: list[list] = []
    for numel, late, share in zip(reversed(mod.tensors), reversed(mod.late),
                                  reversed(ready), strict=True):
        if cap > 0 and filling and size + numel * itemsize > cap:
            pieces.append([0, share, False, True])
            size = 0
        elif not pieces:
            pieces.append([0, share, False, not filling])
        piece = pieces[-1]
        piece[0] += numel
        piece[1] = max(piece[1], share)
        piece[2] = piece[2] or late
        size += numel * itemsize
        filling = True
    return [_Piece(*piece) for piece in pieces], size


def back_to_back(modules: list[Module], start: float) -> list[float]:
    """When each module's backward begins in one backward begun at `start` (the last
    module first)."""
    begins, clock = [0.0] * len(modules), start
    for i in reversed(range(len(modules))):
        begins[i] = clock
        clock += modules[i].backward_s
    return begins


def split_back_to_back(whole: list[Module], weight: list[Module], in_input,
                       input_start: float, weight_start: float
                       ) -> tuple[list[float], list[Module]]:
    """A split backward's modules as their gradients are made, and when each one's
    backward begins: module i of `in_input` as the I begun at input_start meets it
    (`whole[i]`: its whole backward makes its gradients), the others as the W begun at
    weight_start does (`weight[i]`: its weight gradients only). On the I's clock a
    module takes its backward less its W."""
    on_input = [mod if i in in_input else replace(mod, backward_s=mod.backward_s - w.backward_s)
                for i, (mod, w) in enumerate(zip(whole, weight, strict=True))]
    input_begins = back_to_back(on_input, input_start)
    weight_begins = back_to_back(weight, weight_start)
    return ([input_begins[i] if i in in_input else weight_begins[i]
             for i in range(len(whole))],
            [whole[i] if i in in_input else weight[i] for i in range(len(whole))])
