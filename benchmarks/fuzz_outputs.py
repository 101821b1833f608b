"""Fuzz what minipar saves and reads back: checkpoints that must survive a second run,
runs that share a save directory, files that are not what their names say, profiles of
extreme traces. Prints one line:

    tried N / refused cleanly N / traceback N / hang N / silent wrong N / data lost N

    python benchmarks/fuzz_outputs.py              # ~3-6 min on 2 busy cores
    python benchmarks/fuzz_outputs.py --verbose    # and one line per case
    from fuzz_outputs import run_cases             # [(case, outcome, detail)], for a
                                                   # script that joins several fuzzers

Every case runs minipar in a child process (a timeout of TIMEOUT_S is a hang; the child's
address space is capped so that reading /dev/zero ends in a MemoryError, a traceback,
rather than in the machine's swap). The outcomes:
  refused cleanly  the case ended as it should: the hostile input or the failed write
                   was one line on stderr, exit status 2 (or, where the input is harmless,
                   as a FIFO named manifest.json beside an output, the command did its
                   work), and what had been saved before is still whole
  traceback        a Python traceback (or another exit) instead of one line
  hang             no answer within TIMEOUT_S
  silent wrong     an answer that is wrong and says nothing: a checkpoint mixing two
                   runs that loads, nonsense profile figures (inf, nan, 300 digits), a
                   consolidate that guesses between runs, debris a later save leaves
  data lost        a checkpoint that was complete before the case is gone or broken,
                   or an earlier output file that did not survive

The cases (what a hostile user tried, and more): a second save into the same step killed
(SIGKILL) at each fsync and at random moments, interrupted (SIGINT) at each fsync, or
failing for space after N bytes (simulated by a write that raises ENOSPC, and for real
on a 600 KiB tmpfs where mounting is allowed); two runs saving into one directory at
once, and a rank file of one run under another's resealed manifest; a manifest that is
/dev/zero, a FIFO or nested 100,000 deep; a FIFO rank file; a rank file's size edited
to a 200 GiB sparse file (sealed or not); a FIFO named manifest.json beside an output;
trace files that are FIFOs, /dev/zero, sparse 200 GiB or nested too deep; traces whose
values are each valid but extreme; `consolidate` of a directory holding two runs;
`profile --json` over an earlier file on a full disk.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TIMEOUT_S = 120
MEMORY_CAP = 3 * 2**30  # the child's address space
OUTCOMES = ("refused cleanly", "traceback", "hang", "silent wrong", "data lost")
CLEAN, TRACEBACK, HANG, SILENT, LOST = OUTCOMES
MODEL = ["--seq-len", "8", "--n-layer", "1", "--d-model", "16", "--n-head", "2",
         "--micro-batch-size", "2", "--quiet"]
SMALL = [*MODEL, "--dp", "2", "--zero", "1", "--steps", "2"]

# The child: cap its memory, install the case's fault, run `minipar ARGV` (or train
# through the API with a KeyboardInterrupt turned into exit status 130).
CHILD = r"""
import builtins, errno, json, os, resource, signal, sys
patch = json.loads(sys.argv[1]); argv = sys.argv[2:]
cap = patch.get("memory_cap")
if cap:
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
if "kill_at_fsync" in patch:  # a signal at the k-th fsync (every file, every directory)
    real_fsync, calls = os.fsync, [0]
    def fsync(fd):
        real_fsync(fd)
        calls[0] += 1
        if calls[0] == patch["kill_at_fsync"]:
            os.kill(os.getpid(), getattr(signal, patch["signal"]))
    os.fsync = fsync
if "enospc_after" in patch:  # the save directory fills up after N bytes
    real_open, left = builtins.open, [patch["enospc_after"]]
    class Full:
        def __init__(self, f): self._f = f
        def write(self, data):
            text = isinstance(data, str)
            n = len(data.encode()) if text else memoryview(data).nbytes
            if n > left[0]:
                self._f.write(data[:left[0]] if text else
                              bytes(memoryview(data).cast("B")[:left[0]]))
                left[0] = 0
                raise OSError(errno.ENOSPC, "No space left on device")
            left[0] -= n
            return self._f.write(data)
        def __getattr__(self, name): return getattr(self._f, name)
        def __enter__(self): return self
        def __exit__(self, *exc): return self._f.__exit__(*exc)
    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        inside = str(file).startswith(patch["directory"])
        return Full(f) if inside and any(c in mode for c in "wxa") else f
    builtins.open = full_open
