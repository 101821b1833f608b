"""Context parallelism's formulas (minipar/plan/context.py) against the emulator: the
ring's bytes from the byte ledger, its time from the simulated clock, the imbalance
from the compute each rank was charged."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.autograd.tensor import Tensor
from minipar.parallel.context.layout import sequence_shard
from minipar.parallel.context.ring_attention import ring_attention
from minipar.plan.context import (
    attention_imbalance,
    chunk_tokens,
    pair_flops,
    pairs_per_step,
    ring_attention_bytes,
    ring_times,
    serial_ring_time,
)

B, T, H, HD = 2, 32, 2, 8
# a link slow enough that one hop of K/V takes about as long as a block's compute
PROFILE = dist.DeviceProfile(flops=2e9, intra_node_bandwidth=4e9, intra_node_latency=1e-6)


def run_ring(n, load_balance, profile=PROFILE):
    """Ring attention alone, forward then backward; per rank: (forward end, backward
    end, compute seconds) on the simulated clock."""
    rng = np.random.default_rng(0)
    qkv = rng.normal(size=(B, T, 3 * H * HD))
    dout = rng.normal(size=(B, T, H * HD))

    def rank_program():
        group = dist.new_group(range(n), "cp")
        r = dist.get_rank()
        clock = dist.get_device().clock
        x = Tensor(sequence_shard(qkv, r, n, load_balance), requires_grad=True)
        with dist.phase("forward"):
            out = ring_attention(x, HD, group, load_balance)
        forward_end = clock.now
        out.backward(sequence_shard(dout, r, n, load_balance))
        return forward_end, clock.now, clock.compute_s
    return dist.launch(rank_program, n, device=profile, return_devices=True)


def predicted(n, load_balance, profile=PROFILE):
    c = chunk_tokens(T, n, load_balance)
    forward_pair, backward_pair = (f / profile.flops for f in pair_flops(B * H, c, HD))
    pairs = pairs_per_step(n, load_balance)
    hop = profile.intra_node_latency + 2 * B * (T // n) * H * HD * 8 / profile.intra_node_bandwidth
    forward = [[p * forward_pair for p in steps] for steps in pairs]
    backward = [[p * backward_pair for p in steps] for steps in pairs]
    return forward, backward, hop


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("load_balance", [True, False])
def test_ring_attention_time_is_the_overlapped_ring_walk(n, load_balance):
    results, _ = run_ring(n, load_balance)
    forward, backward, hop = predicted(n, load_balance)
    expected_forward = ring_times(forward, hop)
    expected_backward = ring_times(backward, hop, hop, start=expected_forward)
    for r, (forward_end, backward_end, _) in enumerate(results):
        assert forward_end == pytest.approx(expected_forward[r], rel=1e-12)
        assert backward_end == pytest.approx(expected_backward[r], rel=1e-12)
    if load_balance:  # the exchange hides behind compute: faster than one after another
        forward_end = max(r[0] for r in results)
        assert forward_end < serial_ring_time(forward[0], hop)
        assert max(r[1] for r in results) - forward_end < serial_ring_time(backward[0], hop,
                                                                             hop)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_without_load_balancing_the_last_rank_does_2n_over_n_plus_1_of_the_mean(n):
    for load_balance in (True, False):
        results, _ = run_ring(n, load_balance)
        compute = [r[2] for r in results]
        measured = max(compute) / np.mean(compute)
        assert measured == pytest.approx(attention_imbalance(n, load_balance), rel=1e-12)
    assert attention_imbalance(n, False) == pytest.approx(2 * n / (n + 1))
    assert attention_imbalance(n, True) == 1.0


@pytest.mark.parametrize("n", [2, 4])
def test_ring_bytes_per_layer_forward_and_backward_match_the_ledger(n):
    _, devices = run_ring(n, True)
    forward, backward = ring_attention_bytes(B, T, H * HD, n, itemsize=8)
    for device in devices:
        sent = {"forward": 0, "backward": 0}
        for record in device.comm.records:
            sent[record.phase] += record.sent_bytes
        assert sent == {"forward": forward, "backward": backward}


# ---------------------------------------------------------------- in training
TRAIN = dict(steps=1, seq_len=32, n_layer=2, d_model=32, n_head=4, micro_batch_size=2,
             data="synthetic", vocab_size=32)


@pytest.mark.parametrize("settings", [
    dict(cp=2, precision="fp32", grad_accum_steps=2),
    dict(cp=4, precision="bf16-mixed"),
    dict(cp=2, tp=2, precision="fp32"),
    dict(cp=2, pp=2, precision="fp32", grad_accum_steps=2, n_layer=4),
], ids=lambda s: " ".join(f"{k}={v}" for k, v in s.items()))
def test_cp_bytes_per_layer_and_micro_batch_are_the_ring_formula(settings):
    from minipar.train.loop import train

    config = {**TRAIN, **settings}
    report = train(**config)
    itemsize, gradient_itemsize = {"fp32": (4, 4), "bf16-mixed": (2, 4)}[config["precision"]]
    forward, backward = ring_attention_bytes(
        config["micro_batch_size"], config["seq_len"], config["d_model"], config["cp"],
        itemsize, tp=config.get("tp", 1), gradient_itemsize=gradient_itemsize)
    layers = config["n_layer"] // config.get("pp", 1)  # each stage's share
    micro_batches = config.get("grad_accum_steps", 1)
    for rank in report.ranks:
        phases = rank["comm"]["by_group_phase"]["cp"]
        assert phases == {"forward": layers * micro_batches * forward,
                          "backward": layers * micro_batches * backward}


def test_activations_per_rank_fall_as_one_over_cp():
    from minipar.train.loop import train

    measured = {cp: [r["memory"]["activations"] for r in train(**TRAIN, cp=cp,
                                                                precision="fp32").ranks]
                for cp in (2, 4, 8)}
    for cp, per_rank in measured.items():
        assert len(set(per_rank)) == 1  # every CP rank holds the same
        assert per_rank[0] * cp == measured[2][0] * 2  # exactly 1/N of the sequence's


# ---------------------------------------------------------------- the planner's estimate
@pytest.mark.parametrize("settings", [
    dict(cp=2, micro_batch_size=2, grad_accum_steps=2),
    dict(cp=4, micro_batch_size=2, precision="bf16-mixed"),
    dict(cp=2, dp=2, zero=1, micro_batch_size=2, grad_accum_steps=2),
    dict(cp=2, tp=2, micro_batch_size=2),
    dict(cp=2, tp=2, sequence_parallel=True, micro_batch_size=2),
    dict(cp=2, pp=2, n_layer=4, micro_batch_size=2, grad_accum_steps=4),
    dict(cp=2, recompute_granularity="full", micro_batch_size=2, grad_accum_steps=2),
], ids=lambda s: " ".join(f"{k}={v}" for k, v in s.items()))
def test_planner_predicts_context_parallel_training(settings):
    """As tests/plan/test_estimate.py: memory exact (buffers and total within 10%),
    bytes per group exact, simulated time within 0.1%."""
    from minipar.plan.cluster import ClusterSpec
    from minipar.plan.estimate import estimate
    from minipar.plan.layout import ParallelConfig
    from minipar.plan.shapes import from_train_config
    from minipar.train import TrainConfig, train

    steps = 2
    config = TrainConfig(**{**TRAIN, "steps": steps, **settings})
    report = train(config)
    shape = from_train_config(config, report.config["vocab_size"])
    est = estimate(shape, ParallelConfig.from_train_config(config),
                   ClusterSpec.from_device_profile(gpus_per_node=8), all_stages=True)
    for stage in est.stages:
        for cp_rank in range(config.cp):
            coords = {"dp": 0, "pp": stage.rank, "cp": cp_rank, "tp": 0}
            (measured,) = [r for r in report.ranks if r["coords"] == coords]
            label = f"pipeline rank {stage.rank}, cp rank {cp_rank}"
            memory = measured["memory"]
            for category in ("params", "grads", "optimizer", "activations"):
                assert stage.memory[category] == memory[category], f"{label}: {category}"
            for category in ("buffers", "peak_total"):
                assert stage.memory[category] == pytest.approx(memory[category], rel=0.10), (
                    f"{label}: {category}")
            for group in ("dp", "tp", "pp", "cp"):
                assert steps * stage.traffic[group] == measured["comm"]["by_group"].get(
                    group, 0), f"{label}: {group} bytes"
            spent = sum(measured["time"][k] for k in ("compute_s", "comm_s", "idle_s"))
            assert spent == pytest.approx(steps * est.step_time, rel=1e-3), f"{label}: time"


# ---------------------------------------------------------------- the advisor
def test_advisor_considers_cp_for_long_sequences_only():
    from minipar.plan import presets
    from minipar.plan.advisor import advise, context_parallel_sizes

    llama = presets.model("llama2-7b")
    assert context_parallel_sizes(llama.with_seq_len(4096), 8) == [1]
    assert context_parallel_sizes(llama.with_seq_len(32768), 8) == [1, 2, 4, 8]
    advice = advise(llama.with_seq_len(32768), 8, presets.cluster("h100"),
                    global_batch_size=8)
    with_cp = [e for e in advice.ranked if e.config.cp > 1]
    without = [e for e in advice.ranked if e.config.cp == 1]
    assert with_cp and without  # both kinds fit; the estimate decides
    best = advice.best
    # on one node at 32k, cutting the sequence beats cutting the matrices
    assert best.config.cp > 1 and best.step_time < without[0].step_time
    assert best.memory["activations"] < without[0].memory["activations"]
    assert "Context parallelism" in advice.explain()


def test_plan_command_takes_cp_and_refuses_a_sequence_that_does_not_cut(capsys):
    from minipar.plan.cli import main

    assert main(["plan", "--model", "llama2-7b", "--seq-len", "32768", "--cluster", "h100",
                 "--cp", "8", "--zero", "1", "--micro-batch-size", "2",
                 "--global-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "cp=8" in out and "cp sent" in out
    assert main(["plan", "--model", "llama2-7b", "--seq-len", "32760", "--cp", "8"]) == 2
    assert "does not split into 16 chunks" in capsys.readouterr().out


def test_grouped_query_attention_sends_its_narrower_kv_around_the_ring():
    # K and V of n_kv_head heads are n_head / n_kv_head times narrower than Q; TE's
    # AttnFuncWithCPAndKVP2P sends only those (the Llama 3 paper, section 3.3.2,
    # all-gathers them for that reason): the cp group's bytes shrink by that factor
    from minipar.plan import presets
    from minipar.plan.estimate import estimate
    from minipar.plan.layout import ParallelConfig
    from minipar.plan.shapes import ModelShape

    def cp_bytes(kv_heads):
        shape = ModelShape(name="gqa", n_layer=4, d_model=1024, n_head=16, n_kv_head=kv_heads,
                           vocab_size=32000, seq_len=4096, mlp="swiglu", d_ff=2816)
        config = ParallelConfig(dp=1, tp=2, cp=4, micro_batch_size=1, global_batch_size=1,
                                sequence_parallel=True, flash_attention=True)
        return estimate(shape, config, presets.cluster("h100")).traffic["cp"]

    assert cp_bytes(4) == cp_bytes(16) * 4 // 16
