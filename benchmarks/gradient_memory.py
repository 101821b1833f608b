"""The planner's gradient memory against the emulator's, over four grids of layouts.

    python benchmarks/gradient_memory.py grads      # 1,456 layouts, about 1 minute
    python benchmarks/gradient_memory.py buffers    # 4,224 layouts, about 4 minutes
    python benchmarks/gradient_memory.py buffers --zero 2 --quick
    python benchmarks/gradient_memory.py beside     # 2,160 layouts, about 3 minutes
    python benchmarks/gradient_memory.py pipelines  # 1,344 layouts, about 4 minutes
    python benchmarks/gradient_memory.py pipelines-dp   # 1,260 layouts, about 3 minutes
    python benchmarks/gradient_memory.py beside --total # peak_total over a grid

`grads`: one micro-batch under recomputation, where the "grads" peak is what backward
has made when the lowest recomputed layer's input gradient is alive
(minipar/plan/gradient_walk.py). ZeRO-0/1/2 x full or selective recomputation x tied or
untied x buckets of 0, 0.001 and 0.25 MiB x overlap on or off x dp 1, 2, 4 x tp 1, 2 x
GELU or SwiGLU x fp64 or bf16-mixed, on a 3-layer toy GPT (d_model 16, seq 8), and a
dozen hand-picked extras (pipelines, block and uniform recomputation, SP, CP, GQA, MoE,
dropout). `buffers`: the gradient reduction's "buffers" (the planner's
`detail.sync_buffers`) of DDP and ZeRO-1/2 with buckets of 0.0005-0.25 MiB, one and two
micro-batches, every recomputation, dp 1-4, tp 1-2 with and without SP, on one pipeline
stage. `beside`: the whole "buffers" figure, the reduction's with the backward's own
beside them (sequence parallelism's re-gather, ring attention's blocks), on one stage
with SP or CP: DDP and ZeRO-1/2, buckets of 0, 0.001 and 0.25 MiB, overlap on and off,
dp 1-2, every recomputation, 1 and 2 micro-batches, micro-batches of 1 and 6 sequences
of 32 tokens, fp64 and bf16, then CP 4, SP with CP 2 and with CP 4. `pipelines`: the
same figure on pp 2 with SP or CP (GPipe, 1F1B, interleaved, ZB-H1, ZB-H2, ZB-V,
DualPipe-V; DDP and ZeRO-1, buckets of 0.001 and 0.25 MiB, overlap on and off, dp 1-2,
no or full recomputation, 2 and 4 micro-batches, ZB-H2, ZB-V and DualPipe-V only 4);
`pipelines-dp` without either (the same schedules, buckets of 0, 0.001 and 0.25 MiB, 4
micro-batches: tied and untied, fp64 and bf16 without recomputation, untied fp64 with
full recomputation). `--total` compares `peak_total` (the peak of the sum of every
category at one instant) over a grid instead of the grid's figure. Each layout trains
two steps and is planned;
printed: every pipeline rank whose figure differs (planned / measured - 1, the two, the
settings) and the tally. Run it on another tree with PYTHONPATH to see what a change
moved.
"""

from __future__ import annotations

import argparse
import itertools
import warnings

from minipar.errors import ConfigError
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig
from minipar.plan.shapes import from_train_config
from minipar.train import TrainConfig, train

TOY = dict(d_model=16, n_head=4, seq_len=8, steps=2, data="synthetic", vocab_size=32,
           micro_batch_size=1)


