"""minipar.train (minipar/run.py): the loop's train after the planner's memory check."""

import inspect

from minipar import run
from minipar.train import loop


def test_every_option_of_the_loop_passes_through():
    """An option missing here would be taken for a config setting and refused."""
    params = inspect.signature(loop.train).parameters
    options = {name for name, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert set(run.TRAIN_OPTIONS) == options
