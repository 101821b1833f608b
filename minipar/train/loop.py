"""`minipar.train(config) -> Report`: the training loop, run once per virtual rank.

Every run, even a single-device one, goes through `minipar.dist.launch`, so the same
ledger and clock measure a 1-rank and an 8-rank run and their reports compare directly.

One optimizer step, from one rank's point of view (nanoGPT's train.py, written as DDP /
DeepSpeed code is):

    for k in range(grad_accum_steps):
        x, y = my micro-batch k of the global batch           (rank-major split, data.py)
        engine.require_backward_grad_sync = (k is the last)   (DDP's no_sync)
        loss = model(x, y)                                    forward
        backward(loss / grad_accum_steps)                     grads accumulate (or shard)
        engine.finish_gradient_synchronization()              DP all-reduce / ZeRO reduce-scatter
    grad_norm = engine.clip_grad_norm_(grad_clip)            global norm, even when sharded
    engine.step(lr); engine.zero_grad()                       AdamW on my replica or shard

What differs between data parallelism and the ZeRO stages lives in minipar.parallel
(data.py, zero.py); this file only drives the steps, saves checkpoints, runs the
single-device reference for `check`, and turns what the ranks measured into a Report.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minipar import dist
from minipar.nn import GPT, GPTConfig, lr_schedule
from minipar.nn.gpt import parameter_shapes
from minipar.parallel.zero import data_parallel_engine
from minipar.train import checkpoint, equivalence
from minipar.train.config import ConfigError, TrainConfig
from minipar.train.data import TokenStream, make_stream, micro_batch
from minipar.train.report import Report


def gpt_config(config: TrainConfig, vocab_size: int) -> GPTConfig:
    """The model part of a TrainConfig."""
    return GPTConfig(vocab_size=vocab_size, seq_len=config.seq_len, n_layer=config.n_layer,
                     n_head=config.n_head, d_model=config.d_model, dropout=config.dropout,
                     tie_embeddings=config.tie_embeddings)


def learning_rate(config: TrainConfig, step: int) -> float:
    """The scheduled learning rate of `step`; a run shorter than the warm-up warms up
    over all its steps (so `--steps 1` works with the default --warmup-steps)."""
    return lr_schedule(step, lr=config.lr, warmup_steps=min(config.warmup_steps, config.steps),
                       total_steps=config.steps, min_lr=config.min_lr)


def _check_supported(config: TrainConfig) -> None:
    if config.tp > 1 or config.pp > 1:
        raise NotImplementedError(
            "this build of minipar trains with data parallelism and ZeRO only (--tp 1 "
            "--pp 1); tensor and pipeline parallelism land in the next releases")


@dataclass
class RunOptions:
    """What a launch needs besides the config (shared read-only by the ranks)."""

    stream: TokenStream
    start: checkpoint.TrainingState | None = None  # resume from this state
    reference_states: dict | None = None  # check: the reference's parameters per step
    record_states: bool = False  # keep the parameters after every step (the reference)
    save_dir: Path | None = None
    save_every: int = 0
    progress: object = None  # a _StepLog, or None
    device: dist.DeviceProfile | None = None  # the simulated GPU (default: H100)


# ------------------------------------------------------------------ the rank program
def _build(config: TrainConfig, options: RunOptions, mesh: dist.DeviceMesh):
    """My replica of the model (initial or resumed weights) and its DP / ZeRO engine."""
    model = GPT(gpt_config(config, options.stream.vocab_size), seed=config.seed,
                precision=config.precision,
                activation_checkpointing=config.activation_checkpointing)
    start = options.start
    if start is not None:
        model.load_state_dict(start.tensors["param"])
        # My saved dropout-generator state (rank 0's if the checkpoint had fewer ranks).
        rank = dist.get_rank()
        rngs = start.rng_states
        model.dropout_generator.bit_generator.state = rngs[rank if rank < len(rngs) else 0]
    adamw = {"lr": config.lr, "betas": (config.beta1, config.beta2),
             "weight_decay": config.weight_decay}
    engine = data_parallel_engine(model, model.named_parameters(), mesh.dp_group(),
                                  zero_stage=config.zero,
                                  bucket_bytes=config.bucket_size_mb * 2**20, adamw=adamw)
    if start is not None:
        engine.load_optimizer_state(start.step, start.tensors)
    return model, engine


def _rank_program(config: TrainConfig, options: RunOptions) -> dict:
    """What every rank runs (SPMD): build my replica, wrap it for DP / ZeRO, train."""
    mesh = dist.DeviceMesh(dp=config.dp, pp=config.pp, tp=config.tp)
    rank = dist.get_rank()
    model, engine = _build(config, options, mesh)
    start_step = 0 if options.start is None else options.start.step
    checker = None
    if options.reference_states is not None:
        checker = equivalence.StepChecker(
            options.reference_states, equivalence.TOLERANCES[config.precision], rank,
            mesh.coords(), dict(zip(("dp", "pp", "tp"), mesh.shape, strict=True)),
            scale=equivalence.SCALES[config.precision])
    history, states = [], {}
    accum = config.grad_accum_steps
    for step in range(start_step, config.steps):
        lr = learning_rate(config, step)
        inputs, targets = options.stream.global_batch(step, config.global_batch_size,
                                                      config.seq_len, config.seed)
        micro_losses = []
        for k in range(accum):
            x, y = micro_batch(inputs, targets, dp_rank=mesh.dp_rank, micro_step=k,
                               micro_batch_size=config.micro_batch_size,
                               grad_accum_steps=accum)
            # Only the last micro-batch's backward reduces gradients (DDP's no_sync);
            # ZeRO-2/3 reduce-scatter every micro-batch (DeepSpeed).
            engine.require_backward_grad_sync = k == accum - 1
            with dist.phase("forward"):
                # Copy my rows, as a data loader moves a micro-batch to the GPU.
                loss = model(np.ascontiguousarray(x), np.ascontiguousarray(y))
            with dist.phase("backward"):
                # d(mean over the global batch)/d(loss_k) = 1 / (accum x dp); the DP
                # average supplies the 1 / dp.
                loss.backward(np.asarray(1.0 / accum, dtype=loss.data.dtype))
                engine.finish_gradient_synchronization()
            micro_losses.append(float(loss.data))
        with dist.phase("optimizer"):
            grad_norm = engine.clip_grad_norm_(config.grad_clip)
            engine.step(lr)
            engine.zero_grad()
        record = {"step": step, "loss": float(np.mean(micro_losses)), "lr": lr,
                  "grad_norm": float(grad_norm)}
        history.append(record)
        if checker is not None:
            owned = [p for p in engine.state_pieces() if p.kind == "param"]
            checker.compare(step, owned, engine.parameter_pieces())
        if options.record_states:
            states[step] = {p.name: p.values.reshape(p.shape).copy()
                            for p in engine.parameter_pieces()}
        if options.save_dir is not None and _save_now(step, config, options.save_every):
            checkpoint.save_checkpoint(
                options.save_dir / f"step-{step + 1:06d}", step=step + 1,
                config=config.to_dict(), pieces=engine.state_pieces(), coords=mesh.coords(),
                rng_state=model.dropout_generator.bit_generator.state)
        if options.progress is not None:
            options.progress.report(rank, record)
    return {"steps": history, "coords": mesh.coords(), "pieces": engine.parameter_pieces(),
            "sharding": engine.describe(), "states": states,
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
            self.progress(record["step"], _merge_step([records[r] for r in sorted(records)]))


def _merge_step(records: list[dict]) -> dict:
    """One step of the report from every rank's record: the loss of the global batch is
    the mean of the ranks' losses (each a mean over equally many sequences)."""
    first = records[0]
    return {"step": first["step"], "loss": float(np.mean([r["loss"] for r in records])),
            "lr": first["lr"], "grad_norm": first["grad_norm"]}


