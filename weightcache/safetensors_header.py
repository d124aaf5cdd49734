"""The safetensors header: parsed and checked here, without the safetensors library.

A file is ``u64 little-endian N``, then ``N`` bytes of JSON, then the data::

    {"<name>": {"dtype": "BF16", "shape": [4096, 4096], "data_offsets": [begin, end]},
     "__metadata__": {"format": "pt"}}

with offsets relative to byte ``8 + N``. The format carries no checksum, so
what can be checked is checked before any offset is trusted: the length
fits the file and :data:`MAX_HEADER_BYTES`; the JSON is an object with no
repeated key and nests no deeper than JSON's own parser can follow (a
table is three levels deep; a hostile file nests millions); every dtype is
known (:mod:`weightcache.dtypes`); every shape is a list of non-negative
integers whose byte size equals its range; no two ranges overlap and none
reaches past the end of the file. A header that
breaks any of these raises :class:`~weightcache.errors.HeaderError` naming
the file and the tensor. Ranges may leave gaps: bytes no tensor claims are
still covered by the manifest's chunk digests, so a gap cannot hide a
changed byte, and refusing it would refuse files safetensors itself reads.

A shape is bounded as well as matched to its range: a zero-size tensor
(``[0, 2**70]``) spans no bytes whatever its other dimensions, yet numpy and
torch refuse to build a view whose dimensions (its zeros taken as one)
overflow a signed 64-bit size. So the product of a shape's dimensions, each
zero counted as one, must be at most :data:`MAX_TENSOR_BYTES` in bytes: every
tensor a header describes can then be made, in both frameworks, and
Python's integers compute the product without overflow.

The same checks run on a manifest's tensor table (:func:`check_table`), so a
hand-edited manifest cannot point a reader outside the file either.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from weightcache.dtypes import DTYPES
from weightcache.errors import HeaderError

LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
MAX_RANK = 64
MAX_TENSOR_BYTES = 1 << 50  # 1 PiB: far past any real tensor, far below a 64-bit size or stride
METADATA_KEY = "__metadata__"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a file: ``begin``/``end`` are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    data_start: int  # 8 + N: where offset 0 of every tensor is in the file
    tensors: tuple[TensorEntry, ...]  # in byte order
    metadata: dict[str, str]


def header_length(first: bytes, file_size: int, where: str) -> int:
    """N from the file's first 8 bytes, checked against the file's size and the limit."""
    if file_size < LENGTH_BYTES or len(first) < LENGTH_BYTES:
        raise HeaderError(
            f"{where}: truncated: {file_size} bytes, but a safetensors file starts with an 8-byte header length; "
            "re-upload the file"
        )
    (n,) = struct.unpack_from("<Q", first)
    if n == 0 or n > MAX_HEADER_BYTES:
        raise HeaderError(
            f"{where}: header length {n} is outside 1..{MAX_HEADER_BYTES} bytes: not a safetensors file, or a corrupt one"
        )
    if LENGTH_BYTES + n > file_size:
        raise HeaderError(
            f"{where}: truncated: the header claims {n} bytes but the file has {file_size - LENGTH_BYTES} after "
            "its length; re-upload the file"
        )
    return n


def parse_header(raw: bytes, file_size: int, where: str) -> SafetensorsHeader:
    """The header from its ``N`` JSON bytes (those after the length), checked against ``file_size``."""
    data_start = LENGTH_BYTES + len(raw)
    try:
        doc = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=_no_repeats)
    except UnicodeDecodeError as err:
        raise HeaderError(f"{where}: the header is not UTF-8 ({err.reason} at byte {err.start}): a corrupt file") from None
    except json.JSONDecodeError as err:
        raise HeaderError(f"{where}: the header is not JSON ({err.msg} at byte {err.pos}): a corrupt or truncated file") from None
    except _Repeated as err:
        raise HeaderError(f"{where}: the header names {err.args[0]!r} twice") from None
    except ValueError:  # the one other refusal of json: an integer past Python's limit on digits
        raise HeaderError(
            f"{where}: the header holds a number of over {sys.get_int_max_str_digits()} digits: a corrupt or hostile file"
        ) from None
    except RecursionError:
        raise HeaderError(
            f"{where}: the header's JSON nests too deeply to parse (a safetensors tensor table is 3 levels deep): "
            "a corrupt or hostile file; re-export it with the safetensors library"
        ) from None
    if not isinstance(doc, dict):
        raise HeaderError(f"{where}: the header is JSON but not an object")
    metadata = doc.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise HeaderError(f"{where}: {METADATA_KEY} must map strings to strings")
    entries = [_entry(name, value, where) for name, value in doc.items()]
    tensors = check_table(entries, file_size - data_start, where)
    return SafetensorsHeader(data_start, tensors, metadata)


def check_table(entries: Iterable[TensorEntry], data_bytes: int, where: str) -> tuple[TensorEntry, ...]:
    """The entries in byte order, once each is known to be well-formed, inside the data section
    of ``data_bytes`` bytes, and disjoint from the others."""
    ordered = sorted(entries, key=lambda e: (e.begin, e.end, e.name))
    names: set[str] = set()
    previous: TensorEntry | None = None
    for e in ordered:
        _check_entry(e, where)
        if e.name in names:
            raise HeaderError(f"{where}: tensor {e.name!r} is listed twice")
        names.add(e.name)
        if e.end > data_bytes:
            raise HeaderError(
                f"{where}: tensor {e.name!r} ends at data byte {e.end}, past the end of the file "
                f"({data_bytes} data bytes): a truncated file or a corrupt header"
            )
        if e.nbytes and previous is not None and e.begin < previous.end:
            raise HeaderError(
                f"{where}: tensors {previous.name!r} [{previous.begin}, {previous.end}) and {e.name!r} "
                f"[{e.begin}, {e.end}) overlap: a corrupt header"
            )
        if e.nbytes:
            previous = e
    return tuple(ordered)


class _Repeated(Exception):
    pass


def _no_repeats(pairs: Sequence[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _Repeated(k)
        out[k] = v
    return out


def _entry(name: str, value: object, where: str) -> TensorEntry:
    if not isinstance(value, dict):
        raise HeaderError(f"{where}: tensor {name!r} is not an object with dtype, shape and data_offsets")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise HeaderError(f"{where}: tensor {name!r}: shape must be a list of integers, not {shape!r:.200}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise HeaderError(f"{where}: tensor {name!r}: data_offsets must be [begin, end], not {offsets!r:.200}")
    if not isinstance(dtype, str):
        raise HeaderError(f"{where}: tensor {name!r}: dtype must be a string, not {dtype!r:.200}")
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_entry(e: TensorEntry, where: str) -> None:
    dtype = DTYPES.get(e.dtype)
    if dtype is None:
        raise HeaderError(f"{where}: tensor {e.name!r} has dtype {e.dtype!r}; known: {', '.join(DTYPES)}")
    if len(e.shape) > MAX_RANK or any(d < 0 for d in e.shape):
        raise HeaderError(f"{where}: tensor {e.name!r}: shape {_shown(e.shape)} is not up to {MAX_RANK} sizes >= 0")
    if math.prod(max(d, 1) for d in e.shape) * dtype.bits > MAX_TENSOR_BYTES * 8:
        raise HeaderError(
            f"{where}: tensor {e.name!r}: shape {_shown(e.shape)} of {e.dtype} is over {MAX_TENSOR_BYTES >> 50} PiB "
            "even with its zero dimensions taken as 1, too large for numpy or torch to describe: a corrupt header"
        )
    if not 0 <= e.begin <= e.end:
        raise HeaderError(f"{where}: tensor {e.name!r}: data_offsets [{e.begin}, {e.end}] must have 0 <= begin <= end")
    size = dtype.nbytes(e.shape)
    if size is None:
        raise HeaderError(
            f"{where}: tensor {e.name!r}: {math.prod(e.shape)} elements of {e.dtype} do not fill whole bytes"
        )
    if size != e.nbytes:
        raise HeaderError(
            f"{where}: tensor {e.name!r}: shape {_shown(e.shape)} of {e.dtype} is {size} bytes but its "
            f"data_offsets span {e.nbytes}: a corrupt header"
        )


def _shown(shape: tuple[int, ...]) -> str:
    """A shape for a message, cut short: a hostile one may hold 64 numbers of any length."""
    text = str(list(shape))
    return text if len(text) <= 200 else f"{text[:200]}...]"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
