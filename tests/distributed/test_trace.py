"""Profiler traces: what a traced launch records, and the Chrome Trace Event files it writes."""

import json
import re

import numpy as np
import pytest

from minipar import distributed as dist
from minipar.distributed.trace import COMPUTE_STREAM, TraceError, rank_trace, read_traces

FLOPS = 4e6  # 10 ns on the default H100 profile (400 TFLOP/s); the all-reduce takes ~6 us


def overlapping_worker():
    """Rank 0 computes while its all-reduce runs; then a send to rank 1; memory comes and goes."""
    device = dist.get_device()
    rank = dist.get_rank()
    x = np.ones(1024, dtype=np.float32)
    device.memory.hold(x, "params")
    work = dist.all_reduce(x, async_op=True)
    buffer = np.zeros(4096, dtype=np.float32)
    device.memory.hold(buffer, "buffers")
    for _ in range(3):
        device.compute(FLOPS, "forward", op="Linear")
    work.wait()
    device.memory.release(buffer)
    device.compute(FLOPS, "backward", op="Linear")
    if rank == 0:
        dist.send(x, 1)
    else:
        dist.recv(0)


def traced(worker=overlapping_worker, world=2):
    _, devices = dist.launch(worker, world, return_devices=True, trace=True)
    return devices


def kernels(trace, stream=None):
    return [e for e in trace["traceEvents"] if e.get("cat") == "kernel"
            and (stream is None or e["args"]["stream"] == stream)]


def test_an_untraced_launch_keeps_nothing_extra():
    _, devices = dist.launch(overlapping_worker, 2, return_devices=True)
    assert devices[0].trace is None and devices[0].memory.history is None
    with pytest.raises(ValueError, match="trace=True"):
        rank_trace(devices[0])


def test_every_op_is_a_compute_kernel_whose_time_is_the_clocks():
    device = traced()[0]
    trace = rank_trace(device)
    compute = kernels(trace, COMPUTE_STREAM)
    assert [e["name"] for e in compute] == ["Linear"] * 3 + ["LinearBackward"]
    assert sum(e["dur"] for e in compute) == pytest.approx(device.clock.compute_s * 1e6)
    assert [e["args"]["kind"] for e in compute] == ["forward"] * 3 + ["backward"]


def test_kernels_follow_the_conventions_holistic_trace_analysis_reads():
    trace = rank_trace(traced()[1])
    assert list(trace)[0] == "distributedInfo"  # HTA takes the first "rank": N it finds
    assert re.search(r'"rank":\s+(\d+)', json.dumps(trace)).group(1) == "1"
    assert trace["distributedInfo"] == {"backend": "nccl", "rank": 1, "world_size": 2}
    launches = {e["args"]["correlation"]: e for e in trace["traceEvents"]
                if e.get("name") == "cudaLaunchKernel"}
    for kernel in kernels(trace):
        assert {"stream", "device", "correlation"} <= set(kernel["args"])
        launch = launches[kernel["args"]["correlation"]]  # launched from the host thread
        assert launch["cat"] == "cuda_runtime" and launch["ts"] == kernel["ts"]
    comm = [k for k in kernels(trace) if k["args"]["stream"] != COMPUTE_STREAM]
    assert {k["args"]["op"] for k in comm} == {"all_reduce", "recv"}
    assert all(re.match(r"^nccl.*Kernel", k["name"]) for k in comm)
    assert not any(re.match(r"^nccl.*Kernel", k["name"]) for k in kernels(trace, COMPUTE_STREAM))


def test_communication_kernels_carry_the_byte_ledgers_figures():
    device = traced()[0]
    trace = rank_trace(device)
    comm = [k for k in kernels(trace) if k["args"]["stream"] != COMPUTE_STREAM]
    assert len(comm) == len(device.comm.records)
    for kernel, record in zip(comm, device.comm.records, strict=True):
        assert kernel["args"]["sent_bytes"] == record.sent_bytes
        assert kernel["args"]["group_ranks"] == list(record.group_ranks)
        assert kernel["ts"] == record.start * 1e6
        assert kernel["dur"] == pytest.approx((record.end - record.start) * 1e6)


def test_slices_on_one_thread_never_overlap():
    for device in traced():
        by_thread = {}
        for e in kernels(rank_trace(device)):
            by_thread.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
        for spans in by_thread.values():
            spans.sort()
            # exactly, in floating point, as a viewer adds ts + dur
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_each_send_flows_to_its_recv_on_the_peer():
    traces = [rank_trace(d) for d in traced()]
    starts = [e for e in traces[0]["traceEvents"] if e.get("ph") == "s"]
    ends = [e for e in traces[1]["traceEvents"] if e.get("ph") == "f"]
    assert len(starts) == len(ends) == 1
    assert starts[0]["id"] == ends[0]["id"] and starts[0]["ts"] == ends[0]["ts"]
    assert (starts[0]["pid"], ends[0]["pid"]) == (0, 1)


def test_memory_counters_replay_the_ledger():
    device = traced()[0]
    counters = [e for e in rank_trace(device)["traceEvents"] if e.get("ph") == "C"]
    totals = [sum(e["args"].values()) for e in counters]
    assert max(totals) == device.memory.peak_total
    assert counters[-1]["args"] == device.memory.current
    peak = counters[totals.index(max(totals))]
    assert peak["args"]["buffers"] == 4096 * 4  # the peak is while the buffer is held


