"""`minipar plan --reductions-in-flight`: where a limit can change the plan, and the job
it names (minipar.plan.cli; ParallelConfig.reductions_limit_moot)."""

from __future__ import annotations

import json

import pytest

# gpt2-xl, ZeRO-1 over dp 4 with 25 MiB buckets reduced during backward: a layout whose
# step the limit changes
OVERLAPPED = ("--model", "gpt2-xl", "--cluster", "a100", "--dp", "4", "--zero", "1",
              "--bucket-size-mb", "25", "--micro-batch-size", "1", "--grad-accum-steps", "4")


@pytest.mark.parametrize("argv,why", [
    # BLOOM's run reduced after the pipeline's flush (DeepSpeed's pipeline engine)
    (("--example", "bloom"), "BLOOM's run reduces them after the pipeline's flush"),
    ((*OVERLAPPED, "--no-overlap-grad-reduce"), "after backward (--no-overlap-grad-reduce)"),
    ((*OVERLAPPED, "--bucket-size-mb", "0"), "one gradient bucket (--bucket-size-mb 0"),
    (("--model", "gpt2-xl", "--pp", "4", "--zero", "1", "--bucket-size-mb", "25"),
     "dp x cp = 1 has no data-parallel reduction"),
    (("--model", "mixtral-8x7b", "--dp", "8", "--ep", "8", "--zero", "1",
      "--bucket-size-mb", "25"), "an MoE model's reductions are priced as they block"),
    (("--model", "gpt2-xl", "--gpus", "8", "--no-overlap-grad-reduce"),
     "--no-overlap-grad-reduce reduces every layout's after backward"),
    (("--model", "gpt2-xl", "--dp", "4", "--zero", "3", "--bucket-size-mb", "25"),
     "ZeRO-3's own"),
])
@pytest.mark.parametrize("limit", ["unlimited", "2"])
def test_a_limit_that_cannot_change_the_plan_is_refused_not_ignored(plan_cli, argv, why, limit):
    # every layout where no reduction waits for another: a limit given there is refused
    # with the reason, as for ZeRO-0 and ZeRO-3, never priced and called a difference
    status, out, err = plan_cli(*argv, "--reductions-in-flight", limit)
    assert status == 2 and out == ""
    error = err.splitlines()[-1]  # (after "minipar plan: estimating ...", if it was slow)
    assert error.startswith("minipar plan: error: --reductions-in-flight: limits ZeRO-1/2's")
    assert why in error and error.endswith("drop it")


def test_the_bloom_example_is_compared_with_its_run_and_takes_no_limit(plan_cli):
    # BLOOM's gradients were reduced after the flush: no limit of reductions in flight
    # could change its step, so `--reductions-in-flight unlimited` is refused where it
    # read "this plan changes reductions_in_flight, so it is not compared"
    status, _, err = plan_cli("--example", "bloom", "--reductions-in-flight", "unlimited")
    assert status == 2 and "changes reductions_in_flight" not in err
    status, out, _ = plan_cli("--example", "bloom")
    assert status == 0 and "this plan is -6.9%" in out
    # overlapped over buckets, BLOOM's layout is another job, in which the limit counts
    argv = ("--example", "bloom", "--overlap-grad-reduce", "--bucket-size-mb", "500",
            "--json", "-")
    _, deepspeeds, _ = plan_cli(*argv)
    status, megatrons, _ = plan_cli(*argv, "--reductions-in-flight", "unlimited")
    deepspeeds, megatrons = json.loads(deepspeeds), json.loads(megatrons)
    assert status == 0 and megatrons["config"]["reductions_in_flight"] is None
    assert set(megatrons["published"]["changed"]) == {"overlap_grad_reduce", "bucket_size_mb",
                                                      "reductions_in_flight"}


