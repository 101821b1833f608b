"""Exercise 05: the 1F1B pipeline schedule, as lists of actions.

Check your work:   python -m exercises.check 05

Pipeline parallelism cuts the model into p stages of consecutive layers, one per rank,
and splits the batch into m micro-batches. A *schedule* says in which order each stage
runs its forwards and backwards, and where activations and gradients travel between
neighbouring stages. minipar keeps schedules as data: per rank, a list of actions
(minipar/parallel/pipeline/actions.py, read its docstring):

    Forward(i)                  run this stage's layers forward on micro-batch i
    Backward(i)                 backpropagate micro-batch i through this stage
    SendActivation(i, 0, peer)  send micro-batch i's output activation to rank `peer`
    RecvActivation(i, 0, peer)  receive micro-batch i's input activation from `peer`
    SendGrad(i, 0, peer)        send the gradient of micro-batch i's input back to `peer`
    RecvGrad(i, 0, peer)        receive the gradient of micro-batch i's output from `peer`
(the 0 is the model chunk: one chunk per rank here; interleaved schedules use more).

1F1B, "PipeDream-Flush" (Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", section 2.2.1 and figure 3; Harlap et al.
2018, PipeDream): GPipe runs all m forwards, then all m backwards, so stage 0 holds the
activations of all m micro-batches. 1F1B starts the backward of a micro-batch as soon as
possible instead: stage s (0-indexed, of p)
    1. warm-up: runs min(p - s - 1, m) forwards,
    2. steady state: then alternates one forward and one backward (1F1B) while forwards
       remain,
    3. cool-down: then runs the remaining backwards.
Micro-batches go forward and backward in increasing order. The bubble is the same as
GPipe's, (p - 1) / (m + p - 1) of the time, but stage s never has more than p - s
micro-batches in flight (forward done, backward not yet): its activation memory no
longer grows with m.

Example, p = 4, m = 8 (figure 3 of the paper, 0-indexed):
    stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
    stage 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7

Use the action classes imported below; do not import the library's schedule functions
(one_f_one_b, gpipe, make_schedule...): the checker refuses them.
"""

from __future__ import annotations


def compute_order(pp: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """Stage `stage`'s forwards and backwards in 1F1B order, without communication.

    Returns [("F", 0), ("F", 1), ..., ("B", 0), ...]: one ("F", i) and one ("B", i) for
    every micro-batch i in range(micro_batches), in the order the stage runs them.
    """
    raise NotImplementedError("compute_order: your code here")


def one_f_one_b(pp: int, micro_batches: int) -> list[list]:
    """The whole 1F1B schedule: actions[rank] is the list of actions of pipeline rank
    `rank` (= stage), for rank in range(pp).

    Take each stage's compute order and add the messages around each compute:
    - before Forward(i), every stage but the first receives its input:
      RecvActivation(i, 0, rank - 1); after it, every stage but the last sends its output
      on: SendActivation(i, 0, rank + 1);
    - before Backward(i), every stage but the last receives the gradient of its output:
      RecvGrad(i, 0, rank + 1); after it, every stage but the first sends the gradient of
      its input back: SendGrad(i, 0, rank - 1).
    Receive right before the compute that needs it and send right after the compute that
    made it: a rank then blocks only when its input has not arrived yet.

    What the checker measures, for (p, m) = (1, 3), (2, 4), (3, 5), (4, 8), (4, 2), (4, 4):
    - the compute order of every stage against the PipeDream-Flush rules above;
    - every send is received and every receive is sent, by the right neighbour, in the
      right order (minipar.parallel.pipeline.simulator.validate);
    - the schedule runs on p virtual ranks without deadlock, and each receive gets the
      message it expects (sends are posted with isend, as Megatron-LM's p2p code does);
    - at most min(p - s, m) micro-batches in flight on stage s;
    - with forward 1 and backward 2 time units, the step takes (m + p - 1) * 3 units:
      bubble (p - 1) / (m + p - 1).
    """
    raise NotImplementedError("one_f_one_b: your code here")
