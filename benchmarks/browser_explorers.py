"""The explorers in a real browser: how long a quick reader waits for each picture, and
for the status line, timed in the page; and screenshots of the notebooks.

    apt-get install chromium chromium-driver                  # Debian's packages
    python3 -m venv /tmp/browser && /tmp/browser/bin/pip install selenium
    /tmp/browser/bin/python benchmarks/browser_explorers.py --python .venv/bin/python
    /tmp/browser/bin/python benchmarks/browser_explorers.py --python .venv/bin/python \\
        --screenshots shots/ --notebooks 00_tour 03_zero 05_pipeline_parallel 06_3d_combined

Runs in its own venv (selenium is no dependency of minipar's): it starts JupyterLab 4
with the project's Python (`--python`, whose minipar is this tree's: PYTHONPATH is set
to it), on a fresh MINIPAR_CACHE_DIR, and headless Chromium. It writes a notebook of
the four explorers at their defaults, runs it, and then makes CHANGES changes, one
control at a time, one every --gap seconds whatever the explorers do (a quick reader),
spread across the four explorers, with --busy processes spinning on the CPU meanwhile
(two: "2 cores with two busy processes beside it"). Most changes go to settings of the
explorers' lattices (measured beforehand, minipar/viz/lattice.py), a few to settings
outside them (measured when asked for): which is which is asked of minipar itself.

Timed in the page, from the moment the script changes the control (the DOM event a click
makes): "status", until the explorer's status line has changed (a MutationObserver) and
been painted (the next animation frame); and "picture", until the explorer's pictures
show the new setting (the `data-setting` minipar/viz/pictures.js writes once it has
drawn them) and have been painted. A change superseded by the next one before its picture came
is counted as such. Reported: every change, then the median and 95th percentile of the
picture times of lattice settings and of the others, the slowest status line, and the
load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--window-size=1280,1600"]
EXPLORERS = ["ShardingExplorer", "MemoryExplorer", "PipelineExplorer", "TrafficExplorer"]

# The quick reader's 50 changes: (explorer, control, value), one control each. The
# notebooks' suggestions ("try ZeRO 0 to 3", the kinds of state, offload, schedules, p
# and m, layouts and micro-batches), turning from one explorer to another; `*` marks the
# settings outside the lattices (64 ranks; two of the step's settings changed at once).
PATH = [
    (0, "pp", 1), (0, "zero", 2), (0, "zero", 3), (0, "kind", "params"), (0, "kind", "grads"),
    (1, "zero", 1), (1, "zero", 2), (1, "zero", 3), (1, "offload_optimizer", "cpu"),
    (1, "offload_param", "cpu"),
    (2, "schedule", "gpipe"), (2, "micro_batches", 4), (2, "micro_batches", 16),
    (2, "schedule", "1f1b"), (2, "pp", 8),
    (3, "zero", 0), (3, "by", "op"), (3, "tp", 4), (3, "gpus_per_node", 8),
    (3, "dp", 8),  # * 64 ranks
    (3, "pp", 1), (3, "precision", "bf16-mixed"),
    (0, "tensor", "h.1.attn.c_attn.weight"), (0, "tp", 4), (0, "dp", 4), (0, "zero", 1),
    (1, "offload_param", "none"), (1, "offload_optimizer", "none"), (1, "dp", 8),
    (1, "recompute_granularity", "full"),
    (1, "micro_batch_size", 8),  # * checkpointing and micro-batch size 8 at once
    (1, "micro_batch_size", 4), (1, "tp", 2),
    (2, "pp", 4), (2, "schedule", "zb-h1"), (2, "schedule", "zb-h2"), (2, "micro_batches", 8),
    (2, "schedule", "gpipe"),
    (3, "grad_accum_steps", 4), (3, "zero", 1), (3, "by", "group"), (3, "tp", 1),
    (0, "kind", "optimizer"), (0, "zero", 0),
    (1, "precision", "fp32"), (1, "zero", 1),
    (2, "schedule", "1f1b"), (2, "micro_batches", 12),
    (3, "dp", 4), (3, "pp", 2),
]

OBSERVE = """
window.miniparTimes = {status: [], picture: []};
const roots = document.querySelectorAll('.minipar-pictures');
roots.forEach((root, k) => {
  new MutationObserver(() => {
    const setting = root.dataset.setting, seen = performance.now();
    const drawing = parseFloat(root.dataset.drawMs);
    requestAnimationFrame(() => requestAnimationFrame(() => window.miniparTimes.picture.push(
      {k, setting, seen, drawing, painted: performance.now()})));
  }).observe(root, {attributes: true, attributeFilter: ['data-setting']});
  const box = root.closest('.widget-vbox');
  const status = box.children[1];
  new MutationObserver(() => {
    const text = status.textContent, seen = performance.now();
    requestAnimationFrame(() => requestAnimationFrame(() => window.miniparTimes.status.push(
      {k, seen, t: performance.now(), text})));
  }).observe(status, {childList: true, subtree: true, characterData: true});
});
return roots.length;
"""

# Set control `name` of explorer k to `value`, as a reader does: a <select>'s option,
# a check box's click, a slider's readout typed in; returns the time of the DOM event.
CHANGE = """
const [k, label, value] = arguments;
const box = document.querySelectorAll('.minipar-pictures')[k].closest('.widget-vbox');
const control = Array.from(box.querySelectorAll('.widget-inline-hbox')).find(c =>
  [c.querySelector('.widget-label'), c.querySelector('.widget-label-basic')].some(
    l => l && l.textContent.trim() === label));