def test_where_the_limit_counts_the_plan_names_it(plan_cli):
    status, out, _ = plan_cli(*OVERLAPPED, "--reductions-in-flight", "unlimited")
    assert status == 0 and "no limit of reductions in flight" in out
    status, out, _ = plan_cli(*OVERLAPPED)
    assert status == 0 and "at most 2 reductions in flight (DeepSpeed's overlap_comm)" in out


# ZeRO-1 over dp 4 across 2-GPU nodes with a pipeline and 1 MiB buckets: DeepSpeed's two
# reductions in flight stall a backward, Megatron-LM's distributed optimizer does not
STALLED = ("--model", "gpt2-xl", "--cluster", "a100", "--gpus-per-node", "2", "--dp", "4",
           "--pp", "2", "--zero", "1", "--bucket-size-mb", "1", "--micro-batch-size", "1",
           "--grad-accum-steps", "4")


def test_megatrons_bytes_come_with_megatrons_reductions(plan_cli):
    # --memory-accounting megatron plans Megatron-LM's job: its bytes and its distributed
    # optimizer's reductions, none waiting for another; before, the step was DeepSpeed's
    plans = {}
    for name, argv in (("deepspeed", ()), ("unlimited", ("--reductions-in-flight", "unlimited")),
                       ("megatron", ("--memory-accounting", "megatron")),
                       ("both", ("--memory-accounting", "megatron", "--reductions-in-flight",
                                 "unlimited"))):
        status, out, _ = plan_cli(*STALLED, *argv, "--json", "-")
        assert status == 0
        plans[name] = json.loads(out)
    assert plans["megatron"]["config"]["reductions_in_flight"] is None
    assert plans["megatron"]["time"] == plans["unlimited"]["time"] == plans["both"]["time"]
    assert plans["megatron"]["time"]["step_s"] < plans["deepspeed"]["time"]["step_s"]
    _, out, _ = plan_cli(*STALLED, "--memory-accounting", "megatron")
    assert "no limit of reductions in flight (Megatron-LM's distributed optimizer)" in out
    # a search prices every candidate so
    _, advice, _ = plan_cli("--model", "gpt2-xl", "--gpus", "8", "--top", "2",
                       "--memory-accounting", "megatron", "--json", "-")
    assert all(r["config"]["reductions_in_flight"] is None
               for r in json.loads(advice)["ranked"])
    # DeepSpeed's bytes keep DeepSpeed's two
    _, out, _ = plan_cli(*STALLED, "--memory-accounting", "deepspeed", "--json", "-")
    assert json.loads(out)["config"]["reductions_in_flight"] == 2


@pytest.mark.parametrize("accounting,limit,whose", [
    ("megatron", "2", "2 is not Megatron-LM's"),
    ("megatron", "1", "1 is not Megatron-LM's"),
    ("deepspeed", "unlimited", "unlimited is not DeepSpeed's"),
    ("deepspeed", "3", "3 is not DeepSpeed's"),
])
def test_one_systems_bytes_with_anothers_reductions_is_refused(plan_cli, accounting, limit,
                                                               whose):
    # a plan of Megatron-LM's bytes and DeepSpeed's time describes no job either runs
    for argv in (STALLED, ("--model", "gpt2-xl", "--gpus", "8")):
        status, out, err = plan_cli(*argv, "--memory-accounting", accounting,
                               "--reductions-in-flight", limit)
        assert status == 2 and out == ""
        error = err.splitlines()[-1]
        assert f"--reductions-in-flight: {whose}" in error
        assert f"--memory-accounting {accounting} counts" in error


def test_the_bloom_example_counts_megatrons_bytes_and_is_still_compared(plan_cli):
    # its reductions follow the flush whoever's optimizer: the limit changes nothing
    status, out, _ = plan_cli("--example", "bloom", "--memory-accounting", "megatron",
                         "--json", "-")
    plan = json.loads(out)
    assert status == 0 and plan["config"]["reductions_in_flight"] is None
    assert plan["published"]["changed"] == [] and plan["published"]["error"] is not None
