"""Layout: how one training run is cut over GPUs, defined once for the trainer and the planner.

A layout is the mesh (dp x pp x cp x tp, with ep inside dp), what each data-parallel rank
keeps (the ZeRO stage, offload), how a step is cut into micro-batches and run through the
pipeline (the schedule), and the numerics and memory settings every one of those costs
depends on (precision, recomputation, gradient buckets). The batch arithmetic every
interview asks about lives here:

    global_batch_size = micro_batch_size x grad_accum_steps x dp

Give either `grad_accum_steps` or `global_batch_size` (or both, consistently); the other
is derived. A global batch that does not split is an error that names the fix.

Two configs build on this one definition, as Megatron-LM's `TransformerConfig` builds on
`ModelParallelConfig` (megatron/core/transformer/transformer_config.py, a dataclass that
inherits the parallel fields): minipar.train.config.TrainConfig (the model, the layout,
the optimizer and the run) and minipar.plan.layout.ParallelConfig (the layout and what a
real cluster adds). A field added here is a flag of `minipar train` and a setting of the
planner at once. Long because every layout setting's field, help line and rule live here
and nowhere else.

The rules below need nothing but the layout and run when it is built. The rules that need
the model (heads that split over tp, layers enough for the stages, a sequence that cuts
into 2cp chunks) need the data's vocabulary too: they are minipar.train.mixes.check_layout
for the trainer and minipar.plan.layout.check_model_fits_layout for the planner.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from minipar.errors import ConfigError, flag
from minipar.nn.recompute import Recompute, recompute_problem
from minipar.parallel.pipeline.schedules.registry import check_schedule_name
from minipar.parallel.zero.offload import DEVICES as OFFLOAD_DEVICES  # DeepSpeed's offload devices

PRECISIONS = ("fp64", "fp32", "bf16-mixed")
GRAD_ACCUM_DTYPES = ("bf16", "fp32")
# Micro-batches per optimizer step: the trainer runs each one and the planner simulates
# each one of the schedule; --grad-accum-steps 10**12 hung the planner and asked the
# trainer for 29 TiB of token ids. Published runs use hundreds to a few thousand.
MAX_MICRO_BATCHES = 65536
# No setting is an integer beyond int64 (the seed's own maximum; the others are far lower).
MAX_INTEGER = 2**63 - 1


def setting(default, help: str, parse=None, metavar: str | None = None):
    """A field of a settings dataclass: its default and the one line of its CLI flag
    (parse, metavar: how the flag reads its text and names it, when the field's type
    alone cannot say)."""
    metadata = {"help": help} if parse is None else {"help": help, "parse": parse,
                                                     "metavar": metavar}
    return dataclasses.field(default=default, metadata=metadata)


def bool_or_int(text: str) -> bool | int:
    """true, false or a positive integer K (FSDP2's reshard_after_forward), as a flag
    gives it (argparse prints the error after the flag's name)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be true, false or a number of ranks K, got {text!r}") from None


@dataclass(frozen=True)
class Layout:
    """How a run is cut over GPUs (the module docstring). Checked when built; the batch
    is derived then: grad_accum_steps and global_batch_size are both set after it."""

    # the device mesh dp x pp x cp x tp (minipar.distributed.DeviceMesh)
    dp: int = setting(1, "data-parallel size")
    tp: int = setting(1, "tensor-parallel size")
    pp: int = setting(1, "pipeline-parallel size")
    # context parallelism: every sequence cut over cp ranks, ring attention
    cp: int = setting(1, "context-parallel size: each sequence cut over this many ranks "
                         "(ring attention)")
    cp_load_balance: bool = setting(True, "cut the sequence into 2 x cp chunks, rank r keeping "
                                          "r and 2cp-1-r, so causal attention gives every "
                                          "rank the same work")
    # expert parallelism: the experts split over ep ranks inside the data-parallel group
    ep: int = setting(1, "expert-parallel size (splits the experts inside the data-parallel "
                         "group)")
    # what each data-parallel rank keeps: ZeRO stage 0-3 over the DP group; ZeRO-Offload /
    # ZeRO-Infinity (minipar/parallel/zero/offload.py): where the optimizer state (ZeRO >= 1)
    # and the parameter shard (ZeRO-3) live: none (GPU), cpu, nvme
    zero: int = setting(0, "ZeRO stage over the data-parallel group (0-3)")
    offload_optimizer: str = setting("none", "ZeRO-Offload: optimizer state and Adam on the "
                                             "host (--zero >= 1)")
    offload_param: str = setting("none", "ZeRO-Infinity: the parameter shard in host memory / "
                                         "NVMe (--zero 3)")
    # the pipeline: its schedule (minipar.parallel.pipeline.schedules) and model chunks
    # per rank; tensor parallelism's sequence-parallel regions
    schedule: str = setting("1f1b", "pipeline schedule")
    virtual_stages: int = setting(1, "model chunks per pipeline rank (interleaved schedule)")
    sequence_parallel: bool = setting(False, "shard LayerNorm/dropout regions along the "
                                             "sequence (with --tp)")
    # data parallelism: gradient bucket capacity (DDP's bucket_cap_mb); buckets reduced
    # asynchronously while backward goes on, and under pipeline parallelism during each
    # stage's last micro-batch backward (DeepSpeed's overlap_comm, Megatron's
    # --overlap-grad-reduce; without it each reduction is waited for as it starts: same
    # bytes and numbers); ZeRO-3's prefetch (FSDP's forward/backward prefetch, DeepSpeed's
    # stage3_prefetch_bucket_size)
    bucket_size_mb: float = setting(0.25, "gradient bucket size in MiB (0 = one bucket, "
                                          "reduced after backward)")
    overlap_grad_reduce: bool = setting(True, "reduce gradient buckets while backward goes on "
                                              "(under --pp: during each stage's last "
                                              "micro-batch backward)")
    zero3_prefetch: bool = setting(True, "ZeRO-3: all-gather the next module's parameters "
                                         "while the current one computes")
    # sharding across nodes (docs/data-parallel-and-zero.md), each with --zero 3: hybrid
    # sharding (FSDP2's HSDP, DeepSpeed's MiCS: zero/hybrid.py); ZeRO++'s hpZ, qwZ, qgZ
    # (DeepSpeed's zero_hpz_partition_size, zero_quantized_weights and _gradients:
    # zero/reshard.py, zero/quantized.py); FSDP2's reshard_after_forward (zero/reshard.py)
    hsdp_shard_size: int | None = setting(
        None, "HSDP / MiCS (--zero 3): shard within groups of K data-parallel ranks (a "
              "node's), replicate across them, all-reducing the gradient shards once per "
              "step")
    zero_hpz_partition_size: int = setting(
        1, "ZeRO++ hpZ (--zero 3): after forward keep a secondary copy of the parameters "
           "sharded over K ranks (a node's), so backward all-gathers there (1 = off)")
    zero_quantized_weights: bool = setting(
        False, "ZeRO++ qwZ (--zero 3): the parameter all-gathers carry int8 blocks")
    zero_quantized_gradients: bool = setting(
        False, "ZeRO++ qgZ (--zero 3): the gradient reduce-scatter is an int4 all-to-all "
               "inside each node, then across nodes")
    reshard_after_forward: bool | int = setting(
        True, "FSDP2 (--zero 3): true frees a module's parameters after its forward, false "
              "keeps them for its backward, K keeps a 1/K piece (backward gathers over K "
              "ranks)", parse=bool_or_int, metavar="true|false|K")
    # the batch: global_batch_size = micro_batch_size x grad_accum_steps x dp
    micro_batch_size: int = setting(4, "sequences per micro-batch on one data-parallel rank")
    grad_accum_steps: int | None = setting(None, "micro-batches per optimizer step (or give "
                                                 "--global-batch-size)")
    global_batch_size: int | None = setting(None, "sequences per optimizer step = micro x "
                                                  "accum x dp")
    # numerics and memory: the dtype policy; recomputation (Megatron-LM's flags,
    # minipar.nn.recompute)
    precision: str = setting("fp32", "numerics: fp64 (exact checks), fp32, bf16-mixed")
    # the dtype gradients are accumulated and reduced in: with bf16-mixed, the ZeRO
    # paper's 2 bytes (bf16, the parameters' dtype) or Megatron-LM's fp32 main_grad
    # buffers (--accumulate-allreduce-grads-in-fp32, its default for --bf16), into which
    # each micro-batch's bf16 gradient is summed; None: the parameters' dtype
    grad_accum_dtype: str | None = setting(
        None, "dtype gradients are accumulated and reduced in under bf16-mixed: bf16 (the "
              "ZeRO paper's 2 bytes per parameter) or fp32 (Megatron-LM's main_grad, "
              "4 bytes); default: the parameters' dtype")
    recompute_granularity: str | None = setting(
        None, "recompute in backward: selective (the attention core only) or full (whole "
              "blocks, every one without --recompute-method; Megatron-LM's flag)")
    recompute_method: str | None = setting(
        None, "with full: uniform (groups of --recompute-num-layers blocks) or block (only "
              "the first N blocks of each pipeline chunk)")
    recompute_num_layers: int | None = setting(
        None, "blocks per group (uniform) or blocks recomputed per chunk (block)")

    def __post_init__(self) -> None:
        self.validate_layout()

    def validate_layout(self, n_layer: int | None = None) -> None:
        """The layout's rules, each once (the sizes, the switches, the ZeRO stage and its
        offload, the precision, the schedule's name, the buckets, --ep inside --dp, the
        batch, the recomputation flags); the batch is derived. n_layer: the model's
        layers, when it is known (a TrainConfig), which bound --recompute-num-layers by a
        chunk's. NumPy values are taken as the Python values they hold (plain_scalars)."""
        plain_scalars(self)
        check_positive_integers(self, ("dp", "tp", "pp", "cp", "ep", "virtual_stages",
                                       "micro_batch_size"))
        check_booleans(self, switches(Layout))
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError("zero", f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero!r}")
        choice("precision", self.precision, PRECISIONS)
        check_grad_accum_dtype(self.grad_accum_dtype, self.precision)
        check_schedule_name(self.schedule, ConfigError)
        bucket = self.bucket_size_mb
        if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or \
                not math.isfinite(bucket) or bucket < 0:  # NaN compares False with every bound
            raise ConfigError("bucket_size_mb", "must be a finite number >= 0 (0 = one "
                              f"bucket), got {bucket!r}")
        check_offload_settings(self.offload_optimizer, self.offload_param, self.zero)
        check_sharding_across_nodes(self)
        if self.dp % self.ep:
            raise ConfigError("ep", f"--ep {self.ep} must divide --dp {self.dp}: the experts "
                              "are split inside the data-parallel group")
        accum, global_batch = resolve_batch(self.micro_batch_size, self.dp,
                                            self.grad_accum_steps, self.global_batch_size)
        object.__setattr__(self, "grad_accum_steps", accum)  # derived, once, at construction
        object.__setattr__(self, "global_batch_size", global_batch)
        # a chunk's layers (pp x virtual_stages chunks) bound the count; no model, no bound
        chunks = self.pp * self.virtual_stages
        layers_per_chunk = (self.recompute_num_layers or 1) if n_layer is None else \
            -(-n_layer // chunks)
        problem = recompute_problem(False, self.recompute_granularity, self.recompute_method,
                                    self.recompute_num_layers, layers_per_chunk)
        if problem is not None:
            raise ConfigError(*problem)

    # ------------------------------------------------------------------ views
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, over which gradients are averaged and ZeRO
        shards: dp x cp (parameters are replicated over context parallelism)."""
        return self.dp * self.cp

    def sharding_across_nodes(self) -> list[str]:
        """The settings of ZeRO-3 across nodes this layout turns on (HSDP, ZeRO++,
        FSDP2's reshard_after_forward), in the order of the fields."""
        return [name for name, on in (
            ("hsdp_shard_size", self.hsdp_shard_size is not None),
            ("zero_hpz_partition_size", self.zero_hpz_partition_size > 1),
            ("zero_quantized_weights", self.zero_quantized_weights),
            ("zero_quantized_gradients", self.zero_quantized_gradients),
            ("reshard_after_forward", self.reshard_after_forward is not True)) if on]

    @property
    def sharding_group(self) -> int:
        """Ranks ZeRO-3 shards over: HSDP's shard group, or all the replicas."""
        return self.hsdp_shard_size or self.replicas

    @property
    def secondary_partition(self) -> int | None:
        """Ranks of the secondary partition a unit keeps after its forward (ZeRO++ hpZ,
        FSDP2's reshard_after_forward=K), or None."""
        if self.zero_hpz_partition_size > 1:
            return self.zero_hpz_partition_size
        reshard = self.reshard_after_forward
        return None if isinstance(reshard, bool) else reshard

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
    def grad_dtype(self) -> str:
        """The dtype gradients are accumulated and reduced in: grad_accum_dtype, or the
        parameters' (bf16 under bf16-mixed)."""
        if self.grad_accum_dtype is not None:
            return self.grad_accum_dtype
        return "bf16" if self.precision == "bf16-mixed" else self.precision

    @property
    def recompute(self) -> Recompute:
        """The recomputation policy (minipar.nn.recompute) of the recompute_* settings."""
        return Recompute.from_settings(granularity=self.recompute_granularity,
                                       method=self.recompute_method,
                                       num_layers=self.recompute_num_layers)

    # ------------------------------------------------------------------ copies
    def to_dict(self) -> dict:
        """Every setting, flat (a TrainConfig's is the report's `config`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_saved(cls, values: dict):
        """The settings of a config saved in a checkpoint, a report or a trace, written by
        this minipar or an earlier one (saved_settings)."""
        return cls.from_dict(saved_settings(values))

    @classmethod
    def from_dict(cls, values: dict):
        """The settings of a dict (today's names only: a saved file's go through
        from_saved), e.g. `replace`'s."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown setting; valid settings: {sorted(known)}")
        return cls(**values)

    def replace(self, **changes):
        """A copy with some settings changed; the batch is re-derived unless given:
        changing dp, the micro-batch size or the accumulation recomputes the global batch,
        and a new global batch recomputes the accumulation."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if "global_batch_size" not in changes and {"dp", "micro_batch_size",
                                                   "grad_accum_steps"} & set(changes):
            values["global_batch_size"] = None
        if "grad_accum_steps" not in changes and "global_batch_size" in changes:
            values["grad_accum_steps"] = None
        return type(self).from_dict({**values, **changes})


# ------------------------------------------------------------------ saved configs
def saved_settings(values: dict) -> dict:
    """A saved config's settings in today's terms. Configs saved before the setting
    `activation_checkpointing` was removed carry it: true is `recompute_granularity`
    "full" without a method (every block recomputed, what it meant), false is the
    default, so it is dropped. Its old rule refused it with a granularity, and so does
    this one. Nothing is rewritten on disk: the file keeps what it says."""
    if "activation_checkpointing" not in values:
        return values
    values = dict(values)
    old = values.pop("activation_checkpointing")
    if old is False:
        return values
    if old is not True:
        raise ConfigError("activation_checkpointing", f"(a saved config's) must be true or "
                          f"false, got {old!r}")
    if values.get("recompute_granularity") is not None:
        raise ConfigError("activation_checkpointing", "true (a saved config's) with "
                          f"recompute_granularity={values['recompute_granularity']!r}: "
                          "the two were never allowed together")
    values["recompute_granularity"] = "full"
    return values


# ------------------------------------------------------------------ the rules
def check_sharding_across_nodes(layout: Layout) -> None:
    """HSDP, ZeRO++ and FSDP2's reshard_after_forward: ZeRO-3's, each a divisor of the
    group it cuts (FSDP2's and DeepSpeed's rules); no ZeRO++ quantization where the TP
    replicas would drift. The mixes the trainer does not build are
    minipar.train.mixes.check_layout's."""
    hsdp, hpz = layout.hsdp_shard_size, layout.zero_hpz_partition_size
    reshard = layout.reshard_after_forward
    if hsdp is not None:
        check_positive_integers(layout, ("hsdp_shard_size",))
    check_positive_integers(layout, ("zero_hpz_partition_size",))
    if not isinstance(reshard, (bool, int)) or (not isinstance(reshard, bool) and reshard < 1):
        raise ConfigError("reshard_after_forward", f"must be true, false or a positive number "
                          f"of ranks K, got {reshard!r}")
    asked = layout.sharding_across_nodes()
    if asked and layout.zero != 3:
        raise ConfigError(asked[0], f"{flag(asked[0])} shards ZeRO-3's parameters or changes "
                          f"its collectives: it needs --zero 3 (got --zero {layout.zero})")
    replicas = layout.replicas
    if hsdp is not None and replicas % hsdp:
        raise ConfigError("hsdp_shard_size", f"{hsdp} must divide the {replicas} "
                          f"data-parallel ranks (dp x cp): one of {divisors(replicas)}")
    # ZeRO++ quantizes a rank's flat shard in blocks (DeepSpeed's partition_parameters.py
    # quantizes the torch.cat of a coalesced group's partitions), so a block mixes
    # TP-replicated parameters with TP-sharded ones and the TP ranks round the same
    # replicated value differently. qgZ: their reduced gradients differ; qwZ: their
    # forwards do, and so their gradients, unless sequence parallelism all-reduces
    # those over TP. Either way the replicas drift apart.
    drifting = [n for n in asked if n == "zero_quantized_gradients"
                or (n == "zero_quantized_weights" and not layout.sequence_parallel)]
    if layout.tp > 1 and drifting:
        fix = ("--tp 1, or --sequence-parallel, whose TP all-reduce of those gradients "
               "keeps them equal" if drifting == ["zero_quantized_weights"] else "--tp 1")
        raise ConfigError(drifting[0], f"{flag(drifting[0])} with --tp {layout.tp} would let "
                          "the TP ranks' copies of replicated parameters (norms, row-parallel "
                          "biases, position embeddings) drift apart: ZeRO++ quantizes each "
                          "rank's shard in blocks that mix them with TP-sharded weights, so "
                          f"each TP rank rounds them differently; use {fix}")
    sharding = hsdp or replicas  # the group ZeRO-3 shards over
    if hpz > 1:
        if reshard is not True and reshard != hpz:
            raise ConfigError("reshard_after_forward", f"--zero-hpz-partition-size {hpz} is "
                              f"ZeRO++'s reshard_after_forward={hpz} (DeepSpeed's name for "
                              f"FSDP2's idea), not {str(reshard).lower()}: give one of the two")
        _secondary_size("zero_hpz_partition_size", hpz, sharding)
    if not isinstance(reshard, bool):
        if reshard == 1:
            raise ConfigError("reshard_after_forward", "1 means false (FSDP2 warns and keeps "
                              "the full parameters): write --reshard-after-forward false")
        if reshard == sharding:
            raise ConfigError("reshard_after_forward", f"{reshard} is the whole sharding group "
                              "(FSDP2 treats it as true): write --reshard-after-forward true")
        _secondary_size("reshard_after_forward", reshard, sharding)


def _secondary_size(name: str, size: int, sharding: int) -> None:
    """A secondary partition of `size` ranks: a divisor of the sharding group, smaller."""
    if sharding % size or size >= sharding:
        sizes = divisors(sharding)[1:-1]
        raise ConfigError(name, f"{size} must be a divisor of the {sharding} ranks ZeRO-3 "
                          "shards over, smaller than it: "
                          + (f"one of {sizes}" if sizes else "there is none, use more "
                             "data-parallel ranks"))


def divisors(n: int) -> list[int]:
    """The divisors of n, in order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_offload_settings(optimizer: str, param: str, zero: int) -> None:
    """ZeRO-Offload / ZeRO-Infinity's devices and the stages DeepSpeed runs them with
    (deepspeed/runtime/zero/offload_config.py; minipar/parallel/zero/offload.py)."""
    choice("offload_optimizer", optimizer, OFFLOAD_DEVICES)
    choice("offload_param", param, OFFLOAD_DEVICES)
    if param != "none" and zero != 3:
        raise ConfigError(
            "offload_param", f"--offload-param {param} needs --zero 3 (got --zero {zero}): "
            "below stage 3 every rank keeps the full parameters on its GPU to run forward "
            "and backward, so there is no parameter shard to offload (DeepSpeed: "
            "offload_param is valid only with stage 3); use --zero 3, or "
            "--offload-optimizer cpu to offload the optimizer state")
    if optimizer != "none" and zero == 0:
        raise ConfigError(
            "offload_optimizer", f"--offload-optimizer {optimizer} needs --zero 1, 2 or 3: "
            "ZeRO-Offload moves a rank's ZeRO partition of the optimizer state to the host, "
            "and --zero 0 has none (DeepSpeed: offload_optimizer is valid with stage 1, 2 "
            "and 3); add --zero 1")
    if optimizer == "nvme" and zero < 3:
        raise ConfigError(
            "offload_optimizer", f"--offload-optimizer nvme needs --zero 3 (got --zero "
            f"{zero}): DeepSpeed's stage 1/2 optimizer has no NVMe swapper (stage_1_and_2.py "
            "keeps the state in CPU memory for any offload device); ZeRO-Infinity's NVMe "
            "swapping is stage 3's. Use --offload-optimizer cpu or --zero 3")


def check_grad_accum_dtype(grad_accum_dtype: str | None, precision: str) -> None:
    """--grad-accum-dtype names a dtype, one no narrower than the parameters' own: bf16
    only under bf16-mixed (fp32 and fp64 parameters keep their gradients in their own
    dtype), fp32 under bf16-mixed or fp32."""
    if grad_accum_dtype is None:
        return
    choice("grad_accum_dtype", grad_accum_dtype, GRAD_ACCUM_DTYPES)
    if precision == "fp64" or (grad_accum_dtype == "bf16" and precision != "bf16-mixed"):
        raise ConfigError(
            "grad_accum_dtype", f"--grad-accum-dtype {grad_accum_dtype} with --precision "
            f"{precision}: {precision} parameters accumulate their gradients in {precision} "
            "(a narrower buffer would round every micro-batch's sum); it chooses between "
            "bf16 and fp32 under --precision bf16-mixed: drop it, or use bf16-mixed")


def resolve_batch(micro_batch_size: int, dp: int, grad_accum_steps: int | None,
                  global_batch_size: int | None) -> tuple[int, int]:
    """(grad_accum_steps, global_batch_size) with global = micro x accum x dp, from
    either (or both, consistent); neither given means one micro-batch per step."""
    per_step = micro_batch_size * dp  # sequences per micro-step, all DP ranks
    accum, global_batch = grad_accum_steps, global_batch_size
    if accum is not None and (not isinstance(accum, int) or accum < 1):
        raise ConfigError("grad_accum_steps", f"must be a positive integer, got {accum!r}")
    if accum is not None and accum > MAX_MICRO_BATCHES:
        raise ConfigError("grad_accum_steps", f"must be at most {MAX_MICRO_BATCHES:,} "
                          f"micro-batches per step (every one is run, or simulated), got "
                          f"{accum:,}")
    if global_batch is None:
        accum = 1 if accum is None else accum
        return accum, per_step * accum
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError("global_batch_size", f"must be a positive integer, got "
                          f"{global_batch!r}")
    if global_batch % per_step:
        lower = max(per_step, global_batch // per_step * per_step)
        raise ConfigError(
            "global_batch_size", f"{global_batch} does not split into micro-batches: it must "
            f"be a multiple of micro_batch_size x dp = {micro_batch_size} x {dp} = "
            f"{per_step} (e.g. {lower} or {lower + per_step}), or set --grad-accum-steps "
            "instead")
    derived = global_batch // per_step
    if derived > MAX_MICRO_BATCHES:
        raise ConfigError("global_batch_size", f"{global_batch:,} is {derived:,} micro-batches "
                          f"of micro_batch_size x dp = {per_step} per step; at most "
                          f"{MAX_MICRO_BATCHES:,} (every one is run, or simulated): raise "
                          "--micro-batch-size or dp")
    if accum is not None and accum != derived:
        raise ConfigError("global_batch_size",
                          f"{global_batch} != micro_batch_size x grad_accum_steps x dp = "
                          f"{micro_batch_size} x {accum} x {dp} = {per_step * accum}; give "
                          "only one of --global-batch-size and --grad-accum-steps")
    return derived, global_batch


def plain_scalars(settings) -> None:
    """Replace the NumPy scalars among the fields of `settings` (a frozen dataclass) by
    the Python values they hold (np.int64(2) -> 2, np.True_ -> True): a setting taken from
    an array or a sweep is then checked by the same rules as one typed in, and the
    config's JSON and comparisons are the same either way. Then check_integer_sizes."""
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if isinstance(value, np.generic):
            object.__setattr__(settings, field.name, value.item())
    check_integer_sizes(settings)


def check_integer_sizes(settings, error=ConfigError) -> None:
    """Refuse an integer field beyond any setting's range (MAX_INTEGER) before a rule
    quotes it: Python will not turn one of more than 4,300 digits into text (nor a float
    into one past 10**308), so its refusal was a traceback. error(name, message) makes the
    exception (the planner's ModelShape raises ValueError)."""
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INTEGER:
            raise error(field.name, f"is an integer of {decimal_digits(value):,} digits, "
                        "beyond any setting (at most 2**63 - 1)")


def decimal_digits(value: int) -> int:
    """Digits of |value| in base 10, without writing it out (Python refuses to past 4,300
    digits: sys.get_int_max_str_digits)."""
    value = abs(value)
    digits = max(1, int(value.bit_length() * math.log10(2)))  # within one of the count
    while value >= 10**digits:
        digits += 1
    while digits > 1 and value < 10**(digits - 1):
        digits -= 1
    return digits


def check_positive_integers(settings, names) -> None:
    """Each setting in `names` (attributes of `settings`) is an int >= 1."""
    for name in names:
        value = getattr(settings, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(name, f"must be a positive integer, got {value!r}")


def switches(section: type) -> tuple[str, ...]:
    """The settings `section` declares as `bool` (its own, not those it inherits): each
    is checked by `check_booleans`, so a switch added later cannot be forgotten there."""
    own = section.__dict__.get("__annotations__", {})
    return tuple(name for name, kind in own.items() if kind in ("bool", bool))


def check_booleans(settings, names, error=ConfigError) -> None:
    """Each setting in `names` (attributes of `settings`) is True or False. Anything else
    is refused rather than given to Python's truth test, for which the string 'False' is
    true (TrainConfig(sequence_parallel='False') ran sequence parallelism) and 0 or None
    would be a silent False. error(name, message) makes the exception (the planner's
    ModelShape raises ValueError)."""
    for name in names:
        value = getattr(settings, name)
        if not isinstance(value, bool):
            raise error(name, f"must be True or False, got {value!r}")


def choice(name: str, value, options) -> None:
    """`value` is one of `options`."""
    if value not in options:
        raise ConfigError(name, f"must be one of {', '.join(options)}; got {value!r}")
