"""ZeRO-3 across nodes: hybrid sharding (HSDP / MiCS), FSDP2's reshard_after_forward,
ZeRO++'s hpZ, qwZ and qgZ. The exact ones against one device in fp64; the quantised
ones against their stated tolerance; each one's memory and bytes (by group, by link)
against what the papers and the reference code say."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.cli import equivalence_line
from minipar.errors import ConfigError
from minipar.parallel.zero.quantize import (
    GRADIENT_BLOCK,
    WEIGHT_BLOCK,
    dequantize,
    pack_int4,
    quantize,
    quantized_nbytes,
    unpack_int4,
)
from minipar.parallel.zero.quantized import AllToAllQuantReduce, QuantizedAllGather
from minipar.train import TrainConfig, train
from minipar.train.equivalence import QUANTIZED_TOLERANCE, compare_runs

# 8 ranks on 2 nodes of 4: the data-parallel group crosses the node boundary once
SMALL = dict(seq_len=16, n_layer=2, d_model=32, n_head=4, micro_batch_size=2, steps=2,
             dp=8, zero=3, gpus_per_node=4)
BF16 = dict(SMALL, precision="bf16-mixed", steps=1)


def run(**settings):
    return train(**{**SMALL, **settings})


def per_rank(report, *keys):
    values = []
    for rank in report.ranks:
        value = rank
        for key in keys:
            value = value.get(key, 0) if isinstance(value, dict) else 0
        values.append(value)
    return values


def sent(report, kind: str) -> list[int]:
    return per_rank(report, "comm", "by_group", kind)


def inter_node(report) -> list[int]:
    return per_rank(report, "comm", "by_link", "inter_node")


# ------------------------------------------------------------------ exact: fp64 vs one device
@pytest.mark.parametrize("settings", [
    dict(hsdp_shard_size=4, grad_accum_steps=2),
    dict(hsdp_shard_size=2, reshard_after_forward=False),
    dict(reshard_after_forward=False, grad_accum_steps=2),
    dict(reshard_after_forward=4, grad_accum_steps=2),
    dict(zero_hpz_partition_size=4, grad_accum_steps=2, recompute_granularity="full"),
    dict(dp=4, tp=2, zero_hpz_partition_size=2),
], ids=str)
def test_the_exact_switches_train_as_one_device_does(settings):
    check = run(precision="fp64", check=True, **settings).equivalence
    assert check["passed"] and check["max_rel_param_diff_per_step"] < 1e-10, check
    assert "quantized" not in check and check["tolerance"] == 1e-10


# ------------------------------------------------------------------ HSDP / MiCS
def test_hsdp_keeps_zero3_over_k_ranks_and_crosses_nodes_only_to_all_reduce():
    hsdp, zero3_over_4, zero3_over_8 = (train(**{**BF16, **s}) for s in (
        dict(hsdp_shard_size=4), dict(dp=4), {}))
    for category in ("params", "optimizer"):  # ZeRO-3's model state over K, not over N
        assert hsdp.memory(category) == zero3_over_4.memory(category)[:1] * 8
        assert max(zero3_over_8.memory(category)) < min(hsdp.memory(category))
    # the shard groups are the nodes: their traffic never leaves one; what crosses is
    # the replicate all-reduce of my gradient shard, 2 (R-1)/R x its bytes with R = 2
    assert inter_node(hsdp) == sent(hsdp, "dp_replicate") and sent(hsdp, "dp") == [0] * 8
    shard_bytes = [r["sharding"]["shard_numel"] * 2 for r in hsdp.ranks]  # bf16 gradients
    assert sent(hsdp, "dp_replicate") == shard_bytes
    assert sum(inter_node(hsdp)) < sum(inter_node(zero3_over_8)) / 2


# ------------------------------------------------------------------ reshard_after_forward, hpZ
def test_the_three_reshard_choices_trade_memory_for_backward_all_gathers():
    deeper = dict(BF16, n_layer=4)  # (2 blocks: the embeddings' buffers set the peak)
    reports = {name: train(**deeper, **s) for name, s in (
        ("true", {}), ("false", dict(reshard_after_forward=False)),
        ("4", dict(reshard_after_forward=4)), ("hpz", dict(zero_hpz_partition_size=4)))}
    gathers = {name: sum(sent(r, "dp")) for name, r in reports.items()}
    # False and K: the backward gathers nothing over the 8 ranks (K: over my node's 4)
    assert gathers["false"] == gathers["4"] == gathers["hpz"] < gathers["true"]
    assert sum(sent(reports["4"], "dp_secondary")) > 0
    assert sum(inter_node(reports["4"])) == sum(inter_node(reports["false"]))
    for name in ("4", "hpz"):  # the secondary group is a node: none of it crosses
        assert sum(inter_node(reports[name])) == sum(inter_node(reports["false"]))
    # memory: K keeps a 1/K piece of every unit (2 Psi / K bytes of bf16 parameters) ...
    padded = reports["4"].ranks[0]["sharding"]["padded_numel"]
    secondary = padded // 4 * 2
    assert reports["4"].memory("params") == [p + secondary for p in
                                             reports["true"].memory("params")]
    # ... False keeps the gathered units until their backward
    assert max(reports["false"].memory("peak_total")) > max(reports["true"].memory("peak_total"))


def test_hpz_keeps_its_secondary_partition_until_the_step_fsdp2_until_the_backward():
    """With accumulation, hpZ's second forward gathers inside the node (DeepSpeed drops
    the secondary tensor only in `_post_step`); FSDP2's K gathers over all ranks again."""
    hpz = train(**BF16, zero_hpz_partition_size=4, grad_accum_steps=2)
    fsdp = train(**BF16, reshard_after_forward=4, grad_accum_steps=2)
    assert sum(sent(hpz, "dp")) < sum(sent(fsdp, "dp"))
    assert sum(sent(hpz, "dp_secondary")) > sum(sent(fsdp, "dp_secondary"))


