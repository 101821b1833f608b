"""`minipar demo`: 3D parallelism on 8 virtual GPUs, measured and explained in a minute.

What it does, in order:
1. trains the demo model with dp=2 x tp=2 x pp=2 and ZeRO-1 on 8 virtual ranks (two
   nodes of four GPUs: each TP group inside a node, each DP group across the two) in
   bf16-mixed, and checks it step by step against single-device training; then checks
   the same layout in fp64, where the only difference left is rounding (~1e-13);
2. prints per-rank memory (by category), traffic (by group and collective) and time
   (compute / comm / idle) tables and the pipeline bubble;
3. trains each parallelism alone (DP, DP + ZeRO-1, TP, PP) on the same global batch, so
   the summary can say which one cut which memory, and what it cost in traffic;
4. saves the figures (pipeline timeline of the last step, per-rank memory bars, traffic
   matrix) to a folder.

The model. 4 layers of width 192 (6 heads), 64-token sequences, micro-batches of 4:
small enough that the whole demo (eight trainings) takes about 12 s of CPU, large
enough that NumPy's work, not the emulator's per-op bookkeeping, dominates a step: the
8-rank step then costs about as much wall time as the single-device step of the same
global batch (benchmarks/bench_emulation.py). A 64-wide model costs ~2.4x, because
every TP rank runs every op of its layers, on arrays too small to amortise the op.

The simulated GPU. On the default H100 profile this model is hopeless as a picture: a
layer computes a micro-batch in about 0.5 us, while every message pays 3 us of NVLink
latency, so every timeline is a wall of communication. Real training lives in the
opposite regime. Compute per byte communicated grows with the hidden size (TP's
all-reduces) and with the tokens per micro-batch (DP's gradients are paid once per
batch): Llama-2 7B (h 4096, 4096-token micro-batches) does ~16-21x more FLOPs per byte
it sends than this model (h 192, 256 tokens). So the demo's GPU (DEMO_PROFILE) does ~18x
fewer FLOPs per byte of link than an H100: 40 GFLOP/s against 0.8 GB/s NVLink, the
network 9x slower than NVLink, as on a DGX H100. Its time then splits like the planner's
estimate for Llama-2 7B on this layout on H100s (compute ~2/3, bubble ~20%,
communication ~14%): the shares, not the absolute times, are the point.

A front end beside the CLI (docs/architecture.md): it drives minipar.train and draws with
minipar.viz, and nothing below imports it. This module is long because it is the demo's
whole story: its runs, the sentences that explain them, and the files it leaves.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from minipar.distributed import DeviceProfile
from minipar.errors import OutputError
from minipar.parallel.pipeline.schedules.registry import SCHEDULES
from minipar.train.config import TrainConfig
from minipar.train.loop import train
from minipar.train.report import MEMORY_CATEGORIES, Report
from minipar.viz.tables import (
    format_table,
    human_bytes,
    human_seconds,
    memory_table,
    time_table,
    traffic_table,
)

DEMO_CONFIG = TrainConfig(
    dp=2, tp=2, pp=2, zero=1, gpus_per_node=4,
    n_layer=4, d_model=192, n_head=6, seq_len=64,
    micro_batch_size=4, grad_accum_steps=4,  # 4 micro-batches fill the 2-stage pipeline
    steps=3, precision="bf16-mixed", check=True, data="corpus", seed=0,
)
DEMO_PROFILE = DeviceProfile(
    name="demo GPU (H100 link ratios, compute per byte scaled to the demo model)",
    flops=40e9, intra_node_bandwidth=0.8e9, inter_node_bandwidth=0.8e9 / 9,
    intra_node_latency=1e-6, inter_node_latency=8e-6 / 3,
    # the offload tiers in the H100 profile's ratios: PCIe 50 / NVLink 450, NVMe 13 and
    # 6.6 / 450, CPU Adam 20 GFLOP/s / 400 TFLOP/s, latencies / 3 as the links'
    pcie_bandwidth=0.8e9 / 9, pcie_latency=10e-6 / 3, nvme_read_bandwidth=0.8e9 * 13 / 450,
    nvme_write_bandwidth=0.8e9 * 6.6 / 450, nvme_latency=100e-6 / 3,
    host_flops=40e9 * 20e9 / 400e12,
)
# ZeRO-Offload / ZeRO-Infinity runs of the demo's second table (over the DP group alone)
OFFLOADS = {"DP 2 + ZeRO-1 + offload optimizer cpu": dict(zero=1, offload_optimizer="cpu"),
            "DP 2 + ZeRO-3 + offload nvme, params nvme": dict(zero=3, offload_optimizer="nvme",
                                                              offload_param="nvme")}
FIGURES = ("timeline.png", "memory.png", "traffic.png")


@dataclass
class DemoResult:
    """The demo's runs (reports), its figures, and the lines it printed."""

    report: Report  # the dp x tp x pp run
    exact: Report  # the same layout in fp64, checked
    single: Report  # the single-device reference of `report`
    ablations: dict[str, Report]  # one parallelism at a time
    figures: list[Path]
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0


