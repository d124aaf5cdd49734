"""``WeightService`` over gRPC: a weight node's prefetch, status and peer chunk reads.

The servicer only translates proto ↔ :class:`~weightcache.prefetch.Prefetcher`
calls; Strata errors become statuses in one place (:mod:`kvstore.rpc.status`),
so an init container sees INVALID_ARGUMENT for a bad digest or location,
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
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc

from kvstore.errors import StrataError
from kvstore.rpc.status import to_status
from weightcache.api.v1 import weights_pb2 as pb
from weightcache.api.v1 import weights_pb2_grpc as pb_grpc
from weightcache.peers import CHANNEL_OPTIONS
from weightcache.prefetch import COMPLETE, FAILED, RUNNING, UNKNOWN, Prefetcher

log = logging.getLogger(__name__)

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
            data = self.prefetcher.read_chunk(request.digest, request.file, request.chunk, wait)
            return pb.ReadChunkResponse(found=False) if data is None else pb.ReadChunkResponse(found=True, data=data)


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


def serve(prefetcher: Prefetcher, address: str, *, max_workers: int = 64, authority=None,
          credentials: grpc.ServerCredentials | None = None, insecure: bool = False) -> tuple[grpc.Server, int]:
    """A started server for the prefetcher on ``address`` (host:port; port 0 picks one); (server, port).
    ``authority`` (a :class:`kvstore.auth.Authority` that requires credentials) checks every call
    (:mod:`weightcache.access`); ``credentials`` serve TLS. Beyond loopback, no authority is refused
    unless ``insecure`` (protected mode, as the daemon's)."""
    from weightcache.access import WeightsAuthInterceptor, check_exposure

    check_exposure(address, authority, insecure)
    interceptors = [WeightsAuthInterceptor(authority)] if authority is not None and authority.required else []
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
