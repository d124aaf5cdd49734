"""The e2e benchmark's reference engine: real engine processes on real ports, a real Strata daemon.

The property that matters: a greedy continuation computed over cached KV (the engine's block
cache, its last-prompt slot, or blocks loaded from the shared pool) equals the one computed
from scratch. Beside it: the engine's KV events make a daemon index it as a holder, pool
blocks make the daemon's own node a holder for a router's Score, the queue is bounded, and
the HTTP shapes are OpenAI's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the reference engine needs torch (installed in CI before the test extra)")
pytest.importorskip("transformers", reason="the reference engine needs transformers (the e2e extra)")
pytest.importorskip("tokenizers", reason="the model builder needs tokenizers (the e2e extra)")
pytest.importorskip("aiohttp", reason="the engine's server needs aiohttp (the e2e extra)")

from benchmarks.harness import free_port  # noqa: E402
from kvstore.client.sync import Client  # noqa: E402
from kvstore.index.keys import BlockHasher, event_key_bytes  # noqa: E402
from tests.support.wait import wait_until  # noqa: E402

pytestmark = pytest.mark.system

BLOCK = 16
SEED = "7"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from benchmarks.e2e.model import build

    return build(tmp_path_factory.mktemp("model") / "tiny", "tiny")


class EngineProcess:
    """``python -m benchmarks.e2e.engine`` as a child process."""

    def __init__(self, model: Path, log_dir: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"engine-{self.port}.log"
        cmd = [sys.executable, "-m", "benchmarks.e2e.engine", "--model", str(model), "--port", str(self.port),
               "--block-size", str(BLOCK), "--hash-seed", SEED, "--threads", "1", *args]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"engine exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def post(self, path: str, body: dict, timeout: float = 120) -> dict:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)

    def stream(self, path: str, body: dict, timeout: float = 120) -> list:
        req = urllib.request.Request(self.url + path, json.dumps(dict(body, stream=True)).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = r.read().decode()
        events = [e[len("data: "):] for e in raw.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    def complete(self, prompt, max_tokens: int = 8, **extra) -> dict:
        body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, return_token_ids=True, **extra)
        return self.post("/v1/completions", body)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    """Start engines (all at once: each takes seconds to import torch); all are killed at the end."""
    started: list[EngineProcess] = []
    log_dir = tmp_path_factory.mktemp("engines")

    def start(*argsets: tuple[str, ...]) -> list[EngineProcess]:
        new = [EngineProcess(tiny_model, log_dir, *args) for args in argsets]
        started.extend(new)
        for e in new:
            wait_until(e.healthy, timeout=120, what=f"engine on {e.url} to serve (log: {e.log})")
        return new

    yield start
    for e in started:
        e.stop()


@pytest.fixture(scope="module")
def started(engines):
    """The module's three engines: ``none`` (every test's cold reference) and two started with
    ``--admin``, which each test sets to what it needs with :func:`configured`."""
    return engines(("--prefix-cache", "none"), ("--admin",), ("--admin",))


@pytest.fixture
def trio(started):
    """One engine per prefix-cache mode, the cached ones empty at the test's start."""
    none, last, blocks = started
    return {"none": none, "last": configured(last, prefix_cache="last"),
            "blocks": configured(blocks, prefix_cache="blocks")}


@pytest.fixture
def spares(started):
    """The two ``--admin`` engines, for a test to reconfigure as its own (POST /admin/reconfigure:
    an empty cache, metrics from zero, its own ids, pool and KV events) instead of starting engines."""
    return started[1:]


ENGINE_DEFAULTS = {"engine_id": "engine-0", "prefix_cache": "blocks", "cache_blocks": 4096, "max_queue": 64,
                   "kv_events": "", "kv_events_replay": "", "strata": "", "namespace": ""}


