"""Checker of exercise 06: `count_parameters(config)` and `predict_rank(config, rank)`.

Trains each configuration below with `minipar.train` (2 steps of a tiny GPT: fast) and
compares the student's prediction with the report: `n_params`, and for every rank the
peak memory of params / grads / optimizer and the bytes sent in the DP and the TP group.
The measured numbers come from the ranks' ledgers (`ndarray.nbytes` of what they held,
the ring bytes of the collectives they called), not from a formula, so a formula that
matches them is a real prediction.

Data, tensor and pipeline parallelism and ZeRO are checked. Under PP only what a stage
keeps (parameters, gradients, optimizer state) and sends is predicted, not its
activations (those depend on the schedule's micro-batches in flight: notebook 05).
"""

from __future__ import annotations

from dataclasses import dataclass

from minipar.train import TrainConfig, train

from .harness import CheckFailed, expect, start_report
from .source_check import check_building_blocks

NUMBER, TITLE = "06", "predict per-rank bytes of a training run"
# The check of the file's text, which the grader also runs on its own copy (grader.py).
BUILDING_BLOCKS = "predicts without running minipar"
# The file's functions, and the classes their arguments and results may hold: the
# grader calls them in a process of their own and runs `check` itself (grader.py).
FUNCTIONS = ("count_parameters", "predict_rank")
CLASSES = (TrainConfig,)
MODEL = dict(data="synthetic", vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16,
             micro_batch_size=2, steps=2, bucket_size_mb=0.0)
# Every flat buffer (and ZeRO-3 unit) of these models splits evenly over dp ranks.
CONFIGS = (
    dict(dp=1, zero=0, precision="fp32", grad_accum_steps=1),
    dict(dp=2, zero=0, precision="fp32", grad_accum_steps=2),
    dict(dp=4, zero=0, precision="bf16-mixed", grad_accum_steps=1),
    dict(dp=2, zero=1, precision="fp32", grad_accum_steps=3),
    dict(dp=4, zero=2, precision="bf16-mixed", grad_accum_steps=2),
    dict(dp=2, zero=3, precision="fp32", grad_accum_steps=2),
    dict(dp=2, zero=2, precision="fp64", grad_accum_steps=1, n_layer=2, tie_embeddings=False),
    dict(dp=1, tp=2, zero=0, precision="fp32", grad_accum_steps=2),
    dict(dp=2, tp=2, zero=1, precision="fp32", grad_accum_steps=1),
    # two pipeline stages: untied (the head on the last stage), then tied (the last stage
    # keeps a copy of wte) with 3 layers split (2, 1), over dp = 2
    dict(pp=2, zero=0, precision="fp32", grad_accum_steps=2, n_layer=2, tie_embeddings=False),
    dict(dp=2, pp=2, zero=0, precision="bf16-mixed", grad_accum_steps=2, n_layer=3),
)
MEMORY = ("params", "grads", "optimizer")
TRAFFIC = ("dp", "tp", "pp")
KEYS = MEMORY + TRAFFIC

FORBIDDEN = {"minipar.plan": "the planner is an answer key; predict from the formulas",
             "minipar.train": "predict without running: the checker trains and compares",
             "train": "predict without running: the checker trains and compares",
             "launch": "predict without running: the checker trains and compares",
             "parameter_shapes": "count the parameters yourself",
             "num_parameters": "count the parameters yourself"}


@dataclass
class Measured:
    config: TrainConfig
    n_params: int
    ranks: list  # per rank: {key: bytes}
    by_op: list  # per rank: bytes sent by collective (all groups)

    def __str__(self) -> str:
        c = self.config
        mesh = (f"dp={c.dp}" + (f" pp={c.pp}" if c.pp > 1 else "")
                + (f" tp={c.tp}" if c.tp > 1 else ""))
        extra = "" if c.tie_embeddings else ", untied"
        return (f"{mesh} zero={c.zero} {c.precision} A={c.grad_accum_steps} "
                f"L={c.n_layer}{extra}")


def measure(values: dict) -> Measured:
    config = TrainConfig(**{**MODEL, **values})
    report = train(config)
    ranks, by_op = [], []
    for r in report.ranks:
        ranks.append({**{k: r["memory"][k] for k in MEMORY},
                      **{k: r["comm"]["by_group"].get(k, 0) for k in TRAFFIC}})
        by_op.append({op: b for op, b in r["comm"]["by_op"].items() if b})
    return Measured(config, report.n_params, ranks, by_op)


