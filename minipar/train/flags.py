"""One command-line flag per setting, read off the dataclass field that defines it.

`micro_batch_size` -> `--micro-batch-size`, of the field's type, with its fixed choices
and the help line of its `setting(...)`: `minipar train` adds every TrainConfig field this
way (minipar/cli.py) and `minipar plan` every Layout field (minipar/plan/cli.py), so a
field added to a settings section is a flag of both without a line here.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from minipar.errors import flag
from minipar.nn.gpt import MLP_KINDS
from minipar.nn.recompute import GRANULARITIES, METHODS
from minipar.parallel.pipeline.schedules.registry import SCHEDULES, schedule_names
from minipar.parallel.zero.offload import DEVICES as OFFLOAD_DEVICES
from minipar.train.config import DATASETS
from minipar.train.layout import GRAD_ACCUM_DTYPES, PRECISIONS


def choices() -> dict[str, tuple]:
    """The settings whose values are a fixed set (the schedules: the registry's now)."""
    return {"precision": PRECISIONS, "grad_accum_dtype": GRAD_ACCUM_DTYPES,
            "schedule": schedule_names(), "data": DATASETS,
            "recompute_granularity": GRANULARITIES, "recompute_method": METHODS,
            "offload_optimizer": OFFLOAD_DEVICES, "offload_param": OFFLOAD_DEVICES,
            "mlp": MLP_KINDS}


def add_setting_flags(parser, settings: type, defaults: dict | None = None,
                      notes: dict | None = None) -> None:
    """A flag for every field of the dataclass `settings` on `parser` (or an argument
    group). defaults: a flag's default instead of the field's (None: "not given");
    notes: words added to a flag's help."""
    hints = typing.get_type_hints(settings)
    fixed, defaults, notes = choices(), defaults or {}, notes or {}
    for f in dataclasses.fields(settings):
        kind = _scalar_type(hints[f.name])
        default = defaults.get(f.name, f.default)
        help_text = f.metadata.get("help")
        if f.name == "schedule":  # each registered schedule says what it does
            help_text += ": " + "; ".join(f"{spec.name}: {spec.description}"
                                          for spec in SCHEDULES.values())
        if f.name in notes:
            help_text += f" ({notes[f.name]})"
        if "parse" in f.metadata:  # e.g. true, false or K: the field's own reader
            parser.add_argument(flag(f.name), dest=f.name, type=f.metadata["parse"],
                                default=default, help=help_text,
                                metavar=f.metadata["metavar"])
        elif kind is bool:
            parser.add_argument(flag(f.name), dest=f.name, default=default, help=help_text,
                                action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(flag(f.name), dest=f.name, type=kind, default=default,
                                choices=fixed.get(f.name), help=help_text,
                                metavar=None if f.name in fixed else f.name.upper())


def _scalar_type(annotation):
    """The scalar type of a field annotation like `int | None` -> int."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation
