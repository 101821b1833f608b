"""Fit the roofline's two efficiencies on Narayanan et al. 2021, Table 1 (A100) and on the
fitted H100 runs of minipar/plan/published_h100.py; print residuals, held-out rows apart
(published_mpt.py's other half and published_dgxc.py's rows, none fitted).

    python benchmarks/fit_time_model.py          # ~1-2 min on a busy laptop core

The planner's A100 time model (minipar.distributed.roofline) has two constants that no
datasheet gives: the fraction of tensor-core peak a large GEMM sustains
(`gemm_efficiency`) and the fraction of HBM bandwidth a streaming kernel sustains
(`memory_efficiency`). Everything else is a datasheet figure (peak, HBM bandwidth, SMs,
links) or a setting of the published runs (minipar.plan.published). This script fits the
two on the ten rows by least squares on log(predicted / published) TFLOP/s, a coarse grid
then a finer one around its best point, and prints the fit, the residual of every row and
how much each constant moves the worst row. The A100 constants in roofline.py are the
ones it prints (rounded to 0.01). The H100's lie in the flat valley its five fitted runs
leave (rms log error 0.057 there, 0.0506 at the grid's best point, 0.68 and 0.325;
docs/planner.md) and are kept, since `minipar train --device h100` shares them. The
H100's overlap contention (minipar.plan.timing.overlap_contention_seconds,
presets.H100_OVERLAP_CONTENTION) is then fitted on every fitted H100 row: the README's
five and every second MPT row. Last, the H100's one FP8 constant, the fraction of the FP8
peak its layers' FP8 GEMMs sustain (roofline.H100_FP8_GEMM_EFFICIENCY), on the FP8 runs of
DGX Cloud Benchmarking v24.11.1, the bf16 constants kept; the later releases' FP8 runs
are held out.
tests/plan/test_published.py and test_published_mpt.py guard the residuals.
"""

from __future__ import annotations

import math
from dataclasses import replace

from arguments import parse_no_flags

from minipar.distributed.roofline import (
    GEMM_EFFICIENCY,
    H100_FP8_GEMM_EFFICIENCY,
    H100_GEMM_EFFICIENCY,
    H100_MEMORY_EFFICIENCY,
    MEMORY_EFFICIENCY,
)
from minipar.plan import presets, published_dgxc, published_h100, published_mpt
from minipar.plan.published import TOLERANCE, compare, format_comparison

if __name__ == "__main__":
    parse_no_flags(__doc__)  # --help says what it measures; no flags to mistype


def cluster_with(gemm: float, memory: float, gpu: str = "a100-80gb"):
    base = presets.cluster(gpu)
    return replace(base, roofline=base.roofline.replace(gemm_efficiency=gemm,
                                                        memory_efficiency=memory))


def loss(rows: list[dict]) -> float:
    """Root mean square of log(predicted / published)."""
    return math.sqrt(sum(math.log(r["tflops"] / r["published"]) ** 2 for r in rows)
                     / len(rows))


def grid(gemms, memories) -> tuple[float, float, float]:
    best = None
    for g in gemms:
        for m in memories:
            value = loss(compare(cluster_with(g, m)))
            if best is None or value < best[0]:
                best = (value, g, m)
    return best


