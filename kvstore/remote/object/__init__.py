"""The object tier: blocks in an S3-compatible bucket the fleet shares, one object per block.

The modules, one job each:

- :mod:`~kvstore.remote.object.layout` — object names: ``<prefix>/<namespace>/<key hex>``
  (namespace escaped to one segment, long keys by digest); parses names back for listings.
- :mod:`~kvstore.remote.object.format` — an object's bytes: a fixed 20-byte preamble (magic
  ``SKVB``, format version, flags, map length, the map's xxh3-64), a msgpack map (``ns``,
  ``key``, ``size``, ``xxh3``, ``parent``, ``layout``, ``at``: unix seconds written), then the
  block's payload. Unknown map fields are ignored; a newer version is a miss, never deleted.
- :mod:`~kvstore.remote.object.client` — :class:`S3Client` over obstore: deadline-bound
  retries, one slow-down gate per client, bounded requests, S3 error codes as metrics labels.
- :mod:`~kvstore.remote.object.credentials` — static keys and region from the AWS variables
  and files (else obstore's chain: IRSA, container, instance role); never logged.
- :mod:`~kvstore.remote.object.quota` — what a source may store, checked before upload
  (reserve / commit / release / forget; the contract's ``capacity_bytes``).
- :mod:`~kvstore.remote.object.source` — :class:`ObjectSource`, the remote-source contract
  (:mod:`kvstore.remote.base`): verified reads into the caller's buffers, conditional-create
  writes, corrupt objects deleted.
- :mod:`~kvstore.remote.object.writeback` — the bounded upload queue the object tier
  (:mod:`kvstore.tiers.object`) puts blocks into, so no put ever waits on S3.
- :mod:`~kvstore.remote.object.metrics` — ``strata_object_*``.
- :mod:`~kvstore.remote.object.uploads` — :class:`PendingUploads`: multipart uploads in progress,
  listed and the abandoned ones aborted by the sweep (botocore: obstore has no such request),
  honouring ``Retry-After``.
- :mod:`~kvstore.remote.object.holders` — :class:`ObjectHolders`: a block whose object went
  leaves the shared index for every node that held it as ``object``.

- :mod:`~kvstore.remote.object.lease` — :class:`SweepLease`: which daemon sweeps a namespace,
  a conditional-write lease object ``<prefix>/~lease/<namespace>`` that also carries its usage.
- :mod:`~kvstore.remote.object.lifecycle` — TTL from last write or read (read markers under
  ``<prefix>/~touch/``), the :class:`Sweeper` (expiry, stale markers, usage), and
  :class:`SharedQuota` (per-namespace bounds checked before a block is queued).

The index learns of object-tier copies from the store's events (tier ``OBJECT``), like any
tier; a sweep's deletes reach the store through ``ObjectTier.on_gone``, and every node's
``object`` entries through :class:`~kvstore.remote.object.holders.ObjectHolders`.
"""

from kvstore.remote.object.source import ObjectLimits, ObjectSource

__all__ = ["ObjectLimits", "ObjectSource"]
