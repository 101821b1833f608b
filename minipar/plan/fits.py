"""Does a run fit this machine? The planner's memory estimate, before anything is built.

The emulator keeps every virtual GPU in this one process, so a run holds the sum of what
its ranks hold. `run_bytes` adds up the planner's per-rank peak (memory.py: the ZeRO
paper's model state, Korthikanti et al.'s activations, the buffers) over every rank,
plus the single-device reference that `check` trains first, plus one thing only the
emulator does: every rank starts from the full initial weights (docs/design.md), so before
training a rank holds at least the full model's parameters. `check_fits` refuses a run
whose estimate exceeds this machine's physical memory, with the estimate in the message:

    --seq-len: this run needs ~119 GiB (1 rank(s): model state ~0.0 GiB, activations
    ~119 GiB), this machine has 23 GiB; ...

The check lives here, above minipar.train, because the formula does (one formula, no
import up the layers); the front ends call it before training, once the run is prepared
(`minipar.train.loop.prepare_run`: the data read, the layout checked): the CLI, and
`minipar.train` (the public entry point, minipar/run.py). `minipar.train.loop.train`
itself does not estimate (it is what the estimate is tested against).
"""

from __future__ import annotations

import os

from minipar.errors import ConfigError
from minipar.plan.layout import ParallelConfig, stage_plans
from minipar.plan.memory import stage_memory
from minipar.plan.shapes import from_train_config

GiB = 2**30
PARAM_BYTES = {"fp64": 8, "fp32": 4, "bf16-mixed": 2}  # the full initial weights' dtype
# Settings that make a run big, checked in this order for the one the message names.
SIZE_SETTINGS = ("seq_len", "micro_batch_size", "d_model", "vocab_size", "n_layer",
                 "moe_num_experts", "moe_capacity_factor", "grad_accum_steps", "dp", "tp",
                 "pp", "cp")


def machine_memory() -> int:
    """Physical memory of this machine in bytes (what the kernel reports)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _ranks_bytes(config) -> tuple[int, dict]:
    """Peak bytes of every rank of `config` (a TrainConfig with vocab_size set), summed;
    and the sum of each category, for the message."""
    shape = from_train_config(config)
    parallel = ParallelConfig.from_train_config(config)
    full_params = shape.n_params * PARAM_BYTES[config.precision]
    total, parts = 0, {"model state": 0, "activations": 0}
    for plan in stage_plans(shape, parallel, all_ranks=True):
        memory = stage_memory(shape, parallel, plan)
        ranks = config.dp * config.tp  # the ranks of this pipeline stage hold the same
        total += ranks * max(memory["peak_total"], full_params)
        parts["model state"] += ranks * (memory["params"] + memory["grads"] +
                                         memory["optimizer"])
        parts["activations"] += ranks * (memory["activations"] + memory["buffers"])
    return total, parts


def run_bytes(config) -> tuple[int, dict]:
    """Bytes this process will hold for `config` (TrainConfig, vocab_size set), and its
    parts; with `check`, the single-device reference is trained too (before the run)."""
    total, parts = _ranks_bytes(config)
    if config.check:
        from minipar.train.equivalence import reference_config

        reference, _ = _ranks_bytes(reference_config(config))
        total = max(total, reference)  # one after the other; the reference's steps kept
    return total, parts


def _culprit(config) -> str:
    """The size setting furthest above its default (the one to lower first)."""
    from minipar.train.config import TrainConfig

    defaults = TrainConfig()
    ratios = {}
    for name in SIZE_SETTINGS:
        value, default = getattr(config, name), getattr(defaults, name)
        ratios[name] = value / (default or 1) if name != "vocab_size" else value / 65
    return max(SIZE_SETTINGS, key=lambda name: (ratios[name], -SIZE_SETTINGS.index(name)))


def check_fits(config, available: int | None = None) -> int:
    """Raise ConfigError if `config` (a TrainConfig whose layout check_layout accepted)
    needs more memory than `available` bytes (default: this machine's); return the
    estimate. Runs in microseconds: the planner's arithmetic, nothing allocated."""
    from minipar.train.data import make_stream

    if config.vocab_size is None:  # (a prepared run's config has the data's)
        config = config.replace(vocab_size=make_stream(config.data).vocab_size)
    available = machine_memory() if available is None else available
    needed, parts = run_bytes(config)
    if needed > available:
        detail = ", ".join(f"{name} ~{_gib(b)}" for name, b in parts.items())
        setting = _culprit(config)
        raise ConfigError(setting, f"this run needs ~{_gib(needed)} ({config.world_size} "
                          f"rank(s) in this process: {detail}), this machine has "
                          f"{available // GiB} GiB; lower --{setting.replace('_', '-')} (or see "
                          "`minipar plan` for a layout that fits)")
    return needed


def _gib(nbytes: float) -> str:
    value = nbytes / GiB
    return f"{value:,.0f} GiB" if value >= 10 else f"{value:.2g} GiB"