def ablation_configs(config: TrainConfig) -> dict[str, TrainConfig]:
    """Each parallelism of `config` alone, same global batch and micro-batch size.

    One step each: what the summary compares (peak bytes per category, bytes sent per
    step, idle share, time per step) is the same in every step, and a first run of the
    demo spends a quarter of its time here (4.4 of 16 s of CPU with 3 steps)."""
    out = {}
    common = dict(dp=1, tp=1, pp=1, zero=0, sequence_parallel=False, check=False,
                  global_batch_size=config.global_batch_size, grad_accum_steps=None,
                  steps=1)
    if config.dp > 1:
        out[f"DP {config.dp}"] = config.replace(**{**common, "dp": config.dp})
        if config.zero:
            out[f"DP {config.dp} + ZeRO-{config.zero}"] = config.replace(
                **{**common, "dp": config.dp, "zero": config.zero})
    if config.tp > 1:
        out[f"TP {config.tp}"] = config.replace(
            **{**common, "tp": config.tp, "sequence_parallel": config.sequence_parallel})
    if config.pp > 1:
        out[f"PP {config.pp}"] = config.replace(**{**common, "pp": config.pp})
    return out


def layout_name(config: TrainConfig) -> str:
    parts = [f"{axis.upper()} {getattr(config, axis)}" for axis in ("dp", "tp", "pp")
             if getattr(config, axis) > 1]
    name = " x ".join(parts) or "1 GPU"
    return name + (f" + ZeRO-{config.zero}" if config.zero else "")


def _progress_to_stderr(text: str, end: str = "\n") -> None:
    print(text, end=end, file=sys.stderr, flush=True)


