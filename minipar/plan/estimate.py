"""`estimate(shape, config, cluster)`: memory, traffic, time and MFU of one training step.

    from minipar.plan import estimate, presets
    est = estimate(presets.model("gpt2-xl"), ParallelConfig(dp=8, zero=1, ...),
                   presets.cluster("a100-80gb"))
    est.memory            # the fullest rank's peak bytes by category (+ peak_total)
    est.traffic           # bytes per step the busiest rank sends, by group (dp, tp, pp)
    est.time              # step_s, bubble_fraction, mfu, tokens_per_s
    est.fits              # peak_total <= the GPU's usable memory
    est.stages            # the same per pipeline rank (first, second, last by default)
    print(est.table())

Everything is per rank: the rank at dp 0, tp 0 of each pipeline stage (all ranks of a
stage hold and run the same amounts; ring positions only change a few bytes of small
tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minipar.errors import flag
from minipar.plan.cluster import GIB, ClusterSpec
from minipar.plan.experts import expert_capacity, expert_parameter_bytes
from minipar.plan.fp8 import FP8_CALIBRATION, check_fp8_plan
from minipar.plan.layout import ParallelConfig, check_model_fits_layout, stage_plans
from minipar.plan.memory import CATEGORIES, stage_memory
from minipar.plan.offload import tier_memory, tier_transfers
from minipar.plan.pipeline_extrapolation import simulated_step_time
from minipar.plan.shapes import ModelShape
from minipar.plan.timing import (
    DP_GROUPS,
    group_links,
    overlap_modelled,
    stage_time,
    step_time,
    transfer_time,
)
from minipar.plan.traffic import GRADIENT_NORM, pipeline_receives, sent_by_group, stage_traffic


@dataclass
class StageEstimate:
    rank: int  # pipeline rank
    layers: int
    in_flight: int
    memory: dict
    traffic: dict  # bytes sent per step by group
    transfers: list
    time: dict
    memory_host: dict = field(default_factory=dict)  # the host tier (plan/offload.py)
    memory_nvme: dict = field(default_factory=dict)  # the NVMe tier
    tier_transfers: dict = field(default_factory=dict)  # bytes per step between tiers


@dataclass
class Estimate:
    shape: ModelShape
    config: ParallelConfig
    cluster: ClusterSpec
    stages: list[StageEstimate]
    time: dict
    links: dict = field(default_factory=dict)

    @property
    def worst_stage(self) -> StageEstimate:
        return max(self.stages, key=lambda s: s.memory["peak_total"])

    @property
    def memory(self) -> dict:
        """Peak bytes by category on the fullest rank."""
        return {k: v for k, v in self.worst_stage.memory.items() if k != "detail"}

    @property
    def groups(self) -> tuple[str, ...]:
        """The groups a step's traffic is reported by (cp and ep when they are used)."""
        return report_groups(self.config)

    @property
    def traffic(self) -> dict:
        """Bytes per step the busiest rank sends, per group."""
        return {group: max(s.traffic[group] for s in self.stages) for group in self.groups}

    @property
    def memory_host(self) -> dict:
        """Peak bytes by category of the host tier behind the fullest rank (offload)."""
        return max((s.memory_host for s in self.stages), key=lambda m: m["peak_total"])

    @property
    def memory_nvme(self) -> dict:
        return max((s.memory_nvme for s in self.stages), key=lambda m: m["peak_total"])

    @property
    def fits(self) -> bool:
        """The fullest GPU's peak fits its usable memory, and what it offloads fits the
        host memory and NVMe drive behind it."""
        return (self.memory["peak_total"] <= self.cluster.usable_memory
                and self.memory_host["peak_total"] <= self.cluster.host_memory_bytes
                and self.memory_nvme["peak_total"] <= self.cluster.nvme_bytes)

    @property
    def step_time(self) -> float:
        return self.time["step_s"]

    @property
    def mfu(self) -> float:
        return self.time["mfu"]

    def comm_time_by_group(self) -> dict[str, float]:
        """Seconds per step the slowest rank spends in each group (pp: sends and receives)."""
        totals = dict.fromkeys(self.groups, 0.0)
        for stage in self.stages:
            per = dict.fromkeys(totals, 0.0)
            # the DP reduction and gathers bucket by bucket, hidden or not (overlap.py)
            per["dp"] = stage.time.get("dp_comm_s", 0.0)
            received = pipeline_receives(self.shape, self.config, stage.rank, self.cluster)
            for tr in stage.transfers + received:
                if tr.group == "dp" and tr.label != GRADIENT_NORM:
                    continue
                seconds = tr.count * transfer_time(tr, self.cluster, self.links[tr.link])
                per[tr.group] += seconds
                if tr.group in DP_GROUPS and tr.label != GRADIENT_NORM:  # (HSDP's: in
                    per["dp"] -= seconds                                # dp_comm_s too)
            per["dp"] = max(0.0, per["dp"])  # (round-off of the subtraction)
            for group in totals:
                totals[group] = max(totals[group], per[group])
        return totals

    def moe(self) -> dict:
        """The report's moe figures, predicted for the fullest rank: `expert_param_bytes` as
        one entry of the report's per-rank list; the all-to-all bytes and seconds per step
        (the report's `all_to_all_sent_bytes` are over the run)."""
        c, shape = self.config, self.shape
        stage = self.worst_stage
        return {"num_experts": shape.moe_num_experts, "top_k": shape.moe_top_k,
                "capacity_factor": shape.moe_capacity_factor, "ep": c.ep,
                "capacity": expert_capacity(shape, c.micro_batch_size * shape.seq_len),
                "expert_param_bytes": stage.memory["detail"]["expert_parameters"]
                * c.bytes.param,
                "all_to_all_sent_bytes_per_step": sum(t.sent_per_step for t in stage.transfers
                                             if t.op == "all_to_all"),
                "all_to_all_s": sum(t.count * transfer_time(t, self.cluster,
                                                            self.links[t.link])
                                    for t in stage.transfers if t.op == "all_to_all"),
                "ep_crosses_nodes": bool(self.links["ep"])}

    def to_dict(self) -> dict:
        return {
            "schema": "minipar.plan/1",
            "model": {**self.shape.__dict__, "n_params": self.shape.n_params},
            "config": self.config.to_dict(),
            "cluster": dict(self.cluster.__dict__),
            # the compute model as the plan prints it, with what each constant was fitted on
            "compute_model": compute_model(self.cluster, self.config.flash_attention,
                                           self.config.fp8_format),
            "world_size": self.config.world_size,
            "fits": self.fits,
            "memory": self.memory,
            "memory_accounting": {"name": self.config.memory_accounting, "terms": [
                {"name": t.name, "category": t.category, "bytes": t.nbytes}
                for t in self.worst_stage.memory["detail"]["accounting"]]},
            "memory_host": self.memory_host,
            "memory_nvme": self.memory_nvme,
            "traffic": self.traffic,
            "time": self.time,
            "comm_time": self.comm_time_by_group(),
            "links_cross_nodes": {g: bool(v) for g, v in self.links.items()},
            **({"moe": self.moe()} if self.shape.is_moe else {}),
            "stages": [{"pp_rank": s.rank, "layers": s.layers, "in_flight": s.in_flight,
                        "memory": {k: v for k, v in s.memory.items() if k != "detail"},
                        "traffic": s.traffic,
                        "memory_host": s.memory_host, "memory_nvme": s.memory_nvme,
                        "transfers": s.tier_transfers,
                        "time": {k: v for k, v in s.time.items() if k != "flops"},
                        "flops_per_micro_batch": s.time["flops"]} for s in self.stages],
        }

    def table(self) -> str:
        return format_estimate(self)


