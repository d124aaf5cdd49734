"""Settings of the node and its listeners: ``[node]`` and ``[server]``."""

from __future__ import annotations

import socket

from pydantic import ByteSize, field_validator

from kvstore.config.section import Section, setting

# A streamed message carries one chunk plus its header fields.
MESSAGE_HEADROOM_BYTES = 64 << 10
HEALTH_WORKERS = 2  # gRPC worker threads no admitted RPC may take: health and reflection answer on them


def _host_of(address: str) -> str:
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class NodeSettings(Section):
    flag_prefix = "node_"
    title = "this node's identity in the fleet"

    id: str = setting(default_factory=socket.gethostname, description="this node's name in the fleet (default: hostname)")


class ServerSettings(Section):
    title = "listeners, worker threads and per-request limits of the gRPC server"

    listen: str = setting("127.0.0.1:50051", "gRPC address, host:port ('0.0.0.0:50051' for all interfaces)")
    advertise_address: str = setting(
        "", "host:port at which other nodes reach this daemon's gRPC service, published in its node record "
        "(peers fetch blocks there); empty: the --listen address, or this host's name with the --listen port "
        "when listening on every interface (0.0.0.0, [::])",
    )
    unix_socket: str = setting(
        "", "also serve gRPC on this Unix socket path (lower latency for same-host clients); empty: off"
    )
    same_host_socket: str = setting(
        "auto",
        "Unix socket of the same-host block path (control of clients that map the arena, without gRPC): "
        "'auto' next to the arena file, 'off' to disable, or a path",
    )
    same_host_max_connections: int = setting(64, "same-host socket connections at once", ge=1, le=4096)
    same_host_max_connections_per_uid: int = setting(
        0, "same-host connections the processes of one uid may hold at once, so no user's engines take the "
        "socket from the others; 0: half of --same-host-max-connections", ge=0, le=4096,
    )
    same_host_idle_seconds: float = setting(300.0, "close a same-host connection idle this long", gt=0, le=86400)
    metrics_listen: str = setting(
        "127.0.0.1:9464", "Prometheus /metrics address, host:port (':PORT' binds loopback; give 0.0.0.0:PORT "
        "for every interface); empty: off"
    )
    workers: int = setting(16, "gRPC worker threads; health checks always keep two of them", ge=3, le=1024)
    max_in_flight: int = setting(
        64, "RPCs served at once, at most workers - 2 (the two left answer health checks); more get "
        "RESOURCE_EXHAUSTED with a retry delay, never a queue", ge=1, le=1 << 16
    )
    max_in_flight_per_identity: int = setting(
        0, "RPCs one authenticated identity (a token, a certificate) may have in flight at once, so that no "
        "tenant takes every admitted RPC; 0: half of them (a daemon without authentication: the limit alone)",
        ge=0, le=1 << 16,
    )
    max_streams: int = setting(
        0, "streamed RPCs (Put, Get) served at once, each holding a worker while its client sends or reads; "
        "more get RESOURCE_EXHAUSTED with a retry delay. 0: half of the admitted RPCs, so that idle streams "
        "never leave unary calls without a worker", ge=0, le=1 << 16,
    )
    max_streams_per_identity: int = setting(
        0, "streams one identity (a token, a certificate, an unauthenticated connection) may hold open at "
        "once, so that no caller takes every stream; 0: half of --max-streams", ge=0, le=1 << 16,
    )
    chunk_bytes: ByteSize = setting(ByteSize(1 << 20), "chunk size of streamed values")
    put_budget_bytes: ByteSize = setting(
        ByteSize(1 << 30),
        "memory streamed puts in flight may hold at once (each holds its block's declared size from its "
        "header on); beyond it RESOURCE_EXHAUSTED with a retry delay. At least max_block_bytes",
    )
    put_budget_bytes_per_identity: ByteSize = setting(
        ByteSize(0), "of --put-budget-bytes, what one authenticated identity's streamed puts may hold at once, so "
        "no tenant takes the whole budget; 0: half of it, or one block (--max-block-bytes) when that is more (a "
        "daemon without authentication: the budget alone)",
    )
    stream_idle_seconds: float = setting(
        30.0, "end a streamed Put whose client sends nothing, or a Get whose client reads nothing, for this "
        "long (DEADLINE_EXCEEDED); what the stream held is given back and nothing partial is stored", gt=0, le=3600
    )
    grace_seconds: float = setting(10.0, "on SIGTERM, time given to in-flight RPCs", ge=0, le=3600)

    @field_validator("chunk_bytes")
    @classmethod
    def _chunk_in_range(cls, value: ByteSize) -> ByteSize:
        if not 4 << 10 <= value <= 4 << 20:
            raise ValueError(f"chunk_bytes is {value.human_readable()}; it must be between 4KiB and 4MiB")
        return value

    @field_validator("advertise_address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if value and (not sep or not host or not port.isdigit() or not 0 < int(port) < 65536):
            raise ValueError(f"advertise_address {value!r} must be host:port, e.g. 10.0.0.2:50051")
        return value

    def advertised_host(self) -> str:
        """The host part of what this node advertises (known before the port is bound)."""
        if self.advertise_address:
            return _host_of(self.advertise_address)
        host = _host_of(self.listen)
        return socket.gethostname() if host in ("", "0.0.0.0", "::") else host

    def advertised(self, port: int) -> str:
        """host:port peers reach this daemon at, ``port`` being the one --listen bound."""
        if self.advertise_address:
            return self.advertise_address
        host = self.advertised_host()
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def admitted_rpcs(self) -> int:
        """RPCs admitted at once: never more than the workers that can run them, less the
        two kept for health checks, so work beyond capacity is refused instead of queued."""
        return min(self.max_in_flight, self.workers - HEALTH_WORKERS)

    @property
    def admitted_streams(self) -> int:
        """Streams served at once: --max-streams, by default half the admitted RPCs (at least one),
        never more than those."""
        return max(1, min(self.max_streams or self.admitted_rpcs // 2, self.admitted_rpcs))

    @property
    def calls_per_identity(self) -> int:
        """RPCs in flight one authenticated identity may hold: --max-in-flight-per-identity, by default
        half the admitted RPCs (at least one), never more than those."""
        return max(1, min(self.max_in_flight_per_identity or self.admitted_rpcs // 2, self.admitted_rpcs))

    @property
    def streams_per_identity(self) -> int:
        return max(1, min(self.max_streams_per_identity or self.admitted_streams // 2, self.admitted_streams))

    @property
    def max_message_bytes(self) -> int:
        return int(self.chunk_bytes) + MESSAGE_HEADROOM_BYTES
