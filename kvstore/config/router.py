"""Settings of ``strata route``, the cache-aware router: one section, its own loader.

The router is its own process, so its settings are not a section of the
daemon's :class:`~kvstore.config.settings.Settings`; they follow the same
pattern (a :class:`~kvstore.config.section.Section` whose fields hold the
defaults and the help text) and the same precedence: flags, then
``STRATA_ROUTER_*`` variables (``--health-interval-seconds`` is
``STRATA_ROUTER_HEALTH_INTERVAL_SECONDS``), then the ``[router]`` table of a
TOML file (``--config``), then the defaults. The prefix is not the daemon's
``STRATA_``: a router and a daemon in one environment must not read each
other's ``STRATA_LISTEN`` or ``STRATA_BLOCK_SIZE``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import ByteSize, Field, ValidationError, field_validator, model_validator

from kvstore.block import validate_namespace
from kvstore.config.load import SettingsError, read_config_file
from kvstore.config.section import Section, SettingName, iter_settings, setting
from kvstore.errors import InvalidNamespace

ROUTER_ENV_PREFIX = "STRATA_ROUTER_"
ENDPOINT_SYNTAX = "http://HOST:PORT[=ID[,ID...]]"
MAX_ENDPOINTS = 256  # each is a label value of the router's metrics
MAX_IDS_PER_ENDPOINT = 16
POLICIES = ("round-robin", "least-loaded", "cache-aware")


def parse_endpoint(spec: str) -> tuple[str, tuple[str, ...]]:
    """``http://10.0.0.5:8000=vllm-0,node-a`` → (``http://10.0.0.5:8000``, (``vllm-0``, ``node-a``))."""
    url, _, ids_text = spec.strip().partition("=")
    url = url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"endpoint {spec!r} must look like {ENDPOINT_SYNTAX}, e.g. http://10.0.0.5:8000=vllm-0")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"endpoint {spec!r} has a port that is not a number 1..65535") from None
    ids = tuple(dict.fromkeys(i.strip() for i in ids_text.split(",") if i.strip()))
    if len(ids) > MAX_IDS_PER_ENDPOINT:
        raise ValueError(f"endpoint {spec!r} names {len(ids)} index ids; at most {MAX_IDS_PER_ENDPOINT}")
    return url, ids


def _split_endpoints(cls, value: Any) -> Any:
    """A variable holds several endpoints separated by spaces or ';' (a comma separates one endpoint's ids)."""
    if isinstance(value, str):
        return [p for p in re.split(r"[;\s]+", value) if p]
    return value


