"""`minipar plan`: the planner on the command line.

    minipar plan --model llama2-70b --gpus 64 --gpu-mem 80        search, rank, explain
    minipar plan --model gpt2-xl --dp 4 --tp 2 --zero 1 ...        estimate and lint a layout
    minipar plan --example bloom                                   the BLOOM-176B layout
    minipar plan --model mixtral-8x7b --dp 64 --ep 8 --zero 1 ...   an MoE layout
    minipar plan --compare-published     the time model vs Narayanan et al. 2021, Table 1
    ... --json [PATH]        the same as JSON (stdout without PATH)
    ... --export DIR         ds_config.json, megatron_args.txt and launch.sh of the layout

The lead wires it into minipar.cli: `add_plan_command(subparsers)` adds the subcommand,
`run_plan(args)` runs it and returns the exit status (2 for bad settings, with a one-line
message naming the flag, as `minipar train` does). This module is long because it is
every flag of `minipar plan` and the checks that keep a flag from being ignored: a preset
fixes the model's shape, a search (`--gpus` alone) chooses the layout's settings itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
from dataclasses import fields, replace

from minipar.errors import ConfigError, OutputError
from minipar.files import atomic_write
from minipar.parallel.zero.sharded import MAX_IN_FLIGHT
from minipar.plan import presets, published, published_dgxc, published_h100, published_mpt
from minipar.plan.accounting import ACCOUNTINGS
from minipar.plan.advice import format_ranking
from minipar.plan.advisor import advise
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import estimate
from minipar.plan.export import write_export
from minipar.plan.launchers import launch_note, plan_command
from minipar.plan.layout import (
    FP8_FORMATS,
    MEGATRON_ORDER,
    MINIPAR_ORDER,
    RANK_ORDERS,
    ParallelConfig,
)
from minipar.plan.lint import lint
from minipar.plan.shapes import ModelShape
from minipar.train.config import ModelSettings, check_learning_rate, moe_setting_without_experts
from minipar.train.flags import add_setting_flags
from minipar.train.layout import Layout
from minipar.train.outputs import check_output_dir, check_output_file

LAYOUT_FLAGS = ("dp", "tp", "pp", "cp", "ep")
UNLIMITED = "unlimited"  # --reductions-in-flight's word for None
# --compare-published's sources, as --source names them
TABLE_1 = "Narayanan et al. 2021, Table 1"
PUBLISHED_SOURCES = {"table1": TABLE_1, "readme": published_h100.README,
                     "llama3": published_h100.LLAMA3, "automodel": published_h100.AUTOMODEL,
                     "mpt": published_mpt.MPT, "dgxc": published_dgxc.DGXC,
                     "dgxc-25": published_dgxc.DGXC_LATER,
                     "dgxc-fp8": published_dgxc.DGXC_FP8,
                     "dgxc-25-fp8": published_dgxc.DGXC_FP8_LATER}
CUSTOM_SHAPE_FLAGS = ("n_layer", "d_model", "n_head", "vocab_size")
# Megatron-LM's switches that the planner prices, by Megatron-LM's names (--X / --no-X)
MEGATRON_SWITCHES = {
    "tp_comm_overlap": "Transformer Engine pipelines the sequence-parallel all-gathers and "
                       "reduce-scatters with the GEMMs beside them (needs "
                       "--sequence-parallel; a search applies it to every layout with tp > 1)",
    "overlap_param_gather": "the distributed optimizer's (ZeRO-1's) parameter all-gather "
                            "under the next step's forward",
    "fp8_param_gather": "with --fp8-format, the layers' GEMM weights kept as FP8 "
                        "parameters (no bf16 copy beside TE's FP8 one: the plan's memory "
                        "has no FP8 weight cache), cast from the optimizer's shard",
    "cross_entropy_loss_fusion": "the loss as one kernel (the default here, as minipar runs "
                                 "it); --no-cross-entropy-loss-fusion prices Megatron-LM's "
                                 "own default, op by op in fp32, 6x the bytes per logit",
}
# ParallelConfig's settings a plan takes beyond the trainer's layout (an example applies
# those given on top of its own; --layer-split too, parsed apart)
PLAN_SETTINGS = (*MEGATRON_SWITCHES, "lr", "memory_accounting", "flash_attention",
                 "fp8_format", "rank_order", "reductions_in_flight")
# settings of a plan beyond the trainer's layout, which the published runs fix for themselves
PUBLISHED_RUN_SETTINGS = (*PLAN_SETTINGS, "layer_split", "reference_global_batch_size",
                          "reference_lr")
# The layout flags are the trainer's (one per Layout field); unset (None) unless given,
# ParallelConfig's defaults otherwise. A search (--gpus without --dp/--tp/--pp) takes
# these from the user and chooses (advisor.candidate_configs) or prices one way (one
# gradient bucket) every other one: given with a search, it would be ignored.
LAYOUT_SETTINGS = tuple(f.name for f in fields(Layout))
SEARCH_TAKES = ("dp", "tp", "pp", "global_batch_size", "precision", "grad_accum_dtype",
                "overlap_grad_reduce", "zero3_prefetch")
SEARCHED_FLAGS = (*(n for n in LAYOUT_SETTINGS if n not in SEARCH_TAKES), "layer_split")
PLANNER_NOTES = {"global_batch_size": "default: the preset's published one",
                 "bucket_size_mb": "default 0: one bucket",
                 "grad_accum_dtype": "the planner's default under bf16-mixed: fp32, what "
                                     "Megatron-LM and DeepSpeed allocate"}
MOE_FLAGS = {"moe_num_experts": int, "moe_top_k": int, "moe_capacity_factor": float,
             "moe_layer_freq": int}


def add_plan_command(subparsers) -> argparse.ArgumentParser:
    """Add `plan` to an argparse subparsers object; returns its parser."""
    plan = subparsers.add_parser(
        "plan", help="predict memory, traffic and step time of a parallel layout; search "
                     "and explain the best one",
        description="Analytic planner (ZeRO paper, Megatron 2019/2021, Korthikanti 2022) "
                    "proved against minipar's emulator.")
    model = plan.add_argument_group("model")
    model.add_argument("--model", help=f"preset: {', '.join(presets.MODELS)}")
    model.add_argument("--example", choices=("bloom",),
                       help="a published configuration (bloom: BLOOM-176B on 384 A100s)")
    for name, help_text in (("n_layer", "layers (custom model)"),
                            ("d_model", "hidden size (custom model)"),
                            ("n_head", "attention heads (custom model)"),
                            ("vocab_size", "vocabulary (custom model)"),
                            ("seq_len", "sequence length (overrides the preset's)")):
        model.add_argument("--" + name.replace("_", "-"), dest=name, type=int, help=help_text)
    model.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction,
                       dest="tie_embeddings", default=None,
                       help=ModelSettings.__dataclass_fields__["tie_embeddings"].metadata[
                           "help"] + " (default: the preset's; --no-tie-embeddings as in "
                                     "minipar train)")
    for name, kind in MOE_FLAGS.items():  # the trainer's flags (a preset's by default)
        model.add_argument("--" + name.replace("_", "-"), dest=name, type=kind,
                           help=ModelSettings.__dataclass_fields__[name].metadata["help"])
    hardware = plan.add_argument_group("cluster")
    hardware.add_argument("--cluster", default=None,
                          help=f"preset: {', '.join(presets.CLUSTERS)} (default h100-80gb, "
                               f"or {presets.BLOOM_CLUSTER} for --example bloom; 'emulated' "
                               "is the cluster `minipar train` simulates)")
    hardware.add_argument("--gpus", type=int, help="GPUs to plan for")
    hardware.add_argument("--gpu-mem", type=float, dest="gpu_mem",
                          help="memory per GPU in GiB (default: the preset's)")
    hardware.add_argument("--gpus-per-node", type=int, dest="gpus_per_node")
    hardware.add_argument("--efficiency", type=float,
                          help="price every FLOP at this fraction of peak instead of the "
                               "preset's roofline (GEMMs by shape, other ops by bytes)")
    hardware.add_argument("--attention-kernel", dest="attention_kernel",
                          help="price fused (flash) attention at this kernel's measured "
                               "rates: flash2, cudnn, flash3 on H100 (Shah et al. 2024), "
                               "triton (flash2's over Dao 2023's A100 gap), or "
                               "gemm (as one GEMM); default: the preset's (cudnn on H100, "
                               "gemm on A100)")
    layout = plan.add_argument_group("layout (give dp/tp/pp to evaluate one instead of "
                                     "searching)")
    add_setting_flags(layout, Layout, defaults=dict.fromkeys(LAYOUT_SETTINGS),
                      notes=PLANNER_NOTES)
    layout.add_argument("--flash-attention", action=argparse.BooleanOptionalAction,
                        dest="flash_attention", default=None,
                        help="attention that does not keep the (s x s) probabilities "
                             "(default: on for model presets, off for a custom shape, "
                             "as minipar's own attention)")
    layout.add_argument("--memory-accounting", dest="memory_accounting", default=None,
                        choices=ACCOUNTINGS,
                        help="whose bytes: paper (minipar's emulator: the ZeRO paper's model "
                             "states, Korthikanti's activations; default), megatron "
                             "(Megatron-LM: fp32 logits in the loss, in-place gradient "
                             "buffers, its estimate's 5%% for temporaries) or deepspeed "
                             "(bf16 gradients + an fp32 partition, reduce_bucket_size "
                             "buckets, ZeRO-3's largest module gathered); the plan names "
                             "each term it adds (plan/accounting.py). megatron also times "
                             "its distributed optimizer's reductions (no limit in flight: "
                             "--reductions-in-flight's default becomes unlimited)")
    for name, text in MEGATRON_SWITCHES.items():
        flag = name.replace("_", "-")
        layout.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, dest=name,
                            default=None, help=f"Megatron-LM's --{flag}: {text}")
    layout.add_argument("--fp8-format", dest="fp8_format", default=None,
                        choices=FP8_FORMATS,
                        help="Megatron-LM's --fp8-format: the layers' linear GEMMs in FP8 by "
                             "Transformer Engine (e4m3, or hybrid: e5m2 gradients), on the "
                             "GPU's FP8 tensor cores, with TE's casts; attention, embedding "
                             "and output layer stay bf16; needs bf16-mixed, an FP8 GPU "
                             "(h100-80gb) and a dense model. Default: bf16")
    layout.add_argument("--rank-order", dest="rank_order", default=None,
                        choices=RANK_ORDERS,
                        help="how ranks are laid on the nodes, in Megatron-LM's words "
                             "(initialize_model_parallel's order, fastest first): "
                             f"{MINIPAR_ORDER} (minipar's mesh, dp slowest; Megatron-LM's "
                             f"--use-tp-pp-dp-mapping; default) or {MEGATRON_ORDER} "
                             "(Megatron-LM's and DeepSpeed's default, pp slowest): which of "
                             "the pipeline's messages and the data-parallel rings cross "
                             "nodes")
    layout.add_argument("--reductions-in-flight", dest="reductions_in_flight",
                        type=_in_flight, default=None, metavar="N|unlimited",
                        help="ZeRO-1/2's gradient reductions in flight at once under "
                             "--overlap-grad-reduce; one more first waits for the oldest, "
                             "stalling backward: 2, DeepSpeed's overlap_comm (two IPG "
                             "buffers) and minipar's emulator (default), or unlimited, "
                             "Megatron-LM's distributed optimizer (each bucket's "
                             "reduce-scatter launched as it is ready; the default under "
                             "--memory-accounting megatron). Refused where no "
                             "limit changes the plan: ZeRO-0/3, one bucket (--bucket-size-mb "
                             "0), dp x cp = 1, no overlap (--example bloom), an MoE model")
    layout.add_argument("--layer-split", dest="layer_split",
                        help="layers per pipeline stage, e.g. 5,6,6,5")
    layout.add_argument("--lr", type=float, help="learning rate (for lint and export)")
    layout.add_argument("--reference-global-batch-size", type=int,
                        dest="reference_global_batch_size",
                        help="global batch the lr was tuned for (lint)")
    layout.add_argument("--reference-lr", type=float, dest="reference_lr",
                        help="lr tuned for the reference global batch (lint)")
    output = plan.add_argument_group("output")
    output.add_argument("--top", type=int, default=5,
                        help="layouts to list when searching (the first 5 priced by "
                             "simulating their pipeline schedules, as a plan of one "
                             "prices it; the others by its closed form, marked ~)")
    output.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="write JSON to PATH (stdout without PATH) instead of tables")
    output.add_argument("--export", metavar="DIR",
                        help="write the (best) layout as DeepSpeed / Megatron-LM files")
    output.add_argument("--all-stages", action="store_true", dest="all_stages",
                        help="list every pipeline rank (default: first, second, last)")
    output.add_argument("--compare-published", action="store_true", dest="compare_published",
                        help="print the time model against Narayanan et al. 2021, Table 1 "
                             "(A100) and published H100 runs (Megatron-LM's README, Llama 3 "
                             "Table 4, NeMo AutoModel's FSDP2 run, MosaicML's MPT runs, "
                             "NVIDIA's DGX Cloud Benchmarking runs): "
                             "published vs predicted TFLOP/s per GPU, error per row, fitted "
                             "or held out, the assumptions")
    output.add_argument("--source", action="append", choices=tuple(PUBLISHED_SOURCES),
                        help="with --compare-published: only this source's rows (repeat "
                             "for more): table1 (Narayanan et al. 2021, A100), readme "
                             "(Megatron-LM's H100 runs), llama3, automodel (NeMo AutoModel's "
                             "FSDP2 run), mpt (MosaicML's H100 runs), dgxc (NVIDIA's DGX "
                             "Cloud Benchmarking runs of NeMo, DGX H100, release "
                             "v24.11.1), dgxc-25 (its later releases, v25.02-v25.05.01); "
                             "dgxc-fp8, dgxc-25-fp8: the same releases' FP8 tables "
                             "(--fp8-format hybrid)")
    return plan


# ------------------------------------------------------------------ building blocks
def _in_flight(text: str) -> int | str:
    """--reductions-in-flight's N or "unlimited" (kept as the word: None is "not given";
    argparse prints the error after the flag's name)."""
    if text.lower() == UNLIMITED:
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of reductions or unlimited, "
                                         f"got {text!r}") from None


