"""Isolated arenas: a real daemon, real gRPC, the real same-host sockets and real files."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import grpc
import pytest

from kvstore import AsyncClient, Client, TierName
from kvstore.api.v1 import kv_pb2 as pb
from kvstore.api.v1 import kv_pb2_grpc
from kvstore.block import checksum
from kvstore.cli.common import serve_overrides
from kvstore.cli.main import build_parser
from kvstore.config import SettingsError, load_settings
from kvstore.errors import InvalidArgument, UnknownLease
from kvstore.server.service import KVServicer
from kvstore.store.leases import RANDOM_BITS, tag_of
from kvstore.store.namespace_rules import NamespaceRules
from kvstore.transport.samehost import frames
from kvstore.wire.unix import connect_unix
from tests.support.wait import wait_until

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
# team-a holds a-* and "shared"; every other namespace is in the default arena.
ARENA_A = "team-a:a-*,shared:32MiB"


def two_arenas(make_daemon, **overrides):
    return make_daemon(ram_bytes="64MiB", arena=[ARENA_A], **overrides)


def attach(daemon, namespace: str = "") -> pb.AttachResponse:
    with grpc.insecure_channel(daemon.target) as channel:
        return kv_pb2_grpc.KVServiceStub(channel).Attach(pb.AttachRequest(namespace=namespace), timeout=10)


def value(tag: int, size: int) -> bytes:
    return bytes([tag % 251]) * size


class Raw:
    """A hand-driven same-host connection to the socket an Attach named."""

    def __init__(self, attached: pb.AttachResponse) -> None:
        self.sock = connect_unix(attached.control_socket, 10)
        self.reader = frames.FrameReader(self.sock)
        assert self.call(frames.HELLO, [frames.PROTOCOL_VERSION, attached.arena_token])[1] == frames.OK

    def call(self, op, args, payload=b""):
        frames.send(self.sock, frames.encode([op, 7, args], len(payload)), [payload] if payload else ())
        return self.reader.read()[0]

    def close(self) -> None:
        self.sock.close()


# ---- the data paths -------------------------------------------------------------


def test_attach_names_each_namespaces_arena_with_its_own_file_and_socket(make_daemon):
    daemon = two_arenas(make_daemon)
    a, default, legacy = attach(daemon, "a-1"), attach(daemon, "b"), attach(daemon)
    assert (a.arena_name, list(a.namespaces)) == ("team-a", ["a-*", "shared"])
    assert (default.arena_name, list(default.namespaces)) == ("default", ["*"])
    assert legacy.arena_path == default.arena_path  # an old client's empty Attach: the default arena
    assert a.arena_path != default.arena_path and a.control_socket != default.control_socket
    assert a.arena_bytes == 32 * MiB and default.arena_bytes == 32 * MiB
    assert attach(daemon, "shared").arena_path == a.arena_path


@pytest.mark.parametrize("transport", ["same-host", "grpc-arena"])
def test_a_client_writes_and_reads_both_arenas_through_shared_memory(make_daemon, transport):
    daemon = two_arenas(make_daemon)
    with Client(daemon.target, use_shm=True, transport=transport) as c:
        for ns in ("a-1", "b", "shared"):
            big, small = value(len(ns), 3 * MiB), value(len(ns) + 1, 4096)  # in place, and inline
            assert c.put(ns, b"big", big) and c.put(ns, b"small", small)
            assert c.get(ns, b"big") == big and c.get(ns, b"small") == small
            assert c.transport_for(ns) == transport
    assert daemon.store.stats("a-1").blocks == 2 and daemon.store.stats("shared").blocks == 2
    assert daemon.store.stats("a-1").tiers[0].blocks == 4  # team-a's RAM holds a-1's and shared's
    assert daemon.store.stats("b").tiers[0].blocks == 2


def test_the_async_client_uses_each_arena(make_daemon):
    daemon = two_arenas(make_daemon)

    async def run():
        async with AsyncClient(daemon.target, use_shm=True) as c:
            for ns in ("a-1", "b"):
                data = value(len(ns), 2 * MiB)
                assert await c.put(ns, b"k", data)
                assert await c.get(ns, b"k") == data
                assert await c.transport_name(ns) == "same-host"
            assert len(c._attached) == 2  # one mapping per arena, not per namespace
            assert await c.put("a-2", b"k", b"x" * 100) and len(c._attached) == 2

    asyncio.run(run())


def test_an_arena_the_caller_may_not_map_is_streamed(make_daemon, monkeypatch):
    monkeypatch.setattr(KVServicer, "_may_attach", lambda self, context, arena: arena.name != "team-a")
    daemon = two_arenas(make_daemon)
    refused = attach(daemon, "a-1")
    assert refused.arena_name == "team-a" and not refused.arena_path and not refused.control_socket
    assert not refused.arena_token
    with Client(daemon.target) as c:
        for ns in ("a-1", "b"):
            data = value(len(ns), MiB)
            assert c.put(ns, b"k", data) and c.get(ns, b"k") == data
        assert c.transport_for("a-1") == "grpc" and c.transport_for("b") == "same-host"

    async def run():
        async with AsyncClient(daemon.target) as c:
            assert await c.get("a-1", b"k") == value(3, MiB)
            assert await c.transport_name("a-1") == "grpc" and await c.transport_name("b") == "same-host"

    asyncio.run(run())


# ---- isolation ---------------------------------------------------------------------


def test_filling_one_arena_never_evicts_another_arenas_blocks(make_daemon):
    daemon = two_arenas(make_daemon, disk_bytes="0")  # RAM only: eviction drops
    with Client(daemon.target) as c:
        kept = {f"b{i}".encode(): value(i, MiB) for i in range(8)}
        for key, data in kept.items():
            c.put("b", key, data)
        for i in range(100):  # 100 MiB into a 32 MiB arena
            c.put("a-1", f"a{i}".encode(), value(i, MiB))
        assert daemon.store.stats("a-1").blocks <= 32  # team-a dropped its own oldest blocks
        assert c.exists("a-1", [b"a0"]) == []
        for key, data in kept.items():
            assert c.exists("b", [key]) == [TierName.HOST] and c.get("b", key) == data


def test_one_arenas_socket_refuses_another_arenas_namespaces(make_daemon):
    daemon = two_arenas(make_daemon)
    with Client(daemon.target) as c:
        c.put("b", b"k", value(1, MiB))
        c.put("a-1", b"k", value(2, MiB))
    raw = Raw(attach(daemon, "a-1"))
    try:
        for op, args, payload in [
            (frames.LOOKUP, ["b", [b"k"], 0, 0, []], b""),
            (frames.ALLOCATE, ["b", 0, 0, [[b"n", 4096, None, ""]]], b""),
            (frames.PUT, ["b", 0, [[b"n", 3, checksum(b"abc"), None, ""]]], b"abc"),
            (frames.LOOKUP, ["shared-not", [b"k"], 0, 0, []], b""),
        ]:
            _, status, (name, message, _) = raw.call(op, args, payload)
            assert (status, name) == (frames.ERROR, "InvalidArgument")
            assert "belongs to arena 'default'" in message and "Attach with namespace" in message
        # its own namespace is served there, with offsets in its own arena
        _, status, (_, found) = raw.call(frames.LOOKUP, ["a-1", [b"k"], 0, 0, []])
        assert status == frames.OK and found[0] is not None and found[0][4] + MiB <= 32 * MiB
    finally:
        raw.close()
    assert daemon.store.stats("b").blocks == 1  # nothing written to b through a's socket


def test_lease_and_slot_ids_route_by_their_arenas_tag(make_daemon):
    daemon = two_arenas(make_daemon)
    with grpc.insecure_channel(daemon.target) as channel:
        stub = kv_pb2_grpc.KVServiceStub(channel)
        alloc = stub.Allocate(pb.AllocateRequest(namespace="a-1", blocks=[pb.BlockHeader(key=b"s", size=4096)],
                                                 arena="team-a"))
        slot = alloc.slots[0].slot_id
        assert tag_of(slot) == 1
        forged = slot & ((1 << RANDOM_BITS) - 1)  # the same random bits with the default arena's tag
        with pytest.raises(grpc.RpcError) as err:
            stub.Commit(pb.CommitRequest(items=[pb.CommitRequest.Item(slot_id=forged, checksum=checksum(bytes(4096)))]))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "never issued" in err.value.details()
        other = stub.Allocate(pb.AllocateRequest(namespace="b", blocks=[pb.BlockHeader(key=b"s", size=4096)]))
        assert tag_of(other.slots[0].slot_id) == 0
        mixed = [pb.CommitRequest.Item(slot_id=s.slot_id, checksum=checksum(bytes(4096))) for s in (alloc.slots[0], other.slots[0])]
        with pytest.raises(grpc.RpcError) as err:
            stub.Commit(pb.CommitRequest(items=mixed))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than one arena" in err.value.details()
        # both slots are still open: each commits on its own (the arena is zero-filled)
        for item in mixed:
            assert stub.Commit(pb.CommitRequest(items=[item])).results[0].stored
        pin = stub.Pin(pb.PinRequest(namespace="a-1", keys=[b"s"]))
        assert tag_of(pin.lease_id) == 1 and stub.Unpin(pb.UnpinRequest(lease_id=pin.lease_id)).released
    # A's socket knows nothing of the default arena's ids, and the reverse
    raw = Raw(attach(daemon, "b"))
    try:
        _, status, (_, found) = raw.call(frames.LOOKUP, ["b", [b"s"], 0, 0, []])
        lease_b = found[0][5]
    finally:
        raw.close()
    raw = Raw(attach(daemon, "a-1"))
    try:
        _, status, (name, message, _) = raw.call(frames.COMMIT, [[lease_b], [0]])
        assert status == frames.ERROR and name == "UnknownLease"
        _, status, valid = raw.call(frames.RELEASE, [[lease_b]])
        assert status == frames.OK and valid == [False]  # not released through the wrong arena
    finally:
        raw.close()
    raw = Raw(attach(daemon, "b"))  # the owner (this process) releases it through its own arena's socket
    try:
        _, status, valid = raw.call(frames.RELEASE, [[lease_b]])
        assert status == frames.OK and valid == [True]
    finally:
        raw.close()


def test_grpc_offsets_only_into_the_arena_the_caller_mapped(make_daemon):
    daemon = two_arenas(make_daemon)
    with Client(daemon.target) as c:
        c.put("a-1", b"k", value(1, MiB))
    with grpc.insecure_channel(daemon.target) as channel:
        stub = kv_pb2_grpc.KVServiceStub(channel)
        block = [pb.BlockHeader(key=b"n", size=4096)]
        for arena in ("", "default"):  # an older client sends none: it mapped the default arena
            for call, request in [(stub.Lookup, pb.LookupRequest(namespace="a-1", keys=[b"k"], arena=arena)),
                                  (stub.Allocate, pb.AllocateRequest(namespace="a-1", blocks=block, arena=arena))]:
                with pytest.raises(grpc.RpcError) as err:
                    call(request)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "belongs to arena 'team-a'" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(pb.LookupRequest(namespace="a-1", keys=[b"k"], arena="gone"))
        assert "no arena 'gone'" in err.value.details() and "Attach again" in err.value.details()
        found = stub.Lookup(pb.LookupRequest(namespace="a-1", keys=[b"k"], arena="team-a")).blocks[0]
        assert found.found and tag_of(found.lease_id) == 1
        assert stub.Release(pb.ReleaseRequest(lease_ids=[found.lease_id])).valid == [True]


def test_stats_per_arena_and_for_the_node(make_daemon):
    daemon = two_arenas(make_daemon, disk_bytes="128MiB")
    with Client(daemon.target) as c:
        c.put("a-1", b"k", b"x" * 4096)
        c.put("b", b"k", b"y" * 4096)
        c.put("b", b"k2", b"z" * 4096)
        a, b, node = c.stats("a-1"), c.stats("b"), c.stats()
    assert a.tiers["host"]["capacity_bytes"] == 32 * MiB and b.tiers["host"]["capacity_bytes"] == 32 * MiB
    assert a.tiers["disk"]["capacity_bytes"] == 64 * MiB and b.tiers["disk"]["capacity_bytes"] == 64 * MiB
    assert (a.blocks, b.blocks, node.blocks) == (1, 2, 3)
    assert node.tiers["host"]["capacity_bytes"] == 64 * MiB and node.tiers["disk"]["capacity_bytes"] == 128 * MiB
    assert node.namespaces == ["a-1", "b"]
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(daemon.metrics.registry).decode())
        for s in family.samples
    }
    assert samples["strata_tier_capacity_bytes", (("tier", "host"),)] == 64 * MiB  # the node's sum, one series
    assert samples["strata_arena_tier_capacity_bytes", (("arena", "team-a"), ("tier", "host"))] == 32 * MiB
    assert samples["strata_arena_tier_blocks", (("arena", "default"), ("tier", "host"))] == 2


def test_a_restart_keeps_both_arenas_disk_blocks(make_daemon, tmp_path):
    disk = tmp_path / "node"
    daemon = two_arenas(make_daemon, disk_dir=str(disk))
    with Client(daemon.target) as c:
        c.put("a-1", b"k", value(1, MiB))
        c.put("b", b"k", value(2, MiB))
    daemon.stop(0)  # a graceful stop writes RAM blocks down to each arena's disk, and keeps each arena
    assert any((disk / "arenas" / "team-a").rglob("*")) and any((disk / "blocks").rglob("*"))
    again = two_arenas(make_daemon, disk_dir=str(disk))
    with Client(again.target) as c:
        for ns, tag in (("a-1", 1), ("b", 2)):  # RAM re-adopted from its own arena, and a copy on its own disk
            assert c.exists(ns, [b"k"]) == [TierName.HOST] and c.get(ns, b"k") == value(tag, MiB)
            assert c.stats(ns).tiers["disk"]["blocks"] == 1
    again.stop(0)
    for path in tmp_path.glob("strata-*"):  # what a reboot leaves: no arena, only the disk
        path.unlink()
    third = two_arenas(make_daemon, disk_dir=str(disk))
    with Client(third.target) as c:
        assert c.exists("a-1", [b"k"]) == [TierName.DISK] and c.get("a-1", b"k") == value(1, MiB)
        assert c.exists("b", [b"k"]) == [TierName.DISK] and c.get("b", b"k") == value(2, MiB)


def test_a_killed_daemon_keeps_both_arenas_written_through_blocks(daemon_process):
    proc = daemon_process("--arena", "team-a:a-*:64MiB", "--arena", "team-c:c:64MiB:32MiB",
                          "--ram-bytes", "192MiB", "--disk-write-policy", "through")
    with Client(proc.target) as c:
        for ns in ("a-1", "c", "b"):
            assert c.put(ns, b"k", value(len(ns), MiB))
            assert c.transport_for(ns) == "same-host"
        wait_until(lambda: all(c.exists(ns, [b"k"]) == [TierName.HOST] for ns in ("a-1", "c", "b")))
        for ns in ("a-1", "c", "b"):  # write-through: a disk copy exists once the demotion queue drained
            wait_until(lambda: c.stats(ns).tiers["disk"]["blocks"] == 1, what=f"{ns}'s disk copy")
    proc.kill()
    proc.start()
    with Client(proc.target) as c:
        for ns in ("a-1", "c", "b"):
            assert c.get(ns, b"k") == value(len(ns), MiB)
        assert c.stats("c").tiers["disk"]["capacity_bytes"] == 32 * MiB


def test_arena_files_blocks_and_sockets_are_private(make_daemon, tmp_path):
    daemon = two_arenas(make_daemon, disk_dir=str(tmp_path / "node"), disk_write_policy="through")
    with Client(daemon.target) as c:
        c.put("a-1", b"k", value(1, MiB))
        wait_until(lambda: c.stats("a-1").tiers["disk"]["blocks"] == 1, what="the disk copy")
    for ns in ("a-1", "b"):
        got = attach(daemon, ns)
        assert os.stat(got.arena_path).st_mode & 0o777 == 0o600
        mode = os.stat(got.control_socket).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    blocks = [p for p in (tmp_path / "node" / "arenas" / "team-a").rglob("*") if p.is_file() and p.name != "LOCK"]
    assert blocks
    # Every file of the state directory: blocks, the tiers' locks, the daemon's lock, the epoch.
    files = [p for p in (tmp_path / "node").rglob("*") if p.is_file()]
    assert {"epoch", "daemon.lock", "LOCK"} <= {p.name for p in files}
    readable = [f"{p.relative_to(tmp_path)} {os.stat(p).st_mode & 0o777:o}" for p in files
                if os.stat(p).st_mode & 0o077]
    assert not readable, readable


def test_without_arenas_the_node_is_one_default_arena(daemon):
    got = attach(daemon, "anything")
    assert (got.arena_name, list(got.namespaces)) == ("default", ["*"])
    assert got.arena_path == daemon.store.head.arena.path and len(daemon.store.arenas) == 1


# ---- config -----------------------------------------------------------------------


def test_arenas_from_flags_variables_and_both_toml_forms(tmp_path):
    args = build_parser().parse_args(["serve", "--ram-bytes", "1GiB", "--arena", "x:x-*:64MiB", "--arena", "y:y:64MiB:1GiB"])
    flags = load_settings(environ={}, **serve_overrides(args))
    env = load_settings(environ={"STRATA_RAM_BYTES": "1GiB", "STRATA_ARENA": "x:x-*:64MiB; y:y:64MiB:1GiB"})
    listed = tmp_path / "listed.toml"
    listed.write_text('[tiers.ram]\nbytes = "1GiB"\n[[arenas]]\nname = "x"\nnamespaces = ["x-*"]\nram_bytes = "64MiB"\n'
                      '[[arenas]]\nname = "y"\nnamespaces = ["y"]\nram_bytes = "64MiB"\ndisk_bytes = "1GiB"\n')
    tables = tmp_path / "tables.toml"
    tables.write_text('[tiers.ram]\nbytes = "1GiB"\n[arenas.x]\nnamespaces = ["x-*"]\nram_bytes = "64MiB"\n'
                      '[arenas.y]\nnamespaces = ["y"]\nram_bytes = "64MiB"\ndisk_bytes = "1GiB"\n')
    plans = [s.arena_plan() for s in (flags, env, load_settings(listed, environ={}), load_settings(tables, environ={}))]
    assert all(p == plans[0] for p in plans)
    default, x, y = plans[0]
    assert (default["name"], default["ram_bytes"]) == ("default", (1 << 30) - 128 * MiB)
    assert x["disk_bytes"] == (10 << 30) // 16  # its RAM share of the disk
    assert y["disk_bytes"] == 1 << 30 and default["disk_bytes"] == (10 << 30) - x["disk_bytes"] - y["disk_bytes"]


def test_the_example_configs_commented_arena_loads():
    text = (ROOT / "deploy" / "strata.example.toml").read_text()
    block = text.split("# [[arenas]]", 1)[1].split("\n\n", 1)[0]
    example = "[[arenas]]" + "\n".join(line.removeprefix("# ") for line in block.splitlines())
    import tomllib

    s = load_settings(environ={}, arena=tomllib.loads(example)["arenas"])
    assert s.arena_plan()[1]["namespaces"] == ("team-a-*", "shared-emb")


@pytest.mark.parametrize("arenas, needle", [
    (["x:m:64MiB", "y:m:64MiB"], "'m' overlaps 'm' in arenas 'x' ('m') and 'y' ('m')"),
    (["x:team-*:64MiB", "y:team-a:64MiB"], "arenas 'x' ('team-*') and 'y' ('team-a')"),
    (["x:m:64MiB", "x:n:64MiB"], "arena 'x' is defined twice"),
    (["x:m:lots"], "--arena"),
    (["x:m:8MiB"], "at least 16MiB"),
    (["x:m:2GiB"], "raise --ram-bytes or shrink the arenas"),
    (["x:m:64MiB:20GiB"], "raise --disk-bytes or lower the arenas' disk sizes"),
    (["Team:m:64MiB"], "a-z, 0-9"),
    (["default:m:64MiB"], "pick another"),
    (["x:a*b:64MiB"], "may only end a prefix pattern"),
    (["x:*:64MiB"], "matches every namespace"),
    (["x:m"], "NAME:NS1,NS2:RAM_BYTES[:DISK_BYTES]"),
])
def test_arena_config_errors_name_the_fix(arenas, needle):
    with pytest.raises(SettingsError) as err:
        load_settings(environ={}, ram_bytes="1GiB", arena=arenas)
    assert needle in str(err.value)


def test_a_disk_size_without_a_disk_tier_is_refused():
    with pytest.raises(SettingsError, match="the disk tier is off"):
        load_settings(environ={}, disk_bytes="0", arena=["x:m:64MiB:1GiB"])


def test_namespace_rules_match_exact_names_then_prefixes():
    rules = NamespaceRules([("a", ["team-a-*", "emb"]), ("b", ["team-b"])], "default")
    assert [rules.arena_of(ns) for ns in ("team-a-1", "emb", "team-b", "team-b-1", "embx", "team-a")] == [
        "a", "a", "b", "default", "default", "default",
    ]


def test_group_routes_ids_it_never_issued_as_unknown(make_daemon):
    daemon = two_arenas(make_daemon)
    with pytest.raises(UnknownLease):
        daemon.store.commit([(200 << RANDOM_BITS | 5, 0)])  # a tag no arena has
    assert daemon.store.release([200 << RANDOM_BITS | 5]) == [False]
    with pytest.raises(InvalidArgument, match="belongs to arena 'team-a'"):
        daemon.store.only("default").lookup("a-1", [b"k"])
