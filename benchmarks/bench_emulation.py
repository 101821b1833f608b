"""What the emulation costs on the host: a dp2 x tp2 x pp2 step against one device.

    python benchmarks/bench_emulation.py              # ~2 minutes on 2 cores
    python benchmarks/bench_emulation.py --quick      # smoke run (a few seconds)
    python benchmarks/bench_emulation.py --only scaling --rounds 5
    python benchmarks/bench_emulation.py --only ratio --split   # dp2, tp2, pp2 alone too
    python benchmarks/bench_emulation.py --only ratio --sequence-parallel   # and with SP
    python benchmarks/bench_emulation.py --only ratio --d-model 384   # a wider demo model

1. Overhead ratio. Wall time of one optimizer step of the demo model (`minipar demo`'s
   config: 4 layers, d_model 192, 6 heads, 64 tokens, bf16-mixed) trained as dp2 x tp2 x
   pp2 with ZeRO-1 on 8 virtual ranks, divided by the wall time of the single-device step
   on the same global batch (32 sequences, in the same 8 micro-batches of 4; the run
   `--check` compares against). 1.0 would mean emulating 8 GPUs costs nothing extra: the
   same arithmetic, cut in pieces. The two alternate in one process, in rounds, so
   machine noise hits both alike; the median of the per-round ratios is reported, for
   wall time and for CPU time (of the whole process: what the machine paid). `--split`
   also runs each parallelism alone on the same global batch (dp2 ZeRO-1, tp2, pp2), in
   the same rounds, to say which of the three costs what; `--d-model` changes the width
   (the heads stay 6), to tell a cost per op from a cost per activation element.
   `--sequence-parallel` also runs the layout with SP (Korthikanti et al. 2022): without
   it, both TP ranks repeat the LayerNorms and residual adds on the whole sequence,
   arithmetic a single device does once. SP removes that repetition but does not lower
   the ratio: its all-gathers and reduce-scatters, and its GEMMs' casts of the gathered
   sequence, cost about what it saves (`emulation_profile.py 3d-sp --ops --against
   single` puts the two side by side, op by op).
   `--no-lending`: the turn is never lent during GEMMs (minipar/distributed/turns.py
   lends it while a core is spare, so that the CPU ratios of an idle machine include two
   ranks computing at once and those of a busy one do not); CPU ratios then compare alike.
2. Weak scaling. Wall time per step as the world grows from 1 to 64 ranks at fixed
   per-rank work (data parallelism, ZeRO-1: every rank runs one micro-batch of a small
   model): ideal emulation costs world x (one rank's step), so the table shows the time
   per rank-step relative to one rank's. Every round measures every world once, smallest
   first, each between two runs of one rank: each ratio is against their mean (paired, as
   in part 1), and each figure is the median over the rounds; the row of 1 rank, against
   itself, reads the noise. Under ZeRO-1 a rank's AdamW runs on 1/world of the
   parameters, so the collectives' own arithmetic is paid from what the sharded
   optimizer saves, and a ratio a little under 1 is possible.

A step's time is measured as (time of a run of 1 + k steps - time of a 1-step run) / k,
which removes building the model and assembling the report. The first line says what the
machine is and how busy it was: on shared cores another job's load lands on some rounds
and not others, which the medians absorb and a single run would not.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from arguments import positive_int
from machine import describe

from minipar.demo import DEMO_CONFIG
from minipar.distributed.turns import SpareCore
from minipar.errors import ConfigError
from minipar.train import TrainConfig, train


def step_seconds(config: TrainConfig, steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds of one steady-state optimizer step of `config`."""
    def run(n):
        wall, cpu = time.perf_counter(), time.process_time()
        train(config.replace(steps=n, warmup_steps=0))
        return time.perf_counter() - wall, time.process_time() - cpu

    (wall_1, cpu_1), (wall_k, cpu_k) = run(1), run(1 + steps)
    return (wall_k - wall_1) / steps, (cpu_k - cpu_1) / steps


def single_device(config: TrainConfig) -> TrainConfig:
    """The run `--check` compares `config` against: one device, the same global batch in
    the same micro-batches."""
    return config.replace(dp=1, tp=1, pp=1, zero=0, sequence_parallel=False,
                          grad_accum_steps=config.grad_accum_steps * config.dp,
                          global_batch_size=config.global_batch_size)


