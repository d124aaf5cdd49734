"""HandoffParams: the transfer parameters a prefill daemon hands out and a decode daemon pulls by.

The boundary object between the two sides. It travels as a proto
(``strata.kv.v1.HandoffParams``) between clients and daemons, and as a
plain dict of JSON types (:meth:`to_dict`) through whatever sits between
the prefill and the decode engine: a router, vLLM's ``kv_transfer_params``.
Keys and checksums are hex strings there, so JSON carries them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.api.v1 import handoff_pb2 as hpb
from kvstore.api.v1 import kv_pb2 as pb
from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument

FORMAT = "strata.handoff.v1"  # the dict's "format": a later shape gets a new name


@dataclass(frozen=True, slots=True)
class HandoffBlock:
    key: bytes
    meta: BlockMeta


@dataclass(frozen=True, slots=True)
class HandoffParams:
    handoff_id: str
    namespace: str
    node_id: str
    epoch: int
    addresses: tuple[str, ...]  # data plane, preferred first (tcp://, grpc://)
    control_address: str  # the prefill daemon's gRPC host:port
    blocks: tuple[HandoffBlock, ...] = field(default_factory=tuple)
    lease_deadline_unix_ms: int = 0
    lease_ms: int = 0

    @property
    def keys(self) -> list[bytes]:
        return [b.key for b in self.blocks]

    @property
    def total_bytes(self) -> int:
        return sum(b.meta.size for b in self.blocks)

    # ---- proto --------------------------------------------------------------------

    def to_proto(self) -> hpb.HandoffParams:
        return hpb.HandoffParams(
            handoff_id=self.handoff_id, namespace=self.namespace, node_id=self.node_id, epoch=self.epoch,
            addresses=list(self.addresses), control_address=self.control_address,
            blocks=[
                pb.BlockHeader(key=b.key, size=b.meta.size, checksum=b.meta.checksum, parent_key=b.meta.parent or b"",
                               layout=b.meta.layout)
                for b in self.blocks
            ],
            lease_deadline_unix_ms=self.lease_deadline_unix_ms, lease_ms=self.lease_ms,
        )

    @classmethod
    def from_proto(cls, m: hpb.HandoffParams) -> HandoffParams:
        if not m.handoff_id or not m.namespace or not m.control_address:
            raise InvalidArgument(
                "handoff params need handoff_id, namespace and control_address: pass what OpenHandoff returned, unchanged"
            )
        return cls(
            m.handoff_id, m.namespace, m.node_id, m.epoch, tuple(m.addresses), m.control_address,
            tuple(HandoffBlock(b.key, BlockMeta(b.size, b.checksum, b.parent_key or None, b.layout)) for b in m.blocks),
            m.lease_deadline_unix_ms, m.lease_ms,
        )

    # ---- a dict of JSON types --------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "handoff_id": self.handoff_id, "namespace": self.namespace, "node_id": self.node_id,
            "epoch": self.epoch, "addresses": list(self.addresses), "control_address": self.control_address,
            "blocks": [
                {"key": b.key.hex(), "size": b.meta.size, "checksum": f"{b.meta.checksum:016x}",
                 "parent": (b.meta.parent or b"").hex(), "layout": b.meta.layout}
                for b in self.blocks
            ],
            "lease_deadline_unix_ms": self.lease_deadline_unix_ms, "lease_ms": self.lease_ms,
        }

    @classmethod
    def from_dict(cls, d: dict) -> HandoffParams:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise InvalidArgument(f"handoff params must be a dict with format {FORMAT!r}, as to_dict() wrote it")
        try:
            blocks = tuple(
                HandoffBlock(bytes.fromhex(b["key"]), BlockMeta(int(b["size"]), int(b["checksum"], 16),
                                                                bytes.fromhex(b["parent"]) or None, str(b["layout"])))
                for b in d["blocks"]
            )
            return cls(
                str(d["handoff_id"]), str(d["namespace"]), str(d["node_id"]), int(d["epoch"]),
                tuple(str(a) for a in d["addresses"]), str(d["control_address"]), blocks,
                int(d["lease_deadline_unix_ms"]), int(d["lease_ms"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise InvalidArgument(f"handoff params do not parse ({err!r}): pass what to_dict() wrote, unchanged") from None
