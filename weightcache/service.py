"""``WeightService`` over gRPC: a weight node's prefetch, status and peer chunk reads.

The servicer only translates proto ↔ :class:`~weightcache.prefetch.Prefetcher`
calls; Strata errors become statuses in one place (:mod:`kvstore.rpc.status`),
so an init container sees INVALID_ARGUMENT for a bad digest or location
(and for bytes that are not the method's message: :mod:`kvstore.rpc.decoding`),
UNAVAILABLE for an origin it cannot reach, RESOURCE_EXHAUSTED (with a delay)
for a node at its bounds.

Why a process of its own (``strata weights serve``) and not a service inside
the KV daemon: ``kvstore`` never imports ``weightcache``, and a plug-in
point would still tie the weight node's lifetime, thread pool and failure to
the KV daemon's; this way a model fetch that fills a disk or wedges on an
origin cannot take the KV cache down with it, each is restarted alone, and
the weight node is the one process that both fills the node cache and
serves its chunks to peers. It runs beside the daemon (a second container
of the same pod, the same image).

Every call holds one of the server's worker threads until it is answered,
and a ``ReadChunk`` may wait (for a chunk the node is still fetching). So
the pool is sized from the prefetcher's bounds: its most waiting reads
(``max_waiting``), its most uploads, and :data:`SPARE_WORKERS` that no
ReadChunk can take; a read past those bounds is refused at once
(RESOURCE_EXHAUSTED with a retry delay), and Status and Prefetch always
find a worker. A wait that ends while the chunk may still come is answered
``found=false`` with the trailing metadata ``strata-chunk-pending: 1``
(:data:`weightcache.peers.PENDING_KEY`); the caller says how long it has
waited already in ``strata-waited-ms`` (:data:`weightcache.peers.WAITED_KEY`).
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc

from kvstore.errors import StrataError
from kvstore.rpc.decoding import DecodingInterceptor
from kvstore.rpc.status import to_status
from weightcache.api.v1 import weights_pb2 as pb
from weightcache.api.v1 import weights_pb2_grpc as pb_grpc
from weightcache.peers import CHANNEL_OPTIONS, PENDING_KEY, WAITED_KEY
from weightcache.prefetch import COMPLETE, FAILED, MAX_WAIT_S, RUNNING, UNKNOWN, Prefetcher

log = logging.getLogger(__name__)

SPARE_WORKERS = 16  # worker threads no waiting or uploading ReadChunk can hold: Status, Prefetch, quick reads

STATES = {
    UNKNOWN: pb.PREFETCH_STATE_UNKNOWN, RUNNING: pb.PREFETCH_STATE_RUNNING,
    COMPLETE: pb.PREFETCH_STATE_COMPLETE, FAILED: pb.PREFETCH_STATE_FAILED,
}


class WeightServicer(pb_grpc.WeightServiceServicer):
    def __init__(self, prefetcher: Prefetcher) -> None:
        self.prefetcher = prefetcher

    def Prefetch(self, request: pb.PrefetchRequest, context) -> pb.PrefetchResponse:
        with _mapped(context):
            digest, started = self.prefetcher.prefetch(request.location, request.digest, request.revision)
            return pb.PrefetchResponse(digest=digest, started=started)

    def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        with _mapped(context):
            p = self.prefetcher.status(request.digest)
            return pb.StatusResponse(
                state=STATES[p.state], model=p.model, total_bytes=p.total_bytes, verified_bytes=p.verified_bytes,
                total_chunks=p.total_chunks, verified_chunks=p.verified_chunks, error=p.error,
                bytes_by_source=p.bytes_by_source, ram_bytes=p.ram_bytes,
            )

    def ReadChunk(self, request: pb.ReadChunkRequest, context) -> pb.ReadChunkResponse:
        with _mapped(context):
            wait = request.wait_ms / 1000
            remaining = context.time_remaining()
            if remaining is not None:
                wait = min(wait, max(0.0, remaining - 1.0))  # answer a miss before the caller gives up
            answer = self.prefetcher.read_chunk(request.digest, request.file, request.chunk, wait,
                                                waited_s=_waited_s(context.invocation_metadata()))
            if answer.data is not None:
                return pb.ReadChunkResponse(found=True, data=answer.data)
            if answer.pending:
                context.set_trailing_metadata(((PENDING_KEY, "1"),))
            return pb.ReadChunkResponse(found=False)


def _waited_s(metadata) -> float:
    """How long the caller says it has waited on this chunk already (0 when it does not say)."""
    for key, value in metadata or ():
        if key == WAITED_KEY:
            try:
                return min(max(int(value), 0), int(MAX_WAIT_S * 1000)) / 1000
            except ValueError:
                return 0.0
    return 0.0


class _mapped:
    """Strata errors → their gRPC status; anything else is a bug and stays INTERNAL (logged by gRPC)."""

    def __init__(self, context) -> None:
        self.context = context

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if isinstance(err, StrataError):
            self.context.abort_with_status(to_status(err))
        return False


def serve(prefetcher: Prefetcher, address: str, *, max_workers: int | None = None, authority=None,
          credentials: grpc.ServerCredentials | None = None, insecure: bool = False) -> tuple[grpc.Server, int]:
    """A started server for the prefetcher on ``address`` (host:port; port 0 picks one); (server, port).
    ``max_workers`` (default: the prefetcher's waiting, upload and resolving bounds, plus :data:`SPARE_WORKERS`)
    must leave at least :data:`SPARE_WORKERS` beyond those bounds.
    ``authority`` (a :class:`kvstore.auth.Authority` that requires credentials) checks every call
    (:mod:`weightcache.access`); ``credentials`` serve TLS. Beyond loopback, no authority is refused
    unless ``insecure`` (protected mode, as the daemon's)."""
    from weightcache.access import WeightsAuthInterceptor, check_exposure

    held = prefetcher.max_waiting + prefetcher.max_uploads + prefetcher.max_resolving
    if max_workers is None:
        max_workers = max(64, held + SPARE_WORKERS)
    if max_workers < held + SPARE_WORKERS:
        raise ValueError(
            f"max_workers {max_workers} leaves fewer than {SPARE_WORKERS} workers beyond the {held} that waiting "
            "and uploading chunk reads and manifest resolutions may hold: give more workers, or lower max_waiting, "
            "max_uploads or max_resolving"
        )
    check_exposure(address, authority, insecure)
    interceptors: list[grpc.ServerInterceptor] = []
    if authority is not None and authority.required:
        interceptors.append(WeightsAuthInterceptor(authority))
    # Last, so innermost: a caller's credentials are checked before its request's bytes are judged.
    interceptors.append(DecodingInterceptor())
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="weights-rpc"),
        options=CHANNEL_OPTIONS, maximum_concurrent_rpcs=max_workers * 4, interceptors=interceptors,
    )
    pb_grpc.add_WeightServiceServicer_to_server(WeightServicer(prefetcher), server)
    if credentials is not None:
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}: the address is in use or not this host's")
    server.start()
    return server, port
