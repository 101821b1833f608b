"""Strategies compose by construction (docs/architecture.md): a parallel model is a GPT
whose child modules a strategy swapped, never a class minted at run time nor a method or
lambda installed on an instance, and GPT's embed and head are written once."""

from __future__ import annotations

import ast
import functools
import types
from pathlib import Path

import pytest

from minipar import distributed as dist
from minipar.train import TrainConfig
from minipar.train.build import build_rank_model

PACKAGE = Path(__file__).resolve().parent.parent / "minipar"
# The model and the code that converts it.
MODEL_CODE = [PACKAGE / "nn", PACKAGE / "parallel", PACKAGE / "train" / "build.py"]


def trees(*roots: Path):
    for root in roots:
        for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            yield path.relative_to(PACKAGE.parent), ast.parse(path.read_text())


def test_no_class_is_minted_at_run_time():
    minted = [f"{path}:{node.lineno}" for path, tree in trees(PACKAGE)
              for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "type" and len(node.args) == 3]
    assert minted == []


def test_no_lambda_is_assigned_onto_an_object_in_the_model_code():
    assigned = []
    for path, tree in trees(*MODEL_CODE):
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda) and any(
                    isinstance(t, ast.Attribute) for t in node.targets):
                assigned.append(f"{path}:{node.lineno}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "setattr" and len(node.args) == 3 \
                    and isinstance(node.args[2], ast.Lambda):
                assigned.append(f"{path}:{node.lineno}")
    assert assigned == []


def test_embed_and_head_are_defined_once():
    defined = {"embed": [], "head": []}
    for path, tree in trees(PACKAGE):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in defined:
                defined[node.name].append(str(path))
    assert defined == {"embed": ["minipar/nn/gpt.py"], "head": ["minipar/nn/gpt.py"]}


TINY = dict(seq_len=8, n_layer=4, d_model=16, n_head=2, micro_batch_size=2, steps=1,
            vocab_size=32, precision="fp64")


@pytest.mark.parametrize("settings", [
    dict(tp=2, sequence_parallel=True, pp=2, cp=2, grad_accum_steps=2),
    dict(pp=2, schedule="interleaved", virtual_stages=2, grad_accum_steps=2),
    dict(pp=2, schedule="zb-v", virtual_stages=2, grad_accum_steps=4),
    dict(dp=2, ep=2, tp=2, sequence_parallel=True, moe_num_experts=4, zero=1),
], ids=lambda s: " ".join(f"{k}={v}" for k, v in s.items()))
def test_no_module_of_a_rank_model_carries_a_function_of_its_own(settings):
    """Every conversion swapped modules: no module instance holds a function, method,
    lambda or partial in its own attributes (which would shadow or stand in for code
    its class defines)."""
    config = TrainConfig(**{**TINY, **settings})

    def program():
        mesh = dist.DeviceMesh(config.dp, config.pp, config.tp, cp=config.cp, ep=config.ep)
        rank = build_rank_model(config, mesh)
        callables = (types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                     functools.partial)
        return [f"{type(module).__name__}.{name}"
                for part in rank.parts() for module in part.modules()
                for name, value in vars(module).items() if isinstance(value, callables)]

    assert dist.launch(program, config.world_size) == [[]] * config.world_size
