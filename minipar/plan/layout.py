"""A parallel configuration, and what it gives each pipeline rank to hold and run.

`ParallelConfig` is the trainer's Layout (minipar/train/layout.py: the mesh, ZeRO and
offload, the schedule, the batch, precision, recomputation, the overlap settings; the same
fields, rules and messages, defined once) plus what planning a real cluster adds: a
FlashAttention kernel (Dao et al. 2022), an explicit pipeline `layer_split`, and the
learning rate that exported configs carry. The schedule's rules (its registry entry,
minipar.parallel.pipeline.schedules) are checked when it is built, since m is known.

`stage_plans` says, for each pipeline rank, which layers it holds (the same balanced
split as minipar.parallel.pipeline.stage.split_layers: n_layer // stages each, the first
n_layer % stages one more), whether it holds the embedding, the head or a tied copy of
the embedding, and how many micro-batches it keeps activations for at once: the
schedule's own `in_flight` formula (ScheduleSpec in minipar.parallel.pipeline.schedules, e.g. m for
GPipe, min(p - r, m) for 1F1B), which the tests check against its action lists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from minipar.errors import ConfigError
from minipar.nn.recompute import Recompute, recompute_problem
from minipar.parallel.context.layout import SELECTIVE_WITH_CP
from minipar.parallel.expert.dispatch import expert_layout_problem
from minipar.parallel.pipeline.schedules.registry import SCHEDULES, check_schedule_settings
from minipar.parallel.zero.sharded import MAX_IN_FLIGHT
from minipar.plan.accounting import check_accounting
from minipar.plan.placement import busiest_pipeline_rank
from minipar.plan.shapes import ModelShape
from minipar.train.config import check_experts_split
from minipar.train.layout import Layout, check_booleans, switches


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


DTYPE_BYTES = {"bf16": 2, "fp32": 4, "fp64": 8}
# How world ranks are laid on the mesh, as Megatron-LM's `initialize_model_parallel(order=)`
# names it (megatron/core/parallel_state.py; fastest first): minipar's own mesh keeps dp
# slowest (minipar.distributed.mesh), Megatron-LM's --use-tp-pp-dp-mapping; Megatron-LM's
# default keeps pp slowest (megatron/training/initialize.py), as DeepSpeed's
# PipeModelDataParallelTopology does. They differ in which of dp and pp crosses nodes.
MINIPAR_ORDER, MEGATRON_ORDER = "tp-cp-ep-pp-dp", "tp-cp-ep-dp-pp"
RANK_ORDERS = (MINIPAR_ORDER, MEGATRON_ORDER)
# Megatron-LM's --fp8-format choices (TransformerConfig.fp8 in
# megatron/core/transformer/transformer_config.py)
FP8_FORMATS = ("e4m3", "hybrid")
PRECISION_BYTES = {
    "fp64": Precision(param=8, grad=8, optimizer=16, activation=8, compute=8),
    "fp32": Precision(param=4, grad=4, optimizer=8, activation=4, compute=4),
    "bf16-mixed": Precision(param=2, grad=2, optimizer=12, activation=2, compute=4),
}


@dataclass(frozen=True)
class ParallelConfig(Layout):
    """A Layout as the planner sees it. Its defaults are a production run's rather than
    the emulator's toy: one sequence per micro-batch, bf16 mixed precision with fp32
    gradient accumulation (Megatron-LM's main_grad, its default for --bf16, and
    DeepSpeed's bf16 optimizer: what a real job allocates; the emulator's default is the
    ZeRO paper's bf16 gradients), one gradient bucket (the fields themselves are
    Layout's). The schedule's rules are checked here, when it is built (the trainer's
    check_layout checks them, with the rules that need the model)."""

    micro_batch_size: int = 1
    precision: str = "bf16-mixed"
    bucket_size_mb: float = 0.0
    flash_attention: bool = False
    layer_split: tuple[int, ...] | None = None
    lr: float | None = None
    # whose bytes the memory estimate counts: minipar's (the papers'), Megatron-LM's or
    # DeepSpeed's (plan/accounting.py)
    memory_accounting: str = "paper"
    # what a real framework overlaps that minipar's emulator runs in turn (timing.py):
    # Megatron-LM's --tp-comm-overlap (Transformer Engine's userbuffers: the sequence-
    # parallel all-gathers and reduce-scatters pipelined with the GEMMs beside them) and
    # --overlap-param-gather (the distributed optimizer's parameter all-gather under the
    # next step's forward)
    tp_comm_overlap: bool = False
    overlap_param_gather: bool = False
    # the loss as one fused kernel (minipar's op; Megatron-LM's --cross-entropy-loss-fusion)
    # or Megatron-LM's default, op by op in fp32 (plan/kernels.cross_entropy_bytes)
    cross_entropy_loss_fusion: bool = True
    # Megatron-LM's --fp8-format: the layers' linear GEMMs in FP8 by Transformer Engine
    # (e4m3 everywhere, or hybrid: e4m3 forward, e5m2 gradients); None: bf16 (plan/fp8.py)
    fp8_format: str | None = None
    # Megatron-LM's --fp8-param-gather: the layers' GEMM weights kept as FP8 parameters
    # (TE's fp8_model_init), cast from the optimizer's fp32 shard once a step
    fp8_param_gather: bool = False
    # the mesh's rank order (RANK_ORDERS): minipar's, or Megatron-LM's default
    rank_order: str = MINIPAR_ORDER
    # ZeRO-1/2's gradient reductions in flight at once under overlap_grad_reduce: a rank
    # starting one more first waits for the oldest, stalling its backward. 2: DeepSpeed's
    # two IPG buffers under overlap_comm (deepspeed/runtime/zero/stage_1_and_2.py), as
    # minipar's emulator (parallel.zero.sharded.MAX_IN_FLIGHT); None: no limit, Megatron-
    # LM's distributed optimizer (megatron/core/distributed/param_and_grad_buffer.py
    # launches each bucket's reduce-scatter as it is ready). ZeRO-0 (DDP) has none and
    # ZeRO-3 its own (plan/overlap.py)
    reductions_in_flight: int | None = MAX_IN_FLIGHT

    def __post_init__(self) -> None:
        if isinstance(self.layer_split, list):
            # a list from Python or JSON: hashable like every other field, so equal
            # layouts share the planner's caches
            object.__setattr__(self, "layer_split", tuple(self.layer_split))
        self.validate_layout()
        check_booleans(self, switches(ParallelConfig))
        check_accounting(self.memory_accounting, self.zero)
        check_reductions_in_flight(self.reductions_in_flight)
        if self.rank_order not in RANK_ORDERS:
            raise ConfigError("rank_order", f"{self.rank_order!r} is not one of "
                              f"{', '.join(RANK_ORDERS)} (Megatron-LM's orders: its "
                              "--use-tp-pp-dp-mapping, minipar's mesh, or its default)")
        if self.tp_comm_overlap and self.tp > 1 and not self.sequence_parallel:
            raise ConfigError("tp_comm_overlap", "Megatron-LM overlaps tensor-parallel "
                              "communication with GEMMs only under sequence parallelism "
                              "(its all-gathers and reduce-scatters): add "
                              "--sequence-parallel")
        if self.fp8_format is not None:
            if self.fp8_format not in FP8_FORMATS:
                raise ConfigError("fp8_format", f"{self.fp8_format!r} is not one of "
                                  f"{', '.join(FP8_FORMATS)} (Megatron-LM's --fp8-format)")
            if self.precision != "bf16-mixed":
                raise ConfigError("fp8_format", "Transformer Engine runs FP8 GEMMs inside bf16 "
                                  "mixed precision (Megatron-LM: --bf16 --fp8-format): use "
                                  f"--precision bf16-mixed, not {self.precision}")
        if self.fp8_param_gather and self.fp8_format is None:
            raise ConfigError("fp8_param_gather", "keeps FP8 parameters, for FP8 training: "
                              "add --fp8-format, or drop it")
        if self.fp8_param_gather and self.zero != 1:
            raise ConfigError("fp8_param_gather", "Megatron-LM gathers FP8 parameters with "
                              "its distributed optimizer (ZeRO-1; megatron/training/"
                              f"arguments.py): use --zero 1, not {self.zero}")
        if self.overlap_param_gather and self.zero != 1:
            raise ConfigError("overlap_param_gather", "overlaps Megatron-LM's distributed "
                              f"optimizer's parameter all-gather (ZeRO-1), not ZeRO-"
                              f"{self.zero}'s: use --zero 1, or drop it")
        check_schedule_settings(self.schedule, self.pp, self.micro_batches,
                                self.virtual_stages, ConfigError)

    # ------------------------------------------------------------------ views
    @property
    def grad_dtype(self) -> str:
        """The gradient buffers' dtype: grad_accum_dtype, or under bf16-mixed fp32 (what
        Megatron-LM and DeepSpeed allocate by default), else the parameters'."""
        if self.grad_accum_dtype is None and self.precision == "bf16-mixed":
            return "fp32"
        return super().grad_dtype

    @property
    def bytes(self) -> Precision:
        """Bytes per element of each kind of state; gradients in the buffers' dtype."""
        return replace(PRECISION_BYTES[self.precision], grad=DTYPE_BYTES[self.grad_dtype])

    def with_recompute(self, recompute: Recompute) -> ParallelConfig:
        """A copy with another recomputation policy (e.g. Recompute("selective"))."""
        return self.replace(recompute_granularity=recompute.granularity,
                            recompute_method=recompute.method,
                            recompute_num_layers=recompute.num_layers)

    @property
    def recomputes(self) -> bool:
        """Any recomputation at all (selective or full)."""
        return self.recompute.granularity is not None

    @property
    def schedule_label(self) -> str:
        """The pipeline schedule as a plan names it: "1f1b", "interleaved v=2"."""
        return self.schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1
                                else "")

    def rank_at(self, dp: int, pp: int, cp: int = 0, tp: int = 0) -> int:
        """The world rank at mesh coordinates (dp, pp, cp, tp) under `rank_order` (tp
        fastest, then cp; minipar.distributed.mesh.DeviceMesh.rank_at is minipar's)."""
        if self.rank_order == MINIPAR_ORDER:
            outer = dp * self.pp + pp
        else:
            outer = pp * self.dp + dp
        return (outer * self.cp + cp) * self.tp + tp

    @property
    def strides(self) -> dict[str, int]:
        """How many world ranks apart the members of a dp and of a pp group sit."""
        block = self.tp * self.cp
        if self.rank_order == MINIPAR_ORDER:
            return {"dp": block * self.pp, "pp": block}
        return {"dp": block, "pp": block * self.dp}

    @property
    def rank_order_label(self) -> str:
        """", ranks <order>" for a plan's layout line, unless the order is minipar's."""
        return "" if self.rank_order == MINIPAR_ORDER else f", ranks {self.rank_order}"

    def reductions_limit_moot(self, moe: bool = False) -> str | None:
        """Why reductions_in_flight cannot change this layout's step, in a refusal's words,
        or None where it can (an MoE model's, `moe`, are priced as they block)."""
        return next((why for moot, why in (
            (self.zero not in (1, 2), f"ZeRO-{self.zero}'s are DDP's (no limit) or ZeRO-3's own"),
            (not self.overlap_grad_reduce, "this layout reduces them after backward "
                                           "(--no-overlap-grad-reduce)"),
            (self.replicas == 1, "dp x cp = 1 has no data-parallel reduction"),
            (self.bucket_size_mb == 0, "one gradient bucket (--bucket-size-mb 0, the "
                                       "default) is reduced alone, after backward"),
            (moe, "an MoE model's reductions are priced as they block")) if moot), None)

    @property
    def reductions_in_flight_label(self) -> str:
        """", <limit>" for a plan's overlap line where ZeRO-1/2 reduces during backward:
        whose limit of reductions in flight the step assumes."""
        if self.reductions_limit_moot():
            return ""
        if self.reductions_in_flight is None:
            return ", no limit of reductions in flight (Megatron-LM's distributed optimizer)"
        if self.reductions_in_flight != MAX_IN_FLIGHT:
            return f", at most {self.reductions_in_flight} reductions in flight"
        # DeepSpeed's pipeline engine reduces after the flush, whatever overlap_comm says
        whose = ("DeepSpeed's overlap_comm" if self.pp == 1 else
                 "minipar's emulator; DeepSpeed's pipeline engine reduces after the flush")
        return f", at most {MAX_IN_FLIGHT} reductions in flight ({whose})"

    def to_dict(self) -> dict:
        values = super().to_dict()
        if values["layer_split"] is not None:
            values["layer_split"] = list(values["layer_split"])
        return values

    @classmethod
    def from_train_config(cls, config) -> ParallelConfig:
        """The layout of a minipar TrainConfig (and its learning rate, for exports)."""
        layout = {f.name: getattr(config, f.name) for f in dataclasses.fields(Layout)}
        if config.precision == "bf16-mixed":  # the trainer's buffers, named (not ours)
            layout["grad_accum_dtype"] = config.grad_dtype
        return cls(**layout, lr=config.lr)


