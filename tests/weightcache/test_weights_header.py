"""The safetensors header parser: the same tables as the safetensors library, and a clear
HeaderError (never another exception, never a wrong offset) for every broken header."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, strategies as st

from tests.support.weightcache_helpers import parse_file
from tests.support.weights_models import f6_file, numpy_tensors, safetensors_file, torch_tensors, write_torch_model
from weightcache.dtypes import DTYPES
from weightcache.errors import HeaderError
from weightcache.safetensors_header import LENGTH_BYTES, header_length, parse_header


def test_tables_match_what_safetensors_wrote(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save

    tensors = numpy_tensors(seed=1)
    blob = save(tensors, metadata={"k": "v"})
    header = parse_file(blob)
    assert header.metadata == {"k": "v"}
    assert {t.name for t in header.tensors} == set(tensors)
    path = tmp_path / "m.safetensors"
    path.write_bytes(blob)
    with safe_open(str(path), framework="numpy") as f:
        for t in header.tensors:
            want = f.get_tensor(t.name)
            assert t.shape == want.shape
            got = np.frombuffer(blob, dtype=want.dtype, count=want.size, offset=header.data_start + t.begin)
            np.testing.assert_array_equal(got.reshape(want.shape), want)


def test_every_dtype_safetensors_knows_is_known_here(tmp_path):
    torch = pytest.importorskip("torch")
    path = write_torch_model(tmp_path, torch_tensors())
    names = {t.dtype for t in parse_file(path.read_bytes()).tensors}
    f6_file(tmp_path / "f6.safetensors")
    names |= {t.dtype for t in parse_file((tmp_path / "f6.safetensors").read_bytes()).tensors}
    names |= {t.dtype for t in parse_file(_numpy_blob()).tensors}
    assert names == set(DTYPES), "a dtype the test models do not cover, or one this parser lacks"
    assert torch is not None


def _numpy_blob() -> bytes:
    from safetensors.numpy import save

    return save(numpy_tensors())


def _file(header, data=b"", length=None):
    return safetensors_file(header, data, length)


BAD = {
    "empty file": b"",
    "shorter than the length": b"\x05\x00\x00",
    "zero length": struct.pack("<Q", 0),
    "length past the file": _file(b'{"a": 1}', length=1000),
    "length over the limit": struct.pack("<Q", 200_000_000) + b"{}",
    "truncated JSON": _file(b'{"a": {"dtype": "F32", "sha'),
    "not UTF-8": _file(b'{"\xff": 1}'),
    "not an object": _file(b"[1, 2]"),
    "repeated name": _file(b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
                           b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}', b"xx"),
    "unknown dtype": _file({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"x" * 16),
    "negative size": _file({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}),
    "bool in shape": _file({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"x"),
    "float offsets": _file({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1.0]}}, b"x"),
    "begin after end": _file({"a": {"dtype": "U8", "shape": [0], "data_offsets": [4, 2]}}, b"xxxx"),
    "size does not match shape": _file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"x" * 8),
    "sub-byte elements": _file({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, b"xx"),
    "past the file": _file({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, b"x" * 4),
    "overlapping": _file({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                          "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, b"x" * 6),
    "metadata not strings": _file({"__metadata__": {"a": 1}}),
    "entry not an object": _file({"a": [1, 2]}),
    "nested deeper than JSON's parser goes": _file(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "a number of 5000 digits": _file(b'{"a": {"dtype": "U8", "shape": [' + b"7" * 5000 + b'], "data_offsets": [0, 0]}}'),
    "zero-size with a dimension of 2**70": _file({"a": {"dtype": "F32", "shape": [0, 2 ** 70], "data_offsets": [0, 0]}}),
    "zero-size, its other dimensions overflowing": _file(
        {"a": {"dtype": "U8", "shape": [0, 2 ** 32, 2 ** 32, 2 ** 32], "data_offsets": [0, 0]}}),
}


@pytest.mark.parametrize("blob", BAD.values(), ids=BAD.keys())
def test_broken_headers_are_refused_with_the_reason(blob):
    with pytest.raises(HeaderError) as info:
        parse_file(blob)
    assert "m.safetensors" in str(info.value)


def test_messages_name_the_tensor_and_the_fix():
    with pytest.raises(HeaderError, match=r"tensors 'a' \[0, 4\) and 'b' \[2, 6\) overlap"):
        parse_file(BAD["overlapping"])
    with pytest.raises(HeaderError, match="past the end of the file"):
        parse_file(BAD["past the file"])
    with pytest.raises(HeaderError, match="truncated.*re-upload"):
        parse_file(BAD["length past the file"])


def test_a_shape_no_framework_can_describe_is_refused_by_name():
    with pytest.raises(HeaderError, match=r"tensor 'a': shape \[0, 1180591620717411303424\] of F32 is over 1 PiB"):
        parse_file(BAD["zero-size with a dimension of 2**70"])
    with pytest.raises(HeaderError, match="nests too deeply"):
        parse_file(BAD["nested deeper than JSON's parser goes"])


def test_every_accepted_shape_makes_a_numpy_view_and_a_torch_tensor():
    """What the parser accepts, the frameworks build: a zero-size tensor at the bound is made, not refused."""
    from weightcache.safetensors_header import MAX_TENSOR_BYTES
    from weightcache.tensors import numpy_tensor

    blob = _file({"a": {"dtype": "U8", "shape": [0, MAX_TENSOR_BYTES], "data_offsets": [0, 0]},
                  "b": {"dtype": "F4", "shape": [MAX_TENSOR_BYTES, 0, 2], "data_offsets": [0, 0]}})
    for t in parse_file(blob).tensors:
        assert numpy_tensor(t, b"", 0).size == 0
    torch = pytest.importorskip("torch")
    from weightcache.tensors import torch_tensor

    for t in parse_file(blob).tensors:
        assert torch_tensor(t, b"", 0).numel() == 0 and torch is not None


@pytest.mark.system
def test_publish_refuses_a_hostile_header_naming_the_file_without_a_traceback(tmp_path):
    """``strata weights publish`` of a nested or oversized header: exit 1, the file and the reason."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for case, reason in (("nested deeper than JSON's parser goes", "nests too deeply"),
                         ("zero-size with a dimension of 2**70", "over 1 PiB")):
        folder = tmp_path / case.replace(" ", "_").replace("*", "")
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(BAD[case])
        done = subprocess.run([sys.executable, "-m", "weightcache", "publish", str(folder), "--no-progress"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr
        assert f"{folder}/model.safetensors" in done.stderr and reason in done.stderr
        assert not (folder / ".strata" / "latest").exists()


def test_gaps_and_zero_sized_tensors_are_accepted():
    blob = _file({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                  "z": {"dtype": "F32", "shape": [0, 3], "data_offsets": [2, 2]},
                  "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}}, b"x" * 6)
    assert [t.name for t in parse_file(blob).tensors] == ["a", "z", "b"]


@given(st.binary(max_size=300))
def test_random_bytes_never_raise_anything_but_header_error(blob):
    try:
        parse_file(blob)
    except HeaderError:
        pass


@given(st.dictionaries(st.text(max_size=5), st.fixed_dictionaries({
    "dtype": st.sampled_from([*DTYPES, "X"]),
    "shape": st.lists(st.integers(-2, 5), max_size=3),
    "data_offsets": st.lists(st.integers(-2, 40), min_size=2, max_size=2),
}), max_size=4), st.integers(0, 48))
def test_random_tables_are_refused_or_inside_the_file_and_disjoint(header, data_len):
    blob = _file(header, b"\0" * data_len)
    try:
        parsed = parse_file(blob)
    except HeaderError:
        return
    end = 0
    for t in parsed.tensors:
        assert parsed.data_start + t.end <= len(blob)
        if t.nbytes:
            assert t.begin >= end
            end = t.end


def test_header_length_alone():
    assert header_length(struct.pack("<Q", 2), 10, "f") == 2
    with pytest.raises(HeaderError):
        header_length(b"\0" * LENGTH_BYTES, 10, "f")
    assert parse_header(b"{}", 10, "f").tensors == ()
