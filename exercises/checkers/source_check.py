"""What the text of the file under test may use: not the library's ready-made answers, and
nothing that hides which names it uses or changes the code it imports.

A check of the text (Python's own parser, `ast`): the grader runs it on its own copy of
the file, before any of it runs, so nothing the file does at run time changes the
answer. It finds each forbidden name imported, called or read as an attribute, and
refuses what would let a file reach a name without writing it (importlib, __import__,
eval, exec, getattr with a computed name, sys.modules, ...), import the grader
(`exercises`), or change a module it imports (`np.allclose = ...`). Python has more ways
than any list: a determined file can still get past the text, and then only the checks
that run it in processes of its own can catch it (docs/exercises.md).
"""

from __future__ import annotations

import ast
import os

from .harness import expect

HIDES = "the checker must see every name your file uses: write it out"
# Refused as a module it imports (and its submodules), as a name it uses, as an attribute.
IMPORTS = {
    "importlib": f"imports by a computed name; {HIDES}",
    "gc": "reaches the checker's objects through the garbage collector",
    "inspect": "reaches the checker's frames and objects",
    "ctypes": "reaches the interpreter's memory",
    "builtins": "changes Python's built-in names",
    "exercises": "the grader's own code: a hand-in does not import it",
}
NAMES = {
    "__import__": f"imports by a computed name; {HIDES}",
    "eval": f"runs code built at run time; {HIDES}",
    "exec": f"runs code built at run time; {HIDES}",
    "compile": f"builds code at run time; {HIDES}",
    "globals": f"reaches names through a dict; {HIDES}",
    "vars": f"reaches names through a dict; {HIDES}",
    "__builtins__": "changes Python's built-in names",
    "attrgetter": f"reaches attributes by a computed name; {HIDES}",
    "methodcaller": f"reaches methods by a computed name; {HIDES}",
}
ATTRIBUTES = {
    "__dict__": f"reaches names through a dict; {HIDES}",
    "__getattribute__": f"reaches attributes by a computed name; {HIDES}",
    "__globals__": "reaches another module's names",
    "__builtins__": "changes Python's built-in names",
    "__subclasses__": "reaches classes it does not name",
    "_getframe": "reads the checker's own variables (sys._getframe)",
    "f_globals": "reads the checker's own variables",
    "f_locals": "reads the checker's own variables",
    "f_back": "reads the checker's own variables",
    "attrgetter": f"reaches attributes by a computed name; {HIDES}",
    "methodcaller": f"reaches methods by a computed name; {HIDES}",
}
SYS_MODULES = f"reaches loaded modules by name; {HIDES}"
COMPUTED_NAME = ("getattr", "setattr", "delattr", "hasattr")  # a computed 2nd argument hides


def forbidden_uses(impl, forbidden: dict[str, str]) -> list[str]:
    """Lines "name (line N): why" for every use of a forbidden name in impl's source file
    (imported, called or read as an attribute, e.g. `dist.all_reduce`), for what IMPORTS,
    NAMES and ATTRIBUTES refuse, and for each attribute of an imported module it assigns.
    [] without a file.

    forbidden: {name: reason}; a dotted module name ("minipar.parallel") matches imports
    of it and of its submodules."""
    path = getattr(impl, "__file__", None)
    if path is None or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as source:
        text = source.read()
    try:
        tree = ast.parse(text, filename=path)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []  # the file does not import: that failure is reported when it is imported
    found = []
    # The file's own functions and classes may share a name with the library's (the
    # student writes `one_f_one_b` too): only imports and attributes of those count.
    own = {node.name for node in ast.walk(tree)
           if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    imported = _imported_names(tree)

    def flag(name: str, node, *rule_sets) -> None:
        for rules in (forbidden, *rule_sets):
            for banned, reason in rules.items():
                if name == banned or name.startswith(banned + "."):
                    found.append(f"{name} (line {node.lineno}): {reason}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                flag(alias.name, node, IMPORTS)
        elif isinstance(node, ast.ImportFrom) and node.module:
            flag(node.module, node, IMPORTS)
            for alias in node.names:
                flag(alias.name, node, NAMES, ATTRIBUTES)
                if node.module == "sys" and alias.name == "modules":
                    found.append(f"sys.modules (line {node.lineno}): {SYS_MODULES}")
        elif isinstance(node, ast.Attribute):
            flag(node.attr, node, ATTRIBUTES)
            if node.attr == "modules" and isinstance(node.value, ast.Name) \
                    and node.value.id == "sys":
                found.append(f"sys.modules (line {node.lineno}): {SYS_MODULES}")
        elif isinstance(node, ast.Name) and node.id not in own:
            flag(node.id, node, NAMES)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in COMPUTED_NAME and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                flag(name.value, node)  # getattr(dist, "all_reduce") uses all_reduce
            else:
                found.append(f"{node.func.id} (line {node.lineno}): reaches an attribute by "
                             f"a computed name; {HIDES}")
        for target in _assigned_attributes(node):
            root = target
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in imported:
                found.append(f"{ast.unparse(target)} (line {node.lineno}): changes the "
                             f"module {root.id} it imports")
    unique = list(dict.fromkeys(found))  # ast.walk's order, without repeats
    return sorted(unique, key=lambda line: int(line.split("(line ")[1].split(")")[0]))


def _imported_names(tree) -> set[str]:
    """Names an import statement binds: `np` for `import numpy as np`, `harness` for
    `from exercises.checkers import harness`, `numpy` for `import numpy.linalg`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add(alias.asname or alias.name.split(".")[0])
    return names


def _assigned_attributes(node) -> list:
    """The attribute targets (`a.b`) that `node` assigns or deletes."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    else:
        return []
    flat = []
    for target in targets:
        flat += target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
    return [t for t in flat if isinstance(t, ast.Attribute)]


def check_building_blocks(impl, forbidden: dict[str, str]):
    """A check: the file under test uses none of the library's ready-made answers, and
    nothing that hides what it uses."""
    uses = forbidden_uses(impl, forbidden)
    expect(not uses, "your file uses what the exercise asks you to build, or hides what it "
                     "uses:\n" + "\n".join(uses))
