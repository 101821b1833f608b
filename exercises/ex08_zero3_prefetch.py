"""Exercise 08: ZeRO-3's gather and free, with prefetch, as a list of actions.

Check your work:   python -m exercises.check 08

ZeRO stage 3 (Rajbhandari et al. 2020, section 5.3; PyTorch FSDP's FULL_SHARD) keeps
only 1/N of every parameter on each of the N data-parallel ranks. The model is cut into
*units* (a transformer block each; FSDP wraps them with `fully_shard`), and a unit's full
parameters exist only while the unit computes:

    before a unit's forward    all-gather its parameters (Ψ_unit (N-1)/N elements in)
    after its forward          free them: only the shard stays
    before its backward        all-gather them again (the forward's copy is gone)
    after its backward         free them again

Done one unit at a time, every all-gather is *exposed*: the rank waits for it and
computes nothing. Prefetch hides it: launch the next unit's all-gather (asynchronously)
*before* the current unit computes, so the transfer runs while it computes, and the wait
before the next unit finds it done. The price: two units' full parameters exist at once.
FSDP calls this `forward_prefetch` and `backward_prefetch=BACKWARD_PRE` (torch/distributed/
fsdp/_runtime_utils.py, `_prefetch_handle`); DeepSpeed's `PartitionedParameterCoordinator`
(deepspeed/runtime/zero/partitioned_param_coordinator.py) fetches ahead by a budget of
elements. In backward, the unit backward reaches next is the *previous* one.

You write, for one rank, the actions of one forward and backward over `n_units` units
(forward 0, 1, ..., n_units - 1; backward n_units - 1, ..., 0), as a list of tuples:

    ("gather", u)    launch the all-gather of unit u (asynchronous: returns at once;
                     the full buffer of unit u exists from now on)
    ("wait", u)      wait until unit u's all-gather has arrived: the parameters are usable
    ("forward", u)   run unit u's forward        (needs unit u gathered and waited for)
    ("backward", u)  run unit u's backward       (the same)
    ("free", u)      drop unit u's full buffer (only the shard stays)

The checker runs your actions on N = 2 and 4 virtual ranks with minipar: real
all-gathers of each unit's shard (`dist.all_gather(shard, async_op=True, out=buffer)`:
it launches at "gather" and is waited for at "wait"), the units' compute on the
simulated clock (a unit's forward lasts longer than its all-gather, its backward twice
as long), and the gathered buffers in the memory ledger. It measures:
- the peak of gathered buffers: at most 2 units with prefetch, 1 without;
- the exposed communication time (the clock's time blocked in a transfer): without
  prefetch every all-gather, 2 x n_units of them; with prefetch at most 2 (the first
  forward's, and the first backward's, which no compute precedes);
- the bytes: exactly two all-gathers per unit (forward and backward), none left
  gathered at the end.
Read minipar/parallel/zero/stage3.py for the same schedule as module hooks.
"""

from __future__ import annotations


def zero3_actions(n_units: int, prefetch: bool) -> list[tuple[str, int]]:
    """One rank's actions for one forward and backward over units 0 .. n_units - 1.

    prefetch=False: gather, wait, compute and free one unit at a time.
    prefetch=True: launch the all-gather of the unit that computes next before the
    current unit computes (in forward the next unit, in backward the previous one).

    Example, n_units = 2, prefetch=False:
        [("gather", 0), ("wait", 0), ("forward", 0), ("free", 0),
         ("gather", 1), ("wait", 1), ("forward", 1), ("free", 1),
         ("gather", 1), ("wait", 1), ("backward", 1), ("free", 1),
         ("gather", 0), ("wait", 0), ("backward", 0), ("free", 0)]
    """
    raise NotImplementedError("zero3_actions: your code here")
