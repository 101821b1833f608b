"""The report: what a run measured, in the schema `minipar.report/1` (docs/design.md).

This is the public contract: notebooks, widgets, the CLI and checks outside the repo read
it. Add fields freely; rename none. `report.schema.json` beside this file is the JSON
Schema (schema.py: `validate_report()` checks a report dict against it).

`report_from_run(config, results, devices, warnings)` gives the report its shape: the
training loop (loop.py) hands over what every rank returned, the virtual devices that
measured it (ledger, comm log, clock) and the layout's warnings, and gets the Report back.
Every section of the report is built here, in one place:

    steps     the ranks' step records merged (the loss of the global batch)
    ranks     each device's summary (memory, comm, time: + exposed / overlapped comm)
              + coords, sharding, flops, recompute_flops (the forwards run again
              in backward, within flops)
    layout    the mesh, the nodes and every group
    traffic   bytes rank i sent to rank j, in total and by group kind
    pipeline  the schedule, measured bubble and the uniform-stage formula (pp > 1)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minipar import distributed as dist
from minipar.distributed.comm_log import GROUP_KINDS
from minipar.distributed.timeline import (
    bubble_fraction,
    communication_share,
    labelled_compute_seconds,
)
from minipar.files import atomic_write
from minipar.nn.gpt import parameter_shapes
from minipar.parallel.pipeline.schedules.registry import (
    SCHEDULES,
    uniform_bubble_fraction,
)
from minipar.parallel.pipeline.stage import split_layers
from minipar.train import checkpoint
from minipar.train.build import device_mesh
from minipar.train.config import TrainConfig, gpt_config
from minipar.train.schema import validate_report

SCHEMA = "minipar.report/1"
MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


@dataclass
class Report:
    config: dict
    world_size: int
    n_params: int
    steps: list[dict] = field(default_factory=list)
    ranks: list[dict] = field(default_factory=list)
    pipeline: dict | None = None
    moe: dict | None = None
    equivalence: dict | None = None
    layout: dict | None = None  # mesh, nodes, groups, tp_group_crosses_nodes
    warnings: list[str] = field(default_factory=list)  # runs, but costs more than needed
    traffic: dict | None = None  # {"matrix": bytes rank i sent to j, "by_group": {...}}
    step_end_s: list[float] | None = None  # simulated time when each step ended (all ranks)
    device: dict | None = None  # the simulated GPU (minipar.distributed.DeviceProfile's fields)
    profile: dict | None = None  # minipar profile's figures and verdict (--profile)
    engine: dict | None = None  # what ran the ranks, when chosen (absent: threads)
    # Not part of the JSON contract: per-rank timeline events (for plots) and the final
    # consolidated single-device state dict (for equivalence checks and inspection).
    timelines: list[list[dict]] | None = field(default=None, repr=False)
    # per rank, every transfer as the comm stream ran it, also while the rank computed:
    # {"op", "group", "sent_bytes", "recv_bytes", "start", "end"} (from the byte ledger)
    transfers: list[list[dict]] | None = field(default=None, repr=False)
    state_dict: dict | None = field(default=None, repr=False)
    reference: Report | None = field(default=None, repr=False)  # check: the 1-device run

    # -------------------------------------------------------------- reading helpers
    @property
    def losses(self) -> list[float]:
        return [s["loss"] for s in self.steps]

    def memory(self, category: str) -> list[int]:
        """Peak bytes of one memory category, per rank."""
        return [r["memory"][category] for r in self.ranks]

    def step_window(self, step: int = -1) -> tuple[float, float]:
        """[start, end] of one optimizer step on the simulated clock (default: the last),
        from the slowest rank's end of the previous step to the slowest rank's end of it."""
        ends = self.step_end_s
        if not ends:
            raise ValueError("this report has no step times (step_end_s)")
        index = step % len(ends)
        return (ends[index - 1] if index else 0.0), ends[index]

    def sent_bytes(self, group: str | None = None) -> list[float]:
        """Bytes each rank sent, in total or in one group kind ("dp", "tp", "pp")."""
        if group is None:
            return [r["comm"]["sent_bytes"] for r in self.ranks]
        return [r["comm"]["by_group"].get(group, 0) for r in self.ranks]

    # -------------------------------------------------------------- serialisation
    def to_dict(self) -> dict:
        out = {
            "schema": SCHEMA,
            "config": self.config,
            "world_size": self.world_size,
            "n_params": self.n_params,
            "steps": self.steps,
            "ranks": self.ranks,
        }
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline
        if self.moe is not None:
            out["moe"] = self.moe
        if self.equivalence is not None:
            out["equivalence"] = self.equivalence
        if self.layout is not None:
            out["layout"] = self.layout
        out["warnings"] = self.warnings
        if self.traffic is not None:
            out["traffic"] = self.traffic
        if self.step_end_s is not None:
            out["step_end_s"] = self.step_end_s
        if self.device is not None:
            out["device"] = self.device
        if self.profile is not None:
            out["profile"] = self.profile
        if self.engine is not None:
            out["engine"] = self.engine
        return out

    def to_json(self, path: str | Path | None = None, indent: int = 2) -> str:
        """The report as JSON text; also written to `path` when given, whole or not at
        all (minipar.files.atomic_write: an earlier file there survives a full disk)."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with atomic_write(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict) -> Report:
        """A report read back from its JSON sections (the fields not in JSON stay None)."""
        validate_report(data)
        optional = ("pipeline", "moe", "equivalence", "layout", "traffic", "step_end_s",
                    "device", "profile", "engine")
        return cls(**{k: data[k] for k in ("config", "world_size", "n_params", "steps",
                                            "ranks")},
                   warnings=data.get("warnings", []), **{k: data.get(k) for k in optional})

    @classmethod
    def from_json(cls, path: str | Path) -> Report:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


