"""``strata route``: the cache-aware router in front of OpenAI-compatible engines.

Every flag is a field of :class:`kvstore.config.router.RouterSettings`; its
help, variable and default come from the field, as ``strata serve``'s do.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing

DESCRIPTION = """\
Proxy /v1/completions and /v1/chat/completions (streaming byte for byte) to one of several engines.

cache-aware (default --cache-aware-score estimated-ttft) sends each request where its estimated time
to first token is smallest (ties: more cached, then lower load, then round-robin):
    ttft     = overhead + per_token * (uncached + backlog) + per_request * ahead
    uncached = the prompt's tokens the endpoint does not hold (the index's Score RPC: its engine's prefix,
               then what its node daemon holds beyond it, tier-weighted)
    backlog  = uncached prefill tokens the router sent there whose first byte has not come back
    ahead    = requests the router has outstanding at the endpoint, or its scraped queue
               (--queue-metric) where that is longer
    load     = the router's outstanding requests + the scraped queue (least-loaded's measure)
The three costs start at their priors (--ttft-overhead-seconds, --ttft-prefill-seconds-per-token,
--ttft-seconds-per-request-ahead) and after --ttft-min-samples streamed requests are fitted from each
stream's measured TTFT (exponentially weighted least squares over about --ttft-window requests,
outliers down-weighted, bounded); metrics strata_router_ttft_model_*.
--cache-aware-score weighted picks the largest weighted sum instead (ties: lower load, then round-robin):
    score = prefix_weight * hit - load_weight * load / max_load
    hit      = the endpoint's cached blocks of the prompt (tier-weighted, from the index's Score RPC)
               / the prompt's full blocks, 0..1: what its engine holds (KV events, --namespace), then
               beyond it what its node daemon holds through vLLM's Strata tier (--tier-namespace)
    load     = requests the router has outstanding at the endpoint + its scraped queue (--queue-metric)
    max_load = the largest load among the healthy endpoints (at least 1)
When the index does not answer within --index-timeout-seconds the request goes least-loaded
(metric strata_router_decisions_total{reason="fallback_index_down"}) and the index is asked again
after --index-retry-seconds.

Every flag can also be set as STRATA_ROUTER_<FLAG> (--max-in-flight: STRATA_ROUTER_MAX_IN_FLIGHT;
several endpoints separated by spaces) or as a key of the [router] table of --config.
"""

EXAMPLE = """\
example, two vLLM pods publishing KV events to the node daemon on 10.0.0.9:50051:
  strata route --listen 0.0.0.0:8000 --model-dir /models/llama-3-8b \\
      --endpoint http://10.0.0.5:8000=vllm-0 --endpoint http://10.0.0.6:8000=vllm-1 \\
      --index 10.0.0.9:50051 --namespace llama-3-8b --block-size 16 --hash-seed 0
"""


def _show(value) -> str:
    if isinstance(value, list):
        return ",".join(value) or "none"
    return str(value) if value != "" else "none"


def add_parser(sub) -> None:
    from kvstore.config.router import ROUTER_SETTINGS, router_env

    route = sub.add_parser("route", help="a cache-aware router in front of OpenAI-compatible engines (vLLM)",
                           description=DESCRIPTION, epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    route.add_argument("--config", metavar="FILE", help="TOML file whose [router] table holds settings "
                       "(flags and STRATA_ROUTER_* variables override it) [env STRATA_CONFIG]")
    for s in ROUTER_SETTINGS:
        default = s.field.get_default(call_default_factory=True)
        help_text = f"{s.field.description} [env {router_env(s)}; default {_show(default)}]"
        if s.repeatable:
            route.add_argument(s.option, dest=s.flag, action="append", default=None, metavar="URL[=ID,...]",
                               help=help_text)
            continue
        literal = typing.get_origin(s.field.annotation) is typing.Literal
        choices = typing.get_args(s.field.annotation) if literal else None
        route.add_argument(s.option, dest=s.flag, default=None, choices=choices, metavar=None if choices else s.flag.upper(),
                           help=help_text)
    route.set_defaults(func=cmd_route)


def cmd_route(args: argparse.Namespace) -> int:
    from kvstore.cli.common import setup_logging
    from kvstore.config.load import SettingsError
    from kvstore.config.router import ROUTER_SETTINGS, load_router_settings

    overrides = {s.flag: getattr(args, s.flag) for s in ROUTER_SETTINGS if getattr(args, s.flag) is not None}
    try:
        settings = load_router_settings(args.config or os.environ.get("STRATA_CONFIG"), **overrides)
    except SettingsError as err:
        print(f"strata route: {err}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    try:
        from kvstore.router.server import run
    except ImportError as err:
        print(f"strata route: {err.name} is missing: pip install 'strata-kvcache[router]'", file=sys.stderr)
        return 2
    try:
        return run(settings)
    except (RuntimeError, OSError) as err:  # a tokenizer that does not load, a port in use
        print(f"strata route: {err}", file=sys.stderr)
        return 1
