"""The advisor: search the parallel layouts of N GPUs, rank those that fit by step time,
and explain the best one the way the 3D-parallelism interview answer does.

The search follows the rules of thumb the answer gives, as constraints rather than
guesses, and lets the estimate decide between what remains:
- tensor parallelism only inside a node (tp divides gpus_per_node): it communicates in
  every layer, forward and backward, and needs NVLink (Narayanan et al. 2021, section
  3.3 and Figure 13);
- pipeline and data parallelism across nodes, pp dividing the GPUs left, at most one
  stage per layer;
- ZeRO 0-3 inside the data-parallel group; with pp > 1 only ZeRO 0-1 (DeepSpeed's
  pipeline engine and Megatron's distributed optimizer stop there);
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
- expert parallelism for an MoE shape: ep dividing dp and the experts (ZeRO 0-2: ZeRO-3
  of experts is not modelled); the estimate weighs the expert memory it saves against
  the four all-to-alls per MoE layer and micro-batch, which like TP's all-reduces sit on
  every layer's critical path, so cheap inside a node and not across (lint says when
  they cross);
- offload only when nothing fits on the GPUs alone: ZeRO-Offload (the optimizer state and
  Adam on the host, any ZeRO stage) first, then ZeRO-Infinity's parameter offload to the
  host and both to NVMe (ZeRO-3). Offload trades PCIe copies and a CPU optimizer step for
  GPU memory (plan/offload.py), so it is the last resort the papers present it as.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from minipar.nn.recompute import Recompute
from minipar.parallel.schedules import SCHEDULES, ScheduleError, check_schedule_settings
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import Estimate, estimate, human_bytes, human_seconds
from minipar.plan.experts import expert_parameter_bytes
from minipar.plan.layout import ParallelConfig, PlanError, check_model_fits_layout
from minipar.plan.shapes import ModelShape

MICRO_BATCH_SIZES = (1, 2, 4, 8)
LONG_SEQUENCE = 8192  # tokens from which the search also tries context parallelism
MAX_CP = 16
# none, selective, full (every layer; what --activation-checkpointing has always meant)
RECOMPUTE_OPTIONS = ({}, {"recompute_granularity": "selective"},
                     {"activation_checkpointing": True})
# (offload_optimizer, offload_param) tried, in order, when no layout fits on the GPUs
OFFLOADS = (("cpu", "none"), ("cpu", "cpu"), ("nvme", "nvme"))


def _accepts(name: str, pp: int, micro_batches: int, virtual_stages: int) -> bool:
    """Whether schedule `name` accepts these settings (its registry entry's rules)."""
    try:
        check_schedule_settings(name, pp, micro_batches, virtual_stages)
    except ScheduleError:
        return False
    return True


@dataclass
class Advice:
    """The ranked layouts that fit (best first) and how many were tried."""

    shape: ModelShape
    cluster: ClusterSpec
    gpus: int
    global_batch_size: int
    ranked: list[Estimate]
    searched: int
    not_fitting: list[Estimate]

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    def explain(self) -> str:
        return explain(self)

    def to_dict(self, top: int = 5) -> dict:
        return {
            "schema": "minipar.plan.advice/1",
            "model": self.shape.name,
            "gpus": self.gpus,
            "global_batch_size": self.global_batch_size,
            "searched": self.searched,
            "fitting": len(self.ranked),
            "ranked": [e.to_dict() for e in self.ranked[:top]],
            "explanation": self.explain(),
        }


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def context_parallel_sizes(shape: ModelShape, gpus: int) -> list[int]:
    """The cp sizes the search tries on `gpus` GPUs: 1, and for long sequences the
    divisors up to MAX_CP that cut the sequence into 2cp chunks."""
    if shape.seq_len < LONG_SEQUENCE:
        return [1]
    return [cp for cp in divisors(gpus) if cp <= MAX_CP and shape.seq_len % (2 * cp) == 0]


def candidate_configs(shape: ModelShape, gpus: int, gpus_per_node: int,
                      global_batch_size: int, precision: str = "bf16-mixed",
                      flash_attention: bool = True, lr: float | None = None):
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
            expert_parallel = [ep for ep in divisors(dp) if shape.is_moe
                               and shape.moe_num_experts % ep == 0] or [1]
            for zero, ep in itertools.product((0, 1) if pp > 1 else (0, 1, 2, 3),
                                              expert_parallel):
                for schedule, v in schedules:
                    for recompute in RECOMPUTE_OPTIONS:
                        try:
                            config = ParallelConfig(
                                dp=dp, tp=tp, pp=pp, zero=zero, schedule=schedule,
                                virtual_stages=v, sequence_parallel=tp > 1,
                                micro_batch_size=micro, global_batch_size=global_batch_size,
                                precision=precision, flash_attention=flash_attention,
                                lr=lr, cp=cp, ep=ep, **recompute)
                            check_model_fits_layout(shape, config)
                        except PlanError:
                            continue
                        yield config


def advise(shape: ModelShape, gpus: int, cluster: ClusterSpec, *, global_batch_size: int,
           precision: str = "bf16-mixed", flash_attention: bool = True,
           lr: float | None = None, overlap_grad_reduce: bool = True,
           zero3_prefetch: bool = True) -> Advice:
    """Rank every candidate layout of `gpus` GPUs that fits by predicted step time.
    overlap_grad_reduce, zero3_prefetch: the overlap every candidate runs with
    (plan/overlap.py); both False ranks the runs that wait for every reduction and gather."""
    if not isinstance(gpus, int) or gpus < 1:
        raise PlanError("gpus", f"must be a positive integer, got {gpus!r}")
    if gpus > cluster.gpus_per_node and gpus % cluster.gpus_per_node:
        raise PlanError("gpus", f"{gpus} GPUs is not a whole number of "
                        f"{cluster.gpus_per_node}-GPU nodes")
    fitting, not_fitting, searched = [], [], 0
    for config in candidate_configs(shape, gpus, cluster.gpus_per_node, global_batch_size,
                                    precision, flash_attention, lr):
        config = config.replace(overlap_grad_reduce=overlap_grad_reduce,
                                zero3_prefetch=zero3_prefetch)
        searched += 1
        est = estimate(shape, config, cluster, exact_pipeline=False)
        (fitting if est.fits else not_fitting).append(est)
    if searched and not fitting:  # the last resort: offload (see the module docstring)
        for config in offload_candidates([e.config for e in not_fitting]):
            searched += 1
            est = estimate(shape, config, cluster, exact_pipeline=False)
            (fitting if est.fits else not_fitting).append(est)
    if not searched:
        raise PlanError("global_batch_size", f"no layout of {gpus} GPUs splits a global batch "
                        f"of {global_batch_size} into micro-batches of "
                        f"{MICRO_BATCH_SIZES}: use a multiple of {gpus}")
    fitting.sort(key=lambda e: (e.step_time, e.memory["peak_total"]))
    not_fitting.sort(key=lambda e: e.memory["peak_total"])
    return Advice(shape, cluster, gpus, global_batch_size, fitting, searched, not_fitting)


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


# ------------------------------------------------------------------ explanation
def _best_where(advice: Advice, predicate) -> Estimate | None:
    return next((e for e in advice.ranked if predicate(e.config)), None)


def explain(advice: Advice) -> str:
    """Why the best layout looks the way it does, in the interview answer's terms."""
    est = advice.best
    shape, cluster = advice.shape, advice.cluster
    if est is None:
        closest = advice.not_fitting[0] if advice.not_fitting else None
        text = (f"No layout of {advice.gpus} GPUs fits {shape.name} in "
                f"{human_bytes(cluster.usable_memory)} per GPU ({advice.searched} tried).")
        if closest is not None:
            text += (f" The closest, dp={closest.config.dp} tp={closest.config.tp} "
                     f"pp={closest.config.pp} ZeRO-{closest.config.zero}, needs "
                     f"{human_bytes(closest.memory['peak_total'])}: use more GPUs, more "
                     "memory per GPU, or a smaller micro-batch / shorter sequence.")
        return text
    c, mem, t = est.config, est.memory, est.time
    comm = est.comm_time_by_group()
    gpn = cluster.gpus_per_node
    nodes = -(-advice.gpus // gpn)
    state = mem["params"] + mem["grads"] + mem["optimizer"]
    replica = (c.bytes.param + c.bytes.grad + c.bytes.optimizer) * shape.n_params
    split = replica > cluster.usable_memory
    lines = [
        f"Best of {len(advice.ranked)} fitting layouts ({advice.searched} tried) for "
        f"{shape.name} ({shape.n_params / 1e9:.1f}B parameters) on {advice.gpus} GPUs "
        f"({nodes} node{'s' * (nodes > 1)} of {gpn}): dp={c.dp} x tp={c.tp} x pp={c.pp}"
        f"{f' x cp={c.cp}' if c.cp > 1 else ''}{f' (ep={c.ep})' if c.ep > 1 else ''}, "
        f"ZeRO-{c.zero}, micro-batch {c.micro_batch_size}, "
        f"{'activation checkpointing, ' if c.activation_checkpointing else ''}"
        f"step {human_seconds(t['step_s'])}, MFU {t['mfu']:.1%}.",
        "",
        f"- The model state (parameters, gradients, optimizer) is "
        f"{human_bytes(replica)} in {c.precision} ({c.bytes.param} + {c.bytes.grad} + "
        f"{c.bytes.optimizer} bytes per parameter, the ZeRO paper's count): "
        + (f"more than one GPU's {human_bytes(cluster.usable_memory)}, so it has to be "
           f"split; this layout leaves {human_bytes(state)} of it per GPU."
           if split else f"it fits on one GPU, so splitting it is optional ("
           f"{human_bytes(state)} per GPU here)."),
    ]
    if c.tp > 1:
        lines.append(
            f"- Tensor parallelism (tp={c.tp}) stays inside a node: it splits every layer's "
            f"matrices and heads over {c.tp} GPUs and all-reduces activations in every layer, "
            f"forward and backward ({human_bytes(est.traffic['tp'])} per GPU per step, "
            f"{human_seconds(comm['tp'])} on NVLink). Across nodes the same traffic would "
            f"run {cluster.intra_node_bandwidth / cluster.inter_node_bandwidth:.0f}x slower."
            + (" Sequence parallelism splits the norms' and dropouts' activations too, for "
               "the same traffic." if c.sequence_parallel else ""))
    else:
        lines.append("- No tensor parallelism: every layer fits on one GPU, so there is no "
                     "need to pay its per-layer all-reduces.")
    if c.cp > 1:
        lines.append(
            f"- Context parallelism (cp={c.cp}) cuts each {shape.seq_len}-token sequence "
            f"into {2 * c.cp} chunks over {c.cp} GPUs (rank r keeps chunks r and "
            f"{2 * c.cp - 1}-r, so causal attention is balanced): every GPU holds the "
            f"activations of {shape.seq_len // c.cp} tokens, and ring attention passes K/V "
            f"blocks around the CP group ({human_bytes(est.traffic['cp'])} per GPU per "
            f"step, {human_seconds(comm['cp'])} of transfers, mostly hidden behind the "
            "block computations).")
    if c.pp > 1:
        lines.append(
            f"- Pipeline parallelism (pp={c.pp}) cuts the {shape.n_layer} layers into {c.pp} "
            f"stages{' across nodes' if est.links['pp'] else ''}; only (b, s, h) activations "
            f"cross a stage boundary ({human_bytes(est.traffic['pp'])} per GPU per step). "
            f"{c.micro_batches} micro-batches per step keep the bubble at "
            f"{t['bubble_fraction']:.1%} ({c.schedule}"
            + (f", {c.virtual_stages} chunks per GPU" if c.virtual_stages > 1 else "") + ").")
    else:
        lines.append("- No pipeline parallelism: the model's layers fit without being cut "
                     "into stages, so there is no bubble.")
    zero_text = {0: "keeps a full replica of the optimizer state on every GPU",
                 1: "shards the optimizer state (12 of the 16 bytes per parameter)",
                 2: "shards the optimizer state and the gradients",
                 3: "shards parameters, gradients and optimizer state (gathering "
                    "parameters layer by layer)"}[c.zero]
    if c.dp > 1:
        lines.append(
            f"- Data parallelism (dp={c.dp}) {'across nodes ' if est.links['dp'] else ''}"
            f"multiplies throughput; ZeRO-{c.zero} inside the DP group {zero_text}. Gradient "
            f"synchronisation moves {human_bytes(est.traffic['dp'])} per GPU per step "
            f"({human_seconds(comm['dp'])}).")
        lower = _best_where(advice, lambda x: x.zero < c.zero and x.dp == c.dp
                            and x.tp == c.tp and x.pp == c.pp)
        if c.zero > 0 and lower is None:
            lines.append("  No lower ZeRO stage fits with the same dp/tp/pp: ZeRO is what "
                         "makes this layout possible.")
        elif c.zero > 0:
            lines.append(f"  ZeRO-{lower.config.zero} would fit too, at "
                         f"{human_seconds(lower.step_time)} per step; ZeRO-{c.zero} is "
                         "as fast or faster and leaves more memory free.")
    elif c.cp > 1:
        lines.append(f"- No data parallelism: the GPUs cut the sequence instead. The "
                     f"parameters are replicated over the {c.cp} CP ranks, so ZeRO-{c.zero} "
                     f"{zero_text} over them (Megatron's data-parallel group with context "
                     "parallelism).")
    else:
        lines.append("- No data parallelism: all GPUs are needed to hold one model replica.")
    if shape.is_moe:
        lines.append(expert_parallel_line(est))
    if c.offload_optimizer != "none" or c.offload_param != "none":
        on_gpu = estimate(shape, c.replace(offload_optimizer="none", offload_param="none"),
                          cluster)
        lines.append(
            f"- Offload (optimizer state: {c.offload_optimizer}, parameters: "
            f"{c.offload_param}): no layout fits on the GPUs alone (this one would need "
            f"{human_bytes(on_gpu.memory['peak_total'])} per GPU). The host holds "
            f"{human_bytes(est.memory_host['peak_total'])} and the NVMe drive "
            f"{human_bytes(est.memory_nvme['peak_total'])} per GPU; PCIe copies and CPU Adam "
            f"make the step {human_seconds(t['step_s'] - on_gpu.step_time)} longer.")
    if c.recompute.full:
        without = estimate(shape, c.with_recompute(Recompute()), cluster)
        selective = estimate(shape, c.with_recompute(Recompute("selective")), cluster)
        lines.append(
            f"- Activation checkpointing is on because without it this layout would need "
            f"{human_bytes(without.memory['peak_total'])} per GPU (activations "
            f"{human_bytes(without.memory['activations'])}), more than the "
            f"{human_bytes(cluster.usable_memory)} usable, and selective recomputation "
            f"still needs {human_bytes(selective.memory['peak_total'])}; recomputing each "
            "layer costs about a third more compute.")
    elif c.recompute.selective:
        without = estimate(shape, c.with_recompute(Recompute()), cluster)
        lines.append(
            f"- Selective recomputation (Korthikanti et al. 2022): without it this layout "
            f"would need {human_bytes(without.memory['peak_total'])} per GPU, more than "
            f"the {human_bytes(cluster.usable_memory)} usable; recomputing only the "
            f"attention core drops the (s x s) probabilities and costs "
            f"{est.step_time / without.step_time - 1:.1%} more time, where full "
            "recomputation would cost about a third.")
    else:
        lines.append(f"- Activation checkpointing is off: the activations "
                     f"({human_bytes(mem['activations'])}) fit, so recomputation would only "
                     "cost time.")
    lines.append(
        f"- Global batch {c.global_batch_size} = micro-batch {c.micro_batch_size} x "
        f"{c.micro_batches} accumulation steps x dp {c.dp}; memory per GPU "
        f"{human_bytes(mem['peak_total'])} of {human_bytes(cluster.usable_memory)}.")
    runner_up = advice.ranked[1] if len(advice.ranked) > 1 else None
    if runner_up is not None:
        r = runner_up.config
        lines.append(
            f"- Runner-up: dp={r.dp} tp={r.tp} pp={r.pp}"
            f"{f' cp={r.cp}' if r.cp > 1 else ''}{f' ep={r.ep}' if r.ep > 1 else ''} "
            f"ZeRO-{r.zero} micro-batch "
            f"{r.micro_batch_size}"
            f"{'' if not r.recomputes else ' with ' + r.recompute.label + ' recomputation'}"
            f", step {human_seconds(runner_up.step_time)} "
            f"(+{runner_up.step_time / est.step_time - 1:.1%}).")
    return "\n".join(lines)


def expert_parallel_line(est: Estimate) -> str:
    """What expert parallelism does in the best layout (or why it is off)."""
    c, shape = est.config, est.shape
    experts = expert_parameter_bytes(shape, c.ep, c.bytes.param, c.tp)
    if c.ep == 1:
        return (f"- No expert parallelism: every GPU holds all {shape.moe_num_experts} experts "
                f"of each MoE layer ({human_bytes(experts)} of expert parameters) and no "
                "token leaves its GPU.")
    return (f"- Expert parallelism (ep={c.ep}, inside the DP group) gives each GPU "
            f"{shape.moe_num_experts // c.ep} of the {shape.moe_num_experts} experts "
            f"({human_bytes(experts)} of expert parameters, 1/{c.ep} of them); tokens reach "
            f"their experts by four all-to-alls per MoE layer and micro-batch "
            f"({human_bytes(est.traffic['ep'])} per GPU per step, "
            f"{human_seconds(est.comm_time_by_group()['ep'])}"
            + (" across nodes" if est.links["ep"] else " inside a node") + "); "
            + (f"expert gradients are reduced over the {c.expert_data_parallel} GPUs holding "
               "the same experts." if c.expert_data_parallel > 1 else
               "each GPU is alone with its experts, so their gradients need no reduction."))


def format_ranking(advice: Advice, top: int = 5) -> str:
    """A table of the `top` fitting layouts."""
    moe = advice.shape.is_moe
    header = ["#", "dp", "tp", "pp", "cp", *(["ep"] if moe else []), "zero", "sched", "mb",
              "accum", "recompute", "memory", "step", "bubble", "MFU"]
    rows = [header]
    for i, e in enumerate(advice.ranked[:top], start=1):
        c = e.config
        sched = c.schedule if c.virtual_stages == 1 else f"{c.schedule}x{c.virtual_stages}"
        rows.append([str(i), str(c.dp), str(c.tp), str(c.pp), str(c.cp),
                     *([str(c.ep)] if moe else []), str(c.zero), sched,
                     str(c.micro_batch_size), str(c.micro_batches),
                     c.recompute.label,
                     human_bytes(e.memory["peak_total"]), human_seconds(e.step_time),
                     f"{e.time['bubble_fraction']:.1%}", f"{e.mfu:.1%}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
