"""A stand-in OpenAI-compatible engine for the router's tests, and the harness around it.

Run as a process (``python -m tests.support.router_stand_in --port P --name N``) it
answers /v1/completions and /v1/chat/completions deterministically (the
same body gives the same bytes, streamed or not), names itself in each
response (``served_by``), and when given ``--kv-events-port`` publishes a
vLLM ``BlockStored`` event for every full block of each prompt it serves,
as an engine with prefix caching does. Test-only controls: a request with
``"x_hold": TAG`` waits until ``POST /admin/release?tag=TAG`` (``"x_hold_mid_stream"``:
the same after the first event of a stream);
``/admin/health?status=N`` sets what GET /health answers;
``/admin/queue?n=N`` sets its ``vllm:num_requests_waiting`` gauge (N as
written on the page: ``NaN`` and ``-5`` too); ``/admin/last`` answers the
last request body it took. Like vLLM it answers 400 to a ``max_tokens``
that is not a positive integer, and a request whose ``kv_transfer_params``
say ``do_remote_decode`` (a disaggregated prefill) gets ``kv_transfer_params``
of its own in the answer, naming this engine (unless ``"x_no_kv_transfer"``:
an engine that is no disaggregated prefill).

:class:`RawClient` is the other side: a client on a bare socket that sends
a request's headers and only part of its body, then as much more as the
test says, and reads the answer.

It is not the reference engine (benchmarks/e2e/engine.py, a real model):
it exists so the policy, health and proxy tests run without torch.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import http.client as http_client
import json
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from benchmarks.harness import free_port
from kvstore.client.sync import Client
from kvstore.index.keys import BlockHasher, event_key_bytes

REPO = Path(__file__).resolve().parents[2]
NS = "router-test"
HASH_SEED = "0"
BLOCK = 4


# ---- the engine process -------------------------------------------------------------


def _completion_text(body: dict, name: str) -> list[str]:
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return [f" {digest[i:i + 6]}" for i in range(0, 30, 6)] + [" é✓"]


def engine_main(argv: list[str]) -> None:
    from aiohttp import web

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--kv-events-port", type=int, default=0)
    p.add_argument("--model-dir", default="")
    p.add_argument("--block-size", type=int, default=BLOCK)
    p.add_argument("--hash-seed", default=HASH_SEED)
    args = p.parse_args(argv)

    state = {"health": 200, "queue": 0, "held": {}, "served": 0, "last": None}
    publisher = None
    if args.kv_events_port:
        import msgpack
        import zmq

        from kvstore.index.keys import BlockHasher
        from kvstore.router.prompt import PromptTokenizer

        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"tcp://127.0.0.1:{args.kv_events_port}")
        tokenizer = PromptTokenizer.from_dir(args.model_dir, 1 << 16)
        hasher = BlockHasher(args.block_size, args.hash_seed)
        seq = [0]

        async def publisher(api: str, body: dict) -> None:
            tokens = await tokenizer.tokens(api, body)
            full = len(tokens) // args.block_size * args.block_size
            hashes = hasher.event_keys(tokens[:full])
            if not hashes:
                return
            event = ["BlockStored", hashes, None, list(tokens[:full]), args.block_size, None, "GPU", None]
            payload = msgpack.packb([time.time(), [event], 0], use_bin_type=True)
            pub.send_multipart((b"", seq[0].to_bytes(8, "big"), payload))
            seq[0] += 1

    async def generate(request: web.Request) -> web.StreamResponse:
        api = "chat" if request.path.endswith("chat/completions") else "completions"
        body = await request.json()
        max_tokens = body.get("max_tokens")
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            error = {"object": "error", "message": f"max_tokens must be at least 1, got {max_tokens!r}.",
                     "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response(error, status=400)
        tag = body.get("x_hold")
        if tag:
            event = state["held"].setdefault(tag, asyncio.Event())
            await event.wait()
        if publisher is not None:
            await publisher(api, body)
        state["served"] += 1
        state["last"] = body
        pieces = _completion_text(body, args.name)
        rid = "cmpl-" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]
        obj = "chat.completion" if api == "chat" else "text_completion"
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(pieces)}} if api == "chat"
                      else {"index": 0, "text": "".join(pieces)})
            out = {"id": rid, "object": obj, "created": 0, "model": body.get("model", "m"), "served_by": args.name,
                   "choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": len(pieces)}}
            if (body.get("kv_transfer_params") or {}).get("do_remote_decode") and not body.get("x_no_kv_transfer"):
                out["kv_transfer_params"] = {"handoff_id": f"{args.name}-{state['served']}", "node_id": args.name}
            return web.Response(body=json.dumps(out, ensure_ascii=False).encode(), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for i, piece in enumerate(pieces):
            if i == 1 and body.get("x_hold_mid_stream"):  # the response has begun: wait here
                await state["held"].setdefault(body["x_hold_mid_stream"], asyncio.Event()).wait()
            delta = {"delta": {"content": piece}} if api == "chat" else {"text": piece}
            chunk = {"id": rid, "object": obj + ".chunk" if api == "chat" else obj, "created": 0,
                     "served_by": args.name, "choices": [{"index": 0, **delta}]}
            await resp.write(b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n")
            await asyncio.sleep(0.001)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=state["health"], text="ok" if state["health"] == 200 else "unhealthy")

    async def metrics(request: web.Request) -> web.Response:
        text = ("# HELP vllm:num_requests_waiting Requests waiting.\n# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{model_name="m"}} {state["queue"]}\n')
        return web.Response(text=text, content_type="text/plain")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": args.name}]})

    async def admin(request: web.Request) -> web.Response:
        what = request.match_info["what"]
        q = request.query
        if what == "release":
            state["held"].setdefault(q["tag"], asyncio.Event()).set()
        elif what == "health":
            state["health"] = int(q["status"])
        elif what == "queue":
            state["queue"] = q["n"]
        elif what == "last":
            return web.json_response(state["last"])
        held = sum(1 for e in state["held"].values() if not e.is_set())
        return web.json_response({"served": state["served"], "held_tags": held})

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/admin/{what}", admin)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


# ---- the harness ---------------------------------------------------------------------


_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(method: str, url: str, body: bytes | dict | None = None, timeout: float = 30.0,
         headers: dict | None = None) -> tuple[int, dict, bytes]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with _opener.open(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def served_by(raw: bytes) -> str:
    if raw.startswith(b"data: "):
        return json.loads(raw.split(b"\n\n")[0][6:])["served_by"]
    return json.loads(raw)["served_by"]


def wait_for(predicate, what: str, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


class RawClient:
    """A client on a bare socket: the request line and headers, then the body in as many pieces as the test sends."""

    def __init__(self, url: str, path: str, *, content_length: int, timeout: float = 30.0) -> None:
        host, _, port = url.removeprefix("http://").rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
                 f"Content-Length: {content_length}"]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answered(self) -> bool:
        """Whether the server has said something (or closed) without waiting for it."""
        return bool(select.select([self.sock], [], [], 0)[0])

    def response(self) -> tuple[int, dict, bytes]:
        """The server's answer: status, headers, body (read to its Content-Length)."""
        r = http_client.HTTPResponse(self.sock)
        r.begin()
        return r.status, dict(r.getheaders()), r.read()

    def close(self) -> None:
        self.sock.close()


