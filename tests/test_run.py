"""minipar.train (minipar/run.py): the loop's train after the planner's memory check."""

import inspect

from minipar import run
from minipar.train import loop


def test_every_option_of_the_loop_passes_through():
    """An option missing here would be taken for a config setting and refused."""
    params = inspect.signature(loop.train).parameters
    options = {name for name, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert set(run.TRAIN_OPTIONS) == options


def test_the_package_loads_its_names_on_first_use_and_train_is_the_function():
    """`import minipar` loads no NumPy (the command handles Ctrl-C before it loads,
    minipar/console.py), and `minipar.train` is this function even when the subpackage
    minipar.train was imported first (Python then sets the package's attribute to it)."""
    import subprocess
    import sys

    child = "\n".join([
        "import sys, minipar, minipar.console",
        "assert 'numpy' not in sys.modules, 'import minipar loaded numpy'",
        "import minipar.train.config",
        "from minipar import GPT, MiniparError, Report, TrainConfig, train",
        "assert train is minipar.train and train.__module__ == 'minipar.run', train",
        "assert TrainConfig.__module__ == 'minipar.train.config' and GPT and Report",
        "assert sys.modules['minipar.train'].__name__ == 'minipar.train'",
        "print(sorted(minipar.__all__))",
    ])
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(sorted(["GPT", "GPTConfig", "MiniparError", "Report",
                                                "TrainConfig", "train"]))
