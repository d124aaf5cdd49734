"""``strata weights``: publish model revisions and look at what is published and cached.

    strata weights publish LOCATION      chunk, hash and index a revision; store its manifest beside it
    strata weights ls LOCATION           the manifests published at a location (the latest first)
    strata weights ls --cache DIR        the models a node cache holds: verified chunks, bytes, in use
    strata weights fetch LOCATION [DIGEST] --cache DIR   fill a node cache (an init container's job)
    strata weights evict DIGEST --cache DIR              remove a cached model no process is using
    strata weights serve --cache DIR --listen ADDR [--peer ADDR ...]  a weight node: prefetch, status,
                                         and chunks for peers (a swarm shares the origin)
    strata weights prefetch LOCATION [DIGEST] --node ADDR   ask a weight node to fetch a model
    strata weights wait DIGEST --node ADDR --deadline 10m   until it is warm (an init container's job)

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
import logging
import os
import sys
from typing import NoReturn

from pydantic import ByteSize, TypeAdapter, ValidationError

from kvstore.errors import InvalidArgument, StrataError

_SIZE = TypeAdapter(ByteSize)


def _size(text: str) -> int:
    try:
        return int(_SIZE.validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (16MiB, 1GiB, 65536)") from None


def _origin_options() -> argparse.ArgumentParser:
    """The S3 origin's flags, ``--revision`` and ``--json``, for the commands that read a location: a parent parser."""
    s3 = argparse.ArgumentParser(add_help=False)
    s3.add_argument("--s3-endpoint", metavar="URL", help="an S3-compatible endpoint (MinIO); default AWS")
    s3.add_argument("--s3-region", metavar="REGION")
    s3.add_argument("--s3-allow-http", action="store_true", help="allow a plain-HTTP endpoint")
    s3.add_argument("--s3-virtual-hosted", action="store_true", help="bucket.host URLs instead of host/bucket")
    s3.add_argument("--revision", help="a Hugging Face repo's branch or commit; elsewhere the revision's label")
    s3.add_argument("--json", action="store_true", help="print JSON")
    return s3


def _s3(args: argparse.Namespace):
    from weightcache.origin import S3OriginOptions

    return S3OriginOptions(
        endpoint=args.s3_endpoint, region=args.s3_region, allow_http=args.s3_allow_http,
        virtual_hosted_style=args.s3_virtual_hosted,
    )


def _add_publish_parser(sub, s3: argparse.ArgumentParser) -> None:
    """``publish LOCATION``."""
    from weightcache.manifest import DEFAULT_CHUNK_BYTES

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


def _add_ls_parser(sub, s3: argparse.ArgumentParser) -> None:
    """``ls LOCATION`` or ``ls --cache DIR``."""
    ls = sub.add_parser("ls", parents=[s3], help="published manifests at a location, or a node cache's models")
    ls.add_argument("location", nargs="?")
    ls.add_argument("--cache", metavar="DIR", help="list this node cache instead")
    ls.add_argument("--ram-dir", metavar="DIR", help="list this host-RAM copy (with --cache: each model's bytes in it)")
    ls.set_defaults(func=cmd_ls)


def cmd_ls(args: argparse.Namespace) -> int:
    if args.cache or args.ram_dir:
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
    """The node cache's models (with --ram-dir too: each one's bytes in the RAM copy), or the RAM copy's."""
    from weightcache.cache import NodeCache

    ram = _ram_entries(args.ram_dir) if args.ram_dir else None
    if not args.cache:
        for e in ram.values():
            if args.json:
                print(json.dumps(e.__dict__))
            else:
                print(f"{e.digest}  {e.files} files  {e.bytes} bytes in RAM  {'in use' if e.in_use else 'idle'}")
        return 0
    cache = NodeCache(args.cache, 1 << 62)
    try:
        entries = cache.entries()
    finally:
        cache.close()
    for e in entries:
        in_ram = ram[e.digest].bytes if ram is not None and e.digest in ram else 0
        if args.json:
            print(json.dumps({**e.__dict__, **({"ram_bytes": in_ram} if ram is not None else {})}))
        else:
            print(f"{e.digest}  {e.model} @ {e.revision}  {e.verified_chunks}/{e.total_chunks} chunks  "
                  f"{e.allocated_bytes}/{e.total_bytes} bytes  {'in use' if e.in_use else 'idle'}"
                  + (f"  {in_ram} bytes in RAM" if ram is not None else ""))
    return 0


def _ram_entries(ram_dir: str) -> dict:
    from weightcache.ram_copy import RamCopy

    copy = RamCopy(ram_dir)
    try:
        return {e.digest: e for e in copy.entries() if e.bytes}
    finally:
        copy.close()


