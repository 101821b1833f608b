"""Interactive explorers for the notebooks: change a setting, see the measured result.

    from minipar.viz.widgets import (MemoryExplorer, PipelineExplorer, RunCache,
                                     ShardingExplorer, TrafficExplorer)
    cache = RunCache()                      # share measured runs between explorers
    MemoryExplorer(cache=cache)             # the last expression of a cell displays it

Four explorers, each an `ipywidgets.VBox` of controls, a status line and pictures drawn
in the browser (minipar/viz/pictures.py):

    ShardingExplorer  dp / tp / pp / ZeRO -> which slice of every weight, gradient and
                      Adam moment each rank holds (minipar.viz.sharding)
    MemoryExplorer    a layout -> per-rank bars of what each rank held at its peak, by
                      category, each category's own peak beside them, from a measured
                      training step (the report's ranks[i]["memory_at_peak"], ["memory"])
    PipelineExplorer  schedule, p, m, v -> the simulated timeline of one pipeline step,
                      its bubble next to the paper's formula, activations in flight
    TrafficExplorer   a layout -> the rank x rank matrix of bytes sent, and each rank's
                      bytes by group (dp / tp / pp) or by collective

Every picture comes from a run, never from a formula (formulas appear only as the
reference they are compared with). Each explorer's lattice of settings (`lattice`: every
layout up to LATTICE_MAX_RANKS ranks with the rest of its controls, minipar/viz/
lattice.py) was measured once and ships with the package, so a change to one of them
costs a lookup and a few KB of data for the browser; any other setting is measured when
asked for, the status line saying so at once (minipar/viz/explorer.py).

This module is long because it holds the four explorers, a screenful each: their
controls, their lattice and what their status line says.
"""

from __future__ import annotations

import itertools

from minipar.nn.gpt import parameter_shapes
from minipar.parallel.pipeline.schedules.registry import (
    SCHEDULES,
    check_schedule_settings,
    schedule_names,
)
from minipar.train.config import TrainConfig, gpt_config
from minipar.viz.controls import make_control
from minipar.viz.explorer import REFUSALS, Explorer
from minipar.viz.lattice import TRAIN_SETTINGS, PipelineSteps, ShardingLayouts, TrainRuns
from minipar.viz.margins import FIGURE_WIDTH
from minipar.viz.memory import memory_picture
from minipar.viz.runs import (
    RunCache,
    check_training_layout,
    summary_report,
    vocab_size,
)
from minipar.viz.sharding import (
    DEFAULT_CONFIG,
    KINDS,
    holdings_from_summary,
    sharding_picture,
    shares,
)
from minipar.viz.stages import stages_picture
from minipar.viz.tables import human_bytes, span
from minipar.viz.timeline import timeline_picture
from minipar.viz.traffic import cross_node_bytes, sent_picture, traffic_of, traffic_picture

__all__ = ["REFUSALS", "Explorer", "MemoryExplorer", "PipelineExplorer", "RunCache",
           "ShardingExplorer", "TrafficExplorer", "cross_node_bytes", "traffic_of"]

# What the explorers train: the default model with 4 layers (so pp can be 4), one step.
EXPLORER_CONFIG = TrainConfig(n_layer=4, steps=1)
# The lattice's layouts: up to 32 ranks. A 64- or 128-rank step costs 1-3 s of CPU each,
# and a reader seldom asks for one: measured when asked.
LATTICE_MAX_RANKS = 32


class NothingToShow(ValueError):
    """A setting that runs, but whose picture would be empty: said, not drawn."""
    said_as = "nothing to show"


def train_settings(config: TrainConfig, values: dict) -> dict:
    """A training step's settings (TRAIN_SETTINGS): `values`, the rest `config`'s."""
    return {name: values.get(name, getattr(config, name)) for name in TRAIN_SETTINGS}


def _options(explorer: Explorer, name: str) -> list:
    return list(explorer.controls[name]._options_values)


def _layouts(explorer: Explorer, most: int, names=("dp", "tp", "pp", "zero")):
    """Every combination of the controls `names` with at most `most` ranks."""
    for values in itertools.product(*(_options(explorer, name) for name in names)):
        layout = dict(zip(names, values, strict=True))
        if layout["dp"] * layout["tp"] * layout["pp"] <= most:
            yield layout


