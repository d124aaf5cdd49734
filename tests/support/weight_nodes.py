"""Weight nodes as real processes (``python -m weightcache serve``) for the swarm tests, and their stubs.

The swarm tests differ in how nodes find each other (a static ``--peer``
list, or the prefix index with ``--index-url``); everything else about a
node, and how a test asks one for status, is the same here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc

from tests.support.weights_s3 import ENV
from weightcache.api.v1 import weights_pb2 as pb
from weightcache.api.v1 import weights_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]


def spawn_node(cache: Path, address: str, endpoint: str, *finding: str) -> subprocess.Popen:
    """A node serving ``cache`` on ``address`` with ``endpoint`` as its origin; ``finding``: how it finds
    its peers (``--peer A --peer B`` or ``--index-url U --index-ttl T``)."""
    env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [sys.executable, "-m", "weightcache", "serve", "--cache", str(cache), "--listen", address,
            "--s3-endpoint", endpoint, "--s3-allow-http", "--s3-region", "us-east-1", "--concurrency", "4",
            "--peer-wait", "60s", *finding]
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stub(address: str):
    return pb_grpc.WeightServiceStub(grpc.insecure_channel(address))


def up(address: str) -> bool:
    try:
        stub(address).Status(pb.StatusRequest(digest="0" * 64), timeout=2)
        return True
    except grpc.RpcError:
        return False


def origin_bytes(gate) -> int:
    """The bytes of every ranged GET the gate let through to the origin."""
    total = 0
    for (_, rng), n in gate.gets.items():
        a, b = rng.removeprefix("bytes=").split("-")
        total += (int(b) - int(a) + 1) * n
    return total
