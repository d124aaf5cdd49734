"""Block keys match vLLM's ``sha256_cbor`` prefix hashing, checked against a real engine's event."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import InvalidArgument
from kvstore.index.keys import (
    MAX_CHAIN_TOKENS,
    BlockHasher,
    ChainTooLong,
    InvalidHashInput,
    event_key,
    event_key_bytes,
    hash_block,
    none_hash,
)

VECTOR_PATH = Path(__file__).resolve().parents[1] / "data" / "vllm_kv_events" / "base_seed42_block16.json"


@pytest.fixture(scope="module")
def vector() -> dict:
    return json.loads(VECTOR_PATH.read_text())


@pytest.fixture(scope="module")
def hasher(vector) -> BlockHasher:
    return BlockHasher(block_size=vector["block_size"], hash_seed=vector["hash_seed"])


# -- the captured vLLM event ---------------------------------------------------------------


def test_vector_is_what_the_tests_assume(vector):
    assert vector["event_type"] == "BlockStored"
    assert vector["hash_seed"] == "42" and vector["block_size"] == 16
    assert vector["lora_name"] is None
    assert len(vector["token_ids"]) == 400 and len(vector["block_hashes"]) == 25


def test_reproduces_every_block_hash_of_the_vllm_event(vector, hasher):
    assert hasher.event_keys(vector["token_ids"]) == vector["block_hashes"]


def test_event_key_is_the_low_64_bits_of_the_digest(vector, hasher):
    chain = hasher.chain(vector["token_ids"])
    assert all(len(h) == 32 for h in chain)
    for digest, published in zip(chain, vector["block_hashes"], strict=True):
        assert event_key(digest) == int.from_bytes(digest, "big") & (2**64 - 1) == published
        # The last eight bytes, not the first: the same 8-byte name from either event form.
        assert event_key_bytes(digest) == digest[-8:] == published.to_bytes(8, "big")
        assert event_key_bytes(published) == event_key_bytes(digest)


def test_parent_of_the_event_is_what_the_chain_implies(vector, hasher):
    # The event stores blocks 0..24, so it has no parent; vLLM sends None there.
    assert vector["parent_block_hash"] is None
    chain = hasher.chain(vector["token_ids"])
    # A later store continuing from block k names block k-1 as its parent, in event form.
    k = 10
    tail = hasher.chain(vector["token_ids"][k * 16 :], parent=chain[k - 1])
    assert tail == chain[k:]
    assert [event_key(h) for h in tail] == vector["block_hashes"][k:]
    assert event_key(chain[k - 1]) == vector["block_hashes"][k - 1]


# -- the algorithm, independently of the vector -----------------------------------------------


def test_none_hash_is_sha256_of_the_seed_text_in_cbor():
    # cbor("42") is a 2-byte text string: 0x62 '4' '2'.
    assert none_hash("42") == hashlib.sha256(b"\x62" + b"42").digest()
    assert BlockHasher(block_size=16, hash_seed="42").none_hash() == none_hash("42")


def test_block_encoding_is_canonical_cbor_of_parent_tokens_extra():
    parent = none_hash("0")
    tokens = (1, 2, 3, 500)
    # array(3) [ bytes(32) parent, array(4) [1, 2, 3, uint16 500], null ]
    encoded = b"\x83" + b"\x58\x20" + parent + b"\x84\x01\x02\x03\x19\x01\xf4" + b"\xf6"
    assert hash_block(parent, tokens) == hashlib.sha256(encoded).digest()
    h = BlockHasher(block_size=4, hash_seed="0")
    assert h.chain(list(tokens)) == [hashlib.sha256(encoded).digest()]
    # extra keys are a CBOR array: ("a",) -> 0x81 0x61 'a'
    with_extra = encoded[:-1] + b"\x81\x61a"
    assert BlockHasher(block_size=4, hash_seed="0", lora_name="a").chain(list(tokens)) == [
        hashlib.sha256(with_extra).digest()
    ]


def test_only_full_blocks_get_keys(vector, hasher):
    tokens = vector["token_ids"]
    assert hasher.chain(tokens[:15]) == []
    assert hasher.chain([]) == []
    full = hasher.chain(tokens)
    assert hasher.chain(tokens + [7] * 15) == full
    assert hasher.chain(tokens[: 3 * 16 + 5]) == full[:3]


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.integers(1, 8),
    head=st.lists(st.integers(0, 2**20), max_size=40),
    tail=st.lists(st.integers(0, 2**20), max_size=40),
)
def test_a_prefix_keeps_its_keys(block_size, head, tail):
    h = BlockHasher(block_size=block_size, hash_seed="7")
    full = h.chain(head + tail)
    assert len(full) == (len(head) + len(tail)) // block_size
    assert h.chain(head) == full[: len(head) // block_size]


def test_lora_name_changes_every_key(vector, hasher):
    tokens = vector["token_ids"]
    base = hasher.chain(tokens)
    lora = BlockHasher(block_size=16, hash_seed="42", lora_name="alice").chain(tokens)
    other = BlockHasher(block_size=16, hash_seed="42", lora_name="bob").chain(tokens)
    assert len(lora) == len(base) == len(other)
    assert all(a != b for a, b in zip(base, lora, strict=True))
    assert all(a != b for a, b in zip(lora, other, strict=True))
    # The name joins every block's extra keys, not only block 0's.
    first = hash_block(none_hash("42"), tokens[:16], ("alice",))
    assert lora[0] == first
    assert lora[1] == hash_block(first, tokens[16:32], ("alice",))


def test_cache_salt_enters_block_zero_and_changes_every_key(vector, hasher):
    tokens = vector["token_ids"]
    base = hasher.chain(tokens)
    salted = hasher.chain(tokens, cache_salt="tenant-a")
    assert all(a != b for a, b in zip(base, salted, strict=True))
    assert hasher.block_extra_keys(0, "tenant-a") == ("tenant-a",)
    assert hasher.block_extra_keys(1, "tenant-a") is None
    # Block 1 carries no salt of its own: it differs only through its parent.
    assert salted[0] == hash_block(none_hash("42"), tokens[:16], ("tenant-a",))
    assert salted[1] == hash_block(salted[0], tokens[16:32], None)
    assert hasher.chain(tokens, cache_salt="tenant-b") != salted
    # vLLM adds the salt only when it is non-empty.
    assert hasher.chain(tokens, cache_salt="") == base


def test_extra_keys_order_is_lora_then_items_then_salt():
    h = BlockHasher(block_size=2, hash_seed="1", lora_name="L")
    assert h.block_extra_keys(0, "S", [("mm", 0)]) == ("L", ("mm", 0), "S")
    assert h.block_extra_keys(1, "S", [("mm", 0)]) == ("L", ("mm", 0))
    tokens = [1, 2, 3, 4, 5]
    keys = h.chain(tokens, cache_salt="S", extra_keys=[[("mm", 0)], None])
    assert keys[0] == hash_block(none_hash("1"), [1, 2], ("L", ("mm", 0), "S"))
    assert keys[1] == hash_block(keys[0], [3, 4], ("L",))
    assert keys != h.chain(tokens, cache_salt="S")


def test_different_seeds_give_different_keys(vector):
    tokens = vector["token_ids"]
    seeds = ("42", "43", "042", "0")
    keys = {seed: BlockHasher(block_size=16, hash_seed=seed).chain(tokens) for seed in seeds}
    assert len({tuple(v) for v in keys.values()}) == 4
    assert all(len({k[i] for k in keys.values()}) == 4 for i in range(25))


_SUBPROCESS = """
import json, sys
from kvstore.index.keys import BlockHasher
v = json.load(open(sys.argv[1]))
h = BlockHasher(block_size=v["block_size"], hash_seed=v["hash_seed"], lora_name="alice")
print(json.dumps([k.hex() for k in h.chain(v["token_ids"], cache_salt="s")]))
"""


@pytest.mark.system
@pytest.mark.parametrize("process_seed", ["0", "12345", "random", None])
def test_keys_do_not_depend_on_the_process_hash_seed(vector, process_seed):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if process_seed is not None:
        env["PYTHONHASHSEED"] = process_seed
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS, str(VECTOR_PATH)],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    here = BlockHasher(block_size=16, hash_seed="42", lora_name="alice").chain(
        vector["token_ids"], cache_salt="s"
    )
    assert json.loads(out) == [k.hex() for k in here]


def test_numpy_and_tuple_token_ids_hash_like_lists(vector, hasher):
    tokens = vector["token_ids"]
    assert hasher.chain(np.array(tokens, dtype=np.int64)) == hasher.chain(tokens)
    assert hasher.chain(tuple(tokens)) == hasher.chain(tokens)


# -- refused input ---------------------------------------------------------------------------


def test_a_seed_is_required():
    with pytest.raises(InvalidHashInput, match="PYTHONHASHSEED"):
        BlockHasher(block_size=16, hash_seed=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidHashInput, match="str"):
        BlockHasher(block_size=16, hash_seed=42)  # type: ignore[arg-type]
    with pytest.raises(InvalidHashInput):
        none_hash(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("block_size", [0, -1, True, 1.5, "16", 1 << 17])
def test_bad_block_size_is_refused(block_size):
    with pytest.raises(InvalidArgument, match="block_size"):
        BlockHasher(block_size=block_size, hash_seed="42")


def test_bad_lora_name_is_refused():
    with pytest.raises(InvalidHashInput, match="lora_name"):
        BlockHasher(block_size=16, hash_seed="42", lora_name=b"x")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "tokens, what",
    [
        ([1, -1], r"token_ids\[1\] is -1"),
        ([1, 2**64], r"token_ids\[1\]"),
        ([True, 2], r"token_ids\[0\] is a bool"),
        ([1.0, 2], r"token_ids\[0\] is float"),
        ("abc", "sequence of ints"),
        (b"abc", "sequence of ints"),
        (iter([1, 2]), "sequence of ints"),
        (None, "sequence of ints"),
    ],
)
def test_bad_token_ids_are_refused(hasher, tokens, what):
    with pytest.raises(InvalidHashInput, match=what):
        hasher.chain(tokens)


def test_a_chain_over_the_limit_is_refused():
    h = BlockHasher(block_size=16, hash_seed="42")
    with pytest.raises(ChainTooLong, match="limit"):
        h.chain([0] * (MAX_CHAIN_TOKENS + 1))
    small = BlockHasher(block_size=4, hash_seed="42", max_tokens=8)
    assert len(small.chain([0] * 8)) == 2
    with pytest.raises(ChainTooLong):
        small.chain([0] * 9)
    assert issubclass(ChainTooLong, InvalidArgument)


def test_bad_parent_and_salt_with_parent_are_refused(hasher):
    with pytest.raises(InvalidHashInput, match="32"):
        hasher.chain([1] * 16, parent=b"\x00" * 8)
    with pytest.raises(InvalidHashInput, match="digest"):
        hasher.chain([1] * 16, parent=12345)  # type: ignore[arg-type]
    with pytest.raises(InvalidHashInput, match="block 0"):
        hasher.chain([1] * 16, cache_salt="s", parent=hasher.none_hash())
    with pytest.raises(InvalidHashInput, match="cache_salt"):
        hasher.chain([1] * 16, cache_salt=5)  # type: ignore[arg-type]


def test_bad_extra_keys_are_refused(hasher):
    tokens = [1] * 32
    with pytest.raises(InvalidHashInput, match="one per full block"):
        hasher.chain(tokens, extra_keys=[None])
    with pytest.raises(InvalidHashInput, match="float"):
        hasher.chain(tokens, extra_keys=[None, [1.5]])
    with pytest.raises(InvalidHashInput, match="sequence of items"):
        hasher.chain(tokens, extra_keys=[None, "mm"])
    with pytest.raises(InvalidHashInput, match="too deep"):
        hasher.chain(tokens, extra_keys=[None, [((((1,),),),)]])


def test_event_key_checks_its_input():
    assert event_key(0) == 0 and event_key(2**64 - 1) == 2**64 - 1
    assert event_key_bytes(1) == b"\x00" * 7 + b"\x01"
    for bad in (-1, 2**64, True):
        with pytest.raises(InvalidHashInput):
            event_key(bad)
    for bad in (b"", b"\x01" * 8, b"\x01" * 33, "ab" * 16):
        with pytest.raises(InvalidHashInput):
            event_key_bytes(bad)
