"""The Redis index with AUTH and TLS, against real redis-servers: one with ``requirepass``
and ACL users, one serving TLS only (certificates made here with trustme), one 3-master
Cluster with a password.

Every password used here is distinctive, so a test can assert that it shows up nowhere:
not in error messages, reprs, log records, CLI output or the daemon's log.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from kvstore.block import TierName
from kvstore.config import load_settings
from kvstore.errors import InvalidArgument, PrefixIndexError
from kvstore.index import open_index
from kvstore.index.base import IndexUnavailable, NodeMatch
from kvstore.index.redis_url import redact
from tests.support import redis_servers
from tests.support.wait import wait_until

trustme = pytest.importorskip("trustme")

PASSWORD = "Pw-9f3k@x/y:z?#%"  # reserved URL characters: percent-encoded in the URL
ALICE = "alice-Pw-71c2"  # an ACL user with every permission
BOB = "bob-Pw-5e0d"  # an ACL user without scripting
CAROL = "carol-Pw-2a8e"  # an ACL user with what the NOPERM message says to grant, on the index's keys only
WRONG = "wrong-Pw-c4b9"
SECRETS = (PASSWORD, quote(PASSWORD, safe=""), ALICE, BOB, CAROL, WRONG)
NS = "llama"
KEY = b"k" * 32

pytestmark = [pytest.mark.system, pytest.mark.skipif(not redis_servers.available(), reason="redis-server is not installed")]


def no_secret(text: str) -> bool:
    return not any(s in text for s in SECRETS)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def works(url: str) -> None:
    """Join, add, look up, leave through a fresh index on ``url``."""
    ix = open_index(url)
    try:
        await ix.join("node-a", 1, 30)
        await ix.add(NS, "node-a", 1, [(KEY, TierName.HOST)])
        assert await ix.lookup(NS, [KEY]) == [NodeMatch("node-a", 1, TierName.HOST)]
        assert [[h.node_id for h in hs] for hs in await ix.holders(NS, [KEY])] == [["node-a"]]
        await ix.clear("node-a")
        await ix.sweep()
        assert await ix.lookup(NS, [KEY]) == []
        await ix.leave("node-a")
    finally:
        await ix.close()


async def refused(url: str, error: type[Exception] = IndexUnavailable) -> str:
    ix = open_index(url)
    try:
        assert no_secret(repr(ix))
        with pytest.raises(error) as info:
            await ix.join("node-a", 1, 30)
        return str(info.value)
    finally:
        await ix.close()


# ---- servers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    server = redis_servers.RedisServer(
        tmp_path_factory.mktemp("redis-auth"),
        "--user", "alice", "on", f">{ALICE}", "~*", "&*", "+@all",
        "--user", "bob", "on", f">{BOB}", "~*", "&*", "+@all", "-@scripting",
        "--user", "carol", "on", f">{CAROL}", "+@scripting", "+@read", "+@write", "+@fast", "~{strata}*", "~{strata:*",
        password=PASSWORD,
    ).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> redis_servers.TLSFiles:
    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("strata-node@example.com")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server.cert_chain_pems[0].write_to_path(str(d / "server.crt"))
    server.private_key_pem.write_to_path(str(d / "server.key"))
    client.cert_chain_pems[0].write_to_path(str(d / "client.crt"))
    client.private_key_pem.write_to_path(str(d / "client.key"))
    trustme.CA().cert_pem.write_to_path(str(d / "other-ca.pem"))  # a CA that signed nothing here
    return redis_servers.TLSFiles(d / "server.crt", d / "server.key", d / "ca.pem", d / "client.crt", d / "client.key")


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, certs):
    """TLS only (no plain port), client certificates required, and a password."""
    server = redis_servers.RedisServer(
        tmp_path_factory.mktemp("redis-tls"), "--tls-auth-clients", "yes", password=PASSWORD, tls=certs
    ).wait_ready()
    yield server
    server.stop()


def tls_url(server, certs, *, password: str | None = PASSWORD, client: bool = True, ca: Path | None = None) -> str:
    auth = f":{quote(password, safe='')}@" if password is not None else ""
    params = f"tls_ca_file={ca or certs.ca}"
    if client:
        params += f"&tls_cert_file={certs.client_cert}&tls_key_file={certs.client_key}"
    return f"rediss://{auth}127.0.0.1:{server.port}/0?{params}"


# ---- AUTH --------------------------------------------------------------------------


def test_password_and_acl_users_authenticate(auth_server):
    run(works(f"redis://:{quote(PASSWORD, safe='')}@127.0.0.1:{auth_server.port}/0"))
    run(works(f"redis://default:{quote(PASSWORD, safe='')}@127.0.0.1:{auth_server.port}/0"))
    run(works(f"redis://alice:{ALICE}@127.0.0.1:{auth_server.port}/0"))


@pytest.mark.parametrize(
    "userinfo", [f":{WRONG}@", f"alice:{WRONG}@", f"nobody:{ALICE}@", ""], ids=["password", "user", "no-user", "none"]
)
def test_refused_credentials_are_a_clear_error_without_the_password(auth_server, userinfo, caplog):
    caplog.set_level(logging.DEBUG)
    message = run(refused(f"redis://{userinfo}127.0.0.1:{auth_server.port}/0"))
    assert "refused the index's credentials" in message
    assert "redis://USER:PASSWORD@HOST:PORT/DB" in message and "index_url" in message
    assert no_secret(message), message
    assert no_secret(caplog.text)


def test_a_user_without_script_permissions_is_told_which_to_grant(auth_server):
    message = run(refused(f"redis://bob:{BOB}@127.0.0.1:{auth_server.port}/0", PrefixIndexError))
    assert "no permissions" in message and no_secret(message)
    grant = "ACL SETUSER USER +@scripting +@read +@write +@fast ~{strata}* ~{strata:*"
    assert grant in message
    run(works(f"redis://carol:{CAROL}@127.0.0.1:{auth_server.port}/0"))  # what it says to grant is enough


def test_an_outage_of_an_authenticated_index_is_still_unavailable(tmp_path):
    server = redis_servers.RedisServer(tmp_path / "r", password=PASSWORD).wait_ready()
    url = f"redis://:{quote(PASSWORD, safe='')}@127.0.0.1:{server.port}/0"

    async def main():
        ix = open_index(url)
        try:
            await ix.join("node-a", 1, 30)
            server.stop()
            with pytest.raises(IndexUnavailable) as info:
                await ix.heartbeat("node-a", 1, 30)
            assert "cannot be reached" in str(info.value) and no_secret(str(info.value))
        finally:
            await ix.close()

    run(main())


# ---- TLS ---------------------------------------------------------------------------


def test_tls_with_a_ca_and_a_client_certificate(tls_server, certs):
    run(works(tls_url(tls_server, certs)))


@pytest.mark.parametrize("case", ["no-client-cert", "untrusted-ca", "plain-redis"])
def test_tls_failures_name_the_tls_settings(tls_server, certs, case, caplog):
    if case == "no-client-cert":
        url = tls_url(tls_server, certs, client=False)
    elif case == "untrusted-ca":
        url = tls_url(tls_server, certs, ca=certs.ca.parent / "other-ca.pem")
    else:  # a plain connection to a TLS-only port
        url = f"redis://:{quote(PASSWORD, safe='')}@127.0.0.1:{tls_server.port}/0"
    message = run(refused(url))
    assert "cannot be reached" in message and no_secret(message) and no_secret(caplog.text)
    assert ("rediss://" if case == "plain-redis" else "tls_ca_file") in message, message


def test_tls_with_a_wrong_password(tls_server, certs):
    message = run(refused(tls_url(tls_server, certs, password=WRONG)))
    assert "refused the index's credentials" in message and no_secret(message)


def test_bad_tls_parameters_are_refused_when_the_index_opens(certs, tmp_path):
    base = f"rediss://:{WRONG}@127.0.0.1:1/0"
    cases = {
        f"redis://:{WRONG}@127.0.0.1:1/0?tls_ca_file={certs.ca}": "use rediss://",
        f"{base}?tls_ca_file={tmp_path / 'missing.pem'}": "tls_ca_file",
        f"{base}?tls_ca_file={certs.client_key}": "tls_ca_file",
        f"{base}?tls_cert_file={certs.client_cert}": "together",
        f"{base}?tls_cert_file={certs.client_cert}&tls_key_file={certs.key}": "tls_key_file",
    }
    for url, named in cases.items():
        with pytest.raises(InvalidArgument, match=named) as info:
            open_index(url)
        assert no_secret(str(info.value)), info.value


# ---- Redis Cluster with a password ------------------------------------------------------


@pytest.fixture(scope="module")
def auth_cluster(tmp_path_factory):
    servers = redis_servers.start_cluster(tmp_path_factory.mktemp("redis-cluster-auth"), password=ALICE)
    yield servers
    for s in servers:
        s.stop()


def test_cluster_with_a_password(auth_cluster):
    port = auth_cluster[0].port
    run(works(f"redis+cluster://:{ALICE}@127.0.0.1:{port}"))
    for userinfo in (f":{WRONG}@", ""):
        message = run(refused(f"redis+cluster://{userinfo}127.0.0.1:{port}"))
        assert "refused the index's credentials" in message and no_secret(message), message


# ---- the URL is shown redacted everywhere ------------------------------------------------


def test_redact_hides_every_form_of_the_password():
    for url, shown in {
        f"redis://:{WRONG}@h:1/0": "redis://:***@h:1/0",
        f"redis://alice:{WRONG}@h:1/0": "redis://alice:***@h:1/0",
        f"rediss+cluster://:{WRONG}@h:1": "rediss+cluster://:***@h:1",
        f"redis://:{PASSWORD}@h:1/0": "redis://:***@h:1/0",  # not encoded: '/', '?', '#' and '@' inside
        f"unix:///run/redis.sock?db=0&password={WRONG}": "unix:///run/redis.sock?db=0&password=***",
        "redis://h:1/0": "redis://h:1/0",
        "redis://alice@h:1/0": "redis://alice@h:1/0",
    }.items():
        assert redact(url) == shown


def test_settings_repr_and_errors_show_no_password():
    s = load_settings(index_url=f"redis://alice:{WRONG}@h:1/0", metrics_listen="")
    assert s.index.url.endswith(f"{WRONG}@h:1/0")  # the value itself is intact
    assert no_secret(repr(s)) and no_secret(str(s)) and "alice:***@h:1/0" in repr(s)
    with pytest.raises(InvalidArgument) as info:
        open_index(f"redus://:{WRONG}@h:1/0")
    assert "unknown scheme" in str(info.value) and no_secret(str(info.value))
    with pytest.raises(InvalidArgument) as info:
        open_index(f"redis://:{WRONG}@[h:1/0")
    assert no_secret(str(info.value))


def test_cli_errors_show_no_password(tmp_path):
    for url in (f"redus://:{WRONG}@127.0.0.1:1/0", f"rediss://:{WRONG}@127.0.0.1:1/0?tls_ca_file={tmp_path}/none.pem"):
        out = subprocess.run(
            [sys.executable, "-m", "kvstore.cli.main", "serve", "--index-url", url, "--listen", "127.0.0.1:0",
             "--metrics-listen", "", "--disk-dir", str(tmp_path / "d"), "--shm-dir", str(tmp_path),
             "--ram-bytes", "32MiB", "--disk-bytes", "64MiB", "--max-block-bytes", "8MiB", "--log-format", "text"],
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode != 0
        assert "index URL" in out.stderr and "***" in out.stderr, out.stderr
        assert no_secret(out.stdout + out.stderr), out.stderr


def test_daemon_with_refused_credentials_serves_and_logs_the_fix_not_the_password(daemon_process, auth_server):
    daemon = daemon_process("--index-url", f"redis://alice:{WRONG}@127.0.0.1:{auth_server.port}/0", "--log-level", "DEBUG")
    wait_until(
        lambda: "refused the index's credentials" in daemon.log.read_text(), what="the index failure to be logged"
    )
    stats = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "stats", "--target", daemon.target, "--json"],
        capture_output=True, text=True, timeout=60,
    )
    assert stats.returncode == 0, stats.stderr
    assert no_secret(stats.stdout + stats.stderr)
    log = daemon.log.read_text()
    assert "alice:***@" in log and no_secret(log)
