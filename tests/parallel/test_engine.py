"""Every gradient engine (DDP, ZeRO-1/2/3, their offloaded forms, the expert pair)
satisfies the engine contract, `minipar.parallel.engine.GradientEngine`: each member,
taking the Protocol's parameters. The engines are built as training builds them."""

from __future__ import annotations

import inspect

import pytest

from minipar import distributed as dist
from minipar.parallel.engine import GradientEngine
from minipar.train import TrainConfig
from minipar.train.build import build_rank_model

SMALL = dict(seq_len=8, n_layer=2, d_model=16, n_head=2, micro_batch_size=2,
             vocab_size=16, data="synthetic")
ENGINES = {
    "DataParallel": dict(dp=2),
    "ZeroOptimizer": dict(dp=2, zero=1),
    "ZeroOptimizer stage 2": dict(dp=2, zero=2),
    "Zero3Optimizer": dict(dp=2, zero=3),
    "OffloadedZeroOptimizer": dict(dp=2, zero=2, offload_optimizer="cpu"),
    "OffloadedZero3Optimizer": dict(dp=2, zero=3, offload_optimizer="nvme",
                                    offload_param="cpu"),
    "ExpertDataParallel": dict(dp=2, ep=2, moe_num_experts=4),
}
MEMBERS = sorted({*GradientEngine.__annotations__,
                  *(name for name, value in vars(GradientEngine).items()
                    if not name.startswith("_") and (callable(value)
                                                     or isinstance(value, property)))})


def breaches(engine) -> list[str]:
    """The contract's members `engine` lacks, or whose parameters differ."""
    found = []
    for name in MEMBERS:
        if not hasattr(engine, name):
            found.append(f"{name}: missing")
            continue
        wanted = getattr(GradientEngine, name, None)
        if callable(wanted):
            expected = list(inspect.signature(wanted).parameters)[1:]  # without self
            got = list(inspect.signature(getattr(engine, name)).parameters)
            if got != expected:
                found.append(f"{name}{tuple(got)}: the contract takes {tuple(expected)}")
    return found


def test_the_contract_lists_what_the_training_step_calls():
    assert {"require_backward_grad_sync", "defer_reduction", "synchronize_gradients",
            "finish_gradient_synchronization", "main_grads", "local_gradients",
            "clip_grad_norm_", "step", "zero_grad", "step_count",
            "load_optimizer_state", "stage"} == set(MEMBERS)


@pytest.mark.parametrize("expected, settings", ENGINES.items(), ids=list(ENGINES))
def test_every_engine_satisfies_the_engine_contract(expected, settings):
    config = TrainConfig(**SMALL, **settings)

    def rank():
        mesh = dist.DeviceMesh(dp=config.dp, ep=config.ep)
        engine = build_rank_model(config, mesh).engine
        return type(engine).__name__, isinstance(engine, GradientEngine), breaches(engine)

    for name, is_engine, found in dist.launch(rank, config.world_size):
        assert name == expected.split()[0]
        assert is_engine and found == [], found
