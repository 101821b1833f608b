"""Real models, real clusters, and one published configuration to check the planner on.

Model shapes are from the papers and released configs:
- GPT-2 small/medium/large/XL (Radford et al. 2019, Table 2; Hugging Face config.json):
  vocab 50257, context 1024, 12/24/36/48 layers of 768/1024/1280/1600 with 12/16/20/25
  heads; 124M, 355M, 774M, 1.5B parameters.
- Llama-2 7B/13B/70B (Touvron et al. 2023, Table 1 and the released params.json):
  vocab 32000, context 4096, RMSNorm, SwiGLU of width 11008/13824/28672, rotary
  positions, no biases, untied output layer, 70B with 8 key/value heads (GQA).
- Llama 3 8B/70B/405B (Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 3,
  and the released config.json): vocab 128,256, 32/80/126 layers of 4096/8192/16384 with
  32/64/128 heads, 8 key/value heads (GQA) throughout, SwiGLU of width 14336/28672/53248,
  RoPE, RMSNorm, no biases, untied; context 8192 (the pre-training length; 128K only in
  its last stage); 8.03B, 70.6B, 406B parameters.
- Mistral 7B (Jiang et al. 2023, Table 1): 32 layers, h 4096, 32 heads, 8 key/value
  heads, SwiGLU of width 14336, vocab 32000, context 8192, untied; 7.24B parameters. Its
  sliding-window attention (window 4096) is planned as full causal attention: the same
  up to 4096 tokens, pessimistic beyond.
- Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1, and the released
  config.json): Mistral 7B's shape (32 layers, h 4096, 32 heads, 8 key/value heads,
  SwiGLU of width 14336, vocab 32000, RoPE, RMSNorm, untied) with every MLP replaced by
  8 experts, top-2, dropless (no capacity: planned as balanced); 46.7B parameters, 12.9B
  active. Its context is 32k tokens; the preset plans 4096-token sequences like the
  Llama-2 presets (--seq-len 32768 for the full context). The training batch is not
  published: 1024 x 4096 = 4M tokens, as Llama-2's, is an assumption.
- GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, h 12288, 96 heads, context 2048,
  the GPT-2 tokenizer.
- BLOOM-176B (BigScience, Le Scao et al. 2022, Table 3): 70 layers, h 14336, 112 heads,
  vocab 250880 (padded), context 2048, ALiBi, a LayerNorm on the embedding, tied head.

GPU datasheet figures (dense BF16 tensor-core peak, no sparsity; per-GPU links):
- A100 SXM 80GB: 312 TFLOP/s; NVLink 3 600 GB/s total bidirectional (300 GB/s each way);
  DGX A100: one 200 Gb/s HDR InfiniBand adapter per GPU (25 GB/s each way).
  (NVIDIA A100 datasheet; DGX A100 system architecture white paper.)
- H100 SXM 80GB: 989 TFLOP/s; NVLink 4 900 GB/s bidirectional (450 GB/s each way);
  DGX H100: one 400 Gb/s NDR ConnectX-7 per GPU (50 GB/s each way).
  (NVIDIA H100 datasheet; DGX H100 user guide.)
Compute: each kernel on the GPU's roofline (minipar.distributed.roofline: datasheet peak,
HBM bandwidth and SM count; a GEMM efficiency and an HBM efficiency fitted on Narayanan
et al. 2021, Table 1, by benchmarks/fit_time_model.py; `minipar plan --compare-published`
prints the fit). `efficiency` (60% of peak on A100, 50% on H100) is the uniform model's
single rate, used only when the roofline is switched off (`minipar plan --efficiency X`).
Usable memory: 90% of 80 GiB (the CUDA context, NCCL buffers and fragmentation take the
rest).
"""

from __future__ import annotations

from minipar.distributed.attention_kernels import CUDNN_H100
from minipar.distributed.clock import A100, H100
from minipar.distributed.roofline import A100_SXM_80GB, H100_SXM_80GB
from minipar.plan.cluster import GIB, ClusterSpec
from minipar.plan.layout import MEGATRON_ORDER, ParallelConfig
from minipar.plan.shapes import ModelShape


def _gpt2(name, n_layer, d_model, n_head):
    return ModelShape(name=name, n_layer=n_layer, d_model=d_model, n_head=n_head,
                      vocab_size=50257, seq_len=1024)


def _llama2(name, n_layer, d_model, n_head, d_ff, n_kv_head=None, vocab_size=32000,
            seq_len=4096):
    return ModelShape(name=name, n_layer=n_layer, d_model=d_model, n_head=n_head,
                      n_kv_head=n_kv_head, d_ff=d_ff, vocab_size=vocab_size, seq_len=seq_len,
                      mlp="swiglu", norm="rmsnorm", bias=False, position="rope",
                      tie_embeddings=False)


def _llama3(name, n_layer, d_model, n_head, d_ff):
    return _llama2(name, n_layer, d_model, n_head, d_ff, n_kv_head=8, vocab_size=128256,
                   seq_len=8192)


