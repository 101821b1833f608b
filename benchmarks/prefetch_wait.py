"""How long a reader's change waits when it comes while the explorers' worker prepares a
neighbouring setting of a given size (minipar/viz/prefetch.py; the cap, PREFETCH_MAX_RANKS,
in minipar/viz/runs.py).

    python benchmarks/prefetch_wait.py                 # a 32-rank neighbour (~30 s)
    python benchmarks/prefetch_wait.py --tp 4          # 64 ranks
    python benchmarks/prefetch_wait.py --tp 4 --pp 2   # 128 ranks

A traffic explorer is shown at dp 8, tp 2 (or --tp), pp 1 (or --pp), ZeRO-0; its
neighbour with twice the pipeline stages is queued as spare work, whatever the cap. The
bench waits until the worker starts on it, sleeps `--delays` seconds into it, then times an
urgent job that does nothing (`run_now(lambda: None)`: what an answer waits before it can
start) and says which phase the spare job was in: its run (cancelled at the ranks' next
call into minipar) or its figures (matplotlib cannot be interrupted).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("MINIPAR_CACHE_DIR", "off")  # every neighbour measured afresh

from minipar.viz.runs import traffic_key  # noqa: E402
from minipar.viz.widgets import TrafficExplorer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, choices=[1, 2, 4])
    parser.add_argument("--pp", type=int, default=1, choices=[1, 2])
    parser.add_argument("--micro-batches", type=int, default=2, choices=[1, 2, 4])
    parser.add_argument("--delays", default="0.05,0.15,0.3,0.45,0.6,0.8,1.0",
                        help="seconds into the spare job at which the change comes")
    args = parser.parse_args()
    explorer = TrafficExplorer(prefetch=True, dp=8, tp=args.tp, pp=args.pp, zero=0,
                               grad_accum_steps=args.micro_batches)
    worker, shown = explorer.worker, explorer.values()
    neighbour = {**shown, "pp": 2 * args.pp}
    key = explorer.picture_key(neighbour)
    run = traffic_key(explorer.config.replace(
        **{k: v for k, v in neighbour.items() if k != "by"}))
    print(f"neighbour: {8 * args.tp * 2 * args.pp} ranks, {args.micro_batches} micro-batches")
    for delay in (float(d) for d in args.delays.split(",")):
        before = set(explorer.cache._runs)
        worker.prefetch(explorer, [(key, lambda: explorer._prefetch(key, neighbour,
                                                                    explorer._style))])
        deadline = time.monotonic() + 120
        while worker._spare_key != key and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
        if worker._spare_key != key:
            print(f"  +{delay:.2f} s: the neighbour was ready already")
        else:
            phase = "figures" if run in explorer.cache else "run"
            started = time.perf_counter()
            worker.run_now(lambda: None)
            waited = (time.perf_counter() - started) * 1e3
            print(f"  +{delay:.2f} s ({phase}): the change waited {waited:.0f} ms")
        worker.wait_idle(60)
        explorer.cache.discard(set(explorer.cache._runs) - before)  # measured afresh
    worker.cancel(explorer)


if __name__ == "__main__":
    main()
