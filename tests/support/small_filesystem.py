"""A real small filesystem to fill: a tmpfs mounted for one test, and a filler that takes its last byte.

The full-disk tests (the disk tier's, the weight cache's) need a filesystem
that really runs out of space, not a patched ``write``; a tmpfs of a few
MiB is one. Mounting needs root or CAP_SYS_ADMIN: where it is not
permitted the test is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` (mount's syntax: ``2m``) mounted at ``path`` for the ``with`` block."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command: these tests need a small real filesystem to fill")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(path: Path) -> Path:
    """Fill the filesystem holding ``path`` to the last byte; returns the filler file."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler
