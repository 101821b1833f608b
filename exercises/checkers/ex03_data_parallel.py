"""Checker of exercise 03: `train_step(model, optimizer, micro_batches, group)`.

Each of N virtual ranks builds the same fp64 GPT and AdamW and runs the student's step on
its A micro-batches for 2 steps; a single-device GPT trained here on the whole global
batch (mean loss over N*A*M sequences) is the reference. The checker watches the model's
forward calls and the optimizer's step to see *when* the rank communicated:
- gradients seen by optimizer.step() and parameters after it: equal to single-device
  training (fp64, relative 1e-10), and bit-identical on every replica;
- communication: nothing between micro-batches; one all-reduce per step of all Ψ
  gradient elements (2(N-1)/N * 8 Ψ bytes sent per rank, what dist.all_reduce books).

A wrong gradient is held against what typical mistakes would give (a factor N or A; only
the last micro-batch's gradient, when p.grad is cleared inside the micro-batch loop). What
follows from it is said so: the parameters after a step with a wrong gradient, and the
loss of the next step, which is then checked at the ranks' own parameters (the returned
mean can be right although single-device training's loss is not reached).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar import distributed as dist
from minipar.autograd import Tensor
from minipar.nn import GPT, AdamW, GPTConfig

from .harness import CheckFailed, expect, scale_factor, start_report
from .source_check import check_building_blocks

NUMBER, TITLE = "03", "data parallelism with gradient accumulation"
# The check of the file's text, which the grader also runs on its own copy (grader.py).
BUILDING_BLOCKS = "writes the step itself (no minipar.parallel / minipar.train)"
CONFIG = GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=16)
MICRO, STEPS, LR, WEIGHT_DECAY = 2, 2, 1e-2, 0.1
CASES = ((2, 3), (3, 2), (4, 1))  # (N ranks, A micro-batches)
RTOL = 1e-10

FORBIDDEN = {"minipar.parallel": "the library's data parallelism is the answer key",
             "minipar.train": "the library's training loop is the answer key",
             "DataParallel": "the library's DDP; write the step yourself",
             "data_parallel_engine": "the library's DDP; write the step yourself"}


def global_batches(n: int, accum: int) -> np.ndarray:
    """Token windows (STEPS, n * accum * MICRO, T + 1) of a case: inputs [:-1], targets [1:]."""
    rng = np.random.default_rng([3, n, accum])
    return rng.integers(0, CONFIG.vocab_size, size=(STEPS, n * accum * MICRO,
                                                     CONFIG.seq_len + 1))


def my_micro_batches(tokens: np.ndarray, rank: int, accum: int) -> list:
    """Rank-major split (DistributedSampler): rank r owns rows [r*A*M, (r+1)*A*M)."""
    out = []
    for k in range(accum):
        rows = tokens[(rank * accum + k) * MICRO:(rank * accum + k + 1) * MICRO]
        out.append((rows[:, :-1].copy(), rows[:, 1:].copy()))
    return out


def new_model_and_optimizer():
    model = GPT(CONFIG, seed=0, precision="fp64")
    return model, AdamW(model.named_parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


@dataclass
class Reference:
    losses: list  # per step
    grads: list  # per step {name: gradient of the global mean loss}
    params: list  # per step {name: parameters after the step}


def reference(tokens: np.ndarray) -> Reference:
    """Single-device training on the whole global batch of every step."""
    model, optimizer = new_model_and_optimizer()
    ref = Reference([], [], [])
    for step in range(STEPS):
        loss = model(tokens[step][:, :-1], tokens[step][:, 1:])
        loss.backward()
        ref.losses.append(float(loss.data))
        ref.grads.append({n: p.grad.copy() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        ref.params.append({n: p.data.copy() for n, p in model.named_parameters()})
    return ref


def _program(impl, n: int, accum: int, tokens: np.ndarray) -> list[dict]:
    """One rank: the student's step, watched. Returns per step what the checks need."""
    group = dist.new_group(range(n), kind="dp")
    rank, device = dist.get_rank(), dist.get_device()
    model, optimizer = new_model_and_optimizer()
    forwards, step_grads = [], []
    model_forward, optimizer_step = model.forward, optimizer.step

    def watched_forward(*args, **kwargs):
        forwards.append(len(device.comm.records))  # communication so far
        return model_forward(*args, **kwargs)

    def watched_step():
        step_grads.append({name: None if p.grad is None else p.grad.copy()
                           for name, p in model.named_parameters()})
        optimizer_step()

    model.forward, optimizer.step = watched_forward, watched_step
    steps = []
    for step in range(STEPS):
        forwards.clear()
        step_grads.clear()
        start = len(device.comm.records)
        loss = impl.train_step(model, optimizer, my_micro_batches(tokens[step], rank, accum),
                               group)
        steps.append({
            "loss": loss, "forwards": list(forwards), "grads": list(step_grads),
            "records": device.comm.records[start:], "start": start,
            "params": {name: p.data.copy() for name, p in model.named_parameters()},
            "left_grads": [name for name, p in model.named_parameters()
                           if p.grad is not None and np.any(p.grad)]})
    return steps


