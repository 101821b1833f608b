"""The `minipar` command line.

    minipar demo [--out DIR]                 dp2 x tp2 x pp2 ZeRO-1 on 8 virtual GPUs, explained
    minipar train [flags] [--json PATH]      train any mix and print what each rank measured
    minipar check [--quick]                  the equivalence matrix against single device
    minipar timeline [flags] --out PNG       train, then draw the ranks' Gantt chart
    minipar train --trace DIR; minipar profile DIR   a profiler trace per rank; its bottleneck
    minipar consolidate CKPT OUT.npz         a sharded checkpoint -> one state dict
    minipar train --engine torch --nproc-per-node 4   the ranks as torch.distributed processes

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
import warnings
from pathlib import Path

from minipar import distributed as dist
from minipar.distributed.clock import device_label
from minipar.distributed.engines import ENGINES, get_engine
from minipar.errors import ConfigError, MiniparError, OutputError
from minipar.files import remove_temporaries
from minipar.plan.cli import add_plan_command, run_plan
from minipar.plan.fits import check_fits
from minipar.profile import cli as profile_cli
from minipar.train.config import ROUTING_SETTINGS, TrainConfig, moe_setting_without_experts
from minipar.train.flags import add_setting_flags
from minipar.train.outputs import check_output_dir, check_output_file


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (no usage dump) and exit status 2, and
    a flag is taken only when spelled out: with abbreviations `--zero3` was read as
    `--zero3-prefetch`, and ran ZeRO-0 without a word."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, defaulting to the field's default (the router's,
    ROUTING_SETTINGS: to None, so that `config_from_args` knows which were typed and
    refuses one on a dense model even at its default value, as `minipar plan` does)."""
    add_setting_flags(parser, TrainConfig, defaults=dict.fromkeys(ROUTING_SETTINGS))


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    given = [name for name in ROUTING_SETTINGS if values[name] is not None]
    if given and not values["moe_num_experts"]:
        raise moe_setting_without_experts(given[0], values[given[0]])
    return TrainConfig(**{k: v for k, v in values.items()
                          if k not in ROUTING_SETTINGS or v is not None})


DEVICES = ("demo", "uniform", "h100", "a100")
# The demo's and the notebooks' GPU: on it a toy model's step splits between compute,
# communication and bubble as a 7B model's does on H100s (minipar/demo.py says why). On
# an H100 profile the same model computes a layer in microseconds and every rank shows
# "compute 0%, comm 100%".
DEFAULT_DEVICE = "demo"


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=DEVICES, default=DEFAULT_DEVICE,
                        help="the simulated GPU: demo (the default, as in `minipar demo` "
                             "and the notebooks: an H100 node's link ratios, compute scaled "
                             "to toy models), uniform (an H100 node's links, every FLOP at "
                             "400 TFLOP/s: toy models are latency-bound on it), h100 / a100 "
                             "(each kernel on the GPU's roofline: GEMMs by shape, other ops "
                             "by bytes moved, the planner's time model)")


def device_profile(name: str):
    if name == "demo":
        from minipar.demo import DEMO_PROFILE

        return DEMO_PROFILE
    if name in ("h100", "a100"):
        return dist.H100 if name == "h100" else dist.A100
    return None  # uniform: minipar.distributed.DeviceProfile(), train()'s own default


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default=None,
                        help="what runs the ranks: threads of this process (the default) or "
                             "torch (one process per rank, torch.distributed with gloo; "
                             "under torchrun, this process joins the job as one rank)")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                        help="--engine torch: processes to start on this machine (default: "
                             "one per rank of the layout)")


