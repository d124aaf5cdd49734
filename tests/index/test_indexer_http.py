"""The indexer HTTP API (``strata index serve``): a real aiohttp server on a free port, a real aiohttp client.

The memory index is filled the way the KV-event subscriber records an engine (8-byte event
keys, the engine's id as holder, its medium's tier), and through ``/register`` by a real
engine stand-in publishing vLLM's events over ZMQ. Each answer's columns are checked against
a computation from the token ids made here, apart from the server's.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import zmq

from kvstore.block import TierName
from kvstore.indexer.api import MAX_QUERY_TOKENS, MAX_SEQ_HASHES
from kvstore.indexer.server import IndexerServer
from kvstore.indexer.settings import IndexerError, IndexerSettings
from kvstore.index.keys import BlockHasher, event_key, event_key_bytes
from kvstore.index.memory import MemoryIndex
from tests.support.vllm_events import TestEngine, stored

SEED = "0"
BS = 4
MODEL = "llama"
WAIT_S = 10.0


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 30))


class Api:
    def __init__(self, **settings):
        self.index = MemoryIndex()
        self.settings = IndexerSettings(listen="127.0.0.1:0", hash_seed=SEED, **settings)

    async def __aenter__(self) -> Api:
        self.server = await IndexerServer(self.settings, self.index).start()
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()
        await self.server.stop()

    async def post(self, path: str, body=None, *, data: bytes | None = None, headers=None) -> tuple[int, dict]:
        kwargs = {"json": body} if data is None else {"data": data}
        async with self.http.post(self.server.url + path, headers=headers, **kwargs) as r:
            return r.status, await r.json()

    async def hold(self, node_id: str, tokens: list[int], tiers: list[TierName], *, lora=None, salt=None,
                   namespace: str = MODEL) -> list[bytes]:
        """Record ``node_id`` as holding the chain's blocks, block i in ``tiers[i]``, as the subscriber does."""
        keys = [event_key_bytes(h) for h in BlockHasher(BS, SEED, lora).chain(tokens, cache_salt=salt)]
        epoch = 1 + max((n.epoch for n in await self.index.nodes() if n.node_id == node_id), default=0)
        await self.index.join(node_id, epoch, 60)
        await self.index.add(namespace, node_id, epoch, list(zip(keys, tiers)))
        return keys


def expected(tiers: list[TierName], held: int) -> dict[str, int]:
    """Columns computed here: leading blocks in T-or-faster, times the block size."""
    out = {}
    for column, tier in (("GPU", 1), ("CPU", 2), ("DISK", 3), ("PEER", 4), ("OBJECT", 5)):
        n = 0
        while n < held and tiers[n] <= tier:
            n += 1
        out[column] = n * BS
    out["longest_matched"] = held * BS
    return out


PROMPT = list(range(100, 100 + 6 * BS + 2))  # six full blocks and a partial one


def test_query_answers_per_instance_per_tier_and_per_dp_rank():
    async def main():
        async with Api() as t:
            a_tiers = [TierName.GPU, TierName.GPU, TierName.HOST, TierName.DISK, TierName.OBJECT]
            await t.hold("vllm-a", PROMPT[: 5 * BS], a_tiers)
            await t.hold("vllm-b@dp0", PROMPT[: 2 * BS], [TierName.GPU] * 2)
            await t.hold("vllm-b@dp1", PROMPT[: 4 * BS], [TierName.HOST] * 4)
            await t.hold("other", [9] * 3 * BS, [TierName.GPU] * 3)  # another prompt: not an answer

            status, body = await t.post("/query", {"model": MODEL, "token_ids": PROMPT, "block_size": BS})
            assert status == 200, body
            assert body["blocks"] == 6 and set(body["instances"]) == {"vllm-a", "vllm-b"}
            a = body["instances"]["vllm-a"]
            assert {k: v for k, v in a.items() if k != "DP"} == expected(a_tiers, 5)
            assert a["DP"] == {"0": 5 * BS}
            b = body["instances"]["vllm-b"]
            assert b["DP"] == {"0": 2 * BS, "1": 4 * BS}
            assert (b["longest_matched"], b["GPU"], b["CPU"], b["OBJECT"]) == (4 * BS, 2 * BS, 4 * BS, 4 * BS)

            # one instance asked for: only it; a miss is an answer of zeros
            status, body = await t.post("/query", {"model": MODEL, "token_ids": PROMPT, "block_size": BS,
                                                   "instance_id": "nobody"})
            assert body["instances"] == {"nobody": {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0,
                                                    "PEER": 0, "OBJECT": 0, "DP": {}}}

    run(main())


