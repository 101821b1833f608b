"""Learning-rate scaling with the batch, done properly: the best learning rate of AdamW
and of SGD at a batch of B and of 4B sequences, on the same data budget, and the
loss-sum-versus-mean accumulation bug (5-15 min per run on 2 busy cores; writes JSON).

    cd benchmarks && export OMP_NUM_THREADS=1
    python lr_scaling.py --data synthetic --vocab 128 --batch 1 --steps 2400 --seeds 2 \
        --out lr_scaling_markov_b1.json     # a small batch: where the rules part
    python lr_scaling.py --data synthetic --vocab 128 --batch 4 --steps 1200 --seeds 2 \
        --out lr_scaling_markov_b4.json
    python lr_scaling.py --out lr_scaling_corpus_b8.json      # the corpus, B = 8, 3 seeds
    python lr_scaling.py --quick                              # a smoke run, nothing written
    python lr_scaling.py --refit lr_scaling_corpus_b8.json    # the optima again, from the losses

Notebook 02 reads the three JSON files and draws them. One device, fp32, minipar's GPT-2
(2 layers, h = 64, sequences of 32 tokens: characters of the built-in corpus, or the
synthetic Markov task of 128 tokens, 3 likely successors each, whose loss floor is
ln 3 = 1.10), trained in this script's own loop so that SGD and the accumulation bug can
be run (the trainer has AdamW only, and averages correctly). What "properly" means here:
- the same data budget: B x STEPS sequences, so 4B trains a quarter of B's steps;
- the large batch by gradient accumulation: 4 micro-batches of B, each loss divided by 4
  (the mean over the batch, what DDP and minipar compute);
- the schedule matched in sequences, not steps: linear warm-up over the first 10% of the
  budget and cosine decay to lr/10 at its end, for both batches;
- a grid of learning rates wide enough to hold each optimum (a quarter decade apart; an
  optimum at an end of the grid is refused), two or three seeds each, the loss measured
  at the end on the same 16 batches of 16 sequences for every run (windows of the same
  stream the runs train on: a training loss, what the scaling rules are about; the
  corpus's 50k characters are seen ~3 times by then); the optimum is the vertex of a
  parabola (in log lr) through the best grid point and its neighbour on each side
  (`best_lr`), and through two on each side (`best_lr_wide`): where the loss is flat
  near its minimum the two differ, and the notebook shows both.
The sqrt rule (Adam: Malladi et al. 2022, Hoffer et al. 2017) predicts the best lr of 4B
at 2x B's, the linear rule (SGD: Goyal et al. 2017) at 4x.

The bug: summing the 4 micro-batches' losses instead of averaging makes the gradient 4x.
SGD's step is then 4x (it trains at 4x the lr it was given); AdamW divides the gradient by
its own running scale, so its step hardly changes. No gradient clipping anywhere: a
clip at norm 1 would hide part of the bug for SGD.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import numpy as np
from arguments import positive_int
from threadpoolctl import threadpool_limits

from minipar.autograd.grad_mode import no_grad
from minipar.nn import GPT, GPTConfig
from minipar.nn.optim import AdamW, lr_schedule
from minipar.train.data import make_stream

OUT = pathlib.Path(__file__).with_name("lr_scaling_corpus_b8.json")
B, K, SEQ = 8, 4, 32  # B: the small batch (and the micro-batch), K: the large batch's factor
STEPS = 600  # the small batch's steps: the budget is B x STEPS sequences
GRIDS = {"adamw": [10 ** e for e in np.arange(-3.25, -0.99, 0.25)],
         "sgd": [10 ** e for e in np.arange(-2.5, 0.76, 0.25)]}
SEEDS = (0, 1, 2)


class SGD:
    """SGD with momentum 0.9 (the linear scaling rule's setting, Goyal et al. 2017)."""

    def __init__(self, params, lr: float, momentum: float = 0.9):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.buffers = [np.zeros_like(p.data) for p in self.params]

    def step(self) -> None:
        for p, buffer in zip(self.params, self.buffers, strict=True):
            buffer *= self.momentum
            buffer += p.grad
            p.data -= self.lr * buffer


def train_once(optimizer: str, lr: float, batch: int, seed: int, *, budget: int,
               micro: int = B, data: str = "corpus", vocab: int | None = None,
               summed: bool = False) -> dict:
    """Train with `batch` sequences per step (micro-batches of `micro`, accumulated),
    `budget` sequences in all; the loss at the end (on the same batches for every run),
    and the first step's update norm."""
    stream = make_stream(data, vocab)
    config = GPTConfig(vocab_size=stream.vocab_size, seq_len=SEQ, n_layer=2, n_head=4,
                       d_model=64)
    model = GPT(config, seed, "fp32")
    params = list(model.parameters())
    opt = (AdamW(params, lr=lr, weight_decay=0.0) if optimizer == "adamw"
           else SGD(params, lr=lr))
    steps, accum = budget // batch, batch // micro
    warmup = max(1, steps // 10)
    first_update = None
    for step in range(steps):
        opt.lr = lr_schedule(step, lr=lr, warmup_steps=warmup, total_steps=steps,
                             min_lr=lr / 10)
        x, y = stream.global_batch(step, batch, SEQ, 1000 + seed)
        for p in params:
            p.grad = None
        for k in range(accum):
            loss = model(x[k * micro:(k + 1) * micro], y[k * micro:(k + 1) * micro])
            (loss if summed else loss * (1.0 / accum)).backward()
        before = [p.data.copy() for p in params] if step == 0 else None
        opt.step()
        if before is not None:
            first_update = math.sqrt(sum(float(((p.data - b) ** 2).sum())
                                         for p, b in zip(params, before, strict=True)))
        if not math.isfinite(float(loss.data)):
            return {"loss": math.inf, "first_update": first_update}
    with no_grad():
        held_out = [float(model(*stream.global_batch(10**6 + i, 16, SEQ, 7)).data)
                    for i in range(16)]
    return {"loss": float(np.mean(held_out)), "first_update": first_update}


def optimum(lrs: list[float], losses: list[float], strict: bool = True,
            neighbours: int = 1) -> float:
    """The lr at the vertex of the parabola through the best point and `neighbours` grid
    points on each side (log lr; diverged runs left out). An optimum at an end of the grid
    is no measurement: refused (`strict`), or that end (a smoke run's sparse grid)."""
    i = int(np.argmin(losses))
    if i in (0, len(lrs) - 1):
        if not strict:
            return lrs[i]
        raise SystemExit(f"the best lr {lrs[i]:.3g} is at an end of the grid "
                         f"{lrs[0]:.3g} .. {lrs[-1]:.3g}: widen GRIDS")
    window = slice(max(0, i - neighbours), i + neighbours + 1)
    x, y = np.log10(lrs[window]), np.asarray(losses[window])
    a, b, _ = np.polyfit(x[np.isfinite(y)], y[np.isfinite(y)], 2)
    return float(10 ** (-b / (2 * a))) if a > 0 else lrs[i]


def fit_optima(results: dict, strict: bool = True) -> None:
    """Each curve's optimum by both fits, and the ratio of the large batch's to the small
    batch's, written into `results`."""
    small, large = results["B"], results["K"] * results["B"]
    for optimizer in GRIDS:
        for batch in (small, large):
            run = results["runs"][f"{optimizer} {batch}"]
            run["best_lr"] = optimum(run["lrs"], run["losses"], strict)
            run["best_lr_wide"] = optimum(run["lrs"], run["losses"], strict, neighbours=2)
        for key, suffix in (("best_lr", "ratio"), ("best_lr_wide", "ratio wide")):
            lo, hi = (results["runs"][f"{optimizer} {b}"][key] for b in (small, large))
            results["runs"][f"{optimizer} {suffix}"] = hi / lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run, nothing written")
    parser.add_argument("--data", choices=("corpus", "synthetic"), default="corpus")
    parser.add_argument("--vocab", type=positive_int, default=None,
                        help="the synthetic task's vocabulary (default 32)")
    parser.add_argument("--batch", type=positive_int, default=B,
                        help=f"the small batch and micro-batch, in sequences (default {B})")
    parser.add_argument("--steps", type=positive_int, default=STEPS,
                        help=f"the small batch's steps (default {STEPS})")
    parser.add_argument("--seeds", type=positive_int, default=len(SEEDS))
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--refit", type=pathlib.Path, metavar="JSON",
                        help="recompute the optima of a file this script wrote, from its "
                             "losses (no training), and write it back")
    args = parser.parse_args()
    if args.refit:
        results = json.loads(args.refit.read_text())
        fit_optima(results)
        args.refit.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.refit}")
        return
    small = args.batch
    budget = small * (8 if args.quick else args.steps)
    grids = {name: grid[::4] for name, grid in GRIDS.items()} if args.quick else GRIDS
    seeds = tuple(range(1 if args.quick else args.seeds))
    run = dict(budget=budget, micro=small, data=args.data, vocab=args.vocab)
    started = time.perf_counter()
    results = {"B": small, "K": K, "budget": budget, "data": args.data, "vocab": args.vocab,
               "seeds": list(seeds), "runs": {}}
    with threadpool_limits(1):
        for optimizer, grid in grids.items():
            for batch in (small, K * small):
                losses = []
                for lr in grid:
                    runs = [train_once(optimizer, lr, batch, seed, **run) for seed in seeds]
                    losses.append(float(np.mean([r["loss"] for r in runs])))
                results["runs"][f"{optimizer} {batch}"] = {"lrs": grid, "losses": losses}
                print(f"{optimizer:5} batch {batch:3}: loss {min(losses):.4f} at best",
                      flush=True)
        fit_optima(results, strict=not args.quick)
        for optimizer in grids:
            ratios = [results["runs"][f"{optimizer} {key}"] for key in ("ratio", "ratio wide")]
            print(f"{optimizer}: best lr at {K}B / at B = {ratios[0]:.2f} ({ratios[1]:.2f} by "
                  f"the wider fit; sqrt rule {math.sqrt(K):.0f}, linear rule {K})", flush=True)
        # the bug: the large batch's losses summed, at the small batch's best lr
        for optimizer in grids:
            lr = results["runs"][f"{optimizer} {small}"]["best_lr"]
            bug = {}
            for summed in (False, True):
                runs = [train_once(optimizer, lr, K * small, seed, summed=summed, **run)
                        for seed in seeds]
                bug["summed" if summed else "mean"] = {
                    "loss": float(np.mean([r["loss"] for r in runs])),
                    "first_update": float(np.mean([r["first_update"] for r in runs]))}
            results["runs"][f"{optimizer} bug"] = {"lr": lr, **bug}
            print(f"{optimizer} at lr {lr:.3g}, {K} micro-batches: loss mean "
                  f"{bug['mean']['loss']:.4f}, summed {bug['summed']['loss']:.4f}; first "
                  f"update x{bug['summed']['first_update'] / bug['mean']['first_update']:.2f}",
                  flush=True)
    results["seconds"] = round(time.perf_counter() - started)
    if not args.quick:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out} ({results['seconds']} s)")


if __name__ == "__main__":
    main()
