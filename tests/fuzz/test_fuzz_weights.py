"""A bounded fuzz run of the weight node's WeightService, against a real node on a real port.

Requests are drawn from the proto descriptors (every field of Prefetch,
Status and ReadChunk: strings empty, huge, unicode, NUL, paths and URLs,
the node's own digest and location beside random ones; integers at their
extremes), with the ``strata-waited-ms`` metadata a reader sends, and as raw
random bytes in place of the serialized request. Every call must end with
a status that means something (never UNKNOWN or INTERNAL; UNAVAILABLE only
from a Prefetch of an S3 location, whose origin here is a closed port), the
node must answer Status and serve a verified chunk after each one, and the
model it held before the run must read back unchanged, chunk by chunk.

What the fuzz found is kept at the end of this module as regression tests
(gRPC's own INTERNAL for bytes that are not a request; RESOURCE_EXHAUSTED for
an error that quoted a long field back into the answer's metadata; UNKNOWN for
a path component over 255 bytes).

Bounded for CI: a fixed number of examples per method, derandomized, no
example database. ``STRATA_FUZZ_EXAMPLES=2000`` runs longer locally (and
``HYPOTHESIS_PROFILE=explore`` draws fresh examples).
"""

from __future__ import annotations

import os
import string
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import weightcache
from benchmarks.harness import free_port
from kvstore.errors import InvalidArgument
from kvstore.rpc.status import from_rpc_error, to_status
from tests.support.raw_frames import MEANINGFUL, weighted
from tests.support.wait import wait_until
from tests.support.weights_models import layered_tensors, write_numpy_model
from weightcache.api.v1 import weights_pb2 as pb
from weightcache.fetch import FetchLimits
from weightcache.origin import S3OriginOptions
from weightcache.peers import WAITED_KEY
from weightcache.prefetch import Prefetcher
from weightcache.service import serve

pytestmark = pytest.mark.system

EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "25"))
RAW_EXAMPLES = max(5, EXAMPLES // 3)
# Derandomized under the default (CI) profile; HYPOTHESIS_PROFILE=explore draws fresh examples.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=settings.default.derandomize,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RAW = settings(FUZZ, max_examples=RAW_EXAMPLES)

SERVICE = pb.DESCRIPTOR.services_by_name["WeightService"]
METHODS = list(SERVICE.methods)
CLASSES = {d.full_name: getattr(pb, d.name) for d in pb.DESCRIPTOR.message_types_by_name.values()}
CHUNK = 64 << 10
# Two rounds over the sources, short back-offs: a chunk of an origin that is down fails at once.
FAST = FetchLimits(max_in_flight=4, origin_concurrency=4, max_attempts=2, backoff_base_s=0.001, backoff_max_s=0.01,
                   poll_interval_s=0.005)


@dataclass
class Node:
    prefetcher: Prefetcher
    channel: grpc.Channel
    folder: str
    digest: str
    chunks: dict[tuple[int, int], bytes]  # (file, chunk) -> the bytes the model holds there
    files: int


def _expected_chunks(folder: Path, manifest) -> dict[tuple[int, int], bytes]:
    out = {}
    for f, entry in enumerate(manifest.files):
        data = (folder / entry.path).read_bytes()
        for c in range(len(entry.chunks)):
            start, end = entry.chunk_span(c, manifest.chunk_bytes)
            out[(f, c)] = data[start:end]
    return out


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz-weights")
    folder = write_numpy_model(tmp / "src", [layered_tensors(seed=5, layers=2)])
    manifest = weightcache.publish_model(str(folder), chunk_bytes=CHUNK)
    closed = f"http://127.0.0.1:{free_port()}"  # an S3 origin no one listens on: UNAVAILABLE, at once
    s3 = S3OriginOptions(endpoint=closed, region="us-east-1", access_key_id="x", secret_access_key="y", allow_http=True,
                   request_timeout_s=2.0, connect_timeout_s=1.0)
    prefetcher = Prefetcher(tmp / "node", limits=FAST, s3=s3, join_wait_s=0.05, max_jobs=4)
    server, port = serve(prefetcher, "127.0.0.1:0")
    prefetcher.prefetch(str(folder), manifest.digest)
    wait_until(lambda: prefetcher.status(manifest.digest).state == "complete", what="the model's prefetch")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield Node(prefetcher, channel, str(folder), manifest.digest, _expected_chunks(folder, manifest),
               len(manifest.files))
    try:  # the model held before the fuzz reads back whole, every chunk
        for (f, c), data in sorted(_expected_chunks(folder, manifest).items()):
            got = _stub_call(channel, "ReadChunk", pb.ReadChunkRequest(digest=manifest.digest, file=f, chunk=c))
            assert got.found and got.data == data, (f, c)
    finally:
        channel.close()
        server.stop(0).wait()
        prefetcher.close()


# ---- strategies from the descriptors ---------------------------------------------------------

_INT_RANGES = {F.TYPE_UINT32: (0, (1 << 32) - 1), F.TYPE_UINT64: (0, (1 << 64) - 1),
               F.TYPE_INT32: (-(1 << 31), (1 << 31) - 1), F.TYPE_INT64: (-(1 << 63), (1 << 63) - 1)}
_STRINGS = st.one_of(
    st.sampled_from(["", "\x00", "é" * 2000, "x" * 70_000, "../etc", "s3://", "s3://bucket", "s3://bucket/prefix/",
                     "file:///nowhere", "http://127.0.0.1:1/m", "hf://org/model", "/nowhere/at/all", "0" * 64,
                     "A" * 64, "g" * 64, "0" * 63, "0" * 65, "sha256:" + "0" * 64]),
    st.text(max_size=40),
)


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [lo, hi, hi - 1, 0, 1, 2, 1000, 60_000, 600_001, (1 << 31) - 1, 1 << 31, (1 << 32) - 1]
    return st.one_of(st.sampled_from([e for e in edges if lo <= e <= hi]), st.integers(0, 8), st.integers(lo, hi))


def _favoured(node: Node) -> dict[str, st.SearchStrategy]:
    """Fields whose random values are refused at the first check, drawn most of the time from
    values the node knows, so the fuzz also reaches what lies behind that check."""
    digests = st.sampled_from([node.digest, node.digest, "0" * 64, "f" * 64])
    return {
        "digest": weighted((3, digests), (1, _STRINGS)),
        "location": weighted((2, st.sampled_from([node.folder, node.folder + "/", node.folder + "/..",
                                                  str(Path(node.folder).parent), "s3://bucket/model/"])),
                             (1, _STRINGS)),
        "revision": weighted((2, st.just("")), (1, _STRINGS)),
        "file": weighted((3, st.integers(0, node.files)), (1, _integers(0, (1 << 32) - 1))),
        "chunk": weighted((3, st.integers(0, 40)), (1, _integers(0, (1 << 32) - 1))),
        "wait_ms": weighted((3, st.sampled_from([0, 0, 50])), (1, _integers(0, (1 << 32) - 1))),
    }


def _scalar(field) -> st.SearchStrategy:
    if field.type in _INT_RANGES:
        return _integers(*_INT_RANGES[field.type])
    if field.type == F.TYPE_STRING:
        return _STRINGS
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=40)
    raise AssertionError(f"no strategy for field {field.full_name} of type {field.type}")


