"""Pipeline parallelism, run: stages hold the right layers under their single-device names,
training equals single-device training in fp64, the simulated bubble and the measured
activation memory follow the papers, neighbours exchange b*s*h per micro-batch, and bad
settings are clear errors (never a hang)."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from benchmarks.uniform_stages import charge_blocks_only
from minipar import distributed as dist
from minipar.distributed.timeline import bubble_fraction, labelled_compute_seconds, time_breakdown
from minipar.errors import PipelineError, ScheduleError
from minipar.nn import GPT, AdamW, GPTConfig, Recompute, clip_grad_norm_
from minipar.nn.gpt import parameter_shapes
from minipar.nn.optim import scale_grads_
from minipar.parallel.pipeline.actions import (
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    Schedule,
    SendActivation,
    SendGrad,
)
from minipar.parallel.pipeline.executor import Step
from minipar.parallel.pipeline.model import Pipeline, check_layer_split
from minipar.parallel.pipeline.schedules.orders import from_compute_orders
from minipar.parallel.pipeline.schedules.registry import SCHEDULES, make_schedule
from minipar.parallel.pipeline.split_backward import SplitBackwardStep, runtime_for
from minipar.parallel.pipeline.stage import split_layers
from minipar.parallel.state import Piece
from minipar.train.checkpoint import assemble, in_model_order
from minipar.train.data import micro_batch, synthetic_stream

SEED, B, T, D, VOCAB = 0, 2, 8, 16, 32
LR, CLIP, STEPS = 1e-2, 0.5, 2
STREAM = synthetic_stream(VOCAB)
# Free communication: no latency, infinite bandwidth.
FREE = dist.DeviceProfile(intra_node_latency=0.0, inter_node_latency=0.0,
                          intra_node_bandwidth=math.inf, inter_node_bandwidth=math.inf)


def gpt_config(n_layer: int, tied: bool = True) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, seq_len=T, n_layer=n_layer, n_head=2, d_model=D,
                     tie_embeddings=tied)


def consolidate_state_dicts(pieces, config: GPTConfig) -> dict[str, np.ndarray]:
    """The single-device state dict from the pp ranks' `Pipeline.state_dict()`s, through
    the path a run's report takes (checkpoint.assemble, then the model's key order)."""
    held = [(f"pp rank {rank}", {}, Piece("param", name, array.shape, 0, array.size,
                                          array.reshape(-1)))
            for rank, piece in enumerate(pieces) for name, array in piece.items()]
    return in_model_order(assemble(held, {})["param"], parameter_shapes(config))


def random_micro_batches(m: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB, (B, T)), rng.integers(0, VOCAB, (B, T))) for _ in range(m)]


# --------------------------------------------------------------------------- stages
def test_layers_are_split_contiguously_balanced_or_as_asked():
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(4, 2, layer_split=(3, 1)) == [range(0, 3), range(3, 4)]
    assert split_layers(4, 3, layer_split=(0, 4, 0)) == [range(0, 0), range(0, 4), range(4, 4)]


@pytest.mark.parametrize("args, match", [
    ((2, 4, None), r"--pp: 4 pipeline stages.*2 layers \(--n-layer\).*at most 2 stages"),
    ((4, 2, (3, 2)), r"adds up to 5 layers but the model has 4.*add up to 4"),
    ((4, 2, (4,)), r"1 entries for 2 stages.*one layer count per stage"),
    ((4, 3, (2, 0, 2)), r"stage 1 gets 0 layers; a middle stage needs at least 1"),
])
def test_bad_layer_splits_name_the_fix(args, match):
    n_layer, num_stages, layer_split = args
    with pytest.raises(PipelineError, match=match):
        check_layer_split(layer_split, n_layer, num_stages)  # what a Pipeline checks first


@pytest.mark.parametrize("tied", [True, False])
def test_stages_hold_their_layers_under_single_device_names_and_weights(tied):
    config = gpt_config(5, tied)
    full = GPT(config, seed=SEED).state_dict()

    def rank():
        pipe = Pipeline(config, micro_batches=1, seed=SEED)
        return {name: p.data.copy() for name, p in pipe.named_parameters()}, pipe.state_dict()

    (first, first_sd), (last, last_sd) = dist.launch(rank, 2)
    layer = {name: int(name.split(".")[1]) for name in full if name.startswith("h.")}
    assert set(first) == {"wte.weight", "wpe.weight"} | {n for n, i in layer.items() if i < 3}
    head = {"wte.weight"} if tied else {"lm_head.weight"}
    assert set(last) == {"ln_f.weight", "ln_f.bias"} | head | {n for n, i in layer.items()
                                                               if i >= 3}
    for name, value in {**first, **last}.items():
        np.testing.assert_array_equal(value, full[name])  # same initial weights
    merged = consolidate_state_dicts([first_sd, last_sd], config)
    assert list(merged) == list(full)  # the tied copy is left out: no duplicates


def test_interleaved_chunk_c_of_rank_r_is_virtual_stage_c_times_p_plus_r():
    config = gpt_config(8)

    def rank():
        pipe = Pipeline(config, schedule="interleaved", micro_batches=4, virtual_stages=2)
        return [sorted({int(n.split(".")[1]) for n, _ in chunk.named_parameters()
                        if n.startswith("h.")}) for chunk in pipe.chunks]

    assert dist.launch(rank, 4) == [[[0], [4]], [[1], [5]], [[2], [6]], [[3], [7]]]


# --------------------------------------------------------------------------- equivalence
@functools.cache
def single_device(n_layer: int, m: int, dp: int, tied: bool = True):
    """The reference: one GPT, m * dp micro-batches accumulated per step, clipping, AdamW."""
    model = GPT(gpt_config(n_layer, tied), seed=SEED, precision="fp64")
    optimizer = AdamW(model.named_parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        inputs, targets = STREAM.global_batch(step, B * m * dp, T, SEED)
        step_losses = []
        for k in range(m * dp):
            x, y = micro_batch(inputs, targets, dp_rank=0, micro_step=k, micro_batch_size=B,
                               grad_accum_steps=m * dp)
            loss = model(x, y)
            loss.backward(np.asarray(1.0 / (m * dp)))
            step_losses.append(float(loss.data))
        clip_grad_norm_(list(model.parameters()), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(np.mean(step_losses)))
    return losses, model.state_dict()


def pipeline_rank(config, schedule, pp, m, dp, v, **options):
    """One rank's training loop: pipeline schedule, DP average, global-norm clipping, AdamW."""
    mesh = dist.DeviceMesh(dp=dp, pp=pp)
    pipe = Pipeline(config, pp_group=mesh.pp_group(), schedule=schedule, micro_batches=m,
                    virtual_stages=v, seed=SEED, precision="fp64", **options)
    device = dist.get_device()
    for p in pipe.parameters():
        device.memory.hold(p.data, "params")
    optimizer = AdamW(pipe.named_parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        inputs, targets = STREAM.global_batch(step, B * m * dp, T, SEED)
        batches = [micro_batch(inputs, targets, dp_rank=mesh.dp_rank, micro_step=k,
                               micro_batch_size=B, grad_accum_steps=m) for k in range(m)]
        loss = pipe.forward_backward(batches)
        if dp > 1:  # plain data parallelism: average gradients and losses over replicas
            for p in pipe.parameters():
                p.grad[...] = dist.all_reduce(p.grad, "avg", group=mesh.dp_group())
            loss = float(dist.all_reduce(np.asarray(loss), "avg", group=mesh.dp_group()))
        norm_squared = dist.all_reduce(np.asarray(pipe.grad_norm_squared()),
                                       group=mesh.pp_group())
        scale_grads_([p.grad for p in pipe.parameters()],
                     CLIP / (math.sqrt(float(norm_squared)) + 1e-6))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    copies = [c.wte.weight.data.copy() for c in pipe.chunks if hasattr(c, "wte")]
    return {"losses": losses, "state": pipe.state_dict(), "coords": mesh.coords(),
            "wte_copies": copies}


def check_equivalent(config, schedule, pp, m, dp, v=1, **options):
    results = dist.launch(pipeline_rank, dp * pp, config, schedule, pp, m, dp, v, **options)
    ref_losses, ref_state = single_device(config.n_layer, m, dp, config.tie_embeddings)
    for r in results:  # every rank reports the step loss
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-12)
    replica = [r["state"] for r in results if r["coords"]["dp"] == 0]
    state = consolidate_state_dicts(replica, config)
    assert list(state) == list(ref_state)
    for name, value in ref_state.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)
    if config.tie_embeddings and pp > 1:  # first and last stage kept equal copies
        first, last = results[0]["wte_copies"][0], results[pp - 1]["wte_copies"][-1]
        np.testing.assert_array_equal(first, last)


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_pipeline_training_equals_single_device_in_fp64(schedule, pp, m, dp):
    v = 2 if schedule == "interleaved" else 1
    config = gpt_config(pp * v if schedule == "interleaved" else 4)
    if schedule == "interleaved" and m % pp:
        with pytest.raises(ScheduleError, match=f"multiple of {pp}"):
            dist.launch(pipeline_rank, dp * pp, config, schedule, pp, m, dp, v)
        return
    check_equivalent(config, schedule, pp, m, dp, v)


