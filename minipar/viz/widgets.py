"""Interactive explorers for the notebooks: change a setting, see the measured result.

    from minipar.viz.widgets import (MemoryExplorer, PipelineExplorer, RunCache,
                                     ShardingExplorer, TrafficExplorer)
    cache = RunCache()                      # share measured runs between explorers
    MemoryExplorer(cache=cache)             # the last expression of a cell displays it

Four explorers, each an `ipywidgets.VBox` of controls, a status line and a picture:

    ShardingExplorer  dp / tp / pp / ZeRO -> which slice of every weight, gradient and
                      Adam moment each rank holds (minipar.viz.sharding)
    MemoryExplorer    a layout -> stacked per-rank bars of the peak bytes by category,
                      from a measured training step (the report's ranks[i]["memory"])
    PipelineExplorer  schedule, p, m, v -> the simulated timeline of one pipeline step,
                      its bubble next to the paper's formula, activations in flight
    TrafficExplorer   a layout -> the rank x rank matrix of bytes sent, and each rank's
                      bytes by group (dp / tp / pp) or by collective

Every picture comes from a run, never from a formula (formulas appear only as the
reference they are compared with). Runs (minipar.viz.runs) are cached by their settings
in a `RunCache`, so going back to a setting is instant and a new one costs one small
run (benchmarks/README.md, `python benchmarks/bench_widgets.py`); in a Jupyter kernel
the settings one control change away are measured and drawn in the background while
the reader looks (`prefetch`, minipar/viz/prefetch.py), so most changes find them ready.

Pictures are drawn on `matplotlib.figure.Figure` (never pyplot, so nothing is shown
twice), with axes that copy their first tick (minipar/viz/ticks.py), and shown as PNG
in an `ipywidgets.Image`, drawn once by Agg with margins fixed in inches (`fixed_margins`,
minipar/viz/explorer.py; `figure_png`, minipar/viz/agg.py, which keeps the labels'
measurements and glyphs between pictures). Tests drive the explorers headless: set a
control's `.value` and the callback runs synchronously; `explorer.figures` holds what
was drawn, `explorer.status.value` what was said, `explorer.error` any refusal.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from minipar.nn.gpt import parameter_shapes
from minipar.parallel.pipeline.schedules.registry import (
    SCHEDULES,
    check_schedule_settings,
    schedule_names,
)
from minipar.train.config import TrainConfig, gpt_config
from minipar.train.report import Report
from minipar.viz.agg import FIGURE_WIDTH, figure_png, fixed_margins
from minipar.viz.controls import make_control
from minipar.viz.explorer import REFUSALS, Explorer
from minipar.viz.memory import plot_memory
from minipar.viz.runs import (
    RunCache,
    check_training_layout,
    pipeline_step,
    traffic_key,
    train_key,
    train_report,
    training_cost,
    vocab_size,
)
from minipar.viz.sharding import DEFAULT_CONFIG, KINDS, holdings, plot_sharding
from minipar.viz.tables import byte_unit, human_bytes, span
from minipar.viz.ticks import TICK_COPYING
from minipar.viz.timeline import plot_timeline
from minipar.viz.traffic import cross_node_bytes, plot_sent_bytes, plot_traffic, traffic_of

__all__ = ["REFUSALS", "Explorer", "MemoryExplorer", "PipelineExplorer", "RunCache",
           "ShardingExplorer", "TrafficExplorer", "cross_node_bytes", "figure_png",
           "fixed_margins", "plot_sent_bytes", "traffic_of"]

# What the explorers train: the default model with 4 layers (so pp can be 4), one step.
EXPLORER_CONFIG = TrainConfig(n_layer=4, steps=1)


class NothingToShow(ValueError):
    """A setting that runs, but whose picture would be empty: said, not drawn."""
    said_as = "nothing to show"


# ------------------------------------------------------------------ sharding
class ShardingExplorer(Explorer):
    """dp, tp, pp, ZeRO stage, kind of state, tensor -> who holds which elements."""

    def __init__(self, config: TrainConfig = DEFAULT_CONFIG, cache: RunCache | None = None,
                 prefetch: bool | None = None, **initial):
        self.config = config
        names = list(_tensor_names(config))
        controls = {
            "dp": make_control("dropdown", "dp", [1, 2, 4], 2, "110px"),
            "tp": make_control("dropdown", "tp", [1, 2, 4], 2, "110px"),
            "pp": make_control("dropdown", "pp", [1, 2, 4], 2, "110px"),
            "zero": make_control("dropdown", "ZeRO", [0, 1, 2, 3], 1, "120px"),
            "kind": make_control("dropdown", "state", list(KINDS), "optimizer", "170px"),
            # A tensor that a ZeRO cut of the default layout splits (with attn.c_attn,
            # three of four panels were empty: whole tensors sit on one DP rank).
            "tensor": make_control("dropdown", "tensor", names, "h.0.mlp.c_proj.weight",
                               "300px"),
        }
        super().__init__(controls, cache, prefetch, initial)

    def holdings(self, dp, tp, pp, zero):
        return self.cache.get(("sharding", repr(self.config), dp, tp, pp, zero),
                              lambda: holdings(dp, tp, pp, zero, config=self.config))

    def pending_status(self, values: dict) -> str:
        world = values["dp"] * values["tp"] * values["pp"]
        return f"building the {values['kind']} of {world} ranks and drawing them ..."

    def check(self, values: dict) -> None:
        ranks = values["dp"] * values["tp"] * values["pp"]
        if ranks > 16:  # one panel per rank: past 16 they are too small to read
            raise ValueError(f"dp x tp x pp = {ranks} ranks; this explorer draws one panel "
                             "per rank, so keep it at 16 or fewer")

    def draw(self, dp, tp, pp, zero, kind, tensor):
        self.check(dict(dp=dp, tp=tp, pp=pp))
        held = self.holdings(dp, tp, pp, zero)
        fig = plot_sharding(held, kind, tensor, width=FIGURE_WIDTH)
        shares = [held.fraction(r, kind) for r in range(held.world_size)]
        who = "1 rank holds" if held.world_size == 1 else f"{held.world_size} ranks; each holds"
        message = (f"{who} {span(shares, '{:.1%}'.format)} of the model's {kind} "
                   f"({span([b[kind] for b in held.nbytes])}); one device would hold 100%.")
        empty = [r for r in range(held.world_size)
                 if not held.masks[r][kind].get(tensor, np.zeros(1, bool)).any()]
        if empty:
            why = []
            if pp > 1:
                why.append("a pipeline stage holds only its own layers")
            if dp > 1 and (zero >= 1 if kind == "optimizer" else
                           zero >= 2 if kind == "grads" else zero >= 3):
                why.append(f"ZeRO-{zero} cuts the {kind} of a stage, laid end to end in "
                           f"one flat buffer, into {dp} contiguous ranges, one per DP rank, "
                           "so a tensor sits wholly on the rank whose range covers it "
                           "unless a cut falls inside it")
            message += (f"<br>{len(empty)} of {held.world_size} panels are empty: "
                        + "; ".join(why or ["those ranks hold none of it"])
                        + " (the strip above shows where the cuts are).")
        return [fig], message


def _tensor_names(config: TrainConfig):
    return parameter_shapes(gpt_config(config, config.vocab_size
                                       or vocab_size(config.data))).keys()


# ------------------------------------------------------------------ memory
def step_status(measured: bool, values: dict) -> str:
    """The training explorers' status while a setting is answered (Explorer.pending_status)."""
    if measured:
        return "drawing the pictures of this step ..."
    world = values["dp"] * values["tp"] * values["pp"]
    micro = values.get("grad_accum_steps") or 1
    return (f"measuring one training step on {world} virtual rank{'s' * (world > 1)}"
            + (f", {micro} micro-batches each" if micro > 1 else "") + " ...")


