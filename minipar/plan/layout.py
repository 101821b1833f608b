"""A parallel configuration, and what it gives each pipeline rank to hold and run.

`ParallelConfig` carries the settings of minipar's TrainConfig that shape memory, traffic
and time (same names: dp, tp, pp, zero, schedule, virtual_stages, sequence_parallel,
micro_batch_size, grad_accum_steps, global_batch_size, precision,
activation_checkpointing, recompute_granularity, recompute_method, recompute_num_layers,
bucket_size_mb), plus two a real cluster needs: a FlashAttention
kernel (Dao et al. 2022) and an explicit pipeline `layer_split`.

The batch arithmetic and the settings' rules are TrainConfig's (minipar.train.config):
global_batch_size = micro_batch_size x grad_accum_steps x dp (give one of the last two,
or both consistently); the schedule's rules are its registry entry's
(minipar.parallel.pipeline.schedules), raised here as PlanError.

`stage_plans` says, for each pipeline rank, which layers it holds (the same balanced
split as minipar.parallel.pipeline.executor.split_layers: n_layer // stages each, the first
n_layer % stages one more), whether it holds the embedding, the head or a tied copy of
the embedding, and how many micro-batches it keeps activations for at once: the
schedule's own `in_flight` formula (ScheduleSpec in minipar.parallel.pipeline.schedules, e.g. m for
GPipe, min(p - r, m) for 1F1B), which the tests check against its action lists.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from minipar.errors import ConfigError
from minipar.nn.recompute import Recompute, recompute_problem
from minipar.parallel.context.layout import SELECTIVE_WITH_CP
from minipar.parallel.expert.dispatch import expert_layout_problem
from minipar.parallel.pipeline.schedules.registry import SCHEDULES, check_schedule_settings
from minipar.plan.shapes import ModelShape
from minipar.train.config import (
    check_expert_parallel_settings,
    check_parallel_settings,
    replace_settings,
    resolve_batch,
)

# A setting the planner cannot use; `setting` names it (the CLI flag is --setting). The
# same class as minipar.train's ConfigError (minipar/errors.py), so one `except` catches both.
PlanError = ConfigError


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state (the ZeRO paper's 2 + 2 + 12 for mixed
    precision with Adam: Rajbhandari et al. 2020, section 3.1). `compute` is the dtype of
    norm statistics and the loss (fp32 under bf16)."""

    param: int
    grad: int
    optimizer: int
    activation: int
    compute: int


