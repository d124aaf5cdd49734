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

from kvstore.config.router import RouterSettings, load_router_settings
from kvstore.router.server import Router

__all__ = ["Router", "RouterSettings", "load_router_settings"]
