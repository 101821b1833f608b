"""Which launcher of an export runs the job a plan priced, and the `minipar plan`
command that prices the other's (export.py writes both launchers into launch.sh).

    launchers(shape, config)          # {"torchrun": {}, "deepspeed": {...}}: who differs
    launch_note(shape, config, cmd)   # launch.sh's lines saying so
    plan_command(args, config, moe)   # "minipar plan --model gpt2-xl --dp 4 ... --zero 1"

The two launchers run two jobs, which a plan prices alike except where the systems
differ in what it models: whose bytes (--memory-accounting megatron or deepspeed), how
many gradient reductions are in flight (Megatron-LM's distributed optimizer: no limit,
megatron/core/distributed/param_and_grad_buffer.py; DeepSpeed's ZeRO: two, its IPG
buffers in deepspeed/runtime/zero/stage_1_and_2.py) and, with a pipeline, whether they
overlap backward at all (DeepSpeed's pipeline engine reduces after the flush:
deepspeed/runtime/pipe/engine.py, _exec_reduce_grads; it runs ZeRO-0/1 only).

plan_command's model and cluster are the flags the user gave (`args`, as `minipar plan`
parsed them); its layout is `config` itself, every setting that differs from what the
command would otherwise take (ParallelConfig's defaults, or --example bloom's), so a
search's winner comes back as that one layout. Each setting is a flag of its own name
(cli.add_plan_command: the trainer's Layout flags and the planner's own).
"""

from __future__ import annotations

import shlex
from dataclasses import fields

from minipar.errors import flag as setting_flag
from minipar.parallel.zero.sharded import MAX_IN_FLIGHT
from minipar.plan import presets
from minipar.plan.layout import ParallelConfig
from minipar.plan.shapes import ModelShape

# what each launcher's job is, in the words of the notes
LAUNCHERS = {"torchrun": "Megatron-LM", "deepspeed": "Megatron-DeepSpeed"}
DIFFERENCES = {("memory_accounting", "megatron"): "Megatron-LM's bytes",
               ("memory_accounting", "deepspeed"): "DeepSpeed's bytes",
               ("reductions_in_flight", None): "no limit of gradient reductions in flight "
                                               "(its distributed optimizer)",
               ("reductions_in_flight", MAX_IN_FLIGHT): "two gradient reductions in flight "
                                                        "(overlap_comm)",
               ("overlap_grad_reduce", False): "its gradients reduced after the pipeline's "
                                               "flush (DeepSpeed's pipeline engine)"}


def launchers(shape: ModelShape, config: ParallelConfig) -> dict[str, dict]:
    """{launcher: the settings in which its job differs from the plan's} ({}: it runs
    the job the plan priced), for the launchers that can run the layout (torchrun:
    Megatron-LM, ZeRO-0/1; deepspeed: Megatron-DeepSpeed). Only differences that change
    the plan count: the accounting of another system than the plan's (paper counts
    neither), a limit of reductions in flight where one can change the step
    (ParallelConfig.reductions_limit_moot), and, with a pipeline whose buckets the plan
    reduces during backward, DeepSpeed's reduction after the flush."""
    moe, jobs = shape.is_moe, {}
    limited = config.reductions_limit_moot(moe) is None
    overlapped = (config.overlap_grad_reduce and config.bucket_size_mb > 0 and not moe
                  and config.zero < 3 and config.replicas > 1)
    for launcher, system, own, limit in (("torchrun", "megatron", "deepspeed", None),
                                         ("deepspeed", "deepspeed", "megatron",
                                          MAX_IN_FLIGHT)):
        if launcher == "torchrun" and config.zero > 1:
            continue  # (Megatron-LM has no ZeRO-2/3: the script says so)
        changes = {}
        if config.memory_accounting == own:
            changes["memory_accounting"] = system
        if launcher == "deepspeed" and config.pp > 1 and overlapped:
            changes["overlap_grad_reduce"] = False
        elif limited and config.reductions_in_flight != limit:
            changes["reductions_in_flight"] = limit
        jobs[launcher] = changes
    return jobs


def launch_note(shape: ModelShape, config: ParallelConfig, command=None) -> str:
    """launch.sh's lines on which launcher runs the job the plan priced, and the plan
    of each other one's (`command(config)`: its `minipar plan` command, or None; without
    it, the flags that change), where the launchers' jobs differ from the plan's."""
    jobs = launchers(shape, config)
    if not any(jobs.values()):
        return ""
    same = [f"LAUNCHER={name} ({LAUNCHERS[name]})" for name, changes in jobs.items()
            if not changes]
    lines = [f"# {' and '.join(same)} runs the job this plan priced." if same else
             "# Neither launcher runs the job this plan priced."]
    for name, changes in jobs.items():
        if not changes:
            continue
        other = config.replace(**changes)
        text = command(other) if command is not None else None
        if text is None:
            text = "this plan with " + " ".join(
                word for name, value in changes.items() for word in _flag(name, value))
        lines.append(f"# LAUNCHER={name} ({LAUNCHERS[name]}) runs this layout with "
                     + ", ".join(DIFFERENCES[item] for item in changes.items())
                     + f"; that job's plan:\n#   {text}")
    return "\n".join(lines) + "\n"


# the flags that say the model and the cluster (not the layout: config has it)
MODEL_AND_CLUSTER = ("model", "example", "n_layer", "d_model", "n_head", "vocab_size",
                     "seq_len", "tie_embeddings", "moe_num_experts", "moe_top_k",
                     "moe_capacity_factor", "moe_layer_freq", "cluster", "gpu_mem",
                     "gpus_per_node", "efficiency", "attention_kernel")
MESH = ("dp", "tp", "pp", "cp", "ep")
# said even at their defaults: a layout needs --dp/--tp/--pp to be evaluated, not
# searched, and the batch and the attention have defaults of the model's
STATED = ("dp", "tp", "pp", "global_batch_size", "flash_attention")


def plan_command(args, config: ParallelConfig, moe: bool = False) -> str | None:
    """The `minipar plan` command of `config` with `args`' model and cluster (moe: the
    model has experts, so no limit of reductions in flight is given); None if a setting
    has no flag that says it."""
    words = ["minipar", "plan"]
    for name in MODEL_AND_CLUSTER:
        value = getattr(args, name, None)
        if value is not None:
            words += _flag(name, value)
    example = getattr(args, "example", None) is not None
    base = presets.BLOOM_176B if example else ParallelConfig()
    for f in fields(ParallelConfig):
        name, value = f.name, getattr(config, f.name)
        if name == "grad_accum_steps" or example and name in MESH:
            continue  # (derived from the batch; the example's mesh is its own)
        if name == "reductions_in_flight":  # (the default follows the accounting)
            default = None if config.memory_accounting == "megatron" else MAX_IN_FLIGHT
            if config.reductions_limit_moot(moe) is not None or value == default:
                continue
        elif value == getattr(base, name) and (example or name not in STATED):
            continue
        try:
            words += _flag(name, value)
        except ValueError:
            return None
    return shlex.join(words)


def _flag(name: str, value) -> list[str]:
    """The words that give setting `name` the value `value`."""
    flag = setting_flag(name)
    if name == "reductions_in_flight":
        return [flag, "unlimited" if value is None else str(value)]
    if name == "reshard_after_forward":  # (true, false or K)
        return [flag, str(value).lower()]
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    if value is None:
        raise ValueError(f"{flag} has no word for None")
    if isinstance(value, tuple):
        return [flag, ",".join(map(str, value))]
    return [flag, str(value)]