def run_demo(out_dir="minipar-demo", config: TrainConfig = DEMO_CONFIG,
             profile: DeviceProfile = DEMO_PROFILE, echo=print,
             progress=_progress_to_stderr) -> DemoResult:
    """Run the demo, print as it goes (echo(line)), save figures to out_dir.

    progress(text, end=...) says what is running while it runs (default: stderr, so the
    report on stdout stays the same; a first run spends ~20 s before its first table)."""
    started = time.perf_counter()
    lines: list[str] = []

    def say(text: str = "") -> None:
        lines.append(text)
        echo(text)

    def working(what: str, run):
        progress(f"  ... {what}", end="")
        begun = time.perf_counter()
        try:
            result = run()
        finally:  # (a failure or a Ctrl-C is said on a line of its own)
            progress(f" {time.perf_counter() - begun:.1f} s")
        return result

    say(f"minipar demo: {layout_name(config)} on {config.world_size} virtual GPUs "
        f"({config.world_size // config.gpus_per_node} nodes x {config.gpus_per_node}), "
        f"{config.steps} steps, {config.precision}")
    say(f"simulated GPU: {profile.name}: {profile.flops / 1e9:g} GFLOP/s, links "
        f"{_rate(profile.intra_node_bandwidth)} in a node, "
        f"{_rate(profile.inter_node_bandwidth)} across (see docs/3d-and-demo.md)")
    trace_dir = Path(out_dir) / "trace"
    failed: dict[str, str] = {}  # outputs not written (a full disk): said last, one line

    def traced() -> Report:
        try:
            return train(config, device=profile, trace=trace_dir)
        except OutputError as err:  # the traces: the run and its report are kept
            if err.report is None:
                raise
            failed["trace"] = err.detail.partition("; the run finished")[0]
            return err.report

    report = working(f"training {layout_name(config)} and the same batches on one device "
                     "(the check)", traced)
    exact = working("the same layout in fp64, 2 steps, checked",
                    lambda: train(config.replace(precision="fp64", steps=2), device=profile))
    single = report.reference
    say(f"model: GPT-2 shape, {config.n_layer} layers, d_model {config.d_model}, "
        f"{report.n_params:,} parameters; global batch {config.global_batch_size} = micro "
        f"{config.micro_batch_size} x accum {config.grad_accum_steps} x dp {config.dp}")
    say()
    say("loss per step (parallel | single device):  " + ",  ".join(
        f"{p['loss']:.4f} | {s['loss']:.4f}" for p, s in zip(report.steps, single.steps,
                                                              strict=True)))
    say(_check_line(report.equivalence, config.precision))
    say(_check_line(exact.equivalence, "fp64"))
    for warning in report.warnings:
        say(f"warning: {warning}")

    say()
    say("Peak memory per rank, by category (bytes each rank's arrays held):")
    say(memory_table(report))
    say()
    say("Traffic per rank and step, by group and collective (ring-algorithm bytes sent):")
    say(traffic_table(report))
    say()
    say("Simulated time per rank over the run:")
    say(time_table(report))
    pipe = report.pipeline
    say(f"pipeline bubble: {pipe['bubble_fraction']:.1%} of rank-time idle "
        f"({pipe['schedule']}, {pipe['micro_batches']} micro-batches over "
        f"{config.pp} stages; uniform-stage formula "
        f"{SCHEDULES[pipe['schedule']].bubble_formula} = "
        f"{pipe['uniform_bubble_fraction']:.1%})")

    ablations = {name: working(f"{name} alone, for the comparison",
                               lambda c=c: train(c, device=profile))
                 for name, c in ablation_configs(config).items()}
    say()
    for line in summary(single, ablations, report, layout_name(config)):
        say(line)

    if config.dp > 1:
        base = next((r for r in ablations.values() if r.config["zero"] == 1
                     and r.world_size == config.dp), None)
        offloaded = {name: working(f"{name}, for the offload table",
                                   lambda c=c: train(c, device=profile))
                     for name, c in offload_configs(config).items()}
        say()
        for line in offload_summary(base, offloaded):
            say(line)

    try:
        figures = working("drawing the figures (a first run also builds matplotlib's font "
                          "cache)", lambda: save_figures(report, single, Path(out_dir)))
    except OSError as err:  # (the run is shown all the same; what is missing, said last)
        figures, failed["figures"] = [], (f"{out_dir}: the figures could not be written "
                                          f"({err.strerror or err})")
    say()
    if figures:
        say(f"figures written to {Path(out_dir)}/: " + ", ".join(p.name for p in figures))
    if "trace" not in failed:
        say(f"profiler trace written to {trace_dir}/: rank<N>.json per rank (open "
            f"merged/all_ranks.json in Perfetto UI); `minipar profile {trace_dir}` names "
            "the bottleneck (docs/profiling.md)")
    seconds = time.perf_counter() - started
    say(f"(demo took {seconds:.1f} s of wall time)")
    result = DemoResult(report, exact, single, ablations, figures, lines, seconds)
    if failed:  # everything above was shown; what is missing on disk is said last
        raise OutputError("out", "; ".join(failed.values()), report=result)
    return result


def _rate(bytes_per_second: float) -> str:
    """0.8e9 -> '0.8 GB/s', 8.9e7 -> '89 MB/s'."""
    if bytes_per_second >= 1e9 / 2:
        return f"{bytes_per_second / 1e9:.2g} GB/s"
    return f"{bytes_per_second / 1e6:.0f} MB/s"


def _check_line(check: dict, precision: str) -> str:
    verdict = "passed" if check["passed"] else "FAILED"
    line = (f"check against single-device training, {precision}: {verdict} (max relative "
            f"parameter difference {check['max_rel_param_diff_per_step']:.1e}, tolerance "
            f"{check['tolerance']:.0e})")
    first = check["first_mismatch"]
    if first is not None:
        line += (f"; first divergence: step {first['step']}, {first['tensor']}"
                 + ("" if first["rank"] is None else f", rank {first['rank']}"))
    return line


