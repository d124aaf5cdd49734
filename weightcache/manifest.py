"""A model revision's manifest: files → fixed-size chunks with BLAKE3 digests → tensor tables.

The manifest is what makes a model addressable: its digest (BLAKE3 of its
canonical JSON bytes) names exactly one set of bytes, so a node that opens
``(location, digest)`` can never serve another revision, or a mix of two.
Everything a reader or a peer needs is in it:

- ``files``: every file of the revision (path relative to the revision's
  root, size), cut into ``chunk_bytes`` chunks (the last one shorter), each
  with the BLAKE3 digest of its bytes. A chunk is the unit of fetching,
  verifying, recording and sharing between peers; its digest is
  content-addressed, so two revisions that share a file share its chunks.
- ``safetensors``: for each ``.safetensors`` file, where its data starts and
  its tensor table (name, dtype, shape, byte range in the data section) as
  parsed from the header at publish time. A reader plans its fetch from this
  table before any byte arrives, and checks it against the header once the
  header's chunks are verified.

The JSON is canonical (sorted keys, no spaces) so the same bytes, chunked
the same way, always give the same digest: publishing twice is idempotent.
A new field changes ``format``; a reader refuses formats it does not know
rather than guess. Every size is bounded (:data:`MAX_FILES`, ...), checked
by :meth:`Manifest.from_bytes` before anything else trusts the document.
"""

from __future__ import annotations

import json
import math
import posixpath
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import blake3

from weightcache.errors import HeaderError, ManifestError, ManifestMismatch
from weightcache.safetensors_header import LENGTH_BYTES, SafetensorsHeader, TensorEntry, check_table

FORMAT = "strata.weights.manifest/1"
DIGEST_BYTES = 32
MIN_CHUNK_BYTES = 64 << 10  # a multiple of every page size: a chunk boundary never splits a page
MAX_CHUNK_BYTES = 1 << 30
DEFAULT_CHUNK_BYTES = 16 << 20
MAX_MANIFEST_BYTES = 256 << 20
MAX_FILES = 100_000
MAX_CHUNKS = 1 << 24
MAX_PATH_CHARS = 1024
MAX_NAME_CHARS = 256  # model and revision


