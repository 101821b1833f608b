"""What the operating system offers to keep the code under test away from the grader.

The grader runs the file under test only in processes of its own (worker.py, and
rank_process.py for the checks with every rank in its own process). Each such process,
before it imports anything of the file under test, calls:

- `confine(writable)`: dies with the grader (PR_SET_PDEATHSIG) and takes no new
  privileges (PR_SET_NO_NEW_PRIVS, which Landlock needs); then Landlock (Linux >= 5.13,
  no root needed; landlock(7)): no file may be written, truncated, created, renamed or
  removed except beneath `writable` (ABI 1-3); no TCP bind or connect (ABI 4); no signal
  to, and no abstract unix socket of, a process outside the sandbox (ABI 6). A process
  confined by Landlock can neither ptrace nor read the memory of one outside it.
- `isolate_network()` (rank processes only, first thing): a user namespace with a
  network and a System V IPC namespace of its own (unshare(2): CLONE_NEWUSER |
  CLONE_NEWNET | CLONE_NEWIPC). Its network has no interface up, so no UDP, TCP or
  abstract unix socket reaches another rank; with no file writable either, the ranks
  can exchange data only through the grader.

Each returns the layers it could set up, for the worker to tell the grader before the
file under test is imported. A layer the kernel lacks (Linux before 5.13 or Landlock off,
user namespaces turned off, another OS) is skipped: docs/exercises.md says what the
grader still guarantees then. MINIPAR_GRADER_SANDBOX=off skips both (tests use it to
show what the grader does without them).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

DISABLE_ENV = "MINIPAR_GRADER_SANDBOX"

# linux/prctl.h, linux/sched.h
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWNET = 0x08000000, 0x10000000, 0x40000000

# linux/landlock.h; the system call numbers are those of every architecture's table.
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1 << 0
RULE_PATH_BENEATH = 1
FS_WRITE_FILE = 1 << 1
FS_WRITES_ABI1 = FS_WRITE_FILE | sum(1 << bit for bit in range(4, 13))  # remove dir/file,
#                                                 make char/dir/reg/sock/fifo/block/sym
FS_REFER, FS_TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
NET_TCP = (1 << 0) | (1 << 1)  # bind, connect (ABI 4)
SCOPE_ABSTRACT_UNIX_SOCKET_AND_SIGNAL = (1 << 0) | (1 << 1)  # ABI 6


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64),
                ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").lower() == "off"


def confine(writable=(), parent: int | None = None) -> list[str]:
    """Confine this process (call it while it has one thread); return the layers set up."""
    if not sys.platform.startswith("linux"):
        return []
    libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent:  # the grader died before prctl
        os._exit(1)
    if _disabled() or libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return []
    abi = libc.syscall(SYS_CREATE_RULESET, None, 0, CREATE_RULESET_VERSION)
    if abi < 1:
        return []
    fs = FS_WRITES_ABI1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    attr = _RulesetAttr(fs, NET_TCP if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET_AND_SIGNAL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the fields this kernel knows
    ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), size, 0)
    if ruleset < 0:
        return []
    try:
        rules = [(path, fs) for path in writable]
        rules.append(("/dev/null", FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0)))
        for path, access in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(access, fd)
                if libc.syscall(SYS_ADD_RULE, ruleset, RULE_PATH_BENEATH,
                                ctypes.byref(rule), 0) != 0:
                    return []
            finally:
                os.close(fd)
        if libc.syscall(SYS_RESTRICT_SELF, ruleset, 0) != 0:
            return []
    finally:
        os.close(ruleset)
    return [f"Landlock ABI {abi}"]


def isolate_network() -> list[str]:
    """A network and an IPC namespace of this process's own (before any thread starts)."""
    if not sys.platform.startswith("linux") or _disabled():
        return []
    if _libc().unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWIPC) != 0:
        return []
    return ["network and IPC namespaces"]
