"""Who this daemon is in the fleet: a node id and an epoch.

The epoch grows by one on every start and is kept in the disk tier's
directory, so anything that remembers what a node held (the prefix index)
can tell a restarted node from the one it knew.
"""

from __future__ import annotations

import os
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
        except (FileNotFoundError, ValueError):
            epoch = 1
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{epoch}\n")
        os.replace(tmp, path)
        return cls(node_id, epoch)
