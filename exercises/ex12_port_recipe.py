"""Exercise 12: port a one-GPU training recipe to N GPUs.

Check your work:   python -m exercises.check 12

A recipe that trains well on one GPU fixes an optimization: the global batch G (the
sequences behind each optimizer step: micro-batch x accumulation steps x data-parallel
ranks), the learning-rate schedule (peak lr, warm-up, cosine decay to min_lr) and the
number of steps. Porting it to N data-parallel GPUs should change the *speed*, not the
optimization: keep G, and the N GPUs compute exactly the same gradient per step (the
average over the same G sequences, exercise 03), so the learning rate, the warm-up and
the steps stay as they are. "N GPUs, so N times the learning rate" is the classic
mistake: the linear scaling rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD",
section 2.1) scales the learning rate with the *global batch*, not with the GPU count.

Only when G cannot be kept (it does not split over N ranks) does the optimization change,
and then every setting that depends on G moves with it. With G' = the smallest multiple
of N at least G, k = G'/G:
- learning rate: AdamW's square-root rule (Malladi et al. 2022, "On the SDEs and Scaling
  Rules for Adaptive Gradient Algorithms"; Krizhevsky 2014, "One weird trick", argued
  for it with SGD and found the linear rule better there): lr and min_lr times sqrt(k);
- the same number of training tokens: steps / k, and the warm-up in tokens too:
  warmup_steps / k (the cases are chosen so that these divide exactly).

Within a step, each GPU runs micro-batches that fit its memory: at most
`max_micro_batch` sequences. Among the splits of G over N ranks, take the fewest
accumulation steps (the largest micro-batch that fits): fewer, larger micro-batches run
the GPU better.

The recipe and your answer are minipar `TrainConfig`s (minipar/train/config.py and
layout.py: dp, micro_batch_size, grad_accum_steps, lr, min_lr, warmup_steps, steps);
`recipe.replace(dp=..., ...)` makes the new one (global_batch_size follows); everything
else (the model, the data, the seed, the precision) stays the recipe's. The checker
trains the recipe and your port with minipar (fp64, synthetic data) and compares: with
G kept the two loss curves must be the same, step for step, to 1e-10.
"""

from __future__ import annotations

import math  # noqa: F401 - math.sqrt


def port_recipe(recipe, n_gpus: int, max_micro_batch: int):
    """The recipe (a TrainConfig with dp = 1) on `n_gpus` data-parallel GPUs, each taking
    micro-batches of at most `max_micro_batch` sequences: a TrainConfig with dp = n_gpus
    and the batch, learning rate, warm-up and steps the rules above give."""
    raise NotImplementedError("port_recipe: your code here")