def digest_of(data) -> bytes:
    return blake3.blake3(data).digest()


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    size: int
    chunks: tuple[bytes, ...]  # BLAKE3 of each chunk, in order
    header: SafetensorsHeader | None = None  # the tensor table, for a safetensors file

    def chunk_span(self, index: int, chunk_bytes: int) -> tuple[int, int]:
        start = index * chunk_bytes
        return start, min(self.size, start + chunk_bytes)

    def chunks_covering(self, start: int, end: int, chunk_bytes: int) -> range:
        """Indices of the chunks holding bytes [start, end) of the file (empty for an empty range)."""
        if end <= start:
            return range(0)
        return range(start // chunk_bytes, (end - 1) // chunk_bytes + 1)


@dataclass(frozen=True)
class Manifest:
    model: str
    revision: str
    chunk_bytes: int
    files: tuple[FileEntry, ...]
    raw: bytes = field(default=b"", repr=False, compare=False)

    @cached_property
    def encoded(self) -> bytes:
        """The canonical bytes, as stored and hashed."""
        return self.raw or _encode(self)

    @cached_property
    def digest(self) -> str:
        return blake3.blake3(self.encoded).hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def total_chunks(self) -> int:
        return sum(len(f.chunks) for f in self.files)

    @cached_property
    def first_chunk(self) -> tuple[int, ...]:
        """Per file, the global number of its chunk 0 (chunks numbered across files, in file order)."""
        out, n = [], 0
        for f in self.files:
            out.append(n)
            n += len(f.chunks)
        return tuple(out)

    def file_index(self, path: str) -> int | None:
        return self._by_path.get(path)

    @cached_property
    def _by_path(self) -> dict[str, int]:
        return {f.path: i for i, f in enumerate(self.files)}

    def tensors(self) -> Iterator[tuple[int, TensorEntry]]:
        """(file index, entry) for every tensor, in file order then byte order."""
        for i, f in enumerate(self.files):
            if f.header is not None:
                for t in f.header.tensors:
                    yield i, t

    @classmethod
    def build(cls, model: str, revision: str, chunk_bytes: int, files: Sequence[FileEntry]) -> Manifest:
        """A new manifest, checked as a loaded one would be."""
        m = cls(model, revision, chunk_bytes, tuple(sorted(files, key=lambda f: f.path)))
        return cls.from_bytes(m.encoded)

    @classmethod
    def from_bytes(cls, raw: bytes, expect_digest: str | None = None, where: str = "manifest") -> Manifest:
        """Parse and check a stored manifest. With ``expect_digest``, the bytes must hash to it:
        a manifest is trusted only as the one that was asked for."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where}: {len(raw)} bytes, over the {MAX_MANIFEST_BYTES >> 20} MiB limit")
        if expect_digest is not None:
            got = blake3.blake3(raw).hexdigest()
            if got != expect_digest:
                raise ManifestMismatch(
                    f"{where}: its bytes hash to {got}, not {expect_digest}: the stored manifest was altered; "
                    "publish the model again (strata weights publish) and open the digest it prints"
                )
        try:
            doc = json.loads(raw)
        except ValueError as err:  # not UTF-8, not JSON, or a number past Python's 4300-digit limit
            raise ManifestError(f"{where}: not JSON ({err})") from None
        except RecursionError:
            raise ManifestError(f"{where}: its JSON nests too deeply to parse: not a manifest strata wrote") from None
        return _decode(doc, bytes(raw), where)


def _encode(m: Manifest) -> bytes:
    files = []
    for f in m.files:
        entry: dict = {"path": f.path, "size": f.size, "chunks": [c.hex() for c in f.chunks]}
        if f.header is not None:
            entry["safetensors"] = {
                "data_start": f.header.data_start,
                "metadata": f.header.metadata,
                "tensors": [[t.name, t.dtype, list(t.shape), t.begin, t.end] for t in f.header.tensors],
            }
        files.append(entry)
    doc = {"format": FORMAT, "model": m.model, "revision": m.revision, "chunk_bytes": m.chunk_bytes, "files": files}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _decode(doc: object, raw: bytes, where: str) -> Manifest:
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: not a JSON object")
    if doc.get("format") != FORMAT:
        raise ManifestError(
            f"{where}: format {doc.get('format')!r}; this reader knows {FORMAT!r} (a newer publisher? upgrade strata)"
        )
    model, revision, chunk_bytes, files = (doc.get(k) for k in ("model", "revision", "chunk_bytes", "files"))
    for name, value in (("model", model), ("revision", revision)):
        if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
            raise ManifestError(f"{where}: {name} must be a string of 1..{MAX_NAME_CHARS} characters")
    check_chunk_bytes(chunk_bytes, where)
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise ManifestError(f"{where}: files must be a list of at most {MAX_FILES}")
    entries = [_file(f, chunk_bytes, f"{where}: files[{i}]") for i, f in enumerate(files)]
    paths = [e.path for e in entries]
    if paths != sorted(set(paths)):
        raise ManifestError(f"{where}: file paths must be unique and sorted")
    if sum(len(e.chunks) for e in entries) > MAX_CHUNKS:
        raise ManifestError(f"{where}: more than {MAX_CHUNKS} chunks: publish with a larger --chunk-size")
    owner: dict[str, str] = {}
    for e in entries:
        for t in e.header.tensors if e.header else ():
            if t.name in owner:
                raise ManifestError(f"{where}: tensor {t.name!r} is in both {owner[t.name]} and {e.path}")
            owner[t.name] = e.path
    return Manifest(model, revision, chunk_bytes, tuple(entries), raw)


def check_chunk_bytes(value: object, where: str = "chunk size") -> int:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or not MIN_CHUNK_BYTES <= value <= MAX_CHUNK_BYTES
        or value % MIN_CHUNK_BYTES
    ):
        raise ManifestError(
            f"{where}: chunk_bytes {value!r} must be a multiple of {MIN_CHUNK_BYTES >> 10} KiB between "
            f"{MIN_CHUNK_BYTES >> 10} KiB and {MAX_CHUNK_BYTES >> 20} MiB"
        )
    return value


def check_path(path: object, where: str) -> str:
    """A path relative to the revision's root that cannot leave it once joined to a directory."""
    if (
        not isinstance(path, str)
        or not 0 < len(path) <= MAX_PATH_CHARS
        or "\0" in path
        or "\\" in path
        or path.startswith("/")
        or posixpath.normpath(path) != path
        or path.split("/")[0] in ("..", ".")
    ):
        raise ManifestError(f"{where}: path {path!r} must be a normalized relative path under {MAX_PATH_CHARS} characters")
    return path


def _file(doc: object, chunk_bytes: int, where: str) -> FileEntry:
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: not an object")
    path = check_path(doc.get("path"), where)
    size, chunks = doc.get("size"), doc.get("chunks")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ManifestError(f"{where} ({path}): size must be an integer >= 0")
    expect = math.ceil(size / chunk_bytes)
    if not isinstance(chunks, list) or len(chunks) != expect:
        raise ManifestError(f"{where} ({path}): {size} bytes in chunks of {chunk_bytes} need {expect} chunk digests")
    try:
        digests = tuple(bytes.fromhex(c) for c in chunks)
    except (TypeError, ValueError):
        raise ManifestError(f"{where} ({path}): chunk digests must be hex") from None
    if any(len(d) != DIGEST_BYTES for d in digests):
        raise ManifestError(f"{where} ({path}): chunk digests must be {DIGEST_BYTES} bytes (BLAKE3)")
    header = None
    if "safetensors" in doc:
        header = _table(doc["safetensors"], size, f"{where} ({path})")
    return FileEntry(path, size, digests, header)


def _table(doc: object, size: int, where: str) -> SafetensorsHeader:
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: safetensors must be an object")
    start, metadata, tensors = doc.get("data_start"), doc.get("metadata"), doc.get("tensors")
    if not isinstance(start, int) or isinstance(start, bool) or not LENGTH_BYTES < start <= size:
        raise ManifestError(f"{where}: data_start {start!r} must be inside the file")
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ManifestError(f"{where}: safetensors metadata must map strings to strings")
    if not isinstance(tensors, list):
        raise ManifestError(f"{where}: tensors must be a list")
    entries = []
    for t in tensors:
        if not (
            isinstance(t, list)
            and len(t) == 5
            and isinstance(t[0], str)
            and isinstance(t[1], str)
            and isinstance(t[2], list)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in (*t[2], t[3], t[4]))
        ):
            raise ManifestError(f"{where}: a tensor must be [name, dtype, shape, begin, end], not {t!r:.200}")
        entries.append(TensorEntry(t[0], t[1], tuple(t[2]), t[3], t[4]))
    try:
        table = check_table(entries, size - start, where)
    except HeaderError as err:
        raise ManifestError(str(err)) from None
    return SafetensorsHeader(start, table, metadata)
