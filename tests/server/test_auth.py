"""Authentication, authorization and protected mode over real sockets.

Real daemons on real TCP ports, real certificates made by a real CA in the
test (trustme), real token files rewritten on disk, and a real second uid
(a forked child that setuid()s to ``nobody``) on the same-host socket.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import pwd
import tempfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import Client, TierName
from kvstore.api.v1 import index_pb2, index_pb2_grpc
from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.auth import ANONYMOUS, EVERY_NAMESPACE, Authority, Grant, Identity, PolicyError, load_policy, may_attach
from kvstore.auth.credentials import ChannelSecurity
from kvstore.client.aio import AsyncClient
from kvstore.client.codec import CHANNEL_OPTIONS
from kvstore.errors import PermissionDenied, Unauthenticated, UnknownLease, UnknownNamespace
from kvstore.server.endpoints import DaemonError
from kvstore.transport.base import Deadline
from kvstore.transport.samehost import frames
from kvstore.transport.samehost.conn import _Connection
from tests.support.identities import TOKEN_A, TOKEN_ADMIN, TOKEN_B, as_uid, policy_text, raw_stub
from tests.support.wait import wait_until


@pytest.fixture
def authed(make_daemon, policy_file):
    return make_daemon(auth_file=str(policy_file), auth_reload_seconds="0.05")


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return info.value


# ---- the policy file -------------------------------------------------------------


def test_policy_maps_tokens_by_digest_and_patterns(policy_file):
    policy = load_policy(policy_file)
    a = policy.by_token(TOKEN_A)
    assert a.name == "token:team-a"
    assert a.grant.allows("a", "read") and a.grant.allows("a-7", "write") and not a.grant.allows("b", "read")
    assert policy.by_token(TOKEN_B).name == "token:team-b"  # listed by its SHA-256 only
    assert policy.by_token("tok-unknown-0123456789abcdef") is None
    assert policy.by_token(TOKEN_ADMIN).grant.admin
    assert TOKEN_A not in repr(policy) and hashlib.sha256(TOKEN_A.encode()).hexdigest() not in repr(policy)


@pytest.mark.parametrize("body, message", [
    ('[[token]]\nname = "x"\ntoken = "short"\nnamespaces = ["a"]', "at least 16"),
    ('[[token]]\nname = "x"\ntoken = "tok-secret-value-0123456789"\nnamespaces = []', "non-empty list"),
    ('[[token]]\nname = "x"\ntoken = "tok-secret-value-0123456789"\nnamespaces = ["a"]\nactions = ["delete"]', "actions"),
    ('[[token]]\nname = "x"\ntoken = "tok-secret-value-0123456789"\ntoken_sha256 = "00"\nnamespaces = ["a"]', "exactly one"),
    ('[[tokens]]\nname = "x"', "unknown table"),
    ('[[peer]]\nuser = "no-such-user-here"\nnamespaces = ["a"]', "no user"),
    ('[[token]\nname = "tok-secret-value-0123456789"', "not valid TOML"),
])
def test_a_bad_policy_file_says_what_to_fix_and_never_quotes_the_token(tmp_path, body, message):
    path = tmp_path / "p.toml"
    path.write_text(body)
    with pytest.raises(PolicyError, match=message) as info:
        load_policy(path)
    assert "tok-secret-value" not in str(info.value)


def test_a_daemon_does_not_start_on_a_broken_policy_file(make_daemon, tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("[[token]]\nname = 3\n")
    with pytest.raises(PolicyError, match="needs name"):
        make_daemon(auth_file=str(path))


# ---- bearer tokens over TCP -----------------------------------------------------


def test_tokens_authenticate_and_namespaces_authorize(authed):
    with Client(authed.target, token=TOKEN_A, use_shm=False) as a:
        assert a.put("a", b"k", b"bytes of a") is True
        assert a.get("a", b"k") == b"bytes of a"
        with pytest.raises(PermissionDenied, match="token:team-a may not write namespace 'b'"):
            a.put("b", b"k", b"x")
        with pytest.raises(PermissionDenied):
            a.get("b", b"k")
    with Client(authed.target, use_shm=False) as nobody:
        with pytest.raises(Unauthenticated, match="requires authentication"):
            nobody.get("a", b"k")
    with Client(authed.target, token="tok-wrong-0123456789abcdef", use_shm=False) as wrong:
        with pytest.raises(Unauthenticated, match="not one this daemon knows") as info:
            wrong.exists("a", [b"k"])
        assert "tok-wrong" not in str(info.value)


def test_every_namespaced_rpc_is_refused_outside_the_grant(authed):
    s = raw_stub(authed.target, TOKEN_A)
    calls = {
        "Exists": lambda: s.Exists(pb.ExistsRequest(namespace="b", keys=[b"k"])),
        "Delete": lambda: s.Delete(pb.DeleteRequest(namespace="b", keys=[b"k"])),
        "Pin": lambda: s.Pin(pb.PinRequest(namespace="b", keys=[b"k"])),
        "List": lambda: s.List(pb.ListRequest(namespace="b")),
        "Stats": lambda: s.Stats(pb.StatsRequest(namespace="b")),
        "Allocate": lambda: s.Allocate(pb.AllocateRequest(namespace="b", blocks=[pb.BlockHeader(key=b"k", size=4)])),
        "Lookup": lambda: s.Lookup(pb.LookupRequest(namespace="b", keys=[b"k"])),
        "Get": lambda: list(s.Get(pb.GetRequest(namespace="b", keys=[b"k"]))),
        "Put": lambda: s.Put(iter([pb.PutRequest(namespace="b", header=pb.BlockHeader(key=b"k", size=1)),
                                   pb.PutRequest(chunk=b"x")])),
    }
    for name, call in calls.items():
        err = rpc_error(call)
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED, name
    index = index_pb2_grpc.IndexServiceStub(ChannelSecurity.build(token=TOKEN_A).channel(authed.target))
    for call in (index.Score, index.Holders):
        request_type = index_pb2.ScoreRequest if call is index.Score else index_pb2.HoldersRequest
        err = rpc_error(call, request_type(namespace="b", keys=index_pb2.KeyChain(keys=[b"k"])))
        assert err.code() is grpc.StatusCode.PERMISSION_DENIED


def test_a_put_stream_cannot_switch_to_a_forbidden_namespace(authed):
    s = raw_stub(authed.target, TOKEN_A)
    header = pb.BlockHeader(key=b"k", size=1)
    err = rpc_error(s.Put, iter([
        pb.PutRequest(namespace="a", header=header), pb.PutRequest(chunk=b"x"),
        pb.PutRequest(namespace="b", header=header), pb.PutRequest(chunk=b"y"),
    ]))
    assert err.code() is grpc.StatusCode.PERMISSION_DENIED
    with Client(authed.target, token=TOKEN_ADMIN, use_shm=False) as admin:
        with pytest.raises(UnknownNamespace):  # nothing of the stream was stored, not even its first block
            admin.exists("b", [b"k"])


def test_a_forbidden_namespace_reads_the_same_whether_or_not_it_exists(authed):
    with Client(authed.target, token=TOKEN_ADMIN, use_shm=False) as admin:
        admin.put("b-secret", b"k", b"tenant b's block")  # exists
    s = raw_stub(authed.target, TOKEN_A)
    for call in (
        lambda ns: s.Exists(pb.ExistsRequest(namespace=ns, keys=[b"k"])),
        lambda ns: list(s.Get(pb.GetRequest(namespace=ns, keys=[b"k"]))),
        lambda ns: s.List(pb.ListRequest(namespace=ns)),
        lambda ns: s.Stats(pb.StatsRequest(namespace=ns)),
    ):
        existing, missing = rpc_error(call, "b-secret"), rpc_error(call, "b-never")
        assert existing.code() is missing.code() is grpc.StatusCode.PERMISSION_DENIED
        assert existing.details().replace("b-secret", "NS") == missing.details().replace("b-never", "NS")
        # ... and the ErrorInfo reason, too
        assert dict(existing.trailing_metadata()).keys() == dict(missing.trailing_metadata()).keys()


def test_stats_show_node_wide_figures_only_to_an_admin(authed):
    with Client(authed.target, token=TOKEN_A, use_shm=False) as a:
        a.put("a", b"k", b"x" * 1000)
        with pytest.raises(PermissionDenied, match="every namespace"):
            a.stats()
        mine = a.stats("a")
        assert mine.blocks == 1 and mine.tiers == {} and mine.namespaces == ["a"]
        assert mine.handoffs is None and mine.replication is None  # node-wide: not for a tenant
    with Client(authed.target, token=TOKEN_ADMIN, use_shm=False) as admin:
        everything = admin.stats()
        assert everything.tiers["host"]["used_bytes"] >= 1000
        assert everything.handoffs.opened == 0 and everything.replication.enabled is True  # pins may ask for copies by default
        assert admin.stats("a").handoffs is not None


def test_health_and_reflection_stay_open(authed):
    channel = grpc.insecure_channel(authed.target)
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_arena_goes_only_to_an_identity_allowed_on_every_namespace(authed):
    with Client(authed.target, token=TOKEN_A) as a:
        a.put("a", b"k", b"streamed")
        assert a.transport_name == "grpc" and a.get("a", b"k") == b"streamed"
    attach = raw_stub(authed.target, TOKEN_A).Attach(pb.AttachRequest())
    assert attach.arena_path == "" and attach.arena_token == b"" and attach.control_socket == ""
    assert attach.max_block_bytes > 0
    with Client(authed.target, token=TOKEN_ADMIN) as admin:
        assert admin.transport_name == "same-host" and admin.get("a", b"k") == b"streamed"


def test_may_attach_needs_read_and_write_on_every_namespace_of_the_arena():
    a = Identity("token:a", Grant.of(["a", "team-*"]))
    reader = Identity("token:r", Grant.of(["*"], ["read"]))
    admin = Identity("token:x", Grant.of(["*"]))
    assert may_attach(admin, EVERY_NAMESPACE) and may_attach(ANONYMOUS, EVERY_NAMESPACE)
    assert not may_attach(a, EVERY_NAMESPACE) and not may_attach(reader, EVERY_NAMESPACE)
    assert may_attach(a, {"a", "team-x"}) and may_attach(a, lambda: ["team-y-*"])
    assert not may_attach(a, {"a", "b"}) and not may_attach(a, {"tea*"}) and not may_attach(reader, {"a"})


def test_the_async_client_sends_its_token(authed):
    async def run() -> None:
        for use_shm in (False, None):  # streamed puts take a blocking channel of their own: it carries the token too
            async with AsyncClient(authed.target, token=TOKEN_A, use_shm=use_shm) as a:
                assert await a.put("a", b"k", b"async") in (True, False)
                assert await a.get("a", b"k") == b"async"
                with pytest.raises(PermissionDenied):
                    await a.get("b", b"k")
        async with AsyncClient(authed.target, use_shm=False) as nobody:
            with pytest.raises(Unauthenticated):
                await nobody.exists("a", [b"k"])

    asyncio.run(run())


def test_the_grpc_unix_socket_needs_a_token_and_keeps_its_mode(make_daemon, policy_file, tmp_path):
    path = tmp_path / "grpc.sock"
    d = make_daemon(auth_file=str(policy_file), unix_socket=str(path))
    assert os.stat(path).st_mode & 0o777 == 0o600
    with Client(f"unix:{path}", use_shm=False) as nobody:
        with pytest.raises(Unauthenticated):
            nobody.exists("a", [b"k"])
    with Client(f"unix:{path}", token=TOKEN_A, use_shm=False) as a:
        assert a.put("a", b"k", b"over uds") is True
    assert d.port


def test_the_cli_takes_a_token_file_or_strata_token(authed, tmp_path, monkeypatch, capsys):
    from kvstore.cli.main import main

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN_A + "\n")
    data = tmp_path / "in"
    data.write_bytes(b"from the cli")
    assert main(["kv", "put", "a", "k", str(data), "--target", authed.target, "--no-shm",
                 "--token-file", str(token_file)]) == 0
    monkeypatch.setenv("STRATA_TOKEN", TOKEN_A)
    assert main(["kv", "get", "a", "k", "--target", authed.target, "--no-shm", "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out").read_bytes() == b"from the cli"
    monkeypatch.delenv("STRATA_TOKEN")
    assert main(["kv", "get", "a", "k", "--target", authed.target, "--no-shm"]) == 1
    assert "requires authentication" in capsys.readouterr().err


# ---- reloading ------------------------------------------------------------------


def test_the_policy_reloads_without_a_restart_and_a_broken_file_keeps_the_old_rules(authed, policy_file, caplog):
    new_token = "tok-team-c-0123456789abcdef"
    with Client(authed.target, token=new_token, use_shm=False) as c:
        with pytest.raises(Unauthenticated):
            c.exists("c", [b"k"])
        policy_file.write_text(policy_text(f'[[token]]\nname = "team-c"\ntoken = "{new_token}"\nnamespaces = ["c"]\n'))
        wait_until(lambda: _works(lambda: c.put("c", b"k", b"v")), what="the changed policy file to be loaded")
        with caplog.at_level(logging.ERROR, logger="kvstore.auth.authority"):
            policy_file.write_text(f'[[token]]\nname = "broken"\ntoken = "{new_token}"\nnamespaces = "c"\n')
            # A request is what notices the change: the check runs on the next one.
            wait_until(lambda: c.exists("c", [b"k"]) is not None and authed.authority.reloads["error"] >= 1,
                       what="the broken file to be tried")
        assert "previous rules stay" in caplog.text and new_token not in caplog.text
        assert c.get("c", b"k") == b"v"  # the old table is still in force
    assert authed.reload_auth() is False  # what SIGHUP calls: still broken, still the old rules


def _works(call) -> bool:
    try:
        call()
        return True
    except Unauthenticated:
        return False


def test_sighup_reloads_the_policy_of_a_running_daemon(daemon_process, tmp_path):
    import signal

    path = tmp_path / "policy.toml"
    path.write_text(policy_text())
    proc = daemon_process("--auth-file", str(path), "--auth-reload-seconds", "0")
    new_token = "tok-team-d-0123456789abcdef"
    path.write_text(policy_text(f'[[token]]\nname = "d"\ntoken = "{new_token}"\nnamespaces = ["d"]\n'))
    with Client(proc.target, token=new_token, use_shm=False, retries=0) as d:
        with pytest.raises(Unauthenticated):  # reload_seconds 0: only a signal reloads
            d.exists("d", [b"k"])
        proc.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: _works(lambda: d.put("d", b"k", b"v")), what="SIGHUP to reload the policy")


# ---- mTLS -----------------------------------------------------------------------


@pytest.fixture
def mtls(make_daemon, pki, tmp_path):
    policy = tmp_path / "certs.toml"
    policy.write_text('[[cert]]\nsubject = "router.strata.test"\nnamespaces = ["r", "shared-*"]\n')
    return make_daemon(tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]),
                       tls_client_ca=str(pki["ca"]), auth_file=str(policy))


def test_mtls_identity_comes_from_the_client_certificate(mtls, pki):
    cert, key = pki["router"]
    with Client(mtls.target, tls_ca=str(pki["ca"]), tls_cert=cert, tls_key=key, use_shm=False) as router:
        assert router.put("r", b"k", b"over mTLS") is True
        assert router.get("r", b"k") == b"over mTLS"
        with pytest.raises(PermissionDenied, match="cert:router.strata.test may not"):
            router.get("other", b"k")
    cert, key = pki["intruder"]  # signed by the CA, but the policy names it nowhere
    with Client(mtls.target, tls_ca=str(pki["ca"]), tls_cert=cert, tls_key=key, use_shm=False) as intruder:
        with pytest.raises(PermissionDenied):
            intruder.get("r", b"k")


@pytest.mark.parametrize("who", ["no certificate", "another CA", "plaintext"])
def test_mtls_refuses_clients_without_a_certificate_the_ca_signed(mtls, pki, who):
    if who == "plaintext":
        client = Client(mtls.target, use_shm=False, retries=0, timeout=3)
    elif who == "no certificate":
        client = Client(mtls.target, tls_ca=str(pki["ca"]), use_shm=False, retries=0, timeout=3)
    else:
        cert, key = pki["forged"]
        client = Client(mtls.target, tls_ca=str(pki["ca"]), tls_cert=cert, tls_key=key, use_shm=False,
                        retries=0, timeout=3)
    with client, pytest.raises(Exception) as info:
        client.get("r", b"k")
    assert "over mTLS" not in str(info.value)
    assert type(info.value).__name__ in {"DaemonUnavailable", "DeadlineExceeded", "Unauthenticated"}


def test_tls_with_tokens_and_no_client_certificates(make_daemon, pki, policy_file):
    d = make_daemon(tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]), auth_file=str(policy_file))
    with Client(d.target, token=TOKEN_A, tls_ca=str(pki["ca"]), use_shm=False) as a:
        assert a.put("a", b"k", b"tls + token") is True
    with Client(d.target, tls_ca=str(pki["ca"]), use_shm=False) as nobody:
        with pytest.raises(Unauthenticated):
            nobody.get("a", b"k")


# ---- protected mode --------------------------------------------------------------


def test_protected_mode_refuses_a_non_loopback_address_without_authentication(make_daemon, policy_file, caplog):
    with pytest.raises(DaemonError, match="protected mode.*--auth-file.*--insecure"):
        make_daemon(listen="0.0.0.0:0")
    with caplog.at_level(logging.WARNING, logger="kvstore.server.daemon"):
        make_daemon(listen="0.0.0.0:0", insecure=True)
    assert "--insecure" in caplog.text
    assert make_daemon(listen="0.0.0.0:0", auth_file=str(policy_file)).port
    assert make_daemon(listen="localhost:0").port
    assert make_daemon(listen="[::1]:0").port


def test_metrics_given_only_a_port_listen_on_loopback(make_daemon):
    d = make_daemon(metrics_listen=":0")
    assert d._metrics_server.server_address[0] == "127.0.0.1"


# ---- slots and leases belong to their owner ----------------------------------------


def _two_connections(target: str, token_a: str | None = None, token_b: str | None = None):
    # Separate channels: separate TCP connections, so separate owners even without authentication.
    return raw_stub(target, token_a), kv_pb2_grpc.KVServiceStub(
        ChannelSecurity.build(token=token_b).channel(target, [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
    )


@pytest.mark.parametrize("auth", [False, True], ids=["no-auth", "tokens"])
def test_a_stranger_cannot_end_another_clients_slots_and_leases(make_daemon, policy_file, auth):
    from kvstore.block import checksum

    d = make_daemon(auth_file=str(policy_file)) if auth else make_daemon()
    a, b = _two_connections(d.target, TOKEN_ADMIN if auth else None, TOKEN_B if auth else None)
    ns = "b"  # a namespace both may use when authenticated
    alloc = a.Allocate(pb.AllocateRequest(namespace=ns, blocks=[pb.BlockHeader(key=b"k", size=4)]))
    [slot] = alloc.slots
    arena = pb.CommitRequest(items=[pb.CommitRequest.Item(slot_id=slot.slot_id, checksum=checksum(b"\0" * 4))])
    # The stranger's commit reads exactly as one of an id never issued.
    stolen = rpc_error(b.Commit, arena)
    never = rpc_error(b.Commit, pb.CommitRequest(items=[pb.CommitRequest.Item(slot_id=12345, checksum=1)]))
    assert stolen.code() is never.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert stolen.details().replace(str(slot.slot_id), "ID") == never.details().replace("12345", "ID")
    b.Abort(pb.AbortRequest(slot_ids=[slot.slot_id]))  # ignored, as for an unknown id
    done = a.Commit(arena)  # still the owner's to commit
    assert [r.stored for r in done.results] == [True]

    found = a.Lookup(pb.LookupRequest(namespace=ns, keys=[b"k"]))
    lease_id = found.blocks[0].lease_id
    assert lease_id
    assert list(b.Release(pb.ReleaseRequest(lease_ids=[lease_id])).valid) == [False]
    assert list(a.Release(pb.ReleaseRequest(lease_ids=[lease_id])).valid) == [True]

    pin = a.Pin(pb.PinRequest(namespace=ns, keys=[b"k"], lease_ms=30_000))
    assert b.Unpin(pb.UnpinRequest(lease_id=pin.lease_id)).released is False
    assert a.Unpin(pb.UnpinRequest(lease_id=pin.lease_id)).released is True


def test_another_process_on_the_same_host_socket_cannot_end_slots_or_leases(daemon):
    from kvstore.block import checksum

    attach = raw_stub(daemon.target).Attach(pb.AttachRequest())
    path, token = attach.control_socket, attach.arena_token
    deadline = lambda: Deadline.after(5)  # noqa: E731
    a = _Connection(path, token)
    try:
        _, [[present, slot_id, _]] = a.call(frames.ALLOCATE, ["m", 0, 0, [[b"k", 4, None, ""]]], deadline=deadline())
        assert not present
        zeros = checksum(b"\0" * 4)

        def stranger(op, args):
            def run() -> str:
                conn = _Connection(path, token)
                try:
                    return repr(conn.call(op, args, deadline=deadline()))
                finally:
                    conn.close()
            return run

        same_uid = os.getuid()  # a stranger is another process, whatever its uid
        assert as_uid(same_uid, stranger(frames.COMMIT, [[slot_id], [zeros]])).startswith("UnknownLease: no slot lease")
        assert as_uid(same_uid, stranger(frames.ABORT, [[slot_id]])) == "None"
        assert a.call(frames.COMMIT, [[slot_id], [zeros]], deadline=deadline()) == [[True, int(TierName.HOST)]]
        _, [entry] = a.call(frames.LOOKUP, ["m", [b"k"], 0, 0, []], deadline=deadline())
        lease_id = entry[5]
        assert as_uid(same_uid, stranger(frames.RELEASE, [[lease_id]])) == "[False]"
        b = _Connection(path, token)  # the same process on another connection of its pool: the owner still
        try:
            assert b.call(frames.RELEASE, [[lease_id]], deadline=deadline()) == [True]
        finally:
            b.close()
    finally:
        a.close()


# ---- peer credentials on the same-host socket -------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_peer_credentials_identify_a_local_uid(make_daemon, tmp_path):
    nobody = pwd.getpwnam("nobody").pw_uid
    policy = tmp_path / "peers.toml"
    policy.write_text(f'[[peer]]\nuid = {nobody}\nname = "nobody"\nnamespaces = ["nobody-ns"]\n')
    shared = tempfile.mkdtemp(prefix="strata-peer-")  # a directory the other uid can reach
    os.chmod(shared, 0o755)
    d = make_daemon(auth_file=str(policy), unix_socket_mode="0666", same_host_socket=f"{shared}/samehost.sock",
                    namespaces="nobody-ns,root-ns")
    attach = raw_stub(d.target, None).Attach  # the daemon's own uid (root) is trusted on same-host only
    with pytest.raises(grpc.RpcError):
        attach(pb.AttachRequest())
    path, token = d._same_host.path, bytes(d.store.head.arena.token)
    assert os.stat(path).st_mode & 0o777 == 0o666

    def lookup(namespace: str):
        def run() -> str:
            conn = _Connection(path, token)
            try:
                conn.call(frames.LOOKUP, [namespace, [b"k"], 0, 0, []], deadline=Deadline.after(5))
                return "ok"
            finally:
                conn.close()
        return run

    assert as_uid(nobody, lookup("nobody-ns")) == "ok"
    denied = as_uid(nobody, lookup("root-ns"))
    assert denied.startswith("PermissionDenied") and "uid:nobody may not read namespace 'root-ns'" in denied
    assert as_uid(nobody, lookup("never-made")).replace("never-made", "NS") == denied.replace("root-ns", "NS")
    stranger = as_uid(54321, lookup("nobody-ns"))
    assert stranger.startswith("Unauthenticated") and "uid 54321 has no [[peer]] rule" in stranger
    # The daemon's own uid is trusted (it can read the arena file anyway).
    assert lookup("root-ns")() == "ok"


def test_authority_without_a_policy_lets_everyone_in_locally():
    authority = Authority()
    assert not authority.required and authority.anonymous() is ANONYMOUS
    assert authority.from_peer(12345) is ANONYMOUS
    with pytest.raises(Unauthenticated):
        Authority(mtls=True).anonymous()


def test_credentials_stay_out_of_reprs(tmp_path):
    security = ChannelSecurity.build(token=TOKEN_A)
    assert TOKEN_A not in repr(security) and "token" in repr(security)
    token_file = tmp_path / "t"
    token_file.write_text(f"  {TOKEN_A}  \n")
    assert ChannelSecurity.build(token_file=token_file).token == TOKEN_A


def test_the_example_policy_file_loads():
    from pathlib import Path

    policy = load_policy(Path(__file__).resolve().parents[2] / "deploy" / "policy.example.toml")
    assert policy.by_subjects(["prefill-0.prod.example"]).grant.allows("team-a-1", "write")
    assert policy.by_uid(1000).name == "uid:1000"


# ---- arenas and authorization ---------------------------------------------------


def test_an_identity_maps_only_the_arenas_whose_every_namespace_it_may_use(make_daemon, policy_file):
    """team-a may use a and a-*: it maps the arena holding a-* only, never the default arena
    (every other namespace); the admin maps both; offsets of an arena it may not map are refused."""
    daemon = make_daemon(auth_file=str(policy_file), ram_bytes="64MiB", arena=["team-a:a-*:16MiB"])
    team_a = raw_stub(daemon.target, TOKEN_A)
    mine = team_a.Attach(pb.AttachRequest(namespace="a-1"), timeout=10)
    assert mine.arena_name == "team-a" and mine.arena_path and mine.control_socket
    default = team_a.Attach(pb.AttachRequest(namespace="a"), timeout=10)  # "a" lives in the default arena
    assert default.arena_name != "team-a" and default.arena_path == "" and default.control_socket == ""
    err = rpc_error(team_a.Allocate, pb.AllocateRequest(
        namespace="a", blocks=[pb.BlockHeader(key=b"k", size=4096)]), timeout=10)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "streamed" in err.details()
    err = rpc_error(team_a.Lookup, pb.LookupRequest(namespace="a", keys=[b"k"]), timeout=10)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    slots = team_a.Allocate(pb.AllocateRequest(
        namespace="a-1", arena="team-a", blocks=[pb.BlockHeader(key=b"k", size=4096)]), timeout=10)
    assert slots.slots[0].slot_id
    admin = raw_stub(daemon.target, TOKEN_ADMIN)
    assert admin.Attach(pb.AttachRequest(namespace="a"), timeout=10).arena_path
    assert admin.Attach(pb.AttachRequest(namespace="a-1"), timeout=10).arena_path
    # The client streams the default arena's namespace and maps its own arena: both round-trip.
    with Client(daemon.target, token=TOKEN_A) as c:
        assert c.put("a", b"x", b"streamed" * 512) and c.put("a-1", b"y", b"mapped" * 512)
        assert c.get("a", b"x") == b"streamed" * 512 and c.get("a-1", b"y") == b"mapped" * 512


def test_a_tenants_stats_count_only_its_own_open_handoffs(authed):
    """Another tenant's handoffs are its activity: a tenant's Stats shows the handoffs open in the
    namespace it asked about, the admin's the node's."""
    with Client(authed.target, token=TOKEN_B, use_shm=False) as b:
        b.put("b", b"k", b"x" * 1000)
        b.open_handoff("b", [b"k"], lease_s=60)
        assert b.stats("b").open_handoffs == 1
    with Client(authed.target, token=TOKEN_A, use_shm=False) as a:
        a.put("a", b"k", b"y" * 1000)
        assert a.stats("a").open_handoffs == 0
        a.open_handoff("a", [b"k"], lease_s=60)
        assert a.stats("a").open_handoffs == 1
    with Client(authed.target, token=TOKEN_ADMIN, use_shm=False) as admin:
        assert admin.stats().open_handoffs == 2


def test_attach_tells_a_tenant_nothing_of_another_tenants_arena(make_daemon, policy_file):
    """Attach naming a namespace the caller may not read answers no arena name and no namespace
    patterns; a namespace it may read but not map gives the arena's name only (which transport to
    cache), never what else the arena holds."""
    daemon = make_daemon(auth_file=str(policy_file), ram_bytes="64MiB", arena=["team-b:b:16MiB", "team-a:a-*:16MiB"])
    team_a = raw_stub(daemon.target, TOKEN_A)
    theirs = team_a.Attach(pb.AttachRequest(namespace="b"), timeout=10)
    assert (theirs.arena_name, list(theirs.namespaces), theirs.arena_path) == ("", [], "")
    assert theirs.max_block_bytes > 0  # the node's limits are no tenant's secret
    mine = team_a.Attach(pb.AttachRequest(namespace="a-1"), timeout=10)
    assert mine.arena_name == "team-a" and list(mine.namespaces) == ["a-*"] and mine.arena_path
    default = team_a.Attach(pb.AttachRequest(namespace="a"), timeout=10)  # the default arena: not mappable
    assert default.arena_name and list(default.namespaces) == [] and default.arena_path == ""
    admin = raw_stub(daemon.target, TOKEN_ADMIN)
    assert admin.Attach(pb.AttachRequest(namespace="b"), timeout=10).namespaces == ["b"]
