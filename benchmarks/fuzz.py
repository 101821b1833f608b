"""Every fuzzer of minipar's entry points, and one line of totals:

    tried N / refused cleanly N / traceback N / hang N / silent wrong N / data lost N

    python benchmarks/fuzz.py            # all of them (~10 min on 2 busy cores)
    python benchmarks/fuzz.py --quick    # the cases of this file and the grader's cheap ones
    python benchmarks/fuzz.py --verbose  # and one line per case

The last four must be 0. It runs benchmarks/fuzz_grader.py (hand-ins written to fool the
exercise checker), benchmarks/fuzz_outputs.py (checkpoints killed, interrupted, out of
space or shared by concurrent runs; files that are not what their names say; extreme
traces) and the cases below, each in a child process:

- every other output on a full disk (a write that raises ENOSPC after a few bytes, as
  fuzz_outputs simulates it): `train --json` over an earlier report, `train --trace`,
  `consolidate`, `plan --json` over an earlier answer, `plan --export`, `timeline --out`.
  Clean: one line on stderr, exit status 2, the earlier file whole, no temporary left,
  and for `train --trace` the report still written (--json);
- Ctrl-C (SIGINT) in `train`, `plan`, `check` and while a checkpoint is written: clean is
  one line, exit status 130 and no temporary file left;
- switches given as strings or numbers (`TrainConfig(sequence_parallel='False')`,
  `tie_embeddings='false'`, ...) and integers too large to print (`n_layer=10**5000`):
  clean is a ConfigError naming the setting;
- Ctrl-C a few tenths of a second into `python -m minipar plan`, while it loads;
- `minipar plan` on the largest inputs it accepts (benchmarks/plan_extremes.py): clean is
  an answer within PLAN_CPU_S seconds of CPU; slower is a hang.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fuzz_grader  # noqa: E402  (the benchmarks folder is not a package)
import fuzz_outputs  # noqa: E402
import plan_extremes  # noqa: E402
from fuzz_outputs import CLEAN, HANG, LOST, MODEL, OUTCOMES, SILENT, TRACEBACK  # noqa: E402

PLAN_CPU_S = 10.0  # the planner answers in ~5 s of CPU on 2 cores; twice that when busy
TRAIN = ["train", *MODEL, "--dp", "2", "--steps", "1"]
EARLIER = '{"earlier": "a finished run\'s output"}\n'


def temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if p.name.endswith((".tmp", ".partial"))]


def full_disk(folder: Path, argv: list, earlier: Path | None = None,
              kept: Path | None = None) -> tuple[str, str]:
    """`minipar argv` whose writes under `folder` fail for space after 64 bytes."""
    if earlier is not None:
        earlier.write_text(EARLIER)
    result = fuzz_outputs.child(argv, {"enospc_after": 64, "directory": str(folder)})
    outcome = fuzz_outputs.refusal(result)
    if outcome[0] != CLEAN:
        return outcome
    if "No space left" not in outcome[1]:
        return SILENT, f"refused for another reason: {outcome[1]}"
    if earlier is not None and earlier.read_text() != EARLIER:
        return LOST, f"{earlier.name}, written before, was changed"
    if left := temporaries(folder):
        return SILENT, f"temporaries left: {left[:3]}"
    if kept is not None and not (kept.is_file() and json.loads(kept.read_text())):
        return LOST, f"the report {kept.name} was not written"
    return outcome


def full_disk_cases(work: Path) -> list:
    checkpoint = work / "ckpt"
    made = fuzz_outputs.child([*TRAIN, "--save", checkpoint])
    assert made is not None and made.returncode == 0, made and made.stderr
    trace_report = work / "kept.json"
    cases = {
        "train --json over an earlier report": lambda d: full_disk(
            d, [*TRAIN, "--json", d / "out.json"], earlier=d / "out.json"),
        "train --trace (the report kept)": lambda d: full_disk(
            d / "trace", [*TRAIN, "--trace", d / "trace", "--json", trace_report],
            kept=trace_report),
        "consolidate": lambda d: full_disk(
            d, ["consolidate", checkpoint / "step-000001", d / "out.npz"],
            earlier=d / "out.npz"),
        "plan --json over an earlier answer": lambda d: full_disk(
            d, ["plan", "--model", "gpt2", "--dp", "2", "--json", d / "plan.json"],
            earlier=d / "plan.json"),
        "plan --export": lambda d: full_disk(
            d, ["plan", "--model", "gpt2", "--dp", "2", "--export", d / "export"]),
        "timeline --out": lambda d: full_disk(
            d, ["timeline", *MODEL[:-1], "--dp", "2",
                "--out", d / "t.png"], earlier=d / "t.png"),
    }
    made_folders = [work / f"full-{i}" for i in range(len(cases))]
    for folder in made_folders:
        (folder / "trace").mkdir(parents=True)
    return [(f"full disk: {name}", lambda case=case, folder=folder: case(folder))
            for (name, case), folder in zip(cases.items(), made_folders, strict=True)]


# A command started after minipar is imported (Ctrl-C during Python's own import of the
# package prints Python's traceback: no handler of minipar's exists yet), saying so.
READY = r"""
import sys
from minipar import cli
print("ready", file=sys.stderr, flush=True)
sys.exit(cli.main(sys.argv[1:]))
"""


def interrupted(argv: list, after_s: float, folder: Path | None = None,
                patch: dict | None = None, loading: bool = False) -> tuple[str, str]:
    """SIGINT to `minipar argv` `after_s` seconds after it started (or, with a patch,
    at the patch's fsync; loading: `after_s` after `python -m minipar` started, while it
    imports NumPy and the package)."""
    if loading:
        started = subprocess.Popen([sys.executable, "-m", "minipar", *map(str, argv)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True)
        time.sleep(after_s)
        started.send_signal(signal.SIGINT)
    elif patch is None:
        started = subprocess.Popen([sys.executable, "-c", READY, *map(str, argv)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True)
        started.stderr.readline()  # "ready"
        time.sleep(after_s)
        started.send_signal(signal.SIGINT)
    else:
        started = fuzz_outputs.child(argv, patch, wait=False)
    try:
        _, err = started.communicate(timeout=fuzz_outputs.TIMEOUT_S)
    except subprocess.TimeoutExpired:
        started.kill()
        started.communicate()
        return HANG, "Ctrl-C did not end it"
    lines = err.strip().splitlines()
    if "Traceback" in err:
        return TRACEBACK, lines[-1][:160]
    if started.returncode == 0:
        return CLEAN, "ended before the signal"  # (too quick to interrupt: nothing to judge)
    if started.returncode != 130 or len(lines) != 1:
        return TRACEBACK, f"exit status {started.returncode}, {len(lines)} lines: {err[-160:]}"
    if folder is not None and (left := temporaries(folder)):
        return SILENT, f"temporaries left: {left[:3]}"
    return CLEAN, lines[0][:160]


def ctrl_c_cases(work: Path) -> list:
    long_train = ["train", *MODEL, "--dp", "2", "--steps", "20000"]  # (minutes: interrupted)
    saving = work / "ctrl-c-save"
    return [
        ("Ctrl-C: train", lambda: interrupted(long_train, 1.0)),
        ("Ctrl-C: train --save at the 3rd fsync", lambda: interrupted(
            [*TRAIN[:-2], "--steps", "2", "--save", saving], 0, saving,
            {"kill_at_fsync": 3, "signal": "SIGINT"})),
        ("Ctrl-C: plan searching 16,384 GPUs", lambda: interrupted(
            ["plan", "--model", "gpt3-175b", "--gpus", "16384"], 0.5)),
        ("Ctrl-C: check", lambda: interrupted(["check"], 1.0)),  # (--quick ends within 0.5 s)
        *[(f"Ctrl-C: {after_s:g} s into python -m minipar plan (loading)",
           lambda after_s=after_s: interrupted(["plan", "--model", "gpt2", "--gpus", "8"],
                                               after_s, loading=True))
          for after_s in (0.05, 0.1, 0.2, 0.3)],
    ]


SWITCHES = [("TrainConfig", {"sequence_parallel": "False", "tp": 2}),
            ("TrainConfig", {"tie_embeddings": "false"}),
            ("TrainConfig", {"overlap_grad_reduce": 1}),
            ("TrainConfig", {"cp_load_balance": "no", "cp": 2}),
            ("TrainConfig", {"check": "yes"}),
            ("ParallelConfig", {"sequence_parallel": "no"}),
            ("ParallelConfig", {"flash_attention": 0}),
            ("ModelShape", {"embedding_norm": "True"}),
            ("ModelShape", {"tie_embeddings": "false"}),
            # integers too large to print ({"digits": N}: 10**N)
            ("TrainConfig", {"n_layer": {"digits": 5000}}),
            ("TrainConfig", {"seed": {"digits": 5000}}),
            ("TrainConfig", {"lr": {"digits": 400}}),
            ("ParallelConfig", {"dp": {"digits": 5000}}),
            ("ModelShape", {"d_model": {"digits": 5000}})]
SWITCH_CHILD = r"""
import json, sys
from minipar.errors import ConfigError
kind, settings = sys.argv[1], json.loads(sys.argv[2])
settings = {k: 10 ** v["digits"] if isinstance(v, dict) else v for k, v in settings.items()}
if kind == "TrainConfig":
    from minipar.train import TrainConfig as made
