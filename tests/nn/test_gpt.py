"""The GPT-2 model: HF names and shapes, initialisation, loss at init, determinism,
precision, checkpointing and the memory it reports."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minipar.autograd import Tensor, bfloat16
from minipar.nn import (
    GPT,
    AdamW,
    Block,
    GPTConfig,
    Linear,
    Recompute,
    init_parameter,
    initialize_parameters,
)

CONFIG = GPTConfig(vocab_size=65, seq_len=32, n_layer=2, n_head=4, d_model=64)


def batch(config=CONFIG, batch_size=4, seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, config.vocab_size, size=(batch_size, config.seq_len))
    targets = rng.integers(0, config.vocab_size, size=(batch_size, config.seq_len))
    return idx, targets


def expected_shapes(v, t, d, n_layer, tied):
    """Written out by hand (HF GPT-2 names, weights stored (in, out))."""
    shapes = {"wte.weight": (v, d), "wpe.weight": (t, d)}
    for i in range(n_layer):
        shapes[f"h.{i}.ln_1.weight"] = (d,)
        shapes[f"h.{i}.ln_1.bias"] = (d,)
        shapes[f"h.{i}.attn.c_attn.weight"] = (d, 3 * d)
        shapes[f"h.{i}.attn.c_attn.bias"] = (3 * d,)
        shapes[f"h.{i}.attn.c_proj.weight"] = (d, d)
        shapes[f"h.{i}.attn.c_proj.bias"] = (d,)
        shapes[f"h.{i}.ln_2.weight"] = (d,)
        shapes[f"h.{i}.ln_2.bias"] = (d,)
        shapes[f"h.{i}.mlp.c_fc.weight"] = (d, 4 * d)
        shapes[f"h.{i}.mlp.c_fc.bias"] = (4 * d,)
        shapes[f"h.{i}.mlp.c_proj.weight"] = (4 * d, d)
        shapes[f"h.{i}.mlp.c_proj.bias"] = (d,)
    shapes["ln_f.weight"] = (d,)
    shapes["ln_f.bias"] = (d,)
    if not tied:
        shapes["lm_head.weight"] = (v, d)
    return shapes


@pytest.mark.parametrize("tied", [True, False])
def test_state_dict_has_exactly_the_hf_names_and_shapes(tied):
    config = GPTConfig(vocab_size=11, seq_len=8, n_layer=3, n_head=2, d_model=16,
                       tie_embeddings=tied)
    model = GPT(config)
    sd = model.state_dict()
    assert {k: v.shape for k, v in sd.items()} == expected_shapes(11, 8, 16, 3, tied)
    assert [n for n, _ in model.named_parameters()] == list(sd)
    assert model.num_parameters() == sum(math.prod(s) for s in
                                         expected_shapes(11, 8, 16, 3, tied).values())


def test_loss_at_init_is_about_log_vocab():
    idx, targets = batch()
    loss = GPT(CONFIG, seed=3)(idx, targets)
    assert loss.shape == () and abs(loss.item() - math.log(65)) < 0.1


def test_logits_without_targets():
    idx, _ = batch()
    logits = GPT(CONFIG)(idx[:, :10])
    assert logits.shape == (4, 10, 65)


def train(model, steps=3, lr=3e-3):
    optimizer = AdamW(model.named_parameters(), lr=lr)
    idx, targets = batch()
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_same_seed_gives_bit_identical_losses():
    config = GPTConfig(dropout=0.1)
    assert train(GPT(config, seed=5)) == train(GPT(config, seed=5))
    assert train(GPT(config, seed=5)) != train(GPT(config, seed=6))


def test_a_few_adamw_steps_lower_the_loss():
    losses = train(GPT(CONFIG, seed=0), steps=8)
    assert losses[-1] < losses[0] - 0.3


def test_initialisation_is_a_function_of_name_and_seed():
    model = GPT(CONFIG, seed=4)
    initial = GPT.initial_state_dict(CONFIG, seed=4)
    for name, array in model.state_dict().items():
        np.testing.assert_array_equal(array, initial[name])
    # a pipeline stage that builds block 1 alone gets the same weights
    block = Block(CONFIG)
    initialize_parameters(block, CONFIG, seed=4, prefix="h.1.")
    for name, p in block.named_parameters():
        np.testing.assert_array_equal(p.data, initial["h.1." + name])
    np.testing.assert_array_equal(init_parameter("h.1.mlp.c_fc.weight", (64, 256), CONFIG, 4),
                                  initial["h.1.mlp.c_fc.weight"])
    assert not np.array_equal(GPT.initial_state_dict(CONFIG, 5)["wte.weight"],
                              initial["wte.weight"])


def test_gpt2_initialisation_statistics():
    config = GPTConfig(vocab_size=512, seq_len=64, n_layer=8, n_head=4, d_model=128)
    sd = GPT.initial_state_dict(config, seed=0)
    assert sd["wte.weight"].std() == pytest.approx(0.02, rel=0.02)
    assert sd["h.0.attn.c_attn.weight"].std() == pytest.approx(0.02, rel=0.03)
    residual_std = 0.02 / math.sqrt(2 * 8)  # GPT-2 paper: scale by 1/sqrt(N residuals)
    assert sd["h.3.mlp.c_proj.weight"].std() == pytest.approx(residual_std, rel=0.03)
    assert sd["h.3.attn.c_proj.weight"].std() == pytest.approx(residual_std, rel=0.05)
    assert np.all(sd["h.2.ln_1.weight"] == 1) and np.all(sd["ln_f.bias"] == 0)
    assert np.all(sd["h.2.attn.c_attn.bias"] == 0)


def test_attention_takes_its_head_count_from_c_attn():
    """Megatron's column/row split: two "ranks" holding 2 of 4 heads each, whose partial
    c_proj outputs sum to the full attention output (the bias added once)."""
    config = GPTConfig(vocab_size=11, seq_len=6, n_layer=1, n_head=4, d_model=16)
    attn = GPT(config, seed=1).h[0].attn
    d, hd = 16, 4
    x = Tensor(np.random.default_rng(0).standard_normal((2, 6, d)))
    full = attn(x).data
    w, b = attn.c_attn.weight.data, attn.c_attn.bias.data
    total = np.zeros_like(full)
    for heads in (slice(0, 8), slice(8, 16)):  # heads {0,1} and {2,3}
        columns = np.concatenate([np.arange(d)[heads] + offset for offset in (0, d, 2 * d)])
        part = GPT(config, seed=1).h[0].attn
        part.c_attn = Linear(d, len(columns))
        part.c_attn.weight.data[...] = w[:, columns]
        part.c_attn.bias.data[...] = b[columns]
        part.c_proj = Linear(len(columns) // 3, d)
        part.c_proj.weight.data[...] = attn.c_proj.weight.data[heads]
        part.c_proj.bias.data[...] = attn.c_proj.bias.data / 2
        assert part.c_attn.weight.shape[1] // (3 * hd) == 2
        total += part(x).data
    np.testing.assert_allclose(total, full, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kwargs, message", [
    ({"d_model": 10, "n_head": 4}, "divisible by n_head"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"n_layer": 1.5}, "n_layer"),
    ({"dropout": 1.0}, "dropout"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_bad_inputs_are_explained():
    model = GPT(CONFIG)
    with pytest.raises(ValueError, match="exceeds seq_len"):
        model(np.zeros((1, 33), dtype=np.int64))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        model(np.zeros(5, dtype=np.int64))
    with pytest.raises(ValueError, match="precision"):
        GPT(CONFIG, precision="fp8")


def test_bf16_mixed_stays_close_to_fp64():
    idx, targets = batch()
    loss64 = GPT(CONFIG, seed=0)(idx, targets).item()
    model16 = GPT(CONFIG, seed=0, precision="bf16-mixed")
    assert model16.wte.weight.dtype == bfloat16
    losses16 = train(model16, steps=4)
    losses64 = train(GPT(CONFIG, seed=0), steps=4)
    assert abs(losses16[0] - loss64) < 0.02
    np.testing.assert_allclose(losses16, losses64, atol=0.05)
    assert all(p.grad.dtype == bfloat16 for p in model16.parameters())


def test_activations_return_to_zero_and_grads_are_held(device):
    model = GPT(CONFIG, seed=0)
    idx, targets = batch()
    loss = model(idx, targets)
    assert device.memory.current["activations"] > 0
    loss.backward()
    assert device.memory.current["activations"] == 0
    param_bytes = sum(p.data.nbytes for p in model.parameters())
    assert device.memory.current["grads"] == param_bytes
    model.zero_grad()
    assert device.memory.current["grads"] == 0


def test_activation_checkpointing_same_gradients_lower_peak(device):
    idx, targets = batch()
    grads, peaks, flops = [], [], []
    for use in (False, True):
        device.memory.peak.clear()
        device.flops.clear()
        model = GPT(CONFIG, seed=0, recompute=Recompute("full", "uniform", 1) if use else None)
        loss = model(idx, targets)
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        peaks.append(device.memory.peak["activations"])
        flops.append(device.flops["forward"])
        model.zero_grad()
        assert device.memory.current["activations"] == 0
    for name in grads[0]:
        np.testing.assert_allclose(grads[1][name], grads[0][name], rtol=1e-10, atol=1e-15)
    assert peaks[1] < 0.75 * peaks[0]
    assert flops[1] > 1.5 * flops[0]  # the blocks' forward runs twice


def test_dropout_is_seeded_and_off_in_eval():
    config = GPTConfig(dropout=0.2)
    idx, targets = batch()
    a, b = GPT(config, seed=1), GPT(config, seed=1)
    assert a(idx, targets).item() == b(idx, targets).item()
    a.eval()
    assert a(idx, targets).item() == GPT(CONFIG, seed=1)(idx, targets).item()


def test_state_dict_round_trip_reproduces_the_loss():
    idx, targets = batch()
    trained = GPT(CONFIG, seed=0)
    train(trained, steps=2)
    fresh = GPT(CONFIG, seed=9)
    fresh.load_state_dict(trained.state_dict())
    assert fresh(idx, targets).item() == trained(idx, targets).item()


def test_post_accumulate_hooks_fire_once_per_parameter_including_tied_wte():
    model = GPT(CONFIG, seed=0)
    fired = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda t, name=name: fired.append(
            (name, t.grad.copy())))
    idx, targets = batch()
    model(idx, targets).backward()
    names = [name for name, _ in fired]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    # the tied embedding's hook saw the complete gradient (lookup + LM head)
    wte_grad = dict(fired)["wte.weight"]
    np.testing.assert_array_equal(wte_grad, model.wte.weight.grad)


@pytest.mark.parametrize("tied", [True, False])
def test_a_stage_is_a_gpt_over_its_layers_with_the_single_device_names_and_values(tied):
    """Megatron's pre_process / post_process: the first stage holds the embedding, the
    last ln_f and the head (and, tied, its own copy of wte), every stage its blocks under
    their global index; names and initial values are the whole model's, and the stages
    run one after the other give the whole model's loss."""
    config = GPTConfig(vocab_size=11, seq_len=8, n_layer=5, n_head=2, d_model=16,
                       tie_embeddings=tied)
    whole = GPT(config, seed=3)
    full = whole.state_dict()
    first = GPT(config, seed=3, layers=range(0, 2), post_process=False)
    middle = GPT(config, seed=3, layers=range(2, 4), pre_process=False, post_process=False)
    last = GPT(config, seed=3, layers=range(4, 5), pre_process=False)

    def blocks(*layers):
        return [n for n in full if n.split(".")[:2] in [["h", str(i)] for i in layers]]
    head = ["wte.weight"] if tied else ["lm_head.weight"]
    assert list(first.state_dict()) == ["wte.weight", "wpe.weight", *blocks(0, 1)]
    assert list(middle.state_dict()) == blocks(2, 3)
    assert list(last.state_dict()) == [*blocks(4), "ln_f.weight", "ln_f.bias", *head]
    for stage in (first, middle, last):
        for name, value in stage.state_dict().items():
            np.testing.assert_array_equal(value, full[name], err_msg=name)
    assert [name for name, _ in middle.h.named_children()] == ["2", "3"]  # global
    assert middle.h[0] is getattr(middle.h, "2")  # indexing is by position, as a list's
    idx, targets = batch(config)
    loss = last(middle(first(idx)), targets)
    assert float(loss.data) == float(whole(idx, targets).data)


