"""HandoffService: translates the handoff RPCs to the prefill side's table and the decode side's puller."""

from __future__ import annotations

from kvstore.api.v1 import handoff_pb2 as hpb
from kvstore.api.v1 import handoff_pb2_grpc
from kvstore.auth import owner_of
from kvstore.block import validate_namespace
from kvstore.errors import InvalidArgument
from kvstore.handoff.params import HandoffParams
from kvstore.handoff.pull import HandoffPuller
from kvstore.handoff.table import HandoffTable


class HandoffServicer(handoff_pb2_grpc.HandoffServiceServicer):
    def __init__(self, table: HandoffTable, puller: HandoffPuller) -> None:
        self._table = table
        self._puller = puller

    def OpenHandoff(self, request: hpb.OpenHandoffRequest, context) -> hpb.OpenHandoffResponse:
        params, missing = self._table.open(
            validate_namespace(request.namespace), list(request.keys),
            request.lease_ms / 1000 if request.lease_ms else None, request.keep_as_cache, owner_of(context),
        )
        return hpb.OpenHandoffResponse(params=params.to_proto(), missing=missing)

    def HeartbeatHandoff(self, request: hpb.HeartbeatHandoffRequest, context) -> hpb.HeartbeatHandoffResponse:
        return hpb.HeartbeatHandoffResponse(lease_deadline_unix_ms=self._table.heartbeat(request.namespace, request.handoff_id))

    def CompleteHandoff(self, request: hpb.CompleteHandoffRequest, context) -> hpb.CompleteHandoffResponse:
        deleted, kept = self._table.complete(request.namespace, request.handoff_id)
        return hpb.CompleteHandoffResponse(deleted=deleted, kept=kept)

    def PullHandoff(self, request: hpb.PullHandoffRequest, context) -> hpb.PullHandoffResponse:
        params = HandoffParams.from_proto(request.params)
        if params.namespace != request.namespace:
            raise InvalidArgument(
                f"PullHandoff names namespace {request.namespace!r} but its params are of {params.namespace!r}: "
                "pass the params' namespace"
            )
        timeout = request.timeout_ms / 1000 if request.timeout_ms else None
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout or remaining, remaining)
        # A cancelled PullHandoff (the caller went away) ends its pull and gives its slot back.
        r = self._puller.pull(params, timeout, on_cancel=context.add_callback, owner=owner_of(context))
        return hpb.PullHandoffResponse(
            stored=r.stored, present=r.present, pulled_bytes=r.pulled_bytes, completed=r.completed,
            complete_error=r.complete_error, published=r.published,
        )
