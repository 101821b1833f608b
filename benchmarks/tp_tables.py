"""The tensor-parallel tables of docs/tensor-parallel.md: per tp and sequence parallelism,
one or two nodes, the activation bytes one layer keeps, parameter bytes, TP bytes sent and the
simulated compute / communication time of one training step (about 2 minutes on 2 cores).

    python benchmarks/tp_tables.py

Prints: tp, sequence_parallel, nodes, layer activation bytes, params bytes, tp bytes sent,
compute us, comm us.
"""

import numpy as np
from arguments import parse_no_flags

from minipar import distributed as dist
from minipar.nn import GPTConfig
from minipar.parallel.tensor.model import tensor_parallel_gpt

if __name__ == "__main__":
    parse_no_flags(__doc__)  # --help says what it measures; no flags to mistype

b, s, h, a = 8, 256, 512, 8                      # as/h = 4
config = GPTConfig(vocab_size=52, seq_len=s, n_layer=2, n_head=a, d_model=h)
rng = np.random.default_rng(0)
idx, targets = rng.integers(0, 52, (b, s)), rng.integers(0, 52, (b, s))

def one_step(tp, sp):
    model = tensor_parallel_gpt(config, 0, "bf16-mixed", dist.DeviceMesh(tp=tp).tp_group(), sp)
    device = dist.get_device()
    for p in model.parameters():
        device.memory.hold(p.data, "params")
    with dist.phase("forward"):
        x = model.embed(idx)
        before = device.memory.current["activations"]
        x = model.h[0](x)                           # activations one layer keeps
        layer = device.memory.current["activations"] - before
        loss = model.head(model.h[1](x), targets)
    with dist.phase("backward"):
        loss.backward()
    return layer

for tp, sp in [(1, False), (2, False), (2, True), (4, False), (4, True)]:
    for per_node in sorted({tp, max(1, tp // 2)}, reverse=True):   # one node, two nodes
        layer, devices = dist.launch(one_step, tp, tp, sp, gpus_per_node=per_node,
                                     return_devices=True)
        d = devices[0]
        print(tp, sp, len({x.node for x in devices}), layer[0], d.memory.peak["params"],
              d.comm.sent_by_group["tp"], d.clock.compute_s * 1e6, d.clock.comm_s * 1e6)