# ------------------------------------------------------------------ the answer
def _step_seconds(report: Report) -> float:
    """Simulated seconds per optimizer step, averaged over the run."""
    return report.step_end_s[-1] / len(report.steps)


def worst_rank_memory(report: Report) -> dict[str, int]:
    """Per category, the largest peak over the ranks (the GPU the layout needs)."""
    keys = (*MEMORY_CATEGORIES, "peak_total")
    return {k: max(r["memory"][k] for r in report.ranks) for k in keys}


def sent_per_step(report: Report) -> dict[str, float]:
    """Per group kind, the most bytes one rank sent per step."""
    steps = max(1, len(report.steps))
    return {g: max(r["comm"]["by_group"].get(g, 0) for r in report.ranks) / steps
            for g in ("dp", "tp", "pp")}


def summary(single: Report, ablations: dict[str, Report], combined: Report,
            combined_name: str) -> list[str]:
    """The answer to "which parallelism cut which memory, and what did it cost in
    traffic", from the measured runs: a table of each run's worst-rank peak bytes as a
    share of the single device's, then one sentence per parallelism."""
    base = worst_rank_memory(single)
    runs = {"1 GPU": single, **ablations, combined_name: combined}
    keys = ("params", "grads", "optimizer", "activations", "peak_total")
    rows = []
    for name, report in runs.items():
        memory = worst_rank_memory(report)
        sent = sent_per_step(report)
        traffic = ", ".join(f"{g} {human_bytes(b)}" for g, b in sent.items() if b) or "-"
        rows.append([name, report.world_size,
                     *(f"{memory[k] / base[k]:.0%}" if base[k] else "-" for k in keys),
                     traffic, human_seconds(_step_seconds(report))])
    out = ["Which parallelism cut which memory, and what did it cost? (worst rank's peak "
           "bytes as a share of one GPU's; bytes one rank sent per step; simulated time "
           "per step)",
           format_table(["run", "ranks", *keys, "sent per step", "step time"], rows)]
    plain_dp = next((r for name, r in ablations.items() if r.config["zero"] == 0
                     and r.config["dp"] > 1 and r.world_size == r.config["dp"]), None)
    for name, report in {**ablations, combined_name: combined}.items():
        out.append("- " + _sentence(name, single, report, plain_dp))
    return out


def _sentence(name: str, single: Report, report: Report, plain_dp: Report | None) -> str:
    """One line: what `report` cut relative to `single`, and what it sent for it."""
    base, memory = worst_rank_memory(single), worst_rank_memory(report)
    ratio = {k: memory[k] / base[k] for k in base if base[k]}
    cut = [f"{k} to {ratio[k]:.0%}" for k in ("params", "grads", "optimizer", "activations")
           if ratio.get(k, 1.0) < 0.9]
    what = (f"cut {', '.join(cut)}" if cut
            else "cut no memory, each rank keeps the whole model state")
    sent = sent_per_step(report)
    cost = " + ".join(f"{human_bytes(b)} {g}" for g, b in sent.items() if b)
    text = f"{name}: {what}; peak total {ratio['peak_total']:.0%}; sends {cost} per step"
    if report.config["zero"] and plain_dp is not None and report is not plain_dp \
            and report.config["tp"] == report.config["pp"] == 1:
        text += f" (plain DP: {human_bytes(sent_per_step(plain_dp)['dp'])})"
    if report.pipeline is not None:
        text += f", and leaves {report.pipeline['bubble_fraction']:.0%} of rank-time idle"
        if ratio.get("activations", 1.0) >= 0.9:
            text += (f"; activations stay: with 1F1B the first stage holds up to "
                     f"{report.config['pp']} micro-batches of its layers in flight")
    speed = _step_seconds(single) / _step_seconds(report)  # runs of 3 steps and of 1
    return text + f"; step {speed:.1f}x faster than one GPU."


