"""The time of a pipeline schedule, by running its order with costs attached.

The closed forms of timing.py (Narayanan et al. 2021, section 2.2) assume communication
is free or hidden. When a stage's compute is short next to a message's latency (small
models, or a slow inter-node link) every point-to-point hop sits on the critical path,
and the schedule's order decides how many. So the exact estimate walks the schedule
itself (the same action lists minipar's pipeline runs: minipar.parallel.schedules) with
the planner's costs:

    Forward / Backward of chunk c on rank r     takes forward[r][c] / backward[r][c]
    send                                        posts the message and goes on (isend)
    receive                                     waits for the matching send, then the
                                                transfer takes `message` seconds from
                                                max(send posted, receive posted): a
                                                rendezvous, as with NCCL
    end of the step                             each rank waits for its own sends

This is a longest-path computation over the schedule's dependency graph, O(actions).
"""

from __future__ import annotations

from minipar.parallel.schedules import (
    Backward,
    Forward,
    RecvActivation,
    SendActivation,
    SendGrad,
    make_schedule,
)


def simulate_schedule(name: str, pp: int, micro_batches: int, virtual_stages: int,
                      forward: list[list[float]], backward: list[list[float]],
                      message: float) -> dict:
    """Run schedule `name` with per-(rank, chunk) costs; returns per-rank finish times
    ("finish"), busy compute ("compute"), transfer ("comm") and waiting ("idle") seconds.
    """
    schedule = make_schedule(name, pp, micro_batches, virtual_stages)
    p = pp
    actions = [schedule[r] for r in range(p)]
    position = [0] * p
    now = [0.0] * p
    compute = [0.0] * p
    comm = [0.0] * p
    idle = [0.0] * p
    posted: dict[tuple, tuple[float, int]] = {}
    send_ends = [[] for _ in range(p)]

    def key(kind: str, micro_batch: int, boundary: int) -> tuple:
        return kind, micro_batch, boundary

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while position[r] < len(actions[r]):
                action = actions[r][position[r]]
                kind = type(action)
                stage = schedule.virtual_stage(r, action.chunk)
                if kind is Forward:
                    now[r] += forward[r][action.chunk]
                    compute[r] += forward[r][action.chunk]
                elif kind is Backward:
                    now[r] += backward[r][action.chunk]
                    compute[r] += backward[r][action.chunk]
                elif kind is SendActivation:
                    posted[key("act", action.micro_batch, stage)] = (now[r], r)
                elif kind is SendGrad:
                    posted[key("grad", action.micro_batch, stage)] = (now[r], r)
                else:
                    wanted = (key("act", action.micro_batch, stage - 1) if kind is RecvActivation
                              else key("grad", action.micro_batch, stage + 1))
                    if wanted not in posted:
                        break  # the sender has not got there yet: run other ranks
                    sent_at, source = posted.pop(wanted)
                    start = max(sent_at, now[r])
                    idle[r] += start - now[r]
                    now[r] = start + message
                    comm[r] += message
                    send_ends[source].append(now[r])
                position[r] += 1
                progress = True
    if any(position[r] < len(actions[r]) for r in range(p)):
        raise RuntimeError(f"the {name} schedule did not complete in the simulation")
    finish = []
    for r in range(p):
        end = max([now[r], *send_ends[r]])
        idle[r] += end - now[r]
        finish.append(end)
    return {"finish": finish, "compute": compute, "comm": comm, "idle": idle}
