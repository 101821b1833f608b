"""--memory-accounting paper|megatron|deepspeed: each system's own terms, named
(minipar/plan/accounting.py; the references themselves: test_reference_memory.py)."""

from __future__ import annotations

import pytest

from minipar.errors import ConfigError
from minipar.plan import presets
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig, stage_plans
from minipar.plan.memory import stage_memory, stage_parameters

LLAMA = presets.model("llama2-7b")
H100 = presets.cluster("h100")


def memory(accounting, **settings):
    config = ParallelConfig(**{**dict(dp=8, micro_batch_size=1, flash_attention=True),
                               **settings}, memory_accounting=accounting)
    (plan,) = stage_plans(LLAMA, config)
    return stage_memory(LLAMA, config, plan), config, plan


def named(memory_, words):
    return [t for t in memory_["detail"]["accounting"] if words in t.name]


def test_paper_is_the_emulators_count_with_no_terms():
    paper, _, _ = memory("paper", zero=1)
    assert paper["detail"]["accounting"] == []


def test_megatron_keeps_the_logits_softmax_in_fp32_and_reduces_in_place():
    paper, _, _ = memory("paper", zero=1)
    megatron, config, _ = memory("megatron", zero=1)
    (logits,) = named(megatron, "fp32 softmax")
    assert logits.nbytes == LLAMA.seq_len * 32000 * (4 - 2)  # b s V, bf16 -> fp32
    (overhead,) = named(megatron, "5%")
    assert overhead.nbytes == round(0.05 * (paper["activations"] + logits.nbytes))
    assert megatron["activations"] == paper["activations"] + logits.nbytes + overhead.nbytes
    assert megatron["buffers"] < paper["buffers"] and named(megatron, "in place")
    # the model states are the planner's own with fp32 main grads: 6 + 12/N bytes
    assert (megatron["params"], megatron["grads"], megatron["optimizer"]) == (
        paper["params"], paper["grads"], paper["optimizer"])


def test_megatron_has_no_5_percent_on_its_sequence_parallel_selective_path():
    megatron, _, _ = memory("megatron", dp=4, tp=2, zero=1, sequence_parallel=True,
                            recompute_granularity="selective")
    assert not named(megatron, "5%")


@pytest.mark.parametrize("zero", [2, 3])
def test_megatron_refuses_zero_2_and_3(zero):
    with pytest.raises(ConfigError) as refused:
        ParallelConfig(dp=8, zero=zero, memory_accounting="megatron")
    assert refused.value.setting == "memory_accounting" and "deepspeed" in str(refused.value)


def test_deepspeed_zero2_is_its_estimators_2_plus_18_over_n():
    ds, config, plan = memory("deepspeed", zero=2)
    psi = stage_parameters(LLAMA, config, plan).numel
    shard = -(-psi // 8)
    assert ds["params"] + ds["grads"] + ds["optimizer"] == pytest.approx(
        2 * psi + 18 * shard, abs=2 * 8)
    assert named(ds, "fp32 copy of my partition")
    assert ds["buffers"] == 2 * min(psi, 500_000_000) * 2  # two reduce buckets of bf16


def test_deepspeed_zero1_with_fp32_accumulation_is_its_bf16_optimizer():
    ds, config, plan = memory("deepspeed", zero=1, grad_accum_dtype="fp32")
    psi = stage_parameters(LLAMA, config, plan).numel
    assert ds["grads"] == 4 * psi and not named(ds, "fp32 copy of my partition")


def test_deepspeed_zero3_gathers_the_largest_module():
    ds, config, plan = memory("deepspeed", zero=3)
    (gathered,) = named(ds, "largest module")
    assert ds["detail"]["forward_buffers"] >= 4 * 32000 * 4096  # the embedding or lm_head


def test_the_plan_names_each_term_and_json_carries_them():
    config = ParallelConfig(dp=8, zero=1, micro_batch_size=1, flash_attention=True,
                            memory_accounting="megatron")
    est = estimate(LLAMA, config, H100)
    text = est.table()
    assert "(megatron's accounting)" in text and "fp32 softmax of the logits" in text
    terms = est.to_dict()["memory_accounting"]
    assert terms["name"] == "megatron" and len(terms["terms"]) == 3


def test_the_cli_takes_the_accounting_and_refuses_a_stage_megatron_does_not_run(capsys):
    from minipar.plan.cli import main

    assert main(["plan", "--model", "llama2-7b", "--dp", "8", "--zero", "2",
                 "--memory-accounting", "deepspeed"]) == 0
    assert "deepspeed's accounting" in capsys.readouterr().out
    assert main(["plan", "--model", "llama2-7b", "--dp", "8", "--zero", "2",
                 "--memory-accounting", "megatron"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--memory-accounting" in err[0]
