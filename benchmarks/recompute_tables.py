"""The recomputation tables of docs/recomputation.md (about 30 s on 2 cores).

    python benchmarks/recompute_tables.py

1. Activation bytes one transformer layer keeps for backward, measured by the ledger
   (bf16, the paper's 2-byte accounting), per granularity, tensor-parallel size t and
   sequence parallelism, beside Korthikanti et al. 2022's formulas (their Table 2 and
   section 5) and minipar's own (minipar.plan.shapes, which the planner uses).
2. "Checkpointing too much": full recomputation of the first k layers (Megatron's
   --recompute-method block) for k = 0 .. L, and selective, on one simulated GPU: the
   activation peak and the FLOPs recomputed per step (both measured) against the
   simulated step time, and the planner's prediction of each.
"""

import numpy as np
from arguments import parse_no_flags

from minipar import distributed as dist
from minipar.demo import DEMO_PROFILE
from minipar.nn import GPTConfig, Recompute
from minipar.nn.recompute import run_blocks
from minipar.parallel.tensor.model import tensor_parallel_gpt
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import estimate
from minipar.plan.layout import ParallelConfig
from minipar.plan.shapes import ModelShape, from_train_config
from minipar.train import TrainConfig, train

if __name__ == "__main__":
    parse_no_flags(__doc__)  # --help says what it measures; no flags to mistype

# ---------------------------------------------------------------- 1. bytes per layer
b, s, h, a = 4, 256, 256, 8  # as/h = 8: the attention core is most of a layer
config = GPTConfig(vocab_size=52, seq_len=s, n_layer=2, n_head=a, d_model=h)
rng = np.random.default_rng(0)
idx = rng.integers(0, 52, (b, s))
POLICIES = {"none": Recompute(), "selective": Recompute("selective"),
            "full": Recompute("full", "uniform", 1)}


def one_layer(tp, sp, policy, gpt=config):
    """Activation bytes that the first block keeps after its forward, on TP rank 0."""
    model = tensor_parallel_gpt(gpt, 0, "bf16-mixed", dist.DeviceMesh(tp=tp).tp_group(),
                                sp, recompute=policy)
    device = dist.get_device()
    for p in model.parameters():  # as the training loop does: weights are not activations
        device.memory.hold(p.data, "params")
    x = model.embed(idx)
    before = device.memory.current["activations"]
    y = run_blocks([model.h[0]], x, policy)  # y keeps the graph (and what it saved) alive
    kept = device.memory.current["activations"] - before
    del y
    return kept


def korthikanti(t, sp, granularity):
    """Bytes per layer, 16-bit activations with dropout (Korthikanti et al. 2022)."""
    sbh = s * b * h
    if granularity == "full":
        return 2 * sbh / (t if sp else 1)  # the layer's input (section 5, Table 2)
    attention = 0 if granularity == "selective" else 5 * a * s / h
    if sp:  # eq. 5 / 6: everything divided by t
        return sbh * (34 + attention) / t
    return sbh * (10 + 24 / t + attention / t)  # eq. 2 (tensor parallel)


print("granularity         t  SP   measured   planner  Korthikanti  measured/Korthikanti")
LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]
# dropout 0.1 (t = 1: minipar refuses dropout under TP), as the paper counts
ROWS = [(g, p, 0.0, LAYOUTS) for g, p in POLICIES.items()]
ROWS += [(g, POLICIES[g], 0.1, [(1, False)]) for g in ("none", "selective")]
for granularity, policy, dropout, layouts in ROWS:
    gpt = GPTConfig(vocab_size=52, seq_len=s, n_layer=2, n_head=a, d_model=h,
                    dropout=dropout)
    shape = ModelShape(n_layer=2, d_model=h, n_head=a, vocab_size=52, seq_len=s,
                       dropout=dropout)
    if dropout:
        granularity += " +dropout"
    for tp, sp in layouts:
        measured = dist.launch(one_layer, tp, tp, sp, policy, gpt)[0]
        plan = ParallelConfig(tp=tp, sequence_parallel=sp,
                              micro_batch_size=b).with_recompute(policy)
        layer = shape.layer_activation_bytes(b, tp, sp, 2, 4)
        if policy.selective:
            layer -= shape.attention_core_bytes(b, tp, 2, 4)
        elif policy.full:
            layer = shape.layer_input_bytes(b, tp, sp, 2)
        assert plan.recompute == policy
        paper = korthikanti(tp, sp, policy.label)
        print(f"{granularity:18s} {tp:2d} {'yes' if sp else 'no ':3s} {measured:10,d} "
              f"{layer:9,d} {paper:12,.0f} {measured / paper:9.3f}")

# ---------------------------------------------------------------- 2. the curve
L = 8
settings = dict(n_layer=L, d_model=64, n_head=8, seq_len=128, micro_batch_size=4,
                grad_accum_steps=1, steps=1, data="synthetic", precision="bf16-mixed")
cluster = ClusterSpec.from_device_profile(DEMO_PROFILE, gpus_per_node=8)
runs = [("none", {})] + [
    (f"block {k}", dict(recompute_granularity="full", recompute_method="block",
                        recompute_num_layers=k)) for k in range(1, L + 1)]
runs.insert(1, ("selective", dict(recompute_granularity="selective")))
print()
print("recompute   activations  recompute GFLOP  step ms   planner: activations  step ms")
for name, flags in runs:
    run_config = TrainConfig(**settings, **flags)
    report = train(run_config, device=DEMO_PROFILE)
    rank = report.ranks[0]
    est = estimate(from_train_config(run_config, report.config["vocab_size"]),
                   ParallelConfig.from_train_config(run_config), cluster)
    print(f"{name:10s} {rank['memory']['activations']:12,d} "
          f"{rank['recompute_flops'] / 1e9:15.3f} {report.step_end_s[-1] * 1e3:8.2f}   "
          f"{est.memory['activations']:20,d} {est.step_time * 1e3:8.2f}")
