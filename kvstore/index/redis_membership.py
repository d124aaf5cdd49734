"""Node membership in the Redis prefix index: join, heartbeats (carrying the served-bytes
counters), leave, the node list, and retiring an ended incarnation in every namespace it wrote
to; with the Lua scripts that run on the membership's slot (``{<prefix>}``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping, Sequence

from kvstore.errors import InvalidArgument, StaleEpoch
from kvstore.index.base import NodeInfo, check_contact, check_node, check_node_id, check_served, check_ttl
from kvstore.index.redis_scripts import _COMMON, REFRESH, RETIRE, _Script

log = logging.getLogger(__name__)

REAP_BATCH = 64  # ended incarnations retired per sweep call

_GLOBAL = _COMMON + r"""
local NODES = KEYS[1]
local GB = string.sub(NODES, 1, -6)
local DL, GONE, ALLNS, ADDR, SERVED = GB .. 'dl', GB .. 'gone', GB .. 'ns', GB .. 'addr', GB .. 'served'
local function record(node)
  local r = redis.call('HGET', NODES, node)
  if not r then return nil end
  local e, g, d = string.match(r, '^(%d+) (%d+) (%d+)$')
  return e, tonumber(g), tonumber(d)
end
local function nslist(g) return redis.call('SMEMBERS', GB .. 'nns:' .. g) end
local function put(node, e, g, d)
  redis.call('HSET', NODES, node, e .. ' ' .. g .. ' ' .. d)
  redis.call('ZADD', DL, d, node)
end
-- the node's live incarnation at this epoch, or a refusal
local function current(node, epoch, now)
  local e, g, d = record(node)
  if not e then return nil, {'NOJOIN'} end
  local c = ecmp(epoch, e)
  if c < 0 then return nil, {'STALE', e} end
  if c > 0 then return nil, {'NEWER', e} end
  if d <= now then return nil, {'EXPIRED'} end
  return g, d
end
"""

# ARGV: node, epoch, ttl ms, what it advertises ('' for nothing)
_JOIN = _GLOBAL + r"""
local now = now_ms()
local node, epoch, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local e, g, d = record(node)
local function advertise()
  if ARGV[4] == '' then redis.call('HDEL', ADDR, node) else redis.call('HSET', ADDR, node, ARGV[4]) end
end
if e then
  local c = ecmp(epoch, e)
  if c < 0 then return {'STALE', e} end
  if c == 0 and d > now then
    put(node, e, g, now + ttl)
    advertise()
    return {'SAME', g, nslist(g)}
  end
  redis.call('HSET', GONE, g, node)
