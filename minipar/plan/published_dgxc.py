"""NVIDIA's DGX Cloud Benchmarking runs on DGX H100 (NeMo): BF16, all held out; FP8, the
first release's fitted, the later ones' held out.

Source: NVIDIA/dgxc-benchmarking at commit 35a9aec (release v24.11.1): each recipe's
README, "Expected Performance", a table of "Training step time (seconds per step)" and
"Model flops utilization" per GPU count, for BF16 and FP8 (`FP8_RUNS`, below), measured
on NVIDIA's DGX H100 reference architecture (8 GPUs a
node, NVLink, one 400 Gb/s NIC a GPU: the h100-80gb preset). The recipes (the yaml beside
each README, with the overrides of its configure.sh or launch.sh) say how each ran:

- Llama 3.1 8B, 70B, 405B (container nemo:24.09; llama3.1/llama3.1_{8b,70b,405b}.yaml):
  sequence 8192, micro-batch 1; 8B TP 1, PP 1, CP 2; 70B TP 4, PP 4, VP 5, CP 2; 405B
  TP 8, PP 9, VP 7, CP 2, with `num_query_groups: 16` and the GPT-2 BPE tokenizer
  (50,257 entries, padded to a multiple of 128 x TP: 51,200), as the yaml sets them;
  vocabularies padded the same way (70B: 128,512); attention by cuDNN
  (`NVTE_FUSED_ATTN=1`, `NVTE_FLASH_ATTN=0`). The 405B table's three "proxy" columns
  (7 to 42 layers on 32 to 192 GPUs, "not realistic", the README says) are left out.
- Nemotron-4 15B and 340B (container nemo:24.09; the tables say "24.11", the release;
  nemotron/nemotron4-{15b,340b}-synth.yaml): sequence 4096, GQA with 8 groups,
  squared-ReLU MLP of 4h (two matrices: planned as the "gelu" MLP's shape), LayerNorm,
  no biases, RoPE, untied, vocabulary 256,000; 15B TP 4, micro-batch 4; 340B TP 8, PP 8,
  VP 12, micro-batch 1, selective recomputation, attention by FlashAttention-2
  (`NVTE_FUSED_ATTN=0`); 15B leaves both of Transformer Engine's fused kernels on
  (`NVTE_FUSED_ATTN=1`, `NVTE_FLASH_ATTN` unset), and TE prefers cuDNN's on Hopper (the
  h100-80gb preset's kernel); configure.sh turns on `ub_tp_comm_overlap` and sequence
  parallelism for both. 340B's optimizer state is bf16 (`optim.dtype: bf16`), which
  moves its memory, not its step.
- GPT-3 175B (the table says "NeMo Megatron 24.11", the release; launch.sh runs
  nemo:24.05; nemo_megatron/gpt3_175b_hydra.yaml): 96 layers, h 12288, sequence 2048,
  GPT-2 tokenizer (padded to 50,688), learned positions, tied, dropout 0.1 (the yaml's),
  TP 4, PP 8, VP 12, micro-batch 1, FlashAttention-2 (`NVTE_FUSED_ATTN=0`), the loss op
  by op (the yaml does not set `cross_entropy_loss_fusion`, off by default).

What every recipe sets alike, and so every row: NeMo's `distributed_fused_adam` (Apex's
DistributedFusedAdam, which shards the gradients too, ZeRO-2; planned as ZeRO-1, the
distributed optimizer whose parameter all-gather `--overlap-param-gather` overlaps: the
step's traffic is the same reduce-scatter and all-gather, the memory is not) with
`overlap_grad_sync` and `overlap_param_sync` (the planner's overlapped reduction and
`--overlap-param-gather`; each bucket's reduce-scatter launched as it fills, with no
limit in flight, as Megatron-Core's distributed optimizer does: apex/contrib/optimizers/
distributed_fused_adam.py's `_try_start_bucket_grad_sync`), gradients kept and reduced
in bf16 (`grad_sync_dtype: bf16`: the planner's `grad_accum_dtype` bf16), its
`bucket_cap_mb`; sequence parallelism with
TP; `ub_tp_comm_overlap` (`--tp-comm-overlap`) where TP > 1; no recomputation but
340B's; the fused cross-entropy (`cross_entropy_loss_fusion: true`) but for GPT-3;
global batch as the table's column heads give it.

Later releases (`DGXC_LATER`, `--source dgxc-25`) publish new BF16 H100 tables of the
same models, measured again on newer containers; every column of a full model is
planned, again with what each release's scripts set (v25.04 on: NeMo 2.0's recipes, at
the NeMo commit its setup.sh pins):

- v25.02 (8f5cbb3, nemo:24.12): Llama 3.1 8B/70B/405B with the yamls of v24.11.1 (byte
  for byte); Nemotron-4 15B on Megatron-Core's distributed optimizer, its
  `grad_sync_dtype` removed (NeMo's default reduces in fp32) and no bucket size given
  (Megatron-Core's default, max(40M, 1M x DP) parameters); GPT-3 175B with the yaml's
  `virtual_pipeline_model_parallel_size: 6`, though the table's header still says 12,
  and cuDNN's attention (`NVTE_FUSED_ATTN=1`). Its Nemotron-4 340B table is v24.11.1's,
  reprinted (the v25.02 script would run CP 2), and is not planned twice.
- v25.04 (741c886, nemo:25.02.01, NeMo d2b21556): Llama 3.1 8B/70B as before; 405B as
  released, 8 key/value groups and the Llama 3.1 vocabulary (128,256, padded to
  129,024), TP 8, PP 8, VP 8, CP 2, with the embedding and the loss each counted as a
  layer of the pipeline split (`account_for_embedding_in_pipeline_split`: one layer on
  the first and the last virtual stage, two on the others); Nemotron-4 15B at TP 2,
  micro-batch 2; 340B at TP 8, PP 8, VP 12 without recomputation (its configuration
  table prints VP "NA"; launch.sh passes `-vp 12`). Nemotron's NullTokenizer has
  256,001 entries, padded to 128 x TP. NeMo 2.0's performance recipes reduce gradients
  in bf16 (`grad_reduce_in_fp32 = False`) in buckets of 128 x 1024 x 1024 parameters,
  except where PP, VP and DP are all > 1: there scripts/performance/utils.py sets
  `overlap_param_gather_with_optimizer_step`, which disables bucketing
  (nemo/lightning/megatron_parallel.py), one bucket a model chunk; and they set both of
  Transformer Engine's fused attention switches (cuDNN's on Hopper).
- v25.05 (68eaf7e, nemo:25.04.00) and v25.05.01 (85d9284, nemo:25.04.01): one column
  each of Nemotron-4 15B and 340B, and of Llama 3.1 405B, under v25.04's settings (their
  precision-aware optimizer and Transformer Engine's cross-entropy kernel are not
  priced).

The 405B tables' "proxy" columns (7 to 62 layers) are left out, as above; so are the
later patch releases, which reprint these numbers.

The FP8 tables beside them (`FP8_RUNS`, `--source dgxc-fp8` and `dgxc-25-fp8`) are
planned with the same recipes in Transformer Engine's FP8 (`fp8_format` "hybrid": every
FP8 script sets `fp8_hybrid`, delayed scaling, FP8 parameters, no BF16 first or last
layers, no FP8 attention; plan/fp8.py), in the layout of their BF16 table but for v25.04's
Llama 3.1 70B, which runs FP8 at PP 8 and no CP (llama31_utils.py at NeMo d2b21556). The
H100's FP8 GEMM efficiency is fitted on v24.11.1's 32 FP8 columns; the later releases'
56 are held out. v25.02's Nemotron-4 340B FP8 table is v24.11.1's, reprinted, and
v25.05.01's Nemotron pair v25.05's: not planned twice. Their MFU column divides by 1,979
TFLOP/s, the FP8 peak.

Nothing in the planner was fitted on the BF16 rows: they were read after its H100
constants were fixed, and every BF16 row is held out. The published TFLOP/s per GPU are
the source's own count ("model flops" per sequence, each README's "Notes"; its MFU column
is that count over 989 TFLOP/s, 1,979 for FP8, which tests/plan/test_published_dgxc.py
checks against the step times transcribed here), so a row's error is the ratio of the
two step times.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from minipar.plan import presets
from minipar.plan.layout import MEGATRON_ORDER, ParallelConfig
from minipar.plan.published_h100 import H100Run
from minipar.plan.shapes import ModelShape

DGXC = "NVIDIA DGX Cloud Benchmarking (dgxc-benchmarking 35a9aec), DGX H100 BF16"
DGXC_LATER = ("NVIDIA DGX Cloud Benchmarking, later releases (dgxc-benchmarking v25.02 "
              "8f5cbb3, v25.04 741c886, v25.05 68eaf7e, v25.05.01 85d9284), DGX H100 BF16")
DGXC_FP8 = "NVIDIA DGX Cloud Benchmarking (dgxc-benchmarking 35a9aec), DGX H100 FP8"
DGXC_FP8_LATER = ("NVIDIA DGX Cloud Benchmarking, later releases (v25.02, v25.04, v25.05, "
                  "v25.05.01), DGX H100 FP8")

_NEMOTRON = dict(n_kv_head=8, vocab_size=256000, seq_len=4096, mlp="gelu",
                 norm="layernorm", bias=False, position="rope", tie_embeddings=False)

MODELS = {
    "llama3.1-8b": presets.model("llama3-8b").with_seq_len(8192),
    "llama3.1-70b": replace(presets.model("llama3-70b").with_seq_len(8192),
                            vocab_size=128512),
    "llama3.1-405b": replace(presets.model("llama3-405b").with_seq_len(8192),
                             n_kv_head=16, vocab_size=51200),
    "nemotron4-15b": ModelShape(name="nemotron4-15b", n_layer=32, d_model=6144, n_head=48,
                                d_ff=24576, **_NEMOTRON),
    "nemotron4-340b": ModelShape(name="nemotron4-340b", n_layer=96, d_model=18432,
                                 n_head=96, d_ff=73728, **_NEMOTRON),
    "gpt3-175b": ModelShape(name="gpt3-175b", n_layer=96, d_model=12288, n_head=96,
                            vocab_size=50688, seq_len=2048, dropout=0.1),
    # NeMo 2.0's recipe: the released model, the Llama 3.1 tokenizer padded to 1,024
    "llama3.1-405b nemo2": replace(presets.model("llama3-405b").with_seq_len(8192),
                                   vocab_size=129024),
    # NeMo 2.0's scripts: NullTokenizer(256000), 256,001 entries, padded to 128 x TP
    "nemotron4-15b nemo2": ModelShape(name="nemotron4-15b", n_layer=32, d_model=6144,
                                      n_head=48, d_ff=24576,
                                      **{**_NEMOTRON, "vocab_size": 256256}),
    "nemotron4-340b nemo2": ModelShape(name="nemotron4-340b", n_layer=96, d_model=18432,
                                       n_head=96, d_ff=73728,
                                       **{**_NEMOTRON, "vocab_size": 257024}),
}


@dataclass(frozen=True)
class Recipe:
    """One README table: the layout in its header, the recipe's settings, the source's
    "model flops" of one sequence, and its columns (GPUs, global batch, step seconds,
    MFU %)."""

    model: str
    tp: int
    pp: int
    cp: int
    vp: int
    micro: int
    bucket_mb: float
    attention_kernel: str
    flops_per_sequence: float
    columns: tuple[tuple[int, int, float, float], ...]
    recompute: str | None = None
    loss_fusion: bool = True
    release: str = "v24.11.1"
    grad_dtype: str = "bf16"  # the gradient buffers' and their reduction's dtype
    # NeMo 2.0's 405B: the embedding and the loss each take a layer's place
    layer_split: tuple[int, ...] | None = None
    # NeMo 2.0 with PP, VP and DP > 1: one bucket per model chunk (its
    # overlap_param_gather_with_optimizer_step disables bucketing)
    bucket_per_chunk: bool = False
    fp8: bool = False  # the FP8 table: Transformer Engine's hybrid FP8 (plan/fp8.py)


RECIPES = (
    Recipe("llama3.1-8b", 1, 1, 2, 1, 1, 75, "cudnn", 4.74e14, (
        (8, 128, 12.91, 59.37), (16, 256, 13.00, 58.96), (32, 512, 13.05, 58.73),
        (64, 1024, 13.08, 58.60), (128, 2048, 13.10, 58.51))),
    Recipe("llama3.1-70b", 4, 4, 2, 5, 1, 75, "cudnn", 3.94e15, (
        (64, 128, 14.72, 54.10), (128, 256, 14.73, 54.06), (256, 512, 14.80, 53.81),
        (512, 1024, 14.89, 53.48), (1024, 2048, 14.92, 53.38),
        (2048, 4096, 14.98, 53.38))),
    Recipe("llama3.1-405b", 8, 9, 2, 7, 1, 125, "cudnn", 2.17e16, (
        (576, 252, 17.20, 55.78), (1152, 504, 17.52, 54.76), (2304, 1008, 17.62, 54.45))),
    Recipe("nemotron4-15b", 4, 1, 1, 1, 4, 100, "cudnn", 434.5e12, (
        (16, 64, 2.83, 62.10), (32, 128, 2.86, 61.45), (64, 256, 2.86, 61.45),
        (128, 512, 2.89, 60.81), (256, 1024, 2.88, 61.02), (512, 2048, 2.92, 60.18),
        (1024, 4096, 2.92, 60.18), (2048, 8192, 2.96, 59.37))),
    Recipe("nemotron4-340b", 8, 8, 1, 12, 1, 50, "flash2", 1.01e16, (
        (128, 32, 4.61, 55.38), (256, 64, 4.67, 54.67), (512, 128, 4.70, 54.32),
        (1024, 256, 4.73, 53.98), (2048, 512, 4.84, 52.75)), recompute="selective"),
    Recipe("gpt3-175b", 4, 8, 1, 12, 1, 220, "flash2", 2.20e15, (
        (128, 256, 8.91, 49.93), (256, 512, 8.95, 49.71), (512, 1024, 9.09, 48.94),
        (1024, 2048, 9.01, 49.38), (2048, 4096, 9.02, 49.32)), loss_fusion=False),
)

_MEGATRON_BUCKET_MB = 128 * 1024 * 1024 * 2 / 2**20  # NeMo 2.0: 128 Mi bf16 parameters
_EDGES_405B = (1,) + (2,) * 62 + (1,)  # 126 layers + embedding + loss over 8 x 8 stages


def _bucket_mb(recipe: Recipe, dp: int) -> float:
    """The recipe's gradient bucket in MiB of bf16 parameters: one model chunk's
    (`bucket_per_chunk`: its largest, by layers), Megatron-Core's default when none is
    given (`bucket_mb` 0: max(40M, 1M x DP x CP) parameters), or `bucket_mb`."""
    if recipe.bucket_per_chunk:
        shape = MODELS[recipe.model]
        layers = max(recipe.layer_split or [shape.n_layer // (recipe.pp * recipe.vp)])
        return layers * sum(shape.layer_params(recipe.tp)) * 2 / 2**20
    if not recipe.bucket_mb:
        return max(40_000_000, 1_000_000 * dp * recipe.cp) * 2 / 2**20
    return recipe.bucket_mb


LATER_RECIPES = (
    Recipe("llama3.1-8b", 1, 1, 2, 1, 1, 75, "cudnn", 4.74e14, (
        (8, 128, 12.78, 59.99), (16, 256, 12.99, 59.03), (32, 512, 13.00, 58.99),
        (64, 1024, 13.00, 58.99), (128, 2048, 13.16, 58.28)), release="v25.02"),
    Recipe("llama3.1-70b", 4, 4, 2, 5, 1, 75, "cudnn", 3.94e15, (
        (64, 128, 14.61, 54.52), (128, 256, 14.70, 54.20), (256, 512, 14.72, 54.12),
        (512, 1024, 14.80, 53.84), (1024, 2048, 14.86, 53.63),
        (2048, 4096, 14.84, 53.68)), release="v25.02"),
    Recipe("llama3.1-405b", 8, 9, 2, 7, 1, 125, "cudnn", 2.17e16, (
        (576, 252, 17.50, 54.85), (1152, 504, 17.60, 54.54), (2304, 1008, 17.70, 54.23)),
        release="v25.02"),
    # bucket 0: Megatron-Core's default, by DP (recipe_config)
    Recipe("nemotron4-15b", 4, 1, 1, 1, 4, 0, "cudnn", 434.5e12, (
        (16, 64, 2.812, 62.49), (32, 128, 2.824, 62.23), (64, 256, 2.845, 61.77),
        (128, 512, 2.859, 61.47), (256, 1024, 2.852, 61.62), (512, 2048, 2.875, 61.12),
        (1024, 4096, 2.895, 60.70), (2048, 8192, 2.887, 60.87)),
        release="v25.02", grad_dtype="fp32"),
    Recipe("gpt3-175b", 4, 8, 1, 6, 1, 220, "cudnn", 2.20e15, (
        (128, 256, 8.309, 53.54), (256, 512, 8.408, 52.91), (512, 1024, 8.42, 52.84),
        (1024, 2048, 8.453, 52.63), (2048, 4096, 8.49, 52.40)),
        loss_fusion=False, release="v25.02"),
    Recipe("llama3.1-8b", 1, 1, 2, 1, 1, _MEGATRON_BUCKET_MB, "cudnn", 4.74e14, (
        (8, 128, 12.27, 62.47), (16, 256, 12.3, 62.31), (32, 512, 12.32, 62.21),
        (64, 1024, 12.33, 62.16), (128, 2048, 12.33, 62.16)), release="v25.04"),
    Recipe("llama3.1-70b", 4, 4, 2, 5, 1, _MEGATRON_BUCKET_MB, "cudnn", 3.94e15, (
        (64, 128, 14.66, 54.32), (128, 256, 14.67, 54.29), (256, 512, 14.68, 54.25),
        (512, 1024, 14.67, 54.29), (1024, 2048, 14.65, 54.36),
        (2048, 4096, 14.66, 54.32)), release="v25.04", bucket_per_chunk=True),
    Recipe("llama3.1-405b nemo2", 8, 8, 2, 8, 1, _MEGATRON_BUCKET_MB, "cudnn", 2.17e16, (
        (512, 256, 19.78, 55.47), (1024, 512, 19.84, 55.31), (2048, 1024, 19.87, 55.22)),
        release="v25.04", layer_split=_EDGES_405B, bucket_per_chunk=True),
    Recipe("nemotron4-15b nemo2", 2, 1, 1, 1, 2, _MEGATRON_BUCKET_MB, "cudnn", 434.5e12, (
        (16, 64, 2.66, 66.07), (32, 128, 2.66, 66.07), (64, 256, 2.67, 65.82),
        (128, 512, 2.67, 65.82), (256, 1024, 2.68, 65.57), (512, 2048, 2.71, 64.85),
        (1024, 4096, 2.74, 64.14), (2048, 8192, 2.78, 63.21)), release="v25.04"),
    Recipe("nemotron4-340b nemo2", 8, 8, 1, 12, 1, _MEGATRON_BUCKET_MB, "cudnn", 1.01e16, (
        (256, 64, 4.36, 58.56), (512, 128, 4.39, 58.16), (1024, 256, 4.41, 57.89),
        (2048, 512, 4.43, 57.63)), release="v25.04", bucket_per_chunk=True),
    Recipe("nemotron4-15b nemo2", 2, 1, 1, 1, 2, _MEGATRON_BUCKET_MB, "cudnn", 3.85e14, (
        (16, 64, 2.746, 56.7),), release="v25.05"),
    Recipe("nemotron4-340b nemo2", 8, 8, 1, 12, 1, _MEGATRON_BUCKET_MB, "cudnn", 8.62124e15, (
        (256, 64, 4.606, 47.3),), release="v25.05", bucket_per_chunk=True),
    Recipe("llama3.1-405b nemo2", 8, 8, 2, 8, 1, _MEGATRON_BUCKET_MB, "cudnn", 2.17e16, (
        (512, 256, 19.810, 55.34),), release="v25.05.01", layer_split=_EDGES_405B,
        bucket_per_chunk=True),
)


def _fp8(recipe: Recipe, columns, **changes) -> Recipe:
    """The FP8 table of the BF16 `recipe`'s release: its columns, the same settings but
    for `changes` (the scripts' FP8 switches are the module docstring's)."""
    return replace(recipe, fp8=True, columns=columns, **changes)


# The FP8 tables beside RECIPES' (v24.11.1): the H100's FP8 GEMM efficiency is fitted on
# these (roofline.H100_FP8_GEMM_EFFICIENCY, benchmarks/fit_time_model.py)
FP8_RECIPES = (
    _fp8(RECIPES[0], ((8, 128, 9.67, 39.63), (16, 256, 9.73, 39.39), (32, 512, 9.75, 39.31),
                      (64, 1024, 9.80, 39.10), (128, 2048, 9.82, 39.02))),
    _fp8(RECIPES[1], ((64, 128, 11.01, 36.17), (128, 256, 10.93, 36.43),
                      (256, 512, 11.16, 35.68), (512, 1024, 11.18, 35.62),
                      (1024, 2048, 11.28, 35.30), (2048, 4096, 11.39, 34.96))),
    _fp8(RECIPES[2], ((576, 252, 11.24, 42.71), (1152, 504, 11.31, 42.45),
                      (2304, 1008, 12.35, 38.87))),
    _fp8(RECIPES[3], ((16, 64, 2.08, 42.22), (32, 128, 2.07, 42.43), (64, 256, 2.09, 42.02),
                      (128, 512, 2.08, 42.22), (256, 1024, 2.10, 41.82),
                      (512, 2048, 2.12, 41.43), (1024, 4096, 2.12, 41.43),
                      (2048, 8192, 2.18, 40.29))),
    _fp8(RECIPES[4], ((128, 32, 3.16, 40.38), (256, 64, 3.21, 39.75), (512, 128, 3.26, 39.14),
                      (1024, 256, 3.34, 38.20), (2048, 512, 3.49, 36.56))),
    _fp8(RECIPES[5], ((128, 256, 5.92, 37.56), (256, 512, 5.96, 37.30),
                      (512, 1024, 6.44, 34.52), (1024, 2048, 6.72, 33.09),
                      (2048, 4096, 6.24, 35.63))),
)

# The later releases' FP8 tables, held out. v25.02's Nemotron-4 340B table is v24.11.1's,
# reprinted, and v25.05.01's Nemotron pair is v25.05's: neither is planned twice.
LATER_FP8_RECIPES = (
    _fp8(LATER_RECIPES[0], ((8, 128, 9.44, 40.59), (16, 256, 9.47, 40.45),
                            (32, 512, 9.60, 39.94), (64, 1024, 9.64, 39.77),
                            (128, 2048, 9.73, 39.41))),
    _fp8(LATER_RECIPES[1], ((64, 128, 10.46, 38.08), (128, 256, 10.52, 37.84),
                            (256, 512, 10.75, 37.04), (512, 1024, 10.76, 37.00),
                            (1024, 2048, 10.83, 36.77), (2048, 4096, 10.99, 36.23))),
    _fp8(LATER_RECIPES[2], ((576, 252, 11.00, 43.61), (1152, 504, 11.10, 43.22),
                            (2304, 1008, 11.20, 42.83))),
    _fp8(LATER_RECIPES[3], ((16, 64, 2.039, 43.07), (32, 128, 2.046, 42.92),
                            (64, 256, 2.048, 42.88), (128, 512, 2.059, 42.65),
                            (256, 1024, 2.075, 42.32), (512, 2048, 2.12, 41.43),
                            (1024, 4096, 2.094, 41.94), (2048, 8192, 2.12, 41.43))),
    _fp8(LATER_RECIPES[4], ((128, 256, 5.626, 39.52), (256, 512, 5.725, 38.84),
                            (512, 1024, 5.774, 38.51), (1024, 2048, 5.82, 38.20),
                            (2048, 4096, 5.96, 37.30))),
    _fp8(LATER_RECIPES[5], ((8, 128, 9.33, 41.07), (16, 256, 9.36, 40.94),
                            (32, 512, 9.43, 40.64), (64, 1024, 9.48, 40.42),
                            (128, 2048, 9.54, 40.17))),
    # v25.04's 70B in FP8 runs PP 8 and no CP where BF16 runs PP 4, CP 2
    # (llama31_utils.py at NeMo d2b21556)
    _fp8(LATER_RECIPES[6], ((64, 128, 9.86, 40.38), (128, 256, 9.95, 40.02),
                            (256, 512, 10.00, 39.82), (512, 1024, 10.07, 39.54),
                            (1024, 2048, 10.08, 39.50), (2048, 4096, 10.15, 39.23)),
         pp=8, cp=1),
    _fp8(LATER_RECIPES[7], ((512, 256, 12.37, 44.35), (1024, 512, 12.42, 44.17),
                            (2048, 1024, 12.56, 43.68))),
    _fp8(LATER_RECIPES[8], ((16, 64, 1.98, 44.35), (32, 128, 1.98, 44.35),
                            (64, 256, 1.98, 44.35), (128, 512, 1.99, 44.13),
                            (256, 1024, 2.00, 43.91), (512, 2048, 2.02, 43.48),
                            (1024, 4096, 2.03, 43.26), (2048, 8192, 2.09, 42.02))),
    _fp8(LATER_RECIPES[9], ((256, 64, 2.93, 43.55), (512, 128, 2.97, 42.96),
                            (1024, 256, 3.00, 42.53), (2048, 512, 3.05, 41.83))),
    _fp8(LATER_RECIPES[10], ((16, 64, 1.988, 39.1),)),
    _fp8(LATER_RECIPES[11], ((256, 64, 3.107, 35.0),)),
    _fp8(LATER_RECIPES[12], ((512, 256, 13.02, 42.12),)),
)


def recipe_config(recipe: Recipe, gpus: int, batch: int) -> ParallelConfig:
    """A column's layout under its recipe's settings (module docstring)."""
    dp = gpus // (recipe.tp * recipe.pp * recipe.cp)
    return ParallelConfig(
        dp=dp, tp=recipe.tp, pp=recipe.pp, cp=recipe.cp, zero=1,
        schedule="interleaved" if recipe.vp > 1 else "1f1b", virtual_stages=recipe.vp,
        micro_batch_size=recipe.micro, global_batch_size=batch,
        sequence_parallel=recipe.tp > 1, tp_comm_overlap=recipe.tp > 1,
        overlap_param_gather=True,
        bucket_size_mb=_bucket_mb(recipe, dp),
        grad_accum_dtype=recipe.grad_dtype, flash_attention=True,
        recompute_granularity=recipe.recompute, cross_entropy_loss_fusion=recipe.loss_fusion,
        layer_split=recipe.layer_split, fp8_format="hybrid" if recipe.fp8 else None,
        fp8_param_gather=recipe.fp8, rank_order=MEGATRON_ORDER, reductions_in_flight=None)


@dataclass(frozen=True)
class SourceFlops:
    """The source's FLOP count of a step: its "model flops" of one sequence x batch."""

    per_sequence: float

    def __call__(self, shape: ModelShape, global_batch: int) -> float:
        return self.per_sequence * global_batch


