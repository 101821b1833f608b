"""The planner against the emulator it claims to predict, over a grid of layouts.

    python benchmarks/plan_vs_emulator.py            # 168 layouts, about 25 s
    python benchmarks/plan_vs_emulator.py --only zb-h1
    python benchmarks/plan_vs_emulator.py --random 150 --seed 2   # about 4 minutes
    python benchmarks/plan_vs_emulator.py --random 40 --seed 1 --moe --nodes 2,4,8

Each layout trains the toy GPT (4 layers, d_model 32, seq 16, two steps) on a device where
compute and communication cost alike (100 GFLOP/s, 5 GB/s links), and `estimate()` prices
the same layout on that device. Per layout it prints the worst pipeline rank's ratio of
measured to predicted exposed communication (HTA's: `ranks[i].time.exposed_comm_s`) and
step (compute + communication + idle, the simulated clock), and flags a layout outside 1%.
The grid: every pipeline schedule x TP 1 or TP 2 with sequence parallelism x ZeRO-0/1 x
no, full or selective recomputation x tied or untied head; DP 2, PP 2, 13 gradient
buckets reduced during backward. tests/plan/test_estimate.py holds rows of it to 1e-3 or
1%; this sweep is how the rows that are not yet there were found.

`--random N` draws N layouts from a wider space instead (DP 1-4, TP 1-2, PP 1-4, CP 1-2,
ZeRO 0-3, 4 or 8 layers, every schedule, recomputation, precision, GELU or SwiGLU,
grouped K/V, bucket sizes, 1-8 micro-batches, overlap on or off; those minipar refuses
are drawn again): up to 16 ranks, so pipelines and rings that cross 8-GPU nodes.
`--nodes 2,4,6` draws the GPUs per node from that list too (groups that cross nodes, and
straddle them where a size does not divide the node); `--moe` draws mixtures of experts
instead (DP 2 or 4, ep dividing it, 2 or 4 experts, top-1 or 2, capacity 1 or 1.5, every
layer or every other one MoE, TP 1-2, PP 1-2, ZeRO-0/1).
"""

from __future__ import annotations

import argparse
import itertools
import random
import warnings

from arguments import positive_int

from minipar import distributed as dist
from minipar.errors import ConfigError
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig
from minipar.plan.shapes import from_train_config
from minipar.train import TrainConfig, train
from minipar.train.mixes import check_layout

STEPS = 2
DEVICE = dist.DeviceProfile(name="compute ~ communication", flops=1e11,
                            intra_node_bandwidth=5e9, intra_node_latency=1e-6)
TOY = dict(n_layer=4, d_model=32, n_head=4, seq_len=16, data="synthetic", steps=STEPS,
           micro_batch_size=2, grad_accum_steps=4, dp=2, pp=2, bucket_size_mb=0.01)
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1),
             ("zb-v", 2), ("dualpipe-v", 2))
TOLERANCE = 0.01
# (each draw sets its own micro-batches; check_layout needs the vocabulary, the
# synthetic data's 32 tokens)
RANDOM_TOY = {**TOY, "grad_accum_steps": None, "vocab_size": 32}


def node_sizes(text: str) -> tuple[int, ...]:
    """--nodes: a comma-separated list of GPUs per node."""
    try:
        sizes = tuple(positive_int(part) for part in text.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r}: give GPUs per node as 2,4,8") from None
    return sizes


def worst_ratios(settings: dict, base: dict = TOY) -> tuple[float, float]:
    """(exposed, step): the largest |measured / predicted - 1| over the pipeline ranks,
    each measured on the busiest of its DP, CP and TP ranks (the planner's figures are
    the busiest rank's: replicas straddling nodes cross on some stages only, and ZeRO's
    shards give DP ranks different shares of the norms' gradients). A rank's time is its
    STEPS steps: the step time each, but the last, which ends when that rank ends (its
    `rank_end_s`; a rank whose tail is short finishes its last step first)."""
    config = TrainConfig(**{**base, **settings})
    report = train(config, device=DEVICE)
    shape = from_train_config(config, report.config["vocab_size"])
    est = estimate(shape, ParallelConfig.from_train_config(config),
                   ClusterSpec.from_device_profile(DEVICE, gpus_per_node=config.gpus_per_node),
                   all_stages=True)
    exposed = step = 0.0
    ends = est.time.get("rank_end_s") or [est.step_time] * config.pp
    for stage in est.stages:
        times = [r["time"] for r in report.ranks if r["coords"]["pp"] == stage.rank]
        measured = max(time["exposed_comm_s"] for time in times)
        spent = max(time["compute_s"] + time["comm_s"] + time["idle_s"] for time in times)
        predicted = STEPS * stage.time["exposed_comm_s"]
        exposed = max(exposed, abs(measured / predicted - 1) if predicted
                      else measured / (STEPS * est.step_time))
        step = max(step, abs(spent / ((STEPS - 1) * est.step_time + ends[stage.rank]) - 1))
    return exposed, step