def test_lora_salt_and_tenant_change_the_keys_as_the_engines_do():
    async def main():
        async with Api() as t:
            await t.hold("lora-engine", PROMPT[: 3 * BS], [TierName.GPU] * 3, lora="ad-1", salt="s")
            await t.hold("tenant-engine", PROMPT[: 2 * BS], [TierName.GPU] * 2, namespace=f"t1/{MODEL}")
            base = {"model": MODEL, "token_ids": PROMPT, "block_size": BS}
            _, plain = await t.post("/query", base)
            assert plain["instances"] == {}
            _, salted = await t.post("/query", {**base, "lora_name": "ad-1", "cache_salt": "s"})
            assert salted["instances"]["lora-engine"]["longest_matched"] == 3 * BS
            _, other_salt = await t.post("/query", {**base, "lora_name": "ad-1", "cache_salt": "x"})
            assert other_salt["instances"] == {}
            _, tenant = await t.post("/query", {**base, "tenant_id": "t1"})
            assert tenant["namespace"] == f"t1/{MODEL}" and tenant["instances"]["tenant-engine"]["GPU"] == 2 * BS

    run(main())


def test_query_by_hash_takes_event_ints_signed_ints_and_hex():
    async def main():
        async with Api() as t:
            keys = await t.hold("vllm-a", PROMPT[: 3 * BS], [TierName.GPU, TierName.HOST, TierName.HOST])
            digests = BlockHasher(BS, SEED).chain(PROMPT[: 3 * BS])
            ints = [event_key(d) for d in digests]
            signed = [i - (1 << 64) if i >= 1 << 63 else i for i in ints]
            for hashes in (ints, signed, [k.hex() for k in keys], [d.hex() for d in digests]):
                status, body = await t.post("/query_by_hash", {"model": MODEL, "seq_hashes": hashes,
                                                               "block_size": BS})
                assert status == 200, body
                assert body["instances"]["vllm-a"]["GPU"] == BS and body["instances"]["vllm-a"]["CPU"] == 3 * BS
            # a chain whose first block is not held matches nothing: leading blocks only
            _, body = await t.post("/query_by_hash", {"model": MODEL, "seq_hashes": [12345, *ints],
                                                      "block_size": BS})
            assert body["instances"] == {}

    run(main())


async def _eventually(predicate, what: str):
    end = time.monotonic() + WAIT_S
    while not await predicate():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_register_follows_a_real_event_stream_and_unregister_drops_it():
    async def main():
        ctx = zmq.Context()
        engine = TestEngine(ctx, replay=True)
        try:
            async with Api() as t:
                reg = {"instance_id": 7, "dp_rank": 1, "endpoint": engine.endpoint,
                       "replay_endpoint": engine.replay_endpoint, "model": MODEL}
                status, body = await t.post("/register", reg)
                assert status == 200 and body["registered"] == "7@dp1", body
                assert (await t.post("/register", reg))[0] == 200  # the same again: idempotent
                status, body = await t.post("/register", {**reg, "endpoint": "tcp://127.0.0.1:1"})
                assert status == 409 and "/unregister" in body["error"]["message"]

                hashes = [event_key(d) for d in BlockHasher(BS, SEED).chain(PROMPT)]
                engine.publish([stored(hashes[:3], block_size=BS), stored(hashes[3:4], parent=hashes[2],
                                                                          block_size=BS, medium="CPU")])
                query = {"model": MODEL, "token_ids": PROMPT, "block_size": BS}

                async def indexed():
                    engine.publish([])  # beat the slow joiner; replay covers the rest
                    _, body = await t.post("/query", query)
                    return body["instances"].get("7", {}).get("longest_matched") == 4 * BS
                await _eventually(indexed, "the engine's events in the index")
                _, body = await t.post("/query", query)
                assert body["instances"]["7"] == {"longest_matched": 16, "GPU": 12, "CPU": 16, "DISK": 16,
                                                  "PEER": 16, "OBJECT": 16, "DP": {"1": 16}}
                async with t.http.get(t.server.url + "/instances") as r:
                    listed = await r.json()
                assert listed[0]["instance_id"] == "7" and listed[0]["endpoints"]["1"]["endpoint"] == engine.endpoint

                status, body = await t.post("/unregister", {"instance_id": "7"})
                assert status == 200 and body == {"unregistered": ["7@dp1"]}
                _, body = await t.post("/query", query)
                assert body["instances"] == {}  # dropped at once, not after a TTL
                status, body = await t.post("/unregister", {"instance_id": "7"})
                assert status == 404 and "GET /instances" in body["error"]["message"]
        finally:
            engine.close()
            ctx.term()

    run(main())


