"""The fleet as one pool: what a daemon does with its peers beyond reading from them.

- :mod:`kvstore.cluster.policy`: which namespaces ask for how many copies;
- :mod:`kvstore.cluster.replicator`: keeps those copies on distinct live nodes;
- :mod:`kvstore.cluster.pin_copies`: keeps the copies a pin asks for, held for its lease;
- :mod:`kvstore.cluster.pusher`: how both reach other nodes' stores (copies, holds, releases).
"""
