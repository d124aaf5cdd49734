"""The CLI's first contact: what a newcomer sees before anything else works.

A put that stored nothing never says it succeeded; a bare ``strata`` and
``--help`` show every command; ``--version``; no daemon is one line naming
``strata serve`` and ``--target`` (``doctor`` beside the daemon it
describes reporting it running: tests/cli/test_doctor.py); the log is readable on a
terminal and JSON elsewhere, and ``strata serve`` says it is ready and
where; ``strata clean`` removes what a trial left in shared memory.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import free_port
from kvstore.cli.common import setup_logging
from kvstore.cli.main import main
from kvstore.config import load_settings

REPO = Path(__file__).resolve().parents[2]
WEIGHTS_COMMANDS = ("publish", "ls", "fetch", "evict", "serve", "prefetch", "wait")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as done:  # argparse's --version and --help
        code = done.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_put_over_a_key_that_holds_other_bytes_is_an_error_that_names_the_contract(make_daemon, tmp_path, capsys):
    daemon = make_daemon()
    target = f"127.0.0.1:{daemon.port}"
    first, other = tmp_path / "first", tmp_path / "other"
    first.write_bytes(b"a" * 65536)
    other.write_bytes(b"b" * 200000)
    assert run(capsys, "kv", "put", "m", "k", str(first), "--target", target)[:2] == (0, "stored: 65536 bytes\n")
    code, out, err = run(capsys, "kv", "put", "m", "k", str(first), "--target", target)
    assert (code, out) == (0, "already present (the same bytes): 65536 bytes\n")
    code, out, err = run(capsys, "kv", "put", "m", "k", str(other), "--target", target)
    assert code == 1 and out == ""
    assert "already holds other bytes (65536 bytes; nothing was stored)" in err
    assert "same key, same bytes" in err and "strata kv delete NS KEY" in err
    files = tmp_path / "dir"
    files.mkdir()
    (files / "k").write_bytes(b"c" * 10)
    (files / "new").write_bytes(b"d" * 10)
    code, out, err = run(capsys, "kv", "put", "m", "--from-dir", str(files), "--target", target)
    assert code == 1 and "stored 1 new blocks of 2 files" in out and "1 keys already hold other bytes (k)" in err


def test_kv_place_moves_blocks_below_ram_and_back(make_daemon, tmp_path, capsys):
    daemon = make_daemon()
    target = f"127.0.0.1:{daemon.port}"
    block = tmp_path / "block"
    block.write_bytes(b"z" * 4096)
    for key in ("a", "b"):
        assert run(capsys, "kv", "put", "m", key, str(block), "--target", target)[0] == 0
    code, out, _ = run(capsys, "kv", "place", "m", "a", "b", "--to", "below", "--target", target)
    assert (code, out) == (0, "2 of 2 blocks below host RAM\n")
    assert run(capsys, "kv", "stat", "m", "a", "--target", target)[1] == "a\tdisk\n"
    code, out, _ = run(capsys, "kv", "place", "m", "a", "gone", "--to", "ram", "--target", target)
    assert code == 3 and out == "1 of 2 blocks in host RAM; 1 not held: gone\n"
    assert run(capsys, "kv", "stat", "m", "a", "--target", target)[1] == "a\thost\n"


def test_no_daemon_is_one_line_that_names_strata_serve_and_target(capsys):
    target = f"127.0.0.1:{free_port()}"
    code, out, err = run(capsys, "stats", "--target", target, "--timeout", "2")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and f"no strata daemon answers at {target}" in err
    assert "`strata serve`" in err and "--target" in err and "failed to connect to all addresses" not in err


def test_a_bare_strata_prints_the_help_and_help_lists_every_command(capsys):
    code, out, _ = run(capsys)
    assert code == 0 and out.startswith("usage: strata")
    code, full, _ = run(capsys, "--help")
    assert code == 0
    for command in ("serve", "kv", "index", "peers", "replication", "stats", "weights", "doctor", "object", "route",
                    "clean"):
        assert f"    {command} " in full or f"    {command}\n" in full, command
    weights = next(line for line in full.splitlines() if line.strip().startswith("weights"))
    assert all(c in weights for c in WEIGHTS_COMMANDS), weights


def test_version(capsys):
    from importlib.metadata import version

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"strata {version('strata-kvcache')}"


def test_the_log_is_text_on_a_terminal_and_json_elsewhere(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        for stream, is_json in ((io.StringIO(), True), (Terminal(), False)):
            monkeypatch.setattr(sys, "stderr", stream)
            setup_logging("INFO", "auto")
            logging.getLogger("strata.test").info("hello")
            line = stream.getvalue().strip().splitlines()[-1]
            if is_json:
                assert json.loads(line)["message"] == "hello"
            else:
                assert line.endswith("INFO strata.test: hello")
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])


def _serve(tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli.main", "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "",
         "--disk-dir", str(tmp_path / "disk"), "--shm-dir", str(tmp_path / "shm"), "--ram-bytes", "32MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )


@pytest.mark.system
def test_serve_says_it_is_ready_and_where_and_clean_removes_the_arena_it_kept(tmp_path, capsys):
    (tmp_path / "shm").mkdir()
    flags = ["--disk-dir", str(tmp_path / "disk"), "--shm-dir", str(tmp_path / "shm")]
    daemon = _serve(tmp_path)
    try:
        ready = daemon.stdout.readline()
        assert ready.startswith("strata serve: ready on 127.0.0.1:") and ", node " in ready, ready
        target = ready.split()[4].rstrip(",")
        block = tmp_path / "block"
        block.write_bytes(b"x" * 5000)
        assert run(capsys, "kv", "put", "m", "k", str(block), "--target", target)[0] == 0
        code, _, err = run(capsys, "clean", *flags)
        assert code == 1 and "is running: stop it first" in err
        assert list((tmp_path / "shm").iterdir()), "the running daemon's arena is still there"
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
    kept = sorted(p.name for p in (tmp_path / "shm").iterdir())
    assert kept, "a stopped daemon that holds blocks keeps its arena (a restart serves them again)"
    code, out, _ = run(capsys, "clean", "--dry-run", *flags)
    assert code == 0 and out.count("would remove") == len(kept)
    code, out, _ = run(capsys, "clean", *flags)
    assert code == 0 and out.count("removed") == len(kept) and not list((tmp_path / "shm").iterdir())
    assert run(capsys, "clean", *flags)[1].endswith(": nothing to remove\n")


@pytest.mark.parametrize("fmt", ["auto"])
def test_the_default_log_format_is_auto(fmt):
    assert load_settings(environ={}).logging.format == fmt
