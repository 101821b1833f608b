"""minipar profile DIR on a malformed trace folder: one line naming the file and what is
wrong, exit status 2; never a traceback, never a verdict on nonsense.

Each case edits one file of a real run's traces (minipar train --trace) and checks that
`minipar profile` refuses it, through the CLI (the message) and the library (the error
class: a ConfigError, so the CLI's MiniparError handling prints it, and a TraceError).
"""

import json
import math
import os
import shutil

import pytest

from minipar.cli import main
from minipar.distributed import TraceError, read_traces
from minipar.distributed.trace import TRACE_SCHEMA
from minipar.errors import ConfigError
from minipar.profile.breakdown import profile_traces
from minipar.profile.cli import profile_folder
from minipar.train import train

RUN = dict(dp=2, tp=2, pp=2, n_layer=2, d_model=32, seq_len=16, steps=1)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """The traces of `minipar train --dp 2 --tp 2 --pp 2 --n-layer 2 --d-model 32
    --seq-len 16 --steps 1 --trace DIR`."""
    folder = tmp_path_factory.mktemp("good")
    train(**RUN, trace=folder)
    return folder


def copy_of(good, tmp_path):
    folder = tmp_path / "trace"
    shutil.copytree(good, folder)
    return folder


def _events(trace, cat="kernel", compute=None):
    """The indices of the events of `cat` (kernels: compute or communication only)."""
    out = []
    for i, event in enumerate(trace["traceEvents"]):
        if not isinstance(event, dict) or event.get("cat") != cat:
            continue
        if compute is not None and (event["args"]["stream"] == 7) != compute:
            continue
        out.append(i)
    return out


def set_key(dotted, value):
    """An edit: trace[a][b]... = value (DELETE: remove the key)."""
    *parents, last = dotted.split(".")

    def edit(trace):
        node = trace
        for key in parents:
            node = node[key]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
        return trace
    return edit


def set_event(key, value, cat="kernel", compute=True, every=False):
    """An edit of the first (or every) event of `cat`: event[key] or event.args[key]."""
    def edit(trace):
        indices = _events(trace, cat, compute if cat == "kernel" else None)
        for i in indices if every else indices[:1]:
            event = trace["traceEvents"][i]
            node, name = (event["args"], key[5:]) if key.startswith("args.") else (event, key)
            if value is DELETE:
                del node[name]
            else:
                node[name] = value
        return trace
    return edit


def whole(text):
    return lambda trace: text


DELETE = object()
NAN, INF = math.nan, math.inf


def past_the_end(trace):
    (i, *_) = _events(trace, compute=True)
    trace["traceEvents"][i]["ts"] = trace["minipar"]["end_s"] * 2e6
    return trace


def no_steps(trace):
    trace["traceEvents"] = [e for e in trace["traceEvents"]
                            if e.get("cat") != "user_annotation"]
    return trace


def not_an_event(trace):
    trace["traceEvents"][3] = 5
    return trace


def memory_peak_of(nbytes):
    """An edit: a memory peak of `nbytes`, its categories still summing to it."""
    def edit(trace):
        peak = trace["minipar"]["memory_peak"]
        peak["by_category"]["params"] += nbytes - peak["bytes"]
        peak["bytes"] = nbytes
        return trace
    return edit


