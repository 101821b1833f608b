"""The `minipar` command line.

    minipar demo [--out DIR]                 dp2 x tp2 x pp2 ZeRO-1 on 8 virtual GPUs, explained
    minipar train [flags] [--json PATH]      train any mix and print what each rank measured
    minipar check [--quick]                  the equivalence matrix against single device
    minipar timeline [flags] --out PNG       train, then draw the ranks' Gantt chart
    minipar train --trace DIR; minipar profile DIR   a profiler trace per rank; its bottleneck
    minipar consolidate CKPT OUT.npz         a sharded checkpoint -> one state dict

Every TrainConfig field is a flag (`micro_batch_size` -> `--micro-batch-size`). Bad values
end the program with one line naming the flag and exit status 2, never a traceback.
This module is long because it is every subcommand's flags and printing; `minipar plan` and
`minipar profile` keep theirs in minipar/plan/cli.py and minipar/profile/cli.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
import warnings
from pathlib import Path

from minipar import distributed as dist
from minipar.errors import ConfigError, MiniparError, OutputError, flag
from minipar.nn.recompute import GRANULARITIES, METHODS
from minipar.parallel.pipeline.schedules.registry import SCHEDULES, schedule_names
from minipar.parallel.zero.offload import DEVICES as OFFLOAD_DEVICES
from minipar.plan.cli import add_plan_command, run_plan
from minipar.plan.fits import check_fits
from minipar.profile import cli as profile_cli
from minipar.train.config import (
    DATASETS,
    MOE_HELP,
    PRECISIONS,
    ROUTING_SETTINGS,
    TrainConfig,
    moe_setting_without_experts,
)
from minipar.train.outputs import check_output_dir, check_output_file

HELP = {**MOE_HELP,  # the MoE and --ep flags, beside their settings in train/config.py
    "vocab_size": "vocabulary size (default: the data's tokenizer)",
    "seq_len": "tokens per sequence (T)",
    "n_layer": "transformer blocks",
    "n_head": "attention heads",
    "d_model": "hidden size (h)",
    "dropout": "dropout probability (0 = off)",
    "tie_embeddings": "share the LM head with the token embedding (GPT-2 does)",
    "dp": "data-parallel size",
    "tp": "tensor-parallel size",
    "pp": "pipeline-parallel size",
    "zero": "ZeRO stage over the data-parallel group (0-3)",
    "schedule": "pipeline schedule",
    "virtual_stages": "model chunks per pipeline rank (interleaved schedule)",
    "sequence_parallel": "shard LayerNorm/dropout regions along the sequence (with --tp)",
    "offload_optimizer": "ZeRO-Offload: optimizer state and Adam on the host (--zero >= 1)",
    "offload_param": "ZeRO-Infinity: the parameter shard in host memory / NVMe (--zero 3)",
    "gpus_per_node": "virtual GPUs per node (ranks on one node share fast links)",
    "bucket_size_mb": "gradient bucket size in MiB (0 = one bucket, reduced after backward)",
    "overlap_grad_reduce": "reduce gradient buckets while backward goes on (under --pp: "
                           "during each stage's last micro-batch backward)",
    "zero3_prefetch": "ZeRO-3: all-gather the next module's parameters while the current "
                      "one computes",
    "micro_batch_size": "sequences per micro-batch on one data-parallel rank",
    "grad_accum_steps": "micro-batches per optimizer step (or give --global-batch-size)",
    "global_batch_size": "sequences per optimizer step = micro x accum x dp",
    "steps": "optimizer steps",
    "lr": "peak learning rate",
    "min_lr": "learning rate at the end of the cosine decay",
    "warmup_steps": "linear warm-up steps",
    "weight_decay": "AdamW decoupled weight decay (matrices only)",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "grad_clip": "clip the global gradient norm to this value (0 = off)",
    "precision": "numerics: fp64 (exact checks), fp32, bf16-mixed",
    "activation_checkpointing": "recompute each block's activations in backward "
                                "(= --recompute-granularity full)",
    "recompute_granularity": "recompute in backward: selective (the attention core only) or "
                             "full (whole blocks; Megatron-LM's flag)",
    "recompute_method": "with full: uniform (groups of --recompute-num-layers blocks) or "
                        "block (only the first N blocks of each pipeline chunk)",
    "recompute_num_layers": "blocks per group (uniform) or blocks recomputed per chunk (block)",
    "data": "training data: the built-in corpus or a synthetic Markov task",
    "seed": "seed of weights and batches",
    "check": "also train the single-device reference and compare every step",
}


def choices() -> dict[str, tuple]:
    """The fields whose values are a fixed set; the schedules are the registry's now."""
    return {"precision": PRECISIONS, "schedule": schedule_names(), "data": DATASETS,
            "recompute_granularity": GRANULARITIES, "recompute_method": METHODS,
            "offload_optimizer": OFFLOAD_DEVICES, "offload_param": OFFLOAD_DEVICES}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (no usage dump) and exit status 2, and
    a flag is taken only when spelled out: with abbreviations `--zero3` was read as
    `--zero3-prefetch`, and ran ZeRO-0 without a word."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _field_type(annotation):
    """The scalar type of a field annotation like `int | None` -> int."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation



def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, defaulting to the field's default (the router's,
    ROUTING_SETTINGS: to None, so that `config_from_args` knows which were typed and
    refuses one on a dense model even at its default value, as `minipar plan` does)."""
    hints = typing.get_type_hints(TrainConfig)
    fixed = choices()
    for f in dataclasses.fields(TrainConfig):
        kind = _field_type(hints[f.name])
        name = flag(f.name)
        default = None if f.name in ROUTING_SETTINGS else f.default
        if kind is bool:
            parser.add_argument(name, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=HELP.get(f.name, f.metadata.get("help")))
        else:
            help_text = HELP.get(f.name, f.metadata.get("help"))
            if f.name == "schedule":  # each registered schedule says what it does
                help_text += ": " + "; ".join(f"{spec.name}: {spec.description}"
                                              for spec in SCHEDULES.values())
            parser.add_argument(name, dest=f.name, type=kind, default=default,
                                choices=fixed.get(f.name), help=help_text,
                                metavar=None if f.name in fixed else f.name.upper())


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    given = [name for name in ROUTING_SETTINGS if values[name] is not None]
    if given and not values["moe_num_experts"]:
        raise moe_setting_without_experts(given[0], values[given[0]])
    return TrainConfig(**{k: v for k, v in values.items()
                          if k not in ROUTING_SETTINGS or v is not None})


