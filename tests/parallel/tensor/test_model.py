"""Megatron tensor parallelism (and sequence parallelism on top): each rank runs its own
small training loop under `dist.launch`, and the runs are held against single-device
training, against NumPy, and against the communication and memory formulas of
Shoeybi et al. 2019 and Korthikanti et al. 2022."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.autograd import Tensor
from minipar.autograd import functional as F
from minipar.autograd.placement import (
    PlacementError,
    Replicate,
    Shard,
    StridedShard,
    shard,
    unshard,
)
from minipar.distributed.clock import DeviceProfile, collective_time
from minipar.nn import (
    GPT,
    AdamW,
    GPTConfig,
    Linear,
    Recompute,
    adamw_update,
    clip_grad_norm_,
    grad_norm_squared,
    lr_schedule,
    parameter_shapes,
)
from minipar.nn.optim import scale_grads_
from minipar.parallel.data.ddp import DataParallel
from minipar.parallel.state import Piece
from minipar.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from minipar.parallel.tensor.model import (
    counts_once_in_norm,
    parallelize_tensor,
    tensor_parallel_gpt,
)
from minipar.parallel.tensor.sequence_grads import SequenceParallelParameter
from minipar.train.build import load_local_state
from minipar.train.checkpoint import assemble
from minipar.train.data import make_stream, micro_batch

# The corpus vocabulary (52 characters) splits over 2 and 4 ranks.
CONFIG = GPTConfig(vocab_size=52, seq_len=8, n_layer=2, n_head=4, d_model=16)
STREAM = make_stream("corpus")
STEPS, MICRO, ACCUM, LR, CLIP = 3, 2, 2, 1e-2, 0.5
RTOL = 1e-10  # fp64 equivalence with one device
EVERY_LAYER = Recompute("full", "uniform", 1)  # full recomputation of every block


def tp_program(fn, tp, *args, dp=1, gpus_per_node=8, **kwargs):
    """Run fn(mesh, *args) on a dp x tp mesh; return (results, devices)."""
    def rank(*a, **k):
        return fn(dist.DeviceMesh(dp=dp, tp=tp), *a, **k)
    return dist.launch(rank, dp * tp, *args, gpus_per_node=gpus_per_node, return_devices=True,
                       **kwargs)


def rank_pieces(named, values=None) -> list[Piece]:
    """A TP rank's parameters (or `values[name]`, e.g. their gradients) as the Pieces the
    engines hand to checkpoints (`parameter_pieces`)."""
    pieces = []
    for name, p in named:
        array = np.array(p.data if values is None else values[name])
        pieces.append(Piece("param", name, array.shape, 0, array.size, array.reshape(-1),
                            p.placement, p.placement_group))
    return pieces


def consolidate(pieces_by_tp_rank) -> dict[str, np.ndarray]:
    """The single-device state dict from every TP rank's Pieces, by the production path
    (`checkpoint.assemble`, which also refuses replicas that differ)."""
    held = [(f"TP rank {i}", {"tp": i}, piece)
            for i, pieces in enumerate(pieces_by_tp_rank) for piece in pieces]
    return assemble(held, {"tp": len(pieces_by_tp_rank)})["param"]


def grad_norm_engine(model, mesh) -> DataParallel:
    """The production DDP engine over my DP group, counting the global gradient norm as
    the training loop does (replicated pieces on TP rank 0 only, summed over TP)."""
    return DataParallel(model.named_parameters(), mesh.dp_group(), adamw={"lr": LR},
                        norm_groups=(mesh.tp_group(),),
                        counts_in_norm=lambda p: counts_once_in_norm(p, mesh.tp_rank))


def batch(config=CONFIG, batch_size=2, seed=0):
    rng = np.random.default_rng(seed)
    shape = (batch_size, config.seq_len)
    return rng.integers(0, config.vocab_size, shape), rng.integers(0, config.vocab_size, shape)


# ---------------------------------------------------------------------------- layers
@pytest.mark.parametrize("tp", [2, 4])
def test_column_then_row_parallel_mlp_equals_the_numpy_mlp(tp):
    """Y = gelu(X A) B with A split by columns and B by rows (Shoeybi et al. figure 3a):
    output and every gradient agree with plain NumPy."""
    rng = np.random.default_rng(1)
    d, hidden = 8, 16
    x_full, a_full, b_full = rng.normal(size=(2, 3, d)), rng.normal(size=(d, hidden)), \
        rng.normal(size=(hidden, d))
    bias_a, bias_b, upstream = rng.normal(size=hidden), rng.normal(size=d), \
        rng.normal(size=(2, 3, d))

    def program(mesh):
        group = mesh.tp_group()
        fc, proj = Linear(d, hidden), Linear(hidden, d)
        fc.weight.data[...], fc.bias.data[...] = a_full, bias_a
        proj.weight.data[...], proj.bias.data[...] = b_full, bias_b
        column = ColumnParallelLinear.from_linear(fc, group)
        row = RowParallelLinear.from_linear(proj, group)
        x = Tensor(x_full, requires_grad=True)
        y = row(F.gelu(column(x)))
        y.backward(upstream)
        return (y.data, x.grad, column.weight.grad, column.bias.grad, row.weight.grad,
                row.bias.grad)

    # Reference by hand: forward, then the chain rule.
    pre = x_full @ a_full + bias_a
    c = math.sqrt(2 / math.pi)
    inner = c * (pre + 0.044715 * pre**3)
    act = 0.5 * pre * (1 + np.tanh(inner))
    y_ref = act @ b_full + bias_b
    d_act = upstream @ b_full.T
    d_pre = d_act * (0.5 * (1 + np.tanh(inner))
                     + 0.5 * pre * (1 - np.tanh(inner) ** 2) * c * (1 + 3 * 0.044715 * pre**2))

    def flat(z):
        return z.reshape(-1, z.shape[-1])

    grads_ref = {"x": d_pre @ a_full.T, "a": flat(x_full).T @ flat(d_pre),
                 "bias_a": flat(d_pre).sum(0), "b": flat(act).T @ flat(upstream),
                 "bias_b": flat(upstream).sum(0)}

    results, _ = tp_program(program, tp)
    width = hidden // tp
    for i, (y, gx, ga, gba, gb, gbb) in enumerate(results):
        mine = slice(i * width, (i + 1) * width)
        np.testing.assert_allclose(y, y_ref, rtol=1e-12)
        np.testing.assert_allclose(gx, grads_ref["x"], rtol=1e-12)
        np.testing.assert_allclose(ga, grads_ref["a"][:, mine], rtol=1e-12)
        np.testing.assert_allclose(gba, grads_ref["bias_a"][mine], rtol=1e-12)
        np.testing.assert_allclose(gb, grads_ref["b"][mine], rtol=1e-12)
        np.testing.assert_allclose(gbb, grads_ref["bias_b"], rtol=1e-12)


@pytest.mark.parametrize("tp", [2, 4])
def test_c_attn_piece_is_my_heads_q_k_v_and_round_trips(tp):
    """Rank i holds the q, k and v columns (and biases) of heads [i H/t, (i+1) H/t),
    which is StridedShard(1, 3), not a slice; full -> shards -> full is exact."""
    full = GPT.initial_state_dict(CONFIG, seed=0)
    weight = full["h.0.attn.c_attn.weight"]
    d, heads_per_rank = CONFIG.d_model, CONFIG.n_head // tp

    def program(mesh):
        model = tensor_parallel_gpt(CONFIG, 0, "fp64", mesh.tp_group())
        attn = model.h[0].attn.c_attn
        return attn.weight.data, attn.weight.placement, attn.bias.placement
    results, _ = tp_program(program, tp)
    width = heads_per_rank * CONFIG.head_dim
    for i, (piece, placement, bias_placement) in enumerate(results):
        q, k, v = (weight[:, j * d + i * width: j * d + (i + 1) * width] for j in range(3))
        np.testing.assert_array_equal(piece, np.concatenate([q, k, v], axis=1))
        assert placement == StridedShard(1, 3) and bias_placement == StridedShard(0, 3)
    np.testing.assert_array_equal(unshard([r[0] for r in results], results[0][1]), weight)
    pieces = [shard(weight, StridedShard(1, 3), i, tp) for i in range(tp)]
    np.testing.assert_array_equal(unshard(pieces, StridedShard(1, 3)), weight)


# ---------------------------------------------------------------------------- state
def _split_names(config):
    """Parameters split over TP (Megatron's partitioning), written out by hand."""
    names = {"wte.weight"} | ({"lm_head.weight"} if not config.tie_embeddings else set())
    for i in range(config.n_layer):
        names |= {f"h.{i}.attn.c_attn.weight", f"h.{i}.attn.c_attn.bias",
                  f"h.{i}.attn.c_proj.weight", f"h.{i}.mlp.c_fc.weight",
                  f"h.{i}.mlp.c_fc.bias", f"h.{i}.mlp.c_proj.weight"}
    return names


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("tied", [True, False])
def test_each_rank_holds_one_tth_of_the_split_matrices_plus_the_replicated_pieces(tp, tied):
    config = GPTConfig(vocab_size=52, seq_len=8, n_layer=2, n_head=4, d_model=16,
                       tie_embeddings=tied)
    split = _split_names(config)
    expected = sum((math.prod(shape) // tp if name in split else math.prod(shape)) * 8
                   for name, shape in parameter_shapes(config).items())

    def program(mesh):
        model = tensor_parallel_gpt(config, 0, "fp64", mesh.tp_group())
        device = dist.get_device()
        for p in model.parameters():
            device.memory.hold(p.data, "params")
        return sum(p.data.nbytes for p in model.parameters())
    results, devices = tp_program(program, tp)
    assert results == [expected] * tp
    assert [d.memory.peak["params"] for d in devices] == [expected] * tp


@pytest.mark.parametrize("tied", [True, False])
def test_consolidation_gives_exactly_the_single_device_names_shapes_and_values(tied):
    config = GPTConfig(vocab_size=52, seq_len=8, n_layer=2, n_head=4, d_model=16,
                       tie_embeddings=tied)
    reference = GPT.initial_state_dict(config, seed=3)

    def program(mesh):
        model = tensor_parallel_gpt(config, 3, "fp64", mesh.tp_group(), sequence_parallel=True)
        return model.state_dict(), rank_pieces(model.named_parameters())
    results, _ = tp_program(program, 4)
    placements = {piece.name: piece.placement for piece in results[0][1]}
    full = consolidate([r[1] for r in results])
    assert list(full) == list(reference)
    for name, value in reference.items():
        np.testing.assert_array_equal(full[name], value)
        placement = placements[name]
        assert isinstance(placement, (Shard, StridedShard)) == (name in _split_names(config))

    def load(mesh):  # and back: what resuming from the full tensors loads (build.py)
        model = tensor_parallel_gpt(config, 0, "fp64", mesh.tp_group(), sequence_parallel=True)
        load_local_state(model.named_parameters(), full, mesh)
        return model.state_dict()
    reloaded, _ = tp_program(load, 4)
    for (pieces, _), resharded in zip(results, reloaded, strict=True):
        assert all(np.array_equal(resharded[k], pieces[k]) for k in pieces)


def test_consolidation_refuses_replicas_that_diverged():
    def program(mesh):
        model = tensor_parallel_gpt(CONFIG, 0, "fp64", mesh.tp_group())
        if dist.get_rank() == 1:
            model.ln_f.weight.data[0] += 1e-9  # as if its gradient had not been reduced
        return rank_pieces(model.named_parameters())
    results, _ = tp_program(program, 2)
    with pytest.raises(RuntimeError, match="ln_f.weight is Replicate.*TP rank 1"):
        consolidate(results)


# ---------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_replicated_gradients_are_identical_on_every_tp_rank(sequence_parallel):
    """Without SP they act on the replicated residual stream; with SP they see 1/t of
    the tokens and f all-reduces them. Either way: bit-identical across the group."""
    idx, targets = batch()

    def program(mesh):
        model = tensor_parallel_gpt(CONFIG, 0, "fp64", mesh.tp_group(), sequence_parallel)
        model(idx, targets).backward()
        return {n: p.grad for n, p in model.named_parameters()
                if isinstance(p.placement, Replicate)}
    results, _ = tp_program(program, 4)
    assert "h.0.ln_1.weight" in results[0] and "h.1.mlp.c_proj.bias" in results[0]
    for grads in results[1:]:
        for name, grad in grads.items():
            np.testing.assert_array_equal(grad, results[0][name], err_msg=name)


@pytest.mark.parametrize("tp, sequence_parallel", [(2, False), (4, True)])
def test_tensor_parallel_grad_norm_equals_the_single_device_norm(tp, sequence_parallel):
    idx, targets = batch()
    reference = GPT(CONFIG, seed=0)
    reference(idx, targets).backward()
    expected = grad_norm_squared(p.grad for p in reference.parameters())

    def program(mesh):
        model = tensor_parallel_gpt(CONFIG, 0, "fp64", mesh.tp_group(), sequence_parallel)
        engine = grad_norm_engine(model, mesh)
        model(idx, targets).backward()
        engine.finish_gradient_synchronization()
        return engine.clip_grad_norm_(0.0) ** 2  # max_norm 0: measure, do not clip
    results, _ = tp_program(program, tp)
    np.testing.assert_allclose(results, [expected] * tp, rtol=1e-12)


def test_parallelize_tensor_converts_partial_trees_like_pipeline_stages():
    """Two parts holding blocks 0 and 1, converted separately, run one after the other
    on each TP rank: the same loss and (consolidated) gradients as the whole GPT."""
    idx, targets = batch()
    reference = GPT(CONFIG, seed=0)
    loss = reference(idx, targets)
    loss.backward()

    def program(mesh):
        group = mesh.tp_group()
        # the two stages of a pipeline (the last holds its own copy of the tied wte)
        first = parallelize_tensor(GPT(CONFIG, layers=range(0, 1), post_process=False),
                                   CONFIG, group, sequence_parallel=True)
        last = parallelize_tensor(GPT(CONFIG, layers=range(1, 2), pre_process=False),
                                  CONFIG, group, sequence_parallel=True)
        x = first.h[0](first.embed(idx))
        out = last.head(last.h[0](x), targets)
        out.backward()
        named = {**dict(first.named_parameters()),
                 **{n: p for n, p in last.named_parameters() if n != "wte.weight"}}
        grads = {n: p.grad for n, p in named.items()}
        grads["wte.weight"] = grads["wte.weight"] + last.wte.weight.grad  # tied copies
        return float(out.data), rank_pieces(named.items(), grads)

    results, _ = tp_program(program, 2)
    grads = consolidate([r[1] for r in results])
    assert [r[0] for r in results] == pytest.approx([float(loss.data)] * 2, rel=1e-13)
    assert set(grads) == set(reference.state_dict())
    for name, p in reference.named_parameters():
        np.testing.assert_allclose(grads[name], p.grad, rtol=1e-10, atol=1e-14, err_msg=name)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_bf16_mixed_runs_in_bf16_and_stays_close_to_single_device(sequence_parallel):
    """bf16 partial sums are rounded before they are added, so only closeness holds."""
    config = GPTConfig(vocab_size=52, seq_len=8, n_layer=2, n_head=4, d_model=32)
    idx, targets = batch(config, 4)
    reference = GPT(config, seed=0, precision="bf16-mixed")
    loss = reference(idx, targets)
    loss.backward()

    def program(mesh):
        model = tensor_parallel_gpt(config, 0, "bf16-mixed", mesh.tp_group(), sequence_parallel)
        out = model(idx, targets)
        out.backward()
        return float(out.data), rank_pieces(model.named_parameters(),
                                            {n: p.grad for n, p in model.named_parameters()})

    results, _ = tp_program(program, 2)
    grads = consolidate([r[1] for r in results])
    assert results[0][0] == pytest.approx(float(loss.data), rel=1e-3)
    for name, p in reference.named_parameters():
        assert grads[name].dtype == p.grad.dtype == np.dtype("bfloat16"), name
        error = np.abs(grads[name].astype(np.float32) - p.grad.astype(np.float32))
        assert error.max() <= 0.05 * np.abs(p.grad.astype(np.float32)).max(), name


# ---------------------------------------------------------------------------- training
def _lr(step):
    return lr_schedule(step, lr=LR, warmup_steps=1, total_steps=STEPS, min_lr=LR / 10)


def single_device_training(config=CONFIG, dp=1):
    """The reference: one model, the whole global batch as dp * ACCUM micro-batches."""
    model = GPT(config, seed=0, precision="fp64")
    optimizer = AdamW(model.parameters(), lr=LR)
    params = list(model.parameters())
    losses, norms, accum = [], [], ACCUM * dp
    for step in range(STEPS):
        inputs, targets = STREAM.global_batch(step, MICRO * accum, config.seq_len, seed=0)
        total = 0.0
        for k in range(accum):
            x, y = micro_batch(inputs, targets, dp_rank=0, micro_step=k,
                               micro_batch_size=MICRO, grad_accum_steps=accum)
            loss = model(x, y)
            loss.backward(np.asarray(1.0 / accum))
            total += float(loss.data) / accum
        norms.append(clip_grad_norm_(params, CLIP))
        optimizer.lr = _lr(step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, norms, model.state_dict()


class Zero1:
    """ZeRO-1 over the DP group (Rajbhandari et al. 2020), written here so that this
    test depends only on the TP code: flat gradients reduce-scattered, each DP rank
    updates its slice with its own Adam moments, the slices are all-gathered. The
    clipping norm counts each element once: TP-split pieces on every TP rank, replicated
    ones on TP rank 0 (`counts_once_in_norm`), summed over TP and DP."""

    def __init__(self, params, tp_group, dp_group):
        self.params, self.tp_group, self.dp_group = params, tp_group, dp_group
        n, d = sum(p.size for p in params), dp_group.size
        self.pad = (-n) % d
        size = (n + self.pad) // d
        start = dist.get_rank(dp_group) * size
        self.mine = slice(start, start + size)
        tp_rank = dist.get_rank(tp_group)
        self.master = self._flat([p.data.ravel() for p in params]).copy()
        self.exp_avg, self.exp_avg_sq = np.zeros(size), np.zeros(size)
        self.decay = self._flat([np.full(p.size, 0.1 if p.ndim >= 2 else 0.0) for p in params])
        self.counted = self._flat([np.full(p.size, float(counts_once_in_norm(p, tp_rank)))
                                   for p in params]) > 0

    def _flat(self, arrays, mine=True):
        flat = np.concatenate([*arrays, np.zeros(self.pad)])
        return flat[self.mine] if mine else flat

    def step(self, step):
        grads = self._flat([p.grad.ravel() for p in self.params], mine=False)
        grad = dist.reduce_scatter(grads, op="avg", group=self.dp_group)
        squares = np.asarray(np.sum(grad[self.counted] ** 2))
        squares = dist.all_reduce(dist.all_reduce(squares, group=self.tp_group),
                                  group=self.dp_group)
        scale_grads_([grad], CLIP / (math.sqrt(float(squares)) + 1e-6))
        adamw_update(self.master, grad, self.exp_avg, self.exp_avg_sq, step + 1, _lr(step),
                     0.9, 0.95, 1e-8, self.decay)
        full = dist.all_gather(self.master, group=self.dp_group)
        offset = 0
        for p in self.params:
            p.data[...] = full[offset:offset + p.size].reshape(p.shape)
            offset += p.size
            p.release_grad()


def parallel_training(mesh, config, sequence_parallel, zero=False, checkpointing=False):
    """One rank's loop: TP model, DP gradient averaging with TP-aware clipping (the
    production DDP engine), or the ZeRO-1 above."""
    tp_group, dp_group = mesh.tp_group(), mesh.dp_group()
    model = tensor_parallel_gpt(config, 0, "fp64", tp_group, sequence_parallel,
                                recompute=EVERY_LAYER if checkpointing else None)
    params = list(model.parameters())
    if zero:
        device = dist.get_device()
        for p in params:
            device.memory.hold(p.data, "params")
        optimizer = Zero1(params, tp_group, dp_group)
    else:
        engine = grad_norm_engine(model, mesh)  # holds the params in the ledger itself
    losses = []
    for step in range(STEPS):
        inputs, targets = STREAM.global_batch(step, MICRO * ACCUM * mesh.dp, config.seq_len,
                                              seed=0)
        total = 0.0
        for k in range(ACCUM):
            x, y = micro_batch(inputs, targets, dp_rank=mesh.dp_rank, micro_step=k,
                               micro_batch_size=MICRO, grad_accum_steps=ACCUM)
            if not zero:  # DDP's no_sync: only the last micro-batch averages over DP
                engine.require_backward_grad_sync = k == ACCUM - 1
            with dist.phase("forward"):
                loss = model(x, y)
            with dist.phase("backward"):
                loss.backward(np.asarray(1.0 / ACCUM))
                if not zero:
                    engine.finish_gradient_synchronization()
            total += float(loss.data) / ACCUM
        with dist.phase("optimizer"):
            losses.append(float(dist.all_reduce(np.asarray(total), op="avg", group=dp_group)))
            if zero:
                optimizer.step(step)
                continue
            engine.clip_grad_norm_(CLIP)
            engine.step(_lr(step))
            engine.zero_grad()
    return losses, model.state_dict(), rank_pieces(model.named_parameters())


def assert_matches_single_device(results, tp, reference):
    ref_losses, ref_norms, ref_state = reference
    assert max(ref_norms) > CLIP  # clipping really happened, so the TP norm was tested
    for losses, _, _ in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    state = consolidate([r[2] for r in results[:tp]])
    assert list(state) == list(ref_state)
    for name, value in ref_state.items():
        scale = np.max(np.abs(value))
        assert np.max(np.abs(state[name] - value)) <= RTOL * scale, name


_REFERENCES = {}


def reference(config=CONFIG, dp=1):
    key = (config, dp)
    if key not in _REFERENCES:
        _REFERENCES[key] = single_device_training(config, dp)
    return _REFERENCES[key]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_training_matches_single_device(tp, sequence_parallel):
    results, _ = tp_program(parallel_training, tp, CONFIG, sequence_parallel)
    assert_matches_single_device(results, tp, reference())


@pytest.mark.parametrize("tp, sequence_parallel, zero", [(2, False, False), (2, True, False),
                                                         (2, True, True), (4, True, True)])
def test_training_with_dp2_and_zero_matches_single_device(tp, sequence_parallel, zero):
    results, _ = tp_program(parallel_training, tp, CONFIG, sequence_parallel, zero, dp=2)
    assert_matches_single_device(results, tp, reference(dp=2))
    # TP rank 0 of DP replica 1 consolidates to the same weights as replica 0.
    np.testing.assert_array_equal(results[tp][1]["wte.weight"], results[0][1]["wte.weight"])


def test_untied_lm_head_and_activation_checkpointing_match_single_device():
    untied = GPTConfig(vocab_size=52, seq_len=8, n_layer=2, n_head=4, d_model=16,
                       tie_embeddings=False)
    results, _ = tp_program(parallel_training, 2, untied, True, checkpointing=True)
    assert_matches_single_device(results, 2, reference(untied))


# ---------------------------------------------------------------------------- traffic
def _one_micro_batch(mesh, config, sequence_parallel, idx, targets):
    model = tensor_parallel_gpt(config, 0, "fp64", mesh.tp_group(), sequence_parallel)
    with dist.phase("forward"):
        loss = model(idx, targets)
    with dist.phase("backward"):
        loss.backward()


def _tp_calls(device) -> Counter:
    """(phase, op, bytes sent) -> number of calls, for the TP group."""
    return Counter((r.phase, r.op, r.sent_bytes) for r in device.comm.records
                   if r.group_kind == "tp")


def megatron_calls(t, b, s, h, n_layer, sequence_parallel, itemsize=8) -> Counter:
    """The TP collectives of one micro-batch, from the papers (bytes: ring algorithm).

    Shoeybi et al.: per layer 2 all-reduces of b*s*h forward (g after attention and MLP)
    and 2 backward (f before them). Ours adds the embedding's g (forward), the LM head's
    f (backward) and the vocabulary-parallel cross-entropy's max and sum all-reduces of
    b*s and 2*b*s numbers (forward).
    Korthikanti et al.: with SP each all-reduce becomes an all-gather plus a
    reduce-scatter ((t-1)/t of b*s*h each, the same volume). Ours adds: backward of the
    embedding's scatter (all-gather), the extra all-gather that re-forms each column-
    parallel input for dW (2 per layer + the head), and f's all-reduce of the LayerNorm
    weights/biases and row-parallel biases (6 of h per layer, 2 for ln_f).
    """

    def all_reduce(n):
        return 2 * (t - 1) * n * itemsize // t

    def gather(n):  # all-gather or reduce-scatter: (t-1)/t of the full tensor
        return (t - 1) * n * itemsize // t

    bsh, bs, L = b * s * h, b * s, n_layer
    calls = Counter({("forward", "all_reduce", all_reduce(bs)): 1,        # max
                     ("forward", "all_reduce", all_reduce(2 * bs)): 1})   # sum exp, target
    if not sequence_parallel:
        calls[("forward", "all_reduce", all_reduce(bsh))] += 2 * L + 1
        calls[("backward", "all_reduce", all_reduce(bsh))] += 2 * L + 1
        return calls
    calls[("forward", "all_reduce", all_reduce(bsh))] += 1                 # embedding g
    calls[("forward", "all_gather", gather(bsh))] += 2 * L + 1
    calls[("forward", "reduce_scatter", gather(bsh))] += 2 * L
    calls[("backward", "all_gather", gather(bsh))] += 1 + 2 * L + 2 * L + 1
    calls[("backward", "reduce_scatter", gather(bsh))] += 2 * L + 1
    calls[("backward", "all_reduce", all_reduce(h))] += 6 * L + 2
    return calls


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_traffic_of_a_micro_batch_is_megatrons(tp, sequence_parallel):
    b, s, h, layers = 2, 8, 16, 2
    config = GPTConfig(vocab_size=52, seq_len=s, n_layer=layers, n_head=4, d_model=h)
    idx, targets = batch(config, b)
    _, devices = tp_program(_one_micro_batch, tp, config, sequence_parallel, idx, targets)
    expected = megatron_calls(tp, b, s, h, layers, sequence_parallel)
    for device in devices:
        assert _tp_calls(device) == expected
        assert all(r.group_kind == "tp" for r in device.comm.records)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_each_layer_adds_megatrons_collectives_and_sp_moves_the_same_volume(sequence_parallel):
    """One more layer adds exactly: 2 all-reduces of b*s*h forward and 2 backward; with
    SP, 2 all-gathers + 2 reduce-scatters forward, whose bytes equal the 2 all-reduces."""
    t, b, s, h = 2, 2, 8, 16
    per_layer = []
    for layers in (1, 2):
        config = GPTConfig(vocab_size=52, seq_len=s, n_layer=layers, n_head=4, d_model=h)
        _, devices = tp_program(_one_micro_batch, t, config, sequence_parallel, *batch(config, b))
        per_layer.append(_tp_calls(devices[0]))
    layer = per_layer[1] - per_layer[0]
    all_reduce_bytes = 2 * (t - 1) * b * s * h * 8 // t
    if not sequence_parallel:
        assert layer == Counter({("forward", "all_reduce", all_reduce_bytes): 2,
                                 ("backward", "all_reduce", all_reduce_bytes): 2})
        return
    forward = {k: n for k, n in layer.items() if k[0] == "forward"}
    assert forward == {("forward", "all_gather", all_reduce_bytes // 2): 2,
                       ("forward", "reduce_scatter", all_reduce_bytes // 2): 2}
    assert sum(k[2] * n for k, n in forward.items()) == 2 * all_reduce_bytes


# ---------------------------------------------------------------------------- activations
def _layer_activation_bytes(mesh, config, sequence_parallel, idx):
    """Bytes that one transformer layer's forward leaves saved for backward."""
    model = tensor_parallel_gpt(config, 0, "fp64", mesh.tp_group(), sequence_parallel)
    device = dist.get_device()
    for p in model.parameters():
        device.memory.hold(p.data, "params")
    x = model.embed(idx)
    before = device.memory.current["activations"]
    x = model.h[0](x)
    return device.memory.current["activations"] - before


def our_layer_activations(b, s, h, a, t, sequence_parallel, itemsize=8):
    """What each op of a layer saves (see the autograd docstrings), in elements:
    2 LayerNorms: xhat (bsh) + 1/std (bs) each; c_attn and c_fc: their input (bsh);
    attention: qkv (3bsh) + probabilities (a b s^2); attn c_proj: its input (bsh);
    GELU: its input (4bsh); mlp c_proj: its input (4bsh). Korthikanti's 34 sbh bytes
    in 16-bit are 17 sbh elements, minus the dropout masks and outputs we do not have.
    TP splits everything between c_attn/c_fc and c_proj by t; SP splits the rest too."""
    split = 3 * b * s * h + a * b * s * s + b * s * h + 4 * b * s * h + 4 * b * s * h
    replicated = 2 * (b * s * h + b * s) + 2 * b * s * h
    if sequence_parallel:
        return (replicated + split) * itemsize // t
    return (replicated + split // t) * itemsize


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_layer_activation_bytes_drop_with_tp_and_further_with_sp(tp, sequence_parallel):
    b, s, h, a = 2, 8, 16, 4
    config = GPTConfig(vocab_size=52, seq_len=s, n_layer=1, n_head=a, d_model=h)
    idx, _ = batch(config, b)
    results, _ = tp_program(_layer_activation_bytes, tp, config, sequence_parallel, idx)
    assert results == [our_layer_activations(b, s, h, a, tp, sequence_parallel)] * tp
    full = our_layer_activations(b, s, h, a, 1, False)
    if tp > 1:
        assert results[0] < full
        if sequence_parallel:
            assert results[0] * tp == full  # Korthikanti: everything divided by t


# ---------------------------------------------------------------------------- topology
def test_a_tp_group_across_two_nodes_makes_the_step_slower_by_the_comm_time():
    """Same TP=2 step; gpus_per_node=2 keeps the group on NVLink, gpus_per_node=1 puts
    each rank on its own node. Compute is identical; communication costs the alpha-beta
    time of Megatron's collectives on the slower link."""
    b, s, h, layers = 2, 8, 16, 2
    config = GPTConfig(vocab_size=52, seq_len=s, n_layer=layers, n_head=4, d_model=h)
    idx, targets = batch(config, b)
    runs = {}
    for per_node in (2, 1):
        _, devices = tp_program(_one_micro_batch, 2, config, False, idx, targets,
                                gpus_per_node=per_node)
        runs[per_node] = devices
    assert [d.summary()["node"] for d in runs[2]] == [0, 0]
    assert [d.summary()["node"] for d in runs[1]] == [0, 1]
    inside, across = runs[2][0].clock, runs[1][0].clock
    assert inside.compute_s == across.compute_s
    assert across.now > inside.now
    profile = DeviceProfile()
    for same_node, clock in ((True, inside), (False, across)):
        alpha, bandwidth = profile.link(same_node)
        expected = 0.0
        for (_, op, sent), count in megatron_calls(2, b, s, h, layers, False).items():
            full_bytes = sent  # t = 2: an all-reduce sends exactly the tensor's size
            expected += count * collective_time(op, 2, full_bytes, alpha, bandwidth)
        assert clock.comm_s == pytest.approx(expected, rel=1e-9)
    # The ranks run in lockstep (no idle time): the step is longer by the comm time.
    assert across.now - inside.now == pytest.approx(across.comm_s - inside.comm_s, rel=1e-9)


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("config, tp, sequence_parallel, message", [
    (GPTConfig(vocab_size=52, seq_len=8, n_head=6, d_model=24), 4, False,
     r"--tp 4: n_head=6 .* whole attention heads; choose --tp among \[1, 2, 3, 6\]"),
    (GPTConfig(vocab_size=53, seq_len=8, n_head=4, d_model=16), 2, False,
     r"vocab_size=53 .* --vocab-size 54"),
    (GPTConfig(vocab_size=52, seq_len=6, n_head=4, d_model=16), 4, True,
     r"--sequence-parallel: seq_len=6 .* --seq-len a multiple of 4"),
    (GPTConfig(vocab_size=52, seq_len=8, n_head=4, d_model=16, dropout=0.1), 2, False,
     r"--dropout 0.1 with --tp 2.* use --dropout 0"),
])
def test_models_that_do_not_split_are_refused_with_the_fix(config, tp, sequence_parallel,
                                                           message):
    def program(mesh):
        tensor_parallel_gpt(config, 0, "fp64", mesh.tp_group(), sequence_parallel)
    with pytest.raises(ValueError, match=message):
        tp_program(program, tp)


def test_a_layer_whose_width_does_not_split_is_refused():
    def program(mesh):
        ColumnParallelLinear.from_linear(Linear(8, 6), mesh.tp_group())
    with pytest.raises(ValueError, match=r"the output width \(6\) is not divisible by --tp 4; "
                                         r"choose --tp among \[1, 2, 3, 6\]"):
        tp_program(program, 4)


def test_a_batch_whose_length_does_not_split_under_sp_is_refused():
    def program(mesh):
        model = tensor_parallel_gpt(CONFIG, 0, "fp64", mesh.tp_group(), sequence_parallel=True)
        model(np.zeros((1, 6), dtype=np.int64), np.zeros((1, 6), dtype=np.int64))
    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by the "
                                         r"tensor-parallel size 4"):
        tp_program(program, 4)


# ---------------------------------------------------------------------------- placements
def _skip(monkeypatch, module, name):
    """Inject the bug: `module.name` (a reduction) becomes the identity."""
    monkeypatch.setattr(module, name, lambda x, group, *args, **kwargs: x)


@pytest.mark.parametrize("sequence_parallel, module, name, reduction", [
    (False, "tensor_layers", "reduce_from_tensor_parallel_region",
     r"g \(reduce_from_tensor_parallel_region\)"),
    (True, "sequence", "reduce_scatter_to_sequence_parallel_region",
     r"g-bar \(reduce_scatter_to_sequence_parallel_region\)"),
])
def test_a_row_parallel_output_used_before_its_reduction_is_a_placement_error(
        monkeypatch, sequence_parallel, module, name, reduction):
    """Skip g (or g-bar): the first use of the Partial sum (the bias add) names the layer
    and the missing collective, instead of a loss that is silently wrong."""
    from minipar.parallel.tensor import layers as tensor_layers
    from minipar.parallel.tensor import sequence
    _skip(monkeypatch, {"tensor_layers": tensor_layers, "sequence": sequence}[module], name)
    idx, targets = batch()

    def program(mesh):
        tensor_parallel_gpt(CONFIG, 0, "fp64", mesh.tp_group(), sequence_parallel)(idx, targets)
    with pytest.raises(PlacementError, match=r"got the output of h\.0\.attn\.c_proj, which is "
                                             r"Partial\(sum\).*the reduction " + reduction):
        tp_program(program, 2)


def test_the_residual_fed_a_partial_sum_is_a_placement_error(monkeypatch):
    """A row-parallel layer without bias: the residual add is the first whole-value use."""
    from minipar.parallel.tensor import layers as tensor_layers
    _skip(monkeypatch, tensor_layers, "reduce_from_tensor_parallel_region")
    rng = np.random.default_rng(0)

    def program(mesh):
        row = RowParallelLinear.from_linear(Linear(8, 4, bias=False), mesh.tp_group(),
                                            name="h.3.mlp.c_proj")
        x = Tensor(rng.normal(size=(2, 3, 4)))
        return x + row(Tensor(rng.normal(size=(2, 3, 8 // mesh.tp))))
    with pytest.raises(PlacementError, match=r"an addition .* got the output of h\.3\.mlp\.c_proj"):
        tp_program(program, 2)


def test_an_embedding_lookup_without_its_reduction_is_a_placement_error(monkeypatch):
    from minipar.parallel.tensor import vocab
    _skip(monkeypatch, vocab, "reduce_from_tensor_parallel_region")
    idx, targets = batch()

    def program(mesh):
        tensor_parallel_gpt(CONFIG, 0, "fp64", mesh.tp_group())(idx, targets)
    with pytest.raises(PlacementError, match=r"got the output of wte \(VocabParallelEmbedding\)"):
        tp_program(program, 2)


def test_a_sequence_parallel_gradient_that_skips_its_all_reduce_is_refused(monkeypatch):
    """Skip f's all-reduce of the LayerNorm weights under SP: each TP rank's gradient
    would hold only its tokens' share, and the replicas would step apart. The gradient is
    refused as it reaches .grad, before any optimizer or norm reads it."""
    from minipar.parallel.tensor import sequence_grads
    _skip(monkeypatch, sequence_grads, "copy_to_tensor_parallel_region")
    idx, targets = batch()

    def program(mesh):
        model = tensor_parallel_gpt(CONFIG, 0, "fp64", mesh.tp_group(), sequence_parallel=True)
        model(idx, targets).backward()
    with pytest.raises(PlacementError, match=r"ln_f\.(weight|bias): its gradient is "
                                             r"Partial\(sum\) over the tensor-parallel group.*"
                                             r"without the all-reduce of f"):
        tp_program(program, 2)


def test_sequence_parallel_parameters_accept_every_reduced_gradient():
    """Gradient accumulation and activation checkpointing: each backward reduces again,
    and a correct run never meets the check."""
    idx, targets = batch()

    def program(mesh):
        model = tensor_parallel_gpt(CONFIG, 0, "fp64", mesh.tp_group(), sequence_parallel=True,
                                    recompute=EVERY_LAYER)
        for _ in range(3):
            model(idx, targets).backward()
        return sorted(n for n, p in model.named_parameters()
                      if isinstance(p, SequenceParallelParameter))
    results, _ = tp_program(program, 2)
    expected = sorted([f"h.{i}.{ln}.{w}" for i in range(2) for ln in ("ln_1", "ln_2")
                       for w in ("weight", "bias")]
                      + [f"h.{i}.{m}.c_proj.bias" for i in range(2) for m in ("attn", "mlp")]
                      + ["ln_f.weight", "ln_f.bias"])
    assert results == [expected] * 2
