"""TrainConfig: every setting of a run, flat, validated in one place.

The report's `config` section is `TrainConfig.to_dict()`, so the names here are part of
the public contract (DESIGN.md): add fields freely, rename none.

The batch arithmetic every interview asks about lives here:

    global_batch_size = micro_batch_size x grad_accum_steps x dp

The user gives either `grad_accum_steps` or `global_batch_size` (or both, consistently);
the other is derived. A global batch that does not split is an error that names the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PRECISIONS = ("fp64", "fp32", "bf16-mixed")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
DATASETS = ("corpus", "synthetic")


class ConfigError(ValueError):
    """An invalid setting. `field` is the TrainConfig field (the CLI flag is --field-name)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{flag(field)}: {message}")


def flag(field_name: str) -> str:
    """The CLI flag of a config field: micro_batch_size -> --micro-batch-size."""
    return "--" + field_name.replace("_", "-")


@dataclass
class TrainConfig:
    # model (GPT-2 shape); vocab_size None = taken from the data's tokenizer
    vocab_size: int | None = None
    seq_len: int = 32
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0
    tie_embeddings: bool = True
    # parallel layout (a device mesh dp x pp x tp; see minipar.distributed.DeviceMesh)
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    gpus_per_node: int = 8
    # data parallelism: gradient bucket capacity in MiB (DDP's bucket_cap_mb); 0 = one
    # bucket reduced after backward, > 0 = buckets reduced while backward goes on
    bucket_size_mb: float = 0.0
    # batch: global_batch_size = micro_batch_size x grad_accum_steps x dp
    micro_batch_size: int = 4
    grad_accum_steps: int | None = None
    global_batch_size: int | None = None
    # optimisation (AdamW, linear warm-up then cosine decay to min_lr)
    steps: int = 20
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    # numerics and memory
    precision: str = "fp32"
    activation_checkpointing: bool = False
    # data and reproducibility
    data: str = "corpus"
    seed: int = 0
    # also train the single-device reference and compare every step (equivalence.py)
    check: bool = False

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check every setting; derive grad_accum_steps / global_batch_size."""
        positive = ("seq_len", "n_layer", "n_head", "d_model", "dp", "tp", "pp",
                    "virtual_stages", "gpus_per_node", "micro_batch_size", "steps")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ConfigError("vocab_size", f"must be at least 2, got {self.vocab_size}")
        if self.d_model % self.n_head:
            raise ConfigError("n_head", f"d_model={self.d_model} is not divisible by "
                              f"n_head={self.n_head}; pick n_head among "
                              f"{_divisors(self.d_model)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError("zero", f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero}")
        _choice("precision", self.precision, PRECISIONS)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("data", self.data, DATASETS)
        if self.lr <= 0:
            raise ConfigError("lr", f"must be positive, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError("min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ConfigError("warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if self.weight_decay < 0:
            raise ConfigError("weight_decay", f"must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)}")
        if not isinstance(self.bucket_size_mb, (int, float)) or self.bucket_size_mb < 0:
            raise ConfigError("bucket_size_mb", f"must be >= 0 (0 = one bucket), got "
                              f"{self.bucket_size_mb!r}")
        if self.grad_clip < 0:
            raise ConfigError("grad_clip", f"must be >= 0 (0 disables), got {self.grad_clip}")
        self._resolve_batch()

    def _resolve_batch(self) -> None:
        per_step = self.micro_batch_size * self.dp  # sequences per micro-step, all DP ranks
        accum, global_batch = self.grad_accum_steps, self.global_batch_size
        if accum is not None and (not isinstance(accum, int) or accum < 1):
            raise ConfigError("grad_accum_steps", f"must be a positive integer, got {accum!r}")
        if global_batch is not None:
            if not isinstance(global_batch, int) or global_batch < 1:
                raise ConfigError("global_batch_size",
                                  f"must be a positive integer, got {global_batch!r}")
            if global_batch % per_step:
                lower = max(per_step, global_batch // per_step * per_step)
                raise ConfigError(
                    "global_batch_size",
                    f"{global_batch} does not split into micro-batches: it must be a multiple "
                    f"of micro_batch_size x dp = {self.micro_batch_size} x {self.dp} = "
                    f"{per_step} (e.g. {lower} or {lower + per_step}), or set "
                    f"--grad-accum-steps instead")
            derived = global_batch // per_step
            if accum is not None and accum != derived:
                raise ConfigError(
                    "global_batch_size",
                    f"{global_batch} != micro_batch_size x grad_accum_steps x dp = "
                    f"{self.micro_batch_size} x {accum} x {self.dp} = {per_step * accum}; "
                    f"give only one of --global-batch-size and --grad-accum-steps")
            self.grad_accum_steps = derived
        else:
            self.grad_accum_steps = accum if accum is not None else 1
            self.global_batch_size = per_step * self.grad_accum_steps

    # ------------------------------------------------------------------ views
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def to_dict(self) -> dict:
        """Every setting, flat (the report's `config`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown setting; valid settings: {sorted(known)}")
        return cls(**values)

    def replace(self, **changes) -> TrainConfig:
        """A copy with some settings changed (the batch is re-derived unless given)."""
        values = self.to_dict()
        if "global_batch_size" not in changes and {"dp", "micro_batch_size",
                                                   "grad_accum_steps"} & set(changes):
            values["global_batch_size"] = None
        if "grad_accum_steps" not in changes and "global_batch_size" in changes:
            values["grad_accum_steps"] = None
        values.update(changes)
        return TrainConfig.from_dict(values)


def _choice(name: str, value, options) -> None:
    if value not in options:
        raise ConfigError(name, f"must be one of {', '.join(options)}; got {value!r}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