def offload_configs(config: TrainConfig) -> dict[str, TrainConfig]:
    """The demo's DP group alone with ZeRO-1/3 and offload, one step each."""
    common = dict(tp=1, pp=1, sequence_parallel=False, check=False, steps=1,
                  global_batch_size=config.global_batch_size, grad_accum_steps=None)
    return {name.replace("DP 2", f"DP {config.dp}"): config.replace(**common, **settings)
            for name, settings in OFFLOADS.items()}


def offload_summary(base: Report | None, runs: dict[str, Report]) -> list[str]:
    """The second table: where offload moves the model state (GPU / host / NVMe peak
    bytes of the worst rank), what crosses PCIe and the NVMe drive per step, and the
    step time it costs."""
    runs = {**({"DP " + str(base.config["dp"]) + " + ZeRO-1": base} if base else {}), **runs}
    rows = []
    for name, report in runs.items():
        steps = max(1, len(report.steps))
        peak = {tier: max(r.get(tier, {}).get("peak_total", 0) for r in report.ranks)
                for tier in ("memory", "memory_host", "memory_nvme")}
        moved = {k: max(r.get("transfers", {}).get(k, 0) for r in report.ranks) / steps
                 for k in ("to_host_bytes", "to_device_bytes", "nvme_read_bytes",
                           "nvme_write_bytes")}
        rows.append([name, *(human_bytes(peak[t]) for t in peak),
                     f"{human_bytes(moved['to_host_bytes'])} / "
                     f"{human_bytes(moved['to_device_bytes'])}",
                     f"{human_bytes(moved['nvme_read_bytes'])} / "
                     f"{human_bytes(moved['nvme_write_bytes'])}",
                     human_seconds(report.step_end_s[-1] / steps)])
    return ["Where offload moves the model state, and what it costs (worst rank's peak "
            "bytes per tier; bytes per step over PCIe and to the NVMe drive; simulated "
            "time per step):",
            format_table(["run", "GPU", "host", "NVMe", "PCIe down / up",
                          "NVMe read / write", "step time"], rows),
            "- Offload cuts GPU bytes, not work: what leaves the GPU crosses PCIe (the "
            "gradient down, the parameters up, ZeRO-3's shards for every gather) and Adam "
            f"runs on the CPU, here {_host_share(runs):.0%} of the offloaded ZeRO-1 step: "
            "this batch is too small to hide it; offload pays when the model does not "
            "fit otherwise (docs/data-parallel-and-zero.md)."]


def _host_share(runs: dict[str, Report]) -> float:
    """CPU Adam's share of rank 0's time in the first offloaded run."""
    report = next(r for r in runs.values() if r.config["offload_optimizer"] != "none")
    time = report.ranks[0]["time"]
    spent = sum(time.get(k, 0.0) for k in ("compute_s", "comm_s", "idle_s",
                                           "host_compute_s", "transfer_s"))
    return time.get("host_compute_s", 0.0) / spent


# ------------------------------------------------------------------ figures
def save_figures(report: Report, single: Report, out_dir: Path) -> list[Path]:
    """timeline.png (the last step), memory.png (with the single device as baseline),
    traffic.png; returns their paths."""
    from minipar.distributed.timeline import bubble_fraction
    from minipar.viz.memory import plot_memory
    from minipar.viz.save import save_figure
    from minipar.viz.timeline import plot_timeline
    from minipar.viz.traffic import plot_traffic

    out_dir.mkdir(parents=True, exist_ok=True)
    start, end = report.step_window(-1)
    labels = [f"rank {r['rank']} (dp{r['coords']['dp']} pp{r['coords']['pp']} "
              f"tp{r['coords']['tp']})" for r in report.ranks]
    config = report.config
    idle = bubble_fraction(report.timelines, start, end)
    title = (f"last step of dp{config['dp']} x tp{config['tp']} x pp{config['pp']} "
             f"ZeRO-{config['zero']}: {config['schedule']}, {config['grad_accum_steps']} "
             f"micro-batches; idle {idle:.1%} of rank-time")
    figures = {
        "timeline.png": plot_timeline(report.timelines, start=start, end=end,
                                      rank_labels=labels, title=title,
                                      transfers=report.transfers),
        "memory.png": plot_memory(report, baselines={"1 GPU": single}),
        "traffic.png": plot_traffic(report),
    }
    return [save_figure(fig, out_dir / name) for name, fig in figures.items()]
