"""Settings of the prefix index: ``[index]``.

Config checks the syntax of each value and hands the index its parts as
plain values (:meth:`IndexSettings.event_sources`, :meth:`IndexSettings.tier_weights`);
the index package builds its own types from them, so config imports none
(only the index's URL redaction, when the settings are shown: the URL may
carry a password).
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import parse_qs, urlsplit

from pydantic import Field, field_validator

from kvstore.block import TierName
from kvstore.config.section import Section, setting
from kvstore.config.values import split_commas

EVENT_SOURCE_SYNTAX = "tcp://HOST:PORT?engine=ID&namespace=NS[&replay=tcp://HOST:PORT][&topic=T]"
_EVENT_SOURCE_PARAMS = {"engine", "namespace", "replay", "topic"}
MAX_EVENT_SOURCES = 1024


def parse_event_source(spec: str) -> dict[str, Any]:
    """``tcp://h:5557?engine=ID&namespace=NS&replay=tcp://h:5558`` → the fields of one engine's event stream.

    The keys are those of ``kvstore.index.events.EngineSource``.
    """
    endpoint, _, query = spec.partition("?")
    params = {k: v[-1] for k, v in parse_qs(query).items()}
    unknown = set(params) - _EVENT_SOURCE_PARAMS
    if not urlsplit(endpoint).scheme or unknown or "engine" not in params or "namespace" not in params:
        raise ValueError(f"kv_events entry {spec!r} must look like {EVENT_SOURCE_SYNTAX}")
    return {
        "endpoint": endpoint,
        "engine_id": params["engine"],
        "namespace": params["namespace"],
        "replay_endpoint": params.get("replay"),
        "topic": params.get("topic", ""),
    }


def parse_tier_weights(text: str) -> dict[str, float]:
    """``gpu=1,host=0.8`` → ``{"gpu": 1.0, "host": 0.8}``, tier labels as ``TierName.label``."""
    labels = [tier.label for tier in TierName]
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        try:
            weight = float(value)
        except ValueError:
            weight = None
        if not sep or name not in labels or weight is None:
            raise ValueError(f"score weight {part!r} is not tier=number with tier one of {', '.join(labels)}")
        if not weight >= 0:
            raise ValueError(f"score weight {part!r} must be tier=number, the number non-negative")
        weights[name] = weight
    return weights


class IndexSettings(Section):
    flag_prefix = "index_"
    title = "the prefix index: where it lives, node heartbeats, router scores, vLLM KV events"

    url: str = setting(
        "memory://",
        "prefix index: memory:// (embedded, this node only), redis://[USER:PASSWORD@]HOST:PORT/DB, "
        "redis+cluster://HOST:PORT for a Redis Cluster, rediss:// (or rediss+cluster://) for TLS with "
        "?tls_ca_file=PEM[&tls_cert_file=PEM&tls_key_file=PEM]; the password is shown as *** everywhere",
    )
    ttl_seconds: float = setting(10.0, "node heartbeat TTL in the prefix index", gt=0, le=3600)
    score_weights: str = setting(
        "gpu=1,host=0.8,disk=0.5,peer=0.3,object=0.1",
        "router score weight per tier: a cached block counts this much (tier=weight,...)",
        flag="score_weights",
    )
    kv_events: Annotated[list[str], Field(max_length=MAX_EVENT_SOURCES)] = setting(
        default_factory=list,
        description="vLLM engines whose KV events to index, comma-separated, each "
        "ENDPOINT?engine=ID&namespace=NS[&replay=ENDPOINT][&topic=T], "
        "e.g. tcp://10.0.0.5:5557?engine=vllm-0&namespace=llama-3-8b",
        flag="kv_events",
    )

    _split = field_validator("kv_events", mode="before")(split_commas)

    @field_validator("kv_events")
    @classmethod
    def _check_kv_events(cls, value: list[str]) -> list[str]:
        for spec in value:
            parse_event_source(spec)
        return value

    @field_validator("score_weights")
    @classmethod
    def _check_weights(cls, value: str) -> str:
        parse_tier_weights(value)
        return value

    def __repr_args__(self):
        from kvstore.index.redis_url import redact  # the index's redaction; imported only when shown

        for name, value in super().__repr_args__():
            yield name, redact(value) if name == "url" else value

    def event_sources(self) -> list[dict[str, Any]]:
        """Keyword arguments of ``kvstore.index.events.EngineSource``, one per engine."""
        return [parse_event_source(spec) for spec in self.kv_events]

    def tier_weights(self) -> dict[str, float]:
        """The router's weight per tier label; tiers not named keep the servicer's default."""
        return parse_tier_weights(self.score_weights)
