"""How the Redis prefix index calls Redis: the key a script runs on (so the Cluster slot it is
routed to: a namespace's hash tag, or the membership's), EVALSHA with EVAL after NOSCRIPT, plain
commands, and Redis's errors as the index's (unavailable, refused), each naming its fix.

A Cluster client learns the slots' masters on its first command. Several first commands at
once each start that, and in redis-py 8.1 they close connections under one another (an
``AttributeError`` from inside redis-py, in 7 of 12 tries of 64 concurrent calls on loopback),
so the index asks for the slots once, under a lock, before its first command. A failover
makes the client learn the slots again while commands are in flight, and the same race can
then end a command the same way: such an ``AttributeError`` raised inside redis-py is the
index unavailable for that call (the caller retries), never an error of the daemon's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from kvstore.errors import PrefixIndexError
from kvstore.index.base import IndexUnavailable
from kvstore.index.redis_scripts import _Script

log = logging.getLogger(__name__)

_UNAVAILABLE = (
    rexc.ConnectionError,  # includes BusyLoadingError, AuthenticationError
    rexc.TimeoutError,
    rexc.ClusterError,  # ClusterDownError, MasterDownError
    rexc.TryAgainError,
    rexc.ReadOnlyError,
    rexc.OutOfMemoryError,
    rexc.RedisClusterException,  # no reachable startup node, slot not covered
)
_BUSY = ("BUSY", "LOADING", "MASTERDOWN")  # replies of a server that is there but cannot serve yet
# How a refused AUTH reads once a Cluster client has wrapped it in RedisClusterException (as text).
_AUTH_REFUSED = ("WRONGPASS", "NOAUTH", "invalid username-password pair", "Authentication required",
                 "HELLO must be called with the client already authenticated", "invalid password")


def _inside_redis_py(err: AttributeError) -> bool:
    """Whether the error was raised in redis-py's own code (its connection race, module docstring)."""
    tb, last = err.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and "/redis/" in last.tb_frame.f_code.co_filename.replace("\\", "/")


def _auth_failure(err: BaseException) -> bool:
    """Whether Redis refused the credentials (or wanted some), however redis-py wrapped it."""
    seen: BaseException | None = err
    for _ in range(8):  # the cause chain, bounded
        if seen is None:
            break
        if isinstance(seen, rexc.AuthenticationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return any(marker in str(err) for marker in _AUTH_REFUSED)


class _Calls:
    """:class:`~kvstore.index.redis.RedisIndex`'s calls to Redis (a mixin of it)."""

    _redis: Redis | RedisCluster
    _where: str
    _tls: bool
    _prefix: str
    _nodes_key: str
    _slots_known: bool = False
    _slots_lock: asyncio.Lock | None = None

    async def _know_slots(self) -> None:
        """A Cluster client's first call, alone: the slots' masters (see the module docstring)."""
        if self._slots_known:
            return
        if not isinstance(self._redis, RedisCluster):
            self._slots_known = True
            return
        if self._slots_lock is None:
            self._slots_lock = asyncio.Lock()
        async with self._slots_lock:
            if not self._slots_known:
                try:
                    await self._redis.initialize()
                except _UNAVAILABLE as err:
                    raise self._unavailable(err) from err
                self._slots_known = True

    def _ns_key(self, namespace: str, suffix: str) -> str:
        return "{%s:%s}:%s" % (self._prefix, namespace, suffix)

    async def _ns(self, script: _Script, namespace: str, *args: Any) -> Any:
        return await self._eval(script, self._ns_key(namespace, "meta"), args)

    async def _global(self, script: _Script, *args: Any) -> Any:
        return await self._eval(script, self._nodes_key, args)

    async def _eval(self, script: _Script, key: str, args: Sequence[Any]) -> Any:
        """EVALSHA; on NOSCRIPT (a restarted or flushed server) EVAL, which caches the script again."""
        await self._know_slots()
        try:
            try:
                return await self._redis.evalsha(script.sha, 1, key, *args)
            except rexc.NoScriptError:
                log.debug("Redis at %s lacks the %s script; sending it", self._where, script.name)
                return await self._redis.eval(script.source, 1, key, *args)
        except _UNAVAILABLE as err:
            raise self._unavailable(err) from err
        except rexc.RedisError as err:
            raise self._refused(script, err) from err
        except AttributeError as err:
            if _inside_redis_py(err):
                raise self._unavailable(err) from err
            raise

    def _refused(self, script: _Script, err: rexc.RedisError) -> PrefixIndexError:
        if str(err).startswith(_BUSY):
            return self._unavailable(err)
        if isinstance(err, rexc.NoPermissionError):
            return PrefixIndexError(
                f"Redis at {self._where} refused the {script.name} script: {err}: grant the index's user scripts "
                f"and reads and writes of its keys, e.g. ACL SETUSER USER +@scripting +@read +@write +@fast "
                f"~{{{self._prefix}}}* ~{{{self._prefix}:*"
            )
        return PrefixIndexError(f"Redis at {self._where} refused the {script.name} script: {err}")

    async def _call(self, *command: Any) -> Any:
        await self._know_slots()
        try:
            return await self._redis.execute_command(*command)
        except _UNAVAILABLE as err:
            raise self._unavailable(err) from err
        except rexc.RedisError as err:
            if str(err).startswith(_BUSY):
                raise self._unavailable(err) from err
            raise PrefixIndexError(f"Redis at {self._where} refused {command[0]}: {err}") from err
        except AttributeError as err:
            if _inside_redis_py(err):
                raise self._unavailable(err) from err
            raise

    def _unavailable(self, err: BaseException) -> IndexUnavailable:
        """Unreachable, refused credentials or a failed TLS handshake: all are the index being
        unavailable to this node (the daemon serves local hits and retries), each with its fix."""
        what = f"{type(err).__name__}: {err}"
        if _auth_failure(err):
            return IndexUnavailable(
                f"Redis at {self._where} refused the index's credentials ({what}): put the right user and "
                "password in index_url (STRATA_INDEX_URL), redis://USER:PASSWORD@HOST:PORT/DB, or "
                "redis://:PASSWORD@HOST:PORT/DB for a server with requirepass (percent-encode special characters)"
            )
        fix = "check that Redis runs there and that index_url (STRATA_INDEX_URL) points at it"
        if self._tls:
            fix += (
                "; for TLS, that tls_ca_file holds the CA that signed the server's certificate and the certificate "
                "names the URL's host, and that tls_cert_file and tls_key_file are given if the server requires "
                "client certificates"
            )
        elif "reset by peer" in str(err) or "closed by server" in str(err):
            fix += "; if the server speaks TLS, use rediss://"
        return IndexUnavailable(f"the prefix index at {self._where} cannot be reached ({what}): {fix}")
