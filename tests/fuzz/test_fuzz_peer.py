"""A bounded fuzz run of the TCP peer protocol (--peer-listen), against a real daemon on a real port.

Written against the protocol (:mod:`kvstore.peer.wire`), not one server's
code: before its Hello a connection may send only a small Hello, and any
other first frame is refused (request id 0) or the connection closed; after
it, every request with a positive id is answered in order, a refusal with
id 0 is the only answer that may end the stream, payload bytes are never
taken for frames, and the daemon logs no unexpected error.

Conversations are drawn as a hostile peer would send them: a Hello (the
right version and no token, or a wrong version, a token of the wrong type
or no one's, a Hello with a payload, one past its size, another request
first), then Read, Put (with its Data frame: sizes and checksums that match
or lie, a Data frame short or long or of another request), Check, Hold and
Release with their fields of the right shape or any msgpack value in their
place, batches past the limit, unknown operations, frames that are not
requests or not msgpack, payloads that carry whole frames of their own;
beside them, such conversations with bytes flipped, cut, inserted or cut
short and headers rewritten with lengths at their extremes (0, the
limits, 4 GiB), and random bytes before and after a Hello. The client
half-closes after its last byte (tests/support/raw_frames.py).

After every example: every reply is a whole frame of a known status, each
error of a meaningful class; a block read carries bytes that match its
checksum, and the kept blocks' own bytes; a probe request at the end is
answered unless the stream was refused; a new connection reads the blocks
stored before the run, unchanged, and gRPC health answers.

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
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from kvstore import Client
from kvstore.block import checksum
from kvstore.config import load_settings
from kvstore.peer import wire
from kvstore.server.daemon import Daemon
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

KEYS = [b"a", b"b", b"c"]
KEPT = {b"k%d" % i: value(200 + i, (i + 1) * 40_000) for i in range(3)}
REQUEST_BYTES = 8 << 20  # --peer-connection-in-flight-bytes: a request's block bytes, a frame's payload
PROBE = 987_654_321
SMUGGLED = 555_000_555
STATUSES = {wire.OK, wire.ERROR, wire.BLOCK, wire.MISS, wire.FAILED}



@dataclass
class Fuzzed:
    daemon: Daemon
    port: int
    kv: Client
    channel: grpc.Channel
    errors: ErrorRecords


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz-peer")
    daemon = Daemon(load_settings(
        listen="127.0.0.1:0", disk_dir=str(tmp / "disk"), shm_dir=str(tmp), metrics_listen="",
        ram_bytes="32MiB", disk_bytes="128MiB", max_block_bytes="8MiB", peer_listen="127.0.0.1:0",
        peer_idle_seconds=10, peer_connection_in_flight_bytes=str(REQUEST_BYTES),
        lease_seconds=2, pin_lease_seconds=2, max_lease_seconds=5,
    )).start()
    target = f"127.0.0.1:{daemon.port}"
    kv = Client(target, use_shm=False)
    for key, data in KEPT.items():
        kv.put("kept", key, data)
    for i, key in enumerate(KEYS):
        kv.put("m", key, value(i, 4096), parent=KEYS[i - 1] if i else None)
    channel = grpc.insecure_channel(target)
    with ErrorRecords() as records:
        yield Fuzzed(daemon, daemon.peer_server.port, kv, channel, records)
    channel.close()
    try:
        assert {k: kv.get("kept", k) for k in KEPT} == KEPT  # nothing stored before the fuzz changed
    finally:
        kv.close()
        daemon.stop(0)


def _connect(fuzzed: Fuzzed) -> socket.socket:
    return socket.create_connection(("127.0.0.1", fuzzed.port), timeout=10)


HELLO = Frame([wire.HELLO, 1, [wire.PROTOCOL_VERSION, ""]])


def _alive(fuzzed: Fuzzed, what: str) -> None:
    """No unexpected error logged; a new peer connection reads the kept blocks whole; gRPC is healthy."""
    fuzzed.errors.assert_none(what)
    with _connect(fuzzed) as sock:
        replies = converse(sock, HELLO.encode() + request(wire.READ, 2, ["kept", list(KEPT), 0, True]).encode())
    assert replies.metas[0][:2] == [1, wire.OK]
    blocks = [(m, p) for m, p in replies.frames[1:] if m[1] == wire.BLOCK]
    assert [p for _, p in blocks] == list(KEPT.values()), replies.metas
    assert replies.metas[-1] == [2, wire.OK, len(KEPT)]
    health = health_pb2_grpc.HealthStub(fuzzed.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


# ---- strategies ---------------------------------------------------------------------------------

NAMESPACES = or_junk(st.sampled_from(["m", "m", "fuzz", "kept"]), st.one_of(TEXT, VALUES))
BYTE_KEYS = st.one_of(st.sampled_from([*KEYS, *KEPT]), st.binary(min_size=1, max_size=40), BINARY)
KEY = or_junk(BYTE_KEYS, VALUES, odds=4)
KEY_LISTS = lists_of(KEY, [b"k%d" % i for i in range(4097)])
IDS = lists_of(NUMBERS, list(range(1, 4098)))
MILLIS = or_junk(st.sampled_from([0, 0, 50, 1000, 3000]), NUMBERS)
LAYOUTS = or_junk(weighted((6, st.just("")), (2, st.just("L")), (1, st.just("x" * 2000))), VALUES)
PARENTS = or_junk(st.one_of(st.none(), st.sampled_from(KEYS)), VALUES)


def _args(*fields) -> st.SearchStrategy:
    return reshaped(st.tuples(*fields).map(list))


ARGS = {
    wire.READ: _args(NAMESPACES, KEY_LISTS, MILLIS, or_junk(st.booleans())),
    wire.CHECK: _args(NAMESPACES, KEY_LISTS),
    wire.HOLD: _args(NAMESPACES, KEY_LISTS, MILLIS),
    wire.RELEASE: _args(IDS),
    wire.DATA: VALUES,  # a Data frame of no Put
    wire.HELLO: VALUES,  # a second Hello
}
OPS = weighted((10, st.sampled_from([*ARGS, wire.PUT, wire.PUT])), (1, st.sampled_from([0, 8, 255, -1, 1 << 32])),
               (1, VALUES))


@st.composite
def puts(draw, rid) -> list[Frame]:
    """A Put and its Data frame: blocks whose sizes and checksums match the bytes (so they are
    stored), or a checksum off, a size that lies, bytes short or long, a block of the wrong
    shape, the Data frame of another request id."""
    datas = draw(st.lists(st.one_of(st.binary(min_size=1, max_size=3000),
                                    st.just(smuggled(SMUGGLED, wire.RELEASE, [[]]))), min_size=1, max_size=3))
    keys = draw(st.lists(weighted((3, st.binary(min_size=1, max_size=16)), (1, st.sampled_from([*KEYS, *KEPT]))),
                         min_size=len(datas), max_size=len(datas)))
    blocks = [[k, len(d), checksum(d), draw(PARENTS), draw(LAYOUTS)] for k, d in zip(keys, datas)]
    payload = b"".join(datas)
    data_rid = rid
    lie = draw(st.sampled_from(["", "", "", "checksum", "size", "short", "long", "block", "rid"]))
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
    elif lie == "rid":
        data_rid = draw(st.sampled_from([0, rid + 1 if _positive(rid) else 1, -1, "x"]))
    return [request(wire.PUT, rid, [draw(NAMESPACES), draw(MILLIS), blocks]),
            Frame([wire.DATA, data_rid, draw(or_junk(st.just([])))], payload, continues=True)]


@st.composite
def requests(draw, rid) -> list[Frame]:
    op = draw(OPS)
    if op == wire.PUT:
        return draw(puts(rid))
    payload = draw(weighted((8, st.just(b"")), (1, st.binary(min_size=1, max_size=50)),
                            (1, st.just(smuggled(SMUGGLED, wire.RELEASE, [[]])))))
    args = ARGS.get(op, VALUES) if isinstance(op, int) else VALUES
    return [request(op, rid, draw(args), payload)]


@st.composite
def frames_after_hello(draw, at: int) -> list[Frame]:
    """A request or a Put with its Data (its id mostly a fresh positive one), a request of an odd
    id, a frame that is not a request, one that is not msgpack."""
    # Not an id of this conversation's own (100 on): those must each get their own answers.
    odd = st.one_of(st.sampled_from([0, -1, (1 << 64) - 1]), VALUES.filter(lambda v: not (_positive(v) and v >= 100)))
    rid = draw(weighted((12, st.just(100 + at)), (2, odd)))
    kind = draw(st.sampled_from(["request"] * 16 + ["not-a-request", "not-msgpack"]))
    if kind == "not-a-request":
        return [Frame(draw(VALUES.filter(lambda v: not (isinstance(v, list) and len(v) == 3))))]
    frames = draw(requests(rid))
    if kind == "not-msgpack":  # the request's own, or a Put's Data frame
        i = draw(st.integers(0, len(frames) - 1))
        frames[i] = draw(mangled(frames[i]))
    return frames


def hellos() -> st.SearchStrategy[tuple[Frame, bool | None]]:
    """A Hello and whether the daemon must take it (True), refuse it (False), or either (None)."""
    good = st.builds(lambda rid: (Frame([wire.HELLO, rid, [wire.PROTOCOL_VERSION, ""]]), True),
                     st.one_of(st.just(1), st.integers(1, 1 << 40)))
    bad = st.one_of(
        st.builds(lambda v: Frame([wire.HELLO, 1, [v, ""]]), st.sampled_from([0, 2, -1, (1 << 64) - 1, "1", None, [1]])),
        st.builds(lambda t: Frame([wire.HELLO, 1, [wire.PROTOCOL_VERSION, t]]),
                  st.one_of(st.sampled_from([b"", None, 0, ["t"], "no-ones-token"]), st.text(min_size=1, max_size=40))),
        st.builds(lambda a: Frame([wire.HELLO, 1, a]), st.sampled_from([[], [1], [1, "", "extra"], "hello", None])),
        st.builds(lambda p: Frame([wire.HELLO, 1, [wire.PROTOCOL_VERSION, ""]], p), st.binary(min_size=1, max_size=9)),
        st.just(Frame([wire.HELLO, 1, [wire.PROTOCOL_VERSION, "t" * (wire.MAX_HELLO_BYTES + 1)]])),
        requests(1).map(lambda fs: fs[0]).filter(lambda f: f.meta[0] != wire.HELLO),
    ).map(lambda f: (f, False))
    odd = st.builds(lambda rid, args: (Frame([wire.HELLO, rid, args]), None), VALUES, VALUES)
    return weighted((8, good), (3, bad), (1, odd))


@st.composite
def conversations(draw) -> tuple[Frame, bool | None, list[Frame]]:
    hello, taken = draw(hellos())
    rest = [f for i in range(draw(st.integers(1, 6))) for f in draw(frames_after_hello(i))]
    return hello, taken, rest


def _wire(hello: Frame, rest: list[Frame]) -> bytes:
    return b"".join(f.encode() for f in [hello, *rest, request(wire.RELEASE, PROBE, [[]])])


# ---- judging ------------------------------------------------------------------------------------


def _positive(rid) -> bool:
    return isinstance(rid, int) and not isinstance(rid, bool) and rid > 0


def _judge_replies(frames: list[tuple[object, bytes]], sent: dict | None = None, *, drawn: bool = True) -> None:
    """Every reply is [rid, status, result] of a known status, each error meaningful; a block's
    bytes match its checksum (and a kept block's own bytes); only a block carries a payload; no
    request carried inside a payload is answered (``drawn``: the frames were drawn whole; in
    mutated bytes a length prefix that lies makes a payload read as frames, which no server can
    tell, and the example is rejected)."""
    for n, (meta, payload) in enumerate(frames):
        assert isinstance(meta, list) and len(meta) == 3, f"a reply that is not [rid, status, result]: {meta!r:.200}"
        rid, status, result = meta
        assert status in STATUSES, f"a reply of status {status!r}: {meta!r:.200}"
        if same(rid, SMUGGLED) and not drawn:
            reject()
        assert not same(rid, SMUGGLED), "a frame carried inside a payload was answered: the stream lost step"
        if status == wire.ERROR:
            check_error(result)
            if same(rid, 0):
                assert n == len(frames) - 1, f"the daemon refused the stream (id 0) and went on: {frames[n:]!r:.300}"
        elif status == wire.FAILED:
            assert isinstance(result, list) and len(result) == 2, meta
            check_error(result[1])
        if status != wire.BLOCK:
            assert not payload, f"a {status} reply with {len(payload)} payload bytes"
            continue
        i, size, sum_, _, _, _ = result
        if payload:
            assert len(payload) == size and checksum(payload) == sum_, f"a block whose bytes fail their checksum: {meta}"
        asked = (sent or {}).get(rid)
        if asked is not None and payload and asked.meta[2][0] == "kept":
            key = asked.meta[2][1][i]
            if key in KEPT:
                assert payload == KEPT[key], f"kept block {key!r} read back changed"


def _runs(ids: list) -> list:
    return [rid for n, rid in enumerate(ids) if n == 0 or ids[n - 1] != rid]


def _judge_conversation(hello: Frame, taken: bool | None, rest: list[Frame], replies) -> None:
    frames = replies.frames
    assert frames, "the daemon closed without a word"
    first = frames[0][0]
    if taken is False or (taken is None and first[1] == wire.ERROR):
        _judge_replies(frames)
        assert len(frames) == 1 and same(first[0], 0) and first[1] == wire.ERROR, \
            f"a Hello the daemon must refuse got {replies.metas!r:.300}"
        return
    assert first[1] == wire.OK and same(first[0], hello.rid), f"a good Hello got {first!r:.300}"
    requests = [f for f in rest if f.request and _positive(f.rid) and not f.continues]
    sent = {f.rid: f for f in requests if f.meta[0] == wire.READ}
    _judge_replies(frames[1:], sent)
    # Answers in request order: runs of one id taken as one (a read's blocks and its OK; a Put's two
    # answers; two requests in a row that share an id).
    expected = _runs([f.rid for f in requests] + [PROBE])
    answered = _runs([meta[0] for meta, _ in frames[1:] if _positive(meta[0])])
    last = frames[-1][0]
    if same(last[0], 0) and last[1] == wire.ERROR:  # refused: what was answered came in order
        assert answered == expected[: len(answered)], f"answers {answered} for requests {expected}"
    else:
        assert answered == expected, f"answers {answered} for requests {expected}: {replies.metas!r:.400}"
        assert last == [PROBE, wire.OK, []]


# ---- the fuzz -----------------------------------------------------------------------------------


def test_conversations_get_answers_in_order_and_never_a_broken_frame(fuzzed):
    @FUZZ
    @given(conversation=conversations())
    def run(conversation):
        hello, taken, rest = conversation
        fuzzed.errors.take()  # a failed example before this one may have left its records
        with _connect(fuzzed) as sock:
            replies = converse(sock, _wire(hello, rest))
        fuzzed.errors.assert_none(f"for {conversation!r:.300}")
        _judge_conversation(hello, taken, rest, replies)
        _alive(fuzzed, f"for {conversation!r:.300}")

    run()


def test_mutated_conversations_get_error_frames_or_a_close(fuzzed):
    drawn = conversations().map(lambda c: _wire(c[0], c[2]))

    @FUZZ
    @given(data=drawn.flatmap(lambda d: mutations(d, wire.MAX_META_BYTES, REQUEST_BYTES)))
    def run(data):
        fuzzed.errors.take()
        with _connect(fuzzed) as sock:
            replies = converse(sock, data)
        fuzzed.errors.assert_none(f"for {data!r:.300}")
        _judge_replies(replies.frames, drawn=False)
        _alive(fuzzed, f"for {data!r:.300}")

    run()


def test_random_bytes_before_and_after_a_hello_get_error_frames_or_a_close(fuzzed):
    @RAW
    @given(greet=st.booleans(), data=st.binary(max_size=300))
    def run(greet, data):
        fuzzed.errors.take()
        with _connect(fuzzed) as sock:
            replies = converse(sock, (HELLO.encode() if greet else b"") + data)
        fuzzed.errors.assert_none(f"for {data!r:.300}")
        _judge_replies(replies.frames, drawn=False)
        if greet:
            assert replies.metas[0][:2] == [1, wire.OK]
        elif replies.frames:  # before the Hello: a refusal, never an answer
            assert [m[:2] for m in replies.metas] == [[0, wire.ERROR]], replies.metas
        _alive(fuzzed, f"for {data!r:.300}")

    run()


_EXTREMES = [(0, 0), (0, 5), (1, 0), (wire.MAX_HELLO_BYTES + 1, 0), (wire.MAX_META_BYTES + 1, 0),
             (0, REQUEST_BYTES + 1), ((1 << 32) - 1, 0), (0, (1 << 32) - 1), ((1 << 32) - 1, (1 << 32) - 1)]


@pytest.mark.parametrize("greet", [False, True], ids=["before-hello", "after-hello"])
@pytest.mark.parametrize(("meta_len", "payload_len"), _EXTREMES, ids=[f"{m}-{p}" for m, p in _EXTREMES])
def test_a_header_at_the_extremes_gets_a_refusal_or_a_close(fuzzed, greet, meta_len, payload_len):
    """A header alone (and the FIN). Before the Hello, any header past a small Hello's (a
    payload, a long control part) is refused from the header; after it, one past the limits."""
    fuzzed.errors.take()
    head = wire.HEADER.pack(meta_len, payload_len) + (b"\xc0" * min(meta_len, 1))
    with _connect(fuzzed) as sock:
        replies = converse(sock, (HELLO.encode() if greet else b"") + head)
    fuzzed.errors.assert_none(f"for a header ({meta_len}, {payload_len})")
    _judge_replies(replies.frames)
    metas = replies.metas[1:] if greet else replies.metas
    over = (meta_len > wire.MAX_META_BYTES or payload_len > REQUEST_BYTES if greet
            else meta_len > wire.MAX_HELLO_BYTES or payload_len > 0)
    if over:
        assert [m[:2] for m in metas] == [[0, wire.ERROR]] and metas[0][2][0] == "InvalidArgument", metas
    else:
        assert all(m[1] == wire.ERROR for m in metas), metas
    _alive(fuzzed, f"for a header ({meta_len}, {payload_len})")


# ---- what the fuzz found, as explicit cases ------------------------------------------------------


def _after_hello(fuzzed: Fuzzed, *frames: Frame) -> list:
    """Hello, ``frames`` and the probe: the replies after the Hello's (no unexpected error logged)."""
    fuzzed.errors.take()
    with _connect(fuzzed) as sock:
        replies = converse(sock, _wire(HELLO, list(frames)))
    logged = fuzzed.errors.take()
    assert not logged, ErrorRecords.format_record(logged[0])
    assert replies.metas[0][:2] == [1, wire.OK]
    return replies.metas[1:]


