"""The object tier's pure parts: object names, the object format, credentials from AWS variables and files."""

from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.block import BlockKey, BlockMeta, checksum
from kvstore.errors import CorruptBlock, InvalidArgument
from kvstore.remote.object import credentials
from kvstore.remote.object.format import (
    FIXED_BYTES, MAGIC, PROBE_BYTES, UnknownFormat, decode_header, encode, header_length,
)
from kvstore.remote.object.layout import MAX_HEX_KEY_BYTES, KeyLayout, check_prefix

NAMESPACES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:/@+=-]{0,40}", fullmatch=True)
KEYS = st.binary(min_size=1, max_size=1024)


def block(n: int, seed: int = 0) -> tuple[bytes, BlockMeta]:
    data = random.Random(seed).randbytes(n)
    return data, BlockMeta(n, checksum(data), b"\x00parent", "f16[2,32,8,128]")


# ---- names -------------------------------------------------------------------------------------


@given(NAMESPACES, KEYS)
def test_every_block_has_one_name_that_parses_back(namespace, key):
    layout = KeyLayout("strata/kv")
    path = layout.path(BlockKey(namespace, key))
    assert len(path.encode()) <= 1024, "S3 names are at most 1024 bytes"
    assert path.startswith(layout.namespace_root(namespace)) and path.count("/") == 3
    parsed_ns, parsed_key = layout.parse(path)
    assert parsed_ns == namespace
    assert parsed_key == (key if len(key) <= MAX_HEX_KEY_BYTES else None)


def test_names_are_readable_and_a_namespace_never_contains_another():
    layout = KeyLayout("/strata/")
    assert layout.path(BlockKey("llama-3-8b", b"\xab\x01")) == "strata/llama-3-8b/ab01"
    assert layout.path(BlockKey("org/model", b"\x01")) == "strata/org~2Fmodel/01"
    assert not layout.path(BlockKey("org/model", b"\x01")).startswith(layout.namespace_root("org"))
    long = layout.path(BlockKey("m", b"k" * (MAX_HEX_KEY_BYTES + 1)))
    assert long.split("/")[-1].startswith("~") and len(long.split("/")[-1]) == 65
    assert KeyLayout("").path(BlockKey("m", b"\x01")) == "m/01"


@pytest.mark.parametrize("path", ["other/m/01", "strata/m", "strata/m/0g", "strata/m/01/02", "strata/m~zz/01",
                                  "strata/m~41/01", "strata//01", "strata/m/~12"])
def test_names_of_other_objects_do_not_parse(path):
    assert KeyLayout("strata").parse(path) is None


@pytest.mark.parametrize("prefix", ["a//b", "a/../b", "a b", "x" * 201, "./a"])
def test_a_bad_prefix_is_refused_with_the_rule(prefix):
    with pytest.raises(InvalidArgument, match="segments of"):
        check_prefix(prefix)


# ---- the object format ---------------------------------------------------------------------------


@given(NAMESPACES, KEYS, st.binary(max_size=5000), st.one_of(st.none(), st.binary(max_size=1024)),
       st.text(max_size=200))
def test_an_object_holds_its_block_and_every_field_of_its_meta(namespace, key, data, parent, layout):
    k = BlockKey(namespace, key)
    meta = BlockMeta(len(data), checksum(data), parent, layout)
    obj = encode(k, memoryview(data), meta, 1_700_000_000.5)
    header = decode_header(obj[:header_length(obj)], k)
    assert header.meta == meta and header.key == k and header.written_at == 1_700_000_000.5
    assert bytes(obj[header.header_bytes:]) == data and header.object_bytes == len(obj)


def test_usual_headers_fit_in_one_probe():
    data, meta = block(100)
    obj = encode(BlockKey("llama-3-8b", bytes(32)), data, meta, 0.0)
    assert header_length(obj) < PROBE_BYTES // 8


def test_bytes_that_do_not_match_their_meta_make_no_object():
    data, meta = block(1000)
    with pytest.raises(CorruptBlock, match="checksum"):
        encode(BlockKey("m", b"k"), data, BlockMeta(meta.size, meta.checksum ^ 1), 0.0)
    with pytest.raises(CorruptBlock, match="meta says"):
        encode(BlockKey("m", b"k"), data[:-1], meta, 0.0)


def test_every_damaged_header_byte_is_caught():
    k = BlockKey("m", b"k")
    data, meta = block(64)
    obj = encode(k, data, meta, 0.0)
    end = header_length(obj)
    for i in range(end):
        if 4 <= i < 8:  # version, flags, reserved: a newer format, not damage (below)
            continue
        damaged = bytearray(obj[:end])
        damaged[i] ^= 0x01
        with pytest.raises(CorruptBlock):
            decode_header(damaged, k)


