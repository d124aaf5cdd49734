"""No test module needs an optional package to be collected.

A module-level import of an optional package (one that neither the base install nor the
``test`` extra brings) must follow a module-level ``pytest.importorskip``, so that a machine
without the package skips the module with a reason instead of stopping the run at collection.
A helper module (under ``tests/support``) may import one at its top only if every test module
that imports the helper at module level has skipped first; a ``conftest.py`` never does.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
OPTIONAL = {"torch", "lmcache", "vllm", "ucxx", "sglang", "mooncake", "rmm", "cupy", "runai_model_streamer"}


def top_level_imports(tree: ast.Module) -> list[tuple[int, str, bool]]:
    """(line, imported module, an importorskip came before it) for every module-level import;
    ``from tests.support import x`` imports the module ``tests.support.x``."""
    found, skipped = [], False
    for node in tree.body:
        if isinstance(node, ast.Expr | ast.Assign) and any(
                isinstance(n, ast.Attribute) and n.attr == "importorskip" for n in ast.walk(node)):
            skipped = True
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, skipped) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "tests.support":
                found += [(node.lineno, f"tests.support.{alias.name}", skipped) for alias in node.names]
            else:
                found.append((node.lineno, node.module, skipped))
    return found


def modules() -> dict[Path, list[tuple[int, str, bool]]]:
    return {p: top_level_imports(ast.parse(p.read_text(), str(p))) for p in sorted(TESTS.rglob("*.py"))}


def dotted(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def optional_helpers(found: dict[Path, list[tuple[int, str, bool]]]) -> set[str]:
    """The support modules that import an optional package at their top, directly or through another."""
    helpers = {dotted(p): [m for _, m, _ in imports] for p, imports in found.items()
               if p.parent.name == "support" and p.name != "__init__.py"}
    optional: set[str] = set()
    while True:
        more = {name for name, imported in helpers.items() if name not in optional
                and any(m.split(".")[0] in OPTIONAL or m in optional for m in imported)}
        if not more:
            return optional
        optional |= more


def test_optional_packages_are_imported_only_after_a_skip():
    found = modules()
    helpers = optional_helpers(found)
    wrong = []
    for path, imports in found.items():
        for line, module, after_skip in imports:
            optional = module.split(".")[0] in OPTIONAL or module in helpers
            if optional and (path.name == "conftest.py" or path.name.startswith("test_") and not after_skip):
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {module} before any pytest.importorskip")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_import_before_a_skip():
    bad = top_level_imports(ast.parse("import pytest\nimport torch\npytest.importorskip('lmcache')\nimport lmcache\n"))
    assert bad == [(1, "pytest", False), (2, "torch", False), (4, "lmcache", True)]
    good = top_level_imports(ast.parse("import pytest\ntorch = pytest.importorskip('torch')\nimport torch.nn\n"))
    assert good[-1] == (3, "torch.nn", True)


def test_the_check_follows_helpers_into_support():
    found = {
        TESTS / "support" / "engine.py": [(1, "lmcache.v1", False)],
        TESTS / "support" / "fleet.py": [(1, "tests.support.engine", False)],
        TESTS / "support" / "plain.py": [(1, "kvstore.block", False)],
    }
    assert optional_helpers(found) == {"tests.support.engine", "tests.support.fleet"}
    assert top_level_imports(ast.parse("from tests.support import engine, plain\n")) == [
        (1, "tests.support.engine", False), (1, "tests.support.plain", False)]
