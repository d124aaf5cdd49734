"""A hostile client's side of Strata's frame protocols: frames drawn, mutated and exchanged over a raw socket.

The same-host socket (:mod:`kvstore.transport.samehost.frames`) and the TCP peer
listener (:mod:`kvstore.peer.wire`) share one frame: ``u32 meta_len, u32
payload_len`` (little-endian), a msgpack control part, a raw payload. The
fuzz suites (test_fuzz_samehost.py, test_fuzz_peer.py) draw conversations
from the strategies here, send them with :func:`converse`, which reads the
replies while it sends and half-closes the socket after the last byte (so a
server that still waits for more of a frame reads EOF at once, and no
example waits on a timeout), and judge what came back with the checks here.

Why half-close rather than wait: a server's answer to a half frame is to
wait for the rest, legitimately, until its idle or Hello timeout; after the
client's FIN it must answer what it has and close. A server that does
neither within :data:`WAIT_S` has hung, and the example fails.

Integers in the drawn values stay out of ``[2**20, 2**60)`` on purpose:
a server that mistakes an integer for a length (``bytes(n)``) would allocate
that much, and the suite must not take the test machine's memory with it.
Fields that are counts or times (sizes, leases, deadlines, ids) take the
whole 64-bit range through :data:`NUMBERS`.
"""

from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Self

import grpc
import msgpack
import pytest
from hypothesis import strategies as st

from kvstore import errors
from kvstore.rpc.status import code_for

HEADER = struct.Struct("<II")
WAIT_S = 30.0  # a server that neither answers nor closes this long after the client's FIN has hung

# What a refusal may mean (as for gRPC in test_fuzz_rpc.py): never INTERNAL or UNKNOWN, and not
# UNAVAILABLE from a daemon whose every dependency is in-process.
MEANINGFUL = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.DEADLINE_EXCEEDED,
}
ERROR_CLASSES = {name: cls for name, cls in vars(errors).items()
                 if isinstance(cls, type) and issubclass(cls, errors.StrataError)}

_pack = msgpack.Packer(use_bin_type=True).pack


# ---- values -------------------------------------------------------------------------------------

_SAFE_INT_EDGES = [0, 1, -1, 2, 127, 128, 255, 256, -32, -33, 4095, 4096, 4097, 65535, 65536, 1 << 19,
                   1 << 60, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -(1 << 63)]
SAFE_INTS = st.one_of(st.sampled_from(_SAFE_INT_EDGES), st.integers(-300, 300))
_NUMBER_EDGES = [0, 1, -1, 2, 1000, 4096, 4097, 10_001, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
                 1 << 53, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -(1 << 63)]
FLOATS = st.one_of(st.sampled_from([0.0, -0.0, 1.5, 1e300, float("inf"), float("-inf"), float("nan")]),
                   st.floats(allow_nan=True, allow_infinity=True))
TEXT = st.one_of(st.sampled_from(["", "m", "\x00", "é" * 300, "a" * 129, "../x", "ns\x00m", "\ud7ff\ue000"]),
                 st.text(max_size=20))
BINARY = st.one_of(st.sampled_from([b"", b"\x00", b"\xff" * 1025, b"k" * 1024]), st.binary(max_size=20))
EXTS = st.one_of(st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=9)),
                 st.builds(msgpack.Timestamp, st.integers(0, (1 << 34) - 1), st.integers(0, 999_999_999)))
SCALARS = st.one_of(st.none(), st.booleans(), SAFE_INTS, FLOATS, TEXT, BINARY, EXTS)


def _containers(children):
    keys = st.one_of(st.text(max_size=6), st.binary(max_size=6))  # int keys: see NOT_MSGPACK
    return st.one_of(st.lists(children, max_size=5), st.dictionaries(keys, children, max_size=3))