ZERO_BUBBLE = {"zb-h1": 1, "zb-h2": 1, "zb-v": 2, "dualpipe-v": 2}  # name -> chunks


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", list(ZERO_BUBBLE))
def test_zero_bubble_training_equals_single_device_in_fp64(schedule, pp, dp, tied):
    """I and W split the backward, the V puts the first and last stage (both copies of a
    tied wte, and the loss) on rank 0: still the single-device run, to 1e-10."""
    v = ZERO_BUBBLE[schedule]
    m = 2 * pp  # every schedule's fewest micro-batches (DualPipe-V: 2p)
    config = gpt_config(pp * v, tied)
    results = dist.launch(pipeline_rank, dp * pp, config, schedule, pp, m, dp, v)
    ref_losses, ref_state = single_device(config.n_layer, m, dp, tied)
    for r in results:
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-12)
    replica = [r["state"] for r in results if r["coords"]["dp"] == 0]
    state = consolidate_state_dicts(replica, config)
    for name, value in ref_state.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)
    if tied:  # the two copies of wte, on ranks 0 and p-1 or both on rank 0, agree
        copies = [c for r in results if r["coords"]["dp"] == 0 for c in r["wte_copies"]]
        assert len(copies) == 2
        np.testing.assert_array_equal(copies[0], copies[1])


