"""A bounded fuzz run over every RPC's request messages, against a real daemon on a real socket.

Requests are drawn from strategies built from the proto descriptors (every
field of every request message: integers at their extremes, huge, unicode
and NUL strings, bytes, repeated fields short and long, nested messages),
and as raw random bytes in place of the serialized request. Every call must
end with a status that means something (never UNKNOWN or INTERNAL), the
daemon must stay healthy after each one, and no block stored before the run
may change.

Bounded for CI: a fixed number of examples per method, derandomized, no
example database. ``STRATA_FUZZ_EXAMPLES=2000`` runs longer locally (and
``HYPOTHESIS_PROFILE=explore`` draws fresh examples).
"""

from __future__ import annotations

import os

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstore import BlockPut, Client
from kvstore.api.v1 import handoff_pb2, index_pb2, kv_pb2, kv_pb2_grpc
from kvstore.block import checksum
from kvstore.config import load_settings
from kvstore.server.daemon import Daemon
from tests.support.store_blocks import MiB, value

pytestmark = pytest.mark.system

EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "25"))
RAW_EXAMPLES = max(5, EXAMPLES // 3)
# Derandomized under the default (CI) profile; HYPOTHESIS_PROFILE=explore draws fresh examples.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=settings.default.derandomize,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RAW = settings(FUZZ, max_examples=RAW_EXAMPLES)

# Statuses that say what happened. UNKNOWN and INTERNAL are defects; so is UNAVAILABLE from a
# daemon whose every dependency is in-process.
EXPECTED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}

KV = kv_pb2.DESCRIPTOR.services_by_name["KVService"]
INDEX = index_pb2.DESCRIPTOR.services_by_name["IndexService"]
HANDOFF = handoff_pb2.DESCRIPTOR.services_by_name["HandoffService"]
METHODS = [(svc, m) for svc in (KV, INDEX, HANDOFF) for m in svc.methods]
CLASSES = {**{d.full_name: getattr(kv_pb2, d.name) for d in kv_pb2.DESCRIPTOR.message_types_by_name.values()},
           **{d.full_name: getattr(index_pb2, d.name) for d in index_pb2.DESCRIPTOR.message_types_by_name.values()},
           **{d.full_name: getattr(handoff_pb2, d.name) for d in handoff_pb2.DESCRIPTOR.message_types_by_name.values()}}

# What the fuzz may find: blocks it can name (namespace "m"), and blocks it must never change ("kept").
KEYS = [b"a", b"b", b"c"]
KEPT = {b"k%d" % i: value(100 + i, (i + 1) * 40_000) for i in range(3)}


# ---- strategies from the descriptors ---------------------------------------------------------

_INT_RANGES = {
    F.TYPE_INT32: (-(1 << 31), (1 << 31) - 1), F.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    F.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1), F.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1), F.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_UINT32: (0, (1 << 32) - 1), F.TYPE_FIXED32: (0, (1 << 32) - 1),
    F.TYPE_UINT64: (0, (1 << 64) - 1), F.TYPE_FIXED64: (0, (1 << 64) - 1),
}


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = (lo, hi, hi - 1, -1, 0, 1, 4097, 10_001, 1 << 20, 8 * MiB + 1, 1 << 31, 1 << 32, 1 << 53)
    return st.one_of(st.sampled_from([e for e in edges if lo <= e <= hi]), st.integers(0, 64), st.integers(lo, hi))


_STRINGS = st.one_of(
    st.sampled_from(["", "m", "kept-not", "a" * 129, "x" * 70_000, "\x00", "ns\x00m", "é" * 2000, "../etc", "m/é"]),
    st.text(max_size=40),
)
_BYTES = st.one_of(
    st.sampled_from([b"", *KEYS, b"\x00", b"\xff" * 1025, b"k" * 1024, b"z" * 70_000]),
    st.binary(max_size=40),
)
_FLOATS = st.floats(allow_nan=True, allow_infinity=True)


def _scalar(field) -> st.SearchStrategy:
    t = field.type
    if t in _INT_RANGES:
        return _integers(*_INT_RANGES[t])
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return _FLOATS if t == F.TYPE_DOUBLE else st.floats(width=32, allow_nan=True, allow_infinity=True)
    if t == F.TYPE_STRING:
        return _STRINGS
    if t == F.TYPE_BYTES:
        return _BYTES
    if t == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), _integers(-(1 << 31), (1 << 31) - 1))
    raise AssertionError(f"no strategy for field {field.full_name} of type {t}")