if argv[0] == "api-train":
    from minipar.train import TrainConfig, train
    try:
        train(TrainConfig(**json.loads(argv[1])), save_dir=argv[2])
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0)
from minipar import cli
sys.exit(cli.main(argv))
"""


def child(argv, patch=None, wait=True):
    """Run the child; its CompletedProcess, or None if it hangs (it is killed)."""
    command = [sys.executable, "-c", CHILD, json.dumps({"memory_cap": MEMORY_CAP,
                                                        **(patch or {})}), *map(str, argv)]
    if not wait:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None


def refusal(result) -> tuple[str, str]:
    """One line on stderr and exit status 2 is clean; what else it was."""
    if result is None:
        return HANG, f"no answer in {TIMEOUT_S} s"
    err = result.stderr.strip()
    if "Traceback" in err:
        return TRACEBACK, err.splitlines()[-1][:160]
    if result.returncode == 2 and len(err.splitlines()) == 1:
        return CLEAN, err[:160]
    if result.returncode == 0:
        return SILENT, "accepted: " + (result.stdout.strip().splitlines() or [""])[-1][:120]
    return TRACEBACK, f"exit status {result.returncode}: {err[-160:]}"


def worst(*outcomes: tuple[str, str]) -> tuple[str, str]:
    bad = [o for o in outcomes if o[0] != CLEAN]
    return bad[0] if bad else outcomes[0]


# ------------------------------------------------------------------ checkpoints
def state_of(directory) -> dict | None:
    """The consolidated state dict of a checkpoint, or None if it does not load."""
    from minipar.errors import MiniparError
    from minipar.train.checkpoint import consolidate

    try:
        return consolidate(directory)
    except MiniparError:
        return None


def same(a: dict | None, b: dict | None) -> bool:
    return a is not None and b is not None and a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) for k in a)


def debris(directory: Path) -> list[str]:
    return [p.name for p in directory.rglob("*") if p.name.startswith(".")]


class Saves:
    """The runs the checkpoint cases compare against: run A saved alone, run B (another
    --lr) saved alone, and how long B takes."""

    def __init__(self, work: Path):
        self.work = work
        a, b = work / "ref-a", work / "ref-b"
        started = time.monotonic()
        for directory, extra in ((a, []), (b, ["--lr", "0.002"])):
            result = child(["train", *SMALL, *extra, "--save", directory])
            assert result is not None and result.returncode == 0, result and result.stderr
        self.seconds = (time.monotonic() - started) / 2
        self.a, self.b = state_of(a / "step-000002"), state_of(b / "step-000002")
        self.bytes = sum(p.stat().st_size for p in (b / "step-000002").iterdir())

    def fresh(self, name: str) -> Path:
        """A save directory holding run A's checkpoint, as a second run finds it."""
        directory = self.work / name
        shutil.copytree(self.work / "ref-a", directory)
        return directory

    def judge(self, directory: Path, second) -> tuple[str, str]:
        """After a second save into `directory` failed or died: is a checkpoint there,
        whole (A's, or B's if B finished), and does the next save clean what was left?"""
        if second is None:
            return HANG, "the second run did not end"
        state = state_of(directory / "step-000002")
        if state is None:
            return LOST, "run A's checkpoint is gone or broken"
        if not (same(state, self.a) or same(state, self.b)):
            return SILENT, "step-000002 loads, but is neither run's"
        later = child(["train", *SMALL[:-2], "--steps", "1", "--save", directory])
        left = debris(directory)
        if later is None or later.returncode != 0:
            return refusal(later)
        if left:
            return SILENT, f"left after a later save: {left[:3]}"
        return CLEAN, "the checkpoint survived, the debris went"


