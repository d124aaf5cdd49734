"""``strata``: run the node daemon and operate it.

    strata serve                     start the daemon (embedded defaults: no Redis, S3 or GPU)
    strata kv put NS KEY [FILE]      store a block (FILE or stdin)
    strata kv get NS KEY [-o FILE]   read a block (to FILE or stdout)
    strata kv stat NS KEY...         which tier holds each block
    strata kv list NS [--prefix P]   keys in byte order, with size and tier
    strata kv delete NS KEY...       remove blocks
    strata stats                     tier usage, blocks, leases, handoffs, replication
    strata index lookup NS KEY...    nodes ranked by the cached prefix they hold (or --tokens)
    strata index holders NS KEY...   who holds each block of a chain
    strata peers                     the fleet's nodes: epochs, liveness, transports, bytes served
    strata replication               replicated namespaces: blocks held here, under-replicated, copies made
    strata object ls|du|gc [NS]      the object tier's bucket: namespaces, usage, a lifecycle sweep now
    strata weights ...               model weights: publish, ls, fetch, evict, serve, prefetch, wait
                                     (runs python -m weightcache; strata weights --help)
    strata route --endpoint URL ...  a cache-aware router in front of OpenAI-compatible engines (vLLM)
    strata doctor [SERVE FLAGS]      check this host for strata serve: tmpfs, disk, memory, ports, Redis, S3, UCX
    strata clean [SERVE FLAGS]       remove the arena a stopped daemon kept in shared memory (and its table)
    strata auth init DIR             the tokens and policy file of a cluster's auth Secrets, and their kubectl commands
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import typing
from pathlib import Path

from kvstore.config import SETTINGS, Settings, SettingsError, load_settings
from kvstore.config.section import iter_sections
from kvstore.cli.common import serve_overrides, setup_logging

DEFAULT_TARGET = "127.0.0.1:50051"


# ---- serve -----------------------------------------------------------------


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, grouped by config section, its help taken from the field."""
    for path, section in iter_sections(Settings):
        names = [s for s in SETTINGS if s.path[:-1] == path]
        if not names:
            continue
        group = parser.add_argument_group(group_title(path), section.title)
        for s in names:
            default = s.field.get_default(call_default_factory=True)
            help_text = f"{s.field.description} [env {s.env}; config key {s.path[-1]}; default {_show(default)}]"
            if s.repeatable:
                group.add_argument(s.option, dest=s.flag, action="append", default=None, metavar=s.flag.upper(), help=help_text)
            elif s.field.annotation is bool:
                group.add_argument(s.option, dest=s.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            else:
                literal = typing.get_origin(s.field.annotation) is typing.Literal
                choices = typing.get_args(s.field.annotation) if literal else None
                group.add_argument(s.option, dest=s.flag, default=None, choices=choices, metavar=s.flag.upper(), help=help_text)


def group_title(path: tuple[str, ...]) -> str:
    """A --help group: the config file's table, or its top level (``[[arenas]]``)."""
    return f"[{'.'.join(path)}]" if path else "top-level keys"


def _show(value) -> str:
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20}MiB" if value < 1 << 30 else f"{value >> 30}GiB"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    if isinstance(value, dict):
        return ",".join(f"{k}:{v}" for k, v in value.items()) or "none"
    return str(value) if value != "" else "off"


def cmd_serve(args: argparse.Namespace) -> int:
    overrides = serve_overrides(args)
    config = args.config or os.environ.get("STRATA_CONFIG")
    try:
        settings = load_settings(config, **overrides)
    except SettingsError as err:
        print(f"strata serve: {err}", file=sys.stderr)
        return 2
    setup_logging(settings.logging.level, settings.logging.format)
    from kvstore.errors import StrataError
    from kvstore.server.daemon import serve

    try:
        return serve(settings)
    except StrataError as err:
        logging.getLogger("strata").error("cannot start: %s", err)
        print(f"strata serve: {err}", file=sys.stderr)
        return 1


# ---- operator commands -------------------------------------------------------


def _key(args: argparse.Namespace, text: str) -> bytes:
    if args.hex:
        try:
            return bytes.fromhex(text)
        except ValueError:
            raise SystemExit(f"strata: key {text!r} is not hex (drop --hex to use it as text)") from None
    return text.encode()


