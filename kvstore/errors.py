"""Errors raised by the Strata KV store, its server and its client.

One tree; callers catch the narrowest class they can act on. Every message
says what was wrong and what to do about it.

    StrataError
    ├── InvalidArgument             bad input (INVALID_ARGUMENT)
    │   ├── InvalidKey              empty, oversized or malformed key
    │   ├── InvalidNamespace        malformed namespace name
    │   ├── BlockTooLarge           value over the configured block limit
    │   ├── InvalidHashInput        token ids or extra keys vLLM's hashing cannot take   [index.keys]
    │   │   └── ChainTooLong        more tokens than one chain may have                   [index.keys]
    │   ├── MalformedEvent          a vLLM KV-event message that does not parse           [index.event_format]
    │   ├── FrameError              a same-host frame that breaks the format or its limits [wire.frames]
    │   └── WrongArena              a namespace of another arena, on one arena's socket   [store.group]
    ├── UnknownNamespace            namespace never created here (NOT_FOUND)
    ├── AuthError                   who the caller is, and what it may do
    │   ├── Unauthenticated         no credentials, or ones this daemon does not know (UNAUTHENTICATED)
    │   ├── PermissionDenied        an identity not allowed this namespace or call (PERMISSION_DENIED)
    │   └── PolicyError             a policy file that does not parse; the old policy stays   [auth.policy]
    ├── LeaseError                  FAILED_PRECONDITION
    │   ├── LeaseExpired            lease or slot deadline passed
    │   ├── UnknownLease            lease or slot id never issued, or released
    │   ├── SlotAlreadyCommitted    a second commit of the same slot
    │   ├── LeaseOwnedElsewhere     a lease or slot ended by a client other than its owner
    │   ├── UnknownHandoff          a handoff id this daemon never issued (or another namespace's)
    │   ├── HandoffEnded            a handoff already completed or expired
    │   └── ArenaReplaced           a Lookup or Allocate names an arena token that is not the
    │                               daemon's arena's (it restarted): attach again
    ├── ResourceExhausted           RESOURCE_EXHAUSTED, carries retry_after_s
    │   ├── TierFull                no space even after eviction
    │   │   ├── NamespaceFull       full for one namespace only (an object quota): others still fit
    │   │   └── DiskFull            the disk tier's filesystem is full (a full tier, not a failing one)
    │   └── Overloaded              too many requests in flight
    ├── CorruptBlock                checksum mismatch (DATA_LOSS)
    ├── TierUnavailable             a tier's device failed (UNAVAILABLE)
    │   └── UcxUnavailable          ucxx cannot be imported here (the ucx extra)          [peer.ucx_link]
    ├── DeadlineExceeded            the caller's deadline passed (DEADLINE_EXCEEDED)
    ├── Cancelled                   client side: the caller cancelled the call
    ├── PrefixIndexError            the prefix index
    │   ├── IndexUnavailable        its backing service cannot be reached (UNAVAILABLE)
    │   └── StaleEpoch              a write names an epoch older than the node's (FAILED_PRECONDITION)
    ├── ArenaMismatch               an arena file is not the one expected (magic, version,
    │                               token or size differ)                                 [shm.arena]
    ├── TableMismatch               an arena's block table is not this arena's, or of
    │                               another format: the RAM tier starts empty             [shm.table]
    ├── DaemonError                 the daemon cannot start as configured              [server.endpoints]
    ├── DaemonUnavailable           client side: the daemon cannot be reached
    │   └── StaleAttachment         client side: the daemon restarted since this client attached
    │                               its arena; the client attaches again
    └── ArenaUnusable               client side: the daemon's arena cannot be mapped
                                    here (another host); the client streams instead

A class marked ``[module]`` is defined in ``kvstore.<module>``, next to the
only code that raises it; :data:`DEFINED_ELSEWHERE` names those modules, so
that an error crossing gRPC (``kvstore.rpc.status``) is re-raised as its own
class even by a process that never imported that module. Every other class
is defined here. A new subclass anywhere goes into this tree, and into
:data:`DEFINED_ELSEWHERE` when it lives outside this module (a test checks).

A cache miss is not an error: lookups return ``None`` or a count.
"""

from __future__ import annotations

from collections.abc import Mapping

# Subclasses of StrataError defined outside this module: class name → module.
DEFINED_ELSEWHERE: Mapping[str, str] = {
    "InvalidHashInput": "kvstore.index.keys",
    "ChainTooLong": "kvstore.index.keys",
    "MalformedEvent": "kvstore.index.event_format",
    "FrameError": "kvstore.wire.frames",
    "ArenaMismatch": "kvstore.shm.arena",
    "TableMismatch": "kvstore.shm.table",
    "DaemonError": "kvstore.server.endpoints",
    "WrongArena": "kvstore.store.group",
    "PolicyError": "kvstore.auth.policy",
    "UcxUnavailable": "kvstore.peer.ucx_link",
}


class StrataError(Exception):
    """Base of every error Strata raises on purpose."""


class InvalidArgument(StrataError):
    pass


class InvalidKey(InvalidArgument):
    pass


class InvalidNamespace(InvalidArgument):
    pass


class BlockTooLarge(InvalidArgument):
    pass


class UnknownNamespace(StrataError):
    pass


class AuthError(StrataError):
    pass


class Unauthenticated(AuthError):
    pass


class PermissionDenied(AuthError):
    pass


class LeaseError(StrataError):
    pass


class LeaseExpired(LeaseError):
    pass


class UnknownLease(LeaseError):
    pass


class SlotAlreadyCommitted(LeaseError):
    pass


class LeaseOwnedElsewhere(LeaseError):
    """Servers answer the stranger with ``stranger_view`` (the answer for an id never issued) instead."""

    stranger_view: StrataError | None = None


class UnknownHandoff(LeaseError):
    pass


class HandoffEnded(LeaseError):
    pass


class ArenaReplaced(LeaseError):
    """The arena file a gRPC-arena client mapped is not the daemon's any more: offsets and leases
    it would be given are of another file. The client attaches again (:class:`StaleAttachment`)."""


class ResourceExhausted(StrataError):
    def __init__(self, message: str, retry_after_s: float = 0.1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TierFull(ResourceExhausted):
    pass


class NamespaceFull(TierFull):
    """A tier is full for one namespace only (its quota): blocks of other namespaces still fit."""

    def __init__(self, message: str, retry_after_s: float = 0.1, namespace: str = "") -> None:
        super().__init__(message, retry_after_s)
        self.namespace = namespace


class Overloaded(ResourceExhausted):
    pass


class CorruptBlock(StrataError):
    pass


class TierUnavailable(StrataError):
    pass


class DiskFull(TierFull):
    pass


class DeadlineExceeded(StrataError):
    pass


class Cancelled(StrataError):
    pass


class DaemonUnavailable(StrataError):
    pass


class StaleAttachment(DaemonUnavailable):
    """The daemon refused a token it accepted before: it restarted, and what was attached is gone."""


class ArenaUnusable(StrataError):
    pass


class PrefixIndexError(StrataError):
    pass


class IndexUnavailable(PrefixIndexError):
    pass


class StaleEpoch(PrefixIndexError):
    pass
