"""minipar: 3D parallelism and ZeRO you can run, inspect and break on a laptop.

    from minipar import GPT, GPTConfig, train, TrainConfig
    report = train(TrainConfig(steps=5, precision="fp64"))
"""

from minipar.errors import MiniparError
from minipar.nn import GPT, GPTConfig
from minipar.train import Report, TrainConfig, train

__all__ = ["GPT", "GPTConfig", "MiniparError", "Report", "TrainConfig", "train"]