def second_save_cases(saves: Saves, rng: random.Random):
    config = dict(seq_len=8, n_layer=1, d_model=16, n_head=2, micro_batch_size=2, dp=2,
                  zero=1, steps=2, lr=0.002)
    for k in range(1, 5):
        yield f"second save, SIGKILL at fsync {k}", lambda k=k: _faulted(
            saves, f"kill{k}", {"kill_at_fsync": k, "signal": "SIGKILL"})
    for k in range(1, 4):
        yield f"second save, SIGINT at fsync {k}", lambda k=k: _faulted(
            saves, f"int{k}", {"kill_at_fsync": k, "signal": "SIGINT"}, api=config)
    for n in (0, 100, *(int(f * saves.bytes) for f in (0.3, 0.6, 0.95))):
        yield f"second save, disk full after {n} bytes", lambda n=n: _faulted(
            saves, f"full{n}", {"enospc_after": n}, expect_refusal=True)
    for i in range(4):
        delay = rng.uniform(0.2, 1.0) * saves.seconds
        yield f"second run, SIGKILL after {delay:.1f} s", lambda i=i, d=delay: _killed_at(
            saves, f"random{i}", d)


def _faulted(saves: Saves, name: str, patch: dict, api=None, expect_refusal=False):
    directory = saves.fresh(name)
    patch = {**patch, "directory": str(directory)}
    if api is not None:
        second = child(["api-train", json.dumps(api), directory], patch)
    else:
        second = child(["train", *SMALL, "--lr", "0.002", "--save", directory], patch)
    outcome = saves.judge(directory, second)
    if expect_refusal and outcome[0] == CLEAN:
        return refusal(second)
    return outcome


def _killed_at(saves: Saves, name: str, delay: float):
    directory = saves.fresh(name)
    process = child(["train", *SMALL, "--lr", "0.002", "--save", directory], wait=False)
    time.sleep(delay)
    process.kill()
    process.communicate()
    return saves.judge(directory, process)


def tmpfs_recipe(work: Path):
    """The issue's recipe on a real 600 KiB tmpfs (skipped where mounting is refused)."""
    disk = work / "tmpfs"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", disk],
                             capture_output=True)
    if mounted.returncode != 0:
        return None
    try:
        flags = ["--seq-len", "8", "--n-layer", "2", "--d-model", "32", "--n-head", "2",
                 "--micro-batch-size", "2", "--steps", "2", "--quiet", "--save", disk / "ck"]
        first = child(["train", *flags])
        if first is None or first.returncode != 0:
            return refusal(first)
        second = refusal(child(["train", *flags, "--lr", "0.002"]))
        result = child(["consolidate", disk / "ck", work / "tmpfs-model.npz"])
        if result is None or result.returncode != 0:
            return LOST, "consolidate refuses the first run's checkpoint"
        return second
    finally:
        subprocess.run(["umount", disk], capture_output=True)


def concurrent_runs(work: Path, trial: int):
    """Two runs (another --lr each) saving every step into one directory at once: every
    checkpoint there must load as one run's (it is), or be refused (data lost: both runs
    said they saved it)."""
    steps = ["--steps", "6", "--save-every", "1", "--dp", "2", "--zero", "3"]
    small = MODEL
    refs = {}
    for lr in ("0.001", "0.002"):
        directory = work / f"alone-{lr}"
        if not directory.exists():
            result = child(["train", *small, *steps, "--lr", lr, "--save", directory])
            assert result is not None and result.returncode == 0, result and result.stderr
        refs[lr] = directory
    shared = work / f"shared{trial}"
    runs = [child(["train", *small, *steps, "--lr", lr, "--save", shared], wait=False)
            for lr in refs]
    for run in runs:
        try:
            run.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            run.kill()
            return HANG, "a run did not end"
    for step in range(1, 7):
        name = f"step-{step:06d}"
        state = state_of(shared / name)
        if state is None:
            return LOST, f"{name} does not load"
        if not any(same(state, state_of(ref / name)) for ref in refs.values()):
            return SILENT, f"{name} loads, but mixes the two runs"
    return CLEAN, "every checkpoint is one run's"


def resealed(directory: Path, edit) -> None:
    from minipar.train import manifest as schema

    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    manifest[schema.SEAL] = schema.seal(manifest)
    path.write_text(json.dumps(manifest))