def check_reductions_in_flight(limit) -> None:
    """Raise ConfigError unless `limit` is a positive number of reductions or None."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or limit < 1):
        raise ConfigError("reductions_in_flight", f"must be a positive integer (2: "
                          f"DeepSpeed's) or unlimited (Megatron-LM's), got {limit!r}")


def check_model_fits_layout(shape: ModelShape, config: ParallelConfig) -> None:
    """Raise ConfigError if the model does not split the way `config` asks."""
    t = config.tp
    if shape.n_head % t:
        raise ConfigError("tp", f"n_head={shape.n_head} is not divisible by tp={t}: every TP "
                        "rank must hold whole attention heads")
    if shape.kv_heads % t:
        raise ConfigError("tp", f"n_kv_head={shape.kv_heads} is not divisible by tp={t}: every "
                        "TP rank must hold whole key/value heads (Megatron's rule)")
    if shape.ffn % t:
        raise ConfigError("tp", f"the MLP width {shape.ffn} is not divisible by tp={t}")
    if config.sequence_parallel and shape.seq_len % t:
        raise ConfigError("sequence_parallel", f"seq_len={shape.seq_len} is not divisible by "
                        f"tp={t}")
    if config.cp > 1:
        chunks = 2 * config.cp if config.cp_load_balance else config.cp
        if shape.seq_len % chunks:
            raise ConfigError("cp", f"seq_len={shape.seq_len} does not split into {chunks} "
                            f"chunks ({'2 x ' if config.cp_load_balance else ''}cp)")
        if config.sequence_parallel and (shape.seq_len // config.cp) % t:
            raise ConfigError("sequence_parallel", f"each CP rank's {shape.seq_len // config.cp}"
                            f" tokens are not divisible by tp={t}")
        if shape.dropout > 0:
            raise ConfigError("cp", "attention dropout under context parallelism is not "
                            "modelled (minipar refuses it)")
        if config.recompute.selective:
            raise ConfigError("recompute_granularity", SELECTIVE_WITH_CP)
    check_experts_split(config.ep, shape.moe_num_experts)  # TrainConfig's rule and words
    if config.ep > 1:
        if config.offload_optimizer != "none" or config.offload_param != "none":
            raise ConfigError("offload_optimizer", "offload with --ep is not modelled "
                            "(minipar train refuses it too)")
    if shape.is_moe and config.cp > 1:  # the trainer's refusal and words (not modelled)
        raise ConfigError(*expert_layout_problem(config.cp, 0, 1, "none", "none"))
    if shape.is_moe and config.zero == 3:
        raise ConfigError("zero", "ZeRO-3 of an MoE model is not modelled (its gather units "
                        "would hold experts of the expert-data-parallel group); use 0-2")
    stages = config.pp * config.virtual_stages
    if config.layer_split is not None:
        split = tuple(config.layer_split)
        if len(split) != stages or sum(split) != shape.n_layer or min(split) < 0:
            raise ConfigError("layer_split", f"{split} must give {stages} non-negative layer "
                            f"counts (pp x virtual_stages) summing to n_layer={shape.n_layer}")
    elif stages > shape.n_layer:
        raise ConfigError("pp", f"{stages} pipeline stages (pp x virtual_stages) but only "
                        f"{shape.n_layer} layers; use fewer stages")
    most = max(layer_counts(shape.n_layer, stages, config.layer_split))
    problem = recompute_problem(False, config.recompute_granularity,
                                config.recompute_method, config.recompute_num_layers, most)
    if problem is not None:
        raise ConfigError(*problem)


def layer_counts(n_layer: int, stages: int, layer_split=None) -> list[int]:
    """Layers of each virtual stage: `layer_split`, or balanced (the first
    n_layer % stages stages one more), as minipar.parallel.pipeline.stage.split_layers."""
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
    # the model's index of each chunk's first layer (where its MoE layers sit:
    # experts.chunk_moe_layers)
    chunk_starts: tuple[int, ...] = ()

    @property
    def layers(self) -> int:
        return sum(self.chunk_layers)


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
        chunk_starts=tuple(sum(counts[:stage]) for stage in stages),
        rank=rank,
        chunk_layers=tuple(counts[stage] for stage in stages),
        first=first,
        last=last,
        # the head's rank keeps its own copy of a tied embedding (Megatron's embedding group)
        tied_copy=shape.tie_embeddings and last and not first,
        in_flight=in_flight(config.schedule, p, rank, config.micro_batches, v),
    )


def checkpointed_layers(config: ParallelConfig, stage: StagePlan) -> int:
    """Layers of `stage` that full recomputation checkpoints whole."""
    if not config.recompute.full:
        return 0
    return sum(config.recompute.recomputed_layers(n) for n in stage.chunk_layers)


def checkpointed_by_chunk(config: ParallelConfig, stage: StagePlan
                          ) -> tuple[tuple[bool, ...], ...]:
    """Per chunk of `stage`, per layer: whether full recomputation checkpoints it."""
    return tuple(tuple(checkpointed for start, end, checkpointed in config.recompute.segments(n)
                       for _ in range(start, end)) for n in stage.chunk_layers)


def representative_ranks(pp: int) -> list[int]:
    """Pipeline ranks whose estimates bound every rank's: the first (embedding, most
    micro-batches in flight), the second (the most of both among the inner ranks: the
    balanced split gives earlier stages the extra layers) and the last (the head)."""
    return sorted({0, min(1, pp - 1), pp - 1})


def stage_plans(shape: ModelShape, config: ParallelConfig, all_ranks: bool = False,
                gpus_per_node: int | None = None) -> list[StagePlan]:
    """Plans of every pipeline rank, or (default) of the representative ranks, which bound
    the others when the split is the balanced one, and, on nodes of gpus_per_node, the
    rank whose pipeline messages cross nodes most, which need not be one of them (pp 8
    on 4-GPU nodes: ranks 3 and 4)."""
    every = all_ranks or config.layer_split is not None
    ranks = set(range(config.pp) if every else representative_ranks(config.pp))
    if gpus_per_node is not None and config.pp > 1:
        ranks.add(busiest_pipeline_rank(config, gpus_per_node))
    return [stage_plan(shape, config, r) for r in sorted(ranks)]
