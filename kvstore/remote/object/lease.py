"""SweepLease: which daemon sweeps a namespace now, decided by a small object in the bucket itself.

A lifecycle sweep (:mod:`~kvstore.remote.object.lifecycle`) lists and
deletes; two daemons sweeping the same namespace at once would each list
it (paying for the requests twice) and race each other's deletes. So each
namespace has one lease object, ``<prefix>/~lease/<namespace>``, a JSON
body ``{"holder", "until", "usage"}``, and only its holder sweeps.

Why in S3 and not in the index: the object tier must work where the fleet
shares a bucket but no Redis (the memory index is per process), the lease
guards S3 work, and S3 has what a lease needs, conditional writes:

- **take a free lease**: ``If-None-Match: *`` (only one creator wins);
- **take an expired one, or renew**: ``If-Match: <ETag read>``, so of two
  daemons that both saw it expire, only the first write succeeds and the
  other gets 412 and stands aside (a delete-then-create would let both in);
- **give it back**: the same conditional write with ``until`` = 0.

``until`` is wall-clock seconds: daemons' clocks must agree to well within
``lease_s`` (NTP gives milliseconds; a lease lasts minutes). A holder that
dies leaves the lease to expire; its sweep was idempotent, so the next
holder redoes at most one pass.

The body also carries the namespace's usage as the last sweep listed it,
so every daemon learns the fleet's usage with one small GET (see
:class:`~kvstore.remote.object.lifecycle.SharedQuota`), and when a sweep
first saw each multipart upload in progress (``uploads``: a digest of the
upload id -> unix seconds, at most :data:`MAX_UPLOADS_REMEMBERED`), so an
upload's age survives a change of sweeper (see
:mod:`~kvstore.remote.object.uploads`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from kvstore.remote.object.client import S3Client
from kvstore.remote.object.layout import KeyLayout, escape_namespace

LEASE_SEGMENT = "~lease"  # never a namespace's segment: escaping writes "~" as "~7E"
MAX_UPLOADS_REMEMBERED = 1000  # ~30 bytes each: the lease stays a small control object


@dataclass(frozen=True, slots=True)
class LeaseState:
    holder: str
    until: float  # unix seconds
    usage_bytes: int | None  # the namespace's block bytes at the last sweep (None: never swept)
    usage_objects: int | None
    etag: str
    uploads: dict[str, float] = field(default_factory=dict)  # upload id digest -> first seen (unix seconds)


def lease_path(layout: KeyLayout, namespace: str) -> str:
    return f"{layout.root}{LEASE_SEGMENT}/{escape_namespace(namespace)}"


def _decode(raw: bytes, etag: str) -> LeaseState:
    try:
        body = json.loads(raw)
        uploads = {str(k): float(v) for k, v in (body.get("uploads") or {}).items()}
        return LeaseState(str(body["holder"]), float(body["until"]), body.get("usage_bytes"),
                          body.get("usage_objects"), etag, uploads)
    except (ValueError, KeyError, TypeError):
        return LeaseState("", 0.0, None, None, etag)  # unreadable: treated as expired, rewritten by the next taker


class SweepLease:
    """The sweep lease of every namespace under one layout, for one holder (a node id)."""

    def __init__(self, client: S3Client, layout: KeyLayout, holder: str, lease_s: float = 300.0,
                 wall: Callable[[], float] = time.time) -> None:
        if not holder or lease_s <= 0:
            raise InvalidArgument("sweep lease: give a holder name and a positive lease_s")
        self._client = client
        self._layout = layout
        self.holder = holder
        self.lease_s = lease_s
        self._wall = wall
        self._held: dict[str, LeaseState] = {}  # namespace -> the lease this holder wrote

    async def read(self, namespace: str, deadline: float) -> LeaseState | None:
        got = await self._client.get_small(lease_path(self._layout, namespace), deadline)
        return None if got is None else _decode(*got)

    async def acquire(self, namespace: str, deadline: float) -> LeaseState | None:
        """Take or renew the lease; the state written, or None when another holder has it."""
        now = self._wall()
        current = await self.read(namespace, deadline)
        if current is not None and current.holder != self.holder and current.until > now:
            return None
        body: dict = {"holder": self.holder, "until": now + self.lease_s}
        if current is not None:
            body["usage_bytes"], body["usage_objects"] = current.usage_bytes, current.usage_objects
            if current.uploads:
                body["uploads"] = current.uploads
        return await self._write(namespace, body, None if current is None else current.etag, deadline)

    async def release(self, namespace: str, deadline: float, usage: tuple[int, int] | None = None,
                      uploads: dict[str, float] | None = None) -> bool:
        """Give the lease back (``until`` = 0), recording ``usage`` (bytes, objects) and ``uploads``
        (None: as they were); False when it was no longer ours (it expired and another daemon took it)."""
        held = self._held.pop(namespace, None)
        if held is None:
            return False
        body: dict = {"holder": self.holder, "until": 0.0}
        if usage is None and held.usage_bytes is not None:
            usage = (held.usage_bytes, held.usage_objects or 0)
        if usage is not None:
            body["usage_bytes"], body["usage_objects"] = usage
        uploads = held.uploads if uploads is None else uploads
        if uploads:
            body["uploads"] = dict(sorted(uploads.items(), key=lambda kv: kv[1])[-MAX_UPLOADS_REMEMBERED:])
        return await self._write(namespace, body, held.etag, deadline) is not None

    async def _write(self, namespace: str, body: dict, etag: str | None, deadline: float) -> LeaseState | None:
        raw = json.dumps(body).encode()
        new = await self._client.put_control(lease_path(self._layout, namespace), raw, deadline, etag=etag)
        if new is None:
            self._held.pop(namespace, None)
            return None
        state = _decode(raw, new)
        if body["until"] > 0:
            self._held[namespace] = state
        return state