@dataclass
class Case:
    n: int
    accum: int
    ranks: list  # per rank: list of step dicts
    ref: Reference
    tokens: np.ndarray  # (STEPS, N*A*M, T+1): the global batches

    def __str__(self) -> str:
        return f"N={self.n} ranks, A={self.accum} micro-batches"


# ------------------------------------------------------------------ the checks
def check_runs(impl) -> list[Case]:
    cases = []
    for n, accum in CASES:
        tokens = global_batches(n, accum)
        try:
            ranks = dist.launch(_program, n, impl, n, accum, tokens)
        except Exception as error:  # noqa: BLE001 - name the case, keep the error
            error.add_note(f"(case N={n} ranks, A={accum} micro-batches)")
            raise
        cases.append(Case(n, accum, ranks, reference(tokens), tokens))
    return cases


def check_structure(cases: list[Case]) -> None:
    for case in cases:
        for rank, steps in enumerate(case.ranks):
            for step, s in enumerate(steps):
                where = f"{case}, rank {rank}, step {step}"
                expect(len(s["forwards"]) == case.accum,
                       f"{where}: the model ran forward {len(s['forwards'])} times; expected "
                       f"once per micro-batch ({case.accum})")
                expect(len(s["grads"]) == 1,
                       f"{where}: optimizer.step() was called {len(s['grads'])} times; "
                       "expected once per train_step")


def check_no_sync(cases: list[Case]) -> None:
    for case in cases:
        for rank, steps in enumerate(case.ranks):
            for step, s in enumerate(steps):
                marks = s["forwards"] + [s["start"] + len(s["records"])]
                first = s["forwards"][0] if s["forwards"] else s["start"]
                expect(first == s["start"], f"{case}, rank {rank}, step {step}: communication "
                                            "before the first forward")
                for k in range(case.accum - 1):
                    between = s["records"][marks[k] - s["start"]:marks[k + 1] - s["start"]]
                    if between:
                        ops = ", ".join(sorted({r.op for r in between}))
                        raise CheckFailed(
                            f"{case}, rank {rank}, step {step}: {len(between)} call(s) of {ops} "
                            f"between micro-batches {k} and {k + 1}; let backward accumulate "
                            "the gradients locally and reduce once, after the last "
                            "micro-batch (DDP's no_sync)")