def estimate(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec, *,
             all_stages: bool = False, exact_pipeline: bool = True,
             scatter_gather: bool = False) -> Estimate:
    """Predict one optimizer step of `shape` trained with `config` on `cluster`.

    all_stages: estimate every pipeline rank (default: layout.stage_plans's, which bound
    the others). exact_pipeline: time a pipeline by simulating its schedule
    (minipar.parallel.pipeline.simulator.simulate_step; O(p m v)); False uses the closed form
    (Narayanan et al. 2021), which the advisor uses to search fast and which agrees when
    compute dominates.
    scatter_gather: price pipeline messages as Megatron-LM sends them across TP
    (pipeline_step.p2p_message_seconds); minipar's own pipeline does not (the default).
    """
    check_model_fits_layout(shape, config)
    check_fp8_plan(shape, config.fp8_format, cluster)
    plans = stage_plans(shape, config, all_stages, cluster.gpus_per_node)
    stages = []
    for plan in plans:
        transfers = stage_traffic(shape, config, plan, cluster.gpus_per_node)
        tiers = tier_memory(shape, config, plan)
        stages.append(StageEstimate(
            rank=plan.rank, layers=plan.layers, in_flight=plan.in_flight,
            memory=stage_memory(shape, config, plan), traffic=sent_by_group(transfers),
            transfers=transfers, time=stage_time(shape, config, cluster, plan, transfers),
            memory_host=tiers["host"], memory_nvme=tiers["nvme"],
            tier_transfers=tier_transfers(shape, config, plan)))
    time = None
    if exact_pipeline and config.pp > 1:  # (None: too long to walk)
        time = simulated_step_time(shape, config, cluster, scatter_gather=scatter_gather)
    if time is not None:
        for stage in stages:  # the schedule's p2p waits and the tail, per rank
            stage.time["exposed_comm_s"] = time["rank_exposed_comm_s"][stage.rank]
    else:
        time = step_time(config, [s.time for s in stages], shape, cluster,
                         [p.rank for p in plans])
    time["exposed_comm_s"] = max(time.get("rank_exposed_comm_s")  # HTA's, the busiest rank's
                                 or [s.time["exposed_comm_s"] for s in stages])
    time["dp_comm_s"] = max(s.time["dp_comm_s"] for s in stages)
    if config.fp8_format is not None:  # the MFU NVIDIA's FP8 tables print: of the FP8 peak
        time["mfu_fp8_peak"] = time["mfu"] * cluster.peak_flops / cluster.roofline.fp8_peak_flops
    time["overlap_contention_s"] = max(time["rank_contention_s"]) if "rank_contention_s" in \
        time else max(s.time["overlap_contention_s"] for s in stages)
    return Estimate(shape, config, cluster, stages, time, links=group_links(config, cluster))


