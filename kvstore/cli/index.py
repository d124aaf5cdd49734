"""``strata index lookup|holders``: query the prefix index (cache-aware routing);
``strata index serve``: the indexer HTTP API over it (:mod:`kvstore.indexer.server`)."""

from __future__ import annotations

import argparse
import json

from kvstore.cli.target import open_client, parse_key


def add_parser(sub, client_opts: argparse.ArgumentParser, key_opts: argparse.ArgumentParser) -> None:
    chain_opts = argparse.ArgumentParser(add_help=False)
    chain_opts.add_argument("namespace")
    chain_opts.add_argument("keys", nargs="*", metavar="KEY", help="the chain as block keys, head first")
    chain_opts.add_argument("--tokens", help="the chain as token ids (comma- or space-separated), hashed as vLLM does")
    chain_opts.add_argument("--block-size", type=int, default=16, help="tokens per block, as the engines' --block-size [16]")
    chain_opts.add_argument("--hash-seed", help="the engines' PYTHONHASHSEED (needed with --tokens)")
    chain_opts.add_argument("--lora-name", help="LoRA adapter name, if the requests use one")
    chain_opts.add_argument("--cache-salt", help="the requests' cache_salt, if any")
    index = sub.add_parser("index", help="query the prefix index (cache-aware routing)")
    index_sub = index.add_subparsers(dest="index_command", required=True, metavar="INDEX_COMMAND")
    lookup = index_sub.add_parser(
        "lookup", parents=[client_opts, key_opts, chain_opts], help="rank nodes by the cached prefix they hold",
        description="Rank nodes by how many leading blocks of the chain they hold, weighted by tier "
        "(what a router's Score call answers).",
    )
    lookup.add_argument("--candidate", action="append", help="only consider this node (repeatable)")
    lookup.add_argument("--json", action="store_true", help="print JSON")
    lookup.set_defaults(func=cmd_index_lookup)
    holders = index_sub.add_parser(
        "holders", parents=[client_opts, key_opts, chain_opts], help="who holds each block of a chain",
        description="For each block of the chain, the nodes holding it now (live, at their current epoch).",
    )
    holders.set_defaults(func=cmd_index_holders)
    add_serve_parser(index_sub)


def add_serve_parser(index_sub) -> None:
    from kvstore.indexer.settings import IndexerSettings

    d = IndexerSettings()
    serve = index_sub.add_parser(
        "serve", help="the indexer HTTP API (/query, /query_by_hash, /register, /unregister)",
        description="Serve the indexer HTTP API gateways share (Mooncake RFC #1403 shapes) over a prefix index: "
        "per instance, the cached prefix of a prompt in tokens, per tier (GPU, CPU, DISK, PEER, OBJECT) and per "
        "DP rank; /register follows an engine's vLLM KV events into the index. See docs/integrations/indexer-api.md.",
    )
    serve.add_argument("--index-url", default=d.index_url, help=f"the prefix index to answer from [{d.index_url}]")
    serve.add_argument("--listen", default=d.listen, help=f"HTTP address, HOST:PORT (port 0: any free one) [{d.listen}]")
    serve.add_argument("--hash-seed", default="", help="the engines' PYTHONHASHSEED, to hash /query's token ids as "
                       "they do (without it /query is refused; /query_by_hash still answers)")
    serve.add_argument("--token-file", default="", help="file holding the bearer token clients must send; needed "
                       "beyond loopback unless --insecure")
    serve.add_argument("--insecure", action="store_true", help="serve a non-loopback --listen without a token")
    serve.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                       help=f"largest request body (413 beyond) [{d.max_body_bytes}]")
    serve.add_argument("--body-timeout-seconds", type=float, default=d.body_timeout_s,
                       help=f"a body must arrive whole within this (408 beyond) [{d.body_timeout_s:g}]")
    serve.add_argument("--max-in-flight", type=int, default=d.max_in_flight,
                       help=f"requests answered at once (429 beyond) [{d.max_in_flight}]")
    serve.add_argument("--index-timeout-seconds", type=float, default=d.index_timeout_s,
                       help=f"deadline of one answer's index calls (503 beyond) [{d.index_timeout_s:g}]")
    serve.add_argument("--max-engines", type=int, default=d.max_engines,
                       help=f"engines /register may follow [{d.max_engines}]")
    serve.add_argument("--event-ttl-seconds", type=float, default=d.event_ttl_s,
                       help=f"a followed engine's liveness in the index without messages [{d.event_ttl_s:g}]")
    serve.add_argument("--tier-namespace", default="", metavar="NAMESPACE",
                       help="vLLM's Strata tier namespace (vllm/<model>@<layout>/g0, in the daemon's log): /query "
                       "also counts the chunks node daemons hold there, as `strata route --tier-namespace` does "
                       "[a body's tier_namespace, else none]")
    serve.add_argument("--tier-blocks-per-chunk", type=int, default=d.tier_blocks_per_chunk,
                       help=f"blocks per chunk of vLLM's offloading in that namespace [{d.tier_blocks_per_chunk}]")
    serve.add_argument("--registrations-file", default="", metavar="PATH",
                       help="keep /register's registrations in this file and follow them again at start "
                       "[in memory only]")
    serve.set_defaults(func=cmd_index_serve)


