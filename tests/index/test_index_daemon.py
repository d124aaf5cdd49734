"""The daemon and the prefix index together: publication, routing scores, restarts, outages."""

from __future__ import annotations

import signal
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore import Client, TierName
from kvstore.errors import IndexUnavailable, InvalidArgument
from kvstore.index.keys import BlockHasher, event_key_bytes
from tests.support import redis_servers
from tests.support.wait import wait_until

pytestmark = pytest.mark.system

TOKENS = list(range(1000, 1000 + 16 * 6 + 5))  # six full blocks and a partial one
HASHER = BlockHasher(16, "42")
KEYS = [event_key_bytes(h) for h in HASHER.chain(TOKENS)]


def put_chain(client: Client, keys: list[bytes], namespace: str = "m") -> None:
    parent = None
    for key in keys:
        client.put(namespace, key, key * 1000, parent=parent)
        parent = key


def score_of(client: Client, node: str, **chain) -> tuple[int, TierName | None]:
    for e in client.score("m", **chain):
        if e.node_id == node:
            return e.blocks, e.tier
    return 0, None


def test_scores_follow_what_the_store_holds(make_daemon):
    daemon = make_daemon(node_id="node-a", ram_bytes="16MiB", max_block_bytes="4MiB")
    with Client(daemon.target) as c:
        put_chain(c, KEYS[:4])
        wait_until(lambda: score_of(c, "node-a", keys=KEYS) == (4, TierName.HOST), what="the chain to be published")
        # the same chain asked as vLLM token ids
        [best] = c.score("m", tokens=TOKENS, block_size=16, hash_seed="42")
        assert (best.node_id, best.blocks) == ("node-a", 4) and best.score == pytest.approx(4 * 0.8)
        # a candidate that holds nothing is listed last with score 0
        ranked = c.score("m", keys=KEYS, candidates=["node-a", "node-z"])
        assert [e.node_id for e in ranked] == ["node-a", "node-z"] and ranked[1].score == 0
        # deleting the second block cuts the prefix at one block
        c.delete("m", [KEYS[1]])
        wait_until(lambda: score_of(c, "node-a", keys=KEYS) == (1, TierName.HOST), what="the delete to be published")
        holders = c.holders("m", keys=KEYS[:3])
        assert [[h.node_id for h in hs] for hs in holders] == [["node-a"], [], ["node-a"]]
        assert holders[0][0].epoch == c.stats().epoch
        # blocks pushed down to disk are scored at the disk tier's weight
        for i in range(8):
            c.put("m", b"filler%d" % i, b"f" * (4 << 20))
        wait_until(lambda: score_of(c, "node-a", keys=KEYS)[1] == TierName.DISK, what="the demotion to be published")


def test_bad_queries_get_clear_errors(daemon):
    with Client(daemon.target) as c:
        with pytest.raises(InvalidArgument, match="hash_seed"):
            c.score("m", tokens=TOKENS)
        with pytest.raises(InvalidArgument, match="either as keys or as tokens"):
            c.score("m")
        with pytest.raises(InvalidArgument, match="limit"):
            c.score("m", keys=[b"k%d" % i for i in range(5000)])
        with pytest.raises(InvalidArgument, match="chain is empty"):
            c.score("m", tokens=[1, 2, 3], block_size=16, hash_seed="0")
        with pytest.raises(InvalidArgument, match="chain is empty"):
            c.holders("m", keys=[])
        assert c.score("m", keys=[b"nothing"]) == []


