"""Fixtures the whole suite shares: real daemons on real ports (in-process and as subprocesses),
private Redis and S3 servers, certificates, and the /dev/shm guard; and the ``system`` marker.
What is not a fixture lives in ``tests/support``; fixtures only one folder's tests use live in
that folder's conftest.py.

A test is ``system`` when it starts a process or a daemon: ``strata serve``, an in-process daemon
on real ports, redis-server, moto, Prometheus, kubectl, network namespaces, engines, routers, a
virtual environment. It is marked in one of three ways, all read here:

- by a fixture it uses (:data:`SYSTEM_FIXTURES`, also through another fixture);
- by its module, ``pytestmark = pytest.mark.system``, where every test of the module is one;
- by itself, ``@pytest.mark.system``, or a contract suite's row,
  ``pytest.param("redis", marks=pytest.mark.system)``.

``-m "not system and not slow"`` is the developer's fast lane (docs/development.md). A module whose
own ``pytestmark`` deselects it is not even imported (the imports of those marked system, vLLM and
LMCache among them, are most of a full collection), so its tests are not counted as deselected.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# The same examples on every run: CI must not find (and then spend minutes
# shrinking) a case that no developer run can reproduce. Hunt with a fresh
# seed locally: HYPOTHESIS_PROFILE=explore python -m pytest ...
settings.register_profile("ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", deadline=None, max_examples=500, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

from kvstore.config import load_settings
from kvstore.server.daemon import Daemon
from tests.support import shm_guard
from tests.support.daemons import SMALL, DaemonProcess

# Fixtures that start a process or a daemon (the folder conftests' too): a test that uses one,
# directly or through another fixture, is a system test.
SYSTEM_FIXTURES = frozenset({
    "make_daemon", "daemon", "daemon_process",  # this file: in-process daemons and strata serve
    "redis_url", "redis_cluster_url", "s3",  # this file: redis-server, moto_server
    "index_url", "nodes", "network",  # peer/conftest.py: a fleet on its own redis, network namespaces
    "engines", "routers", "fleet",  # router/conftest.py: stand-in engines, routers on real ports
    "weights_moto",  # weightcache/conftest.py: moto's server
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SYSTEM_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.system)


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """Leave a test module unimported when its module-level marks alone deselect it (``-m "not system"``
    and a module marked system as a whole): importing it would only cost time."""
    markexpr = config.getoption("markexpr")
    if not markexpr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    marks = _module_marks(collection_path)
    return True if marks and _deselected(markexpr, marks) else None


def _deselected(markexpr: str, marks: set[str]) -> bool:
    """Whether ``-m markexpr`` deselects every test that carries ``marks``, whatever other marks it has
    (checked with none and with all of them: enough for the expressions people type)."""
    try:
        from _pytest.mark.expression import Expression  # no public API; without it, import everything

        expression = Expression.compile(markexpr)
        with_these = expression.evaluate(lambda name, **_: name in marks)
        return not with_these and not expression.evaluate(lambda name, **_: True)
    except Exception:  # noqa: BLE001 - an optimisation only: pytest reports a bad expression itself
        return False


def _module_marks(path: Path) -> set[str]:
    """The names of the marks in a module's ``pytestmark``, read from its source, not imported."""
    try:
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError):
        return set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}
    return set()


@pytest.fixture
def make_daemon(tmp_path):
    """Start in-process daemons; each gets its own cache dir and arena under tmp_path."""
    started: list[Daemon] = []

    def start(**overrides) -> Daemon:
        n = len(started)
        cfg = dict(SMALL, listen="127.0.0.1:0", disk_dir=str(tmp_path / f"d{n}"), shm_dir=str(tmp_path))
        cfg.update(overrides)
        daemon = Daemon(load_settings(**cfg)).start()
        daemon.target = f"127.0.0.1:{daemon.port}"
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop(0)


@pytest.fixture
def daemon(make_daemon):
    return make_daemon()


@pytest.fixture
def daemon_process(tmp_path):
    procs: list[DaemonProcess] = []

    def start(*args: str) -> DaemonProcess:
        p = DaemonProcess(tmp_path, *args).start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


# ---- nothing left in /dev/shm (tests/support/shm_guard.py) ---------------------------------
# Per module (module-scoped daemons stop at its end) and per test (to name the test).


@pytest.fixture(autouse=True, scope="module")
def _shm_clean_module(request, tmp_path_factory):
    before, since = shm_guard.entries(), shm_guard.now()
    yield
    leak = shm_guard.check(before, lambda: shm_guard.recent(tmp_path_factory.getbasetemp(), since), request.node.nodeid)
    if leak:
        pytest.fail(leak, pytrace=False)


@pytest.fixture(autouse=True)
def _shm_clean(request, tmp_path_factory):
    before, since = shm_guard.entries(), shm_guard.now()
    yield
    leak = shm_guard.check(before, lambda: shm_guard.recent(tmp_path_factory.getbasetemp(), since), request.node.nodeid)
    if leak:
        pytest.fail(leak, pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def _no_proxy():
    # gRPC honours http_proxy; tests talk to loopback only.
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        os.environ.pop(var, None)
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"


# ---- private Redis servers (the prefix index contract) -------------------------
# Session-scoped: started on first use, killed at the end. Tests isolate
# themselves with a key prefix of their own instead of flushing.


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    from tests.support import redis_servers

    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = redis_servers.start_standalone(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory):
    from tests.support import redis_servers

    if not redis_servers.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    servers = redis_servers.start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield f"redis+cluster://127.0.0.1:{servers[0].port}"
    for s in servers:
        s.stop()


# ---- a private S3-compatible server (the object tier) ---------------------------
# moto's server in a child process, one bucket; tests isolate themselves with a
# prefix of their own (tests/support/s3_servers.py).


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    from tests.support import s3_servers

    if not s3_servers.available():
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    env = s3_servers.S3Env(s3_servers.start_moto(tmp_path_factory.mktemp("moto")))
    yield env
    env.close()


# ---- certificates (TLS and mTLS: the daemon, the weight node) -----------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, the daemon's certificate and three client certificates, as PEM files."""
    import trustme

    root = tmp_path_factory.mktemp("pki")
    ca, stranger_ca = trustme.CA(), trustme.CA()
    files = {"ca": root / "ca.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server = ca.issue_cert("localhost", "127.0.0.1")
    server.private_key_pem.write_to_path(str(root / "server.key"))
    server.cert_chain_pems[0].write_to_path(str(root / "server.pem"))
    files["server_key"], files["server_cert"] = root / "server.key", root / "server.pem"
    for name, issuer in (("router", ca), ("intruder", ca), ("forged", stranger_ca)):
        cert = issuer.issue_cert(f"{name}.strata.test", common_name=f"{name}.strata.test")
        cert.private_key_pem.write_to_path(str(root / f"{name}.key"))
        cert.cert_chain_pems[0].write_to_path(str(root / f"{name}.pem"))
        files[name] = (str(root / f"{name}.pem"), str(root / f"{name}.key"))
    return files
