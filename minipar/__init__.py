"""minipar: 3D parallelism and ZeRO you can run, inspect and break on a laptop.

    from minipar import GPT, GPTConfig, train, TrainConfig
    report = train(TrainConfig(steps=5, precision="fp64"))
"""

from minipar.errors import MiniparError
from minipar.nn import GPT, GPTConfig
from minipar.run import train  # minipar.train.loop.train after a memory check
from minipar.train import Report, TrainConfig

__all__ = ["GPT", "GPTConfig", "MiniparError", "Report", "TrainConfig", "train"]
