"""The router credits an endpoint for what its node's daemon holds through vLLM's Strata tier.

The tier stores each chunk in its node daemon under vLLM's 32-byte block hash
(``integrations/vllm/mapping.py`` ``block_key``: the chunk's last block), in
the namespace of the engine's KV layout (``vllm/<model>@<layout>/g<group>``),
and the daemon publishes it to the index as its own (node id, tier). Here the
daemon is a real ``strata serve`` process (memory index, or two of them on a
real redis-server) and the blocks are put as the tier puts them: those keys,
that namespace. vLLM's Python layers are not needed; ``tests/integrations/test_vllm_tier.py``
stores the chunks through vLLM's real tiering code where they are installed.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

pytest.importorskip("aiohttp", reason="the router needs aiohttp (pip install 'strata-kvcache[router]')")
pytest.importorskip("transformers", reason="the cache-aware router needs transformers (pip install 'strata-kvcache[router]')")

from kvstore.client.sync import Client  # noqa: E402
from kvstore.config.load import SettingsError  # noqa: E402
from kvstore.config.router import load_router_settings  # noqa: E402
from kvstore.index.keys import BlockHasher  # noqa: E402
from kvstore.router.metrics import RouterMetrics  # noqa: E402
from kvstore.router.scorer import PrefixScorer  # noqa: E402
from kvstore.transport.base import BlockPut  # noqa: E402
from tests.support.router_stand_in import BLOCK, HASH_SEED, NS, completion, seed, words  # noqa: E402
from tests.support.wait import wait_until  # noqa: E402

P_A = words(1, 16)  # 4 blocks of 4 tokens
P_B = words(100, 16)
HOST_WEIGHT = 0.8  # the daemon's default weight of the host tier


def layout_namespace(model: str = "acme/tiny-llm") -> str:
    """A namespace as ``KVLayout.namespace(0)`` names one, for a layout of its own (tests share one Redis)."""
    return f"vllm/{model}@{uuid.uuid4().hex[:16]}/g0"


def chain(prompt: str, model_dir) -> list[bytes]:
    """The prompt's 32-byte vLLM block hashes, as the router's tokenizer and the engines hash it."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)(prompt)["input_ids"]
    return BlockHasher(BLOCK, HASH_SEED).chain(ids[: len(ids) // BLOCK * BLOCK])


def hold(daemon, node_id: str, namespace: str, keys: list[bytes]) -> None:
    """Store ``keys`` in ``daemon`` as the tier stores chunks, and wait for the index to list them."""
    with Client(daemon.target, use_shm=False) as c:
        c.put_many(namespace, [BlockPut(k, k * 64, layout="vllm-tier/1;layout=test;bytes=2048") for k in keys])

        def listed() -> bool:
            scores = c.score(namespace, keys=keys, candidates=[node_id])
            return bool(scores) and scores[0].node_id == node_id and scores[0].blocks == len(keys)

        wait_until(listed, what=f"the index to list {node_id} holding {len(keys)} blocks of {namespace}")


def hits(daemon, keys: list[bytes], ids: list[str], **tier) -> dict[str, float]:
    """The router's own scorer, asking the daemon's Score RPC: the credit of an endpoint of each id alone."""

    async def ask():
        scorer = PrefixScorer(daemon.target, NS, BlockHasher(BLOCK, HASH_SEED), RouterMetrics(), timeout_s=5.0,
                              retry_s=1.0, **tier)
        try:
            return await scorer.credits(keys, [[i] for i in ids])
        finally:
            await scorer.close()

    return dict(zip(ids, asyncio.run(ask())))


@pytest.fixture(params=["memory", "redis"])
def index_args(request):
    if request.param == "memory":
        return ()
    return ("--index-url", request.getfixturevalue("redis_url"))


def test_a_node_daemon_holding_the_tier_chunks_is_credited_at_its_tier(daemon_process, model_dir, index_args):
    daemon = daemon_process("--node-id", "node-a", *index_args)
    mine, other_layout, chunked = layout_namespace(), layout_namespace(), layout_namespace()
    keys = chain(P_A, model_dir)
    assert len(keys) == 4
    hold(daemon, "node-a", mine, keys)
    hold(daemon, "node-a", other_layout, chain(P_B, model_dir))
    ids = ["engine-a", "node-a"]

    got = hits(daemon, keys, ids, tier_namespace=mine)
    assert got == {"engine-a": 0.0, "node-a": pytest.approx(4 * HOST_WEIGHT)}
    # The same prompt's blocks under another KV layout: this engine could not load them.
    assert hits(daemon, chain(P_B, model_dir), ids, tier_namespace=mine)["node-a"] == 0.0
    # Half the prompt held: half the credit (the chain stops at the first missing block).
    with Client(daemon.target, use_shm=False) as c:
        c.delete(mine, [keys[2]])
    wait_until(lambda: hits(daemon, keys, ids, tier_namespace=mine)["node-a"] == pytest.approx(2 * HOST_WEIGHT),
               what="the index to drop the deleted block")
    # Chunks of two blocks are keyed by their last block's hash and count as two blocks each.
    hold(daemon, "node-a", chunked, keys[1::2])
    assert hits(daemon, keys, ids, tier_namespace=chunked, blocks_per_chunk=2)["node-a"] == pytest.approx(4 * HOST_WEIGHT)
    assert hits(daemon, keys, ids, tier_namespace=chunked)["node-a"] == 0.0  # read as one block a chunk: no match


def test_the_router_sends_a_prompt_to_the_endpoint_whose_node_holds_it(daemon_process, redis_url, model_dir,
                                                                       engines, routers, tmp_path):
    """Two nodes on one Redis index, one engine each; neither engine holds anything itself."""
    node_a = daemon_process("--node-id", "node-a", "--index-url", redis_url)
    node_b = daemon_process("--node-id", "node-b", "--index-url", redis_url, "--disk-dir", str(tmp_path / "b"))
    mine, other_layout = layout_namespace(), layout_namespace()
    hold(node_a, "node-a", mine, chain(P_A, model_dir))
    hold(node_b, "node-b", other_layout, chain(P_A, model_dir))  # P_A at b too, but another layout's
    hold(node_b, "node-b", mine, chain(P_B, model_dir))
    a, b = engines("a"), engines("b")
    r = routers(endpoint=[f"{a.url}=engine-a,node-a", f"{b.url}=engine-b,node-b"], policy="cache-aware",
                model_dir=str(model_dir), index=node_a.target, namespace=NS, tier_namespace=mine,
                hash_seed=HASH_SEED, block_size=BLOCK, index_timeout_seconds=5.0)
    assert [completion(r, P_A + " w400") for _ in range(3)] == ["a"] * 3
    assert [completion(r, P_B + " w401") for _ in range(3)] == ["b"] * 3
    assert r.decisions("cache_hit") == 6


def test_what_engines_hold_and_what_their_nodes_hold_are_weighed_by_tier(fleet, model_dir, routers):
    """Engine b holds prompts on its GPU (KV events); a's node daemon holds them in host RAM (tier)."""
    daemon, a, b = fleet
    mine = layout_namespace()
    hold(daemon, "router-test-node", mine, chain(P_A, model_dir))
    hold(daemon, "router-test-node", mine, chain(P_B, model_dir))
    seed(daemon, b, words(1, 12), model_dir)  # 3 of P_A's 4 blocks on b's GPU: 0.75 < 4 x 0.8 / 4
    seed(daemon, b, P_B, model_dir)  # all of P_B on b's GPU: 1.0 > 0.8
    r = routers(endpoint=[f"{a.url}=engine-a,router-test-node", f"{b.url}=engine-b"], policy="cache-aware",
                model_dir=str(model_dir), index=daemon.target, namespace=NS, tier_namespace=mine,
                hash_seed=HASH_SEED, block_size=BLOCK, index_timeout_seconds=5.0)
    assert completion(r, P_A) == "a"
    assert completion(r, P_B) == "b"
    # vLLM takes its own prefix first and asks its tier for the rest: a's engine holds 4 of P_C's 8
    # blocks on its GPU and its node all 8 in RAM, 4 + 4 x 0.8 = 7.2, more than b's 7 GPU blocks
    # (either alone, 4 or 6.4, is less).
    p_c = words(200, 32)
    hold(daemon, "router-test-node", mine, chain(p_c, model_dir))
    seed(daemon, a, words(200, 16), model_dir)
    seed(daemon, b, words(200, 28), model_dir)
    assert completion(r, p_c) == "a"
    assert r.decisions("cache_hit") == 3


def test_the_tier_namespace_is_checked_at_start_and_may_stand_in_for_the_event_namespace(model_dir):
    base = dict(endpoint=["http://10.0.0.5:8000=vllm-0,node-a"], model_dir=str(model_dir), index="127.0.0.1:50051",
                hash_seed="0")
    s = load_router_settings(environ={"STRATA_ROUTER_TIER_NAMESPACE": "vllm/acme/tiny-llm@0123456789abcdef/g0"},
                             **base)
    assert (s.namespace, s.tier_namespace, s.tier_blocks_per_chunk) == ("", "vllm/acme/tiny-llm@0123456789abcdef/g0", 1)
    with pytest.raises(SettingsError, match="needs --namespace .*--tier-namespace may stand in"):
        load_router_settings(environ={}, **base)
    with pytest.raises(SettingsError, match="--tier-namespace.*characters outside"):
        load_router_settings(environ={}, tier_namespace="vllm/acme tiny@0/g0", **base)
    with pytest.raises(SettingsError, match="--tier-blocks-per-chunk"):
        load_router_settings(environ={}, namespace=NS, tier_blocks_per_chunk="0", **base)