def check_one_all_reduce(cases: list[Case]) -> None:
    numel = sum(int(np.prod(p.shape)) for p in new_model_and_optimizer()[0].parameters())
    for case in cases:
        for rank, steps in enumerate(case.ranks):
            for step, s in enumerate(steps):
                where = f"{case}, rank {rank}, step {step}"
                records = s["records"]
                ops = sorted({r.op for r in records} - {"all_reduce"})
                expect(not ops, f"{where}: called {', '.join(ops)}; data parallelism needs "
                                "one all_reduce")
                expected = dist.all_reduce_bytes(numel, 8, case.n, rank)[0]
                if not records:
                    raise CheckFailed(f"{where}: no all-reduce: the replicas' gradients were "
                                      "never averaged")
                if len(records) > 1:
                    raise CheckFailed(
                        f"{where}: {len(records)} all-reduces in one step; flatten all "
                        f"{numel} gradient elements into one bucket and all-reduce it once "
                        "(fewer, larger messages: each call pays the latency alpha)")
                expect(records[0].group_ranks == tuple(range(case.n)),
                       f"{where}: the all-reduce ran over ranks {list(records[0].group_ranks)}, "
                       f"not the DP group {list(range(case.n))}")
                expect(records[0].sent_bytes == expected,
                       f"{where}: the all-reduce sent {records[0].sent_bytes} bytes; all "
                       f"Ψ={numel} fp64 gradients take 2(N-1)/N*8Ψ = {expected}")


# ------------------------------------------------------------------ what a mistake gives
def _params_before(case: Case, rank: int, step: int) -> dict:
    """{name: value} of rank's parameters entering `step` (step 0: the common init)."""
    if step == 0:
        return {n: p.data.copy() for n, p in new_model_and_optimizer()[0].named_parameters()}
    return case.ranks[rank][step - 1]["params"]


def _model_at(params: dict):
    model = new_model_and_optimizer()[0]
    for name, p in model.named_parameters():
        p.data[...] = params[name]
    return model


def _relative_diff(got: np.ndarray, expected: np.ndarray) -> float:
    scale = max(float(np.max(np.abs(expected))), 1e-300)
    return float(np.max(np.abs(got - expected))) / scale


def _diverged_before(case: Case, step: int) -> bool:
    """Some rank's parameters entering `step` already differ from single-device training."""
    return step > 0 and any(
        _relative_diff(steps[step - 1]["params"][name], expected) > RTOL
        for steps in case.ranks for name, expected in case.ref.params[step - 1].items())


def _gradient_wrong(case: Case, rank: int, step: int) -> bool:
    s = case.ranks[rank][step]
    if len(s["grads"]) != 1:
        return False  # not one optimizer.step(): check_structure says so, not this
    return any(s["grads"][0][name] is None
               or not np.allclose(s["grads"][0][name], expected, rtol=RTOL, atol=1e-13)
               for name, expected in case.ref.grads[step].items())


def _gradients_scaled(case: Case, rank: int, step: int) -> bool:
    """Rank's gradients at `step` are all one multiple c != 1 of the right ones."""
    s = case.ranks[rank][step]
    if len(s["grads"]) != 1 or any(g is None for g in s["grads"][0].values()):
        return False
    names = list(case.ref.grads[step])
    c = _scale(np.concatenate([s["grads"][0][k].reshape(-1) for k in names]),
               np.concatenate([case.ref.grads[step][k].reshape(-1) for k in names]))
    return c is not None and abs(c - 1) > 1e-6


def _first_wrong_gradient(case: Case, rank: int, step: int) -> int | None:
    """The first step <= `step` at which rank's optimizer.step() saw a wrong gradient."""
    return next((k for k in range(step + 1) if _gradient_wrong(case, rank, k)), None)


def _last_micro_batch_gradient(case: Case, step: int) -> dict:
    """{name: mean over ranks of the gradient of each rank's last micro-batch's loss}, at
    the parameters the ranks entered `step` with: what optimizer.step() sees when p.grad
    is cleared before every micro-batch (up to the 1/A scale and avg or sum)."""
    total = {}
    for rank in range(case.n):
        model = _model_at(_params_before(case, rank, step))
        x, y = my_micro_batches(case.tokens[step], rank, case.accum)[-1]
        model(x, y).backward()
        for name, p in model.named_parameters():
            total[name] = total.get(name, 0) + p.grad / case.n
    return total


def _scale(got: np.ndarray, base: np.ndarray) -> float | None:
    """c if got == c * base (fp64 rounding aside, over a whole model's gradients), else
    None."""
    return scale_factor(got, base, rtol=1e-8, atol=1e-13)


