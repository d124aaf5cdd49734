"""What the blocking and the asyncio client share but I/O: arguments, attachments, the retry policy.

As httpx's ``_client.py:BaseClient`` does for its ``Client`` and
``AsyncClient``, :class:`BaseClient` holds everything
:class:`~kvstore.client.sync.Client` and
:class:`~kvstore.client.aio.AsyncClient` do alike, so each is a thin shell
that opens its channel and transports, waits between attempts and awaits
(or not) its calls:

- the constructor's arguments (target, timeout, retries, shared memory,
  the transport wanted, credentials), checked and kept once;
- argument checks and request building before any call;
- attachments: which namespace's blocks take which arena's transport
  (:class:`Attached`), remembered for at most :data:`MAX_KNOWN_NAMESPACES`
  namespaces, and forgotten when the daemon restarts;
- the retry policy: which failures are tried again, after how long
  (:func:`retry_delay`, :class:`Retries`); the shells loop over its answers.

``tests/client/test_client_twins.py`` compares the two shells' public methods and
signatures, so they cannot drift apart again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kvstore.api.v1 import handoff_pb2 as hpb
from kvstore.api.v1 import index_pb2
from kvstore.api.v1 import kv_pb2 as pb
from kvstore.auth.credentials import ChannelSecurity
from kvstore.block import TierName, validate_namespace
from kvstore.errors import DaemonUnavailable, InvalidArgument, ResourceExhausted, StaleAttachment, StrataError
from kvstore.handoff.params import HandoffParams
from kvstore.rpc.status import from_rpc_error
from kvstore.shm.arena import ShmArena
from kvstore.transport.base import AsyncTransport, BlockPut, Deadline, Transport
from kvstore.transport.grpc.blocks import DEFAULT_CHUNK, check_gets

DEFAULT_TIMEOUT_S = 10.0
# Namespaces whose arena a client remembers; beyond it the memo starts over
# (an Attach per namespace again, the arenas stay mapped).
MAX_KNOWN_NAMESPACES = 4096

# ---- the retry policy -----------------------------------------------------------------

# Methods safe to repeat after UNAVAILABLE: they change nothing, or a repeat
# is a no-op (puts are idempotent), or what a lost reply held (a lease, a
# slot) expires by itself. Commit and Pin are not: a repeat of a call that
# succeeded fails or takes a second lease.
RETRY_ON_UNAVAILABLE = frozenset(
    {"Put", "Get", "Exists", "Delete", "Stats", "Attach", "Allocate", "Lookup", "Release", "Abort", "Unpin",
     "Score", "Holders", "List", "Nodes"}
)


def retry_delay(err: StrataError, method: str, attempt: int, retries: int) -> float | None:
    """Seconds to wait before another attempt, or None to give up."""
    if attempt >= retries:
        return None
    if isinstance(err, ResourceExhausted):
        return err.retry_after_s
    if isinstance(err, DaemonUnavailable) and method in RETRY_ON_UNAVAILABLE:
        return min(0.05 * 2**attempt, 1.0)
    return None


REATTACH = -1.0  # not a delay: forget what was attached, then try again at once


class Retries:
    """One call's retry decisions; the blocking and the asyncio client loop over the same ones.

    :meth:`after` a failure answers :data:`REATTACH` once per call when the
    daemon restarted since the client attached (:class:`StaleAttachment`),
    whatever ``retries`` says (this is not the same failure again); else
    :func:`retry_delay`'s answer.
    """

    __slots__ = ("method", "retries", "attempt", "attached_again")

    def __init__(self, method: str, retries: int) -> None:
        self.method, self.retries = method, retries
        self.attempt = 0
        self.attached_again = False

    def after(self, err: BaseException) -> tuple[StrataError, float | None]:
        """``err`` as a Strata error, and what to do: seconds to wait, :data:`REATTACH`, or None (raise it)."""
        if isinstance(err, grpc.RpcError):
            err = from_rpc_error(err)
        if isinstance(err, StaleAttachment) and not self.attached_again:
            self.attached_again = True
            return err, REATTACH
        delay = retry_delay(err, self.method, self.attempt, self.retries)
        self.attempt += 1
        return err, delay


# The failures a call's attempt may end with that the retry policy answers: control calls
# raise gRPC's, transports Strata errors already.
RETRIED = (grpc.RpcError, StrataError)

# ---- attachments ------------------------------------------------------------------------


@dataclass(slots=True)
class Attached:
    """One arena a client attached: the transport its namespaces' block bytes take, and the arena it
    maps (None: the bytes are streamed, the arena not mapped here)."""

    name: str
    transport: Transport | AsyncTransport
    arena: ShmArena | None = None

    @property
    def same_host(self) -> Transport | AsyncTransport | None:
        """The transport when it is the same-host socket's, else None."""
        return self.transport if self.transport.name == "same-host" else None