def published_tflops(recipe: Recipe, gpus: int, batch: int, step_s: float) -> float:
    """TFLOP/s per GPU by the source's count (its MFU column x 989, or x 1,979 in FP8)."""
    return recipe.flops_per_sequence * batch / step_s / gpus / 1e12


def _runs(*tables) -> tuple[H100Run, ...]:
    """The runs of (source, label, recipes, fitted) tables, every column of each."""
    runs = []
    for source, label, recipes, fitted in tables:
        for recipe in recipes:
            name = recipe.model if recipe.release == "v24.11.1" else (
                f"{recipe.model.split()[0]} ({recipe.release})")
            for gpus, batch, step_s, _mfu in recipe.columns:
                config = recipe_config(recipe, gpus, batch)
                vp = f" (v {recipe.vp})" if recipe.vp > 1 else ""
                row = (f"{name}: tp {recipe.tp}, pp {recipe.pp}{vp}, cp {recipe.cp}, "
                       f"{gpus:,} GPUs, batch {batch}, {recipe.attention_kernel}")
                runs.append(H100Run(source, label, row, MODELS[recipe.model], config,
                                    published_tflops(recipe, gpus, batch, step_s), fitted,
                                    SourceFlops(recipe.flops_per_sequence),
                                    attention_kernel=recipe.attention_kernel))
    return tuple(runs)


RUNS = _runs((DGXC, "DGXC", RECIPES, False), (DGXC_LATER, "DGXC 25", LATER_RECIPES, False))
FP8_RUNS = _runs((DGXC_FP8, "DGXC FP8", FP8_RECIPES, True),
                 (DGXC_FP8_LATER, "DGXC 25 FP8", LATER_FP8_RECIPES, False))
