"""Block keys from token ids, bit for bit as vLLM computes them.

Strata keys a prefix block the way vLLM's prefix cache does with
``--prefix-caching-hash-algo sha256_cbor``, so a key computed by a router, by
Strata, or by any engine replica names the same block, and the hashes in
vLLM's KV events can be matched against keys computed here.

The algorithm (vLLM ``vllm/v1/core/kv_cache_utils.py`` and
``vllm/utils/hashing.py``)::

    cbor(x)   = cbor2.dumps(x, canonical=True)
    H(x)      = sha256(cbor(x)).digest()                       # 32 bytes
    NONE_HASH = H(os.environ["PYTHONHASHSEED"])                 # the string as set
    h_0       = H((NONE_HASH, tuple(tokens[0:B]),  extra_0))
    h_i       = H((h_{i-1},   tuple(tokens[iB:(i+1)B]), extra_i))

Only full blocks get a key; a trailing partial block has none. ``extra_i`` is
``None`` unless something joins it, in vLLM's order: the LoRA name (every
block), multimodal ``(identifier, offset)`` pairs (here: the caller's
per-block items), then ``cache_salt`` (block 0 only, and only if non-empty).
The salt therefore changes block 0's key and, through the chain, every key
after it.

The seed must be given. vLLM derives ``NONE_HASH`` from ``PYTHONHASHSEED`` and,
when that variable is unset, from ``os.urandom(32)``: such an engine's keys
cannot be reproduced by anyone, so a hasher without a seed is refused rather
than guessed. The seed is vLLM's view of the variable, a string: ``"42"`` and
``"042"`` are the same seed to Python but different keys to vLLM.

KV events carry a 64-bit form of each hash (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
default on): ``int.from_bytes(h, "big") & (2**64 - 1)``, i.e. the *last* eight
bytes of the digest read big-endian. With the variable off, events carry the
32 raw bytes; :func:`event_key_bytes` folds both forms to the same 8 bytes.

Older vLLM releases (integer parent hashes, ``sha256_cbor_64bit``) and the
other hash algorithms (``sha256`` over pickle, ``xxhash_cbor``) give other
keys and are not reproduced here.

Errors, beyond :mod:`kvstore.errors`::

    InvalidArgument
    └── InvalidHashInput      bad seed, block size, token id, parent or extra key
        └── ChainTooLong      more tokens than one chain may hash
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterable, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any

import cbor2

from kvstore.errors import InvalidArgument

DIGEST_BYTES = 32
EVENT_KEY_BYTES = 8
MAX_CHAIN_TOKENS = 1 << 20
MAX_BLOCK_SIZE = 1 << 16
MAX_TOKEN_ID = (1 << 64) - 1  # larger ints become CBOR bignums; no vocabulary is that big
MAX_EXTRA_ITEMS = 64
MAX_EXTRA_DEPTH = 4
_U64 = (1 << 64) - 1

ExtraKeys = tuple[Any, ...] | None


class InvalidHashInput(InvalidArgument):
    pass


class ChainTooLong(InvalidHashInput):
    pass


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of the canonical CBOR encoding."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(hash_seed: str) -> bytes:
    """The parent hash of block 0 for an engine started with ``PYTHONHASHSEED=hash_seed``."""
    return sha256_cbor(_check_seed(hash_seed))


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: ExtraKeys = None) -> bytes:
    """One link of the chain (vLLM ``hash_block_tokens``); inputs are not validated here."""
    return sha256_cbor((parent, tuple(token_ids), extra_keys))


def event_key(block_hash: bytes | int) -> int:
    """The 64-bit key vLLM puts in KV events for ``block_hash`` (a 32-byte digest).

    An int is taken as already in event form and returned after a range check.
    """
    if isinstance(block_hash, bool):
        raise InvalidHashInput("block hash must be 32 bytes or a 64-bit int, not bool")
    if isinstance(block_hash, int):
        if not 0 <= block_hash <= _U64:
            raise InvalidHashInput(f"event block hash {block_hash} is outside 0..2**64-1")
        return block_hash
    return int.from_bytes(_check_digest(block_hash, "block hash"), "big") & _U64


def event_key_bytes(block_hash: bytes | int) -> bytes:
    """The event key as 8 big-endian bytes, one name per block whichever form the event used."""
    return event_key(block_hash).to_bytes(EVENT_KEY_BYTES, "big")


@dataclass(frozen=True)
class BlockHasher:
    """Computes vLLM ``sha256_cbor`` block keys for one engine configuration.

    ``hash_seed`` is the engine's ``PYTHONHASHSEED`` exactly as set (a string);
    ``lora_name`` the adapter name the request used, or ``None`` for the base model.
    """

    block_size: int
    hash_seed: str
    lora_name: str | None = None
    max_tokens: int = MAX_CHAIN_TOKENS
    _none_hash: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise InvalidHashInput(f"block_size must be an int, not {type(self.block_size).__name__}")
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise InvalidHashInput(
                f"block_size is {self.block_size}; use the engine's --block-size (1..{MAX_BLOCK_SIZE})"
            )
        if self.lora_name is not None and not isinstance(self.lora_name, str):
            raise InvalidHashInput(f"lora_name must be a str or None, not {type(self.lora_name).__name__}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidHashInput(f"max_tokens must be a positive int, not {self.max_tokens!r}")
        object.__setattr__(self, "_none_hash", none_hash(self.hash_seed))

    def none_hash(self) -> bytes:
        return self._none_hash

    def block_extra_keys(
        self, block_index: int, cache_salt: str | None = None, items: Sequence[Any] | None = None
    ) -> ExtraKeys:
        """``extra_i`` for block ``block_index`` (vLLM ``generate_block_hash_extra_keys``).

        ``items`` take the place of vLLM's multimodal keys: after the LoRA name,
        before the salt. The salt joins block 0 only, and only when non-empty.
        """
        keys: list[Any] = []
        if self.lora_name is not None:
            keys.append(self.lora_name)
        if items:
            keys.extend(items)
        if block_index == 0 and cache_salt:
            keys.append(cache_salt)
        return tuple(keys) if keys else None

    def chain(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
        *,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """32-byte keys of every full block of ``token_ids``, in order.

        ``extra_keys``, if given, has one entry per full block (``None`` or a
        sequence of str/bytes/int items, nested tuples allowed). ``parent``
        continues a chain from the 32-byte key of the block before
        ``token_ids[0]``; the salt belongs to block 0 and is refused with it.
        """
        tokens = _check_tokens(token_ids, self.max_tokens)
        n_blocks = len(tokens) // self.block_size
        salt = _check_salt(cache_salt)
        if parent is not None:
            prev = _check_digest(parent, "parent")
            if salt:
                raise InvalidHashInput(
                    "cache_salt only enters block 0's key; it cannot apply to a chain continued from a parent"
                )
            first_index = 1
        else:
            prev = self._none_hash
            first_index = 0
        per_block = _check_extra_keys(extra_keys, n_blocks)

        bs = self.block_size
        keys: list[bytes] = []
        for i in range(n_blocks):
            extra = self.block_extra_keys(first_index + i, salt, per_block[i] if per_block else None)
            prev = sha256_cbor((prev, tokens[i * bs : (i + 1) * bs], extra))
            keys.append(prev)
        return keys

    def event_keys(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
    ) -> list[int]:
        """The 64-bit keys vLLM would publish in a ``BlockStored`` for these tokens."""
        return [event_key(h) for h in self.chain(token_ids, cache_salt, extra_keys)]


def _check_seed(hash_seed: Any) -> str:
    if hash_seed is None:
        raise InvalidHashInput(
            "hash_seed is required: with PYTHONHASHSEED unset vLLM seeds block hashes from "
            "os.urandom and its keys cannot be reproduced; start the engine with "
            "PYTHONHASHSEED=<value> and pass the same value here"
        )
    if not isinstance(hash_seed, str):
        raise InvalidHashInput(
            f"hash_seed must be the PYTHONHASHSEED text (a str such as '42'), not {type(hash_seed).__name__}"
        )
    return hash_seed


def _check_salt(cache_salt: Any) -> str | None:
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidHashInput(f"cache_salt must be a str or None, not {type(cache_salt).__name__}")
    return cache_salt


def _check_digest(value: Any, what: str) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidHashInput(f"{what} must be a {DIGEST_BYTES}-byte digest, not {type(value).__name__}")
    value = bytes(value)
    if len(value) != DIGEST_BYTES:
        raise InvalidHashInput(
            f"{what} is {len(value)} bytes; a sha256_cbor block hash is {DIGEST_BYTES} "
            "(a 64-bit event key cannot be extended back to one)"
        )
    return value


def _check_tokens(token_ids: Any, limit: int) -> tuple[int, ...]:
    if (
        isinstance(token_ids, (str, bytes, bytearray))
        or not isinstance(token_ids, Sized)
        or not isinstance(token_ids, Iterable)
    ):
        raise InvalidHashInput(f"token_ids must be a sequence of ints, not {type(token_ids).__name__}")
    if len(token_ids) > limit:
        raise ChainTooLong(
            f"{len(token_ids)} tokens exceed the limit of {limit} per chain; hash a shorter prefix"
        )
    if all(type(t) is int for t in token_ids):
        tokens = tuple(token_ids)
    else:
        out = []
        for pos, t in enumerate(token_ids):
            if isinstance(t, bool):
                raise InvalidHashInput(f"token_ids[{pos}] is a bool; token ids are ints")
            try:
                out.append(operator.index(t))
            except TypeError:
                raise InvalidHashInput(
                    f"token_ids[{pos}] is {type(t).__name__}; token ids are ints"
                ) from None
        tokens = tuple(out)
    if tokens and (min(tokens) < 0 or max(tokens) > MAX_TOKEN_ID):
        pos, bad = next((p, t) for p, t in enumerate(tokens) if not 0 <= t <= MAX_TOKEN_ID)
        raise InvalidHashInput(f"token_ids[{pos}] is {bad}; token ids are in 0..2**64-1")
    return tokens


def _check_extra_keys(extra_keys: Any, n_blocks: int) -> list[tuple[Any, ...] | None] | None:
    if extra_keys is None:
        return None
    if isinstance(extra_keys, (str, bytes)) or not isinstance(extra_keys, Sequence):
        raise InvalidHashInput("extra_keys must be a sequence with one entry per full block")
    if len(extra_keys) != n_blocks:
        raise InvalidHashInput(
            f"extra_keys has {len(extra_keys)} entries for {n_blocks} full blocks; give one per full block"
        )
    out: list[tuple[Any, ...] | None] = []
    for i, entry in enumerate(extra_keys):
        if entry is None:
            out.append(None)
            continue
        if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence):
            raise InvalidHashInput(
                f"extra_keys[{i}] must be None or a sequence of items, not {type(entry).__name__}"
            )
        if len(entry) > MAX_EXTRA_ITEMS:
            raise InvalidHashInput(f"extra_keys[{i}] has {len(entry)} items; the limit is {MAX_EXTRA_ITEMS}")
        out.append(tuple(_check_item(item, f"extra_keys[{i}]", 1) for item in entry))
    return out


def _check_item(item: Any, where: str, depth: int) -> Any:
    if item is None or isinstance(item, (str, bytes)):
        return item
    if isinstance(item, int) and not isinstance(item, bool):
        return item
    if isinstance(item, (tuple, list)):
        if depth >= MAX_EXTRA_DEPTH or len(item) > MAX_EXTRA_ITEMS:
            raise InvalidHashInput(
                f"{where} nests too deep or too wide (limits {MAX_EXTRA_DEPTH}, {MAX_EXTRA_ITEMS})"
            )
        return tuple(_check_item(x, where, depth + 1) for x in item)
    raise InvalidHashInput(
        f"{where} holds a {type(item).__name__}; extra keys are str, bytes, int or tuples of them"
    )
