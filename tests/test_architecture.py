"""The structure of minipar (docs/architecture.md), kept by a test rather than by hope.

1. Imports go down the layers, never up:

       autograd -> nn -> distributed -> parallel -> train -> plan -> profile -> viz
       -> (cli, demo)

   Every `import` of every module counts, including the ones inside functions (a lazy
   import is still an arrow: it only moves the moment the dependency bites).
2. No import cycle between modules, except inside autograd's tensor/function/ops core
   and the backward engine it calls (CYCLE_OK).
3. No module over MAX_LINES lines unless its docstring says why, on a line containing
   LONG_MARKER ("long because ...").

A leaf helper (a module whose import runs no other minipar code: it imports nothing
from minipar, nor does any package `__init__` above it other than minipar's own) may be
imported from any layer, e.g. a `minipar/errors.py` holding the error classes. So may a
top-level module that imports only leaf helpers (`minipar/files.py`, the atomic writer
and bounded reader every layer uses, raises `minipar/errors.py`'s InputFileError): what
its import runs is leaf helpers too.

4. No module imports a name through a re-export: `from minipar.a.b import name` names
   the module that defines `name` (a package's `__init__` may gather its public names:
   `from minipar import distributed as dist`, `from minipar.nn import GPT`).

The KNOWN_* lists are violations being removed while work is under way in parallel.
Each entry is an xfail(strict=True) test that asserts the violation is gone: while it is
present, the test xfails; once a merge removes it, the test XPASSes, which fails the
suite until the entry is deleted here. So the lists can only shrink.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minipar"
LAYERS = ("autograd", "nn", "distributed", "parallel", "train", "plan", "profile", "viz",
          "front end")
# `minipar` re-exports the API; `minipar.run` is `minipar.train`, checked by the planner first
FRONT_ENDS = {"minipar", "minipar.cli", "minipar.console", "minipar.demo", "minipar.run",
              "minipar.__main__"}
# Tensor's operators call the ops, the ops build Tensors through Function, and
# Tensor.backward runs the engine that walks Functions: one idea, four files.
CYCLE_OK = {"minipar.autograd.tensor", "minipar.autograd.function", "minipar.autograd.ops",
            "minipar.autograd.engine"}
MAX_LINES = 400
LONG_MARKER = "long because"

# ---------------------------------------------------------------- known, being removed
# (importer, imported): upward imports being removed elsewhere.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
# Import cycles (the modules of one cycle) being removed elsewhere.
KNOWN_CYCLES: dict[frozenset[str], str] = {}
# Modules over MAX_LINES being split elsewhere (split, or say why).
KNOWN_LONG: dict[str, str] = {}


# ---------------------------------------------------------------- reading the imports
def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def resolve(name: str) -> str | None:
    """The minipar module `name` refers to (a module, or the package whose attribute it
    is), or None outside minipar."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str) -> list[tuple[str, int]]:
    """(imported minipar module, line) for every import statement in module `name`,
    wherever it stands (top level, inside a function, under `if TYPE_CHECKING`)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..nn import y
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from minipar import distributed`: the submodule when there is one.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            module = resolve(target)
            if module is not None and module != name and (module, node.lineno) not in found:
                found.append((module, node.lineno))
    return found


GRAPH = {name: imports(name) for name in MODULES}


def layer(name: str) -> int:
    if name in FRONT_ENDS:
        return LAYERS.index("front end")
    if name.split(".")[1] not in LAYERS and is_leaf(name):
        return 0  # a top-level leaf helper (minipar/errors.py): below everything
    return LAYERS.index(name.split(".")[1])


def is_leaf(name: str, seen: frozenset[str] = frozenset()) -> bool:
    """Importing `name` runs no minipar code but leaf helpers': neither it nor a package
    __init__ above it (below minipar's own, which every import runs anyway) imports from
    minipar anything but a top-level leaf helper (minipar/errors.py)."""
    chain = [name] + [".".join(name.split(".")[:k]) for k in range(2, name.count(".") + 1)]
    return name != "minipar" and name not in seen and all(
        target.count(".") == 1 and target.split(".")[1] not in LAYERS
        and target not in FRONT_ENDS and is_leaf(target, seen | {name})
        for m in chain if m in MODULES for target, _ in GRAPH[m])


def upward_imports() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) -> where, for every import that goes up a layer."""
    out: dict[tuple[str, str], list[str]] = {}
    for name, edges in GRAPH.items():
        for target, line in edges:
            if not is_leaf(target) and layer(target) > layer(name):
                where = f"{MODULES[name].relative_to(ROOT)}:{line}"
                out.setdefault((name, target), []).append(where)
    return out


def import_cycles() -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(frozenset(component))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    return components


def cycle_edges(component: frozenset[str]) -> list[str]:
    return [f"{a} -> {b} ({MODULES[a].relative_to(ROOT)}:{line})"
            for a in sorted(component) for b, line in GRAPH[a] if b in component]


def long_modules() -> dict[str, int]:
    """Modules over MAX_LINES lines whose docstring does not say why."""
    out = {}
    for path in MODULES.values():
        text = path.read_text(encoding="utf-8")
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_LINES and LONG_MARKER not in doc.lower():
            out[str(path.relative_to(ROOT))] = lines
    return out


# ---------------------------------------------------------------- the rules
def test_every_module_is_in_a_layer():
    unknown = [m for m in MODULES if m not in FRONT_ENDS and m.split(".")[1] not in LAYERS
               and not is_leaf(m)]
    assert not unknown, (f"modules outside every layer {LAYERS[:-1]} and not front ends "
                         f"{sorted(FRONT_ENDS)}: {unknown}; put each in a layer "
                         "(docs/architecture.md), or make it a leaf helper that imports "
                         "nothing from minipar")


def test_no_import_goes_up_a_layer():
    found = {edge: where for edge, where in upward_imports().items()
             if edge not in KNOWN_UPWARD}
    lines = [f"{a} ({LAYERS[layer(a)]}) -> {b} ({LAYERS[layer(b)]}) at {', '.join(w)}"
             for (a, b), w in sorted(found.items())]
    assert not lines, "imports that go up a layer:\n" + "\n".join(lines)


def test_no_import_cycle_between_modules():
    found = [c for c in import_cycles() if not c <= CYCLE_OK and c not in KNOWN_CYCLES]
    lines = [" | ".join(cycle_edges(c)) for c in found]
    assert not lines, "import cycles:\n" + "\n".join(lines)


def test_no_module_is_long_without_a_reason():
    found = {path: n for path, n in long_modules().items() if path not in KNOWN_LONG}
    assert not found, (f"modules over {MAX_LINES} lines whose docstring does not say why "
                       f"(a line with {LONG_MARKER!r}), or split them: {found}")


@pytest.mark.parametrize("edge", [pytest.param(e, marks=pytest.mark.xfail(
    strict=True, reason=why)) for e, why in KNOWN_UPWARD.items()])
def test_known_upward_import_is_gone(edge):
    assert edge not in upward_imports(), f"still present: {edge}"


@pytest.mark.parametrize("cycle", [pytest.param(c, marks=pytest.mark.xfail(
    strict=True, reason=why), id="<->".join(sorted(c))) for c, why in KNOWN_CYCLES.items()])
def test_known_cycle_is_gone(cycle):
    assert cycle not in import_cycles(), f"still present: {cycle_edges(cycle)}"


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.xfail(
    strict=True, reason=why)) for p, why in KNOWN_LONG.items()])
