"""The measured tables of docs/data-parallel-and-zero.md: memory, traffic, accumulation,
bucket overlap, equivalence and wall-clock cost of DP and ZeRO-1/2/3.

    python benchmarks/zero_tables.py            # ~1 minute on 2 cores
    python benchmarks/zero_tables.py --quick    # smaller model, fewer runs

Every figure is read from a run's report (the per-rank memory ledger, byte ledger and
simulated clock); the ZeRO paper's formulas are printed next to them, not used for them.
Wall-clock times are best of 3 on this machine (set OPENBLAS_NUM_THREADS=1: eight rank
threads each asking OpenBLAS for its own thread pool oversubscribe the cores).
"""

from __future__ import annotations

import argparse
import time

from minipar import distributed as dist
from minipar.train import TrainConfig, train

STAGES = ("DP (ZeRO-0)", "ZeRO-1", "ZeRO-2", "ZeRO-3")
BYTES = {"bf16-mixed": (2, 2, 12), "fp32": (4, 4, 8)}


def table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(headers))) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def paper_bytes(stage: int, psi: int, n: int, k) -> float:
    """Model-state bytes per device (Rajbhandari et al. 2020, Figure 1)."""
    p, g, o = k
    return [(p + g + o) * psi, (p + g) * psi + o * psi / n, p * psi + (g + o) * psi / n,
            (p + g + o) * psi / n][stage]


def memory(base: dict, n: int) -> str:
    rows = []
    for precision in ("bf16-mixed", "fp32"):
        for stage in range(4):
            r = train(TrainConfig(dp=n, zero=stage, precision=precision, steps=1, **base))
            m, psi = r.ranks[0]["memory"], r.n_params
            measured = m["params"] + m["grads"] + m["optimizer"]
            paper = paper_bytes(stage, psi, n, BYTES[precision])
            rows.append([f"{precision} {STAGES[stage]}", f"{m['params'] / psi:.3f}",
                         f"{m['grads'] / psi:.3f}", f"{m['optimizer'] / psi:.3f}",
                         f"{measured / psi:.4f}", f"{paper / psi:.4f}",
                         r.ranks[0]["sharding"]["padding_elements"]])
    return table(["run", "params B/Ψ", "grads B/Ψ", "optimizer B/Ψ", "total B/Ψ (measured)",
                  "paper B/Ψ", "padding (elements)"], rows)