def messages(descriptor, favoured: dict) -> st.SearchStrategy:
    """Request messages of ``descriptor``'s type with any subset of their fields set."""
    cls = CLASSES[descriptor.full_name]
    fields = {f.name: favoured.get(f.name, _scalar(f)) for f in descriptor.fields}
    return st.fixed_dictionaries({}, optional=fields).map(lambda values: cls(**values))


_METADATA_TEXT = st.text(alphabet=string.ascii_letters + string.digits + " -+.:_", max_size=30)
METADATA = st.lists(st.one_of(
    st.tuples(st.just(WAITED_KEY), st.one_of(st.sampled_from(["0", "-1", "600000", "1e9", "9" * 30, "", "ten"]),
                                             _METADATA_TEXT)),
    st.tuples(st.sampled_from(["strata-chunk-pending", "x-fuzz", "grpc-timeout-x"]), _METADATA_TEXT),
), max_size=3)


# ---- calls ----------------------------------------------------------------------------------------

# Statuses that say what happened (tests/support/raw_frames.py); a Prefetch of an S3 location may also
# find its origin UNAVAILABLE (the fixture's S3 endpoint is a closed port).
EXPECTED = MEANINGFUL | {grpc.StatusCode.OK}
def _stub_call(channel, method: str, request, *, raw: bool = False, metadata=(), timeout: float = 20):
    ser = None if raw else (lambda m: m.SerializeToString())
    output = getattr(pb, SERVICE.methods_by_name[method].output_type.name)
    rpc = channel.unary_unary(f"/{SERVICE.full_name}/{method}", request_serializer=ser,
                              response_deserializer=output.FromString)
    return rpc(request, timeout=timeout, metadata=metadata)


def _check(node: Node, method: str, request, *, raw: bool = False, metadata=()) -> None:
    try:
        _stub_call(node.channel, method, request, raw=raw, metadata=metadata)
    except grpc.RpcError as err:
        allowed = set(EXPECTED)
        if method == "Prefetch" and (raw or request.location.startswith("s3:")):
            allowed.add(grpc.StatusCode.UNAVAILABLE)
        assert err.code() in allowed, f"{method}: {err.code()} {err.details()!r:.300} for {request!r:.300}"
    _alive(node)


def _alive(node: Node) -> None:
    """The node answers Status for the model it holds (COMPLETE) and serves one of its chunks, verified."""
    status = _stub_call(node.channel, "Status", pb.StatusRequest(digest=node.digest), timeout=10)
    assert status.state == pb.PREFETCH_STATE_COMPLETE, status
    (f, c), data = next(iter(node.chunks.items()))
    got = _stub_call(node.channel, "ReadChunk", pb.ReadChunkRequest(digest=node.digest, file=f, chunk=c), timeout=10)
    assert got.found and got.data == data


