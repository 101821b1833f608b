"""`minipar.train(config) -> Report`: the training loop, run once per virtual rank.

Every run, even a single-device one, goes through `minipar.distributed.launch`, so the same
ledger and clock measure a 1-rank and an 8-rank run and their reports compare directly.

One optimizer step, from one rank's point of view (nanoGPT's train.py, written as
Megatron-LM / DeepSpeed code is):

    micro_batches = my DP rank's grad_accum_steps micro-batches of the global batch
    loss = rank.forward_backward(micro_batches)   # pp = 1: forward + backward each,
                                                  #   DDP's no_sync until the last;
                                                  # pp > 1: the pipeline schedule, then
                                                  #   the DP reduction after the flush;
                                                  # then SP's one TP all-reduce of the
                                                  #   norm/bias gradients (Megatron's
                                                  #   finalize_model_grads)
    grad_norm = engine.clip_grad_norm_(grad_clip)  # global norm over DP shards, TP, PP
    engine.step(lr); engine.zero_grad()             # AdamW on my replica or shard

What a rank builds for its mesh coordinates (GPT, its TP slices, its pipeline stage) and
which mixes are refused lives in build.py; each strategy in minipar.parallel; how what the
ranks measured becomes a Report in report.py. This file drives the steps, saves
checkpoints and runs the single-device reference for `check`.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minipar import distributed as dist
from minipar.errors import ConfigError, OutputError, flag
from minipar.nn import lr_schedule
from minipar.parallel.context import layout as context
from minipar.parallel.state import describe, parameter_pieces, state_pieces
from minipar.train import checkpoint, equivalence
from minipar.train.build import build_rank_model
from minipar.train.config import TrainConfig
from minipar.train.data import TokenStream, make_stream, micro_batch
from minipar.train.divergence import check_finite
from minipar.train.layouts import check_layout
from minipar.train.outputs import check_output_dir
from minipar.train.report import Report, merge_step, report_from_run

__all__ = ["Reference", "learning_rate", "reference_run", "train"]


def learning_rate(config: TrainConfig, step: int) -> float:
    """The scheduled learning rate of `step`; a run shorter than the warm-up warms up
    over all its steps (so `--steps 1` works with the default --warmup-steps)."""
    return lr_schedule(step, lr=config.lr, warmup_steps=min(config.warmup_steps, config.steps),
                       total_steps=config.steps, min_lr=config.min_lr)


@dataclass
class RunOptions:
    """What a launch needs besides the config (shared read-only by the ranks)."""

    stream: TokenStream
    start: checkpoint.TrainingState | None = None  # resume from this state
    reference_states: dict | None = None  # check: the reference's parameters per step
    record_states: bool = False  # keep the parameters after every step (the reference)
    save_dir: Path | None = None
    save_every: int = 0
    # Checkpoint writes that failed, as (rank, directory, OSError): host-side, like a log.
    save_failures: list = field(default_factory=list)
    progress: object = None  # a _StepLog, or None
    device: dist.DeviceProfile | None = None  # the simulated GPU (default: H100)
    trace: Path | None = None  # write a profiler trace per rank here (trace.py)


# ------------------------------------------------------------------ the rank program
def _rank_program(config: TrainConfig, options: RunOptions) -> dict:
    """What every rank runs (SPMD): build my share of the model and its engine, train."""
    mesh = dist.DeviceMesh(dp=config.dp, pp=config.pp, tp=config.tp, cp=config.cp,
                           ep=config.ep)
    rank = dist.get_rank()
    rank_model = build_rank_model(config, mesh, options.start)
    engine = rank_model.engine
    start_step = 0 if options.start is None else options.start.step
    checker = None
    if options.reference_states is not None:
        checker = equivalence.StepChecker(
            options.reference_states, equivalence.TOLERANCES[config.precision], rank,
            mesh.coords(), dict(zip(mesh.axes, mesh.shape, strict=True)),
            scale=equivalence.SCALES[config.precision])
    history, states, step_ends = [], {}, []
    clock = dist.get_device().clock
    loop_start = clock.now
    accum = config.grad_accum_steps
    for step in range(start_step, config.steps):
        lr = learning_rate(config, step)
        inputs, targets = options.stream.global_batch(step, config.global_batch_size,
                                                      config.seq_len, config.seed)
        micro_batches = [micro_batch(inputs, targets, dp_rank=mesh.dp_rank, micro_step=k,
                                     micro_batch_size=config.micro_batch_size,
                                     grad_accum_steps=accum) for k in range(accum)]
        if config.cp > 1:  # my CP rank's tokens of each sequence, targets alike
            micro_batches = [tuple(context.sequence_shard(a, mesh.cp_rank, config.cp,
                                                          config.cp_load_balance)
                                   for a in batch) for batch in micro_batches]
        aux_before = rank_model.aux_loss_total()
        loss = rank_model.forward_backward(micro_batches)  # the LM loss (MoE: aux apart)
        with dist.phase("optimizer"):
            grad_norm = engine.clip_grad_norm_(config.grad_clip)
            check_finite(step, loss, grad_norm, rank_model)  # before NaN reaches the weights
            engine.step(lr)
            engine.zero_grad()
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm)}
        if config.moe_num_experts:  # my MoE layers' aux losses, mean over my micro-batches
            record["aux_loss"] = (rank_model.aux_loss_total() - aux_before) / accum
        history.append(record)
        step_ends.append(clock.now)
        if checker is not None:
            owned = [p for p in state_pieces(engine) if p.kind == "param"]
            checker.compare(step, owned, parameter_pieces(engine))
        if options.record_states:
            states[step] = {p.name: p.values.reshape(p.shape).copy()
                            for p in parameter_pieces(engine)}
        if options.save_dir is not None and _save_now(step, config, options.save_every):
            checkpoint.save_checkpoint(
                options.save_dir / f"step-{step + 1:06d}", step=step + 1,
                config=config.to_dict(), pieces=state_pieces(engine), coords=mesh.coords(),
                rng_state=rank_model.dropout_generator.bit_generator.state,
                failures=options.save_failures)
        if options.progress is not None:
            options.progress.report(rank, record)
    return {"steps": history, "step_ends": step_ends, "loop_start": loop_start,
            "coords": mesh.coords(),
            "pieces": parameter_pieces(engine),
            "sharding": describe(engine), "states": states,
            "routing": rank_model.routing(),
            "check": None if checker is None else checker.summary()}


def _save_now(step: int, config: TrainConfig, every: int) -> bool:
    done = step + 1
    return done == config.steps or (every > 0 and done % every == 0)


class _StepLog:
    """Calls progress(step, record) once every rank has finished the step, with the loss
    averaged over the ranks (host-side logging, not simulated communication)."""

    def __init__(self, progress, world_size: int):
        self.progress, self.world_size = progress, world_size
        self.lock = threading.Lock()
        self.pending: dict[int, dict[int, dict]] = {}

    def report(self, rank: int, record: dict) -> None:
        with self.lock:
            records = self.pending.setdefault(record["step"], {})
            records[rank] = record
            if len(records) < self.world_size:
                return
            del self.pending[record["step"]]
            self.progress(record["step"], merge_step([records[r] for r in sorted(records)]))


# ------------------------------------------------------------------ the driver
def _launch(config: TrainConfig, options: RunOptions):
    """Run the rank program on every virtual rank; the report is what they measured
    (shaped in report.py), the results are what each rank returned."""
    results, devices = dist.launch(_rank_program, config.world_size, config, options,
                                   gpus_per_node=config.gpus_per_node,
                                   device=options.device, return_devices=True,
                                   trace=options.trace is not None)
    if options.trace is not None:
        start_step = 0 if options.start is None else options.start.step
        _write_trace(options.trace, config, devices, results, start_step)
    return report_from_run(config, results, devices), results


def _write_trace(directory: Path, config: TrainConfig, devices, results, first_step: int):
    """rank<N>.json per rank: ProfilerStep#N from each rank's own step boundaries."""
    steps, metadata = [], []
    for result in results:
        starts = [result["loop_start"], *result["step_ends"][:-1]]
        steps.append([(first_step + k, s, e)
                      for k, (s, e) in enumerate(zip(starts, result["step_ends"], strict=True))])
        metadata.append({"config": config.to_dict(), "coords": result["coords"]})
    dist.write_traces(directory, devices, steps, metadata)


