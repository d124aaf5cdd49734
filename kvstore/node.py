"""Who this daemon is in the fleet: a node id and an epoch.

The epoch grows by one on every start and is kept in the disk tier's
directory, so anything that remembers what a node held (the prefix index)
can tell a restarted node from the one it knew. It must only ever grow: an
epoch that went back would make stale index entries look current. So an
epoch file that cannot be read as a number is not a first start: the new
epoch is then the wall clock in milliseconds, larger than any count of
restarts, and counting goes on from there.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    node_id: str
    epoch: int

    @classmethod
    def start(cls, node_id: str, state_dir: Path) -> NodeIdentity:
        """Bump and persist the epoch (atomically: write a temp file, rename)."""
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / "epoch"
        try:
            epoch = int(path.read_text().strip()) + 1
        except FileNotFoundError:
            epoch = 1
        except (ValueError, UnicodeDecodeError):
            epoch = int(time.time() * 1000)
            logging.getLogger(__name__).warning(
                "the epoch file %s is damaged; starting at epoch %d (the clock), which is above any earlier one",
                path, epoch,
            )
        if epoch < 1:
            epoch = int(time.time() * 1000)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{epoch}\n")
        os.replace(tmp, path)
        return cls(node_id, epoch)
