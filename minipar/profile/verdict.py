"""The bottleneck of a profiled run, the knob to try, and what the planner says it changes.

The interview drill's last advice (notebook 07): don't guess, profile, then turn the knob
that addresses what the profile shows. Where the rank-time of the run went decides:

  idle (pipeline bubble)  more micro-batches per step (the bubble is (p-1)/(m+p-1)):
                          halve the micro-batch and double the accumulation (same global
                          batch), or interleave virtual stages (Narayanan et al. 2021, 2.2)
  exposed communication   of the group that exposes most: tp -> a smaller TP degree (its
                          all-reduces sit on the critical path of every layer), or a TP
                          group inside one node; dp -> gradient buckets that overlap
                          backward (DDP's bucket_cap_mb), ZeRO-3 -> ZeRO-2 (no parameter
                          all-gathers); pp -> fewer stages
  compute                 the goal. With activation checkpointing on, turning it off saves
                          the recomputation (if memory allows); and the knobs of the waste
                          left (idle, exposed communication) still apply.
and the memory peak's largest category (params / grads / optimizer / activations) decides
the memory knob (ZeRO-3 / ZeRO-2 / ZeRO-1 / activation checkpointing).

Each knob is a TrainConfig change that minipar can run (validated as `minipar train`
would); the one with the most tokens/s at the same global batch wins. The planner
(estimate.py, tested against the emulator to 1e-3) predicts step time, bubble, MFU and
peak memory before and after, so the verdict says what to expect before anyone trains it.
"""

from __future__ import annotations

from minipar.distributed.clock import device_label
from minipar.distributed.trace import device_profile
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import estimate, human_bytes, human_seconds
from minipar.plan.layout import ParallelConfig
from minipar.plan.shapes import from_train_config

MEMORY_KNOBS = {
    "activations": "activation checkpointing (keep one input per block, recompute the rest)",
    "optimizer": "a higher ZeRO stage (ZeRO-1 shards the Adam moments over dp)",
    "grads": "ZeRO-2 (each dp rank keeps the gradient shard it updates)",
    "params": "ZeRO-3, or more tensor / pipeline parallelism (each rank holds a slice)",
    "buffers": "smaller gradient buckets (the transient gathers and unsharded gradients)",
}


def _train_config(values: dict):
    from minipar.train.config import TrainConfig
    from minipar.train.mixes import check_layout

    config = TrainConfig.from_saved(values)
    check_layout(config)
    return config


def _more_dp(c: dict, factor: int = 2) -> tuple[str, dict]:
    """dp x factor at the same global batch: fewer micro-batches (or smaller ones) per rank."""
    changes = {"dp": factor * c["dp"]}
    if c["grad_accum_steps"] % factor == 0:
        changes["grad_accum_steps"] = c["grad_accum_steps"] // factor
    elif c["micro_batch_size"] % factor == 0:
        changes["micro_batch_size"] = c["micro_batch_size"] // factor
    else:
        return f"dp {c['dp']} -> {factor * c['dp']} (the global batch grows)", changes
    return f"dp {c['dp']} -> {factor * c['dp']}, same global batch", changes


