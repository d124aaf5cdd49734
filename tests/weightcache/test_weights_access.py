"""Auth on the weight node's gRPC, with the daemon's own policy file and PKI (kvstore.auth): tokens
allowed or denied per method over real sockets, a peer's ReadChunk with and without a token, mTLS
with certificates a real CA signed, and the CLI presenting a token file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

import weightcache
from kvstore.auth import Authority
from kvstore.auth.credentials import ChannelSecurity
from kvstore.errors import InvalidArgument
from tests.support.wait import wait_until
from tests.support.weights_models import layered_tensors, write_numpy_model
from weightcache.access import server_credentials
from weightcache.api.v1 import weights_pb2 as pb
from weightcache.api.v1 import weights_pb2_grpc as pb_grpc
from weightcache.fetch import FetchLimits
from weightcache.peers import CHANNEL_OPTIONS, PeerChunkSource
from weightcache.prefetch import Prefetcher
from weightcache.service import serve

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64 << 10
FAST = FetchLimits(max_in_flight=4, origin_concurrency=4, backoff_base_s=0.001, backoff_max_s=0.01, poll_interval_s=0.005)
READER = "tok-weights-reader-0123456789"
OPERATOR = "tok-weights-operator-0123456789"
KV_ONLY = "tok-kv-team-a-0123456789abcdef"

POLICY = textwrap.dedent(f"""
    [[token]]
    name = "peer"
    token = "{READER}"
    namespaces = ["weights"]
    actions = ["read"]

    [[token]]
    name = "operator"
    token = "{OPERATOR}"
    namespaces = ["weights"]

    [[token]]
    name = "team-a"
    token = "{KV_ONLY}"
    namespaces = ["a"]

    [[cert]]
    subject = "router.strata.test"
    namespaces = ["weights"]
    actions = ["read"]
    """)


@pytest.fixture
def model(tmp_path):
    folder = write_numpy_model(tmp_path / "src", [layered_tensors(seed=8, layers=2)])
    return str(folder), weightcache.publish_model(str(folder), chunk_bytes=CHUNK)


@pytest.fixture
def policy(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(POLICY)
    return path


@pytest.fixture
def authed_node(tmp_path, policy):
    prefetcher = Prefetcher(tmp_path / "node", limits=FAST)
    server, port = serve(prefetcher, "127.0.0.1:0", authority=Authority(str(policy)))
    yield prefetcher, f"127.0.0.1:{port}"
    server.stop(0).wait()
    prefetcher.close()


def stub(address: str, token: str | None = None, **tls):
    channel = ChannelSecurity.build(token=token, **tls).channel(address, options=CHANNEL_OPTIONS)
    return pb_grpc.WeightServiceStub(channel)


def code_of(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def calls(s, location: str, digest: str) -> dict[str, object]:
    return {
        "Status": lambda: s.Status(pb.StatusRequest(digest=digest), timeout=10),
        "ReadChunk": lambda: s.ReadChunk(pb.ReadChunkRequest(digest=digest, file=0, chunk=0), timeout=10),
        "Prefetch": lambda: s.Prefetch(pb.PrefetchRequest(location=location, digest=digest), timeout=30),
    }


@pytest.mark.parametrize("token, expected", [
    (None, dict.fromkeys(("Status", "ReadChunk", "Prefetch"), grpc.StatusCode.UNAUTHENTICATED)),
    ("tok-nobody-knows-this-0123456", dict.fromkeys(("Status", "ReadChunk", "Prefetch"), grpc.StatusCode.UNAUTHENTICATED)),
    (KV_ONLY, dict.fromkeys(("Status", "ReadChunk", "Prefetch"), grpc.StatusCode.PERMISSION_DENIED)),
    (READER, {"Status": grpc.StatusCode.OK, "ReadChunk": grpc.StatusCode.OK,
              "Prefetch": grpc.StatusCode.PERMISSION_DENIED}),
    (OPERATOR, dict.fromkeys(("Status", "ReadChunk", "Prefetch"), grpc.StatusCode.OK)),
], ids=["no token", "unknown token", "kv namespace only", "read only", "read and write"])
def test_each_method_needs_its_action_on_namespace_weights(model, authed_node, token, expected):
    folder, m = model
    _, address = authed_node
    got = {name: code_of(call) for name, call in calls(stub(address, token), folder, m.digest).items()}
    assert got == expected


def test_a_refusal_names_the_fix_and_never_the_token(model, authed_node):
    folder, m = model
    _, address = authed_node
    with pytest.raises(grpc.RpcError) as info:
        stub(address, READER).Prefetch(pb.PrefetchRequest(location=folder, digest=m.digest), timeout=10)
    assert "may not write namespace 'weights'" in info.value.details() and READER not in info.value.details()


def test_a_peer_reads_chunks_with_a_token_and_falls_back_to_the_origin_without(tmp_path, model, authed_node):
    folder, m = model
    prefetcher, address = authed_node
    prefetcher.prefetch(folder, m.digest)
    wait_until(lambda: prefetcher.status(m.digest).state == "complete", what="the authed node warm")
    token = ChannelSecurity.build(token=READER)
    with weightcache.open_model(folder, m.digest, cache_dir=tmp_path / "with", limits=FAST, include="*",
                                sources=[PeerChunkSource(address, m.digest, security=token)]) as r:
        assert dict(r.wait().fetched_bytes) == {"peer": m.total_bytes}
    with weightcache.open_model(folder, m.digest, cache_dir=tmp_path / "without", limits=FAST, include="*",
                                sources=[PeerChunkSource(address, m.digest)]) as r:
        stats = r.wait()
        assert dict(stats.fetched_bytes) == {"origin": m.total_bytes} and stats.unavailable > 0


def test_mtls_lets_in_certificates_the_ca_signed_and_the_policy_names(tmp_path, model, policy, pki):  # noqa: F811
    folder, m = model
    prefetcher = Prefetcher(tmp_path / "node", limits=FAST)
    creds = server_credentials(str(pki["server_cert"]), str(pki["server_key"]), str(pki["ca"]))
    server, port = serve(prefetcher, "127.0.0.1:0", authority=Authority(str(policy), mtls=True), credentials=creds)
    address = f"127.0.0.1:{port}"
    try:
        cert, key = pki["router"]
        router = stub(address, tls_ca=str(pki["ca"]), tls_cert=cert, tls_key=key)
        assert code_of(calls(router, folder, m.digest)["Status"]) == grpc.StatusCode.OK
        assert code_of(calls(router, folder, m.digest)["Prefetch"]) == grpc.StatusCode.PERMISSION_DENIED
        cert, key = pki["intruder"]  # the CA signed it, the policy names it nowhere
        intruder = stub(address, tls_ca=str(pki["ca"]), tls_cert=cert, tls_key=key)
        assert code_of(calls(intruder, folder, m.digest)["Status"]) == grpc.StatusCode.PERMISSION_DENIED
        cert, key = pki["forged"]  # another CA: the handshake fails
        forged = stub(address, tls_ca=str(pki["ca"]), tls_cert=cert, tls_key=key)
        assert code_of(calls(forged, folder, m.digest)["Status"]) == grpc.StatusCode.UNAVAILABLE
        plaintext = stub(address, OPERATOR)
        assert code_of(calls(plaintext, folder, m.digest)["Status"]) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0).wait()
        prefetcher.close()


def test_the_cli_presents_a_token_file(tmp_path, model, authed_node):
    folder, m = model
    _, address = authed_node
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("STRATA_TOKEN", None)
    token_file = tmp_path / "token"
    token_file.write_text(OPERATOR + "\n")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "weightcache", *args], capture_output=True, text=True, env=env,
                              timeout=120)

    denied = cli("prefetch", folder, m.digest, "--node", address)
    assert denied.returncode == 1 and "requires authentication" in denied.stderr
    done = cli("prefetch", folder, m.digest, "--node", address, "--token-file", str(token_file), "--wait", "60s",
               "--no-progress", "--interval", "0.1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == m.digest


def _this_hosts_address() -> str:
    """A non-loopback address of this host (its default route's), to listen on."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the kernel only picks a route
        except OSError:
            pytest.skip("this host has no non-loopback IPv4 route")
        host = probe.getsockname()[0]
    if host.startswith("127."):
        pytest.skip("this host has no non-loopback IPv4 address")
    return host


def test_protected_mode_refuses_a_non_loopback_listen_without_authentication(tmp_path, policy):
    """As the daemon's: unauthenticated beyond loopback is refused with the fix named, before
    anything binds; --insecure serves it (and says so); authentication serves it."""
    host = _this_hosts_address()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    refused = subprocess.run(
        [sys.executable, "-m", "weightcache", "serve", "--cache", str(tmp_path / "c"), "--listen", f"{host}:0"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert refused.returncode != 0
    assert "protected mode" in refused.stderr and "--insecure" in refused.stderr and "--auth-file" in refused.stderr
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())

    prefetcher = Prefetcher(tmp_path / "node", limits=FAST)
    try:
        with pytest.raises(InvalidArgument, match="protected mode"):
            serve(prefetcher, f"{host}:0")
        for kwargs in ({"insecure": True}, {"authority": Authority(str(policy))}):
            server, port = serve(prefetcher, f"{host}:0", **kwargs)
            assert port > 0
            server.stop(0).wait()
    finally:
        prefetcher.close()
