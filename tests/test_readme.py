"""The README's two opening commands are the ones that work (and the one CI runs)."""

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)[:2]


def test_readme_opens_with_an_install_and_run_command_and_a_test_command():
    main, tests = readme_commands()
    assert "pip install" in main and "minipar " in main
    assert "pip install" in tests and "pytest" in tests


def test_ci_runs_exactly_the_readme_test_command():
    _, tests = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci


def test_ci_lints_the_whole_tree():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "ruff check ." in ci


def readme_examples() -> list[list[str]]:
    """The `minipar ...` commands of the README's bash blocks, as argv (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    commands = [part.strip() for block in re.findall(r"```bash\n(.+?)\n```", text, re.S)
                for line in block.splitlines() for part in line.split("#")[0].split("&&")]
    return [shlex.split(command)[1:] for command in commands if command.startswith("minipar ")]


def outputs(argv: list[str]) -> list[str]:
    """The files and folders a command writes into the current directory."""
    written = [argv[i + 1] for i, arg in enumerate(argv[:-1])
               if arg in ("--json", "--out", "--trace", "--save", "--export")]
    defaults = {"demo": "minipar-demo/", "timeline": "timeline.png"}
    if argv[0] in defaults and "--out" not in argv:
        written.append(defaults[argv[0]])
    if argv[0] == "demo":  # its figures and trace, inside its folder
        written += ["minipar-demo/memory.png", "minipar-demo/trace/rank0.json"]
    return written


def test_what_the_readme_commands_write_is_git_ignored():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    written = sorted({path for argv in readme_examples() for path in outputs(argv)})
    assert {"out.json", "timeline.png", "trace/", "minipar-demo/"} <= set(written)
    for path in written:
        probe = path + "rank0.json" if path.endswith("/") else path  # a file inside
        ignored = subprocess.run(["git", "check-ignore", "--no-index", "-q", probe], cwd=ROOT)
        assert ignored.returncode == 0, f"{path} (written by a README command) is not ignored"


def test_the_readme_training_examples_tell_the_truth(tmp_path, monkeypatch, capsys):
    # On an H100 profile these toy runs printed "compute 0%, comm 100%" on every rank and
    # "the formula does not apply, try --device demo"; the trace example warned that its
    # pipeline never fills. Each runs here for 2 steps.
    from minipar import cli

    monkeypatch.chdir(tmp_path)
    examples = [argv for argv in readme_examples() if argv[0] in ("train", "timeline")]
    assert len(examples) >= 10
    for argv in examples:
        assert cli.main([*argv, "--steps", "2"]) == 0, argv
        out = capsys.readouterr().out
        assert "does not apply" not in out, argv
        assert not re.search(r"\s100%\s+0%\s*$", out, re.M), (argv, out)  # comm 100%
        assert "warning:" not in out, (argv, out)
        if argv[0] == "train":
            assert "(--device demo, the default)" in out