def _multiple(got: np.ndarray, base: np.ndarray, factors) -> str | None:
    """The name of the factor in `factors` ((factor, name) pairs) with got == factor *
    base, else None."""
    c = _scale(got, base)
    return None if c is None else next(
        (name for factor, name in factors if abs(c - factor) < 1e-6 * factor), None)


def _diagnose(got: np.ndarray, expected: np.ndarray, case: Case, name: str,
              step: int) -> str:
    """A hint when the gradient is what a typical mistake gives."""
    n, a = case.n, case.accum
    factors = [(f, f"{f:g}x the single-device gradient, a factor {hint}")
               for f, hint in ((n, "N: sum -> average the gradients (op='avg')"),
                               (a, "A: scale each micro-batch's loss by 1/A"),
                               (n * a, "N*A: average over ranks, scale by 1/A"),
                               (1 / n, "1/N: averaged twice?"),
                               (1 / a, "1/A: scaled by 1/A twice?")) if f != 1]
    found = _multiple(got, expected, factors)
    if found is not None:
        return f" (it is {found})"
    if a > 1:
        # zero_grad() inside the micro-batch loop: only the last backward is left, scaled
        # by 1/A (or not), averaged (or summed) over the ranks
        last = _last_micro_batch_gradient(case, step)[name]
        scale = _multiple(got, last, ((1 / a, "1/A x "), (1, ""), (n / a, "N/A x "),
                                      (n, "N x ")))
        if scale is not None:
            return (f" (it is {scale}the gradient of the last micro-batch alone; only the "
                    "last micro-batch's gradient is left: zero the gradients once per step, "
                    "before the micro-batch loop (DDP's no_sync accumulates))")
    return ""


def check_gradients(cases: list[Case]) -> None:
    for case in cases:
        for rank, steps in enumerate(case.ranks):
            for step, s in enumerate(steps):
                if len(s["grads"]) != 1:
                    continue  # reported by check_structure
                for name, expected in case.ref.grads[step].items():
                    got = s["grads"][0][name]
                    where = f"{case}, rank {rank}, step {step}: {name}.grad"
                    expect(got is not None, f"{where} is None at optimizer.step()")
                    if not np.allclose(got, expected, rtol=RTOL, atol=1e-13):
                        diff = float(np.max(np.abs(got - expected)))
                        raise CheckFailed(f"{where} at optimizer.step() differs from the "
                                          f"single-device gradient of the global batch: max "
                                          f"abs diff {diff:.3g}"
                                          f"{_diagnose(got, expected, case, name, step)}")


def check_parameters(cases: list[Case]) -> None:
    for case in cases:
        for step in range(STEPS):
            first = case.ranks[0][step]["params"]
            for rank, steps in enumerate(case.ranks[1:], start=1):
                for name, value in steps[step]["params"].items():
                    if not np.array_equal(value, first[name]):
                        raise CheckFailed(f"{case}, step {step}: rank {rank}'s {name} differs "
                                          "from rank 0's: the replicas drifted apart (every "
                                          "rank must step with the same averaged gradients)")
            for rank, steps in enumerate(case.ranks):
                params = steps[step]["params"]
                for name, expected in case.ref.params[step].items():
                    diff = _relative_diff(params[name], expected)
                    if diff <= RTOL:
                        continue
                    cause = _first_wrong_gradient(case, rank, step)
                    why = "" if cause is None else (
                        f": this follows from the step-{cause} gradients above, which "
                        "optimizer.step() was given; fix those first")
                    if cause is not None and _gradients_scaled(case, rank, cause):
                        why += (" (AdamW's update m / (sqrt(v) + eps) hardly depends on "
                                "the gradient's scale, so the parameters differ only this "
                                "little)")
                    raise CheckFailed(f"{case}: after step {step}, {name} on rank {rank} "
                                      f"differs from single-device training by {diff:.3g} "
                                      f"(relative; fp64 runs agree to {RTOL:g}){why}")