class MemoryExplorer(Explorer):
    """A layout and precision -> the measured peak bytes per rank, by category."""

    def __init__(self, config: TrainConfig = EXPLORER_CONFIG, cache: RunCache | None = None,
                 prefetch: bool | None = None, **initial):
        self.config = config
        controls = {
            "dp": make_control("dropdown", "dp", [1, 2, 4, 8], 4, "110px"),
            "tp": make_control("dropdown", "tp", [1, 2, 4], 1, "110px"),
            "pp": make_control("dropdown", "pp", [1, 2, 4], 1, "110px"),
            "zero": make_control("dropdown", "ZeRO", [0, 1, 2, 3], 0, "120px"),
            "precision": make_control("dropdown", "precision", ["fp32", "bf16-mixed", "fp64"],
                                  "bf16-mixed", "190px"),
            "micro_batch_size": make_control("dropdown", "micro-batch size", [1, 2, 4, 8, 16],
                                         4, "190px"),
            # a pipeline's memory depends on how many micro-batches it holds (notebook 05)
            "grad_accum_steps": make_control("dropdown", "micro-batches", [1, 2, 4, 8], 1,
                                         "160px"),
            "recompute_granularity": make_control(
                "dropdown", "recompute", [("none", None), ("selective", "selective"),
                                          ("full", "full")], None, "160px"),
            # ZeRO-Offload / ZeRO-Infinity: a second panel, below, shows host and NVMe tiers
            "offload_optimizer": make_control("dropdown", "offload optimizer",
                                          ["none", "cpu", "nvme"], "none", "210px"),
            "offload_param": make_control("dropdown", "offload params", ["none", "cpu", "nvme"],
                                      "none", "200px"),
        }
        super().__init__(controls, cache, prefetch, initial)

    def run(self, **settings) -> Report:
        config = self.config.replace(**settings)
        return self.cache.get(train_key(config), lambda: train_report(config))

    def prefetch_cost(self, values: dict) -> float | None:
        if train_key(self.config.replace(**values)) in self.cache:
            return 0.0  # measured already: only the picture is left to draw
        return training_cost(values)

    def check(self, values: dict) -> None:
        check_training_layout(self.config.replace(**values))

    def pending_status(self, values: dict) -> str:
        return step_status(train_key(self.config.replace(**values)) in self.cache, values)

    def draw(self, **settings):
        report = self.run(**settings)
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
        fig = plot_memory(report, width=FIGURE_WIDTH, title=title)
        fixed_margins(fig, left=0.8, right=1.3, bottom=0.75, top=0.55 if extras else 0.35,
                      row_gap=1.0)
        for legend in fig.legends:  # level with the bars' bottom, clear of a long title
            legend.set_bbox_to_anchor((1.0, 0.75 / fig.get_size_inches()[1]),
                                      transform=fig.transFigure)
        peaks = [r["memory"]["peak_total"] for r in report.ranks]
        message = (f"{report.world_size} rank{'s' * (report.world_size > 1)}, Ψ = "
                   f"{report.n_params:,} parameters; "
                   f"peak per rank {span(peaks)} "
                   f"(bars: each category's own peak; black tick: the peak of their sum)")
        host = max(r["memory_host"]["peak_total"] for r in report.ranks)
        nvme = max(r["memory_nvme"]["peak_total"] for r in report.ranks)
        if host or nvme:
            moved = report.ranks[0]["transfers"]
            message += (f"; behind each GPU up to {human_bytes(host)} in host memory and "
                        f"{human_bytes(nvme)} on NVMe; rank 0 copied "
                        f"{human_bytes(moved['to_host_bytes'])} down and "
                        f"{human_bytes(moved['to_device_bytes'])} up over PCIe")
        return [fig], message