# ---- the fuzz -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [m.name for m in METHODS])
def test_every_request_message_gets_a_meaningful_status(node, method):
    descriptor = SERVICE.methods_by_name[method].input_type

    @FUZZ
    @given(request=messages(descriptor, _favoured(node)), metadata=METADATA)
    def run(request, metadata):
        _check(node, method, request, metadata=metadata)

    run()


@pytest.mark.parametrize("method", [m.name for m in METHODS])
def test_raw_bytes_in_place_of_a_request_get_a_meaningful_status(node, method):
    @RAW
    @given(request=st.binary(max_size=300))
    def run(request):
        _check(node, method, request, raw=True)

    run()


def test_every_chunk_of_the_model_and_none_past_it(node):
    """Each (file, chunk) the model has is served whole; one past a file's last chunk, or past the
    last file, is INVALID_ARGUMENT; an unknown digest is a miss (an answer, not an error)."""
    for (f, c), data in node.chunks.items():
        got = _stub_call(node.channel, "ReadChunk", pb.ReadChunkRequest(digest=node.digest, file=f, chunk=c))
        assert got.found and got.data == data
    last = {f: c for f, c in sorted(node.chunks)}
    for f, c in [*((f, c + 1) for f, c in last.items()), (node.files, 0), ((1 << 32) - 1, (1 << 32) - 1)]:
        with pytest.raises(grpc.RpcError) as info:
            _stub_call(node.channel, "ReadChunk", pb.ReadChunkRequest(digest=node.digest, file=f, chunk=c))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (f, c, info.value.details())
    miss = _stub_call(node.channel, "ReadChunk", pb.ReadChunkRequest(digest="f" * 64, file=0, chunk=0))
    assert not miss.found


# ---- what the fuzz found, as explicit cases ------------------------------------------------------


@pytest.mark.parametrize("method", [m.name for m in METHODS])
def test_bytes_that_are_not_a_request_are_invalid_argument(node, method):
    """gRPC's own answer is INTERNAL 'Exception deserializing request!'; the node's, as the KV daemon's
    (kvstore.rpc.decoding), is INVALID_ARGUMENT naming the message it expected."""
    with pytest.raises(grpc.RpcError) as info:
        _stub_call(node.channel, method, b"\x00", raw=True)  # field number 0: never a valid message
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())
    expected = SERVICE.methods_by_name[method].input_type.full_name
    assert f"{method}: the request is not a valid {expected}" in info.value.details()


@pytest.mark.parametrize(("method", "request_", "says"), [
    ("Status", pb.StatusRequest(digest="x" * 20_000), "64 lowercase hex characters"),
    ("ReadChunk", pb.ReadChunkRequest(digest="0" * 20_000), "64 lowercase hex characters"),
    ("Prefetch", pb.PrefetchRequest(location="/x" * 10_000), "4096-byte limit"),
], ids=["status-digest", "readchunk-digest", "prefetch-location"])
def test_a_long_digest_or_location_is_invalid_argument(node, method, request_, says):
    """Quoted whole, the field made the answer's metadata too big (RESOURCE_EXHAUSTED 'received metadata
    size exceeds hard limit'): the message quotes its head and its length, and says what to give."""
    with pytest.raises(grpc.RpcError) as info:
        _stub_call(node.channel, method, request_)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details()[:120])
    details = info.value.details()
    assert "… (20000 chars)" in details and says in details and len(details) < 400, details


@pytest.mark.parametrize("message", ["x" * 70_000, "é" * 20_000, "\x00\n%" * 10_000], ids=["ascii", "utf-8", "escaped"])
def test_no_error_message_overflows_the_answers_metadata(message):
    """The other half of the fix: kvstore/rpc/status.py carries a message twice in the trailers, so it
    carries at most MAX_MESSAGE_BYTES of it. An error that quotes a long input whole (here, every byte
    percent-encoded at worst) still reaches the client as its own class, its message cut and marked."""
    def fail(request, context):
        context.abort_with_status(to_status(InvalidArgument(message)))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "strata.test.v1.Bound", {"Fail": grpc.unary_unary_rpc_method_handler(fail)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/strata.test.v1.Bound/Fail")(b"", timeout=10)
    finally:
        server.stop(0).wait()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details()[:120])
    err = from_rpc_error(info.value)
    assert type(err) is InvalidArgument
    assert str(err).startswith(message[:100]) and str(err).endswith(f"(cut: {len(message.encode())} bytes in all)")


@pytest.mark.parametrize("location", ["/" + "a" * 300, "a" * 300 + "/model", "é" * 200])
def test_a_location_with_a_long_path_component_is_invalid_argument(node, location):
    """Path.is_dir() raises ENAMETOOLONG for a path component over 255 bytes: once UNKNOWN 'Exception
    calling application', now the limit in an INVALID_ARGUMENT."""
    with pytest.raises(grpc.RpcError) as info:
        _stub_call(node.channel, "Prefetch", pb.PrefetchRequest(location=location))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details()[:120])
    assert "over the 255-byte limit on a file or folder name" in info.value.details()
