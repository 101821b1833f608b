"""Checker of exercise 03: `train_step(model, optimizer, micro_batches, group)`.

Each of N virtual ranks builds the same fp64 GPT and AdamW and runs the student's step on
its A micro-batches for 2 steps; a single-device GPT trained here on the whole global
batch (mean loss over N*A*M sequences) is the reference. The checker watches the model's
forward calls and the optimizer's step to see *when* the rank communicated:
- gradients seen by optimizer.step() and parameters after it: equal to single-device
  training (fp64, relative 1e-10), and bit-identical on every replica;
- communication: nothing between micro-batches; one all-reduce per step of all Ψ
  gradient elements (2(N-1)/N * 8 Ψ bytes sent per rank, what dist.all_reduce books).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar import distributed as dist
from minipar.autograd import Tensor
from minipar.nn import GPT, AdamW, GPTConfig

from .harness import CheckFailed, check_building_blocks, expect, start_report

NUMBER, TITLE = "03", "data parallelism with gradient accumulation"
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
        cases.append(Case(n, accum, ranks, reference(tokens)))
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


def _diagnose(got: np.ndarray, expected: np.ndarray, case: Case) -> str:
    """A hint when the gradients are off by a telling factor."""
    ratio = float(np.vdot(got, expected) / np.vdot(expected, expected))
    for factor, hint in ((case.n, "N: sum -> average the gradients (op='avg')"),
                         (case.accum, "A: scale each micro-batch's loss by 1/A"),
                         (case.n * case.accum, "N*A: average over ranks, scale by 1/A"),
                         (1 / case.n, "1/N: averaged twice?"),
                         (1 / case.accum, "1/A: scaled by 1/A twice?")):
        if factor != 1 and abs(ratio - factor) < 1e-6 * factor:
            return f" (it is {ratio:g}x the single-device gradient, a factor {hint})"
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
                                          f"abs diff {diff:.3g}{_diagnose(got, expected, case)}")


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
                    got = params[name]
                    scale = max(float(np.max(np.abs(expected))), 1e-300)
                    diff = float(np.max(np.abs(got - expected)))
                    expect(diff <= RTOL * scale,
                           f"{case}: after step {step}, {name} on rank {rank} differs from "
                           f"single-device training by {diff / scale:.3g} (relative; fp64 "
                           f"runs agree to {RTOL:g})")


def check_loss(cases: list[Case]) -> None:
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
            expect(abs(mean - expected) <= 1e-10 * abs(expected),
                   f"{case}, step {step}: the ranks' returned losses average to {mean:.12g}; "
                   f"the single-device loss of the global batch is {expected:.12g} (return "
                   "the mean over this rank's micro-batches)")


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
    report.run("writes the step itself (no minipar.parallel / minipar.train)",
               check_building_blocks, impl, FORBIDDEN)
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