def _own_loss(case: Case, rank: int, step: int) -> float:
    """The mean loss of rank's micro-batches at the parameters it entered `step` with."""
    model = _model_at(_params_before(case, rank, step))
    return float(np.mean([float(model(x, y).data) for x, y in
                          my_micro_batches(case.tokens[step], rank, case.accum)]))


def check_loss(cases: list[Case]) -> str:
    remarks = []
    for case in cases:
        for step in range(STEPS):
            values = []
            for rank, steps in enumerate(case.ranks):
                loss = steps[step]["loss"]
                if isinstance(loss, Tensor):
                    loss = loss.data
                try:
                    values.append(float(loss))
                except (TypeError, ValueError):
                    raise CheckFailed(f"{case}, rank {rank}: train_step returned "
                                      f"{type(loss).__name__}; return the mean loss of this "
                                      "rank's micro-batches as a float") from None
            mean, expected = float(np.mean(values)), case.ref.losses[step]
            if abs(mean - expected) <= 1e-10 * abs(expected):
                continue
            if _diverged_before(case, step):
                # The parameters this step started from are already wrong (the checks
                # above say why): the loss can only be held against the ranks' own.
                for rank, value in enumerate(values):
                    own = _own_loss(case, rank, step)
                    expect(abs(value - own) <= 1e-10 * abs(own),
                           f"{case}, step {step}, rank {rank}: train_step returned "
                           f"{value:.12g}; the mean loss of its micro-batches at its own "
                           f"parameters is {own:.12g} (return the mean over this rank's "
                           "micro-batches)")
                causes = [k for k in (_first_wrong_gradient(case, r, step - 1)
                                      for r in range(case.n)) if k is not None]
                why = (f"follows from the step-{min(causes)} gradients above" if causes
                       else "follows from the parameters above")
                remarks.append((case, step, why))
                continue
            raise CheckFailed(
                f"{case}, step {step}: the ranks' returned losses average to {mean:.12g}; "
                f"the single-device loss of the global batch is {expected:.12g} (return "
                "the mean over this rank's micro-batches)")
    if not remarks:
        return ""
    case, step, why = remarks[0]
    more = f" (and {len(remarks) - 1} more)" if len(remarks) > 1 else ""
    return (f"{case}, step {step}{more}: the loss differs from single-device training's, "
            f"but that {why}; at the ranks' own parameters the returned mean is right")


def check_zeroed(cases: list[Case]) -> None:
    for case in cases:
        for rank, steps in enumerate(case.ranks):
            for step, s in enumerate(steps):
                left = s["left_grads"]
                if left:
                    raise CheckFailed(
                        f"{case}, rank {rank}: after step {step}, p.grad still holds values "
                        f"for {len(left)} parameters (e.g. {left[0]}); call "
                        "optimizer.zero_grad() so the next step starts from zero")


def check(impl, *, show_traceback: bool = False):
    report = start_report(NUMBER, TITLE, impl, show_traceback)
    report.run(BUILDING_BLOCKS, check_building_blocks, impl, FORBIDDEN)
    cases = report.run("runs on N = 2, 3, 4 ranks with A = 3, 2, 1 micro-batches, 2 steps",
                       check_runs, impl)
    checks = [
        ("one forward per micro-batch, one optimizer.step() per train_step", check_structure),
        ("no communication between micro-batches (no_sync)", check_no_sync),
        ("exactly one all-reduce per step, of all gradients: 2(N-1)/N*8Ψ bytes",
         check_one_all_reduce),
        ("gradients at optimizer.step() = single-device gradients of the global batch",
         check_gradients),
        ("parameters after each step = single-device training; replicas identical",
         check_parameters),
        ("returned loss: its mean over ranks = the global batch's loss", check_loss),
        ("gradients cleared for the next step", check_zeroed),
    ]
    for name, fn in checks:
        if cases is None:
            report.skip(name, "needs the runs above")
        else:
            report.run(name, fn, cases)
    return report
