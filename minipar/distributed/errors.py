"""What goes wrong in a distributed program, named so the fix is obvious.

Real clusters hang when ranks disagree: NCCL waits forever for a peer that called a
different collective. The emulator sees every rank at once, so it turns each such hang
into an exception that says who waited for whom.
"""

from __future__ import annotations

from minipar.errors import DistError

# DistError: the base class of every error raised by `minipar.distributed` itself; a
# MiniparError (minipar/errors.py), so the CLI reports it in one line.


class CollectiveMismatchError(DistError):
    """Ranks of one group made different collective calls (op, shape, dtype, root, ...).

    The message lists what each rank called, so the rank with the odd call stands out.
    """


class DeadlockError(DistError):
    """Every live rank waits for another one: a cycle of waits, or a wait for a rank that
    has already returned. The message is the wait-for graph, one line per rank, e.g.
    "rank 0 waits recv from 1; rank 1 waits recv from 0".
    """


class LaunchTimeoutError(DistError):
    """The launch watchdog fired: a rank waited longer than the timeout, or no rank made
    progress for that long (an infinite loop, a rank stuck in its own code). The message
    names each unfinished rank, what it was doing and last did, and its Python stack;
    `stacks[rank]` is that stack (a traceback.StackSummary), `timeout` the seconds, and
    `left_running` the ranks whose threads could not be stopped (daemon threads)."""

    def __init__(self, message: str, timeout: float, stacks: dict, left_running=()):
        super().__init__(message)
        self.timeout, self.stacks, self.left_running = timeout, stacks, list(left_running)

    def __reduce__(self):  # (sent between processes by the torch engine, without stacks)
        return type(self), (str(self), self.timeout, {}, self.left_running)


class PeerLostError(DistError):
    """On the torch engine (one process per rank): a rank's collective or message failed
    because a process of the job is gone (it failed, or was stopped). The message names
    the call; the launch prefers the error of the rank that failed first."""


class LaunchCancelled(DistError):
    """The launch was stopped from outside by `Cancellation.cancel()` (launch.py): its
    ranks stopped at their next call into minipar and its results were thrown away. The
    notebook explorers' background worker cancels the spare run in progress when the
    reader asks for another setting (minipar/viz/prefetch.py)."""


class RankAborted(BaseException):  # noqa: N818 (not an error of its own: a signal to stop)
    """Raised inside a rank's thread when another rank failed and the launch is aborting.

    A BaseException (like KeyboardInterrupt), so that a user's `except Exception:` in the
    rank function cannot swallow the abort and keep the rank running. `launch` never lets
    it escape: it re-raises the failing rank's own exception instead.
    """
