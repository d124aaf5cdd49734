"""What must hold for Strata to install beside LMCache 0.5.6 (grpcio 1.78.0, protobuf 6.x)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from kvstore.api.v1 import index_pb2_grpc, kv_pb2, kv_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
LMCACHE_GRPCIO = (1, 78, 0)  # lmcache 0.5.6 -> grpcio-observability==1.78.0 -> grpcio 1.78.0


def version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def test_generated_grpc_code_loads_on_the_grpcio_lmcache_pins():
    # Generated stubs refuse to import under a grpcio older than their generator.
    for module in (kv_pb2_grpc, index_pb2_grpc):
        assert version(module.GRPC_GENERATED_VERSION) <= LMCACHE_GRPCIO, module.__name__


def test_generated_protobuf_code_targets_protobuf_6():
    source = Path(kv_pb2.__file__).read_text()
    assert "Protobuf Python Version: 6." in source


def test_dependency_ranges_admit_lmcaches_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {d.split(">")[0].split("<")[0].split("=")[0].strip(): d for d in project["dependencies"]}
    assert deps["grpcio"] == "grpcio>=1.78,<1.79"
    assert deps["protobuf"] == "protobuf>=6.31.1,<7"
    assert "<=0.24.1" in deps["prometheus-client"]
    assert project["optional-dependencies"]["lmcache"] == ["grpcio==1.78.0", "lmcache==0.5.6"]