def _runs(explorer: Explorer, settings) -> list[dict]:
    """Those of `settings` the rules let run, each once, in order."""
    kept, seen = [], set()
    for values in settings:
        key = tuple(sorted(values.items()))
        if key in seen:
            continue
        seen.add(key)
        try:
            check_training_layout(explorer.config.replace(**values))
        except REFUSALS:
            continue
        kept.append(values)
    return kept


# ------------------------------------------------------------------ sharding
class ShardingExplorer(Explorer):
    """dp, tp, pp, ZeRO stage, kind of state, tensor -> who holds which elements."""

    def __init__(self, config: TrainConfig = DEFAULT_CONFIG, cache: RunCache | None = None,
                 prefetch: bool | None = None, **initial):
        self.config = config
        self.measurements = ShardingLayouts(config, cache)
        self.shapes = parameter_shapes(gpt_config(config, config.vocab_size
                                                  or vocab_size(config.data)))
        names = list(self.shapes)
        controls = {
            "dp": make_control("dropdown", "dp", [1, 2, 4], 2, "110px"),
            "tp": make_control("dropdown", "tp", [1, 2, 4], 2, "110px"),
            "pp": make_control("dropdown", "pp", [1, 2, 4], 2, "110px"),
            "zero": make_control("dropdown", "ZeRO", [0, 1, 2, 3], 1, "120px"),
            # HSDP / MiCS (ZeRO-3): shard within groups of 2, replicate across them
            "hsdp_shard_size": make_control("dropdown", "HSDP shard",
                                            [("off", None), ("2 ranks", 2)], None, "170px"),
            "kind": make_control("dropdown", "state", list(KINDS), "optimizer", "170px"),
            # A tensor that a ZeRO cut of the default layout splits (with attn.c_attn,
            # three of four panels were empty: whole tensors sit on one DP rank).
            "tensor": make_control("dropdown", "tensor", names, "h.0.mlp.c_proj.weight",
                               "300px"),
        }
        super().__init__(controls, cache, prefetch, initial)

    def measured(self, values: dict) -> dict:
        return {name: values[name] for name in ("dp", "tp", "pp", "zero", "hsdp_shard_size")}

    def holdings(self, dp, tp, pp, zero, hsdp_shard_size=None):
        """The Holdings of a layout (its masks made again from the measured rectangles)."""
        return holdings_from_summary(self.measurements.get(dict(
            dp=dp, tp=tp, pp=pp, zero=zero, hsdp_shard_size=hsdp_shard_size)), self.config)

    def lattice(self) -> list[dict]:
        kept = []
        for layout in _layouts(self, 16, ("dp", "tp", "pp", "zero", "hsdp_shard_size")):
            try:
                self.check(layout)
                check_training_layout(self.config.replace(**layout))
            except REFUSALS:
                continue
            kept.append(layout)
        return kept

    def pending_status(self, values: dict) -> str:
        world = values["dp"] * values["tp"] * values["pp"]
        return f"building the {values['kind']} of {world} ranks ..."

    def check(self, values: dict) -> None:
        ranks = values["dp"] * values["tp"] * values["pp"]
        if ranks > 16:  # one panel per rank: past 16 they are too small to read
            raise ValueError(f"dp x tp x pp = {ranks} ranks; this explorer draws one panel "
                             "per rank, so keep it at 16 or fewer")

    def answer(self, values: dict, result: dict):
        dp, pp, zero, kind, tensor = (values[k] for k in ("dp", "pp", "zero", "kind",
                                                          "tensor"))
        picture = sharding_picture(result, self.shapes, kind, tensor)
        world = len(result["rects"])
        who = "1 rank holds" if world == 1 else f"{world} ranks; each holds"
        # what is shown, last: a change that moves no share still changes the line
        hsdp = values["hsdp_shard_size"]
        hybrid = "" if hsdp is None else (
            f" HSDP: ZeRO-3 within groups of {hsdp} data-parallel ranks, each group holding "
            "the same shards as the others,")
        message = (f"{who} {span(shares(result, self.shapes, kind), '{:.1%}'.format)} of "
                   f"the model's {kind} ({span([b[kind] for b in result['nbytes']])}); one "
                   f"device would hold 100% (dp={dp} tp={values['tp']} pp={pp} ZeRO-{zero},"
                   f"{hybrid} {tensor} below).")
        empty = [r for r, rank in enumerate(result["rects"]) if not rank[kind].get(tensor)]
        if empty:
            why = []
            if pp > 1:
                why.append("a pipeline stage holds only its own layers")
            if dp > 1 and (zero >= 1 if kind == "optimizer" else
                           zero >= 2 if kind == "grads" else zero >= 3):
                cuts, whose = (dp, "DP rank") if hsdp is None else (hsdp, "rank of a group")
                why.append(f"ZeRO-{zero} cuts the {kind} of a stage, laid end to end in "
                           f"one flat buffer, into {cuts} contiguous ranges, one per {whose}, "
                           "so a tensor sits wholly on the rank whose range covers it "
                           "unless a cut falls inside it")
            message += (f"<br>{len(empty)} of {world} panels are empty: "
                        + "; ".join(why or ["those ranks hold none of it"])
                        + " (the strip above shows where the cuts are).")
        return [picture], message


