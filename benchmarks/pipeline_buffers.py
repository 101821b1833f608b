"""The planner's pipeline buffers against the emulator's, on every pipeline rank.

    python benchmarks/pipeline_buffers.py            # 700 layouts, about 3 minutes
    python benchmarks/pipeline_buffers.py --quick    # a sixth of them

One replica (so the only buffers are the pipeline's messages, sequence parallelism's
re-gather and ring attention's blocks): pp 2-4 x GPipe, 1F1B, interleaved, ZB-H1, ZB-H2,
ZB-V, DualPipe-V x 1-9 micro-batches x tp 1-2 with and without SP x no, full or
selective recomputation x cp 1-2 x fp64 or bf16-mixed, drawn with a fixed seed, on a
toy GPT (d_model 16, seq 8, two layers a chunk). Each layout trains one step and is
planned; printed: every pipeline rank whose "buffers" differ (planned / measured - 1,
the two, the settings) and the tally, with and without sequence parallelism. Run it on
another tree with PYTHONPATH to see what a change moved.
"""

from __future__ import annotations

import argparse
import itertools
import random
import warnings

from minipar.errors import ConfigError
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig
from minipar.plan.shapes import from_train_config
from minipar.train import TrainConfig, train

TOY = dict(d_model=16, n_head=4, seq_len=8, steps=1, data="synthetic", vocab_size=32,
           micro_batch_size=1)
CHUNKS = {"interleaved": 2, "dualpipe-v": 2, "zb-v": 2}


def layouts(quick: bool):
    grid = list(itertools.product(
        ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipe-v"), (2, 3, 4),
        (1, 2, 3, 4, 5, 6, 8, 9), ((1, False), (2, False), (2, True)),
        (None, "full", "selective"), (1, 2), ("fp64", "bf16-mixed")))
    random.Random(7).shuffle(grid)
    for schedule, pp, m, (tp, sp), recompute, cp, precision in grid[:120 if quick else 700]:
        v = CHUNKS.get(schedule, 1)
        yield dict(pp=pp, schedule=schedule, virtual_stages=v, n_layer=pp * v,
                   grad_accum_steps=m, tp=tp, sequence_parallel=sp, cp=cp,
                   recompute_granularity=recompute, precision=precision)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a sixth of the layouts")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # a layout's advice is not a finding
    ranks, off = {False: 0, True: 0}, {False: 0, True: 0}
    for settings in layouts(args.quick):
        try:
            config = TrainConfig(**{**TOY, **settings})
            report = train(config)
        except ConfigError:  # a layout minipar refuses (e.g. too few micro-batches)
            continue
        shape = from_train_config(config, report.config["vocab_size"])
        est = estimate(shape, ParallelConfig.from_train_config(config),
                       ClusterSpec.from_device_profile(gpus_per_node=8), all_stages=True)
        sp = settings["sequence_parallel"]
        for stage in est.stages:
            (measured,) = [r for r in report.ranks if r["coords"] == {
                **dict.fromkeys(r["coords"], 0), "pp": stage.rank}]
            got, planned = measured["memory"]["buffers"], stage.memory["buffers"]
            ranks[sp] += 1
            if got != planned:
                off[sp] += 1
                print(f"{planned / got - 1:+8.2%}  measured {got:6d}  planned {planned:6d}  "
                      f"pipeline rank {stage.rank}  {settings}", flush=True)
    for sp in (False, True):
        print(f"{'with' if sp else 'without'} sequence parallelism: "
              f"{ranks[sp] - off[sp]} of {ranks[sp]} pipeline ranks exact")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
