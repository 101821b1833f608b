"""Who holds what: the masks `holdings` reads off the ranks' engines match what data,
tensor and pipeline parallelism and the ZeRO stages are defined to keep (expectations
derived here from the papers' definitions, not from the code's output)."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure

from minipar.errors import ConfigError
from minipar.nn.gpt import parameter_shapes
from minipar.train.config import TrainConfig, gpt_config
from minipar.viz.sharding import KINDS, holdings, plot_sharding

CONFIG = TrainConfig(data="synthetic", vocab_size=16, seq_len=8, n_layer=2, n_head=4,
                     d_model=16)
SHAPES = parameter_shapes(gpt_config(CONFIG))
PSI = sum(int(np.prod(s)) for s in SHAPES.values())


def coverage(held, kind):
    """{name: int array, how many ranks hold each element of the full tensor}."""
    counts = {name: np.zeros(shape, int) for name, shape in SHAPES.items()}
    for rank in range(held.world_size):
        for name, mask in held.masks[rank][kind].items():
            counts[name] += mask
    return counts


def test_one_device_holds_everything_and_its_bytes_are_four_per_parameter():
    held = holdings(config=CONFIG)
    for kind in KINDS:
        assert held.fraction(0, kind) == 1.0
    # fp32: 4 bytes of weights and of gradient per parameter, Adam's m and v 8.
    assert held.nbytes[0] == {"params": 4 * PSI, "grads": 4 * PSI, "optimizer": 8 * PSI}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages_shard_exactly_what_the_paper_says(zero):
    n = 4
    held = holdings(dp=n, zero=zero, config=CONFIG)
    # ZeRO (Rajbhandari et al. 2020, Figure 1): stage 1 shards the optimizer state,
    # stage 2 also the gradients, stage 3 also the parameters.
    sharded = {"optimizer": zero >= 1, "grads": zero >= 2, "params": zero >= 3}
    for kind in KINDS:
        counts = coverage(held, kind)
        every = np.concatenate([c.reshape(-1) for c in counts.values()])
        if sharded[kind]:
            assert np.all(every == 1), f"{kind}: each element on exactly one rank"
            for rank in range(n):  # ~1/N each (flat buffers padded to a multiple of N)
                assert held.fraction(rank, kind) == pytest.approx(1 / n, abs=2 / PSI + 1e-9)
        else:
            assert np.all(every == n), f"{kind}: replicated on every DP rank"


def test_tensor_parallel_splits_follow_megatron():
    held = holdings(tp=2, config=CONFIG)
    d = CONFIG.d_model
    params = [held.masks[r]["params"] for r in range(2)]
    for r in range(2):
        # c_fc (d, 4d): column-parallel, rank r keeps columns [r 2d, (r+1) 2d)
        expected = np.zeros((d, 4 * d), bool)
        expected[:, r * 2 * d:(r + 1) * 2 * d] = True
        assert np.array_equal(params[r]["h.0.mlp.c_fc.weight"], expected)
        # mlp.c_proj (4d, d): row-parallel, rows [r 2d, (r+1) 2d)
        expected = np.zeros((4 * d, d), bool)
        expected[r * 2 * d:(r + 1) * 2 * d] = True
        assert np.array_equal(params[r]["h.1.mlp.c_proj.weight"], expected)
        # c_attn (d, 3d) = [q | k | v]: rank r keeps its heads' columns of each block
        expected = np.zeros((d, 3 * d), bool)
        for block in range(3):
            expected[:, block * d + r * d // 2: block * d + (r + 1) * d // 2] = True
        assert np.array_equal(params[r]["h.0.attn.c_attn.weight"], expected)
        # wte (V, d): vocabulary rows; LayerNorms replicated
        expected = np.zeros(SHAPES["wte.weight"], bool)
        expected[r * 8:(r + 1) * 8] = True
        assert np.array_equal(params[r]["wte.weight"], expected)
        assert params[r]["h.0.ln_1.weight"].all()


def test_pipeline_stages_hold_their_layers_and_the_last_a_tied_copy_of_wte():
    held = holdings(pp=2, config=CONFIG)
    first, last = (set(held.masks[r]["params"]) for r in range(2))
    assert {n for n in first if n.startswith("h.")} == {n for n in SHAPES if n.startswith("h.0.")}
    assert {n for n in last if n.startswith("h.")} == {n for n in SHAPES if n.startswith("h.1.")}
    assert "wpe.weight" in first and "wpe.weight" not in last
    assert "ln_f.weight" in last and "ln_f.weight" not in first
    assert "wte.weight" in first and "wte.weight" in last  # GPT-2's tied LM head


def test_a_3d_layout_with_zero1_loses_nothing():
    held = holdings(dp=2, tp=2, pp=2, zero=1, config=CONFIG)
    for kind in KINDS:
        for name, counts in coverage(held, kind).items():
            assert counts.min() >= 1, f"{kind} of {name}: some element on no rank"
    # Optimizer state is split by DP too: nothing held by both replicas of a position.
    counts = coverage(held, "optimizer")
    assert counts["h.0.mlp.c_fc.weight"].max() == 1


def test_a_layout_training_refuses_is_refused_with_the_same_message():
    # DeepSpeed refuses ZeRO-2/3 with pipeline parallelism; so does minipar's builder.
    with pytest.raises(ConfigError, match="--zero"):
        holdings(dp=2, pp=2, zero=2, config=CONFIG)


def test_plot_sharding_draws_each_ranks_mask():
    held = holdings(dp=2, tp=2, config=CONFIG)
    fig = plot_sharding(held, "params", "h.0.mlp.c_fc.weight")
    assert isinstance(fig, Figure)
    strip, panels = fig.axes
    # beside the strip, a bar says what a shade means: the share of a slice held
    assert {"0%", "50%", "100%", "share of a slice held"} <= {t.get_text() for t in fig.texts}
    assert "in 400 slices" in strip.get_title()
    assert strip.images[0].get_array().shape[0] == 4  # one row per rank
    assert len(panels.images) == 4  # one panel per rank, in rank order
    titles = [text.get_text() for text in panels.texts]
    for rank, image in enumerate(panels.images):
        drawn = np.asarray(image.get_array())
        assert drawn.shape == SHAPES["h.0.mlp.c_fc.weight"]
        assert np.array_equal(drawn > 0.5, held.masks[rank]["params"]["h.0.mlp.c_fc.weight"])
        # TP splits c_fc's columns over 2 ranks: each holds half (DP replicates it)
        assert titles[rank].startswith(f"r{rank} (") and titles[rank].endswith("50%")


def test_plot_sharding_refuses_unknown_kind_or_tensor():
    held = holdings(config=CONFIG)
    with pytest.raises(ValueError, match="kind"):
        plot_sharding(held, "weights", "wte.weight")
    with pytest.raises(ValueError, match="no tensor"):
        plot_sharding(held, "params", "h.9.mlp.c_fc.weight")
