"""Settings of the peer data plane: ``[peers]``, the TCP and UCX listeners (and UCX shared memory) other daemons read blocks from."""

from __future__ import annotations

from pydantic import ByteSize, field_validator

from kvstore.config.section import Section, setting


class PeerSettings(Section):
    flag_prefix = "peer_"
    title = "the peer data plane: the TCP (and UCX) listeners other daemons read blocks from and write blocks to"

    listen: str = setting(
        "", "peer data-plane address, host:port (e.g. 0.0.0.0:50061); beyond loopback it needs authentication "
        "or --insecure, as --listen does (protected mode); empty: off"
    )
    advertise: str = setting(
        "", "the address other daemons reach the peer listener at, host:port (default: the listen address, "
        "with this node's hostname in place of a wildcard host)"
    )
    ucx_listen: str = setting(
        "", "UCX peer data-plane address, host:port (e.g. 0.0.0.0:50062), served through ucxx (install the "
        "ucx extra); ucxx binds the port on every interface, so it needs authentication or --insecure "
        "whatever the host; empty: off"
    )
    ucx_advertise: str = setting(
        "", "the address other daemons reach the UCX listener at, host:port (default: the UCX listen address, "
        "with this node's hostname in place of a wildcard host)"
    )
    ucx_shm: bool = setting(
        False, "also serve the peer data plane over UCX shared memory to daemons on this host (ucxx, the ucx "
        "extra; advertised as ucx-shm://<host id>:<port>, tried first by a reader on this host that lists "
        "ucx-shm in its peer transports); reachable by this user's processes on this host only",
    )
    ucx_over_tcp: bool = setting(
        False, "read from and pull from peers over UCX (ucx in --peer-transports or --handoff-transports) even "
        "where UCX's only transport to other hosts is its own tcp one (no RDMA): slower than the tcp scheme in "
        "every case measured, so by default such a daemon takes tcp first for a peer that advertises both",
    )
    max_connections: int = setting(
        64, "peer connections at once; one more is refused with a retry delay. At most half of them may be "
        "waiting for their Hello (a quarter from one address): one more closes the oldest waiting", ge=1, le=4096,
    )
    max_connections_per_node: int = setting(
        0, "peer connections one node (a peer token from one address) may hold once its Hello is taken, so no "
        "node's pool takes the listener from the others; 0: half of --peer-max-connections", ge=0, le=4096,
    )
    idle_seconds: float = setting(
        120.0, "close a peer connection that sends nothing, or stops reading its reply, for this long, or that "
        "takes longer than this to send one frame once it began", gt=0, le=86400,
    )
    hello_seconds: float = setting(
        5.0, "close a peer connection that has not finished its Hello (the first frame, with its token) this long "
        "after it was accepted, however its bytes trickle in", gt=0, le=600,
    )
    in_flight_bytes: ByteSize = setting(
        ByteSize(1 << 30), "block bytes every peer connection together may have in flight (being sent or received) "
        "at once; beyond it the request is refused with RESOURCE_EXHAUSTED and a retry delay",
    )
    in_flight_bytes_per_node: ByteSize = setting(
        ByteSize(0), "block bytes one peer node (a peer token from one address) may have in flight at once, so no "
        "node's transfers take the whole budget; 0: half of --peer-in-flight-bytes, or one request's limit "
        "(--peer-connection-in-flight-bytes) when that is more",
    )
    connection_in_flight_bytes: ByteSize = setting(
        ByteSize(512 << 20), "block bytes one peer request may carry (a read's blocks, a write's); a larger "
        "request is refused: split the batch",
    )

    @field_validator("listen", "advertise", "ucx_listen", "ucx_advertise")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value and (":" not in value or not value.rpartition(":")[2].isdigit()):
            raise ValueError(f"{value!r} is not host:port (e.g. 0.0.0.0:50061)")
        return value