class RouterSettings(Section):
    """Everything ``strata route`` is configured with; built once at start, passed to :class:`Router`."""

    title = "Strata cache-aware router"

    listen: str = setting("127.0.0.1:8000", "HTTP address of the router, host:port (port 0: any free port)")
    endpoints: Annotated[list[str], Field(max_length=MAX_ENDPOINTS)] = setting(
        default_factory=list,
        description=f"an OpenAI-compatible engine, {ENDPOINT_SYNTAX} (repeat per engine): the IDs are the "
        "prefix-index node ids whose cached blocks count as this engine's (its --kv-events engine id, its node "
        "daemon's --node-id); without IDs it gets no prefix credit",
        flag="endpoint", repeatable=True,
    )
    prefill_endpoints: Annotated[list[str], Field(max_length=MAX_ENDPOINTS)] = setting(
        default_factory=list,
        description=f"a prefill engine for disaggregated serving, {ENDPOINT_SYNTAX} (repeat per engine): with any, "
        "each request is prefilled on the least-loaded of them (max_tokens 1, kv_transfer_params "
        "do_remote_decode), then sent with the kv_transfer_params it answered to a decode engine (the "
        "--endpoint ones, picked by --policy), which pulls the KV through the handoff; a prefill that fails "
        "costs only the handoff: the decode engine computes the whole prompt",
        flag="prefill_endpoint", repeatable=True,
    )
    policy: Literal["round-robin", "least-loaded", "cache-aware"] = setting(
        "cache-aware", "how to pick an endpoint: round-robin, least-loaded (fewest requests outstanding, plus "
        "the scraped queue), cache-aware (by the prompt's cached prefix and the load: see --cache-aware-score)"
    )
    cache_aware_score: Literal["estimated-ttft", "weighted"] = setting(
        "estimated-ttft", "what cache-aware minimizes or maximizes: estimated-ttft, the smallest estimated time to "
        "first token (queued prefill and requests ahead + this prompt's uncached tokens, in seconds, costs "
        "learned from measured TTFT); weighted, the largest prefix_weight x cached fraction - load_weight x "
        "relative load (--prefix-weight, --load-weight)"
    )
    model_dir: str = setting(
        "", "local directory of the model's tokenizer (tokenizer.json, tokenizer_config.json, chat template); "
        "never fetched from a hub. Needed by cache-aware"
    )
    index: str = setting("", "a Strata daemon whose Score RPC answers for the prefix index, host:port. Needed by cache-aware")
    namespace: str = setting("", "the index namespace the engines' blocks are published under (the --kv-events namespace)")
    tier_namespace: str = setting(
        "", "the namespace the engines' vLLM Strata tier stores KV-cache group 0 under, vllm/<model>@<layout>/g0 "
        "(the tier logs it at start): blocks the endpoints' node daemons hold there count for them, at the tier "
        "they are in; empty: only what the engines themselves hold (--namespace) counts"
    )
    tier_blocks_per_chunk: int = setting(
        1, "the engines' offload chunk in blocks (vLLM's blocks_per_chunk): a chunk is keyed by its last block's hash",
        ge=1, le=1024,
    )
    index_token_file: str = setting("", "bearer token file for a daemon with authentication; empty: none")
    block_size: int = setting(16, "tokens per KV block, the engines' --block-size", ge=1, le=4096)
    hash_seed: str = setting(
        "", "the engines' PYTHONHASHSEED (vLLM's block hashes depend on it); needed by cache-aware"
    )
    lora_adapters: Annotated[list[str], Field(max_length=1024)] = setting(
        default_factory=list,
        description="model names that are LoRA adapters of the engines (their --lora-modules names), comma-separated: "
        "a request for one is hashed with it as vLLM does (the adapter's blocks are its own); other names are the base model",
        flag="lora_adapter", repeatable=True,
    )
    index_timeout_seconds: float = setting(
        0.05, "deadline of one Score RPC; a slower index counts as down for this request", gt=0, le=10
    )
    index_retry_seconds: float = setting(
        1.0, "after the index failed, route least-loaded without asking it for this long, then ask again",
        gt=0, le=600,
    )
    prefix_weight: float = setting(
        2.0, "weight of the cached-prefix fraction (0..1) in the weighted score (--cache-aware-score weighted)",
        ge=0, le=1000,
    )
    load_weight: float = setting(
        1.0, "weight of the load penalty (an endpoint's load / the busiest endpoint's load, 0..1) in the weighted "
        "score (--cache-aware-score weighted)", ge=0, le=1000
    )
    ttft_prefill_seconds_per_token: float = setting(
        1e-4, "prior of the estimated TTFT: prefill seconds per uncached prompt token (1e-4: an 8B model on one "
        "current GPU), used until --ttft-min-samples streamed requests were measured, then fitted from them",
        ge=1e-7, le=0.1,
    )
    ttft_overhead_seconds: float = setting(
        0.02, "prior of the estimated TTFT: seconds of a request with nothing to prefill and nothing ahead "
        "(routing, scheduling, the first decode step)", ge=0, le=60,
    )
    ttft_seconds_per_request_ahead: float = setting(
        0.05, "prior of the estimated TTFT: seconds each request ahead at an endpoint adds beyond its prefill "
        "(its decode, when the engine serves one request at a time; near 0 for a batching engine)", ge=0, le=600,
    )
    ttft_min_samples: int = setting(
        10, "streamed requests measured before the fitted costs replace the priors (a ridge keeps what they do "
        "not show, e.g. requests ahead when none ever queued, at its prior)", ge=1, le=1 << 20
    )
    ttft_window: int = setting(
        256, "the estimate follows about this many recent requests (exponential weights: a sample's weight halves "
        "every 0.69 x window samples)", ge=2, le=1 << 20,
    )
    max_in_flight: int = setting(
        256, "requests the router has outstanding at once, each from its whole body read to the end of its "
        "response; beyond: 429 with Retry-After", ge=1, le=1 << 16
    )
    retry_after_seconds: int = setting(1, "the Retry-After of a 429 or 503 the router answers", ge=1, le=3600)
    max_body_bytes: ByteSize = setting(ByteSize(8 << 20), "largest request body accepted; beyond: 413")
    body_timeout_seconds: float = setting(
        30.0, "time a client has to send its whole request body, from its headers to the last byte; beyond: 408 "
        "and the connection closed. A deadline for the whole body, not for the gap between two reads (a client "
        "trickling a byte at a time cannot stretch it); a body still arriving holds no --max-in-flight slot",
        gt=0, le=3600,
    )
    header_timeout_seconds: float = setting(
        10.0, "time a client has from opening a connection to the end of its first request's headers; beyond: "
        "the connection is closed, unanswered (a client that connects and sends nothing, or half its headers, "
        "holds no descriptor longer). Later requests on a kept-alive connection: --keepalive-timeout-seconds",
        gt=0, le=3600,
    )
    keepalive_timeout_seconds: float = setting(
        75.0, "a kept-alive connection is closed when its next request's headers are not whole this long after "
        "its last response (an idle one, and one mid-headers)", gt=0, le=86400,
    )
    max_body_reads: int = setting(
        256, "requests whose body is still arriving, at once (a body that came whole with its headers does not "
        "count); they wait apart from --max-in-flight, so slow uploads never hold the slots of requests already "
        "read; beyond: 429 with Retry-After. At most this x --max-body-bytes is buffered for them",
        ge=1, le=1 << 16,
    )
    max_prompt_tokens: int = setting(
        65536, "tokens of a prompt hashed for the index (a longer prompt is scored on its head)", ge=1, le=1 << 20
    )
    retries: int = setting(
        1, "other endpoints tried when the chosen one refuses the connection (never once bytes were sent)",
        ge=0, le=3,
    )
    connect_timeout_seconds: float = setting(5.0, "time to open a connection to an engine", gt=0, le=600)
    upstream_timeout_seconds: float = setting(
        600.0, "time an engine may take to send its response headers, and the longest gap between two body "
        "chunks", gt=0, le=86400,
    )
    health_interval_seconds: float = setting(
        2.0, "GET /health of every endpoint this often; one that fails leaves rotation until it passes", gt=0, le=3600
    )
    health_timeout_seconds: float = setting(1.0, "a health check answered slower than this fails", gt=0, le=600)
    queue_metric: str = setting(
        "vllm:num_requests_waiting",
        "gauge scraped from each engine's /metrics with the health check and added to its load; empty: no scrape",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = setting("INFO", "log level")
    log_format: Literal["json", "text"] = setting("json", "log lines as JSON objects or plain text")

    _split = field_validator("endpoints", "prefill_endpoints", mode="before")(_split_endpoints)

    @field_validator("endpoints", "prefill_endpoints")
    @classmethod
    def _check_endpoints(cls, value: list[str]) -> list[str]:
        urls = [parse_endpoint(spec)[0] for spec in value]
        dup = next((u for u in urls if urls.count(u) > 1), None)
        if dup:
            raise ValueError(f"endpoint {dup} is given twice")
        return value

    @field_validator("namespace", "tier_namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if value:
            try:
                validate_namespace(value)
            except InvalidNamespace as err:
                raise ValueError(str(err)) from None
        return value

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"listen {value!r} must be host:port, e.g. 0.0.0.0:8000")
        return value

    @model_validator(mode="after")
    def _complete(self) -> RouterSettings:
        if not self.endpoints:
            raise ValueError(f"no endpoints: give --endpoint {ENDPOINT_SYNTAX} once per engine")
        both = {parse_endpoint(e)[0] for e in self.endpoints} & {parse_endpoint(e)[0] for e in self.prefill_endpoints}
        if both:
            raise ValueError(f"{sorted(both)[0]} is both a prefill and a decode endpoint: an engine is one or the "
                             "other (a colocated engine is an --endpoint only)")
        if self.policy == "cache-aware":
            missing = [f"--{n.replace('_', '-')}" for n in ("model_dir", "index", "namespace", "hash_seed")
                       if not getattr(self, n) and not (n == "namespace" and self.tier_namespace)]
            if missing:
                raise ValueError(f"policy cache-aware needs {', '.join(missing)} (or pick --policy least-loaded; "
                                 "--tier-namespace may stand in for --namespace)")
        if self.header_timeout_seconds > self.keepalive_timeout_seconds:
            raise ValueError(f"header_timeout_seconds {self.header_timeout_seconds:g} is over "
                             f"keepalive_timeout_seconds {self.keepalive_timeout_seconds:g}, whose timer runs from a "
                             "connection's opening too: lower the one or raise the other")
        if self.model_dir and not Path(self.model_dir).is_dir():
            raise ValueError(f"model_dir {self.model_dir} is not a directory: give the model's local directory")
        return self

    def endpoint_specs(self) -> list[tuple[str, tuple[str, ...]]]:
        return [parse_endpoint(spec) for spec in self.endpoints]

    def prefill_specs(self) -> list[tuple[str, tuple[str, ...]]]:
        return [parse_endpoint(spec) for spec in self.prefill_endpoints]

    @property
    def listen_host(self) -> str:
        host = self.listen.rpartition(":")[0]
        return host[1:-1] if host.startswith("[") else (host or "127.0.0.1")

    @property
    def listen_port(self) -> int:
        return int(self.listen.rpartition(":")[2])


ROUTER_SETTINGS: tuple[SettingName, ...] = tuple(iter_settings(RouterSettings))


def router_env(s: SettingName) -> str:
    return ROUTER_ENV_PREFIX + s.flag.upper()


def load_router_settings(
    config_file: str | Path | None = None, *, environ: Mapping[str, str] | None = None, **overrides: Any
) -> RouterSettings:
    """Settings from ``overrides`` (flag names), ``STRATA_ROUTER_*`` variables, then ``config_file``'s [router]."""
    by_flag = {s.flag: s for s in ROUTER_SETTINGS}
    merged: dict[str, Any] = {}
    if config_file is not None:
        table = read_config_file(Path(config_file)).get("router", {})
        if not isinstance(table, dict):
            raise SettingsError(f"config file {config_file}: [router] must be a table")
        merged.update(table)
    env = os.environ if environ is None else environ
    for s in ROUTER_SETTINGS:
        if router_env(s) in env:
            merged[s.path[-1]] = env[router_env(s)]
    unknown = [name for name in overrides if name not in by_flag]
    if unknown:
        raise SettingsError(f"invalid settings:\n  {', '.join(unknown)}: unknown; known: {', '.join(by_flag)}")
    merged.update({by_flag[name].path[-1]: value for name, value in overrides.items()})
    try:
        return RouterSettings.model_validate(merged)
    except ValidationError as err:
        raise SettingsError("invalid settings:\n" + "\n".join(_describe(e, by_flag) for e in err.errors())) from None


def _describe(error: Mapping[str, Any], by_flag: Mapping[str, SettingName]) -> str:
    message = error["msg"].removeprefix("Value error, ")
    loc = tuple(error["loc"])
    by_field = {s.path[-1]: s for s in by_flag.values()}
    if error["type"] == "extra_forbidden":
        return f"  [router] {loc[-1]}: unknown key; known: {', '.join(by_field)}"
    s = by_field.get(loc[0]) if loc else None
    if s is None:
        return f"  router: {message}"
    return f"  {s.flag} (flag {s.option}, env {router_env(s)}, config [router] {s.path[-1]}): {message}"
