"""The measured tables of docs/data-parallel-and-zero.md, "Sharding across nodes": ZeRO-3,
HSDP, FSDP2's reshard_after_forward and ZeRO++ on the demo-sized model, 2 nodes x 4 GPUs.

    python benchmarks/across_nodes.py              # memory and bytes (~30 s on 2 cores)
    python benchmarks/across_nodes.py --deviation  # + the quantised runs' deviation after
                                                   #   20 steps (~3 minutes)

Every figure is read from a run's report: per-rank peak bytes from the memory ledger,
bytes per step from the byte ledger (`ranks[i].comm.by_link`: to a GPU of the same node
or of another; `by_group`: by group kind), the simulated time of the last step on the
demo's GPU (minipar/demo.py's DEMO_PROFILE: H100's link ratios, the inter-node link 9x
slower than NVLink), the losses from the steps and the check's `equivalence` section.
The papers' formulas are printed beside them, not used for them.
"""

from __future__ import annotations

import argparse

from minipar.demo import DEMO_PROFILE
from minipar.train import train

# The demo model (minipar/demo.py) on 8 ranks, 2 nodes of 4, ZeRO-3 over all 8.
DEMO = dict(n_layer=4, d_model=192, n_head=6, seq_len=64, micro_batch_size=4,
            precision="bf16-mixed", zero=3, dp=8, gpus_per_node=4)
CASES = {
    "ZeRO-3": {},
    "HSDP(4) / MiCS": dict(hsdp_shard_size=4),
    "hpZ(4)": dict(zero_hpz_partition_size=4),
    "hpZ(4) + qwZ + qgZ": dict(zero_hpz_partition_size=4, zero_quantized_weights=True,
                               zero_quantized_gradients=True),
    "reshard_after_forward=False": dict(reshard_after_forward=False),
    "reshard_after_forward=4": dict(reshard_after_forward=4),
    "qwZ": dict(zero_quantized_weights=True),
    "qgZ": dict(zero_quantized_gradients=True),
}
QUANTISED = ("qwZ", "qgZ", "hpZ(4) + qwZ + qgZ")
MIB = 2**20


def table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(headers))) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def per_step(report, *keys) -> list[float]:
    """A ranks[i] figure summed over the run, per step, for every rank."""
    values = []
    for rank in report.ranks:
        value = rank
        for key in keys:
            value = value.get(key, 0)
        values.append(value / len(report.steps))
    return values


def memory_and_bytes(steps: int, settings: dict) -> str:
    rows = []
    for name, case in CASES.items():
        r = train(**DEMO, **settings, **case, steps=steps, device=DEMO_PROFILE)
        inter = per_step(r, "comm", "by_link", "inter_node")
        intra = per_step(r, "comm", "by_link", "intra_node")
        groups = {kind: sum(per_step(r, "comm", "by_group", kind))
                  for kind in r.ranks[0]["comm"]["by_group"]}
        shown = ", ".join(f"{kind} {b / MIB:.2f}" for kind, b in groups.items() if b)
        rows.append([name, f"{max(r.memory('peak_total')) / MIB:.2f}",
                     f"{max(r.memory('params')) / MIB:.2f}",
                     f"{max(r.memory('optimizer')) / MIB:.2f}",
                     f"{sum(inter[:4]) / MIB:.2f}", f"{max(inter) / MIB:.2f}",
                     f"{sum(intra) / len(intra) / MIB:.2f}",
                     f"{(lambda w: w[1] - w[0])(r.step_window()) * 1e3:.1f}", shown])
    return table(["layout", "peak GPU MiB/rank", "params", "optimizer",
                  "inter-node MiB/step, node 0", "... busiest rank",
                  "intra-node MiB/step, mean rank", "simulated ms/step",
                  "sent MiB/step by group, all ranks"], rows)


def zeropp_ratio(settings: dict) -> str:
    """The ZeRO++ paper's 3M -> 0.75M, measured: node 0's inter-node bytes of one step
    in units of M, the model's bf16 bytes; the untied model has no second gather of wte."""
    rows = []
    for tied in (True, False):
        base = {**DEMO, **settings, "steps": 1, "tie_embeddings": tied}
        zero3 = train(**base)
        zeropp = train(**base, **CASES["hpZ(4) + qwZ + qgZ"])
        M = zero3.ranks[0]["sharding"]["padded_numel"] * 2
        node0 = [sum(per_step(r, "comm", "by_link", "inter_node")[:4]) / M
                 for r in (zero3, zeropp)]
        rows.append(["tied (GPT-2)" if tied else "untied", f"{M / MIB:.2f}",
                     f"{node0[0]:.3f} M", f"{node0[1]:.3f} M", f"{node0[0] / node0[1]:.2f}x"])
    rows.append(["formula, N = 8 ranks on Q = 2 nodes", "",
                 f"{3 * 7 / 8:.3f} M", f"{0.5 * 7 / 8 + 0.25 * 1 / 2:.3f} M",
                 f"{3 * 7 / 8 / (0.5 * 7 / 8 + 0.25 / 2):.2f}x"])
    rows.append(["formula, N, Q -> infinity (the paper)", "", "3 M", "0.75 M", "4x"])
    return table(["model", "M (bf16 bytes)", "ZeRO-3: node 0 -> other nodes",
                  "hpZ + qwZ + qgZ", "less"], rows)


def deviation(steps: int, settings: dict) -> str:
    rows = []
    for name in QUANTISED:
        r = train(**DEMO, **settings, **CASES[name], steps=steps, check=True)
        e, reference = r.equivalence, r.reference
        rows.append([name, f"{r.losses[-1]:.4f}", f"{reference.losses[-1]:.4f}",
                     f"{(r.losses[-1] / reference.losses[-1] - 1):+.2%}",
                     f"{e['max_rel_loss_diff']:.2%}", f"{e['max_rel_param_diff']:.2%}",
                     f"{e['quantized']['grad_norm_ratio']:.3f}",
                     f"{e['max_rel_grad_norm_diff']:.0%}",
                     "pass" if e["passed"] else "FAIL"])
    return table([f"{steps} steps", "loss", "reference loss", "final", "max loss diff",
                  "params (model scale)", "norm ratio (geo. mean)", "max one-step norm",
                  f"check (tolerance {r.equivalence['tolerance']:g})"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deviation", action="store_true",
                        help="also the quantised runs' deviation after 20 checked steps")
    args = parser.parse_args()
    print("## Memory and bytes per step (2 steps)\n")
    print(memory_and_bytes(2, {}))
    print("\n## The ZeRO++ paper's cross-node bytes of one ZeRO-3 step\n")
    print(zeropp_ratio({}))
    if args.deviation:
        print("\n## Quantised runs against one device\n")
        print(deviation(20, {}))


if __name__ == "__main__":
    main()