def grads_layouts(zeros, quick: bool):
    """One micro-batch under recomputation."""
    for zero, rec, tie, bucket, overlap, dp, tp, mlp, precision in itertools.product(
            zeros, ("full", "selective"), (True, False), (0, 0.001, 0.25), (True, False),
            (1, 2, 4), (1, 2), ("gelu", "swiglu"), ("fp64", "bf16-mixed")):
        if (dp, tp) == (4, 2) or (quick and (mlp, precision) != ("gelu", "fp64")):
            continue
        yield dict(zero=zero, recompute_granularity=rec, tie_embeddings=tie,
                   bucket_size_mb=bucket, overlap_grad_reduce=overlap, dp=dp, tp=tp, mlp=mlp,
                   precision=precision, n_layer=3, grad_accum_steps=1)
    full = dict(recompute_granularity="full", grad_accum_steps=1)
    yield from (
        dict(full, zero=1, pp=2, dp=2, n_layer=4, bucket_size_mb=0.001),
        dict(full, zero=1, pp=2, dp=2, n_layer=4, tie_embeddings=False),
        dict(zero=0, recompute_granularity="selective", pp=3, n_layer=3, grad_accum_steps=1),
        dict(full, zero=2, recompute_method="uniform", recompute_num_layers=2, dp=2,
             n_layer=4, bucket_size_mb=0.001),
        dict(full, zero=2, recompute_method="block", recompute_num_layers=1, dp=2, n_layer=4,
             bucket_size_mb=0.001),
        dict(full, zero=1, recompute_method="block", recompute_num_layers=1, dp=2, n_layer=4,
             bucket_size_mb=0.001, tie_embeddings=False),
        dict(full, zero=2, dp=2, tp=2, sequence_parallel=True, n_layer=3,
             bucket_size_mb=0.001),
        dict(zero=2, recompute_granularity="selective", dp=2, cp=2, n_layer=3,
             bucket_size_mb=0.001, grad_accum_steps=1),
        dict(full, zero=1, dp=2, n_layer=3, moe_num_experts=2, moe_top_k=1,
             moe_layer_freq=1),
        dict(full, zero=2, dp=2, n_layer=3, bucket_size_mb=0.001, n_kv_head=2),
        dict(full, zero=2, dp=2, n_layer=3, bucket_size_mb=0.001, dropout=0.1),
    )


def buffers_layouts(zeros, quick: bool):
    """Bucketed reductions on one pipeline stage."""
    for zero, rec, tie, bucket, overlap, dp, tp, sp, mlp, accum, precision, layers in (
            itertools.product(zeros, (None, "full", "selective"), (True, False),
                              (0.0005, 0.001, 0.002, 0.005, 0.25), (True, False),
                              (1, 2, 3, 4), (1, 2), (False, True), ("gelu", "swiglu"),
                              (1, 2), ("fp64", "bf16-mixed"), (2, 3))):
        if (sp and tp == 1) or (dp, tp) in ((4, 2), (3, 2)):
            continue
        if (mlp, precision, layers) != ("gelu", "fp64", 2) and (rec, bucket) != ("full", 0.001):
            continue
        if quick and (rec, tie, mlp) != (None, True, "gelu"):
            continue
        yield dict(zero=zero, recompute_granularity=rec, tie_embeddings=tie,
                   bucket_size_mb=bucket, overlap_grad_reduce=overlap, dp=dp, tp=tp,
                   sequence_parallel=sp, mlp=mlp, grad_accum_steps=accum,
                   precision=precision, n_layer=layers)


def beside_layouts(zeros, quick: bool):
    """The backward's own buffers beside the reduction's, on one stage."""
    for zero, rec, bucket, overlap, dp, split, accum, precision, micro in itertools.product(
            zeros, (None, "full", "selective"), (0, 0.001, 0.25), (True, False), (1, 2),
            ("sp", "cp"), (1, 2), ("fp64", "bf16-mixed"), (1, 6)):
        if quick and (precision, rec) != ("fp64", None):
            continue
        yield dict(zero=zero, recompute_granularity=rec, bucket_size_mb=bucket,
                   overlap_grad_reduce=overlap, dp=dp, grad_accum_steps=accum,
                   precision=precision, n_layer=2, micro_batch_size=micro, seq_len=32,
                   **(dict(tp=2, sequence_parallel=True) if split == "sp" else dict(cp=2)))
    for zero, rec, bucket, overlap, dp, precision, split in itertools.product(
            zeros, (None, "full", "selective"), (0.001, 0.25), (True, False), (1, 2),
            ("fp64", "bf16-mixed"), ((4, False), (2, True), (4, True))):
        if quick and (precision, rec) != ("fp64", None):
            continue
        cp, sp = split
        yield dict(zero=zero, recompute_granularity=rec, bucket_size_mb=bucket,
                   overlap_grad_reduce=overlap, dp=dp, precision=precision, n_layer=2,
                   micro_batch_size=3, seq_len=32, grad_accum_steps=1, cp=cp,
                   **(dict(tp=2, sequence_parallel=True) if sp else {}))


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipe-v")
TWO_CHUNKS = ("interleaved", "zb-v", "dualpipe-v")


def pipeline_layouts(zeros, quick: bool):
    """The backward's own buffers beside the reduction's, on two pipeline stages."""
    for schedule, zero, rec, bucket, overlap, dp, split, accum in itertools.product(
            SCHEDULES, zeros, (None, "full"), (0.001, 0.25), (True, False), (1, 2),
            ("sp", "cp"), (2, 4)):
        if quick and (rec, accum, bucket) != (None, 2, 0.001):
            continue
        yield dict(pp=2, schedule=schedule, zero=zero, recompute_granularity=rec,
                   bucket_size_mb=bucket, overlap_grad_reduce=overlap, dp=dp,
                   grad_accum_steps=accum, precision="fp64", n_layer=4, micro_batch_size=6,
                   seq_len=32, virtual_stages=2 if schedule in TWO_CHUNKS else 1,
                   **(dict(tp=2, sequence_parallel=True) if split == "sp" else dict(cp=2)))


