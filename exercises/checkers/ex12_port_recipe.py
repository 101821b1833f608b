"""Checker of exercise 12: `port_recipe(recipe, n_gpus, max_micro_batch)`.

For each case the expected port is derived here from the exercise's rules (keep the
global batch G when it splits over the N GPUs; otherwise G' = the smallest multiple of N
at least G, AdamW's square-root rule for lr and min_lr, steps and warm-up in tokens; the
fewest accumulation steps within the micro-batch limit). The answer is then checked
field by field (and nothing else may differ from the recipe: the model, the data and
the seed stay), with the typical mistakes named (a learning rate scaled by N, the
one-GPU accumulation kept, a micro-batch over the limit, the steps or the warm-up left
in steps when G grows, the linear rule for AdamW), and trained: minipar runs the recipe
on one GPU and the port on N (fp64, synthetic data); with G kept the loss curves must be
the same, step for step, to 1e-10, and the tokens seen the same in every case.
"""

from __future__ import annotations

import dataclasses
import math

from minipar.errors import ConfigError
from minipar.train import TrainConfig, train

from .harness import CheckFailed, expect, start_report
from .source_check import check_building_blocks

NUMBER, TITLE = "12", "port a one-GPU recipe to N GPUs"
BUILDING_BLOCKS = "ports the recipe by its rules (without running or planning it)"
FUNCTIONS = ("port_recipe",)
CLASSES = (TrainConfig,)
FORBIDDEN = {"minipar.plan": "the planner is not the exercise",
             "train": "the checker trains the recipe and the port",
             "launch": "the checker trains the recipe and the port"}
MODEL = dict(data="synthetic", vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16,
             bucket_size_mb=0.0, precision="fp64", lr=2e-3, min_lr=2e-4)
# (one-GPU micro-batch, accumulation, steps, warm-up; N GPUs, max micro-batch)
CASES = ((2, 4, 4, 2, 4, 2),   # G = 8 on 4 GPUs: one micro-batch of 2 each
         (2, 4, 4, 2, 2, 4),   # G = 8 on 2 GPUs: a micro-batch of 4, no accumulation
         (1, 8, 4, 2, 2, 2),   # G = 8 on 2 GPUs, at most 2: accumulate 2
         (3, 2, 8, 4, 4, 2))   # G = 6 does not split over 4: G' = 8, k = 4/3
RTOL = 1e-10
# What a port sets; every other field of the TrainConfig stays the recipe's (the model,
# the data and the seed, precision, the optimizer's other settings, how the ranks run).
PORTED = ("dp", "micro_batch_size", "grad_accum_steps", "global_batch_size", "lr", "min_lr",
          "steps", "warmup_steps")


def recipe_of(case) -> TrainConfig:
    micro, accum, steps, warmup, _, _ = case
    return TrainConfig(**MODEL, micro_batch_size=micro, grad_accum_steps=accum, steps=steps,
                       warmup_steps=warmup)


def expected_port(recipe: TrainConfig, n: int, limit: int) -> dict:
    batch = recipe.micro_batch_size * recipe.grad_accum_steps
    grown = -(-batch // n) * n
    per_gpu = grown // n
    micro = max(m for m in range(1, min(limit, per_gpu) + 1) if per_gpu % m == 0)
    k = grown / batch
    return {"dp": n, "micro_batch_size": micro, "grad_accum_steps": per_gpu // micro,
            "global_batch_size": grown, "lr": recipe.lr * math.sqrt(k),
            "min_lr": recipe.min_lr * math.sqrt(k), "steps": round(recipe.steps / k),
            "warmup_steps": round(recipe.warmup_steps / k)}


def _where(recipe: TrainConfig, n: int, limit: int) -> str:
    return (f"G = {recipe.micro_batch_size} x {recipe.grad_accum_steps} = "
            f"{recipe.micro_batch_size * recipe.grad_accum_steps} on 1 GPU -> {n} GPUs "
            f"(micro-batch <= {limit})")


def _port(impl, case) -> tuple[TrainConfig, TrainConfig, dict]:
    recipe = recipe_of(case)
    n, limit = case[4], case[5]
    port = impl.port_recipe(recipe, n, limit)
    expect(isinstance(port, TrainConfig),
           f"{_where(recipe, n, limit)}: port_recipe returned {type(port).__name__}; return "
           "a TrainConfig (recipe.replace(...))")
    try:  # validated again: a frozen dataclass's fields can be set around its checks
        port = TrainConfig(**{f.name: getattr(port, f.name)
                              for f in dataclasses.fields(TrainConfig)})
    except (ConfigError, ValueError, OverflowError, TypeError) as error:
        raise CheckFailed(f"{_where(recipe, n, limit)}: minipar refuses the port: "
                          f"{type(error).__name__}: {error}") from None
    return recipe, port, expected_port(recipe, n, limit)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12)