def alone(config: TrainConfig) -> dict[str, TrainConfig]:
    """Each parallelism of `config` on its own (`--split`), on the same global batch."""
    single = single_device(config)
    return {f"dp{config.dp} ZeRO-{config.zero} alone": single.replace(
                dp=config.dp, zero=config.zero, grad_accum_steps=config.grad_accum_steps),
            f"tp{config.tp} alone": single.replace(tp=config.tp),
            f"pp{config.pp} alone": single.replace(pp=config.pp)}


def overhead_ratio(config: TrainConfig, rounds: int, steps: int,
                   others: dict[str, TrainConfig] | None = None) -> dict:
    """Median over rounds of (parallel step time / single-device step time), wall and CPU;
    with `others` ({name: config}), each of them against the same single-device step
    (`result["others"][name]`: its wall and CPU ratios)."""
    parallel = config.replace(check=False)
    single = single_device(parallel)
    others = {name: other.replace(check=False) for name, other in (others or {}).items()}
    step_seconds(parallel, 1), step_seconds(single, 1)  # warm up (imports, caches)
    times = {"parallel": [], "single": [], **{name: [] for name in others}}
    for _ in range(rounds):
        times["parallel"].append(step_seconds(parallel, steps))
        times["single"].append(step_seconds(single, steps))
        for name, other in others.items():
            times[name].append(step_seconds(other, steps))
    pairs = list(zip(times["parallel"], times["single"], strict=True))

    def against_single(name: str, part: int) -> float:  # part 0: wall, 1: CPU
        return statistics.median(o[part] / s[part] for o, s in
                                 zip(times[name], times["single"], strict=True))

    return {"ratio": statistics.median(p[0] / s[0] for p, s in pairs),
            "ratios": [p[0] / s[0] for p, s in pairs],
            "cpu_ratio": statistics.median(p[1] / s[1] for p, s in pairs),
            "parallel_s": statistics.median(p[0] for p, _ in pairs),
            "single_s": statistics.median(s[0] for _, s in pairs),
            "parallel_cpu_s": statistics.median(p[1] for p, _ in pairs),
            "single_cpu_s": statistics.median(s[1] for _, s in pairs),
            "others": {name: (against_single(name, 0), against_single(name, 1))
                       for name in others}}


# Weak scaling uses a smaller rank program than the demo's (a 64-wide model, one micro-batch
# per step), so that 64 ranks take seconds, not minutes; it measures how the emulator's
# own cost grows with the world, not the model.
SCALING = DEMO_CONFIG.replace(check=False, tp=1, pp=1, d_model=64, n_head=4, seq_len=32,
                              micro_batch_size=4, grad_accum_steps=1, global_batch_size=None,
                              precision="fp32")