# ------------------------------------------------------------------ the driver
def _launch(config: TrainConfig, options: RunOptions):
    results, devices = dist.launch(_rank_program, config.world_size, config, options,
                                   gpus_per_node=config.gpus_per_node,
                                   device=options.device, return_devices=True)
    steps = [_merge_step(list(records)) for records in zip(*(r["steps"] for r in results),
                                                            strict=True)]
    ranks = []
    for result, device in zip(results, devices, strict=True):
        summary = device.summary()
        summary["coords"] = result["coords"]
        summary["sharding"] = result["sharding"]
        ranks.append(summary)
    held = [(f"rank {rank}", result["coords"], piece)
            for rank, result in enumerate(results) for piece in result["pieces"]]
    # Replicas must agree; with check on, a difference is reported, not raised.
    state_dict = checkpoint.assemble(held, config.to_dict(), strict=not config.check)["param"]
    shapes = parameter_shapes(gpt_config(config, config.vocab_size))
    state_dict = {name: state_dict[name] for name in shapes}
    report = Report(config=config.to_dict(), world_size=config.world_size,
                    n_params=int(sum(np.prod(s) for s in shapes.values())), steps=steps,
                    ranks=ranks, timelines=[device.clock.events for device in devices],
                    state_dict=state_dict)
    return report, results