# ------------------------------------------------------------------ a run's report
def report_from_run(config: TrainConfig, results: list[dict], devices,
                    warnings: list[str]) -> Report:
    """The Report of one launch: `results[i]` is what rank i's program returned (steps,
    step_ends, coords, pieces, sharding), `devices[i]` its virtual device, `warnings`
    what check_layout said of the layout before the run."""
    steps = [merge_step(list(records)) for records in zip(*(r["steps"] for r in results),
                                                           strict=True)]
    ranks = []
    for result, device in zip(results, devices, strict=True):
        summary = device.summary()
        summary["coords"] = result["coords"]
        summary["sharding"] = result["sharding"]
        summary["flops"] = _flops(device)
        summary["recompute_flops"] = device.recompute_flops  # part of flops["forward"]
        overlap = dist.device_comm_overlap(device)  # (one pass over the rank's timeline)
        # Communication no compute hides (HTA's "non-compute" time), over the run.
        summary["time"]["exposed_comm_s"] = overlap["exposed_comm_s"]
        # ... and the transfer time compute did hide (async buckets, ZeRO-3 prefetch).
        summary["time"]["overlapped_comm_s"] = overlap["overlapped_comm_s"]
        ranks.append(summary)
    held = [(f"rank {rank}", result["coords"], piece)
            for rank, result in enumerate(results) for piece in result["pieces"]]
    # Replicas must agree; with check on, a difference is reported, not raised.
    state_dict = checkpoint.assemble(held, config.to_dict(), strict=not config.check)["param"]
    shapes = parameter_shapes(gpt_config(config, config.vocab_size))
    state_dict = checkpoint.in_model_order(state_dict, shapes)
    timelines = [device.clock.events for device in devices]
    report = Report(config=config.to_dict(), world_size=config.world_size,
                    n_params=int(sum(np.prod(s) for s in shapes.values())), steps=steps,
                    ranks=ranks, timelines=timelines, transfers=_transfers(devices),
                    state_dict=state_dict,
                    layout=_layout(config), warnings=list(warnings),
                    traffic=_traffic(devices), device=dataclasses.asdict(devices[0].profile),
                    step_end_s=[max(ends) for ends in zip(*(r["step_ends"] for r in results),
                                                          strict=True)])
    if config.pp > 1:
        report.pipeline = _pipeline(config, timelines, [r["coords"] for r in results])
    if config.moe_num_experts:
        report.moe = _moe(config, results, devices)
    return report