def traffic(base: dict, n: int) -> str:
    rows = []
    for stage in range(4):
        r = train(TrainConfig(dp=n, zero=stage, precision="bf16-mixed", steps=1, **base))
        comm, psi = r.ranks[0]["comm"], r.n_params
        by_op = {op: b // 2 for op, b in comm["by_op"].items()}  # bf16: 2 bytes/element
        paper = (3 if stage == 3 else 2) * (n - 1) / n * psi
        rows.append([STAGES[stage], by_op.get("all_reduce", 0), by_op.get("reduce_scatter", 0),
                     by_op.get("all_gather", 0), f"{comm['by_group']['dp'] // 2 / psi:.4f}",
                     f"{paper / psi:.4f}", comm["calls"]])
    return table(["stage", "all-reduce (elem)", "reduce-scatter (elem)", "all-gather (elem)",
                  "sent / Ψ (measured)", "paper / Ψ", "calls"], rows)


def accumulation(base: dict, n: int) -> str:
    rows = []
    for stage in range(4):
        row = [STAGES[stage]]
        for accum in (1, 2, 4):
            r = train(TrainConfig(dp=n, zero=stage, grad_accum_steps=accum,
                                  precision="bf16-mixed", steps=1, **base))
            row.append(f"{r.ranks[0]['comm']['by_group']['dp'] // 2 / r.n_params:.3f}")
        rows.append(row)
    return table(["stage", "A = 1", "A = 2", "A = 4"], rows)


def overlap(base: dict, n: int) -> str:
    # This toy model computes a step in 0.2 µs on an H100, less than one ring step's
    # latency: its transfers are latency-bound. The second device computes 10,000x slower
    # and communicates 100x slower, so backward lasts longer than the transfers, as for
    # a real model on a real GPU.
    slow = dist.DeviceProfile(name="slow", flops=40e9, intra_node_bandwidth=4.5e9)
    rows = []
    for label, profile in (("H100 (default)", None), ("slow compute", slow)):
        for stage in (0, 2):
            for mb in (0.0, 0.1, 0.02):
                r = train(TrainConfig(dp=n, zero=stage, bucket_size_mb=mb, precision="fp32",
                                      steps=1, **base), device=profile)
                t = r.ranks[0]["time"]
                rows.append([label, STAGES[stage], "one" if mb == 0 else f"{mb} MiB",
                             r.ranks[0]["sharding"]["buckets"],
                             f"{t['compute_s'] * 1e6:.2f}", f"{t['comm_s'] * 1e6:.2f}",
                             f"{r.ranks[0]['memory']['buffers'] / 1024:.0f}"])
    return table(["device", "stage", "bucket", "buckets", "compute (µs)",
                  "exposed comm (µs)", "buffers peak (KiB)"], rows)


def equivalence(base: dict, n: int) -> str:
    rows = []
    for precision in ("fp64", "fp32", "bf16-mixed"):
        worst_param = worst_loss = 0.0
        passed = True
        for stage in range(4):
            r = train(TrainConfig(dp=n, zero=stage, grad_accum_steps=2, precision=precision,
                                  check=True, steps=10, grad_clip=0.5, **base))
            e = r.equivalence
            worst_param = max(worst_param, e["max_rel_param_diff_per_step"])
            worst_loss = max(worst_loss, e["max_rel_loss_diff"])
            passed &= e["passed"]
        rows.append([precision, f"{worst_loss:.1e}", f"{worst_param:.1e}",
                     f"{e['tolerance']:.0e} ({e['relative_to']})", passed])
    return table(["precision", "max rel. loss diff", "max rel. param diff (any step, rank)",
                  "tolerance (scale)", "passed"], rows)


def zero3_rhythm(base: dict) -> str:
    """Rank 0's timeline of one ZeRO-3 step: what it did, in order (F forward compute,
    B backward, O optimizer, AG all-gather, RS reduce-scatter, AR all-reduce, "wait"
    idle until the group's previous collective is done)."""
    r = train(TrainConfig(dp=2, zero=3, precision="fp32", steps=1, tie_embeddings=False,
                          **base))
    names = {"forward": "F", "backward": "B", "optimizer": "O"}
    ops = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    out = []
    for event in r.timelines[0]:
        if event.kind == "comm":
            out.append(ops[event.label.split()[0]])
        elif event.kind in names:
            out.append(names[event.kind])
        elif event.kind == "idle":
            out.append("wait")
    return " ".join(out)


def wall_clock(base: dict, repeats: int) -> str:
    def best(config):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            train(config)
            times.append(time.perf_counter() - start)
        return min(times)

    micro = 4
    single = best(TrainConfig(micro_batch_size=8 * micro, steps=5, **base))
    rows = [["1 device, micro-batch 32", f"{single:.3f}", "1.00"]]
    for stage in range(4):
        t = best(TrainConfig(dp=8, zero=stage, micro_batch_size=micro, steps=5, **base))
        rows.append([f"8 ranks x micro-batch 4, {STAGES[stage]}", f"{t:.3f}",
                     f"{t / single:.2f}"])
    return table(["run (global batch 32, 5 steps, fp32)", "wall s (best)", "vs 1 device"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer runs")
    args = parser.parse_args()
    if args.quick:
        base = dict(seq_len=8, n_layer=1, d_model=16, n_head=2)
    else:
        base = dict(seq_len=32, n_layer=2, d_model=64, n_head=4)
    model = TrainConfig(**base)
    print(f"model: n_layer={model.n_layer}, d_model={model.d_model}, seq_len={model.seq_len},"
          f" corpus vocabulary; micro-batch {model.micro_batch_size}\n")
    print("### Model-state memory per rank, N = 4 (ledger peaks, rank 0)\n")
    print(memory({**base, "tie_embeddings": False}, 4) + "\n")
    print("### Memory at N = 3 (shards need padding)\n")
    print(memory({**base, "tie_embeddings": False}, 3) + "\n")
    print("### Memory at N = 8\n")
    print(memory({**base, "tie_embeddings": False}, 8) + "\n")
    print("### Traffic per rank per step, N = 4, bf16 (untied embeddings)\n")
    print(traffic({**base, "tie_embeddings": False}, 4) + "\n")
    print("### Traffic per rank per step with gradient accumulation (sent / Ψ), N = 4\n")
    print(accumulation({**base, "tie_embeddings": False}, 4) + "\n")
    print("### Gradient buckets: exposed communication, N = 4, one step, rank 0\n")
    print(overlap(base, 4) + "\n")
    print("### Equivalence with single-device training, N = 4, A = 2, 10 steps, "
          "clipping on\n")
    print(equivalence(base, 4) + "\n")
    print("### ZeRO-3 timeline of rank 0, one step (N = 2, untied embeddings)\n")
    print(zero3_rhythm(base) + "\n")
    print("### Wall-clock cost of the emulation\n")
    print(wall_clock(base, 1 if args.quick else 3))


if __name__ == "__main__":
    main()
