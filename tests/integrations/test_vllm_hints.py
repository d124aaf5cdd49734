"""KV hints on vLLM's requests (``ReqContext.kv_hints``, vLLM's own ``KvHintsEnvelope``) through the Strata tier.

The envelopes are vLLM's classes; the requests go through vLLM's real
tiering manager (``tests/support/vllm_engine.py``), which hands each
request's context to the tier. What each hint did is read from the daemon
itself: pins in its stats, each block's tier in its listing.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec", reason="vLLM 0.33 is not installed (docs/integrations/vllm.md: the vllm extra)")

from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope  # noqa: E402

from kvstore import Client  # noqa: E402
from kvstore.block import TierName  # noqa: E402
from kvstore.integrations.vllm import block_key, hints, metrics  # noqa: E402
from tests.support.vllm_engine import Engine, chunk_bytes, chunk_keys, strata_entry  # noqa: E402
from tests.support.wait import wait_until  # noqa: E402

FAST = dict(timeout_s=1.0, down_backoff_s=0.3, job_timeout_s=5.0)


def envelope(*actions: tuple[str, dict], version: str = "1", action_version: str = "1") -> KvHintsEnvelope:
    return KvHintsEnvelope(protocol_version=version, message_id="m-1", actions=[
        KvHintAction(action_id=f"a{i}", action_type=kind, action_version=action_version, payload=payload)
        for i, (kind, payload) in enumerate(actions)])


def outcomes(env, max_hold_s: float = 3600.0) -> list[tuple[str, str]]:
    return [(a.action_type, a.outcome) for a in hints.read(env, max_hold_s)[1]]


# ---- what each action is answered --------------------------------------------------------------


def test_each_action_is_accepted_clipped_deferred_or_rejected_with_the_reason():
    assert outcomes(envelope(("pin", {"ttl_s": 60}), ("retain", {}), ("share", {"replicas": 3}),
                             ("prefetch", {}))) == [
        ("pin", "accepted"), ("retain", "accepted"), ("share", "accepted"), ("prefetch", "deferred")]
    plan, answers = hints.read(envelope(("pin", {"ttl_s": 99999})), max_hold_s=600)
    assert answers[0].outcome == "clipped" and "hint_max_hold_s" in answers[0].reason and plan.pin_s == 600
    rejected = hints.read(envelope(("evict_everything", {}), ("pin", {"ttl_s": -1}), ("pin", {"tll_s": 5}),
                                   ("share", {"replicas": 1}), ("prefetch", {"block_hashes": ["zz"]})), 3600)[1]
    assert [a.outcome for a in rejected] == ["rejected"] * 5
    assert "not one the Strata tier implements" in rejected[0].reason
    assert "ttl_s must be a number" in rejected[1].reason and "it takes ttl_s" in rejected[2].reason
    assert outcomes(envelope(("pin", {}), version="2")) == [("pin", "rejected")]
    assert outcomes(envelope(("pin", {}), action_version="2")) == [("pin", "rejected")]
    assert outcomes(envelope(("retain", {}), ("demote", {}))) == [("retain", "accepted"), ("demote", "rejected")]
    assert hints.read(envelope(("nothing", {})), 3600)[0] is None  # nothing applies: no plan kept
    key = chunk_keys(1)[0]
    plan, answers = hints.read(envelope(("prefetch", {"block_hashes": [key.hex()]})), 3600)
    assert answers[0].outcome == "accepted" and plan.prefetch_keys == [key]


# ---- what they do in the daemon ----------------------------------------------------------------


def tiers(target: str, namespace: str) -> dict[bytes, TierName]:
    with Client(target, use_shm=False) as c:
        return {b.key: b.tier for b in c.list_blocks(namespace).blocks}


def hint_counts(e: Engine) -> dict[str, int]:
    return {k: v for k, v in e.tier.counts.items() if k.startswith("hint")}


def test_pin_and_retain_hold_the_requests_chunks_past_its_end(make_daemon):
    daemon = make_daemon()
    with Engine([strata_entry(daemon.target, **FAST)]) as e:
        pinned = chunk_bytes(chunk_keys(4, seed=1))
        e.store(pinned, hints=envelope(("pin", {"ttl_s": 120})))
        wait_until(lambda: Client(daemon.target).stats().pinned_blocks == 4, what="the pin hint's pins")
        retained = chunk_bytes(chunk_keys(3, seed=2))
        e.store(retained, hints=envelope(("retain", {"ttl_s": 120})))
        wait_until(lambda: Client(daemon.target).stats().pinned_blocks == 7, what="the retain hint's pins")
        e.store(chunk_bytes(chunk_keys(2, seed=3)))  # no hint: nothing pinned
        e.settle()
        assert Client(daemon.target).stats().pinned_blocks == 7
        counts = hint_counts(e)
        assert counts["hint:pin:accepted"] == 1 and counts["hint_chunks:pin:done"] == 4
        assert counts["hint_chunks:retain:done"] == 3
        stats = e.manager.get_stats().data["data"]
        assert stats[metrics.KV_HINTS][("pin", "accepted")] == 1
        assert stats[metrics.KV_HINT_CHUNKS][("retain", "done")] == 3


def test_demote_moves_the_chunks_below_ram_and_prefetch_brings_them_back(make_daemon):
    daemon = make_daemon()
    with Engine([strata_entry(daemon.target, **FAST)]) as e:
        chunks = chunk_bytes(chunk_keys(5, seed=4))
        namespace = e.tier.layout.namespace(0)
        e.store(chunks, hints=envelope(("demote", {})))
        wait_until(lambda: set(tiers(daemon.target, namespace).values()) == {TierName.DISK},
                   what="the demote hint to move every chunk to disk")
        e.evict()  # out of vLLM's own CPU tier too: the next read comes from the daemon
        assert e.fetch(list(chunks), hints=envelope(("prefetch", {}))) == chunks
        held = tiers(daemon.target, namespace)
        assert all(held[block_key(k)[1]] is TierName.HOST for k in chunks)  # read into RAM before the load
        assert hint_counts(e)["hint_chunks:prefetch:done"] >= 5


def test_a_prefetch_naming_chunks_reads_them_into_ram_at_once(make_daemon):
    daemon = make_daemon()
    with Engine([strata_entry(daemon.target, **FAST)]) as e:
        chunks = chunk_bytes(chunk_keys(3, seed=5))
        namespace = e.tier.layout.namespace(0)
        e.store(chunks)
        e.settle()
        with Client(daemon.target) as c:
            assert c.place(namespace, [block_key(k)[1] for k in chunks], "below").placed == 3
        e.fetch(chunk_keys(1, seed=99), hints=envelope(("prefetch", {"block_hashes": [k.hex() for k in chunks]})))
        wait_until(lambda: set(tiers(daemon.target, namespace).values()) == {TierName.HOST},
                   what="the named chunks to be read into RAM")


def test_share_pins_with_copies_and_a_daemon_that_keeps_none_refuses_it(make_daemon):
    daemon = make_daemon()
    with Engine([strata_entry(daemon.target, **FAST)]) as e:
        e.store(chunk_bytes(chunk_keys(2, seed=6)), hints=envelope(("share", {"replicas": 2})))
        wait_until(lambda: hint_counts(e).get("hint_chunks:share:done") == 2, what="the share's pins")
        with Client(daemon.target) as c:
            assert c.stats().pinned_blocks == 2 and c.replication().under_replicated == 2  # no other node yet
    alone = make_daemon(replication_max_pin_replicas=1)  # keeps no copies of pins on other nodes: a share is refused
    with Engine([strata_entry(alone.target, **FAST)]) as e:
        chunks = chunk_bytes(chunk_keys(2, seed=7))
        e.store(chunks, hints=envelope(("share", {"replicas": 2})))
        wait_until(lambda: hint_counts(e).get("hint_chunks:share:failed") == 2, what="the refused share")
        e.evict()
        assert e.fetch(list(chunks)) == chunks


def test_hints_can_be_turned_off(make_daemon):
    daemon = make_daemon()
    with Engine([strata_entry(daemon.target, kv_hints=False, **FAST)]) as e:
        e.store(chunk_bytes(chunk_keys(2, seed=7)), hints=envelope(("pin", {})))
        e.settle()
        assert hint_counts(e) == {"hint:pin:rejected": 1} and Client(daemon.target).stats().pinned_blocks == 0
