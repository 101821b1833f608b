"""What the emulation costs on the host: a dp2 x tp2 x pp2 step against one device.

    python benchmarks/bench_emulation.py              # ~1.5 minutes on 2 cores
    python benchmarks/bench_emulation.py --quick      # smoke run (a few seconds)

1. Overhead ratio. Wall time of one optimizer step of the demo model (`minipar demo`'s
   config: 4 layers, d_model 64, 32 tokens, bf16-mixed) trained as dp2 x tp2 x pp2 with
   ZeRO-1 on 8 virtual ranks, divided by the wall time of the single-device step on the
   same global batch (32 sequences, in the same 8 micro-batches of 4; the run `--check`
   compares against). 1.0 would mean emulating 8 GPUs costs nothing extra: the same
   arithmetic, cut in pieces. The two alternate in one process, in rounds, so machine
   noise hits both alike; the median of the per-round ratios is reported.
2. Weak scaling. Wall time per step as the world grows from 1 to 64 ranks at fixed
   per-rank work (data parallelism: every rank runs the same micro-batch of a small
   model): ideal emulation costs world x (one rank's step), so the table shows the time
   per rank-step relative to one rank.

A step's time is measured as (time of a run of 1 + k steps - time of a 1-step run) / k,
which removes building the model and assembling the report.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np
from arguments import positive_int

from minipar.demo import DEMO_CONFIG
from minipar.train import TrainConfig, train


def step_seconds(config: TrainConfig, steps: int) -> float:
    """Wall seconds of one steady-state optimizer step of `config`."""
    def run(n):
        start = time.perf_counter()
        train(config.replace(steps=n, warmup_steps=0))
        return time.perf_counter() - start

    return (run(1 + steps) - run(1)) / steps


def overhead_ratio(config: TrainConfig, rounds: int, steps: int) -> dict:
    """Median over rounds of (parallel step time / single-device step time)."""
    parallel = config.replace(check=False)
    single = parallel.replace(dp=1, tp=1, pp=1, zero=0, sequence_parallel=False,
                              grad_accum_steps=config.grad_accum_steps * config.dp,
                              global_batch_size=config.global_batch_size)
    step_seconds(parallel, 1), step_seconds(single, 1)  # warm up (imports, caches)
    times = {"parallel": [], "single": []}
    ratios = []
    for _ in range(rounds):
        p, s = step_seconds(parallel, steps), step_seconds(single, steps)
        times["parallel"].append(p)
        times["single"].append(s)
        ratios.append(p / s)
    return {"ratio": statistics.median(ratios), "ratios": ratios,
            "parallel_s": statistics.median(times["parallel"]),
            "single_s": statistics.median(times["single"])}


# Weak scaling uses a smaller rank program than the demo's (a 64-wide model, one micro-batch
# per step), so that 64 ranks take seconds, not minutes; it measures how the emulator's
# own cost grows with the world, not the model.
SCALING = DEMO_CONFIG.replace(check=False, tp=1, pp=1, d_model=64, n_head=4, seq_len=32,
                              micro_batch_size=4, grad_accum_steps=1, global_batch_size=None,
                              precision="fp32")


def weak_scaling(worlds, steps: int) -> list[dict]:
    """Step time per world size at fixed per-rank work: data parallelism (ZeRO-1) over
    `world` ranks, every rank running the same micro-batch of the SCALING model."""
    rows, one = [], None
    for world in worlds:
        config = SCALING.replace(dp=world, zero=1, grad_accum_steps=1, global_batch_size=None)
        seconds = min(step_seconds(config, steps) for _ in range(2 if world < 32 else 1))
        one = seconds if one is None else one
        rows.append({"world": world, "step_s": seconds, "per_rank_s": seconds / world,
                     "vs_one": seconds / world / one})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--rounds", type=positive_int, default=7)
    args = parser.parse_args(argv)
    rounds, steps = (2, 1) if args.quick else (args.rounds, 4)
    worlds = (1, 2, 8) if args.quick else (1, 2, 4, 8, 16, 32, 64)
    print(f"Python {platform.python_version()}, NumPy {np.__version__}, "
          f"{os.cpu_count()} CPU(s), {sys.platform}")

    config = DEMO_CONFIG
    result = overhead_ratio(config, rounds, steps)
    print(f"\n1. demo model ({config.n_layer} layers, d_model {config.d_model}, seq "
          f"{config.seq_len}, {config.precision}), global batch {config.global_batch_size}:")
    print(f"   single device           {result['single_s'] * 1e3:7.1f} ms per step")
    print(f"   dp2 x tp2 x pp2 ZeRO-1  {result['parallel_s'] * 1e3:7.1f} ms per step "
          f"on 8 virtual ranks")
    print(f"   overhead ratio (median of {rounds} rounds): {result['ratio']:.2f}  "
          f"(rounds: {', '.join(f'{r:.2f}' for r in result['ratios'])})")

    print(f"\n2. weak scaling: dp=world (ZeRO-1), each rank one micro-batch of "
          f"{SCALING.micro_batch_size} x {SCALING.seq_len} tokens, d_model "
          f"{SCALING.d_model}, {SCALING.n_layer} layers, {SCALING.precision}:")
    print(f"   {'world':>5}  {'step':>10}  {'per rank':>9}  {'vs 1 rank':>9}")
    for row in weak_scaling(worlds, steps):
        print(f"   {row['world']:>5}  {row['step_s'] * 1e3:7.1f} ms  "
              f"{row['per_rank_s'] * 1e3:6.1f} ms  {row['vs_one']:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