def test_known_long_module_is_split_or_explained(path):
    assert path not in long_modules(), f"still long without a reason: {path}"


# ---------------------------------------------------------------- the checker itself
def test_the_walker_sees_lazy_relative_and_from_package_imports():
    """The rules are only as good as the import reader: check it on known edges."""
    loop = dict(GRAPH["minipar.train.loop"])
    assert "minipar.distributed" in loop  # from minipar import distributed as dist
    assert "minipar.train.checkpoint" in loop  # from minipar.train import checkpoint
    cli = {m for m, _ in GRAPH["minipar.cli"]}
    assert "minipar.demo" in cli  # imported inside a function
    assert layer("minipar.viz.tables") > layer("minipar.train.grid")
    assert not is_leaf("minipar.distributed.errors") or not GRAPH["minipar.distributed"]


def test_the_architecture_page_lists_every_module_of_each_layer():
    """docs/architecture.md's layer table names each layer's modules: a module added
    without a line there (turns, uniform_stages, layouts, advice, offload were missing)
    fails here, as does a name for a module that is gone."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing, unknown = {}, {}
    for layer in LAYERS[:-1]:  # the front ends' row names commands, not modules
        row = next(line for line in text.splitlines() if line.startswith(f"| `minipar.{layer}`"))
        listed = set(re.findall(r"`([\w/]+)`", row.split("|")[2]))
        modules = {p.relative_to(PACKAGE / layer).with_suffix("").as_posix()
                   for p in (PACKAGE / layer).rglob("*.py") if p.stem != "__init__"}
        if modules - listed:
            missing[layer] = sorted(modules - listed)
        if listed - modules:
            unknown[layer] = sorted(listed - modules)
    assert not missing and not unknown, (f"not in docs/architecture.md: {missing}; "
                                         f"listed there but not modules: {unknown}")


# ---------------------------------------------------------------- no re-exports
@functools.cache  # each module is parsed once, not once per import of it
def defined_names(name: str) -> set[str]:
    """What module `name` defines at its top level (functions, classes, assignments) or
    takes from outside minipar (a library it imports, e.g. behind a clear ImportError)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.asname or a.name for a in node.names if not a.name.startswith("minipar")}
        elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("minipar") \
                and not node.level:
            out |= {a.asname or a.name for a in node.names}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.If):  # `if TYPE_CHECKING:` and the like define nothing
            continue
    return out


