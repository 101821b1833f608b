"""The advisor: search the parallel layouts of N GPUs and rank those that fit by step
time (the `Advice` it returns explains the best one the way the 3D-parallelism interview
answer does: minipar/plan/advice.py).

The search follows the rules of thumb the answer gives, as constraints rather than
guesses, and lets the estimate decide between what remains:
- tensor parallelism only inside a node (tp divides gpus_per_node): it communicates in
  every layer, forward and backward, and needs NVLink (Narayanan et al. 2021, section
  3.3 and Figure 13);
- pipeline and data parallelism across nodes, pp dividing the GPUs left, at most one
  stage per layer;
- ZeRO 0-3 inside the data-parallel group; with pp > 1 only ZeRO 0-1 (DeepSpeed's
  pipeline engine and Megatron's distributed optimizer stop there); ZeRO-2 reduces
  through DeepSpeed's reduce_bucket_size buckets (5e8 elements), not one flat copy of
  every gradient;
- micro-batch sizes 1, 2, 4, 8 that split the global batch; interleaving with 2 chunks
  per rank when the layers and micro-batches allow it;
- sequence parallelism whenever tp > 1 (same traffic as plain TP, less activation
  memory: Korthikanti et al. 2022, section 4.2.2);
- context parallelism (cp > 1: each sequence cut over cp GPUs, ring attention) only for
  long sequences, from LONG_SEQUENCE tokens on (Megatron-LM's context-parallel docs:
  "for long context training"; Llama 3 used cp 16 at 128k), cp up to 16 and cutting the
  sequence into 2cp chunks; the mesh keeps it next to tp (dp x pp x cp x tp);
- recomputation off, selective (the attention core only: Korthikanti et al. 2022,
  section 5, a few percent more compute) and full (every layer: about a third more), so
  the ranking picks the cheapest that fits: selective whenever it suffices;
- expert parallelism for an MoE shape: ep dividing dp and the experts, at most
  MAX_LOCAL_EXPERTS experts per GPU where some ep allows it (the largest ep otherwise:
  DeepSeek-V3's 256 experts run 8 per GPU, Mixtral's 8 at most 8), ZeRO 0-2 (ZeRO-3
  of experts is not modelled); the estimate weighs the expert memory it saves against
  the four all-to-alls per MoE layer and micro-batch, which like TP's all-reduces sit on
  every layer's critical path, so cheap inside a node and not across (lint says when
  they cross);
- at most MAX_SEARCHED layouts: a search that would estimate more (a toy model on
  hundreds of thousands of GPUs) is refused before it starts, since each estimate
  costs milliseconds and `minipar plan` answers in seconds; evaluating one layout
  stays open;
- offload only when nothing fits on the GPUs alone: ZeRO-Offload (the optimizer state and
  Adam on the host, any ZeRO stage) first, then ZeRO-Infinity's parameter offload to the
  host and both to NVMe (ZeRO-3). Offload trades PCIe copies and a CPU optimizer step for
  GPU memory (plan/offload.py), so it is the last resort the papers present it as.
"""

from __future__ import annotations

import itertools

from minipar.errors import ConfigError, ScheduleError
from minipar.parallel.pipeline.schedules.registry import SCHEDULES, check_schedule_settings
from minipar.parallel.zero.sharded import MAX_IN_FLIGHT
from minipar.plan.accounting import with_deepspeed_buckets
from minipar.plan.advice import Advice
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import estimate
from minipar.plan.layout import MINIPAR_ORDER, ParallelConfig, check_model_fits_layout
from minipar.plan.shapes import ModelShape
from minipar.train.layout import MAX_MICRO_BATCHES

