"""minipar: 3D parallelism and ZeRO you can run, inspect and break on a laptop.

    from minipar import GPT, GPTConfig, train, TrainConfig
    report = train(TrainConfig(steps=5, precision="fp64"))

The public names load the first time one is asked for (PEP 562's module __getattr__),
so `import minipar.<module>` costs only what that module imports: the `minipar` command
(minipar/console.py) can handle Ctrl-C before NumPy and the rest of minipar load.
"""

import sys
from types import ModuleType

__all__ = ["GPT", "GPTConfig", "MiniparError", "Report", "TrainConfig", "train"]


def __getattr__(name: str):
    """GPT, GPTConfig, MiniparError, Report, TrainConfig: imported on first use."""
    if name not in __all__:
        raise AttributeError(f"module 'minipar' has no attribute {name!r}")
    from minipar.errors import MiniparError
    from minipar.nn import GPT, GPTConfig
    from minipar.train import Report, TrainConfig

    globals().update(GPT=GPT, GPTConfig=GPTConfig, MiniparError=MiniparError, Report=Report,
                     TrainConfig=TrainConfig)
    return getattr(sys.modules[__name__], name)


class _Package(ModuleType):
    """minipar, whose `train` is the function (minipar.run.train) although a subpackage
    minipar.train exists: Python's import sets the package's attribute `train` to that
    subpackage when it first loads it (importlib's _find_and_load_unlocked), which this
    property ignores. (The Python docs' "Customizing module attribute access".)"""

    @property
    def train(self):
        from minipar.run import train

        return train

    @train.setter
    def train(self, subpackage: ModuleType) -> None:
        pass  # it stays in sys.modules["minipar.train"], where imports find it


sys.modules[__name__].__class__ = _Package
