"""TrainConfig: every setting of a run, flat, validated in one place.

This module is long because it is every setting's rule, and the rules the planner
shares (the batch arithmetic, the parallel sizes, the limits), each written once.

The report's `config` section is `TrainConfig.to_dict()`, so the names here are part of
the public contract (DESIGN.md): add fields freely, rename none.

The batch arithmetic every interview asks about lives here:

    global_batch_size = micro_batch_size x grad_accum_steps x dp

The user gives either `grad_accum_steps` or `global_batch_size` (or both, consistently);
the other is derived. A global batch that does not split is an error that names the fix.

The rules the planner shares (minipar.plan.layout.ParallelConfig: the layout's sizes, ZeRO
stage, precision, schedule name, bucket size, the batch arithmetic and its re-derivation
on `replace`) are the functions below; each takes `error`, the exception class to raise
as error(field, message), so each rule and its message are written once. Schedule names
and their rules come from the schedule registry (minipar.parallel.pipeline.schedules).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from minipar.distributed.cluster import MAX_WORLD_SIZE
from minipar.errors import ConfigError, flag
from minipar.nn.gpt import GPTConfig
from minipar.nn.recompute import Recompute, recompute_problem
from minipar.parallel.pipeline.schedules.registry import check_schedule_name
from minipar.parallel.zero.offload import DEVICES as OFFLOAD_DEVICES  # DeepSpeed's offload devices

__all__ = ["DATASETS", "PRECISIONS", "ConfigError", "TrainConfig", "flag"]

PRECISIONS = ("fp64", "fp32", "bf16-mixed")
# The CLI help of the mixture-of-experts flags (Megatron-LM's names in brackets).
MOE_HELP = {
    "moe_num_experts": "experts per MoE layer (0 = dense MLP; Megatron's --num-experts)",
    "moe_top_k": "experts each token is routed to (--moe-router-topk)",
    "moe_capacity_factor": "expert capacity = ceil(tokens x k / E x factor); overflow dropped",
    "moe_aux_loss_coeff": "load-balancing auxiliary loss coefficient (Switch/GShard)",
    "moe_layer_freq": "every k-th block is MoE (blocks 0, k, 2k, ...)",
    "ep": "expert-parallel size (splits the experts inside the data-parallel group)",
}
MAX_LR = 1.0  # docs/refusals.md: larger peak learning rates are refused
# The deepest and widest models minipar takes (the trainer's and the planner's): far past
# any published one (GPT-3 has 96 layers, Megatron's 1T model 128; DeepSeek-V3 256 routed
# experts), and low enough that the planner's per-layer and per-expert work stays seconds
# (--n-layer 10**12 hung the memory check that runs before training).
MAX_LAYERS = 4096
MAX_EXPERTS = 4096
# Micro-batches per optimizer step: the trainer runs each one and the planner simulates
# each one of the schedule; --grad-accum-steps 10**12 hung the planner and asked the
# trainer for 29 TiB of token ids. Published runs use hundreds to a few thousand.
MAX_MICRO_BATCHES = 65536
MAX_SEED = 2**63 - 1  # NumPy's SeedSequence takes any integer >= 0; int64 keeps it portable
DATASETS = ("corpus", "synthetic")


def moe_setting_without_experts(setting: str, value) -> ConfigError:
    """The error for an MoE setting given to a dense model (the trainer's and the
    planner's): ignoring it would answer another question than the one asked."""
    return ConfigError(setting, f"{value} has no effect without --moe-num-experts (the model "
                       "is dense: no router, no experts); add --moe-num-experts E or drop it")


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
    # mixture of experts (minipar/nn/moe.py); 0 experts = the dense GPT-2
    moe_num_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float = 1.0
    moe_aux_loss_coeff: float = 0.01
    moe_layer_freq: int = 1
    # parallel layout (a device mesh dp x pp x cp x tp; see minipar.distributed.DeviceMesh)
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    # context parallelism: every sequence cut over cp ranks, ring attention (a mesh
    # dp x pp x cp x tp); load balancing gives rank r chunks r and 2cp-1-r of 2cp
    cp: int = dataclasses.field(default=1, metadata={
        "help": "context-parallel size: each sequence cut over this many ranks (ring attention)"})
    cp_load_balance: bool = dataclasses.field(default=True, metadata={
        "help": "cut the sequence into 2 x cp chunks, rank r keeping r and 2cp-1-r, so causal "
                "attention gives every rank the same work"})
    # expert parallelism: the experts split over ep ranks inside the DP group
    ep: int = 1
    gpus_per_node: int = 8
    # ZeRO-Offload / ZeRO-Infinity (minipar/parallel/zero/offload.py): where the optimizer
    # state (ZeRO >= 1) and the parameter shard (ZeRO-3) live: none (GPU), cpu, nvme
    offload_optimizer: str = "none"
    offload_param: str = "none"
    # data parallelism: gradient bucket capacity in MiB (DDP's bucket_cap_mb); 0 = one
    # bucket reduced after backward, > 0 = buckets reduced while backward goes on
    bucket_size_mb: float = 0.25
    # communication overlap (issue 15): reduce gradient buckets asynchronously while
    # backward goes on, and under pipeline parallelism during each stage's last
    # micro-batch backward (DeepSpeed's overlap_comm, Megatron's --overlap-grad-reduce);
    # False waits for each reduction as it starts (same bytes and numbers)
    overlap_grad_reduce: bool = True
    # ZeRO-3: all-gather the next module's parameters while the current one computes
    # (FSDP's forward/backward prefetch, DeepSpeed's stage3_prefetch_bucket_size)
    zero3_prefetch: bool = True
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
    activation_checkpointing: bool = False  # = --recompute-granularity full, every layer
    # finer recomputation (Megatron-LM's flags; minipar.nn.recompute): selective = only
    # the attention core; full = whole layers, the method choosing which of each chunk's
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
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
        check_positive_integers(self, ("seq_len", "n_layer", "n_head", "d_model",
                                       "gpus_per_node", "steps"))
        check_parallel_settings(self)
        if self.world_size > MAX_WORLD_SIZE:  # the emulator's limit, not the planner's
            largest = max(("dp", "tp", "pp", "cp"), key=lambda name: getattr(self, name))
            raise ConfigError(largest, f"dp x tp x pp x cp = {self.dp} x {self.tp} x {self.pp} "
                              f"x {self.cp} = {self.world_size} virtual ranks, above minipar's "
                              f"maximum of {MAX_WORLD_SIZE} (one thread each); use fewer")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ConfigError("vocab_size", f"must be at least 2, got {self.vocab_size}")
        if self.d_model % self.n_head:
            raise ConfigError("n_head", f"d_model={self.d_model} is not divisible by "
                              f"n_head={self.n_head}; pick n_head among "
                              f"{_divisors(self.d_model)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
        self._validate_moe()
        _choice("data", self.data, DATASETS)
        # Real numbers first: NaN compares False with everything, so `lr <= 0` alone
        # lets --lr nan through (and --grad-clip nan silently turned clipping off).
        for name in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "grad_clip",
                     "dropout"):
            _finite(name, getattr(self, name))
        check_learning_rate("lr", self.lr)
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError("min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr}")
        _integer("warmup_steps", self.warmup_steps, 0)
        if self.weight_decay < 0:
            raise ConfigError("weight_decay", f"must be >= 0, got {self.weight_decay}")
        if self.lr * self.weight_decay >= 1:
            raise ConfigError("weight_decay", f"lr x weight_decay = {self.lr} x "
                              f"{self.weight_decay} must be below 1: decoupled decay "
                              "multiplies every weight by (1 - lr x weight_decay) each step")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)}")
        if self.grad_clip < 0:
            raise ConfigError("grad_clip", f"must be >= 0 (0 disables), got {self.grad_clip}")
        _integer("seed", self.seed, 0, MAX_SEED)
        chunks = self.pp * self.virtual_stages
        problem = recompute_problem(self.activation_checkpointing, self.recompute_granularity,
                                    self.recompute_method, self.recompute_num_layers,
                                    -(-self.n_layer // chunks))
        if problem is not None:
            raise ConfigError(*problem)
        self.grad_accum_steps, self.global_batch_size = resolve_batch(
            self.micro_batch_size, self.dp, self.grad_accum_steps, self.global_batch_size)

    def _validate_moe(self) -> None:
        """The MoE settings (GPTConfig's rules, as flags) and --ep inside --dp."""
        _integer("moe_num_experts", self.moe_num_experts, 0)
        check_model_size(self)
        _integer("ep", self.ep, 1)
        if self.moe_num_experts:
            _integer("moe_top_k", self.moe_top_k, 1)
            _integer("moe_layer_freq", self.moe_layer_freq, 1)
            for name in ("moe_capacity_factor", "moe_aux_loss_coeff"):
                _finite(name, getattr(self, name))
            if self.moe_top_k > self.moe_num_experts:
                raise ConfigError("moe_top_k", f"{self.moe_top_k} exceeds --moe-num-experts "
                                  f"{self.moe_num_experts}: a token picks k distinct experts")
            if not self.moe_capacity_factor > 0:
                raise ConfigError("moe_capacity_factor", "must be > 0, got "
                                  f"{self.moe_capacity_factor}")
            if self.moe_aux_loss_coeff < 0:
                raise ConfigError("moe_aux_loss_coeff", "must be >= 0, got "
                                  f"{self.moe_aux_loss_coeff}")
        else:  # a dense model has no router: a changed MoE setting would be ignored
            for field in dataclasses.fields(self):
                if (field.name in ROUTING_SETTINGS
                        and getattr(self, field.name) != field.default):
                    raise moe_setting_without_experts(field.name, getattr(self, field.name))
        check_expert_parallel_settings(self.ep, self.dp, self.moe_num_experts)

    # ------------------------------------------------------------------ views
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def recompute(self) -> Recompute:
        """The recomputation policy of the activation_checkpointing / recompute_* flags."""
        return Recompute.from_settings(self.activation_checkpointing,
                                       self.recompute_granularity, self.recompute_method,
                                       self.recompute_num_layers)

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
        return TrainConfig.from_dict(replace_settings(self.to_dict(), changes))


# ------------------------------------------------------------------ the shared rules
def check_model_size(settings, error=ConfigError) -> None:
    """At most MAX_LAYERS layers and MAX_EXPERTS experts (settings: a TrainConfig or a
    ModelShape, whose n_layer and moe_num_experts are already integers)."""
    for name, most in (("n_layer", MAX_LAYERS), ("moe_num_experts", MAX_EXPERTS)):
        if getattr(settings, name) > most:
            raise error(name, f"must be at most {most:,} (minipar's limit: far past any "
                        f"published model), got {getattr(settings, name):,}")


def check_positive_integers(settings, names, error=ConfigError) -> None:
    """Each setting in `names` (attributes of `settings`) is an int >= 1."""
    for name in names:
        value = getattr(settings, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise error(name, f"must be a positive integer, got {value!r}")


def check_expert_parallel_settings(ep: int, dp: int, moe_num_experts: int | None,
                                   error=ConfigError) -> None:
    """--ep's rules, shared by TrainConfig and the planner: ep | dp (the experts are split
    inside the DP group, Megatron's expert-data-parallel layout), an MoE model, ep | E.
    ep and dp must already be positive integers; moe_num_experts None: the model is not
    known yet (the planner's ParallelConfig), only the layout rule applies."""
    if ep == 1:
        return
    if dp % ep:
        raise error("ep", f"--ep {ep} must divide --dp {dp}: the experts are split inside "
                    "the data-parallel group")
    if moe_num_experts is None:
        return
    if not moe_num_experts:
        raise error("ep", "expert parallelism splits the experts of an MoE model: add "
                    "--moe-num-experts")
    if moe_num_experts % ep:
        raise error("ep", f"--ep {ep} must divide --moe-num-experts {moe_num_experts}: each "
                    "rank holds E / ep experts")


def check_parallel_settings(settings, error=ConfigError) -> None:
    """The layout's rules, shared by TrainConfig and the planner's ParallelConfig: mesh
    sizes and micro-batch size, ZeRO stage, precision, schedule name, bucket size."""
    check_positive_integers(settings, ("dp", "tp", "pp", "cp", "virtual_stages",
                                       "micro_batch_size"), error)
    if settings.zero not in (0, 1, 2, 3):
        raise error("zero", f"ZeRO stage must be 0, 1, 2 or 3, got {settings.zero!r}")
    _choice("precision", settings.precision, PRECISIONS, error)
    check_schedule_name(settings.schedule, error)
    bucket = settings.bucket_size_mb
    if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or \
            not math.isfinite(bucket) or bucket < 0:  # NaN compares False with every bound
        raise error("bucket_size_mb", f"must be a finite number >= 0 (0 = one bucket), got "
                    f"{bucket!r}")
    check_offload_settings(settings, error)


def check_offload_settings(settings, error=ConfigError) -> None:
    """ZeRO-Offload / ZeRO-Infinity's devices and the stages DeepSpeed runs them with
    (deepspeed/runtime/zero/offload_config.py; minipar/parallel/zero/offload.py)."""
    optimizer, param, zero = settings.offload_optimizer, settings.offload_param, settings.zero
    _choice("offload_optimizer", optimizer, OFFLOAD_DEVICES, error)
    _choice("offload_param", param, OFFLOAD_DEVICES, error)
    if param != "none" and zero != 3:
        raise error("offload_param",
                    f"--offload-param {param} needs --zero 3 (got --zero {zero}): below "
                    "stage 3 every rank keeps the full parameters on its GPU to run forward "
                    "and backward, so there is no parameter shard to offload (DeepSpeed: "
                    "offload_param is valid only with stage 3); use --zero 3, or "
                    "--offload-optimizer cpu to offload the optimizer state")
    if optimizer != "none" and zero == 0:
        raise error("offload_optimizer",
                    f"--offload-optimizer {optimizer} needs --zero 1, 2 or 3: ZeRO-Offload "
                    "moves a rank's ZeRO partition of the optimizer state to the host, and "
                    "--zero 0 has none (DeepSpeed: offload_optimizer is valid with stage 1, "
                    "2 and 3); add --zero 1")
    if optimizer == "nvme" and zero < 3:
        raise error("offload_optimizer",
                    f"--offload-optimizer nvme needs --zero 3 (got --zero {zero}): "
                    "DeepSpeed's stage 1/2 optimizer has no NVMe swapper (stage_1_and_2.py "
                    "keeps the state in CPU memory for any offload device); ZeRO-Infinity's "
                    "NVMe swapping is stage 3's. Use --offload-optimizer cpu or --zero 3")


def resolve_batch(micro_batch_size: int, dp: int, grad_accum_steps: int | None,
                  global_batch_size: int | None, error=ConfigError) -> tuple[int, int]:
    """(grad_accum_steps, global_batch_size) with global = micro x accum x dp, from
    either (or both, consistent); neither given means one micro-batch per step."""
    per_step = micro_batch_size * dp  # sequences per micro-step, all DP ranks
    accum, global_batch = grad_accum_steps, global_batch_size
    if accum is not None and (not isinstance(accum, int) or accum < 1):
        raise error("grad_accum_steps", f"must be a positive integer, got {accum!r}")
    if accum is not None and accum > MAX_MICRO_BATCHES:
        raise error("grad_accum_steps", f"must be at most {MAX_MICRO_BATCHES:,} micro-batches "
                    f"per step (every one is run, or simulated), got {accum:,}")
    if global_batch is None:
        accum = 1 if accum is None else accum
        return accum, per_step * accum
    if not isinstance(global_batch, int) or global_batch < 1:
        raise error("global_batch_size", f"must be a positive integer, got {global_batch!r}")
    if global_batch % per_step:
        lower = max(per_step, global_batch // per_step * per_step)
        raise error("global_batch_size",
                    f"{global_batch} does not split into micro-batches: it must be a multiple "
                    f"of micro_batch_size x dp = {micro_batch_size} x {dp} = {per_step} "
                    f"(e.g. {lower} or {lower + per_step}), or set --grad-accum-steps instead")
    derived = global_batch // per_step
    if derived > MAX_MICRO_BATCHES:
        raise error("global_batch_size", f"{global_batch:,} is {derived:,} micro-batches of "
                    f"micro_batch_size x dp = {per_step} per step; at most "
                    f"{MAX_MICRO_BATCHES:,} (every one is run, or simulated): raise "
                    "--micro-batch-size or dp")
    if accum is not None and accum != derived:
        raise error("global_batch_size",
                    f"{global_batch} != micro_batch_size x grad_accum_steps x dp = "
                    f"{micro_batch_size} x {accum} x {dp} = {per_step * accum}; give only "
                    f"one of --global-batch-size and --grad-accum-steps")
    return derived, global_batch


def replace_settings(values: dict, changes: dict) -> dict:
    """`values` with `changes` applied, the batch left to be re-derived: changing dp, the
    micro-batch size or the accumulation recomputes the global batch (unless it is given
    too), and a new global batch recomputes the accumulation."""
    values = dict(values)
    if "global_batch_size" not in changes and {"dp", "micro_batch_size",
                                               "grad_accum_steps"} & set(changes):
        values["global_batch_size"] = None
    if "grad_accum_steps" not in changes and "global_batch_size" in changes:
        values["grad_accum_steps"] = None
    values.update(changes)
    return values


# The router's settings: what has no effect on a dense model (moe_num_experts = 0).
ROUTING_SETTINGS = tuple(f.name for f in dataclasses.fields(TrainConfig)
                         if f.name.startswith("moe_") and f.name != "moe_num_experts")


def check_learning_rate(name: str, lr) -> None:
    """A learning rate AdamW can train with: finite, in (0, MAX_LR] (the trainer's --lr, and
    the planner's --lr and --reference-lr, which go into exported DeepSpeed configs)."""
    _finite(name, lr)
    if not 0 < lr <= MAX_LR:
        raise ConfigError(name, f"must be in (0, {MAX_LR:g}], got {lr}: an AdamW step moves "
                          "every weight by about lr, so a larger one does not train (GPT-2 "
                          "used 6e-4)")


def _finite(name: str, value) -> None:
    """A real, finite number (not a bool, str, NaN or inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number, got {value!r}")


def _integer(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or \
            (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(name, f"must be an integer {bound}, got {value!r}")


def _choice(name: str, value, options, error=ConfigError) -> None:
    if value not in options:
        raise error(name, f"must be one of {', '.join(options)}; got {value!r}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def gpt_config(config: TrainConfig, vocab_size: int | None = None) -> GPTConfig:
    """The model part of a TrainConfig."""
    return GPTConfig(vocab_size=vocab_size or config.vocab_size, seq_len=config.seq_len,
                     n_layer=config.n_layer, n_head=config.n_head, d_model=config.d_model,
                     dropout=config.dropout, tie_embeddings=config.tie_embeddings,
                     moe_num_experts=config.moe_num_experts, moe_top_k=config.moe_top_k,
                     moe_capacity_factor=config.moe_capacity_factor,
                     moe_aux_loss_coeff=config.moe_aux_loss_coeff,
                     moe_layer_freq=config.moe_layer_freq)