def weak_scaling(worlds, rounds: int, steps: int) -> list[dict]:
    """Step time per world size at fixed per-rank work: data parallelism (ZeRO-1) over
    `world` ranks, every rank running the same micro-batch of the SCALING model.

    Paired, as the overhead ratio is: in every round each world is measured between two
    runs of one rank, and its ratio is taken against their mean, so that a spell of
    another job's load on shared cores lands on both sides of a ratio, not on one world's
    column; the figures are medians over the rounds. A world of w ranks runs
    max(steps, 16 x steps / w) steps: every measurement spans at least 16 x steps
    rank-steps, so that a small world's few milliseconds a step are not lost in the noise
    of the two runs' start-up that the difference cancels only on average."""
    configs = {world: SCALING.replace(dp=world, zero=1, grad_accum_steps=1,
                                      global_batch_size=None) for world in worlds}
    # (its own row, world 1 against itself, reads the noise between two runs of one rank)
    one = SCALING.replace(dp=1, zero=1, grad_accum_steps=1, global_batch_size=None)

    def measure(config: TrainConfig, world: int) -> tuple[float, float]:
        return step_seconds(config, max(steps, math.ceil(16 * steps / world)))

    measure(one, 1)  # warm up
    measured = {world: [] for world in worlds}
    for _ in range(rounds):
        before = measure(one, 1)
        for world in worlds:
            ranks = measure(configs[world], world)
            after = measure(one, 1)
            # one rank on both sides: a run measured second was seen to run ~10% slower
            # than the same run measured first, so one side alone biases every ratio
            measured[world].append((tuple((a + b) / 2 for a, b in zip(before, after,
                                                                      strict=True)), ranks))
            before = after
    rows = []
    for world in worlds:
        pairs = measured[world]
        wall = statistics.median(w for _, (w, _c) in pairs)
        cpu = statistics.median(c for _, (_w, c) in pairs)
        rows.append({"world": world, "step_s": wall, "per_rank_s": wall / world,
                     "vs_one": statistics.median(w / world / w1 for (w1, _), (w, _c) in pairs),
                     "cpu_per_rank_s": cpu / world,
                     "cpu_vs_one": statistics.median(c / world / c1
                                                     for (_, c1), (_w, c) in pairs)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--rounds", type=positive_int, default=None,
                        help="rounds of each part (default: 7 for the ratio, 3 for scaling)")
    parser.add_argument("--only", choices=("ratio", "scaling"), default=None,
                        help="run one of the two parts")
    parser.add_argument("--split", action="store_true",
                        help="the ratio of dp, tp and pp alone too (same rounds)")
    parser.add_argument("--d-model", type=positive_int, default=DEMO_CONFIG.d_model,
                        help="the ratio part's model width (default: the demo's)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="the ratio of the same layout with sequence parallelism too "
                             "(same rounds): TP without SP repeats the LayerNorms and residual "
                             "adds on both TP ranks, extra arithmetic one device "
                             "does not do")
    parser.add_argument("--no-lending", action="store_true",
                        help="never lend the turn during GEMMs, whatever the load")
    args = parser.parse_args(argv)
    if args.no_lending:
        SpareCore.SPARE_CORES = math.inf  # no machine has that many spare cores
    steps = 1 if args.quick else 4
    worlds = (1, 2, 8) if args.quick else (1, 2, 4, 8, 16, 32, 64)
    print(describe())

    if args.only in (None, "ratio"):
        rounds = 2 if args.quick else (args.rounds or 7)
        try:
            config = DEMO_CONFIG.replace(d_model=args.d_model)
        except ConfigError as error:  # (a width the demo's 6 heads and tp2 do not divide)
            parser.error(f"argument --d-model: {error}")
        others = alone(config) if args.split else {}
        if args.sequence_parallel:
            others[f"dp{config.dp} x tp{config.tp} x pp{config.pp} + SP"] = config.replace(
                sequence_parallel=True)
        result = overhead_ratio(config, rounds, steps, others)
        print(f"\n1. demo model ({config.n_layer} layers, d_model {config.d_model}, seq "
              f"{config.seq_len}, {config.precision}), global batch "
              f"{config.global_batch_size}{', the turn never lent' if args.no_lending else ''}:")
        print(f"   single device           {result['single_s'] * 1e3:7.1f} ms per step "
              f"(CPU {result['single_cpu_s'] * 1e3:.1f} ms)")
        print(f"   dp2 x tp2 x pp2 ZeRO-1  {result['parallel_s'] * 1e3:7.1f} ms per step "
              f"(CPU {result['parallel_cpu_s'] * 1e3:.1f} ms) on 8 virtual ranks")
        print(f"   overhead ratio (median of {rounds} rounds): wall {result['ratio']:.2f}, "
              f"CPU {result['cpu_ratio']:.2f}  (wall by round: "
              f"{', '.join(f'{r:.2f}' for r in result['ratios'])})")
        for name, (wall, cpu) in result["others"].items():
            print(f"   {name:<24}overhead ratio: wall {wall:.2f}, CPU {cpu:.2f}")

    if args.only in (None, "scaling"):
        rounds = 1 if args.quick else (args.rounds or 3)
        print(f"\n2. weak scaling: dp=world (ZeRO-1), each rank one micro-batch of "
              f"{SCALING.micro_batch_size} x {SCALING.seq_len} tokens, d_model "
              f"{SCALING.d_model}, {SCALING.n_layer} layers, {SCALING.precision}; median of "
              f"{rounds} rounds:")
        print(f"   {'world':>5}  {'step':>10}  {'per rank':>9}  {'vs 1 rank':>9}  "
              f"{'CPU per rank':>12}  {'vs 1 rank':>9}")
        for row in weak_scaling(worlds, rounds, steps):
            print(f"   {row['world']:>5}  {row['step_s'] * 1e3:7.1f} ms  "
                  f"{row['per_rank_s'] * 1e3:6.1f} ms  {row['vs_one']:9.2f}  "
                  f"{row['cpu_per_rank_s'] * 1e3:9.1f} ms  {row['cpu_vs_one']:9.2f}")
    print(f"\n{describe().rpartition('; ')[2]} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