def _add_fetch_parser(sub, s3: argparse.ArgumentParser) -> None:
    """``fetch LOCATION [DIGEST] --cache DIR``."""
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
    fetch.add_argument("--ram-dir", metavar="DIR", help="the node's host-RAM copy: files there are not fetched")
    fetch.set_defaults(func=cmd_fetch)


def cmd_fetch(args: argparse.Namespace) -> int:
    from weightcache.fetch import FetchLimits
    from weightcache.reader import open_model

    limits = FetchLimits(max_in_flight=args.concurrency, origin_concurrency=args.concurrency)
    with open_model(args.location, args.digest, cache_dir=args.cache, cache_bytes=args.cache_bytes,
                    revision=args.revision, files=args.files, names=args.names, include=args.include,
                    limits=limits, s3=_s3(args), ram_dir=args.ram_dir) as model:
        stats = model.wait()
        print(json.dumps({
            "digest": model.digest, "planned": stats.planned, "cached": stats.cached,
            "fetched": dict(stats.fetched), "fetched_bytes": dict(stats.fetched_bytes),
            "requests": dict(stats.requests), "throttled": stats.throttled, "corrupt": stats.corrupt,
        }))
    return 0


def _add_evict_parser(sub) -> None:
    """``evict DIGEST --cache DIR``."""
    evict = sub.add_parser("evict", help="remove a cached model no process is using")
    evict.add_argument("digest")
    evict.add_argument("--cache", required=True, metavar="DIR")
    evict.add_argument("--ram-dir", metavar="DIR", help="remove the model's host-RAM copy too")
    evict.set_defaults(func=cmd_evict)


def cmd_evict(args: argparse.Namespace) -> int:
    from weightcache.cache import NodeCache

    cache = NodeCache(args.cache, 1 << 62)
    try:
        if args.ram_dir:  # the RAM copy first: it is the one engines map
            from weightcache.ram_copy import RamCopy

            copy = RamCopy(args.ram_dir, writable=True)
            try:
                if not copy.evict(args.digest) and any(e.digest == args.digest and e.bytes for e in copy.entries()):
                    print(f"strata weights evict: {args.digest} is open in the RAM copy {args.ram_dir}", file=sys.stderr)
                    return 3
            finally:
                copy.close()
        if cache.evict(args.digest):
            return 0
        print(f"strata weights evict: {args.digest} is not cached in {args.cache}, or a process is using it",
              file=sys.stderr)
        return 3
    finally:
        cache.close()


