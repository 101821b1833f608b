"""Every fenced Python block of README.md and docs/*.md runs, so no example drifts from the
code. A block written as a doctest (`>>>` lines) must also print what it shows; any other
block must run without raising. Each runs in a fresh namespace in a temporary directory
(examples write files such as out.json)."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks():
    for document in DOCUMENTS:
        text = document.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 2
            name = f"{document.relative_to(ROOT)}:{line}"
            yield pytest.param(name, match.group(1), id=name)


def test_the_documents_have_python_examples():
    assert len(list(python_blocks())) >= 8


@pytest.mark.parametrize(("name", "source"), list(python_blocks()))
def test_python_block_runs(name, source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if source.lstrip().startswith(">>>"):
        test = doctest.DocTestParser().get_doctest(source, {}, name, name, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS
                                       | doctest.NORMALIZE_WHITESPACE)
        failures = []
        runner.run(test, out=failures.append)
        assert runner.failures == 0, f"{name}: the example's output differs:\n" + "".join(failures)
    else:
        exec(compile(source, name, "exec"), {"__name__": "__docs__"})


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors: lower-case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(anchor)
    return anchors


def test_every_relative_link_resolves():
    """A link to a file of the repository (and its #anchor, for Markdown) must exist, as
    the page is read on GitHub or in an editor: relative to the document's folder."""
    broken = []
    for document in [*DOCUMENTS, ROOT / "benchmarks" / "README.md",
                     ROOT / "exercises" / "README.md"]:
        text = FENCE.sub("", document.read_text())
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (document.parent / path).resolve() if path else document
            if not file.exists():
                broken.append(f"{document.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in heading_anchors(
                    file.read_text()):
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