# ------------------------------------------------------------------ qwZ, qgZ: the numerics
def test_block_quantization_stays_within_half_a_step():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 0.02, 1000), [0.0] * 300, rng.normal(0, 3, 77)])
    for bits, block in ((8, WEIGHT_BLOCK), (4, GRADIENT_BLOCK), (4, 64)):
        q, scales = quantize(x, bits, block)
        assert q.nbytes + scales.nbytes == quantized_nbytes(x.size, bits, block)
        back = dequantize(q, scales, bits, block, x.size, np.float64)
        steps = np.repeat(scales.astype(np.float64), block)[:x.size]
        # half a step, except the block's largest, which the clamp cuts by a full one
        # (up to the fp32 rounding of the stored step)
        assert np.all(np.abs(back - x) <= steps * (1 + 1e-6))
        assert np.sum(np.abs(back - x) > steps / 2 * (1 + 1e-6)) <= len(scales)
        assert np.all(back[1000:1300] == 0)
    values = np.arange(-8, 8, dtype=np.int8).repeat(3)[:-1]  # odd length
    assert np.array_equal(unpack_int4(pack_int4(values), values.size), values)


def test_qwz_all_gathers_int8_blocks_and_their_scales():
    def worker():
        shard = np.random.default_rng(dist.get_rank()).normal(0, 0.02, 3000)
        exact = dist.all_gather(shard)
        return exact, QuantizedAllGather()(shard), QuantizedAllGather()(
            shard, async_op=True).wait(), dist.get_device().comm.sent_by_op["all_gather"]

    results, devices = dist.launch(worker, 4, return_devices=True)
    for exact, quantized, waited, _ in results:
        assert np.array_equal(quantized, waited)
        assert np.abs(quantized - exact).max() <= 0.02 * 6 / 127
    exact_bytes = 3 * 3000 * 8
    assert results[0][3] == exact_bytes + 2 * 3 * quantized_nbytes(3000, 8, WEIGHT_BLOCK)


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_qgz_hierarchical_all_to_all_reduces_within_the_quantisation_error(nodes):
    def worker():
        mesh = dist.DeviceMesh(dp=8, dp_node_groups=True)
        group = mesh.dp_group()
        flat = np.random.default_rng(dist.get_rank()).normal(0, 1, 8 * 600)
        reduce = AllToAllQuantReduce(mesh.dp_subgroup("dp_intra_node"),
                                     mesh.dp_subgroup("dp_inter_node"))
        return (dist.reduce_scatter(flat, op="avg", group=group),
                reduce(flat, op="avg", group=group), dist.get_device().comm.summary())

    results, _ = dist.launch(worker, 8, gpus_per_node=8 // nodes, return_devices=True)
    L, Q = 8 // nodes, nodes
    for exact, quantized, comm in results:
        if Q == 1:  # one node: DeepSpeed reduce-scatters, unquantized
            assert np.array_equal(exact, quantized)
            continue
        # each of the 8 contributions off by m/16 (m <= ~5 sigma), each node sum by its m/16
        assert np.abs(quantized - exact).max() <= (8 * 5 / 16 + Q * 5 * L / 16) / 8
        assert np.abs(quantized - exact).max() > 0  # it does round
        piece = quantized_nbytes(600, 4, GRADIENT_BLOCK)
        assert comm["by_group"]["dp_intra_node"] == (L - 1) * Q * piece
        assert comm["by_group"]["dp_inter_node"] == (Q - 1) * piece


# ------------------------------------------------------------------ qwZ, qgZ: in training
def test_zeropp_bytes_meet_what_quantisation_promises():
    zero3 = train(**BF16)
    qwz = train(**BF16, zero_quantized_weights=True)
    qgz = train(**BF16, zero_quantized_gradients=True)
    # qwZ: every all-gather of S bf16 elements carries S int8 values and S/2048 scales
    for plain, quantized in zip(zero3.transfers, qwz.transfers, strict=True):
        shards = [t["sent_bytes"] // (7 * 2) for t in plain if t["op"] == "all_gather"]
        expected = sum(7 * quantized_nbytes(shard, 8, WEIGHT_BLOCK) for shard in shards)
        assert sum(t["sent_bytes"] for t in quantized if t["op"] == "all_gather") == expected
    # qgZ: no reduce-scatter left; the all-to-alls of int4 blocks instead
    assert all(t["op"] != "reduce_scatter" for rank in qgz.transfers for t in rank)
    assert sum(sent(qgz, "dp_inter_node")) + sum(sent(qgz, "dp_intra_node")) < \
        sum(t["sent_bytes"] for rank in zero3.transfers for t in rank
            if t["op"] == "reduce_scatter") / 3


def test_zeropp_cuts_the_cross_node_bytes_of_a_zero3_step_toward_a_quarter():
    """The ZeRO++ paper's 3M -> 0.75M (section 4): the forward all-gather at int8 (0.5M),
    the backward all-gather inside the node (0), the gradients at int4 through the
    hierarchical all-to-all (0.25M). On minipar's rings, a node sends (N-1)/N of each
    collective across its boundary, and qgZ's inter-node all-to-all (Q-1)/Q of M/4."""
    untied = dict(BF16, tie_embeddings=False)  # (a tied head gathers wte once more)
    zero3 = train(**untied)
    zeropp = train(**untied, zero_hpz_partition_size=4, zero_quantized_weights=True,
                   zero_quantized_gradients=True)
    node0 = [sum(inter_node(r)[:4]) for r in (zero3, zeropp)]
    M = zero3.ranks[0]["sharding"]["padded_numel"] * 2  # bf16 bytes of the model
    assert node0[0] == pytest.approx(3 * 7 / 8 * M, rel=0.01)
    assert node0[1] == pytest.approx((0.5 * 7 / 8 + 0.25 / 2) * M, rel=0.03)


def test_a_quantised_check_says_so_and_judges_against_its_tolerance():
    report = run(precision="fp64", check=True, zero_quantized_weights=True,
                 zero_quantized_gradients=True)
    check = report.equivalence
    assert check["passed"] and check["tolerance"] == QUANTIZED_TOLERANCE
    assert check["relative_to"] == "model"
    assert {"weights", "gradients", "grad_norm_ratio"} <= set(check["quantized"])
    assert 1e-6 < check["max_rel_param_diff_per_step"] < QUANTIZED_TOLERANCE  # it rounds
    assert "within the quantisation tolerance, not exact" in equivalence_line(check)
    # a bug that sums where it should average (a constant factor on every norm) fails
    doubled = [{**s, "grad_norm": 2 * s["grad_norm"]} for s in report.steps]
    failed = compare_runs(doubled, report.reference.steps, report.state_dict,
                          report.reference.state_dict, [], QUANTIZED_TOLERANCE, "model",
                          check["quantized"])
    assert not failed["passed"] and failed["first_mismatch"]["tensor"] == "grad_norm"


# ------------------------------------------------------------------ the report, the settings
def test_every_report_splits_each_ranks_sent_bytes_by_link():
    zero3 = train(**{**SMALL, "dp": 4, "gpus_per_node": 2, "steps": 1})
    for rank in zero3.ranks:
        link = rank["comm"]["by_link"]
        assert link["intra_node"] + link["inter_node"] == rank["comm"]["sent_bytes"]
    # the ring 0 -> 1 -> 2 -> 3 -> 0 leaves node 0 at rank 1 and node 1 at rank 3
    assert [r["comm"]["by_link"]["inter_node"] > 0 for r in zero3.ranks] == \
        [False, True, False, True]
    assert set(zero3.layout["groups"]) == {"dp", "pp", "tp"}
    hsdp = train(**BF16, hsdp_shard_size=4)
    assert hsdp.layout["groups"]["dp_shard"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hsdp.layout["groups"]["dp_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("settings, message", [
    (dict(hsdp_shard_size=4), "needs --zero 3"),
    (dict(zero=3, hsdp_shard_size=3), "must divide the 8 data-parallel ranks"),
    (dict(zero=3, zero_hpz_partition_size=8), "smaller than it: one of [2, 4]"),
    (dict(zero=3, reshard_after_forward=1), "1 means false"),
    (dict(zero=3, reshard_after_forward=8), "write --reshard-after-forward true"),
    (dict(zero=3, zero_hpz_partition_size=4, reshard_after_forward=False), "give one of"),
    (dict(zero=3, reshard_after_forward="2"), "true, false or a positive number"),
], ids=str)
def test_the_settings_rules_name_the_fix(settings, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        TrainConfig(dp=8, **settings)


@pytest.mark.parametrize("settings, message", [
    (dict(dp=6, gpus_per_node=4, zero_quantized_gradients=True), "same number of"),
    (dict(hsdp_shard_size=4, zero_quantized_weights=True), r"MiCS and ZeRO\+\+ apart"),
    (dict(zero_hpz_partition_size=4, offload_optimizer="cpu"), "offloading is not built"),
    # TP replicas rounded differently in blocks shared with TP-sharded weights
    (dict(dp=4, tp=2, zero_quantized_gradients=True, gpus_per_node=4), "drift apart"),
    (dict(dp=4, tp=2, zero_quantized_gradients=True, sequence_parallel=True,
          gpus_per_node=4), "drift apart.*use --tp 1$"),
    (dict(dp=4, tp=2, zero_quantized_weights=True), "drift apart.*--sequence-parallel"),
], ids=str)
def test_the_mixes_not_built_are_refused_before_training(settings, message):
    with pytest.raises(ConfigError, match=message):
        train(**{**SMALL, **settings})


def test_quantized_weights_with_tp_and_sequence_parallelism_keep_the_replicas_equal():
    # SP all-reduces the replicated parameters' gradients over TP, so the TP ranks'
    # different rounding of them cannot make their copies drift (the replica check of
    # every checkpoint and report would stop the run if it did)
    report = train(**{**BF16, "dp": 4, "tp": 2, "steps": 2}, zero_quantized_weights=True,
                   sequence_parallel=True)
    assert report.ranks and not any("drift" in w for w in report.warnings)


def test_groups_meant_for_a_node_that_span_two_are_warned_about():
    report = train(**{**BF16, "gpus_per_node": 2}, zero_hpz_partition_size=4,
                   zero_quantized_gradients=True)
    assert any("secondary partitions span nodes" in w for w in report.warnings)
    one_node = train(**{**BF16, "gpus_per_node": 8}, zero_quantized_gradients=True)
    assert any("reduce-scatters as ZeRO-3 does" in w for w in one_node.warnings)