def _add_serve_parser(sub, s3: argparse.ArgumentParser, creds: argparse.ArgumentParser) -> None:
    """``serve --cache DIR``: a weight node."""
    srv = sub.add_parser("serve", parents=[s3, creds], help="a weight node: prefetch into a node cache, serve peers",
                         description="Serve WeightService: Prefetch and Status for init containers, ReadChunk for "
                         "peers. With --peer, the listed nodes (the same list on each) form a swarm: each chunk "
                         "is fetched from the origin by one of them and read from it by the rest.")
    srv.add_argument("--cache", required=True, metavar="DIR")
    srv.add_argument("--cache-bytes", type=_size, help="the node cache's bound [default: its disk]")
    srv.add_argument("--listen", default="127.0.0.1:7460", metavar="HOST:PORT", help="[127.0.0.1:7460]")
    srv.add_argument("--advertise", metavar="HOST:PORT", help="this node's address in --peer lists [--listen]")
    srv.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                     help="a swarm member (repeat; may include this node)")
    srv.add_argument("--index-url", dest="index", metavar="URL",
                     help="find the swarm in the prefix index (redis://HOST:PORT, redis+cluster://..., memory://): "
                     "members, chunk holders and liveness, instead of --peer")
    srv.add_argument("--node-id", help="this node's id in the index [--advertise]")
    srv.add_argument("--index-ttl", type=_seconds, default=10.0,
                     help="how long the index counts this node alive without a heartbeat [10s]")
    srv.add_argument("--peer-wait", type=_seconds, default=120.0,
                     help="how long to wait for a chunk's owner to have it before the origin [120s]")
    srv.add_argument("--peer-join-wait", type=_seconds, default=5.0,
                     help="how long a peer asked for a model it was not told to prefetch waits for that [5s]")
    srv.add_argument("--peer-read-timeout", type=_seconds, default=10.0,
                     help="how long one chunk read from a peer may take beyond its wait before the chunk is read "
                     "elsewhere and the peer passed over for a while (a hung node) [10s]")
    srv.add_argument("--max-uploads", type=int, default=8, help="chunks served to peers at once [8]")
    srv.add_argument("--max-waiting-reads", type=int, default=32,
                     help="peer chunk reads that may wait at once for chunks this node is still fetching; more are "
                     "refused as overloaded, so Status and Prefetch always find a worker [32]")
    srv.add_argument("--concurrency", type=int, default=8, help="chunks in flight per prefetch [8]")
    srv.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    srv.add_argument("--ram-dir", metavar="DIR",
                     help="keep one host-RAM copy of each complete model here (a tmpfs, e.g. /dev/shm/strata-weights) "
                     "for every engine on the node to map")
    srv.add_argument("--ram-bytes", type=_size, help="the RAM copy's bound (with --ram-dir)")
    srv.add_argument("--auth-file", metavar="TOML", help="the daemon's auth policy: tokens and certificate subjects "
                     "allowed on namespace 'weights' (read: Status, ReadChunk; write: Prefetch)")
    srv.add_argument("--insecure", action="store_true",
                     help="serve a non-loopback --listen without authentication (protected mode off: anyone who "
                     "reaches the port may read chunks and start prefetches; logs a warning)")
    srv.add_argument("--auth-reload-seconds", type=float, default=2.0, help="how often to look for a changed policy [2]")
    srv.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate (and --tls-key)")
    srv.add_argument("--tls-key", metavar="PEM")
    srv.add_argument("--tls-client-ca", metavar="PEM", help="require client certificates this CA signed (mTLS); "
                     "the node presents --tls-cert to its peers")
    srv.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from weightcache.fetch import FetchLimits
    from weightcache.metrics import WeightMetrics
    from weightcache.peers import Swarm
    from weightcache.prefetch import Prefetcher
    from weightcache.service import serve

    from kvstore.auth import Authority
    from weightcache.access import check_exposure, server_credentials

    metrics = WeightMetrics()
    me = args.advertise or args.listen
    authority = Authority(args.auth_file or "", mtls=bool(args.tls_client_ca), reload_s=args.auth_reload_seconds)
    try:
        check_exposure(args.listen, authority, args.insecure)  # before anything joins a swarm or binds
    except InvalidArgument as err:
        raise SystemExit(f"strata weights serve: {err}") from None
    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
    # What this node presents to its peers: its token, and its own certificate for their mTLS.
    security = _security(args, client_cert=(args.tls_cert, args.tls_key) if args.tls_client_ca else None)
    if args.peer and args.index:
        raise SystemExit("strata weights serve: give --peer (a fixed swarm) or --index-url (members from the index), not both")
    swarm = (Swarm([me, *[p for p in args.peer if p != me]], me, wait_s=args.peer_wait,
                   read_timeout_s=args.peer_read_timeout, security=security) if args.peer else None)
    if args.index:
        from kvstore.index import open_index
        from weightcache.index_swarm import IndexSwarm

        swarm = IndexSwarm(open_index(args.index), args.node_id or me, me, ttl_s=args.index_ttl,
                           wait_s=args.peer_wait, read_timeout_s=args.peer_read_timeout, security=security)
    limits = FetchLimits(max_in_flight=args.concurrency, origin_concurrency=args.concurrency)
    ram = None
    if args.ram_dir:
        from weightcache.ram_copy import RamCopy

        if not args.ram_bytes:
            raise SystemExit("strata weights serve: --ram-dir needs --ram-bytes (the RAM copy's bound, e.g. 64GiB)")
        ram = RamCopy(args.ram_dir, args.ram_bytes)
        ram.drop_stale_copies()
    prefetcher = Prefetcher(args.cache, cache_bytes=args.cache_bytes, limits=limits, s3=_s3(args), swarm=swarm,
                            metrics=metrics, max_uploads=args.max_uploads, max_waiting=args.max_waiting_reads,
                            join_wait_s=args.peer_join_wait, ram=ram)
    if args.index:
        swarm.attach(prefetcher.verified)
    server, port = serve(prefetcher, args.listen, authority=authority, credentials=credentials,
                         insecure=True)  # protected mode was checked (and logged) above
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, registry=metrics.registry)
    print(f"weight node listening on port {port}", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: authority.reload())
    stop.wait()
    server.stop(5).wait()
    prefetcher.close()
    if args.index:
        swarm.close()  # leaves the index: its peers stop asking it at once
    return 0


