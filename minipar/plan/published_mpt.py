"""MosaicML's published H100 runs of MPT models (llm-foundry), held out from the fit.

Source: mosaicml/llm-foundry, scripts/train/benchmarking/README.md at commit 061f2c7c
("H100 80GB BF16"): 52 runs of MPT 760M to 70B on 8 to 64 H100s, PyTorch FSDP
(`FULL_SHARD`: ZeRO-3) under Composer, each row a model, sequence length, GPUs, micro-batch,
gradient accumulation, global batch, activation checkpointing, NumParams, MFU and "Model
TFLOP" (MFU x peak: model TFLOP/s per GPU). The runs were made by the README's sweep.sh
with submit_benchmarks.py, which sets the model from scripts/train/yamls/mpt/<size>.yaml.

**Half held out.** Every second row of the table below (the 2nd, 4th, ...) fits the H100's
overlap contention (presets.H100_OVERLAP_CONTENTION), the one constant these runs brought
in; the others are held out, and the efficiencies stay fitted on the five Megatron-LM
README rows (published_h100.py). A second stack (FSDP, not Megatron-Core), a second FLOP
count and a second kind of layout (pure data parallelism, ZeRO-3) that fit never saw.
(All 52 were held out until then; the split was made after their errors had been seen.)

The models (yamls/mpt/*.yaml, checked against NumParams: tests/plan/test_published_mpt.py):
d_model, n_heads (d_head 128 throughout: "so that d_head == 128 to satisfy
FlashAttention"), n_layers and expansion_ratio 4 as listed below, vocabulary 50,368, tied
embeddings. Those yamls set no `alibi` and no `no_bias`, so MPTConfig's defaults apply:
biases in every linear layer and LayerNorm, and a learned (max_seq_len, d_model) position
table (`learned_pos_emb: True`). That is why NumParams grows with the sequence length
(13B: 12,853,954,560 at 2048, +30,720 x 5,120 at 32,768): a GPT-2 shape reproduces every
row's NumParams exactly, where the released MPT checkpoints (ALiBi, no biases) would not.

The layout, per row: dp = GPUs, ZeRO-3 (FULL_SHARD, one FSDP unit per block: MPT's
`fsdp_wrap_fn`), the row's micro-batch and global batch, full recomputation of every
block when "Activation Checkpointing" is True (Composer wraps each block,
`activation_checkpointing_reentrant: False`). FSDP's overlaps: the next unit's all-gather
issued while the current one computes (`limit_all_gathers` keeps two in flight; the
planner's ZeRO-3 prefetch) and the reduce-scatter of each unit during backward
(`overlap_grad_reduce`). "MP Mode DEFAULT": in the Composer versions read, bf16
parameters with fp32 gradient reduction (`reduce_dtype` fp32; some older ones reduce in
the autocast dtype), the planner's default fp32 gradients.

Attention: `attn_impl: triton` (the yamls and submit_benchmarks.py's default; sweep.sh
passes no other): FlashAttention in Triton (llm-foundry's flash_attn_triton.py, after Tri
Dao's), on the pre-MLIR Triton llm-foundry's setup.py pins. It is priced as
`--attention-kernel triton`: FlashAttention-2's measured H100 rates over the gap Dao
2023 measured between the two on the A100 (minipar.distributed.attention_kernels,
FLASH_TRITON_H100: derived, no H100 measurement of it exists). Priced as FlashAttention-2
itself, the nearest measured kernel, the rows of 8K tokens and more read 13-57% fast
(docs/planner.md).

FLOPs: the README's own count (section "MFU"), per sequence 3 x (2 N s + 4 L h s^2):
N = NumParams (embedding and position table included), attention full (not causal).
"""

from __future__ import annotations

from minipar.plan.layout import ParallelConfig
from minipar.plan.published_h100 import H100Run
from minipar.plan.shapes import ModelShape

MPT = "MosaicML llm-foundry, benchmarking README (061f2c7c), H100 80GB BF16"
ATTENTION_KERNEL = "triton"  # FlashAttention in Triton, attn_impl: triton

# yamls/mpt/<size>.yaml: d_model, n_layers (n_heads = d_model / 128)
SIZES = {"760m": (1536, 24), "1b": (2048, 24), "3b": (2560, 32), "7b": (4096, 32),
         "13b": (5120, 40), "30b": (7168, 48), "70b": (8192, 80)}