class StandIn:
    """One stand-in engine process on a port of its own."""

    def __init__(self, name: str, log_dir: Path, *, kv_events_port: int = 0, model_dir: str = "") -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv_events_port = kv_events_port
        self.kv_events = f"tcp://127.0.0.1:{kv_events_port}" if kv_events_port else ""
        self.model_dir = model_dir
        self.log = log_dir / f"engine-{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> StandIn:
        cmd = [sys.executable, "-m", "tests.support.router_stand_in", "--port", str(self.port), "--name", self.name]
        if self.kv_events_port:
            cmd += ["--kv-events-port", str(self.kv_events_port), "--model-dir", self.model_dir]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        wait_for(self._up, f"stand-in engine {self.name} to serve (log {self.log})")
        return self

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"stand-in {self.name} exited:\n{self.log.read_text()}")
        try:
            return http("GET", self.url + "/health", timeout=2)[0] == 200
        except OSError:
            return False

    def admin(self, what: str, **query) -> dict:
        qs = "&".join(f"{k}={v}" for k, v in query.items())
        return json.loads(http("POST", f"{self.url}/admin/{what}?{qs}", b"")[2])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


class RouterThread:
    """A :class:`kvstore.router.Router` on its own event loop in a thread (the tests stay synchronous)."""

    def __init__(self, settings) -> None:
        from kvstore.router import Router

        self.router = Router(settings)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.router.start(), self.loop).result(timeout=60)
        self.url = self.router.url

    @staticmethod
    async def _cancel_the_rest() -> None:
        """What ``asyncio.run`` does before it closes its loop (``strata route`` runs in one): cancel what is
        left, e.g. aiohttp's lingering read of a body the router refused unread, which outlives its client."""
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def metric(self, name: str, **labels) -> float:
        return self.router.metrics.registry.get_sample_value(name, labels) or 0.0

    def decisions(self, reason: str) -> float:
        return self.metric("strata_router_decisions_total", policy=self.router.settings.policy, reason=reason)

    def post(self, path: str, body, **kw) -> tuple[int, dict, bytes]:
        return http("POST", self.url + path, body, **kw)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.router.stop(), self.loop).result(timeout=60)
        asyncio.run_coroutine_threadsafe(self._cancel_the_rest(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


class ReferenceEngine(StandIn):
    """The benchmark's reference engine (benchmarks/e2e/engine.py, a tiny real model) as a process."""

    def __init__(self, name: str, log_dir: Path, model_dir: str, *extra: str, kv_events_port: int = 0) -> None:
        super().__init__(name, log_dir, kv_events_port=kv_events_port, model_dir=model_dir)
        self.extra = extra

    def start(self) -> ReferenceEngine:
        cmd = [sys.executable, "-m", "benchmarks.e2e.engine", "--model", self.model_dir, "--port", str(self.port),
               "--engine-id", f"engine-{self.name}", "--block-size", str(BLOCK), "--hash-seed", HASH_SEED,
               "--threads", "1", *self.extra]
        if self.kv_events_port:
            cmd += ["--kv-events", self.kv_events]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        wait_for(self._up, f"reference engine {self.name} to serve (log {self.log})", timeout=120)
        return self


RECURSIVE_TEMPLATE = ("{% macro show(x) %}{% if x is string %}{{ x }}{% elif x is iterable %}"
                      "{% for y in x %}{{ show(y) }}{% endfor %}{% endif %}{% endmacro %}"
                      "{% for m in messages %}{{ m['role'] }} : {{ show(m['content']) }} {% endfor %}")


def build_tokenizer(out: Path, chat_template: str | None = None) -> Path:
    """A word-level tokenizer with a chat template (``chat_template``, or one that checks each message has a
    role), saved as a local model directory (no hub). :data:`RECURSIVE_TEMPLATE` renders nested content
    parts by recursion, as templates that walk a message's parts do."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<s>", "</s>", "user", "assistant", "system", ":"] + [f"w{i}" for i in range(500)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    fast.chat_template = chat_template or ("{% for m in messages %}{% if m['role'] is not defined %}"
                                           "{{ raise_exception('every message needs a role') }}{% endif %}"
                                           "{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                                           "{% if add_generation_prompt %}assistant : {% endif %}")
    fast.save_pretrained(str(out))
    return out


# ---- what the router tests send -------------------------------------------------------


def words(start: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


def prompt_keys(prompt: str, model_dir) -> list[bytes]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)(prompt)["input_ids"]
    full = len(ids) // BLOCK * BLOCK
    return [event_key_bytes(h) for h in BlockHasher(BLOCK, HASH_SEED).chain(ids[:full])]


def seed(daemon, engine: StandIn, prompt: str, model_dir) -> None:
    """Serve ``prompt`` at ``engine`` directly until the index shows it holding every block of it
    (a publication sent before the daemon's subscription joined is lost, as with vLLM; send again)."""
    keys = prompt_keys(prompt, model_dir)
    with Client(daemon.target) as c:
        def held() -> bool:
            assert http("POST", engine.url + "/v1/completions", {"prompt": prompt, "max_tokens": 1})[0] == 200
            for _ in range(25):
                scores = c.score(NS, keys=keys, candidates=[f"engine-{engine.name}"])
                if scores and scores[0].blocks == len(keys):
                    return True
                wait_for(lambda: True, "a pause")
            return False

        wait_for(held, f"the index to show engine-{engine.name} holding {prompt!r}", timeout=60)


def completion(r: RouterThread, prompt: str, **extra) -> str:
    status, _, raw = r.post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 4, **extra})
    assert status == 200, raw
    return served_by(raw)


if __name__ == "__main__":
    engine_main(sys.argv[1:])
