"""The prefix index in Redis (one server, or a Redis Cluster).

URLs: ``redis://host:port/db`` (``rediss://`` for TLS, ``unix:///path``) for
one server; ``redis+cluster://host:port`` (or ``cluster=True``) for a Cluster,
the address being any one of its masters. A user and password in the URL
authenticate (``AUTH``); TLS files are query parameters of a ``rediss://`` URL
(:mod:`kvstore.index.redis_url`). Messages and reprs show the URL with its
password replaced by ``***``.

Key layout
----------
A namespace's keys share the hash tag ``{<prefix>:<namespace>}`` so that one
Lua script sees them all in one Cluster slot; node membership lives under
``{<prefix>}``::

    {p:ns}:meta        hash   M, S (linear-hashing level and split pointer),
                              N (blocks), seq (last holder id)
    {p:ns}:b:<n>       hash   bucket n (five letters): block key + its CRC-32 -> 4 bytes a holder
    {p:ns}:m           hash   node id -> "<holder id> <incarnation>" ("0 <inc>": inc ended)
    {p:ns}:i           hash   holder id -> "<epoch> <incarnation> <deadline ms> <node id>"
    {p:ns}:dead        set    holder ids whose rows wait for the sweep
    {p:ns}:r:<h>:<c>   hash   holder h's reverse index: bucket (c*128 + field) -> its rows there
    {p:ns}:rc:<h>      set    chunks c of holder h's reverse index
    {p}:nodes          hash   node id -> "<epoch> <incarnation> <deadline ms>"
    {p}:addr           hash   node id -> what it advertised at its latest join (JSON: address, transports)
    {p}:served         hash   node id -> its peer listeners' served bytes at its latest heartbeat
                              (JSON: scheme -> bytes; gone with a new incarnation or a leave)
    {p}:dl             zset   node id by deadline (finds expired nodes without a scan)
    {p}:seq            string last incarnation
    {p}:gone           hash   incarnation -> node id, ended but not yet retired everywhere
    {p}:nns:<inc>      set    namespaces incarnation <inc> wrote to (heartbeats refresh these)
    {p}:ns             set    every namespace (the sweep visits them)

Why this shape. A Redis key costs ~80 bytes before its value, so one key
per block cannot meet ~100 bytes per (block, holder). Blocks are therefore
fields of bucket hashes small enough to stay listpack-encoded (a packed
array, no per-field pointers), and a holder is a 4-byte record
(``holder id << 3 | tier``) in the field's value, the records sorted by holder
id. Buckets split one at a time by linear hashing on the key's CRC-32, keeping
~``LOAD`` blocks a bucket at any size without a rehash pause. Clients compute
the CRCs (C code, sent with the keys) and the field keeps them after the key,
so no script hashes in Lua (~10 us a key there). The reverse index does not
repeat block keys: it counts a holder's rows per bucket, so clearing a holder
visits only the buckets it has rows in: O(its blocks), the constant being one
bucket scan. Measured with 32-byte keys: ~52 bytes per block with one holder,
~4 more per extra holder (``tests/index/test_index_contract.py::test_bytes_per_entry``).

Lookups are one EVALSHA (EVAL again after NOSCRIPT); a chain travels as two
arguments (key lengths, then the fields end to end), not one per key. What a
lookup costs, and why it is shaped so:

- one HGET a block until the first miss (~2-3 us a block inside Lua, most of
  a lookup's server time; nothing cheaper reads a field of a compact bucket);
- sorted records make a block's value a canonical encoding of its holders
  and their tiers, so along a prefix that 25 nodes share the walk compares
  each value with the previous one (one string comparison: Lua strings are
  interned) and decodes only where holders or tiers change: O(nodes) per
  change instead of O(holders x blocks);
- the first block's holders are checked for liveness in one HMGET;
- bucket names are letters, not decimal (Lua's number formatting is
  sprintf), and the read scripts go through a small lane of connections
  that skips redis-py's per-command machinery (:class:`_ReadLane`).

A *holder id* names one node incarnation in one namespace. Answers count a
record only if its holder id is listed in ``{p:ns}:i`` with a deadline in the
future, so ``leave``, ``clear``, a restart (greater epoch) or an expiry drops
a node at once by deleting one field; the rows follow in the sweep.

Membership across slots. The lookup script can only read its own slot, so
each namespace keeps a mirror of the liveness of the nodes that wrote to it
(``{p:ns}:i``): a heartbeat updates ``{p}:nodes`` and then, in parallel, the
mirror of every namespace the node wrote to (``{p}:nns:<inc>``). Lookups
stay one round trip; a heartbeat costs one more per namespace of the node, a
node's first write to a namespace two more. Each server computes deadlines
from its own ``TIME`` plus the TTL, so client clocks never matter and server
clocks need not agree. ``{p}:nodes`` decides death: a namespace deletes rows
only of holder ids retired by ``leave``, ``clear``, a newer incarnation, or an
expiry ``{p}:nodes`` saw; a mirror that lapses a moment early (its refresh
still in flight) costs a brief false miss, never a deleted row.

Limits: fields and values over ``hash-max-listpack-value`` (64 bytes by
default: keys longer than 60 bytes, or blocks with more than 16 holders) turn
their bucket into a plain hash table, correct but several times larger; a
namespace lives on one Cluster shard; holder ids are 29 bits per namespace
(one per node incarnation or clear); the ``m`` tombstone of a node that left
stays (a few dozen bytes) so that a late write of it is refused; buckets
never merge when a namespace shrinks (an emptied bucket costs nothing); a
namespace stops splitting at ``MAX_BUCKETS`` buckets (~475M blocks).

This layout replaced one whose values began with the CRC and whose records
were unsorted; an index written by that version is not readable by this one
(when upgrading, flush the index's keys or use a new ``prefix``, and restart
the daemons so that they publish what they hold again).
"""