def pipeline_dp_layouts(zeros, quick: bool):
    """The reduction's buffers beside a pipeline's messages, without SP or CP."""
    for schedule, zero, rec, bucket, overlap, dp, tie, precision in itertools.product(
            SCHEDULES, zeros, (None, "full"), (0, 0.001, 0.25), (True, False), (1, 2),
            (True, False), ("fp64", "bf16-mixed")):
        if (quick and (bucket, precision) != (0.001, "fp64")) or (
                rec and (tie, precision) != (False, "fp64")):
            continue
        yield dict(pp=2, schedule=schedule, zero=zero, recompute_granularity=rec,
                   bucket_size_mb=bucket, overlap_grad_reduce=overlap, dp=dp,
                   grad_accum_steps=4, tie_embeddings=tie, precision=precision, n_layer=4,
                   virtual_stages=2 if schedule in TWO_CHUNKS else 1)


FIGURES = {  # the grid's figure: the report's category, the planner's
    "grads": ("grads", lambda memory: memory["grads"]),
    "buffers": ("buffers", lambda memory: memory["detail"]["sync_buffers"]),
    "beside": ("buffers", lambda memory: memory["buffers"]),
    "pipelines": ("buffers", lambda memory: memory["buffers"]),
    "pipelines-dp": ("buffers", lambda memory: memory["buffers"]),
    "total": ("peak_total", lambda memory: memory["peak_total"]),  # --total, any grid
}


def compare(settings: dict, figure: str) -> list[tuple[int, int, int]] | None:
    """(pipeline rank, measured, planned) of each rank whose figure differs; None if
    minipar refuses the layout."""
    try:
        config = TrainConfig(**{**TOY, **settings})
        report = train(config)
    except ConfigError:
        return None
    shape = from_train_config(config, report.config["vocab_size"])
    est = estimate(shape, ParallelConfig.from_train_config(config),
                   ClusterSpec.from_device_profile(gpus_per_node=8), all_stages=True)
    differ = []
    for stage in est.stages:
        (measured,) = [r for r in report.ranks if r["coords"] == {
            **dict.fromkeys(r["coords"], 0), "pp": stage.rank}]
        category, planner = FIGURES[figure]
        got, planned = measured["memory"][category], planner(stage.memory)
        if got != planned:
            differ.append((stage.rank, got, planned))
    return differ


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("grid", choices=tuple(figure for figure in FIGURES
                                              if figure != "total"))
    parser.add_argument("--zero", type=lambda s: tuple(int(z) for z in s.split(",")),
                        default=(0, 1, 2), help="ZeRO stages, e.g. 1,2 (default 0,1,2)")
    parser.add_argument("--quick", action="store_true", help="a fraction of the grid")
    parser.add_argument("--total", action="store_true",
                        help="compare peak_total, the peak of the sum, over the grid")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # a layout's advice is not a finding
    layouts = {"grads": grads_layouts, "buffers": buffers_layouts, "beside": beside_layouts,
               "pipelines": pipeline_layouts,
               "pipelines-dp": pipeline_dp_layouts}[args.grid](args.zero, args.quick)
    figure = "total" if args.total else args.grid
    ranks = exact = refused = low = 0
    worst = 0.0
    errors = []
    for settings in layouts:
        differ = compare(settings, figure)
        if differ is None:
            refused += 1
            continue
        for rank, got, planned in differ:
            worst = max(worst, abs(planned / got - 1))
            errors.append(planned / got - 1)
            low += planned < got
            print(f"{planned / got - 1:+8.2%}  measured {got:7d}  planned {planned:7d}  "
                  f"pipeline rank {rank}  {settings}", flush=True)
        # (every pipeline rank counts once; a refused layout has none)
        stages = settings.get("pp", 1)
        ranks += stages
        exact += stages - len(differ)
    print(f"{args.grid}{' (peak_total)' if args.total else ''}: {exact} of {ranks} pipeline "
          f"ranks exact, worst {worst:.2%} ({refused} layouts refused)")
    if errors:
        print(f"  of the others {low} low, {len(errors) - low} high; planned / measured - 1 "
              f"from {min(errors):+.2%} to {max(errors):+.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