#: Any value msgpack can carry (lists and maps nested a few deep, ext types, timestamps) that
#: Strata's readers decode: maps keyed by strings or bytes (strict_map_key).
VALUES = st.recursive(SCALARS, _containers, max_leaves=12)
#: A field that should be a count, a time or an id: any integer msgpack holds, or something else.
NUMBERS = st.one_of(st.sampled_from(_NUMBER_EDGES), st.integers(0, 64), st.integers(-(1 << 63), (1 << 64) - 1),
                    SCALARS)


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, drawn with the weights given. Not ``st.one_of(good, good, junk)``:
    one_of drops a branch repeated, so that draws good and junk evenly. Shrinks to the first."""
    ladder = [s for w, s in choices for _ in range(w)]
    return st.integers(0, len(ladder) - 1).flatmap(ladder.__getitem__)


def or_junk(good: st.SearchStrategy, junk: st.SearchStrategy = VALUES, odds: int = 6) -> st.SearchStrategy:
    """Mostly ``good`` (``odds`` to 1); now and then any value at all in its place. A request has
    several fields: junk in one of them is found by the first check, so most fields are good."""
    return weighted((odds, good), (1, junk))


def lists_of(one: st.SearchStrategy, many: list, max_size: int = 5) -> st.SearchStrategy:
    """A short list of ``one``, or ``many`` (a list past a batch limit), or something that is not a list."""
    past = st.just(None).map(lambda _: many)  # not st.just(many): a 4097-item repr in every report
    return weighted((6, st.lists(one, max_size=max_size)), (1, past), (1, VALUES))


def reshaped(fields: st.SearchStrategy) -> st.SearchStrategy:
    """A request's argument list as drawn; or with a field dropped, one too many, or not a list at all."""
    def drop(args):
        return args[:-1]

    def extra(args):
        return [*args, None]

    return weighted((8, fields), (1, fields.map(drop)), (1, fields.map(extra)), (1, VALUES))


