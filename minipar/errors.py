"""The errors minipar raises on purpose: one base, a subclass only where callers differ.

    MiniparError                  everything minipar refuses (bad input, a run it stops)
    ├── ConfigError               a setting that cannot work (the trainer's or the
    │                              planner's); `.setting` names it (the CLI flag is
    │                              --setting) and the message starts with that flag:
    │                              "--n-head: d_model=64 is not ..."
    │   └── OutputError            an output path that cannot be written; `.report`
    │                              keeps a finished run's results if the write failed late
    ├── PipelineError              a pipeline schedule / stage that cannot work
    │   └── ScheduleError          a schedule that cannot run (exercise 5 catches it)
    ├── CheckpointError            a checkpoint that cannot be used; names the file
    ├── InputFileError             a file minipar will not read (not a regular file, too
    │                              large, nested too deep); `.path` and `.detail`
    ├── TrainingDiverged           the loss or a gradient became NaN or inf
    └── DistError                  the virtual cluster: mismatch, deadlock, timeout

The command line catches `MiniparError` once and prints its message as one line with exit
status 2 (`minipar train: error: --lr: must be finite ...`). A caller that wants one kind
catches the subclass. Built-in bases are kept (ConfigError is a ValueError, DistError and
CheckpointError are RuntimeErrors, OutputError an OSError) so that code written against
older versions still catches them.

This module imports nothing from minipar, so every layer (autograd ... cli) may use it.
"""

from __future__ import annotations


class MiniparError(Exception):
    """Base class of every error minipar raises deliberately. `setting` names the setting
    at fault when there is one (None otherwise)."""

    setting: str | None = None


def flag(setting: str) -> str:
    """The CLI flag of a setting: micro_batch_size -> --micro-batch-size. A positional
    argument is named by its metavar, which is capitalised (consolidate's OUT.npz) and is
    shown as it is: there is no --OUT.npz flag to point the user at."""
    if setting[:1].isupper():
        return setting
    return "--" + setting.replace("_", "-")


class ConfigError(MiniparError, ValueError):
    """An invalid setting or mix of settings. `setting` (also `field`, its older name) is
    the TrainConfig / planner field; the message starts with its flag, unless it already
    starts with a flag (a strategy module's message that names the flag to change)."""

    def __init__(self, setting: str, message: str):
        self.setting, self.detail = setting, message  # detail: the message without the flag
        super().__init__(message if message.startswith("--") else f"{flag(setting)}: {message}")

    @property
    def field(self) -> str:
        return self.setting


class OutputError(ConfigError, OSError):
    """An output (--json, --save, --out, consolidate's OUT) that cannot be written.
    Raised before the work starts; if a write fails after it (a full disk), `report` is
    what was computed, so the caller can still show it (the CLI prints it), and
    `outputs` names every output that failed (the first is `setting`). Also an OSError,
    so that code catching the write's own error still catches it."""

    def __init__(self, setting: str, message: str, report=None, outputs=()):
        super().__init__(setting, message)
        self.report = report
        self.outputs = tuple(outputs) or (setting,)


class PipelineError(MiniparError, ValueError):
    """A pipeline setting or stage that cannot work (the message names the flag and fix)."""


class ScheduleError(PipelineError):
    """A schedule that cannot run: a missing or misplaced action, a send nobody receives,
    a cycle of waits; or a setting no schedule exists for."""


class CheckpointError(MiniparError, RuntimeError):
    """A checkpoint that cannot be used: the message names the file and what is wrong."""


class InputFileError(MiniparError, ValueError):
    """A file minipar will not read as it is: not a regular file (a FIFO, a device), larger
    than such a file can be, or JSON nested deeper than minipar writes (minipar.files).
    `path` is the file, `detail` what is wrong; readers re-raise it as their own error
    (a CheckpointError, a TraceFileError) with the same words."""

    def __init__(self, path, detail: str):
        self.path, self.detail = str(path), detail
        super().__init__(f"{path}: {detail}")


class TrainingDiverged(MiniparError, RuntimeError):  # noqa: N818 (what happened, not a bug)
    """The loss (or a gradient) became NaN or inf: `step` is the optimizer step, `tensor`
    the first tensor found non-finite (in forward/backward order)."""

    def __init__(self, message: str, step: int | None = None, tensor: str | None = None):
        self.step, self.tensor = step, tensor
        super().__init__(message)


class DistError(MiniparError, RuntimeError):
    """Base class of every error raised by `minipar.distributed` itself."""
