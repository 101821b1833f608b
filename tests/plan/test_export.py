"""The exported DeepSpeed config, Megatron-LM arguments and launch script agree with
each other and with the plan on every batch and parallel size."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from dataclasses import replace

import pytest

from minipar.plan import presets
from minipar.plan.export import deepspeed_config, megatron_args, write_export
from minipar.plan.layout import ParallelConfig

LAYOUTS = {
    "bloom": presets.bloom_example(),
    "llama2-70b interleaved": (
        presets.model("llama2-70b"),
        ParallelConfig(dp=8, tp=4, pp=2, zero=1, schedule="interleaved", virtual_stages=2,
                       micro_batch_size=1, global_batch_size=1024, sequence_parallel=True,
                       flash_attention=True, lr=1.5e-4),
        presets.cluster("h100")),
    "gpt2 zero3": (presets.model("gpt2"), ParallelConfig(dp=8, zero=3, micro_batch_size=8,
                                                         global_batch_size=512),
                   presets.cluster("a100")),
}


def parse_flags(text: str) -> dict[str, str | bool]:
    tokens = shlex.split(text)
    flags, i = {}, 0
    while i < len(tokens):
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            flags[tokens[i]] = tokens[i + 1]
            i += 2
        else:
            flags[tokens[i]] = True
            i += 1
    return flags


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_exported_files_agree_on_batch_and_parallel_sizes(name, tmp_path):
    shape, config, cluster = LAYOUTS[name]
    files = write_export(tmp_path, shape, config, cluster)
    ds = json.loads(files["deepspeed"].read_text())
    args = parse_flags(files["megatron"].read_text())
    launch = files["launch"].read_text()
    tp = int(args["--tensor-model-parallel-size"])
    pp = int(args["--pipeline-model-parallel-size"])
    nodes = int(re.search(r"^NNODES=(\d+)$", launch, re.M).group(1))
    per_node = int(re.search(r"^GPUS_PER_NODE=(\d+)$", launch, re.M).group(1))
    world = nodes * per_node
    dp = world // (tp * pp)  # how Megatron-LM and DeepSpeed derive it
    assert (dp, tp, pp, world) == (config.dp, config.tp, config.pp, config.world_size)
    # DeepSpeed's own check, and Megatron's global batch the same number
    assert ds["train_batch_size"] == (ds["train_micro_batch_size_per_gpu"]
                                      * ds["gradient_accumulation_steps"] * dp)
    assert ds["train_batch_size"] == int(args["--global-batch-size"]) == \
        config.global_batch_size
    assert ds["train_micro_batch_size_per_gpu"] == int(args["--micro-batch-size"])
    assert ds["zero_optimization"]["stage"] == config.zero
    assert f"--zero-stage {config.zero}" in launch
    assert int(args["--num-layers"]) == shape.n_layer
    assert float(args["--lr"]) == pytest.approx(ds["optimizer"]["params"]["lr"])
    if "--num-layers-per-virtual-pipeline-stage" in args:
        chunk = int(args["--num-layers-per-virtual-pipeline-stage"])
        assert chunk * pp * config.virtual_stages == shape.n_layer
    # the Megatron-DeepSpeed arguments and the launch script carry the same sizes
    ds_args = parse_flags(files["megatron_deepspeed"].read_text())
    assert int(ds_args["--zero-stage"]) == config.zero
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--micro-batch-size", "--global-batch-size"):
        assert ds_args[flag] == args[flag]
        assert launch.count(f"{flag} {args[flag]}") == 2  # both launchers


def test_llama_architecture_flags():
    shape, config, _ = LAYOUTS["llama2-70b interleaved"]
    args = parse_flags(" ".join(megatron_args(shape, config)))
    assert args["--num-query-groups"] == "8" and args["--ffn-hidden-size"] == "28672"
    for flag in ("--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                 "--sequence-parallel", "--use-flash-attn", "--bf16",
                 "--use-distributed-optimizer"):
        assert args[flag] is True
    assert args["--normalization"] == "RMSNorm"
    assert args["--position-embedding-type"] == "rope"


def test_bloom_recomputation_and_stage_split():
    shape, config, _ = LAYOUTS["bloom"]
    args = parse_flags(" ".join(megatron_args(shape, config)))
    assert args["--recompute-granularity"] == "full"
    assert args["--decoder-first-pipeline-num-layers"] == "5"
    assert args["--decoder-last-pipeline-num-layers"] == "5"
    ds = deepspeed_config(shape, config)
    assert ds["bf16"] == {"enabled": True} and ds["pipeline"]["stages"] == 12


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_launch_script_is_valid_bash(tmp_path):
    files = write_export(tmp_path, *LAYOUTS["bloom"])
    subprocess.run(["bash", "-n", str(files["launch"])], check=True)


@pytest.mark.parametrize("settings, expected", [
    (dict(recompute_granularity="selective"), ["--recompute-granularity", "selective"]),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
     ["--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "2"]),
    (dict(recompute_granularity="full"),
     ["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"]),
])
def test_recomputation_exports_megatrons_flags(settings, expected):
    shape = presets.model("gpt2")
    config = ParallelConfig(dp=2, pp=2, micro_batch_size=1, grad_accum_steps=4, **settings)
    args = megatron_args(shape, config)
    start = args.index("--recompute-granularity")
    assert args[start:start + len(expected)] == expected
    # DeepSpeed checkpoints whole layers (its activation_checkpointing section); it has
    # no selective recomputation
    ds = deepspeed_config(shape, config)
    assert ("activation_checkpointing" in ds) == config.recompute.full


@pytest.mark.parametrize("optimizer, param", [("cpu", "none"), ("cpu", "cpu"),
                                              ("nvme", "nvme")])
def test_offload_writes_deepspeeds_offload_keys(optimizer, param):
    config = ParallelConfig(dp=8, zero=3 if param != "none" or optimizer == "nvme" else 2,
                            micro_batch_size=8, global_batch_size=512,
                            offload_optimizer=optimizer, offload_param=param)
    zero = deepspeed_config(presets.model("gpt2"), config)["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == optimizer
    if param == "none":
        assert "offload_param" not in zero
    else:
        assert zero["offload_param"]["device"] == param
    if optimizer == "nvme":  # DeepSpeed refuses NVMe offload without a path
        assert zero["offload_optimizer"]["nvme_path"]


def test_no_offload_keys_without_offload():
    zero = deepspeed_config(*LAYOUTS["gpt2 zero3"][:2])["zero_optimization"]
    assert "offload_optimizer" not in zero and "offload_param" not in zero


def test_mixtral_exports_its_experts_and_expert_parallelism():
    mixtral = presets.model("mixtral-8x7b")
    config = ParallelConfig(dp=64, ep=8, zero=1, global_batch_size=1024)
    args = " ".join(megatron_args(mixtral, config))
    assert ("--num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 8 "
            "--moe-token-dispatcher-type alltoall") in args
    assert "capacity" not in args  # dropless
    capped = replace(mixtral, moe_capacity_factor=1.25)
    assert "--moe-expert-capacity-factor 1.25 --moe-pad-expert-input-to-capacity" in " ".join(
        megatron_args(capped, config))
    fork = " ".join(megatron_args(capped, config, flavor="megatron-deepspeed"))
    assert "--moe-expert-parallel-size 8" in fork and "--moe-train-capacity-factor 1.25" in fork


@pytest.mark.parametrize("grad_accum_dtype", [None, "fp32", "bf16"])
def test_the_export_describes_the_planned_gradient_buffers(grad_accum_dtype):
    # Megatron-LM with --bf16 keeps fp32 main_grad buffers unless --grad-reduce-in-bf16:
    # the flag is there exactly when the plan counted bf16 ones
    shape = presets.model("llama2-13b")
    config = ParallelConfig(dp=16, zero=1, micro_batch_size=1, global_batch_size=1024,
                            flash_attention=True, grad_accum_dtype=grad_accum_dtype)
    args = parse_flags(" ".join(megatron_args(shape, config)))
    assert ("--grad-reduce-in-bf16" in args) == (config.grad_dtype == "bf16")
    assert config.bytes.grad == (2 if "--grad-reduce-in-bf16" in args else 4)
    ds = deepspeed_config(shape, config)
    assert ds["data_types"]["grad_accum_dtype"] == config.grad_dtype


def test_the_export_sets_the_planned_dropout():
    # Megatron's defaults are 0.1; a preset planned without dropout says 0
    for shape in (presets.model("llama2-7b"), replace(presets.model("gpt2"), dropout=0.1)):
        args = parse_flags(" ".join(megatron_args(shape, ParallelConfig(dp=8))))
        assert args["--attention-dropout"] == args["--hidden-dropout"] == f"{shape.dropout:g}"


def test_the_export_names_the_planned_loss():
    # Megatron-LM's default is the unfused loss; the plan's default, the fused kernel,
    # is its --cross-entropy-loss-fusion. Megatron-DeepSpeed has no such flag.
    shape = presets.model("llama2-7b")
    fused, unfused = (ParallelConfig(dp=8, zero=1, cross_entropy_loss_fusion=f)
                      for f in (True, False))
    assert parse_flags(" ".join(megatron_args(shape, fused)))["--cross-entropy-loss-fusion"]
    assert "--cross-entropy-loss-fusion" not in megatron_args(shape, unfused)
    assert "--cross-entropy-loss-fusion" not in megatron_args(shape, fused, "megatron-deepspeed")


def test_deepspeed_overlap_comm_is_the_plans_overlap():
    # the JSON describes the job the plan priced: BLOOM's example reduces after the flush,
    # as DeepSpeed's pipeline engine does; a ZeRO-3 plan overlaps the buckets with backward
    shape, bloom, _ = presets.bloom_example()
    assert deepspeed_config(shape, bloom)["zero_optimization"]["overlap_comm"] is False
    gpt2, zero3, _ = LAYOUTS["gpt2 zero3"]
    assert deepspeed_config(gpt2, zero3)["zero_optimization"]["overlap_comm"] is True


def test_context_parallelism_is_exported_as_megatron_lms_context_parallel_size(tmp_path):
    # dp x tp x pp x cp = world: without --context-parallel-size Megatron-LM would take
    # the cp ranks for data parallelism, another job than the plan's
    shape = presets.model("llama3-8b")
    config = ParallelConfig(dp=2, tp=2, pp=1, cp=2, zero=1, sequence_parallel=True,
                            global_batch_size=8)
    args = megatron_args(shape, config, "megatron-lm")
    assert args[args.index("--context-parallel-size") + 1] == "2"
    assert "--context-parallel-size" not in megatron_args(shape, config, "megatron-deepspeed")
    files = write_export(tmp_path, shape, config, presets.cluster("h100-80gb"))
    launch = files["launch"].read_text()
    assert "dp 2 x tp 2 x pp 1 x cp 2" in launch and "use LAUNCHER=torchrun" in launch


def test_the_export_sets_the_overlaps_and_buckets_the_plan_priced():
    # the planned step assumes them (plan/overlap.py, timing.tp_overlap_hidden): a job
    # without them is another, slower job
    shape = presets.model("llama3-8b")
    config = ParallelConfig(dp=4, tp=2, zero=1, sequence_parallel=True,
                            tp_comm_overlap=True, overlap_param_gather=True,
                            bucket_size_mb=80.0, global_batch_size=16)
    args = megatron_args(shape, config, "megatron-lm")
    for flag in ("--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap"):
        assert flag in args
    # 80 MiB of bf16 parameters: 40 Mi parameters, Megatron-LM's --ddp-bucket-size unit,
    # and DeepSpeed's reduce_bucket_size's
    assert args[args.index("--ddp-bucket-size") + 1] == str(40 * 2**20)
    assert deepspeed_config(shape, config)["zero_optimization"]["reduce_bucket_size"] == (
        40 * 2**20)
    # one bucket (bucket_size_mb 0): for Megatron-LM the whole model, where its default
    # (max(40M, 1M x dp)) would cut a model of 8B parameters in pieces; DeepSpeed keeps
    # its default 5e8, at which it allocates its reduction buffers (and which
    # --memory-accounting deepspeed prices)
    one = config.replace(bucket_size_mb=0.0)
    whole = megatron_args(shape, one, "megatron-lm")
    assert whole[whole.index("--ddp-bucket-size") + 1] == str(shape.n_params)
    assert deepspeed_config(shape, one)["zero_optimization"]["reduce_bucket_size"] == 5e8
    plain = megatron_args(shape, config.replace(
        overlap_grad_reduce=False, overlap_param_gather=False, tp_comm_overlap=False,
        bucket_size_mb=0.0), "megatron-lm")
    assert not {"--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
                "--ddp-bucket-size"} & set(plain)


def test_the_megatron_export_keeps_the_plans_rank_order():
    # minipar's mesh keeps dp slowest: Megatron-LM's --use-tp-pp-dp-mapping; its default
    # order (pp slowest) needs no flag, and the order only matters with both dp and pp
    shape, config, _ = LAYOUTS["llama2-70b interleaved"]
    assert "--use-tp-pp-dp-mapping" in megatron_args(shape, config, "megatron-lm")
    megatrons = config.replace(rank_order="tp-cp-ep-dp-pp")
    assert "--use-tp-pp-dp-mapping" not in megatron_args(shape, megatrons, "megatron-lm")
    assert "--use-tp-pp-dp-mapping" not in megatron_args(
        shape, config.replace(pp=1, schedule="1f1b", virtual_stages=1, dp=16), "megatron-lm")


def test_experts_with_a_pipeline_keep_megatrons_order_and_the_launcher_says_so(tmp_path):
    # Megatron-LM refuses --use-tp-pp-dp-mapping when experts and a pipeline make the
    # expert data-parallel size differ from the dense one (ep != cp; parallel_state.py)
    shape = presets.model("mixtral-8x7b")
    config = ParallelConfig(dp=8, tp=2, pp=2, ep=4, zero=1, global_batch_size=64)
    files = write_export(tmp_path, shape, config, presets.cluster("h100"))
    assert "--use-tp-pp-dp-mapping" not in files["megatron"].read_text()
    assert "--rank-order tp-cp-ep-dp-pp" in files["launch"].read_text()
    assert "--use-tp-pp-dp-mapping" in megatron_args(shape, config.replace(ep=1),
                                                     "megatron-lm")