# ---- frames -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """One frame as sent: ``meta`` packed as its control part (or ``control``, bytes that are not
    valid msgpack, in its place), then ``payload``. ``rid``: the request id it carries, when its
    meta is a request ``[op, rid, args]``. ``continues``: the second frame of a request of two
    (a peer Put's Data), answered under the first one's id."""

    meta: object
    payload: bytes = b""
    control: bytes | None = None
    continues: bool = False

    def encode(self) -> bytes:
        body = self.control if self.control is not None else _pack(self.meta)
        return HEADER.pack(len(body), len(self.payload)) + body + self.payload

    @property
    def well_formed(self) -> bool:
        """Whether the control part is msgpack a receiver must decode: whole, maps keyed by strings
        or bytes only (Strata's readers decode with ``strict_map_key``, as msgpack does by default)."""
        return self.control is None and _string_keyed(self.meta)

    @property
    def request(self) -> bool:
        return self.well_formed and isinstance(self.meta, list) and len(self.meta) == 3

    @property
    def rid(self):
        return self.meta[1] if self.request else None


def _string_keyed(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, (str, bytes)) and _string_keyed(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_string_keyed(v) for v in value)
    return True


def request(op, rid, args, payload: bytes = b"") -> Frame:
    return Frame([op, rid, args], payload)


# Control parts that are never whole msgpack, or not what Strata's readers decode: a reserved byte,
# a truncated array, trailing bytes, a map with an int key (refused with strict_map_key), an empty
# control part, a length past the end.
NOT_MSGPACK = st.sampled_from([b"\xc1", b"\x93\x01", b"\x93\x01\x02\x03\x04", b"\x81\x01\x02", b"",
                               b"\xdd\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xd9\x05ab"])


def mangled(frame: Frame) -> st.SearchStrategy[Frame]:
    """``frame`` with its control part replaced by bytes that are not msgpack (lengths kept honest)."""
    return NOT_MSGPACK.map(lambda c: Frame(frame.meta, frame.payload, c))


def smuggled(rid: int, op: int, args) -> bytes:
    """A whole request frame, to be carried as payload bytes: a server that ever answers ``rid``
    took a payload for frames (its stream lost step with the client's)."""
    return Frame([op, rid, args]).encode()


@st.composite
def mutations(draw, data: bytes, max_meta: int, max_payload: int) -> bytes:
    """``data`` (whole frames) with one to three of: a byte flipped, bytes cut or inserted, the
    stream cut short, a header rewritten with lengths at their extremes."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "truncate", "header", "header"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "cut" and data:
            del data[at : at + draw(st.integers(1, 16))]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "truncate":
            del data[at:]
        else:
            meta = draw(st.sampled_from([0, 1, 3, max_meta - 1, max_meta, max_meta + 1, 1 << 31, (1 << 32) - 1]))
            payload = draw(st.sampled_from([0, 1, 7, max_payload, max_payload + 1, 1 << 31, (1 << 32) - 1]))
            data[at : at + HEADER.size] = HEADER.pack(meta, payload)
    return bytes(data)


# ---- a conversation -----------------------------------------------------------------------------


@dataclass
class Replies:
    """What the server sent back: whole frames (meta, payload), then the end of the stream."""

    frames: list[tuple[object, bytes]] = field(default_factory=list)
    reset: bool = False  # the server reset the connection (it closed with our bytes unread)
    torn: bytes = b""  # the start of a frame the server never finished (only ever after a reset)

    @property
    def metas(self) -> list:
        return [m for m, _ in self.frames]


def converse(sock: socket.socket, data: bytes, *, wait_s: float = WAIT_S) -> Replies:
    """Send ``data`` while reading what comes back, half-close, and read to the server's close.

    The reads go on while the bytes are sent, so a server that answers (a
    big read) before the client is done sending cannot wedge both sides on
    full socket buffers. Sending stops when the server closes first."""
    sock.setblocking(False)
    received = bytearray()
    reset = False
    end = time.monotonic() + wait_s
    view, sent = memoryview(data), 0
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        writing = True
        while True:
            left = end - time.monotonic()
            if left <= 0:
                pytest.fail(f"the server neither answered nor closed within {wait_s:g} s of the client's last byte "
                            f"({len(received)} bytes came back)")
            events = sel.select(min(left, 1.0))
            for _, mask in events:
                if mask & selectors.EVENT_WRITE and writing:
                    try:
                        sent += sock.send(view[sent : sent + (256 << 10)])
                    except BlockingIOError:
                        pass
                    except (BrokenPipeError, ConnectionResetError):
                        sent = len(data)  # the server closed first: what it said is still to be read
                    if sent >= len(data):
                        writing = False
                        _half_close(sock)
                        sel.modify(sock, selectors.EVENT_READ)
                        end = time.monotonic() + wait_s
                if mask & selectors.EVENT_READ:
                    try:
                        chunk = sock.recv(1 << 20)
                    except BlockingIOError:
                        continue
                    except ConnectionResetError:
                        reset, chunk = True, b""
                    if not chunk:  # the server closed (before we were done sending, perhaps)
                        return _parse(bytes(received), reset)
                    received += chunk


def _half_close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # already closed by the server


def _parse(data: bytes, reset: bool) -> Replies:
    out = Replies(reset=reset)
    at = 0
    while at < len(data):
        if len(data) - at < HEADER.size:
            break
        meta_len, payload_len = HEADER.unpack_from(data, at)
        end = at + HEADER.size + meta_len + payload_len
        if end > len(data):
            break
        control = data[at + HEADER.size : at + HEADER.size + meta_len]
        try:
            meta = msgpack.unpackb(control, use_list=True, raw=False)
        except ValueError as err:
            pytest.fail(f"the server sent a frame whose control part is not msgpack ({err}): {control[:80]!r}")
        out.frames.append((meta, data[end - payload_len : end]))
        at = end
    out.torn = data[at:]
    assert not out.torn or reset, f"the server closed in the middle of a frame: {out.torn[:80]!r}"
    return out


# ---- judging ------------------------------------------------------------------------------------


def same(a, b) -> bool:
    """Whether two decoded values are the same on the wire (NaN equals itself, 1 is not True)."""
    try:
        return _pack(a) == _pack(b)
    except (TypeError, ValueError, OverflowError):
        return False


def check_error(result, allowed: set = MEANINGFUL) -> str:
    """An error reply's ``[class name, message, retry_after_s]``: a class of Strata's tree whose
    status means something, a message, a delay; the class name."""
    assert isinstance(result, list) and len(result) == 3, f"a malformed error result: {result!r:.200}"
    name, message, retry = result
    cls = ERROR_CLASSES.get(name)
    assert cls is not None, f"an error of no known class: {result!r:.200}"
    code = code_for(cls.__new__(cls))
    assert code in allowed, f"{name} ({code.name}) is not a meaningful refusal: {message!r:.200}"
    assert isinstance(message, str) and message, f"an error without a message: {result!r:.200}"
    assert isinstance(retry, (int, float)) and not isinstance(retry, bool) and retry >= 0, result
    return name


class ErrorRecords(logging.Handler):
    """Records of ERROR and above under a logger (``kvstore``): a server that logs an unexpected
    error has ended a connection for a bug, whatever it sent the client."""

    def __init__(self, logger: str = "kvstore") -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self._logger = logging.getLogger(logger)
        self._taking = threading.Lock()  # records come from the server's threads

    def emit(self, record: logging.LogRecord) -> None:
        with self._taking:
            self.records.append(record)

    def __enter__(self) -> Self:
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self)

    def take(self) -> list[logging.LogRecord]:
        with self._taking:
            out, self.records = self.records, []
        return out

    def assert_none(self, what: str = "") -> None:
        """Fail on any record."""
        records = self.take()
        if records:
            pytest.fail(f"the server logged {len(records)} error(s) {what}: {self.format_record(records[0])}",
                        pytrace=False)

    @staticmethod
    def format_record(r: logging.LogRecord) -> str:
        text = r.getMessage()
        if r.exc_info:
            text += "\n" + logging.Formatter().formatException(r.exc_info)
        return text
