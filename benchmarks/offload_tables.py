"""The measured tables of docs/data-parallel-and-zero.md's offload section: GPU, host and
NVMe bytes, bytes across PCIe and to NVMe, and the simulated step time of ZeRO-1/2/3 with
and without ZeRO-Offload / ZeRO-Infinity, and how a larger batch amortises the cost.

    python benchmarks/offload_tables.py         # ~20 s on 2 cores

Every figure is read from a run's report (ranks[i].memory / memory_host / memory_nvme /
transfers / time: the ledgers and the simulated clock of the default H100 profile).
"""

from __future__ import annotations

from arguments import parse_no_flags

from minipar.plan import presets
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig
from minipar.train import TrainConfig, train
from minipar.viz.tables import human_bytes, human_seconds

if __name__ == "__main__":
    parse_no_flags(__doc__)  # --help says what it measures; no flags to mistype

BASE = dict(n_layer=2, d_model=64, n_head=4, seq_len=32, data="synthetic", steps=2,
            dp=2, micro_batch_size=4, precision="bf16-mixed")
LAYOUTS = [
    ("ZeRO-1", dict(zero=1)), ("ZeRO-1 + offload cpu", dict(zero=1, offload_optimizer="cpu")),
    ("ZeRO-2", dict(zero=2)), ("ZeRO-2 + offload cpu", dict(zero=2, offload_optimizer="cpu")),
    ("ZeRO-3", dict(zero=3)),
    ("ZeRO-3 + offload cpu", dict(zero=3, offload_optimizer="cpu")),
    ("ZeRO-3 + offload cpu, params cpu", dict(zero=3, offload_optimizer="cpu",
                                              offload_param="cpu")),
    ("ZeRO-3 + offload nvme, params nvme", dict(zero=3, offload_optimizer="nvme",
                                                offload_param="nvme")),
]


def table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(headers))) + " |"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def step_time(report) -> float:
    return report.step_end_s[-1] / len(report.steps)


def main() -> None:
    rows = []
    for name, settings in LAYOUTS:
        report = train(TrainConfig(**BASE, **settings))
        r, steps = report.ranks[0], len(report.steps)
        rows.append([name, human_bytes(r["memory"]["peak_total"]),
                     human_bytes(r["memory"]["optimizer"]),
                     human_bytes(r["memory_host"]["peak_total"]),
                     human_bytes(r["memory_nvme"]["peak_total"]),
                     human_bytes(r["transfers"]["to_host_bytes"] / steps),
                     human_bytes(r["transfers"]["to_device_bytes"] / steps),
                     human_bytes((r["transfers"]["nvme_read_bytes"]
                                  + r["transfers"]["nvme_write_bytes"]) / steps),
                     human_seconds(step_time(report))])
    print(f"dp=2, bf16-mixed, {report.n_params:,} parameters, micro-batch 4 x 32 tokens, "
          "rank 0, per step:")
    print(table(["layout", "GPU peak", "GPU optimizer", "host peak", "NVMe peak",
                 "PCIe down", "PCIe up", "NVMe r+w", "step time"], rows))
    rows = []
    for accum in (1, 4, 16):
        times = [step_time(train(TrainConfig(**{**BASE, "grad_accum_steps": accum},
                                             zero=1, offload_optimizer=device)))
                 for device in ("none", "cpu")]
        rows.append([accum, accum * 4 * 32, human_seconds(times[0]), human_seconds(times[1]),
                     f"{times[1] / times[0]:.2f}x"])
    print("\nZeRO-1, offload cpu vs none, as the batch grows (the copies and CPU Adam are "
          "per step, compute per token):")
    print(table(["accum", "tokens/rank/step", "no offload", "offload cpu", "ratio"], rows))

    # The same trade at real scale, from the planner (held to the emulator's measurements
    # in tests/plan/test_estimate.py): GPT-2 XL on 8 H100s, and Llama-2 7B on one.
    rows = []
    h100 = presets.cluster("h100")
    for model, gpus, batch, zero in (("gpt2-xl", 8, 64, 1), ("gpt2-xl", 8, 512, 1),
                                     ("gpt2-xl", 8, 4096, 1), ("llama2-7b", 1, 64, 1),
                                     ("llama2-7b", 1, 64, 3)):
        shape = presets.model(model)
        for optimizer, param in (("none", "none"), ("cpu", "none"), ("cpu", "cpu")):
            if param != "none" and zero < 3:
                continue
            config = ParallelConfig(dp=gpus, zero=zero, micro_batch_size=1,
                                    global_batch_size=batch, flash_attention=True,
                                    recompute_granularity="full",
                                    offload_optimizer=optimizer, offload_param=param)
            est = estimate(shape, config, h100)
            rows.append([model, gpus, batch, f"ZeRO-{zero} {optimizer}/{param}",
                         human_bytes(est.memory["peak_total"]),
                         human_bytes(est.memory_host["peak_total"]),
                         "yes" if est.fits else "no", human_seconds(est.step_time)])
    print("\nPlanner, H100 nodes, micro-batch 1, checkpointing, offload optimizer/params:")
    print(table(["model", "GPUs", "global batch", "layout", "GPU peak", "host peak",
                 "fits", "step time"], rows))


if __name__ == "__main__":
    main()