# ------------------------------------------------------------ Llama's shapes in the model
LLAMA_LIKE = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=8, n_kv_head=2,
                       d_model=32, d_ff=88, mlp="swiglu", tie_embeddings=False)


def test_swiglu_and_grouped_query_attention_shapes_are_the_planners():
    from minipar.plan.shapes import ModelShape

    model = GPT(LLAMA_LIKE)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    kv = 2 * 2 * 4  # 2 key/value heads of head_dim 4, k and v
    assert shapes["h.0.attn.c_attn.weight"] == (32, 32 + kv)
    assert shapes["h.0.mlp.c_fc.weight"] == (32, 2 * 88)  # gate and up
    assert shapes["h.0.mlp.c_proj.weight"] == (88, 32)
    assert "lm_head.weight" in shapes
    shape = ModelShape(n_layer=2, d_model=32, n_head=8, n_kv_head=2, d_ff=88, mlp="swiglu",
                       vocab_size=64, seq_len=16, tie_embeddings=False)
    assert sum(p.size for p in model.parameters()) == shape.n_params
    assert list(shapes) == list(GPT.initial_state_dict(LLAMA_LIKE))


def test_grouped_query_attention_is_mha_with_each_kv_head_repeated():
    # a GQA model equals the MHA model whose k and v columns repeat each group's head
    gqa = GPT(LLAMA_LIKE)
    mha_config = GPTConfig(**{**LLAMA_LIKE.__dict__, "n_kv_head": None})
    mha = GPT(mha_config)
    state = {name: p.data.copy() for name, p in gqa.named_parameters()}
    hd, groups, group = 4, 2, 4
    for name in list(state):
        if ".attn.c_attn." in name:  # Megatron's layout -> GPT-2's [q | k | v]
            w = state[name]
            heads = w.reshape(*w.shape[:-1], groups, group + 2, hd)
            q = heads[..., :group, :].reshape(*w.shape[:-1], -1)
            k, v = (np.repeat(heads[..., i:i + 1, :], group, axis=-2).reshape(
                *w.shape[:-1], -1) for i in (group, group + 1))
            state[name] = np.concatenate([q, k, v], axis=-1)
    for name, p in mha.named_parameters():
        p.data[...] = state[name]
    idx, targets = batch(LLAMA_LIKE)
    np.testing.assert_allclose(gqa(idx, targets).item(), mha(idx, targets).item(), rtol=1e-13)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, sequence_parallel=True),
                                    dict(pp=2, n_layer=4), dict(dp=2, zero=3),
                                    dict(dp=2, tp=2, zero=1,
                                         recompute_granularity="selective")])
