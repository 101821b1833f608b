"""Lint of mixture-of-experts layouts (minipar.plan.lint_experts), on Mixtral 8x7B and
the H100 preset (8 GPUs a node)."""

from __future__ import annotations

from minipar.plan import presets
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig
from minipar.plan.lint import lint
from minipar.plan.shapes import ModelShape

MIXTRAL = presets.model("mixtral-8x7b")
H100 = presets.cluster("h100-80gb")


def layout(**settings) -> ParallelConfig:
    # bf16 gradient buffers (Megatron's --grad-reduce-in-bf16): with the planner's default
    # fp32 ones no ep fits Mixtral on 64 GPUs at ZeRO-1, and the lint's choice of ep is
    # what these tests are about
    return ParallelConfig(**{**dict(zero=1, micro_batch_size=1, global_batch_size=1024,
                                    flash_attention=True, grad_accum_dtype="bf16"),
                             **settings})


def codes(config) -> dict:
    return {f.code: f for f in lint(MIXTRAL, config, H100)}


def test_ep_across_nodes_is_warned_with_the_inside_a_node_time():
    # tp 2 spaces the ep group's members 2 apart: 8 of them span 16 GPUs, two nodes
    config = layout(dp=32, tp=2, sequence_parallel=True, ep=8)
    finding = codes(config)["EP_ACROSS_NODES"]
    assert finding.severity == "warning" and "--ep 4" in finding.fix
    across = estimate(MIXTRAL, config, H100)
    inside = estimate(MIXTRAL, config.replace(ep=4), H100)
    assert across.links["ep"] and not inside.links["ep"]
    assert across.comm_time_by_group()["ep"] > 5 * inside.comm_time_by_group()["ep"]


def test_the_ep_groups_spacing_follows_the_rank_order():
    # tp 2 x pp 2: minipar's order spaces the ep group's members tp x cp x pp = 4 apart
    # (ep 2 fits a node), Megatron-LM's tp x cp = 2 apart (ep 4 does)
    config = layout(dp=16, tp=2, pp=2, sequence_parallel=True, ep=8)
    assert "--ep 2 " in codes(config)["EP_ACROSS_NODES"].fix
    megatrons = codes(config.replace(rank_order="tp-cp-ep-dp-pp"))["EP_ACROSS_NODES"]
    assert "--ep 4 " in megatrons.fix and "tp x cp = 2" in megatrons.message
    assert not estimate(MIXTRAL, config.replace(rank_order="tp-cp-ep-dp-pp", ep=4),
                        H100).links["ep"]


def test_ep_inside_a_node_is_not_warned():
    assert "EP_ACROSS_NODES" not in codes(layout(dp=64, ep=8))


def test_experts_that_do_not_fit_get_the_smallest_ep_that_fits():
    config = layout(dp=64, ep=1)
    assert not estimate(MIXTRAL, config, H100).fits
    finding = codes(config)["EXPERTS_NEED_EP"]
    ep = int(finding.fix.split()[1])
    assert estimate(MIXTRAL, config.replace(ep=ep), H100).fits
    assert all(not estimate(MIXTRAL, config.replace(ep=smaller), H100).fits
               for smaller in (1, 2, 4, 8) if smaller < ep)


def test_ep_that_does_not_divide_the_experts_is_an_invalid_layout():
    (finding,) = [f for f in lint(MIXTRAL, layout(dp=6, ep=6, global_batch_size=1020), H100)
                  if f.code == "INVALID_LAYOUT"]
    assert "--moe-num-experts 8" in finding.message


def test_ep_across_nodes_that_buys_unneeded_memory_is_pointed_out():
    small = ModelShape(name="moe", n_layer=4, d_model=1024, n_head=16, vocab_size=32000,
                       seq_len=1024, moe_num_experts=8, moe_top_k=2)
    config = layout(dp=8, tp=2, sequence_parallel=True, ep=8, global_batch_size=32)
    found = {f.code: f for f in lint(small, config, H100)}
    assert "EP_ACROSS_NODES" in found and found["EP_WITHOUT_NEED"].fix == "consider --ep 1"
    assert estimate(small, config.replace(ep=1), H100).fits