DEVICES = ("uniform", "h100", "a100", "demo")


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=DEVICES, default="uniform",
                        help="the simulated GPU: uniform (default: an H100 node's links, "
                             "every FLOP at 400 TFLOP/s; toy models are latency-bound on "
                             "it), h100 / a100 (each kernel on the GPU's roofline: GEMMs by "
                             "shape, other ops by bytes moved, the planner's time model) or "
                             "demo (compute scaled to toy models, see `minipar demo`)")


def device_profile(name: str):
    if name == "demo":
        from minipar.demo import DEMO_PROFILE

        return DEMO_PROFILE
    if name in ("h100", "a100"):
        return dist.H100 if name == "h100" else dist.A100
    return None  # the default: minipar.distributed.DeviceProfile(), uniform pricing


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="minipar",
                           description="3D parallelism and ZeRO on N virtual GPUs.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    demo = commands.add_parser(
        "demo", help="train dp2 x tp2 x pp2 ZeRO-1 on 8 virtual GPUs, check it against one "
                     "GPU, and explain which parallelism cut which memory at what traffic")
    demo.add_argument("--out", metavar="DIR", default="minipar-demo",
                      help="folder for the figures (default: ./minipar-demo)")
    train = commands.add_parser("train", help="train and print what each rank measured")
    add_config_flags(train)
    add_device_flag(train)
    train.add_argument("--json", metavar="PATH", help="write the report (minipar.report/1)")
    train.add_argument("--quiet", action="store_true", help="no progress bar or tables")
    train.add_argument("--save", metavar="DIR",
                       help="write sharded checkpoints to DIR/step-NNNNNN (at the end)")
    train.add_argument("--save-every", metavar="N", type=int, default=0,
                       help="also checkpoint every N steps (with --save)")
    train.add_argument("--resume", metavar="CKPT",
                       help="continue from a checkpoint (or the latest one in a --save DIR), "
                            "saved under any --dp / --zero")
    profile_cli.add_trace_flags(train)
    profile_cli.add_profile_command(commands)
    check = commands.add_parser(
        "check", help="train a grid of dp x tp x pp x ZeRO layouts in fp64 and compare each "
                      "with single-device training, step by step")
    check.add_argument("--quick", action="store_true",
                       help="only the representative cases (as the tests do)")
    check.add_argument("--steps", type=int, default=None, help="steps per case (default 3)")
    timeline = commands.add_parser(
        "timeline", help="train, then draw each rank's simulated timeline (Gantt chart)")
    add_config_flags(timeline)
    add_device_flag(timeline)
    timeline.add_argument("--out", metavar="PNG", default="timeline.png",
                          help="where to save the figure (default: timeline.png)")
    timeline.add_argument("--step", type=int, default=-1,
                          help="which optimizer step to draw (default: the last)")
    timeline.add_argument("--all-steps", action="store_true", help="draw the whole run")
    consolidate = commands.add_parser(
        "consolidate", help="merge a sharded checkpoint into one single-device state dict")
    consolidate.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory")
    consolidate.add_argument("output", metavar="OUT.npz", help="where to write the .npz")
    add_plan_command(commands)
    return parser


