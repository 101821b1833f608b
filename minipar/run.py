"""`minipar.train(config)`: the public entry point, which first checks the run fits.

    from minipar import TrainConfig, train
    report = train(TrainConfig(dp=2, zero=1, steps=5))

The same as `minipar.train.loop.train` (see there for every argument), except that the
prepared run (its data read, its layout checked) is estimated by the planner
(minipar/plan/fits.py) and refused with a ConfigError if it cannot fit this machine's
memory, before anything is allocated. It
lives above minipar.plan (with the CLI) so that minipar.train need not import the
planner: the formula has one home and the layers' arrows point down.
"""

from __future__ import annotations

from minipar.plan.fits import check_fits
from minipar.train import loop
from minipar.train.config import TrainConfig


def train(config: TrainConfig | None = None, **kwargs):
    """minipar.train.loop.train after the planner's memory check (module docstring)."""
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in TRAIN_OPTIONS}
    if config is None:
        config = TrainConfig(**kwargs)
    elif kwargs:
        config = config.replace(**kwargs)
    prepared = loop.prepare_run(config, options.pop("resume_from", None))
    check_fits(prepared.config)
    return loop.train_prepared(prepared, **options)


TRAIN_OPTIONS = ("progress", "save_dir", "save_every", "resume_from", "device", "references",
                 "trace")
train.__doc__ = (train.__doc__ or "") + "\n\n" + (loop.train.__doc__ or "")