def engine_from_args(args):
    """The engine the flags ask for; None for the default threads (no `engine` section)."""
    if args.engine is None and args.nproc_per_node is None:
        return None
    return get_engine(args.engine or "threads", nproc_per_node=args.nproc_per_node)


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
    add_engine_flags(train)
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
    add_engine_flags(check)
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
    from minipar.train.loop import prepare_run, train_prepared

    config = config_from_args(args)
    if args.save_every and not args.save:
        raise ConfigError("save_every", "needs --save DIR (where to write the checkpoints)")
    # Every output is checked before the work starts (minipar/train/outputs.py).
    if args.json is not None:
        check_output_file("json", args.json)
    if args.save is not None:
        check_output_dir("save", args.save)
    engine = engine_from_args(args)
    prepared = prepare_run(config, args.resume)  # the data, the layout, the checkpoint
    check_fits(prepared.config)  # the planner's estimate, before anything is allocated
    bar = None
    if not args.quiet and (engine is None or not engine.elsewhere):
        from tqdm.auto import tqdm

        start = 0 if prepared.start is None else prepared.start.step
        bar = tqdm(total=config.steps, initial=start, desc="train", unit="step",
                   disable=None)

    def progress(step, record):
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}")

    # Outputs that failed after the run (a full disk): said last, in one line, with the
    # results kept (printed, and the outputs that could be written, written).
    late: OutputError | None = None
    with profile_cli.trace_folder(args) as trace:  # checked before the work
        try:
            report = train_prepared(prepared, progress=progress, save_dir=args.save,
                                    save_every=args.save_every,
                                    device=device_profile(args.device), trace=trace,
                                    engine=engine)
        except OutputError as err:
            if err.report is None:
                raise
            # the flags: train()'s save_dir is --save; --profile alone traces for itself
            flags = {"save_dir": "save", "trace": "trace" if args.trace else "profile"}
            report, late = err.report, OutputError(
                flags[err.setting], err.detail, outputs=[flags[o] for o in err.outputs])
        finally:
            if bar is not None:
                bar.close()
        if report is None:  # a rank of a torchrun job other than 0: rank 0 reports
            return 0
        traced = late is None or not {"trace", "profile"} & set(late.outputs)
        profile = profile_cli.profile_folder(trace) if args.profile and traced else None
        if profile is not None:
            report.profile = profile.to_dict()
    if args.json:
        try:
            report.to_json(args.json)
        except OSError as err:
            failed = (f"{args.json}: the report could not be written ({err.strerror or err});"
                      " it is printed above instead")
            late = OutputError("json", failed) if late is None else OutputError(
                late.setting, f"{late.detail}; --json: {failed}",
                outputs=[*late.outputs, "json"])
            print(report.to_json())
    print_summary(report, config, args, () if late is None else late.outputs, profile)
    if late is not None:
        raise late
    check = report.equivalence
    if check is not None and not check["passed"]:
        if args.quiet:
            print(equivalence_line(check), file=sys.stderr)
        return 1
    return 0


def print_summary(report, config: TrainConfig, args, failed=(), profile=None) -> None:
    """What `minipar train` prints after the run (nothing with --quiet; profile: --profile;
    failed: the outputs that could not be written, not said to be)."""
    from minipar.viz import tables
    from minipar.viz.measured import engine_text

    check = report.equivalence
    if not args.quiet:
        print(f"\nminipar: {report.world_size} rank(s), {report.n_params:,} parameters, "
              f"precision {config.precision}, global batch {config.global_batch_size} "
              f"= micro {config.micro_batch_size} x accum {config.grad_accum_steps} "
              f"x dp {config.dp}, recompute {config.recompute.label}\n"
              f"simulated GPU: {device_label(report.device)} (--device {args.device}"
              f"{', the default' if args.device == DEFAULT_DEVICE else ''})\n")
        if report.engine is not None:
            print(engine_text(report) + "\n")
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
        if args.save and "save" not in failed:
            print(f"checkpoints written to {args.save}")
        if args.trace and "trace" not in failed:  # rank<N>.json, merged/all_ranks.json
            print(f"\ntraces written to {args.trace}/ (`minipar profile {args.trace}`)")
        if profile is not None:
            print(f"\n{profile.text()}")
        if args.json and "json" not in failed:
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


def pipeline_line(pipeline: dict, device: str = DEFAULT_DEVICE) -> str:
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
    if args.engine == "torch":
        return cmd_check_torch(args)
    if args.nproc_per_node is not None:
        raise ConfigError("nproc_per_node", "starts processes of the torch engine; add "
                          "--engine torch")
    cases = [c for c in GRID if not args.quick or c.name in REPRESENTATIVE]
    overrides = {} if args.steps is None else {"steps": args.steps}
    print(f"equivalence matrix: {len(cases)} layouts, each against single-device training "
          "(fp64, same seed, same global batch, every step)")

    def progress(result):
        print(f"  {result.case.name}: {'ok' if result.passed else 'FAILED'}", flush=True)

    results = run_grid(cases, progress=progress, **overrides)
    return verdict(grid_table(results), [(r.case.name, r.passed) for r in results])


