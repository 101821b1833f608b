"""`minipar profile DIR`: the bottleneck report of a traced run, on the command line.

    minipar train --dp 2 --pp 2 --device demo --trace trace/    # write the traces
    minipar profile trace/ [--json PATH]                        # read them back

minipar.cli wires it in: `add_profile_command(subparsers)` adds the subcommand and
`run_profile(args)` runs it (a folder that is not a run's traces, or a malformed file in
it, is one line naming the file and what is wrong, exit status 2, through the CLI's
MiniparError handling; minipar.profile.trace_input checks them). The figures are
minipar.profile.breakdown's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile

from minipar.distributed.trace import read_trace_files
from minipar.errors import OutputError
from minipar.files import atomic_write
from minipar.profile.breakdown import Profile, profile_traces
from minipar.profile.trace_input import TraceFileError


def profile_folder(directory) -> Profile:
    """The profile of the traces in `directory` (minipar train --trace DIR). A folder or
    file that is not a run's traces is a TraceFileError (a ConfigError) naming the file,
    where in it and what is wrong (minipar.profile.trace_input)."""
    files = read_trace_files(directory, TraceFileError)
    return profile_traces([t for _, t in files], sources=[p for p, _ in files])


def add_trace_flags(train: argparse.ArgumentParser) -> None:
    """`minipar train`'s --trace DIR and --profile."""
    train.add_argument("--trace", metavar="DIR", help="a profiler trace per rank, DIR/rank<N>"
                       ".json (Perfetto: DIR/merged/all_ranks.json; HTA: DIR)")
    train.add_argument("--profile", action="store_true", help="the bottleneck report (as "
                       "`minipar profile DIR`), also in the --json report as \"profile\"")


@contextlib.contextmanager
def trace_folder(args):
    """Where `minipar train` writes its traces: --trace DIR (checked before the run, as
    every output is), a temporary folder for --profile alone, or None."""
    from minipar.train.outputs import check_output_dir

    if args.trace is not None:
        yield check_output_dir("trace", args.trace)
    elif args.profile:
        with tempfile.TemporaryDirectory(prefix="minipar-trace-") as folder:
            yield folder
    else:
        yield None


def add_profile_command(subparsers) -> argparse.ArgumentParser:
    """Add `profile` to an argparse subparsers object; returns its parser."""
    profile = subparsers.add_parser(
        "profile", help="read a traced run (minipar train --trace DIR) and name its "
                        "bottleneck: compute, exposed communication, bubble, memory peak")
    profile.add_argument("trace_dir", metavar="DIR", help="the folder of rank<N>.json traces")
    profile.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return profile


def run_profile(args) -> int:
    """Run `minipar profile` with parsed `args`; returns the exit status."""
    from minipar.train.outputs import check_output_file

    if args.json is not None:  # an empty --json '' too: refused, not ignored
        check_output_file("json", args.json)  # before the work, as minipar train does
    profile = profile_folder(args.trace_dir)
    print(profile.text())
    if args.json is not None:  # whole or not at all: an earlier file survives a full disk
        try:
            with atomic_write(args.json, "w") as out:
                json.dump(profile.to_dict(), out, indent=2)
        except OSError as err:
            raise OutputError("json", f"{args.json}: the profile could not be written "
                              f"({err.strerror or err}); it is printed above") from None
        print(f"\nprofile written to {args.json}")
    return 0
