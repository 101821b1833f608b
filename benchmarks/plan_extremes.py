"""CPU time of `minipar plan` on the largest inputs it accepts (each in its own process).

    python benchmarks/plan_extremes.py              # every case, one line each
    python benchmarks/plan_extremes.py --limit 60   # give up on a case after 60 s of wall time

The cases are the planner's slowest known inputs (a 4096-layer model searched, a 64-stage
pipeline of 65,536 micro-batches evaluated, Mixtral searched on 512 GPUs) and the other
corners of what the CLI accepts: the most layers, the most micro-batches on every kind of
schedule, clusters whose GPU count has many divisors, the most experts. Each runs as
`python -m minipar plan ...` in a child; its CPU time (user + system, the child's own
getrusage) is what is printed, since the machine may be shared. A case that does not
finish within --limit seconds of wall time is killed and printed as such.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

DEEP = ["--n-layer", "4096", "--d-model", "1024", "--n-head", "16", "--vocab-size", "50257"]
TOY = ["--n-layer", "4096", "--d-model", "64", "--n-head", "4", "--vocab-size", "65"]
CASES = [
    ("4096 layers searched on 8 GPUs", [*DEEP, "--gpus", "8"]),
    ("4096 layers searched on 64 GPUs", [*DEEP, "--gpus", "64"]),
    ("4096 layers searched on 4096 GPUs", [*DEEP, "--gpus", "4096"]),
    ("4096 tiny layers on 720,720 GPUs", [*TOY, "--gpus", "720720"]),
    ("pp 64, 65,536 micro-batches (1f1b)", ["--model", "llama2-70b", "--pp", "64",
                                           "--grad-accum-steps", "65536"]),
    ("pp 64 x dp 2, 65,536 micro-batches, gpipe", ["--model", "llama2-70b", "--pp", "64",
                                                  "--dp", "2", "--schedule", "gpipe",
                                                  "--grad-accum-steps", "65536"]),
    ("pp 32 x v 2 interleaved, 65,536 micro-batches", [
        "--model", "llama2-70b", "--pp", "32", "--schedule", "interleaved",
        "--virtual-stages", "2", "--grad-accum-steps", "65536"]),
    ("pp 64 zb-h1, 65,536 micro-batches", ["--model", "llama2-70b", "--pp", "64",
                                          "--schedule", "zb-h1",
                                          "--grad-accum-steps", "65536"]),
    ("pp 40 dualpipe-v, 65,536 micro-batches", ["--model", "llama2-70b", "--pp", "40",
                                               "--schedule", "dualpipe-v",
                                               "--virtual-stages", "2",
                                               "--grad-accum-steps", "65536"]),
    ("4096 layers, pp 4096, 16 micro-batches each", [*TOY, "--pp", "4096",
                                                    "--grad-accum-steps", "65536"]),
    ("mixtral-8x7b searched on 512 GPUs", ["--model", "mixtral-8x7b", "--gpus", "512"]),
    ("mixtral-8x7b searched on 4096 GPUs", ["--model", "mixtral-8x7b", "--gpus", "4096"]),
    ("4096 experts searched on 4096 GPUs", [
        "--n-layer", "32", "--d-model", "1024", "--n-head", "16", "--vocab-size", "50257",
        "--moe-num-experts", "4096", "--gpus", "4096"]),
    ("llama2-70b on 64 GPUs, 524,288 sequences", ["--model", "llama2-70b", "--gpus", "64",
                                                  "--global-batch-size", "524288"]),
    ("gpt3-175b searched on 16,384 GPUs", ["--model", "gpt3-175b", "--gpus", "16384"]),
]


def run(argv: list[str], limit: float) -> tuple[float | None, int | None, str]:
    """(CPU seconds, exit status, last line of stderr) of `minipar plan argv`; (None,
    None, ...) if it was killed after `limit` seconds."""
    before = os.times()
    child = subprocess.Popen([sys.executable, "-m", "minipar", "plan", *argv],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = child.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return None, None, f"killed after {limit:g} s of wall time"
    after = os.times()
    cpu = (after.children_user - before.children_user
           + after.children_system - before.children_system)
    lines = [line for line in err.splitlines() if line.strip()]
    return cpu, child.returncode, lines[-1][:100] if lines else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=float, default=300.0,
                        help="seconds of wall time before a case is killed (default 300)")
    args = parser.parse_args()
    if not args.limit > 0:
        parser.error(f"--limit must be > 0, got {args.limit}")
    worst = 0.0
    for name, argv in CASES:
        started = time.monotonic()
        cpu, status, said = run(argv, args.limit)
        wall = time.monotonic() - started
        shown = "   -   " if cpu is None else f"{cpu:6.2f} s"
        print(f"{shown} CPU ({wall:5.1f} s wall)  exit {status}  {name}"
              + (f"  [{said}]" if said and status not in (0, 1) else ""), flush=True)
        worst = max(worst, float("inf") if cpu is None else cpu)
    print(f"slowest: {worst:.2f} s of CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
