"""Bytes per rank and step against the papers' communication volumes (ZeRO section 7,
Shoeybi et al. 2019 section 3, Korthikanti et al. 2022 section 4.2.2, Narayanan et al.
2021 section 2.2), which count 16-bit gradients: the layouts here say so
(grad_accum_dtype="bf16"; the planner's default is fp32 buffers, Megatron-LM's). The
emulator-backed checks are in test_estimate.py."""

from __future__ import annotations

import pytest

from minipar.plan import presets
from minipar.plan.layout import ParallelConfig, stage_plans
from minipar.plan.memory import stage_parameters
from minipar.plan.shapes import ModelShape
from minipar.plan.traffic import sent_by_group, stage_traffic

UNTIED = ModelShape(n_layer=4, d_model=256, n_head=8, vocab_size=1024, seq_len=128,
                    tie_embeddings=False)


def traffic(shape, config, rank=0):
    plan = [p for p in stage_plans(shape, config, all_ranks=True) if p.rank == rank][0]
    return stage_traffic(shape, config, plan)


def sent(shape, config, group, rank=0):
    return sent_by_group(traffic(shape, config, rank))[group]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zero_1_and_2_move_what_data_parallelism_moves(n):
    # ZeRO section 7.2.1: reduce-scatter + all-gather = one all-reduce, 2 Psi (n-1)/n x 2
    # bytes; plus one fp64 number for the gradient norm.
    config = ParallelConfig(dp=n, precision="bf16-mixed", grad_accum_dtype="bf16")
    psi = UNTIED.n_params
    dp = sent(UNTIED, config, "dp")
    assert dp == pytest.approx(2 * (n - 1) / n * 2 * psi, abs=2)
    for zero in (1, 2):
        zero_sent = sent(UNTIED, config.replace(zero=zero), "dp")
        assert zero_sent == pytest.approx(dp, abs=2 * n * 2 + 2 * 8)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zero_3_moves_one_and_a_half_times_data_parallelism(n):
    # ZeRO section 7.2.2: parameters all-gathered for forward and for backward, gradients
    # reduce-scattered: 3 Psi (n-1)/n against DP's 2 Psi (n-1)/n.
    config = ParallelConfig(dp=n, precision="bf16-mixed", grad_accum_dtype="bf16")
    dp = sent(UNTIED, config, "dp")
    zero3 = sent(UNTIED, config.replace(zero=3), "dp")
    assert zero3 / dp == pytest.approx(1.5, rel=1e-3)


