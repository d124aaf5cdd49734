"""``strata index lookup|holders``: query the prefix index (cache-aware routing)."""

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