MODELS: dict[str, ModelShape] = {
    "gpt2": _gpt2("gpt2", 12, 768, 12),
    "gpt2-medium": _gpt2("gpt2-medium", 24, 1024, 16),
    "gpt2-large": _gpt2("gpt2-large", 36, 1280, 20),
    "gpt2-xl": _gpt2("gpt2-xl", 48, 1600, 25),
    "llama2-7b": _llama2("llama2-7b", 32, 4096, 32, 11008),
    "llama2-13b": _llama2("llama2-13b", 40, 5120, 40, 13824),
    "llama2-70b": _llama2("llama2-70b", 80, 8192, 64, 28672, n_kv_head=8),
    "llama3-8b": _llama3("llama3-8b", 32, 4096, 32, 14336),
    "llama3-70b": _llama3("llama3-70b", 80, 8192, 64, 28672),
    "llama3-405b": _llama3("llama3-405b", 126, 16384, 128, 53248),
    "mistral-7b": _llama2("mistral-7b", 32, 4096, 32, 14336, n_kv_head=8, seq_len=8192),
    "mixtral-8x7b": ModelShape(name="mixtral-8x7b", n_layer=32, d_model=4096, n_head=32,
                               n_kv_head=8, d_ff=14336, vocab_size=32000, seq_len=4096,
                               mlp="swiglu", norm="rmsnorm", bias=False, position="rope",
                               tie_embeddings=False, moe_num_experts=8, moe_top_k=2,
                               moe_capacity_factor=None),
    "gpt3-175b": ModelShape(name="gpt3-175b", n_layer=96, d_model=12288, n_head=96,
                            vocab_size=50257, seq_len=2048),
    "bloom-176b": ModelShape(name="bloom-176b", n_layer=70, d_model=14336, n_head=112,
                             vocab_size=250880, seq_len=2048, position="alibi",
                             embedding_norm=True),
}
ALIASES = {"gpt2-small": "gpt2", "gpt3": "gpt3-175b", "bloom": "bloom-176b",
           "mixtral": "mixtral-8x7b"}

# Sequences per optimizer step of the published runs: GPT-2 512 (Radford et al. 2019,
# section 2.3); Llama-2 4M tokens = 1024 x 4096 (Touvron et al. 2023, section 2.2);
# GPT-3 175B 3.2M tokens = 1536 x 2048 (Brown et al. 2020, Table 2.1); BLOOM 2048;
# Llama 3 405B 16M tokens = 2048 x 8192 (Grattafiori et al. 2024, Table 4; its 8B and
# 70B batches are not published).
GLOBAL_BATCH = {"gpt2": 512, "gpt2-medium": 512, "gpt2-large": 512, "gpt2-xl": 512,
                "llama2-7b": 1024, "llama2-13b": 1024, "llama2-70b": 1024,
                "mixtral-8x7b": 1024, "llama3-405b": 2048,
                "gpt3-175b": 1536, "bloom-176b": 2048}

# ClusterSpec.overlap_contention on the H100 (minipar.plan.timing.overlap_contention_seconds):
# fitted by benchmarks/fit_time_model.py on the fitted published runs (5 of the Megatron-LM
# README's, 26 of MosaicML's MPT runs), the efficiencies of the roofline kept. No A100
# run calibrates it: the A100 keeps overlap free, as its fit on Narayanan et al. 2021
# assumed.
H100_OVERLAP_CONTENTION = 0.65

