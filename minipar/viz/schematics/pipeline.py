"""A pipeline schedule as a timeline with its dependencies: who waits for whom.

    fig = plot_schedule_dependencies("1f1b", pp=4, micro_batches=8)
    picture = schedule_dependencies_picture("1f1b", 4, 8)

The schedule is the trainer's own (`make_schedule`: every rank's list of actions, what
the pipeline executor runs), timed on paper by the simulator the planner uses
(`simulate_step`, a forward 1 unit, a backward 2). Each message of the schedule is an
arrow: an activation from a stage's forward to the next stage's forward of the same
micro-batch, a gradient from a backward to the previous stage's backward. Micro-batch
0's path is drawn dark: down the stages in forward, back up in backward, which is why
stage 0 cannot start its first backward before 2(p-1) messages have been passed. Beside
each rank: the micro-batches whose activations it holds at most at once
(`in_flight_peak`). Only schedules with one model chunk per rank (GPipe, 1F1B).
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from minipar.parallel.pipeline.actions import (
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)
from minipar.parallel.pipeline.schedules.registry import make_schedule
from minipar.parallel.pipeline.simulator import in_flight_peak, simulate_step

COLORS = {"F": "#3b75af", "B": "#e1812c"}


def schedule_dependencies_picture(schedule: str = "1f1b", pp: int = 4,
                                  micro_batches: int = 8) -> dict:
    """Each rank's forwards and backwards (start, end, label), the arrows of the
    schedule's messages (from the sender's compute to the receiver's), each rank's
    in-flight peak and the step's length."""
    plan = make_schedule(schedule, pp, micro_batches)
    if plan.virtual_stages != 1:
        raise ValueError(f"schedule_dependencies_picture: {schedule} has model chunks; "
                         "draw gpipe or 1f1b")
    step = simulate_step(plan, forward=1.0, backward=2.0)
    boxes, done = [], {}
    for rank, timeline in enumerate(step.timelines):
        for action, start, end in timeline:
            if isinstance(action, (Forward, Backward)):
                letter = "F" if isinstance(action, Forward) else "B"
                boxes.append([rank, start, end, letter, action.micro_batch])
                done[rank, letter, action.micro_batch] = (start, end)
    arrows = []
    for rank, actions in enumerate(plan.actions):
        for action in actions:
            if isinstance(action, (SendActivation, SendGrad)):
                letter = "F" if isinstance(action, SendActivation) else "B"
                receive = RecvActivation if letter == "F" else RecvGrad
                peer = action.peer
                assert any(isinstance(a, receive) and a.micro_batch == action.micro_batch
                           for a in plan.actions[peer])  # the schedule's own pairing
                sent = done[rank, letter, action.micro_batch][1]
                used = done[peer, letter, action.micro_batch][0]
                arrows.append([rank, sent, peer, used, action.micro_batch])
    return {"figure": "schedule_dependencies", "schedule": schedule, "pp": pp,
            "micro_batches": micro_batches, "boxes": boxes, "arrows": arrows,
            "in_flight": [in_flight_peak(plan, r) for r in range(pp)],
            "step": max(step.finish)}


def plot_schedule_dependencies(schedule: str = "1f1b", pp: int = 4,
                               micro_batches: int = 8) -> Figure:
    return draw_schedule_dependencies(schedule_dependencies_picture(schedule, pp,
                                                                    micro_batches))


def draw_schedule_dependencies(picture: dict, width: float = 10.0) -> Figure:
    pp, length = picture["pp"], picture["step"]
    fig = Figure(figsize=(width, 0.62 * pp + 1.4))
    ax = fig.add_axes((0.08, 0.14, 0.8, 0.68))
    ax.add_patch(Rectangle((0, -0.5), length, pp, facecolor="#e6e6e6", zorder=0))
    for rank, start, end, letter, micro in picture["boxes"]:
        ax.add_patch(Rectangle((start, rank - 0.35), end - start, 0.7,
                               facecolor=COLORS[letter], edgecolor="white", zorder=2,
                               alpha=1.0 if micro == 0 else 0.85))
        ax.text((start + end) / 2, rank, f"{letter}{micro}", ha="center", va="center",
                fontsize=7, color="white", zorder=3, weight="bold" if micro == 0 else None)
    for sender, sent, receiver, used, micro in picture["arrows"]:
        first = micro == 0
        y0 = sender + (0.35 if receiver > sender else -0.35)
        y1 = receiver + (-0.35 if receiver > sender else 0.35)
        ax.add_patch(FancyArrowPatch((sent, y0), (used, y1), arrowstyle="-|>",
                                     mutation_scale=7 if first else 5, zorder=4,
                                     color="black" if first else "#777777",
                                     linewidth=1.3 if first else 0.5))
    for rank, held in enumerate(picture["in_flight"]):
        ax.text(length + 0.3, rank, f"holds <= {held}", va="center", fontsize=8)
    ax.set_xlim(0, length)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp), [f"stage {r}" for r in range(pp)], fontsize=8)
    ax.set_xlabel("time (a forward = 1 unit, a backward = 2)", fontsize=8)
    ax.tick_params(labelsize=8)
    idle = 1 - sum(end - start for _, start, end, _, _ in picture["boxes"]) / (pp * length)
    fig.suptitle(f"{picture['schedule']}: p = {pp} stages, m = {picture['micro_batches']} "
                 f"micro-batches; arrows: activations down, gradients up (micro-batch 0 "
                 f"dark)\ngrey: the bubble, {idle:.0%} of rank-time; right: the "
                 "micro-batches of activations a stage holds at once", fontsize=9, y=0.99)
    return fig