def cmd_train(args) -> int:
    from minipar.train.checkpoint import read_manifest
    from minipar.train.loop import train

    config = config_from_args(args)
    if args.save_every and not args.save:
        raise ConfigError("save_every", "needs --save DIR (where to write the checkpoints)")
    # Every output is checked before the work starts (minipar/train/outputs.py).
    if args.json is not None:
        check_output_file("json", args.json)
    if args.save is not None:
        check_output_dir("save", args.save)
    check_fits(config)  # the planner's estimate, before anything is allocated
    bar = None
    if not args.quiet:
        from tqdm.auto import tqdm

        start = read_manifest(args.resume)["step"] if args.resume else 0
        bar = tqdm(total=config.steps, initial=start, desc="train", unit="step",
                   disable=None)

    def progress(step, record):
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}")

    late = None  # an output that failed after the run: said last, the results kept
    with profile_cli.trace_folder(args) as trace:  # checked before the work
        try:
            report = train(config, progress=progress, save_dir=args.save,
                           save_every=args.save_every, resume_from=args.resume,
                           device=device_profile(args.device), trace=trace)
        except OutputError as err:
            if err.report is None:
                raise
            report, late = err.report, OutputError("save", err.detail)  # its flag is --save
        finally:
            if bar is not None:
                bar.close()
        profile = profile_cli.profile_folder(trace) if args.profile else None
        if profile is not None:
            report.profile = profile.to_dict()
    if args.json:
        try:
            report.to_json(args.json)
        except OSError as err:
            late = OutputError("json", f"{args.json}: the report could not be written "
                               f"({err.strerror or err}); it is printed above instead")
            print(report.to_json())
    print_summary(report, config, args, late, profile)
    if late is not None:
        raise late
    check = report.equivalence
    if check is not None and not check["passed"]:
        if args.quiet:
            print(equivalence_line(check), file=sys.stderr)
        return 1
    return 0


def print_summary(report, config: TrainConfig, args, late=None, profile=None) -> None:
    """What `minipar train` prints after the run (nothing with --quiet; profile: --profile)."""
    from minipar.viz import tables

    check = report.equivalence
    if not args.quiet:
        print(f"\nminipar: {report.world_size} rank(s), {report.n_params:,} parameters, "
              f"precision {config.precision}, global batch {config.global_batch_size} "
              f"= micro {config.micro_batch_size} x accum {config.grad_accum_steps} "
              f"x dp {config.dp}, recompute {config.recompute.label}\n"
              f"simulated GPU: {report.device['name']} (--device {args.device})\n")
        print(tables.loss_table(report))
        if report.moe is not None:  # what the routing did (the report's `moe` section)
            print(moe_line(report.moe))
        print("\nPeak memory per rank, by category (measured from the arrays each rank held):")
        print(tables.memory_table(report))
        if (tiers := tables.tier_table(report)) is not None:
            print(f"\nOffload: peak bytes behind each GPU, bytes between tiers:\n{tiers}")
        if report.world_size > 1:
            print("\nTraffic per rank and step, by group and collective (bytes sent):")
            print(tables.traffic_table(report))
            print("\nSimulated time per rank over the run:")
            print(tables.time_table(report))
        if report.pipeline is not None:
            print(pipeline_line(report.pipeline, args.device))
        for warning in report.warnings:
            print(f"warning: {warning}")
        if check is not None:
            print(f"\n{equivalence_line(check)}")
        if args.save and not (late is not None and late.setting == "save"):
            print(f"checkpoints written to {args.save}")
        if args.trace:  # rank<N>.json, and merged/all_ranks.json for Perfetto
            print(f"\ntraces written to {args.trace}/ (`minipar profile {args.trace}`)")
        if profile is not None:
            print(f"\n{profile.text()}")
        if args.json and not (late is not None and late.setting == "json"):
            print(f"\nreport written to {args.json}")