def _shape(args) -> ModelShape:
    custom = [n for n in CUSTOM_SHAPE_FLAGS if getattr(args, n) is not None]
    if (args.example or args.model) and custom:  # a preset's shape is the preset's
        flag, preset = "--" + custom[0].replace("_", "-"), (
            f"--model {args.model}" if args.model else f"--example {args.example}")
        raise ConfigError(custom[0], f"describes a custom model, and {preset} fixes its "
                        f"shape; drop {flag} (or drop --model and give --n-layer, "
                        "--d-model, --n-head and --vocab-size)")
    if args.example == "bloom":
        shape = presets.MODELS["bloom-176b"]
    elif args.model:
        try:
            shape = presets.model(args.model)
        except KeyError as err:
            raise ConfigError("model", err.args[0]) from None
    else:
        missing = [n for n in ("n_layer", "d_model", "n_head", "vocab_size")
                   if getattr(args, n) is None]
        if missing:
            raise ConfigError("model", "give a preset (--model NAME) or a custom shape; "
                            f"missing {', '.join('--' + m.replace('_', '-') for m in missing)}")
        try:
            shape = ModelShape(name="custom", n_layer=args.n_layer, d_model=args.d_model,
                               n_head=args.n_head, vocab_size=args.vocab_size,
                               seq_len=args.seq_len or 1024)
        except ValueError as err:  # "ModelShape.n_layer must be ...": name the flag
            field, _, rest = str(err).removeprefix("ModelShape.").partition(" ")
            raise ConfigError(field if field in CUSTOM_SHAPE_FLAGS + ("seq_len",) else "model",
                            rest if field in CUSTOM_SHAPE_FLAGS + ("seq_len",)
                            else str(err)) from None
    if args.seq_len is not None and args.seq_len != shape.seq_len:
        try:
            shape = shape.with_seq_len(args.seq_len)
        except ValueError as err:
            raise ConfigError("seq_len", str(err).replace("ModelShape.seq_len ", "")) from None
    if args.tie_embeddings is not None:
        shape = replace(shape, tie_embeddings=args.tie_embeddings)
    moe = {name: getattr(args, name) for name in MOE_FLAGS if getattr(args, name) is not None}
    if moe:
        try:
            shape = replace(shape, **moe)
        except ValueError as err:
            # name the flag the message is about (not just the first one given), in the
            # CLI's words rather than the dataclass's
            named = [n for n in moe if n in str(err)] or list(moe)
            message = str(err).replace("ModelShape.", "").replace("ModelShape: ", "")
            raise ConfigError(named[0], message.removeprefix(f"{named[0]} ")) from None
        routing = [name for name in moe if name != "moe_num_experts"]
        if routing and not shape.moe_num_experts:  # a dense model: nothing to route
            raise moe_setting_without_experts(routing[0], moe[routing[0]])
    return shape