def test_the_memory_peak_is_replayed_exactly_with_its_moment():
    device = traced()[0]
    peak = rank_trace(device)["minipar"]["memory_peak"]
    assert peak["bytes"] == device.memory.peak_total
    assert peak["by_category"]["buffers"] == 4096 * 4 and peak["at_s"] == 0.0
    # a buffer held and released at one instant shows in the peak, not on the counter
    def spike():
        device = dist.get_device()
        device.compute(FLOPS, "forward")
        spike = np.zeros(100, dtype=np.float64)
        device.memory.hold(spike, "buffers")
        device.memory.release(spike)
        device.compute(FLOPS, "forward")

    device = traced(spike, world=1)[0]
    trace = rank_trace(device)
    assert trace["minipar"]["memory_peak"] == {
        "bytes": 800, "at_s": FLOPS / 400e12,
        "by_category": {"params": 0, "grads": 0, "optimizer": 0, "activations": 0,
                        "buffers": 800}}
    assert all(sum(e["args"].values()) == 0 for e in trace["traceEvents"] if e["ph"] == "C")


def test_profiler_steps_and_metadata():
    device = traced()[0]
    trace = rank_trace(device, steps=[(0, 0.0, 1e-6), (1, 1e-6, 2e-6)],
                       metadata={"coords": {"dp": 0}})
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]
    assert [(e["name"], e["ts"], e["dur"]) for e in steps] == [
        ("ProfilerStep#0", 0.0, 1.0), ("ProfilerStep#1", 1.0, 1.0)]
    assert trace["minipar"]["coords"] == {"dp": 0}
    assert trace["deviceProperties"][0]["peakFlops"] == device.profile.flops


def test_comm_overlap_splits_communication_into_hidden_and_exposed():
    # compute [0, 2] and [3, 4]; transfers [1, 3.5] and [3.2, 5]: comm is [1, 5] (4 s),
    # of which [1, 2] and [3, 4] run under compute.
    overlap = dist.comm_overlap([(0, 2), (3, 4)], [(1, 3.5), (3.2, 5)])
    assert overlap == {"compute_s": 3, "comm_s": 4, "overlapped_comm_s": 2,
                       "exposed_comm_s": 2, "busy_s": 5}


def test_an_async_all_reduce_is_partly_hidden_behind_compute():
    overlap = dist.device_comm_overlap(traced()[0])
    assert overlap["overlapped_comm_s"] == pytest.approx(3 * FLOPS / 400e12)
    assert overlap["exposed_comm_s"] > 0


def test_write_and_read_a_trace_folder(tmp_path):
    devices = traced()
    paths = dist.write_traces(tmp_path, devices)
    assert [p.name for p in paths] == ["rank0.json", "rank1.json"]
    assert (tmp_path / "merged" / "all_ranks.json").exists()
    traces = read_traces(tmp_path)
    assert [t["distributedInfo"]["rank"] for t in traces] == [0, 1]
    merged = json.loads((tmp_path / "merged" / "all_ranks.json").read_text())
    flows = [e for e in merged["traceEvents"] if e.get("ph") in ("s", "f")]
    assert len(flows) == 2 and flows[0]["id"] == flows[1]["id"]


def test_reading_a_folder_that_is_not_a_trace_says_so(tmp_path):
    with pytest.raises(TraceError, match="is not a folder"):
        read_traces(tmp_path / "missing")
    with pytest.raises(TraceError, match="no rank<N>.json"):
        read_traces(tmp_path)
    (tmp_path / "rank0.json").write_text("{not json")
    with pytest.raises(TraceError, match="not a JSON trace"):
        read_traces(tmp_path)
    (tmp_path / "rank0.json").write_text('{"traceEvents": []}')
    with pytest.raises(TraceError, match="not a minipar trace"):
        read_traces(tmp_path)


def test_the_device_section_reads_back_as_the_profile_it_came_from():
    from dataclasses import asdict

    from minipar.distributed.trace import device_profile, peak_flops

    for profile in (dist.DeviceProfile(), dist.H100, dist.A100):
        values = json.loads(json.dumps(asdict(profile)))  # as a trace file holds it
        assert device_profile(values) == profile
    assert peak_flops(asdict(dist.A100)) == dist.A100.roofline.peak_flops


def test_every_group_kind_gets_its_own_stream_and_all_to_all_is_a_send_recv_kernel():
    """MoE's all-to-all over an "ep" group (and CP's "cp" ring) are traced like the other
    collectives: their own stream per group kind, NCCL's SendRecv kernel name."""
    def worker():
        dist.all_to_all(np.ones((2, 8)), group=dist.new_group([0, 1], kind="ep"))
        dist.all_reduce(np.ones(8), group=dist.new_group([0, 1], kind="cp"))

    trace = rank_trace(traced(worker)[0])
    streams = {e["args"]["stream"]: e["name"] for e in kernels(trace) if "nccl" in e["name"]}
    assert len(streams) == 2 and "ncclDevKernel_SendRecv" in streams.values()


def test_read_traces_refuses_a_trace_without_its_rank_in_one_error(tmp_path):
    """profile.py's recipe, profile_traces(read_traces(DIR)), raised KeyError
    'distributedInfo' on such a file (a reviewer's case)."""
    import json

    from minipar.distributed import TraceError, read_traces
    from minipar.distributed.trace import TRACE_SCHEMA

    (tmp_path / "rank0.json").write_text(json.dumps({"minipar": {"schema": TRACE_SCHEMA},
                                                     "traceEvents": []}))
    with pytest.raises(TraceError, match="distributedInfo.rank"):
        read_traces(tmp_path)
