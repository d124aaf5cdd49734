"""Who may call a weight node: the KV daemon's credentials and policy, applied to ``WeightService``.

The weight node takes the same ``--auth-file`` (bearer tokens, certificate
subjects), ``--tls-cert``/``--tls-key`` and ``--tls-client-ca`` (mTLS) as
the daemon, read by the same code (:class:`kvstore.auth.Authority`, the
identities of :meth:`kvstore.auth.interceptor.AuthInterceptor.identify`),
so one policy file and one PKI cover both processes of a node. Its RPCs
name no KV namespace; each is checked against the one namespace
``weights``::

    Prefetch    write   (starts a fetch: costs origin bytes and disk)
    Status      read
    ReadChunk   read    (what peer weight nodes call: give them a token too)

So a rule with ``namespaces = ["weights"]`` (or ``"*"``) and ``actions =
["read"]`` lets a peer read chunks and an init container wait; Prefetch
also needs ``write``. A method not in this table is refused, as in the
daemon. Refusals are UNAUTHENTICATED (no or unknown credential) and
PERMISSION_DENIED (known, not allowed), decided before the servicer runs.

Protected mode as the daemon's (:mod:`kvstore.auth.exposure`): a weight node
without authentication listens on loopback only, unless ``--insecure`` says
to serve every client that can reach it. Unauthenticated, anyone who reaches
the port may start fetches (origin egress, disk) with Prefetch; the check
runs before anything is fetched or bound.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from kvstore.auth import READ, WRITE, Authority
from kvstore.auth.exposure import refusal
from kvstore.auth.interceptor import AuthInterceptor
from kvstore.errors import InvalidArgument, PermissionDenied, StrataError
from kvstore.rpc.status import to_status

log = logging.getLogger(__name__)

NAMESPACE = "weights"
_GUARDED_PREFIX = "/strata.weights."
ACTIONS: dict[str, str] = {"Prefetch": WRITE, "Status": READ, "ReadChunk": READ}


class WeightsAuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, authority: Authority) -> None:
        self._authority = authority
        self._identify = AuthInterceptor(authority).identify

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(_GUARDED_PREFIX):
            return handler  # health and reflection stay open to probes
        op = method.rsplit("/", 1)[-1]
        if handler.unary_unary is None:  # every WeightService method is unary; a streaming one is new
            return handler._replace(stream_stream=_refused(op))
        return handler._replace(unary_unary=self._guarded(handler.unary_unary, op))

    def check(self, op: str, context) -> None:
        action = ACTIONS.get(op)
        identity = self._identify(context)
        if action is None:
            raise PermissionDenied(f"{op}: the weight node's auth policy has no rule for this method; upgrade it")
        self._authority.check(identity, NAMESPACE, action)

    def _guarded(self, behavior, op: str):
        def guarded(request, context):
            try:
                self.check(op, context)
            except StrataError as err:
                context.abort_with_status(to_status(err))
            return behavior(request, context)

        return guarded


def _refused(op: str):
    def refused(requests, context):
        context.abort_with_status(to_status(PermissionDenied(f"{op}: not a method the weight node serves")))

    return refused


def server_credentials(tls_cert: str | None, tls_key: str | None, tls_client_ca: str | None):
    """TLS for the listener (None without ``tls_cert``); with a client CA, clients need its certificates."""
    if not tls_cert:
        if tls_key or tls_client_ca:
            raise InvalidArgument("--tls-key and --tls-client-ca need --tls-cert (the weight node's certificate)")
        return None
    if not tls_key:
        raise InvalidArgument("--tls-cert needs --tls-key (its private key)")

    def read(path: str, flag: str) -> bytes:
        try:
            return Path(path).expanduser().read_bytes()
        except OSError as err:
            raise InvalidArgument(f"cannot read {path} ({err.strerror}): check {flag}") from None

    pair = (read(tls_key, "--tls-key"), read(tls_cert, "--tls-cert"))
    ca = read(tls_client_ca, "--tls-client-ca") if tls_client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def check_exposure(listen: str, authority: Authority | None, insecure: bool) -> None:
    """Refuse (InvalidArgument naming the fix) to serve a non-loopback ``listen`` without authentication
    unless ``insecure``; with it, say so in the log."""
    why = refusal(listen, authority is not None and authority.required, False)
    if why is None:
        return
    if not insecure:
        raise InvalidArgument(why.replace("--listen 127.0.0.1:PORT", "--listen 127.0.0.1:PORT (strata weights serve)"))
    log.warning("--insecure: the weight node on %s serves every client that can reach it, Prefetch included", listen)
