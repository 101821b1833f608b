"""The library floors pyproject.toml declares are the ones tried (.ci/oldest.txt).

A floor nobody installed is a guess: threadpoolctl 3.1 (the old floor) does not find
NumPy 2's BLAS, so launch's one-thread-per-rank limit silently did nothing, and
matplotlib 3.7 does not import beside NumPy 2. .ci/oldest.txt pins each floor; README
says the suite passed with it. A floor of two numbers is tried at the newest patch
release of that series (numpy >=2.0: 2.0.2).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = {"numpy", "ml_dtypes", "matplotlib", "tqdm", "threadpoolctl"}


def floors(requirements: list[str] | None = None) -> dict[str, str]:
    """name -> the version after '>=', of pyproject's dependencies by default."""
    if requirements is None:
        requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "dependencies"]
    found = {}
    for requirement in requirements:
        floor = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", requirement)
        assert floor, f"{requirement!r}: every dependency gets a floor (>=), tried"
        found[floor[1]] = floor[2]
    return found


def notebook_floors() -> dict[str, str]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    return floors(extras["notebooks"])


def pins() -> dict[str, str]:
    lines = (ROOT / ".ci" / "oldest.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_every_runtime_dependency_has_a_floor_and_a_tried_pin():
    assert set(floors()) == RUNTIME
    assert RUNTIME <= set(pins())


def test_each_pin_is_its_floor_or_a_patch_release_of_it():
    declared, tried = {**floors(), "ipywidgets": notebook_floors()["ipywidgets"]}, pins()
    for name in [*RUNTIME, "ipywidgets"]:
        floor, pin = release(declared[name]), release(tried[name])
        assert pin[:len(floor)] == floor, (
            f"{name}: pyproject says >={declared[name]}, .ci/oldest.txt tried {tried[name]}")