def add_engine(report: Report, launched) -> None:
    """`engine`: what ran the ranks; on an engine that measures (torch), each rank's
    `measured`: wall seconds per step (the rank program's marks), in comm, bytes on wire."""
    report.engine = launched.engine
    for summary, result, measured in zip(report.ranks, launched.results,
                                         launched.measured or (), strict=False):
        steps = np.diff([result["wall_loop_start"], *result["wall_step_ends"]]).tolist()
        summary["measured"] = {"wall_step_s": steps, **measured}


def _moe(config: TrainConfig, results: list[dict], devices) -> dict:
    """The MoE section: per MoE layer, tokens routed to each expert over the run (summed
    over the DP ranks, before dropping; TP ranks route the same tokens, so TP rank 0's
    count) and the dropped share; per step, the aux loss; per rank, the expert parameter
    bytes it holds and the all-to-all bytes it sent (minipar/parallel/expert/dispatch.py)."""
    routers = [r for r in results if r["coords"].get("tp", 0) == 0]
    by_layer: dict[str, list[dict]] = {}
    for result in routers:  # a pipeline stage holds only its own layers
        for totals in result["routing"]:
            by_layer.setdefault(totals["name"], []).append(totals)
    layers = []
    for name in sorted(by_layer, key=lambda n: int(n.split(".")[1])):
        per_rank = by_layer[name]
        tokens = np.sum([t["tokens_per_expert"] for t in per_rank], axis=0)
        assigned = sum(t["assigned"] for t in per_rank)
        dropped = sum(t["dropped"] for t in per_rank)
        layers.append({"name": name, "tokens_per_expert": [int(t) for t in tokens],
                       "assigned": int(assigned), "dropped": int(dropped),
                       "dropped_fraction": dropped / assigned if assigned else 0.0,
                       "max_over_mean_load": float(tokens.max() / tokens.mean())
                       if tokens.sum() else 0.0})
    # The aux loss of a step: every layer's (summed over the pipeline stages that hold
    # them), averaged over the DP ranks' micro-batches, as the objective weighs it.
    dp = config.dp * config.cp
    aux = [float(sum(r["steps"][k]["aux_loss"] for r in routers) / dp)
           for k in range(len(results[0]["steps"]))]
    expert_bytes = [sum(p.values.nbytes for p in r["pieces"] if ".mlp.experts." in p.name)
                    for r in results]
    return {"num_experts": config.moe_num_experts, "top_k": config.moe_top_k,
            "capacity_factor": config.moe_capacity_factor, "ep": config.ep,
            "layers": layers, "aux_loss": aux, "expert_param_bytes": expert_bytes,
            "all_to_all_sent_bytes": [d.comm.sent_by_op.get("all_to_all", 0)
                                      for d in devices]}


def merge_step(records: list[dict]) -> dict:
    """One step of the report from every rank's record: the loss of the global batch is
    the mean of the ranks' losses (each a mean over equally many sequences)."""
    first = records[0]
    return {"step": first["step"], "loss": float(np.mean([r["loss"] for r in records])),
            "lr": first["lr"], "grad_norm": first["grad_norm"]}


def _flops(device) -> dict[str, float]:
    """FLOPs a rank computed, by kind, from its simulated clock (time x FLOP/s): the
    GPU's kinds at its FLOP rate, and with offload the host's CPU Adam ("host_optimizer")
    at the host's."""
    seconds = dict.fromkeys(("forward", "backward", "optimizer"), 0.0)
    host = 0.0
    for event in device.clock.events:
        if event.kind in seconds:
            seconds[event.kind] += event.end - event.start
        elif event.kind == "host_optimizer":
            host += event.end - event.start
    flops = {kind: s * device.profile.flops for kind, s in seconds.items()}
    if host:
        flops["host_optimizer"] = host * device.profile.host_flops
    return flops


