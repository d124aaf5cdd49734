"""Test models for the weight pipeline, written by the safetensors library itself.

Every dtype safetensors knows is covered: through numpy where numpy has the
type, through torch for the rest (bf16, the float8s, F4), and F6 (which
neither framework writes) by hand, to the byte layout the format defines.
Sizes stay small (a few MB a model): moto re-reads a whole object for each
ranged GET.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

NUMPY_DTYPES = ("float64", "float32", "float16", "int64", "int32", "int16", "int8",
                "uint64", "uint32", "uint16", "uint8", "bool", "complex64")


def numpy_tensors(seed: int = 0, scale: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i, dt in enumerate(NUMPY_DTYPES):
        shape = (3 + i, 17 * scale)
        if dt == "bool":
            out[f"np.{dt}"] = rng.integers(0, 2, shape).astype(bool)
        elif dt.startswith(("int", "uint")):
            out[f"np.{dt}"] = rng.integers(0, 100, shape).astype(dt)
        elif dt == "complex64":
            out[f"np.{dt}"] = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
        else:
            out[f"np.{dt}"] = rng.standard_normal(shape).astype(dt)
    out["np.empty"] = np.zeros((0, 4), np.float32)
    out["np.scalar"] = np.array(3.5, np.float32)
    return out


def torch_tensors(seed: int = 0, scale: int = 1) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    base = torch.randn(37, 29 * scale, generator=g)
    out = {
        "pt.bf16": base.to(torch.bfloat16),
        "pt.f16": base.to(torch.float16),
        "pt.f32": base,
        "pt.f8_e4m3": base.to(torch.float8_e4m3fn),
        "pt.f8_e5m2": base.to(torch.float8_e5m2),
        "pt.f8_e4m3fnuz": base.to(torch.float8_e4m3fnuz),
        "pt.f8_e5m2fnuz": base.to(torch.float8_e5m2fnuz),
        "pt.f8_e8m0": base.abs().to(torch.float8_e8m0fnu),
        "pt.f4": torch.randint(0, 256, (5, 6), dtype=torch.uint8, generator=g).view(torch.float4_e2m1fn_x2),
        "pt.u16": torch.randint(0, 60000, (11, 3), generator=g).to(torch.uint16),
        "pt.bool": base > 0,
        "pt.i64": torch.randint(-1000, 1000, (7,), generator=g),
    }
    return out


def layered_tensors(seed: int, layers: int = 6, width: int = 256) -> dict[str, np.ndarray]:
    """A model-shaped set: an embedding, then per layer a few matrices (about layers * 0.5 MB)."""
    rng = np.random.default_rng(seed)
    out = {"embed.weight": rng.standard_normal((128, width)).astype(np.float32)}
    for i in range(layers):
        out[f"layers.{i}.attn.weight"] = rng.standard_normal((width, width)).astype(np.float32)
        out[f"layers.{i}.mlp.weight"] = rng.standard_normal((width, width // 2)).astype(np.float16)
        out[f"layers.{i}.norm"] = rng.standard_normal((width,)).astype(np.float32)
    return out


def write_numpy_model(folder: Path, shards: list[dict[str, np.ndarray]], *, index: bool = True,
                      config: dict | None = None, prefix: str = "model") -> Path:
    """Shards ``<prefix>-0000i-of-0000n.safetensors`` (or one ``model.safetensors``), an HF index, a config."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"{prefix}.safetensors" if len(shards) == 1 else f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "np", "shard": str(i)})
        weight_map.update({t: name for t in tensors})
    if index and len(shards) > 1:
        (folder / f"{prefix}.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config or {"architectures": ["Test"], "hidden_size": 256}))
    return folder


def write_torch_model(folder: Path, tensors: dict, name: str = "model.safetensors") -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / name), metadata={"format": "pt"})
    return folder / name


def f6_file(path: Path) -> bytes:
    """A file with F6 tensors (4 elements in 3 bytes), laid out by hand: neither numpy nor torch writes F6."""
    data = bytes(range(12)) + bytes(range(100, 106))
    header = {
        "a.f6_e2m3": {"dtype": "F6_E2M3", "shape": [2, 8], "data_offsets": [0, 12]},
        "b.f6_e3m2": {"dtype": "F6_E3M2", "shape": [8], "data_offsets": [12, 18]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    blob = struct.pack("<Q", len(raw)) + raw + data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    return data


def safetensors_file(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """Bytes of a (possibly broken) safetensors file, for the header tests."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    return struct.pack("<Q", n) + raw + data