def moe_line(moe: dict) -> str:
    """One line on the MoE layers: settings, dropped share, the most loaded expert."""
    assigned = sum(layer["assigned"] for layer in moe["layers"])
    dropped = sum(layer["dropped"] for layer in moe["layers"])
    load = max(layer["max_over_mean_load"] for layer in moe["layers"])
    return (f"\nMoE: {len(moe['layers'])} layer(s) of {moe['num_experts']} experts, top-"
            f"{moe['top_k']}, capacity factor {moe['capacity_factor']:g}, ep {moe['ep']}; "
            f"`loss` is the LM loss, the load-balancing loss is `aux_loss`; over the run "
            f"{dropped / max(assigned, 1):.1%} of token assignments were dropped (over "
            f"capacity), the busiest expert took {load:.2f}x the mean load")


def pipeline_line(pipeline: dict, device: str = "h100") -> str:
    """The measured bubble, and the uniform-stage formula only where it applies."""
    from minipar.distributed.timeline import COMMUNICATION_BOUND_SHARE

    line = (f"pipeline: {pipeline['schedule']}, {pipeline['micro_batches']} micro-batches, "
            f"layers per stage {pipeline['layers_per_stage']}: bubble (idle share of "
            f"rank-time) {pipeline['bubble_fraction']:.1%}")
    share = pipeline.get("communication_share", 0.0)
    if share > COMMUNICATION_BOUND_SHARE:  # minipar.distributed.timeline.communication_bound
        formula = "(p-1)/(v·m+p-1)" if pipeline.get("virtual_stages", 1) > 1 else "(p-1)/(m+p-1)"
        hint = "; try --device demo, whose slower GPU makes compute dominate" * (device != "demo")
        return (line + f".\n  The stages spend {share:.0%} of their busy time communicating "
                f"(a small model on the {device} profile pays each message's latency on "
                f"top of ~microseconds of compute), so the uniform-stage formula {formula}, "
                f"which assumes compute-bound stages and free communication, does not "
                f"apply{hint}")
    return (line + f"; uniform stages with free communication would give "
            f"{pipeline['uniform_bubble_fraction']:.1%}")


def cmd_demo(args) -> int:
    from minipar.demo import run_demo

    check_output_dir("out", args.out)
    result = run_demo(args.out)
    checks = (result.report.equivalence, result.exact.equivalence)
    return 0 if all(c["passed"] for c in checks) else 1


def cmd_check(args) -> int:
    from minipar.train.grid import GRID, REPRESENTATIVE, run_grid
    from minipar.viz.tables import grid_table

    if args.steps is not None and args.steps < 1:
        raise ConfigError("steps", f"must be a positive integer, got {args.steps}")
    cases = [c for c in GRID if not args.quick or c.name in REPRESENTATIVE]
    overrides = {} if args.steps is None else {"steps": args.steps}
    print(f"equivalence matrix: {len(cases)} layouts, each against single-device training "
          "(fp64, same seed, same global batch, every step)")

    def progress(result):
        print(f"  {result.case.name}: {'ok' if result.passed else 'FAILED'}", flush=True)

    results = run_grid(cases, progress=progress, **overrides)
    print()
    print(grid_table(results))
    failed = [r for r in results if not r.passed]
    print(f"\n{len(results) - len(failed)} of {len(results)} as expected"
          + (f"; FAILED: {', '.join(r.case.name for r in failed)}" if failed else ""))
    return 1 if failed else 0