# (model, seq len, GPUs, micro-batch, global batch, activation checkpointing,
#  Model TFLOP/s per GPU, NumParams): the README's rows in its order
TABLE = (
    ("70b", 2048, 64, 8, 2048, True, 421.2583, 64862437376),
    ("70b", 2048, 32, 2, 1024, True, 357.6911, 64862437376),
    ("30b", 8192, 8, 1, 168, True, 296.1077, 30019254272),
    ("30b", 4096, 8, 1, 168, True, 354.8107, 29989894144),
    ("30b", 2048, 32, 14, 1344, True, 434.6371, 29975214080),
    ("30b", 2048, 16, 10, 480, True, 426.1622, 29975214080),
    ("30b", 2048, 8, 3, 504, True, 377.1361, 29975214080),
    ("30b", 1024, 8, 6, 1008, True, 383.5386, 29967874048),
    ("13b", 32768, 8, 1, 24, True, 313.4795, 13011240960),
    ("13b", 16384, 8, 3, 72, True, 351.7379, 12927354880),
    ("13b", 4096, 8, 10, 240, True, 411.6250, 12864440320),
    ("13b", 2048, 64, 2, 128, False, 394.3653, 12853954560),
    ("13b", 2048, 32, 2, 64, False, 395.2796, 12853954560),
    ("13b", 2048, 16, 2, 32, False, 391.6861, 12853954560),
    ("13b", 2048, 8, 2, 16, False, 393.7055, 12853954560),
    ("13b", 1024, 8, 40, 960, True, 438.0472, 12848711680),
    ("7b", 65536, 8, 1, 16, True, 282.9422, 6918905856),
    ("7b", 32768, 8, 2, 32, True, 306.1503, 6784688128),
    ("7b", 8192, 8, 8, 128, True, 367.4893, 6684024832),
    ("7b", 4096, 8, 16, 256, True, 399.9793, 6667247616),
    ("7b", 2048, 8, 6, 48, False, 459.5096, 6658859008),
    ("7b", 1024, 8, 64, 1024, True, 423.8424, 6654664704),
    ("3b", 65536, 8, 1, 16, True, 265.2666, 2814366720),
    ("3b", 32768, 8, 3, 144, True, 285.4036, 2730480640),
    ("3b", 16384, 8, 1, 48, False, 359.5418, 2688537600),
    ("3b", 8192, 8, 3, 144, False, 398.8482, 2667566080),
    ("3b", 4096, 8, 5, 240, False, 418.6327, 2657080320),
    ("3b", 2048, 64, 6, 1152, False, 403.7625, 2651837440),
    ("3b", 2048, 32, 6, 576, False, 412.6519, 2651837440),
    ("3b", 2048, 16, 10, 480, False, 432.7437, 2651837440),
    ("3b", 1024, 8, 20, 960, False, 457.1338, 2649216000),
    ("3b", 512, 8, 40, 1920, False, 458.3697, 2647905280),
    ("1b", 65536, 8, 1, 16, True, 260.6140, 1445974016),
    ("1b", 32768, 8, 1, 32, False, 331.9089, 1378865152),
    ("1b", 16384, 8, 2, 64, False, 348.4904, 1345310720),
    ("1b", 8192, 8, 3, 96, False, 373.2998, 1328533504),
    ("1b", 4096, 8, 7, 224, False, 398.3310, 1320144896),
    ("1b", 2048, 64, 20, 1280, False, 404.2246, 1315950592),
    ("1b", 2048, 32, 20, 640, False, 410.8550, 1315950592),
    ("1b", 2048, 16, 20, 320, False, 419.1080, 1315950592),
    ("1b", 2048, 8, 14, 112, False, 413.8134, 1315950592),
    ("1b", 1024, 8, 18, 576, False, 415.1125, 1313853440),
    ("1b", 512, 8, 56, 1792, False, 427.5497, 1312804864),
    ("760m", 32768, 8, 1, 16, False, 315.1039, 807656448),
    ("760m", 16384, 8, 3, 48, False, 332.1888, 782490624),
    ("760m", 8192, 8, 6, 96, False, 344.7797, 769907712),
    ("760m", 4096, 8, 12, 192, False, 354.5866, 763616256),
    ("760m", 2048, 32, 24, 768, False, 371.7227, 760470528),
    ("760m", 2048, 16, 24, 384, False, 374.8925, 760470528),
    ("760m", 2048, 8, 24, 384, False, 345.3389, 760470528),
    ("760m", 1024, 8, 48, 768, False, 393.4058, 758897664),
    ("760m", 512, 8, 96, 1536, False, 399.9190, 758111232),
)


def mpt_shape(size: str, seq_len: int) -> ModelShape:
    d_model, n_layer = SIZES[size]
    return ModelShape(name=f"mpt-{size}", n_layer=n_layer, d_model=d_model,
                      n_head=d_model // 128, vocab_size=50368, seq_len=seq_len,
                      position="learned", bias=True, norm="layernorm", tie_embeddings=True)


def mpt_flops(shape: ModelShape, global_batch: int) -> float:
    """FLOPs of a step as the README's MFU counts them: 3 (2 N s + 4 L h s^2) per
    sequence (full attention, N every parameter)."""
    s = shape.seq_len
    return 3 * global_batch * (2 * shape.n_params * s
                               + 4 * shape.n_layer * shape.d_model * s * s)


def mpt_config(gpus: int, micro: int, batch: int, checkpointing: bool) -> ParallelConfig:
    """A row's layout (module docstring): FSDP FULL_SHARD over every GPU with its
    overlaps, every block recomputed when the row checkpoints activations."""
    return ParallelConfig(
        dp=gpus, zero=3, micro_batch_size=micro, global_batch_size=batch,
        flash_attention=True, zero3_prefetch=True, overlap_grad_reduce=True,
        recompute_granularity="full" if checkpointing else None)


def _run(size, seq_len, gpus, micro, batch, checkpointing, tflops, _n_params,
         fitted: bool) -> H100Run:
    config = mpt_config(gpus, micro, batch, checkpointing)
    row = (f"{size}: seq {seq_len:,}, {gpus} GPUs, micro {micro}, batch {batch}"
           + (", ckpt" if checkpointing else ""))
    return H100Run(MPT, "MPT", row, mpt_shape(size, seq_len), config, tflops, fitted,
                   mpt_flops, attention_kernel=ATTENTION_KERNEL)


# Every second row of the README's table (the 2nd, 4th, ...) fits the overlap contention;
# the others are held out.
RUNS = tuple(_run(*row, fitted=i % 2 == 1) for i, row in enumerate(TABLE))
