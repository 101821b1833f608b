"""The classic mistakes of a 3D-parallel configuration, found before the cluster does.

    findings = lint(shape, config, cluster, reference={"global_batch_size": 256, "lr": 3e-4})
    for f in findings:
        print(f.code, f.message, f.fix)

Each `Finding` has a stable `code`, a `severity` (error: the run is wrong or will not
start; warning: it runs but wastes time or changes the training; info), a `message`
saying what is wrong with the numbers that show it, and a `fix`. The checks are the
"most common configuration mistakes" of the interview answer:

    GLOBAL_BATCH_MISMATCH    global batch != micro-batch x accumulation x dp
    LR_NOT_RESCALED          the global batch changed but the learning rate did not
    TP_ACROSS_NODES          a tensor-parallel group spans nodes (InfiniBand, not NVLink)
    PIPELINE_UNBALANCED      one pipeline stage is much slower than the average
    TOO_FEW_MICRO_BATCHES    the pipeline bubble eats the step (m < p, or a large bubble)
    ZERO_COMM_DOMINATES      the ZeRO stage's traffic is a large share of the step and a
                             lower stage would fit, or (ZeRO-3 across nodes) HSDP, ZeRO++
                             or FSDP2's reshard_after_forward would keep it in the node
    UNNEEDED_CHECKPOINTING   recomputation (any granularity) on although activations fit
    RECOMPUTES_TOO_MUCH      full recomputation where less fits with 10% to spare:
                             selective, or full for fewer layers (--recompute-method
                             block); info, as the planner leaves out framework buffers
    DOES_NOT_FIT             the fullest rank exceeds the GPU's usable memory
    ZERO_WITH_PIPELINE       ZeRO-2/3 with pp > 1 (DeepSpeed's pipeline engine refuses)
    INVALID_LAYOUT           the model does not split as asked (heads, layers, widths)
    SEQUENCE_PARALLEL_OFF    tp > 1 without sequence parallelism (free activation savings)
    EP_ACROSS_NODES, EXPERTS_NEED_EP, EP_WITHOUT_NEED   an MoE layout (lint_experts.py)
This module is long because it is one short function per classic mistake above.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import SimpleNamespace

from minipar.errors import ConfigError, flag
from minipar.nn.recompute import Recompute
from minipar.parallel.pipeline.schedules.registry import SCHEDULES
from minipar.plan.accounting import with_deepspeed_buckets
from minipar.plan.advisor import TIE
from minipar.plan.cluster import ClusterSpec, group_rails
from minipar.plan.estimate import Estimate, estimate, human_bytes, human_seconds
from minipar.plan.fp8 import check_fp8_plan
from minipar.plan.layout import (
    ParallelConfig,
    check_model_fits_layout,
    layer_counts,
    stage_plans,
)
from minipar.plan.lint_experts import check_expert_parallel
from minipar.plan.shapes import ModelShape
from minipar.plan.timing import stage_time, transfer_time
from minipar.plan.traffic import data_parallel_nodes, stage_traffic
from minipar.train.layout import check_positive_integers

SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Finding:
    code: str
    severity: str
    message: str
    fix: str

    def to_dict(self) -> dict:
        return asdict(self)


def lint(shape: ModelShape, config: ParallelConfig | Mapping, cluster: ClusterSpec, *,
         reference: Mapping | None = None, zero_comm_share: float = 0.15,
         balance_tolerance: float = 0.10, bubble_limit: float = 0.20) -> list[Finding]:
    """Findings for `config` (a ParallelConfig, or a mapping of its settings, which may
    be inconsistent), most severe first.

    reference: {"global_batch_size": G0, "lr": lr0} of the run whose hyper-parameters were
    tuned (the single-GPU baseline), for the learning-rate check.
    """
    findings: list[Finding] = []
    config = _as_config(config, findings)
    check_fp8_plan(shape, config.fp8_format, cluster)  # (it prices stages below)
    findings += _check_learning_rate(config, reference)
    findings += _check_tensor_parallel_placement(config, cluster)
    if config.zero >= 2 and config.pp > 1:
        findings.append(Finding(
            "ZERO_WITH_PIPELINE", "warning",
            f"ZeRO-{config.zero} with pp={config.pp}: DeepSpeed's pipeline engine supports "
            "only ZeRO-1 (stage 2 reduce-scatters gradients every micro-batch, which "
            "collides with the pipeline's gradient accumulation), and Megatron's "
            "distributed optimizer is ZeRO-1.",
            "use --zero 1 with pipeline parallelism, or --pp 1 with ZeRO-2/3"))
    if config.fp8_format is not None and config.zero >= 2:
        findings.append(Finding(
            "FP8_WITH_ZERO", "warning",
            f"FP8 (Transformer Engine) with ZeRO-{config.zero}: Megatron-LM, where "
            "--fp8-format runs, shards only the optimizer (its distributed optimizer, "
            "ZeRO-1), and DeepSpeed's config has no FP8 setting: the exported DeepSpeed "
            "files describe this job in bf16.",
            "use --zero 1 (Megatron-LM's --use-distributed-optimizer) with --fp8-format"))
    if config.sequence_parallel and config.tp == 1:
        findings.append(Finding(
            "SEQUENCE_PARALLEL_OFF", "info",
            "--sequence-parallel with tp=1 does nothing: it splits the tensor-parallel "
            "group's replicated activations.", "drop --sequence-parallel or use --tp > 1"))
    try:
        check_model_fits_layout(shape, config)
    except ConfigError as err:  # nothing below can be estimated
        findings.append(Finding("INVALID_LAYOUT", "error", str(err),
                                f"choose --{err.setting.replace('_', '-')} so that the model "
                                "splits evenly"))
        return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))
    findings += _check_pipeline(shape, config, cluster, balance_tolerance, bubble_limit)
    est = estimate(shape, config, cluster)
    findings += _check_memory(shape, config, cluster, est)
    findings += _check_zero_traffic(shape, config, cluster, est, zero_comm_share)
    findings += [Finding(*f) for f in check_expert_parallel(shape, config, cluster, est)]
    if config.tp > 1 and not config.sequence_parallel:
        with_sp = estimate(shape, config.replace(sequence_parallel=True), cluster)
        saved = est.memory["activations"] - with_sp.memory["activations"]
        findings.append(Finding(
            "SEQUENCE_PARALLEL_OFF", "info",
            f"tp={config.tp} without sequence parallelism keeps the norms' activations "
            f"replicated on every TP rank; sequence parallelism would save "
            f"{human_bytes(saved)} of activations per GPU for the same traffic "
            "(Korthikanti et al. 2022, section 4.2.2).", "add --sequence-parallel"))
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


# ------------------------------------------------------------------ the checks
def _as_config(config, findings: list[Finding]) -> ParallelConfig:
    if isinstance(config, ParallelConfig):
        return config
    if not isinstance(config, Mapping):  # a minipar TrainConfig
        return ParallelConfig.from_train_config(config)
    values = {k: v for k, v in config.items() if k in ParallelConfig.__dataclass_fields__}
    micro, dp = values.get("micro_batch_size", 1), values.get("dp", 1)
    # the batch arithmetic below divides by them: refuse 0 first, in TrainConfig's words
    check_positive_integers(SimpleNamespace(micro_batch_size=micro, dp=dp),
                            ("micro_batch_size", "dp"))
    accum, global_batch = values.get("grad_accum_steps"), values.get("global_batch_size")
    if accum is not None and global_batch is not None and micro * accum * dp != global_batch:
        per_step = micro * dp
        fix = (f"set --grad-accum-steps {global_batch // per_step}" if global_batch % per_step
               == 0 else f"set --global-batch-size {micro * accum * dp}, or a multiple of "
               f"micro_batch_size x dp = {per_step}")
        findings.append(Finding(
            "GLOBAL_BATCH_MISMATCH", "error",
            f"global batch {global_batch} != micro-batch {micro} x accumulation {accum} x "
            f"dp {dp} = {micro * accum * dp}: DeepSpeed refuses to start (train_batch_size "
            "check) and Megatron recomputes the accumulation, so the run would not train "
            "with the batch you tuned for.", fix))
        values["global_batch_size"] = None  # go on with the accumulation as given
    elif accum is None and global_batch is not None and global_batch % (micro * dp):
        findings.append(Finding(
            "GLOBAL_BATCH_MISMATCH", "error",
            f"global batch {global_batch} is not a multiple of micro-batch {micro} x dp {dp}"
            f" = {micro * dp}, so it cannot be split into micro-batches.",
            f"use --global-batch-size {max(micro * dp, global_batch // (micro * dp) * micro * dp)}"
            f" or change --micro-batch-size / --dp"))
        values["global_batch_size"] = None
    if values.get("layer_split") is not None:
        values["layer_split"] = tuple(values["layer_split"])
    return ParallelConfig(**values)


def _check_learning_rate(config: ParallelConfig, reference: Mapping | None) -> list[Finding]:
    if not reference or config.lr is None:
        return []
    base_batch, base_lr = reference.get("global_batch_size"), reference.get("lr")
    if not base_batch or not base_lr or base_batch == config.global_batch_size:
        return []
    ratio = config.global_batch_size / base_batch
    if abs(config.lr / base_lr - 1) > 1e-9:
        return []
    linear, square_root = base_lr * ratio, base_lr * ratio**0.5
    return [Finding(
        "LR_NOT_RESCALED", "warning",
        f"the global batch changed from {base_batch} to {config.global_batch_size} "
        f"({ratio:g}x) but the learning rate stayed {config.lr:g}: each step now averages "
        f"{ratio:g}x {'more' if ratio > 1 else 'fewer'} sequences, so the same lr takes "
        "relatively smaller (or larger) steps and the run no longer matches the baseline.",
        f"rescale the lr: linear rule (Goyal et al. 2017) {linear:.3g}, square-root rule "
        f"often used with Adam (Malladi et al. 2022) {square_root:.3g}; re-check the warm-up")]


def _check_tensor_parallel_placement(config: ParallelConfig,
                                     cluster: ClusterSpec) -> list[Finding]:
    gpn = cluster.gpus_per_node
    crossing = group_rails(config.tp, 1, config.world_size, gpn)
    if not crossing:
        return []
    # the ring crosses nodes on `crossing` NICs at once (cluster.rails), at a latency
    # per step that no NIC count lowers: the per-layer messages are small and on the
    # critical path
    (fast_alpha, fast), (slow_alpha, slow) = cluster.link(False), cluster.link(
        True, crossing if cluster.nic_rails else 1)
    inside = max(t for t in range(1, gpn + 1) if gpn % t == 0 and config.tp % t == 0)
    return [Finding(
        "TP_ACROSS_NODES", "warning",
        f"tp={config.tp} with {gpn} GPUs per node: tensor-parallel groups span nodes, so "
        f"the per-layer all-reduces (forward and backward) run over InfiniBand: "
        f"{fast / slow:.1f}x NVLink's time per byte and {slow_alpha / fast_alpha:.1f}x "
        f"its latency on each ring step from one node to the next.",
        f"keep tp inside a node (a divisor of {gpn}, e.g. --tp {inside}) and move the "
        f"factor {config.tp // inside} to pipeline or data parallelism")]


def _check_pipeline(shape, config, cluster, tolerance, bubble_limit) -> list[Finding]:
    p, m = config.pp, config.micro_batches
    if p == 1:
        return []
    findings = []
    plans = stage_plans(shape, config, all_ranks=True)
    gpn = cluster.gpus_per_node
    times = [stage_time(shape, config, cluster, plan, stage_traffic(shape, config, plan, gpn))
             ["micro_batch_s"] for plan in plans]
    mean = sum(times) / p
    slowest = max(range(p), key=times.__getitem__)
    suggestion = _balanced_split(shape, config, cluster)
    if times[slowest] > (1 + tolerance) * mean and suggestion != layer_counts(
            shape.n_layer, p, config.layer_split) and config.virtual_stages == 1:
        balanced = config.replace(layer_split=tuple(suggestion))
        new_times = [stage_time(shape, balanced, cluster, plan,
                                stage_traffic(shape, balanced, plan, gpn))["micro_batch_s"]
                     for plan in stage_plans(shape, balanced, all_ranks=True)]
        if max(new_times) < 0.97 * times[slowest]:
            plan = plans[slowest]
            holds = [f"{plan.layers} layers"]
            if plan.first:
                holds.append("the embedding")
            if plan.last:
                holds.append(f"the LM head and loss over {shape.vocab_size} words")
            findings.append(Finding(
                "PIPELINE_UNBALANCED", "warning",
                f"pipeline stage {slowest} ({', '.join(holds)}) takes "
                f"{times[slowest] / mean:.2f}x the mean stage time per micro-batch; every "
                "stage waits for the slowest, so the others idle on every micro-batch.",
                f"move layers off stage {slowest}: --layer-split "
                f"{','.join(map(str, suggestion))} brings the slowest stage to "
                f"{max(new_times) / mean:.2f}x (Megatron: --decoder-first/last-pipeline-"
                "num-layers; DeepSpeed: partition_method)"))
    v, spec = config.virtual_stages, SCHEDULES[config.schedule]
    bubble = spec.uniform_bubble(p, m, v)  # uniform stages (the schedule's own formula)
    if m < p or bubble > bubble_limit:
        # the fewest micro-batches (at least p) that bring the bubble under the limit
        want = next(k for k in itertools.count(p) if spec.uniform_bubble(p, k, v) <= bubble_limit)
        chunked = [name for name, s in SCHEDULES.items() if not s.accepts_chunks(1)]
        findings.append(Finding(
            "TOO_FEW_MICRO_BATCHES", "warning",
            f"{m} micro-batches for {p} pipeline stages: the bubble is {bubble:.0%} of the "
            f"step ({spec.bubble_formula} for uniform stages; Narayanan et "
            "al. 2021 need m >> p)"
            + ("; with m < p the pipeline never even fills." if m < p else "."),
            f"raise --grad-accum-steps to >= {want} (global batch "
            f"{config.micro_batch_size * want * config.dp}), or keep the global batch and "
            "lower --micro-batch-size"
            + (f", or use --schedule {' or '.join(chunked)}" if v == 1 and chunked else "")))
    return findings


def _balanced_split(shape, config, cluster) -> list[int]:
    """Layers per stage that even out the stage times, counting the embedding and the
    head as fractions of a layer (DeepSpeed's partition_method "parameters" idea)."""
    p, b, t = config.pp, config.micro_batch_size, config.tp
    sp = config.sequence_parallel
    layer = sum(shape.layer_flops(b, t, sp))
    embedding = sum(shape.embedding_flops(b, t)) / layer
    head = sum(shape.head_flops(b, t, sp)) / layer
    target = (shape.n_layer + embedding + head) / p
    split = [0] * p
    remaining = shape.n_layer
    split[0] = max(0, min(remaining, round(target - embedding)))
    remaining -= split[0]
    if p > 1:
        split[-1] = max(0, min(remaining, round(target - head)))
        remaining -= split[-1]
    inner = p - 2
    for i in range(1, p - 1):
        share = remaining // inner + (i - 1 < remaining % inner)
        split[i] = share
    if p == 2:
        split[0] += remaining
    return split


def _check_memory(shape, config, cluster, est: Estimate) -> list[Finding]:
    findings = []
    usable = cluster.usable_memory
    peak = est.memory["peak_total"]
    if peak > usable:
        options = []
        # the cheapest recomputation that fits: selective, then full (every layer)
        if not config.recompute.full:
            for flags, policy in (("--recompute-granularity selective", Recompute("selective")),
                                  ("--recompute-granularity full",
                                   Recompute("full", "uniform", 1))):
                if policy == config.recompute:
                    continue
                ck = _estimate_if_valid(shape, config.with_recompute(policy), cluster)
                if ck is not None and ck.fits:
                    options.append(f"{flags} ({human_bytes(ck.memory['peak_total'])})")
                    break
        for stage in range(config.zero + 1, 2 if config.pp > 1 else 3 if shape.is_moe else 4):
            z = _estimate_if_valid(shape, _with_stage(config, stage), cluster)
            if z is not None and z.fits:
                options.append(f"--zero {stage} ({human_bytes(z.memory['peak_total'])})")
                break
        options.append(("expert parallelism (--ep: see EXPERTS_NEED_EP), "
                        if shape.is_moe and config.ep < shape.moe_num_experts else "")
                       + "more tensor/pipeline parallelism or a smaller --micro-batch-size")
        biggest = max(("params", "grads", "optimizer", "activations", "buffers"),
                      key=lambda k: est.memory[k])
        findings.append(Finding(
            "DOES_NOT_FIT", "error",
            f"the fullest rank needs {human_bytes(peak)} but a GPU has "
            f"{human_bytes(usable)} usable; the largest part is {biggest} "
            f"({human_bytes(est.memory[biggest])}).", "; or ".join(options)))
    elif config.recomputes:
        finding = _cheaper_recomputation(shape, config, cluster, est)
        if finding is not None:
            findings.append(finding)
    return findings


def _estimate_if_valid(shape, config, cluster) -> Estimate | None:
    """The estimate of an alternative the lint weighs, or None if the layout refuses it
    (selective recomputation under context parallelism, for one)."""
    try:
        return estimate(shape, config, cluster)
    except ConfigError:
        return None


CHEAPER_RECOMPUTE_HEADROOM = 0.9  # advise less recomputation only below 90% of memory


def _cheaper_recomputation(shape, config, cluster, est: Estimate) -> Finding | None:
    """Checkpointing too much: recomputation on although less of it fits. Tried from the
    cheapest: none, selective (full only), then full for fewer layers (block k, the
    smallest k per chunk that fits; Megatron's --recompute-method block)."""
    usable = cluster.usable_memory
    recompute = config.recompute
    what = ("selective recomputation" if recompute.selective
            else "activation checkpointing" if recompute.label == "full"
            else f"full recomputation ({recompute.label})")
    flag = "--recompute-granularity"

    def slower(cheaper: Estimate) -> str:
        return (f"{est.step_time / cheaper.step_time - 1:.0%} more time per step "
                f"({human_seconds(est.step_time)} vs {human_seconds(cheaper.step_time)})")

    off = estimate(shape, config.with_recompute(Recompute()), cluster)
    if off.fits:
        return Finding(
            "UNNEEDED_CHECKPOINTING", "warning",
            f"{what} is on, but without it the fullest rank needs "
            f"{human_bytes(off.memory['peak_total'])} of {human_bytes(usable)}: memory "
            f"was not short, and recomputing {'attention' if recompute.selective else 'layers'}"
            f" costs {slower(off)}.",
            f"drop {flag}" + ("" if recompute.selective else
                              " (or checkpoint only some layers / use selective "
                              "recomputation of attention, Korthikanti et al. 2022 section 5)"))
    if not recompute.full:
        return None
    # Less recomputation is only advised with room to spare: the planner's peak_total is
    # an estimate (within 10% of the emulator's, tests/plan/test_estimate.py), and a
    # layout at 99% of memory is one allocator fragment away from running out.
    roomy = CHEAPER_RECOMPUTE_HEADROOM * usable
    selective = _estimate_if_valid(shape, config.with_recompute(Recompute("selective")),
                                   cluster)
    if selective is not None and selective.memory["peak_total"] <= roomy:
        return Finding(
            "RECOMPUTES_TOO_MUCH", "info",
            f"{what} recomputes whole layers, but recomputing only the attention core fits "
            f"({human_bytes(selective.memory['peak_total'])} of {human_bytes(usable)}); "
            f"full recomputation costs {slower(selective)}.",
            "use --recompute-granularity selective (Korthikanti et al. 2022, section 5)")
    chunk = max(layer_counts(shape.n_layer, config.pp * config.virtual_stages,
                             config.layer_split))
    done = recompute.recomputed_layers(chunk)

    def block(k: int):
        return estimate(shape, config.with_recompute(Recompute("full", "block", k)), cluster)

    # The fewest layers k < done whose block recomputation fits. A rank's peak falls as
    # k grows (each checkpointed layer keeps its input only), so a bisection finds the
    # first k that fits in ~log2(chunk) estimates: a 4096-layer chunk costs 12, not 4095.
    counts = range(1, min(done, chunk))
    first = bisect.bisect_left(counts, True,
                               key=lambda k: block(k).memory["peak_total"] <= roomy)
    if first < len(counts):
        k = counts[first]
        fewer = block(k)
        if fewer.memory["peak_total"] <= roomy:
            return Finding(
                "RECOMPUTES_TOO_MUCH", "info",
                f"{what} recomputes {done} of the {chunk} layers of its largest pipeline chunk, "
                f"but recomputing {k} fits ({human_bytes(fewer.memory['peak_total'])} of "
                f"{human_bytes(usable)}); the extra recomputation costs {slower(fewer)}.",
                f"use --recompute-granularity full --recompute-method block "
                f"--recompute-num-layers {k}")
    return None


def _with_stage(config, stage: int):
    """`config` at another ZeRO stage, keeping the offload (and ZeRO-3's sharding across
    nodes) that stage allows (and, for a stage Megatron-LM does not run, DeepSpeed's
    memory accounting instead of its)."""
    optimizer = "none" if stage == 0 or (stage < 3 and config.offload_optimizer == "nvme") \
        else config.offload_optimizer
    param = config.offload_param if stage == 3 else "none"
    across = {} if stage == 3 else {
        "hsdp_shard_size": None, "zero_hpz_partition_size": 1, "reshard_after_forward": True,
        "zero_quantized_weights": False, "zero_quantized_gradients": False}
    accounting = ("deepspeed" if config.memory_accounting == "megatron" and stage > 1
                  else config.memory_accounting)
    return with_deepspeed_buckets(config.replace(
        zero=stage, offload_optimizer=optimizer, offload_param=param,
        memory_accounting=accounting,
        overlap_param_gather=config.overlap_param_gather and stage == 1, **across))


def _check_zero_traffic(shape, config, cluster, est: Estimate, share: float) -> list[Finding]:
    if config.zero == 0 or config.dp == 1:
        return []
    dp_seconds = max(sum(tr.count * transfer_time(tr, cluster, est.links[tr.link])
                         for tr in stage.transfers if tr.group.startswith("dp"))
                     for stage in est.stages)
    baseline = estimate(shape, _with_stage(config, 0), cluster)
    base_seconds = baseline.comm_time_by_group()["dp"]
    extra = dp_seconds - base_seconds
    if extra <= share * est.step_time:
        return []
    # a lower stage that fits and is faster by this plan's own figures (its traffic may
    # be less exposed, or its memory buy no time: recommend it only when the step wins)
    lower = None
    for stage in range(config.zero - 1, -1, -1):
        candidate = _estimate_if_valid(shape, _with_stage(config, stage), cluster)
        if candidate is not None and candidate.fits and _wins(candidate, est):
            lower = candidate
            break
    why = {1: "", 2: f" (the gradients are reduce-scattered on every one of the "
                     f"{config.micro_batches} micro-batches)",
           3: f" (parameters are all-gathered before every forward and backward of every "
              f"one of the {config.micro_batches} micro-batches)"}[config.zero]
    if config.sharding_across_nodes():
        why = " (with " + ", ".join(flag(name) for name in config.sharding_across_nodes()) + ")"
    message = (f"ZeRO-{config.zero}'s data-parallel traffic takes {human_seconds(dp_seconds)} "
               f"of the {human_seconds(est.step_time)} step ({dp_seconds / est.step_time:.0%}"
               f"), {human_seconds(extra)} more than plain data parallelism{why}.")
    across = _across_nodes_options(shape, config, cluster, est)
    if across:  # ZeRO-3's data-parallel group crosses nodes: keep ZeRO-3, move its traffic
        flags, best, what = across[0]
        others = "; ".join(f"{f}: {human_seconds(e.step_time)}" for f, e, _ in across[1:])
        message += (f" Its group crosses nodes: {flags} {what} "
                    f"({human_bytes(best.memory['peak_total'])}, "
                    f"{human_seconds(best.step_time)} per step)"
                    + (f"; also {others}" if others else "") + ".")
    # (a win inside the advisor's tie, with more memory, is no win: _wins)
    no_lower = f" No lower stage fits and runs faster (by over {TIE:.0%}, if it takes more memory)."
    if lower is None:
        if across:
            return [Finding("ZERO_COMM_DOMINATES", "warning", message + no_lower,
                            f"add {across[0][0]}")]
        return [Finding("ZERO_COMM_DOMINATES", "info", message + no_lower,
                        "accept it, or reduce accumulation steps / use more GPUs per "
                        "replica (tp, pp) so a lower ZeRO stage fits")]
    return [Finding(
        "ZERO_COMM_DOMINATES", "warning",
        message + f" ZeRO-{lower.config.zero} fits ({human_bytes(lower.memory['peak_total'])}"
        f") and takes {human_seconds(lower.step_time)} per step.",
        f"use --zero {lower.config.zero}" + (f", or add {across[0][0]}" if across else ""))]

def _wins(candidate: Estimate, est: Estimate) -> bool:
    """Whether a lint should offer `candidate` for `est`: a faster step, by more than the
    advisor's tie (advisor.TIE) when it takes more memory (inside the time model's error,
    the headroom is worth more)."""
    if candidate.step_time >= est.step_time:
        return False
    return (candidate.memory["peak_total"] <= est.memory["peak_total"]
            or candidate.step_time * (1 + TIE) < est.step_time)


def _across_nodes_options(shape, config, cluster,
                          est: Estimate) -> list[tuple[str, Estimate, str]]:
    """ZeRO-3 across nodes (HSDP / MiCS, ZeRO++ hpZ with qwZ and qgZ, FSDP2's
    reshard_after_forward=False) for a ZeRO-3 layout whose data-parallel group crosses
    nodes: (the flags, the estimate, what it changes) of those that fit and are faster,
    fastest first."""
    if (config.zero != 3 or config.sharding_across_nodes() or not est.links["dp"]
            or shape.is_moe or config.offload_optimizer != "none"
            or config.offload_param != "none"):
        return []
    node = config.replicas // data_parallel_nodes(config, cluster.gpus_per_node)
    options = [("--reshard-after-forward false", {"reshard_after_forward": False},
                "skips the backward's gathers, keeping each unit from its forward")]
    if 1 < node < config.replicas:
        options = [(f"--hsdp-shard-size {node}", {"hsdp_shard_size": node},
                    "keeps the gathers inside the node"),
                   (f"--zero-hpz-partition-size {node}", {"zero_hpz_partition_size": node},
                    "keeps the backward's gathers inside the node"),
                   (f"--zero-hpz-partition-size {node} --zero-quantized-weights "
                    "--zero-quantized-gradients",
                    {"zero_hpz_partition_size": node, "zero_quantized_weights": True,
                     "zero_quantized_gradients": True},
                    "keeps the backward's gathers inside the node and quantises the rest")
                   ] + options
    found = []
    for flags, changes, what in options:
        try:
            candidate = estimate(shape, config.replace(**changes), cluster)
        except ConfigError:
            continue
        if candidate.fits and _wins(candidate, est):
            found.append((flags, candidate, what))
    return sorted(found, key=lambda pair: pair[1].step_time)
