from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefetchState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_STATE_UNSPECIFIED: _ClassVar[PrefetchState]
    PREFETCH_STATE_UNKNOWN: _ClassVar[PrefetchState]
    PREFETCH_STATE_RUNNING: _ClassVar[PrefetchState]
    PREFETCH_STATE_COMPLETE: _ClassVar[PrefetchState]
    PREFETCH_STATE_FAILED: _ClassVar[PrefetchState]
PREFETCH_STATE_UNSPECIFIED: PrefetchState
PREFETCH_STATE_UNKNOWN: PrefetchState
PREFETCH_STATE_RUNNING: PrefetchState
PREFETCH_STATE_COMPLETE: PrefetchState
PREFETCH_STATE_FAILED: PrefetchState

class PrefetchRequest(_message.Message):
    __slots__ = ("location", "digest", "revision")
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    location: str
    digest: str
    revision: str
    def __init__(self, location: _Optional[str] = ..., digest: _Optional[str] = ..., revision: _Optional[str] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("digest", "started")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    digest: str
    started: bool
    def __init__(self, digest: _Optional[str] = ..., started: bool = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("digest",)
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    digest: str
    def __init__(self, digest: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("state", "model", "total_bytes", "verified_bytes", "total_chunks", "verified_chunks", "error", "bytes_by_source", "ram_bytes")
    class BytesBySourceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_BY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    state: PrefetchState
    model: str
    total_bytes: int
    verified_bytes: int
    total_chunks: int
    verified_chunks: int
    error: str
    bytes_by_source: _containers.ScalarMap[str, int]
    ram_bytes: int
    def __init__(self, state: _Optional[_Union[PrefetchState, str]] = ..., model: _Optional[str] = ..., total_bytes: _Optional[int] = ..., verified_bytes: _Optional[int] = ..., total_chunks: _Optional[int] = ..., verified_chunks: _Optional[int] = ..., error: _Optional[str] = ..., bytes_by_source: _Optional[_Mapping[str, int]] = ..., ram_bytes: _Optional[int] = ...) -> None: ...

class ReadChunkRequest(_message.Message):
    __slots__ = ("digest", "file", "chunk", "wait_ms")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    digest: str
    file: int
    chunk: int
    wait_ms: int
    def __init__(self, digest: _Optional[str] = ..., file: _Optional[int] = ..., chunk: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class ReadChunkResponse(_message.Message):
    __slots__ = ("found", "data")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    found: bool
    data: bytes
    def __init__(self, found: bool = ..., data: _Optional[bytes] = ...) -> None: ...
