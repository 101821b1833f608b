"""Holistic Trace Analysis reads minipar's traces and agrees with minipar's own figures.

Needs the optional extra: pip install -e ".[profile]" (holistictraceanalysis==0.5.0).
HTA reads every rank<N>.json of the folder as one rank (distributedInfo.rank), recognises
GPU kernels by "cat": "kernel" with a stream, communication kernels by their `nccl...Kernel`
names, and steps by ProfilerStep#N; docs/profiling.md lists the conventions.
"""

import logging

import pytest

from minipar.demo import DEMO_PROFILE
from minipar.distributed import read_traces
from minipar.profile.breakdown import profile_traces, rank_breakdown
from minipar.train import train


def trace_analysis_class():
    """HTA's TraceAnalysis, or a skip naming the extra to install. Imported inside the
    fixture, not at module level, so that the file is still collected (and each test
    reported as skipped) without HTA: tests/test_layout.py checks no test file is lost."""
    pytest.importorskip(
        "hta", reason="Holistic Trace Analysis is not installed: pip install -e '.[profile]'")
    from hta.trace_analysis import TraceAnalysis

    return TraceAnalysis


# HTA 0.5.0 calls pandas APIs that newer pandas deprecates: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:::hta")
TINY = dict(n_layer=2, d_model=32, n_head=4, seq_len=16, data="synthetic", steps=2)
US = 1e6
RUNS = {
    # gradient buckets reduced while backward goes on: communication hidden under compute
    "dp2 buckets": dict(dp=2, micro_batch_size=2, grad_accum_steps=2, bucket_size_mb=0.004),
    # a pipeline (bubble: idle) with tensor parallelism (exposed all-reduces) and ZeRO-1
    "dp2 tp2 pp2": dict(dp=2, tp=2, pp=2, zero=1, micro_batch_size=2, grad_accum_steps=4),
}


@pytest.fixture(scope="module", params=list(RUNS))
def analysed(request, tmp_path_factory):
    """(report, minipar's profile, HTA's temporal breakdown and overlap) of one traced run."""
    trace_analysis = trace_analysis_class()  # skip before training when HTA is absent
    folder = tmp_path_factory.mktemp("trace")
    report = train(**TINY, **RUNS[request.param], device=DEMO_PROFILE, trace=folder)
    traces = read_traces(folder)
    # minipar's kernels last nanoseconds-microseconds: HTA would round timestamps to whole
    # microseconds (a workaround for a PyTorch bug, pytorch/pytorch#122425) unless told not to.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HTA_DISABLE_NS_ROUNDING", "1")
        # HTA parses the ranks' files in a fork()ed pool by default; a test worker runs
        # threads (explorers' workers, watchdogs), and fork() beside threads can deadlock
        # the child (Python 3.12+ warns). The same parser, in this process:
        from hta.common.trace import Trace

        load_traces = Trace.load_traces
        env.setattr(Trace, "load_traces", lambda self, *args, **kwargs: load_traces(
            self, *args, **{**kwargs, "use_multiprocessing": False}))
        logging.getLogger("hta").setLevel(logging.ERROR)
        analysis = trace_analysis(trace_dir=str(folder), include_last_profiler_step=True)
        breakdown = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
        overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    return report, traces, profile_traces(traces, verdict=False), breakdown, overlap


def test_hta_finds_every_rank_and_step(analysed):
    report, traces, _, breakdown, _ = analysed
    assert list(breakdown.index) == list(range(report.world_size))


def test_compute_time_agrees_with_the_report(analysed):
    report, _, _, breakdown, _ = analysed
    for r in report.ranks:
        hta_compute = breakdown.loc[r["rank"], "compute_time(us)"]
        assert hta_compute == pytest.approx(r["time"]["compute_s"] * US, rel=1e-9)


def test_non_compute_time_is_the_reports_exposed_communication(analysed):
    report, _, _, breakdown, _ = analysed
    for r in report.ranks:
        hta_exposed = breakdown.loc[r["rank"], "non_compute_time(us)"]
        assert hta_exposed == pytest.approx(r["time"]["exposed_comm_s"] * US, rel=1e-9)


def test_comm_comp_overlap_agrees_with_the_profile(analysed):
    _, _, profile, _, overlap = analysed
    for row in profile.ranks:
        percent = 100 * row["overlapped_comm_s"] / row["comm_s"]
        # HTA rounds the percentage to 2 decimals
        assert overlap.loc[row["rank"], "comp_comm_overlap_pctg"] == pytest.approx(
            percent, abs=0.005 + 1e-9)


def test_idle_time_agrees_over_htas_window(analysed):
    """HTA's window is a rank's first to last kernel; minipar's profile takes any window."""
    _, traces, _, breakdown, _ = analysed
    for trace in traces:
        kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
        start = min(e["ts"] for e in kernels) / US
        end = max(e["ts"] + e["dur"] for e in kernels) / US
        rank = trace["distributedInfo"]["rank"]
        mine = rank_breakdown(trace, start, end)
        assert breakdown.loc[rank, "idle_time(us)"] == pytest.approx(mine["idle_s"] * US,
                                                                     rel=1e-9, abs=1e-9)
        assert breakdown.loc[rank, "kernel_time(us)"] == pytest.approx((end - start) * US)


def test_the_runs_show_what_they_were_chosen_for(analysed):
    """Not vacuous: the bucketed run hides some communication, the pipeline idles."""
    report, _, profile, _, overlap = analysed
    if report.config["pp"] == 1:
        assert (overlap["comp_comm_overlap_pctg"] > 5).all()
    else:
        assert all(r["idle_s"] > 0.1 * profile.window_s for r in profile.ranks)