def _candidates(profile, bottleneck: str, group: str | None) -> list[tuple[str, dict]]:
    """(why, setting changes) to try, best first, for this bottleneck."""
    c = profile.config
    out: list[tuple[str, dict]] = []
    if bottleneck == "idle" and c["pp"] > 1:
        m = c["grad_accum_steps"]
        if c["micro_batch_size"] % 2 == 0:
            out.append((f"twice the micro-batches per step ({m} -> {2 * m}) at the same "
                        "global batch", {"micro_batch_size": c["micro_batch_size"] // 2,
                                         "grad_accum_steps": 2 * m}))
        if c["schedule"] != "interleaved":
            out.append(("the interleaved schedule with 2 model chunks per stage",
                        {"schedule": "interleaved", "virtual_stages": 2}))
        out.append((f"twice the micro-batches per step ({m} -> {2 * m}; the global batch "
                    "doubles)", {"grad_accum_steps": 2 * m}))
    elif bottleneck == "exposed_comm":
        if group == "tp" and c["tp"] > 1:
            why, changes = _more_dp(c)
            changes["tp"] = c["tp"] // 2
            if changes["tp"] == 1 and c["sequence_parallel"]:
                changes["sequence_parallel"] = False  # sequence parallelism needs TP
            out.append((f"half the tensor parallelism (tp {c['tp']} -> {c['tp'] // 2}, "
                        f"{why})", changes))
        if group == "dp":
            if c["zero"] == 3:
                out.append(("ZeRO-2 instead of ZeRO-3 (no parameter all-gathers)",
                            {"zero": 2}))
            if c["zero"] == 3 and not c.get("zero3_prefetch", True):
                out.append(("ZeRO-3 prefetch (the next module's gather runs while the "
                            "current one computes)", {"zero3_prefetch": True}))
            if not c.get("overlap_grad_reduce", True):
                out.append(("gradient buckets reduced while backward goes on "
                            "(--overlap-grad-reduce)", {"overlap_grad_reduce": True}))
            if c["bucket_size_mb"] == 0 and c["pp"] == 1:
                out.append(("gradient buckets of 0.1 MiB reduced while backward goes on",
                            {"bucket_size_mb": 0.1}))
            out.append((f"twice the gradient accumulation ({c['grad_accum_steps']} -> "
                        f"{2 * c['grad_accum_steps']}): one reduction per twice the "
                        "samples", {"grad_accum_steps": 2 * c["grad_accum_steps"]}))
        if group == "pp" and c["pp"] > 1:
            why, changes = _more_dp(c)
            out.append((f"half the pipeline stages (pp {c['pp']} -> {c['pp'] // 2}, {why})",
                        {"pp": c["pp"] // 2, **changes}))
    elif bottleneck == "compute" and c["recompute_granularity"] is not None:
        out.append(("recomputation off (no forward run again in backward)",
                    {name: None for name in ("recompute_granularity", "recompute_method",
                                             "recompute_num_layers") if c[name] is not None}))
    return out


def _planned(config, profile) -> dict:
    device = device_profile(profile.device)
    cluster = ClusterSpec.from_device_profile(device, gpus_per_node=config.gpus_per_node)
    shape, layout = from_train_config(config), ParallelConfig.from_train_config(config)
    est = estimate(shape, layout, cluster, all_stages=True)
    # the run that waits for every reduction and gather: an upper bound of the step
    waited = estimate(shape, layout.replace(overlap_grad_reduce=False, zero3_prefetch=False),
                      cluster)
    # exposed_comm_s: the busiest rank's, per step, with the run's overlap settings
    # (plan/overlap.py), to set beside the profile's measured exposed communication
    return {"step_s": est.step_time, "tokens_per_s": est.time["tokens_per_s"],
            "exposed_comm_s": est.time["exposed_comm_s"],
            "waited_tokens_per_s": waited.time["tokens_per_s"],
            "bubble_fraction": est.time["bubble_fraction"], "mfu": est.mfu,
            "peak_memory_bytes": est.memory["peak_total"],
            "global_batch_size": config.global_batch_size}


def _knob(profile, targets: list[str], group: str | None) -> dict | None:
    """The knob for one of `targets` (bottlenecks, in order) that the planner says raises
    throughput (tokens/s) the most at the same global batch; failing that, the best one
    that changes the global batch (a different recipe: the verdict says so); failing
    that, the best of those it could estimate. Only knobs minipar can run are tried."""
    from minipar.errors import ConfigError

    tried = []
    for target in targets:
        for why, changes in _candidates(profile, target, group):
            values = {**profile.config, **changes}
            if {"micro_batch_size", "grad_accum_steps", "dp"} & set(changes):
                values["global_batch_size"] = None
            try:
                new = _train_config(values)
                before = _planned(_train_config(profile.config), profile)
                after = _planned(new, profile)
            except (ConfigError, ValueError):
                continue  # minipar cannot run it (the layout check says why): next one
            tried.append({"target": target, "setting": why, "changes": changes,
                          "planner_before": before, "planner_after": after,
                          "throughput_change": after["tokens_per_s"] / before["tokens_per_s"]
                          - 1})
    if not tried:
        return None

    def same_batch(knob):
        return (knob["planner_after"]["global_batch_size"]
                == knob["planner_before"]["global_batch_size"])

    for pool in ([k for k in tried if same_batch(k) and k["throughput_change"] > 0],
                 [k for k in tried if k["throughput_change"] > 0], tried):
        if pool:
            return max(pool, key=lambda k: k["throughput_change"])
    return None


def diagnose(profile) -> dict:
    """The verdict: the bottleneck, the knob to try and the planner's estimate of it."""
    totals = profile.totals()
    rank_time = profile.window_s * profile.world_size
    shares = {"compute": totals["compute_s"] / rank_time,
              "exposed_comm": totals["exposed_comm_s"] / rank_time,
              "idle": totals["idle_s"] / rank_time}
    bottleneck = max(("idle", "exposed_comm", "compute"), key=lambda k: shares[k])
    by_group: dict[str, float] = {}
    for row in profile.ranks:
        for g, s in row["exposed_comm_by_group_s"].items():
            by_group[g] = by_group.get(g, 0.0) + s
    group = max(by_group, key=by_group.get) if by_group else None
    # The bottleneck's knobs, and those of the other shares: the best one at the same
    # global batch wins (compute-bound is the goal; a knob then goes after a waste left).
    targets = [bottleneck] + [k for k in ("idle", "exposed_comm", "compute") if k != bottleneck]
    knob = _knob(profile, targets, group)
    peak = profile.memory_peak
    verdict = {"bottleneck": bottleneck, "shares": shares, "exposed_comm_group": group,
               "knob": knob,
               "memory_knob": MEMORY_KNOBS[peak["largest_category"]]}
    verdict["paragraph"] = _paragraph(profile, verdict)
    return verdict


def _paragraph(profile, verdict: dict) -> str:
    s = verdict["shares"]
    b = verdict["bottleneck"]
    what = {"idle": "idle time" + (" (the pipeline bubble)" if profile.config["pp"] > 1
                                   else " (ranks waiting for each other)"),
            "exposed_comm": f"communication no compute hides (mostly "
                            f"{verdict['exposed_comm_group']})",
            "compute": "compute (where a training run should spend its time)"}
    text = (f"Bottleneck: {what[b]}, {s[b]:.0%} of rank-time (compute {s['compute']:.0%}, "
            f"exposed communication {s['exposed_comm']:.0%}, idle {s['idle']:.0%}; "
            f"MFU {profile.mfu:.1%} on the simulated {profile.device['name'].split(' (')[0]}).")
    knob = verdict["knob"]
    waste = None if knob is None or knob["target"] == b else knob["target"]
    if waste is not None:
        text += (f" The knob that buys the most goes after {what[waste]}, "
                 f"{s[waste]:.0%}.")
    if knob is not None:
        before, after = knob["planner_before"], knob["planner_after"]
        verb = "Knob to try" if knob["throughput_change"] > 0 else "No knob helps; the best"
        text += (f" {verb}: {knob['setting']}. The planner predicts "
                 f"{knob['throughput_change']:+.0%} tokens/s (a step of "
                 f"{human_seconds(before['step_s'])} -> {human_seconds(after['step_s'])} for "
                 f"a global batch of {before['global_batch_size']} -> "
                 f"{after['global_batch_size']}"
                 + ("" if after["global_batch_size"] == before["global_batch_size"] else
                    ": a different recipe, check the learning rate")
                 + f"), bubble {before['bubble_fraction']:.0%} -> "
                 f"{after['bubble_fraction']:.0%}, MFU {before['mfu']:.1%} -> "
                 f"{after['mfu']:.1%}, peak memory {human_bytes(before['peak_memory_bytes'])}"
                 f" -> {human_bytes(after['peak_memory_bytes'])}.")
    elif b == "compute":
        text += " Nothing to fix in the layout: to go faster, add GPUs (dp) or a bigger GPU."
    else:
        text += " No single setting minipar can change addresses it; see the tables."
    peak = profile.memory_peak
    text += (f" Memory: the peak, {human_bytes(peak['bytes'])} on rank {peak['rank']} at "
             f"{human_seconds(peak['at_s'])} ({peak['during']}), is "
             f"{peak['largest_share']:.0%} {peak['largest_category']}; if memory is what "
             f"you need, try {verdict['memory_knob']}.")
    return text


# ------------------------------------------------------------------ text
def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = ["  ".join(str(h).rjust(w) for h, w in zip(headers, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def format_profile(profile) -> str:
    """The bottleneck report as text (what `minipar profile DIR` prints)."""
    window = profile.window_s
    lines = [f"profile of {profile.world_size} rank(s), {profile.steps} step(s), "
             f"{human_seconds(window)} simulated on {device_label(profile.device)}", "",
             "Time per rank over the run (simulated; HTA's definitions):"]
    rows = []
    for r in profile.ranks:
        c = r["coords"]
        rows.append([r["rank"], f"{c['dp']}/{c['pp']}/{c['tp']}",
                     human_seconds(r["compute_s"]), human_seconds(r["exposed_comm_s"]),
                     human_seconds(r["overlapped_comm_s"]), human_seconds(r["idle_s"]),
                     f"{r['mfu']:.1%}", f"{r['hfu']:.1%}"])
    lines.append(_table(["rank", "dp/pp/tp", "compute", "exposed comm", "overlapped comm",
                         "idle", "MFU", "HFU"], rows))
    for key, title in (("time_s", "time"), ("sent_bytes", "bytes sent")):
        lines += ["", f"Top collectives by {title} (summed over ranks):"]
        lines.append(_table(["op", "group", "calls", "time", "sent"], [
            [c["op"], c["group"], c["calls"], human_seconds(c["time_s"]),
             human_bytes(c["sent_bytes"])] for c in profile.top_collectives(key)]))
    peak = profile.memory_peak
    lines += ["", f"Memory peak: {human_bytes(peak['bytes'])} on rank {peak['rank']} at "
              f"{human_seconds(peak['at_s'])}, {peak['during']}: " + ", ".join(
                  f"{k} {human_bytes(v)}" for k, v in peak["by_category"].items() if v)]
    if profile.stages is not None:
        st = profile.stages
        lines.append("Pipeline stages, compute per step: " + ", ".join(
            f"stage {i} {human_seconds(s)}" for i, s in enumerate(st["compute_per_step_s"]))
            + f"; the slowest (stage {st['slowest_stage']}) is {st['imbalance']:+.0%} over "
              f"the mean (layers per chunk {st['layers_per_chunk']})")
    lines += ["", profile.verdict.get("paragraph", "")]
    return "\n".join(lines)