def h100() -> None:
    """The H100's two efficiencies, fitted on the FITTED rows of published_h100.RUNS
    only (the others are held out), then its overlap contention on every fitted H100
    row (the README's and MosaicML's), then every row's residual."""
    fitted = [run for run in published_h100.RUNS if run.fitted]

    def h100_loss(g, m):
        return loss(published_h100.compare(cluster_with(g, m, "h100-80gb"), fitted))

    best = min((h100_loss(g, m), g, m) for g in (0.62, 0.64, 0.66, 0.68, 0.70, 0.72)
               for m in (0.3, 0.35, 0.4, 0.45, 0.5, 0.55))
    _, g, m = best
    best = min((h100_loss(gg, mm), gg, mm) for gg in (g - 0.01, g, g + 0.01)
               for mm in (m - 0.025, m, m + 0.025))
    print(f"\nH100 fit on {len(fitted)} runs: gemm_efficiency {best[1]:.2f}, "
          f"memory_efficiency {best[2]:.3f}, rms log error {best[0]:.4f}")
    print(f"in roofline.py: {H100_GEMM_EFFICIENCY}, {H100_MEMORY_EFFICIENCY}")
    every_fitted = [run for run in (*published_h100.RUNS, *published_mpt.RUNS) if run.fitted]
    base = presets.cluster("h100-80gb")

    def contention_loss(k):
        return loss(published_h100.compare(replace(base, overlap_contention=k), every_fitted))

    contention = min((contention_loss(k), k) for k in [i / 20 for i in range(0, 31)])
    contention = min((contention_loss(k), k) for k in
                     [max(0.0, contention[1] + i / 100) for i in range(-4, 5)])
    print(f"overlap contention fitted on {len(every_fitted)} runs: {contention[1]:.2f} "
          f"(rms log error {contention[0]:.4f}); in presets.py: "
          f"{presets.H100_OVERLAP_CONTENTION}\n")
    # every row, the held-out ones apart (NVIDIA's DGX Cloud Benchmarking runs: all held out)
    print(published_h100.format_comparison(
        published_h100.compare() + published_h100.compare(runs=published_mpt.RUNS)
        + published_h100.compare(runs=published_dgxc.RUNS)))


def fp8() -> None:
    """The H100's FP8 GEMM efficiency (roofline.fp8_gemm_efficiency), fitted on the FITTED
    FP8 rows (DGX Cloud Benchmarking v24.11.1's), the bf16 constants kept, then every
    FP8 row, the later releases' held out."""
    runs = published_dgxc.FP8_RUNS
    fitted = [run for run in runs if run.fitted]
    base = presets.cluster("h100-80gb")

    def fp8_loss(efficiency):
        cluster = replace(base, roofline=base.roofline.replace(
            fp8_gemm_efficiency=efficiency))
        return loss(published_h100.compare(cluster, fitted))

    best = min((fp8_loss(e / 100), e / 100) for e in range(50, 81, 2))
    best = min((fp8_loss(best[1] + d / 100), best[1] + d / 100) for d in range(-2, 3))
    print(f"FP8 GEMM efficiency fitted on {len(fitted)} runs: {best[1]:.2f} (rms log error "
          f"{best[0]:.4f}); in roofline.py: {H100_FP8_GEMM_EFFICIENCY}\n")
    print(published_h100.format_comparison(published_h100.compare(runs=runs)))


def main() -> None:
    value, g, m = grid([0.60, 0.65, 0.70, 0.75, 0.80], [0.6, 0.7, 0.8, 0.9, 1.0])
    print(f"coarse grid: gemm_efficiency {g:.2f}, memory_efficiency {m:.2f}, "
          f"rms log error {value:.4f}")
    value, g, m = grid([g - 0.02, g - 0.01, g, g + 0.01, g + 0.02],
                       [min(1.0, m + d) for d in (-0.1, -0.05, -0.025, 0.0, 0.025, 0.05)])
    print(f"fine grid:   gemm_efficiency {g:.2f}, memory_efficiency {m:.3f}, "
          f"rms log error {value:.4f}")
    print(f"in roofline.py: gemm_efficiency {GEMM_EFFICIENCY}, memory_efficiency "
          f"{MEMORY_EFFICIENCY}\n")
    cluster = cluster_with(GEMM_EFFICIENCY, MEMORY_EFFICIENCY)
    rows = compare(cluster)
    print(format_comparison(rows, cluster))
    print(f"\nrms log error {loss(rows):.4f}; rows within {TOLERANCE:.0%}: "
          f"{sum(abs(r['error']) <= TOLERANCE for r in rows)} of {len(rows)}")
    # Sensitivity: how much the worst row moves with each constant (+0.05).
    worst = max(range(len(rows)), key=lambda i: abs(rows[i]["error"]))
    for name, cluster in (("gemm_efficiency + 0.05",
                           cluster_with(GEMM_EFFICIENCY + 0.05, MEMORY_EFFICIENCY)),
                          ("memory_efficiency + 0.05",
                           cluster_with(GEMM_EFFICIENCY, min(1.0, MEMORY_EFFICIENCY + 0.05)))):
        moved = compare(cluster)[worst]
        print(f"{name}: {rows[worst]['model']} {rows[worst]['tflops']:.1f} -> "
              f"{moved['tflops']:.1f} TFLOP/s")
    h100()
    fp8()


if __name__ == "__main__":
    main()
