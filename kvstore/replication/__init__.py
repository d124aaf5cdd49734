"""Replication: copies of a namespace's blocks, and of pinned blocks, kept on other live nodes.

- :mod:`kvstore.replication.policy`: which namespaces ask for how many copies;
- :mod:`kvstore.replication.replicator`: keeps those copies on distinct live nodes;
- :mod:`kvstore.replication.pin_copies`: keeps the copies a pin asks for, held for its lease;
- :mod:`kvstore.replication.pusher`: how both reach other nodes' stores (copies, holds, releases).
"""
