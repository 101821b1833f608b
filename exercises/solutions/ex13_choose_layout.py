"""Reference solution of exercise 13: a layout per task, with its justification."""

from __future__ import annotations

BOTTLENECKS = ("compute", "pipeline bubble", "tp communication", "dp communication",
               "pp communication")

ANSWERS = {
    "gpt2-xl": {
        "dp": 8, "tp": 1, "pp": 1, "zero": 1, "micro_batch_size": 8,
        "sequence_parallel": False, "recompute": None, "memory_gib": 27.6,
        "bottleneck": "compute",
        "why": "1.5B parameters need 16 bytes each with mixed precision and Adam, 24 GB, "
               "well inside an 80 GB A100, so pure data parallelism (dp 8) over the one "
               "node, with ZeRO-1 to shard the 12 bytes of optimizer state for free. Tensor "
               "parallelism is not needed (and 25 heads would not split). The gradient "
               "all-reduce hides behind backward on NVLink, so the step is compute-bound; "
               "micro-batches of 8 keep the GPU busy and the activations fit."},
    "llama2-70b": {
        "dp": 2, "tp": 2, "pp": 16, "zero": 1, "micro_batch_size": 1,
        "sequence_parallel": True, "recompute": None, "memory_gib": 66.0,
        "bottleneck": "compute",
        "why": "70B parameters are 1.1 TB of model state: they must be split. Tensor "
               "parallelism tp 2 inside the node with sequence parallelism halves every "
               "layer at a modest all-reduce cost; pipeline parallelism pp 16 across the "
               "nodes (5 layers per stage) cuts the rest, and 512 micro-batches per "
               "pipeline keep the bubble small, (p-1)/(m+p-1) = 15/527. Data "
               "parallelism dp 2 with ZeRO-1 uses the remaining GPUs and shards the "
               "optimizer state. Pipelining does not cut the first stage's activations: "
               "it holds 16 micro-batches of 5 layers, one micro-batch of the whole "
               "model (about 40 GiB with SP), so micro-batch 1, and the model state "
               "(with fp32 gradient buffers, as Megatron-LM keeps them) must stay under "
               "30 GiB: hence pp 16 rather than 8. The TP, PP and DP transfers and the "
               "bubble each stay under 10% of the step."},
}


def choose_layout(task: dict) -> dict:
    return dict(ANSWERS[task["model"]])
