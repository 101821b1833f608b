"""What the advisor's search found (`Advice`: the layouts that fit, ranked by step time)
and why the best one wins, in the terms of the 3D-parallelism interview answer: what TP
keeps inside a node, what PP and DP cross, what ZeRO shards, why recomputation is on or
off, the batch arithmetic and the runner-up (`explain`), and the ranking as a table
(`format_ranking`). The search itself is minipar/plan/advisor.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.nn.recompute import Recompute
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import Estimate, estimate, human_bytes, human_seconds
from minipar.plan.experts import expert_parameter_bytes
from minipar.plan.shapes import ModelShape


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
        f"ZeRO-{c.zero}, {f'{c.schedule_label}, ' if c.pp > 1 else ''}"
        f"micro-batch {c.micro_batch_size}, "
        f"{f'recompute {c.recompute.label}, ' if c.recomputes else ''}"
        f"step {human_seconds(t['step_s'])}, MFU {t['mfu']:.1%}"
        f"{' of the bf16 peak' if c.fp8_format is not None else ''}.",
        "",
        f"- The model state (parameters, gradients, optimizer) is "
        f"{human_bytes(replica)} in {c.precision} ({c.bytes.param} + {c.bytes.grad} + "
        f"{c.bytes.optimizer} bytes per parameter: the ZeRO paper's count with "
        f"{c.grad_dtype} gradient buffers): "
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
            f"{human_seconds(comm['tp'])} on NVLink). Across nodes each GPU's NIC is "
            f"{cluster.intra_node_bandwidth / cluster.inter_node_bandwidth:.0f}x slower than "
            f"its NVLink, and each ring step from one node to the next pays "
            f"{cluster.inter_node_latency / cluster.intra_node_latency:.1f}x the latency."
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
            f"{c.micro_batches} micro-batches per step leave a bubble of "
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
    elif split:
        lines.append("- No data parallelism: all GPUs are needed to hold one model replica.")
    else:  # a replica fits on fewer GPUs: what kept dp at 1 is the batch, or the clock
        lines.append("- No data parallelism: " + _why_no_data_parallelism(advice))
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
            f"ZeRO-{r.zero},{f' {r.schedule_label},' if r.pp > 1 else ''} micro-batch "
            f"{r.micro_batch_size}"
            f"{'' if not r.recomputes else ' with ' + r.recompute.label + ' recomputation'}"
            f", step {human_seconds(runner_up.step_time)} ({_against(runner_up, est)}).")
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


def _why_no_data_parallelism(advice: Advice) -> str:
    """Why the best layout has dp = 1 although one replica needs fewer GPUs than it has:
    no layout with dp > 1 splits the global batch, or those that do are slower."""
    if any(e.config.dp > 1 for e in advice.ranked):
        return ("layouts with data parallelism fit too, but are slower here (the table "
                "lists them).")
    if any(e.config.dp > 1 for e in advice.not_fitting):  # tried: memory was the reason
        return ("the layouts with data parallelism do not fit in memory: with dp > 1 "
                "each GPU holds more of the model than when the GPUs split it.")
    replicas = [d for d in range(2, advice.gpus + 1) if advice.gpus % d == 0]
    return (f"the global batch of {advice.global_batch_size} sequences does not split "
            f"evenly over {' or '.join(map(str, replicas))} replicas, so all {advice.gpus} "
            f"GPUs serve one replica; a --global-batch-size that is a multiple of "
            f"{advice.gpus} lets the planner try data parallelism.")


def format_ranking(advice: Advice, top: int = 5) -> str:
    """A table of the `top` fitting layouts."""
    moe = advice.shape.is_moe
    header = ["#", "dp", "tp", "pp", "cp", *(["ep"] if moe else []), "zero", "sched", "mb",
              "accum", "recompute", "memory", "step", "bubble", "MFU"]
    rows = [header]
    closed_form = False  # a pipelined row priced by the closed form, not simulated
    for i, e in enumerate(advice.ranked[:top], start=1):
        c = e.config
        rough = c.pp > 1 and "simulated_micro_batches" not in e.time
        closed_form |= rough
        rows.append([str(i), str(c.dp), str(c.tp), str(c.pp), str(c.cp),
                     *([str(c.ep)] if moe else []), str(c.zero), c.schedule_label,
                     str(c.micro_batch_size), str(c.micro_batches),
                     c.recompute.label,
                     human_bytes(e.memory["peak_total"]),
                     ("~" if rough else "") + human_seconds(e.step_time),
                     f"{e.time['bubble_fraction']:.1%}", f"{e.mfu:.1%}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if closed_form:
        lines.append("(~: the pipeline's closed form, within about 1% of its simulated "
                     "schedule, which `minipar plan` of that layout runs)")
    if advice.ranked and advice.ranked[0].config.fp8_format is not None:
        lines.append(f"(FP8 GEMMs, {advice.ranked[0].config.fp8_format}: MFU of the bf16 "
                     "peak; of the FP8 peak it is half)")
    return "\n".join(lines)


def _against(runner_up: Estimate, best: Estimate) -> str:
    """The runner-up's step against the best's: slower, or faster by less than the tie
    the advisor allows (advisor.rank_by_time_then_headroom), where more headroom wins."""
    change = runner_up.step_time / best.step_time - 1
    if change >= 0:
        return f"+{change:.1%}"
    return (f"{-change:.1%} faster: a tie, and the layout above leaves "
            f"{human_bytes(runner_up.memory['peak_total'] - best.memory['peak_total'])} "
            "more memory free")
