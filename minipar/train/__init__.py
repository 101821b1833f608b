"""Training: config, data, the loop over any parallel mix, and the report."""

from minipar.train.config import TrainConfig
from minipar.train.loop import train
from minipar.train.report import Report, validate_report

__all__ = ["Report", "TrainConfig", "train", "validate_report"]
