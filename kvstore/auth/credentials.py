"""The client side: a bearer token and TLS on the channels a client opens.

The token travels as ``authorization: Bearer <token>`` metadata, added by
a channel interceptor (gRPC's own call credentials refuse insecure
channels, and a loopback or Unix-socket daemon needs none). TLS applies to
TCP targets: ``tls_ca`` verifies the daemon, ``tls_cert``/``tls_key`` are
the client's certificate for mTLS; a ``unix:`` target is same-host and
stays plaintext (the token still goes with it).

The token is read once, kept out of reprs, and sent only as metadata.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import grpc.aio

from kvstore.errors import InvalidArgument

MAX_TOKEN_FILE_BYTES = 64 << 10


def _read(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as err:
        raise InvalidArgument(f"cannot read the {what} {path} ({err.strerror})") from None


def read_token_file(path: str | Path) -> str:
    """The token in ``path``: its first line, surrounding whitespace removed."""
    data = _read(path, "token file")[:MAX_TOKEN_FILE_BYTES]
    token = data.decode(errors="replace").strip().splitlines()[0].strip() if data.strip() else ""
    if not token:
        raise InvalidArgument(f"the token file {path} is empty: put the bearer token on its first line")
    return token


@dataclass(frozen=True)
class ChannelSecurity:
    """What a client presents to the daemon. Build it with :meth:`build`."""

    token: str | None = field(default=None, repr=False)
    root_ca: bytes | None = field(default=None, repr=False)
    cert_chain: bytes | None = field(default=None, repr=False)
    private_key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None

    def __repr__(self) -> str:
        parts = ["token" if self.token else "", "tls" if self.tls else "", "client-cert" if self.cert_chain else ""]
        return f"ChannelSecurity({', '.join(p for p in parts if p) or 'none'})"

    @classmethod
    def build(cls, *, token: str | None = None, token_file: str | Path | None = None, tls_ca: str | Path | None = None,
              tls_cert: str | Path | None = None, tls_key: str | Path | None = None,
              tls_server_name: str | None = None) -> ChannelSecurity:
        if token and token_file:
            raise InvalidArgument("give token or token_file, not both")
        if bool(tls_cert) != bool(tls_key):
            raise InvalidArgument("a client certificate needs both tls_cert and tls_key")
        if token is not None and (not token.strip() or token != token.strip()):
            raise InvalidArgument("the token is empty or has surrounding whitespace")
        return cls(
            token=token or (read_token_file(token_file) if token_file else None),
            root_ca=_read(tls_ca, "CA certificate") if tls_ca else None,
            cert_chain=_read(tls_cert, "client certificate") if tls_cert else None,
            private_key=_read(tls_key, "client key") if tls_key else None,
            server_name=tls_server_name,
        )

    @property
    def tls(self) -> bool:
        return self.root_ca is not None or self.cert_chain is not None

    def _tls_for(self, target: str) -> grpc.ChannelCredentials | None:
        if not self.tls or target.startswith("unix:"):
            return None
        return grpc.ssl_channel_credentials(self.root_ca, self.private_key, self.cert_chain)

    def _options(self, options) -> list:
        options = list(options)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return options

    def channel(self, target: str, options=()) -> grpc.Channel:
        creds = self._tls_for(target)
        opts = self._options(options)
        ch = grpc.secure_channel(target, creds, options=opts) if creds else grpc.insecure_channel(target, options=opts)
        return grpc.intercept_channel(ch, _Bearer(self.token)) if self.token else ch

    def aio_channel(self, target: str, options=()) -> grpc.aio.Channel:
        creds = self._tls_for(target)
        opts = self._options(options)
        interceptors = _aio_bearer(self.token) if self.token else None
        if creds:
            return grpc.aio.secure_channel(target, creds, options=opts, interceptors=interceptors)
        return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)


NONE = ChannelSecurity()


class _Details(
    collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._header = ("authorization", "Bearer " + token)

    def __repr__(self) -> str:
        return "_Bearer(...)"

    def _with_token(self, d):
        metadata = [*(d.metadata or ()), self._header]
        return _Details(d.method, d.timeout, metadata, d.credentials, getattr(d, "wait_for_ready", None),
                        getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)


def _aio_bearer(token: str) -> list:
    header = ("authorization", "Bearer " + token)

    def with_token(d):
        metadata = grpc.aio.Metadata(*(tuple(d.metadata) if d.metadata else ()), header)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):
            return await continuation(with_token(details), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):
            return await continuation(with_token(details), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, details, requests):
            return await continuation(with_token(details), requests)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, details, requests):
            return await continuation(with_token(details), requests)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]