def test_untied_head_uneven_split_one_stage_and_checkpointing_are_equivalent_too():
    check_equivalent(gpt_config(4, tied=False), "1f1b", 2, 4, 1)
    check_equivalent(gpt_config(4), "1f1b", 1, 4, 1)  # pp = 1: gradient accumulation
    check_equivalent(gpt_config(4), "gpipe", 2, 4, 1, layer_split=(3, 1))
    check_equivalent(gpt_config(4), "1f1b", 2, 4, 1, recompute=Recompute("full", "uniform", 1))


# --------------------------------------------------------------------------- runtime
# executor.Step runs F, B and messages between ranks; split_backward.SplitBackwardStep adds
# I and W and the hand-off between two neighbouring stages of one rank, each on its own.
@pytest.mark.parametrize("name, pp, m, v, runtime", [
    ("gpipe", 4, 4, 1, Step), ("1f1b", 4, 8, 1, Step), ("interleaved", 4, 8, 2, Step),
    ("zb-h1", 4, 8, 1, SplitBackwardStep), ("zb-h2", 4, 8, 1, SplitBackwardStep),
    ("zb-v", 4, 8, 2, SplitBackwardStep), ("dualpipe-v", 4, 8, 2, SplitBackwardStep),
])
def test_only_a_split_backward_or_a_v_gets_the_extended_runtime(name, pp, m, v, runtime):
    assert runtime_for(make_schedule(name, pp, m, v)) is runtime


def v_without_split(m: int):
    """GPipe's order on a V of two ranks: F and B only, but stages 1 and 2 (the V's tip)
    and stages 0 and 3 (first and last) share a rank."""
    order = ([("F", i, 0) for i in range(m)] + [("F", i, 1) for i in range(m)]
             + [("B", i, 1) for i in range(m)] + [("B", i, 0) for i in range(m)])
    return from_compute_orders("v-gpipe", 2, m, 2, [order, order], placement="v")


def test_a_v_without_a_split_backward_hands_its_tensors_over_and_equals_one_device():
    schedule = v_without_split(4)
    assert runtime_for(schedule) is SplitBackwardStep  # for the hand-off alone
    check_equivalent(gpt_config(4, tied=False), schedule, 2, 4, 1, v=2)


def test_one_rank_with_two_chunks_needs_the_hand_off_too():
    order = [("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)]
    assert runtime_for(from_compute_orders("looped", 1, 1, 2, [order])) is SplitBackwardStep
    assert runtime_for(from_compute_orders("one", 1, 1, 1, [order[::3]])) is Step


# --------------------------------------------------------------------------- bubble
def one_step(config, schedule, m, v, uniform, layer_split=None):
    pipe = Pipeline(config, schedule=schedule, micro_batches=m, virtual_stages=v,
                    layer_split=layer_split)
    if uniform:
        for chunk in pipe.chunks:
            charge_blocks_only(chunk)
    pipe.forward_backward(random_micro_batches(m))


@pytest.mark.parametrize("schedule, p, m, v", [
    ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1), ("gpipe", 2, 1, 1),
    ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3),
])
def test_uniform_stages_have_the_papers_bubble(schedule, p, m, v):
    """Every chunk holds one block, the extras are free and so is communication: the
    measured idle / total is (p-1)/(m+p-1), or (p-1)/(v m+p-1) interleaved (Narayanan et
    al. 2021, section 2.2)."""
    config = gpt_config(p * v)
    _, devices = dist.launch(one_step, p, config, schedule, m, v, True, device=FREE,
                             return_devices=True)
    measured = bubble_fraction([d.clock.events for d in devices])
    assert measured == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9)
    # and the bubble is what the ranks' clocks call idle (none ran past the flush)
    idle = sum(d.clock.idle_s for d in devices)
    total = sum(d.clock.now for d in devices)
    assert idle / total == pytest.approx(measured, rel=1e-9)


