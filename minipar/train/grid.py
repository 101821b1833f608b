"""The equivalence matrix: many parallel layouts, each against single-device training.

    results = run_grid()                 # every case of GRID, fp64, a few steps each
    print(minipar.viz.tables.grid_table(results))   # what `minipar check` prints

Each case trains with `check=True` (minipar/train/equivalence.py): the single-device
reference runs the same global batch in the same micro-batches, and every rank compares
what it holds after every step. Cases that share a reference (same global batch and
micro-batches) share one reference run. A case the layout rules refuse is reported as
refused, with the reason, and counts as expected when the case says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minipar.errors import ConfigError
from minipar.train.config import TrainConfig
from minipar.train.loop import train

# Small enough that the whole grid runs in seconds; 4 layers so that pp=4 and
# interleaved pp=2 x 2 chunks each get a layer; vocabulary 52 (the corpus) splits over
# tp 2 and 4. Clipping at 1.0 is active on these steps, so the global norm is checked.
BASE = dict(steps=3, precision="fp64", seq_len=16, d_model=32, n_head=4, n_layer=4,
            micro_batch_size=2, check=True)


@dataclass(frozen=True)
class Case:
    """One layout of the matrix. refused: the layout rules must refuse it (a decision
    documented in minipar/train/build.py), and the check is that they do."""

    name: str
    settings: dict
    refused: bool = False

    def config(self, **overrides) -> TrainConfig:
        return TrainConfig(**{**BASE, **self.settings, **overrides})


GRID = [
    Case("dp2", dict(dp=2, grad_accum_steps=2)),
    Case("dp4 zero1", dict(dp=4, zero=1)),
    Case("dp4 zero2 accum2", dict(dp=4, zero=2, grad_accum_steps=2)),
    Case("dp3 zero3 (padded shards)", dict(dp=3, zero=3)),
    Case("tp2", dict(tp=2, grad_accum_steps=2)),
    Case("tp4 sequence-parallel", dict(tp=4, sequence_parallel=True)),
    Case("pp2 gpipe", dict(pp=2, schedule="gpipe", grad_accum_steps=4)),
    Case("pp4 1f1b", dict(pp=4, grad_accum_steps=4)),
    Case("pp2 interleaved v2 untied", dict(pp=2, schedule="interleaved", virtual_stages=2,
                                           grad_accum_steps=4, tie_embeddings=False)),
    Case("dp2 tp2 zero3 sp checkpointing", dict(dp=2, tp=2, zero=3, sequence_parallel=True,
                                                recompute_granularity="full")),
    Case("tp2 pp2 sp 1f1b", dict(tp=2, pp=2, sequence_parallel=True, grad_accum_steps=4)),
    Case("dp2 pp2 zero1 checkpointing buckets",
         dict(dp=2, pp=2, zero=1, grad_accum_steps=2, recompute_granularity="full",
              bucket_size_mb=0.01)),
    Case("tp2 pp2 sp selective recompute", dict(tp=2, pp=2, sequence_parallel=True,
                                                grad_accum_steps=4,
                                                recompute_granularity="selective")),
    Case("dp2 pp2 zero1 interleaved, recompute block 1",
         dict(dp=2, pp=2, zero=1, schedule="interleaved", virtual_stages=2,
              grad_accum_steps=4, recompute_granularity="full", recompute_method="block",
              recompute_num_layers=1)),
    Case("dp2 tp2 pp2 zero1 (8 ranks)", dict(dp=2, tp=2, pp=2, zero=1, grad_accum_steps=4)),
    Case("dp3 tp1 pp2 zero1 (odd, 6 ranks)", dict(dp=3, pp=2, zero=1, grad_accum_steps=2)),
    Case("dp2 tp2 pp2 interleaved, TP across nodes",
         dict(dp=2, tp=2, pp=2, schedule="interleaved", virtual_stages=2,
              grad_accum_steps=4, gpus_per_node=1)),
    Case("pp2 zb-h1", dict(pp=2, schedule="zb-h1", grad_accum_steps=4)),
    Case("pp4 zb-h2", dict(pp=4, schedule="zb-h2", grad_accum_steps=7)),
    Case("pp2 zb-v (first and last stage on rank 0)",
         dict(pp=2, schedule="zb-v", virtual_stages=2, grad_accum_steps=4)),
    Case("pp2 dualpipe-v", dict(pp=2, schedule="dualpipe-v", virtual_stages=2,
                                grad_accum_steps=4)),
    Case("dp2 pp2 zb-h1 zero1", dict(dp=2, pp=2, zero=1, schedule="zb-h1",
                                     grad_accum_steps=2)),
    Case("dp2 pp2 zb-v zero1 (one wte for two chunks, buckets reduced in W)",
         dict(dp=2, pp=2, zero=1, schedule="zb-v", virtual_stages=2, grad_accum_steps=4)),
    Case("tp2 pp2 zb-v", dict(tp=2, pp=2, schedule="zb-v", virtual_stages=2,
                              grad_accum_steps=4)),
    Case("dp2 tp2 pp2 dualpipe-v zero1 (8 ranks)",
         dict(dp=2, tp=2, pp=2, zero=1, schedule="dualpipe-v", virtual_stages=2,
              grad_accum_steps=4)),
    Case("cp2 load-balanced", dict(cp=2)),
    Case("cp4 without load balancing", dict(cp=4, cp_load_balance=False)),
    Case("cp2 tp2 sp", dict(cp=2, tp=2, sequence_parallel=True)),
    Case("dp2 cp2 pp2 zero1", dict(dp=2, cp=2, pp=2, zero=1, grad_accum_steps=2)),
    Case("cp3 (16 tokens do not cut into 6 chunks)", dict(cp=3), refused=True),
    # ZeRO-Offload / ZeRO-Infinity: the same numbers with the state in another tier
    Case("dp2 zero2 offload cpu accum2", dict(dp=2, zero=2, offload_optimizer="cpu",
                                              grad_accum_steps=2)),
    Case("dp2 tp2 zero3 offload nvme, params cpu",
         dict(dp=2, tp=2, zero=3, offload_optimizer="nvme", offload_param="cpu")),
    Case("dp2 pp2 zero1 offload cpu", dict(dp=2, pp=2, zero=1, offload_optimizer="cpu",
                                           grad_accum_steps=2)),
    Case("moe E4 top2 dp4 ep2 zero1", dict(dp=4, ep=2, zero=1, moe_num_experts=4,
                                           moe_capacity_factor=1.25, grad_accum_steps=2)),
    Case("moe E4 top1 dp4 ep4, every 2nd block", dict(dp=4, ep=4, moe_num_experts=4,
                                                      moe_top_k=1, moe_layer_freq=2)),
    Case("moe E4 dp2 ep2 tp2 sp", dict(dp=2, tp=2, ep=2, moe_num_experts=4,
                                       sequence_parallel=True)),
    Case("moe E4 dp2 ep2 pp2 zero1 1f1b", dict(dp=2, pp=2, ep=2, zero=1, moe_num_experts=4,
                                               grad_accum_steps=2)),
    Case("moe cp2 (routing over a split sequence: not built)",
         dict(cp=2, moe_num_experts=4), refused=True),
    Case("moe dp2 zero2 (experts' ZeRO-2 buckets: not built)",
         dict(dp=2, zero=2, moe_num_experts=4), refused=True),
    # ZeRO-3 across nodes (2 nodes): hybrid sharding, FSDP2's reshard choice, ZeRO++
    Case("dp8 zero3 hsdp4 accum2 (HSDP / MiCS, 2 nodes)",
         dict(dp=8, zero=3, hsdp_shard_size=4, gpus_per_node=4, grad_accum_steps=2)),
    Case("dp4 tp2 zero3 reshard_after_forward false", dict(dp=4, tp=2, zero=3,
                                                           reshard_after_forward=False)),
    Case("dp8 zero3 hsdp4 reshard_after_forward 2",
         dict(dp=8, zero=3, hsdp_shard_size=4, reshard_after_forward=2, gpus_per_node=4)),
    Case("dp8 zero3 hpz4 accum2 (ZeRO++ hpZ, 2 nodes)",
         dict(dp=8, zero=3, zero_hpz_partition_size=4, gpus_per_node=4, grad_accum_steps=2)),
    Case("dp4 zero3 qwZ (int8 weights: quantisation tolerance)",
         dict(dp=4, zero=3, zero_quantized_weights=True, gpus_per_node=2)),
    Case("dp8 zero3 qgZ (int4 gradients, 2 nodes: quantisation tolerance)",
         dict(dp=8, zero=3, zero_quantized_gradients=True, gpus_per_node=4)),
    Case("dp8 zero3 hpz4 + qwZ + qgZ (ZeRO++: quantisation tolerance)",
         dict(dp=8, zero=3, zero_hpz_partition_size=4, zero_quantized_weights=True,
              zero_quantized_gradients=True, gpus_per_node=4)),
    Case("dp4 tp2 zero3 qgZ (the TP replicas would drift)",
         dict(dp=4, tp=2, zero=3, zero_quantized_gradients=True, gpus_per_node=4),
         refused=True),
    Case("dp8 zero3 hsdp4 + qgZ (MiCS and ZeRO++ apart: not built)",
         dict(dp=8, zero=3, hsdp_shard_size=4, zero_quantized_gradients=True),
         refused=True),
    Case("dp2 pp2 zero2 (DeepSpeed refuses)", dict(dp=2, pp=2, zero=2, grad_accum_steps=2),
         refused=True),
    Case("dp2 pp2 zero3 (DeepSpeed refuses)", dict(dp=2, pp=2, zero=3, grad_accum_steps=2),
         refused=True),
]
# The cases `tests/train/test_grid.py` runs (the rest is `minipar check`'s job).
REPRESENTATIVE = ("dp2 tp2 pp2 zero1 (8 ranks)", "dp3 tp1 pp2 zero1 (odd, 6 ranks)",
                  "dp2 pp2 zero2 (DeepSpeed refuses)")


@dataclass
class GridResult:
    """The outcome of one case: passed (equivalent, or refused as expected)."""

    case: Case
    world_size: int
    equivalence: dict | None = None
    refusal: str | None = None  # the layout rules' message, when refused
    warnings: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        if self.refusal is not None:
            return self.case.refused
        return not self.case.refused and bool(self.equivalence["passed"])


def run_case(case: Case, references: dict | None = None, **overrides) -> GridResult:
    """Train one case with its check; `references` keeps the reference runs for the
    cases after it (`train`'s `references`). A refused layout is refused before its
    reference trains."""
    try:  # refused by the settings' own rules (the config) or by the trainer's mixes
        config = case.config(**overrides)
        report = train(config, references=references)
    except ConfigError as err:
        world = math.prod(case.settings.get(axis, 1) for axis in ("dp", "tp", "pp", "cp"))
        return GridResult(case, world, refusal=str(err))
    return GridResult(case, config.world_size, report.equivalence,
                      warnings=tuple(report.warnings))


def run_grid(cases=GRID, progress=None, **overrides) -> list[GridResult]:
    """Run `cases` (default: all of GRID); progress(result) after each."""
    references: dict = {}
    results = []
    for case in cases:
        result = run_case(case, references, **overrides)
        results.append(result)
        if progress is not None:
            progress(result)
    return results
