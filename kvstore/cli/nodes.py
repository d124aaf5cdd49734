"""``strata peers``, ``strata replication`` and ``strata stats``: what a daemon reports of itself and its fleet."""

from __future__ import annotations

import argparse
import dataclasses
import json

from kvstore.cli.target import open_client


def _size(n: float) -> str:
    """Bytes for a person: 512 B, 1.5 KiB, 20.0 MiB, 3.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def add_peers_parser(sub, client_opts: argparse.ArgumentParser) -> None:
    """``strata peers``: the nodes the prefix index knows."""
    peers = sub.add_parser(
        "peers", parents=[client_opts], help="list the fleet's nodes: epochs, liveness, transports, bytes served",
        description="Every node the daemon's prefix index knows: node id, epoch, whether it heartbeats within "
        "its TTL, its advertised gRPC address, its data-plane transports (what peers fetch blocks over) and the "
        "block bytes its peer listeners served to other nodes this epoch, by transport (tcp, ucx, grpc), as its "
        "latest heartbeat reported them (every ttl/3).",
    )
    peers.add_argument("--json", action="store_true", help="print JSON")
    peers.set_defaults(func=cmd_peers)


def cmd_peers(args: argparse.Namespace) -> int:
    with open_client(args) as client:
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


def add_replication_parser(sub, client_opts: argparse.ArgumentParser) -> None:
    """``strata replication``: replicated namespaces and pins with replicas."""
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


def cmd_replication(args: argparse.Namespace) -> int:
    import time

    with open_client(args) as client:
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


def add_stats_parser(sub, client_opts: argparse.ArgumentParser) -> None:
    """``strata stats``: the daemon's tiers, blocks, leases, handoffs, replication."""
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


def cmd_stats(args: argparse.Namespace) -> int:
    with open_client(args) as client:
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