CLUSTERS: dict[str, ClusterSpec] = {
    "a100-80gb": ClusterSpec(
        name="8x A100-SXM-80GB, NVLink 3, 200 Gb/s HDR IB per GPU", gpus_per_node=8,
        memory_bytes=80 * GIB, peak_flops=312e12, efficiency=0.6,
        intra_node_bandwidth=300e9, inter_node_bandwidth=25e9,
        intra_node_latency=3e-6, inter_node_latency=8e-6, roofline=A100_SXM_80GB,
        # DGX A100: PCIe Gen4 x16 (~25 GB/s measured per direction); Gen4 U.2 drives
        # (Samsung PM1733 datasheet: 7.0 GB/s read, 3.8 GB/s write)
        pcie_bandwidth=25e9, nvme_read_bandwidth=7.0e9, nvme_write_bandwidth=3.8e9,
        calibration="Narayanan et al. 2021, Table 1 (minipar plan --compare-published)"),
    "h100-80gb": ClusterSpec(
        name="8x H100-SXM5-80GB, NVLink 4, 400 Gb/s NDR IB per GPU", gpus_per_node=8,
        memory_bytes=80 * GIB, peak_flops=989e12, efficiency=0.5,
        intra_node_bandwidth=450e9, inter_node_bandwidth=50e9,
        intra_node_latency=3e-6, inter_node_latency=8e-6,
        # attention: cuDNN's fused kernel, which Transformer Engine (Megatron-Core's and
        # NeMo's attention) prefers on Hopper when both it and FlashAttention-2 apply
        # (NeMo Framework docs, memory_optimizations.rst, "Flash Attention")
        roofline=H100_SXM_80GB.replace(attention=CUDNN_H100),
        overlap_contention=H100_OVERLAP_CONTENTION,
        calibration="5 of the Megatron-LM README's H100 runs and 26 of MosaicML's MPT "
                    "runs, held out on 4 more README runs, 26 more MPT runs, the Llama 3 "
                    "paper's Table 4, NeMo AutoModel's FSDP2 run and NVIDIA's 88 DGX "
                    "Cloud Benchmarking runs of five releases (minipar plan "
                    "--compare-published)"),
    # Jean Zay's A100 partition, where BLOOM-176B trained (`minipar plan --example bloom`):
    # nodes of 8 A100-SXM4-80GB with "4 OmniPath links" and 512 GB of CPU memory
    # (BigScience's tr11-176B-ml README, "Hardware"), each link 100 Gb/s (Le Scao et al.
    # 2022, the BLOOM paper, section 3.4.1), shared by the node's 8 GPUs: 6.25 GB/s a GPU,
    # a quarter of a DGX A100's 200 Gb/s. Assumed as on the a100-80gb preset (no source
    # gives them for Jean Zay): NVLink 3's 300 GB/s, PCIe and NVMe, and rails (NCCL's
    # rings spread over the node's 4 NICs: a group with k members a node crosses at k
    # GPUs' shares, never more than the node's 4 links). The A100 roofline and its two
    # efficiencies are the a100-80gb preset's, fitted on Table 1 alone.
    "jean-zay-a100": ClusterSpec(
        name="8x A100-SXM-80GB, NVLink 3, 4 x 100 Gb/s Omni-Path per node (Jean Zay)",
        gpus_per_node=8, memory_bytes=80 * GIB, peak_flops=312e12, efficiency=0.6,
        intra_node_bandwidth=300e9, inter_node_bandwidth=4 * 100e9 / 8 / 8,
        intra_node_latency=3e-6, inter_node_latency=8e-6, roofline=A100_SXM_80GB,
        pcie_bandwidth=25e9, nvme_read_bandwidth=7.0e9, nvme_write_bandwidth=3.8e9,
        host_memory_bytes=512e9 / 8,
        calibration="Narayanan et al. 2021, Table 1 (minipar plan --compare-published)"),
    # The cluster minipar's emulator simulates (minipar.distributed.DeviceProfile's defaults, every
    # FLOP at its sustained rate): compare `minipar plan` with `minipar train` on it.
    "emulated": ClusterSpec.from_device_profile(),
    # ... and its roofline profiles (`minipar train --device h100 / a100`).
    "emulated-h100": ClusterSpec.from_device_profile(H100),
    "emulated-a100": ClusterSpec.from_device_profile(A100),
}
CLUSTER_ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb"}


def model(name: str) -> ModelShape:
    """A model preset by name (see MODELS), e.g. "llama2-70b"."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in MODELS:
        raise KeyError(f"unknown model preset {name!r}; choose one of "
                       f"{', '.join(sorted(MODELS))}")
    return MODELS[key]


def cluster(name: str, memory_gib: float | None = None) -> ClusterSpec:
    """A cluster preset by name (see CLUSTERS), optionally with another memory size."""
    key = CLUSTER_ALIASES.get(name.lower(), name.lower())
    if key not in CLUSTERS:
        raise KeyError(f"unknown cluster preset {name!r}; choose one of "
                       f"{', '.join(sorted(CLUSTERS))}")
    spec = CLUSTERS[key]
    return spec if memory_gib is None else spec.with_memory(memory_gib * GIB)


# ---------------------------------------------------------------------- BLOOM-176B
# The published layout (BigScience's Megatron-DeepSpeed launch script tr11-176B-ml and
# the BLOOM paper, section 3.4, "Engineering"): 384 A100-80GB in 48 nodes, TP 4 inside a
# node, PP 12, DP 8 with ZeRO stage 1, micro-batch 2, global batch 2048 sequences of 2048
# tokens (after the batch-size ramp-up), bf16, activation checkpointing. The pipeline is
# partitioned "type:transformer|embedding": the two embedding ends count as layers, so
# the first and last of the 12 stages get 5 transformer layers and the others 6.
# DeepSpeed's pipeline engine reduces the gradients after the pipeline's flush, never
# during backward (deepspeed/runtime/pipe/schedule.py, TrainSchedule: ReduceTiedGrads,
# ReduceGrads, OptimizerStep after the last step's commands).
BLOOM_176B = ParallelConfig(
    dp=8, tp=4, pp=12, zero=1, schedule="1f1b", micro_batch_size=2,
    global_batch_size=2048, precision="bf16-mixed", recompute_granularity="full",
    layer_split=(5,) + (6,) * 10 + (5,), lr=6e-5, overlap_grad_reduce=False,
    rank_order=MEGATRON_ORDER)


# The step BigScience logged at full batch (tr11-176B-ml README, "Important checkpoints":
# iteration 85,376, "elapsed time per iteration (s): 104.70 ... TFLOPs: 149.77").
BLOOM_176B_STEP_S = 104.70
BLOOM_CLUSTER = "jean-zay-a100"


def bloom_example():
    """(shape, config, cluster) of the BLOOM-176B worked example: the published layout on
    the cluster it trained on."""
    return MODELS["bloom-176b"], BLOOM_176B, CLUSTERS[BLOOM_CLUSTER]
