"""The planner's A100 against MosaicML's A100-80GB MPT runs, which nothing was fitted on.

    python benchmarks/mpt_a100.py

Source: mosaicml/llm-foundry, scripts/train/benchmarking/README.md at commit 061f2c7c,
"A100 80GB with 1600 Gbps node-node interconnect (RoCE)": the same sweep as the H100
rows `minipar plan --compare-published --source mpt` holds the planner to (same models,
same FSDP FULL_SHARD layout, `attn_impl: triton`, the README's own FLOP count), on
A100-80GB: all its rows of the sizes minipar.plan.published_mpt encodes (125M and 350M
have 64-wide heads, which its d_head-128 shapes cannot express). The two 70B rows come
from another sweep (precision `bf16`, MP mode `PURE`: bf16 parameters and gradients, where
the others run `amp_bf16` / `DEFAULT`); they are planned like the rest, as bf16 gradient
buffers move them by under 0.1 point. Their "Model TFLOP" column is 100 x MFU x peak (the
percentage not divided); the script reads MFU.

Each row is planned as minipar.plan.published_mpt plans the H100 ones, on the
`a100-80gb` preset. The A100 has no stored measurement of a fused attention kernel, so
attention is priced as one GEMM at the roofline's GEMM efficiency: where attention is a
large share of the step (long sequences, small models) the plan reads fast. Printed: each
row's published and planned TFLOP/s per GPU (MFU x 312), the error, and how many rows
are within 10% (docs/planner.md quotes the result).
"""

from __future__ import annotations

import sys

from minipar.plan import presets
from minipar.plan.estimate import estimate
from minipar.plan.published_mpt import mpt_config, mpt_flops, mpt_shape

A100_PEAK = 312e12
# (model, seq len, GPUs, micro-batch, global batch, activation checkpointing, MFU %,
#  NumParams): the README's A100-80GB rows in its order
ROWS = (
    ("70b", 2048, 64, 8, 2048, True, 53.33, 64862437376),
    ("70b", 2048, 32, 2, 1024, True, 48.56, 64862437376),
    ("30b", 8192, 8, 1, 168, True, 39.38, 30019254272),
    ("30b", 4096, 8, 1, 168, True, 51.37, 29989894144),
    ("30b", 2048, 8, 3, 504, True, 55.3, 29975214080),
    ("30b", 1024, 8, 6, 1008, True, 55.82, 29967874048),
    ("30b", 512, 8, 12, 2016, True, 56.4, 29964204032),
    ("13b", 32768, 8, 1, 24, True, 51.69, 13011240960),
    ("13b", 16384, 8, 3, 72, True, 54.07, 12927354880),
    ("13b", 8192, 8, 5, 120, True, 56.07, 12885411840),
    ("13b", 4096, 8, 10, 240, True, 57.62, 12864440320),
    ("13b", 2048, 8, 2, 48, False, 59.57, 12853954560),
    ("13b", 1024, 8, 40, 960, True, 59.48, 12848711680),
    ("7b", 65536, 8, 1, 16, True, 46.97, 6918905856),
    ("7b", 32768, 8, 2, 32, True, 49.46, 6784688128),
    ("7b", 16384, 8, 4, 64, True, 51.96, 6717579264),
    ("7b", 8192, 8, 8, 128, True, 54.47, 6684024832),
    ("7b", 4096, 8, 16, 256, True, 54.84, 6667247616),
    ("7b", 2048, 8, 6, 96, False, 64.23, 6658859008),
    ("7b", 1024, 8, 64, 1024, True, 58.01, 6654664704),
    ("3b", 65536, 8, 1, 16, True, 46.05, 2814366720),
    ("3b", 32768, 8, 3, 144, True, 47.18, 2730480640),
    ("3b", 16384, 8, 1, 48, False, 57.13, 2688537600),
    ("3b", 8192, 8, 3, 144, False, 59.34, 2667566080),
    ("3b", 4096, 8, 5, 240, False, 60.53, 2657080320),
    ("3b", 2048, 8, 10, 160, False, 62.11, 2651837440),
    ("3b", 1024, 8, 20, 960, False, 62.73, 2649216000),
    ("3b", 512, 8, 40, 1920, False, 63.71, 2647905280),
    ("1b", 65536, 8, 1, 16, True, 46.18, 1445974016),
    ("1b", 32768, 8, 1, 32, False, 55.52, 1378865152),
    ("1b", 16384, 8, 2, 64, False, 56.6, 1345310720),
    ("1b", 8192, 8, 3, 96, False, 56.69, 1328533504),
    ("1b", 4096, 8, 7, 224, False, 59.0, 1320144896),
    ("1b", 2048, 8, 14, 448, False, 59.86, 1315950592),
    ("1b", 1024, 8, 18, 576, False, 60.15, 1313853440),
    ("1b", 512, 8, 56, 1792, False, 60.68, 1312804864),
    ("760m", 65536, 8, 1, 16, True, 45.34, 857988096),
    ("760m", 32768, 8, 1, 16, False, 54.57, 807656448),
    ("760m", 16384, 8, 3, 48, False, 54.64, 782490624),
    ("760m", 8192, 8, 6, 96, False, 55.31, 769907712),
    ("760m", 4096, 8, 12, 192, False, 56.05, 763616256),
    ("760m", 2048, 8, 24, 384, False, 56.85, 760470528),
    ("760m", 1024, 8, 48, 768, False, 47.76, 758897664),
    ("760m", 512, 8, 96, 1536, False, 45.07, 758111232),
)


def main() -> int:
    a100 = presets.cluster("a100-80gb")
    print(f"{'model':>5} {'seq':>6} {'GPUs':>4} {'micro':>5} {'ckpt':>5}  "
          f"{'published':>9} {'planned':>8} {'error':>7}")
    errors = []
    for size, seq, gpus, micro, batch, checkpointing, mfu, n_params in ROWS:
        shape = mpt_shape(size, seq)
        if shape.n_params != n_params:  # the shape is the run's model, parameter for parameter
            raise SystemExit(f"{size} at {seq}: {shape.n_params} parameters, the README "
                             f"says {n_params}")
        step = estimate(shape, mpt_config(gpus, micro, batch, checkpointing), a100).step_time
        planned = mpt_flops(shape, batch) / step / gpus
        published = mfu / 100 * A100_PEAK
        errors.append(planned / published - 1)
        print(f"{size:>5} {seq:>6} {gpus:>4} {micro:>5} {checkpointing!s:>5}  "
              f"{published / 1e12:9.1f} {planned / 1e12:8.1f} {errors[-1]:+7.1%}")
    within = sum(abs(e) <= 0.10 for e in errors)
    print(f"\n{within} of {len(errors)} rows within 10% (attention priced as one GEMM on "
          f"the A100)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
