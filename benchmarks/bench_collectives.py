"""Emulator overhead per collective per rank, for 2, 8 and 32 virtual ranks.

Every rank calls one collective K times on a tiny array (8 float32 per rank), so the
arithmetic is negligible and the wall time is the emulator's own cost: the rendezvous
(lock, condition variables, thread switches under the GIL), signature checks, the byte
ledger and the clock. We report wall time / (K x ranks): what one rank's call costs.

    python benchmarks/bench_collectives.py            # full table (~10-20 s)
    python benchmarks/bench_collectives.py --quick    # fewer calls, for a smoke run
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from minipar import distributed as dist

ELEMENTS = 8  # per rank


def _exchange(x):
    """A ring shift on send/recv: isend to the successor, recv from the predecessor."""
    rank, n = dist.get_rank(), dist.get_world_size()
    request = dist.isend(x, (rank + 1) % n)
    dist.recv((rank - 1) % n)
    request.wait()


# op -> (input of one rank for n ranks, the call). Inputs are built once, outside the loop.
OPS = {
    "all_reduce": (lambda n: np.ones(ELEMENTS, np.float32), dist.all_reduce),
    "all_gather": (lambda n: np.ones(ELEMENTS, np.float32), dist.all_gather),
    "reduce_scatter": (lambda n: np.ones(ELEMENTS * n, np.float32), dist.reduce_scatter),
    "broadcast": (lambda n: np.ones(ELEMENTS, np.float32), lambda x: dist.broadcast(x, src=0)),
    "barrier": (lambda n: None, lambda x: dist.barrier()),
    "isend/recv ring": (lambda n: np.ones(ELEMENTS, np.float32), _exchange),
}


def measure(op: str, n: int, calls: int, repeats: int = 3) -> float:
    """Best-of-`repeats` seconds per call per rank."""
    make_input, call = OPS[op]

    def worker():
        x = make_input(n)
        for _ in range(calls):
            call(x)

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dist.launch(worker, n)
        elapsed = time.perf_counter() - start
        start = time.perf_counter()
        dist.launch(lambda: None, n)  # thread start-up, subtracted
        elapsed -= time.perf_counter() - start
        best = min(best, elapsed / (calls * n))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls per rank")
    args = parser.parse_args()
    ranks = (2, 8, 32)
    calls = {2: 2000, 8: 500, 32: 120}
    if args.quick:
        calls = {n: max(10, k // 10) for n, k in calls.items()}
    print(f"emulator overhead, microseconds per call per rank ({ELEMENTS} float32 per rank)")
    print(f"{'op':<18}" + "".join(f"{f'{n} ranks':>12}" for n in ranks))
    for op in OPS:
        row = [measure(op, n, calls[n]) * 1e6 for n in ranks]
        print(f"{op:<18}" + "".join(f"{us:>12.1f}" for us in row))


if __name__ == "__main__":
    main()