def stage_costs(devices, v):
    """The mean T_F, T_B (the I action) and T_W of micro-batch 0 over the chunks."""
    seconds = [labelled_compute_seconds(d.clock.events) for d in devices]
    suffixes = [""] + [f".{c}" for c in range(1, v)]
    return [np.mean([s[f"{kind}0{x}"] for s in seconds for x in suffixes])
            for kind in ("F", "I", "W")]


@pytest.mark.parametrize("schedule, p, m", [("zb-h1", 4, 8), ("zb-h1", 3, 3),
                                             ("zb-h2", 4, 8), ("zb-h2", 2, 5)])
def test_uniform_stages_have_the_zero_bubble_papers_bubble(schedule, p, m):
    """Uniform stages, free communication: the idle time per rank is Table 2 of Qi et al.
    2024 evaluated with the measured T_F, T_B, T_W of one block (ZB-H1 (p-1)(T_F+T_B-T_W);
    ZB-H2 (p-1)(T_F+T_B-2T_W), here (p-1)T_F, the skew the step's end keeps)."""
    _, devices = dist.launch(one_step, p, gpt_config(p), schedule, m, 1, True, device=FREE,
                             return_devices=True)
    f, b, w = stage_costs(devices, 1)
    assert w < b and w <= f  # the papers' regime: the weight GEMMs alone are the least
    idle = SCHEDULES[schedule].bubble_time(p, m, 1, f, b, w)
    assert bubble_fraction([d.clock.events for d in devices]) == pytest.approx(
        idle / (idle + m * (f + b + w)), rel=1e-9)


def test_zb_h1_keeps_1f1b_s_activation_peak_zb_h2_holds_2p_minus_1():
    p, m = 4, 8
    peaks = {}
    for schedule in ("1f1b", "zb-h1", "zb-h2"):
        _, devices = dist.launch(one_step, p, gpt_config(p), schedule, m, 1, False,
                                 return_devices=True)
        peaks[schedule] = [d.memory.peak["activations"] for d in devices]
    # 1F1B's peak is rank 0's p micro-batches; ZB-H1's rank 0 holds the same, the middle
    # ranks no more (their W's wait r micro-batches, but W needs less than F saved) ...
    # (plus the LayerNorm weight gradients B computes anyway and W adds in: 2 x d floats)
    assert peaks["zb-h1"][0] - peaks["1f1b"][0] == 2 * D * 8
    assert all(peak <= peaks["1f1b"][0] for peak in peaks["zb-h1"][1:-1])
    # ... but the last rank's delayed W's keep the head's input and logits gradient
    # (b, s, V): the papers' "1F1B memory" counts uniform stages, not the head
    assert peaks["zb-h1"][-1] > peaks["1f1b"][-1]
    # rank 0 runs W right after I: 2p - 1 micro-batches of stage activations at once
    # (and a few of W's small partial gradients: within 0.2%)
    assert peaks["zb-h2"][0] / peaks["1f1b"][0] == pytest.approx((2 * p - 1) / p, rel=2e-3)


def test_the_v_sends_twice_the_point_to_point_bytes_of_1f1b():
    """2(p-1) rank boundaries instead of p-1 (the V's tip stays on rank p-1)."""
    p, m = 4, 8
    sent = {}
    for schedule, v in (("1f1b", 1), ("zb-v", 2), ("dualpipe-v", 2)):
        _, devices = dist.launch(one_step, p, gpt_config(p * v), schedule, m, v, False,
                                 return_devices=True)
        sent[schedule] = sum(r.sent_bytes for d in devices for r in d.comm.records
                             if r.op == "send")
    assert sent["zb-v"] == sent["dualpipe-v"] == 2 * sent["1f1b"]