elif kind == "ParallelConfig":
    from minipar.plan.layout import ParallelConfig as made
else:
    from minipar.plan.shapes import ModelShape
    def made(**kw):
        return ModelShape(**{"n_layer": 1, "d_model": 16, "n_head": 2, "vocab_size": 32,
                             "seq_len": 8, **kw})
try:
    made(**settings)
except (ConfigError, ValueError) as err:  # (ModelShape's checks raise ValueError)
    print(err, file=sys.stderr)
    sys.exit(2)
print("accepted")
"""


def switch_case(kind: str, settings: dict) -> tuple[str, str]:
    try:
        result = subprocess.run([sys.executable, "-c", SWITCH_CHILD, kind,
                                 json.dumps(settings)], capture_output=True, text=True,
                                timeout=fuzz_outputs.TIMEOUT_S)
    except subprocess.TimeoutExpired:
        result = None
    outcome = fuzz_outputs.refusal(result)
    named = next(iter(settings))
    if outcome[0] == CLEAN and named not in outcome[1].replace("-", "_"):
        return SILENT, f"refused without naming {named}: {outcome[1]}"
    return outcome


def plan_case(argv: list) -> tuple[str, str]:
    cpu, status, said = plan_extremes.run(argv, limit=fuzz_outputs.TIMEOUT_S * 2.5)
    if cpu is None:
        return HANG, said
    if status != 0:
        return (TRACEBACK if "Traceback" in said or status != 2 else CLEAN), said
    if cpu > PLAN_CPU_S:
        return HANG, f"{cpu:.1f} s of CPU (more than {PLAN_CPU_S:g})"
    return CLEAN, f"{cpu:.1f} s of CPU"


def own_cases(work: Path) -> list:
    """This file's cases: [(name, case)], each case () -> (outcome, detail)."""
    return [*full_disk_cases(work), *ctrl_c_cases(work),
            *[(f"switch {kind}({', '.join(f'{k}={v!r}' for k, v in s.items())})",
               lambda kind=kind, s=s: switch_case(kind, s)) for kind, s in SWITCHES],
            *[(f"plan: {name}", lambda argv=argv: plan_case(argv))
              for name, argv in plan_extremes.CASES]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="this file's cases and the grader's cheap ones")
    parser.add_argument("--verbose", action="store_true", help="one line per case")
    args = parser.parse_args()
    # The Ctrl-C cases need SIGINT to reach the children as it reaches a terminal's
    # command; a shell starts a background job (`fuzz.py &`) with it ignored, which its
    # children inherit, so none of them could be interrupted. A Python handler is not
    # inherited: the children start with the default one.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    say = print if args.verbose else (lambda *a, **k: None)
    counts = collections.Counter()
    tried = 0
    with tempfile.TemporaryDirectory(prefix="minipar-fuzz-") as tmp:
        for name, case in own_cases(Path(tmp)):
            outcome, detail = case()
            counts[outcome] += 1
            tried += 1
            if args.verbose or outcome != CLEAN:
                print(f"  {outcome:15s} {name}: {detail}", flush=True)
    grader = fuzz_grader.fuzz(args.quick, report=print)
    tried += grader["tried"]
    counts.update({kind: grader[kind] for kind in OUTCOMES})
    if not args.quick:
        for name, outcome, detail in fuzz_outputs.run_cases(args.verbose):
            counts[outcome] += 1
            tried += 1
            if outcome != CLEAN and not args.verbose:
                print(f"  {outcome:15s} {name}: {detail}", flush=True)
    say(f"(the children's CPU: {resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime:.0f} s)")
    print(f"tried {tried} / " + " / ".join(f"{o} {counts[o]}" for o in OUTCOMES))
    return 0 if counts[CLEAN] == tried else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