def cmd_index_serve(args: argparse.Namespace) -> int:
    import sys

    from kvstore.errors import InvalidArgument
    from kvstore.indexer.settings import IndexerError, IndexerSettings

    try:
        from kvstore.indexer.server import run
    except ImportError as err:
        print(f"strata index serve: {err.name} is missing: pip install 'strata-kvcache[router]'", file=sys.stderr)
        return 2
    try:
        settings = IndexerSettings(
            index_url=args.index_url, listen=args.listen, hash_seed=args.hash_seed, token_file=args.token_file,
            insecure=args.insecure, max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_seconds,
            max_in_flight=args.max_in_flight, index_timeout_s=args.index_timeout_seconds, max_engines=args.max_engines,
            event_ttl_s=args.event_ttl_seconds, registrations_file=args.registrations_file,
            tier_namespace=args.tier_namespace, tier_blocks_per_chunk=args.tier_blocks_per_chunk,
        )
        return run(settings)
    except (IndexerError, InvalidArgument, OSError) as err:  # protected mode, a bad URL, a port in use
        print(f"strata index serve: {err}", file=sys.stderr)
        return 2


def _chain_args(args: argparse.Namespace) -> dict:
    if bool(args.keys) == bool(args.tokens):
        raise SystemExit("strata index: give the chain as KEY arguments or as --tokens, not both")
    if args.tokens:
        try:
            tokens = [int(t) for t in args.tokens.replace(",", " ").split()]
        except ValueError:
            raise SystemExit("strata index: --tokens takes integers separated by commas or spaces") from None
        if not args.hash_seed:
            raise SystemExit("strata index: --tokens needs --hash-seed (the engines' PYTHONHASHSEED)")
        return dict(tokens=tokens, block_size=args.block_size, hash_seed=args.hash_seed,
                    lora_name=args.lora_name or "", cache_salt=args.cache_salt or "")
    return dict(keys=[parse_key(args, k) for k in args.keys])


def cmd_index_lookup(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        scores = client.score(args.namespace, candidates=args.candidate or (), **_chain_args(args))
    if args.json:
        print(json.dumps([{"node_id": e.node_id, "blocks": e.blocks, "tier": e.tier.label if e.tier else None,
                           "score": e.score} for e in scores]))
        return 0
    if not scores:
        print("no node holds the first block of this chain")
    for e in scores:
        print(f"{e.node_id}\t{e.blocks} blocks\t{e.tier.label if e.tier else '-'}\tscore {e.score:g}")
    return 0


def cmd_index_holders(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        found = client.holders(args.namespace, **_chain_args(args))
    for i, holders in enumerate(found):
        names = ", ".join(f"{h.node_id}({h.tier.label}, epoch {h.epoch})" for h in holders) or "nobody"
        print(f"block {i}\t{names}")
    return 0
