"""The README's first command is enough: every ``strata`` command works after ``pip install .`` alone.

A virtual environment made here holds Strata installed from a copy of this tree with no extras,
and nothing else. In it every command and subcommand answers ``--help``, the daemon starts with
its embedded defaults and answers ``strata stats``, and the weight pipeline publishes and fetches
a model. A command that needs an extra says which in one line, never with a traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import textwrap
import venv
from pathlib import Path

import pytest

from benchmarks.harness import free_port
from tests.support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.system, pytest.mark.slow]

# Prints every command path of both parsers, one JSON list per line.
COMMANDS = textwrap.dedent("""
    import argparse, json
    from kvstore.cli.main import build_parser
    from weightcache.cli import build_parser as weights_parser

    def walk(parser, path):
        yield path
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from walk(child, path + [name])

    for path in walk(build_parser(), []):
        if path != ["weights"]:  # strata weights is the weights parser's own process
            print(json.dumps(path))
    for path in walk(weights_parser(), ["weights"]):
        print(json.dumps(path))
""")


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    """A venv with ``pip install <copy of this tree>`` and nothing more; its bin folder."""
    base = tmp_path_factory.mktemp("fresh-install")
    source = base / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("kvstore", "weightcache"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    venv.create(base / "venv", with_pip=True)
    bin_dir = base / "venv" / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    done = subprocess.run([bin_dir / "python", "-m", "pip", "install", "-q", str(source)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"pip install . failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return bin_dir


def bare_env(bin_dir: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", HOME=str(home))
    return env


def run(bin_dir: Path, home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([bin_dir / "strata", *args], env=bare_env(bin_dir, home), capture_output=True,
                          text=True, timeout=timeout, cwd=home)


def test_the_install_has_no_extra_beyond_the_base_requirements(bare, tmp_path):
    done = subprocess.run([bare / "python", "-c", "import torch"], capture_output=True, timeout=60)
    assert done.returncode != 0, "torch is in the bare venv: this test would prove nothing"
    for module in ("lmcache", "vllm", "ucxx", "pytest", "aiohttp"):
        done = subprocess.run([bare / "python", "-c", f"import {module}"], capture_output=True, timeout=60)
        assert done.returncode != 0, f"{module} is in the bare venv"


def test_every_command_answers_help(bare, tmp_path):
    listed = subprocess.run([bare / "python", "-c", COMMANDS], capture_output=True, text=True, timeout=120,
                            env=bare_env(bare, tmp_path), cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    paths = [json.loads(line) for line in listed.stdout.splitlines()]
    assert ["serve"] in paths and ["weights", "prefetch"] in paths and ["kv", "put"] in paths
    assert len(paths) > 20
    for path in paths:
        done = run(bare, tmp_path, *path, "--help")
        assert done.returncode == 0 and "Traceback" not in done.stderr, (
            f"strata {' '.join(path)} --help exited {done.returncode}:\n{done.stderr[-3000:]}")
        assert "usage:" in done.stdout


def test_the_daemon_starts_with_its_defaults_and_answers(bare, tmp_path):
    port = free_port()
    env = bare_env(bare, tmp_path)
    # The README's first command, with the arena and the listen address moved out of the way of
    # other runs on this machine.
    daemon = subprocess.Popen([bare / "strata", "serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "",
                               "--shm-dir", str(tmp_path), "--ram-bytes", "64MiB"],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def answers():
            return run(bare, tmp_path, "stats", "--json", "--target", f"127.0.0.1:{port}").returncode == 0
        wait_until(answers, timeout=60, interval=0.3, what="strata serve from the bare install to answer")
        done = run(bare, tmp_path, "kv", "stat", "model", "block-0", "--target", f"127.0.0.1:{port}")
        assert "Traceback" not in done.stderr
    finally:
        daemon.send_signal(signal.SIGTERM)
        out, _ = daemon.communicate(timeout=60)
    assert "Traceback" not in out, out[-3000:]
    assert (tmp_path / ".cache" / "strata").is_dir()  # the default disk tier, under the home folder


def tiny_safetensors(path: Path) -> None:
    data = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, len(data)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_the_weights_pipeline_publishes_and_fetches(bare, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    tiny_safetensors(model / "model.safetensors")
    (model / "config.json").write_text("{}")
    published = run(bare, tmp_path, "weights", "publish", str(model), "--json")
    assert published.returncode == 0, published.stderr
    digest = json.loads(published.stdout)["digest"]
    fetched = run(bare, tmp_path, "weights", "fetch", str(model), digest, "--cache", str(tmp_path / "cache"))
    assert fetched.returncode == 0, fetched.stderr
    listed = run(bare, tmp_path, "weights", "ls", "--cache", str(tmp_path / "cache"), "--json")
    assert listed.returncode == 0 and digest in listed.stdout, listed.stderr


def test_a_command_whose_extra_is_missing_names_it_in_one_line(bare, tmp_path):
    done = run(bare, tmp_path, "route", "--policy", "round-robin", "--endpoint", "http://127.0.0.1:9", "--listen", f"127.0.0.1:{free_port()}")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert "pip install" in done.stderr and "[router]" in done.stderr, done.stderr