MICRO_BATCH_SIZES = (1, 2, 4, 8)
LONG_SEQUENCE = 8192  # tokens from which the search also tries context parallelism
MAX_CP = 16
MAX_LOCAL_EXPERTS = 64  # experts one GPU holds, at most, in a searched layout
MAX_SEARCHED = 5000  # layouts one search estimates, at most (about 5 ms each)
# none, selective, full (every layer: --recompute-granularity full without a method)
RECOMPUTE_OPTIONS = ({}, {"recompute_granularity": "selective"},
                     {"recompute_granularity": "full"})
# (offload_optimizer, offload_param) tried, in order, when no layout fits on the GPUs
OFFLOADS = (("cpu", "none"), ("cpu", "cpu"), ("nvme", "nvme"))


def _accepts(name: str, pp: int, micro_batches: int, virtual_stages: int) -> bool:
    """Whether schedule `name` accepts these settings (its registry entry's rules)."""
    try:
        check_schedule_settings(name, pp, micro_batches, virtual_stages)
    except ScheduleError:
        return False
    return True


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (pairs up to sqrt(n): --gpus 10**12 took minutes)."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def context_parallel_sizes(shape: ModelShape, gpus: int) -> list[int]:
    """The cp sizes the search tries on `gpus` GPUs: 1, and for long sequences the
    divisors up to MAX_CP that cut the sequence into 2cp chunks."""
    if shape.seq_len < LONG_SEQUENCE:
        return [1]
    return [cp for cp in divisors(gpus) if cp <= MAX_CP and shape.seq_len % (2 * cp) == 0]


