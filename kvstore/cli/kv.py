"""``strata kv put|get|stat|list|delete``: read and write blocks (operators, debugging)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvstore.cli.target import open_client, parse_key, show_key


def add_parser(sub, client_opts: argparse.ArgumentParser, key_opts: argparse.ArgumentParser) -> None:
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
    place = kv_sub.add_parser("place", parents=[client_opts, key_opts], help="move blocks into host RAM or out of it",
                              description="Warm blocks into the daemon's host-RAM tier from disk, a peer or S3 "
                                          "(--to ram), or move them out of RAM into the tier below it (--to below; "
                                          "pinned blocks stay): what an engine's Prefetch and Demote hints do. "
                                          "Exit 3 when any key is not held.")
    place.add_argument("namespace")
    place.add_argument("keys", nargs="+", metavar="KEY")
    place.add_argument("--to", choices=("ram", "below"), required=True, help="where the blocks go")
    place.set_defaults(func=cmd_kv_place)


def cmd_kv_put(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvstore.client.codec import BlockPut

    if args.from_dir:
        files = sorted(p for p in Path(args.from_dir).iterdir() if p.is_file())
        with open_client(args) as client:
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
    parent = parse_key(args, args.parent) if args.parent else None
    key = parse_key(args, args.key)
    with open_client(args) as client:
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
    with open_client(args) as client:
        data = client.get(args.namespace, parse_key(args, args.key))
    if data is None:
        print(f"strata kv get: no block {args.key!r} in namespace {args.namespace!r}", file=sys.stderr)
        return 3
    if args.output in (None, "-"):
        sys.stdout.buffer.write(data)
    else:
        Path(args.output).write_bytes(data)
    return 0


def cmd_kv_stat(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        rows = []
        for text in args.keys:
            found = client.exists(args.namespace, [parse_key(args, text)])
            rows.append({"key": text, "present": bool(found), "tier": found[0].label if found else None})
    if args.json:
        print(json.dumps(rows))
    else:
        for row in rows:
            print(f"{row['key']}\t{row['tier'] or 'absent'}")
    return 0 if all(r["present"] for r in rows) else 3


def cmd_kv_list(args: argparse.Namespace) -> int:
    prefix = parse_key(args, args.prefix) if args.prefix else b""
    shown = 0
    with open_client(args) as client:
        for block in client.iter_blocks(args.namespace, prefix, page_size=min(args.limit or 1000, 1000)):
            if args.limit and shown == args.limit:
                break
            key = show_key(args, block.key)
            if args.json:
                print(json.dumps({"key": key, "size": block.size, "tier": block.tier.label, "layout": block.layout}))
            else:
                print(f"{key}\t{block.size}\t{block.tier.label}")
            shown += 1
    return 0


def cmd_kv_delete(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        n = client.delete(args.namespace, [parse_key(args, k) for k in args.keys])
    print(f"deleted {n} of {len(args.keys)} blocks")
    return 0


def cmd_kv_place(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        placed = client.place(args.namespace, [parse_key(args, k) for k in args.keys], args.to)
    where = "in host RAM" if args.to == "ram" else "below host RAM"
    print(f"{placed.placed} of {len(args.keys)} blocks {where}"
          + (f"; {placed.pinned} pinned, kept in RAM" if placed.pinned else "")
          + (f"; {len(placed.missing)} not held: {', '.join(show_key(args, k) for k in placed.missing[:5])}"
             if placed.missing else ""))
    return 3 if placed.missing else 0

