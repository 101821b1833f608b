"""Machine instructions per forward+backward of a tiny GPT on a Device: the per-op cost
of autograd dispatch and bookkeeping (ledger, clock, FLOP booking), counted, not timed.

    python benchmarks/op_instructions.py                 # this tree, ~25 s
    python benchmarks/op_instructions.py /path/to/tree   # another tree's `minipar/`

On a shared 2-core machine a wall or CPU time of a 40 ms run moves by 10-30% with the
load; the instructions valgrind counts (`cachegrind`, no cache simulation) move by less
than 0.01%, so a 1% change of the Python each op runs shows. The model is 4 layers of
d_model 8 on 4 tokens, so NumPy's own work is small and the count is mostly minipar's
Python; each step gets a fresh Device, so the ledger's peaks rise again as in a run's
first step. Counted: the instructions of 25 steps minus those of 5, over 20 (start-up
cancels). OpenBLAS is kept to one thread (its idle workers spin) and hashing is seeded.
Skips with a message when valgrind is not installed.
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


def instructions(tree: pathlib.Path, n: int) -> int:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no",
                          "--cachegrind-out-file=/dev/null", sys.executable, __file__,
                          "--steps", str(n)], env=env, capture_output=True, text=True,
                         check=True).stderr
    return int(re.search(r"I\s+refs:\s+([\d,]+)", out).group(1).replace(",", ""))


def main() -> None:
    if sys.argv[1:2] == ["--steps"]:
        steps(int(sys.argv[2]))
        return
    if shutil.which("valgrind") is None:
        print("skipped: valgrind is not installed (apt-get install valgrind)")
        return
    tree = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parents[1])
    per_step = (instructions(tree, 25) - instructions(tree, 5)) / 20
    print(f"{tree}: {per_step / 1e6:.2f}M instructions per forward+backward step")


if __name__ == "__main__":
    main()