def candidate_configs(shape: ModelShape, gpus: int, gpus_per_node: int,
                      global_batch_size: int, precision: str = "bf16-mixed",
                      flash_attention: bool = True, lr: float | None = None,
                      grad_accum_dtype: str | None = None, memory_accounting: str = "paper"):
    """Every layout of `gpus` GPUs the search considers (see the module docstring)."""
    layouts = []
    for tp in divisors(min(gpus_per_node, gpus)):
        if gpus % tp or gpus_per_node % tp:
            continue
        for cp in context_parallel_sizes(shape, gpus // tp):
            layouts += [(tp, cp, pp) for pp in divisors(gpus // (tp * cp))]
    for tp, cp, pp in layouts:
        if pp > shape.n_layer:
            continue
        dp = gpus // (tp * pp * cp)
        for micro in MICRO_BATCH_SIZES:
            if global_batch_size % (micro * dp):
                continue
            m = global_batch_size // (micro * dp)
            # the schedules that say the search should try them, where their rules
            # allow, with chunks that split the layers evenly
            schedules = [(spec.name, v) for spec in SCHEDULES.values()
                         for v in spec.searched_virtual_stages
                         if _accepts(spec.name, pp, m, v)
                         and (v == 1 or shape.n_layer % (pp * v) == 0)]
            expert_parallel = _expert_parallel_sizes(shape, dp)
            # Megatron-LM's own ZeRO is its distributed optimizer: stages 0-1
            stages = (0, 1) if pp > 1 or memory_accounting == "megatron" else (0, 1, 2, 3)
            for zero, ep in itertools.product(stages, expert_parallel):
                for schedule, v in schedules:
                    for recompute in RECOMPUTE_OPTIONS:
                        try:
                            config = ParallelConfig(
                                dp=dp, tp=tp, pp=pp, zero=zero, schedule=schedule,
                                virtual_stages=v, sequence_parallel=tp > 1,
                                micro_batch_size=micro, global_batch_size=global_batch_size,
                                precision=precision, grad_accum_dtype=grad_accum_dtype,
                                flash_attention=flash_attention, lr=lr, cp=cp, ep=ep,
                                memory_accounting=memory_accounting, **recompute)
                            check_model_fits_layout(shape, config)
                        except ConfigError:
                            continue
                        yield config


def _expert_parallel_sizes(shape: ModelShape, dp: int) -> list[int]:
    """The ep sizes searched for dp data-parallel ranks: those leaving at most
    MAX_LOCAL_EXPERTS experts per GPU, or the largest if none does ([1] for a dense
    model)."""
    if not shape.is_moe:
        return [1]
    splits = [ep for ep in divisors(dp) if shape.moe_num_experts % ep == 0]
    few = [ep for ep in splits if shape.moe_num_experts // ep <= MAX_LOCAL_EXPERTS]
    return few or splits[-1:]


def advise(shape: ModelShape, gpus: int, cluster: ClusterSpec, *, global_batch_size: int,
           precision: str = "bf16-mixed", flash_attention: bool = True,
           lr: float | None = None, overlap_grad_reduce: bool = True,
           zero3_prefetch: bool = True, grad_accum_dtype: str | None = None,
           memory_accounting: str = "paper", tp_comm_overlap: bool = False,
           overlap_param_gather: bool = False, cross_entropy_loss_fusion: bool = True,
           fp8_format: str | None = None, fp8_param_gather: bool = False,
           rank_order: str = MINIPAR_ORDER, reductions_in_flight: int | None = MAX_IN_FLIGHT,
           shown: int = 5) -> Advice:
    """Rank every candidate layout of `gpus` GPUs that fits by predicted step time: each
    priced with the pipeline's closed form, then the `shown` fastest by simulating their
    schedules, as a plan of that one layout prices it (price_shown_exactly).
    overlap_grad_reduce, zero3_prefetch: the overlap every candidate runs with
    (plan/overlap.py); both False ranks the runs that wait for every reduction and gather.
    tp_comm_overlap, overlap_param_gather: Megatron-LM's, for the candidates they apply to
    (sequence parallelism; ZeRO-1); cross_entropy_loss_fusion: every candidate's loss;
    fp8_format, fp8_param_gather: every candidate's linear GEMMs in FP8, and its GEMM
    weights as FP8 parameters (plan/fp8.py); FP8 candidates are ZeRO-0 and ZeRO-1 only,
    what Megatron-LM runs FP8 with. rank_order: how every candidate's ranks are laid on
    the nodes (ParallelConfig.rank_order); reductions_in_flight: every ZeRO-1/2
    candidate's limit of gradient reductions in flight (ParallelConfig's)."""
    if not isinstance(gpus, int) or gpus < 1:
        raise ConfigError("gpus", f"must be a positive integer, got {gpus!r}")
    if gpus > cluster.gpus_per_node and gpus % cluster.gpus_per_node:
        raise ConfigError("gpus", f"{gpus} GPUs is not a whole number of "
                        f"{cluster.gpus_per_node}-GPU nodes")
    fitting, not_fitting, searched = [], [], 0
    candidates = list(itertools.islice(candidate_configs(
        shape, gpus, cluster.gpus_per_node, global_batch_size, precision, flash_attention,
        lr, grad_accum_dtype, memory_accounting), MAX_SEARCHED + 1))
    if len(candidates) > MAX_SEARCHED:
        raise ConfigError("gpus", f"searching {gpus:,} GPUs for this model means more than "
                          f"{MAX_SEARCHED:,} layouts to estimate, more than minipar plan "
                          "answers in seconds: evaluate one layout (--dp, --tp, --pp, ...) "
                          "or search fewer GPUs")
    if fp8_format is not None:  # Megatron-LM runs FP8, with ZeRO-0/1 (lint: FP8_WITH_ZERO)
        candidates = [c for c in candidates if c.zero <= 1]
    for config in candidates:
        config = with_deepspeed_buckets(config.replace(
            overlap_grad_reduce=overlap_grad_reduce, zero3_prefetch=zero3_prefetch,
            tp_comm_overlap=tp_comm_overlap and config.sequence_parallel,
            overlap_param_gather=overlap_param_gather and config.zero == 1,
            cross_entropy_loss_fusion=cross_entropy_loss_fusion, fp8_format=fp8_format,
            fp8_param_gather=fp8_param_gather and config.zero == 1, rank_order=rank_order,
            reductions_in_flight=reductions_in_flight))
        searched += 1
        est = estimate(shape, config, cluster, exact_pipeline=False)
        (fitting if est.fits else not_fitting).append(est)
    if searched and not fitting:  # the last resort: offload (see the module docstring)
        for config in offload_candidates([e.config for e in not_fitting]):
            searched += 1
            est = estimate(shape, config, cluster, exact_pipeline=False)
            (fitting if est.fits else not_fitting).append(est)
    if not searched:
        if global_batch_size % gpus == 0:  # it splits: into more micro-batches than allowed
            raise ConfigError("global_batch_size", f"{global_batch_size:,} sequences on {gpus} "
                            f"GPUs is more than {MAX_MICRO_BATCHES:,} micro-batches of at "
                            f"most {max(MICRO_BATCH_SIZES)} per step on every layout")
        raise ConfigError("global_batch_size", f"no layout of {gpus} GPUs splits a global batch "
                        f"of {global_batch_size} into micro-batches of "
                        f"{MICRO_BATCH_SIZES}: use a multiple of {gpus}")
    fitting = price_shown_exactly(shape, cluster, rank_by_time_then_headroom(fitting), shown)
    not_fitting.sort(key=lambda e: e.memory["peak_total"])
    return Advice(shape, cluster, gpus, global_batch_size, fitting, searched, not_fitting)


# price_shown_exactly: the leaders it simulates, and how many simulations in all (a
# 64-stage pipeline's takes ~0.75 s: a search answers in seconds)
MAX_SIMULATED_SHOWN, MAX_SIMULATED = 5, 12
TIE = 0.01  # step times within 1% of the fastest are a tie (the model's own error is more)


def rank_by_time_then_headroom(estimates: list) -> list:
    """Fastest first; the layouts within TIE of the fastest step time first of all, the
    one with the most memory to spare leading (a 1% faster step is inside the time
    model's error; a rank at 99% of memory is one allocator fragment from running out)."""
    ranked = sorted(estimates, key=lambda e: (e.step_time, e.memory["peak_total"]))
    if not ranked:
        return ranked
    tied = [e for e in ranked if e.step_time <= ranked[0].step_time * (1 + TIE)]
    rest = ranked[len(tied):]
    return sorted(tied, key=lambda e: (e.memory["peak_total"], e.step_time)) + rest


def price_shown_exactly(shape: ModelShape, cluster: ClusterSpec, ranked: list,
                        shown: int) -> list:
    """`ranked` with its `shown` leading pipelined layouts priced again by simulating
    their schedules (estimate's exact_pipeline: what `minipar plan` of that layout
    prints; the closed form is within about 1% of it), ranked again until the leaders
    are all simulated ones: a ranking and the plan of its winner then print one step."""
    simulated: set[int] = set()
    shown = max(2, min(shown, MAX_SIMULATED_SHOWN))  # the winner and its runner-up at least
    while True:
        leaders = [i for i, e in enumerate(ranked[:shown])
                   if e.config.pp > 1 and id(e) not in simulated]
        if not leaders or len(simulated) >= MAX_SIMULATED:
            return ranked
        for i in leaders[:MAX_SIMULATED - len(simulated)]:
            ranked[i] = estimate(shape, ranked[i].config, cluster)
            simulated.add(id(ranked[i]))
        ranked = rank_by_time_then_headroom(ranked)


def offload_candidates(configs):
    """The offload variants of layouts that do not fit: ZeRO >= 1 with the optimizer on
    the host; ZeRO-3 also with the parameters on the host, and both on NVMe."""
    for config in configs:
        if config.ep > 1:  # offload with expert parallelism is not modelled
            continue
        for optimizer, param in OFFLOADS:
            if config.zero == 0 or (param != "none" or optimizer == "nvme") and config.zero < 3:
                continue
            yield config.replace(offload_optimizer=optimizer, offload_param=param)
