"""The guard that keeps tests from leaving arenas in the host's shared-memory directory.

A daemon started without a scratch ``--shm-dir`` puts its arena
(``strata-<hash>``), the arena's block table (``strata-<hash>.table``) and its
same-host socket (``samehost-strata-<hash>.sock``) in ``/dev/shm``, and with
``keep_on_exit`` (the default) or a SIGKILL it leaves them there: a test
suite run that does so fills the host's RAM a little more every time.

``<hash>`` is :func:`kvstore.config.tiers.arena_name` of the daemon's state
directory, so an entry that appears during a test is this session's when the
hash is that of a directory under the session's temporary root (or of the
default state directory): those fail the test that left them, and are removed.
An entry no directory of ours explains comes from another process on the host
(another test run, a real daemon): it is reported as a warning, and left alone.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from kvstore.config.tiers import arena_name

SHM = Path("/dev/shm")
_ENTRY = re.compile(r"^(?:samehost-)?(strata-[0-9a-f]{16})(?:-[^/]*)?(?:\.table|\.sock)?$")
_WALK_DEPTH = 6  # tmp_path/<daemon>/<cache>/...: state directories sit a few levels down
_FAN_OUT = re.compile(r"^[0-9a-f]{2}$")  # a disk tier's 256 block folders: never a state directory
_CLOCK_SLACK_S = 5.0


def entries() -> set[str]:
    """The names in ``/dev/shm`` that a Strata daemon's RAM tier or same-host socket would use."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith(("strata-", "samehost-strata-"))}
    except FileNotFoundError:
        return set()


def recent(root: Path, since: float) -> list[Path]:
    """The directories directly under ``root`` made (or changed) since ``since`` (``time.time()``):
    a test's tmp_path, a module fixture's mktemp. Only these are walked, so a check costs a few
    directories, not the whole run's."""
    out = []
    try:
        with os.scandir(root) as it:
            for entry in it:
                try:
                    if entry.is_dir(follow_symlinks=False) and entry.stat().st_ctime >= since - _CLOCK_SLACK_S:
                        out.append(Path(entry.path))
                except OSError:
                    continue
    except FileNotFoundError:
        pass
    return out


def now() -> float:
    """The clock :func:`recent` compares with (directories' ctimes are wall-clock times)."""
    return time.time()


def _directories(root: Path) -> Iterable[Path]:
    base = len(root.parts)
    for here, subdirs, _ in os.walk(root):
        if len(Path(here).parts) - base >= _WALK_DEPTH:
            subdirs.clear()
        subdirs[:] = [d for d in subdirs if not _FAN_OUT.match(d)]
        yield Path(here)


def _arena_names(roots: Iterable[Path]) -> set[str]:
    names = {arena_name((Path.home() / ".cache" / "strata").resolve())}
    for root in roots:
        for d in _directories(root):
            names.add(arena_name(d))
            names.add(arena_name(d.resolve()))
    return names


def check(before: set[str], roots: Iterable[Path] | Callable[[], Iterable[Path]], who: str) -> str | None:
    """Entries new since ``before``: ours are removed and described (the failure message);
    others are warned about. ``None`` when nothing of ours was left. ``roots``: the directories
    whose state directories count as ours (or a function giving them, called only when needed)."""
    new = {n for n in entries() - before if _ENTRY.match(n)}  # a daemon's names, not a test's own arena
    if not new:
        return None
    ours_names = _arena_names(roots() if callable(roots) else roots)
    ours, others = [], []
    for name in sorted(new):
        (ours if _ENTRY.match(name).group(1) in ours_names else others).append(name)
    if others:
        warnings.warn(
            f"{who}: {', '.join(others)} appeared in {SHM} during this test but no directory of this test run "
            "explains them (another process on the host?)",
            stacklevel=1,
        )
    for name in ours:
        try:
            (SHM / name).unlink()
        except FileNotFoundError:
            pass
    if not ours:
        return None
    return (
        f"{who} left {', '.join(ours)} in {SHM} (removed now): start its daemons with a scratch shm_dir "
        "(--shm-dir tmp_path), as tests/conftest.py's make_daemon and tests/support/daemons.py's DaemonProcess do"
    )
