"""--grad-accum-dtype: bf16 micro-batch gradients summed in fp32 buffers (Megatron-LM's
main_grad) or kept in bf16 (the ZeRO paper's 2 bytes), measured like every other byte."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.autograd.precision import bfloat16, float32
from minipar.errors import ConfigError
from minipar.nn import GPT, GPTConfig
from minipar.parallel.data.ddp import accumulate_gradients_in
from minipar.train import TrainConfig, train

TINY = dict(n_layer=2, d_model=32, n_head=4, seq_len=16, data="synthetic", steps=2,
            precision="bf16-mixed", micro_batch_size=2, grad_accum_steps=3)


def run(**settings) -> dict:
    return json.loads(train(TrainConfig(**{**TINY, **settings})).to_json())


def test_fp32_buffers_sum_each_micro_batchs_bf16_gradient_exactly():
    config = GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 32, (2, 8)), rng.integers(0, 32, (2, 8))) for _ in range(3)]

    def gradients(dtype):
        model = GPT(config, precision="bf16-mixed")
        accumulate_gradients_in(model.parameters(), dtype)
        for x, y in batches:
            model(x, y).backward()
        return {name: p.grad for name, p in model.named_parameters()}

    def each_micro_batch():
        model = GPT(config, precision="bf16-mixed")
        out = []
        for x, y in batches:
            model.zero_grad()
            model(x, y).backward()
            out.append({name: p.grad.copy() for name, p in model.named_parameters()})
        return out

    in_fp32, in_bf16, single = gradients(float32), gradients(None), each_micro_batch()
    for name, grad in in_fp32.items():
        assert grad.dtype == float32 and in_bf16[name].dtype == bfloat16
        assert single[0][name].dtype == bfloat16  # each backward still computes in bf16
        exact = sum(s[name].astype(np.float64) for s in single)
        np.testing.assert_array_equal(grad, exact.astype(np.float32))  # bf16 + bf16 fits fp32
    # bf16 buffers round every partial sum: somewhere that differs
    assert any(not np.array_equal(in_bf16[n].astype(np.float32), g) for n, g in in_fp32.items())


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_fp32_buffers_double_the_gradient_bytes_and_the_reductions(zero):
    bf16, fp32 = run(dp=2, zero=zero, grad_accum_dtype="bf16"), run(dp=2, zero=zero,
                                                                    grad_accum_dtype="fp32")
    n_params = bf16["n_params"]
    grads = {0: n_params, 1: n_params, 2: n_params // 2, 3: n_params // 2}[zero]
    for report, itemsize in ((bf16, 2), (fp32, 4)):
        assert report["ranks"][0]["memory"]["grads"] == grads * itemsize
    assert bf16["ranks"][0]["memory"]["params"] == fp32["ranks"][0]["memory"]["params"]
    sent_bf16 = bf16["traffic"]["matrix"][0][1]
    sent_fp32 = fp32["traffic"]["matrix"][0][1]
    # the gradient reductions move twice the bytes; ZeRO-1/2's parameter all-gather (a
    # third of the bytes) and ZeRO-3's gathers (two thirds) stay bf16
    norm = 8 * 2 * (zero > 0)  # one fp64 number per step
    if zero == 3:  # gathered twice per micro-batch (the tied embedding once more)
        assert 1 + 1 / 4 < (sent_fp32 - norm) / (sent_bf16 - norm) < 1 + 1 / 3
        return
    # ZeRO-2 reduce-scatters on each of the 3 micro-batches and gathers once
    grad_share = {0: 1, 1: 1 / 2, 2: 3 / 4}[zero]
    expected = (sent_bf16 - norm) * (1 + grad_share) + norm
    assert sent_fp32 == pytest.approx(expected, rel=1e-3)


def test_bf16_given_is_the_default_bit_for_bit():
    default, explicit = run(dp=2, zero=1), run(dp=2, zero=1, grad_accum_dtype="bf16")
    default["config"].pop("grad_accum_dtype"), explicit["config"].pop("grad_accum_dtype")
    assert json.dumps(default, sort_keys=True) == json.dumps(explicit, sort_keys=True)


def test_fp32_buffers_pass_the_check_against_one_device():
    report = run(dp=2, tp=2, zero=1, sequence_parallel=True, grad_accum_dtype="fp32",
                 check=True)
    assert report["equivalence"]["passed"]


@pytest.mark.parametrize("precision, dtype", [("fp32", "bf16"), ("fp64", "fp32"),
                                              ("fp64", "bf16")])
def test_a_buffer_narrower_than_the_parameters_is_refused(precision, dtype):
    with pytest.raises(ConfigError) as refused:
        TrainConfig(precision=precision, grad_accum_dtype=dtype)
    assert refused.value.setting == "grad_accum_dtype"
    assert f"--precision {precision}" in str(refused.value)
    with pytest.raises(ConfigError, match="must be one of"):
        TrainConfig(precision="bf16-mixed", grad_accum_dtype="fp16")


def test_the_rank_builds_its_buffers_in_the_layouts_dtype():
    def dtypes(config):
        def rank():
            from minipar.train.build import build_rank_model
            built = build_rank_model(config, dist.DeviceMesh(dp=1))
            return {p.grad_dtype for _, p in built.named_parameters()}
        return dist.launch(rank, world_size=1)[0]

    assert dtypes(TrainConfig(**TINY, vocab_size=32, grad_accum_dtype="fp32")) == {float32}
    assert dtypes(TrainConfig(**TINY, vocab_size=32)) == {None}  # bf16: the parameters' own
