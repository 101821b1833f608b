"""The benchmarks' command lines: `--help` for every script, one line for a bad value.

    parse_no_flags(__doc__)                       # a script without flags: --help, no strays
    parser.add_argument("--repeat", type=positive_int)
    parser.add_argument("--think", type=non_negative_float)

A benchmark that took `--rounds 0` printed timings of nothing, `--gap inf` ended in an
OverflowError, `--help` ran the whole job: argparse's `type=` turns each into
"error: argument --rounds: must be an integer >= 1, got '0'" and exit status 2.
"""

from __future__ import annotations

import argparse
import math


def parse_no_flags(doc: str) -> argparse.Namespace:
    """For a script that takes no flags: `--help` prints what it measures; anything else
    is refused instead of running the whole job."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0]).parse_args()


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    # (a minute's wait is already a long benchmark: 1e12 s overflowed time.monotonic)
    if abs(value) > 1e6:
        raise argparse.ArgumentTypeError(f"must be at most 1e6 in size, got {text!r}")
    return value
