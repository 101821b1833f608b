"""Reference solution of exercise 12: port a one-GPU recipe to N GPUs."""

from __future__ import annotations

import math


def port_recipe(recipe, n_gpus: int, max_micro_batch: int):
    batch = recipe.micro_batch_size * recipe.grad_accum_steps  # G on one GPU
    grown = -(-batch // n_gpus) * n_gpus  # G': kept when it splits over the GPUs
    per_gpu = grown // n_gpus
    micro = max(m for m in range(1, min(max_micro_batch, per_gpu) + 1) if per_gpu % m == 0)
    k = grown / batch  # 1 when G is kept
    return recipe.replace(
        dp=n_gpus, micro_batch_size=micro, grad_accum_steps=per_gpu // micro,
        lr=recipe.lr * math.sqrt(k), min_lr=recipe.min_lr * math.sqrt(k),
        steps=round(recipe.steps / k), warmup_steps=round(recipe.warmup_steps / k))