def _client(args: argparse.Namespace):
    from kvstore.client.sync import Client

    token = os.environ.get("STRATA_TOKEN") if not args.token_file else None
    return Client(args.target, timeout=args.timeout, use_shm=False if args.no_shm else None,
                  token=token or None, token_file=args.token_file, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                  tls_key=args.tls_key, tls_server_name=args.tls_server_name)


def cmd_kv_put(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvstore.client.codec import BlockPut

    if args.from_dir:
        files = sorted(p for p in Path(args.from_dir).iterdir() if p.is_file())
        with _client(args) as client:
            stored, conflicts = 0, []
            for path in tqdm(files, unit="block", desc="put", disable=None):
                data = path.read_bytes()
                if client.put_many(args.namespace, [BlockPut(path.name.encode(), data, None, args.layout)])[0]:
                    stored += 1
                elif _holds_other_bytes(client, args.namespace, path.name.encode(), data):
                    conflicts.append(path.name)
        print(f"stored {stored} new blocks of {len(files)} files from {args.from_dir}")
        if conflicts:
            print(f"strata kv put: {len(conflicts)} keys already hold other bytes ({', '.join(conflicts[:5])}"
                  f"{', ...' if len(conflicts) > 5 else ''}): {_SAME_KEY_SAME_BYTES}", file=sys.stderr)
            return 1
        return 0
    if args.key is None:
        raise SystemExit("strata kv put: give a KEY (and a FILE, or data on stdin), or --from-dir DIR")
    data = sys.stdin.buffer.read() if args.file in (None, "-") else Path(args.file).read_bytes()
    parent = _key(args, args.parent) if args.parent else None
    key = _key(args, args.key)
    with _client(args) as client:
        stored = client.put(args.namespace, key, data, parent=parent, layout=args.layout)
        other = not stored and _holds_other_bytes(client, args.namespace, key, data)
    if other:
        print(f"strata kv put: key {args.key!r} in namespace {args.namespace!r} already holds other bytes "
              f"({other} bytes; nothing was stored): {_SAME_KEY_SAME_BYTES}", file=sys.stderr)
        return 1
    print(f"{'stored' if stored else 'already present (the same bytes)'}: {len(data)} bytes")
    return 0


_SAME_KEY_SAME_BYTES = ("a key names its bytes for good (blocks are content- or prefix-addressed: same key, same "
                        "bytes), so a put never replaces a block; delete it first (strata kv delete NS KEY) or "
                        "use another key")


def _holds_other_bytes(client, namespace: str, key: bytes, data: bytes) -> int:
    """The size of the block ``key`` holds when its bytes are not ``data`` (0 when they are, or it is gone)."""
    held = client.get(namespace, key)
    return 0 if held is None or held == data else max(len(held), 1)


def cmd_kv_get(args: argparse.Namespace) -> int:
    with _client(args) as client:
        data = client.get(args.namespace, _key(args, args.key))
    if data is None:
        print(f"strata kv get: no block {args.key!r} in namespace {args.namespace!r}", file=sys.stderr)
        return 3
    if args.output in (None, "-"):
        sys.stdout.buffer.write(data)
    else:
        Path(args.output).write_bytes(data)
    return 0


def cmd_kv_stat(args: argparse.Namespace) -> int:
    with _client(args) as client:
        rows = []
        for text in args.keys:
            found = client.exists(args.namespace, [_key(args, text)])
            rows.append({"key": text, "present": bool(found), "tier": found[0].label if found else None})
    if args.json:
        print(json.dumps(rows))
    else:
        for row in rows:
            print(f"{row['key']}\t{row['tier'] or 'absent'}")
    return 0 if all(r["present"] for r in rows) else 3


def _show_key(args: argparse.Namespace, key: bytes) -> str:
    if args.hex:
        return key.hex()
    try:
        return key.decode()
    except UnicodeDecodeError:
        return "hex:" + key.hex()


def cmd_kv_list(args: argparse.Namespace) -> int:
    prefix = _key(args, args.prefix) if args.prefix else b""
    shown = 0
    with _client(args) as client:
        for block in client.iter_blocks(args.namespace, prefix, page_size=min(args.limit or 1000, 1000)):
            if args.limit and shown == args.limit:
                break
            key = _show_key(args, block.key)
            if args.json:
                print(json.dumps({"key": key, "size": block.size, "tier": block.tier.label, "layout": block.layout}))
            else:
                print(f"{key}\t{block.size}\t{block.tier.label}")
            shown += 1
    return 0


def cmd_kv_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        n = client.delete(args.namespace, [_key(args, k) for k in args.keys])
    print(f"deleted {n} of {len(args.keys)} blocks")
    return 0


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
    return dict(keys=[_key(args, k) for k in args.keys])


def cmd_index_lookup(args: argparse.Namespace) -> int:
    with _client(args) as client:
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
    with _client(args) as client:
        found = client.holders(args.namespace, **_chain_args(args))
    for i, holders in enumerate(found):
        names = ", ".join(f"{h.node_id}({h.tier.label}, epoch {h.epoch})" for h in holders) or "nobody"
        print(f"block {i}\t{names}")
    return 0


def _size(n: float) -> str:
    """Bytes for a person: 512 B, 1.5 KiB, 20.0 MiB, 3.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def cmd_peers(args: argparse.Namespace) -> int:
    with _client(args) as client:
        nodes = client.nodes()
    if args.json:
        print(json.dumps([dataclasses.asdict(n) for n in nodes]))
        return 0
    if not nodes:
        print("the prefix index knows no node (is --index-url a shared Redis?)")
    for n in nodes:
        state = "alive" if n.alive else "dead"
        served = ", ".join(f"{t} {_size(b)}" for t, b in n.served_bytes.items()) or "nothing reported"
        print(f"{n.node_id}\tepoch {n.epoch}\t{state}\t{n.address or '-'}\t{' '.join(n.transports) or '-'}"
              f"\tserved: {served}")
    return 0


def cmd_replication(args: argparse.Namespace) -> int:
    import time

    with _client(args) as client:
        r = client.replication()
    if args.json:
        print(json.dumps(dataclasses.asdict(r)))
        return 4 if args.check and r.under_replicated else 0
    if not r.enabled:
        print(f"node {r.node_id} replicates no namespace (set [replication] namespaces, or --replicate NS:K)")
    else:
        age = f"{time.time() - r.last_round_unix_seconds:.1f}s ago" if r.last_round_unix_seconds else "not yet"
        print(f"node {r.node_id}: {r.rounds} rounds, {r.passes} complete passes, last round {age}"
              + (f" (stopped short: {r.last_error})" if r.last_error else ""))
        if not r.namespaces:
            print("  no block of a replicated namespace is held here")
        for n in r.namespaces:
            print(f"  {n.namespace}\tk={n.replicas} (rule {n.rule})\t{n.blocks} blocks\t"
                  f"{n.under_replicated} under-replicated\t{n.copies_made} copies made\t{n.copies_failed} failed")
    if r.max_pin_replicas < 2:
        print("pins may not ask for replicas here ([replication] max_pin_replicas)")
    else:
        print(f"pins with replicas (at most {r.max_pin_replicas}):" + ("" if r.pins else " none"))
        for p in r.pins:
            print(f"  {p.namespace}\t{p.pins} pins\tk<={p.replicas}\t{p.blocks} blocks\t"
                  f"{p.under_replicated} under-replicated\t{p.copies_held} copies held elsewhere\t"
                  f"{p.copies_made} copies made\t{p.copies_failed} failed")
    if args.check and r.under_replicated:
        print(f"{r.under_replicated} under-replicated blocks")
    return 4 if args.check and r.under_replicated else 0


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        s = client.stats(args.namespace or "")
    if args.json:
        print(json.dumps(dataclasses.asdict(s)))
        return 0
    print(f"node {s.node_id} (epoch {s.epoch}): {s.blocks} blocks, {s.pinned_blocks} pinned, "
          f"{s.active_leases} leases, {s.open_slots} open slots, {s.demotion_queue_depth} queued for disk, "
          f"{s.open_handoffs} open handoffs")
    for tier, t in s.tiers.items():
        pct = 100 * t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else 0
        print(f"  {tier:5} {t['used_bytes'] / 2**20:10.1f} / {t['capacity_bytes'] / 2**20:.1f} MiB ({pct:.0f}%)  {t['blocks']} blocks")
        if t.get("degraded"):
            print(f"        degraded: {t['degraded']}")
    print(f"  namespaces: {', '.join(s.namespaces) or 'none'}")
    if s.handoffs is not None:
        h = s.handoffs
        print(f"  handoffs: {h.open} open, {h.opened} opened, {h.completed} completed, {h.expired} expired; "
              f"pulls here: {h.pulls_ok} ok, {h.pulls_failed} failed, {_size(h.pulled_bytes)} pulled, "
              f"{h.pull_fallbacks} fallbacks")
    r = s.replication
    if r is not None and not r.enabled:
        print("  replication: off")
    elif r is not None:
        import time

        check = f"{time.time() - r.last_round_unix_seconds:.1f}s ago" if r.last_round_unix_seconds else "not yet"
        print(f"  replication: {r.under_replicated} blocks under-replicated, {r.copies_made} copies pushed "
              f"({r.copies_failed} failed), {r.rounds} rounds, last check {check}"
              + (f" (stopped short: {r.last_error})" if r.last_error else ""))
    return 0


# ---- parser ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata",
        description="Strata: a tiered KV-block cache daemon for LLM inference fleets.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 1)[1],
    )
    parser.add_argument("--version", action="version", version=f"strata {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="start the node daemon",
        description="Start the node daemon: gRPC KVService with health and reflection, Prometheus metrics, "
        "a host-RAM tier (shared memory) over a disk tier. Every setting comes from a flag, a STRATA_* "
        "environment variable (the flag's name, or the section path: STRATA_TIERS__RAM__BYTES) or a TOML "
        "config file, in that order of precedence. Flags are grouped below by the config file section that "
        "holds them; sizes take units (512MiB, 4GiB).",
    )
    serve.add_argument("--config", metavar="FILE",
                       help="TOML config file, one table per section below: [tiers.ram] bytes = \"1GiB\" "
                       "(example: deploy/strata.example.toml) [env STRATA_CONFIG]")
    _add_settings_flags(serve)
    serve.set_defaults(func=cmd_serve)

    client_opts = argparse.ArgumentParser(add_help=False)
    client_opts.add_argument("--target", default=os.environ.get("STRATA_TARGET", DEFAULT_TARGET),
                             help=f"daemon address host:port or unix:PATH [env STRATA_TARGET; default {DEFAULT_TARGET}]")
    client_opts.add_argument("--timeout", type=float, default=10.0, help="seconds per call [default 10]")
    client_opts.add_argument("--no-shm", action="store_true", help="stream bytes over gRPC even on the daemon's host")
    client_opts.add_argument("--token-file", default=os.environ.get("STRATA_TOKEN_FILE"), metavar="FILE",
                             help="bearer token for a daemon with --auth-file, first line of FILE "
                             "[env STRATA_TOKEN_FILE; or the token itself in STRATA_TOKEN]")
    client_opts.add_argument("--tls-ca", default=os.environ.get("STRATA_TLS_CA"), metavar="PEM",
                             help="verify the daemon's TLS certificate with this CA [env STRATA_TLS_CA]")
    client_opts.add_argument("--tls-cert", default=os.environ.get("STRATA_TLS_CERT"), metavar="PEM",
                             help="client certificate, for a daemon with --tls-client-ca (mTLS) [env STRATA_TLS_CERT]")
    client_opts.add_argument("--tls-key", default=os.environ.get("STRATA_TLS_KEY"), metavar="PEM",
                             help="private key of --tls-cert [env STRATA_TLS_KEY]")
    client_opts.add_argument("--tls-server-name", default=os.environ.get("STRATA_TLS_SERVER_NAME"), metavar="NAME",
                             help="name to verify in the daemon's certificate when --target is an address")
    key_opts = argparse.ArgumentParser(add_help=False)
    key_opts.add_argument("--hex", action="store_true", help="keys are hex-encoded bytes, not text")

    kv = sub.add_parser("kv", help="read and write blocks (operators, debugging)")
    kv_sub = kv.add_subparsers(dest="kv_command", required=True, metavar="KV_COMMAND")
    put = kv_sub.add_parser("put", parents=[client_opts, key_opts], help="store a block",
                            description="Store FILE (or stdin) as one block; or every file of --from-dir as a block keyed by its name.")
    put.add_argument("namespace", help="namespace (model or tenant)")
    put.add_argument("key", nargs="?", help="block key")
    put.add_argument("file", nargs="?", help="file to store; '-' or omitted: stdin")
    put.add_argument("--parent", help="key of the previous block of a prefix chain")
    put.add_argument("--layout", default="", help="free-form layout tag stored with the block")
    put.add_argument("--from-dir", metavar="DIR", help="store each regular file of DIR (with a progress bar)")
    put.set_defaults(func=cmd_kv_put)
    get = kv_sub.add_parser("get", parents=[client_opts, key_opts], help="read a block",
                            description="Write a block's bytes to -o FILE or stdout; exit 3 when absent.")
    get.add_argument("namespace")
    get.add_argument("key")
    get.add_argument("-o", "--output", help="file to write; '-' or omitted: stdout")
    get.set_defaults(func=cmd_kv_get)
    stat = kv_sub.add_parser("stat", parents=[client_opts, key_opts], help="show where blocks are",
                             description="For each key, the tier holding it; exit 3 when any is absent.")
    stat.add_argument("namespace")
    stat.add_argument("keys", nargs="+", metavar="KEY")
    stat.add_argument("--json", action="store_true", help="print JSON")
    stat.set_defaults(func=cmd_kv_stat)
    ls = kv_sub.add_parser("list", parents=[client_opts, key_opts], help="list a namespace's blocks",
                           description="Print the namespace's keys in byte order, one per line: key, size in bytes, "
                                       "tier (--json: one JSON object per line, with the layout). Keys that are not "
                                       "UTF-8 are shown as hex:... unless --hex.")
    ls.add_argument("namespace")
    ls.add_argument("--prefix", help="only keys that start with this")
    ls.add_argument("--limit", type=int, default=0, help="print at most this many [default: all]")
    ls.add_argument("--json", action="store_true", help="print JSON lines")
    ls.set_defaults(func=cmd_kv_list)
    delete = kv_sub.add_parser("delete", parents=[client_opts, key_opts], help="remove blocks")
    delete.add_argument("namespace")
    delete.add_argument("keys", nargs="+", metavar="KEY")
    delete.set_defaults(func=cmd_kv_delete)

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

    peers = sub.add_parser(
        "peers", parents=[client_opts], help="list the fleet's nodes: epochs, liveness, transports, bytes served",
        description="Every node the daemon's prefix index knows: node id, epoch, whether it heartbeats within "
        "its TTL, its advertised gRPC address, its data-plane transports (what peers fetch blocks over) and the "
        "block bytes its peer listeners served to other nodes this epoch, by transport (tcp, ucx, grpc), as its "
        "latest heartbeat reported them (every ttl/3).",
    )
    peers.add_argument("--json", action="store_true", help="print JSON")
    peers.set_defaults(func=cmd_peers)

    replication = sub.add_parser(
        "replication", parents=[client_opts],
        help="replicated namespaces and pins with replicas: blocks held here, under-replicated",
        description="Per namespace that [replication] namespaces (--replicate) asks k copies of: the blocks this "
        "daemon holds, those found with fewer than k live holders at their latest check, and the copies it "
        "pushed to other nodes. Each holder reports the blocks it holds. Then, per namespace, this daemon's pins "
        "that ask for replicas: their blocks, those with fewer than k copies, the copies held on other nodes.",
    )
    replication.add_argument("--json", action="store_true", help="print JSON")
    replication.add_argument("--check", action="store_true", help="exit 4 when any block is under-replicated")
    replication.set_defaults(func=cmd_replication)

    stats = sub.add_parser(
        "stats", parents=[client_opts], help="show tier usage, blocks, leases, handoffs and replication",
        description="The daemon's tiers (used, capacity, degraded), blocks, pins, leases and slots; its handoffs "
        "since it started (open, completed, expired; pulls run here, bytes pulled, fallbacks); its replication "
        "(under-replicated blocks, copies pushed, the latest check). Node-wide figures need an identity allowed "
        "on every namespace.",
    )
    stats.add_argument("--namespace", help="only this namespace")
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.set_defaults(func=cmd_stats)

    sub.add_parser("weights", add_help=False,
                   help="model weights: publish, ls, fetch, evict, serve, prefetch, wait (strata weights --help)")
    clean = sub.add_parser(
        "clean", help="remove the arena a stopped daemon kept in shared memory",
        description="A daemon keeps its arena (the host-RAM tier) and its block table in --shm-dir when it stops, "
        "so a restart serves the blocks again. After a trial, this removes them: the files of the arena the "
        "given settings name (the same flags as strata serve: --shm-dir, --disk-dir, --config). It refuses while "
        "that daemon runs. The disk tier's blocks are left where they are (--disk-dir).",
    )
    clean.add_argument("--config", metavar="FILE", help="the daemon's TOML config file [env STRATA_CONFIG]")
    clean.add_argument("--dry-run", action="store_true", help="list what would be removed")
    _add_settings_flags(clean)
    clean.set_defaults(func=cmd_clean)
    from kvstore.cli import auth, doctor, objects, route

    doctor.add_parser(sub, _add_settings_flags)
    objects.add_parser(sub)
    route.add_parser(sub)
    auth.add_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("strata-kvcache")
    except PackageNotFoundError:
        return "unknown (not installed as a distribution)"


def cmd_clean(args: argparse.Namespace) -> int:
    from kvstore.config.tiers import arena_name
    from kvstore.doctor.host import daemon_running, state_dir

    try:
        settings = load_settings(args.config or os.environ.get("STRATA_CONFIG"), **serve_overrides(args))
    except SettingsError as err:
        print(f"strata clean: {err}", file=sys.stderr)
        return 2
    if daemon_running(settings):
        print(f"strata clean: the daemon of --disk-dir {state_dir(settings)} is running: stop it first "
              "(its arena is in use)", file=sys.stderr)
        return 1
    directory = Path(settings.tiers.ram.shm_dir).expanduser()
    prefix = arena_name(state_dir(settings))
    found = sorted(p for p in directory.glob(prefix + "*") if p.is_file() or p.is_socket())
    held = sum(p.stat().st_blocks * 512 for p in found)
    for path in found:
        if not args.dry_run:
            path.unlink(missing_ok=True)
        print(f"{'would remove' if args.dry_run else 'removed'} {path}")
    print(f"{len(found)} files, {held / (1 << 20):.1f} MiB of shared memory"
          + (" would be given back" if args.dry_run else " given back" if found else ": nothing to remove"))
    return 0


def run_weights(argv: list[str]) -> int:
    """``strata weights ...`` is ``python -m weightcache ...``, run in this process's place: the
    weight pipeline is its own package, which kvstore never imports."""
    command = [sys.executable, "-m", "weightcache", *argv]
    try:
        os.execv(sys.executable, command)
    except OSError as err:
        print(f"strata weights: cannot run {' '.join(command[:3])}: {err}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["weights"]:
        return run_weights(argv[1:])
    parser = build_parser()
    if not argv:  # a bare strata: what it can do, not an argparse error
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    if args.command in ("serve", "doctor", "route", "clean", "auth"):
        return args.func(args)
    from kvstore.errors import DaemonUnavailable, StrataError

    try:
        return args.func(args)
    except DaemonUnavailable as err:
        print(f"strata {args.command}: no strata daemon answers at {args.target} ({_reason(err)}): start one "
              "with `strata serve`, or point --target (or STRATA_TARGET) at a running one", file=sys.stderr)
        return 1
    except StrataError as err:
        print(f"strata {args.command}: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as ls and cat do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _reason(err: Exception) -> str:
    """gRPC's connection error, shortened to its cause."""
    text = str(err)
    for cause in ("Connection refused", "No such file or directory", "Name or service not known", "Deadline Exceeded",
                  "Permission denied", "Network is unreachable", "timed out"):
        if cause.lower() in text.lower():
            return cause.lower()
    return text if len(text) <= 120 else text[:117] + "..."


if __name__ == "__main__":
    sys.exit(main())
