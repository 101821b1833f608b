"""Make a student handout: the exercises without the reference solutions.

    python -m exercises.handout DIR      # writes DIR/exercises/ (student files, checkers,
                                         # README), leaving out exercises/solutions/

Students then work in DIR, with minipar installed in their Python environment
(`pip install <path or URL of the minipar repository>`), and check from DIR:

    python -m exercises.check 01
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HERE = Path(__file__).resolve().parent
LEFT_OUT = ("solutions", "__pycache__", "*.pyc", "handout.py")


def make_handout(directory) -> Path:
    """Copy the exercises, minus the solutions, to directory/exercises; return that path."""
    target = Path(directory) / "exercises"
    if target.exists():
        raise FileExistsError(f"{target} exists already: choose an empty directory")
    shutil.copytree(HERE, target, ignore=shutil.ignore_patterns(*LEFT_OUT))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m exercises.handout",
        description="Copy the exercises without the reference solutions, for students.")
    parser.add_argument("directory", help="where to write the exercises/ folder")
    args = parser.parse_args(argv)
    try:
        target = make_handout(args.directory)
    except FileExistsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {target} (without solutions/). Students, from {target.parent}:")
    print("    python -m exercises.check          # list the exercises")
    print("    python -m exercises.check 01       # check exercise 01")
    return 0


if __name__ == "__main__":
    sys.exit(main())