def _resume_state(config: TrainConfig, resume_from) -> checkpoint.TrainingState:
    """Load a checkpoint and check that it fits this run's model and data."""
    state = checkpoint.load_checkpoint(resume_from)
    saved = state.config
    for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "tie_embeddings",
                 "precision", "data", "seed", "moe_num_experts", "moe_layer_freq"):
        if saved.get(name, getattr(TrainConfig, name, None)) != getattr(config, name):
            raise ConfigError(name, f"the checkpoint {resume_from} was saved with "
                              f"{name}={saved.get(name)!r}, this run has "
                              f"{getattr(config, name)!r}; use the same value to resume")
    if state.step >= config.steps:
        raise ConfigError("steps", f"the checkpoint {resume_from} has already done "
                          f"{state.step} steps; set --steps above {state.step} to go on")
    # Optimisation settings may change on purpose when resuming (a new learning rate, a
    # bigger batch), but then the run no longer continues the saved one: say so.
    for name in ("lr", "min_lr", "warmup_steps", "weight_decay", "beta1", "beta2",
                 "grad_clip", "dropout", "global_batch_size", "moe_top_k",
                 "moe_capacity_factor", "moe_aux_loss_coeff"):
        if name in saved and saved[name] != getattr(config, name):
            # The global batch is usually derived (micro x accum x dp): name where it came from.
            derived = (f" = micro {config.micro_batch_size} x accum {config.grad_accum_steps}"
                       f" x dp {config.dp}" if name == "global_batch_size" else "")
            warnings.warn(f"resuming {resume_from} with {flag(name)} {getattr(config, name)!r}"
                          f"{derived} (saved with {saved[name]!r}): the run continues with the"
                          " new value and is no longer the uninterrupted run", stacklevel=3)
    return state


