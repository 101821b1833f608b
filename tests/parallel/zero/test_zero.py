"""ZeRO stages 1-3: the measured memory and traffic against the ZeRO paper's formulas
(Rajbhandari et al. 2020), the sharded update against the replicated one, and ZeRO-3's
gather / free rhythm."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.nn import GPT, GPTConfig, Recompute, parameter_shapes
from minipar.parallel.state import describe, holdings
from minipar.parallel.zero.stage3 import Zero3Optimizer
from minipar.parallel.zero.stage_1_and_2 import ZeroOptimizer
from minipar.train import TrainConfig, train
from minipar.train.data import make_stream
from minipar.train.engines import data_parallel_engine

# d_model 16, 2 layers, the corpus's characters: unit sizes that are not multiples of 3
# or 4, so shards need padding.
VOCAB = make_stream("corpus").vocab_size
SMALL = dict(seq_len=8, n_layer=2, d_model=16, n_head=2, micro_batch_size=2, steps=1)
BYTES = {"bf16-mixed": (2, 2, 12), "fp32": (4, 4, 8)}  # params, grads, optimizer per element


def round_up(x: int, n: int) -> int:
    return -(-x // n) * n


def model_numel(config: TrainConfig, vocab: int) -> tuple[int, int]:
    """(Psi, Psi padded as one flat bucket over N = dp ranks, Psi padded per ZeRO-3
    unit): units are the embeddings, each block, and the rest (ln_f, lm_head)."""
    shapes = parameter_shapes(GPTConfig(vocab_size=vocab, seq_len=config.seq_len,
                                        n_layer=config.n_layer, n_head=config.n_head,
                                        d_model=config.d_model,
                                        tie_embeddings=config.tie_embeddings))
    sizes = {name: int(np.prod(shape)) for name, shape in shapes.items()}
    units: dict[str, int] = {}
    for name, size in sizes.items():
        unit = ".".join(name.split(".")[:2]) if name.startswith("h.") else \
            "embed" if name.startswith(("wte", "wpe")) else "head"
        units[unit] = units.get(unit, 0) + size
    psi, n = sum(sizes.values()), config.dp
    return psi, round_up(psi, n), sum(round_up(u, n) for u in units.values())


def formula(stage: int, psi: float, n: int, k: tuple[int, int, int]) -> float:
    """Model-state bytes per device, the ZeRO paper's section 3 / Figure 1."""
    p, g, o = k
    return [(p + g + o) * psi, (p + g) * psi + o * psi / n, p * psi + (g + o) * psi / n,
            (p + g + o) * psi / n][stage]