def report_groups(config: ParallelConfig) -> tuple[str, ...]:
    kinds = {"cp": config.cp > 1, "ep": config.ep > 1, "dp_shard": config.hsdp_shard_size,
             "dp_replicate": config.hsdp_shard_size and config.replicas > config.sharding_group,
             "dp_secondary": config.secondary_partition,  # (qgZ's two levels:)
             **dict.fromkeys(("dp_intra_node", "dp_inter_node"), config.zero_quantized_gradients)}
    return ("dp", "tp", "pp") + tuple(kind for kind, used in kinds.items() if used)


# ------------------------------------------------------------------ text
def human_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.2f} us"


def fp8_mfu(est: Estimate) -> str:
    """Under FP8, the MFU of the FP8 peak beside the 16-bit one (NVIDIA's FP8 tables
    divide by the FP8 peak; `mfu` stays of the 16-bit peak, comparable across plans)."""
    if est.config.fp8_format is None:
        return ""
    return f" of the bf16 peak ({est.time['mfu_fp8_peak']:.1%} of FP8's)"


def compute_model(cluster: ClusterSpec, fused_attention: bool = True,
                  fp8_format: str | None = None) -> str:
    """How the cluster prices compute, in a few words, and what calibrates it (the fused
    attention kernel's rates only for a plan that fuses attention; the FP8 GEMMs' fit
    for a plan in FP8)."""
    if fp8_format is not None:  # (estimate() has checked the roofline prices FP8)
        return (f"on the {cluster.roofline.name} roofline, the layers' GEMMs in FP8 "
                f"({fp8_format}) at {cluster.roofline.fp8_gemm_efficiency:.0%} of the FP8 "
                f"peak, fitted on {FP8_CALIBRATION}, the rest as in bf16 "
                f"({compute_model(cluster, fused_attention)})")
    if cluster.roofline is None:
        how = f"at {cluster.efficiency:.0%} kernel efficiency"
    elif not fused_attention:
        how = f"on the {cluster.roofline.name} roofline, attention unfused (op by op)"
    else:
        how = f"on the {cluster.roofline.name} roofline, fused attention " + (
            "as a GEMM" if cluster.roofline.attention is None
            else f"at {cluster.roofline.attention.name}'s {cluster.roofline.attention.rate}")
    if cluster.calibration is None:
        return how + " (uncalibrated: no published run fitted or checked on this profile)"
    return how + f" (calibrated on {cluster.calibration})"


