"""A figure saved whole or not at all.

    save_figure(fig, "timeline.png")          # minipar timeline --out, the demo's figures

`fig.savefig(path)` writes the file as it renders it: a full disk or a Ctrl-C half-way
leaves a truncated picture where an earlier one was. Here matplotlib renders into
minipar.files.atomic_write's temporary file, which replaces `path` only once it is
complete (the format is the name's extension, as savefig infers it).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from minipar.files import atomic_write


def save_figure(fig: Figure, path, dpi: int = 110) -> Path:
    """Write `fig` to `path` (png, pdf, svg, ...: its extension; png without one)."""
    path = Path(path)
    with atomic_write(path) as f:
        fig.savefig(f, format=path.suffix.lstrip(".").lower() or "png", dpi=dpi)
    return path