# ------------------------------------------------------------------ memory
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
@pytest.mark.parametrize("n", [3, 4])
def test_model_state_bytes_per_rank_meet_the_zero_paper(precision, n):
    p, g, o = BYTES[precision]
    for stage in range(4):
        config = TrainConfig(dp=n, zero=stage, precision=precision, **SMALL)
        report = train(config)
        psi, flat, units = model_numel(config, report.config["vocab_size"])
        assert report.n_params == psi
        padded = [psi, flat, flat, units][stage]
        for rank in report.ranks:
            memory = rank["memory"]
            measured = (memory["params"], memory["grads"], memory["optimizer"])
            expected = [(p * psi, g * psi, o * psi),
                        (p * flat, g * psi, o * flat // n),
                        (p * flat, g * flat // n, o * flat // n),
                        (p * units // n, g * units // n, o * units // n)][stage]
            assert measured == expected, (stage, rank["rank"])
            # the paper's formula, up to the padding (fewer than n elements per bucket)
            total = sum(measured)
            assert formula(stage, psi, n, (p, g, o)) <= total
            assert total <= formula(stage, padded, n, (p, g, o)) + 1e-9
            assert rank["sharding"]["padding_elements"] == padded - psi


def test_zero3_transient_memory_does_not_grow_with_depth():
    """ZeRO-3 gathers one module at a time and keeps at most two reductions in flight,
    so its transient buffers stay the same when layers are added; DP with one bucket
    copies every gradient."""
    def buffers(zero, n_layer):
        config = TrainConfig(dp=4, zero=zero, precision="fp32", **{**SMALL,
                                                                    "n_layer": n_layer})
        return train(config).ranks[0]["memory"]["buffers"]

    assert buffers(3, 3) == buffers(3, 6)
    assert buffers(0, 6) > 1.5 * buffers(0, 3)


# ------------------------------------------------------------------ traffic
def dp_bytes(report, op=None) -> list[int]:
    if op is None:
        return [r["comm"]["by_group"]["dp"] for r in report.ranks]
    return [r["comm"]["by_op"].get(op, 0) for r in report.ranks]


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_traffic_per_step_meets_the_zero_paper(precision):
    n, itemsize = 4, BYTES[precision][1]
    config = TrainConfig(dp=n, precision=precision, tie_embeddings=False, **SMALL)
    psi, flat, units = model_numel(config, VOCAB)
    # DP: one ring all-reduce, 2(n-1)/n Psi elements per rank (2(n-1) Psi in total).
    dp = train(config)
    assert sum(dp_bytes(dp)) == 2 * (n - 1) * psi * itemsize
    assert max(dp_bytes(dp)) - min(dp_bytes(dp)) <= 2 * itemsize  # uneven ring chunks
    # ZeRO-1/2: reduce-scatter + all-gather = 2(n-1)/n Psi; stage 3: 3(n-1)/n Psi.
    for stage, padded, factor in ((1, flat, 2), (2, flat, 2), (3, units, 3)):
        report = train(config.replace(zero=stage))
        moved = [a + b for a, b in zip(dp_bytes(report, "reduce_scatter"),
                                       dp_bytes(report, "all_gather"), strict=True)]
        assert moved == [factor * (n - 1) * padded // n * itemsize] * n, stage
        # besides, one fp64 scalar all-reduce for the global gradient norm
        assert all(b <= 16 for b in dp_bytes(report, "all_reduce"))
    assert 1.49 < (3 * units) / (2 * flat) < 1.51  # ZeRO-3 moves 1.5x


def test_a_tied_embedding_is_gathered_again_for_the_lm_head():
    """GPT-2 ties the LM head to wte: ZeRO-3 gathers the embedding unit for the head's
    forward as well, one more all-gather of that unit per micro-batch."""
    n = 4
    config = TrainConfig(dp=n, zero=3, precision="fp32", **SMALL)
    report = train(config)
    psi, _, units = model_numel(config, VOCAB)
    embed = round_up(VOCAB * 16 + 8 * 16, n)  # wte + wpe
    expected = (3 * units + embed) * (n - 1) // n * 4
    moved = [a + b for a, b in zip(dp_bytes(report, "reduce_scatter"),
                                   dp_bytes(report, "all_gather"), strict=True)]
    assert moved == [expected] * n


@pytest.mark.parametrize("stage, factor", [(0, 2), (1, 2), (2, 4), (3, 9)])
def test_what_grows_with_gradient_accumulation(stage, factor):
    """3 micro-batches per step: DP and ZeRO-1 still reduce once; ZeRO-2 reduce-scatters
    every micro-batch ((A+1)(n-1)/n Psi); ZeRO-3 also gathers twice per micro-batch
    (3A(n-1)/n Psi)."""
    n, accum = 4, 3
    config = TrainConfig(dp=n, zero=stage, grad_accum_steps=accum, precision="fp32",
                         tie_embeddings=False, **SMALL)
    psi, flat, units = model_numel(config, VOCAB)
    report = train(config)
    if stage == 0:
        assert sum(dp_bytes(report)) == n * factor * (n - 1) * psi // n * 4
    else:
        padded = units if stage == 3 else flat
        moved = [a + b for a, b in zip(dp_bytes(report, "reduce_scatter"),
                                       dp_bytes(report, "all_gather"), strict=True)]
        assert moved == [factor * (n - 1) * padded // n * 4] * n


# ------------------------------------------------------------------ arithmetic
@pytest.mark.parametrize("precision", ["fp64", "fp32", "bf16-mixed"])
def test_sharded_adamw_gives_exactly_the_replicated_result(precision):
    """Without clipping and accumulation the reductions add the same numbers in the same
    order, and AdamW is elementwise: every stage must match DP bit for bit."""
    config = TrainConfig(dp=3, precision=precision, grad_clip=0.0,
                         **{**SMALL, "steps": 3})
    replicated = train(config)
    for stage in (1, 2, 3):
        for bucket_size_mb in (0, 1e-3):
            sharded = train(config.replace(zero=stage, bucket_size_mb=bucket_size_mb))
            assert sharded.losses == replicated.losses
            for name, value in replicated.state_dict.items():
                assert np.array_equal(sharded.state_dict[name], value), (stage, name)


def test_clipping_uses_the_global_norm_of_the_sharded_gradient():
    config = TrainConfig(precision="fp64", grad_clip=0.05, **{**SMALL, "steps": 2})
    single = train(config.replace(grad_accum_steps=4))
    assert single.steps[0]["grad_norm"] > 0.05  # clipping is active
    for stage in (1, 2, 3):
        sharded = train(config.replace(dp=4, zero=stage))
        np.testing.assert_allclose([s["grad_norm"] for s in sharded.steps],
                                   [s["grad_norm"] for s in single.steps], rtol=1e-12)
        for name, value in single.state_dict.items():
            np.testing.assert_allclose(sharded.state_dict[name], value, rtol=1e-10,
                                       atol=1e-12)


# ------------------------------------------------------------------ ZeRO-3 rhythm
def _one_zero3_step(tie_embeddings: bool, activation_checkpointing: bool = False):
    def worker():
        model = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=16,
                              tie_embeddings=tie_embeddings),
                    recompute=Recompute("full", "uniform", 1) if activation_checkpointing
                    else None)
        engine = data_parallel_engine(model, model.named_parameters(),
                                      dist.new_group([0, 1], "dp"), zero_stage=3,
                                      bucket_bytes=0, adamw={"lr": 0.01})
        idx = np.random.default_rng(dist.get_rank()).integers(0, 16, size=(2, 8))
        with dist.phase("forward"):
            loss = model(idx, idx)
        with dist.phase("backward"):
            loss.backward()
            engine.finish_gradient_synchronization()
        with dist.phase("optimizer"):
            engine.clip_grad_norm_(0.0)
            engine.step(0.01)
            engine.zero_grad()
        device = dist.get_device()
        calls = [(r.op, r.phase, r.recv_bytes // 4 if r.op == "all_gather" else None)
                 for r in device.comm.records]
        return calls, [p.size for p in model.parameters()], device.memory.current

    return dist.launch(worker, 2)


def test_zero3_gathers_each_module_before_forward_and_backward_and_frees_it():
    (calls, sizes, current), _ = _one_zero3_step(tie_embeddings=False)
    gathers = [(op, phase) for op, phase, _ in calls if op == "all_gather"]
    # embed, h.0, h.1, head in forward; head, h.1, h.0, embed in backward
    assert gathers == [("all_gather", "forward")] * 4 + [("all_gather", "backward")] * 4
    received = [n for op, _, n in calls if op == "all_gather"]
    assert received[:4] == received[4:][::-1]  # the same units, in reverse order
    assert [op for op, _, _ in calls].count("reduce_scatter") == 4
    assert all(size == 0 for size in sizes)  # every gathered parameter was freed
    assert current["buffers"] == 0 and current["activations"] == 0


def test_zero3_with_activation_checkpointing_gathers_no_more_often():
    (plain, _, _), _ = _one_zero3_step(tie_embeddings=True)
    (recomputed, sizes, current), _ = _one_zero3_step(tie_embeddings=True,
                                                       activation_checkpointing=True)
    assert [c[:2] for c in recomputed] == [c[:2] for c in plain]
    assert all(size == 0 for size in sizes) and current["buffers"] == 0
    report = train(TrainConfig(dp=2, zero=3, activation_checkpointing=True,
                               grad_accum_steps=2, precision="fp64", check=True,
                               **{**SMALL, "steps": 2}))
    assert report.equivalence["passed"], report.equivalence["first_mismatch"]


def test_bad_stage_or_units_are_clear_errors():
    def worker(engine=ZeroOptimizer, **kwargs):
        model = GPT(GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=16))
        engine(model.named_parameters(), dist.new_group([0]), adamw={}, **kwargs)

    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        dist.launch(worker, 1, stage=4)
    with pytest.raises(ValueError, match="stage 3 needs `units`"):
        dist.launch(worker, 1, engine=Zero3Optimizer)
    with pytest.raises(ValueError, match="missing"):
        dist.launch(worker, 1, engine=Zero3Optimizer, units=[("embed", [])])


# ------------------------------------------------------------------ composing with TP / PP
def _grads_after(zero: int, after_flush: bool, accum: int = 2):
    """Every DP rank's reduced gradient (DP: p.grad; ZeRO-1: its shard) after `accum`
    micro-batches, reduced by the hooks on the last one or, as under a pipeline, by
    synchronize_gradients() after all of them."""
    config = GPTConfig(vocab_size=VOCAB, seq_len=8, n_layer=1, n_head=2, d_model=16)
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, VOCAB, size=(2, 2, 8)) for _ in range(accum)]

    def rank():
        model = GPT(config, seed=0, precision="fp64")
        engine = data_parallel_engine(model, model.named_parameters(), dist.DeviceMesh(dp=2)
                                      .dp_group(), zero_stage=zero, bucket_bytes=0, adamw={})
        me = dist.get_rank()
        for k, (x, y) in enumerate(batches):
            engine.require_backward_grad_sync = not after_flush and k == accum - 1
            model(x[me:me + 1], y[me:me + 1]).backward(np.asarray(1.0 / accum))
            engine.finish_gradient_synchronization()
        if after_flush:
            engine.synchronize_gradients()
        if zero == 0:
            return np.concatenate([p.grad.reshape(-1) for p in model.parameters()])
        return np.concatenate([sb.grad_shard for sb in engine.shards])

    return dist.launch(rank, 2)


@pytest.mark.parametrize("zero", [0, 1])
def test_synchronizing_after_a_pipeline_flush_reduces_like_the_hooks(zero):
    hooks, flush = _grads_after(zero, False), _grads_after(zero, True)
    for a, b in zip(hooks, flush, strict=True):
        np.testing.assert_array_equal(a, b)


def test_zero2_cannot_wait_for_a_pipeline_flush():
    def rank():
        model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=8, n_layer=1, n_head=2, d_model=16))
        engine = data_parallel_engine(model, model.named_parameters(), dist.DeviceMesh(dp=2)
                                      .dp_group(), zero_stage=2, bucket_bytes=0, adamw={})
        engine.synchronize_gradients()

    with pytest.raises(RuntimeError, match="only ZeRO-1"):
        dist.launch(rank, 2)