from __future__ import annotations

import asyncio
from typing import Any

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from kvstore.errors import InvalidArgument
from kvstore.index import redis_url
from kvstore.index.base import PrefixIndex, check_budget
from kvstore.index.redis_calls import _Calls
# The parts, and (noqa) the names this module has always offered: its constants and scripts.
from kvstore.index.redis_holdings import PURGE_BATCH, _Holdings  # noqa: F401
from kvstore.index.redis_membership import (  # noqa: F401
    ATTACH, BEAT, FINISH, JOIN, LEAVE, NODES, REAP, REAP_BATCH, SPREAD, _Membership,
)
from kvstore.index.redis_reads import LANE_CONNECTIONS, LANE_TIMEOUT_S, _Reads, _ReadLane
from kvstore.index.redis_scripts import (  # noqa: F401
    HOLDERS, LOAD, LOOKUP, MAX_BUCKETS, PURGE, REFRESH, RETIRE, WRITE,
)

_PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class RedisIndex(_Membership, _Holdings, _Reads, _Calls, PrefixIndex):
    """Use :meth:`from_url`; the constructor takes a ready ``redis.asyncio`` client.

    Its parts: membership (:mod:`~kvstore.index.redis_membership`), writes
    (:mod:`~kvstore.index.redis_holdings`), reads (:mod:`~kvstore.index.redis_reads`),
    calls and errors (:mod:`~kvstore.index.redis_calls`), scripts (:mod:`~kvstore.index.redis_scripts`).
    """

    def __init__(
        self, client: Redis | RedisCluster, *, where: str = "redis", prefix: str = "strata", tls: bool = False
    ) -> None:
        if not prefix or not set(prefix) <= _PREFIX_CHARS:
            raise InvalidArgument(f"key prefix {prefix!r} must be non-empty and use only [A-Za-z0-9._-]")
        self._redis = client
        self._where = redis_url.redact(where)
        self._tls = tls
        self._prefix = prefix
        self._nodes_key = "{%s}:nodes" % prefix
        self._sweep_turn = 0
        self._lane: _ReadLane | None = None
        if not isinstance(client, RedisCluster):
            pool = client.connection_pool
            timeout_s = pool.connection_kwargs.get("socket_timeout") or LANE_TIMEOUT_S
            self._lane = _ReadLane(pool, timeout_s, LANE_CONNECTIONS)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        cluster: bool | None = None,
        prefix: str = "strata",
        timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        retries: int = 2,
    ) -> RedisIndex:
        """``redis://[USER:PASSWORD@]host:port/db``, ``rediss://…[?tls_ca_file=…]``, ``unix:///path``,
        or ``redis+cluster://host:port`` (:mod:`kvstore.index.redis_url` has the syntax).

        ``cluster=True`` treats a plain ``redis://`` URL as a Cluster's entry point. Every
        command has ``timeout_s``; a failed connection is retried ``retries`` times, briefly.
        """
        parsed = redis_url.parse(url)
        cluster = cluster or parsed.cluster
        options: dict[str, Any] = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
            **parsed.options,
        )
        try:
            if cluster:
                client: Redis | RedisCluster = RedisCluster.from_url(parsed.client_url, **options)
            else:
                client = Redis.from_url(parsed.client_url, **options)
        except (ValueError, TypeError, rexc.RedisError, rexc.RedisClusterException) as err:
            raise InvalidArgument(f"index URL {parsed.where}: {err}") from None
        return cls(client, where=parsed.where, prefix=prefix, tls=parsed.tls)

    def __repr__(self) -> str:
        return f"<RedisIndex {self._where} prefix={self._prefix}>"

    async def close(self) -> None:
        if self._lane is not None:
            await self._lane.close()
        await self._redis.aclose()


    # ---- maintenance -----------------------------------------------------------

    async def sweep(self, max_entries: int = 1000) -> int:
        check_budget(max_entries)
        await self._reap()
        namespaces = sorted(n.decode() for n in await self._call("SMEMBERS", "{%s}:ns" % self._prefix))
        pending = await asyncio.gather(*(self._call("SCARD", self._ns_key(ns, "dead")) for ns in namespaces))
        dirty = [ns for ns, n in zip(namespaces, pending) if n]
        if not dirty:
            return 0
        self._sweep_turn = (self._sweep_turn + 1) % len(dirty)  # no namespace starves the others
        deleted = 0
        for ns in dirty[self._sweep_turn :] + dirty[: self._sweep_turn]:
            if deleted >= max_entries:
                break
            n, _ = await self._ns(PURGE, ns, "", max_entries - deleted)
            deleted += n
        return deleted