def test_two_daemons_share_a_redis_index_and_a_killed_node_drops_out(daemon_process, redis_url, tmp_path):
    args = ("--index-url", redis_url, "--index-ttl-seconds", "1")
    a = daemon_process("--node-id", "node-a", *args)
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    from tests.support.daemons import DaemonProcess

    b = DaemonProcess(b_dir, "--node-id", "node-b", *args).start()
    try:
        with Client(a.target) as ca, Client(b.target) as cb:
            put_chain(ca, KEYS[:5])
            put_chain(cb, KEYS[:2])
            wait_until(
                lambda: [(e.node_id, e.blocks) for e in cb.score("m", keys=KEYS)] == [("node-a", 5), ("node-b", 2)],
                what="both nodes' chains ranked, seen through node-b",
            )
            first_epoch = ca.stats().epoch
            a.kill(signal.SIGKILL)
            # no answer names the dead node once its heartbeat lapses
            wait_until(lambda: score_of(cb, "node-a", keys=KEYS)[0] == 0, what="node-a to drop out after SIGKILL")
            a.start()  # a new epoch: re-publishes what survived (its RAM blocks, re-adopted from the arena)
            with Client(a.target) as ca2:
                epoch = ca2.stats().epoch
                assert epoch > first_epoch
                wait_until(lambda: score_of(cb, "node-a", keys=KEYS)[0] == 5, what="node-a's new epoch published")
                assert {h.epoch for h in cb.holders("m", keys=KEYS[:1])[0] if h.node_id == "node-a"} == {epoch}
    finally:
        b.stop()


@pytest.mark.skipif(not redis_servers.available(), reason="redis-server is not installed (apt-get install redis-server)")
def test_index_outage_degrades_then_republishes(make_daemon, tmp_path):
    redis = redis_servers.start_standalone(tmp_path / "redis")
    port = redis.port
    daemon = make_daemon(node_id="node-a", index_url=redis.url, index_ttl_seconds=2, metrics_listen="127.0.0.1:0")
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(daemon.target))

    def index_health():
        return health.Check(health_pb2.HealthCheckRequest(service="strata.index.v1.IndexService")).status

    def degraded() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read().decode()
        return float(next(l.split()[-1] for l in text.splitlines() if l.startswith("strata_index_degraded ")))

    try:
        with Client(daemon.target, retries=0) as c:
            put_chain(c, KEYS[:3])
            wait_until(lambda: score_of(c, "node-a", keys=KEYS)[0] == 3, what="publication to Redis")
            redis.stop()
            put_chain(c, KEYS[:5])  # local writes and hits go on
            assert c.get("m", KEYS[4]) == KEYS[4] * 1000
            wait_until(lambda: degraded() == 1.0, what="the agent to report the index degraded")
            assert index_health() == health_pb2.HealthCheckResponse.NOT_SERVING
            assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(IndexUnavailable):
                c.score("m", keys=KEYS)
            redis = redis_servers.RedisServer(tmp_path / "redis2", "--port", str(port))  # a new, empty Redis
            redis.port = port  # the later --port wins; ping that one
            redis.wait_ready()
            wait_until(lambda: degraded() == 0.0, what="the agent to reconnect")
            # the full holdings were re-published, including what was written during the outage
            wait_until(lambda: score_of(c, "node-a", keys=KEYS)[0] == 5, what="the re-publication")
            assert index_health() == health_pb2.HealthCheckResponse.SERVING
    finally:
        redis.stop()


def test_vllm_kv_events_reach_router_scores(make_daemon):
    """A real ZMQ publisher sends what vLLM sends for a captured request; a router asking
    with that request's token ids finds the engine, at tier GPU."""
    import json
    from pathlib import Path

    import zmq

    from tests.support.vllm_events import TestEngine, stored

    vector = json.loads((Path(__file__).resolve().parents[1] / "data/vllm_kv_events/base_seed42_block16.json").read_text())
    ctx = zmq.Context()
    engine = TestEngine(ctx)
    try:
        daemon = make_daemon(node_id="router-node", kv_events=f"{engine.endpoint}?engine=vllm-0&namespace=qwen3")
        event = stored(vector["block_hashes"], tokens=vector["token_ids"], block_size=vector["block_size"])
        query = dict(tokens=vector["token_ids"], block_size=vector["block_size"], hash_seed=vector["hash_seed"])
        with Client(daemon.target) as c:

            def engine_ranked():
                engine.publish([event])  # again until the subscriber has joined (ZMQ slow joiner)
                return [(e.node_id, e.blocks, e.tier) for e in c.score("qwen3", **query)]

            assert wait_until(engine_ranked, what="the engine's blocks in the index") == [
                ("vllm-0", len(vector["block_hashes"]), TierName.GPU)
            ]
    finally:
        engine.close()
        ctx.term()