@pytest.mark.parametrize("path, body, status, words", [
    ("/query", {"token_ids": [1], "block_size": BS}, 400, "'model' is required"),
    ("/query", {"model": MODEL, "token_ids": "1 2", "block_size": BS}, 400, "list of integers"),
    ("/query", {"model": MODEL, "token_ids": [1, -2], "block_size": BS}, 400, "token_ids[1]"),
    ("/query", {"model": MODEL, "token_ids": [1, True], "block_size": BS}, 400, "token_ids[1]"),
    ("/query", {"model": MODEL, "token_ids": [1]}, 400, "'block_size' is required"),
    ("/query", {"model": MODEL, "token_ids": [1], "block_size": 0}, 400, "--block-size"),
    ("/query", {"model": "bad model", "token_ids": [1], "block_size": BS}, 400, "namespace"),
    ("/query", {"model": MODEL, "token_ids": [0] * (MAX_QUERY_TOKENS + 1), "block_size": BS}, 413, "prompt's head"),
    ("/query_by_hash", {"model": MODEL, "seq_hashes": [], "block_size": BS}, 400, "non-empty list"),
    ("/query_by_hash", {"model": MODEL, "seq_hashes": ["zz"], "block_size": BS}, 400, "as hex"),
    ("/query_by_hash", {"model": MODEL, "seq_hashes": [1 << 64], "block_size": BS}, 400, "as an integer"),
    ("/query_by_hash", {"model": MODEL, "seq_hashes": [1] * (MAX_SEQ_HASHES + 1), "block_size": BS}, 413,
     "chain's head"),
    ("/register", {"instance_id": "x", "endpoint": "ipc:///tmp/x", "model": MODEL}, 400, "tcp://HOST:PORT"),
    ("/register", {"endpoint": "tcp://127.0.0.1:5557", "model": MODEL}, 400, "'instance_id' is required"),
    ("/register", {"instance_id": "x", "endpoint": "tcp://h:1", "dp_rank": -1, "model": MODEL}, 400, "dp_rank"),
    ("/unregister", {}, 400, "'instance_id' is required"),
])
def test_malformed_bodies_are_4xx_naming_the_fix(path, body, status, words):
    async def main():
        async with Api() as t:
            got, answer = await t.post(path, body)
            assert got == status, answer
            assert words in answer["error"]["message"]

    run(main())


def test_hostile_bodies_and_paths_are_4xx_never_500():
    async def main():
        async with Api(max_body_bytes=1 << 16) as t:
            for raw, words in ((b"{", "not valid JSON"), (b"[1]", "JSON object"), (b"[" * 100_000, "too deeply"),
                               (b'{"a": ' + b"9" * 5000 + b"}", "too long")):
                status, answer = await t.post("/query", data=raw)
                assert status in (400, 413) and answer["error"]["code"] == status, (raw[:10], answer)
            status, answer = await t.post("/query", data=b'{"x": "' + b"a" * (1 << 17) + b'"}')
            assert status == 413 and "--max-body-bytes" in answer["error"]["message"]
            status, answer = await t.post("/nowhere", {})
            assert status == 404 and "/query_by_hash" in answer["error"]["message"]
            async with t.http.get(t.server.url + "/query") as r:
                assert r.status == 405 and "POST" in (await r.json())["error"]["message"]

    run(main())


def test_protected_mode_and_bearer_token(tmp_path):
    with pytest.raises(IndexerError, match="protected mode"):
        IndexerSettings(listen="0.0.0.0:0").token()
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789\n")

    async def main():
        async with Api(token_file=str(token)) as t:
            body = {"model": MODEL, "seq_hashes": [1], "block_size": BS}
            status, answer = await t.post("/query_by_hash", body)
            assert status == 401 and "Authorization: Bearer" in answer["error"]["message"]
            status, _ = await t.post("/query_by_hash", body, headers={"Authorization": "Bearer wrong"})
            assert status == 401
            status, _ = await t.post("/query_by_hash", body,
                                     headers={"Authorization": "Bearer s3cret-token-0123456789"})
            assert status == 200

    run(main())