# Fields whose random values would almost always be refused at the first check: drawn half the
# time from values the daemon knows, so the fuzz also reaches what lies behind that check.
_NAMES = st.sampled_from(["m", "m", "fuzz"])
_KNOWN_KEYS = st.sampled_from(KEYS)
_FAVOURED = {
    "namespace": _NAMES, "key": _KNOWN_KEYS, "keys": _KNOWN_KEYS, "parent_key": _KNOWN_KEYS,
    "prefix": st.sampled_from([b"", b"a"]), "hash_seed": st.just("0"), "block_size": st.sampled_from([1, 4, 16]),
    "token_ids": st.integers(0, 1 << 17), "candidates": st.just("node-x"),
}


def _field(field, depth: int) -> st.SearchStrategy:
    one = messages(field.message_type, depth + 1) if field.type == F.TYPE_MESSAGE else _scalar(field)
    if field.name in _FAVOURED and field.type != F.TYPE_MESSAGE:
        one = st.one_of(_FAVOURED[field.name], one)
    if not field.is_repeated:
        return one
    return st.one_of(st.lists(one, max_size=6), st.just(_many(field)))  # short, or past a batch limit


def _many(field) -> list:
    """4097 small values of a repeated field: one more than a batch may hold."""
    n = 4097
    if field.type == F.TYPE_MESSAGE:
        cls = CLASSES.get(field.message_type.full_name) or _nested_class(field.message_type)
        return [cls() for _ in range(n)]
    if field.type == F.TYPE_BYTES:
        return [b"k%d" % i for i in range(n)]
    if field.type == F.TYPE_STRING:
        return ["n%d" % i for i in range(n)]
    if field.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return [1.0] * n
    if field.type == F.TYPE_BOOL:
        return [True] * n
    return [i + 1 for i in range(n)]


def messages(descriptor, depth: int = 0) -> st.SearchStrategy:
    """Messages of ``descriptor``'s type with any subset of their fields set (a oneof: the last one wins)."""
    cls = CLASSES.get(descriptor.full_name) or _nested_class(descriptor)
    if depth > 3:
        return st.just(cls())
    fields = {f.name: _field(f, depth) for f in descriptor.fields}

    def build(values: dict):
        msg = cls()
        for name, v in values.items():
            target = getattr(msg, name) if descriptor.fields_by_name[name].type == F.TYPE_MESSAGE else None
            if descriptor.fields_by_name[name].is_repeated:
                getattr(msg, name).extend(v)
            elif target is not None:
                target.CopyFrom(v)
            else:
                setattr(msg, name, v)
        return msg

    return st.fixed_dictionaries({}, optional=fields).map(build)


def _nested_class(descriptor):
    outer = CLASSES[descriptor.containing_type.full_name]
    return getattr(outer, descriptor.name)


def _put_streams() -> st.SearchStrategy:
    """Put streams shaped like a client's (a header, then chunks), with fuzzed fields; when
    ``consistent`` the header's size (and checksum) match the chunks, so blocks are also stored."""

    def build(namespace, header, chunks, consistent):
        if consistent:  # the size the chunks make; and their checksum, or one a bit off
            header.size = sum(len(c) for c in chunks)
            header.checksum = checksum(b"".join(chunks)) ^ (consistent == "size")
        return [kv_pb2.PutRequest(namespace=namespace, header=header), *(kv_pb2.PutRequest(chunk=c) for c in chunks)]

    u64 = _integers(0, (1 << 64) - 1)
    header = st.builds(
        kv_pb2.BlockHeader, key=st.one_of(_KNOWN_KEYS, st.binary(min_size=1, max_size=40), _BYTES), size=u64,
        checksum=u64, parent_key=st.one_of(st.just(b""), _KNOWN_KEYS, _BYTES), layout=st.one_of(st.just(""), _STRINGS),
    )
    block = st.builds(build, st.one_of(_NAMES, _NAMES, _STRINGS), header,
                      st.lists(st.binary(min_size=1, max_size=3000), min_size=1, max_size=4),
                      st.sampled_from(["", "size", "size+checksum", "size+checksum"]))
    return st.lists(block, min_size=1, max_size=3).map(lambda blocks: [m for b in blocks for m in b])


def requests(method) -> st.SearchStrategy:
    one = messages(method.input_type)
    if not method.client_streaming:
        return one
    if method.input_type is kv_pb2.PutRequest.DESCRIPTOR:
        return st.one_of(st.lists(one, max_size=8), _put_streams(), _put_streams())
    return st.lists(one, max_size=8)


