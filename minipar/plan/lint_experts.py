"""The lint checks of a mixture-of-experts layout (lint.py runs them and wraps each as a
Finding: code, severity, message, fix):

    EP_ACROSS_NODES      the expert-parallel group spans nodes: its four all-to-alls per
                         MoE layer and micro-batch run on InfiniBand (warning)
    EXPERTS_NEED_EP      the layout does not fit and the experts are the largest model
                         state; a larger --ep that fits is named (error, DOES_NOT_FIT's fix)
    EP_WITHOUT_NEED      ep > 1 across nodes although ep 1 fits: the all-to-alls buy
                         memory that was not short (info)

An expert-parallel group is ep consecutive data-parallel indices, spaced a data-parallel
stride apart (ParallelConfig.strides: tp x cp x pp in minipar's mesh, tp x cp in
Megatron-LM's default order), so it stays inside a node when ep x that stride divides
the GPUs per node.
"""

from __future__ import annotations

from dataclasses import replace

from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import Estimate, estimate, human_bytes, human_seconds
from minipar.plan.experts import expert_parameter_bytes
from minipar.plan.layout import MINIPAR_ORDER, ParallelConfig
from minipar.plan.shapes import ModelShape


def expert_parallel_sizes(shape: ModelShape, config: ParallelConfig) -> list[int]:
    """The ep sizes this layout allows: divisors of dp that divide the experts."""
    return [ep for ep in range(1, config.dp + 1)
            if config.dp % ep == 0 and shape.moe_num_experts % ep == 0]


def check_expert_parallel(shape: ModelShape, config: ParallelConfig, cluster: ClusterSpec,
                          est: Estimate) -> list[tuple[str, str, str, str]]:
    if not shape.is_moe:
        return []
    findings = []
    stride = config.strides["dp"]
    minipars = config.rank_order == MINIPAR_ORDER  # (Megatron-LM's: pp does not space it)
    spaced = "tp x cp x pp" if minipars else "tp x cp"
    if config.ep > 1 and est.links["ep"]:
        across = est.comm_time_by_group()["ep"]
        # the same all-to-alls if every link were the node's (NVLink)
        fast = replace(cluster, inter_node_bandwidth=cluster.intra_node_bandwidth,
                       inter_node_latency=cluster.intra_node_latency)
        on_nvlink = estimate(shape, config, fast).comm_time_by_group()["ep"]
        fitting = [ep for ep in expert_parallel_sizes(shape, config)
                   if ep * stride <= cluster.gpus_per_node and ep < config.ep]
        fix = f"keep ep x {spaced} within the {cluster.gpus_per_node} GPUs of a node: "
        if fitting and fitting[-1] > 1:
            held = expert_parameter_bytes(shape, fitting[-1], config.bytes.param, config.tp)
            fix += f"--ep {fitting[-1]} ({human_bytes(held)} of expert parameters per GPU)"
        else:
            fix += f"lower {'tp x pp' if minipars else 'tp'}, or --ep 1"
        findings.append((
            "EP_ACROSS_NODES", "warning",
            f"ep={config.ep} with {spaced} = {stride} and {cluster.gpus_per_node} GPUs "
            f"per node: the expert-parallel group spans nodes, so its four all-to-alls per "
            f"MoE layer and micro-batch ({human_bytes(est.traffic['ep'])} per GPU per step) "
            f"take {human_seconds(across)}, against {human_seconds(on_nvlink)} inside a node.",
            fix))
        dense = estimate(shape, config.replace(ep=1), cluster)
        if dense.fits:
            findings.append((
                "EP_WITHOUT_NEED", "info",
                f"ep 1 fits too ({human_bytes(dense.memory['peak_total'])} of "
                f"{human_bytes(cluster.usable_memory)}) and sends no token across nodes: "
                f"step {human_seconds(dense.step_time)} against "
                f"{human_seconds(est.step_time)}.", "consider --ep 1"))
    if not est.fits:
        experts = expert_parameter_bytes(shape, config.ep, config.bytes.param, config.tp)
        for ep in expert_parallel_sizes(shape, config):
            if ep <= config.ep:
                continue
            candidate = estimate(shape, config.replace(ep=ep), cluster)
            if candidate.fits:
                findings.append((
                    "EXPERTS_NEED_EP", "error",
                    f"the experts are {human_bytes(experts)} of parameters per GPU with "
                    f"ep={config.ep} (each GPU holds {shape.moe_num_experts // config.ep} of "
                    f"{shape.moe_num_experts} experts, with their gradients and optimizer "
                    f"state); ep={ep} keeps {shape.moe_num_experts // ep} per GPU and fits "
                    f"({human_bytes(candidate.memory['peak_total'])}).",
                    f"--ep {ep}" + (" (its all-to-alls cross nodes)"
                                    if candidate.links["ep"] else "")))
                break
    return findings
