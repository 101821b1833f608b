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
which mixes are refused in mixes.py; each strategy in minipar.parallel; how what the
ranks measured becomes a Report in report.py. This file drives the steps, saves
checkpoints and runs the single-device reference for `check`.

A run first reads what it needs once (`prepare_run`: the data, whose vocabulary completes
the model; the layout check; the checkpoint to resume from), then trains
(`train_prepared`); a checked run's reference trains from the same stream and checkpoint.
`train(config)` is the two in a row.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minipar import distributed as dist
from minipar.distributed.engine import Engine, ThreadEngine
from minipar.errors import ConfigError, OutputError, flag
from minipar.nn import lr_schedule
from minipar.parallel.context import layout as context
from minipar.parallel.state import describe, parameter_pieces, state_pieces
from minipar.train import checkpoint, checkpoint_dirs, equivalence
from minipar.train.build import build_rank_model, device_mesh
from minipar.train.config import TrainConfig
from minipar.train.data import TokenStream, make_stream, micro_batch
from minipar.train.divergence import check_finite
from minipar.train.mixes import check_layout
from minipar.train.outputs import check_output_dir
from minipar.train.report import Report, add_engine, merge_step, report_from_run

__all__ = ["PreparedRun", "Reference", "learning_rate", "prepare_run", "reference_run",
           "train", "train_prepared"]


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
    run: str = field(default_factory=checkpoint_dirs.new_run_id)  # in every file it saves
    # Checkpoint writes that failed, as (rank, directory, OSError): host-side, like a log.
    save_failures: list = field(default_factory=list)
    trace_failure: OSError | None = None  # the traces could not be written (a full disk)
    progress: object = None  # a _StepLog, or None
    device: dist.DeviceProfile | None = None  # the simulated GPU (default: H100)
    trace: Path | None = None  # write a profiler trace per rank here (trace.py)

    @property
    def origin(self) -> str:
        """The run whose trajectory this one continues: itself, or the resumed one's."""
        return self.run if self.start is None else self.start.origin