def _layout(config: TrainConfig) -> dict:
    """Where the ranks are: the mesh, the nodes, every group (with the data-parallel
    sub-groups of ZeRO-3 across nodes, when the run has them), and whether a TP group
    spans nodes (its all-reduces then cross the slow inter-node network)."""
    mesh = device_mesh(config, world_size=config.world_size,
                       gpus_per_node=config.gpus_per_node)
    per_node = config.gpus_per_node
    groups = {axis: [list(g.ranks) for g in mesh.all_groups(axis)] for axis in mesh.axes}
    for kind in mesh.dp_subgroup_kinds:
        groups[kind] = [list(ranks) for ranks in sorted(
            {mesh.dp_subgroup(kind, r).ranks for r in range(config.world_size)})]
    return {"mesh": dict(zip(mesh.axes, mesh.shape, strict=True)),
            "gpus_per_node": per_node, "nodes": -(-config.world_size // per_node),
            "groups": groups,
            "tp_group_crosses_nodes": any(len({r // per_node for r in g}) > 1
                                          for g in groups["tp"])}


def _traffic(devices) -> dict:
    """Bytes rank i sent to rank j ("matrix"), and the same split by group kind."""
    world = len(devices)
    by_group = {kind: np.zeros((world, world), np.int64) for kind in GROUP_KINDS}
    for src, device in enumerate(devices):
        for record in device.comm.records:
            for dst, nbytes in record.sent_to:
                by_group[record.group_kind][src, dst] += nbytes
    total = sum(by_group.values())
    return {"matrix": total.tolist(),
            "by_group": {kind: m.tolist() for kind, m in by_group.items() if m.any()}}


def _transfers(devices) -> list[list[dict]]:
    return [[{"op": r.op, "group": r.group_kind, "sent_bytes": r.sent_bytes,
              "recv_bytes": r.recv_bytes, "start": r.start, "end": r.end, "phase": r.phase}
             for r in device.comm.records] for device in devices]


def _pipeline(config: TrainConfig, timelines, coords=None) -> dict:
    """The pipeline section: the schedule, its measured bubble, the formula's, and the
    measured times of one micro-batch through each virtual stage."""
    p, m, v = config.pp, config.grad_accum_steps, config.virtual_stages
    section = {
        "schedule": config.schedule,
        # Idle rank-time / total rank-time over the run, from the simulated clocks.
        "bubble_fraction": bubble_fraction(timelines),
        "micro_batches": m, "virtual_stages": v,
        # Uniform stages and free communication: the schedule's own formula.
        "uniform_bubble_fraction": uniform_bubble_fraction(config.schedule, p, m, v),
        "layers_per_stage": [len(r) for r in split_layers(config.n_layer, p * v)],
        # Communication / busy time: above COMMUNICATION_BOUND_SHARE the formula above
        # does not describe the run (timeline.communication_bound); front ends say so.
        "communication_share": communication_share(timelines),
    }
    if coords is not None:
        section["stage_times"] = _stage_times(config, timelines, coords)
    return section


def _stage_times(config: TrainConfig, timelines, coords) -> list[dict]:
    """Per virtual stage, the simulated seconds of micro-batch 0's forward (F), input
    gradient (I: the ZB paper's B), weight gradient (W) and full backward (B, or I + W),
    averaged over the steps, on the dp = tp = 0 rank that runs it: the T_F, T_B, T_W of
    the papers' bubble formulas. Without a split backward, I and W are None."""
    spec = SCHEDULES[config.schedule]
    p, v, steps = config.pp, config.virtual_stages, config.steps
    times = []
    for timeline, where in zip(timelines, coords, strict=True):
        if where["dp"] or where["tp"]:
            continue
        seconds = labelled_compute_seconds(timeline)
        for c in range(v):
            suffix = "" if c == 0 else f".{c}"

            def per_step(kind, suffix=suffix, seconds=seconds):
                label = f"{kind}0{suffix}"
                return seconds[label] / steps if label in seconds else None

            forward, full = per_step("F"), per_step("B")
            backward_input, backward_weight = per_step("I"), per_step("W")
            if full is None and backward_input is not None:
                full = backward_input + (backward_weight or 0.0)
            times.append({"stage": spec.virtual_stage(p, where["pp"], c),
                          "rank": where["pp"], "chunk": c, "forward_s": forward,
                          "backward_input_s": backward_input,
                          "backward_weight_s": backward_weight, "backward_s": full})
    return sorted(times, key=lambda t: t["stage"])
