"""The overlap model (minipar/plan/overlap.py), its buckets (minipar/plan/buckets.py)
and the parameter order they follow (minipar/plan/parameter_order.py), as
specifications: hand-worked recurrences, and the planner's parameter lists against
minipar's own modules. tests/plan/test_estimate.py
compares the whole model with the emulator."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import GPT, GPTConfig
from minipar import distributed as dist
from minipar.plan.buckets import GradientBucket, Module, back_to_back, gradient_buckets
from minipar.plan.layout import ParallelConfig
from minipar.plan.overlap import (
    Stream,
    data_parallel_time,
    overlap_seconds,
    reduce_during_backward,
    zero3_micro_batch,
)
from minipar.plan.parameter_order import (
    embedding_tensors,
    head_tensors,
    layer_ready,
    layer_tensors,
)
from minipar.plan.shapes import ModelShape

TINY = ModelShape(n_layer=2, d_model=32, n_head=4, vocab_size=65, seq_len=16)


def buckets(*after_s: float) -> list[GradientBucket]:
    return [GradientBucket(numel=1, after_s=a, late=False) for a in after_s]


# ------------------------------------------------------------------ the recurrence
def test_waited_reductions_add_up():
    # backward 10 s; buckets done at 2, 6, 10; each reduction 3 s, waited as it starts
    computed, comm_end = reduce_during_backward(10.0, buckets(2, 6, 10), [3, 3, 3],
                                                overlap=False, max_in_flight=None)
    assert computed == comm_end == 10 + 9


def test_buckets_hide_behind_the_backward_left():
    # starts 2, 6, 10 -> ends 5, 9, 13: only the last bucket outlasts the backward
    computed, comm_end = reduce_during_backward(10.0, buckets(2, 6, 10), [3, 3, 3],
                                                overlap=True, max_in_flight=None)
    assert computed == 10 and comm_end == 13


def test_reductions_longer_than_the_compute_queue_on_one_stream():
    # 5 s each from 2: 2-7, 7-12, 12-17
    _, comm_end = reduce_during_backward(10.0, buckets(2, 6, 10), [5, 5, 5], overlap=True,
                                         max_in_flight=None)
    assert comm_end == 17


def test_a_third_reduction_in_flight_waits_for_the_oldest():
    # ZeRO's two in flight: reductions run 1-6 and 6-11; at 2.5 the third bucket waits
    # for the first (until 6), so backward's last 0.5 s runs 6-6.5; the third runs 11-16
    computed, comm_end = reduce_during_backward(3.0, buckets(1, 2, 2.5), [5, 5, 5],
                                                overlap=True, max_in_flight=2)
    assert computed == 6.5 and comm_end == 16


def test_each_stall_is_reported_and_no_limit_never_stalls():
    # the case above: the third bucket, complete at 2.5, waits 3.5 s for the first; the
    # stalls add up to how much later the compute stream ends. Without a limit (Megatron-
    # LM's distributed optimizer, DDP) nothing waits, and the reductions end as late
    stalls, free = [], []
    computed, comm_end = reduce_during_backward(3.0, buckets(1, 2, 2.5), [5, 5, 5],
                                                overlap=True, max_in_flight=2, stalls=stalls)
    assert stalls == [(2.5, 3.5)] and computed == 3.0 + sum(s for _, s in stalls)
    unlimited = reduce_during_backward(3.0, buckets(1, 2, 2.5), [5, 5, 5], overlap=True,
                                       max_in_flight=None, stalls=free)
    assert free == [] and unlimited == (3.0, comm_end)


def test_late_buckets_are_left_for_after_the_flush():
    late = [GradientBucket(1, 2.0, False), GradientBucket(1, 10.0, True)]
    stream = Stream()
    reduce_during_backward(10.0, late, [3, 100], overlap=True, max_in_flight=None,
                           stream=stream)
    assert stream.free_at == 5


def test_prefetch_hides_each_gather_behind_the_module_before():
    # three modules of 4 s forward, 8 s backward; gathers of 3 s, reduce-scatters of 2 s
    modules = [Module(f"m{i}", 4.0, 8.0, (1,), (False,)) for i in range(3)]
    waited, comm, hidden = zero3_micro_batch(modules, [3] * 3, [2] * 3, prefetch=False,
                                             overlap=False, tied_head=False)
    assert comm == 6 * 3 + 3 * 2 and waited == 3 * 12 + comm and hidden == 0
    prefetched, comm, hidden = zero3_micro_batch(modules, [3] * 3, [2] * 3, prefetch=True,
                                                 overlap=True, tied_head=False)
    # only the first forward gather and the first backward gather (nothing before them to
    # hide behind) and the last reduce-scatter (after the last module) are exposed; the
    # rest ran beside compute
    assert prefetched == 3 * 12 + 3 + 3 + 2
    assert hidden == comm - (3 + 3 + 2)


def test_what_runs_while_the_rank_waits_is_not_hidden_behind_compute():
    # HSDP's last micro-batch: each unit's all-reduce over the replicas (10 s) blocks the
    # rank; the shard group's stream meanwhile finishes a reduce-scatter still in flight
    # (2 s): busy, but beside no compute, so not hidden (what slows the GEMMs is traffic
    # beside them: timing.overlap_contention_seconds)
    modules = [Module(f"m{i}", 4.0, 8.0, (1,), (False,)) for i in range(3)]
    compute = 3 * (4 + 8)
    _, comm, hidden = zero3_micro_batch(modules, [3] * 3, [2] * 3, prefetch=True,
                                        overlap=True, tied_head=False)
    seconds, last_comm, last_hidden = zero3_micro_batch(
        modules, [3] * 3, [2] * 3, prefetch=True, overlap=True, tied_head=False,
        all_reduce_s=[10.0] * 3)
    assert last_comm == comm + 3 * 10 and last_hidden == hidden == 16
    # all communication minus the waits would count that reduce-scatter too
    assert last_comm - (seconds - compute) == hidden + 2


# ------------------------------------------------------------------ buckets
def test_buckets_follow_the_reverse_registration_order_with_ddp_capacity():
    modules = [Module("a", 1.0, 1.0, (100, 300), (False, False)),
               Module("b", 1.0, 1.0, (200,), (False,))]
    config = ParallelConfig(dp=2, precision="fp32", bucket_size_mb=2000 / 2**20)
    # backward order: b's 200, a's 300 (4 bytes each: 2000 B, the capacity), a's 100
    assert [b.numel for b in gradient_buckets(modules, config)] == [500, 100]
    one = config.replace(bucket_size_mb=0)
    assert [b.numel for b in gradient_buckets(modules, one)] == [600]


def tensor_by_tensor(modules: list[Module], config: ParallelConfig,
                     begins: list[float]) -> list[GradientBucket]:
    """build_buckets' rule as written, one tensor at a time: what gradient_buckets, which
    takes a run of alike layers at once, must give to the bit."""
    cap, itemsize = config.bucket_size_mb * 2**20, config.bytes.param
    shards = 1 if config.zero == 0 else config.replicas
    groups: list[list[tuple[int, float, bool]]] = [[]]
    size = 0
    for mod, begin in zip(reversed(modules), reversed(begins), strict=True):
        ready = mod.ready if mod.ready is not None else (1.0,) * len(mod.tensors)
        for numel, late, share in zip(reversed(mod.tensors), reversed(mod.late),
                                      reversed(ready), strict=True):
            if cap > 0 and groups[-1] and size + numel * itemsize > cap:
                groups.append([])
                size = 0
            groups[-1].append((numel, begin + mod.backward_s * share, late))
            size += numel * itemsize
    return [GradientBucket(-(-sum(t[0] for t in g) // shards) * shards,
                           max(t[1] for t in g), any(t[2] for t in g)) for g in groups if g]


@pytest.mark.parametrize("seed", range(40))
def test_alike_layers_at_once_are_the_tensor_by_tensor_rule(seed):
    rng = np.random.default_rng(seed)
    layer = Module("layer", 0.1, float(rng.uniform(0, 3)),
                   tuple(int(x) for x in rng.integers(0, 5000, 5)), (False,) * 5,
                   tuple(sorted(float(x) for x in rng.uniform(0, 1, 5))))
    other = Module("layer", 0.1, float(rng.uniform(0, 3)), (int(rng.integers(1, 9000)),),
                   (True,))
    modules = [Module("embedding", 0.2, 0.7, (3000, 200), (True, False)),
               *[layer] * int(rng.integers(0, 60)), other, *[layer] * int(rng.integers(1, 60)),
               Module("empty", 0.1, 0.3, (), ()), Module("head", 0.3, 0.9, (40, 5),
                                                           (False, False))]
    # begins as back_to_back lays them, or a pipeline's chunks' in no order
    begins = ([float(x) for x in rng.uniform(0, 100, len(modules))] if seed % 2
              else back_to_back(modules, float(rng.uniform(0, 10))))
    cap = float(rng.choice([0, 0.001, 0.005, 0.02, 0.3, 1e-9])) + float(rng.uniform(0, 1e-3))
    if seed % 3 == 0:  # a bucket of exactly k layers and what of the head fits with them
        cap = (int(rng.integers(1, 4)) * sum(layer.tensors) + 45 * int(seed % 2)) * 4 / 2**20
    config = ParallelConfig(dp=4, zero=int(rng.integers(0, 3)), precision="fp32",
                            bucket_size_mb=cap if seed % 5 else 0)
    assert gradient_buckets(modules, config, begins) == tensor_by_tensor(modules, config,
                                                                          begins)


def test_one_bucket_is_all_exposed_whatever_the_backward():
    modules = [Module("layer", 1.0, 50.0, (1000,), (False,))]
    config = ParallelConfig(dp=2, precision="fp32", micro_batch_size=1, grad_accum_steps=1)

    def collective(op, nbytes):
        return nbytes * 1e-3

    out = data_parallel_time(modules, config, collective)
    assert out["last_backward_s"] == pytest.approx(4.0) == out["comm_s"]


# ------------------------------------------------------------------ parameter order
def test_parameter_lists_follow_minipars_registration_order():
    model = GPT(GPTConfig(vocab_size=65, seq_len=16, n_layer=2, n_head=4, d_model=32,
                          tie_embeddings=False), seed=0)
    sizes = [p.size for _, p in model.named_parameters()]
    shape = ModelShape(n_layer=2, d_model=32, n_head=4, vocab_size=65, seq_len=16,
                       tie_embeddings=False)
    planned = [*embedding_tensors(shape), *layer_tensors(shape), *layer_tensors(shape),
               *head_tensors(shape)[0]]
    assert planned == sizes


def test_backward_completes_the_last_registered_parameters_first():
    # ln_1 last, mlp.c_proj first; a linear layer's bias (registered after its weight)
    # just after its weight, as the emulator's backward sums dy after the dW GEMM
    for weight in (False, True):
        ready = layer_ready(TINY, b=2, weight=weight)
        tensors = layer_tensors(TINY)  # ln_1 (w, b), c_attn (w, b), c_proj (w, b), ...
        assert len(ready) == len(tensors) == 12
        assert ready[0] == pytest.approx(1.0)
        weights = [ready[i] for i in (0, 2, 4, 6, 8, 10)]  # ln_1, c_attn, c_proj, ln_2, ...
        assert weights == sorted(weights, reverse=True)
        for linear in (2, 4, 8, 10):  # each bias completes after its weight, not after
            assert ready[linear] < ready[linear + 1] <= ready[linear - 2]  # the layer below
    # under TP a row-parallel layer (c_proj, mlp.c_proj) adds its bias after the
    # reduction, an op of its own that backward meets before the GEMM
    ready = layer_ready(TINY, b=2, tp=2)
    assert ready[5] < ready[4] and ready[11] < ready[10]  # their biases first
    assert ready[2] < ready[3] and ready[8] < ready[9]  # column-parallel: weight first
    with_tp = layer_ready(TINY, b=2, tp=2, comm_share=0.5)
    assert len(with_tp) == len(layer_tensors(TINY, 2))


@pytest.mark.parametrize("recompute", [dict(recompute_granularity="full"),
                                       dict(recompute_granularity="full",
                                            recompute_method="uniform",
                                            recompute_num_layers=2)])
def test_tp_comm_overlap_keeps_every_gradient_inside_its_layers_backward(recompute):
    # --tp-comm-overlap hides the recomputed forward's collectives with the backward's
    # own; what is left of the latter is never negative, so no gradient is complete
    # before its layer's backward begins, nor after it ends
    from minipar.plan.cluster import ClusterSpec
    from minipar.plan.layout import stage_plan
    from minipar.plan.timing import stage_modules

    shape = ModelShape(n_layer=8, d_model=32, n_head=4, vocab_size=64, seq_len=16)
    config = ParallelConfig(dp=2, tp=2, pp=2, sequence_parallel=True, tp_comm_overlap=True,
                            micro_batch_size=2, grad_accum_steps=4, bucket_size_mb=0.01,
                            overlap_grad_reduce=True, **recompute)
    cluster = ClusterSpec.from_device_profile(
        dist.DeviceProfile(name="comparable", flops=1e11, intra_node_bandwidth=5e9,
                           intra_node_latency=1e-6))
    layers = 0
    for rank in range(config.pp):
        for weight in (False, True):
            for module in stage_modules(shape, config, cluster, stage_plan(shape, config, rank),
                                        weight):
                if module.name == "layer" and module.ready is not None:
                    layers += 1
                    assert all(0.0 <= share <= 1.0 for share in module.ready), module
    assert layers


def test_hidden_reduction_is_what_ran_beside_a_compute_action():
    # the contention's h under pipelining: the stream's busy spans that fall inside the
    # rank's compute actions, not inside its waits between them
    stream = Stream()
    for now, seconds in ((1.0, 2.0), (1.5, 1.0), (6.0, 1.0)):  # busy 1-3, 3-4, 6-7
        stream.launch(now, seconds)
    assert stream.busy == [(1.0, 3.0), (3.0, 4.0), (6.0, 7.0)]
    computing = [(0.0, 2.0), (3.5, 5.0), (6.5, 8.0)]  # waits 2-3.5 and 5-6.5
    assert overlap_seconds(stream.busy, computing) == pytest.approx(1.0 + 0.5 + 0.5)
    assert overlap_seconds(stream.busy, [(0.0, 10.0)]) == pytest.approx(4.0)
    assert overlap_seconds(stream.busy, []) == 0.0