def moe_line(est: Estimate) -> str:
    """The MoE shape and what expert parallelism gives the fullest rank."""
    shape, c = est.shape, est.config
    factor = shape.moe_capacity_factor
    cap = expert_capacity(shape, c.micro_batch_size * shape.seq_len)
    experts = expert_parameter_bytes(shape, c.ep, c.bytes.param, c.tp)
    local = shape.moe_num_experts // c.ep
    line = (f"MoE: {shape.n_moe_layers} of {shape.n_layer} layers, {shape.moe_num_experts} "
            f"experts, top-{shape.moe_top_k}, "
            + ("dropless (planned balanced)" if factor is None else f"capacity factor {factor}")
            + f": C = {cap} slots per expert; {local} expert{'s' * (local > 1)} per ep rank"
            + (f", each cut over tp={c.tp}" if c.tp > 1 else "")
            + f" ({human_bytes(experts)} of expert parameters per GPU)")
    if c.ep > 1:
        line += (f", 4 all-to-alls per MoE layer and micro-batch over ep={c.ep}"
                 + (" (crosses nodes)" if est.links["ep"] else " (inside a node)"))
    return line


def accounting_lines(est: Estimate) -> list[str]:
    """What the chosen memory accounting counts beyond the paper's, on the fullest rank."""
    terms = est.worst_stage.memory["detail"]["accounting"]
    return [f"  {'+' if t.nbytes >= 0 else '-'} {human_bytes(abs(t.nbytes))} {t.category}: "
            f"{t.name}" for t in terms if t.nbytes]


