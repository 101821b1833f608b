"""Which exported launcher runs the job a plan priced, and the `minipar plan` command of
the other's (minipar.plan.launchers, through `minipar plan --export`)."""

from __future__ import annotations

import json
import shlex

import pytest

from minipar.plan import presets
from minipar.plan.launchers import launch_note, launchers

# gpt2-xl, ZeRO-1 over dp 4 with 25 MiB buckets reduced during backward: whose limit of
# reductions in flight changes the step
OVERLAPPED = ("--model", "gpt2-xl", "--cluster", "a100", "--dp", "4", "--zero", "1",
              "--bucket-size-mb", "25", "--micro-batch-size", "1", "--grad-accum-steps", "4")


def exported(plan_cli, tmp_path, *argv):
    """(the plan's JSON, launch.sh's text, the stdout of the same plan as tables)."""
    out_dir = tmp_path / "out"
    status, plan, _ = plan_cli(*argv, "--json", "-", "--export", str(out_dir))
    assert status == 0
    _, tables, _ = plan_cli(*argv, "--export", str(tmp_path / "again"))
    return json.loads(plan), (out_dir / "launch.sh").read_text(), tables


def commands(script: str) -> dict[str, list[str]]:
    """{launcher: the `minipar plan` argv the note gives for its job}."""
    lines = script.splitlines()
    return {line.split()[1].removeprefix("LAUNCHER="): shlex.split(lines[i + 1][4:])[2:]
            for i, line in enumerate(lines) if line.endswith("; that job's plan:")}


def replanned(plan_cli, argv: list[str]) -> dict:
    status, out, err = plan_cli(*argv, "--json", "-")
    assert status == 0, err
    return json.loads(out)


def test_a_deepspeed_plan_says_megatron_lms_job_is_another_and_how_to_price_it(
        plan_cli, tmp_path):
    # priced with DeepSpeed's two reductions in flight (the default), the export's
    # Megatron-LM arguments still launch its distributed optimizer with
    # --overlap-grad-reduce, which has no limit: launch.sh says which job was priced
    plan, script, tables = exported(plan_cli, tmp_path, *OVERLAPPED)
    assert plan["config"]["reductions_in_flight"] == 2
    assert "# LAUNCHER=deepspeed (Megatron-DeepSpeed) runs the job this plan priced." in script
    assert ("# LAUNCHER=torchrun (Megatron-LM) runs this layout with no limit of gradient "
            "reductions in flight (its distributed optimizer); that job's plan:") in script
    # ... and the plan printed says it below the files
    assert "LAUNCHER=deepspeed (Megatron-DeepSpeed) runs the job this plan priced." in tables
    # the command is exact: the same layout, with Megatron-LM's reductions
    (argv,) = commands(script).values()
    assert argv[-2:] == ["--reductions-in-flight", "unlimited"]
    other = replanned(plan_cli, argv)
    assert other["config"] == {**plan["config"], "reductions_in_flight": None}
    # whose export, in turn, says torchrun runs it
    _, script, _ = exported(plan_cli, tmp_path / "megatron", *argv)
    assert "# LAUNCHER=torchrun (Megatron-LM) runs the job this plan priced." in script
    assert commands(script)["deepspeed"][-2:] != ["--reductions-in-flight", "unlimited"]


def test_megatrons_bytes_send_deepspeeds_job_to_deepspeeds_bytes_and_limit(plan_cli, tmp_path):
    plan, script, _ = exported(plan_cli, tmp_path, *OVERLAPPED, "--memory-accounting", "megatron")
    assert "# LAUNCHER=torchrun (Megatron-LM) runs the job this plan priced." in script
    assert ("runs this layout with DeepSpeed's bytes, two gradient reductions in flight "
            "(overlap_comm)") in script
    other = replanned(plan_cli, commands(script)["deepspeed"])
    assert other["config"] == {**plan["config"], "memory_accounting": "deepspeed",
                               "reductions_in_flight": 2}


def test_with_a_pipeline_deepspeeds_job_reduces_after_the_flush(plan_cli, tmp_path):
    # DeepSpeed's pipeline engine reduces the gradients after the flush, whatever
    # overlap_comm says; Megatron-LM reduces during each chunk's last backward, no limit:
    # a plan of two reductions in flight during backward is neither launcher's job
    argv = (*OVERLAPPED, "--pp", "2", "--gpus-per-node", "2")
    plan, script, _ = exported(plan_cli, tmp_path, *argv)
    assert "# Neither launcher runs the job this plan priced." in script
    assert "its gradients reduced after the pipeline's flush" in script
    jobs = commands(script)
    deepspeeds = replanned(plan_cli, jobs["deepspeed"])
    assert deepspeeds["config"] == {**plan["config"], "overlap_grad_reduce": False}
    megatrons = replanned(plan_cli, jobs["torchrun"])
    assert megatrons["config"] == {**plan["config"], "reductions_in_flight": None}
    assert megatrons["time"]["step_s"] < plan["time"]["step_s"]


def test_a_searchs_winner_comes_back_as_its_layout(plan_cli, tmp_path):
    plan, script, _ = exported(plan_cli, tmp_path, "--model", "gpt2-xl", "--gpus", "8",
                               "--memory-accounting", "megatron")
    argv = commands(script)["deepspeed"]
    assert "--gpus" not in argv and "--dp" in argv
    # DeepSpeed's bytes, and its two reductions in flight (the default with them)
    assert replanned(plan_cli, argv)["config"] == {**plan["ranked"][0]["config"],
                                                 "memory_accounting": "deepspeed",
                                                 "reductions_in_flight": 2}


def test_the_bloom_example_keeps_its_example(plan_cli, tmp_path):
    # BLOOM reduced after the flush: only whose bytes tell its launchers apart
    _, script, _ = exported(plan_cli, tmp_path, "--example", "bloom")
    assert "this plan priced" not in script
    plan, script, _ = exported(plan_cli, tmp_path / "m", "--example", "bloom",
                               "--memory-accounting", "megatron")
    argv = commands(script)["deepspeed"]
    assert argv == ["--example", "bloom", "--memory-accounting", "deepspeed"]
    assert replanned(plan_cli, argv)["config"] == {**plan["config"],
                                                 "memory_accounting": "deepspeed",
                                                 "reductions_in_flight": 2}


@pytest.mark.parametrize("argv", [
    (*OVERLAPPED[:-6], "--bucket-size-mb", "0"),  # one bucket: reduced after backward
    (*OVERLAPPED, "--no-overlap-grad-reduce"),
    (*OVERLAPPED, "--zero", "2"),  # DeepSpeed's alone (Megatron-LM has no ZeRO-2)
])
def test_where_the_launchers_jobs_are_the_plans_nothing_is_said(plan_cli, tmp_path, argv):
    _, script, tables = exported(plan_cli, tmp_path, *argv)
    assert "this plan priced" not in script and "this plan priced" not in tables


def test_without_a_command_the_note_gives_the_flags_that_change():
    shape, config, cluster = presets.bloom_example()
    overlapped = config.replace(overlap_grad_reduce=True, bucket_size_mb=25.0, pp=1,
                                dp=96, layer_split=None)
    assert launchers(shape, overlapped) == {"torchrun": {"reductions_in_flight": None},
                                            "deepspeed": {}}
    assert "#   this plan with --reductions-in-flight unlimited" in launch_note(shape,
                                                                              overlapped)
