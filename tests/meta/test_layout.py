"""The suite keeps the layout of the packages it tests.

Test modules live in ``tests/<area>/`` (``tests/store/``, ``tests/peer/``, ...), never directly in
``tests/``; what they share that is not a fixture lives in the ``tests.support`` package, and
fixtures live in ``conftest.py`` files. The test folders have no ``__init__.py``, so pytest
imports each test module by its basename: basenames are unique. A test module imports neither
another test module nor a ``conftest`` (a conftest is pytest's to load, once per folder).
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
TOP_LEVEL = {"__init__.py", "conftest.py", "install.py"}  # install.py: the README runs python tests/install.py
DYNAMIC = {"__import__", "importlib.import_module", "import_module"}


def python_files(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def module_paths() -> list[Path]:
    return [p for p in python_files(TESTS) if p.name.startswith("test_")]


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it, also by name (``__import__("x")``,
    ``importlib.import_module("x")``); ``from tests.support import x`` imports ``tests.support.x``
    (a name imported from a module is left out: it may be anything)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and ast.unparse(node.func) in DYNAMIC:
            names.add(node.args[0].value)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            if node.module == "tests" or node.module.startswith("tests."):  # packages: their names are modules
                names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def forbidden(name: str) -> bool:
    """A conftest or a test module: pytest's to import, not another module's."""
    parts = name.split(".")
    return parts[-1] == "conftest" or any(part.startswith("test_") for part in parts)


def test_no_test_module_sits_directly_in_tests():
    stray = sorted(p.name for p in TESTS.glob("*.py") if p.name not in TOP_LEVEL)
    assert not stray, f"move these into the folder of what they test (tests/<area>/): {stray}"


def test_test_module_basenames_are_unique():
    twice = sorted(name for name, n in Counter(p.name for p in module_paths()).items() if n > 1)
    assert not twice, f"pytest imports test modules by basename; rename one of each: {twice}"


def test_nothing_imports_a_conftest_or_a_test_module():
    wrong = []
    for path in python_files(TESTS, REPO / "benchmarks"):
        wrong += [f"{path.relative_to(REPO)} imports {name}" for name in sorted(imported(path)) if forbidden(name)]
    assert not wrong, "share it through tests/support (a fixture: through a conftest.py):\n" + "\n".join(wrong)


def test_support_modules_hold_no_fixtures():
    wrong = []
    for path in python_files(TESTS / "support"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                    "fixture" in ast.unparse(d) for d in node.decorator_list):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert not wrong, f"fixtures live in conftest.py files: {wrong}"


def test_the_checks_see_what_they_are_for(tmp_path):
    module = tmp_path / "test_x.py"
    name = "conftest"  # in a placeholder, so that a grep for imports of it finds none in this file
    module.write_text(f"import {name}\nfrom tests import {name} as c\nfrom test_auth import TOKEN_A\n"
                      "from tests.peer.test_peer_tier import NS\nfrom tests.support import wait\n"
                      "from kvstore.tiers import test_helpers_would_be_odd\n")
    names = imported(module)
    assert names == {"conftest", "tests", "tests.conftest", "test_auth", "tests.peer.test_peer_tier",
                     "tests.peer.test_peer_tier.NS", "tests.support", "tests.support.wait", "kvstore.tiers"}
    assert sorted(n for n in names if forbidden(n)) == [
        "conftest", "test_auth", "tests.conftest", "tests.peer.test_peer_tier", "tests.peer.test_peer_tier.NS"]
    by_name = tmp_path / "test_y.py"
    by_name.write_text(f"import importlib\nw = __import__({name!r}).wait_until\nimportlib.import_module('test_auth')\n")
    assert imported(by_name) == {"importlib", "conftest", "test_auth"}
