"""Fixtures of the weight pipeline's tests: moto's S3 server for the session, a bucket per test,
and the steerable gate in front of it (tests/support/weights_s3.py)."""

from __future__ import annotations

import os

import pytest

from benchmarks.harness import free_port
from tests.support.weights_s3 import ENV, Bucket, S3Gate


@pytest.fixture(scope="session")
def weights_moto():
    """moto's S3 server on a free loopback port, for the whole session: its port."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        pytest.skip("moto[server] is not installed (the test extra)")
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield port
    server.stop()


@pytest.fixture
def make_bucket(weights_moto):
    return lambda: Bucket(weights_moto)


@pytest.fixture
def s3_gate(weights_moto):
    gates = []

    def make() -> S3Gate:
        gates.append(S3Gate(weights_moto))
        return gates[-1]

    yield make
    for g in gates:
        g.close()
