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
import os
import sys

from kvstore.cli import clean, index, kv, nodes, serve
from kvstore.cli.target import client_options, key_options


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser, each built next to its handler, in the order ``--help`` lists them."""
    parser = argparse.ArgumentParser(
        prog="strata",
        description="Strata: a tiered KV-block cache daemon for LLM inference fleets.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 1)[1],
    )
    parser.add_argument("--version", action="version", version=f"strata {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    client_opts, key_opts = client_options(), key_options()
    serve.add_parser(sub)
    kv.add_parser(sub, client_opts, key_opts)
    index.add_parser(sub, client_opts, key_opts)
    nodes.add_peers_parser(sub, client_opts)
    nodes.add_replication_parser(sub, client_opts)
    nodes.add_stats_parser(sub, client_opts)
    sub.add_parser("weights", add_help=False,
                   help="model weights: publish, ls, fetch, evict, serve, prefetch, wait (strata weights --help)")
    clean.add_parser(sub)
    from kvstore.cli import auth, doctor, objects, route  # heavier (S3, the router): not loaded for `strata weights`

    doctor.add_parser(sub)
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