# ------------------------------------------------------------------ memory
def step_status(values: dict) -> str:
    """The training explorers' status while a step is measured (Explorer.pending_status)."""
    world = values["dp"] * values["tp"] * values["pp"]
    micro = values.get("grad_accum_steps") or 1
    return (f"measuring one training step on {world} virtual rank{'s' * (world > 1)}"
            + (f", {micro} micro-batches each" if micro > 1 else "") + " ...")


class MemoryExplorer(Explorer):
    """A layout and precision -> the measured peak bytes per rank, by category."""

    # The step's settings besides the layout, as the controls start: the lattice holds
    # every layout with each of these changed alone (and every micro-batch count).
    STEP_DEFAULTS = {"micro_batch_size": 4, "grad_accum_steps": 1,
                     "recompute_granularity": None, "offload_optimizer": "none",
                     "offload_param": "none"}

    def __init__(self, config: TrainConfig = EXPLORER_CONFIG, cache: RunCache | None = None,
                 prefetch: bool | None = None, **initial):
        self.config = config
        self.model = config.to_dict()  # (the settings of each step replace their own)
        self.measurements = TrainRuns(config, cache)
        step = self.STEP_DEFAULTS
        controls = {
            "dp": make_control("dropdown", "dp", [1, 2, 4, 8], 4, "110px"),
            "tp": make_control("dropdown", "tp", [1, 2, 4], 1, "110px"),
            "pp": make_control("dropdown", "pp", [1, 2, 4], 1, "110px"),
            "zero": make_control("dropdown", "ZeRO", [0, 1, 2, 3], 0, "120px"),
            "precision": make_control("dropdown", "precision", ["fp32", "bf16-mixed", "fp64"],
                                  "bf16-mixed", "190px"),
            "micro_batch_size": make_control("dropdown", "micro-batch size", [1, 2, 4, 8, 16],
                                         step["micro_batch_size"], "190px"),
            # a pipeline's memory depends on how many micro-batches it holds (notebook 05)
            "grad_accum_steps": make_control("dropdown", "micro-batches", [1, 2, 4, 8],
                                         step["grad_accum_steps"], "160px"),
            "recompute_granularity": make_control(
                "dropdown", "recompute", [("none", None), ("selective", "selective"),
                                          ("full", "full")],
                step["recompute_granularity"], "160px"),
            # ZeRO-Offload / ZeRO-Infinity: a second panel, below, shows host and NVMe tiers
            "offload_optimizer": make_control("dropdown", "offload optimizer",
                                          ["none", "cpu", "nvme"], step["offload_optimizer"],
                                          "210px"),
            "offload_param": make_control("dropdown", "offload params", ["none", "cpu", "nvme"],
                                      step["offload_param"], "200px"),
        }
        super().__init__(controls, cache, prefetch, initial)

    def measured(self, values: dict) -> dict:
        return train_settings(self.config, values)

    def run(self, **settings):
        """The Report (the fields the pictures read) of a setting's training step."""
        measured = self.measured(settings)
        return summary_report(self.measurements.get(measured),
                              {**self.model, **measured})

    def lattice(self) -> list[dict]:
        """Every layout (and precision) up to LATTICE_MAX_RANKS ranks with each number of
        micro-batches; and with one micro-batch, each with one other step setting changed
        (micro-batch size, recomputation, offload)."""
        settings = []
        for layout in _layouts(self, LATTICE_MAX_RANKS, ("dp", "tp", "pp", "zero",
                                                          "precision")):
            base = {**layout, **self.STEP_DEFAULTS}
            settings += [{**base, "grad_accum_steps": n}
                         for n in _options(self, "grad_accum_steps")]
            settings += [{**base, "micro_batch_size": n}
                         for n in _options(self, "micro_batch_size")]
            settings += [{**base, "recompute_granularity": g}
                         for g in _options(self, "recompute_granularity") if g is not None]
            settings += [{**base, "offload_optimizer": o, "offload_param": p}
                         for o in _options(self, "offload_optimizer")
                         for p in _options(self, "offload_param")]
        return _runs(self, [self.measured(values) for values in settings])  # as `run` asks

    def check(self, values: dict) -> None:
        check_training_layout(self.config.replace(**values))

    def pending_status(self, values: dict) -> str:
        return step_status(values)

    def answer(self, values: dict, result: dict):
        report = summary_report(result, {**self.model, **self.measured(values)})
        c = report.config
        recompute = c["recompute_granularity"]
        extras = ([f"recompute {recompute}"] * (recompute is not None)
                  + [f"{what} offloaded to {c[f'offload_{name}']}"
                     for name, what in (("optimizer", "optimizer state"),
                                        ("param", "parameters"))
                     if c[f"offload_{name}"] != "none"])
        # The extras on a second line: on one, a long title ran off both sides.
        title = (f"peak bytes per rank, measured: dp={c['dp']} tp={c['tp']} pp={c['pp']} "
                 f"ZeRO-{c['zero']} {c['precision']}"
                 + (f", {c['grad_accum_steps']} micro-batches" * (c["grad_accum_steps"] > 1))
                 + ("\n+ " + ", ".join(extras) if extras else ""))
        picture = memory_picture(report, title=title)
        peaks = [r["memory"]["peak_total"] for r in report.ranks]
        # The setting first, as the title says it (and the micro-batch size): a change that
        # moves no bar still changes the line.
        setting = (title.removeprefix("peak bytes per rank, measured: ").replace("\n+", ",")
                   + f", micro-batch size {c['micro_batch_size']}")
        message = (f"{setting}: {report.world_size} rank{'s' * (report.world_size > 1)}, Ψ = "
                   f"{report.n_params:,} parameters; "
                   f"peak per rank {span(peaks)} "
                   f"(bars: what each rank held at its peak instant, the black tick; dashes beside "
                   f"them: each category's own peak)")
        host = max(r["memory_host"]["peak_total"] for r in report.ranks)
        nvme = max(r["memory_nvme"]["peak_total"] for r in report.ranks)
        if host or nvme:
            moved = report.ranks[0]["transfers"]
            message += (f"; behind each GPU up to {human_bytes(host)} in host memory and "
                        f"{human_bytes(nvme)} on NVMe; rank 0 copied "
                        f"{human_bytes(moved['to_host_bytes'])} down and "
                        f"{human_bytes(moved['to_device_bytes'])} up over PCIe")
        return [picture], message