@dataclass
class Reference:
    """A single-device run recorded for equivalence checks: its config, its report and
    its parameters after every step. Several checked runs with the same reference config
    (the same global batch and micro-batches) can share one (`minipar check` does)."""

    config: TrainConfig
    report: Report
    states: dict[int, dict[str, np.ndarray]]


def reference_run(config: TrainConfig, *, resume_from=None,
                  device: dist.DeviceProfile | None = None) -> Reference:
    """Train the single-device reference of `config` (equivalence.reference_config)."""
    stream = make_stream(config.data, config.vocab_size)
    config = config.replace(vocab_size=stream.vocab_size)
    start = None if resume_from is None else _resume_state(config, resume_from)
    single = equivalence.reference_config(config)
    report, results = _launch(single, RunOptions(stream, start=start, record_states=True,
                                                 device=device))
    return Reference(single, report, results[0]["states"])


def train(config: TrainConfig | None = None, *, progress=None, save_dir=None,
          save_every: int = 0, resume_from=None, device: dist.DeviceProfile | None = None,
          reference: Reference | None = None, trace=None, **overrides) -> Report:
    """Train the model described by `config` and return its measured Report.

    progress(step, record): called after every optimizer step (the CLI's progress bar).
    save_dir: write sharded checkpoints to save_dir/step-NNNNNN at the end and every
    `save_every` steps. resume_from: a checkpoint directory (or a save_dir: its latest)
    to continue from, saved under any dp / tp / pp / ZeRO layout. device: the
    DeviceProfile every rank simulates (default: an H100 SXM; see minipar.distributed.clock).
    Keyword overrides build or modify the config: `train(steps=5, precision="fp64")`.
    With config.check, the single-device reference is trained first (or `reference`, a
    `reference_run` of the same reference config, is reused) and the report gets an
    `equivalence` section; `report.reference` is the reference's own report.
    trace: a folder to write one profiler trace per rank to (rank<N>.json, Chrome Trace
    Event format on the simulated clock; see minipar.distributed.trace and
    docs/profiling.md); `minipar profile DIR` reads it."""
    if config is None:
        config = TrainConfig(**overrides)
    elif overrides:
        config = config.replace(**overrides)
    if save_every < 0:
        raise ConfigError("save_every", f"must be >= 0, got {save_every}")
    if save_dir is not None:
        check_output_dir("save_dir", save_dir)  # before the work, not after it
    if trace is not None:
        check_output_dir("trace", trace)
    stream = make_stream(config.data, config.vocab_size)
    config = config.replace(vocab_size=stream.vocab_size)
    check_layout(config)  # refuse an unsupported mix before anything runs
    start = None if resume_from is None else _resume_state(config, resume_from)
    if config.check:
        expected = equivalence.reference_config(config)
        if reference is None:
            reference = reference_run(config, resume_from=resume_from, device=device)
        elif reference.config.to_dict() != expected.to_dict():
            raise ValueError("train(reference=...): the reference was trained with another "
                             "config than this run's single-device reference; build it with "
                             "reference_run(config)")
    options = RunOptions(
        stream, start=start,
        reference_states=None if reference is None else reference.states,
        save_dir=None if save_dir is None else Path(save_dir), save_every=save_every,
        progress=None if progress is None else _StepLog(progress, config.world_size),
        device=device, trace=None if trace is None else Path(trace))
    report, results = _launch(config, options)
    if config.check:
        report.reference = reference.report
        report.equivalence = equivalence.compare_runs(
            report.steps, reference.report.steps, report.state_dict,
            reference.report.state_dict, [r["check"] for r in results],
            equivalence.TOLERANCES[config.precision], equivalence.SCALES[config.precision])
    if options.save_failures:  # the run is done: say what was not written, keep the rest
        _, directory, error = options.save_failures[0]
        raise OutputError("save_dir", f"{directory}: the checkpoint could not be written "
                          f"({error.strerror or error}); the run finished, its report is "
                          "this error's .report", report=report)
    return report
