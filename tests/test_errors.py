"""One base for every refusal (minipar.errors), caught by `except MiniparError`, one name
per class, and the CLI turns any of them into one line, exit 2."""

import pytest

import minipar
from minipar import errors
from minipar.distributed import CollectiveMismatchError, DeadlockError, DistError
from minipar.errors import CheckpointError, ConfigError, PipelineError, ScheduleError


@pytest.mark.parametrize("cls", [ConfigError, PipelineError,
                                 ScheduleError, CheckpointError, DistError, DeadlockError,
                                 CollectiveMismatchError, errors.TrainingDiverged])
def test_every_error_type_is_a_minipar_error(cls):
    assert issubclass(cls, minipar.MiniparError)


def test_the_setting_errors_are_one_class_that_keeps_its_builtin_base_and_message():
    # the trainer's and the planner's setting errors are this one class, by one name
    assert not hasattr(errors, "LayoutError") and not hasattr(errors, "PlanError")
    error = ConfigError("micro_batch_size", "must be a positive integer, got 0")
    assert isinstance(error, ValueError)
    assert error.setting == error.field == "micro_batch_size"
    assert str(error) == "--micro-batch-size: must be a positive integer, got 0"
    # a strategy's message that already names its flag is kept as it is
    assert str(ConfigError("schedule", "--pp: needs 2 ranks")) == "--pp: needs 2 ranks"
    assert issubclass(CheckpointError, RuntimeError) and issubclass(DistError, RuntimeError)
    assert issubclass(ScheduleError, PipelineError)
    assert issubclass(errors.OutputError, OSError) and issubclass(errors.OutputError, ConfigError)


def test_errors_is_a_leaf_any_layer_may_import():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(errors))
    imported = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert all(getattr(node, "module", "") == "__future__" for node in imported)


def test_the_cli_turns_any_minipar_error_into_one_line_and_exit_2(monkeypatch, capsys):
    from minipar import cli

    def refuse(args):
        raise DeadlockError("deadlock:\n  rank 0 waits recv from 1\n  rank 1 waits recv from 0")

    monkeypatch.setitem(cli.__dict__, "cmd_consolidate", refuse)
    assert cli.main(["consolidate", "a", "b.npz"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "rank 0 waits recv from 1; rank 1 waits recv from 0" in err
