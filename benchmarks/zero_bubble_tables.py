"""The zero-bubble tables of docs/pipeline-parallel.md: the same p = 4 and m = 8 under every
registered schedule, one step each on the simulated clock with free communication, with
uniform stages (embedding, head and loss made free, every chunk one block's cost) and with
the real embedding / head imbalance (about 10 s on 2 cores).

    python benchmarks/zero_bubble_tables.py

Prints per schedule: the measured bubble (idle / total rank-time), the papers' formula
evaluated with the measured per-stage T_F, T_B, T_W (report field pipeline.stage_times),
the peak activations per rank (KiB, from the ledger) and the pipeline bytes each rank sent.
"""

import math

import numpy as np
from arguments import parse_no_flags
from uniform_stages import charge_blocks_only

from minipar import distributed as dist
from minipar.distributed.timeline import bubble_fraction, labelled_compute_seconds
from minipar.nn import GPTConfig
from minipar.parallel.pipeline.model import Pipeline
from minipar.parallel.pipeline.schedules.registry import SCHEDULES

if __name__ == "__main__":
    parse_no_flags(__doc__)  # --help says what it measures; no flags to mistype

FREE = dist.DeviceProfile(intra_node_latency=0.0, inter_node_latency=0.0,
                          intra_node_bandwidth=math.inf, inter_node_bandwidth=math.inf)
P, M, B, S = 4, 8, 4, 32
CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zb-h2": 1, "zb-v": 2,
          "dualpipe-v": 2}


def one_step(config, schedule, v, uniform):
    pipe = Pipeline(config, schedule=schedule, micro_batches=M, virtual_stages=v,
                    precision="fp32")
    if uniform:
        for chunk in pipe.chunks:
            charge_blocks_only(chunk)
    rng = np.random.default_rng(0)
    V = config.vocab_size
    pipe.forward_backward([(rng.integers(0, V, (B, S)), rng.integers(0, V, (B, S)))
                           for _ in range(M)])


def measure(schedule, uniform, vocab=65):
    v = CHUNKS[schedule]
    config = GPTConfig(vocab_size=vocab, seq_len=S, n_layer=8, n_head=4, d_model=64)
    _, devices = dist.launch(one_step, P, config, schedule, v, uniform, device=FREE,
                             return_devices=True)
    bubble = bubble_fraction([d.clock.events for d in devices])
    seconds = [labelled_compute_seconds(d.clock.events) for d in devices]
    suffixes = [""] + [f".{c}" for c in range(1, v)]

    def mean(kind):
        found = [s[f"{kind}0{x}"] for s in seconds for x in suffixes if f"{kind}0{x}" in s]
        return sum(found) / len(found) if found else None

    f, full, i, w = mean("F"), mean("B"), mean("I"), mean("W")
    if i is None:  # no split backward: the paper's T_B + T_W is the full backward
        i, w = full * 0.5, full * 0.5
    spec = SCHEDULES[schedule]
    formula = ""
    if spec.bubble_time is not None:
        idle = spec.bubble_time(P, M, v, f, i, w)
        formula = f"{idle / (idle + M * v * (f + i + w)):.3f}"
    if schedule == "dualpipe-v":  # DualPipe README: (PP/2-1)(F&B + B - 3W), PP = 2p stages
        idle = (P - 1) * ((f + i + w) + (i + w) - 3 * w)
        formula = f"README {idle / (idle + M * v * (f + i + w)):.3f}"
    activations = [d.memory.peak["activations"] // 1024 for d in devices]
    p2p = [sum(r.sent_bytes for r in d.comm.records if r.op == "send") // 1024
           for d in devices]
    print(f"{schedule:11} {'uniform' if uniform else 'real V=' + str(vocab):9} "
          f"bubble {bubble:.3f}  formula {formula:12} T_F {f * 1e6:.3f} T_B {i * 1e6:.3f} "
          f"T_W {w * 1e6:.3f} us  activations KiB {activations}  p2p KiB sent {p2p}")


for uniform in (True, False):
    for name in CHUNKS:
        measure(name, uniform)
measure("1f1b", False, vocab=2048)
measure("zb-h1", False, vocab=2048)
measure("zb-v", False, vocab=2048)


def synchronised_step(config, schedule):
    """One step as the training loop runs it: forward_backward (whose loss broadcast
    waits for the last stage), then the gradient-norm all-reduce before the optimizer."""
    pipe = Pipeline(config, schedule=schedule, micro_batches=M, precision="fp32")
    rng = np.random.default_rng(0)
    V = config.vocab_size
    pipe.forward_backward([(rng.integers(0, V, (B, S)), rng.integers(0, V, (B, S)))
                           for _ in range(M)])
    clock = dist.get_device().clock
    computed = max(e.end for e in clock.events if e.kind in ("forward", "backward"))
    dist.all_reduce(np.asarray(pipe.grad_norm_squared()))
    return computed, clock.now


print("\nthe synchronisation before the optimizer (real V=65 model, free links):")
for name in ("1f1b", "zb-h1", "zb-h2"):
    config = GPTConfig(vocab_size=65, seq_len=S, n_layer=8, n_head=4, d_model=64)
    ends = dist.launch(synchronised_step, P, config, name, device=FREE)
    step = max(end for _, end in ends)
    waits = [step - computed for computed, _ in ends]
    print(f"{name:6} step {step * 1e6:.3f} us; each rank waits after its last compute "
          f"{[round(w * 1e6, 3) for w in waits]} us = {sum(waits) / (P * step):.3f} "
          f"of the rank-time")
