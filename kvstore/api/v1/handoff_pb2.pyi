from kvstore.api.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenHandoffRequest(_message.Message):
    __slots__ = ("namespace", "keys", "lease_ms", "keep_as_cache")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    KEEP_AS_CACHE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ms: int
    keep_as_cache: bool
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., lease_ms: _Optional[int] = ..., keep_as_cache: bool = ...) -> None: ...

class HandoffParams(_message.Message):
    __slots__ = ("handoff_id", "namespace", "node_id", "epoch", "addresses", "control_address", "blocks", "lease_deadline_unix_ms", "lease_ms")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    namespace: str
    node_id: str
    epoch: int
    addresses: _containers.RepeatedScalarFieldContainer[str]
    control_address: str
    blocks: _containers.RepeatedCompositeFieldContainer[_kv_pb2.BlockHeader]
    lease_deadline_unix_ms: int
    lease_ms: int
    def __init__(self, handoff_id: _Optional[str] = ..., namespace: _Optional[str] = ..., node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., addresses: _Optional[_Iterable[str]] = ..., control_address: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[_kv_pb2.BlockHeader, _Mapping]]] = ..., lease_deadline_unix_ms: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class OpenHandoffResponse(_message.Message):
    __slots__ = ("params", "missing")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    params: HandoffParams
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, params: _Optional[_Union[HandoffParams, _Mapping]] = ..., missing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class HeartbeatHandoffRequest(_message.Message):
    __slots__ = ("namespace", "handoff_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    handoff_id: str
    def __init__(self, namespace: _Optional[str] = ..., handoff_id: _Optional[str] = ...) -> None: ...

class HeartbeatHandoffResponse(_message.Message):
    __slots__ = ("lease_deadline_unix_ms",)
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_deadline_unix_ms: int
    def __init__(self, lease_deadline_unix_ms: _Optional[int] = ...) -> None: ...

class CompleteHandoffRequest(_message.Message):
    __slots__ = ("namespace", "handoff_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    handoff_id: str
    def __init__(self, namespace: _Optional[str] = ..., handoff_id: _Optional[str] = ...) -> None: ...

class CompleteHandoffResponse(_message.Message):
    __slots__ = ("deleted", "kept")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    kept: int
    def __init__(self, deleted: _Optional[int] = ..., kept: _Optional[int] = ...) -> None: ...

class PullHandoffRequest(_message.Message):
    __slots__ = ("namespace", "params", "timeout_ms")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    params: HandoffParams
    timeout_ms: int
    def __init__(self, namespace: _Optional[str] = ..., params: _Optional[_Union[HandoffParams, _Mapping]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class PullHandoffResponse(_message.Message):
    __slots__ = ("stored", "present", "pulled_bytes", "completed", "complete_error", "published")
    STORED_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_ERROR_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    present: int
    pulled_bytes: int
    completed: bool
    complete_error: str
    published: bool
    def __init__(self, stored: _Optional[int] = ..., present: _Optional[int] = ..., pulled_bytes: _Optional[int] = ..., completed: bool = ..., complete_error: _Optional[str] = ..., published: bool = ...) -> None: ...