# ------------------------------------------------------------------ pipeline
class PipelineExplorer(Explorer):
    """Schedule, p, m, v -> timeline, bubble (measured and formula), activations in flight."""
    FLAG_ALIASES = {"--grad-accum-steps": "micro_batches"}  # the schedules' rules

    def __init__(self, cache: RunCache | None = None, prefetch: bool | None = None,
                 **initial):
        controls = {
            "schedule": make_control("dropdown", "schedule", list(schedule_names()), "1f1b",
                                 "190px"),
            "pp": make_control("dropdown", "p (stages)", [2, 4, 8], 4, "150px"),
            "micro_batches": make_control("slider", "m (micro-batches)", (1, 16), 8, "440px"),
            "virtual_stages": make_control("dropdown", "v (chunks)", [1, 2, 3], 1, "140px"),
        }
        super().__init__(controls, cache, prefetch, initial)

    def run(self, schedule, pp, micro_batches, virtual_stages):
        key = ("pipeline", schedule, pp, micro_batches, virtual_stages)
        return self.cache.get(key, lambda: pipeline_step(schedule, pp, micro_batches,
                                                         virtual_stages))

    def prefetch_cost(self, values: dict) -> float:
        """Every stage runs every micro-batch through each of its chunks."""
        return values["pp"] * values["micro_batches"] * values["virtual_stages"]

    def check(self, values: dict) -> None:
        check_schedule_settings(values["schedule"], values["pp"], values["micro_batches"],
                                values["virtual_stages"])

    def pending_status(self, values: dict) -> str:
        return (f"measuring one {values['schedule']} step on {values['pp']} stages, "
                f"{values['micro_batches']} micro-batches ...")

    def draw(self, schedule, pp, micro_batches, virtual_stages):
        check_schedule_settings(schedule, pp, micro_batches, virtual_stages)
        result = self.run(schedule, pp, micro_batches, virtual_stages)
        setting = (f"{schedule}, p={pp}, m={micro_batches}"
                   + (f", v={virtual_stages}" if virtual_stages > 1 else ""))
        timeline = plot_timeline(
            result["timelines"], width=FIGURE_WIDTH,
            show_labels=micro_batches * virtual_stages <= 8,
            title=(f"{setting}: bubble {result['bubble']:.1%} measured, "
                   f"{result['formula']:.1%} by the formula"))
        fixed_margins(timeline, left=0.75, right=0.2, bottom=0.8, top=0.35)
        fig = Figure(figsize=(FIGURE_WIDTH, 2.4))
        left, right = fig.subplots(1, 2, subplot_kw=TICK_COPYING)
        fixed_margins(fig, left=0.45, right=0.2, bottom=0.35, top=0.5)
        ranks = range(pp)  # 8 "stage 7" labels run into each other in half the width
        # with v chunks a rank holds v stages (interleaved: r, r+p, ...; V: r and 2p-1-r)
        word, short = ("stage", "S") if virtual_stages == 1 else ("rank", "r")
        names = [f"{word} {r}" if pp <= 4 else f"{short}{r}" for r in ranks]
        left.bar(ranks, result["in_flight"], color="#8e6bb8")
        left.set_title(("micro-batch x chunk forwards" if virtual_stages > 1 else "forwards")
                       + " awaiting their backward\n(peak, from the schedule)", fontsize=8, y=1.0)
        left.set_xticks(list(ranks), names, fontsize=7)
        unit, scale = byte_unit(max(result["activations"]))
        right.bar(ranks, np.array(result["activations"]) / scale, color="#8e6bb8")
        right.set_title(f"peak activations held\n({unit}, measured)", fontsize=8, y=1.0)
        right.set_xticks(list(ranks), names, fontsize=7)
        formula = SCHEDULES[schedule].bubble_formula
        # The setting first, as the other explorers' status lines begin with their layout:
        # gpipe's and 1f1b's bubbles are the same number.
        message = (f"{setting}: bubble {result['bubble']:.3f} measured on the simulated "
                   f"clocks vs "
                   f"{formula} = {result['formula']:.3f} for uniform stages (the last virtual "
                   f"stage also runs the head and loss: rank p-1, or rank 0 in a V); "
                   f"{word} 0 holds the activations of {result['in_flight'][0]} "
                   + ("micro-batch x chunk forwards (one chunk's layers each)"
                      if virtual_stages > 1 else "micro-batches") + " at once")
        return [timeline, fig], message