PRECISION_BYTES = {
    "fp64": Precision(param=8, grad=8, optimizer=16, activation=8, compute=8),
    "fp32": Precision(param=4, grad=4, optimizer=8, activation=4, compute=4),
    "bf16-mixed": Precision(param=2, grad=2, optimizer=12, activation=2, compute=4),
}


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    grad_accum_steps: int | None = None
    global_batch_size: int | None = None
    precision: str = "bf16-mixed"
    activation_checkpointing: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    flash_attention: bool = False
    layer_split: tuple[int, ...] | None = None
    bucket_size_mb: float = 0.0
    lr: float | None = None
    # Communication overlap (TrainConfig's names; plan/overlap.py prices them): gradient
    # buckets reduced while backward goes on, and ZeRO-3's next unit gathered while the
    # current one computes (its memory too: one more unit's parameters). False, False
    # prices the run that waits for every reduction and gather.
    overlap_grad_reduce: bool = True
    zero3_prefetch: bool = True
    cp: int = 1  # context parallelism: each sequence cut over cp ranks (ring attention)
    cp_load_balance: bool = True
    # ZeRO-Offload / ZeRO-Infinity (plan/offload.py): none | cpu | nvme
    offload_optimizer: str = "none"
    offload_param: str = "none"
    # expert parallelism (TrainConfig.ep; plan/experts.py): the experts split over ep
    # ranks inside the data-parallel group
    ep: int = 1

    def __post_init__(self) -> None:
        # TrainConfig's rules and messages (minipar.train.config), raised as PlanError
        check_parallel_settings(self, PlanError)
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise PlanError("ep", f"must be a positive integer, got {self.ep!r}")
        check_expert_parallel_settings(self.ep, self.dp, None, PlanError)  # (no model yet)
        accum, global_batch = resolve_batch(self.micro_batch_size, self.dp,
                                            self.grad_accum_steps, self.global_batch_size,
                                            PlanError)
        object.__setattr__(self, "grad_accum_steps", accum)
        object.__setattr__(self, "global_batch_size", global_batch)
        check_schedule_settings(self.schedule, self.pp, self.micro_batches,
                                self.virtual_stages, PlanError)
        # (the count against the layers of a chunk is checked with the model's shape)
        problem = recompute_problem(self.activation_checkpointing, self.recompute_granularity,
                                    self.recompute_method, self.recompute_num_layers,
                                    layers_per_chunk=self.recompute_num_layers or 1)
        if problem is not None:
            raise PlanError(*problem)

    # ------------------------------------------------------------------ views
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, over which gradients are averaged and ZeRO
        shards: dp x cp (parameters are replicated over context parallelism)."""
        return self.dp * self.cp

    @property
    def expert_data_parallel(self) -> int:
        """Ranks holding the same experts, over which expert gradients are reduced and
        expert ZeRO shards cut: dp / ep (Megatron's expert-data-parallel group)."""
        return self.replicas // self.ep

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step on each DP rank (= grad_accum_steps; the
        pipeline's m)."""
        return self.grad_accum_steps

    @property
    def bytes(self) -> Precision:
        return PRECISION_BYTES[self.precision]

    @property
    def recompute(self) -> Recompute:
        """The recomputation policy (minipar.nn.recompute) of the checkpointing settings."""
        return Recompute.from_settings(self.activation_checkpointing,
                                       self.recompute_granularity, self.recompute_method,
                                       self.recompute_num_layers)

    def with_recompute(self, recompute: Recompute) -> ParallelConfig:
        """A copy with another recomputation policy (e.g. Recompute("selective"))."""
        return self.replace(**recompute.to_flags())

    @property
    def recomputes(self) -> bool:
        """Any recomputation at all (selective or full)."""
        return self.recompute.granularity is not None

    def replace(self, **changes) -> ParallelConfig:
        """A copy with some settings changed; the batch is re-derived as in TrainConfig."""
        return ParallelConfig(**replace_settings(asdict(self), changes))

    def to_dict(self) -> dict:
        values = asdict(self)
        if values["layer_split"] is not None:
            values["layer_split"] = list(values["layer_split"])
        return values

    @classmethod
    def from_train_config(cls, config) -> ParallelConfig:
        """The parallel part of a minipar TrainConfig."""
        return cls(dp=config.dp, tp=config.tp, pp=config.pp, zero=config.zero,
                   schedule=config.schedule, virtual_stages=config.virtual_stages,
                   sequence_parallel=config.sequence_parallel,
                   micro_batch_size=config.micro_batch_size,
                   grad_accum_steps=config.grad_accum_steps, precision=config.precision,
                   activation_checkpointing=config.activation_checkpointing,
                   recompute_granularity=config.recompute_granularity,
                   recompute_method=config.recompute_method,
                   recompute_num_layers=config.recompute_num_layers,
                   bucket_size_mb=config.bucket_size_mb, lr=config.lr,
                   overlap_grad_reduce=config.overlap_grad_reduce,
                   zero3_prefetch=config.zero3_prefetch, cp=config.cp,
                   cp_load_balance=config.cp_load_balance,
                   offload_optimizer=config.offload_optimizer,
                   offload_param=config.offload_param, ep=config.ep)


def check_model_fits_layout(shape: ModelShape, config: ParallelConfig) -> None:
    """Raise PlanError if the model does not split the way `config` asks."""
    t = config.tp
    if shape.n_head % t:
        raise PlanError("tp", f"n_head={shape.n_head} is not divisible by tp={t}: every TP "
                        "rank must hold whole attention heads")
    if shape.kv_heads % t:
        raise PlanError("tp", f"n_kv_head={shape.kv_heads} is not divisible by tp={t}: every "
                        "TP rank must hold whole key/value heads (Megatron's rule)")
    if shape.ffn % t:
        raise PlanError("tp", f"the MLP width {shape.ffn} is not divisible by tp={t}")
    if config.sequence_parallel and shape.seq_len % t:
        raise PlanError("sequence_parallel", f"seq_len={shape.seq_len} is not divisible by "
                        f"tp={t}")
    if config.cp > 1:
        chunks = 2 * config.cp if config.cp_load_balance else config.cp
        if shape.seq_len % chunks:
            raise PlanError("cp", f"seq_len={shape.seq_len} does not split into {chunks} "
                            f"chunks ({'2 x ' if config.cp_load_balance else ''}cp)")
        if config.sequence_parallel and (shape.seq_len // config.cp) % t:
            raise PlanError("sequence_parallel", f"each CP rank's {shape.seq_len // config.cp}"
                            f" tokens are not divisible by tp={t}")
        if shape.dropout > 0:
            raise PlanError("cp", "attention dropout under context parallelism is not "
                            "modelled (minipar refuses it)")
        if config.recompute.selective:
            raise PlanError("recompute_granularity", SELECTIVE_WITH_CP)
    # TrainConfig's --ep rules and messages (minipar.train.config)
    check_expert_parallel_settings(config.ep, config.dp, shape.moe_num_experts, PlanError)
    if config.ep > 1:
        if config.offload_optimizer != "none" or config.offload_param != "none":
            raise PlanError("offload_optimizer", "offload with --ep is not modelled "
                            "(minipar train refuses it too)")
    if shape.is_moe and config.cp > 1:  # the trainer's refusal and words (not modelled)
        raise PlanError(*expert_layout_problem(config.cp, 0, 1, "none", "none"))
    if shape.is_moe and config.zero == 3:
        raise PlanError("zero", "ZeRO-3 of an MoE model is not modelled (its gather units "
                        "would hold experts of the expert-data-parallel group); use 0-2")
    stages = config.pp * config.virtual_stages
    if config.layer_split is not None:
        split = tuple(config.layer_split)
        if len(split) != stages or sum(split) != shape.n_layer or min(split) < 0:
            raise PlanError("layer_split", f"{split} must give {stages} non-negative layer "
                            f"counts (pp x virtual_stages) summing to n_layer={shape.n_layer}")
    elif stages > shape.n_layer:
        raise PlanError("pp", f"{stages} pipeline stages (pp x virtual_stages) but only "
                        f"{shape.n_layer} layers; use fewer stages")
    most = max(layer_counts(shape.n_layer, stages, config.layer_split))
    problem = recompute_problem(config.activation_checkpointing, config.recompute_granularity,
                                config.recompute_method, config.recompute_num_layers, most)
    if problem is not None:
        raise PlanError(*problem)


def layer_counts(n_layer: int, stages: int, layer_split=None) -> list[int]:
    """Layers of each virtual stage: `layer_split`, or balanced (the first
    n_layer % stages stages one more), as minipar.parallel.pipeline.executor.split_layers."""
    if layer_split is not None:
        return list(layer_split)
    base, extra = divmod(n_layer, stages)
    return [base + (s < extra) for s in range(stages)]


@dataclass(frozen=True)
class StagePlan:
    """What pipeline rank `rank` holds and runs.

    chunk_layers: layers of each of its v model chunks (virtual stage by the schedule's
    placement: c p + rank for interleaving);
    first: it runs the embedding (virtual stage 0); last: it runs the head (the last
    virtual stage); tied_copy: it holds its own copy of a tied embedding (the last stage
    when pp > 1: Megatron's embedding group); in_flight: chunk forwards whose backward has
    not run yet, at the peak (micro-batches of activations held).
    """

    rank: int
    chunk_layers: tuple[int, ...]
    first: bool
    last: bool
    tied_copy: bool
    in_flight: int
    chunk_moe_layers: tuple[int, ...] = ()  # MoE layers of each chunk (plan/experts.py)

    @property
    def layers(self) -> int:
        return sum(self.chunk_layers)

    @property
    def moe_layers(self) -> int:
        return sum(self.chunk_moe_layers)


def in_flight(schedule: str, pp: int, rank: int, micro_batches: int, virtual_stages: int) -> int:
    """Peak micro-batch chunks whose activations pipeline rank `rank` holds at once (the
    schedule's declared formula)."""
    return SCHEDULES[schedule].in_flight(pp, micro_batches, virtual_stages, rank)


def stage_plan(shape: ModelShape, config: ParallelConfig, rank: int) -> StagePlan:
    p, v = config.pp, config.virtual_stages
    spec = SCHEDULES[config.schedule]
    counts = layer_counts(shape.n_layer, p * v, config.layer_split)
    stages = [spec.virtual_stage(p, rank, c) for c in range(v)]
    first, last = 0 in stages, p * v - 1 in stages
    return StagePlan(
        chunk_moe_layers=tuple(chunk_moe_layers(shape, counts, stage) for stage in stages),
        rank=rank,
        chunk_layers=tuple(counts[stage] for stage in stages),
        first=first,
        last=last,
        # the head's rank keeps its own copy of a tied embedding (Megatron's embedding group)
        tied_copy=shape.tie_embeddings and last and not first,
        in_flight=in_flight(config.schedule, p, rank, config.micro_batches, v),
    )


def chunk_moe_layers(shape: ModelShape, counts: list[int], stage: int) -> int:
    """MoE layers of virtual stage `stage` (layers in order over the stages)."""
    start = sum(counts[:stage])
    return shape.moe_layers_in(start, start + counts[stage])


def representative_ranks(pp: int) -> list[int]:
    """Pipeline ranks whose estimates bound every rank's: the first (embedding, most
    micro-batches in flight), the second (the most of both among the inner ranks: the
    balanced split gives earlier stages the extra layers) and the last (the head)."""
    return sorted({0, min(1, pp - 1), pp - 1})


def stage_plans(shape: ModelShape, config: ParallelConfig, all_ranks: bool = False
                ) -> list[StagePlan]:
    """Plans of every pipeline rank, or (default) of the representative ranks, which bound
    the others when the split is the balanced one."""
    every = all_ranks or config.layer_split is not None
    ranks = range(config.pp) if every else representative_ranks(config.pp)
    return [stage_plan(shape, config, r) for r in ranks]
