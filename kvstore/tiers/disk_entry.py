"""What the disk tier knows of a block file without reading it (:class:`_Entry`, its index's
value), the error of a file whose payload is unsound, and the layout every part of the tier shares.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from kvstore.block import BlockKey, BlockMeta

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FOLDERS = [f"{i:02x}" for i in range(256)]  # fan-out by the name's first byte
_IO_CHUNK = 1 << 20  # bytes per read or write: small enough that a chunk just hashed is still in cache


class _BadPayload(ValueError):
    """A block file whose header is sound but whose payload is short, long or fails its checksum."""


@dataclass(slots=True)
class _Entry:
    key: BlockKey
    meta: BlockMeta
    header_len: int
    header_sum: int  # lets a get recognise its own header without parsing it

    @property
    def disk_bytes(self) -> int:
        return self.header_len + self.meta.size
