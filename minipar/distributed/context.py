"""Which virtual rank is running: one contextvar, set by `launch` in each rank's thread.

Every rank's thread sees its own (cluster, device) pair; the main thread sees none.
Nothing else in minipar.distributed is global, so two launches can never see each other's state.
"""

from __future__ import annotations

import contextvars

_rank_context: contextvars.ContextVar = contextvars.ContextVar("minipar_rank", default=None)


def current(api: str):
    """(cluster, device) of the running rank; a clear error outside a launch."""
    context = _rank_context.get()
    if context is None:
        raise RuntimeError(
            f"{api} was called outside a virtual rank: run the function that calls it with "
            "minipar.distributed.launch(fn, world_size)"
        )
    return context


def get_device():
    """The running rank's Device (memory ledger, clock, comm ledger, phase)."""
    return current("get_device()")[1]


def get_rank(group=None) -> int:
    """Global rank of the running rank, or its index inside `group` (like torch.distributed)."""
    rank = current("get_rank()")[1].rank
    return rank if group is None else group.group_rank(rank)


def get_world_size(group=None) -> int:
    """Number of ranks in the launch, or in `group`."""
    device = current("get_world_size()")[1]
    return device.world_size if group is None else group.size
