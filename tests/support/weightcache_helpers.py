"""Small helpers shared by the weight pipeline's tests."""

from __future__ import annotations

import asyncio

from weightcache.safetensors_header import LENGTH_BYTES, SafetensorsHeader, header_length, parse_header


def parse_file(blob: bytes, where: str = "m.safetensors") -> SafetensorsHeader:
    n = header_length(blob[:LENGTH_BYTES], len(blob), where)
    return parse_header(blob[LENGTH_BYTES:LENGTH_BYTES + n], len(blob), where)


def run(coro):
    return asyncio.run(coro)