# ------------------------------------------------------------------ traffic
class TrafficExplorer(Explorer):
    """A layout -> who sends how many bytes to whom, and in which group."""

    def __init__(self, config: TrainConfig = EXPLORER_CONFIG, cache: RunCache | None = None,
                 prefetch: bool | None = None, **initial):
        self.config = config
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
            "by": make_control("dropdown", "bars by", ["group", "op"], "group", "150px"),
        }
        super().__init__(controls, cache, prefetch, initial)

    def run(self, **settings) -> Report:
        """The measured run of a layout, shared by its gpus_per_node settings: where a
        node ends changes the simulated clock, never which bytes go to which rank (same
        collectives, same arrays; tests/viz/test_widgets.py measures both); the pictures
        draw the node boundaries of the setting shown."""
        config = self.config.replace(**settings)
        return self.cache.get(traffic_key(config), lambda: train_report(config))

    def prefetch_cost(self, values: dict) -> float | None:
        settings = {k: v for k, v in values.items() if k != "by"}
        if traffic_key(self.config.replace(**settings)) in self.cache:
            return 0.0  # measured already: only the pictures are left to draw
        return training_cost(values)

    def check(self, values: dict) -> None:
        check_training_layout(self.config.replace(
            **{k: v for k, v in values.items() if k != "by"}))
        if values["dp"] * values["tp"] * values["pp"] == 1:
            raise NothingToShow("one device sends no bytes to anyone: set dp, tp or pp "
                                "above 1 to see who sends what to whom")

    def pending_status(self, values: dict) -> str:
        settings = {k: v for k, v in values.items() if k != "by"}
        return step_status(traffic_key(self.config.replace(**settings)) in self.cache,
                           values)

    def draw(self, by, **settings):
        report = self.run(**settings)
        per_node = settings["gpus_per_node"]
        matrix = traffic_of(report)
        # The matrices do not depend on `by`: switching the bars redraws only the bars.
        heatmaps = self.cached_figure((repr(self.config), *sorted(settings.items())),
                                      lambda: plot_traffic(report, annotate=False,
                                                           width=FIGURE_WIDTH,
                                                           gpus_per_node=per_node))
        figures = [heatmaps, plot_sent_bytes(report, by=by)]
        crossing = cross_node_bytes(matrix, per_node)
        total = int(matrix.sum())
        groups = {kind: sum(r["comm"]["by_group"].get(kind, 0) for r in report.ranks)
                  for kind in ("dp", "tp", "pp")}
        # The layout first: ZeRO-1 and -2 move what plain DP moves; a change must show.
        message = (f"dp={settings['dp']} tp={settings['tp']} pp={settings['pp']} ZeRO-"
                   f"{settings['zero']}, micro-batches {settings['grad_accum_steps']}, "
                   f"{settings['precision']}, "
                   f"{per_node} GPUs per node: one step moved {human_bytes(total)} in all; "
                   + ", ".join(f"{k} {human_bytes(v)}" for k, v in groups.items())
                   + f"; {crossing / max(total, 1):.0%} of it crosses a node boundary "
                     f"(InfiniBand instead of NVLink)")
        return figures, message