def random_layouts(count: int, seed: int, moe: bool = False, nodes: tuple[int, ...] = (8,)):
    """`count` (settings, layout name) drawn from the wider space (module docstring)."""
    rng, drawn = random.Random(seed), 0
    while drawn < count:
        schedule, v = rng.choice(SCHEDULES)
        s = dict(dp=rng.choice((1, 2, 4)), tp=rng.choice((1, 2)), pp=rng.choice((1, 2, 4)),
                 cp=rng.choice((1, 1, 2)), zero=rng.choice((0, 1, 2, 3)),
                 n_layer=rng.choice((4, 8)), schedule=schedule, virtual_stages=v,
                 recompute_granularity=rng.choice((None, "full", "selective")),
                 tie_embeddings=rng.choice((True, False)),
                 bucket_size_mb=rng.choice((0, 0.01, 0.25)),
                 grad_accum_steps=rng.choice((1, 2, 4, 8)),
                 precision=rng.choice(("fp32", "bf16-mixed")), mlp=rng.choice(("gelu", "swiglu")),
                 n_kv_head=rng.choice((None, 2)), overlap_grad_reduce=rng.random() < 0.7)
        if nodes != (8,):  # (the default draws stay those of earlier runs)
            s["gpus_per_node"] = rng.choice(nodes)
        if moe:  # minipar's experts are GPT-2 MLPs; MoE runs without CP and ZeRO-2/3
            experts = rng.choice((2, 4))
            s.update(dp=rng.choice((2, 4)), pp=rng.choice((1, 2)), cp=1,
                     zero=rng.choice((0, 1)), n_layer=4, mlp="gelu", n_kv_head=None,
                     moe_num_experts=experts, moe_top_k=rng.choice((1, 2)),
                     moe_capacity_factor=rng.choice((1.0, 1.5)),
                     moe_layer_freq=rng.choice((1, 2)))
            s["ep"] = rng.choice([e for e in (1, 2, 4) if s["dp"] % e == 0 and experts % e == 0])
        if s["pp"] == 1:
            s.update(schedule="1f1b", virtual_stages=1)
        s["sequence_parallel"] = s["tp"] > 1 and rng.random() < 0.6
        try:  # what minipar refuses (ZeRO-2/3 with a pipeline, too few micro-batches...)
            check_layout(TrainConfig(**{**RANDOM_TOY, **s}))
        except ConfigError:
            continue
        drawn += 1
        yield s, " ".join(f"{k}={v}" for k, v in s.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=[name for name, _ in SCHEDULES],
                        help="one schedule's layouts")
    parser.add_argument("--random", type=positive_int, metavar="N",
                        help="N layouts drawn from a wider space (module docstring)")
    parser.add_argument("--seed", type=int, default=0, help="of --random's draws (0)")
    parser.add_argument("--moe", action="store_true", help="--random draws MoE layouts")
    parser.add_argument("--nodes", type=node_sizes, default=(8,), metavar="G,G,...",
                        help="--random draws the GPUs per node from these (default 8)")
    args = parser.parse_args()
    if args.random and args.only:
        parser.error("--only picks the grid's layouts; --random draws its own")
    if (args.seed or args.moe or args.nodes != (8,)) and not args.random:
        parser.error("--seed, --moe and --nodes are --random's")
    warnings.filterwarnings("ignore")
    if args.random:
        outside = stopped = 0
        for settings, name in random_layouts(args.random, args.seed, args.moe, args.nodes):
            try:
                exposed, step = worst_ratios(settings, RANDOM_TOY)
            except Exception as err:  # the emulator or the planner stopped: say which
                stopped += 1
                print(f"stopped ({type(err).__name__}): {name}: "
                      f"{str(err).splitlines()[0][:100]}", flush=True)
                continue
            flag = "  outside 1%" if max(exposed, step) > TOLERANCE else ""
            outside += bool(flag)
            print(f"{exposed:8.2%} {step:7.2%}  {name}{flag}", flush=True)
        print(f"{args.random - outside - stopped} of {args.random} drawn layouts within 1% "
              f"(exposed communication and step, worst pipeline rank); {stopped} stopped")
        return
    outside = stopped = total = 0
    print(f"{'schedule':>11} {'tp':>2} {'zero':>4} {'recompute':>9} {'tied':>5} "
          f"{'exposed':>8} {'step':>7}")
    for (schedule, v), tp, zero, recompute, tied in itertools.product(
            SCHEDULES, (1, 2), (0, 1), (None, "full", "selective"), (True, False)):
        if args.only is not None and schedule != args.only:
            continue
        row = f"{schedule:>11} {tp:>2} {zero:>4} {recompute or '-':>9} {tied!s:>5} "
        total += 1
        try:
            exposed, step = worst_ratios(dict(
                schedule=schedule, virtual_stages=v, tp=tp, sequence_parallel=tp > 1,
                zero=zero, recompute_granularity=recompute, tie_embeddings=tied))
        except Exception as err:  # the emulator stopped: the first line of why
            stopped += 1
            print(row + f"stopped: {str(err).splitlines()[0][:100]}")
            continue
        flag = "  outside 1%" if max(exposed, step) > TOLERANCE else ""
        outside += bool(flag)
        print(row + f"{exposed:8.2%} {step:7.2%}{flag}")
    print(f"{total - outside - stopped} of {total} layouts within 1% (exposed communication "
          f"and step, worst pipeline rank); {stopped} stopped in the emulator")


if __name__ == "__main__":
    main()