def test_a_header_naming_another_block_is_corrupt_and_a_short_object_too():
    data, meta = block(64)
    obj = encode(BlockKey("m", b"k"), data, meta, 0.0)
    with pytest.raises(CorruptBlock, match="holds block"):
        decode_header(obj, BlockKey("m", b"other"))
    with pytest.raises(CorruptBlock):
        header_length(obj[:FIXED_BYTES - 1])
    with pytest.raises(CorruptBlock, match="shorter than its own header"):
        decode_header(obj[:FIXED_BYTES + 3], BlockKey("m", b"k"))
    with pytest.raises(CorruptBlock, match="magic"):
        header_length(b"PK\x03\x04" + bytes(FIXED_BYTES))


def test_a_newer_format_is_not_judged():
    data, meta = block(64)
    obj = bytearray(encode(BlockKey("m", b"k"), data, meta, 0.0))
    newer = bytearray(obj)
    newer[4] = 2
    with pytest.raises(UnknownFormat):
        header_length(newer)
    flagged = bytearray(obj)
    flagged[5] = 1
    with pytest.raises(UnknownFormat):
        decode_header(flagged, BlockKey("m", b"k"))
    assert struct.unpack_from("<4s", obj)[0] == MAGIC


# ---- credentials -----------------------------------------------------------------------------------


def test_credentials_from_the_variables_first(tmp_path):
    env = {"AWS_ACCESS_KEY_ID": "AKIAENV", "AWS_SECRET_ACCESS_KEY": "s3cr3t-env", "AWS_SESSION_TOKEN": "tok",
           "AWS_REGION": "eu-west-1", "HOME": str(tmp_path)}
    found = credentials.resolve(env)
    assert found.credentials.access_key_id == "AKIAENV" and found.credentials.session_token == "tok"
    assert found.region == "eu-west-1" and found.credentials.source == "environment"
    assert "s3cr3t" not in repr(found) and "tok" not in repr(found.credentials)
    with pytest.raises(InvalidArgument, match="together"):
        credentials.resolve({"AWS_ACCESS_KEY_ID": "AKIA", "HOME": str(tmp_path)})


def test_credentials_and_region_from_the_files_by_profile(tmp_path):
    aws = tmp_path / ".aws"
    aws.mkdir()
    (aws / "credentials").write_text(
        "[default]\naws_access_key_id = AKIADEF\naws_secret_access_key = def-secret\n\n"
        "[team]\naws_access_key_id = AKIATEAM\naws_secret_access_key = team-secret\n\n[role]\nrole_arn = arn:x\n"
    )
    (aws / "config").write_text("[default]\nregion = us-west-2\n\n[profile team]\nregion = ap-south-1\n")
    home = {"HOME": str(tmp_path)}
    found = credentials.resolve(home)
    assert (found.credentials.access_key_id, found.region) == ("AKIADEF", "us-west-2")
    found = credentials.resolve({**home, "AWS_PROFILE": "team"})
    assert (found.credentials.access_key_id, found.region) == ("AKIATEAM", "ap-south-1")
    assert credentials.resolve(home, profile="team", region="eu-north-1").region == "eu-north-1"
    role = credentials.resolve(home, profile="role")
    assert role.credentials is None and role.region == "us-east-1", "a role profile is left to obstore's chain"
    other = tmp_path / "other"
    other.write_text("[default]\naws_access_key_id = AKIAOTHER\n")
    with pytest.raises(InvalidArgument, match="only one of"):
        credentials.resolve({**home, "AWS_SHARED_CREDENTIALS_FILE": str(other)})
    assert "def-secret" not in repr(credentials.resolve(home))


def test_no_credentials_anywhere_leaves_them_to_the_instance(tmp_path):
    found = credentials.resolve({"HOME": str(tmp_path)})
    assert found.credentials is None and found.region == "us-east-1"


# ---- what an S3 answer means ---------------------------------------------------------------------


def test_s3_answers_are_told_apart_by_their_code():
    import obstore.exceptions as obx

    from kvstore.remote.object.client import classify

    def generic(status: int, code: str) -> Exception:
        return obx.GenericError(f"Error performing PUT http://h/b/k - Server returned non-2xx status code: "
                                f"{status} X: <Error><Code>{code}</Code></Error>")

    slow = classify(generic(503, "SlowDown"))
    assert (slow.code, slow.retryable, slow.slow_down) == ("SlowDown", True, True)
    assert classify(generic(500, "InternalError")).retryable and not classify(generic(500, "InternalError")).slow_down
    assert not classify(generic(400, "InvalidArgument")).retryable
    conflict = classify(obx.AlreadyExistsError("409 <Code>ConditionalRequestConflict</Code>"))
    assert conflict.retryable, "a create that raced a delete is tried again, never taken for 'present'"
    assert classify(obx.AlreadyExistsError("412 <Code>PreconditionFailed</Code>")).code == "PreconditionFailed"
    assert classify(FileNotFoundError("404 <Code>NoSuchBucket</Code>")).code == "NoSuchBucket"
    dropped = classify(obx.GenericError("HTTP error: error sending request ... HttpError {\n kind: Request, "
                                        "retry_timeout: 180s"))
    assert (dropped.code, dropped.retryable) == ("connection", True)
    assert classify(obx.GenericError("HttpError {\n kind: Timeout,")).code == "timeout"
