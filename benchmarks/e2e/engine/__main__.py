"""``python -m benchmarks.e2e.engine``: the reference engine's command line (see :mod:`benchmarks.e2e.engine`)."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from benchmarks.e2e import engine
from benchmarks.e2e.engine import EngineConfig
from benchmarks.e2e.model import MODEL_MARKER
from benchmarks.e2e.prefix_cache import PREFIX_CACHES
from benchmarks.e2e.server import serve


def parse_args(argv: list[str] | None = None) -> EngineConfig:
    d = EngineConfig(model="")
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e.engine", description=engine.__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory (python -m benchmarks.e2e.model --out DIR), or "
                   "with --model-digest a published revision's location (s3://bucket/prefix)")
    p.add_argument("--model-digest", default="", help="the published revision's manifest digest: --model is "
                   "streamed through the node's weight cache (weightcache.open_model), every chunk verified")
    p.add_argument("--weights-cache", default="", help="the node cache directory for --model-digest")
    p.add_argument("--s3-endpoint", default="", help="an S3-compatible endpoint for --model s3://... "
                   "(credentials: the AWS_* variables)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--engine-id", default=d.engine_id, help="this engine's holder id in the prefix index")
    p.add_argument("--served-model-name", default="", help="the model name in the API (default: the directory's name)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (vLLM --block-size)")
    p.add_argument("--hash-seed", default=d.hash_seed, help="vLLM's PYTHONHASHSEED for block keys (a string)")
    p.add_argument("--prefix-cache", default=d.prefix_cache, choices=sorted(PREFIX_CACHES))
    p.add_argument("--cache-blocks", type=int, default=d.cache_blocks, help="blocks the block cache holds (LRU)")
    p.add_argument("--kv-events", default="", help="bind a ZMQ PUB for vLLM KV events here, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--kv-events-replay", default="", help="bind the ZMQ ROUTER replay socket here")
    p.add_argument("--strata", default="", help="the node's Strata daemon (host:port) for the shared KV pool")
    p.add_argument("--namespace", default="", help="the pool's namespace (one per model and block size)")
    p.add_argument("--pool-max-pending", type=int, default=d.pool_max_pending, help="blocks queued for the pool")
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="requests waiting beyond the one computing")
    p.add_argument("--max-tokens-limit", type=int, default=d.max_tokens_limit)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--admin", action="store_true",
                   help="serve POST /admin/reconfigure: a fresh cache, pool namespace and KV-event endpoint "
                        "without reloading the model (benchmark only; loopback)")
    p.add_argument("--wait-for-model", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to SECONDS for --model to be complete (python -m benchmarks.e2e.model writes "
                        f"{MODEL_MARKER} last), so an engine's imports overlap the model's build")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return EngineConfig(
            model=a.model, host=a.host, port=a.port, engine_id=a.engine_id, served_model_name=a.served_model_name,
            block_size=a.block_size, hash_seed=a.hash_seed, prefix_cache=a.prefix_cache, cache_blocks=a.cache_blocks,
            kv_events=a.kv_events, kv_events_replay=a.kv_events_replay, strata=a.strata, namespace=a.namespace,
            pool_max_pending=a.pool_max_pending, max_queue=a.max_queue, max_tokens_limit=a.max_tokens_limit,
            threads=a.threads, admin=a.admin, wait_for_model_s=a.wait_for_model, model_digest=a.model_digest,
            weights_cache=a.weights_cache, s3_endpoint=a.s3_endpoint,
        )
    except ValueError as e:
        p.error(str(e))


def wait_for_model(config: EngineConfig) -> None:
    """Until the model directory's marker exists (its builder writes it after every other file), at most
    ``config.wait_for_model_s``; then the load says what is missing, as without the wait."""
    if config.published is not None:
        return
    marker = Path(config.model) / MODEL_MARKER
    end = time.monotonic() + config.wait_for_model_s
    while not marker.exists() and time.monotonic() < end:
        time.sleep(0.05)  # polling a file another process is about to write


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    wait_for_model(config)
    serve(config)


if __name__ == "__main__":
    main()
