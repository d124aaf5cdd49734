"""No test module needs an optional package to be collected.

A module-level import of an optional package (one that neither the base install nor the
``test`` extra brings) must follow a module-level ``pytest.importorskip``, so that a machine
without the package skips the module with a reason instead of stopping the run at collection.
A helper module (not ``test_*.py``) may import one at its top only if every test module that
imports the helper at module level has skipped first.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
OPTIONAL = {"torch", "lmcache", "vllm", "ucxx", "sglang", "mooncake", "rmm", "cupy", "runai_model_streamer"}


def top_level_imports(tree: ast.Module) -> list[tuple[int, str, bool]]:
    """(line, top-level package, an importorskip came before it) for every module-level import."""
    found, skipped = [], False
    for node in tree.body:
        if isinstance(node, ast.Expr | ast.Assign) and any(
                isinstance(n, ast.Attribute) and n.attr == "importorskip" for n in ast.walk(node)):
            skipped = True
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0], skipped) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0], skipped))
    return found


def modules() -> dict[str, list[tuple[int, str, bool]]]:
    return {p.stem: top_level_imports(ast.parse(p.read_text(), str(p))) for p in sorted(TESTS.glob("*.py"))}


def test_optional_packages_are_imported_only_after_a_skip():
    found = modules()
    # Helpers that import an optional package at their top, and the modules importing them.
    optional_helpers = {name for name, imports in found.items() if not name.startswith("test_")
                        and any(pkg in OPTIONAL for _, pkg, _ in imports)}
    wrong = []
    for name, imports in found.items():
        for line, pkg, after_skip in imports:
            optional = pkg in OPTIONAL or pkg in optional_helpers
            if optional and not after_skip and name.startswith("test_") or optional and name == "conftest":
                wrong.append(f"tests/{name}.py:{line} imports {pkg} before any pytest.importorskip")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_import_before_a_skip():
    bad = top_level_imports(ast.parse("import pytest\nimport torch\npytest.importorskip('lmcache')\nimport lmcache\n"))
    assert bad == [(1, "pytest", False), (2, "torch", False), (4, "lmcache", True)]
    good = top_level_imports(ast.parse("import pytest\ntorch = pytest.importorskip('torch')\nimport torch.nn\n"))
    assert good[-1] == (3, "torch", True)