def _resume_state(config: TrainConfig, resume_from) -> checkpoint.TrainingState:
    """Load a checkpoint and check that it fits this run's model and data."""
    state = checkpoint.load_checkpoint(resume_from)
    saved = state.config
    for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "tie_embeddings",
                 "precision", "data", "seed"):
        if saved.get(name) != getattr(config, name):
            raise ConfigError(name, f"the checkpoint {resume_from} was saved with "
                              f"{name}={saved.get(name)!r}, this run has "
                              f"{getattr(config, name)!r}; use the same value to resume")
    if state.step >= config.steps:
        raise ConfigError("steps", f"the checkpoint {resume_from} has already done "
                          f"{state.step} steps; set --steps above {state.step} to go on")
    return state


def train(config: TrainConfig | None = None, *, progress=None, save_dir=None,
          save_every: int = 0, resume_from=None, device: dist.DeviceProfile | None = None,
          **overrides) -> Report:
    """Train the model described by `config` and return its measured Report.

    progress(step, record): called after every optimizer step (the CLI's progress bar).
    save_dir: write sharded checkpoints to save_dir/step-NNNNNN at the end and every
    `save_every` steps. resume_from: a checkpoint directory (or a save_dir: its latest)
    to continue from, saved under any dp / ZeRO layout. device: the DeviceProfile every
    rank simulates (default: an H100 SXM; see minipar.dist.clock). Keyword overrides build or
    modify the config: `train(steps=5, precision="fp64")`.
    With config.check, the single-device reference is trained first and the report gets
    an `equivalence` section."""
    if config is None:
        config = TrainConfig(**overrides)
    elif overrides:
        config = config.replace(**overrides)
    _check_supported(config)
    if save_every < 0:
        raise ConfigError("save_every", f"must be >= 0, got {save_every}")
    stream = make_stream(config.data, config.vocab_size)
    config = config.replace(vocab_size=stream.vocab_size)
    start = None if resume_from is None else _resume_state(config, resume_from)

    reference = reference_results = None
    if config.check:
        reference, reference_results = _launch(
            equivalence.reference_config(config),
            RunOptions(stream, start=start, record_states=True, device=device))
    options = RunOptions(
        stream, start=start,
        reference_states=None if reference is None else reference_results[0]["states"],
        save_dir=None if save_dir is None else Path(save_dir), save_every=save_every,
        progress=None if progress is None else _StepLog(progress, config.world_size),
        device=device)
    report, results = _launch(config, options)
    if reference is not None:
        report.equivalence = equivalence.compare_runs(
            report.steps, reference.steps, report.state_dict, reference.state_dict,
            [r["check"] for r in results], equivalence.TOLERANCES[config.precision],
            equivalence.SCALES[config.precision])
    return report
