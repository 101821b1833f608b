"""TrainConfig: every setting of a run, flat, validated once, when it is built.

A TrainConfig is four sections, each a dataclass whose fields are defined once:

    ModelSettings        the GPT-2 shape (minipar.nn.gpt.GPTConfig's fields) and its MoE
    Layout               how the run is cut over GPUs, the batch, precision, recomputation
                         (minipar/train/layout.py; the planner's ParallelConfig is one too)
    OptimizerSettings    AdamW and its learning-rate schedule
    RunSettings          how long, on which data, from which seed, checked or not

`TrainConfig` inherits the four (dataclass field inheritance, as Megatron-LM's
`TransformerConfig(ModelParallelConfig)` does), so its fields stay flat:
`TrainConfig(dp=2, zero=1)`, `config.dp`, one CLI flag per field, and `to_dict()` is the
report's `config` section. The names are part of the public contract (the report's
schema): add fields freely, rename none.

Each section checks its own rules when it is built; TrainConfig adds the rules that
span sections (the emulator's world size, experts for --ep, a chunk's layers for
--recompute-num-layers). The rules that need the data's vocabulary are
minipar.train.mixes.check_layout, run once by `train`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from minipar.distributed.cluster import MAX_WORLD_SIZE
from minipar.errors import ConfigError
from minipar.nn.gpt import MLP_KINDS, GPTConfig
from minipar.train.layout import (
    Layout,
    check_booleans,
    check_positive_integers,
    choice,
    divisors,
    plain_scalars,
    setting,
    switches,
)

MAX_LR = 1.0  # docs/refusals.md: larger peak learning rates are refused
# The deepest and widest models minipar takes (the trainer's and the planner's): far past
# any published one (GPT-3 has 96 layers, Megatron's 1T model 128; DeepSeek-V3 256 routed
# experts), and low enough that the planner's per-layer and per-expert work stays seconds
# (--n-layer 10**12 hung the memory check that runs before training).
MAX_LAYERS = 4096
MAX_EXPERTS = 4096
MAX_SEED = 2**63 - 1  # NumPy's SeedSequence takes any integer >= 0; int64 keeps it portable
DATASETS = ("corpus", "synthetic")


@dataclass(frozen=True)
class ModelSettings:
    """The model: GPT-2's shape (vocab_size None = taken from the data's tokenizer) and
    its mixture of experts (minipar/nn/moe.py; 0 experts = the dense GPT-2)."""

    vocab_size: int | None = setting(None, "vocabulary size (default: the data's tokenizer)")
    seq_len: int = setting(32, "tokens per sequence (T)")
    n_layer: int = setting(2, "transformer blocks")
    n_head: int = setting(4, "attention heads")
    d_model: int = setting(64, "hidden size (h)")
    dropout: float = setting(0.0, "dropout probability (0 = off)")
    tie_embeddings: bool = setting(True, "share the LM head with the token embedding (GPT-2 "
                                         "does)")
    # Llama's shape: grouped-query attention, the MLP's width and its gated unit
    n_kv_head: int | None = setting(None, "key/value heads (grouped-query attention; default "
                                          "n_head: multi-head attention)")
    d_ff: int | None = setting(None, "MLP hidden width (default 4 x d_model)")
    mlp: str = setting("gelu", "MLP activation: gelu (GPT-2) or swiglu (Llama: gate, up and "
                               "down matrices)")
    # Megatron-LM's names of the MoE flags in brackets
    moe_num_experts: int = setting(0, "experts per MoE layer (0 = dense MLP; Megatron's "
                                      "--num-experts)")
    moe_top_k: int = setting(2, "experts each token is routed to (--moe-router-topk)")
    moe_capacity_factor: float = setting(1.0, "expert capacity = ceil(tokens x k / E x "
                                              "factor); overflow dropped")
    moe_aux_loss_coeff: float = setting(0.01, "load-balancing auxiliary loss coefficient "
                                              "(Switch/GShard)")
    moe_layer_freq: int = setting(1, "every k-th block is MoE (blocks 0, k, 2k, ...)")

    def __post_init__(self) -> None:
        self.validate_model()

    def validate_model(self) -> None:
        plain_scalars(self)
        check_positive_integers(self, ("seq_len", "n_layer", "n_head", "d_model"))
        check_booleans(self, switches(ModelSettings))
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ConfigError("vocab_size", f"must be at least 2, got {self.vocab_size}")
        if self.d_model % self.n_head:
            raise ConfigError("n_head", f"d_model={self.d_model} is not divisible by "
                              f"n_head={self.n_head}; pick n_head among "
                              f"{divisors(self.d_model)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
        _finite("dropout", self.dropout)
        for name in ("n_kv_head", "d_ff"):
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name), 1)
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            raise ConfigError("n_kv_head", f"n_head={self.n_head} is not a multiple of "
                              f"{self.n_kv_head}: each key/value head serves a group of query "
                              f"heads; pick one of {divisors(self.n_head)}")
        choice("mlp", self.mlp, MLP_KINDS)
        _integer("moe_num_experts", self.moe_num_experts, 0)
        check_model_size(self)
        if self.moe_num_experts:  # GPTConfig's rules, as flags
            if self.mlp != "gelu" or self.d_ff is not None:
                flag = "mlp" if self.mlp != "gelu" else "d_ff"
                raise ConfigError(flag, "minipar's experts are GPT-2 MLPs (GELU, 4 x "
                                  "d_model): drop it, or --moe-num-experts")
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
            for field in dataclasses.fields(ModelSettings):
                if (field.name in ROUTING_SETTINGS
                        and getattr(self, field.name) != field.default):
                    raise moe_setting_without_experts(field.name, getattr(self, field.name))


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW, linear warm-up then cosine decay to min_lr; clipping of the global norm."""

    lr: float = setting(1e-3, "peak learning rate")
    min_lr: float = setting(1e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = setting(2, "linear warm-up steps")
    weight_decay: float = setting(0.1, "AdamW decoupled weight decay (matrices only)")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    grad_clip: float = setting(1.0, "clip the global gradient norm to this value (0 = off)")

    def __post_init__(self) -> None:
        self.validate_optimizer()

    def validate_optimizer(self) -> None:
        plain_scalars(self)
        # Real numbers first: NaN compares False with everything, so `lr <= 0` alone
        # lets --lr nan through (and --grad-clip nan silently turned clipping off).
        for name in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "grad_clip"):
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