def _cluster(args):
    default = presets.BLOOM_CLUSTER if args.example == "bloom" else "h100-80gb"
    name = args.cluster or default
    try:
        spec = presets.cluster(name, args.gpu_mem)
    except KeyError as err:
        raise ConfigError("cluster", err.args[0]) from None
    except ValueError:  # ClusterSpec's own check of the memory it was given
        raise ConfigError("gpu_mem", f"must be > 0 GiB, got {args.gpu_mem}") from None
    if args.gpus_per_node is not None:
        try:
            spec = replace(spec, gpus_per_node=args.gpus_per_node)
        except ValueError:
            raise ConfigError("gpus_per_node", "must be a positive integer, got "
                            f"{args.gpus_per_node}") from None
    if args.efficiency is not None:
        if not 0 < args.efficiency <= 1:
            raise ConfigError("efficiency", f"must be in (0, 1], got "
                            f"{args.efficiency}")
        spec = spec.uniform(args.efficiency)
    return spec


def _attention_kernel(args, spec: ClusterSpec) -> ClusterSpec:
    """`spec` (a plan's cluster, or --compare-published's H100 one: Table 1's A100 runs
    use no fused attention) with --attention-kernel's rates, if given."""
    if args.attention_kernel is None:
        return spec
    try:
        return spec.with_attention_kernel(args.attention_kernel)
    except ValueError as err:
        raise ConfigError("attention_kernel", str(err)) from None


