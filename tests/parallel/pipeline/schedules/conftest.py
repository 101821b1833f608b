"""What the schedule tests share: a schedule's bubble measured on paper, and the compute
orders of PyTorch's own schedules (torch/distributed/pipelining/schedules.py), which
minipar's ZB-V and DualPipe-V follow (PyTorch is the bench extra: without it, the tests
that compare with it skip)."""

from __future__ import annotations

import pytest

from minipar.parallel.pipeline.actions import Backward, Compute, Forward
from minipar.parallel.pipeline.simulator import simulate


@pytest.fixture
def simulated_bubble():
    def bubble(schedule, forward_time=1.0, backward_time=2.0):
        """Idle / total rank-time of the schedule run on paper."""
        timeline = simulate(schedule, forward_time, backward_time)
        end = max(e for row in timeline for _, _, e in row)
        busy = sum(e - s for row in timeline for a, s, e in row
                   if isinstance(a, (Forward, Backward)))
        return 1 - busy / (end * len(timeline))
    return bubble


@pytest.fixture
def in_pytorch_ir():
    def printed(schedule, rank: int) -> str:
        """Rank's compute actions as PyTorch prints its schedule IR: virtual stage, kind,
        micro-batch ("3F0": stage 3's forward of micro-batch 0)."""
        return " ".join(f"{schedule.virtual_stage(rank, a.chunk)}{str(a)[0]}{a.micro_batch}"
                        for a in schedule[rank] if isinstance(a, Compute))
    return printed


@pytest.fixture
def pytorch_order():
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

    def order(class_name: str, pp: int, micro_batches: int, virtual_stages: int,
              rank: int) -> str:
        """Rank's compute order in PyTorch's schedule `class_name`, printed in its IR
        (an overlapped forward-backward pair as its forward, then its backward). The
        schedule is built without stages: only what `_calculate_single_rank_operations`
        reads is set."""
        schedule = object.__new__(getattr(schedules, class_name))
        schedule.pp_group_size, schedule._n_microbatches = pp, micro_batches
        schedule.n_local_stages = virtual_stages
        schedule.num_stages = schedule._num_stages = pp * virtual_stages
        schedule.number_of_rounds = max(1, micro_batches // pp)  # interleaved's groups
        schedule.microbatches_per_round = micro_batches // schedule.number_of_rounds
        actions = [a for a in schedule._calculate_single_rank_operations(rank) if a]
        return " ".join(repr(sub) for a in actions for sub in (a.sub_actions or (a,)))
    return order
