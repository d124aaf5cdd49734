"""The import graph of ``kvstore``, ``weightcache`` and ``benchmarks`` has no cycle, between packages or files.

Each package depends only on packages below it (errors and block at the
bottom, the daemon and the CLI at the top), so a change in one is local to
the ones above it, and a newcomer can read the code from the bottom up.
The graph is built from the source with :mod:`ast`, not by importing it:

- between packages, an edge is a module-level import (also one under
  ``if``/``try``), with ``from a import b`` counted as an import of the
  module ``a.b`` when there is one; an import inside a function is left out
  (a registry opens its implementations, a level above it, on first use);
- between files, imports inside functions count too: two modules that call
  into each other are one module, whenever the import runs;
- imports under ``if TYPE_CHECKING`` are left out everywhere (a type only a
  checker reads ties nothing);
- a package is a folder directly under a top-level package
  (``kvstore/peer/``, with everything below it); a module directly in a
  top-level package (``kvstore/node.py``) is a node of its own.

A cycle is reported with one import line per edge, so the line to move is
named. The checker itself is tested on a small tree with a known cycle.

The same walk checks that no two modules of ``kvstore`` and ``weightcache``
define a public class of one name (two ``S3Options`` that meant two things
were one), but for the pairs :data:`SAME_NAME_ON_PURPOSE` lists.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("kvstore", "weightcache", "benchmarks")


def _modules(base: Path, roots: Iterable[str]) -> dict[str, Path]:
    out = {}
    for root in roots:
        for path in sorted((base / root).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, name: str, modules: dict[str, Path], *, lazy: bool) -> list[tuple[str, int]]:
    """(imported module, line) of each import of ``name`` that names one of ``modules``: those at
    module level, and with ``lazy`` those inside functions and classes too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.extend((alias.name, node.lineno) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.append((sub if sub in modules else base, node.lineno))
            elif isinstance(node, ast.If) and not _type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)
            elif lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.With,
                                            ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
                visit(node.body)
                visit(getattr(node, "orelse", []))

    visit(ast.parse(path.read_text(), str(path)).body)
    return [(m, line) for m, line in found if m in modules and m != name]


def _package(name: str, base: Path) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and (base / parts[0] / parts[1]).is_dir() else name


def _cycles(nodes: Iterable[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, successors = work[-1]
            for w in successors:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def find_cycles(base: Path, roots: Iterable[str]) -> tuple[list[str], list[str]]:
    """(package cycles, file cycles), each told with the import lines that make it."""
    modules = _modules(base, roots)
    files: dict[str, set[str]] = {}
    packages: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], list[str]] = {}
    for name, path in modules.items():
        for target, line in _imports(path, name, modules, lazy=True):
            files.setdefault(name, set()).add(target)
            lines.setdefault((name, target), []).append(f"{path.relative_to(base)}:{line}")
        for target, line in _imports(path, name, modules, lazy=False):
            a, b = _package(name, base), _package(target, base)
            if a != b and not b.startswith(a + ".") and not a.startswith(b + "."):
                packages.setdefault(a, set()).add(b)
                lines.setdefault((a, b), []).append(f"{path.relative_to(base)}:{line} imports {target}")

    def told(component: list[str], edges: dict[str, set[str]]) -> str:
        inside = [f"  {a} -> {b}: {', '.join(list(dict.fromkeys(lines[(a, b)]))[:3])}"
                  for a in component for b in sorted(edges.get(a, ())) if b in component]
        return " <-> ".join(component) + "\n" + "\n".join(inside)

    package_nodes = sorted({_package(m, base) for m in modules})
    return ([told(c, packages) for c in _cycles(package_nodes, packages)],
            [told(c, files) for c in _cycles(sorted(modules), files)])


@pytest.mark.slow  # parses every module of the three packages
def test_no_package_imports_another_that_imports_it_back():
    package_cycles, _ = find_cycles(REPO, ROOTS)
    assert not package_cycles, "packages import each other in a loop (move the line that runs against the " \
                               "order, or import it where it is used):\n" + "\n".join(package_cycles)


@pytest.mark.slow  # parses every module of the three packages
def test_no_module_imports_another_that_imports_it_back():
    _, file_cycles = find_cycles(REPO, ROOTS)
    assert not file_cycles, "modules import each other in a loop:\n" + "\n".join(file_cycles)


# A class of the same name in two modules, each the same thing at its own layer.
SAME_NAME_ON_PURPOSE = {
    "Holder": {"kvstore.client.codec", "kvstore.index.base"},  # the client's copy of the index's answer
    "Listed": {"kvstore.client.codec", "kvstore.store.tiered"},  # a block of a listing: the client's, the store's
    "Placed": {"kvstore.client.codec", "kvstore.store.moves"},  # what a Place did: the client's, the store's
}


def duplicate_classes(base: Path, roots: Iterable[str]) -> dict[str, set[str]]:
    """Public class names defined at module level in more than one module (generated code left out)."""
    where: dict[str, set[str]] = {}
    for name, path in _modules(base, roots).items():
        if "_pb2" in path.name:
            continue
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, set()).add(name)
    return {cls: modules for cls, modules in where.items() if len(modules) > 1}


def test_no_two_modules_define_a_public_class_of_one_name():
    found = {cls: m for cls, m in duplicate_classes(REPO, ("kvstore", "weightcache")).items()
             if SAME_NAME_ON_PURPOSE.get(cls) != m}
    assert not found, "one class name for two things (name each for what it is, or list the pair in " \
                      "SAME_NAME_ON_PURPOSE):\n" + "\n".join(f"  {c}: {', '.join(sorted(m))}" for c, m in found.items())


@pytest.fixture
def tree(tmp_path):
    def write(files: dict[str, str]) -> Path:
        for rel, text in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return tmp_path
    return write


def test_the_checker_finds_a_back_import_between_packages_and_names_its_line(tree):
    base = tree({
        "app/__init__.py": "", "app/low/__init__.py": "", "app/low/a.py": "import os\n",
        "app/high/__init__.py": "", "app/high/b.py": "from app.low import a\n",
        "app/low/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.high import b\n"
                        "def f():\n    from app.high import b\n",
    })
    assert find_cycles(base, ["app"]) == ([], [])  # a type-only import ties nothing, a lazy one no packages
    (base / "app/low/d.py").write_text("import json\nfrom app.high.b import thing\n")
    package_cycles, file_cycles = find_cycles(base, ["app"])
    assert len(package_cycles) == 1 and file_cycles == []
    assert "app.high <-> app.low" in package_cycles[0] and "app/low/d.py:2 imports app.high.b" in package_cycles[0]


def test_the_checker_finds_a_circle_of_files_in_one_package(tree):
    base = tree({"app/__init__.py": "", "app/p/__init__.py": "", "app/p/x.py": "from . import y\n",
                 "app/p/y.py": "from .z import name\n", "app/p/z.py": "def late():\n    import app.p.x\n"})
    package_cycles, file_cycles = find_cycles(base, ["app"])
    assert package_cycles == [] and len(file_cycles) == 1
    assert file_cycles[0].startswith("app.p.x <-> app.p.y <-> app.p.z")


def test_the_name_check_finds_two_classes_of_one_name(tree):
    base = tree({"app/__init__.py": "", "app/a.py": "class Options:\n    pass\nclass _Job:\n    pass\n",
                 "app/b.py": "class Options:\n    pass\nclass _Job:\n    pass\n"})
    assert duplicate_classes(base, ["app"]) == {"Options": {"app.a", "app.b"}}