@dataclass(frozen=True)
class RunSettings:
    """How long, on which data, from which seed, on nodes of how many virtual GPUs, and
    whether the single-device reference is trained too and compared every step
    (equivalence.py)."""

    steps: int = setting(20, "optimizer steps")
    data: str = setting("corpus", "training data: the built-in corpus or a synthetic Markov "
                                  "task")
    seed: int = setting(0, "seed of weights and batches")
    gpus_per_node: int = setting(8, "virtual GPUs per node (ranks on one node share fast "
                                    "links)")
    check: bool = setting(False, "also train the single-device reference and compare every "
                                 "step")

    def __post_init__(self) -> None:
        self.validate_run()

    def validate_run(self) -> None:
        plain_scalars(self)
        check_positive_integers(self, ("steps", "gpus_per_node"))
        check_booleans(self, switches(RunSettings))
        choice("data", self.data, DATASETS)
        _integer("seed", self.seed, 0, MAX_SEED)


# The bases are listed last-section-first: a dataclass orders the fields of its bases
# from the last to the first, so to_dict() reads model, layout, optimizer, run.
@dataclass(frozen=True)
class TrainConfig(RunSettings, OptimizerSettings, Layout, ModelSettings):
    """Every setting of a training run (the module docstring)."""

    def __post_init__(self) -> None:
        self.validate_model()
        self.validate_layout(n_layer=self.n_layer)
        if self.world_size > MAX_WORLD_SIZE:  # the emulator's limit, not the planner's
            largest = max(("dp", "tp", "pp", "cp"), key=lambda name: getattr(self, name))
            raise ConfigError(largest, f"dp x tp x pp x cp = {self.dp} x {self.tp} x {self.pp} "
                              f"x {self.cp} = {self.world_size} virtual ranks, above minipar's "
                              f"maximum of {MAX_WORLD_SIZE} (one thread each); use fewer")
        check_experts_split(self.ep, self.moe_num_experts)
        self.validate_optimizer()
        self.validate_run()


# ------------------------------------------------------------------ the shared rules
def check_model_size(settings, error=ConfigError) -> None:
    """At most MAX_LAYERS layers and MAX_EXPERTS experts (settings: a TrainConfig or a
    ModelShape, whose n_layer and moe_num_experts are already integers)."""
    for name, most in (("n_layer", MAX_LAYERS), ("moe_num_experts", MAX_EXPERTS)):
        if getattr(settings, name) > most:
            raise error(name, f"must be at most {most:,} (minipar's limit: far past any "
                        f"published model), got {getattr(settings, name):,}")


def check_experts_split(ep: int, moe_num_experts: int) -> None:
    """--ep's rules with the model (the trainer's and the planner's; Layout checks that ep
    divides dp): an MoE model, whose experts split evenly over the ep ranks."""
    if ep == 1:
        return
    if not moe_num_experts:
        raise ConfigError("ep", "expert parallelism splits the experts of an MoE model: add "
                          "--moe-num-experts")
    if moe_num_experts % ep:
        raise ConfigError("ep", f"--ep {ep} must divide --moe-num-experts {moe_num_experts}: "
                          "each rank holds E / ep experts")


def moe_setting_without_experts(setting: str, value) -> ConfigError:
    """The error for an MoE setting given to a dense model (the trainer's and the
    planner's): ignoring it would answer another question than the one asked."""
    return ConfigError(setting, f"{value} has no effect without --moe-num-experts (the model "
                       "is dense: no router, no experts); add --moe-num-experts E or drop it")


# The router's settings: what has no effect on a dense model (moe_num_experts = 0).
ROUTING_SETTINGS = tuple(f.name for f in dataclasses.fields(ModelSettings)
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


def gpt_config(config: TrainConfig, vocab_size: int | None = None) -> GPTConfig:
    """The model section of a TrainConfig as the model's own config."""
    model = {f.name: getattr(config, f.name) for f in dataclasses.fields(ModelSettings)}
    return GPTConfig(**{**model, "vocab_size": vocab_size or config.vocab_size})
