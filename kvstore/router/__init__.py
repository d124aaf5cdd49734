"""``strata route``: a cache-aware router in front of OpenAI-compatible engines (vLLM and the like).

    settings  kvstore.config.router   RouterSettings, load_router_settings (flags, STRATA_ROUTER_*, [router])
    server    Router                  the HTTP front: admission, limits, the request's way, /health, /metrics
    body      BodyReader              a client's body under a size limit, a deadline and a bound of its own; its JSON
    policy    POLICIES                round-robin, least-loaded, cache-aware: which endpoint, and why
    ttft      TtftModel, TtftFit      cache-aware's estimated TTFT per endpoint, its costs fitted from measured TTFT
    scorer    PrefixScorer            block keys of the prompt, the index's Score RPC under a deadline
    prompt    PromptTokenizer         the prompt's token ids from the model's local tokenizer
    health    HealthChecker           GET /health per interval, the engine's queue from its /metrics
    proxy     Upstream                one request to an engine and its response back, bytes unchanged
    endpoint  Endpoint                an engine's address, index ids and state
    metrics   RouterMetrics           Prometheus metrics on the router's own registry
    errors    RequestRefused          the HTTP answers the router gives itself (400-499, 502-504)

Needs the ``router`` extra (aiohttp; transformers for the cache-aware policy).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.config.router import RouterSettings, load_router_settings
    from kvstore.router.server import Router

# Imported on first use, not with the package: the policies, the TTFT model and the endpoint
# records are plain Python that a simulation (benchmarks.fleet) imports without the HTTP server.
_LAZY = {"Router": "kvstore.router.server", "RouterSettings": "kvstore.config.router",
         "load_router_settings": "kvstore.config.router"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Router", "RouterSettings", "load_router_settings"]