def test_real_stages_deviate_the_embedding_head_and_loss_are_not_free():
    p, m = 4, 8
    _, devices = dist.launch(one_step, p, gpt_config(p), "1f1b", m, 1, False, device=FREE,
                             return_devices=True)
    assert bubble_fraction([d.clock.events for d in devices]) > (p - 1) / (m + p - 1) + 0.01


# --------------------------------------------------------------------------- memory, bytes
@pytest.mark.parametrize("p, m", [(4, 8), (4, 2)])
def test_gpipe_holds_m_micro_batches_of_activations_1f1b_at_most_p_minus_stage(p, m):
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        _, devices = dist.launch(one_step, p, gpt_config(p), schedule, m, 1, False,
                                 return_devices=True)
        peaks[schedule] = [d.memory.peak["activations"] for d in devices]
    for stage in range(p):
        assert peaks["gpipe"][stage] / peaks["1f1b"][stage] == pytest.approx(
            m / min(m, p - stage), rel=1e-12)


def test_neighbours_exchange_b_s_h_per_micro_batch_each_way():
    p, m = 3, 4
    _, devices = dist.launch(one_step, p, gpt_config(p), "1f1b", m, 1, False,
                             return_devices=True)
    message = B * T * D * 8  # one fp64 activation (or its gradient)
    for stage, device in enumerate(devices):
        sends = [r for r in device.comm.records if r.op == "send"]
        assert all(r.sent_bytes == message and r.group_kind == "pp" for r in sends)
        forward = [r for r in sends if r.phase == "forward"]
        backward = [r for r in sends if r.phase == "backward"]
        assert len(forward) == (m if stage < p - 1 else 0)  # activations to stage + 1
        assert len(backward) == (m if stage > 0 else 0)  # their gradients to stage - 1
        assert all(r.sent_to[0][0] == stage + 1 for r in forward)


def test_timeline_events_carry_micro_batch_labels():
    _, devices = dist.launch(one_step, 2, gpt_config(2), "1f1b", 2, 1, False,
                             return_devices=True)
    labels = [e.label for e in devices[0].clock.events if e.kind in ("forward", "backward")]
    assert [k for i, k in enumerate(labels) if i == 0 or labels[i - 1] != k] == [
        "F0", "F1", "B0", "B1"]


def test_bubble_fraction_counts_idle_and_time_after_a_rank_finished():
    timelines = [
        [{"kind": "forward", "start": 0.0, "end": 3.0}],
        [{"kind": "idle", "start": 0.0, "end": 1.0}, {"kind": "comm", "start": 1.0, "end": 1.5},
         {"kind": "backward", "start": 1.5, "end": 2.0}],  # then nothing until 3.0
    ]
    assert bubble_fraction(timelines) == pytest.approx(2.0 / 6.0)
    assert time_breakdown(timelines)[1] == pytest.approx(
        {"compute_s": 0.5, "comm_s": 0.5, "idle_s": 2.0})
    assert bubble_fraction(timelines, start=0.0, end=1.0) == pytest.approx(0.5)


# --------------------------------------------------------------------------- errors
def test_bad_settings_are_clear_errors_not_hangs():
    with pytest.raises(PipelineError, match=r"--pp: 4 pipeline stages.*--n-layer"):
        dist.launch(lambda: Pipeline(gpt_config(2), micro_batches=1), 4)
    with pytest.raises(ScheduleError, match=r"--grad-accum-steps.*multiple of 4"):
        dist.launch(lambda: Pipeline(gpt_config(8), schedule="interleaved", micro_batches=6,
                                     virtual_stages=2), 4)

    def wrong_count():
        Pipeline(gpt_config(2), micro_batches=4).forward_backward(random_micro_batches(3))

    with pytest.raises(PipelineError, match=r"got 3 micro-batches.*built for 4"):
        dist.launch(wrong_count, 2)


DEADLOCK = Schedule("custom", 2, 1, 1, (
    (Forward(0), RecvGrad(0, 0, 1), SendActivation(0, 0, 1), Backward(0)),
    (RecvActivation(0, 0, 0), Forward(0), Backward(0), SendGrad(0, 0, 0)),
))


@pytest.mark.parametrize("validate", [True, False])
def test_a_deadlocking_schedule_is_refused_or_caught(validate):
    def rank():
        pipe = Pipeline(gpt_config(2), schedule=DEADLOCK, micro_batches=1,
                        validate_schedule=validate)
        pipe.forward_backward(random_micro_batches(1))

    # Validated: refused before anything runs. Not validated: the dist layer sees every
    # rank blocked in a receive and names the cycle.
    error = ScheduleError if validate else dist.DeadlockError
    with pytest.raises(error, match=r"deadlock.*rank 0 waits.*recv"):
        dist.launch(rank, 2)
