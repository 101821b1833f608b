"""Fuzz the exercise grader with hand-ins written to break or fool it; one line of totals.

    python benchmarks/fuzz_grader.py            # every case (~1-2 min on 2 cores)
    python benchmarks/fuzz_grader.py --quick    # the cheap ones

Prints "tried N / refused cleanly N / traceback N / hang N / silent wrong N / data lost N"
(the last four must be 0), and one line per case that is not "refused cleanly". Each case
is a file handed in with `python -m exercises.check NN --file FILE`, run from a fresh copy
of exercises/ (minipar from this checkout), none of which solves its exercise:

- refused cleanly: exit status 1 (2 for a file that cannot be checked), the grader's own
  last line, no traceback of the grader's;
- traceback: "Traceback" in what the grader printed (what the file printed is marked);
- hang: no exit within the case's limit;
- silent wrong: exit status 0, or any other than 1 and 2;
- data lost: the copy's exercises/ (solutions included) or minipar/ differ afterwards, or
  a file the user owns outside them (a canary) was changed or removed.

The whole-CLI fuzzer calls `fuzz()` and adds its tally to its own (`line(tally)`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = ROOT / "tests" / "exercises" / "hostile"
KINDS = ("refused cleanly", "traceback", "hang", "silent wrong", "data lost")
MARK = "  | "  # how the grader marks the file's own output (grader.OUTPUT_MARK)
# The grader with a 3 s import allowance, so that a loop at import costs 3 s, not 30.
GRADER = ("import sys; import exercises.check as check; check.IMPORT_TIMEOUT = 3; "
          "sys.exit(check.main(sys.argv[1:]))")

RING = """
import numpy as np
from minipar import distributed as dist

def ring_neighbours(group=None):
    ranks = list(range(dist.get_world_size())) if group is None else list(group.ranks)
    me = ranks.index(dist.get_rank())
    return me, len(ranks), ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
"""

# The reference ring, and a ring_all_reduce that does `{then}` and returns its result: the
# cases that must get past the worker (whose checks it passes) start from it.
SOLUTION = (ROOT / "exercises" / "solutions" / "ex01_ring_allreduce.py").read_text()
CORRECT = SOLUTION.replace("{", "{{").replace("}", "}}") + """
_ring = ring_all_reduce

def ring_all_reduce(x, group=None):
    {then}
    return _ring(x, group=group)
