"""The same-host protocol, both ends: block bytes through the daemon's arena, control over its Unix socket.

- :mod:`~kvstore.transport.samehost.frames`: the protocol's version and operations, on the
  daemon's frames (:mod:`kvstore.wire.frames`);
- :mod:`~kvstore.transport.samehost.protocol`: the client's half of the protocol without I/O (what
  each request says, what its answer means), driven by both client transports;
- :mod:`~kvstore.transport.samehost.conn`: one client connection (Hello, calls, replies);
- :mod:`~kvstore.transport.samehost.client`: the blocking client transport
  (:class:`~kvstore.transport.samehost.client.SameHostTransport`);
- :mod:`~kvstore.transport.samehost.client_aio`: its asyncio twin
  (:class:`~kvstore.transport.samehost.client_aio.AsyncSameHostTransport`);
- :mod:`~kvstore.transport.samehost.locations`: where a client saw blocks, and the removal page
  that tells it to forget;
- :mod:`~kvstore.transport.samehost.regions`: device-memory regions handed to a client that
  declares the ``gpu`` capability;
- :mod:`~kvstore.transport.samehost.server`: the daemon's end (``SameHostServer``).
"""
