"""The planner held against a real cluster: Narayanan et al. 2021, Table 1.

"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC21)
reports the teraFLOP/s per GPU Megatron-LM achieved on DGX A100-80GB nodes for ten GPT
models from 1.7B to 1T parameters (fp16, full recomputation, seq 2048, vocab 51200).
Their FLOPs are eq. 3 of section 5.1, which counts the recomputed forward:

    F = 96 B s l h^2 (1 + s / 6h + V / 16 l h)   per step of B sequences

so a predicted step time T gives F / (T x GPUs) to compare with the table.

Settings (stated, with where they come from):
- layouts, micro-batch sizes, interleaving and DDP flavour: the paper's artifact script,
  Megatron-LM examples/academic_paper_scripts/sc21/run_table_1.sh (micro-batch 16 up to
  7.5B, 8 for 18.4B, 4, 2, 2 for 39.1B-145.6B, 1 above; layers per virtual stage 5, 5, 3,
  1 for 76.1B, 145.6B, 310.1B, 529.6B, i.e. v = 3, 2, 2, 3; none for the others;
  `--DDP-impl torch` up to 18.4B, `local` above); `--activations-checkpoint-method
  uniform` (every layer recomputed); fp16 (2-byte activations and gradients, the bytes
  of minipar's bf16-mixed).
- Megatron's defaults of the time: hidden and attention dropout 0.1, tied embeddings,
  biases, GELU, LayerNorm, no flash attention, no sequence parallelism, and the
  scatter-gather of pipeline messages across TP (section 4.1).
- Assumed: torch DDP (rows up to 18.4B) reduces 25 MiB buckets (its bucket_cap_mb
  default) during the last micro-batch's backward (Li et al. 2020; priced by
  plan/overlap.py, so only what outlasts that backward is exposed); `local` DDP
  all-reduces after the backward (--no-overlap-grad-reduce). The all-reduce bandwidth
  is the planner's: a group crossing nodes runs at one InfiniBand adapter's 25 GB/s.
- Everything else is the planner's model: each kernel on the A100 roofline
  (minipar.distributed.roofline), the alpha-beta cost of every collective, the exact
  1F1B / interleaved schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.plan import presets
from minipar.plan.cluster import ClusterSpec
from minipar.plan.estimate import estimate
from minipar.plan.layout import MEGATRON_ORDER, ParallelConfig
from minipar.plan.shapes import ModelShape

SEQ_LEN, VOCAB = 2048, 51200
TORCH_DDP_BUCKET_MB = 25  # torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)
TOLERANCE = 0.10  # the target: every row within 10% of the published throughput


@dataclass(frozen=True)
class PublishedRun:
    """One row of Narayanan et al. 2021, Table 1, and its run_table_1.sh settings."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops: float  # achieved teraFLOP/s per GPU (eq. 3 FLOPs)
    micro_batch: int
    layers_per_virtual_stage: int | None  # interleaving (None: plain 1F1B)
    ddp: str  # "torch" (overlapped) or "local"

    @property
    def shape(self) -> ModelShape:
        return ModelShape(name=f"gpt-{self.name}", n_layer=self.layers, d_model=self.hidden,
                          n_head=self.heads, vocab_size=VOCAB, seq_len=SEQ_LEN, dropout=0.1)

    @property
    def config(self) -> ParallelConfig:
        per_stage = self.layers // self.pp
        v = 1 if self.layers_per_virtual_stage is None else (
            per_stage // self.layers_per_virtual_stage)
        return ParallelConfig(
            dp=self.gpus // (self.tp * self.pp), tp=self.tp, pp=self.pp,
            schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v,
            micro_batch_size=self.micro_batch, global_batch_size=self.global_batch,
            precision="bf16-mixed", recompute_granularity="full", flash_attention=False,
            # torch DDP reduces its 25 MiB buckets (bucket_cap_mb's default) during the
            # last micro-batch's backward; Megatron's local DDP after it (plan/overlap.py)
            bucket_size_mb=TORCH_DDP_BUCKET_MB if self.ddp == "torch" else 0.0,
            overlap_grad_reduce=self.ddp == "torch", rank_order=MEGATRON_ORDER)


TABLE_1 = (
    PublishedRun("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, None, "torch"),
    PublishedRun("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, None, "torch"),
    PublishedRun("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, None, "torch"),
    PublishedRun("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, None, "torch"),
    PublishedRun("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, None, "local"),
    PublishedRun("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5, "local"),
    PublishedRun("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5, "local"),
    PublishedRun("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3, "local"),
    PublishedRun("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1, "local"),
    PublishedRun("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, None, "local"),
)


def paper_flops(shape: ModelShape, global_batch: int) -> float:
    """FLOPs of one step as Narayanan et al. 2021 count them (eq. 3, recomputation in)."""
    s, h, n = shape.seq_len, shape.d_model, shape.n_layer
    return 96 * global_batch * s * n * h**2 * (1 + s / (6 * h)
                                               + shape.vocab_size / (16 * n * h))


def predicted_step(run: PublishedRun, cluster: ClusterSpec | None = None) -> dict:
    """The planner's step for one row: its seconds, the part of them that is exposed
    data-parallel communication, and the throughput in the paper's convention."""
    cluster = presets.cluster("a100-80gb") if cluster is None else cluster
    shape, config = run.shape, run.config
    est = estimate(shape, config, cluster, scatter_gather=True)
    step = est.step_time
    tflops = paper_flops(shape, run.global_batch) / (step * run.gpus) / 1e12
    return {"step_s": step, "tflops": tflops, "bubble_fraction": est.time["bubble_fraction"],
            "error": tflops / run.tflops - 1}


def compare(cluster: ClusterSpec | None = None) -> list[dict]:
    """Every row: published and predicted TFLOP/s per GPU and the relative error."""
    rows = []
    for run in TABLE_1:
        predicted = predicted_step(run, cluster)
        rows.append({"model": run.name, "tp": run.tp, "pp": run.pp, "gpus": run.gpus,
                     "micro_batch": run.micro_batch, "virtual_stages": run.config.virtual_stages,
                     "published": run.tflops, **predicted})
    return rows


SETTINGS = (
    "links: NVLink 300 GB/s per direction, one 200 Gb/s HDR adapter per GPU (DGX A100)",
    "settings of run_table_1.sh: micro-batch, interleaving (v), DDP torch/local; full "
    "recomputation; fp16; dropout 0.1; no flash attention; no sequence parallelism",
    "pipeline messages scatter-gathered across TP (Narayanan et al. 2021, section 4.1)",
    "torch DDP reduces 25 MiB buckets during the last backward (assumed; plan/overlap.py); "
    "local DDP after it",
    "FLOPs per step: the paper's eq. 3, 96 B s l h^2 (1 + s/6h + V/16lh)",
)


def assumptions(cluster: ClusterSpec | None = None) -> list[str]:
    """What the comparison assumes, the compute model of `cluster` first."""
    cluster = presets.cluster("a100-80gb") if cluster is None else cluster
    r = cluster.roofline
    if r is None:
        compute = (f"uniform model: every FLOP at {cluster.efficiency:.0%} of "
                   f"{cluster.peak_flops / 1e12:.0f} TFLOP/s")
    else:
        compute = (f"{r.name} roofline: {r.peak_flops / 1e12:.0f} TFLOP/s tensor, "
                   f"{r.hbm_bandwidth / 1e9:.0f} GB/s HBM, {r.sm_count} SMs (datasheet); "
                   f"gemm_efficiency {r.gemm_efficiency:.2f}, memory_efficiency "
                   f"{r.memory_efficiency:.2f} (fitted: benchmarks/fit_time_model.py)")
    return [compute, *SETTINGS]


def format_comparison(rows: list[dict], cluster: ClusterSpec | None = None) -> str:
    """The comparison as a text table, the worst error and the assumptions."""
    header = ("model", "t", "p", "v", "GPUs", "mb", "published", "predicted", "error",
              "bubble")
    lines = ["Narayanan et al. 2021, Table 1 (A100-80GB, TFLOP/s per GPU, eq. 3 FLOPs) vs "
             "minipar plan", ""]
    table = [header] + [(r["model"], str(r["tp"]), str(r["pp"]), str(r["virtual_stages"]),
                         str(r["gpus"]), str(r["micro_batch"]), f"{r['published']:.0f}",
                         f"{r['tflops']:.1f}", f"{r['error']:+.1%}",
                         f"{r['bubble_fraction']:.1%}") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    worst = max(rows, key=lambda r: abs(r["error"]))
    lines += ["", f"worst row: {worst['model']} at {worst['error']:+.1%} (target: every row "
                  f"within {TOLERANCE:.0%})", "", "assumptions:"]
    lines += [f"  - {a}" for a in assumptions(cluster)]
    return "\n".join(lines)
