"""Pipeline schedules as data: per pipeline rank, the actions it runs, registered by name.

    from minipar.parallel.pipeline.schedules.registry import make_schedule
    schedule = make_schedule("1f1b", pp=4, micro_batches=8)
    print(schedule)                 # one line per rank: F0, send act 0 -> 1, F1, ...
    schedule[2]                     # rank 2's actions: (RecvActivation(0, 0, 1), Forward(0), ...)
    schedule.compute_order(0)       # "F0 F1 F2 F3 B0 F4 B1 ..."

Seven schedules, one module per family, in the order the papers came:
    one_f_one_b.py   GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2021, 2.2.1)
    interleaved.py   interleaved 1F1B, v model chunks per rank (Narayanan et al. 2021, 2.2.2)
    zero_bubble.py   ZB-H1, ZB-H2, ZB-V: the backward split in B and W (Qi et al. 2024)
    dualpipe.py      DualPipe-V (DeepSeek-AI 2024, DeepSeek-V3 report 3.2.1)
Each holds its generators (per rank, the order of its forwards and backwards, turned into
actions with sends and receives by orders.py) and one `register_schedule(ScheduleSpec(...))`
per schedule: its chunks per rank and their placement, its settings rules, its bubble and
activations in flight for uniform stages. registry.py holds the registry, the rules'
checks and `make_schedule`; the actions and the Schedule are in ../actions.py (I and W
in ../split_backward.py), the simulator that checks and times them in ../simulator.py.

Importing this package registers the seven, in this order (the CLI's choices).
"""

# Each module registers its schedules when imported: in the papers' order, the CLI's.
# isort: off
from minipar.parallel.pipeline.schedules import one_f_one_b  # noqa: F401
from minipar.parallel.pipeline.schedules import interleaved  # noqa: F401
from minipar.parallel.pipeline.schedules import zero_bubble  # noqa: F401
from minipar.parallel.pipeline.schedules import dualpipe  # noqa: F401
# isort: on
