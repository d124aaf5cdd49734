"""A disk tier's block files as the tests damage them: where a block's file lies, and one byte of a
file flipped in place."""

from __future__ import annotations

from pathlib import Path

from kvstore.block import BlockKey
from kvstore.tiers.block_file import block_name
from kvstore.tiers.disk import DiskTier


def file_of(tier: DiskTier, k: BlockKey) -> Path:
    name = block_name(k)
    return tier.directory / name[:2] / name


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