def _global_batch(args, shape: ModelShape, gpus: int) -> int:
    if args.global_batch_size is not None:
        return args.global_batch_size
    return presets.GLOBAL_BATCH.get(shape.name, 4 * gpus)


def _layout(args, shape: ModelShape) -> ParallelConfig | dict:
    """The layout asked for: the example's ParallelConfig with the settings given, or the
    settings as a dict (possibly inconsistent, for the lint to report)."""
    if args.example == "bloom":  # (its mesh sizes were refused above)
        given = {name: getattr(args, name) for name in (*LAYOUT_SETTINGS, *PLAN_SETTINGS)
                 if getattr(args, name) is not None}
        if args.layer_split is not None:
            given["layer_split"] = _layer_split(args.layer_split)
        if args.reductions_in_flight is not None or args.memory_accounting is not None:
            given["reductions_in_flight"] = _reductions_in_flight(args)
        return presets.BLOOM_176B.replace(**given)
    values = {name: _setting(args, name) for name in LAYOUT_SETTINGS}
    values.update(flash_attention=args.flash_attention, lr=args.lr,
                  memory_accounting=args.memory_accounting or "paper",
                  fp8_format=args.fp8_format,
                  fp8_param_gather=bool(args.fp8_param_gather),
                  tp_comm_overlap=bool(args.tp_comm_overlap),
                  overlap_param_gather=bool(args.overlap_param_gather),
                  cross_entropy_loss_fusion=args.cross_entropy_loss_fusion is not False,
                  rank_order=args.rank_order or MINIPAR_ORDER,
                  reductions_in_flight=_reductions_in_flight(args))
    if args.layer_split is not None:  # ("" too: refused below, not ignored)
        values["layer_split"] = _layer_split(args.layer_split)
    if values["grad_accum_steps"] is None and values["global_batch_size"] is None:
        gpus = values["dp"] * values["tp"] * values["pp"] * values["cp"]
        values["global_batch_size"] = _global_batch(args, shape, gpus)
    return values


