"""minipar.plan: an analytic planner for 3D parallelism, proved against the emulator.

    from minipar.plan import ModelShape, ParallelConfig, estimate, advise, lint, presets
    est = estimate(presets.model("gpt2-xl"), ParallelConfig(dp=8, zero=1,
                   micro_batch_size=4, global_batch_size=512), presets.cluster("a100"))
    print(est.table())                      # memory by category, traffic, step time, MFU
    advice = advise(presets.model("llama2-70b"), 64, presets.cluster("a100"),
                    global_batch_size=1024)
    print(advice.explain())                 # TP in the node, PP/DP across, ZeRO in DP ...
    for finding in lint(shape, config, cluster): ...
    write_export("out/", shape, config, cluster)   # DeepSpeed JSON, Megatron args, launcher

Modules, one idea each: shapes (parameters, FLOPs, activations of a transformer shape),
cluster (hardware, ring bytes, alpha-beta time), layout (parallel config, what each
pipeline rank holds), memory, traffic, timing, estimate (the three together), presets,
advisor, lint, export, cli (`minipar plan`).
"""

from __future__ import annotations

from minipar.plan import presets
from minipar.plan.advice import Advice
from minipar.plan.advisor import advise
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import Estimate, estimate
from minipar.plan.export import deepspeed_config, megatron_args, write_export
from minipar.plan.layout import ParallelConfig
from minipar.plan.lint import Finding, lint
from minipar.plan.shapes import ModelShape, from_train_config

__all__ = [
    "Advice",
    "ClusterSpec",
    "Estimate",
    "Finding",
    "ModelShape",
    "ParallelConfig",
    "advise",
    "deepspeed_config",
    "estimate",
    "from_train_config",
    "lint",
    "megatron_args",
    "presets",
    "write_export",
]
