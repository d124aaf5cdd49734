"""The gRPC client paths: blocks as Put/Get streams (any host), or through the arena with gRPC control.

- :mod:`~kvstore.transport.grpc.blocks`: what both share: request building, the Get stream's
  assembler, the arena's slots and leases as gRPC messages;
- :mod:`~kvstore.transport.grpc.stream`: the ``grpc`` transport (Put/Get streams);
- :mod:`~kvstore.transport.grpc.arena`: the ``grpc-arena`` transport (the daemon's arena,
  control as gRPC calls);
- :mod:`~kvstore.transport.grpc.stream_aio`, :mod:`~kvstore.transport.grpc.arena_aio`: their
  asyncio twins (:class:`~kvstore.transport.base.AsyncTransport`).
"""
