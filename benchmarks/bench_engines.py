"""The demo model's step on the thread engine, on the torch engine, and under PyTorch DDP.

    python benchmarks/bench_engines.py [--rounds 3] [--steps 4] [--layouts dp4 3d]

Three ways to run one training step of the demo model (4 layers, d_model 192, 6 heads,
64 tokens, micro-batches of 4; fp32, so that PyTorch computes in the same dtype):

  threads  minipar's thread engine: every rank a thread of this process (one BLAS thread
           each), collectives handed between threads;
  torch    minipar's torch engine: every rank a process (one thread each), gloo on
           loopback TCP, the same rank program and ledgers;
  DDP      PyTorch's DistributedDataParallel over gloo in the same processes (the torch
           engine's), on the same model (benchmarks/bench_step.py's nanoGPT-style GPT-2,
           holding minipar's initial weights): the library baseline. For dp4 it is the
           same layout and batch; for dp2 x tp2 x pp2 (8 ranks), DDP has no TP or PP, so
           it runs dp8 on the same global batch (32 sequences): a reference, not a twin.

The three alternate round by round, so that the machine's load hits each alike; a step's
time is the median over the rounds of the median over steps after the first (rank 0's
wall marks; the ranks meet at every step). Printed: each runner's step time and the
ratios, in one run; the CPU time per step of the thread engine's process (a run of k
steps minus a 1-step run, over k - 1) and of DDP's processes (summed: on shared cores
a layout of several processes takes a larger share of them than one process of threads,
so wall ratios favour it as the load grows); a floor: the CPU per step of one device
on the same global batch (same rounds), spread over the cores, against DDP's wall (what
the thread engine would take with no cost of its own and every core busy, and lower
than any layout's, which adds arithmetic of its own: dp4's four replicas each run AdamW,
and the all-reduce sums; where the floor is above 0.8 x DDP, no saving in the emulator
reaches 0.8); the torch engine's start-up (the first
pool of processes pays for importing torch in the forkserver; a later pool forks it
warm); and, from the torch engine's report, per op the bytes its ranks put on their
sockets (TCP_INFO) beside the ledger's ring-formula bytes. Skips with a message without
torch (pip install -e '.[torch]').
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np
from arguments import positive_int
from machine import describe

MODEL = dict(n_layer=4, d_model=192, n_head=6, seq_len=64, micro_batch_size=4,
             precision="fp32", data="corpus", seed=0)
LAYOUTS = {"dp4": (dict(dp=4, grad_accum_steps=4), dict(dp=4, accum=4)),
           "3d": (dict(dp=2, tp=2, pp=2, zero=1, grad_accum_steps=4, gpus_per_node=4),
                  dict(dp=8, accum=1))}


def ddp_steps(steps: int, accum: int, vocab: int) -> list[tuple[float, float]]:
    """One DDP rank (run on the torch engine's processes: the default group is theirs):
    (wall, CPU of this process) seconds of each step."""
    import torch
    import torch.distributed as tdist
    from bench_step import build_torch_model
    from torch.nn.parallel import DistributedDataParallel

    from minipar.nn import GPT, GPTConfig

    config = GPTConfig(vocab_size=vocab, seq_len=MODEL["seq_len"], n_layer=MODEL["n_layer"],
                       n_head=MODEL["n_head"], d_model=MODEL["d_model"])
    state = GPT(config, seed=0, precision="fp32").state_dict()
    model = DistributedDataParallel(build_torch_model(torch, config, state))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(tdist.get_rank())
    shape = (MODEL["micro_batch_size"], MODEL["seq_len"])
    batches = [(torch.from_numpy(rng.integers(0, vocab, shape)),
                torch.from_numpy(rng.integers(0, vocab, shape))) for _ in range(accum)]
    times = []
    for _ in range(steps):
        began, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        for k, (idx, targets) in enumerate(batches):
            with model.no_sync() if k < accum - 1 else contextlib.nullcontext():
                (model(idx, targets) / accum).backward()
        optimizer.step()
        times.append((time.perf_counter() - began, time.process_time() - cpu))
    return times


def later(times: list[float]) -> float:
    return statistics.median(times[1:] or times)


def cpu_per_step(train, config: dict, engine) -> float:
    """CPU seconds of this process per step of `config` after the first: a run's CPU
    minus a 1-step run's (building the model, the first step), over the other steps."""
    began = time.process_time()
    train(**config, engine=engine)
    run_cpu = time.process_time() - began
    began = time.process_time()
    train(**{**config, "steps": 1}, engine=engine)
    return (run_cpu - time.process_time() + began) / (config["steps"] - 1)


def bench_layout(name: str, rounds: int, steps: int, get_engine, train) -> dict:
    settings, ddp = LAYOUTS[name]
    config = dict(**MODEL, **settings, steps=steps)
    world = settings.get("dp", 1) * settings.get("tp", 1) * settings.get("pp", 1)
    # one device on the same global batch, in the same micro-batches: the arithmetic
    # every layout shares, and what an emulator that cost nothing would still pay
    single = dict(**MODEL, steps=steps, grad_accum_steps=settings.get("grad_accum_steps", 1)
                  * settings.get("dp", 1))
    times: dict[str, list[float]] = {"threads": [], "torch": [], "DDP": []}
    cpu: dict[str, list[float]] = {"threads": [], "DDP": [], "one device": []}  # s per step
    threads = get_engine("threads")
    with get_engine("torch", nproc_per_node=world) as engine:  # DDP too: dp = world
        report = None
        for _ in range(rounds):
            began = time.process_time()
            ours = train(**config, engine=threads)
            run_cpu = time.process_time() - began
            times["threads"].append(later(ours.ranks[0]["measured"]["wall_step_s"]))
            if steps > 1:  # a 1-step run's CPU (building, the first step) taken off
                began = time.process_time()
                train(**{**config, "steps": 1}, engine=threads)
                cpu["threads"].append((run_cpu - time.process_time() + began) / (steps - 1))
                cpu["one device"].append(cpu_per_step(train, single, threads))
            report = train(**config, engine=engine)
            times["torch"].append(later(report.ranks[0]["measured"]["wall_step_s"]))
            done = engine.launch(ddp_steps, world, steps, ddp["accum"],
                                 report.config["vocab_size"])
            times["DDP"].append(later([wall for wall, _ in done.results[0]]))
            cpu["DDP"].append(sum(later([c for _, c in rank]) for rank in done.results))
    return {"times": {k: statistics.median(v) for k, v in times.items()},
            "cpu": {k: statistics.median(v) for k, v in cpu.items() if v},
            "report": report, "startup": report.engine["startup_s"], "world": world}


def wire_rows(report) -> list[list]:
    ops: dict[str, list] = {}
    for rank in report.ranks:
        for op, entry in rank["measured"]["wire_by_op"].items():
            row = ops.setdefault(op, [0, 0, entry["algorithm"]])
            row[0] += entry["ledger_sent_bytes"] or 0
            row[1] += entry["wire_sent_bytes"]
    return [[op, ledger, wire, f"{wire / ledger:.3f}" if ledger else "-", algorithm or ""]
            for op, (ledger, wire, algorithm) in sorted(ops.items())]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--steps", type=positive_int, default=4,
                        help="steps per run (the first is not timed)")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("skipped: PyTorch is not installed (pip install -e '.[torch]')")
        return 0
    from minipar.distributed.engines import get_engine
    from minipar.train import train
    from minipar.viz.tables import format_table

    print(f"{describe()}; torch {torch.__version__}; {args.rounds} rounds x {args.steps} "
          "steps")
    for name in args.layouts:
        began = time.perf_counter()
        result = bench_layout(name, args.rounds, args.steps, get_engine, train)
        t = result["times"]
        print(f"\n{name} ({result['world']} ranks), demo model, fp32: step time "
              f"(median; {time.perf_counter() - began:.0f} s of benchmark)")
        print(format_table(["threads", "torch engine", "DDP (gloo)", "torch / threads",
                            "torch / DDP", "threads / DDP"],
                           [[f"{1e3 * t['threads']:.0f} ms", f"{1e3 * t['torch']:.0f} ms",
                             f"{1e3 * t['DDP']:.0f} ms", f"{t['torch'] / t['threads']:.2f}",
                             f"{t['torch'] / t['DDP']:.2f}",
                             f"{t['threads'] / t['DDP']:.2f}"]]))
        c = result["cpu"]
        if c:  # the torch engine's CPU is its processes': not measured here
            print(f"CPU per step: threads {1e3 * c['threads']:.0f} ms (this process), DDP "
                  f"{1e3 * c['DDP']:.0f} ms (its {result['world']} processes), threads / "
                  f"DDP {c['threads'] / c['DDP']:.2f}")
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else os.cpu_count() or 1  # (the cores this process may run on)
            floor = c["one device"] / min(cores, result["world"])
            print(f"floor: one device's CPU per step on the same global batch, "
                  f"{1e3 * c['one device']:.0f} ms, spread over {min(cores, result['world'])} "
                  f"core(s): {1e3 * floor:.0f} ms = {floor / t['DDP']:.2f} x DDP's wall "
                  "(the threads' wall with no cost of their own and every core busy)")
        print(f"start-up of the torch engine's {result['world']} processes: "
              f"{result['startup']:.1f} s" + (" (the first pool: torch imported in the "
                                               "forkserver)" if name == args.layouts[0]
                                               else " (forked from a warm forkserver)"))
        print("bytes sent over the run, summed over the ranks: the ledger (ring formula) "
              "and the sockets (TCP_INFO)")
        print(format_table(["op", "ledger", "wire", "wire / ledger", "gloo's algorithm"],
                           wire_rows(result["report"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
