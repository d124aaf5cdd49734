"""``strata object ls|du|gc``: the object tier's bucket, straight from S3 (no daemon needed).

    strata object ls [NS]    namespaces (or one namespace's blocks: key hex, bytes, last write)
    strata object du [NS]    objects and bytes per namespace, and the read markers and leases
    strata object gc [NS]    one lifecycle sweep now (TTL expiry, stale markers), under the sweep
                             lease: a namespace a daemon is sweeping is left to it

The bucket and prefix come from ``[tiers.object]`` of ``--config`` (or STRATA_CONFIG), then the
flags; credentials as the daemon finds them (AWS variables and files, then the role). du and gc
show a progress bar (tqdm, on stderr) over the objects listed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from kvstore.remote.object import credentials
from kvstore.remote.object.client import S3Client, S3Options
from kvstore.remote.object.layout import KeyLayout
from kvstore.remote.object.lease import LEASE_SEGMENT, SweepLease
from kvstore.remote.object.lifecycle import TOUCH_SEGMENT, LifecyclePolicy, Sweeper, parse_ttls
from kvstore.remote.object.metrics import ObjectMetrics

DEADLINE_S = 3600.0  # one command's S3 work


def add_parser(sub) -> None:
    obj = sub.add_parser("object", help="the object tier's bucket: ls, du, gc (straight from S3)",
                         description=__doc__.split("\n\n", 2)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", metavar="FILE", help="TOML config whose [tiers.object] names the bucket")
    for flag, what in (("bucket", "S3 bucket"), ("prefix", "key prefix"), ("endpoint", "S3 endpoint"),
                       ("region", "region"), ("profile", "AWS profile")):
        common.add_argument(f"--{flag}", help=f"{what} (default: [tiers.object] {flag})")
    common.add_argument("--json", action="store_true", help="print JSON")
    common.add_argument("namespace", nargs="?", default="", help="one namespace (default: every one)")
    verbs = obj.add_subparsers(dest="verb", required=True, metavar="VERB")
    verbs.add_parser("ls", parents=[common], help="list namespaces, or one namespace's blocks").set_defaults(func=cmd_ls)
    verbs.add_parser("du", parents=[common], help="objects and bytes per namespace").set_defaults(func=cmd_du)
    gc = verbs.add_parser("gc", parents=[common], help="run one lifecycle sweep now")
    gc.add_argument("--ttl-seconds", type=float, default=None, help="TTL (default: [tiers.object] ttl_seconds)")
    gc.add_argument("--holder", default=f"cli-{os.uname().nodename}-{os.getpid()}", help="sweep lease holder name")
    gc.set_defaults(func=cmd_gc)


def _open(args) -> tuple[S3Client, KeyLayout, dict]:
    from kvstore.config import load_settings

    config = args.config or os.environ.get("STRATA_CONFIG")
    o = load_settings(config).tiers.object if config else None
    pick = lambda name, default="": getattr(args, name) or (getattr(o, name) if o else default)  # noqa: E731
    found = credentials.resolve(os.environ, region=pick("region"), profile=pick("profile"))
    options = S3Options(bucket=pick("bucket"), endpoint=pick("endpoint") or os.environ.get("AWS_ENDPOINT_URL", ""),
                        region=found.region, credentials=found.credentials)
    policy = {"ttl_s": o.ttl_seconds if o else 0.0, "namespace_ttl_s": parse_ttls(o.namespace_ttl) if o else {}}
    return S3Client(options, ObjectMetrics()), KeyLayout(pick("prefix", "strata")), policy


def _bar(what: str):
    from tqdm import tqdm

    return tqdm(desc=what, unit=" objects", file=sys.stderr, disable=None)  # None: no bar off a terminal


async def _usage(client: S3Client, layout: KeyLayout, namespaces: list[str], deadline: float) -> list[dict]:
    rows = []
    with _bar("listing") as bar:
        for ns in namespaces:
            row = {"namespace": ns, "objects": 0, "bytes": 0}
            async for page in client.list(layout.namespace_root(ns), deadline):
                for m in page:
                    if layout.parse(m["path"]) is not None:
                        row["objects"] += 1
                        row["bytes"] += m["size"]
                bar.update(len(page))
            rows.append(row)
    return rows


def cmd_ls(args) -> int:
    client, layout, _ = _open(args)

    async def run():
        deadline = time.monotonic() + DEADLINE_S
        sweeper = Sweeper(client, layout, LifecyclePolicy(), SweepLease(client, layout, "ls"))
        if not args.namespace:
            return await sweeper.namespaces(deadline)
        out = []
        async for page in client.list(layout.namespace_root(args.namespace), deadline):
            for m in page:
                parsed = layout.parse(m["path"])
                if parsed is not None:
                    key = parsed[1].hex() if parsed[1] is not None else m["path"].rsplit("/", 1)[-1]
                    out.append({"key": key, "bytes": m["size"], "written": m["last_modified"].isoformat()})
        return out

    rows = asyncio.run(run())
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(r if isinstance(r, str) else f"{r['key']}\t{r['bytes']}\t{r['written']}")
    return 0


def cmd_du(args) -> int:
    client, layout, _ = _open(args)

    async def run():
        deadline = time.monotonic() + DEADLINE_S
        sweeper = Sweeper(client, layout, LifecyclePolicy(), SweepLease(client, layout, "du"))
        names = [args.namespace] if args.namespace else await sweeper.namespaces(deadline)
        rows = await _usage(client, layout, names, deadline)
        control = {"markers": 0, "leases": 0}
        for segment, field in ((TOUCH_SEGMENT, "markers"), (LEASE_SEGMENT, "leases")):
            async for page in client.list(f"{layout.root}{segment}/", deadline):
                control[field] += len(page)
        return rows, control

    rows, control = asyncio.run(run())
    if args.json:
        print(json.dumps({"namespaces": rows, **control}))
        return 0
    for r in rows:
        print(f"{r['namespace']}\t{r['objects']} objects\t{r['bytes']} bytes")
    print(f"total\t{sum(r['objects'] for r in rows)} objects\t{sum(r['bytes'] for r in rows)} bytes\t"
          f"({control['markers']} read markers, {control['leases']} sweep leases)")
    return 0


def cmd_gc(args) -> int:
    client, layout, policy = _open(args)
    if args.ttl_seconds is not None:
        policy["ttl_s"] = args.ttl_seconds

    async def run():
        deadline = time.monotonic() + DEADLINE_S
        sweeper = Sweeper(client, layout, LifecyclePolicy(**policy), SweepLease(client, layout, args.holder))
        with _bar("sweeping") as bar:
            if args.namespace:
                return [await sweeper.sweep(args.namespace, deadline, bar.update)]
            return await sweeper.sweep_all(deadline, bar.update)

    reports = asyncio.run(run())
    rows = [{"namespace": r.namespace, "swept": r.swept, "expired": r.expired, "expired_bytes": r.expired_bytes,
             "markers_deleted": r.markers, "kept": r.kept, "kept_bytes": r.kept_bytes} for r in reports]
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        if not r["swept"]:
            print(f"{r['namespace']}\tleft to the daemon holding its sweep lease")
        else:
            print(f"{r['namespace']}\t{r['expired']} expired ({r['expired_bytes']} bytes)\t"
                  f"{r['markers_deleted']} stale markers\t{r['kept']} kept ({r['kept_bytes']} bytes)")
    return 0