# ------------------------------------------------------------------ pipeline
class PipelineExplorer(Explorer):
    """Schedule, p, m, v -> timeline, bubble (measured and formula), activations in flight."""
    FLAG_ALIASES = {"--grad-accum-steps": "micro_batches"}  # the schedules' rules

    def __init__(self, cache: RunCache | None = None, prefetch: bool | None = None,
                 **initial):
        self.measurements = PipelineSteps(cache)
        controls = {
            "schedule": make_control("dropdown", "schedule", list(schedule_names()), "1f1b",
                                 "190px"),
            "pp": make_control("dropdown", "p (stages)", [2, 4, 8], 4, "150px"),
            "micro_batches": make_control("slider", "m (micro-batches)", (1, 16), 8, "440px"),
            "virtual_stages": make_control("dropdown", "v (chunks)", [1, 2, 3], 1, "140px"),
        }
        super().__init__(controls, cache, prefetch, initial)

    def run(self, schedule, pp, micro_batches, virtual_stages):
        """The measured pipeline step (`pipeline_summary`) of a setting."""
        return self.measurements.get(dict(schedule=schedule, pp=pp,
                                          micro_batches=micro_batches,
                                          virtual_stages=virtual_stages))

    def lattice(self) -> list[dict]:
        slider = self.controls["micro_batches"]
        settings = []
        for schedule, pp, m, v in itertools.product(
                _options(self, "schedule"), _options(self, "pp"),
                range(slider.min, slider.max + 1), _options(self, "virtual_stages")):
            values = dict(schedule=schedule, pp=pp, micro_batches=m, virtual_stages=v)
            try:
                self.check(values)
            except REFUSALS:
                continue
            settings.append(values)
        return settings

    def check(self, values: dict) -> None:
        check_schedule_settings(values["schedule"], values["pp"], values["micro_batches"],
                                values["virtual_stages"])

    def pending_status(self, values: dict) -> str:
        return (f"measuring one {values['schedule']} step on {values['pp']} stages, "
                f"{values['micro_batches']} micro-batches ...")

    def answer(self, values: dict, result: dict):
        schedule, pp, micro_batches, virtual_stages = (
            values[k] for k in ("schedule", "pp", "micro_batches", "virtual_stages"))
        setting = (f"{schedule}, p={pp}, m={micro_batches}"
                   + (f", v={virtual_stages}" if virtual_stages > 1 else ""))
        timeline = timeline_picture(
            result["timelines"], show_labels=micro_batches * virtual_stages <= 8,
            title=(f"{setting}: bubble {result['bubble']:.1%} measured, "
                   f"{result['formula']:.1%} by the formula"))
        stages = stages_picture(result["in_flight"], result["activations"], virtual_stages)
        formula = SCHEDULES[schedule].bubble_formula
        # with v chunks a rank holds v stages (interleaved: r, r+p, ...; V: r and 2p-1-r)
        word = "stage" if virtual_stages == 1 else "rank"
        # The setting first, as the other explorers' status lines begin with their layout:
        # gpipe's and 1f1b's bubbles are the same number.
        message = (f"{setting}: bubble {result['bubble']:.3f} measured on the simulated "
                   f"clocks vs "
                   f"{formula} = {result['formula']:.3f} for uniform stages (the last virtual "
                   f"stage also runs the head and loss: rank p-1, or rank 0 in a V); "
                   f"{word} 0 holds the activations of {result['in_flight'][0]} "
                   + ("micro-batch x chunk forwards (one chunk's layers each)"
                      if virtual_stages > 1 else "micro-batches") + " at once")
        return [timeline, stages], message