@pytest.mark.parametrize("zero", [0, 1])
def test_the_gradient_norm_sums_only_counted_pieces_over_the_norm_groups(zero):
    """Two model-parallel ranks (each its own DP group of 1 for DP, or a DP pair for
    ZeRO-1) hold different gradients; the global norm adds the squares of the counted
    ones over the norm group, as a NumPy sum over both ranks."""
    world = 2 if zero == 0 else 4
    grads = np.random.default_rng(5).normal(size=(world, 3, 4))

    def rank():
        from minipar.nn import Parameter

        me = dist.get_rank()
        mesh = dist.DeviceMesh(dp=world // 2, tp=2)
        params = [Parameter(np.zeros(4)) for _ in range(3)]
        for p, g in zip(params, grads[mesh.tp_rank], strict=True):  # DP replicas agree
            p.grad = g.copy()
        skip = params[2]  # e.g. a tied copy: counted elsewhere
        engine = data_parallel_engine(None, [(f"p{i}", p) for i, p in enumerate(params)],
                                      mesh.dp_group(), zero_stage=zero, bucket_bytes=0,
                                      adamw={}, norm_groups=(mesh.tp_group(),),
                                      counts_in_norm=lambda p: p is not skip)
        if zero:
            engine.synchronize_gradients()
        return engine.clip_grad_norm_(0.0), me

    expected = np.sqrt(np.sum(grads[:2, :2] ** 2))
    for norm, _ in dist.launch(rank, world):
        assert norm == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------ what each rank holds
CATEGORY_OF = {"param": "params", "grad": "grads", "master": "optimizer",
               "exp_avg": "optimizer", "exp_avg_sq": "optimizer"}


@pytest.mark.parametrize("precision", ["fp64", "bf16-mixed"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_holdings_describe_the_arrays_the_ledger_counts(zero, precision):
    """The engine's holdings after a backward: every range is a live array of the ledger,
    the parameter ranges hold the initial weights' elements, and per category the
    holdings add up to the bytes the ledger counts (a model that needs no padding over
    2 ranks, so that flat buffers are exactly their parameters)."""
    config = GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=16)
    initial = GPT(config, seed=0, precision=precision).state_dict()

    def rank():
        model = GPT(config, seed=0, precision=precision)
        engine = data_parallel_engine(model, model.named_parameters(),
                                      dist.DeviceMesh(dp=2).dp_group(), zero_stage=zero,
                                      bucket_bytes=0, adamw={})
        idx = np.random.default_rng(dist.get_rank()).integers(0, 16, size=(2, 8))
        model(idx, idx).backward()
        engine.finish_gradient_synchronization()
        memory = dist.get_device().memory
        held = holdings(engine)
        for h in held:
            assert h.values is not None and memory.is_held(h.values), (h.kind, h.name)
            assert h.values.shape == (h.numel,) and h.values.dtype == h.dtype
            if h.kind == "param":
                expected = initial[h.name].reshape(-1)[h.start:h.stop]
                np.testing.assert_array_equal(h.values, expected)
        if zero in (1, 2):  # one flat bucket: my optimizer state is my piece of it
            shard, me = describe(engine)["shard_numel"], dist.get_rank()
            for h in held:
                if h.kind in ("master", "exp_avg", "exp_avg_sq"):
                    assert h.bucket == 0
                    assert me * shard <= h.flat_start <= h.flat_start + h.numel <= (me + 1) * shard
        booked = {c: sum(h.nbytes for h in held if CATEGORY_OF[h.kind] == c)
                  for c in ("params", "grads", "optimizer")}
        return booked, {c: memory.current[c] for c in booked}, held

    results = dist.launch(rank, 2)
    for booked, counted, _ in results:
        assert booked == counted
    # Across the two ranks: sharded kinds cover each element once, replicated ones twice.
    sharded = {"param": zero >= 3, "grad": zero >= 2, "master": zero >= 1,
               "exp_avg": zero >= 1, "exp_avg_sq": zero >= 1}
    for kind, is_sharded in sharded.items():
        if kind == "master" and precision != "bf16-mixed":
            continue
        for name, value in initial.items():
            count = np.zeros(value.size, int)
            for _, _, held in results:
                for h in held:
                    if h.kind == kind and h.name == name:
                        count[h.start:h.stop] += 1
            assert np.all(count == (1 if is_sharded else 2)), (kind, name)


def test_peaks_fall_stage_by_stage_on_the_demo_model():
    """Set-to-none gradients (no stage keeps gradient storage between steps): on the demo
    model the measured peak falls (or stays) from ZeRO-0 to 3. ZeRO-1/2 peak at the end
    of forward, holding exactly their parameters, optimizer shard and activations (no
    gradient, no buffer), so sharding the gradient (ZeRO-2) cannot lower it further;
    ZeRO-3 peaks in backward, where it re-gathers parameters."""
    from minipar.demo import DEMO_CONFIG, DEMO_PROFILE

    base = DEMO_CONFIG.replace(tp=1, pp=1, check=False, steps=1, grad_accum_steps=1)
    runs = [train(base.replace(zero=z), device=DEMO_PROFILE) for z in range(4)]
    peaks = [r.ranks[0]["memory"]["peak_total"] for r in runs]
    assert peaks[0] > peaks[1] >= peaks[2] >= peaks[3]
    for z in (1, 2):
        memory, at = runs[z].ranks[0]["memory"], runs[z].ranks[0]["memory_at_peak"]
        assert at["phase"] == "forward" and at["grads"] == at["buffers"] == 0
        assert peaks[z] == memory["params"] + memory["optimizer"] + memory["activations"]
    assert runs[3].ranks[0]["memory_at_peak"]["phase"] == "backward"
