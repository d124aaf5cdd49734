"""The engine's OpenAI-compatible HTTP API (aiohttp), with SSE streaming and a bounded queue.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``, and with ``--admin`` ``POST /admin/reconfigure`` (the
benchmark's reuse of one engine process across phases: :meth:`Engine.reconfigure`).
Response and chunk shapes are vLLM's/OpenAI's; ``usage`` carries
``prompt_tokens_details.cached_tokens`` (KV from the engine's cache or the pool) and a
non-standard ``strata: {cached_local, cached_pool, pulled_blocks}``. Disaggregated serving takes
vLLM's ``kv_transfer_params``: ``{"do_remote_decode": true}`` on a prefill engine's request (the
answer carries the handoff's params as ``kv_transfer_params``), those params on a decode engine's. A stream ends with a usage chunk
(``choices: []``, as with ``stream_options.include_usage``) and ``data: [DONE]``.

One request computes at a time, on one worker thread: the model uses every core it is given,
so two at once would only make both slower. At most ``max_queue`` more wait; beyond that a
request is refused at once with 429 and ``Retry-After`` (seconds: the mean request time so far
times the queue length, at least 1), never held for an unbounded time. A client that goes away
mid-stream stops its request's decoding at the next token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from benchmarks.e2e.engine import RECONFIGURABLE, Engine, EngineConfig, Generation

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
DEFAULT_MAX_TOKENS = 16
MAX_MESSAGES = 1024


class BadRequest(Exception):
    pass


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status,
                             headers=headers)


class EngineServer:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        c = engine.config
        self.model_name = c.served_model_name or Path(c.model).resolve().name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self._admitted = 0  # waiting + computing
        self._served = 0
        self._busy_s = 0.0
        self.app = web.Application(client_max_size=MAX_BODY_BYTES)
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])
        if c.admin:
            self.app.add_routes([web.post("/admin/reconfigure", self.reconfigure)])
        self.app.on_cleanup.append(self._cleanup)

    async def _cleanup(self, app) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        await asyncio.to_thread(self.engine.close)

    # ---- plain routes ----------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "strata-e2e",
            "root": self.model_name, "max_model_len": self.engine.max_model_len,
            "engine_id": self.engine.config.engine_id,
        }]})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.engine.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def reconfigure(self, request: web.Request) -> web.Response:
        """``POST /admin/reconfigure`` ``{field: value, ...}`` (:data:`RECONFIGURABLE`): the engine starts
        over (empty cache, new pool namespace and KV-event endpoint, metrics from zero) on the compute
        thread, after what it computes now. Refused with 409 while any request is admitted: a phase's
        engine is reconfigured between phases, never under load."""
        try:
            changes = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"the body must be a JSON object of fields to change: {e}", "BadRequestError")
        if not isinstance(changes, dict):
            return _error(400, "the body must be a JSON object of fields to change", "BadRequestError")
        if self._admitted:
            return _error(409, f"{self._admitted} requests admitted: reconfigure an idle engine", "ConflictError")
        loop = asyncio.get_running_loop()
        try:
            config = await loop.run_in_executor(self._executor, lambda: self.engine.reconfigure(**changes))
        except (ValueError, TypeError) as e:
            return _error(400, str(e), "BadRequestError")
        self._served, self._busy_s = 0, 0.0
        return web.json_response({k: getattr(config, k) for k in sorted(RECONFIGURABLE)})

    # ---- generation ------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        m = self.engine.metrics
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            params = self._params(body, chat)
        except (BadRequest, json.JSONDecodeError, UnicodeDecodeError) as e:
            m.requests.labels("400").inc()
            return _error(400, str(e), "BadRequestError")
        if self._admitted > self.engine.config.max_queue:
            m.requests.labels("429").inc()
            retry = max(1, math.ceil(self._mean_request_s() * self._admitted))
            return _error(429, f"the engine's queue is full ({self.engine.config.max_queue} waiting); retry later",
                          "RateLimitError", headers={"Retry-After": str(retry)})
        self._admitted += 1
        m.queue_depth.set(self._admitted - 1)
        try:
            if params["stream"]:
                return await self._stream(request, params, chat)
            return await self._complete(params, chat)
        finally:
            self._admitted -= 1
            m.queue_depth.set(max(0, self._admitted - 1))

    def _params(self, body: dict, chat: bool) -> dict:
        name = body.get("model")
        if name not in (None, self.model_name):
            raise BadRequest(f"model {name!r} is not served here; this engine serves {self.model_name!r}")
        if chat:
            prompt_ids = self.engine.runner.encode(self.engine.runner.chat_prompt(_messages(body.get("messages"))))
        else:
            prompt_ids = self._prompt_ids(body.get("prompt"))
        if not prompt_ids:
            raise BadRequest("the prompt is empty")
        default = DEFAULT_MAX_TOKENS if not chat else self.engine.config.max_tokens_limit
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = min(default, self.engine.max_model_len - len(prompt_ids))
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest("max_tokens must be a positive integer")
        if max_tokens > self.engine.config.max_tokens_limit:
            raise BadRequest(f"max_tokens {max_tokens} is over this engine's limit {self.engine.config.max_tokens_limit}")
        if len(prompt_ids) + max_tokens > self.engine.max_model_len:
            raise BadRequest(
                f"{len(prompt_ids)} prompt tokens + max_tokens {max_tokens} exceed the model's "
                f"{self.engine.max_model_len}: shorten the prompt or lower max_tokens"
            )
        temperature = body.get("temperature", 1.0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
            raise BadRequest("temperature must be a number >= 0 (0: greedy)")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("seed must be an integer")
        transfer = body.get("kv_transfer_params")
        if transfer is not None and not isinstance(transfer, dict):
            raise BadRequest("kv_transfer_params must be an object: {\"do_remote_decode\": true} on a prefill, or the "
                             "kv_transfer_params a prefill engine answered")
        transfer = transfer or {}
        remote_decode = transfer.get("do_remote_decode") is True
        handoff = transfer if "handoff_id" in transfer else None
        if (remote_decode or handoff is not None) and self.engine.pool is None:
            raise BadRequest("this engine has no shared pool (--strata, --namespace): it cannot hand KV off or take "
                             "a handoff; send the request without kv_transfer_params")
        return {
            "prompt_ids": prompt_ids, "max_tokens": max_tokens, "temperature": float(temperature), "seed": seed,
            "ignore_eos": bool(body.get("ignore_eos", False)), "stream": bool(body.get("stream", False)),
            "return_token_ids": bool(body.get("return_token_ids", False)),
            "remote_decode": remote_decode, "handoff": handoff,
        }

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.engine.runner.encode(prompt)
        vocab = self.engine.runner.model.config.vocab_size
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(not 0 <= t < vocab for t in prompt):
                raise BadRequest(f"a prompt token id is outside the vocabulary 0..{vocab - 1}")
            return list(prompt)
        raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)")

    def _mean_request_s(self) -> float:
        return self._busy_s / self._served if self._served else 1.0

    async def _run(self, params: dict, on_token, cancelled) -> Generation:
        loop = asyncio.get_running_loop()
        m = self.engine.metrics

        def work() -> Generation:
            m.running.set(1)
            t = time.perf_counter()
            try:
                return self.engine.generate(
                    params["prompt_ids"], params["max_tokens"], temperature=params["temperature"],
                    seed=params["seed"], ignore_eos=params["ignore_eos"], on_token=on_token, cancelled=cancelled,
                    remote_decode=params["remote_decode"], handoff=params["handoff"],
                )
            finally:
                self._busy_s += time.perf_counter() - t
                self._served += 1
                m.running.set(0)

        return await loop.run_in_executor(self._executor, work)

    def _usage(self, gen: Generation) -> dict:
        cached = gen.cached_local + gen.cached_pool
        return {
            "prompt_tokens": gen.prompt_tokens, "completion_tokens": len(gen.tokens),
            "total_tokens": gen.prompt_tokens + len(gen.tokens),
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _strata(self, gen: Generation) -> dict:
        return {"cached_local": gen.cached_local, "cached_pool": gen.cached_pool, "engine_id": self.engine.config.engine_id,
                "pulled_blocks": gen.pulled_blocks}

    async def _complete(self, params: dict, chat: bool) -> web.Response:
        admitted = time.perf_counter()
        first: list[float] = []

        def on_token(gen: Generation) -> None:
            if not first:
                first.append(time.perf_counter())

        gen = await self._run(params, on_token, lambda: False)
        if first:
            self.engine.metrics.ttft_seconds.observe(first[0] - admitted)
        text = self.engine.runner.decode(gen.tokens)
        rid, created = _ids(chat)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": gen.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": gen.finish_reason}
        if params["return_token_ids"]:
            choice["token_ids"] = gen.tokens
            choice["prompt_token_ids"] = params["prompt_ids"]
        self.engine.metrics.requests.labels("200").inc()
        answer = {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": self.model_name, "choices": [choice], "usage": self._usage(gen), "strata": self._strata(gen),
        }
        if params["remote_decode"]:
            answer["kv_transfer_params"] = gen.kv_transfer_params  # None: no handoff (the decode side computes)
        return web.json_response(answer)

    async def _stream(self, request: web.Request, params: dict, chat: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[int] = asyncio.Queue()
        gone = False
        admitted = time.perf_counter()

        def on_token(gen: Generation) -> None:
            loop.call_soon_threadsafe(tokens.put_nowait, gen.tokens[-1])

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        rid, created = _ids(chat)
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload) -> None:
            nonlocal gone
            if gone:
                return
            data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
            try:
                await resp.write(f"data: {data}\n\n".encode())
            except (ConnectionResetError, ConnectionError):
                gone = True

        def chunk(text: str | None, finish: str | None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice]}

        task = asyncio.ensure_future(self._run(params, on_token, lambda: gone))
        if chat:
            await send(chunk(None, None, role=True))
        sent_text = ""
        gen_ids: list[int] = []
        # Text is sent as it becomes whole characters (a byte-level token can end inside one).
        while True:
            getter = asyncio.ensure_future(tokens.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                break
            if not gen_ids:
                self.engine.metrics.ttft_seconds.observe(time.perf_counter() - admitted)
            gen_ids.append(getter.result())
            if request.transport is None or request.transport.is_closing():
                gone = True
            sent_text = await self._send_text(send, chunk, gen_ids, sent_text, final=False)
        gen = await task
        await self._send_text(send, chunk, gen.tokens, sent_text, final=True)
        await send(chunk(None if chat else "", gen.finish_reason))
        final = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                 "usage": self._usage(gen), "strata": self._strata(gen)}
        if params["return_token_ids"]:
            final["token_ids"] = gen.tokens
            final["prompt_token_ids"] = params["prompt_ids"]
        if params["remote_decode"]:
            final["kv_transfer_params"] = gen.kv_transfer_params
        await send(final)
        await send("[DONE]")
        self.engine.metrics.requests.labels("200" if not gone else "499").inc()
        if not gone:
            await resp.write_eof()
        return resp

    async def _send_text(self, send, chunk, ids: list[int], sent: str, final: bool) -> str:
        text = self.engine.runner.decode(ids)
        if (text.endswith("\ufffd") and not final) or text == sent:
            return sent
        # Byte-level BPE decodes a prefix of the tokens to a prefix of the text once it is whole.
        await send(chunk(text[len(sent):], None))
        return text


def _ids(chat: bool) -> tuple[str, int]:
    return (("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()))


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}")
    if len(messages) > MAX_MESSAGES:
        raise BadRequest(f"{len(messages)} messages; the limit is {MAX_MESSAGES}")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role")
        content = msg.get("content", "")
        if isinstance(content, list):  # content parts: only text is understood
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"messages[{i}].content parts must all be text parts")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": msg["role"], "content": content})
    return out


def serve(config: EngineConfig) -> None:
    engine = Engine(config)
    server = EngineServer(engine)
    log.info("engine %s serving %s on http://%s:%s (prefix cache %s)", config.engine_id, server.model_name,
             config.host, config.port, config.prefix_cache)
    web.run_app(server.app, host=config.host, port=config.port, print=None, access_log=None)
