"""The `minipar` command's entry point (pyproject.toml's [project.scripts], and
`python -m minipar`): Ctrl-C is one line and exit status 130 from the first moment.

Loading the command line takes about half a second (NumPy, matplotlib, all of minipar);
a Ctrl-C then raised KeyboardInterrupt inside an import, Python's traceback through
importlib. This module imports nothing of that (minipar/__init__.py loads its names on
first use): it installs a SIGINT handler, imports the command line, and gives Ctrl-C
back to Python's KeyboardInterrupt, which minipar.cli.main turns into its own line
("minipar <command>: interrupted") once there are ranks to stop and files to remove.
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    """Run the `minipar` command (minipar.cli.main) with Ctrl-C handled while it loads."""
    starting = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if starting:  # (a shell that ignores SIGINT for a background job keeps it ignored)
        signal.signal(signal.SIGINT, _interrupted_while_loading)
    from minipar.cli import main as run

    if starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return run(argv)


def _interrupted_while_loading(signum, frame) -> None:
    """Ctrl-C before the command runs: nothing is written or running yet, so say so and
    leave at once (minipar.cli.main's message, before its arguments are read)."""
    os.write(sys.stderr.fileno(), b"minipar: interrupted\n")
    os._exit(130)