def _index_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``strata index ARGS`` through the CLI's own entry point, in this process: (exit status, stdout, stderr)."""
    from kvstore.cli.main import main

    capsys.readouterr()
    try:
        status = main(["index", *args])
    except SystemExit as e:  # a refusal: as the interpreter exits, a message goes to stderr with status 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        status = 1 if isinstance(e.code, str) else e.code or 0
    out = capsys.readouterr()
    return status, out.out, out.err


def test_index_cli(daemon_process, capsys):
    d = daemon_process("--node-id", "node-cli")
    with Client(d.target) as c:
        put_chain(c, KEYS[:3])
        wait_until(lambda: score_of(c, "node-cli", keys=KEYS)[0] == 3, what="publication")
    tokens = ",".join(map(str, TOKENS))
    status, out, err = _index_cli(capsys, "lookup", "m", "--tokens", tokens, "--hash-seed", "42", "--target", d.target)
    assert status == 0 and out.startswith("node-cli\t3 blocks\thost"), out + err
    status, out, err = _index_cli(capsys, "holders", "--hex", "--target", d.target, "m", *(k.hex() for k in KEYS[:4]))
    assert status == 0 and out.splitlines()[3] == "block 3\tnobody", out + err
    status, out, err = _index_cli(capsys, "lookup", "m", "--tokens", tokens, "--target", d.target)
    assert status != 0 and "--hash-seed" in err


@pytest.mark.skipif(not redis_servers.available(), reason="redis-server is not installed (apt-get install redis-server)")
def test_a_stalled_index_cannot_take_the_kv_workers(make_daemon, tmp_path):
    """Redis stopped with SIGSTOP: index RPCs hang until their timeout. At most half the
    workers may wait on it; the rest of the index RPCs are refused at once with a retry
    delay, and KV RPCs are still answered."""
    import os
    import threading

    from kvstore.api.v1 import index_pb2, index_pb2_grpc
    from kvstore.errors import DeadlineExceeded, Overloaded
    from kvstore.rpc.status import from_rpc_error

    redis = redis_servers.start_standalone(tmp_path / "redis")
    daemon = make_daemon(node_id="node-a", index_url=redis.url, workers=4, index_ttl_seconds=30)
    channel = grpc.insecure_channel(daemon.target)
    index = index_pb2_grpc.IndexServiceStub(channel)
    request = index_pb2.ScoreRequest(namespace="m", keys=index_pb2.KeyChain(keys=KEYS))
    outcomes: list = []
    try:
        with Client(daemon.target, retries=0, timeout=10) as c:
            put_chain(c, KEYS[:2])
            wait_until(lambda: score_of(c, "node-a", keys=KEYS)[0] == 2, what="publication to Redis")
            os.kill(redis.proc.pid, signal.SIGSTOP)

            def score() -> None:
                try:
                    outcomes.append(index.Score(request, timeout=60))
                except grpc.RpcError as err:
                    outcomes.append(from_rpc_error(err))

            callers = [threading.Thread(target=score) for _ in range(24)]
            for t in callers:
                t.start()
            wait_until(lambda: any(isinstance(o, Overloaded) for o in outcomes), what="an index RPC to be refused")
            # 24 index RPCs would hold all 4 workers for several index timeouts; a local hit
            # is served now
            assert c.get("m", KEYS[0]) == KEYS[0] * 1000
            refused = [o for o in outcomes if isinstance(o, Overloaded)]
            assert refused and all(o.retry_after_s > 0 for o in refused)
            os.kill(redis.proc.pid, signal.SIGCONT)
            for t in callers:
                t.join(60)
            assert len(outcomes) == 24
            # the ones that waited got an answer or a timeout, never a hang or an INTERNAL error
            assert all(isinstance(o, (index_pb2.ScoreResponse, Overloaded, DeadlineExceeded, IndexUnavailable)) for o in outcomes)
            wait_until(lambda: score_of(c, "node-a", keys=KEYS)[0] == 2, what="index queries to work again")
    finally:
        os.kill(redis.proc.pid, signal.SIGCONT)
        channel.close()
        redis.stop()