@pytest.mark.parametrize("op", [[wire.READ], {"op": 2}], ids=["list", "map"])
def test_an_operation_that_is_a_list_or_a_map_gets_an_error_frame(fuzzed, op):
    metas = _after_hello(fuzzed, request(op, 7, ["m", [b"a"], 0, False]))
    assert metas[0][:2] == [7, wire.ERROR] and metas[0][2][0] == "InvalidArgument"
    assert metas[1] == [PROBE, wire.OK, []]


@pytest.mark.parametrize("key", ["k", None, 1.5, ["k"]], ids=["str", "nil", "float", "list"])
def test_a_check_of_a_key_that_is_not_bytes_gets_an_answer(fuzzed, key):
    metas = _after_hello(fuzzed, request(wire.CHECK, 7, ["m", [key]]))
    assert metas[0][0] == 7 and (metas[0][1:] == [wire.OK, [False]] or metas[0][1] == wire.ERROR), metas
    assert metas[-1] == [PROBE, wire.OK, []]


def test_a_data_frame_that_is_not_msgpack_ends_the_connection_and_its_payload_is_never_served(fuzzed):
    data = b"abc"
    put = request(wire.PUT, 7, ["fuzz", 0, [[b"smuggler", len(data), checksum(data), None, ""]]])
    inside = smuggled(SMUGGLED, wire.RELEASE, [[]])
    metas = _after_hello(fuzzed, put, Frame([wire.DATA, 7, []], inside, control=b"\xc1", continues=True))
    assert metas[0] == [7, wire.OK, [False]]  # the slot is granted; then the Data frame breaks the format
    assert not any(same(m[0], SMUGGLED) for m in metas), metas
    assert metas[-1][:2] == [0, wire.ERROR], metas


@pytest.mark.parametrize("meta", [[1, 2], None, [wire.RELEASE, 0, [[]]]], ids=["short", "nil", "id-0"])
def test_a_refusal_with_id_0_ends_the_connection(fuzzed, meta):
    metas = _after_hello(fuzzed, Frame(meta))
    assert [m[:2] for m in metas] == [[0, wire.ERROR]], metas
