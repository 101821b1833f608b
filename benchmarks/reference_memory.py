"""The planner's memory against the real systems' own accounting, called as they ship.

    # the references: DeepSpeed importable (pip install deepspeed; its sdist builds only
    # with torch already installed: pip install --no-build-isolation deepspeed), and a
    # Megatron-LM checkout (its megatron/training/theoretical_memory_usage.py is not in
    # the megatron-core wheel)
    MINIPAR_MEGATRON_LM=/path/to/Megatron-LM python benchmarks/reference_memory.py \
        --write tests/plan/reference_memory.json
    python benchmarks/reference_memory.py --table       # planner vs the fixture, no references

DeepSpeed: `estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/
stage_1_and_2.py; DeepSpeed has no ZeRO-1 estimator: stage 1 runs the same optimizer)
and `estimate_zero3_model_states_mem_needs` (stage3.py), on CPU, with the parameters one
model-parallel rank holds (`total_params`), its module's largest (`largest_layer_params`)
and the data-parallel size (`num_gpus_per_node`, one node), no offload: the GPU bytes of
the model states. Megatron-LM: `report_theoretical_memory(args, num_microbatches)` of
megatron/training/theoretical_memory_usage.py, the file as it ships with its two imports
(`.utils`: is_hybrid_model, print_rank_0) stubbed: the first pipeline stage's weights and
optimizer, and its activations.

The planner's side: `estimate` with --memory-accounting deepspeed / megatron, the same
layout. Where the planner counts what the reference leaves out (or assumes what the
layout does not have), the difference is named and measured by the planner itself: the
layout is estimated again with that one assumption of the reference switched on, and
the two estimates' difference is the named term. What remains must be within 2%
(tests/plan/test_reference_memory.py). The fixture keeps the references' own numbers,
with the version and file they came from; the test re-runs them when it can.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import types
from dataclasses import replace

from minipar.plan import presets
from minipar.plan.accounting import largest_module_params
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig, stage_plans
from minipar.plan.memory import stage_parameters
from minipar.plan.shapes import padded_vocab

MIB = 2**20
TOLERANCE = 0.02
FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "tests/plan/reference_memory.json"
MEGATRON_FILE = "megatron/training/theoretical_memory_usage.py"
CLUSTER = presets.cluster("h100-80gb")

# (name, model preset, layout): GPT-2 and Llama shapes, ZeRO-1/2/3, TP, PP (1F1B and
# interleaved), sequence parallelism, selective and full recomputation. bf16-mixed,
# flash attention, 4096 (Llama) or 1024 (GPT-2) tokens.
LAYOUTS = [
    ("gpt2-xl dp8 zero1", "gpt2-xl", dict(dp=8, zero=1, micro_batch_size=4,
                                          grad_accum_steps=2)),
    ("gpt2-xl dp8 zero2", "gpt2-xl", dict(dp=8, zero=2, micro_batch_size=4,
                                          grad_accum_steps=2)),
    ("gpt2-xl dp8 zero3", "gpt2-xl", dict(dp=8, zero=3, micro_batch_size=4,
                                          grad_accum_steps=2)),
    ("gpt2-xl dp64 zero3", "gpt2-xl", dict(dp=64, zero=3, micro_batch_size=2)),
    ("gpt2-xl pp4 dp2 zero1 full", "gpt2-xl", dict(dp=2, pp=4, zero=1, micro_batch_size=4,
                                                   grad_accum_steps=8,
                                                   recompute_granularity="full")),
    ("gpt2 dp16 zero0", "gpt2", dict(dp=16, micro_batch_size=8, grad_accum_steps=1)),
    ("gpt2-medium tp4 sp dp2 zero1 selective", "gpt2-medium",
     dict(dp=2, tp=4, zero=1, sequence_parallel=True, recompute_granularity="selective",
          micro_batch_size=8, grad_accum_steps=2)),
    ("gpt2-medium tp2 pp2 dp2 zero0", "gpt2-medium",
     dict(dp=2, tp=2, pp=2, micro_batch_size=4, grad_accum_steps=8)),
    ("gpt2-medium dp8 zero2", "gpt2-medium", dict(dp=8, zero=2, micro_batch_size=8)),
    ("llama2-7b dp8 zero1", "llama2-7b", dict(dp=8, zero=1, micro_batch_size=1,
                                              grad_accum_steps=4)),
    ("llama2-7b tp2 sp dp4 zero1 selective", "llama2-7b",
     dict(dp=4, tp=2, zero=1, sequence_parallel=True, recompute_granularity="selective",
          micro_batch_size=1, grad_accum_steps=4)),
    ("llama2-7b tp4 sp pp2 dp2 zero1 selective", "llama2-7b",
     dict(dp=2, tp=4, pp=2, zero=1, sequence_parallel=True,
          recompute_granularity="selective", micro_batch_size=1, grad_accum_steps=16)),
    ("llama2-7b pp4 dp4 zero0", "llama2-7b", dict(dp=4, pp=4, micro_batch_size=1,
                                                  grad_accum_steps=16)),
    ("llama2-7b dp16 zero2", "llama2-7b", dict(dp=16, zero=2, micro_batch_size=1)),
    ("llama2-7b dp16 zero3", "llama2-7b", dict(dp=16, zero=3, micro_batch_size=1)),
    ("llama2-13b dp16 zero1 full", "llama2-13b", dict(dp=16, zero=1, micro_batch_size=1,
                                                      grad_accum_steps=4,
                                                      recompute_granularity="full")),
    ("llama2-13b tp2 sp dp8 zero1 selective", "llama2-13b",
     dict(dp=8, tp=2, zero=1, sequence_parallel=True, recompute_granularity="selective",
          micro_batch_size=1, grad_accum_steps=8)),
    ("llama2-13b tp8 sp pp2 zero0 selective", "llama2-13b",
     dict(tp=8, pp=2, sequence_parallel=True, recompute_granularity="selective",
          micro_batch_size=1, grad_accum_steps=8)),
    ("llama2-13b tp4 pp2 dp2 zero1 full", "llama2-13b",
     dict(dp=2, tp=4, pp=2, zero=1, recompute_granularity="full", micro_batch_size=1,
          grad_accum_steps=8)),
    ("llama2-13b dp32 zero3", "llama2-13b", dict(dp=32, zero=3, micro_batch_size=1)),
    ("llama2-70b tp8 sp pp4 dp4 zero1 selective", "llama2-70b",
     dict(dp=4, tp=8, pp=4, zero=1, sequence_parallel=True,
          recompute_granularity="selective", micro_batch_size=1, grad_accum_steps=16)),
    ("llama2-70b tp8 sp pp8 v2 dp2 zero1 selective", "llama2-70b",
     dict(dp=2, tp=8, pp=8, zero=1, sequence_parallel=True, schedule="interleaved",
          virtual_stages=2, recompute_granularity="selective", micro_batch_size=1,
          grad_accum_steps=32)),
    ("llama2-70b tp8 sp dp8 zero2", "llama2-70b",
     dict(dp=8, tp=8, zero=2, sequence_parallel=True, recompute_granularity="selective",
          micro_batch_size=1)),
    ("llama2-70b dp64 zero3", "llama2-70b", dict(dp=64, zero=3, micro_batch_size=1)),
]


def layout(model: str, settings: dict, accounting: str = "paper"):
    shape = presets.model(model)
    config = ParallelConfig(**{"flash_attention": True, **settings},
                            memory_accounting=accounting)
    return shape, config


# ------------------------------------------------------------------ the references' inputs
def deepspeed_call(shape, config) -> dict | None:
    """The estimator and its arguments for this layout (None: DeepSpeed has none for
    ZeRO-0)."""
    if config.zero == 0:
        return None
    rank = stage_plans(shape, config)[0]
    call = {"function": "estimate_zero3_model_states_mem_needs" if config.zero == 3
            else "estimate_zero2_model_states_mem_needs",
            "total_params": stage_parameters(shape, config, rank).numel,
            "num_gpus_per_node": config.replicas, "num_nodes": 1, "cpu_offload": False}
    if config.zero == 3:
        call.update(largest_layer_params=largest_module_params(shape, config.tp, rank),
                    cpu_offload_params=False)
    return call


def megatron_args(shape, config) -> dict | None:
    """The argparse namespace theoretical_memory_usage.py reads (None: Megatron-LM runs
    no ZeRO-2/3)."""
    if config.zero > 1:
        return None
    recompute = config.recompute.granularity
    return {
        "hidden_size": shape.d_model, "num_attention_heads": shape.n_head,
        "kv_channels": shape.head_dim, "group_query_attention": shape.kv_heads != shape.n_head,
        "num_query_groups": shape.kv_heads, "ffn_hidden_size": shape.ffn,
        "swiglu": shape.mlp == "swiglu", "num_layers": shape.n_layer,
        "padded_vocab_size": padded_vocab(shape.vocab_size, config.tp),
        "untie_embeddings_and_output_weights": not shape.tie_embeddings,
        "normalization": "RMSNorm" if shape.norm == "rmsnorm" else "LayerNorm",
        "add_bias_linear": shape.bias, "seq_length": shape.seq_len,
        "micro_batch_size": config.micro_batch_size,
        "tensor_model_parallel_size": config.tp,
        "pipeline_model_parallel_size": config.pp, "data_parallel_size": config.dp,
        "world_size": config.world_size,
        "virtual_pipeline_model_parallel_size": (config.virtual_stages
                                                 if config.virtual_stages > 1 else None),
        "sequence_parallel": config.sequence_parallel,
        "recompute_granularity": recompute,
        "use_distributed_optimizer": config.zero == 1,
        "num_experts": None, "moe_layer_freq": 1, "moe_ffn_hidden_size": None,
        "moe_router_topk": 1, "moe_shared_expert_intermediate_size": None,
        "moe_latent_size": None, "mtp_num_layers": None, "multi_latent_attention": False,
        "expert_tensor_parallel_size": 1, "expert_model_parallel_size": 1,
    }


# ------------------------------------------------------------------ calling them
def load_megatron(path: str):
    """theoretical_memory_usage.py from a Megatron-LM checkout, a bare clone (the file at
    its HEAD) or the file itself, as it ships, its package's `.utils` stubbed (the two
    names it imports)."""
    source = pathlib.Path(path)
    if (source / "objects").is_dir() and (source / "HEAD").is_file():  # a bare clone
        text = subprocess.run(["git", "--git-dir", str(source), "show",
                               f"HEAD:{MEGATRON_FILE}"], check=True, capture_output=True
                              ).stdout
        source = pathlib.Path(tempfile.mkdtemp()) / "theoretical_memory_usage.py"
        source.write_bytes(text)
    elif source.is_dir():
        source = source / MEGATRON_FILE
    for name in ("megatron", "megatron.training"):
        sys.modules.setdefault(name, types.ModuleType(name)).__path__ = []
    utils = types.ModuleType("megatron.training.utils")
    utils.is_hybrid_model = lambda args: False
    utils.print_rank_0 = lambda *args, **kwargs: None
    sys.modules["megatron.training.utils"] = utils
    spec = importlib.util.spec_from_file_location(
        "megatron.training.theoretical_memory_usage", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    blob = hashlib.sha1(b"blob %d\0" % source.stat().st_size + source.read_bytes())
    return module, blob.hexdigest()


def run_megatron(module, args: dict, num_microbatches: int) -> dict:
    namespace = types.SimpleNamespace(**args)
    weights, activations, _ = module.report_theoretical_memory(namespace, num_microbatches)
    return {"weight_and_optimizer_mb": weights, "activation_mb": activations}


def run_deepspeed(call: dict) -> int:
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    kwargs = {k: v for k, v in call.items() if k != "function"}
    if call["function"] == "estimate_zero3_model_states_mem_needs":
        return stage3.estimate_zero3_model_states_mem_needs(**kwargs)[1]
    return stage_1_and_2.estimate_zero2_model_states_mem_needs(**kwargs)[1]


def reference_numbers(megatron_path: str | None) -> dict:
    """Every layout's inputs and both references' outputs (None where a reference has no
    estimate for the layout)."""
    import deepspeed

    module, blob = load_megatron(megatron_path)
    rows = []
    for name, model, settings in LAYOUTS:
        shape, config = layout(model, settings)
        call, args = deepspeed_call(shape, config), megatron_args(shape, config)
        rows.append({
            "name": name, "model": model, "settings": settings,
            "deepspeed": None if call is None else {"call": call,
                                                    "gpu_bytes": run_deepspeed(call)},
            "megatron": None if args is None else {
                "args": args, "num_microbatches": config.micro_batches,
                **run_megatron(module, args, config.micro_batches)},
        })
    return {"schema": "minipar.reference_memory/1",
            "deepspeed": {"version": deepspeed.__version__,
                          "functions": ["deepspeed/runtime/zero/stage_1_and_2.py "
                                        "estimate_zero2_model_states_mem_needs",
                                        "deepspeed/runtime/zero/stage3.py "
                                        "estimate_zero3_model_states_mem_needs"]},
            "megatron": {"file": MEGATRON_FILE, "blob": blob,
                         "commit": os.environ.get("MINIPAR_MEGATRON_LM_COMMIT")},
            "layouts": rows}


# ------------------------------------------------------------------ the planner's side
def model_states(est, rank: int = 0) -> int:
    memory = next(s for s in est.stages if s.rank == rank).memory
    return memory["params"] + memory["grads"] + memory["optimizer"]


def planner_deepspeed(model: str, settings: dict) -> dict:
    """The planner's model states under DeepSpeed's accounting, the terms it names
    against DeepSpeed's estimator, and what remains to compare."""
    shape, config = layout(model, settings, "deepspeed")
    rank = stage_plans(shape, config)[0]
    est = estimate(shape, config, CLUSTER)
    gathered = 4 * largest_module_params(shape, config.tp, rank) if config.zero == 3 else 0
    planned = model_states(est) + gathered
    terms = []
    if config.recomputes:  # minipar's checkpoint: the recomputed input's gradient
        plain = estimate(shape, config.replace(recompute_granularity=None,
                                               recompute_method=None,
                                               recompute_num_layers=None), CLUSTER)
        terms.append(("the recomputed layer's input gradient (the checkpoint's leaf)",
                      model_states(est) - model_states(plain)))
    local = stage_parameters(shape, config, rank).numel
    if config.zero == 1:
        terms.append(("stage 1 keeps the whole bf16 gradient: the ZeRO-2 estimator "
                      "partitions it (DeepSpeed has no ZeRO-1 estimator)",
                      2 * (local - -(-local // config.replicas))))
    if config.zero == 3:
        terms.append(("stage 3 partitions both the bf16 parameters and the bf16 gradients "
                      "(2 + 2 bytes); its estimator's 18 bytes per parameter count one of "
                      "them (the ZeRO-2 estimator counts 2 + 18)",
                      2 * -(-local // config.replicas)))
    return {"planned": planned, "terms": terms,
            "compared": planned - sum(b for _, b in terms)}


def planner_megatron(model: str, settings: dict) -> dict:
    """The planner's first stage under Megatron's accounting (weights with optimizer,
    activations), the terms it names against theoretical_memory_usage.py, and what
    remains to compare. Each term: the planner's own estimate, with one assumption of the
    theoretical estimate switched on, subtracted from the one before."""
    shape, config = layout(model, settings, "megatron")

    def figures(shape, config):
        est = estimate(shape, config, CLUSTER)
        first = next(s for s in est.stages if s.rank == 0)
        return model_states(est), first.memory["activations"]

    weights, activations = figures(shape, config)
    terms, now = [], (weights, activations)

    def step(name: str, shape_, config_, what: str = "both") -> None:
        nonlocal now
        after = figures(shape_, config_)
        after = (after[0] if what != "activations" else now[0],
                 after[1] if what != "weights" else now[1])
        terms.append((name, now[0] - after[0], now[1] - after[1]))
        now = after

    sp_path = config.sequence_parallel and config.recompute.selective
    if config.recomputes and not sp_path:
        config = config.replace(recompute_granularity=None, recompute_method=None,
                                recompute_num_layers=None)
        step("recomputation (the estimate counts every layer's activations without SP, "
             "and the checkpoint's input gradient is minipar's)", shape, config)
    if shape.dropout == 0:
        shape = replace(shape, dropout=0.1)
        step("dropout masks (the estimate counts Megatron's default dropout 0.1)", shape,
             config, "activations")

    # the estimate's layer: GELU (two (s, f) tensors), multi-head (3h of Q, K, V); of
    # width 4h on its path without sequence parallelism (10 + 24/t), f on the other
    plain = replace(shape, mlp="gelu", n_kv_head=None, d_ff=shape.d_ff if sp_path else None)
    if plain != shape:
        step("SwiGLU's three (s, f) tensors, grouped K/V and the MLP's width (the estimate's "
             "layer is GPT-3's: GELU, multi-head" + ("" if sp_path else ", f = 4h") + ")",
             plain, config, "activations")
        shape = replace(plain, **{k: getattr(shape, k) for k in ("mlp", "d_ff", "n_kv_head")})
    if shape.bias or shape.position == "learned":
        step("biases and learned positions (the estimate counts neither)",
             replace(shape, bias=False, position="rope"), config, "weights")
    # what the planner's estimates cannot switch, by formula
    if sp_path and shape.dropout > 0:  # the estimate's embedding mask: after the scatter
        first = stage_plans(shape, config)[0]
        with_embedding = -(-first.in_flight // config.virtual_stages)
        penalty = (1 + (config.pp - 1) / (config.pp * config.virtual_stages)
                   if config.virtual_stages > 1 else 1)
        bsh = config.micro_batch_size * shape.seq_len * shape.d_model
        mask = bsh * (with_embedding - penalty * config.pp / config.tp)
        terms.append(("the embedding's dropout mask: minipar drops out before the "
                      "sequence-parallel scatter (whole), Megatron after it (1/t)", 0, mask))
        now = (now[0], now[1] - mask)
    if config.pp == 1:
        head = _head_difference(shape, config, sp_path)
        terms.append(("the head's activations: norm and logits inputs, the fp32 softmax "
                      "and targets (the estimate: " + ("4sbh(1 + V/h)/t" if sp_path else
                                                       "2(sbV/t + sbh)") + ")", 0, head))
        now = (now[0], now[1] - head)
    return {"planned": (weights, activations), "terms": terms, "compared": now}


def _head_difference(shape, config, sp_path: bool) -> float:
    """The planner's head activations under Megatron's accounting minus the theoretical
    estimate's output-layer term (with its 5% where it applies)."""
    b, t, s, h = config.micro_batch_size, config.tp, shape.seq_len, shape.d_model
    vocab = padded_vocab(shape.vocab_size, t)
    a, c = config.bytes.activation, config.bytes.compute
    mine = shape.head_activation_bytes(b, t, config.sequence_parallel, a, c)
    mine += b * s * vocab // t * (4 - a)  # the fp32 softmax (plan/accounting.py)
    if sp_path:
        return mine - 4 * s * b * h * (1 + vocab / h) / t
    return (mine - 2 * (s * b * vocab / t + s * b * h)) * 1.05


# ------------------------------------------------------------------ the table
def comparison(fixture: dict) -> list[dict]:
    rows = []
    for row in fixture["layouts"]:
        out = {"name": row["name"]}
        if row["deepspeed"] is not None:
            mine = planner_deepspeed(row["model"], row["settings"])
            reference = row["deepspeed"]["gpu_bytes"]
            out["deepspeed"] = {**mine, "reference": reference,
                                "ratio": mine["planned"] / reference,
                                "residual": mine["compared"] / reference - 1}
        if row["megatron"] is not None:
            mine = planner_megatron(row["model"], row["settings"])
            reference = (row["megatron"]["weight_and_optimizer_mb"] * MIB,
                         row["megatron"]["activation_mb"] * MIB)
            out["megatron"] = {**mine, "reference": reference,
                               "ratio": tuple(p / r for p, r in zip(mine["planned"],
                                                                    reference, strict=True)),
                               "residual": tuple(c / r - 1 for c, r in zip(
                                   mine["compared"], reference, strict=True))}
        rows.append(out)
    return rows


def format_table(rows: list[dict]) -> str:
    gib = 2**30
    lines = ["| layout | DeepSpeed: planner / estimator (GiB) | ratio | after named terms | "
             "Megatron weights+optimizer: planner / estimate (GiB) | ratio | after | "
             "Megatron activations: planner / estimate (GiB) | ratio | after |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [r["name"]]
        if "deepspeed" in r:
            d = r["deepspeed"]
            cells += [f"{d['planned'] / gib:.2f} / {d['reference'] / gib:.2f}",
                      f"{d['ratio']:.3f}", f"{d['residual']:+.2%}"]
        else:
            cells += ["- (no ZeRO-0 estimator)", "", ""]
        if "megatron" in r:
            m = r["megatron"]
            for i in (0, 1):
                cells += [f"{m['planned'][i] / gib:.2f} / {m['reference'][i] / gib:.2f}",
                          f"{m['ratio'][i]:.3f}", f"{m['residual'][i]:+.2%}"]
        else:
            cells += ["- (ZeRO-2/3: not Megatron's)", "", "", "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    names = sorted({t[0] for r in rows for k in ("deepspeed", "megatron") if k in r
                    for t in r[k]["terms"]})
    lines += ["", "named terms (the planner's own difference, measured by switching the "
                  "reference's assumption on):"] + [f"- {n}" for n in names]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="JSON", help="call the references, write the "
                        "fixture (needs deepspeed and MINIPAR_MEGATRON_LM)")
    parser.add_argument("--table", action="store_true",
                        help="the planner against the fixture, as a markdown table")
    args = parser.parse_args()
    if args.write:
        path = os.environ.get("MINIPAR_MEGATRON_LM")
        if not path:
            parser.error("set MINIPAR_MEGATRON_LM to a Megatron-LM checkout")
        pathlib.Path(args.write).write_text(json.dumps(reference_numbers(path), indent=1)
                                            + "\n")
    if args.table or not args.write:
        print(format_table(comparison(json.loads(FIXTURE.read_text()))))


if __name__ == "__main__":
    main()