class BaseClient:
    """A connection to one daemon, but its I/O; see the module docstring.

    ``use_shm``: None picks shared memory when the daemon's arena can be
    mapped from here; False always streams; True requires shared memory.
    ``transport`` names one ("same-host", "grpc-arena", "grpc") instead of
    picking, and fails rather than fall back.

    Credentials, for a daemon with authentication: ``token`` or
    ``token_file`` (a bearer token), ``tls_ca`` (PEM that verifies the
    daemon's certificate), ``tls_cert``/``tls_key`` (this client's
    certificate, for mTLS), ``tls_server_name`` (the name to verify when the
    target is an address); or a prepared ``security``.
    """

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = 3,
        use_shm: bool | None = None,
        lease_ms: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK,
        transport: str | None = None,
        token: str | None = None,
        token_file: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
        security: ChannelSecurity | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.retries = retries
        self._use_shm = use_shm
        self._want = transport
        self._lease_ms = lease_ms
        self._chunk = chunk_bytes
        if security is None:
            security = ChannelSecurity.build(token=token, token_file=token_file, tls_ca=tls_ca, tls_cert=tls_cert,
                                             tls_key=tls_key, tls_server_name=tls_server_name)
        self._security = security
        self._attached: dict[str, Attached] = {}  # arena name → what the client attached of it
        self._arena_of: dict[str, str] = {}  # namespace → arena name

    # ---- attachments -----------------------------------------------------------------------

    def _streams_only(self) -> bool:
        """Whether block bytes always stream (nothing to attach)."""
        return self._use_shm is False or self._want == "grpc"

    def _known(self, namespace: str) -> Attached | None:
        """What was attached for ``namespace``'s arena, if anything yet."""
        name = self._arena_of.get(namespace)
        return None if name is None else self._attached.get(name)

    def _remember(self, namespace: str, attach: pb.AttachResponse, make) -> Attached:
        """``namespace``'s arena from its Attach answer: the one already attached under that name, or
        ``make()``'s (a new :class:`Attached`)."""
        attached = self._attached.get(attach.arena_name)
        if attached is None:
            attached = self._attached[attach.arena_name] = make()
        if len(self._arena_of) >= MAX_KNOWN_NAMESPACES:
            self._arena_of.clear()
        self._arena_of[namespace] = attach.arena_name
        return attached

    def _forget(self, attached: Attached) -> bool:
        """Forget one attached arena (its namespaces attach again on their next call); False when it was
        already forgotten (another call attached that arena again since)."""
        if self._attached.get(attached.name) is not attached:
            return False
        del self._attached[attached.name]
        self._arena_of = {ns: arena for ns, arena in self._arena_of.items() if arena != attached.name}
        return True

    def _forget_all(self) -> list[Attached]:
        """Forget every attached arena; what was attached, each transport once."""
        attached, self._attached, self._arena_of = self._attached, {}, {}
        return list({id(a.transport): a for a in attached.values()}.values())

    # ---- calls -----------------------------------------------------------------------------

    def _retries(self, method: str) -> Retries:
        return Retries(method, self.retries)

    def _deadline(self) -> Deadline:
        return Deadline.after(self.timeout, cancellable=False)  # the call's own: nobody else can cancel it

    # ---- argument checks and requests --------------------------------------------------------

    @staticmethod
    def _keys(namespace: str, keys: Sequence[bytes]) -> list[bytes]:
        return check_gets(namespace, keys)

    @staticmethod
    def _items(namespace: str, items: Sequence[BlockPut]) -> list[BlockPut]:
        check_gets(namespace, [item.key for item in items])
        return list(items)

    @staticmethod
    def _pin_request(namespace: str, keys: Sequence[bytes], lease_s: float, replicas: int) -> pb.PinRequest:
        return pb.PinRequest(namespace=namespace, keys=list(keys), lease_ms=int(lease_s * 1000), replicas=replicas)

    @staticmethod
    def _score_request(namespace: str, keys, tokens, block_size: int, hash_seed: str, lora_name: str,
                       cache_salt: str, candidates: Sequence[str], weights: dict[TierName, float] | None,
                       ) -> index_pb2.ScoreRequest:
        request = chain_request(index_pb2.ScoreRequest, namespace, keys, tokens, block_size, hash_seed, lora_name,
                                cache_salt)
        request.candidates.extend(candidates)
        for tier, weight in (weights or {}).items():
            request.tier_weights.add(tier=int(tier), weight=weight)
        return request

    @staticmethod
    def _holders_request(namespace: str, keys, tokens, block_size: int, hash_seed: str, lora_name: str,
                         cache_salt: str) -> index_pb2.HoldersRequest:
        return chain_request(index_pb2.HoldersRequest, namespace, keys, tokens, block_size, hash_seed, lora_name,
                             cache_salt)

    @staticmethod
    def _open_handoff_request(namespace: str, keys: Sequence[bytes], lease_s: float,
                              keep_as_cache: bool) -> hpb.OpenHandoffRequest:
        return hpb.OpenHandoffRequest(namespace=namespace, keys=list(keys), lease_ms=int(lease_s * 1000),
                                      keep_as_cache=keep_as_cache)

    def _pull_handoff_request(self, params: HandoffParams | dict,
                              timeout: float | None) -> tuple[hpb.PullHandoffRequest, float]:
        """The PullHandoff request, and its own timeout: the pull's, and 5 s for the answer to come back."""
        if isinstance(params, dict):
            params = HandoffParams.from_dict(params)
        timeout = timeout or max(self.timeout, 120.0)
        request = hpb.PullHandoffRequest(namespace=params.namespace, params=params.to_proto(),
                                         timeout_ms=int(timeout * 1000))
        return request, timeout + 5


def list_request(namespace: str, prefix: bytes, page_size: int, page_token: bytes) -> pb.ListRequest:
    validate_namespace(namespace)
    return pb.ListRequest(namespace=namespace, prefix=prefix, page_size=page_size, page_token=page_token)


def chain_request(cls, namespace: str, keys, tokens, block_size: int, hash_seed: str, lora_name: str,
                  cache_salt: str):
    """A Score or Holders request for a chain given as block keys or as token ids."""
    if (keys is None) == (tokens is None):
        raise InvalidArgument("give the chain either as keys or as tokens")
    request = cls(namespace=namespace)
    if keys is not None:
        request.keys.keys.extend(keys)
    else:
        request.tokens.token_ids.extend(tokens)
        request.tokens.block_size = block_size
        request.tokens.hash_seed = hash_seed
        request.tokens.lora_name = lora_name
        request.tokens.cache_salt = cache_salt
    return request
