"""Carry a plan to a real cluster: a DeepSpeed config, Megatron-LM arguments, a launcher.

    files = write_export("out/", shape, config, cluster)
    # out/ds_config.json    DeepSpeed: batch sizes, bf16, ZeRO stage, optimizer
    # out/megatron_args.txt Megatron-LM: model shape, tp / pp / sequence parallel,
    #                       micro and global batch, recomputation, precision
    # out/megatron_deepspeed_args.txt   the same for Megatron-DeepSpeed (--zero-stage)
    # out/launch.sh         torchrun (Megatron-LM) or deepspeed (Megatron-DeepSpeed)

Megatron-LM sets the parallel sizes and derives data parallelism from the world size:
dp = world / (tp x pp). DeepSpeed checks train_batch_size = micro-batch x accumulation x
dp, so the three batch numbers and the three parallel sizes must agree everywhere; the
tests read the files back and check that they do.

Flag names are those of Megatron-LM's arguments.py (core_r0.x) and of DeepSpeed's config
JSON (deepspeed.ai/docs/config-json). Megatron-LM's own ZeRO-1 is its distributed
optimizer; ZeRO-2/3 need DeepSpeed (Megatron-DeepSpeed passes --zero-stage and reads the
JSON).

launch.sh says which of its two launchers runs the job the plan priced, where they
differ, and the `minipar plan` command that prices the other's (plan/launchers.py).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from minipar.files import atomic_write
from minipar.plan.accounting import reduce_bucket_elements
from minipar.plan.cluster import ClusterSpec
from minipar.plan.launchers import launch_note
from minipar.plan.layout import MINIPAR_ORDER, ParallelConfig
from minipar.plan.shapes import ModelShape

BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
DEFAULT_LR = 3e-4


NVME_PATH = "/local_nvme"  # DeepSpeed's docs' example; set it to the node's NVMe mount


def ddp_bucket_elements(shape: ModelShape, config: ParallelConfig) -> int:
    """Megatron-LM's `--ddp-bucket-size` (parameters) of a plan: its buckets, or with
    bucket_size_mb 0 (one bucket) the whole model, which its default, max(40M, 1M x dp),
    would cut in pieces the plan did not price."""
    return reduce_bucket_elements(config) if config.bucket_size_mb > 0 else shape.n_params


def deepspeed_config(shape: ModelShape, config: ParallelConfig) -> dict:
    """The DeepSpeed config JSON (as a dict) of `config`."""
    ds = {
        "train_batch_size": config.global_batch_size,
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.micro_batches,
        "gradient_clipping": GRAD_CLIP,
        "optimizer": {"type": "AdamW", "params": {
            "lr": config.lr if config.lr is not None else DEFAULT_LR,
            "betas": list(BETAS), "eps": 1e-8, "weight_decay": WEIGHT_DECAY}},
        # overlap_comm: reduce gradient buckets during backward, as the plan priced it;
        # reduce_bucket_size: the plan's buckets (--memory-accounting deepspeed's)
        "zero_optimization": {"stage": config.zero, "overlap_comm": config.overlap_grad_reduce,
                              "contiguous_gradients": True,
                              "reduce_bucket_size": reduce_bucket_elements(config),
                              "allgather_bucket_size": 5e8},
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }
    # ZeRO-Offload / ZeRO-Infinity (deepspeed/runtime/zero/offload_config.py); NVMe needs
    # a path on the node's drive, which the user must set (DeepSpeed requires nvme_path)
    zero = ds["zero_optimization"]
    for key, device in (("offload_optimizer", config.offload_optimizer),
                        ("offload_param", config.offload_param)):
        if device != "none":
            zero[key] = {"device": device, "pin_memory": True}
            if device == "nvme":
                zero[key]["nvme_path"] = NVME_PATH
    # ZeRO-3 across nodes: MiCS (runtime/zero/mics.py) and ZeRO++ (runtime/zero/config.py:
    # zero_hpz_partition_size, zero_quantized_weights, zero_quantized_gradients); FSDP2's
    # reshard_after_forward=K is DeepSpeed's hpZ, =False has no DeepSpeed key
    if config.hsdp_shard_size:
        zero["mics_shard_size"] = config.hsdp_shard_size
        zero["mics_hierarchical_params_gather"] = False
    if config.secondary_partition:
        zero["zero_hpz_partition_size"] = config.secondary_partition
    if config.zero_quantized_weights:
        zero["zero_quantized_weights"] = True
    if config.zero_quantized_gradients:
        zero["zero_quantized_gradients"] = True
    if config.precision == "bf16-mixed":
        ds["bf16"] = {"enabled": True}
        if config.zero <= 1:
            # the plan's gradient buffers (engine.get_data_types): fp32 is DeepSpeed's
            # BF16_Optimizer; its ZeRO-2/3 optimizer accumulates in bf16 whatever this
            # says, plus an fp32 copy of the partition (--memory-accounting deepspeed)
            ds["data_types"] = {"grad_accum_dtype": config.grad_dtype}
    if config.recompute.full:  # DeepSpeed checkpoints whole layers; it has no selective
        ds["activation_checkpointing"] = {"partition_activations": config.tp > 1,
                                          "contiguous_memory_optimization": False,
                                          "cpu_checkpointing": False}
    if config.pp > 1:  # DeepSpeed's pipeline engine reads these from the same file
        ds["pipeline"] = {"stages": config.pp, "partition": "type:transformer"}
    return ds


FLAVORS = ("megatron-lm", "megatron-deepspeed")


def moe_args(shape: ModelShape, config: ParallelConfig, deepspeed: bool) -> list[str]:
    """The MoE shape and ep. Megatron-LM (megatron/core/transformer/moe/README.md): the
    alltoall dispatcher, and with a capacity factor minipar's padded buffers and position
    dropping. Megatron-DeepSpeed (DeepSpeed-MoE): its --moe-expert-parallel-size and
    --moe-train-capacity-factor (its top-k gate is not exported)."""
    e, c = str(shape.moe_num_experts), shape.moe_capacity_factor
    if deepspeed:
        return (["--num-experts", e, "--moe-expert-parallel-size", str(config.ep)]
                + (["--moe-train-capacity-factor", f"{c:g}"] if c is not None else []))
    args = ["--num-experts", e, "--moe-router-topk", str(shape.moe_top_k),
            "--expert-model-parallel-size", str(config.ep),
            "--moe-token-dispatcher-type", "alltoall"]
    if shape.moe_layer_freq > 1:
        args += ["--moe-layer-freq", str(shape.moe_layer_freq)]
    if c is not None:
        args += ["--moe-expert-capacity-factor", f"{c:g}", "--moe-pad-expert-input-to-capacity",
                 "--moe-token-drop-policy", "position"]
    return args


def megatron_args(shape: ModelShape, config: ParallelConfig,
                  flavor: str = "megatron-lm") -> list[str]:
    """Command-line arguments of `config` for pretrain_gpt.py.

    flavor "megatron-lm" (NVIDIA's Megatron-LM): ZeRO-1 is its distributed optimizer,
    uneven pipeline stages are --decoder-first/last-pipeline-num-layers. "megatron-
    deepspeed" (Microsoft's fork, used for BLOOM): ZeRO comes from the DeepSpeed JSON
    (--zero-stage), uneven stages from --pp-partition-method, and it has BLOOM's ALiBi
    and embedding LayerNorm.
    """
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")
    deepspeed = flavor == "megatron-deepspeed"
    args = [
        "--num-layers", str(shape.n_layer),
        "--hidden-size", str(shape.d_model),
        "--num-attention-heads", str(shape.n_head),
        "--ffn-hidden-size", str(shape.ffn),
        "--seq-length", str(shape.seq_len),
        "--max-position-embeddings", str(shape.seq_len),
        "--tensor-model-parallel-size", str(config.tp),
        "--pipeline-model-parallel-size", str(config.pp),
        *(["--context-parallel-size", str(config.cp)] if config.cp > 1 and not deepspeed
          else []),
        "--micro-batch-size", str(config.micro_batch_size),
        "--global-batch-size", str(config.global_batch_size),
        "--lr", f"{config.lr if config.lr is not None else DEFAULT_LR:g}",
        "--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]),
        "--weight-decay", str(WEIGHT_DECAY), "--clip-grad", str(GRAD_CLIP),
    ]
    if shape.kv_heads != shape.n_head:
        args += ["--group-query-attention", "--num-query-groups", str(shape.kv_heads)]
    if shape.mlp == "swiglu":
        args.append("--swiglu")
    if shape.norm == "rmsnorm":
        args += ["--normalization", "RMSNorm"]
    if not shape.bias:
        args.append("--disable-bias-linear")
    if shape.position in ("rope", "alibi"):  # alibi: Megatron-DeepSpeed only (BLOOM)
        args += ["--position-embedding-type", shape.position]
    if shape.embedding_norm:
        args.append("--embed-layernorm")  # Megatron-DeepSpeed only (BLOOM)
    if not shape.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if shape.is_moe:
        args += moe_args(shape, config, deepspeed)
    if config.virtual_stages > 1:
        per_chunk = shape.n_layer // (config.pp * config.virtual_stages)
        args += ["--num-layers-per-virtual-pipeline-stage", str(per_chunk)]
    if config.sequence_parallel:
        args.append("--sequence-parallel")
    recompute = config.recompute  # Megatron-LM's own flags (minipar.nn.recompute)
    if recompute.selective:
        args += ["--recompute-granularity", "selective"]
    elif recompute.full:
        args += ["--recompute-granularity", "full", "--recompute-method", recompute.method,
                 "--recompute-num-layers", str(recompute.num_layers)]
    if config.flash_attention:
        args.append("--use-flash-attn")
    if config.precision == "bf16-mixed":
        args.append("--bf16")
        if config.grad_dtype == "bf16":  # else Megatron's default: fp32 main_grad buffers
            args.append("--grad-reduce-in-bf16")
    # Megatron's defaults are 0.1: say the plan's (a preset planned without dropout keeps
    # no masks, and the plan counts none)
    args += ["--attention-dropout", f"{shape.dropout:g}", "--hidden-dropout",
             f"{shape.dropout:g}"]
    if deepspeed:
        args += ["--zero-stage", str(config.zero)]
        if config.layer_split is not None:
            # the embedding and the head count as layers when partitioning (BLOOM)
            args += ["--pp-partition-method", "type:transformer|embedding"]
    else:
        if config.zero == 1:
            args.append("--use-distributed-optimizer")  # Megatron's ZeRO-1
        if config.cross_entropy_loss_fusion:  # (Megatron-LM's default is the unfused loss)
            args.append("--cross-entropy-loss-fusion")
        # the overlaps the plan's time assumes (plan/overlap.py, timing.py), and its
        # gradient buckets: Megatron-LM's --ddp-bucket-size counts parameters
        if config.overlap_grad_reduce and config.replicas > 1:
            args.append("--overlap-grad-reduce")
        if config.overlap_param_gather:
            args.append("--overlap-param-gather")
        if config.tp_comm_overlap and config.tp > 1:
            args.append("--tp-comm-overlap")
        if config.overlap_grad_reduce and config.replicas > 1:
            args += ["--ddp-bucket-size", str(ddp_bucket_elements(shape, config))]
        if config.fp8_format is not None:  # Transformer Engine's FP8 (plan/fp8.py)
            args += ["--fp8-format", config.fp8_format]
            if config.fp8_param_gather:
                args.append("--fp8-param-gather")
        if keeps_minipars_order(shape, config):
            args.append("--use-tp-pp-dp-mapping")
        if config.layer_split is not None and config.virtual_stages == 1:
            args += ["--decoder-first-pipeline-num-layers", str(config.layer_split[0]),
                     "--decoder-last-pipeline-num-layers", str(config.layer_split[-1])]
    return args


def keeps_minipars_order(shape: ModelShape, config: ParallelConfig) -> bool:
    """Whether the Megatron-LM job takes --use-tp-pp-dp-mapping, to lay its ranks out as
    minipar's mesh and the plan do (dp slowest; its default puts pp slowest). Only when
    the order matters (dp and pp both over 1), and not for experts with a pipeline unless
    ep == cp: Megatron-LM then requires the pp-last order (parallel_state.py,
    initialize_model_parallel: "When not using pp-last rank ordering, the data parallel
    size of the attention and moe layers must be the same")."""
    return _order_matters(config) and (not shape.is_moe or config.ep == config.cp)


def _order_matters(config: ParallelConfig) -> bool:
    """minipar's order, with dp and pp both over 1: where Megatron-LM's would differ."""
    return config.rank_order == MINIPAR_ORDER and config.pp > 1 and config.dp > 1


def launch_script(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
                  command=None) -> str:
    """A shell script that launches the run on every node: torchrun for Megatron-LM, or
    (LAUNCHER=deepspeed) the deepspeed launcher for Megatron-DeepSpeed with
    ds_config.json. command: launch_note's."""
    gpn = cluster.gpus_per_node
    nodes = -(-config.world_size // gpn)
    per_node = min(gpn, config.world_size)
    lm = "\n    ".join(_pairs(megatron_args(shape, config, "megatron-lm")))
    ds = "\n    ".join(_pairs(megatron_args(shape, config, "megatron-deepspeed")))
    note = ("" if config.zero <= 1 else
            f"# Megatron-LM has no ZeRO-{config.zero}: use LAUNCHER=deepspeed.\n")
    if config.cp > 1:  # (Megatron-DeepSpeed's sequence parallelism is Ulysses, not a ring)
        note += ("# Context parallelism (ring attention) is Megatron-LM's "
                 "--context-parallel-size: use LAUNCHER=torchrun.\n")
    if _order_matters(config) and not keeps_minipars_order(shape, config):
        note += ("# Megatron-LM lays experts with a pipeline out in its own order (pp "
                 "slowest), not the plan's: plan with --rank-order tp-cp-ep-dp-pp.\n")
    if config.fp8_format is not None:  # (DeepSpeed's config has no FP8 setting)
        note += ("# FP8 (Transformer Engine) is Megatron-LM's --fp8-format: with "
                 "LAUNCHER=deepspeed the job runs in bf16.\n")
    note += launch_note(shape, config, command)
    return f"""#!/usr/bin/env bash
# Written by `minipar plan --export`: {shape.name} on {config.world_size} GPUs
# ({nodes} node(s) x {per_node}) = dp {config.dp} x tp {config.tp} x pp {config.pp}\
{f" x cp {config.cp}" if config.cp > 1 else ""}.
# Global batch {config.global_batch_size} = micro-batch {config.micro_batch_size} x \
{config.micro_batches} accumulation steps x dp {config.dp}.
# Set MASTER_ADDR and NODE_RANK on each node; add your data and tokenizer arguments.
{note}set -euo pipefail
NNODES={nodes}
GPUS_PER_NODE={per_node}
MASTER_ADDR=${{MASTER_ADDR:-localhost}}
MASTER_PORT=${{MASTER_PORT:-6000}}
NODE_RANK=${{NODE_RANK:-0}}
LAUNCHER=${{LAUNCHER:-torchrun}}

MEGATRON_LM_ARGS=(
    {lm}
)
MEGATRON_DEEPSPEED_ARGS=(
    {ds}
)

if [ "$LAUNCHER" = "torchrun" ]; then
    # NVIDIA Megatron-LM
    torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "$NODE_RANK" \\
        --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \\
        pretrain_gpt.py "${{MEGATRON_LM_ARGS[@]}}" "$@"
else
    # Microsoft Megatron-DeepSpeed (batch sizes and ZeRO stage also in ds_config.json)
    deepspeed --num_nodes "$NNODES" --num_gpus "$GPUS_PER_NODE" --hostfile hostfile \\
        pretrain_gpt.py "${{MEGATRON_DEEPSPEED_ARGS[@]}}" --deepspeed \\
        --deepspeed_config ds_config.json "$@"
fi
"""


def _pairs(args: list[str]) -> list[str]:
    """Group "--flag value" pairs on one line each, quoted for the shell."""
    lines, i = [], 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            lines.append(f"{args[i]} {shlex.quote(args[i + 1])}")
            i += 2
        else:
            lines.append(args[i])
            i += 1
    return lines


def write_export(directory, shape: ModelShape, config: ParallelConfig,
                 cluster: ClusterSpec, command=None) -> dict[str, Path]:
    """Write ds_config.json, megatron_args.txt (Megatron-LM), megatron_deepspeed_args.txt
    and launch.sh into `directory`. command: launch_note's."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "deepspeed": directory / "ds_config.json",
        "megatron": directory / "megatron_args.txt",
        "megatron_deepspeed": directory / "megatron_deepspeed_args.txt",
        "launch": directory / "launch.sh",
    }
    texts = {"deepspeed": json.dumps(deepspeed_config(shape, config), indent=2) + "\n",
             "launch": launch_script(shape, config, cluster, command)}
    for key, flavor in (("megatron", "megatron-lm"),
                        ("megatron_deepspeed", "megatron-deepspeed")):
        texts[key] = "\n".join(_pairs(megatron_args(shape, config, flavor))) + "\n"
    for key, path in files.items():  # each whole or not at all (minipar.files)
        with atomic_write(path, "w") as f:
            f.write(texts[key])
    files["launch"].chmod(0o755)
    return files