def _reductions_in_flight(args) -> int | None:
    """--reductions-in-flight as ParallelConfig takes it; if not given, that of the system
    whose bytes the plan counts: Megatron-LM's (no limit) under --memory-accounting
    megatron, else ParallelConfig's default, DeepSpeed's 2 (as minipar's emulator)."""
    value = args.reductions_in_flight
    if value is None:
        return (None if args.memory_accounting == "megatron" else
                ParallelConfig.__dataclass_fields__["reductions_in_flight"].default)
    return None if value == UNLIMITED else value


def _check_in_flight(args, shape: ModelShape, config: ParallelConfig | None = None) -> None:
    """--reductions-in-flight given where no limit can change the plan, refused rather
    than ignored: `config`'s layout (ParallelConfig.reductions_limit_moot), or a search's
    (None), whose candidates reduce during backward unless --no-overlap-grad-reduce."""
    if args.reductions_in_flight is None:
        return
    if config is not None:
        why = config.reductions_limit_moot(shape.is_moe)
        if why is not None and args.example == "bloom" and not config.overlap_grad_reduce:
            why = ("BLOOM's run reduces them after the pipeline's flush (DeepSpeed's pipeline "
                   "engine: the example's --no-overlap-grad-reduce)")
    elif shape.is_moe:
        why = "an MoE model's reductions are priced as they block"
    else:
        why = (None if _setting(args, "overlap_grad_reduce") else
               "--no-overlap-grad-reduce reduces every layout's after backward")
    if why is not None:
        raise ConfigError("reductions_in_flight", "limits ZeRO-1/2's gradient reductions "
                          f"during backward, and {why}: drop it")
    # the time of the system whose bytes the plan counts, not another's
    limit, accounting = _reductions_in_flight(args), args.memory_accounting
    if accounting == "megatron" and limit is not None:
        raise ConfigError("reductions_in_flight", f"{limit} is not Megatron-LM's: its "
                          "distributed optimizer, whose bytes --memory-accounting megatron "
                          "counts, has no limit: drop it, or count another system's bytes")
    if accounting == "deepspeed" and limit != MAX_IN_FLIGHT:
        raise ConfigError("reductions_in_flight", f"{limit or UNLIMITED} is not DeepSpeed's: "
                          f"its ZeRO, whose bytes --memory-accounting deepspeed counts, keeps "
                          f"{MAX_IN_FLIGHT} in flight (overlap_comm's two IPG buffers): drop "
                          "it, or count another system's bytes")


