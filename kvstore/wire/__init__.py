"""What every framed socket server of the daemon shares: taking and counting connections, byte budgets.

The same-host socket (:mod:`kvstore.transport.samehost.server`), the TCP peer data
plane and both UCX peer listeners (:mod:`kvstore.peer`) serve each
connection on a thread of its own and refuse work beyond their limits the
same way; the bookkeeping they share lives here, below both, so neither
imports the other's package: :mod:`~kvstore.wire.listeners` (the connection
table, the accept loop, stopping) and :mod:`~kvstore.wire.budget` (bytes in
flight, refused beyond the budget with a retry delay).
"""