# ------------------------------------------------------------------ traffic
# ZeRO-3 across nodes, the traffic explorer's choices (docs/data-parallel-and-zero.md)
ACROSS = {"none": "none", "HSDP: shard inside a node": "hsdp",
          "hpZ: backward inside a node": "hpz",
          "reshard_after_forward=False": "keep", "hpZ + qwZ + qgZ (ZeRO++)": "zeropp"}
ACROSS_SAID = {"hsdp": "HSDP", "hpz": "hpZ", "keep": "reshard_after_forward=False",
               "zeropp": "hpZ + qwZ + qgZ"}


def across_nodes(choice: str, values: dict) -> dict:
    """The settings of a ZeRO-3-across-nodes choice for a layout: HSDP's shard group and
    hpZ's secondary partition are the data-parallel ranks of one node."""
    ranks = values["gpus_per_node"] // (values["tp"] * values["pp"])
    per_node = max(1, min(values["dp"], ranks))
    return {"hsdp": {"hsdp_shard_size": per_node},
            "hpz": {"zero_hpz_partition_size": per_node},
            "keep": {"reshard_after_forward": False},
            "zeropp": {"zero_hpz_partition_size": per_node, "zero_quantized_weights": True,
                       "zero_quantized_gradients": True}}[choice] | {
        "gpus_per_node": values["gpus_per_node"]}


