"""A bounded fuzz run of the same-host socket's frames, against a real daemon on a real Unix socket.

Conversations are drawn as a hostile client would send them: a Hello (this
daemon's token, or a wrong one, a wrong version, a malformed one, none at
all), then requests of every operation with their fields of the right
shape or any msgpack value in their place, batches past the limit, inline
puts whose sizes and checksums match their payload or lie about it,
control parts that are not msgpack, payloads that carry whole frames of
their own; and, beside them, such conversations with bytes flipped, cut,
inserted or cut short and frame headers rewritten with lengths at their
extremes (0, the limits, 4 GiB), and plain random bytes before and after a
Hello. The client half-closes after its last byte (tests/support/raw_frames.py).

After every example: every reply is a whole frame with a meaningful error
class (never one that maps to INTERNAL), each request with an id gets one
answer in order and a malformed request never costs the connection (a
probe request at the end is answered unless the daemon refused the stream,
with request id 0, and closed it), payload bytes are never taken for
frames, the daemon logs no unexpected error, answers a new connection and
gRPC health, and the blocks stored before the run read back unchanged.

What the fuzz found is kept at the end of this module as explicit
regression tests (each failed before its fix), and the drawn conversations
reach those inputs again.

Bounded for CI: a fixed number of examples per test, derandomized, no
example database. ``STRATA_FUZZ_EXAMPLES=2000`` runs longer locally (and
``HYPOTHESIS_PROFILE=explore`` draws fresh examples).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import Client
from kvstore.block import checksum
from kvstore.config import load_settings
from kvstore.server.daemon import Daemon
from kvstore.transport.samehost import frames
from kvstore.wire.unix import connect_unix
from tests.support.raw_frames import (
    BINARY, NUMBERS, TEXT, VALUES, ErrorRecords, Frame, check_error, converse, lists_of, mangled, mutations,
    or_junk, request, reshaped, same, smuggled, weighted,
)
from tests.support.store_blocks import value

pytestmark = pytest.mark.system

EXAMPLES = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "25"))
RAW_EXAMPLES = max(5, EXAMPLES // 3)
# Derandomized under the default (CI) profile; HYPOTHESIS_PROFILE=explore draws fresh examples.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=settings.default.derandomize,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RAW = settings(FUZZ, max_examples=RAW_EXAMPLES)

# What the fuzz may name: blocks in "m", and the blocks it must never change ("kept"; a put of
# one of their keys with other bytes stores nothing).
KEYS = [b"a", b"b", b"c"]
KEPT = {b"k%d" % i: value(100 + i, (i + 1) * 40_000) for i in range(3)}
PROBE = 987_654_321  # the request id of the Release [[]] that ends every drawn conversation
SMUGGLED = 555_000_555  # the request id of frames carried inside payloads: never to be answered


@dataclass
class Fuzzed:
    daemon: Daemon
    path: str
    token: bytes
    kv: Client
    channel: grpc.Channel
    errors: ErrorRecords


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz-samehost")
    daemon = Daemon(load_settings(
        listen="127.0.0.1:0", disk_dir=str(tmp / "disk"), shm_dir=str(tmp), metrics_listen="",
        ram_bytes="32MiB", disk_bytes="128MiB", max_block_bytes="8MiB", put_budget_bytes="16MiB",
        lease_seconds=2, pin_lease_seconds=2, max_lease_seconds=5, same_host_idle_seconds=10,
    )).start()
    target = f"127.0.0.1:{daemon.port}"
    kv = Client(target, use_shm=False)
    for key, data in KEPT.items():
        kv.put("kept", key, data)
    for i, key in enumerate(KEYS):
        kv.put("m", key, value(i, 4096), parent=KEYS[i - 1] if i else None)
    channel = grpc.insecure_channel(target)
    with ErrorRecords() as records:
        yield Fuzzed(daemon, daemon._same_host.path, bytes(daemon.store.head.arena.token), kv, channel, records)
    channel.close()
    try:
        assert {k: kv.get("kept", k) for k in KEPT} == KEPT  # nothing stored before the fuzz changed
        with Client(target, transport="same-host") as near:  # and a real same-host client reads it in place
            assert {k: near.get("kept", k) for k in KEPT} == KEPT
    finally:
        kv.close()
        daemon.stop(0)


def _connect(fuzzed: Fuzzed) -> socket.socket:
    return connect_unix(fuzzed.path, 10)


def _alive(fuzzed: Fuzzed, what: str) -> None:
    """No unexpected error logged; a new connection is served; gRPC is healthy; the kept blocks are whole."""
    fuzzed.errors.assert_none(what)
    with _connect(fuzzed) as sock:
        reader = frames.FrameReader(sock)
        frames.send(sock, frames.encode([frames.HELLO, 1, [frames.PROTOCOL_VERSION, fuzzed.token]]))
        assert reader.read()[0][:2] == [1, frames.OK]
        frames.send(sock, frames.encode([frames.LOOKUP, 2, ["kept", list(KEPT), 0, 0, []]]))
        rid, status, result = reader.read()[0]
        assert (rid, status) == (2, frames.OK), result
        entries = result[1]
        assert [e[:2] for e in entries] == [[len(v), checksum(v)] for v in KEPT.values()]
        frames.send(sock, frames.encode([frames.RELEASE, 0, [[e[5] for e in entries if e[5]]]]))
    health = health_pb2_grpc.HealthStub(fuzzed.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert [b.data for b in fuzzed.kv.get_many("kept", list(KEPT))] == list(KEPT.values())


# ---- strategies ---------------------------------------------------------------------------------

NAMESPACES = or_junk(st.sampled_from(["m", "m", "fuzz", "kept"]), st.one_of(TEXT, VALUES))
KEY = st.one_of(st.sampled_from([*KEYS, *KEPT]), st.binary(min_size=1, max_size=40), BINARY, VALUES)
KEY_LISTS = lists_of(KEY, [b"k%d" % i for i in range(4097)])
IDS = lists_of(NUMBERS, list(range(1, 4098)))
MILLIS = or_junk(st.sampled_from([0, 0, 50, 1000]), NUMBERS)
LAYOUTS = or_junk(weighted((6, st.just("")), (2, st.just("L")), (1, st.just("x" * 2000))), VALUES)
PARENTS = or_junk(st.one_of(st.none(), st.sampled_from(KEYS)), VALUES)


def _args(*fields) -> st.SearchStrategy:
    return reshaped(st.tuples(*fields).map(list))


ARGS = {
    frames.LOOKUP: _args(NAMESPACES, KEY_LISTS, MILLIS, MILLIS, IDS),
    frames.RELEASE: _args(IDS),
    frames.ALLOCATE: _args(NAMESPACES, MILLIS, MILLIS,
                           lists_of(_args(KEY, or_junk(st.integers(1, 70_000), NUMBERS), PARENTS, LAYOUTS), [])),
    frames.COMMIT: _args(IDS, IDS),
    frames.ABORT: _args(IDS),
    frames.TOUCH: _args(NAMESPACES, KEY_LISTS),
    frames.HELLO: VALUES,  # a second Hello, after the first
}
OPS = weighted((10, st.sampled_from([*ARGS, frames.PUT, frames.PUT])), (1, st.sampled_from([0, 9, 255, -1, 1 << 32])),
               (1, VALUES))


@st.composite
def puts(draw, rid) -> Frame:
    """An inline put: blocks whose sizes and checksums match the payload (so they are stored),
    or one checksum off, sizes that do not add up to the payload, a block of the wrong shape."""
    datas = draw(st.lists(st.one_of(st.binary(min_size=1, max_size=3000),
                                    st.just(smuggled(SMUGGLED, frames.RELEASE, [[]]))), min_size=1, max_size=3))
    keys = draw(st.lists(weighted((3, st.binary(min_size=1, max_size=16)), (1, st.sampled_from([*KEYS, *KEPT]))),
                         min_size=len(datas), max_size=len(datas)))
    blocks = [[k, len(d), checksum(d), draw(PARENTS), draw(LAYOUTS)] for k, d in zip(keys, datas)]
    payload = b"".join(datas)
    lie = draw(st.sampled_from(["", "", "", "checksum", "size", "short", "long", "block"]))
    i = draw(st.integers(0, len(blocks) - 1))
    if lie == "checksum":
        blocks[i][2] ^= 1
    elif lie == "size":
        blocks[i][1] = draw(NUMBERS)
    elif lie == "short":
        payload = payload[:-1]
    elif lie == "long":
        payload += b"\0"
    elif lie == "block":
        blocks[i] = draw(VALUES)
    return request(frames.PUT, rid, [draw(NAMESPACES), draw(MILLIS), blocks], payload)


@st.composite
def requests(draw, rid) -> Frame:
    op = draw(OPS)
    if op == frames.PUT:
        return draw(puts(rid))
    payload = draw(weighted((8, st.just(b"")), (1, st.binary(min_size=1, max_size=50)),
                            (1, st.just(smuggled(SMUGGLED, frames.RELEASE, [[]])))))
    args = ARGS.get(op, VALUES) if isinstance(op, int) else VALUES
    return request(op, rid, draw(args), payload)


@st.composite
def frames_after_hello(draw, at: int) -> Frame:
    """A request (its id mostly a fresh positive one), a request of an odd id, a frame whose
    control part is not a request, or one that is not msgpack."""
    rid = draw(weighted((12, st.just(100 + at)), (1, st.just(0)), (1, st.sampled_from([-1, (1 << 64) - 1])),
                        (1, VALUES)))
    kind = draw(st.sampled_from(["request"] * 16 + ["not-a-request", "not-msgpack"]))
    if kind == "not-a-request":
        return Frame(draw(VALUES.filter(lambda v: not (isinstance(v, list) and len(v) == 3))))
    frame = draw(requests(rid))
    return draw(mangled(frame)) if kind == "not-msgpack" else frame


def hellos(token: bytes) -> st.SearchStrategy[tuple[Frame, bool | None]]:
    """A Hello and whether the daemon must take it (True), refuse it (False), or either (None)."""
    caps = st.sampled_from([[], [[]], [["gpu"]], [["x", "gpu"]]])
    good = st.builds(lambda rid, version, c: (Frame([frames.HELLO, rid, [version, token, *c]]), True),
                     st.one_of(st.just(1), st.integers(1, 1 << 40)), st.sampled_from([1, 2]), caps)
    bad_token = st.one_of(st.sampled_from([b"", token[:-1], token + b"\0", bytes(len(token)), None, token.hex()]),
                          st.binary(max_size=40).filter(lambda t: t != token))
    bad = st.one_of(
        st.builds(lambda t: Frame([frames.HELLO, 1, [frames.PROTOCOL_VERSION, t]]), bad_token),
        st.builds(lambda v: Frame([frames.HELLO, 1, [v, token]]),
                  st.sampled_from([0, 3, -1, 99, (1 << 64) - 1, "2", 2.0, None, [2]])),
        st.builds(lambda a: Frame([frames.HELLO, 1, a]),
                  st.sampled_from([[], [2], [2, token, [], "extra"], "hello", None, {"v": 2}])),
        st.builds(lambda c: Frame([frames.HELLO, 1, [2, token, c]]), st.sampled_from(["gpu", 7, None, {"gpu": 1}])),
        requests(1),  # any request before the Hello
    ).map(lambda f: (f, False))
    odd = st.builds(lambda rid, args: (Frame([frames.HELLO, rid, args]), None), VALUES, VALUES)
    return weighted((8, good), (3, bad), (1, odd))


@st.composite
def conversations(draw, token: bytes) -> tuple[Frame, bool | None, list[Frame]]:
    hello, taken = draw(hellos(token))
    rest = [draw(frames_after_hello(i)) for i in range(draw(st.integers(1, 6)))]
    return hello, taken, rest


def _wire(hello: Frame, rest: list[Frame]) -> bytes:
    return b"".join(f.encode() for f in [hello, *rest, request(frames.RELEASE, PROBE, [[]])])


# ---- judging ------------------------------------------------------------------------------------


def _positive(rid) -> bool:
    return isinstance(rid, int) and not isinstance(rid, bool) and rid > 0


def _judge_replies(metas: list) -> None:
    """Every reply is [rid, OK or ERROR, result], each error meaningful; a refusal (id 0) ends the stream."""
    for n, meta in enumerate(metas):
        assert isinstance(meta, list) and len(meta) == 3, f"a reply that is not [rid, status, result]: {meta!r:.200}"
        rid, status, result = meta
        assert status in (frames.OK, frames.ERROR), f"a reply of status {status!r}: {meta!r:.200}"
        if status == frames.ERROR:
            check_error(result)
        if same(rid, 0) and status == frames.ERROR:
            assert n == len(metas) - 1, f"the daemon refused the stream (id 0) and went on: {metas[n:]!r:.300}"
        assert not same(rid, SMUGGLED), "a frame carried inside a payload was answered: the stream lost step"


def _judge_conversation(hello: Frame, taken: bool | None, rest: list[Frame], metas: list) -> None:
    _judge_replies(metas)
    assert metas, "the daemon closed without a word"
    first = metas[0]
    if taken is False or (taken is None and first[1] == frames.ERROR):
        assert len(metas) == 1 and same(first[0], 0) and first[1] == frames.ERROR, \
            f"a Hello the daemon must refuse got {metas!r:.300}"
        return
    assert first[1] == frames.OK and same(first[0], hello.rid), f"a good Hello got {first!r:.300}"
    # One answer per request with an id, in order (the protocol: id 0 gets none; replies in order).
    expected = [f.rid for f in rest if f.request and _positive(f.rid)] + [PROBE]
    answered = [m[0] for m in metas[1:] if _positive(m[0])]
    refused = same(metas[-1][0], 0) and metas[-1][1] == frames.ERROR
    if refused:  # only a frame that breaks the format may cost the connection
        assert any(not f.request for f in rest), f"a stream of well-formed frames was refused: {metas[-1]!r:.300}"
        assert answered == expected[: len(answered)], f"answers {answered} for requests {expected}"
    else:
        assert answered == expected, f"answers {answered} for requests {expected}: {metas!r:.400}"
        assert metas[-1] == [PROBE, frames.OK, []]


# ---- the fuzz -----------------------------------------------------------------------------------


def test_conversations_get_one_answer_per_request_and_keep_the_connection(fuzzed):
    @FUZZ
    @given(conversation=conversations(fuzzed.token))
    def run(conversation):
        hello, taken, rest = conversation
        fuzzed.errors.take()  # a failed example before this one may have left its records
        with _connect(fuzzed) as sock:
            replies = converse(sock, _wire(hello, rest))
        fuzzed.errors.assert_none(f"for {conversation!r:.300}")
        _judge_conversation(hello, taken, rest, replies.metas)
        _alive(fuzzed, f"for {conversation!r:.300}")

    run()


def test_mutated_conversations_get_error_frames_or_a_close(fuzzed):
    drawn = conversations(fuzzed.token).map(lambda c: _wire(c[0], c[2]))

    @FUZZ
    @given(data=drawn.flatmap(lambda d: mutations(d, frames.MAX_META_BYTES, frames.MAX_PAYLOAD_BYTES)))
    def run(data):
        fuzzed.errors.take()
        with _connect(fuzzed) as sock:
            replies = converse(sock, data)
        fuzzed.errors.assert_none(f"for {data!r:.300}")
        _judge_replies(replies.metas)
        _alive(fuzzed, f"for {data!r:.300}")

    run()


def test_random_bytes_before_and_after_a_hello_get_error_frames_or_a_close(fuzzed):
    hello = Frame([frames.HELLO, 1, [frames.PROTOCOL_VERSION, fuzzed.token]]).encode()

    @RAW
    @given(greet=st.booleans(), data=st.binary(max_size=300))
    def run(greet, data):
        fuzzed.errors.take()
        with _connect(fuzzed) as sock:
            replies = converse(sock, (hello if greet else b"") + data)
        fuzzed.errors.assert_none(f"for {data!r:.300}")
        _judge_replies(replies.metas)
        if greet:
            assert replies.metas[0][:2] == [1, frames.OK]
        _alive(fuzzed, f"for {data!r:.300}")

    run()


_EXTREMES = [(0, 0), (0, 5), (1, 0), (frames.MAX_META_BYTES + 1, 0), (0, frames.MAX_PAYLOAD_BYTES + 1),
             ((1 << 32) - 1, 0), (0, (1 << 32) - 1), ((1 << 32) - 1, (1 << 32) - 1)]


@pytest.mark.parametrize("greet", [False, True], ids=["before-hello", "after-hello"])
@pytest.mark.parametrize(("meta_len", "payload_len"), _EXTREMES, ids=[f"{m}-{p}" for m, p in _EXTREMES])
def test_a_header_at_the_extremes_is_refused_with_id_0_and_the_connection_closed(fuzzed, greet, meta_len, payload_len):
    """A header alone (and the FIN): over a limit it is refused from the header; within them the
    daemon waits for the rest, reads EOF and closes; either way it never answers with an OK."""
    hello = Frame([frames.HELLO, 1, [frames.PROTOCOL_VERSION, fuzzed.token]]).encode()
    head = frames.HEADER.pack(meta_len, payload_len) + (b"\xc0" * min(meta_len, 1))
    with _connect(fuzzed) as sock:
        replies = converse(sock, (hello if greet else b"") + head)
    metas = replies.metas[1:] if greet else replies.metas
    _judge_replies(replies.metas)
    over = meta_len > frames.MAX_META_BYTES or payload_len > frames.MAX_PAYLOAD_BYTES
    if over:
        assert len(metas) == 1 and metas[0][:2] == [0, frames.ERROR] and metas[0][2][0] == "InvalidArgument"
    else:
        assert all(m[1] == frames.ERROR for m in metas), metas
    _alive(fuzzed, f"for a header ({meta_len}, {payload_len})")


# ---- what the fuzz found, as explicit cases ------------------------------------------------------


def _one_request(fuzzed: Fuzzed, frame: Frame) -> list:
    """Hello, ``frame`` (request id 7) and the probe: the replies after the Hello's."""
    fuzzed.errors.take()
    with _connect(fuzzed) as sock:
        replies = converse(sock, _wire(Frame([frames.HELLO, 1, [frames.PROTOCOL_VERSION, fuzzed.token]]), [frame]))
    logged = fuzzed.errors.take()
    assert not logged, ErrorRecords.format_record(logged[0])
    return replies.metas[1:]


@pytest.mark.parametrize("op", [[frames.LOOKUP], {"op": 2}], ids=["list", "map"])
def test_an_operation_that_is_a_list_or_a_map_gets_an_error_frame(fuzzed, op):
    metas = _one_request(fuzzed, request(op, 7, ["m", [b"a"], 0, 0, []]))
    assert metas[0][:2] == [7, frames.ERROR] and metas[0][2][0] == "InvalidArgument"
    assert metas[1] == [PROBE, frames.OK, []]


@pytest.mark.parametrize(("op", "args"), [
    (frames.LOOKUP, [7, [b"a"], 0, 0, []]),
    (frames.PUT, [b"m", 0, []]),
    (frames.ALLOCATE, [1.5, 0, 0, []]),
    (frames.TOUCH, [["m"], [b"a"]]),
], ids=["lookup-int", "put-bytes", "allocate-float", "touch-list"])
def test_a_namespace_that_is_not_a_string_gets_an_error_frame(fuzzed, op, args):
    metas = _one_request(fuzzed, request(op, 7, args))
    assert metas[0][:2] == [7, frames.ERROR] and metas[0][2][0] in ("InvalidArgument", "InvalidNamespace")
    assert metas[1] == [PROBE, frames.OK, []]