def check_settings(impl) -> list:
    ports = []
    for case in CASES:
        recipe, port, want = _port(impl, case)
        n, limit = case[4], case[5]
        where = _where(recipe, n, limit)
        batch = recipe.micro_batch_size * recipe.grad_accum_steps
        k = want["global_batch_size"] / batch
        changed = [f"{f.name} {getattr(recipe, f.name)!r} -> {getattr(port, f.name)!r}"
                   for f in dataclasses.fields(TrainConfig) if f.name not in PORTED
                   and getattr(port, f.name) != getattr(recipe, f.name)]
        expect(not changed,
               f"{where}: the port changes {', '.join(changed[:4])}"
               f"{' ...' if len(changed) > 4 else ''}; a port sets only "
               f"{', '.join(PORTED)}: the model, the data, the seed and everything else "
               "stay the recipe's (recipe.replace(...) with those fields only)")
        expect(port.dp == n, f"{where}: dp = {port.dp}; the port runs on dp = {n} GPUs")
        expect(port.micro_batch_size <= limit,
               f"{where}: micro_batch_size = {port.micro_batch_size} does not fit: each GPU "
               f"takes at most {limit} sequences at once (accumulate instead)")
        if port.global_batch_size != want["global_batch_size"]:
            hint = ""
            if port.grad_accum_steps == recipe.grad_accum_steps and port.micro_batch_size \
                    == recipe.micro_batch_size:
                hint = (f": the one-GPU micro-batch and accumulation were kept, so each step "
                        f"now averages {n} x {batch} sequences; divide the accumulation by N")
            raise CheckFailed(
                f"{where}: global batch {port.dp} x {port.micro_batch_size} x "
                f"{port.grad_accum_steps} = {port.global_batch_size}; expected "
                f"{want['global_batch_size']} ("
                + ("G is kept: it splits over the GPUs" if k == 1 else
                   f"the smallest multiple of {n} at least {batch}") + ")" + hint)
        expect(port.grad_accum_steps == want["grad_accum_steps"],
               f"{where}: {port.grad_accum_steps} accumulation steps of micro-batches of "
               f"{port.micro_batch_size}; the largest micro-batch that fits gives "
               f"{want['grad_accum_steps']} of {want['micro_batch_size']} (fewer, larger "
               "micro-batches run the GPU better)")
        for name in ("lr", "min_lr"):
            got, expected = getattr(port, name), want[name]
            if _close(got, expected):
                continue
            ratio = got / getattr(recipe, name)
            hint = ""
            if k == 1 and _close(ratio, n):
                hint = (f": scaled by N = {n}, but the global batch is the same, so every "
                        "step computes the same gradient: the learning rate stays (the "
                        "linear scaling rule follows the global batch, not the GPU count)")
            elif k != 1 and _close(ratio, k):
                hint = (f": scaled linearly by k = {k:g}; for AdamW take the square-root "
                        f"rule, sqrt(k) = {math.sqrt(k):.4g} (Malladi et al. 2022)")
            elif k != 1 and _close(ratio, 1):
                hint = (f": unchanged, but the global batch grew by k = {k:g}: scale it by "
                        f"sqrt(k) = {math.sqrt(k):.4g} (AdamW's square-root rule)")
            raise CheckFailed(f"{where}: {name} = {got:g}, expected {expected:g}{hint}")
        for name in ("steps", "warmup_steps"):
            got, expected = getattr(port, name), want[name]
            expect(got == expected,
                   f"{where}: {name} = {got}, expected {expected}"
                   + (f": with k = {k:g} times the sequences per step, the same tokens take "
                      f"{name} / k steps" if k != 1 and got == getattr(recipe, name) else
                      ": the global batch is the same, so the same steps" if k == 1 else ""))
        ports.append((case, recipe, port))
    return ports


def check_trained(ports) -> None:
    for case, recipe, port in ports:
        where = _where(recipe, case[4], case[5])
        one, many = train(recipe), train(port)
        tokens = [c.steps * c.global_batch_size * c.seq_len for c in (recipe, port)]
        expect(tokens[0] == tokens[1],
               f"{where}: the port trains on {tokens[1]} tokens, the recipe on {tokens[0]}")
        if port.global_batch_size != recipe.global_batch_size:
            continue
        for step, (a, b) in enumerate(zip(one.steps, many.steps, strict=True)):
            if not math.isclose(a["loss"], b["loss"], rel_tol=RTOL):
                raise CheckFailed(f"{where}: step {step}'s loss is {b['loss']:.12g} on "
                                  f"{port.dp} GPUs, {a['loss']:.12g} on one: with the same "
                                  "global batch the two runs must be the same training")


def check(impl, *, show_traceback: bool = False):
    report = start_report(NUMBER, TITLE, impl, show_traceback)
    report.run(BUILDING_BLOCKS, check_building_blocks, impl, FORBIDDEN)
    ports = report.run("the port's settings: global batch, micro-batch and accumulation, lr "
                       "and min_lr, steps and warm-up (4 cases)", check_settings, impl)
    name = ("minipar trains recipe and port (fp64): the same tokens; with G kept, the same "
            "loss at every step")
    if ports is None:
        report.skip(name, "needs the check above")
    else:
        report.run(name, check_trained, ports)
    return report