def sources_importing_minipar():
    """(where, source text) of every module of minipar, the tests, the benchmarks, the
    exercises and every code cell of the notebooks."""
    for path in [*MODULES.values(), *(p for folder in ("tests", "benchmarks", "exercises")
                                      for p in sorted((ROOT / folder).rglob("*.py")))]:
        yield str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                yield f"{path.relative_to(ROOT)} cell {i}", "".join(cell["source"])


def imports_through_reexports() -> list[str]:
    """`from minipar.x import name` where minipar.x is a module (not a package) that does
    not define `name` itself: the name came to it by import, and so through a shim."""
    found = []
    for where, text in sources_importing_minipar():
        try:
            tree = ast.parse(text)
        except SyntaxError:  # a notebook cell with IPython magics
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            source = node.module
            if source not in MODULES or is_package(source):
                continue
            missing = [a.name for a in node.names if a.name not in defined_names(source)]
            if missing:
                found.append(f"{where}:{node.lineno} imports {missing} "
                             f"from {source}, which does not define them")
    return found


def test_no_module_imports_a_name_through_a_reexport():
    found = imports_through_reexports()
    assert not found, ("import each name from the module that defines it:\n"
                       + "\n".join(found))


# ---------------------------------------------------------------- reading one idea
def test_the_architecture_page_shows_the_reading_paths_as_measured_today():
    """The table of files a student opens per idea (docs/architecture.md) is what
    benchmarks/reading_paths.py counts in this tree, and every algorithm file on a path
    stays under ~300 lines: a file that grows past it, or a table left stale, fails."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("reading_paths",
                                                  ROOT / "benchmarks" / "reading_paths.py")
    reading = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reading)
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert reading.markdown() in text, (
        "docs/architecture.md's reading table is stale: paste the output of "
        "`python benchmarks/reading_paths.py --markdown`")
    for idea, (files, _) in reading.PATHS.items():
        first = files[0]
        assert reading.counts(first)[0] <= 300, f"{idea}'s algorithm file {first} > 300 lines"
