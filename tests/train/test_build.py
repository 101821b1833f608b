"""Which dp x tp x pp x ZeRO mixes run, which are refused (naming the fix), and what one
rank builds for its mesh coordinates."""

from __future__ import annotations

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.errors import ConfigError
from minipar.nn.gpt import parameter_shapes
from minipar.train import TrainConfig, train
from minipar.train.build import build_rank_model
from minipar.train.config import gpt_config
from minipar.train.mixes import check_layout, tp_groups_across_nodes

TINY = dict(seq_len=8, n_layer=2, d_model=16, n_head=2, micro_batch_size=2, steps=2,
            vocab_size=52, precision="fp64")


@pytest.mark.parametrize("settings, flag, words", [
    (dict(dp=2, pp=2, zero=2, grad_accum_steps=2), "--zero 2", "DeepSpeed"),
    (dict(dp=2, pp=2, zero=3, grad_accum_steps=2), "--zero 3", "DeepSpeed"),
    (dict(sequence_parallel=True), "--sequence-parallel", "--tp 2"),
    (dict(virtual_stages=2, pp=2, grad_accum_steps=2), "--virtual-stages", "interleaved"),
    (dict(schedule="interleaved", virtual_stages=2), "--pp", "2 pipeline ranks"),
    (dict(pp=4, grad_accum_steps=4), "--pp", "layers"),  # 4 stages, 2 layers
    (dict(pp=2, schedule="interleaved", virtual_stages=2, grad_accum_steps=3, n_layer=4),
     "--grad-accum-steps", "multiple of 2"),
    (dict(tp=3), "--tp 3", "n_head"),
    (dict(tp=2, vocab_size=53), "--tp 2", "--vocab-size 54"),
    (dict(tp=2, dropout=0.1), "--dropout", "RNG"),
    (dict(dp=2, dropout=0.1, check=True), "--check", "--dropout 0"),
])
def test_unsupported_mixes_are_refused_naming_the_flag_and_the_fix(settings, flag, words):
    config = TrainConfig(**{**TINY, **settings})
    with pytest.raises(ConfigError) as error:
        check_layout(config)
    message = str(error.value)
    assert message.startswith(flag) or flag in message.split(":")[0], message
    assert words in message
    assert isinstance(error.value, ConfigError)  # the CLI prints it as one line
    with pytest.raises(ConfigError):  # and train() refuses before anything runs
        train(config)


@pytest.mark.parametrize("settings", [
    dict(dp=2, tp=2, pp=2, zero=1, grad_accum_steps=2),
    dict(dp=2, tp=2, zero=3, sequence_parallel=True, recompute_granularity="full"),
    dict(pp=2, schedule="interleaved", virtual_stages=2, grad_accum_steps=2, n_layer=4),
    dict(dp=3, pp=2, zero=1, grad_accum_steps=2),
    dict(dropout=0.1, check=True),  # one rank draws the reference's masks
])
def test_supported_mixes_pass_without_warnings(settings):
    assert check_layout(TrainConfig(**{**TINY, **settings})) == []


def test_a_tp_group_across_nodes_runs_but_is_flagged():
    inside = TrainConfig(**TINY, dp=2, tp=2, gpus_per_node=2)
    across = inside.replace(gpus_per_node=1)
    odd = inside.replace(gpus_per_node=3)  # groups [0, 1] on node 0, [2, 3] on nodes 0, 1
    assert tp_groups_across_nodes(inside) == []
    assert tp_groups_across_nodes(across) == [[0, 1], [2, 3]]
    assert tp_groups_across_nodes(odd) == [[2, 3]]
    (warning,) = check_layout(across)
    assert "span nodes" in warning and "--gpus-per-node" in warning
    report = train(across)
    assert report.layout["tp_group_crosses_nodes"] is True
    assert report.warnings == [warning]
    assert train(inside).layout["tp_group_crosses_nodes"] is False


def test_a_pipeline_with_fewer_micro_batches_than_stages_is_flagged():
    (warning,) = check_layout(TrainConfig(**TINY, pp=2, grad_accum_steps=1))
    assert "never fills" in warning and "--grad-accum-steps 2" in warning


def _holdings(settings):
    """Per rank: {name: local shape} of the parameters its model (or stage) holds."""
    config = TrainConfig(**{**TINY, **settings})

    def program():
        mesh = dist.DeviceMesh(dp=config.dp, pp=config.pp, tp=config.tp)
        model = build_rank_model(config, mesh)
        parts = model.pipeline if model.pipeline is not None else model.model
        return {name: p.shape for name, p in parts.named_parameters()}

    return config, dist.launch(program, config.world_size)


def test_each_rank_builds_its_stage_of_its_tensor_parallel_slices():
    config, held = _holdings(dict(dp=2, tp=2, pp=2, n_layer=4, grad_accum_steps=2))
    full = parameter_shapes(gpt_config(config))
    mesh = dist.DeviceMesh(2, 2, 2)
    for rank, shapes in enumerate(held):
        stage = mesh.coords(rank)["pp"]
        layers = {name.split(".")[1] for name in shapes if name.startswith("h.")}
        assert layers == ({"0", "1"} if stage == 0 else {"2", "3"})
        assert ("wpe.weight" in shapes) == (stage == 0)
        assert ("ln_f.weight" in shapes) == (stage == 1)
        assert "wte.weight" in shapes  # first stage: embedding; last: the tied head's copy
        d, v = config.d_model, config.vocab_size
        assert shapes["wte.weight"] == (v // 2, d)  # vocabulary-parallel rows
        block = "h.0" if stage == 0 else "h.2"
        assert shapes[f"{block}.mlp.c_fc.weight"] == (d, 4 * d // 2)  # column-parallel
        assert shapes[f"{block}.mlp.c_proj.weight"] == (4 * d // 2, d)  # row-parallel
        assert shapes[f"{block}.ln_1.weight"] == full[f"{block}.ln_1.weight"]  # replicated
    assert held[0] == held[4]  # DP replicas build the same pieces


@pytest.mark.parametrize("settings", [
    dict(dp=2, tp=2, pp=2, zero=1, grad_accum_steps=2, n_layer=4),
    dict(dp=2, tp=2, zero=3, sequence_parallel=True),
    dict(pp=2, tie_embeddings=True, grad_accum_steps=2),
])
def test_the_clipped_gradient_norm_is_the_single_device_norm(settings):
    """TP replicas and the pipeline's tied embedding copy count once: every step's
    global norm (before clipping) equals the single device's, so clipping scales alike."""
    config = TrainConfig(**{**TINY, **settings, "grad_clip": 0.05, "steps": 3})
    parallel = train(config)
    single = train(config.replace(dp=1, tp=1, pp=1, zero=0, sequence_parallel=False,
                                  grad_accum_steps=config.grad_accum_steps * config.dp,
                                  global_batch_size=config.global_batch_size))
    norms = [s["grad_norm"] for s in parallel.steps]
    assert min(norms) > 0.05  # clipping active on every step
    np.testing.assert_allclose(norms, [s["grad_norm"] for s in single.steps], rtol=1e-12)
