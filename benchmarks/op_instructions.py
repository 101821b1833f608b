"""Machine instructions per forward+backward of a tiny GPT on a Device: the per-op cost
of autograd dispatch and bookkeeping (ledger, clock, FLOP booking), counted, not timed.

    python benchmarks/op_instructions.py                 # this tree, ~25 s
    python benchmarks/op_instructions.py /path/to/tree   # another tree's `minipar/`
    python benchmarks/op_instructions.py --case tp-step [tree]      # ~30 s, see below
    python benchmarks/op_instructions.py --case all-reduce [tree]   # ~30 s

On a shared 2-core machine a wall or CPU time of a 40 ms run moves by 10-30% with the
load; the instructions valgrind counts (`cachegrind`, no cache simulation) move by less
than 0.01%, so a 1% change of the Python each op runs shows. The model is 4 layers of
d_model 8 on 4 tokens, so NumPy's own work is small and the count is mostly minipar's
Python; each step gets a fresh Device, so the ledger's peaks rise again as in a run's
first step. Counted: the instructions of 25 steps minus those of 5, over 20 (start-up
cancels). OpenBLAS is kept to one thread (its idle workers spin) and hashing is seeded.
Skips with a message when valgrind is not installed.

`--case tp-step` counts a multi-rank training step instead: `train()` of the same tiny
model on dp 2 x tp 2 ranks with 2 micro-batches (TP's f and g all-reduces, the
vocab-parallel embedding and cross-entropy, the DP gradient buckets, the optimizer step):
the collectives' own cost (call checks, rendezvous, turns, ledger and clock booking, the
TP mapping Functions) next to the ops'. Instructions of a 12-step run minus a 2-step one,
over 10. Valgrind runs one thread at a time, like the turns, but ~50x slower, so the
turns' patience is raised for the count (a rank's compute would outlast it and change who
runs when); the count moves by ~0.1% between runs.

`--case all-reduce`: 4 ranks calling all_reduce on a small array in a loop (1000 calls
minus 200, over 800 x 4): one collective's cost to a rank, from the call to its return.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys


def steps(n: int) -> None:
    """n forward+backward steps of the tiny GPT, each on a fresh Device."""
    import gc

    import numpy as np

    from minipar.autograd.tracking import use_device
    from minipar.distributed.device import Device
    from minipar.nn.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_head=2, n_layer=4)
    model = GPT(config, precision="fp32")
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, config.vocab_size, (1, 4)) for _ in range(2))
    seed = np.asarray(1.0, dtype=np.float32)
    gc.collect()
    gc.disable()  # a collection's cost depends on what else was allocated
    for _ in range(n):
        with use_device(Device(0, 1)):
            model(x, y).backward(seed)
        for p in model.parameters():
            p.grad = None


def tp_steps(n: int) -> None:
    """One training run of n steps of the tiny GPT on dp 2 x tp 2 ranks."""
    import gc

    from minipar.distributed import turns
    from minipar.train import train

    turns.PATIENCE_S = 60.0  # valgrind is ~50x slower (module docstring)
    gc.collect()
    gc.disable()
    train(seq_len=4, d_model=8, n_head=2, n_layer=4, dp=2, tp=2,
          micro_batch_size=1, grad_accum_steps=2, steps=n, precision="fp32")


def all_reduces(n: int) -> None:
    """4 ranks, each calling all_reduce n times on a (4, 4, 8) float32 array (a TP
    activation's shape in miniature): what one collective costs a rank, call to return."""
    import gc

    import numpy as np

    from minipar import distributed as dist
    from minipar.distributed import turns

    def worker():
        x = np.ones((4, 4, 8), np.float32)
        for _ in range(n):
            dist.all_reduce(x)

    turns.PATIENCE_S = 60.0
    gc.collect()
    gc.disable()
    dist.launch(worker, 4)


# case: (run, calls in the long run, in the short one, what one unit is, units per call)
CASES = {"op": (steps, 25, 5, "forward+backward step", 1),
         "tp-step": (tp_steps, 12, 2, "dp2 tp2 training step (2 micro-batches, 4 ranks)", 1),
         "all-reduce": (all_reduces, 1000, 200, "all_reduce call per rank (4 ranks)", 4)}


def instructions(tree: pathlib.Path, case: str, n: int) -> int:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no",
                          "--cachegrind-out-file=/dev/null", sys.executable, __file__,
                          "--steps", case, str(n)], env=env, capture_output=True, text=True,
                         check=True).stderr
    return int(re.search(r"I\s+refs:\s+([\d,]+)", out).group(1).replace(",", ""))


def main() -> None:
    args = sys.argv[1:]
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if args[:1] == ["--steps"]:  # (the inner call, under valgrind)
        CASES[args[1]][0](int(args[2]))
        return
    case = "op"
    if args[:1] == ["--case"]:
        case, args = args[1], args[2:]
        if case not in CASES:
            sys.exit(f"--case: one of {', '.join(CASES)}, got {case!r}")
    if shutil.which("valgrind") is None:
        print("skipped: valgrind is not installed (apt-get install valgrind)")
        return
    if len(args) > 1 or (args and args[0].startswith("-")):
        sys.exit(f"op_instructions.py: error: unrecognized arguments: {' '.join(args)} "
                 "(see --help)")
    tree = pathlib.Path(args[0] if args else pathlib.Path(__file__).parents[1])
    if not (tree / "minipar").is_dir():
        sys.exit(f"op_instructions.py: error: {tree} has no minipar/ to count")
    _, many, few, what, units = CASES[case]
    per_unit = ((instructions(tree, case, many) - instructions(tree, case, few))
                / ((many - few) * units))
    count = f"{per_unit / 1e6:.2f}M" if per_unit >= 1e6 else f"{per_unit / 1e3:.1f}k"
    print(f"{tree}: {count} instructions per {what}")


if __name__ == "__main__":
    main()