end
local ng = redis.call('INCR', GB .. 'seq')
put(node, epoch, ng, now + ttl)
advertise()
redis.call('HDEL', SERVED, node)  -- a new incarnation has served nothing yet
if e then return {'NEW', ng, g, nslist(g)} end
return {'NEW', ng}
"""

# ARGV: node, epoch, ttl ms, served-bytes counters ('' leaves them)
_BEAT = _GLOBAL + r"""
local now = now_ms()
local node, epoch = ARGV[1], ARGV[2]
local g, d = current(node, epoch, now)
if not g then return d end
local e = record(node)
put(node, e, g, now + tonumber(ARGV[3]))
if ARGV[4] ~= '' then redis.call('HSET', SERVED, node, ARGV[4]) end
return {'OK', g, nslist(g)}
"""

# ARGV: node, epoch, namespace. Records that the incarnation writes to the namespace.
_ATTACH = _GLOBAL + r"""
local now = now_ms()
local g, d = current(ARGV[1], ARGV[2], now)
if not g then return d end
redis.call('SADD', GB .. 'nns:' .. g, ARGV[3])
redis.call('SADD', ALLNS, ARGV[3])
return {'OK', g, d - now}
"""

# ARGV: node
_LEAVE = _GLOBAL + r"""
local node = ARGV[1]
local e, g = record(node)
if not e then return {} end
redis.call('HDEL', NODES, node)
redis.call('HDEL', ADDR, node)
redis.call('HDEL', SERVED, node)
redis.call('ZREM', DL, node)
redis.call('HSET', GONE, g, node)
return {g, nslist(g)}
"""

# ARGV: node. The namespaces of its current incarnation.
_SPREAD = _GLOBAL + r"""
local e, g = record(ARGV[1])
if not e then return {} end
return nslist(g)
"""

# ARGV: limit. Ended incarnations (left, replaced, expired) still to retire: {node, inc, namespaces}.
_REAP = _GLOBAL + r"""
local now = now_ms()
local lim = tonumber(ARGV[1])
local out = {}
local gone = redis.call('HGETALL', GONE)
for j = 1, #gone, 2 do
  if #out >= lim then break end
  out[#out + 1] = {gone[j + 1], gone[j], nslist(gone[j])}
end
if #out < lim then
  for _, node in ipairs(redis.call('ZRANGEBYSCORE', DL, '-inf', now, 'LIMIT', 0, lim - #out)) do
    local e, g, d = record(node)
    if e and d <= now then out[#out + 1] = {node, tostring(g), nslist(g)} end
  end
end
return out
"""

# ARGV: node, inc, node, inc, ... retired everywhere.
_FINISH = _GLOBAL + r"""
for j = 1, #ARGV, 2 do
  local node, g = ARGV[j], ARGV[j + 1]
  redis.call('DEL', GB .. 'nns:' .. g)
  redis.call('HDEL', GONE, g)
  local e, cg = record(node)
  if e and cg == tonumber(g) then redis.call('ZREM', DL, node) end
end
return 1
"""

_NODES = _GLOBAL + r"""
local now = now_ms()
local out = {}
local all = redis.call('HGETALL', NODES)
for j = 1, #all, 2 do
  local e, g, d = string.match(all[j + 1], '^(%d+) (%d+) (%d+)$')
  out[#out + 1] = {all[j], e, tonumber(d) > now and 1 or 0, redis.call('HGET', ADDR, all[j]) or '',
                   redis.call('HGET', SERVED, all[j]) or ''}
end
return out
"""


JOIN, BEAT, ATTACH, LEAVE, SPREAD, REAP, FINISH, NODES = (
    _Script(n, s)
    for n, s in [
        ("join", _JOIN), ("heartbeat", _BEAT), ("attach", _ATTACH), ("leave", _LEAVE),
        ("spread", _SPREAD), ("reap", _REAP), ("finish", _FINISH), ("nodes", _NODES),
    ]
)


class _Membership:
    """:class:`~kvstore.index.redis.RedisIndex`'s membership (a mixin of it)."""

    # ---- membership ------------------------------------------------------------

    async def join(
        self, node_id: str, epoch: int, ttl_s: float, *, address: str = "", transports: Sequence[str] = ()
    ) -> None:
        check_node(node_id, epoch)
        check_ttl(ttl_s)
        address, transports = check_contact(address, transports)
        contact = json.dumps({"address": address, "transports": list(transports)}) if address or transports else ""
        r = await self._global(JOIN, node_id, str(epoch), _ms(ttl_s), contact)
        if r[0] == b"STALE":
            raise StaleEpoch(_older(node_id, epoch, r[1]))
        if r[0] == b"SAME":
            await self._refresh(node_id, r[1], r[2], ttl_s)
        elif len(r) > 2:  # a new incarnation replaced a previous one: it stops counting now
            await self._end(node_id, r[2], r[3], purge=False)

    async def heartbeat(self, node_id: str, epoch: int, ttl_s: float, *, served: Mapping[str, int] | None = None) -> None:
        check_node(node_id, epoch)
        check_ttl(ttl_s)
        counters = check_served(served)
        r = await self._global(BEAT, node_id, str(epoch), _ms(ttl_s), "" if counters is None else json.dumps(dict(counters)))
        self._raise_refusal(node_id, epoch, r)
        await self._refresh(node_id, r[1], r[2], ttl_s)

    async def leave(self, node_id: str) -> None:
        check_node_id(node_id)
        r = await self._global(LEAVE, node_id)
        if r:
            await self._end(node_id, r[0], r[1], purge=True)

    async def nodes(self) -> list[NodeInfo]:
        rows = await self._global(NODES)
        return sorted((_node_info(*row) for row in rows), key=lambda i: i.node_id)


    # ---- internals -------------------------------------------------------------

    def _raise_refusal(self, node_id: str, epoch: int, r: list) -> None:
        status = r[0] if r else b"NOJOIN"
        if status == b"OK":
            return
        if status == b"STALE":
            raise StaleEpoch(_older(node_id, epoch, r[1]))
        if status == b"NEWER":
            raise StaleEpoch(
                f"node {node_id!r} joined at epoch {int(r[1])}, not {epoch}: join at epoch {epoch} first"
            )
        if status == b"EXPIRED":
            raise StaleEpoch(f"node {node_id!r} missed its heartbeats and expired: join again and re-add its blocks")
        raise StaleEpoch(f"node {node_id!r} is not a member of the prefix index: join it first")

    async def _refresh(self, node_id: str, inc: int, namespaces: list[bytes], ttl_s: float) -> None:
        ms = _ms(ttl_s)
        await asyncio.gather(*(self._ns(REFRESH, ns.decode(), node_id, inc, ms) for ns in namespaces))

    async def _end(self, node_id: str, inc: int | bytes, namespaces: list[bytes], *, purge: bool) -> None:
        """Retire an ended incarnation in every namespace it wrote to, then tell the membership."""
        names = [ns.decode() for ns in namespaces]
        lids = await asyncio.gather(*(self._ns(RETIRE, ns, node_id, inc) for ns in names))
        if purge:
            await asyncio.gather(*(self._purge(ns, lid) for ns, lid in zip(names, lids) if lid))
        await self._global(FINISH, node_id, inc)

    async def _reap(self) -> None:
        ended = await self._global(REAP, REAP_BATCH)
        for node, inc, namespaces in ended:
            await self._end(node.decode(), inc, namespaces, purge=False)



def _node_info(node: bytes, epoch: bytes, alive: int, contact: bytes, served: bytes = b"") -> NodeInfo:
    address, transports, counters = "", (), ()
    if contact:
        try:
            record = json.loads(contact)
            address, transports = check_contact(record.get("address", ""), record.get("transports", ()))
        except (ValueError, AttributeError, InvalidArgument):  # written by something else: reported as none
            log.warning("the prefix index holds an unreadable address record for node %r: ignored", node)
    if served:
        try:
            counters = check_served(json.loads(served)) or ()
        except (ValueError, InvalidArgument):
            log.warning("the prefix index holds unreadable served-bytes counters for node %r: ignored", node)
    return NodeInfo(node.decode(), int(epoch), bool(alive), address, transports, counters)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _older(node_id: str, epoch: int, current: bytes) -> str:
    return (
        f"node {node_id!r} is at epoch {int(current)}; epoch {epoch} is older: "
        "this process was replaced by a restarted one and must stop writing"
    )