# (id, rank file to edit, edit, what the message must say besides the file's name)
CASES = [
    ("not JSON", 0, whole("{"), ["not a JSON trace"]),
    ("nested too deep", 0, whole("[" * 100_000), ["not a JSON trace"]),
    ("a list", 0, whole("[]"), ["not a minipar trace"]),
    ("another schema", 0, set_key("minipar.schema", "other/1"), ["not a minipar trace"]),
    ("minipar a string", 0, set_key("minipar", "x"), ["minipar", "object"]),
    ("only a schema", 0, whole(json.dumps({"minipar": {"schema": TRACE_SCHEMA}})),
     ["distributedInfo", "missing"]),
    ("traceEvents null", 0, set_key("traceEvents", None), ["traceEvents", "list"]),
    ("traceEvents empty", 0, set_key("traceEvents", []), ["no compute kernel"]),
    ("an event not an object", 0, not_an_event, ["traceEvents[3]", "object"]),
    ("device missing", 1, set_key("minipar.device", DELETE), ["minipar.device", "missing"]),
    ("device a string", 1, set_key("minipar.device", "x"), ["minipar.device", "object"]),
    ("device flops 0", 1, set_key("minipar.device.flops", 0), ["minipar.device", "flops"]),
    ("device flops a string", 1, set_key("minipar.device.flops", "x"),
     ["minipar.device", "flops"]),
    ("device name missing", 1, set_key("minipar.device.name", DELETE),
     ["minipar.device", "name"]),
    ("device roofline a string", 1, set_key("minipar.device.roofline", "x"),
     ["minipar.device", "roofline"]),
    ("end_s missing", 2, set_key("minipar.end_s", DELETE), ["minipar.end_s", "missing"]),
    ("end_s a string", 2, set_key("minipar.end_s", "x"), ["minipar.end_s", "number"]),
    ("end_s 0", 2, set_key("minipar.end_s", 0), ["minipar.end_s", "> 0"]),
    ("end_s NaN", 2, set_key("minipar.end_s", NAN), ["minipar.end_s", "finite"]),
    ("end_s negative", 2, set_key("minipar.end_s", -1e-4), ["minipar.end_s", "> 0"]),
    ("end_s inf", 2, set_key("minipar.end_s", INF), ["minipar.end_s", "finite"]),
    ("end_s true", 2, set_key("minipar.end_s", True), ["minipar.end_s", "number"]),
    ("config missing", 0, set_key("minipar.config", DELETE), ["minipar.config", "missing"]),
    ("config a string", 0, set_key("minipar.config", "abc"), ["minipar.config", "object"]),
    ("config empty", 0, set_key("minipar.config", {}), ["minipar.config", "world"]),
    ("config dp 0", 0, set_key("minipar.config.dp", 0), ["minipar.config", "dp", "positive"]),
    ("config unknown setting", 0, set_key("minipar.config.a", 1),
     ["minipar.config", "unknown setting"]),
    ("config lr a string", 0, set_key("minipar.config.lr", "x"), ["minipar.config", "lr"]),
    ("config of another run", 3, set_key("minipar.config.lr", 0.5),
     ["minipar.config", "rank0.json"]),
    ("device of another run", 3, set_key("minipar.device.flops", 1e12),
     ["minipar.device", "rank0.json"]),
    ("coords missing", 4, set_key("minipar.coords", DELETE), ["minipar.coords", "missing"]),
    ("coords a string", 4, set_key("minipar.coords", "x"), ["minipar.coords", "object"]),
    ("coords pp missing", 4, set_key("minipar.coords.pp", DELETE),
     ["minipar.coords.pp", "missing"]),
    ("coords pp a string", 4, set_key("minipar.coords.pp", "0"), ["minipar.coords.pp"]),
    ("coords pp past the mesh", 4, set_key("minipar.coords.pp", 7),
     ["minipar.coords.pp", "pp 2"]),
    ("memory_peak missing", 5, set_key("minipar.memory_peak", DELETE),
     ["minipar.memory_peak", "missing"]),
    ("memory_peak a string", 5, set_key("minipar.memory_peak", "x"),
     ["minipar.memory_peak", "object"]),
    ("memory_peak bytes negative", 5, set_key("minipar.memory_peak.bytes", -1),
     ["minipar.memory_peak.bytes"]),
    ("memory_peak bytes not the categories' sum", 5,
     set_key("minipar.memory_peak.bytes", 1), ["minipar.memory_peak", "sum"]),
    ("memory_peak category missing", 5, set_key("minipar.memory_peak.by_category.params",
                                                DELETE), ["by_category.params", "missing"]),
    ("memory_peak at_s NaN", 5, set_key("minipar.memory_peak.at_s", NAN),
     ["minipar.memory_peak.at_s", "finite"]),
    ("memory_peak after the end", 5, set_key("minipar.memory_peak.at_s", 1.0),
     ["minipar.memory_peak.at_s", "end_s"]),
    ("distributedInfo a list", 6, set_key("distributedInfo", []),
     ["distributedInfo", "object"]),
    ("world_size a string", 6, set_key("distributedInfo.world_size", "x"),
     ["distributedInfo.world_size", "integer"]),
    ("world_size null", 6, set_key("distributedInfo.world_size", None),
     ["distributedInfo.world_size", "integer"]),
    ("world_size 0", 6, set_key("distributedInfo.world_size", 0),
     ["distributedInfo.world_size", "integer"]),
    ("world_size 2.0", 6, set_key("distributedInfo.world_size", 2.0),
     ["distributedInfo.world_size", "integer"]),
    ("world_size not the config's", 6, set_key("distributedInfo.world_size", 16),
     ["minipar.config", "world size 8", "distributedInfo.world_size is 16"]),
    ("rank null", 7, set_key("distributedInfo.rank", None), ["distributedInfo.rank", "integer"]),
    ("rank a string", 7, set_key("distributedInfo.rank", "7"),
     ["distributedInfo.rank", "integer"]),
    ("rank past the world", 7, set_key("distributedInfo.rank", 8), ["distributedInfo.rank"]),
    ("rank twice", 7, set_key("distributedInfo.rank", 6), ["rank 6", "rank6.json"]),
    ("kernel without ts", 0, set_event("ts", DELETE), ["traceEvents[", "ts", "missing"]),
    ("kernel without dur", 0, set_event("dur", DELETE), ["traceEvents[", "dur", "missing"]),
    ("kernel without args", 0, set_event("args", DELETE), ["traceEvents[", "args", "missing"]),
    ("kernel without name", 0, set_event("name", DELETE), ["traceEvents[", "name", "missing"]),
    ("kernel dur a string", 0, set_event("dur", "abc"), ["traceEvents[", "dur", "number"]),
    ("kernel ts null", 0, set_event("ts", None), ["traceEvents[", "ts", "number"]),
    ("kernel ts inf", 0, set_event("ts", INF), ["traceEvents[", "ts", "finite"]),
    ("every dur NaN", 0, set_event("dur", NAN, every=True), ["traceEvents[", "dur", "finite"]),
    ("every dur negative", 0, set_event("dur", -1.0, every=True),
     ["traceEvents[", "dur", ">= 0"]),
    ("kernel after the end", 0, past_the_end, ["traceEvents[", "end_s"]),
    ("kernel without stream", 0, set_event("args.stream", DELETE),
     ["traceEvents[", "args.stream", "missing"]),
    ("kernel stream a string", 0, set_event("args.stream", "7"),
     ["traceEvents[", "args.stream", "integer"]),
    ("kernel without flops", 0, set_event("args.flops", DELETE),
     ["traceEvents[", "args.flops", "missing"]),
    ("kernel flops negative", 0, set_event("args.flops", -5), ["traceEvents[", "args.flops"]),
    ("kernel args a string", 0, set_event("args", "x"), ["traceEvents[", "args", "object"]),
    ("collective without group", 0, set_event("args.group", DELETE, compute=False),
     ["traceEvents[", "args.group", "missing"]),
    ("collective without op", 0, set_event("args.op", DELETE, compute=False),
     ["traceEvents[", "args.op", "missing"]),
    ("collective sent_bytes a string", 0, set_event("args.sent_bytes", "x", compute=False),
     ["traceEvents[", "args.sent_bytes", "number"]),
    ("ProfilerStep#x", 0, set_event("name", "ProfilerStep#x", cat="user_annotation"),
     ["traceEvents[", "ProfilerStep#x"]),
    ("step ts NaN", 0, set_event("ts", NAN, cat="user_annotation"),
     ["traceEvents[", "ts", "finite"]),
    ("step name a number", 0, set_event("name", 3, cat="user_annotation"),
     ["traceEvents[", "name", "string"]),
    ("no ProfilerStep", 0, no_steps, ["no ProfilerStep"]),
    # valid values, extreme: the figures made of them were inf GiB, nan%, a 300-digit
    # MFU or an OverflowError traceback
    ("end_s 1e300", 2, set_key("minipar.end_s", 1e300), ["minipar.end_s", "at most 1e+09"]),
    ("memory peak 10**400 bytes", 5, memory_peak_of(10**400),
     ["minipar.memory_peak.bytes", "at most"]),
    ("sent_bytes 1e308", 0, set_event("args.sent_bytes", 1e308, compute=False),
     ["args.sent_bytes", "at most"]),
    ("a kernel of 1e300 FLOPs", 0, set_event("args.flops", 1e300),
     ["ranks[0].hfu", "over 100%"]),
    ("every kernel 1e308 FLOPs", 0, set_event("args.flops", 1e308, every=True),
     ["ranks[0].hfu is inf", "not a finite number"]),
]