class TrafficExplorer(Explorer):
    """A layout -> who sends how many bytes to whom, and in which group."""

    def __init__(self, config: TrainConfig = EXPLORER_CONFIG, cache: RunCache | None = None,
                 prefetch: bool | None = None, **initial):
        self.config = config
        self.model = config.to_dict()  # (the settings of each step replace their own)
        self.measurements = TrainRuns(config, cache)
        controls = {
            "dp": make_control("dropdown", "dp", [1, 2, 4, 8], 2, "110px"),
            "tp": make_control("dropdown", "tp", [1, 2, 4], 2, "110px"),
            "pp": make_control("dropdown", "pp", [1, 2, 4], 2, "110px"),
            "zero": make_control("dropdown", "ZeRO", [0, 1, 2, 3], 1, "120px"),
            "grad_accum_steps": make_control("dropdown", "micro-batches", [1, 2, 4], 2,
                                         "160px"),
            # bf16-mixed sends half the bytes of fp32 (activations and gradients)
            "precision": make_control("dropdown", "precision", ["fp32", "bf16-mixed", "fp64"],
                                  "fp32", "190px"),
            "gpus_per_node": make_control("dropdown", "GPUs per node", [2, 4, 8], 4, "170px"),
            # ZeRO-3 across nodes (docs/data-parallel-and-zero.md): each with the groups
            # of a node (K = the data-parallel ranks one node holds)
            "across": make_control("dropdown", "ZeRO-3 across nodes", list(ACROSS.items()),
                                   "none", "300px"),
            "by": make_control("dropdown", "bars by", ["group", "op", "link"], "group",
                               "150px"),
        }
        super().__init__(controls, cache, prefetch, initial)

    def measured(self, values: dict) -> dict:
        """The training step of a layout, shared by its gpus_per_node and "bars by"
        settings: where a node ends changes the simulated clock, never which bytes go to
        which rank (same collectives, same arrays; tests/viz/test_widgets.py measures
        both); the pictures draw the node boundaries of the setting shown. ZeRO-3 across
        nodes builds its groups from the nodes, so its steps are measured per
        gpus_per_node. The step's other settings are the model's (so the memory
        explorer's runs serve too)."""
        settings = {name: values[name] for name in values
                    if name not in ("gpus_per_node", "by", "across")}
        across = values.get("across", "none")
        if across != "none":
            settings |= across_nodes(across, values)
        return train_settings(self.config, settings)

    def run(self, **settings):
        """The Report (the fields the pictures read) of a layout's training step."""
        measured = self.measured(settings)
        return summary_report(self.measurements.get(measured),
                              {**self.model, **measured})

    def lattice(self) -> list[dict]:
        """Every layout (and precision) up to LATTICE_MAX_RANKS ranks with each number of
        micro-batches (the GPUs per node and the bars are views of the same run)."""
        plain = (self.measured({**layout, "grad_accum_steps": n})
                 for layout in _layouts(self, LATTICE_MAX_RANKS,
                                        ("dp", "tp", "pp", "zero", "precision"))
                 for n in _options(self, "grad_accum_steps"))
        # and ZeRO-3 across nodes, for the data-parallel layouts of 4 and 8 ranks with
        # the other controls as they start
        start = {name: control.value for name, control in self.controls.items()}
        across = (self.measured({**start, "dp": dp, "tp": 1, "pp": 1, "zero": 3,
                                 "gpus_per_node": g, "across": a})
                  for dp in (4, 8) for g in (2, 4) for a in ACROSS.values() if a != "none")
        return _runs(self, itertools.chain(plain, across))

    def check(self, values: dict) -> None:
        check_training_layout(self.config.replace(
            **{**self.measured(values), "gpus_per_node": values["gpus_per_node"]}))
        if values["dp"] * values["tp"] * values["pp"] == 1:
            raise NothingToShow("one device sends no bytes to anyone: set dp, tp or pp "
                                "above 1 to see who sends what to whom")

    def pending_status(self, values: dict) -> str:
        return step_status(values)

    def answer(self, values: dict, result: dict):
        settings = {k: v for k, v in values.items() if k != "by"}
        report = summary_report(result, {**self.model, **self.measured(values)})
        per_node = settings["gpus_per_node"]
        matrix = traffic_of(report)
        pictures = [traffic_picture(report, annotate=False, width=FIGURE_WIDTH,
                                    gpus_per_node=per_node),
                    sent_picture(report, by=values["by"], gpus_per_node=per_node)]
        crossing = cross_node_bytes(matrix, per_node)
        total = int(matrix.sum())
        kinds = {kind for r in report.ranks for kind, b in r["comm"]["by_group"].items() if b}
        groups = {kind: sum(r["comm"]["by_group"].get(kind, 0) for r in report.ranks)
                  for kind in ("dp", "tp", "pp", *sorted(kinds - {"dp", "tp", "pp"}))}
        across = settings.get("across", "none")
        # The layout first: ZeRO-1 and -2 move what plain DP moves; a change must show.
        message = (f"dp={settings['dp']} tp={settings['tp']} pp={settings['pp']} ZeRO-"
                   f"{settings['zero']}"
                   + ("" if across == "none" else f" + {ACROSS_SAID[across]}")
                   + f", micro-batches {settings['grad_accum_steps']}, "
                   f"{settings['precision']}, "
                   f"{per_node} GPUs per node, bars by {values['by']}: one step moved "
                   f"{human_bytes(total)} in all; "
                   + ", ".join(f"{k} {human_bytes(v)}" for k, v in groups.items())
                   + f"; {crossing / max(total, 1):.0%} of it crosses a node boundary "
                     f"(InfiniBand instead of NVLink)")
        return pictures, message
