"""Who this daemon is in the fleet: a node id and an epoch.

The epoch grows on every start and is kept in the disk tier's directory, so
anything that remembers what a node held (the prefix index) can tell a
restarted node from the one it knew. It must only ever grow: an epoch that
went back would make stale index entries look current. So a start takes the
larger of the last persisted epoch plus one and the wall clock in
milliseconds: it grows with the clock even when the last run could not
persist its epoch (a full filesystem) or the file is damaged, and still
grows by one if the clock stepped back below the last persisted epoch.

A full filesystem must not keep the daemon from starting (it serves from
RAM), nor make it reuse an epoch. The new epoch is written to a temp file
and renamed over the old one; when that fails the temp file goes, and the
old file is overwritten in place instead, which needs no new space on a
filesystem that allocates in place (a write torn by a crash makes the file
unreadable, and the next start goes by the clock). When even that fails the
epoch is not persisted: :meth:`NodeIdentity.persist` writes it once the
filesystem has room (the daemon retries every second).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvstore.fsops import REAL, FileOps

log = logging.getLogger(__name__)

_MAX_EPOCH_FILE = 64  # bytes: an epoch and a newline; anything longer is damage


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    node_id: str
    epoch: int
    persisted: bool = True  # False: the epoch file could not be written; persist() retries

    @classmethod
    def start(cls, node_id: str, state_dir: Path, ops: FileOps = REAL) -> NodeIdentity:
        """Bump and persist the epoch (atomically: write a temp file, rename)."""
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / "epoch"
        try:
            previous = _read_epoch(ops, path)
        except FileNotFoundError:
            previous = 0
        except (ValueError, UnicodeDecodeError):
            previous = 0
            log.warning("the epoch file %s is damaged; this start goes by the clock, which is above any earlier epoch", path)
        epoch = max(previous + 1, _clock_epoch())
        identity = cls(node_id, epoch, persisted=False)
        if identity.persist(state_dir, ops):
            return cls(node_id, epoch)
        log.error(
            "cannot write the epoch file in %s (its filesystem is full or failing): this run takes epoch %d "
            "(above any earlier one) and writes it once there is room; free space in --disk-dir",
            state_dir, epoch, extra={"disk_dir": str(state_dir), "epoch": epoch},
        )
        return cls(node_id, epoch, persisted=False)

    def persist(self, state_dir: Path, ops: FileOps = REAL) -> bool:
        """Write this epoch to ``state_dir``; False (logged, nothing left behind) when the filesystem refuses."""
        path = os.fspath(state_dir / "epoch")
        text = f"{self.epoch}\n".encode()
        tmp = path + ".tmp"
        try:
            _write_file(ops, tmp, text)
            ops.replace(tmp, path)
            return True
        except OSError as e:
            _remove(ops, tmp)
            first = e
        try:
            _overwrite(ops, path, text)
        except OSError as e:
            log.warning(
                "cannot persist epoch %d in %s: %s, then in place: %s",
                self.epoch, state_dir, first.strerror or first, e.strerror or e,
            )
            return False
        log.warning("epoch file %s rewritten in place (%s writing a new one)", path, first.strerror or first)
        return True


def _clock_epoch() -> int:
    return int(time.time() * 1000)


def _read_epoch(ops: FileOps, path: Path) -> int:
    fd = ops.open(os.fspath(path), os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = ops.read(fd, _MAX_EPOCH_FILE + 1)
    finally:
        ops.close(fd)
    if len(data) > _MAX_EPOCH_FILE:
        raise ValueError("epoch file too long")
    return int(data.decode().strip())


def _write_file(ops: FileOps, path: str, data: bytes) -> None:
    fd = ops.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)  # the daemon's own
    try:
        _write_all(ops, fd, data)
    finally:
        ops.close(fd)


def _overwrite(ops: FileOps, path: str, data: bytes) -> None:
    """Write ``data`` over the start of an existing file, then cut it there: no new file, no rename."""
    fd = ops.open(path, os.O_WRONLY | os.O_CLOEXEC)  # no O_CREAT: only a file that exists has its space
    try:
        _write_all(ops, fd, data)
        ops.ftruncate(fd, len(data))
        ops.fsync(fd)
    finally:
        ops.close(fd)


def _write_all(ops: FileOps, fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = ops.write(fd, view)
        if n == 0:
            raise OSError(errno.EIO, "write made no progress")
        view = view[n:]


def _remove(ops: FileOps, path: str) -> None:
    try:
        ops.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not remove %s: %s", path, e.strerror)
