"""Plain-text tables of a report and of the equivalence grid: what the CLI prints and
notebooks can show. The grid's cases and verdicts live in minipar/train/grid.py; how they
read on a terminal lives here, beside the other tables."""

from __future__ import annotations

import unicodedata

from minipar.train.grid import GridResult
from minipar.train.report import MEMORY_CATEGORIES, Report


def byte_unit(largest: float) -> tuple[str, float]:
    """The binary unit an axis of bytes up to `largest` is drawn in: ("MiB", 2**20) ..."""
    return next(((unit, float(scale)) for unit, scale in (("GiB", 2**30), ("MiB", 2**20),
                 ("KiB", 2**10)) if largest >= scale), ("B", 1.0))


BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")  # each 1024 times the one before


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as memory is counted)."""
    value = float(n)
    for unit in BINARY_UNITS:
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def span(values, show=human_bytes) -> str:
    """'1.0 KiB to 2.0 KiB', or '1.0 KiB' when the smallest and largest read the same
    (a status line's "X to X" reads like a typo)."""
    low, high = show(min(values)), show(max(values))
    return low if low == high else f"{low} to {high}"


def display_width(text: str) -> int:
    """Columns `text` takes in a monospaced font: a CJK character takes two (the Chinese
    headers of the interview drill's tables)."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def format_table(headers: list[str], rows: list[list], align: str | None = None) -> str:
    """A fixed-width table; `align` is one of 'l'/'r' per column (default: first left)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(display_width(row[i]) for row in cells) for i in range(len(headers))]
    align = align or "l" + "r" * (len(headers) - 1)

    def pad(cell: str, width: int, side: str) -> str:
        fill = " " * (width - display_width(cell))
        return cell + fill if side == "l" else fill + cell

    def line(row):
        return "  ".join(pad(c, w, a)
                         for c, w, a in zip(row, widths, align, strict=True)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def loss_table(report: Report, max_rows: int = 12) -> str:
    """Loss, learning rate and gradient norm per step (the middle elided on long runs);
    an MoE run adds its aux loss beside the LM loss (Megatron logs "lm loss" and
    "load_balancing_loss" apart)."""
    steps = [dict(s) for s in report.steps]
    aux = report.moe["aux_loss"] if report.moe and "aux_loss" in report.moe else None
    if aux is not None:
        for s, value in zip(steps, aux, strict=True):
            s["aux_loss"] = value
    if len(steps) > max_rows:
        half = max_rows // 2
        shown = steps[:half] + [None] + steps[-half:]
    else:
        shown = steps
    header = ["step", "loss", "lr", "grad_norm"] + ([] if aux is None else ["aux_loss"])
    rows = [["...", *[""] * (len(header) - 1)] if s is None else
            [s["step"], f"{s['loss']:.4f}", f"{s['lr']:.2e}", f"{s['grad_norm']:.3f}"]
            + ([] if aux is None else [f"{s['aux_loss']:.5f}"])
            for s in shown]
    return format_table(header, rows)


def memory_table(report: Report) -> str:
    """Peak bytes per memory category, one row per rank (measured by each rank's ledger)."""
    headers = ["rank", _coords_header(report), *MEMORY_CATEGORIES, "peak_total"]
    rows = []
    for r in report.ranks:
        rows.append([r["rank"], _coords(r),
                     *(human_bytes(r["memory"][k]) for k in MEMORY_CATEGORIES),
                     human_bytes(r["memory"]["peak_total"])])
    return format_table(headers, rows)


def tier_table(report: Report) -> str | None:
    """With offload: each rank's peak host and NVMe bytes and what it copied between its
    tiers per step (ranks[i].memory_host / memory_nvme / transfers); None without."""
    ranks = [r for r in report.ranks
             if r.get("memory_host", {}).get("peak_total") or
             r.get("memory_nvme", {}).get("peak_total")]
    if not ranks:
        return None
    steps = max(1, len(report.steps))
    headers = ["rank", "GPU peak", "host peak", "NVMe peak", "PCIe down/step",
               "PCIe up/step", "NVMe read/step", "NVMe write/step"]
    rows = [[r["rank"], human_bytes(r["memory"]["peak_total"]),
             human_bytes(r["memory_host"]["peak_total"]),
             human_bytes(r["memory_nvme"]["peak_total"]),
             *(human_bytes(r["transfers"][k] / steps) for k in
               ("to_host_bytes", "to_device_bytes", "nvme_read_bytes", "nvme_write_bytes"))]
            for r in ranks]
    return format_table(headers, rows)


def _coords(rank: dict) -> str:
    """"dp/pp/tp", or "dp/pp/cp/tp" for a rank of a context-parallel mesh."""
    c = rank["coords"]
    return "/".join(str(c[axis]) for axis in ("dp", "pp", "cp", "tp") if axis in c)


def _coords_header(report: Report) -> str:
    return "dp/pp/cp/tp" if any("cp" in r["coords"] for r in report.ranks) else "dp/pp/tp"


def traffic_table(report: Report) -> str:
    """Bytes each rank sent per optimizer step, by group kind and by collective."""
    steps = max(1, len(report.steps))
    kinds = {g for r in report.ranks for g, sent in r["comm"]["by_group"].items() if sent}
    order = ("dp", "tp", "pp", "cp", "ep")  # then any other kind (MoE's "ep", "edp", ...)
    groups = ([g for g in order if g in kinds] + sorted(kinds - {*order, "other"})
              + ["other"] * ("other" in kinds))
    ops = sorted({op for r in report.ranks for op, b in r["comm"]["by_op"].items() if b})
    headers = ["rank", _coords_header(report), "node", *(f"{g} group" for g in groups), *ops,
               "sent/step", "calls/step"]
    rows = []
    for r in report.ranks:
        comm = r["comm"]
        rows.append([r["rank"], _coords(r), r["node"],
                     *(human_bytes(comm["by_group"].get(g, 0) / steps) for g in groups),
                     *(human_bytes(comm["by_op"].get(op, 0) / steps) for op in ops),
                     human_bytes(comm["sent_bytes"] / steps), f"{comm['calls'] / steps:g}"])
    return format_table(headers, rows)


def human_seconds(seconds: float) -> str:
    """0.00012 -> '120.0 us' (simulated time)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if abs(seconds) >= scale or unit == "ns":
            return f"{seconds / scale:.1f} {unit}"
    raise AssertionError("unreachable")


def time_table(report: Report) -> str:
    """Simulated seconds each rank spent computing, communicating and idle (waiting for
    a peer: the pipeline bubble, a collective's last member), over the run; with offload
    also the host CPU's Adam and the waits for PCIe / NVMe copies."""
    offload = any("transfer_s" in r["time"] for r in report.ranks)
    kinds = ["compute_s", "comm_s", "idle_s"] + (["host_compute_s", "transfer_s"]
                                                 if offload else [])
    names = {"compute_s": "compute", "comm_s": "comm", "idle_s": "idle",
             "host_compute_s": "CPU Adam", "transfer_s": "copies"}
    headers = ["rank", _coords_header(report), *(names[k] for k in kinds),
               *(f"{names[k]} %" for k in kinds)]
    rows = []
    for r in report.ranks:
        t = {k: r["time"].get(k, 0.0) for k in kinds}
        total = sum(t.values())
        share = [f"{100 * t[k] / total:.0f}%" if total else "-" for k in kinds]
        rows.append([r["rank"], _coords(r), *(human_seconds(t[k]) for k in kinds), *share])
    return format_table(headers, rows)


def grid_table(results: list[GridResult]) -> str:
    """config, ranks, max loss diff, max param diff, pass/fail, first divergence."""
    rows = []
    for r in results:
        if r.refusal is not None:
            verdict = "refused" + ("" if r.passed else " (UNEXPECTED)")
            rows.append([r.case.name, r.world_size, "-", "-", verdict, _short(r.refusal)])
            continue
        e = r.equivalence
        first = e["first_mismatch"]
        where = "-" if first is None else (
            f"step {first['step']}, {first['tensor']}"
            + ("" if first["rank"] is None else f", rank {first['rank']}"))
        verdict = "FAIL" if not r.passed else \
            "pass (quantised)" if e.get("quantized") else "pass"
        rows.append([r.case.name, r.world_size, f"{e['max_abs_loss_diff']:.1e}",
                     f"{e['max_rel_param_diff_per_step']:.1e}", verdict, where])
    return format_table(["config", "ranks", "max |loss diff|", "max rel param diff",
                         "result", "first divergence (step, tensor, rank) / reason"],
                        rows, align="lrrrll")


def _short(message: str, width: int = 70) -> str:
    return message if len(message) <= width else message[:width - 3] + "..."