def test_a_restarted_server_follows_its_registrations_again(tmp_path):
    """With --registrations-file, /register survives a restart: the new server follows the same engine and
    answers from its events without the gateway registering again."""
    path = tmp_path / "registrations.json"

    async def main():
        ctx = zmq.Context()
        engine = TestEngine(ctx, replay=True)
        try:
            reg = {"instance_id": "vllm-0", "endpoint": engine.endpoint, "replay_endpoint": engine.replay_endpoint,
                   "model": MODEL}
            async with Api(registrations_file=str(path)) as t:
                assert (await t.post("/register", reg))[0] == 200
            saved = path.read_text()
            assert engine.endpoint in saved and '"version": 1' in saved

            hashes = [event_key(d) for d in BlockHasher(BS, SEED).chain(PROMPT)]
            async with Api(registrations_file=str(path)) as t:  # a new process: nothing registered by hand
                async with t.http.get(t.server.url + "/instances") as r:
                    assert [i["instance_id"] for i in await r.json()] == ["vllm-0"]
                query = {"model": MODEL, "token_ids": PROMPT, "block_size": BS}

                async def indexed():
                    engine.publish([stored(hashes[:2], block_size=BS)])
                    _, body = await t.post("/query", query)
                    return body["instances"].get("vllm-0", {}).get("longest_matched") == 2 * BS
                await _eventually(indexed, "the restored engine's events in the index")
                assert (await t.post("/unregister", {"instance_id": "vllm-0"}))[0] == 200
            assert '"registrations": []' in path.read_text()
        finally:
            engine.close()
            ctx.term()

    run(main())


def test_an_unreadable_registrations_file_is_kept_aside_and_the_server_starts(tmp_path):
    path = tmp_path / "registrations.json"
    path.write_text("{not json")

    async def main():
        async with Api(registrations_file=str(path)) as t:
            async with t.http.get(t.server.url + "/instances") as r:
                assert await r.json() == []
        assert (tmp_path / "registrations.json.unreadable").read_text() == "{not json"

    run(main())


def test_metrics_count_requests_by_route_and_status_class(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789\n")

    async def main():
        async with Api(token_file=str(token)) as t:
            auth = {"Authorization": "Bearer s3cret-token-0123456789"}
            await t.hold("vllm-a", PROMPT[: 3 * BS], [TierName.GPU] * 3)
            await t.post("/query", {"model": MODEL, "token_ids": PROMPT, "block_size": BS}, headers=auth)
            await t.post("/query", {"model": MODEL, "block_size": BS}, headers=auth)  # 400
            await t.post("/nowhere", {}, headers=auth)  # 404
            async with t.http.get(t.server.url + "/metrics") as r:  # scraped without the token
                assert r.status == 200
                text = await r.text()
        assert 'strata_indexer_requests_total{code="2xx",route="/query"} 1.0' in text
        assert 'strata_indexer_requests_total{code="4xx",route="/query"} 1.0' in text
        assert 'strata_indexer_requests_total{code="4xx",route="other"} 1.0' in text
        assert 'strata_indexer_query_matched_blocks_bucket{le="4.0"} 1.0' in text
        assert "strata_indexer_request_duration_seconds_count" in text

    run(main())


def test_query_counts_the_chunks_node_daemons_hold_through_the_vllm_tier():
    """vLLM's Strata tier stores a chunk (here 2 blocks) under the 32-byte hash of its last block, in the tier's
    namespace, held by the node daemon: /query with tier_namespace credits the daemon in chunks' worth of tokens."""
    tier_ns = "vllm/llama@0123456789ab/g0"

    async def main():
        async with Api(tier_blocks_per_chunk=2) as t:
            await t.hold("vllm-a", PROMPT[: 2 * BS], [TierName.GPU] * 2)
            chain = BlockHasher(BS, SEED).chain(PROMPT[: 6 * BS])
            chunks = chain[1::2]  # 3 chunks of 2 blocks
            await t.index.join("node-a", 1, 60)
            await t.index.add(tier_ns, "node-a", 1, [(chunks[0], TierName.HOST), (chunks[1], TierName.HOST),
                                                     (chunks[2], TierName.DISK)])
            query = {"model": MODEL, "token_ids": PROMPT, "block_size": BS}
            _, plain = await t.post("/query", query)
            assert set(plain["instances"]) == {"vllm-a"}  # the tier's namespace not asked
            status, body = await t.post("/query", {**query, "tier_namespace": tier_ns})
            assert status == 200, body
            assert body["instances"]["node-a"] == {"longest_matched": 6 * BS, "GPU": 0, "CPU": 4 * BS,
                                                   "DISK": 6 * BS, "PEER": 6 * BS, "OBJECT": 6 * BS,
                                                   "DP": {"0": 6 * BS}}
            assert body["instances"]["vllm-a"]["GPU"] == 2 * BS
            status, body = await t.post("/query", {**query, "tier_namespace": "bad namespace"})
            assert status == 400 and "tier_namespace" in body["error"]["message"]

    run(main())
