"""What a new explorer setting costs at the least, and what preparing its neighbours costs:
the two figures that decide whether issue 19's item 6 ("every explorer answers a new
setting in under 0.2 s on 2 busy cores") can be met by computing faster or earlier.

    python benchmarks/explorer_floor.py                        # traffic, dp 4 tp 4 pp 1
    python benchmarks/explorer_floor.py --setting dp=2 tp=2 pp=2
    python benchmarks/explorer_floor.py --explorer memory --setting dp=8 zero=3

For one setting of one explorer (built with prefetch off and the disk store off, so
everything is measured and drawn here), CPU time of the process (time.process_time):

    answer        the setting itself, its measured run and its pictures, as a reader's
                  first visit to it costs (the explorer's first draw)
    pictures      the same setting drawn again from its run (a view or a GPUs-per-node
                  change; traffic only): what is left when the run costs nothing
    neighbours    every setting one control change away that the background worker
                  would prepare (minipar/viz/explorer.py `_prefetch_neighbours`: the
                  same calls, one after another), their CPU in all and one by one

Ratios, against the target and against a reader's look: answer / 0.2 s, and the share of
the neighbours a look of --look seconds can prepare when the worker gets --share of a
core (2/3 with two other busy processes on 2 cores: bench_widgets --busy 2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from arguments import fraction, positive_float

os.environ["MINIPAR_CACHE_DIR"] = "off"
try:
    from minipar.viz import widgets
except ImportError as error:  # ipywidgets missing
    print(f"skipped: {error}")
    sys.exit(0)

EXPLORERS = {"traffic": widgets.TrafficExplorer, "memory": widgets.MemoryExplorer,
             "pipeline": widgets.PipelineExplorer, "sharding": widgets.ShardingExplorer}
TARGET_S = 0.2  # issue 19, item 6


def parse_setting(parser: argparse.ArgumentParser, words: list[str]) -> dict:
    setting = {}
    for word in words:
        name, equals, text = word.partition("=")
        if not equals or not name or not text:
            parser.error(f"--setting takes name=value words, got {word!r}")
        setting[name] = int(text) if text.lstrip("-").isdigit() else text
    return setting


def cpu_of(action) -> float:
    started = time.process_time()
    action()
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--explorer", choices=EXPLORERS, default="traffic")
    parser.add_argument("--setting", nargs="*", default=None,
                        help="name=value words (default: dp=4 tp=4 pp=1 for the traffic "
                             "explorer, the explorer's own first setting for the others)")
    parser.add_argument("--look", type=positive_float, default=3.0, help="seconds a reader looks")
    parser.add_argument("--share", type=fraction, default=2 / 3,
                        help="the share of a core the worker gets meanwhile")
    args = parser.parse_args()
    if args.setting is None:
        args.setting = ["dp=4", "tp=4", "pp=1"] if args.explorer == "traffic" else []
    cls, setting = EXPLORERS[args.explorer], parse_setting(parser, args.setting)

    try:  # imports, fonts and first draws out of the way; and the setting checked
        cls(prefetch=False)
        refused = cls(prefetch=False, **setting).error
    except (KeyError, ValueError) as error:  # a control it lacks, an option it lacks
        parser.error(str(error).strip('"'))
    if refused:
        parser.error(f"the {args.explorer} explorer refuses this setting: {refused}")
    answers = []
    for _ in range(3):
        holder = []
        answers.append(cpu_of(lambda h=holder: h.append(cls(prefetch=False, **setting))))
    explorer = holder[0]
    answer = statistics.median(answers)
    values = explorer.values()
    print(f"# {args.explorer} explorer at {values}")
    print(f"answer (run + pictures), CPU: {answer * 1e3:.0f} ms, median of 3 "
          f"({min(answers) * 1e3:.0f}-{max(answers) * 1e3:.0f}); "
          f"{answer / TARGET_S:.1f}x the {TARGET_S:g} s target")
    if "gpus_per_node" in values:  # the traffic explorer shares one run between these
        other = next(v for v in explorer.controls["gpus_per_node"].options
                     if v != values["gpus_per_node"])
        pictures = cpu_of(lambda: explorer.set(gpus_per_node=other))
        print(f"pictures alone (gpus_per_node {values['gpus_per_node']} -> {other}, the run "
              f"shared), CPU: {pictures * 1e3:.0f} ms; the run: ~{(answer - pictures) * 1e3:.0f}"
              f" ms")
        explorer.set(gpus_per_node=values["gpus_per_node"])

    costs = []
    for near in explorer.neighbours(values):
        key = explorer.picture_key(near)
        try:
            if explorer.prefetch_cost(near) is None:
                continue  # the worker leaves it out (more than PREFETCH_MAX_RANKS ranks)
        except widgets.REFUSALS:
            continue  # refused: a status line, no run
        if key in explorer.cache:
            continue
        changed = {k: v for k, v in near.items() if values[k] != v}
        costs.append((cpu_of(lambda k=key, s=near: explorer._prefetch(
            k, s, explorer._style)), changed))
    total = sum(c for c, _ in costs)
    print(f"neighbours the worker prepares: {len(costs)}, CPU {total:.2f} s in all")
    for cost, changed in sorted(costs, key=lambda item: item[0]):
        print(f"  {cost * 1e3:6.0f} ms  {changed}")
    prepared = args.look * args.share
    print(f"a {args.look:g} s look with {args.share:.2f} of a core prepares {prepared:.1f} s "
          f"of it: {min(1.0, prepared / max(total, 1e-9)):.0%} of the neighbours' CPU")


if __name__ == "__main__":
    main()