"""
SPEC = "import json, os, sys\nSPEC = json.loads(sys.argv[1])\n"  # the process's own spec

# (name, exercise, source of the hand-in, quick?, seconds allowed). {canary} is a file the
# case may try to damage.
CASES = [
    ("write a file outside", "01",
     "open({canary!r}, 'w').write('gone')\n" + RING, True, 60),
    ("remove a file outside", "01", "import os\nos.remove({canary!r})\n" + RING, True, 60),
    ("kill the grader", "01", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
     + RING, True, 60),
    ("stop the grader", "01", "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n"
     + RING, False, 60),
    ("garbage into the grader's pipe", "03",
     "import json, os, sys\nos.write(json.loads(sys.argv[1])['events'], b'\\xff' * 64)\n",
     True, 60),
    ("close stdout and stderr", "01", "import os\nos.close(1)\nos.close(2)\n" + RING,
     False, 60),
    ("ten megabytes of output", "01", "print('x' * 10_000_000)\n" + RING, False, 60),
    ("a child process that sleeps", "01",
     "import os, time\nif os.fork() == 0:\n    time.sleep(30)\n    os._exit(0)\n" + RING,
     False, 60),
    ("a detached process", "01",
     "import os, subprocess, sys\nsubprocess.Popen([sys.executable, '-c', "
     "'import time; time.sleep(5)'], start_new_session=True)\n" + RING, False, 60),
    ("a loop at import", "01", "while True:\n    pass\n", False, 60),
    ("a loop in the function", "01", RING + "\ndef ring_all_reduce(x, group=None):\n"
     "    while True:\n        pass\n", False, 90),
    ("a rank that sends to itself", "01", RING + "\ndef ring_all_reduce(x, group=None):\n"
     "    dist.isend(x, dist.get_rank()).wait()\n    return x\n", False, 60),
    ("a rank that sends garbage to the grader", "01", SPEC + CORRECT.replace(
        "{then}", "if 'to_grader' in SPEC:\n        os.write(SPEC['to_grader'], "
        "b'\\x00\\x00\\x00\\x05[[[[[')"), False, 60),
    ("a rank that never returns", "01", SPEC + CORRECT.replace(
        "{then}", "while 'to_grader' in SPEC:\n        pass"), False, 90),
    ("a thread left running, a wrong ring", "01", "import threading, time\n"
     "threading.Thread(target=time.sleep, args=(60,), daemon=False).start()\n" + RING
     + "\ndef ring_all_reduce(x, group=None):\n    return x\n", True, 60),
    ("returns an object", "05", "def compute_order(pp, m, stage):\n    return object()\n"
     "def one_f_one_b(pp, m):\n    return [[object()]] * pp\n", False, 60),
    ("a list nested 100,000 deep", "07", "x = []\nfor _ in range(100_000):\n    x = [x]\n"
     "def zb_h1_compute_order(pp, m, rank):\n    return x\n", False, 60),
    # Exercises 08-13: plans, counts, configs and layouts built to slip past their checks.
    ("a plan padded with 20,000 gathers", "08",
     "def zero3_actions(n_units, prefetch):\n    plan = [('gather', 0), ('free', 0)] * 20_000\n"
     "    for kind, order in (('forward', range(n_units)), "
     "('backward', reversed(range(n_units)))):\n"
     "        for u in order:\n            plan += [('gather', u), ('wait', u), (kind, u), "
     "('free', u)]\n    return plan\n", True, 60),
    ("hooks that raise", "09", "class Zero2Gradients:\n    def __init__(self, *a, **k):\n"
     "        raise SystemExit(0)\n", True, 60),
    ("a g that returns None", "10", "def _none(*args, **kwargs):\n    return None\n"
     "class GatherFromSequenceParallelRegion:\n    apply = staticmethod(_none)\n"
     "class ReduceScatterToSequenceParallelRegion:\n    apply = staticmethod(_none)\n"
     "sequence_parallel_mlp = allreduce_sequence_parallel_grads = _none\n", True, 60),
    ("an empty array for bytes", "11", "import numpy as np\n"
     "def layer_activation_bytes(config):\n    return np.array([], dtype=np.int64)\n"
     "activation_peak = lambda config, rank, terms: np.array([], dtype=np.int64)\n",
     True, 60),
    ("bytes too large to print", "11", "def layer_activation_bytes(config):\n"
     "    return 10 ** 5000\ndef activation_peak(config, rank, terms):\n"
     "    return -10 ** 5000\n", True, 60),
    ("a port of another, larger model", "12",
     "import math\ndef port_recipe(recipe, n_gpus, max_micro_batch):\n"
     "    g = recipe.micro_batch_size * recipe.grad_accum_steps\n"
     "    grown = -(-g // n_gpus) * n_gpus\n    k = grown / g\n"
     "    m = max(x for x in range(1, min(max_micro_batch, grown // n_gpus) + 1) "
     "if grown // n_gpus % x == 0)\n"
     "    return recipe.replace(dp=n_gpus, micro_batch_size=m, "
     "grad_accum_steps=grown // n_gpus // m, lr=recipe.lr * math.sqrt(k), "
     "min_lr=recipe.min_lr * math.sqrt(k), steps=round(recipe.steps / k), "
     "warmup_steps=round(recipe.warmup_steps / k), seed=1, "
     "d_model=(512 if k != 1 else recipe.d_model), n_layer=(8 if k != 1 else recipe.n_layer))\n",
     True, 60),
    ("a port set around the config's checks", "12",
     "def port_recipe(recipe, n_gpus, max_micro_batch):\n"
     "    port = recipe.replace(dp=n_gpus)\n"
     "    object.__setattr__(port, 'grad_accum_steps', 10 ** 5000)\n    return port\n",
     True, 60),
    ("a layout of 10**5000 GPUs", "13",
     "def choose_layout(task):\n    return dict(dp=10 ** 5000, tp=1, pp=1, zero=0, "
     "micro_batch_size=1, sequence_parallel=False, recompute=None, memory_gib=1.0, "
     "bottleneck='compute', why='dp ' * 20)\n", True, 60),
    ("an expression nested 100,000 deep", "01", "x = " + "(" * 100_000 + "1" + ")" * 100_000
     + "\n", True, 60),
    ("not UTF-8", "01", "# \udcff\n", True, 60),
    ("larger than the grader reads", "01", "#" * 2_000_000 + "\n", True, 60),
    ("a syntax error", "01", "def ring_all_reduce(x, group=None)\n", True, 60),
]


def tally() -> dict:
    return {"tried": 0, **dict.fromkeys(KINDS, 0)}


def line(counts: dict) -> str:
    return " / ".join(f"{name} {counts[name]}" for name in ("tried", *KINDS))


def _digest(*trees: Path) -> str:
    total = hashlib.sha256()
    for tree in trees:
        for path in sorted(tree.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                total.update(str(path).encode() + path.read_bytes())
    return total.hexdigest()


def _judge(result, seconds_allowed: float, before: str, after: str, canary_ok: bool) -> str:
    if result is None:
        return "hang"
    if before != after or not canary_ok:
        return "data lost"
    returncode, out, err = result
    own = [text for text in out.splitlines() if not text.startswith(MARK)]
    if "Traceback" in err or any("Traceback" in text for text in own):
        return "traceback"
    if returncode not in (1, 2):
        return "silent wrong"
    if returncode == 1 and not (own and " checks pass" in own[-1]):
        return "traceback"  # ended without the grader's verdict line
    return "refused cleanly"


def run_case(name, exercise, source, seconds_allowed, folder: Path) -> str:
    """One case in its own copy of exercises/; its kind (KINDS)."""
    checkout = folder / name.replace(" ", "-").replace(",", "")
    shutil.copytree(ROOT / "exercises", checkout / "exercises",
                    ignore=shutil.ignore_patterns("__pycache__"))
    canary = checkout / "canary.txt"
    canary.write_text("keep")
    hand_in = checkout / "hand-in" / f"{name.replace(' ', '_').replace(',', '')}.py"
    hand_in.parent.mkdir()
    hand_in.write_bytes(source.format(canary=str(canary)).encode("utf-8", "surrogateescape"))
    before = _digest(checkout / "exercises", ROOT / "minipar")
    env = {**os.environ, "MINIPAR_CACHE_DIR": "off",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-c", GRADER, exercise, "--file", str(hand_in)],
                               cwd=checkout, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = process.communicate(timeout=seconds_allowed)
        result = (process.returncode, out.decode(errors="replace"),
                  err.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        result = None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.communicate()
    canary_ok = canary.exists() and canary.read_text() == "keep"
    return _judge(result, seconds_allowed, before,
                  _digest(checkout / "exercises", ROOT / "minipar"), canary_ok)


def hostile_cases() -> list:
    """The hand-ins of tests/exercises/hostile/ (none solves its exercise)."""
    exercise = {"forge_report": "03", "patch_checker_05": "05"}
    return [(path.stem, exercise.get(path.stem, "01"),
             path.read_text().replace("{", "{{").replace("}", "}}"), True, 60)
            for path in sorted(HOSTILE.glob("*.py"))]


def fuzz(quick: bool = False, report=print) -> dict:
    """Run the cases; return their tally; `report` gets a line per case not refused
    cleanly."""
    counts = tally()
    with tempfile.TemporaryDirectory(prefix="fuzz-grader-") as folder:
        for name, exercise, source, cheap, seconds in hostile_cases() + CASES:
            if quick and not cheap:
                continue
            counts["tried"] += 1
            kind = run_case(name, exercise, source, seconds, Path(folder))
            counts[kind] += 1
            if kind != "refused cleanly":
                report(f"  {name} ({exercise}): {kind}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the cheap cases")
    counts = fuzz(parser.parse_args(argv).quick)
    print(line(counts))
    return 0 if counts["tried"] == counts["refused cleanly"] else 1


if __name__ == "__main__":
    sys.exit(main())