# ------------------------------------------------------------------ the rank program
def _rank_program(config: TrainConfig, options: RunOptions) -> dict:
    """What every rank runs (SPMD): build my share of the model and its engine, train."""
    mesh = device_mesh(config)
    rank = dist.get_rank()
    rank_model = build_rank_model(config, mesh, options.start)
    engine = rank_model.engine
    start_step = 0 if options.start is None else options.start.step
    checker = None
    if options.reference_states is not None:
        judging = equivalence.judging(config)
        checker = equivalence.StepChecker(
            options.reference_states, judging.tolerance, rank,
            mesh.coords(), dict(zip(mesh.axes, mesh.shape, strict=True)),
            scale=judging.scale)
    history, states, step_ends, wall_ends = [], {}, [], []
    clock = dist.get_device().clock
    loop_start, wall_start = clock.now, time.perf_counter()
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
        wall_ends.append(time.perf_counter())  # measured (a real engine reports it)
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
                run=options.run, origin=options.origin, failures=options.save_failures)
        if options.progress is not None:
            options.progress.report(rank, record)
    return {"steps": history, "step_ends": step_ends, "loop_start": loop_start,
            "wall_loop_start": wall_start, "wall_step_ends": wall_ends,
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
def _launch(config: TrainConfig, options: RunOptions, warnings: list[str],
            engine: Engine | None = None):
    """Run the rank program on every rank (threads, or `engine`'s); the report is what they
    measured (shaped in report.py, with the layout's `warnings`), the results are what each
    rank returned. (None, None) on a process of a torchrun job other than rank 0, which
    reports."""
    launched = (engine or ThreadEngine()).launch(
        _rank_program, config.world_size, config, options, gpus_per_node=config.gpus_per_node,
        device=options.device, trace=options.trace is not None)
    if launched is None:
        return None, None
    results = launched.results
    if options.trace is not None:
        start_step = 0 if options.start is None else options.start.step
        try:
            _write_trace(engine or ThreadEngine(), options.trace, config, launched,
                         start_step)
        except OSError as err:  # the run is not lost with its traces: said at the end
            options.trace_failure = err
    report = report_from_run(config, results, launched.devices, warnings)
    if engine is not None:
        add_engine(report, launched)
    return report, results


def _write_trace(engine: Engine, directory: Path, config: TrainConfig, launched,
                 first_step: int):
    """rank<N>.json per rank: ProfilerStep#N from each rank's own step boundaries (on the
    simulated clock, and on the wall clock for an engine that measures it)."""
    steps, wall_steps, metadata = [], [], []
    for result in launched.results:
        for out, start, ends in ((steps, "loop_start", "step_ends"),
                                 (wall_steps, "wall_loop_start", "wall_step_ends")):
            starts = [result[start], *result[ends][:-1]]
            out.append([(first_step + k, s, e)
                        for k, (s, e) in enumerate(zip(starts, result[ends], strict=True))])
        metadata.append({"config": config.to_dict(), "coords": result["coords"]})
    engine.write_traces(directory, launched, steps, wall_steps, metadata)


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
class PreparedRun:
    """What a run reads and decides before it trains, once: the config with the data's
    vocabulary, the token stream, the layout's warnings (check_layout) and the training
    state to resume from (None: from the initial weights)."""

    config: TrainConfig
    stream: TokenStream
    warnings: list[str]
    start: checkpoint.TrainingState | None = None


def prepare_run(config: TrainConfig, resume_from=None) -> PreparedRun:
    """Read the data (its vocabulary completes the model), refuse a mix that cannot run
    before anything runs (check_layout: once per run) and load the checkpoint to resume
    from (a checkpoint directory, or a save_dir: its latest), checked against the config."""
    stream = make_stream(config.data, config.vocab_size)
    config = config.replace(vocab_size=stream.vocab_size)
    warnings = check_layout(config)
    start = None if resume_from is None else _resume_state(config, resume_from)
    return PreparedRun(config, stream, warnings, start)


@dataclass
class Reference:
    """A single-device run recorded for equivalence checks: its config, its report and
    its parameters after every step. Several checked runs with the same reference config
    (the same global batch and micro-batches) can share one (`minipar check` does)."""

    config: TrainConfig
    report: Report
    states: dict[int, dict[str, np.ndarray]]


def reference_run(prepared: PreparedRun, device: dist.DeviceProfile | None = None
                  ) -> Reference:
    """Train the single-device reference of a prepared run (equivalence.reference_config)
    from what the run read: the same token stream, the same checkpoint. One device has
    no layout to warn about (no group spans nodes, no pipeline to fill)."""
    single = equivalence.reference_config(prepared.config)
    options = RunOptions(prepared.stream, start=prepared.start, record_states=True,
                         device=device)
    report, results = _launch(single, options, warnings=[])
    return Reference(single, report, results[0]["states"])


def train(config: TrainConfig | None = None, *, progress=None, save_dir=None,
          save_every: int = 0, resume_from=None, device: dist.DeviceProfile | None = None,
          references: dict | None = None, trace=None, engine: Engine | None = None,
          **overrides) -> Report | None:
    """Train the model described by `config` and return its measured Report.

    progress(step, record): called after every optimizer step (the CLI's progress bar).
    save_dir: write sharded checkpoints to save_dir/step-NNNNNN at the end and every
    `save_every` steps. resume_from: a checkpoint directory (or a save_dir: its latest)
    to continue from, saved under any dp / tp / pp / ZeRO layout. device: the
    DeviceProfile every rank simulates (default: an H100 SXM; see minipar.distributed.clock).
    Keyword overrides build or modify the config: `train(steps=5, precision="fp64")`.
    With config.check, the single-device reference is trained first and the report gets
    an `equivalence` section; `report.reference` is the reference's own report.
    references: a dict the runs of a series share (`minipar check`), in which a run
    started from the initial weights finds (or leaves) its reference by its config.
    trace: a folder to write one profiler trace per rank to (rank<N>.json, Chrome Trace
    Event format on the simulated clock; see minipar.distributed.trace and
    docs/profiling.md); `minipar profile DIR` reads it.
    engine: what runs the ranks (minipar.distributed.engines.get_engine("torch", ...): one
    process each; default: threads of this process). The report then has an `engine`
    section and each rank a `measured` one; under torchrun it is rank 0's, and the other
    processes get None (docs/real-engine.md)."""
    if config is None:
        config = TrainConfig(**overrides)
    elif overrides:
        config = config.replace(**overrides)
    return train_prepared(prepare_run(config, resume_from), progress=progress,
                          save_dir=save_dir, save_every=save_every, device=device,
                          references=references, trace=trace, engine=engine)


def train_prepared(prepared: PreparedRun, *, progress=None, save_dir=None,
                   save_every: int = 0, device: dist.DeviceProfile | None = None,
                   references: dict | None = None, trace=None,
                   engine: Engine | None = None) -> Report | None:
    """Train a prepared run (`prepare_run`); the options are `train`'s."""
    config = prepared.config
    if save_every < 0:
        raise ConfigError("save_every", f"must be >= 0, got {save_every}")
    if save_dir is not None:
        check_output_dir("save_dir", save_dir)  # before the work, not after it
    if trace is not None:
        check_output_dir("trace", trace)
    runner = engine or ThreadEngine()
    reference = None
    if config.check:
        key = (equivalence.reference_config(config), device)
        shared = references if references is not None and prepared.start is None else {}
        if key not in shared:
            # on rank 0 of a torchrun job, then sent to the others
            shared[key] = runner.shared(lambda: reference_run(prepared, device))
        reference = shared[key]
    options = RunOptions(
        prepared.stream, start=prepared.start,
        reference_states=None if reference is None else reference.states,
        save_dir=None if save_dir is None else Path(save_dir), save_every=save_every,
        progress=None if progress is None else runner.relay(
            _StepLog(progress, config.world_size)),
        device=device, trace=None if trace is None else Path(trace))
    if not runner.in_process:  # ranks cannot share a list of failed writes: they raise
        options.save_failures = None
    report, results = _launch(config, options, prepared.warnings, engine)
    if report is None:  # a process of a torchrun job other than rank 0
        return None
    if reference is not None:
        report.reference = reference.report
        judging = equivalence.judging(config)
        report.equivalence = equivalence.compare_runs(
            report.steps, reference.report.steps, report.state_dict,
            reference.report.state_dict, [r["check"] for r in results],
            judging.tolerance, judging.scale, judging.quantized)
    # The run is done: say what was not written, keep the rest (the report).
    failed = []
    if options.save_failures:
        _, directory, error = options.save_failures[0]
        failed.append(("save_dir", f"{directory}: the checkpoint could not be written "
                                   f"({error.strerror or error})"))
    if options.trace_failure is not None:
        error = options.trace_failure
        failed.append(("trace", f"{trace}: the traces could not be written "
                                f"({error.strerror or error})"))
    if failed:
        said = "; ".join(f"{flag(name)}: {text}" if i else text
                         for i, (name, text) in enumerate(failed))
        raise OutputError(failed[0][0], f"{said}; the run finished, its report is this "
                          "error's .report", report=report, outputs=[n for n, _ in failed])
    return report