def _layer_split(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError("layer_split", f"{text!r} is not a comma-separated list of layer "
                          "counts") from None


def _setting(args, name: str):
    """A layout setting as given, or ParallelConfig's default."""
    value = getattr(args, name)
    return ParallelConfig.__dataclass_fields__[name].default if value is None else value


def _emit_json(args, payload: dict) -> None:
    """The JSON to stdout (--json) or to PATH, whole or not at all (an earlier file there
    survives a full disk; the answer is then printed, and one line says why)."""
    text = json.dumps(payload, indent=2, default=str)
    if args.json == "-":
        print(text)
        return
    try:
        with atomic_write(args.json, "w") as f:
            f.write(text + "\n")
    except OSError as err:
        print(text)
        raise OutputError("json", f"{args.json}: the answer could not be written "
                          f"({err.strerror or err}); it is printed above instead") from None


def pipeline_note(est) -> str | None:
    """How a pipeline's step was timed, when its schedule was not walked whole
    (minipar.plan.pipeline_step: too many actions to walk in seconds)."""
    c = est.config
    walked = est.time.get("simulated_micro_batches")
    if c.pp == 1 or walked == [c.micro_batches]:
        return None
    size = f"{c.pp} x {c.micro_batches:,} x {c.virtual_stages} (p x m x v)"
    if walked is None:
        return (f"note: the pipeline's {size} computations are too many to walk in seconds: "
                "its step is the closed form for uniform stages, not the simulation of its "
                "schedule")
    return (f"note: the pipeline's {size} computations were walked at m = "
            f"{', '.join(map(str, walked))} and extrapolated to m = {c.micro_batches:,} (its "
            "steady state: the same time per micro-batch; exposed communication within "
            "~0.5% of the step)")


@contextlib.contextmanager
def said_after(seconds: float, text: str):
    """Print `text` on stderr if the block takes longer than `seconds`: the planner
    answers within a few seconds, and past one the user is told what it is doing."""
    timer = threading.Timer(seconds, lambda: print(text, file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# ------------------------------------------------------------------ the command
def run_plan(args) -> int:
    """Run `minipar plan` with parsed `args`; returns the exit status."""
    searching = args.gpus is not None and all(getattr(args, k) is None
                                              for k in ("dp", "tp", "pp", "example"))
    doing = (f"searching the layouts of {args.gpus:,} GPUs" if searching else
             "estimating the layout and its lint's variants")
    try:
        with said_after(1.0, f"minipar plan: {doing} (a few seconds) ..."):
            return _run(args)
    except ConfigError as err:
        print(f"minipar plan: error: {err}", file=sys.stderr)
        return 2


def _run(args) -> int:
    # the outputs first, as minipar train checks them: before any work, never after it
    if args.json is not None and args.json != "-":
        check_output_file("json", args.json)
    if args.export is not None:
        check_output_dir("export", args.export)
    if args.compare_published:
        return _compare_published(args)
    if args.source is not None:
        raise ConfigError("source", "chooses which of --compare-published's published "
                          "runs to print: add --compare-published, or drop it")
    if args.example is not None:  # a published configuration: its model and its layout
        given = ["model"] * (args.model is not None) + [k for k in LAYOUT_FLAGS
                                                       if getattr(args, k) is not None]
        if given:
            flag = "--" + given[0]
            raise ConfigError(given[0], f"--example {args.example} is a published model and "
                            f"layout; drop {flag} (or drop --example and give --model and "
                            "the layout)")
    if args.top < 1:
        raise ConfigError("top", f"lists the fastest N layouts: give N >= 1, got {args.top}")
    for name in ("lr", "reference_lr"):  # (they go into the exported DeepSpeed config)
        if getattr(args, name) is not None:
            check_learning_rate(name, getattr(args, name))
    if args.reference_global_batch_size is not None and args.reference_global_batch_size < 1:
        raise ConfigError("reference_global_batch_size", "must be a positive integer, got "
                        f"{args.reference_global_batch_size}")
    shape = _shape(args)
    cluster = _attention_kernel(args, _cluster(args))
    if args.flash_attention is None and args.example is None:  # (the example has its own)
        args.flash_attention = shape.name != "custom"
    if args.attention_kernel is not None and not args.flash_attention:
        raise ConfigError("attention_kernel", "prices the fused (flash) attention kernel, and "
                          "this plan's attention is unfused: add --flash-attention or drop it")
    evaluate = args.example is not None or any(getattr(args, k) is not None
                                               for k in LAYOUT_FLAGS)
    if args.gpus is not None and args.example is None and all(
            getattr(args, k) is None for k in ("dp", "tp", "pp")):
        # a search: say so rather than evaluate dp=1 with it, or silently drop it
        for name in SEARCHED_FLAGS:
            if getattr(args, name) not in (None, "none"):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(name, f"--gpus searches the layouts and chooses {flag} "
                                f"itself; drop {flag}, or give --dp/--tp/--pp to "
                                "evaluate one layout")
        evaluate = False
    if evaluate:
        values = _layout(args, shape)
        reference = None
        if args.reference_global_batch_size and args.reference_lr:
            reference = {"global_batch_size": args.reference_global_batch_size,
                         "lr": args.reference_lr}
        raw = values.to_dict() if isinstance(values, ParallelConfig) else values
        sizes = [raw["dp"], raw["tp"], raw["pp"], raw.get("cp", 1)]
        world = sizes[0] * sizes[1] * sizes[2] * sizes[3]
        if (args.gpus is not None and args.gpus != world  # before the batch is judged,
                and all(isinstance(s, int) and s >= 1 for s in sizes)):  # after the sizes
            raise ConfigError("gpus", f"{args.gpus} GPUs but dp x tp x pp"
                            f"{' x cp' if raw.get('cp', 1) > 1 else ''} = {world}; drop "
                            "--gpus or change the layout")
        findings = lint(shape, raw, cluster, reference=reference)
        if any(f.code == "INVALID_LAYOUT" for f in findings):
            if args.json:
                _emit_json(args, {"findings": [f.to_dict() for f in findings]})
            else:
                _print_findings(findings)
            return 2
        config = values if isinstance(values, ParallelConfig) else _consistent(values)
        _check_in_flight(args, shape, config)
        est = estimate(shape, config, cluster, all_stages=args.all_stages)
        logged = _logged_step(est) if args.example == "bloom" else None
        if args.json:
            _emit_json(args, {**est.to_dict(), "findings": [f.to_dict() for f in findings],
                              **({"published": logged} if logged else {})})
        else:
            print(est.table())
            if logged is not None:
                print(logged["text"])
            if (note := pipeline_note(est)) is not None:
                print(note)
            _print_findings(findings)
        chosen = config
    else:
        if args.gpus is None:
            raise ConfigError("gpus", "give --gpus N to search layouts, or --dp/--tp/--pp to "
                            "evaluate one")
        _check_in_flight(args, shape)
        advice = advise(shape, args.gpus, cluster,
                        global_batch_size=_global_batch(args, shape, args.gpus),
                        precision=_setting(args, "precision"),
                        grad_accum_dtype=args.grad_accum_dtype,
                        memory_accounting=args.memory_accounting or "paper",
                        fp8_format=args.fp8_format,
                        fp8_param_gather=bool(args.fp8_param_gather),
                        tp_comm_overlap=bool(args.tp_comm_overlap),
                        overlap_param_gather=bool(args.overlap_param_gather),
                        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion is not False,
                        flash_attention=args.flash_attention, lr=args.lr,
                        overlap_grad_reduce=_setting(args, "overlap_grad_reduce"),
                        zero3_prefetch=_setting(args, "zero3_prefetch"),
                        rank_order=args.rank_order or MINIPAR_ORDER,
                        reductions_in_flight=_reductions_in_flight(args), shown=args.top)
        if args.json:
            payload = advice.to_dict(top=args.top)
            if advice.best is not None:
                payload["findings"] = [f.to_dict() for f in
                                       lint(shape, advice.best.config, cluster)]
            _emit_json(args, payload)
        else:
            if advice.ranked:
                print(f"{len(advice.ranked)} of {advice.searched} layouts fit; the fastest "
                      f"{min(args.top, len(advice.ranked))}:\n")
                print(format_ranking(advice, args.top))
                print()
            print(advice.explain())
            if advice.best is not None:
                print()
                print(advice.best.table())
                _print_findings(lint(shape, advice.best.config, cluster))
        if advice.best is None:
            return 1
        chosen = advice.best.config
    if args.export:
        def command(config):  # the plan of a launcher's job (plan/launchers.py)
            return plan_command(args, config, shape.is_moe)
        try:
            files = write_export(args.export, shape, chosen, cluster, command)
        except OSError as err:  # each file whole or not at all: earlier ones kept
            raise OutputError("export", f"{args.export}: the layout's files could not be "
                              f"written ({err.strerror or err})") from None
        if not args.json or args.json != "-":
            print("\nexported: " + ", ".join(str(p) for p in files.values()))
            # which launcher runs the job priced above, as launch.sh says
            for line in launch_note(shape, chosen, command).splitlines():
                print(line.removeprefix("# "))
    return 0


def _compare_published(args) -> int:
    """`--compare-published`: Table 1 of Narayanan et al. 2021 on the A100 preset (or the
    uniform model with --efficiency)."""
    if args.example is not None or args.model is not None or any(
            getattr(args, k) is not None for k in LAYOUT_FLAGS):
        raise ConfigError("compare_published", "takes no model or "
                        "layout: it evaluates the published layouts")
    for name in (*LAYOUT_SETTINGS, *PUBLISHED_RUN_SETTINGS):
        value = getattr(args, name)
        if value is not None:  # each run has its source's; none is overridden
            flag = ("--no-" if value is False else "--") + name.replace("_", "-")
            raise ConfigError(name, "--compare-published prices each published run with "
                              "the settings its source states or implies (docs/planner.md); "
                              f"drop {flag}")
    for name, given in (("gpus", args.gpus is not None), ("export", args.export is not None),
                        ("cluster", args.cluster is not None)):  # (typed, even a100)
        if given:  # each published row has its own GPUs, on the paper's A100 cluster
            raise ConfigError(name, f"--compare-published prices the paper's own layouts on "
                            f"its A100 cluster; drop --{name}")
    args.cluster = "a100-80gb"
    cluster = _cluster(args)
    h100 = presets.cluster("h100-80gb")
    h100 = _attention_kernel(args, h100 if args.efficiency is None
                             else h100.uniform(args.efficiency))
    chosen = [PUBLISHED_SOURCES[name] for name in (args.source or PUBLISHED_SOURCES)]
    rows = published.compare(cluster) if TABLE_1 in chosen else []
    h100_runs = tuple(run for run in published_h100.RUNS + published_mpt.RUNS
                      + published_dgxc.RUNS + published_dgxc.FP8_RUNS
                      if run.source in chosen
                      # the uniform model has no FP8 roof: its rows only when asked for
                      # (and then refused, by name)
                      and (args.efficiency is None or args.source is not None
                           or run.config.fp8_format is None))
    if args.attention_kernel is not None:  # every row at the kernel asked for
        h100_runs = tuple(replace(run, attention_kernel=None) for run in h100_runs)
    h100_rows = published_h100.compare(h100, h100_runs)
    if args.json:
        _emit_json(args, {"schema": "minipar.plan.published/1",
                          "source": TABLE_1, "rows": rows,
                          "tolerance": published.TOLERANCE,
                          "assumptions": published.assumptions(cluster),
                          "h100": {"sources": [s for s in chosen if s != TABLE_1],
                                   "rows": h100_rows,
                                   "tolerance": published_h100.TOLERANCE}})
        return 0
    tables = []
    if rows:
        tables.append(published.format_comparison(rows, cluster))
    if h100_rows:
        tables.append(published_h100.format_comparison(h100_rows, h100))
    print("\n\n".join(tables))
    return 0


def _logged_step(est) -> dict:
    """The step BigScience logged for BLOOM-176B beside the plan of `--example bloom`
    (docs/planner.md, "Presets and the BLOOM-176B example"): the error when the plan is
    the run's (model, layout, cluster), else the settings in which it differs, and no
    error (the logged step is another job's). How memory is counted is not the run's."""
    logged = presets.BLOOM_176B_STEP_S
    source = "BigScience's tr11-176B-ml README, iteration 85,376 at full batch"
    shape, ran, cluster = presets.bloom_example()
    planned, published = est.config.to_dict(), ran.to_dict()
    # a limit of reductions in flight that changes neither step is no difference
    moot = est.config.reductions_limit_moot(shape.is_moe) and ran.reductions_limit_moot(
        shape.is_moe)
    changed = [name for name in published
               if name != "memory_accounting" and planned[name] != published[name]
               and not (name == "reductions_in_flight" and moot)]
    changed += [name for name, same in (("model", est.shape == shape),
                                        ("cluster", est.cluster == cluster)) if not same]
    if changed:
        text = (f"published: {logged:.2f} s a step for BLOOM as it ran ({source}); this plan "
                f"changes {', '.join(changed)}, so it is not compared")
        return {"step_s": logged, "source": source, "error": None, "changed": changed,
                "text": text}
    error = est.step_time / logged - 1
    text = (f"published: {logged:.2f} s a step ({source}); this plan is {error:+.1%} on "
            f"{est.cluster.name}")
    return {"step_s": logged, "source": source, "error": error, "changed": [], "text": text}


def _consistent(values: dict) -> ParallelConfig:
    """The ParallelConfig of possibly inconsistent settings (lint reported the batch)."""
    try:
        return ParallelConfig(**values)
    except ConfigError as err:
        if err.setting != "global_batch_size" or values.get("grad_accum_steps") is None:
            raise
        return ParallelConfig(**{**values, "global_batch_size": None})


def _print_findings(findings) -> None:
    if not findings:
        print("\nlint: no findings")
        return
    print("\nlint:")
    for f in findings:
        print(f"  [{f.severity}] {f.code}: {f.message}\n      fix: {f.fix}")


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (`python -m minipar.plan.cli ...`), for before the lead
    wires `plan` into `minipar`."""
    parser = argparse.ArgumentParser(prog="minipar")
    add_plan_command(parser.add_subparsers(dest="command", required=True))
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