let t;
const select = control.querySelector('select');
if (select) {
  const index = Array.from(select.options).findIndex(o => o.textContent.trim() === value);
  select.selectedIndex = index;
  t = performance.now();
  select.dispatchEvent(new Event('change', {bubbles: true}));
} else if (control.querySelector('input[type=checkbox]')) {
  t = performance.now();
  control.querySelector('input[type=checkbox]').click();
} else {
  const readout = control.querySelector('.widget-readout');
  readout.textContent = value;
  t = performance.now();
  readout.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter', keyCode: 13,
                                                      bubbles: true}));
  readout.blur();
}
return t;
"""

CLASSIFY = """
import json, sys
from minipar.viz import widgets
from minipar.viz.lattice import key_text
made = [getattr(widgets, name)(prefetch=False) for name in {explorers!r}]
answers = []
for k, name, value in json.loads(sys.stdin.read()):
    explorer = made[k]
    explorer.set(**{{name: value}})
    values = explorer.values()
    answers.append([key_text(values), key_text(explorer.measured(values))
                    in explorer.measurements.shipped, explorer.controls[name].description,
                    explorer.error is not None])
print(json.dumps(answers))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def notebook(cells: list[str]) -> dict:
    return {"cells": [{"cell_type": "code", "execution_count": None, "id": str(i),
                       "metadata": {}, "outputs": [], "source": source}
                      for i, source in enumerate(cells)],
            "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                        "name": "python3"}},
            "nbformat": 4, "nbformat_minor": 5}