def hostile_checkpoints(saves: Saves):
    """A checkpoint whose files are not what they say: consolidate must refuse it."""
    def prepared(name, damage):
        def case():
            directory = saves.fresh(name) / "step-000002"
            damage(directory)
            return refusal(child(["consolidate", directory, saves.work / f"{name}.npz"]))
        return case

    def swap(target, make):
        def damage(directory):
            (directory / target).unlink()
            make(directory / target)
        return damage

    def sparse(size, seal):
        def damage(directory):
            with open(directory / "rank-00000.npz", "r+b") as f:
                f.truncate(size)
            if seal:
                resealed(directory, lambda m: m["files"][0].update(bytes=size))
            else:
                manifest = json.loads((directory / "manifest.json").read_text())
                manifest["files"][0]["bytes"] = size
                (directory / "manifest.json").write_text(json.dumps(manifest))
        return damage

    def fifo_rank_file(directory):
        swap("rank-00001.npz", os.mkfifo)(directory)
        resealed(directory, lambda m: m["files"][1].update(bytes=0))

    def other_run(directory):
        theirs = saves.work / "ref-b" / "step-000002" / "rank-00001.npz"
        data = theirs.read_bytes()
        (directory / "rank-00001.npz").write_bytes(data)
        resealed(directory, lambda m: m["files"][1].update(
            bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))

    yield "manifest -> /dev/zero", prepared("zero", swap(
        "manifest.json", lambda p: p.symlink_to("/dev/zero")))
    yield "manifest a FIFO", prepared("fifo-m", swap("manifest.json", os.mkfifo))
    yield "manifest nested 100,000 deep", prepared("deep", lambda d: (
        d / "manifest.json").write_text("[" * 100_000 + "]" * 100_000))
    yield "rank file a FIFO (resealed)", prepared("fifo-r", fifo_rank_file)
    yield "bytes edited to a 2 GiB sparse file", prepared("sparse2", sparse(2 * 2**30, False))
    yield "bytes resealed to a 200 GiB sparse file", prepared("sparse200",
                                                               sparse(200 * 2**30, True))
    yield "another run's rank file, resealed", prepared("mixed", other_run)


def fifo_beside_output(work: Path):
    folder = work / "fifo-out"
    folder.mkdir()
    os.mkfifo(folder / "manifest.json")
    result = child(["train", *SMALL, "--json", folder / "r.json"])
    if result is None or result.returncode != 0:
        return refusal(result)
    return CLEAN, "the FIFO is not taken for a checkpoint"


def consolidate_two_runs(work: Path):
    directory = work / "two-runs"
    first = child(["train", *SMALL, "--save-every", "1", "--save", directory])
    second = child(["train", *SMALL[:-2], "--steps", "3", "--lr", "0.002", "--save-every", "3",
                    "--save", directory])
    if first is None or second is None or first.returncode or second.returncode:
        return TRACEBACK, "the runs did not save"
    guessed = refusal(child(["consolidate", directory, work / "two.npz"]))
    if guessed[0] != CLEAN:
        return guessed
    named = child(["consolidate", directory / "step-000003", work / "two.npz"])
    if named is None or named.returncode != 0 or "step 3" not in named.stdout:
        return SILENT, "consolidate of a named checkpoint does not say its run and step"
    return guessed