def format_estimate(est: Estimate) -> str:
    """A plain-text table: memory per pipeline rank by category, traffic, time."""
    c, shape, groups = est.config, est.shape, est.groups
    lines = [
        f"{shape.name}: {shape.n_params / 1e9:.2f}B parameters"
        + (f" ({shape.n_active_params / 1e9:.2f}B active)" if shape.is_moe else "")
        + f", {shape.n_layer} layers, h={shape.d_model}, seq {shape.seq_len}, vocab "
          f"{shape.vocab_size}",
        *([moe_line(est)] if shape.is_moe else []),
        f"layout: dp={c.dp} tp={c.tp} pp={c.pp}" + (f" cp={c.cp}" if c.cp > 1 else "")
        + (f" ep={c.ep}" if c.ep > 1 else "")
        + f" ({c.world_size} GPUs on {est.cluster.name}, "
        f"{est.cluster.gpus_per_node}/node{c.rank_order_label}), ZeRO-{c.zero}, "
        f"{c.schedule_label}"
        + f", micro-batch {c.micro_batch_size} x {c.micro_batches} accum x dp {c.dp} = "
          f"global {c.global_batch_size}, {c.precision}"
        + (f" with FP8 GEMMs ({c.fp8_format}"
           + (", FP8 parameters)" if c.fp8_param_gather else ")")
           if c.fp8_format is not None else "")
        + (f", recompute {c.recompute.label}" if c.recomputes else "")
        + (", sequence parallel" if c.sequence_parallel else "")
        + (", flash attention" if c.flash_attention else "")
        + (", ring attention" + ("" if c.cp_load_balance else " without load balancing")
           if c.cp > 1 else ""),
        "",
    ]
    header = ["pp rank", "layers", "in flight", *CATEGORIES, "total",
              *(f"{g} sent" for g in groups)]
    rows = [header]
    for s in est.stages:
        rows.append([str(s.rank), str(s.layers), str(s.in_flight)]
                    + [human_bytes(s.memory[k]) for k in CATEGORIES]
                    + [human_bytes(s.memory["peak_total"])]
                    + [human_bytes(s.traffic[g]) for g in groups])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    t = est.time
    usable = est.cluster.usable_memory
    lines += [
        "",
        f"memory: {human_bytes(est.memory['peak_total'])} of {human_bytes(usable)} usable "
        f"per GPU -> {'fits' if est.fits else 'DOES NOT FIT'}"
        + (f" ({c.memory_accounting}'s accounting)" if c.memory_accounting != "paper"
           else ""),
        *accounting_lines(est),
        f"step: {human_seconds(t['step_s'])} (pipeline {human_seconds(t['pipeline_s'])}, "
        f"after the last backward {human_seconds(t['tail_s'])}), bubble "
        f"{t['bubble_fraction']:.1%}, MFU {t['mfu']:.1%}{fp8_mfu(est)} "
        f"{compute_model(est.cluster, est.config.flash_attention, c.fp8_format)}, "
        f"{t['tokens_per_s']:,.0f} tokens/s",
    ]
    if c.offload_optimizer != "none" or c.offload_param != "none":
        host, nvme = est.memory_host, est.memory_nvme
        moved = max(est.stages, key=lambda st: st.memory_host["peak_total"]).tier_transfers
        lines.append(
            f"offload (optimizer {c.offload_optimizer}, params {c.offload_param}): host "
            f"{human_bytes(host['peak_total'])} of {human_bytes(est.cluster.host_memory_bytes)}"
            f", NVMe {human_bytes(nvme['peak_total'])} per GPU; per step PCIe down "
            f"{human_bytes(moved['to_host_bytes'])}, up {human_bytes(moved['to_device_bytes'])}"
            f", NVMe read {human_bytes(moved['nvme_read_bytes'])}, write "
            f"{human_bytes(moved['nvme_write_bytes'])}; CPU Adam "
            f"{human_seconds(max(st.time['host_optimizer_s'] for st in est.stages))}")
    comm = est.comm_time_by_group()
    lines.append("communication per step: " + ", ".join(
        f"{g} {human_seconds(comm[g])}" + (" (crosses nodes)" if est.links[g] else "")
        for g in groups))
    lines.append(
        f"exposed communication (not hidden behind compute): "
        f"{human_seconds(t['exposed_comm_s'])} per step on the busiest rank, of "
        f"{human_seconds(sum(comm.values()))}; overlap: "
        + ("gradient buckets priced as they block (MoE: two engines, not in the overlap "
           "model)" if shape.is_moe else
           "gradient buckets waited for" if not c.overlap_grad_reduce else
           "gradient buckets reduced during backward" if c.zero == 3 or c.bucket_size_mb > 0
           # complete only when backward ends: nothing to hide it behind
           else "one gradient bucket, reduced after backward (--bucket-size-mb to overlap)")
        + ("" if shape.is_moe else c.reductions_in_flight_label)
        + (", parameter all-gathers overlapped with the next forward"
           if c.overlap_param_gather and c.bucket_size_mb > 0 else "")
        + (f", ZeRO-3 prefetch {'on' if c.zero3_prefetch else 'off'}" if c.zero == 3 else "")
        + ("" if overlap_modelled(c) else "; " + ", ".join(
            flag(name) for name in c.sharding_across_nodes()) + ": collectives priced as they "
           "block"))
    if t["overlap_contention_s"]:
        lines.append(
            f"overlap contention: the hidden data-parallel collectives slow the compute "
            f"beside them by {human_seconds(t['overlap_contention_s'])} per step "
            f"({est.cluster.overlap_contention:g} x their time at NVLink's rate; "
            "minipar.plan.timing.overlap_contention_seconds)")
    return "\n".join(lines)