# ---- the daemon under fuzz ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    daemon = Daemon(load_settings(
        listen="127.0.0.1:0", disk_dir=str(tmp / "disk"), shm_dir=str(tmp), metrics_listen="",
        ram_bytes="32MiB", disk_bytes="128MiB", max_block_bytes="8MiB", put_budget_bytes="16MiB",
        workers=8, stream_idle_seconds=2,
    )).start()
    target = f"127.0.0.1:{daemon.port}"
    with Client(target, use_shm=False) as kv:
        for key, data in KEPT.items():
            kv.put("kept", key, data)
        for i, key in enumerate(KEYS):
            kv.put("m", key, value(i, 4096), parent=KEYS[i - 1] if i else None)
    channel = grpc.insecure_channel(target)
    yield channel, target
    channel.close()
    with Client(target, use_shm=False) as kv:  # nothing stored before the fuzz changed
        assert {k: kv.get("kept", k) for k in KEPT} == KEPT
    daemon.stop(0)


def _call(channel: grpc.Channel, service, method, request, raw: bool):
    path = f"/{service.full_name}/{method.name}"
    ser = None if raw else (lambda m: m.SerializeToString())
    if method.client_streaming:
        rpc = channel.stream_unary(path, request_serializer=ser, response_deserializer=None)
        return rpc(iter(request), timeout=20)
    if method.server_streaming:
        rpc = channel.unary_stream(path, request_serializer=ser, response_deserializer=None)
        return list(rpc(request, timeout=20))
    return channel.unary_unary(path, request_serializer=ser, response_deserializer=None)(request, timeout=20)


def _check(fuzzed, service, method, request, raw: bool = False) -> None:
    channel, _ = fuzzed
    try:
        _call(channel, service, method, request, raw)
    except grpc.RpcError as err:
        assert err.code() in EXPECTED, f"{method.name}: {err.code()} {err.details()!r} for {request!r:.300}"
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def _kept_unchanged(fuzzed) -> None:
    with Client(fuzzed[1], use_shm=False) as kv:
        assert {k: kv.get("kept", k) for k in KEPT} == KEPT


@pytest.mark.parametrize(("service", "method"), METHODS, ids=[m.name for _, m in METHODS])
def test_every_request_message_gets_a_meaningful_status(fuzzed, service, method):
    @FUZZ
    @given(request=requests(method))
    def run(request):
        _check(fuzzed, service, method, request)

    run()
    _kept_unchanged(fuzzed)


@pytest.mark.parametrize(("service", "method"), METHODS, ids=[m.name for _, m in METHODS])
def test_raw_bytes_in_place_of_a_request_get_a_meaningful_status(fuzzed, service, method):
    raw = st.binary(max_size=300)

    @RAW
    @given(request=st.lists(raw, max_size=5) if method.client_streaming else raw)
    def run(request):
        _check(fuzzed, service, method, request, raw=True)

    run()
    _kept_unchanged(fuzzed)


# ---- what the fuzz found, as explicit cases ------------------------------------------------------

_BATCHED = [(svc, m, f) for svc, m in METHODS if not m.client_streaming
            for f in m.input_type.fields if f.is_repeated]


@pytest.mark.parametrize(("service", "method", "field"), _BATCHED, ids=[f"{m.name}.{f.name}" for _, m, f in _BATCHED])
def test_every_repeated_field_past_the_batch_limit_is_refused(fuzzed, service, method, field):
    """Abort and Release used to take any number of ids, under the store lock, where every other
    batch is refused past --max-batch-blocks."""
    request = CLASSES[method.input_type.full_name]()
    getattr(request, field.name).extend(_many(field))
    if method.input_type.fields_by_name.get("namespace"):
        request.namespace = "m"
    with pytest.raises(grpc.RpcError) as info:
        _call(fuzzed[0], service, method, request, raw=False)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def test_answers_bigger_than_a_chunk_are_sent(fuzzed):
    """Answers that echo a batch of long keys with their layouts (Lookup, a List page) used to fail
    with RESOURCE_EXHAUSTED 'Sent message larger than max': the daemon capped its replies at the
    size of a request, though the requests were within every limit."""
    channel, target = fuzzed
    keys = [b"%04d" % i + b"k" * 1000 for i in range(1000)]  # a request of them fits a message ...
    with Client(target, use_shm=False) as kv:  # ... their answer, with 1000-character layouts, does not
        kv.put_many("long", [BlockPut(k, b"v", layout="L" * 1000) for k in keys])
    stub = kv_pb2_grpc.KVServiceStub(channel)
    found = stub.Lookup(kv_pb2.LookupRequest(namespace="long", keys=keys), timeout=30)
    stub.Release(kv_pb2.ReleaseRequest(lease_ids=[b.lease_id for b in found.blocks]), timeout=30)
    assert all(b.found for b in found.blocks)
    page = stub.List(kv_pb2.ListRequest(namespace="long", page_size=2000), timeout=30)
    assert [b.block.key for b in page.blocks] == keys
