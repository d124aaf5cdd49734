"""The Redis prefix index's reads: ``lookup`` (each node's longest cached prefix of a chain,
what routers score by) and ``holders``, through a lane of connections kept out of redis-py's
pool on a single server (:class:`_ReadLane`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis import exceptions as rexc

from kvstore.block import TierName, validate_namespace
from kvstore.index.base import Holder, NodeMatch, check_candidates, check_keys
from kvstore.index.redis_scripts import HOLDERS, LOOKUP, _chain, _Script

LANE_CONNECTIONS = 4  # read-lane connections a single-server index keeps; more concurrent reads use the pool
LANE_TIMEOUT_S = 5.0  # a lane call's deadline when the client sets no socket timeout
_TIERS = {int(t): t for t in TierName}


class _Detour(Exception):
    """The read lane cannot take this call; the ordinary path must."""


class _ReadLane:
    """A few connections kept out of redis-py's pool for the read scripts (lookup, holders) of
    a single server.

    Why: redis-py's per-command path (a pool checkout and return, a retry wrapper, an
    asyncio Task per send to apply the socket timeout, a timer per read) costs ~60 us here,
    a sixth of a 64-block lookup. A lane connection sends the packed command and reads the
    reply itself under one deadline for the whole call. What the lane does not handle (all
    its connections busy, NOSCRIPT, a broken connection) goes the ordinary way, with its
    retries and reconnects; a Cluster client has no lane (it routes by slot).
    """

    def __init__(self, pool: Any, timeout_s: float, size: int) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._size = size
        self._idle: list[Any] = []
        self._busy = 0

    async def call(self, command: tuple) -> Any:
        if self._idle:
            conn = self._idle.pop()
        elif self._busy < self._size:
            # the pool's own settings (address, TLS, credentials, db), minus the socket timeout
            # whose per-send Task is what the lane avoids: the call's deadline replaces it
            conn = self._pool.connection_class(**{**self._pool.connection_kwargs, "socket_timeout": None})
        else:
            raise _Detour
        self._busy += 1
        try:
            async with asyncio.timeout(self._timeout_s):
                await conn.send_packed_command(conn.pack_command(*command), check_health=False)
                reply = await conn.read_response()
        except rexc.ResponseError:  # the reply was read whole: the connection is fine
            self._busy -= 1
            self._idle.append(conn)
            raise
        except BaseException:  # broken, timed out or cancelled part-way: never reuse
            self._busy -= 1
            await conn.disconnect(nowait=True)
            raise
        self._busy -= 1
        self._idle.append(conn)
        return reply

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.disconnect()


class _Reads:
    """:class:`~kvstore.index.redis.RedisIndex`'s reads (a mixin of it)."""

    _lane: _ReadLane | None

    # ---- reads -----------------------------------------------------------------

    async def lookup(
        self, namespace: str, keys: Sequence[bytes], candidates: Sequence[str] | None = None
    ) -> list[NodeMatch]:
        validate_namespace(namespace)
        chain = check_keys(keys)
        wanted = check_candidates(candidates)
        if wanted is not None and not wanted:
            return []
        head = [-1] if wanted is None else [len(wanted), *sorted(wanted)]
        flat = await self._read(LOOKUP, namespace, *head, *_chain(chain))
        # sort_matches' order, on (-blocks, node id as UTF-8): bytes of UTF-8 sort as its code points do
        rows = sorted(zip([-n for n in flat[1::3]], flat[0::3], flat[2::3]))
        return [NodeMatch(node.decode(), -n, _TIERS[t]) for n, node, t in rows]

    async def holders(self, namespace: str, keys: Sequence[bytes]) -> list[list[Holder]]:
        validate_namespace(namespace)
        checked = check_keys(keys, allow_empty=True)
        if not checked:
            return []
        per_key = await self._read(HOLDERS, namespace, *_chain(checked))
        return [
            sorted(
                (Holder(f[i].decode(), TierName(int(f[i + 1])), int(f[i + 2])) for i in range(0, len(f), 3)),
                key=lambda h: h.node_id,
            )
            for f in per_key
        ]


    # ---- internals -------------------------------------------------------------

    async def _read(self, script: _Script, namespace: str, *args: Any) -> Any:
        """A read script through the lane when there is one; anything it cannot finish goes the
        ordinary way (NOSCRIPT: EVAL sends the script; a broken connection: reconnect, retry)."""
        key = self._ns_key(namespace, "meta")
        if self._lane is not None:
            try:
                return await self._lane.call(("EVALSHA", script.sha, 1, key, *args))
            except (_Detour, rexc.NoScriptError, rexc.ConnectionError, rexc.TimeoutError, OSError):
                pass  # rexc.TimeoutError here is a connect timeout: the ordinary path retries or reports it
            except TimeoutError as err:  # the call's deadline
                raise self._unavailable(err) from err
            except rexc.RedisError as err:
                raise self._refused(script, err) from err
        return await self._eval(script, key, args)
