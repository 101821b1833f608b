"""How long `minipar plan`'s advisor takes to search every layout of a cluster.

    python benchmarks/bench_plan.py

The advisor must feel instant on the command line; this prints the median wall time of
the search (5 runs) for a few model / cluster sizes, next to one closed-form estimate of
a single layout in the same process (the unit the search repeats).
"""

from __future__ import annotations

import statistics
import time
from functools import partial

from arguments import parse_no_flags

from minipar.plan import ParallelConfig, advise, estimate, presets

if __name__ == "__main__":
    parse_no_flags(__doc__)  # --help says what it measures; no flags to mistype

CASES = [("llama2-70b", 64, 1024), ("llama2-70b", 512, 1024), ("gpt3-175b", 512, 1536)]


def median_seconds(fn, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    cluster = presets.cluster("a100")
    for name, gpus, batch in CASES:
        shape = presets.model(name)
        layout = ParallelConfig(dp=gpus // 16, tp=8, pp=2, zero=1, micro_batch_size=1,
                                global_batch_size=batch)
        search = median_seconds(partial(advise, shape, gpus, cluster, global_batch_size=batch))
        one = median_seconds(partial(estimate, shape, layout, cluster, exact_pipeline=False))
        print(f"{name:12} {gpus:4} GPUs: search {search * 1e3:7.1f} ms "
              f"= {search / one:6.0f} x one estimate ({one * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