def malformed(good, tmp_path, rank, edit):
    folder = copy_of(good, tmp_path)
    path = folder / f"rank{rank}.json"
    new = edit(json.loads(path.read_text()))
    path.write_text(new if isinstance(new, str) else json.dumps(new))
    return folder


@pytest.mark.parametrize(("rank", "edit", "says"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_malformed_trace_is_one_line_naming_the_file_and_exit_status_2(
        good, tmp_path, capsys, rank, edit, says):
    folder = malformed(good, tmp_path, rank, edit)
    status = main(["profile", str(folder)])
    out, err = capsys.readouterr()
    assert status == 2, out + err
    assert out == ""  # no report on nonsense
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("minipar profile: error: ")
    assert f"rank{rank}.json" in err
    for words in says:
        assert words in err, err
    assert not err.removeprefix("minipar profile: error: ").startswith("--")  # no flag typed


@pytest.mark.parametrize(("rank", "edit"), [c[1:3] for c in CASES], ids=[c[0] for c in CASES])
def test_a_malformed_trace_raises_a_config_error_naming_the_file(good, tmp_path, rank, edit):
    folder = malformed(good, tmp_path, rank, edit)
    with pytest.raises(ConfigError, match=f"rank{rank}\\.json") as caught:
        profile_folder(folder)
    assert isinstance(caught.value, TraceError)


def test_the_library_checks_traces_it_is_given_too(good, tmp_path):
    folder = malformed(good, tmp_path, 2, set_key("minipar.end_s", NAN))
    with pytest.raises(ConfigError, match="minipar.end_s"):
        profile_traces(read_traces(folder))


@pytest.mark.parametrize("what", ["missing", "empty", "a file", "a rank missing",
                                  "a rank file that is a folder"])
def test_a_folder_that_is_not_a_run_is_one_line(good, tmp_path, capsys, what):
    folder = tmp_path / "trace"
    if what == "empty":
        folder.mkdir()
    elif what == "a file":
        folder.write_text("x")
    elif what != "missing":
        shutil.copytree(good, folder)
        (folder / "rank5.json").unlink()
        if what == "a rank file that is a folder":
            (folder / "rank5.json").mkdir()
    assert main(["profile", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert str(folder) in err
    if what.startswith("a rank"):
        assert "rank5" in err or "rank 5" in err


def test_a_good_trace_gives_the_same_report_as_before(good, capsys):
    assert main(["profile", str(good)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "Bottleneck:" in out
    assert out.strip() == profile_traces(read_traces(good)).text().strip()


@pytest.mark.parametrize("json_path", ["", "out/p.json/", "missing/p.json", "out"])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_work(
        good, tmp_path, capsys, monkeypatch, json_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    assert main(["profile", str(good), "--json", json_path]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before the report, not after it
    assert err.startswith("minipar profile: error: --json: ") and err.count("\n") == 1
    assert "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []


def test_the_json_report_is_written(good, tmp_path, capsys):
    path = tmp_path / "p.json"
    assert main(["profile", str(good), "--json", str(path)]) == 0
    assert "profile written to" in capsys.readouterr().out
    assert json.loads(path.read_text())["verdict"]["bottleneck"]


@pytest.mark.parametrize("what, says", [("a FIFO", "a FIFO (named pipe)"),
                                        ("/dev/zero", "a character device"),
                                        ("200 GiB", "200.0 GiB, larger than a trace can be")])
def test_a_rank_file_that_is_not_a_trace_sized_file_is_refused_unread(good, tmp_path, capsys,
                                                                     what, says):
    """A FIFO blocked the read forever, /dev/zero read until memory ran out, a sparse
    200 GiB file was read whole: each is refused from its stat, before a byte is read."""
    folder = copy_of(good, tmp_path)
    path = folder / "rank3.json"
    path.unlink()
    if what == "a FIFO":
        os.mkfifo(path)
    elif what == "/dev/zero":
        path.symlink_to("/dev/zero")
    else:
        with open(path, "wb") as f:
            f.truncate(200 * 2**30)
    assert main(["profile", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "rank3.json: not a JSON trace" in err and says in err, err


def test_figures_out_of_range_together_are_one_line(good, tmp_path, capsys):
    """Every file's device a 1e-300 FLOP/s GPU (the same in every file, each value
    positive and finite): the MFU comes out infinite, and is refused as such."""
    folder = copy_of(good, tmp_path)
    for path in folder.glob("rank*.json"):
        trace = json.loads(path.read_text())
        trace["minipar"]["device"]["flops"] = 1e-300
        path.write_text(json.dumps(trace))
    assert main(["profile", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert f"{folder}: the profile's mfu is" in err and "not a run minipar" in err, err


def test_kernels_that_executed_next_to_nothing_are_not_the_config_s_run(good, tmp_path,
                                                                        capsys):
    """Kernels of 1e-300 FLOPs each (valid numbers): the config's model needs ~1e300
    times more, which made any MFU possible; refused as a figure out of range."""
    folder = copy_of(good, tmp_path)
    for path in folder.glob("rank*.json"):
        path.write_text(json.dumps(set_event("args.flops", 1e-300, every=True)(
            json.loads(path.read_text()))))
    assert main(["profile", str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert "the profile's mfu is" in err and "over 1000 times its HFU" in err, err


def test_an_moe_run_dropping_tokens_has_an_mfu_over_100_percent_and_is_profiled(tmp_path):
    """MFU counts the model's FLOPs, HFU the executed ones: an MoE layer dropping tokens
    over capacity executes fewer than the model counts, so a compute-bound run's MFU can
    pass 100% while its HFU cannot. Such a run is profiled, not refused."""
    train(seq_len=8, n_layer=1, d_model=16, n_head=2, micro_batch_size=2, steps=1,
          moe_num_experts=4, moe_capacity_factor=0.25, trace=tmp_path)
    profile = profile_folder(tmp_path)
    assert profile.mfu > 1 and all(r["hfu"] <= 1 + 1e-9 for r in profile.ranks)


def test_the_json_report_on_a_full_disk_keeps_the_earlier_one(good, small_disk, capsys):
    """`profile --json` onto a full disk: one line, exit 2, the profile printed, and the
    earlier file at that path whole (it used to be truncated, with a traceback)."""
    disk = small_disk("64k")
    earlier = disk / "p.json"
    earlier.write_text('{"earlier": true}')
    with open(disk / "filler", "wb", buffering=0) as f:  # fill the disk up
        try:
            while True:
                f.write(b"x" * 4096)
                f.flush()
        except OSError:
            pass
    assert main(["profile", str(good), "--json", str(earlier)]) == 2
    out, err = capsys.readouterr()
    assert "Bottleneck:" in out and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("minipar profile: error: --json: ") and "No space left" in err
    assert json.loads(earlier.read_text()) == {"earlier": True}
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "p.json"]