def test_zero_2_reduces_every_micro_batch_zero_1_once():
    m, n = 4, 4
    config = ParallelConfig(dp=n, zero=1, grad_accum_steps=m, precision="bf16-mixed",
                            grad_accum_dtype="bf16")
    one = sent(UNTIED, config, "dp")
    two = sent(UNTIED, config.replace(zero=2), "dp")
    (plan,) = stage_plans(UNTIED, config)
    reduce_scatter = (n - 1) * -(-stage_parameters(UNTIED, config, plan).numel // n) * 2
    assert two - one == (m - 1) * reduce_scatter


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tensor_parallel_layer_all_reduces_twice_each_way(t):
    # Shoeybi et al. 2019, section 3: f and g, one all-reduce each, in attention and MLP:
    # 2 forward + 2 backward all-reduces of the (b, s, h) activation per layer.
    b, m = 2, 3
    config = ParallelConfig(tp=t, micro_batch_size=b, grad_accum_steps=m)
    deeper = ModelShape(**{**UNTIED.__dict__, "n_layer": UNTIED.n_layer + 1})
    per_layer = sent(deeper, config, "tp") - sent(UNTIED, config, "tp")
    bsh = b * UNTIED.seq_len * UNTIED.d_model * 2
    assert per_layer == m * 4 * 2 * (t - 1) / t * bsh
    recomputed = config.replace(recompute_granularity="full")
    per_layer = sent(deeper, recomputed, "tp") - sent(UNTIED, recomputed, "tp")
    assert per_layer == m * 6 * 2 * (t - 1) / t * bsh  # the forward's two again


def test_sequence_parallel_layer_adds_only_the_backward_regathers():
    # Korthikanti et al. 2022, section 4.2.2: each all-reduce becomes a reduce-scatter and
    # an all-gather of the same total volume. Megatron's column-parallel layers gather
    # their input again in backward (2 more all-gathers), and the norms' and row-parallel
    # biases' gradients are all-reduced (6 vectors of h for a GPT layer).
    t, b = 4, 2
    config = ParallelConfig(tp=t, micro_batch_size=b, grad_accum_dtype="bf16")
    deeper = ModelShape(**{**UNTIED.__dict__, "n_layer": UNTIED.n_layer + 1})
    tp_layer = sent(deeper, config, "tp") - sent(UNTIED, config, "tp")
    sp = config.replace(sequence_parallel=True)
    sp_layer = sent(deeper, sp, "tp") - sent(UNTIED, sp, "tp")
    bsh = b * UNTIED.seq_len * UNTIED.d_model * 2
    gather = (t - 1) / t * bsh
    small = 6 * 2 * (t - 1) / t * UNTIED.d_model * 2
    assert sp_layer == tp_layer + 2 * gather + small


def test_pipeline_sends_one_activation_and_one_gradient_per_micro_batch():
    p, m, b = 4, 8, 2
    config = ParallelConfig(pp=p, grad_accum_steps=m, micro_batch_size=b)
    bsh = b * UNTIED.seq_len * UNTIED.d_model * 2
    # an inner rank: m activations forward, m gradients back, plus its share of the
    # 8-byte loss broadcast along the chain, plus the ring all-reduce of the 8-byte
    # squared gradient norm: rank i sends every chunk twice except chunks i+1 and i+2;
    # the one element is in chunk 0, so rank 1 of 4 sends it twice
    loss, norm = 8, 2 * 8
    assert sent(UNTIED, config, "pp", rank=1) == 2 * m * bsh + loss + norm
    interleaved = config.replace(schedule="interleaved", virtual_stages=2)
    # Narayanan et al. 2021, section 2.2.2: v times the point-to-point messages
    assert sent(UNTIED, interleaved, "pp", rank=1) == 2 * 2 * m * bsh + loss + norm


def test_each_pipeline_send_knows_whether_its_hop_leaves_the_node():
    # dp 2 x tp 2 x pp 4 on 8-GPU nodes. Megatron-LM's order: a stage is 4 ranks, two
    # stages a node, so stage 1 sends its activations across to stage 2 and its gradients
    # inside to stage 0; minipar's: a replica's four stages (2 ranks each) fill one node
    def sends(config, rank):
        return {(t.label, t.crosses_nodes): t.count for t in traffic(UNTIED, config, rank)
                if t.op == "send"}

    megatrons = ParallelConfig(dp=2, tp=2, pp=4, grad_accum_steps=8,
                               rank_order="tp-cp-ep-dp-pp")
    assert sends(megatrons, 1) == {("activation send", True): 8, ("gradient send", False): 8}
    minipars = megatrons.replace(rank_order="tp-cp-ep-pp-dp")
    assert sends(minipars, 1) == {("activation send", False): 8, ("gradient send", False): 8}
    # interleaved: the last rank's first chunk sends on to rank 0, across; its gradients
    # go to rank 2, beside it, from both chunks
    interleaved = megatrons.replace(schedule="interleaved", virtual_stages=2)
    assert sends(interleaved, 3) == {("activation send", True): 8,
                                     ("gradient send", False): 16}


@pytest.mark.parametrize("rank,norm_bytes", [(0, 16), (1, 16), (2, 8), (3, 8)])
def test_gradient_norm_is_all_reduced_over_the_pipeline(rank, norm_bytes):
    # One fp64 number in a ring of 4: chunk 0 holds it, rank i skips chunks i+1 and i+2
    # (reduce-scatter sends all chunks but i+1, all-gather all but i+2).
    config = ParallelConfig(pp=4, grad_accum_steps=4)
    (norm,) = [t for t in traffic(UNTIED, config, rank) if t.group == "pp"
               and t.op == "all_reduce"]
    assert (norm.phase, norm.count, norm.sent) == ("step", 1, norm_bytes)


def test_tied_embedding_gradient_is_all_reduced_between_first_and_last_stage():
    tied = ModelShape(**{**UNTIED.__dict__, "tie_embeddings": True})
    config = ParallelConfig(pp=2, grad_accum_steps=2, precision="fp32")
    extra = sent(tied, config, "pp", rank=0) - sent(UNTIED, config, "pp", rank=0)
    assert extra == tied.vocab_size * tied.d_model * 4  # n = 2: each sends S


def test_gpt3_layout_traffic_is_dominated_by_tensor_parallelism():
    shape = presets.model("gpt3-175b")
    config = ParallelConfig(dp=8, tp=8, pp=8, zero=1, micro_batch_size=1,
                            global_batch_size=1536, sequence_parallel=True)
    by_group = sent_by_group(traffic(shape, config, rank=1))
    assert by_group["tp"] > by_group["dp"] > 0 and by_group["tp"] > by_group["pp"] > 0
