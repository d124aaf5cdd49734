from kvstore.api.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenChain(_message.Message):
    __slots__ = ("token_ids", "block_size", "hash_seed", "lora_name", "cache_salt")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    hash_seed: str
    lora_name: str
    cache_salt: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., hash_seed: _Optional[str] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class KeyChain(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TierWeight(_message.Message):
    __slots__ = ("tier", "weight")
    TIER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    tier: _kv_pb2.Tier
    weight: float
    def __init__(self, tier: _Optional[_Union[_kv_pb2.Tier, str]] = ..., weight: _Optional[float] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "keys", "candidates", "tier_weights")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    TIER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    tokens: TokenChain
    keys: KeyChain
    candidates: _containers.RepeatedScalarFieldContainer[str]
    tier_weights: _containers.RepeatedCompositeFieldContainer[TierWeight]
    def __init__(self, namespace: _Optional[str] = ..., tokens: _Optional[_Union[TokenChain, _Mapping]] = ..., keys: _Optional[_Union[KeyChain, _Mapping]] = ..., candidates: _Optional[_Iterable[str]] = ..., tier_weights: _Optional[_Iterable[_Union[TierWeight, _Mapping]]] = ...) -> None: ...

class EndpointScore(_message.Message):
    __slots__ = ("node_id", "blocks", "tier", "score")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    blocks: int
    tier: _kv_pb2.Tier
    score: float
    def __init__(self, node_id: _Optional[str] = ..., blocks: _Optional[int] = ..., tier: _Optional[_Union[_kv_pb2.Tier, str]] = ..., score: _Optional[float] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("endpoints", "chain_blocks")
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[EndpointScore]
    chain_blocks: int
    def __init__(self, endpoints: _Optional[_Iterable[_Union[EndpointScore, _Mapping]]] = ..., chain_blocks: _Optional[int] = ...) -> None: ...

class HoldersRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    tokens: TokenChain
    keys: KeyChain
    def __init__(self, namespace: _Optional[str] = ..., tokens: _Optional[_Union[TokenChain, _Mapping]] = ..., keys: _Optional[_Union[KeyChain, _Mapping]] = ...) -> None: ...

class Holder(_message.Message):
    __slots__ = ("node_id", "tier", "epoch")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    tier: _kv_pb2.Tier
    epoch: int
    def __init__(self, node_id: _Optional[str] = ..., tier: _Optional[_Union[_kv_pb2.Tier, str]] = ..., epoch: _Optional[int] = ...) -> None: ...

class BlockHolders(_message.Message):
    __slots__ = ("key", "holders")
    KEY_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    def __init__(self, key: _Optional[bytes] = ..., holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ...) -> None: ...

class HoldersResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockHolders]
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockHolders, _Mapping]]] = ...) -> None: ...

class NodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Node(_message.Message):
    __slots__ = ("node_id", "epoch", "alive", "address", "transports", "served_bytes")
    class ServedBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    SERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    alive: bool
    address: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    served_bytes: _containers.ScalarMap[str, int]
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., alive: bool = ..., address: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., served_bytes: _Optional[_Mapping[str, int]] = ...) -> None: ...

class NodesResponse(_message.Message):
    __slots__ = ("nodes", "node_id")
    NODES_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    node_id: str
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., node_id: _Optional[str] = ...) -> None: ...

class ReplicationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceReplication(_message.Message):
    __slots__ = ("namespace", "rule", "replicas", "blocks", "under_replicated", "copies_made", "copies_failed")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNDER_REPLICATED_FIELD_NUMBER: _ClassVar[int]
    COPIES_MADE_FIELD_NUMBER: _ClassVar[int]
    COPIES_FAILED_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    rule: str
    replicas: int
    blocks: int
    under_replicated: int
    copies_made: int
    copies_failed: int
    def __init__(self, namespace: _Optional[str] = ..., rule: _Optional[str] = ..., replicas: _Optional[int] = ..., blocks: _Optional[int] = ..., under_replicated: _Optional[int] = ..., copies_made: _Optional[int] = ..., copies_failed: _Optional[int] = ...) -> None: ...

class PinReplication(_message.Message):
    __slots__ = ("namespace", "pins", "replicas", "blocks", "under_replicated", "copies_held", "copies_made", "copies_failed")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNDER_REPLICATED_FIELD_NUMBER: _ClassVar[int]
    COPIES_HELD_FIELD_NUMBER: _ClassVar[int]
    COPIES_MADE_FIELD_NUMBER: _ClassVar[int]
    COPIES_FAILED_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    pins: int
    replicas: int
    blocks: int
    under_replicated: int
    copies_held: int
    copies_made: int
    copies_failed: int
    def __init__(self, namespace: _Optional[str] = ..., pins: _Optional[int] = ..., replicas: _Optional[int] = ..., blocks: _Optional[int] = ..., under_replicated: _Optional[int] = ..., copies_held: _Optional[int] = ..., copies_made: _Optional[int] = ..., copies_failed: _Optional[int] = ...) -> None: ...

class ReplicationResponse(_message.Message):
    __slots__ = ("node_id", "enabled", "rounds", "passes", "last_round_unix_seconds", "last_error", "namespaces", "pins", "max_pin_replicas")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    enabled: bool
    rounds: int
    passes: int
    last_round_unix_seconds: float
    last_error: str
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceReplication]
    pins: _containers.RepeatedCompositeFieldContainer[PinReplication]
    max_pin_replicas: int
    def __init__(self, node_id: _Optional[str] = ..., enabled: bool = ..., rounds: _Optional[int] = ..., passes: _Optional[int] = ..., last_round_unix_seconds: _Optional[float] = ..., last_error: _Optional[str] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceReplication, _Mapping]]] = ..., pins: _Optional[_Iterable[_Union[PinReplication, _Mapping]]] = ..., max_pin_replicas: _Optional[int] = ...) -> None: ...
