"""Every fenced Python block of README.md and docs/*.md runs, so no example drifts from the
code. A block written as a doctest (`>>>` lines) must also print what it shows; any other
block must run without raising. Each runs in a fresh namespace in a temporary directory
(examples write files such as out.json). The minipar command lines of the other blocks
are checked too: every `minipar plan` runs, every `minipar train` / `timeline`
passes the rules train applies before it trains; and the figures docs/3d-and-demo.md
counts (the equivalence matrix's cases, the interview claims) are the code's."""

from __future__ import annotations

import doctest
import re
import shlex
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


def test_the_equivalence_matrix_in_the_docs_lists_every_case_of_the_grid():
    """docs/3d-and-demo.md shows `minipar check`'s table: a case added to the grid (or
    renamed) must appear there, in the grid's order, with the counts that go with it (the
    figures in the table may differ in their last digits between CPUs; the names may not)."""
    from minipar.train.grid import GRID

    text = (ROOT / "docs" / "3d-and-demo.md").read_text()
    block = text[text.index("```\nconfig "):]
    block = block[:block.index("\n```", 4)]
    rows = block.splitlines()[3:]  # after the fence, the header and the dashes
    names = [re.split(r"\s{2,}", row)[0] for row in rows
             if row.strip() and not row.endswith("as expected")]
    assert names == [case.name for case in GRID]
    assert f"{len(GRID)} of {len(GRID)} as expected" in block
    assert f"{len(GRID)} layouts (" in text


def test_the_docs_count_the_interview_claims_that_tests_test_claims_has():
    claims = re.findall(r"^def test_", (ROOT / "tests" / "test_claims.py").read_text(), re.M)
    text = (ROOT / "docs" / "3d-and-demo.md").read_text()
    assert re.search(rf"\b{len(claims)}\s+claims\b", text), (
        f"docs/3d-and-demo.md should say the {len(claims)} claims of tests/test_claims.py")


SHELL_TAGS = ("", "bash", "text")  # every block but python's


def shell_commands(program: str, *subcommands: str):
    """The `program subcommand ...` lines of the shell and text blocks of README.md, docs/*.md
    and exercises/README.md, continuation lines joined, comments dropped; each once."""
    seen = set()
    for document in [*DOCUMENTS, ROOT / "exercises" / "README.md"]:
        for block in shell_blocks(document.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                try:
                    words = shlex.split(line, comments=True)
                except ValueError:  # not a command line (a quote left open in output)
                    continue
                if (words[:1] == [program] and words[1:2] and words[1] in subcommands
                        and tuple(words) not in seen):
                    seen.add(tuple(words))
                    name = f"{document.relative_to(ROOT)}: {' '.join(words)}"
                    yield pytest.param(words[1:], id=name[:120])


def shell_blocks(text: str):
    """The bodies of the fenced blocks tagged bash, text or nothing, fences paired line by
    line (a regex took a python block's closing fence for an opening one and skipped
    the next shell block)."""
    tag, body = None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if tag is None:
                tag, body = line[3:].strip(), []
            else:
                if tag in SHELL_TAGS:
                    yield "\n".join(body)
                tag = None
        elif tag is not None:
            body.append(line)


@pytest.mark.parametrize("argv", list(shell_commands("minipar", "train", "timeline")))
def test_every_training_command_the_docs_show_is_accepted(argv):
    """A `minipar train` or `minipar timeline` line of the docs parses and passes the
    rules `minipar train` applies before it trains (the layout, the fit), so a reader who
    pastes it is not refused (docs/pipeline-parallel.md showed --pp 4 on the default two
    layers). Checked without training: the commands' runs are the examples' own."""
    from minipar.cli import build_parser, config_from_args
    from minipar.plan.fits import check_fits
    from minipar.viz.runs import check_training_layout

    if "..." in argv or "--help" in argv:
        pytest.skip("an elided command line, or the flags' help")
    config = config_from_args(build_parser().parse_args(argv))
    check_training_layout(config)
    check_fits(config)


@pytest.mark.parametrize("argv", list(shell_commands("minipar", "plan")))
def test_every_plan_command_the_docs_show_runs(argv, tmp_path, monkeypatch, capsys):
    from minipar.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0, capsys.readouterr().err
