"""Random mixes of every feature, each trained against one device and planned:

    python benchmarks/fuzz_layouts.py                 # 120 draws, seed 0 (~4 min on 2 cores)
    python benchmarks/fuzz_layouts.py --draws 400 --seed 3 --verbose

The grid of `minipar check` holds each strategy and a few chosen mixes; the defects it
cannot see live where features meet (ZeRO++'s quantised gather under TP was one: the TP
replicas drifted apart, and no grid case held that mix). This draws TrainConfig settings
of every feature at random, on a model small enough to train in a fraction of a second:
dp/tp/pp/cp/ep, ZeRO 0-3 with offload, HSDP, hpZ, qwZ/qgZ and resharding, every pipeline
schedule, recomputation, buckets and overlap, SwiGLU, GQA, untied embeddings, MoE,
clipping, precisions, gradient-accumulation dtypes and GPUs per node. Each draw is one of:

- refused cleanly: a ConfigError before any training;
- equal: trained with `check=True` and matched the single-device run (fp64 to 1e-10, the
  looser documented tolerances of fp32, bf16 and quantising collectives:
  minipar/train/equivalence.py), and `minipar plan` priced the same layout;
- traceback: any other exception, in the config, the training or the planner;
- silent wrong: trained to its end but not equal to one device;
- planner refuses: the emulator trains a layout the planner will not price (the two
  validate with the same rules, so this is a disagreement, counted apart);
- hang: a draw that has not finished after HANG_S seconds stops the run with every
  thread's stack (faulthandler), and is the last line printed.

It prints one line of totals; every outcome but "refused cleanly" and "equal" must be 0.
The same seed draws the same layouts.

`--resume` draws pairs instead: the first layout trains one step and saves (and its
checkpoint, consolidated, must be its state dict); the second, of
the same model, global batch and precision but its own parallel layout, resumes from
that checkpoint for a second step, checked against one device resumed from it (a
checkpoint loads under any layout: minipar/train/checkpoint.py). A resume refused with
a CheckpointError or a traceback is a finding: finished work the user cannot continue.

`--plan` also holds each trained draw's plan to what the emulator measured on pipeline
rank r's first DP/TP/CP rank: parameters, gradients, optimizer state and activations
per rank, bytes sent per group. It prints, per figure, how many draws differ and the
largest |planned / measured - 1|, with the worst draw. These are not failures: several
are approximations docs/planner.md states (ZeRO's share of sequence parallelism's norm
gradients, recomputation's input gradient with one micro-batch); the tally shows where
the planner is exact and where not.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import random
import sys
import tempfile
import time
import warnings

import numpy as np
from arguments import positive_int

from minipar.errors import ConfigError
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig
from minipar.plan.shapes import from_train_config
from minipar.train import TrainConfig, train
from minipar.train.checkpoint import consolidate

# what defines the model and its numbers: a resumed layout keeps them, draws the rest
MODEL = ("n_layer", "d_model", "n_head", "seq_len", "vocab_size", "data", "tie_embeddings",
         "mlp", "n_kv_head", "moe_num_experts", "moe_top_k", "moe_layer_freq",
         "moe_capacity_factor", "dropout", "grad_clip", "precision")
HANG_S = 300  # a draw trains two tiny models in well under a second; minutes is a hang
OUTCOMES = ("refused cleanly", "equal", "traceback", "silent wrong", "planner refuses")
REFUSED, EQUAL, TRACEBACK, SILENT, PLANNER = OUTCOMES
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1),
             ("zb-v", 2), ("dualpipe-v", 2))


def draw(rng: random.Random) -> dict:
    """One layout's settings: every axis and switch drawn, then the pairs the rules tie
    together made consistent (enough layers for the stages, enough micro-batches for a
    zero-bubble schedule, ZeRO-2/3 without a pipeline), so most draws train and the
    refusals left are the rules that decide between features."""
    schedule, chunks = rng.choice(SCHEDULES)
    s = dict(n_layer=rng.choice((2, 3, 4, 6)), d_model=16, n_head=4, seq_len=8, steps=2,
             data="synthetic", vocab_size=32, micro_batch_size=rng.choice((1, 2)),
             dp=rng.choice((1, 2, 4)), tp=rng.choice((1, 2)), pp=rng.choice((1, 2, 3)),
             cp=rng.choice((1, 1, 2)), zero=rng.choice((0, 1, 2, 3)),
             schedule=schedule, virtual_stages=chunks,
             grad_accum_steps=rng.choice((1, 2, 3, 4, 6)),
             precision=rng.choice(("fp64", "fp64", "fp32", "bf16-mixed")),
             recompute_granularity=rng.choice((None, "full", "selective")),
             tie_embeddings=rng.choice((True, False)),
             bucket_size_mb=rng.choice((0, 0.001, 0.25)),
             overlap_grad_reduce=rng.random() < 0.6,
             gpus_per_node=rng.choice((1, 2, 4, 8)), mlp=rng.choice(("gelu", "swiglu")),
             grad_clip=rng.choice((0.0, 1.0, 0.01)))
    s["sequence_parallel"] = s["tp"] > 1 and rng.random() < 0.5
    if s["cp"] > 1:
        s["cp_load_balance"] = rng.random() < 0.5
    if s["pp"] == 1:
        s.update(schedule="1f1b", virtual_stages=1)
    else:
        s["n_layer"] = max(s["n_layer"], s["pp"] * s["virtual_stages"])
        s["grad_accum_steps"] = max(s["grad_accum_steps"], 2 * s["pp"])
        s["zero"] = min(s["zero"], 1)  # ZeRO-2/3 under a pipeline: DeepSpeed's refusal
    if s["recompute_granularity"] == "full" and rng.random() < 0.5:
        s["recompute_method"] = rng.choice(("uniform", "block"))
        s["recompute_num_layers"] = rng.choice((1, 2))
    if s["zero"] >= 1 and rng.random() < 0.25:
        s["offload_optimizer"] = "cpu"
    if s["zero"] == 3:
        if rng.random() < 0.2:
            s["offload_param"] = "cpu"
        if s["dp"] == 4 and rng.random() < 0.3:
            s["hsdp_shard_size"] = 2
        elif s["dp"] == 4 and rng.random() < 0.2:
            s["zero_hpz_partition_size"] = 2
        elif s["dp"] == 4 and "offload_optimizer" not in s and rng.random() < 0.3:
            s["reshard_after_forward"] = rng.choice((False, 2))
        if rng.random() < 0.3:
            s["zero3_prefetch"] = True
        if s["tp"] == 1 and rng.random() < 0.2:
            s["zero_quantized_weights"] = True
    if s["zero"] >= 2 and s["tp"] == 1 and rng.random() < 0.2:
        s["zero_quantized_gradients"] = True
    if s["cp"] == 1 and s["zero"] <= 1 and rng.random() < 0.35:
        s.update(moe_num_experts=rng.choice((2, 4)), moe_top_k=rng.choice((1, 2)),
                 moe_layer_freq=rng.choice((1, 2, 3)), mlp="gelu")
        if rng.random() < 0.5:
            s["moe_capacity_factor"] = rng.choice((1.0, 2.0))
        s["ep"] = rng.choice([e for e in (1, 2, 4)
                              if s["dp"] % e == 0 and s["moe_num_experts"] % e == 0])
    if rng.random() < 0.2:
        s["n_kv_head"] = s["tp"]  # grouped-query: whole key/value heads on each TP rank
    if s["precision"] == "bf16-mixed" and rng.random() < 0.3:
        s["grad_accum_dtype"] = rng.choice(("fp32", "bf16"))
    if s["tp"] == 1 and rng.random() < 0.1:
        s["dropout"] = 0.1
    return s


def name(settings: dict) -> str:
    fixed = ("d_model", "n_head", "seq_len", "steps", "data", "vocab_size")
    return " ".join(f"{k}={v}" for k, v in settings.items() if k not in fixed)


def plan_differences(config: TrainConfig, report, est) -> dict[str, float]:
    """|planned / measured - 1| of each figure that differs, on each pipeline rank's
    first DP/TP/CP/EP rank (the planner's figures are per pipeline rank)."""
    differ = {}
    for stage in est.stages:
        coords = {"pp": stage.rank}
        measured = next(r for r in report.ranks if all(
            r["coords"].get(axis, 0) == coords.get(axis, 0) for axis in r["coords"]))
        pairs = [(category, measured["memory"][category], stage.memory[category])
                 for category in ("params", "grads", "optimizer", "activations")]
        pairs += [(f"{group} bytes", measured["comm"]["by_group"].get(group, 0),
                   config.steps * sent) for group, sent in stage.traffic.items()]
        for figure, value, planned in pairs:
            if value != planned:
                error = abs(planned / value - 1) if value else float("inf")
                differ[figure] = max(differ.get(figure, 0.0), error)
    return differ


def run(settings: dict, plan_errors: dict | None = None) -> tuple[str, str]:
    """(outcome, detail) of one drawn layout; with `plan_errors`, each figure the plan
    gets wrong is added to it: {figure: [(error, settings), ...]}."""
    try:
        config = TrainConfig(**settings, check=True)
        report = train(config)
    except ConfigError as err:
        return REFUSED, str(err).splitlines()[0]
    except Exception as err:  # noqa: BLE001  (any other exception is the finding)
        return TRACEBACK, f"train: {type(err).__name__}: {str(err).splitlines()[:1]}"
    check = report.equivalence
    if not check or not check.get("passed"):
        return SILENT, f"not equal to one device: {check}"
    try:
        shape = from_train_config(config, report.config["vocab_size"])
        cluster = ClusterSpec.from_device_profile(gpus_per_node=config.gpus_per_node)
        est = estimate(shape, ParallelConfig.from_train_config(config), cluster,
                       all_stages=True)
    except ConfigError as err:
        return PLANNER, str(err).splitlines()[0]
    except Exception as err:  # noqa: BLE001
        return TRACEBACK, f"plan: {type(err).__name__}: {str(err).splitlines()[:1]}"
    if plan_errors is not None:
        for figure, error in plan_differences(config, report, est).items():
            plan_errors.setdefault(figure, []).append((error, settings))
    return EQUAL, (f"parameters within {check['max_rel_param_diff']:.1e} of one device's "
                   f"(tolerance {check['tolerance']:g})")


def resumed_pair(rng: random.Random) -> tuple[dict, dict]:
    """A layout that trains a step and saves, and another of the same model, global
    batch and precision that resumes: its own dp/tp/pp/cp/ep, ZeRO and schedule."""
    first, second = draw(rng), draw(rng)
    for settings in (first, second):
        settings.pop("grad_accum_dtype", None)
    for key in MODEL:
        second.pop(key, None)
        if key in first:
            second[key] = first[key]
    if "moe_num_experts" not in first:
        second.pop("ep", None)
    batch = first["micro_batch_size"] * first["grad_accum_steps"] * first["dp"]
    second["micro_batch_size"] = first["micro_batch_size"]
    second["grad_accum_steps"] = max(1, batch // (first["micro_batch_size"] * second["dp"]))
    first["steps"], second["steps"] = 1, 2
    return first, second


def resume(first: dict, second: dict) -> tuple[str, str]:
    """(outcome, detail) of training `first` a step, then `second` from its checkpoint."""
    with tempfile.TemporaryDirectory(prefix="minipar-fuzz-") as folder:
        try:
            saved = train(TrainConfig(**first), save_dir=folder)
            config = TrainConfig(**second, check=True)
            consolidated = consolidate(folder)  # `minipar consolidate` of what it saved
        except ConfigError as err:
            return REFUSED, str(err).splitlines()[0]
        except Exception as err:  # noqa: BLE001
            return TRACEBACK, f"first: {type(err).__name__}: {str(err).splitlines()[:1]}"
        for tensor, value in saved.state_dict.items():  # (mixed: fp32 masters, rounded)
            if not np.array_equal(consolidated[tensor].astype(value.dtype), value):
                return SILENT, f"consolidated {tensor} is not the saving run's"
        try:
            report = train(config, resume_from=folder)
        except ConfigError as err:  # the layout refused for itself (a CheckpointError,
            return REFUSED, str(err).splitlines()[0]  # not a ConfigError, is a finding)
        except Exception as err:  # noqa: BLE001
            return TRACEBACK, f"resume: {type(err).__name__}: {str(err).splitlines()[:1]}"
    check = report.equivalence
    if not check or not check.get("passed"):
        return SILENT, f"resumed, not equal to one device: {check}"
    return EQUAL, "resumed, equal to one device"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=positive_int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="one line per draw")
    parser.add_argument("--resume", action="store_true",
                        help="pairs: save under one layout, resume under another")
    parser.add_argument("--plan", action="store_true",
                        help="also tally where the plan differs from the measured run")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # a drawn layout's advice is not a finding
    rng = random.Random(args.seed)
    counts = collections.Counter()
    plan_errors = {} if args.plan else None
    started = time.process_time()
    for index in range(args.draws):
        faulthandler.dump_traceback_later(HANG_S, exit=True)  # a hang: every stack, then exit
        if args.resume:
            first, settings = resumed_pair(rng)
            outcome, detail = resume(first, settings)
            settings = {**settings, "from": name(first)}
        else:
            settings = draw(rng)
            outcome, detail = run(settings, plan_errors)
        faulthandler.cancel_dump_traceback_later()
        counts[outcome] += 1
        if args.verbose or outcome not in (REFUSED, EQUAL):
            print(f"  {index:4d} {outcome:15s} {name(settings)} | {detail}", flush=True)
    if plan_errors is not None:
        print(f"the plan against the run, of {counts[EQUAL]} trained draws:")
        for figure, errors in sorted(plan_errors.items(), key=lambda kv: -len(kv[1])):
            error, worst = max(errors, key=lambda e: e[0])
            print(f"  {figure:12s} differs in {len(errors):3d}, worst {error:.1%}: "
                  f"{name(worst)}")
    print(f"(CPU {time.process_time() - started:.0f} s)")
    print(f"drawn {args.draws} / " + " / ".join(f"{o} {counts[o]}" for o in OUTCOMES))
    return 0 if counts[REFUSED] + counts[EQUAL] == args.draws else 1


if __name__ == "__main__":
    sys.exit(main())
