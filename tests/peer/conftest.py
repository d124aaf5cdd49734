"""Fixtures of the peer tests: a fleet of ``strata serve`` processes on one private Redis index
(per module), and network namespaces that stand for other hosts."""

from __future__ import annotations

import pytest

from tests.support import redis_servers
from tests.support.peer_cluster import PeerNode, VirtualNetwork, netns_unavailable


@pytest.fixture(scope="module")
def index_url(tmp_path_factory):
    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = redis_servers.start_standalone(tmp_path_factory.mktemp("peer-redis"))
    yield server.url
    server.stop()


@pytest.fixture
def nodes(tmp_path, index_url):
    started: list[PeerNode] = []

    def start(name: str, *extra: str, **kw) -> PeerNode:
        node = PeerNode(tmp_path, name, index_url, *extra, **kw)
        started.append(node)
        return node.start()

    yield start
    for node in started:
        node.kill()


@pytest.fixture
def network():
    why = netns_unavailable()
    if why is not None:
        pytest.skip(why)
    net = VirtualNetwork(3)
    try:
        yield net
    finally:
        net.close()