class Lab:
    """JupyterLab on a free port, serving `root`, with this tree's minipar."""

    def __init__(self, python: str, root: pathlib.Path, cache: pathlib.Path):
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MINIPAR_CACHE_DIR": str(cache)}
        self.process = subprocess.Popen(
            [python, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip", "127.0.0.1",
             "--port", str(self.port), "--ServerApp.token=", "--ServerApp.password=",
             f"--ServerApp.root_dir={root}"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                return
            except OSError:
                time.sleep(0.3)
        raise SystemExit("JupyterLab did not start")

    def stop(self) -> None:
        self.process.terminate()  # its kernels stop with it
        self.process.wait(30)


def browser(profile: pathlib.Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


def run_all(driver, lab: Lab, name: str, roots: int, timeout: float = 240.0) -> float:
    """Open notebook `name`, Run All, wait for `roots` explorers drawn and the kernel idle;
    the seconds it took."""
    from selenium.webdriver.common.by import By

    driver.get(f"http://127.0.0.1:{lab.port}/lab/tree/{name}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not driver.find_elements(By.CSS_SELECTOR,
                                                                   ".jp-Notebook"):
        time.sleep(0.3)
    time.sleep(3)  # the kernel starts
    started = time.monotonic()
    for text in ("Run", "Run All Cells"):
        for element in driver.find_elements(By.XPATH, f"//*[normalize-space(text())='{text}']"):
            if element.is_displayed():
                element.click()
                break
        time.sleep(0.5)
    deadline = started + timeout
    while time.monotonic() < deadline:
        drawn = driver.execute_script(
            "return Array.from(document.querySelectorAll('.minipar-pictures'))"
            ".filter(r => r.dataset.drawn).length")
        idle = driver.execute_script(
            "return document.querySelector('.jp-Notebook-ExecutionIndicator')"
            "?.getAttribute('data-status') ?? 'idle'")
        busy = driver.find_elements(By.XPATH, "//*[contains(@class,'jp-InputPrompt') and "
                                              "contains(text(),'[*]')]")
        if drawn >= roots and idle == "idle" and not busy:
            return time.monotonic() - started
        time.sleep(0.5)
    raise SystemExit(f"{name}: Run All did not finish in {timeout:.0f} s")


def screenshots(driver, lab: Lab, names: list[str], out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = f"notebooks/{name}.ipynb"
        expected = {"00_tour": 1, "03_zero": 2, "05_pipeline_parallel": 2,
                    "06_3d_combined": 2}.get(name, 0)
        took = run_all(driver, lab, path, expected, timeout=600)
        errors = driver.execute_script(
            "return document.querySelectorAll('.jp-OutputArea-output[data-mime-type="
            "\"application/vnd.jupyter.stderr\"]').length")
        print(f"{name}: Run All {took:.0f} s, {errors} stderr outputs")
        roots = driver.execute_script("return document.querySelectorAll('.minipar-pictures')"
                                      ".length")
        for k in range(roots):
            driver.execute_script("document.querySelectorAll('.minipar-pictures')[arguments[0]]"
                                  ".closest('.widget-vbox').scrollIntoView()", k)
            time.sleep(1.0)
            driver.save_screenshot(str(out / f"{name}-explorer{k}.png"))
        driver.execute_script("document.querySelector('.jp-Notebook').scrollTop = 0")
        time.sleep(0.5)
        driver.save_screenshot(str(out / f"{name}-top.png"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def measure(driver, lab: Lab, args) -> int:
    path = PATH[:args.changes]
    classified = json.loads(subprocess.run(
        [args.python, "-c", CLASSIFY.format(explorers=EXPLORERS)],
        input=json.dumps(path), capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "MINIPAR_CACHE_DIR": "off"}).stdout)
    took = run_all(driver, lab, "explorers.ipynb", len(EXPLORERS))
    print(f"Run All: {took:.1f} s")
    assert driver.execute_script(OBSERVE) == len(EXPLORERS)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    before = load()
    changes = []
    try:
        time.sleep(2)
        for (k, _, value), (setting, on_lattice, label, refused) in zip(path, classified,
                                                                          strict=True):
            t = driver.execute_script(CHANGE, k, label, str(value))
            changes.append({"k": k, "label": label, "value": value, "t": t,
                            "setting": setting, "lattice": on_lattice, "refused": refused})
            time.sleep(args.gap)
        time.sleep(max(5.0, args.gap))  # the last answers
        times = driver.execute_script("return window.miniparTimes")
    finally:
        for process in busy:
            process.kill()
    after = load()
    # each change: its status line's first change after it, its picture's first drawing
    for i, change in enumerate(changes):
        until = changes[i + 1]["t"] if i + 1 < len(changes) else float("inf")
        status = [s["t"] for s in times["status"] if s["k"] == change["k"]
                  and s["seen"] >= change["t"]]
        drawn = [p["painted"] for p in times["picture"] if p["k"] == change["k"]
                 and p["setting"] == change["setting"] and p["seen"] >= change["t"]]
        change["status_ms"] = (status[0] - change["t"]) if status else None
        change["picture_ms"] = (drawn[0] - change["t"]) if drawn else None
        change["drawing_ms"] = next((p["drawing"] for p in times["picture"]
                                     if p["k"] == change["k"] and p["setting"] ==
                                     change["setting"] and p["seen"] >= change["t"]), None)
        change["superseded"] = bool(drawn) and drawn[0] > until and not change["lattice"]
    print(f"\n{'#':>3} {'explorer':16} {'change':32} {'lattice':>7} {'status ms':>9} "
          f"{'picture ms':>10} {'of it, SVG':>10}")
    for i, c in enumerate(changes):
        status = "-" if c["status_ms"] is None else f"{c['status_ms']:.0f}"
        picture = "-" if c["picture_ms"] is None else f"{c['picture_ms']:.0f}"
        drawing = "-" if c["drawing_ms"] is None else f"{c['drawing_ms']:.0f}"
        what = f"{c['label']} = {c['value']}" + (" (refused)" if c["refused"] else "")
        print(f"{i + 1:>3} {EXPLORERS[c['k']]:16} {what:32} {'yes' if c['lattice'] else 'no':>7} "
              f"{status:>9} {picture:>10} {drawing:>10}")
    on = [c["picture_ms"] for c in changes if c["lattice"] and c["picture_ms"] is not None]
    off = [c["picture_ms"] for c in changes if not c["lattice"] and c["picture_ms"] is not None]
    statuses = [c["status_ms"] for c in changes if c["status_ms"] is not None]
    print(f"\nload average before {before}, after {after} ({args.busy} busy processes "
          f"beside; a change every {args.gap:g} s)")
    print(f"lattice settings: {len(on)} of {sum(c['lattice'] for c in changes)} drawn; "
          f"change to picture p50 {statistics.median(on):.0f} ms, p95 "
          f"{percentile(on, 0.95):.0f} ms, max {max(on):.0f} ms")
    if off:
        print(f"other settings: {len(off)} of {sum(not c['lattice'] for c in changes)} drawn;"
              f" change to picture p50 {statistics.median(off):.0f} ms, max {max(off):.0f} ms")
    missing = sum(c["status_ms"] is None for c in changes)
    print(f"status line: every change's within {max(statuses):.0f} ms (p50 "
          f"{statistics.median(statuses):.0f} ms, p95 {percentile(statuses, 0.95):.0f} ms); "
          f"{missing} changes without one")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"changes": changes, "load_before": before, "load_after": after}, indent=1))
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable,
                        help="the project's Python, with jupyterlab and minipar's deps")
    parser.add_argument("--changes", type=int, default=len(PATH), choices=range(1, 51),
                        metavar=f"1..{len(PATH)}")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between changes")
    parser.add_argument("--busy", type=int, default=2, help="processes spinning beside")
    parser.add_argument("--json", help="write every change's times here")
    parser.add_argument("--screenshots", type=pathlib.Path,
                        help="only Run All the --notebooks and save screenshots here")
    parser.add_argument("--notebooks", nargs="+", default=["00_tour", "03_zero",
                                                           "05_pipeline_parallel",
                                                           "06_3d_combined"])
    args = parser.parse_args()
    if not 0.05 <= args.gap <= 60 or not 0 <= args.busy <= 8:
        parser.error("--gap is 0.05 to 60 s, --busy 0 to 8")
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        root = scratch / "served"  # copies: JupyterLab saves what it runs, now and then
        root.mkdir()
        if args.screenshots:
            shutil.copytree(ROOT / "notebooks", root / "notebooks")
            # and the measurements a notebook reads (02: ../benchmarks/lr_scaling_*.json)
            (root / "benchmarks").mkdir()
            for path in (ROOT / "benchmarks").glob("*.json"):
                shutil.copy(path, root / "benchmarks")
        else:
            cells = ["%matplotlib inline\nfrom minipar.viz import widgets\n"
                     f"widgets.{EXPLORERS[0]}()"] + [f"widgets.{name}()" for name in
                                                     EXPLORERS[1:]]
            (root / "explorers.ipynb").write_text(json.dumps(notebook(cells)))
        lab = Lab(args.python, root, scratch / "cache")
        driver = browser(scratch / "profile")
        try:
            if args.screenshots:
                screenshots(driver, lab, args.notebooks, args.screenshots)
                status = 0
            else:
                status = measure(driver, lab, args)
        finally:
            driver.quit()
            lab.stop()
    sys.exit(status)


if __name__ == "__main__":
    main()