def cmd_timeline(args) -> int:
    from minipar.train.loop import train
    from minipar.viz.timeline import plot_timeline

    config = config_from_args(args)
    if args.all_steps and args.step != -1:  # (before the run, as every check here)
        raise ConfigError("step", "--all-steps draws every step; drop --step, or drop "
                          "--all-steps to draw one")
    if not Path(args.out).suffix and not Path(args.out).is_dir():  # matplotlib adds .png
        args.out = f"{args.out}.png"
    check_output_file("out", args.out)
    check_figure_format(args.out)
    check_fits(config)
    report = train(config, device=device_profile(args.device))
    start = end = None
    what = "the whole run"
    if not args.all_steps:
        if not -config.steps <= args.step < config.steps:
            raise ConfigError("step", f"{args.step} is outside the run's "
                              f"{config.steps} steps")
        start, end = report.step_window(args.step)
        what = f"step {args.step % config.steps}"
    fig = plot_timeline(report.timelines, start=start, end=end)
    try:
        fig.savefig(args.out, dpi=110)
    except OSError as err:
        raise OutputError("out", f"{args.out}: the figure could not be written "
                          f"({err.strerror or err})") from None
    print(f"{args.out}: timeline of {report.world_size} rank(s), {what}")
    if report.pipeline is not None:
        print(pipeline_line(report.pipeline))
    for warning in report.warnings:
        print(f"warning: {warning}")
    return 0


def check_figure_format(path: str) -> None:
    """A file name whose extension matplotlib can write (png, pdf, svg, ...), checked before
    the run: `--out t.txt` ended, after training, in matplotlib's ValueError traceback."""
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix.lower().lstrip(".")
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise ConfigError("out", f"{path}: matplotlib cannot write .{suffix} figures; use "
                          f"one of {', '.join('.' + f for f in sorted(formats))}")


def equivalence_line(check: dict) -> str:
    """One line on the equivalence check: passed, or where the runs first differ."""
    if check["passed"]:
        return (f"equivalence with single-device training: passed (max relative parameter "
                f"difference {check['max_rel_param_diff_per_step']:.2e}, loss "
                f"{check['max_rel_loss_diff']:.2e}, tolerance {check['tolerance']:.0e})")
    first = check["first_mismatch"]
    where = "" if first["rank"] is None else f" on rank {first['rank']}"
    return (f"equivalence with single-device training: FAILED: step {first['step']}, "
            f"{first['tensor']}{where} differs by {first['rel_diff']:.2e} (tolerance "
            f"{check['tolerance']:.0e})")


def cmd_consolidate(args) -> int:
    from minipar.train.checkpoint import consolidate, save_state_dict

    check_output_file("OUT.npz", args.output)
    state_dict = consolidate(args.checkpoint)
    save_state_dict(args.output, state_dict)
    n = sum(a.size for a in state_dict.values())
    print(f"{args.output}: {len(state_dict)} tensors, {n:,} parameters "
          f"(single-device names, {next(iter(state_dict.values())).dtype})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # A warning (a resumed run that changed a setting) is one line like an error, not
    # Python's "file:line: UserWarning" with a source line the user did not write.
    try:
        commands = {"train": cmd_train, "consolidate": cmd_consolidate, "demo": cmd_demo,
                    "check": cmd_check, "timeline": cmd_timeline, "plan": run_plan,
                    "profile": profile_cli.run_profile}
        with warnings.catch_warnings():
            warnings.showwarning = lambda message, *_: print(
                f"minipar {args.command}: warning: {message}", file=sys.stderr)
            return commands[args.command](args)
    except (MiniparError, NotImplementedError) as err:
        # Every refusal (a setting, a checkpoint, a diverged run, a stuck rank) is one
        # line and exit status 2; anything else is a bug in minipar and keeps its traceback.
        print(f"minipar {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `minipar plan ... | head`: the reader has what it wanted
        # The recipe of Python's signal docs ("Note on SIGPIPE"): send the rest of the
        # output to devnull, so the flush at exit does not raise again, and exit with 1.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _one_line(error: BaseException) -> str:
    """The error's message on one line (some, like a deadlock, list one rank per line)."""
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