def _hint(key: str, got: int, measured: Measured, rank: int) -> str:
    """A pointer when the prediction is off by a telling amount."""
    c = measured.config
    expected = measured.ranks[rank][key]
    if key in TRAFFIC and 0 < abs(expected - got) <= 16 * c.steps:
        loss = " or the loss the last stage broadcasts (8 bytes)" if key == "pp" else ""
        return ("; about one float64 per step apart: the gradient-norm all-reduce"
                f"{loss}? (dist.all_reduce_bytes(1, 8, n, i)[0] bytes at position i)")
    stages = c.pp > 1 and key in MEMORY + ("pp",)
    if stages and c.tie_embeddings:
        stage = (rank // c.tp) % c.pp
        wte = c.vocab_size // c.tp * c.d_model * {"fp64": 8, "fp32": 4}.get(c.precision, 2)
        if key == "pp" and stage in (0, c.pp - 1) and expected - got == c.steps * wte:
            return ("; one wte gradient per step apart: the tied embedding's all-reduce "
                    "between the first and the last stage (Megatron's embedding group)?")
        if key in MEMORY and stage == c.pp - 1 and got < expected:
            return ("; the last stage holds less than measured: with a tied head it keeps "
                    "its own copy of wte (kept equal to the first stage's)")
    hint = ""
    if got and expected:
        for factor, why in ((c.dp, f"N={c.dp}: is it sharded at this stage?"),
                            (1 / c.dp, f"1/N: is it replicated at ZeRO-{c.zero}?"),
                            (c.tp, f"t={c.tp}: does TP split it?"),
                            (c.grad_accum_steps, "A: once per micro-batch, or per step?"),
                            (1 / c.grad_accum_steps, "1/A: once per step, or per micro-batch?"),
                            (c.steps, "the number of steps?")):
            if factor != 1 and abs(got * factor - expected) < 0.5:
                hint = f"; measured = predicted x {why}"
                break
    groups = (c.dp > 1) + (c.tp > 1) + (c.pp > 1)
    if key in TRAFFIC and (c.tp == 1 or key == "tp"):
        ops = ", ".join(f"{op} {b}" for op, b in measured.by_op[rank].items())
        hint += f" (measured by collective{'' if groups <= 1 else ', all groups'}: {ops})"
    return hint


# ------------------------------------------------------------------ the checks
def check_measurements() -> list[Measured]:
    return [measure(values) for values in CONFIGS]


def check_count(impl, runs: list[Measured]) -> None:
    for run in runs:
        c = run.config
        got = impl.count_parameters(c)
        if got == run.n_params:
            continue
        d, diff = c.d_model, run.n_params - int(got)
        hints = {c.vocab_size * d: "the (V, d) token embedding or the untied lm_head",
                 c.seq_len * d: "the (T, d) position embedding wpe",
                 2 * d: "ln_f (weight and bias)",
                 c.n_layer * (12 * d * d + 13 * d): "the blocks",
                 c.n_layer * 4 * d: "the blocks' LayerNorms"}
        hint = f" (missing {hints[diff]}?)" if diff in hints else ""
        if -diff in hints:
            hint = f" (counted {hints[-diff]} once too often?)"
        raise CheckFailed(f"{run}: count_parameters returned {got}; the model has "
                          f"{run.n_params} parameters (V={c.vocab_size}, T={c.seq_len}, "
                          f"L={c.n_layer}, d={d}); off by {diff}{hint}")


def check_config(impl, run: Measured) -> None:
    problems = []
    for rank, measured in enumerate(run.ranks):
        predicted = impl.predict_rank(run.config, rank)
        expect(isinstance(predicted, dict), f"predict_rank returned "
                                            f"{type(predicted).__name__}; return a dict")
        missing = [k for k in KEYS if k not in predicted]
        expect(not missing, f"predict_rank's dict lacks {', '.join(missing)} (keys: "
                            f"{', '.join(KEYS)})")
        for key in KEYS:
            if predicted[key] != measured[key]:
                problems.append(f"rank {rank}: {key} predicted {predicted[key]}, measured "
                                f"{measured[key]}{_hint(key, predicted[key], run, rank)}")
    if problems:
        shown = problems[:6] + ([f"... and {len(problems) - 6} more"] if len(problems) > 6
                                else [])
        raise CheckFailed("\n".join(shown))


def check(impl, *, show_traceback: bool = False):
    report = start_report(NUMBER, TITLE, impl, show_traceback)
    report.run(BUILDING_BLOCKS, check_building_blocks, impl, FORBIDDEN)
    runs = report.run(f"minipar trains the {len(CONFIGS)} configurations (measurements)",
                      check_measurements)
    if runs is None:
        report.skip("count_parameters = the report's n_params", "needs the measurements")
        return report
    report.run("count_parameters = the report's n_params (tied, untied, 1-3 layers)",
               check_count, impl, runs)
    for run in runs:
        report.run(f"{run}: memory and DP/TP/PP bytes sent, every rank", check_config, impl,
                   run)
    return report
