"""The safetensors dtypes, and what each becomes in numpy and in torch.

safetensors names 22 dtypes (version 0.8 of the format library). numpy has
no bfloat16, float8, float6 or float4, so for those the numpy view is the raw
storage (``uint16`` for BF16, ``uint8`` for the 8-bit floats) with the
safetensors name kept beside it in :class:`~weightcache.safetensors_header.TensorEntry`;
torch gets its real dtype, reinterpreted in place from the raw view (no copy).

Sub-byte dtypes pack several elements per byte. safetensors counts a
tensor's shape in elements (an F4 tensor of shape ``[3, 8]`` is 12 bytes),
so its byte size is ``prod(shape) * bits / 8`` and must be whole. Their
numpy view is the packed bytes: F4 keeps its shape with the last dimension
halved (what torch's ``float4_e2m1fn_x2`` means), F6 is a flat byte array
(4 elements in 3 bytes do not follow any dimension).

The table is the registry: a new safetensors dtype is one line here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DType:
    name: str  # the safetensors spelling: "BF16"
    bits: int  # per element
    numpy: str  # the numpy dtype of the view: the real type, or the raw storage when ``raw``
    torch: str | None  # attribute of the torch module; None: torch has no such dtype (raw uint8)
    raw: bool = False  # the numpy view holds storage bits, not values

    def nbytes(self, shape: tuple[int, ...]) -> int | None:
        """Bytes of a tensor of this shape; None when the elements do not fill whole bytes."""
        bits = math.prod(shape) * self.bits
        return bits // 8 if bits % 8 == 0 else None


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("F64", 64, "<f8", "float64"),
        DType("F32", 32, "<f4", "float32"),
        DType("F16", 16, "<f2", "float16"),
        DType("BF16", 16, "<u2", "bfloat16", raw=True),
        DType("I64", 64, "<i8", "int64"),
        DType("I32", 32, "<i4", "int32"),
        DType("I16", 16, "<i2", "int16"),
        DType("I8", 8, "i1", "int8"),
        DType("U64", 64, "<u8", "uint64"),
        DType("U32", 32, "<u4", "uint32"),
        DType("U16", 16, "<u2", "uint16"),
        DType("U8", 8, "u1", "uint8"),
        DType("BOOL", 8, "?", "bool"),
        DType("C64", 64, "<c8", "complex64"),
        DType("F8_E4M3", 8, "u1", "float8_e4m3fn", raw=True),
        DType("F8_E5M2", 8, "u1", "float8_e5m2", raw=True),
        DType("F8_E4M3FNUZ", 8, "u1", "float8_e4m3fnuz", raw=True),
        DType("F8_E5M2FNUZ", 8, "u1", "float8_e5m2fnuz", raw=True),
        DType("F8_E8M0", 8, "u1", "float8_e8m0fnu", raw=True),
        DType("F4", 4, "u1", "float4_e2m1fn_x2", raw=True),
        DType("F6_E2M3", 6, "u1", None, raw=True),
        DType("F6_E3M2", 6, "u1", None, raw=True),
    )
}


def storage_shape(dtype: DType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the raw view: the element shape for whole-byte dtypes, packed bytes otherwise."""
    if dtype.bits % 8 == 0:
        return shape
    if dtype.bits == 4 and shape and shape[-1] % 2 == 0:
        return (*shape[:-1], shape[-1] // 2)
    return (math.prod(shape) * dtype.bits // 8,)
