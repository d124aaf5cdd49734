from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_PEER: _ClassVar[Tier]
    TIER_OBJECT: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_GPU: Tier
TIER_HOST: Tier
TIER_DISK: Tier
TIER_PEER: Tier
TIER_OBJECT: Tier

class BlockHeader(_message.Message):
    __slots__ = ("key", "size", "checksum", "parent_key", "layout")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    size: int
    checksum: int
    parent_key: bytes
    layout: str
    def __init__(self, key: _Optional[bytes] = ..., size: _Optional[int] = ..., checksum: _Optional[int] = ..., parent_key: _Optional[bytes] = ..., layout: _Optional[str] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("namespace", "header", "chunk")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    header: BlockHeader
    chunk: bytes
    def __init__(self, namespace: _Optional[str] = ..., header: _Optional[_Union[BlockHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class PutResult(_message.Message):
    __slots__ = ("key", "stored", "tier")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    stored: bool
    tier: Tier
    def __init__(self, key: _Optional[bytes] = ..., stored: bool = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PutResult, _Mapping]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "keys", "local_only")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    local_only: bool
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., local_only: bool = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: GetHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[GetHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class GetHeader(_message.Message):
    __slots__ = ("found", "block", "tier")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    found: bool
    block: BlockHeader
    tier: Tier
    def __init__(self, found: bool = ..., block: _Optional[_Union[BlockHeader, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("arena_path", "arena_token", "arena_bytes", "max_block_bytes", "lease_ms", "control_socket", "arena_name", "namespaces")
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    ARENA_NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    arena_path: str
    arena_token: bytes
    arena_bytes: int
    max_block_bytes: int
    lease_ms: int
    control_socket: str
    arena_name: str
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, arena_path: _Optional[str] = ..., arena_token: _Optional[bytes] = ..., arena_bytes: _Optional[int] = ..., max_block_bytes: _Optional[int] = ..., lease_ms: _Optional[int] = ..., control_socket: _Optional[str] = ..., arena_name: _Optional[str] = ..., namespaces: _Optional[_Iterable[str]] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("namespace", "blocks", "lease_ms", "arena", "arena_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    ARENA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockHeader]
    lease_ms: int
    arena: str
    arena_token: bytes
    def __init__(self, namespace: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockHeader, _Mapping]]] = ..., lease_ms: _Optional[int] = ..., arena: _Optional[str] = ..., arena_token: _Optional[bytes] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("key", "present", "slot_id", "offset", "size")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    present: bool
    slot_id: int
    offset: int
    size: int
    def __init__(self, key: _Optional[bytes] = ..., present: bool = ..., slot_id: _Optional[int] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("slots", "lease_deadline_unix_ms")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    lease_deadline_unix_ms: int
    def __init__(self, slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., lease_deadline_unix_ms: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("items",)
    class Item(_message.Message):
        __slots__ = ("slot_id", "checksum")
        SLOT_ID_FIELD_NUMBER: _ClassVar[int]
        CHECKSUM_FIELD_NUMBER: _ClassVar[int]
        slot_id: int
        checksum: int
        def __init__(self, slot_id: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[CommitRequest.Item]
    def __init__(self, items: _Optional[_Iterable[_Union[CommitRequest.Item, _Mapping]]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PutResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PutResult, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("slot_ids",)
    SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    slot_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slot_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "keys", "lease_ms", "arena", "arena_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    ARENA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ms: int
    arena: str
    arena_token: bytes
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., lease_ms: _Optional[int] = ..., arena: _Optional[str] = ..., arena_token: _Optional[bytes] = ...) -> None: ...

class Located(_message.Message):
    __slots__ = ("found", "block", "offset", "lease_id", "tier")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    found: bool
    block: BlockHeader
    offset: int
    lease_id: int
    tier: Tier
    def __init__(self, found: bool = ..., block: _Optional[_Union[BlockHeader, _Mapping]] = ..., offset: _Optional[int] = ..., lease_id: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("blocks", "lease_deadline_unix_ms")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[Located]
    lease_deadline_unix_ms: int
    def __init__(self, blocks: _Optional[_Iterable[_Union[Located, _Mapping]]] = ..., lease_deadline_unix_ms: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("valid",)
    VALID_FIELD_NUMBER: _ClassVar[int]
    valid: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, valid: _Optional[_Iterable[bool]] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("prefix_blocks", "tiers")
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    prefix_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, prefix_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace", "keys", "lease_ms", "replicas")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ms: int
    replicas: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., lease_ms: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("lease_id", "pinned", "missing", "lease_deadline_unix_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    pinned: int
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    lease_deadline_unix_ms: int
    def __init__(self, lease_id: _Optional[int] = ..., pinned: _Optional[int] = ..., missing: _Optional[_Iterable[bytes]] = ..., lease_deadline_unix_ms: _Optional[int] = ...) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("namespace", "keys", "where")
    class Where(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        WHERE_UNSPECIFIED: _ClassVar[PlaceRequest.Where]
        WARM: _ClassVar[PlaceRequest.Where]
        DEMOTE: _ClassVar[PlaceRequest.Where]
    WHERE_UNSPECIFIED: PlaceRequest.Where
    WARM: PlaceRequest.Where
    DEMOTE: PlaceRequest.Where
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    where: PlaceRequest.Where
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., where: _Optional[_Union[PlaceRequest.Where, str]] = ...) -> None: ...

class PlaceResponse(_message.Message):
    __slots__ = ("placed", "missing", "pinned")
    PLACED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    placed: int
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    pinned: int
    def __init__(self, placed: _Optional[int] = ..., missing: _Optional[_Iterable[bytes]] = ..., pinned: _Optional[int] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("namespace", "prefix", "page_size", "page_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    prefix: bytes
    page_size: int
    page_token: bytes
    def __init__(self, namespace: _Optional[str] = ..., prefix: _Optional[bytes] = ..., page_size: _Optional[int] = ..., page_token: _Optional[bytes] = ...) -> None: ...

class Listed(_message.Message):
    __slots__ = ("block", "tier")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block: BlockHeader
    tier: Tier
    def __init__(self, block: _Optional[_Union[BlockHeader, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("blocks", "next_page_token")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[Listed]
    next_page_token: bytes
    def __init__(self, blocks: _Optional[_Iterable[_Union[Listed, _Mapping]]] = ..., next_page_token: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "used_bytes", "capacity_bytes", "blocks", "degraded")
    TIER_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    used_bytes: int
    capacity_bytes: int
    blocks: int
    degraded: str
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., degraded: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "blocks", "pinned_blocks", "active_leases", "open_slots", "demotion_queue_depth", "namespaces", "node_id", "epoch", "open_handoffs", "handoffs", "replication")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    OPEN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEMOTION_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OPEN_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    blocks: int
    pinned_blocks: int
    active_leases: int
    open_slots: int
    demotion_queue_depth: int
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    node_id: str
    epoch: int
    open_handoffs: int
    handoffs: HandoffStats
    replication: ReplicationStats
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., active_leases: _Optional[int] = ..., open_slots: _Optional[int] = ..., demotion_queue_depth: _Optional[int] = ..., namespaces: _Optional[_Iterable[str]] = ..., node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., open_handoffs: _Optional[int] = ..., handoffs: _Optional[_Union[HandoffStats, _Mapping]] = ..., replication: _Optional[_Union[ReplicationStats, _Mapping]] = ...) -> None: ...

class HandoffStats(_message.Message):
    __slots__ = ("open", "opened", "completed", "expired", "pulls_ok", "pulls_failed", "pulled_bytes", "pull_fallbacks")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PULLS_OK_FIELD_NUMBER: _ClassVar[int]
    PULLS_FAILED_FIELD_NUMBER: _ClassVar[int]
    PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULL_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    open: int
    opened: int
    completed: int
    expired: int
    pulls_ok: int
    pulls_failed: int
    pulled_bytes: int
    pull_fallbacks: int
    def __init__(self, open: _Optional[int] = ..., opened: _Optional[int] = ..., completed: _Optional[int] = ..., expired: _Optional[int] = ..., pulls_ok: _Optional[int] = ..., pulls_failed: _Optional[int] = ..., pulled_bytes: _Optional[int] = ..., pull_fallbacks: _Optional[int] = ...) -> None: ...

class ReplicationStats(_message.Message):
    __slots__ = ("enabled", "under_replicated", "copies_made", "copies_failed", "rounds", "last_round_unix_seconds", "last_error")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    UNDER_REPLICATED_FIELD_NUMBER: _ClassVar[int]
    COPIES_MADE_FIELD_NUMBER: _ClassVar[int]
    COPIES_FAILED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    under_replicated: int
    copies_made: int
    copies_failed: int
    rounds: int
    last_round_unix_seconds: float
    last_error: str
    def __init__(self, enabled: bool = ..., under_replicated: _Optional[int] = ..., copies_made: _Optional[int] = ..., copies_failed: _Optional[int] = ..., rounds: _Optional[int] = ..., last_round_unix_seconds: _Optional[float] = ..., last_error: _Optional[str] = ...) -> None: ...
