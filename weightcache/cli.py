"""``strata weights``: publish model revisions and look at what is published and cached.

    strata weights publish LOCATION      chunk, hash and index a revision; store its manifest beside it
    strata weights ls LOCATION           the manifests published at a location (the latest first)
    strata weights ls --cache DIR        the models a node cache holds: verified chunks, bytes, in use
    strata weights fetch LOCATION [DIGEST] --cache DIR   fill a node cache (an init container's job)
    strata weights evict DIGEST --cache DIR              remove a cached model no process is using

The same program runs as ``strata-weights``, ``python -m weightcache`` and
``strata weights``: the ``strata`` command hands ``weights`` over by
running ``python -m weightcache`` (``kvstore`` never imports
``weightcache``). S3 credentials come the usual AWS way (``AWS_*``
environment variables, profile, instance role); ``--s3-endpoint`` points at
MinIO or another S3-compatible store.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from pydantic import ByteSize, TypeAdapter, ValidationError

from kvstore.errors import StrataError

_SIZE = TypeAdapter(ByteSize)


def _size(text: str) -> int:
    try:
        return int(_SIZE.validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (16MiB, 1GiB, 65536)") from None


def _s3(args: argparse.Namespace):
    from weightcache.origin import S3Options

    return S3Options(
        endpoint=args.s3_endpoint, region=args.s3_region, allow_http=args.s3_allow_http,
        virtual_hosted_style=args.s3_virtual_hosted,
    )


def cmd_publish(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from weightcache.origin import open_origin
    from weightcache.publish import publish

    async def run():
        origin = open_origin(args.location, revision=args.revision, s3=_s3(args))
        try:
            total = sum(size for _, size in await origin.list_files())
            with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="publish",
                      disable=args.no_progress, file=sys.stderr) as bar:
                return await publish(origin, model=args.model, chunk_bytes=args.chunk_size,
                                     concurrency=args.concurrency, progress=bar.update)
        finally:
            await origin.close()

    manifest = asyncio.run(run())
    if args.json:
        print(json.dumps(_summary(manifest, latest=True)))
    else:
        print(manifest.digest)
        print(f"  {manifest.model} @ {manifest.revision}: {len(manifest.files)} files, {manifest.total_bytes} bytes, "
              f"{manifest.total_chunks} chunks of {manifest.chunk_bytes}, "
              f"{sum(1 for _ in manifest.tensors())} tensors", file=sys.stderr)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    if args.cache:
        return _ls_cache(args)
    if not args.location:
        raise SystemExit("strata weights ls: give a LOCATION, or --cache DIR")
    from weightcache import catalog
    from weightcache.origin import open_origin

    async def run():
        origin = open_origin(args.location, revision=args.revision, s3=_s3(args))
        try:
            return await catalog.published(origin)
        finally:
            await origin.close()

    found = asyncio.run(run())
    for p in found:
        s = _summary(p.manifest, p.latest)
        if args.json:
            print(json.dumps(s))
        else:
            mark = "latest" if p.latest else "      "
            print(f"{s['digest']}  {mark}  {s['model']} @ {s['revision']}  {s['files']} files  {s['bytes']} bytes  "
                  f"{s['tensors']} tensors")
    if not found and not args.json:
        print(f"no manifests at {args.location}: run 'strata weights publish {args.location}'", file=sys.stderr)
    return 0


def _ls_cache(args: argparse.Namespace) -> int:
    from weightcache.cache import NodeCache

    cache = NodeCache(args.cache, 1 << 62)
    try:
        entries = cache.entries()
    finally:
        cache.close()
    for e in entries:
        if args.json:
            print(json.dumps(e.__dict__))
        else:
            print(f"{e.digest}  {e.model} @ {e.revision}  {e.verified_chunks}/{e.total_chunks} chunks  "
                  f"{e.allocated_bytes}/{e.total_bytes} bytes  {'in use' if e.in_use else 'idle'}")
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from weightcache.fetch import FetchLimits
    from weightcache.reader import open_model

    limits = FetchLimits(max_in_flight=args.concurrency, origin_concurrency=args.concurrency)
    with open_model(args.location, args.digest, cache_dir=args.cache, cache_bytes=args.cache_bytes,
                    revision=args.revision, files=args.files, names=args.names, include=args.include,
                    limits=limits, s3=_s3(args)) as model:
        stats = model.wait()
        print(json.dumps({
            "digest": model.digest, "planned": stats.planned, "cached": stats.cached,
            "fetched": dict(stats.fetched), "fetched_bytes": dict(stats.fetched_bytes),
            "requests": dict(stats.requests), "throttled": stats.throttled, "corrupt": stats.corrupt,
        }))
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    from weightcache.cache import NodeCache

    cache = NodeCache(args.cache, 1 << 62)
    try:
        if cache.evict(args.digest):
            return 0
        print(f"strata weights evict: {args.digest} is not cached in {args.cache}, or a process is using it",
              file=sys.stderr)
        return 3
    finally:
        cache.close()


def _summary(manifest, latest: bool) -> dict:
    return {
        "digest": manifest.digest, "latest": latest, "model": manifest.model, "revision": manifest.revision,
        "files": len(manifest.files), "bytes": manifest.total_bytes, "chunks": manifest.total_chunks,
        "chunk_bytes": manifest.chunk_bytes, "tensors": sum(1 for _ in manifest.tensors()),
    }


def build_parser() -> argparse.ArgumentParser:
    from weightcache.manifest import DEFAULT_CHUNK_BYTES

    parser = argparse.ArgumentParser(
        prog="strata weights", description="Publish model revisions; inspect what is published and cached.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1],
    )
    s3 = argparse.ArgumentParser(add_help=False)
    s3.add_argument("--s3-endpoint", metavar="URL", help="an S3-compatible endpoint (MinIO); default AWS")
    s3.add_argument("--s3-region", metavar="REGION")
    s3.add_argument("--s3-allow-http", action="store_true", help="allow a plain-HTTP endpoint")
    s3.add_argument("--s3-virtual-hosted", action="store_true", help="bucket.host URLs instead of host/bucket")
    s3.add_argument("--revision", help="a Hugging Face repo's branch or commit; elsewhere the revision's label")
    s3.add_argument("--json", action="store_true", help="print JSON")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pub = sub.add_parser("publish", parents=[s3], help="chunk, hash and index a revision; store its manifest",
                         description="Read every file of the revision once, hash it in chunks (BLAKE3), parse each "
                         "safetensors header, and store the manifest under .strata/ beside the files. Prints the "
                         "manifest's digest: what nodes open the model by.")
    pub.add_argument("location", help="a folder (plain, or a Hugging Face repo or snapshot) or s3://bucket/prefix")
    pub.add_argument("--chunk-size", type=_size, default=DEFAULT_CHUNK_BYTES,
                     help=f"bytes per chunk, a multiple of 64KiB [default {DEFAULT_CHUNK_BYTES >> 20}MiB]")
    pub.add_argument("--model", help="the model's name in the manifest [default: from the location]")
    pub.add_argument("--concurrency", type=int, default=8, help="chunks read at once [8]")
    pub.add_argument("--no-progress", action="store_true", help="no progress bar")
    pub.set_defaults(func=cmd_publish)

    ls = sub.add_parser("ls", parents=[s3], help="published manifests at a location, or a node cache's models")
    ls.add_argument("location", nargs="?")
    ls.add_argument("--cache", metavar="DIR", help="list this node cache instead")
    ls.set_defaults(func=cmd_ls)

    fetch = sub.add_parser("fetch", parents=[s3], help="fill a node cache with a model (or a subset)",
                           description="Fetch every chunk of the model (or of --files/--names) into the node cache, "
                           "verified, resuming what an earlier run left; prints what came from where as JSON.")
    fetch.add_argument("location")
    fetch.add_argument("digest", nargs="?", help="the manifest to fetch [default: the location's latest]")
    fetch.add_argument("--cache", required=True, metavar="DIR")
    fetch.add_argument("--cache-bytes", type=_size, help="the node cache's bound [default: its disk]")
    fetch.add_argument("--files", help="only the safetensors files matching this glob")
    fetch.add_argument("--names", help="only the tensors matching this glob")
    fetch.add_argument("--include", default="*.json", help="other files to fetch whole (a glob) [*.json]")
    fetch.add_argument("--concurrency", type=int, default=8, help="chunks in flight [8]")
    fetch.set_defaults(func=cmd_fetch)

    evict = sub.add_parser("evict", help="remove a cached model no process is using")
    evict.add_argument("digest")
    evict.add_argument("--cache", required=True, metavar="DIR")
    evict.set_defaults(func=cmd_evict)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except StrataError as err:
        print(f"strata weights {args.command}: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # a limit given on the command line (FetchLimits)
        print(f"strata weights {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