def verdict(table: str, outcomes: list[tuple[str, bool]]) -> int:
    """Print a check's table and how many cases went as expected; the exit status."""
    print(f"\n{table}")
    failed = [name for name, passed in outcomes if not passed]
    print(f"\n{len(outcomes) - len(failed)} of {len(outcomes)} as expected"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def cmd_check_torch(args) -> int:
    """`minipar check --engine torch`: the cross-check's cases on processes (crosscheck.py)."""
    from minipar.train.crosscheck import CASES, run_cases
    from minipar.viz.measured import cross_check_table

    get_engine("torch", nproc_per_node=args.nproc_per_node)  # no torch: one line, at once
    overrides = {} if args.steps is None else {"steps": args.steps}
    print(f"the torch engine against the thread engine and single-device training: "
          f"{len(CASES)} layouts" + (f", those of {args.nproc_per_node} ranks"
                                     if args.nproc_per_node else ""))

    def progress(result):
        print(f"  {result.name}: {'ok' if result.passed else 'FAILED'}", flush=True)

    results = run_cases(nproc_per_node=args.nproc_per_node, progress=progress, **overrides)
    if not results:
        raise ConfigError("nproc_per_node", f"no case of the cross-check has "
                          f"{args.nproc_per_node} ranks (they have 2, 3, 4 or 8)")
    return verdict(cross_check_table(results), [(r.name, r.passed) for r in results])


def cmd_timeline(args) -> int:
    from minipar.train.loop import prepare_run, train_prepared
    from minipar.viz.save import save_figure
    from minipar.viz.timeline import plot_timeline

    config = config_from_args(args)
    if args.all_steps and args.step != -1:  # (before the run, as every check here)
        raise ConfigError("step", "--all-steps draws every step; drop --step, or drop "
                          "--all-steps to draw one")
    if not Path(args.out).suffix and not Path(args.out).is_dir():  # matplotlib adds .png
        args.out = f"{args.out}.png"
    check_output_file("out", args.out)
    check_figure_format(args.out)
    prepared = prepare_run(config)
    check_fits(prepared.config)
    report = train_prepared(prepared, device=device_profile(args.device))
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
        save_figure(fig, args.out)
    except OSError as err:
        raise OutputError("out", f"{args.out}: the figure could not be written "
                          f"({err.strerror or err})") from None
    print(f"{args.out}: timeline of {report.world_size} rank(s), {what}, simulated on "
          f"{device_label(report.device)} (--device {args.device})")
    if report.pipeline is not None:
        print(pipeline_line(report.pipeline, args.device))
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
    quantized = check.get("quantized")
    if check["passed"] and quantized is not None:  # rounding on purpose: never a bare pass
        rounds = " and ".join(quantized[k] for k in ("weights", "gradients") if k in quantized)
        return (f"equivalence with single-device training: within the quantisation "
                f"tolerance, not exact ({rounds} round on purpose): max relative parameter "
                f"difference "
                f"{check['max_rel_param_diff_per_step']:.2e} of the model's scale, loss "
                f"{check['max_rel_loss_diff']:.2e}, tolerance {check['tolerance']:.0e}; "
                f"gradient norms x{quantized['grad_norm_ratio']:.3f} on average (tolerance "
                f"{quantized['grad_norm_tolerance']:g})")
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
    from minipar.train.checkpoint import consolidate, read_manifest, save_state_dict
    from minipar.train.checkpoint_dirs import resolve

    check_output_file("OUT.npz", args.output)
    source = resolve(args.checkpoint)  # a save directory: its latest, if of one run
    manifest = read_manifest(source)
    state_dict = consolidate(source)
    try:
        save_state_dict(args.output, state_dict)
    except OSError as err:  # a full disk: whole or not at all, an earlier file kept
        raise OutputError("OUT.npz", f"{args.output}: the state dict could not be written "
                          f"({err.strerror or err})") from None
    n = sum(a.size for a in state_dict.values())
    if "run" in manifest:
        run = "run " + manifest["run"] + ("" if manifest["origin"] == manifest["run"] else
                                          f", continuing run {manifest['origin']}")
    else:  # a checkpoint saved before run ids (its warning said so)
        run = f"{manifest['format']}, no run id"
    print(f"{args.output}: {len(state_dict)} tensors, {n:,} parameters "
          f"(single-device names, {next(iter(state_dict.values())).dtype}), from {source} "
          f"({run}; step {manifest['step']})")
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
    except KeyboardInterrupt:  # Ctrl-C: the ranks are stopped (threads, or processes)
        # and what was being written is removed, even by a rank that did not stop in time
        remove_temporaries()
        print(f"minipar {args.command}: interrupted", file=sys.stderr)
        return 130
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
