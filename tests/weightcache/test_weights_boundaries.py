"""What holds the weight pipeline apart from the KV store: kvstore never imports weightcache (the
source and a live import both say so), weightcache's error tree is drawn where it is defined,
``strata weights`` reaches weightcache without an import, and the extras name what it needs."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import weightcache
from kvstore import errors as kv_errors
from weightcache import errors

ROOT = Path(__file__).resolve().parents[2]


def test_no_kvstore_source_imports_weightcache():
    offenders = []
    for path in sorted((ROOT / "kvstore").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__",
            ):
                names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "weightcache"]
    assert not offenders, f"kvstore imports weightcache at {offenders}"


@pytest.mark.system
def test_importing_all_of_kvstore_loads_no_weightcache():
    script = (
        "import importlib, pkgutil, sys, kvstore\n"
        "for m in pkgutil.walk_packages(kvstore.__path__, 'kvstore.', onerror=lambda name: None):\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ModuleNotFoundError as err:\n"  # an integration whose host project (lmcache, vllm) is absent
        "        if not m.name.startswith('kvstore.integrations.') or (err.name or '').startswith('kvstore'):\n"
        "            raise\n"
        "loaded = sorted(n for n in sys.modules if n.split('.')[0] == 'weightcache')\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def every_weight_error() -> list[type]:
    for name in ("cache", "cached_model", "catalog", "fetch", "manifest", "publish", "reader", "record"):
        __import__(f"weightcache.{name}")
    found, todo = [], [kv_errors.StrataError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return [c for c in found if c.__module__.split(".")[0] == "weightcache"]


def test_the_error_tree_is_drawn_where_it_is_defined():
    tree = errors.__doc__
    drawn = set(re.findall(r"[├└]── (\w+)", tree))
    defined = every_weight_error()
    assert all(c.__module__ == "weightcache.errors" for c in defined), "define weightcache errors in weightcache.errors"
    assert {c.__name__ for c in defined} <= drawn
    assert {c.__name__ for c in defined} == set(errors.__all__)
    for cls in defined:
        line = next(l for l in tree.splitlines() if re.search(rf"── {cls.__name__}\b", l))
        parent = cls.__bases__[0].__name__
        above = tree[: tree.index(line)].splitlines()
        indent = line.index("──")
        owner = next(l for l in reversed(above) if "──" in l and l.index("──") < indent)
        assert f"── {parent}" in owner, f"{cls.__name__} is not drawn under {parent}"
        assert not hasattr(kv_errors, cls.__name__), f"{cls.__name__} shadows a kvstore error"


@pytest.mark.system
def test_strata_weights_runs_weightcache(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    pub = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "weights", "publish", str(folder), "--no-progress"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert pub.returncode == 0, pub.stderr
    digest = pub.stdout.split()[0]
    ls = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "weights", "ls", str(folder)],
                        capture_output=True, text=True, env=env, timeout=300)
    assert ls.returncode == 0 and ls.stdout.startswith(f"{digest}  latest"), ls.stderr
    bad = subprocess.run([sys.executable, "-m", "weightcache", "ls", str(tmp_path / "nowhere")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 1 and "not a directory" in bad.stderr


def test_the_extras_name_what_weightcache_needs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names = lambda deps: {re.split(r"[<>=\[]", d)[0] for d in deps}  # noqa: E731
    # The weight pipeline is in the default install (every strata weights command works after
    # pip install .); the "weights" extra stays, empty, so that strata-kvcache[weights] still resolves.
    assert {"blake3", "numpy", "obstore"} <= names(project["dependencies"])
    assert extras["weights"] == []
    assert {"safetensors", "moto"} <= names(extras["test"])
    for dep in project["dependencies"]:
        assert "<" in dep, f"{dep}: give it an upper bound"
    assert project["scripts"]["strata-weights"] == "weightcache.cli:run"
    assert weightcache.open_model and weightcache.publish_model