def configured(engine: EngineProcess, **settings) -> EngineProcess:
    """``engine`` as if started with ``settings`` (the rest the engine's defaults), once it is idle
    (409 while a request a test abandoned has not yet noticed it)."""

    def reconfigured() -> bool:
        try:
            engine.post("/admin/reconfigure", {**ENGINE_DEFAULTS, **settings})
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise
            return False
        return True

    wait_until(reconfigured, timeout=60, what=f"engine {engine.url} idle to reconfigure")
    return engine


def _tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(8, 512) for _ in range(n)]  # the tiny vocabulary, clear of special tokens


@pytest.mark.parametrize("mode", ["last", "blocks"])
def test_cache_hit_continues_exactly_as_a_cold_prefill(trio, mode):
    engine, ref = trio[mode], trio["none"]
    first = _tokens({"last": 1, "blocks": 2}[mode], 5 * BLOCK + 3)
    generated = engine.complete(first, max_tokens=4)["choices"][0]["token_ids"]
    second = first + generated[:2] + _tokens(9, 2 * BLOCK + 5)  # a follow-up turn extends the exchange

    hit = engine.complete(second, max_tokens=12)
    cold = ref.complete(second, max_tokens=12)

    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = hit["usage"]["prompt_tokens_details"]["cached_tokens"]
    if mode == "blocks":
        assert cached == 5 * BLOCK  # the first prompt's full blocks (its generated tokens fill no block)
    else:
        assert cached == len(first) + 2  # the slot held the prompt and the generated tokens fed back
    assert hit["strata"] == {"cached_local": cached, "cached_pool": 0, "engine_id": "engine-0", "pulled_blocks": 0}
    assert hit["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    assert hit["choices"][0]["text"] == cold["choices"][0]["text"]


def test_a_repeated_prompt_reuses_all_but_its_last_token_and_matches(trio):
    engine, ref = trio["blocks"], trio["none"]
    prompt = _tokens(3, 4 * BLOCK)  # exactly whole blocks: the last block cannot be reused
    a = engine.complete(prompt)
    b = engine.complete(prompt)
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"] == ref.complete(prompt)["choices"][0]["token_ids"]


def test_stream_carries_the_same_text_and_ends_with_usage(trio):
    engine = trio["blocks"]
    prompt = "The engine streams text the way an OpenAI server does, chunk by chunk, then usage."
    whole = engine.post("/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
    chunks = engine.stream("/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"]
    assert all(c["object"] == "text_completion" and c["model"] == "tiny" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == 10 and usage["total_tokens"] == usage["prompt_tokens"] + 10
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt, seconds before


def test_chat_second_turn_hits_the_first_and_matches_a_cold_engine(trio):
    engine, ref = trio["blocks"], trio["none"]
    system = ("You are a test assistant. Answer about caches, pools, routers and queues; cite the block "
              "sizes, hash seeds, namespaces and layouts involved, then stop.")
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Tell me about block caches."}]
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    r1 = engine.post("/v1/chat/completions", dict(body, messages=turn1))
    assert r1["object"] == "chat.completion" and r1["choices"][0]["message"]["role"] == "assistant"
    turn2 = turn1 + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And about the pool?"}]
    chunks = engine.stream("/v1/chat/completions", dict(body, messages=turn2))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * BLOCK
    cold = ref.post("/v1/chat/completions", dict(body, messages=turn2))
    assert chunks[-1]["token_ids"] == cold["choices"][0]["token_ids"]
    assert text == cold["choices"][0]["message"]["content"]


def test_bad_requests_are_refused_with_the_reason(trio):
    engine = trio["none"]
    for body, words in [
        ({"prompt": "x", "model": "other"}, "not served here"),
        ({"prompt": ""}, "empty"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 2, 10**6]}, "vocabulary"),
        ({"prompt": "x", "max_tokens": 10**6}, "limit"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
    ]:
        with pytest.raises(urllib.error.HTTPError) as e:
            engine.post("/v1/completions", body)
        assert e.value.code == 400
        assert words in json.load(e.value)["error"]["message"]
    models = json.load(urllib.request.urlopen(engine.url + "/v1/models"))
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] > 0


def test_beyond_the_queue_a_request_gets_429_with_retry_after(spares):
    engine = configured(spares[0], prefix_cache="none", max_queue=0)
    body = json.dumps({"prompt": _tokens(5, 40), "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    req = urllib.request.Request(engine.url + "/v1/completions", body, {"Content-Type": "application/json"})
    long_stream = urllib.request.urlopen(req, timeout=120)
    long_stream.readline()  # the first chunk: the request is computing
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            engine.complete("a second request while the first computes", max_tokens=2)
        assert e.value.code == 429
        assert int(e.value.headers["Retry-After"]) >= 1
    finally:
        long_stream.close()  # the client goes away: the engine stops decoding for it
    wait_until(lambda: engine.metric("e2e_engine_running") == 0, timeout=120, what="the abandoned stream to stop")
    assert engine.complete("after the queue drained", max_tokens=2)["usage"]["completion_tokens"] == 2
    assert engine.metric('e2e_engine_requests_total{code="429"}') == 1


def test_kv_events_make_the_daemon_index_the_engine_as_a_holder(spares, daemon_process):
    pub, replay, metrics = free_port(), free_port(), free_port()
    source = f"tcp://127.0.0.1:{pub}?engine=eng-ev&namespace=ev&replay=tcp://127.0.0.1:{replay}"
    daemon = daemon_process("--kv-events", source, "--metrics-listen", f"127.0.0.1:{metrics}")
    engine = configured(spares[0], prefix_cache="blocks", cache_blocks=6, engine_id="eng-ev",
                        kv_events=f"tcp://127.0.0.1:{pub}", kv_events_replay=f"tcp://127.0.0.1:{replay}")

    def subscribed() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
            return any(line.startswith("strata_kv_events_engines_connected") and float(line.rsplit(" ", 1)[1]) == 1
                       for line in r.read().decode().splitlines())

    wait_until(subscribed, what="the daemon to subscribe to the engine's KV events")
    first, nudge = _tokens(11, 4 * BLOCK + 1), _tokens(13, BLOCK + 1)
    engine.complete(first, max_tokens=1)
    # A PUB socket drops what it sends before a subscription reaches it; the next batch's seq
    # then shows the daemon what it missed, and it fetches that from the replay socket.
    engine.complete(nudge, max_tokens=1)

    with Client(daemon.target) as c:
        def blocks_of(tokens) -> int:
            scores = c.score("ev", tokens=tokens, block_size=BLOCK, hash_seed=SEED)
            return next((s.blocks for s in scores if s.node_id == "eng-ev"), 0)

        wait_until(lambda: blocks_of(first) == 4 and blocks_of(nudge) == 1,
                   what="the engine's stored blocks in the daemon's index")
        # Six blocks of cache: a second prompt of four evicts three of the first's, its deepest
        # first, so the first prompt keeps a shorter prefix, not a hole.
        second = _tokens(12, 4 * BLOCK + 1)
        engine.complete(second, max_tokens=1)
        wait_until(lambda: blocks_of(second) == 4, what="the second prompt's blocks in the index")
        wait_until(lambda: blocks_of(first) == 1, what="the evicted blocks to leave the index")
        assert engine.complete(first, max_tokens=1)["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCK


def test_the_pool_gives_one_replica_the_prefix_another_computed(spares, daemon_process, trio):
    daemon = daemon_process("--node-id", "node-a")
    a, b = (configured(e, prefix_cache="blocks", strata=daemon.target, namespace="pool", engine_id=n)
            for e, n in zip(spares, ("rep-a", "rep-b")))
    prompt = _tokens(21, 6 * BLOCK + 9)
    cold = a.complete(prompt, max_tokens=10)
    assert cold["strata"]["cached_pool"] == 0
    keys = [event_key_bytes(h) for h in BlockHasher(BLOCK, SEED).chain(prompt)]

    with Client(daemon.target) as c:
        wait_until(lambda: len(c.exists("pool", keys)) == 6, what="replica a's blocks stored in the pool")
        blocks = c.get_many("pool", keys[:2])
        assert blocks[0].parent is None and blocks[1].parent == keys[0]
        assert blocks[0].layout.startswith("strata-e2e-kv/1;dtype=float32;shape=2x2x2x16x16;model=")

        hit = b.complete(prompt, max_tokens=10)
        assert hit["strata"]["cached_pool"] == 6 * BLOCK and hit["strata"]["cached_local"] == 0
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BLOCK
        assert hit["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
        assert trio["none"].complete(prompt, max_tokens=10)["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]

        # A router's Score over the prompt's tokens credits the daemon's node for the pool's blocks.
        wait_until(lambda: any(s.node_id == "node-a" and s.blocks == 6 for s in
                               c.score("pool", tokens=prompt, block_size=BLOCK, hash_seed=SEED)),
                   what="the daemon's node to hold the pool blocks in its index")
    # Now replica b's own cache has them: a second time is a local hit.
    again = b.complete(prompt, max_tokens=10)
    assert again["strata"] == {"cached_local": 6 * BLOCK, "cached_pool": 0, "engine_id": "rep-b", "pulled_blocks": 0}


def test_a_reconfigured_engine_starts_over_with_an_empty_cache_and_pool(spares, daemon_process, trio):
    """The benchmark reuses one engine across phases (POST /admin/reconfigure): after it, a prompt the
    engine computed before is a miss in its own cache and in the pool (a new namespace), its first
    token equal to a cold engine's, and its metrics count from zero."""
    daemon = daemon_process("--node-id", "node-r")
    engine = configured(spares[0], prefix_cache="blocks", engine_id="phase-1", strata=daemon.target,
                        namespace="phase-1")
    prompt = _tokens(31, 4 * BLOCK + 5)
    cold = engine.complete(prompt)
    assert engine.complete(prompt)["strata"]["cached_local"] == 4 * BLOCK  # the engine's cache holds it
    keys = [event_key_bytes(h) for h in BlockHasher(BLOCK, SEED).chain(prompt)]
    with Client(daemon.target) as c:
        wait_until(lambda: len(c.exists("phase-1", keys)) == 4, what="the prompt's blocks stored in the pool")

    changed = engine.post("/admin/reconfigure", {"engine_id": "phase-2", "namespace": "phase-2"})
    assert changed["engine_id"] == "phase-2" and changed["prefix_cache"] == "blocks"
    assert engine.metric("e2e_engine_prompt_tokens_total") == 0
    after = engine.complete(prompt)
    assert after["strata"] == {"cached_local": 0, "cached_pool": 0, "engine_id": "phase-2", "pulled_blocks": 0}
    assert after["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    assert engine.metric("e2e_engine_prompt_tokens_total") == len(prompt)

    # Another mode, the pool off: the one-slot cache of policy (a), empty too.
    engine.post("/admin/reconfigure", {"engine_id": "phase-3", "prefix_cache": "last", "strata": "", "namespace": ""})
    assert engine.complete(prompt)["strata"] == {"cached_local": 0, "cached_pool": 0, "engine_id": "phase-3", "pulled_blocks": 0}
    assert engine.complete(prompt)["strata"]["cached_local"] == len(prompt) - 1  # the slot: all but the last
    for body, words in [({"block_size": 32}, "cannot change without a restart"),
                        ({"strata": daemon.target, "namespace": ""}, "needs both")]:
        with pytest.raises(urllib.error.HTTPError) as e:
            engine.post("/admin/reconfigure", body)
        assert e.value.code == 400 and words in json.load(e.value)["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as e:  # only an engine started with --admin serves it
        trio["none"].post("/admin/reconfigure", {"engine_id": "x"})
    assert e.value.code in (404, 405)


# ---- in-process: the block cache's order and the events' wire -------------------------------------


class _Collect:
    def __init__(self) -> None:
        self.events: list = []

    def publish(self, events) -> None:
        self.events.extend(events)


def test_block_cache_evicts_a_chain_deepest_first_and_reports_each_change():
    import torch

    from benchmarks.e2e.events import Removed, Stored
    from benchmarks.e2e.kv_blocks import BlockCache
    from kvstore.index.keys import event_key

    sink = _Collect()
    cache = BlockCache(capacity=4, block_size=2, sink=sink)
    hasher = BlockHasher(2, SEED)
    a, b = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    ka, kb = hasher.chain(a), hasher.chain(b)
    kv_a = torch.arange(2 * 2 * 1 * 6 * 3, dtype=torch.float32).view(2, 2, 1, 6, 3)
    assert cache.store(ka, a, kv_a) == 3
    assert cache.store(ka, a, kv_a) == 0  # held: only touched
    assert cache.store(kb, b, torch.zeros(2, 2, 1, 4, 3)) == 2
    assert sink.events == [
        Stored(tuple(event_key(k) for k in ka), None, tuple(a), 2),
        Stored((event_key(kb[0]),), None, tuple(b[:2]), 2),
        Removed((event_key(ka[2]),)),
        Stored((event_key(kb[1]),), event_key(kb[0]), tuple(b[2:]), 2),
    ]
    found = cache.longest_prefix(ka)
    assert len(found) == 2 and torch.equal(torch.cat(found, dim=3), kv_a[:, :, :, :4])


def test_published_batches_are_what_the_index_parses_live_and_by_replay():
    import zmq

    from benchmarks.e2e.events import Cleared, Removed, Stored, ZmqEventPublisher
    from kvstore.index import event_format as ef

    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(pub, replay)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    try:
        stored = Stored((1, 2**64 - 1), 7, (5, 6, 7, 8), 2)

        def received():  # a PUB drops batches until the subscription reaches it: publish until one arrives
            publisher.publish([stored])
            return sub.poll(100) and sub.recv_multipart()

        topic, seq, payload = ef.split_message(wait_until(received, what="a live batch"))
        batch = ef.decode_batch(payload)
        assert topic == b"" and batch.events == (ef.BlockStored((1, 2**64 - 1), 7, (5, 6, 7, 8), 2, None, "GPU",
                                                                 None, None, 0),)
        publisher.publish([Removed((2**64 - 1,)), Cleared()])

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart([b"", (seq + 1).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            frames = [f for f in dealer.recv_multipart()][1:]
            if frames[0] == ef.REPLAY_END:
                break
            replies.append(ef.decode_batch(frames[1]).events)
        dealer.close(linger=0)
        assert replies[-1] == (ef.BlockRemoved((2**64 - 1,), "GPU", 0), ef.AllBlocksCleared())
        assert all(r == batch.events for r in replies[:-1])
    finally:
        sub.close(linger=0)
        publisher.close()


def test_ttft_measurement_reuses_the_cached_blocks_and_checks_the_first_token(tiny_model, tmp_path):
    from benchmarks.e2e.ttft import cases, main, measure

    r = measure(str(tiny_model), prompt_tokens=6 * BLOCK, cached_tokens=4 * BLOCK, rounds=1, threads=1)
    assert r.first_token_equal and len(r.cold_s) == len(r.hit_s) == 1
    assert [c.unit for c in cases(r)] == ["s", "s"]
    out = tmp_path / "ttft.json"
    main(["--model", str(tiny_model), "--prompt-tokens", "64", "--cached-tokens", "48", "--rounds", "1",
          "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "e2e_ttft" and doc["detail"]["first_token_equal"] is True