def _credential_options() -> argparse.ArgumentParser:
    """The token and TLS presented to weight nodes: a parent parser (defaults from ``STRATA_*`` now)."""
    creds = argparse.ArgumentParser(add_help=False)
    creds.add_argument("--token-file", default=os.environ.get("STRATA_TOKEN_FILE"), metavar="FILE",
                       help="bearer token to present to weight nodes, first line of FILE "
                       "[env STRATA_TOKEN_FILE; or the token itself in STRATA_TOKEN]")
    creds.add_argument("--tls-ca", default=os.environ.get("STRATA_TLS_CA"), metavar="PEM",
                       help="verify weight nodes' TLS certificates with this CA [env STRATA_TLS_CA]")
    creds.add_argument("--tls-server-name", default=os.environ.get("STRATA_TLS_SERVER_NAME"), metavar="NAME",
                       help="name to verify in a weight node's certificate")
    return creds


def _node_options(creds: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The weight node a command asks (with the credentials and a client certificate), and its progress: a parent parser."""
    node = argparse.ArgumentParser(add_help=False, parents=[creds])
    node.add_argument("--tls-cert", default=os.environ.get("STRATA_TLS_CERT"), metavar="PEM",
                      help="client certificate, for a weight node with --tls-client-ca [env STRATA_TLS_CERT]")
    node.add_argument("--tls-key", default=os.environ.get("STRATA_TLS_KEY"), metavar="PEM",
                      help="private key of --tls-cert [env STRATA_TLS_KEY]")
    node.add_argument("--node", default="127.0.0.1:7460", metavar="HOST:PORT", help="the weight node [127.0.0.1:7460]")
    node.add_argument("--no-progress", action="store_true", help="no progress bar")
    node.add_argument("--interval", type=_seconds, default=1.0, help="how often to ask for progress [1s]")
    return node


def _security(args: argparse.Namespace, client_cert: tuple[str, str] | None = None):
    """The token and TLS this command presents to weight nodes (kvstore's client credentials)."""
    from kvstore.auth.credentials import ChannelSecurity

    token = os.environ.get("STRATA_TOKEN") if not args.token_file else None
    cert, key = client_cert if client_cert else (getattr(args, "tls_cert", None), getattr(args, "tls_key", None))
    return ChannelSecurity.build(token=token or None, token_file=args.token_file, tls_ca=args.tls_ca,
                                 tls_cert=cert, tls_key=key, tls_server_name=args.tls_server_name)


def _stub(args: argparse.Namespace):
    from weightcache.api.v1 import weights_pb2_grpc as pb_grpc
    from weightcache.peers import CHANNEL_OPTIONS

    return pb_grpc.WeightServiceStub(_security(args).channel(args.node, options=CHANNEL_OPTIONS))


def _call(method, request, timeout: float):
    import grpc

    from kvstore.rpc.status import from_rpc_error

    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as err:
        raise from_rpc_error(err) from None


def _add_prefetch_parser(sub, s3: argparse.ArgumentParser, node: argparse.ArgumentParser) -> None:
    """``prefetch LOCATION [DIGEST] --node ADDR``."""
    pre = sub.add_parser("prefetch", parents=[s3, node], help="ask a weight node to fetch a model",
                         description="Start a prefetch on the node (nothing new if it runs or is done); prints the "
                         "manifest digest. With --wait, waits as 'strata weights wait' does.")
    pre.add_argument("location")
    pre.add_argument("digest", nargs="?", help="the manifest [default: the location's latest]")
    pre.add_argument("--timeout", type=_seconds, default=120.0, help="for resolving the manifest [120s]")
    pre.add_argument("--wait", type=_seconds, metavar="DEADLINE", help="then wait until warm, up to this long")
    pre.set_defaults(func=cmd_prefetch)


def cmd_prefetch(args: argparse.Namespace) -> int:
    from weightcache.api.v1 import weights_pb2 as pb

    reply = _call(_stub(args).Prefetch, pb.PrefetchRequest(
        location=args.location, digest=args.digest or "", revision=args.revision or ""), timeout=args.timeout)
    print(reply.digest)
    if args.wait is not None:
        args.digest, args.deadline = reply.digest, args.wait
        return cmd_wait(args)
    return 0


def _add_wait_parser(sub, node: argparse.ArgumentParser) -> None:
    """``wait DIGEST --node ADDR --deadline D``."""
    wait = sub.add_parser("wait", parents=[node], help="wait until a model is warm on a weight node",
                          description="Exit 0 once every chunk is verified in the node's cache; 1 if its prefetch "
                          "failed; 4 at the deadline, saying how far it got.")
    wait.add_argument("digest")
    wait.add_argument("--deadline", type=_seconds, required=True, help="give up after this long (90, 30s, 10m)")
    wait.add_argument("--json", action="store_true", help="print where the bytes came from, as JSON")
    wait.set_defaults(func=cmd_wait)


def cmd_wait(args: argparse.Namespace) -> int:
    """Poll Status until the model is complete (0), failed (1) or the deadline passes (4)."""
    import time

    from tqdm import tqdm

    from weightcache.api.v1 import weights_pb2 as pb

    stub = _stub(args)
    end = time.monotonic() + args.deadline
    bar = None
    try:
        while True:
            try:
                s = _call(stub.Status, pb.StatusRequest(digest=args.digest), timeout=min(30.0, max(1.0, args.deadline)))
            except InvalidArgument as err:  # the node rejects the request itself: asking again will not help
                print(f"strata weights wait: {err}", file=sys.stderr)
                return 2
            except StrataError as err:
                s, last = None, err  # the node not up yet (an init container may start first): keep asking
            if s is not None:
                if bar is None and s.total_bytes:
                    bar = tqdm(total=s.total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                               desc=s.model or args.digest[:12], disable=args.no_progress, file=sys.stderr)
                if bar is not None:
                    bar.update(s.verified_bytes - bar.n)
                if s.state == pb.PREFETCH_STATE_COMPLETE:
                    if args.json:
                        print(json.dumps({"digest": args.digest, "bytes": s.total_bytes,
                                          "bytes_by_source": dict(s.bytes_by_source), "ram_bytes": s.ram_bytes}))
                    return 0
                if s.state == pb.PREFETCH_STATE_FAILED:
                    print(f"strata weights wait: the prefetch of {args.digest} failed: {s.error}", file=sys.stderr)
                    return 1
                last = None
            if time.monotonic() >= end:
                where = (f"{s.verified_chunks} of {s.total_chunks} chunks verified" if s is not None and s.total_chunks
                         else f"the node answered: {last}" if s is None else "the node has not been asked for it")
                print(f"strata weights wait: {args.digest} is not warm on {args.node} after {args.deadline:g}s "
                      f"({where}); start it with 'strata weights prefetch', or give a longer --deadline",
                      file=sys.stderr)
                return 4
            time.sleep(min(args.interval, max(0.0, end - time.monotonic())))
    finally:
        if bar is not None:
            bar.close()


def _seconds(text: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return float(text[: -len(unit)]) * units[unit]
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (90, 30s, 10m, 1h)") from None


def _summary(manifest, latest: bool) -> dict:
    return {
        "digest": manifest.digest, "latest": latest, "model": manifest.model, "revision": manifest.revision,
        "files": len(manifest.files), "bytes": manifest.total_bytes, "chunks": manifest.total_chunks,
        "chunk_bytes": manifest.chunk_bytes, "tensors": sum(1 for _ in manifest.tensors()),
    }


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser, each built next to its handler, in the order ``--help`` lists them."""
    parser = argparse.ArgumentParser(
        prog="strata weights", description="Publish model revisions; inspect what is published and cached.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1],
    )
    s3 = _origin_options()
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_publish_parser(sub, s3)
    _add_ls_parser(sub, s3)
    _add_fetch_parser(sub, s3)
    _add_evict_parser(sub)
    creds = _credential_options()
    _add_serve_parser(sub, s3, creds)
    node = _node_options(creds)
    _add_prefetch_parser(sub, s3, node)
    _add_wait_parser(sub, node)
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


def run() -> NoReturn:
    """The ``strata weights`` process: :func:`main`, then an exit that leaves the interpreter standing.

    obstore (the S3 origin) runs its requests on a Tokio runtime of its own
    whose threads nothing can stop. One of them hands each result to the
    event loop (``call_soon_threadsafe``) and then still writes the loop's
    wake-up socket; the loop may have run the callback already, so the
    command can finish and the interpreter start its teardown while that
    write is in flight. When the thread takes the GIL back, CPython ends it
    with ``pthread_exit``, which cannot unwind through the Rust frames
    below, and the process aborts (SIGABRT) after printing its whole
    answer. Every command closes what it opened itself (origins, caches,
    channels, the node's server), so nothing is lost by ending the process
    at once instead: the output is flushed and ``os._exit`` ends it with
    the command's status. An exception that escapes :func:`main` (a bug)
    still ends the ordinary way, traceback and all.
    """
    try:
        code = main()
    except SystemExit as stop:  # argparse's usage errors, and commands that stop with a message
        code = stop.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    exit_now(code or 0)


def exit_now(code: int) -> NoReturn:
    """Flush what the command wrote (logs, stdout, stderr) and end the process with ``code``."""
    logging.shutdown()
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (| head): what it wanted, it had
        pass
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
