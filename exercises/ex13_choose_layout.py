"""Exercise 13: choose a layout for a cluster, and justify it in a few sentences.

Check your work:   python -m exercises.check 13

The interview question behind the whole course: "you have this model and these GPUs:
how do you train it?" Answer it for two tasks, the way a practitioner does before
running anything (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", section 3, gives the rules of thumb):
- tensor parallelism (tp) inside a node only: it communicates in every layer, forward
  and backward, and needs NVLink; tp must divide the attention heads;
- pipeline parallelism (pp) across nodes when the model's state does not fit, its
  bubble shrinking with more micro-batches; pp must not exceed the layers;
- data parallelism (dp) for the rest, with ZeRO (stage 1 shards the optimizer state
  for free; with pp > 1 stay at ZeRO 0-1, as DeepSpeed and Megatron-LM do);
- sequence parallelism whenever tp > 1; recomputation ("selective", "full") only if the
  activations do not fit; the micro-batch as large as memory allows.
dp x tp x pp must use every GPU, and the global batch (in sequences) must split into
dp x micro-batch x accumulation.

Each answer is a dict:
    {"dp": int, "tp": int, "pp": int, "zero": 0-3, "micro_batch_size": int,
     "sequence_parallel": bool, "recompute": None | "selective" | "full",
     "memory_gib": float,      your estimate of the fullest GPU's peak memory, in GiB
     "bottleneck": str,        what limits the step most, one of BOTTLENECKS below
     "why": str}               a few sentences (40 to 1000 characters) that justify it

What the checker judges, with minipar's planner (minipar.plan: estimate, advise) and its
emulator (minipar.train):
- the layout is valid (GPU count, heads, layers, the batch) and keeps TP inside a node;
- it fits the GPU's usable memory (the planner's estimate), and your memory_gib is within
  15% of the planner's peak;
- its step time is within 1.3x of the best layout the planner's search finds (advise);
- your bottleneck matches the planner's breakdown of your layout's step: "compute" when
  no overhead reaches 10% of the step, else the largest of the pipeline bubble and the
  time in TP, DP and PP communication (or one within 80% of it);
- `why` names every parallelism you use (tp / tensor, pp / pipeline, dp / data, ZeRO);
- the emulator trains your layout scaled down (a tiny GPT-2 of the same tp, pp, ZeRO,
  sequence parallelism and recomputation, dp at most 2) and matches one device.
What it cannot judge of your prose: whether the reasons are the right ones, whether you
weighed the alternatives, whether it reads well. The report prints it for your teacher.
Do not import minipar.plan or minipar.train: the checker refuses them (the planner would
answer for you).
"""

from __future__ import annotations

BOTTLENECKS = ("compute", "pipeline bubble", "tp communication", "dp communication",
               "pp communication")


def choose_layout(task: dict) -> dict:
    """Your answer for `task`, a dict:
        model: name; n_layer, d_model, n_head, vocab_size, seq_len; parameters (count)
        gpus, gpus_per_node, gpu_memory_gib (usable), intra_node_gbps, inter_node_gbps
        (GB/s one GPU sends per direction), peak_tflops (bf16 dense)
        global_batch_size (sequences per optimizer step); precision "bf16-mixed"
    The two tasks: GPT-2 XL on one node of 8 A100-80GB, and Llama-2 70B on 8 nodes of
    8 H100-80GB. Returns the dict described above."""
    raise NotImplementedError("choose_layout: your code here")
