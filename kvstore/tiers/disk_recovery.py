"""The disk tier's start: its directory made and locked (one process at a time), leftover temp
files deleted, and the index rebuilt from every block file's header in LRU order.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from kvstore.errors import TierUnavailable
from kvstore.tiers.block_file import BadHeader, block_name, read_header
from kvstore.tiers.disk_entry import _FOLDERS, _FULL_ERRNOS, _Entry
from kvstore.fsops import FileOps

log = logging.getLogger(__name__)

_LOCK_FILE = "LOCK"


class _Recovery:
    """:class:`~kvstore.tiers.disk.DiskTier`'s start-up (a mixin of it)."""

    # -- start-up ----------------------------------------------------------------

    def _open_directory(self) -> int:
        ops = self._ops
        try:
            _make_dirs(ops, self._root)
            present = set(ops.listdir(self._root_str))
            for folder in _FOLDERS:
                if folder not in present:
                    try:
                        ops.mkdir(f"{self._root_str}/{folder}")
                    except FileExistsError:
                        pass
                    except OSError as e:
                        if e.errno not in _FULL_ERRNOS:
                            raise
                        # A full filesystem: the folder is made by the first put into it.
            # Read-only: flock needs no more, and a file open for writing would
            # keep the filesystem from being remounted read-only after errors.
            fd = ops.open(f"{self._root_str}/{_LOCK_FILE}", os.O_RDONLY | os.O_CREAT, 0o600)
        except OSError as e:
            raise TierUnavailable(
                f"cannot use {self._root} as the disk tier directory: {os.strerror(e.errno or 0)}; "
                "point --disk-dir at a writable directory"
            ) from e
        try:
            ops.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            ops.close(fd)
            raise TierUnavailable(
                f"disk tier directory {self._root} is in use by another process; "
                "stop it or give this one its own --disk-dir"
            ) from e
        return fd

    def _recover(self) -> None:
        found: list[tuple[int, str, _Entry]] = []
        for folder in _FOLDERS:
            folder_path = f"{self._root_str}/{folder}"
            try:
                with self._ops.scandir(folder_path) as it:
                    files = [(d.name, d.path) for d in it if d.is_file(follow_symlinks=False)]
            except FileNotFoundError:
                continue  # not made yet (the filesystem was full at the last start)
            except OSError as e:
                raise self._unavailable(folder_path, e) from e
            for fname, path in files:
                if fname.endswith(".tmp"):
                    self._remove_quietly(path)  # an uncommitted write from a killed process
                elif len(fname) == 32 and fname.startswith(folder):
                    item = self._recover_file(fname, path)
                    if item is None:
                        self.dropped_on_recovery += 1
                        self._remove_quietly(path)
                    else:
                        found.append(item)
        found.sort(key=lambda item: (item[0], item[1]))
        for mtime, name, entry in found:
            self._index[name] = entry
            self._used += entry.disk_bytes
            self._clock_ns = max(self._clock_ns, mtime)
        self.recovered_blocks = len(found)
        log.info(
            "disk tier %s: recovered %d blocks (%d bytes), dropped %d",
            self._root, self.recovered_blocks, self._used, self.dropped_on_recovery,
        )

    def _recover_file(self, name: str, path: str) -> tuple[int, str, _Entry] | None:
        """The (mtime, name, entry) of a sound block file, or None when it must be dropped."""
        ops = self._ops
        try:
            fd = ops.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = ops.fstat(fd)
                header = read_header(_FdReader(ops, fd))
            finally:
                ops.close(fd)
        except BadHeader as e:
            log.warning("disk tier: dropping %s at recovery: %s", path, e)
            return None
        except OSError as e:
            raise self._unavailable(path, e) from e
        if header.meta.size != st.st_size - header.length or block_name(header.key) != name:
            log.warning("disk tier: dropping %s at recovery: size or name disagrees with its header", path)
            return None
        return st.st_mtime_ns, name, _Entry(header.key, header.meta, header.length, header.checksum)



class _FdReader:
    """``read(n)`` on an fd through the tier's FileOps: what :func:`read_header` reads from."""

    __slots__ = ("_ops", "_fd")

    def __init__(self, ops: FileOps, fd: int) -> None:
        self._ops, self._fd = ops, fd

    def read(self, n: int) -> bytes:
        return self._ops.read(self._fd, n)


def _make_dirs(ops: FileOps, path: Path) -> None:
    """``mkdir -p`` through ``ops``."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for p in reversed(missing):
        try:
            ops.mkdir(os.fspath(p))
        except FileExistsError:
            pass