def test_llama_shapes_train_like_one_device_in_fp64(layout):
    from minipar.train import train

    settings = dict(n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=40, mlp="swiglu",
                    tie_embeddings=False, seq_len=16, steps=2, precision="fp64",
                    data="synthetic", micro_batch_size=2, grad_accum_steps=2, check=True)
    report = train(**{**settings, **layout})
    assert report.equivalence["passed"]
    assert report.equivalence["max_rel_param_diff"] < 1e-10


def test_llama_shapes_refuse_what_does_not_split():
    from minipar.errors import ConfigError
    from minipar.train import TrainConfig, train

    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_head=4, n_kv_head=3, d_model=32)
    with pytest.raises(ValueError, match="mlp"):
        GPTConfig(mlp="relu")
    with pytest.raises(ConfigError) as refused:
        TrainConfig(n_head=4, n_kv_head=3)
    assert refused.value.setting == "n_kv_head"
    with pytest.raises(ConfigError) as refused:
        TrainConfig(moe_num_experts=4, mlp="swiglu")
    assert refused.value.setting == "mlp"
    base = dict(n_layer=2, d_model=32, n_head=4, seq_len=16, steps=1, data="synthetic")
    with pytest.raises(ConfigError, match="whole key/value heads"):
        train(**base, n_kv_head=1, tp=2)
    with pytest.raises(ConfigError, match="--n-kv-head 2 with --cp 2"):
        train(**base, n_kv_head=2, cp=2)