# ------------------------------------------------------------------ traces and profiles
def trace_cases(work: Path):
    good = work / "trace"
    result = child(["train", *SMALL, "--trace", good])
    assert result is not None and result.returncode == 0, result and result.stderr

    def edited(name, edit, every_file=False):
        def case():
            folder = work / f"trace-{name}"
            shutil.copytree(good, folder)
            for path in sorted(folder.glob("rank*.json"))[: None if every_file else 1]:
                edit(path)
            result = child(["profile", folder])
            if result is not None and result.returncode == 0:
                return nonsense(result.stdout)
            return refusal(result)
        return case

    def swap(make):
        def edit(path):
            path.unlink()
            make(path)
        return edit

    def json_edit(change):
        def edit(path):
            trace = json.loads(path.read_text())
            change(trace)
            path.write_text(json.dumps(trace))
        return edit

    def kernels(trace, compute=True):
        return [e for e in trace["traceEvents"] if e.get("cat") == "kernel"
                and (e["args"]["stream"] == 7) == compute]

    def every(key, value, compute=True):
        return json_edit(lambda t: [e["args"].__setitem__(key, value)
                                    for e in kernels(t, compute)])

    def memory(nbytes):
        def change(trace):
            peak = trace["minipar"]["memory_peak"]
            peak["by_category"]["params"] += nbytes - peak["bytes"]
            peak["bytes"] = nbytes
        return json_edit(change)

    def sparse(path):
        with open(path, "wb") as f:
            f.truncate(200 * 2**30)

    yield "trace a FIFO", edited("fifo", swap(os.mkfifo))
    yield "trace -> /dev/zero", edited("zero", swap(lambda p: p.symlink_to("/dev/zero")))
    yield "trace a 200 GiB sparse file", edited("sparse", swap(sparse))
    yield "trace nested 100,000 deep", edited("deep", lambda p: p.write_text("[" * 100_000))
    yield "kernel FLOPs 1e300", edited("f300", json_edit(
        lambda t: kernels(t)[0]["args"].__setitem__("flops", 1e300)))
    yield "every kernel 1e308 FLOPs", edited("f308", every("flops", 1e308))
    yield "sent_bytes 1e308", edited("sent", every("sent_bytes", 1e308, compute=False))
    yield "end_s 1e300", edited("end", json_edit(
        lambda t: t["minipar"].__setitem__("end_s", 1e300)))
    yield "memory peak 10**400 bytes", edited("mem400", memory(10**400))
    yield "memory peak 1.7e308 bytes", edited("mem308", memory(int(1.7e308)))
    yield "device 1e-300 FLOP/s", edited("slow", json_edit(
        lambda t: t["minipar"]["device"].__setitem__("flops", 1e-300)), every_file=True)
    yield "every kernel 1e-300 FLOPs", edited("tiny", every("flops", 1e-300),
                                              every_file=True)
    yield "device 1e308 FLOP/s (valid)", edited("fast", json_edit(
        lambda t: t["minipar"]["device"].__setitem__("flops", 1e308)), every_file=True)
    yield "profile --json over a file, disk full", lambda: profile_json_full(work, good)


def nonsense(text: str) -> tuple[str, str]:
    """A profile printed: clean unless a figure in it is inf, nan or 40 digits long."""
    words = text.replace(",", " ").split()
    bad = [w for w in words if w.strip("%()").lower() in ("inf", "nan", "-inf")
           or sum(c.isdigit() for c in w) > 40]
    return (SILENT, f"printed {bad[0][:60]}") if bad else (CLEAN, "a sane profile")


def profile_json_full(work: Path, good: Path):
    earlier = work / "p.json"
    earlier.write_text('{"earlier": true}')
    result = child(["profile", good, "--json", earlier],
                   {"enospc_after": 100, "directory": str(work)})
    try:
        whole = json.loads(earlier.read_text()) == {"earlier": True}
    except ValueError:
        whole = False
    if not whole:
        return LOST, "the earlier --json file was destroyed"
    return refusal(result)


# ------------------------------------------------------------------ all of them
def run_cases(verbose: bool = False, seed: int = 0) -> list[tuple[str, str, str]]:
    """Every case, run: [(case, outcome, detail)]."""
    rng = random.Random(seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="minipar-fuzz-outputs-") as tmp:
        work = Path(tmp)
        saves = Saves(work)
        cases = [*second_save_cases(saves, rng),
                 ("tmpfs 600 KiB: the issue's recipe", lambda: tmpfs_recipe(work)),
                 *[(f"two runs saving at once, trial {i}", lambda i=i: concurrent_runs(work, i))
                   for i in range(3)],
                 *hostile_checkpoints(saves),
                 ("a FIFO manifest.json beside --json", lambda: fifo_beside_output(work)),
                 ("consolidate a directory of two runs", lambda: consolidate_two_runs(work)),
                 *trace_cases(work)]
        for name, case in cases:
            outcome = case()
            if outcome is None:  # not possible here (a tmpfs without root)
                continue
            results.append((name, *outcome))
            if verbose:
                print(f"  {outcome[0]:15s} {name}: {outcome[1]}", flush=True)
    return results


def summary(results) -> str:
    counts = collections.Counter(outcome for _, outcome, _ in results)
    return f"tried {len(results)} / " + " / ".join(f"{o} {counts[o]}" for o in OUTCOMES)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", action="store_true", help="one line per case")
    parser.add_argument("--seed", type=int, default=0, help="of the random kill moments")
    args = parser.parse_args()
    results = run_cases(args.verbose, args.seed)
    print(summary(results))
    return 0 if all(outcome == CLEAN for _, outcome, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
