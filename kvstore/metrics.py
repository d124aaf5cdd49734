"""Prometheus metrics of one daemon.

Every metric lives in the registry passed in (tests build their own, the
daemon serves its registry on ``/metrics``). Names carry units; labels are
bounded: tier, op, outcome, code — never a key, namespace or request id.
Tier occupancy is read from the tiers at scrape time (a collector), so it
can never drift from what the tiers hold.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.events import Delivery, Evicted, Moved, Removed, Stored, Subscription
from kvstore.tiers.base import TierStats

_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.hits = Counter("strata_kv_hits_total", "Block reads answered, by the tier that held the block", ["tier"], registry=r)
        self.misses = Counter("strata_kv_misses_total", "Block reads of keys held by no tier", registry=r)
        self.evictions = Counter(
            "strata_kv_evictions_total", "Blocks removed from a tier to make room (demoted or dropped)", ["tier"], registry=r
        )
        self.drops = Counter("strata_kv_dropped_total", "Blocks that left the store entirely to make room", registry=r)
        self.demotions = Counter("strata_kv_demotions_total", "Blocks moved down the chain to a lower tier (RAM to disk, GPU to RAM)", ["outcome"], registry=r)
        self.promotions = Counter("strata_kv_promotions_total", "Blocks copied up into the head tier on read, from a tier below it", registry=r)
        self.bytes_in = Counter("strata_kv_bytes_in_total", "Payload bytes written into a tier", ["tier"], registry=r)
        self.bytes_out = Counter("strata_kv_bytes_out_total", "Payload bytes read out of a tier", ["tier"], registry=r)
        self.corrupt = Counter(
            "strata_kv_corrupt_blocks_total", "Blocks that failed their checksum and were dropped", ["tier"], registry=r
        )
        self.tier_errors = Counter(
            "strata_kv_tier_errors_total", "I/O failures of a tier's device (disk full, I/O error)", ["tier"], registry=r
        )
        self.leases_expired = Counter("strata_kv_leases_expired_total", "Leases reclaimed at their deadline", ["kind"], registry=r)
        self.lapsed_slot_bytes = Gauge(
            "strata_kv_lapsed_slot_bytes", "Bytes of arena slots whose lease ran out unwritten, kept from other "
            "blocks for --lapsed-slot-hold-seconds (a writer may still be copying into them)", registry=r,
        )
        self.op_latency = Histogram(
            "strata_kv_op_duration_seconds", "Duration of store and RPC operations", ["op"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.in_flight = Gauge("strata_rpc_in_flight_requests", "RPCs being served now", registry=r)
        self.rejected = Counter(
            "strata_rpc_rejected_total", "RPCs refused before any work (overload, deadline too short)", ["reason"], registry=r
        )
        self.rpc_errors = Counter("strata_rpc_errors_total", "RPCs that ended with an error status", ["op", "code"], registry=r)
        self.idle_streams = Counter(
            "strata_rpc_idle_streams_ended_total",
            "Streams ended because their client sent or read nothing for --stream-idle-seconds", ["op"], registry=r,
        )
        self.store_events = Counter(
            "strata_store_events_total",
            "Store events, by kind (stored, moved, evicted, removed, changed) and the tier each is about "
            "(moved: the tier that gained a copy; removed: none)",
            ["kind", "tier"],
            registry=r,
        )

    def count_events(self, batch: Sequence[Delivery]) -> None:
        """A store-event subscriber (:class:`~kvstore.events.EventBus`): counts each event
        by kind and tier. A Resync carries no count; the bus's own counters say what was lost."""
        tally: Tally[tuple[str, str]] = Tally()
        for event in batch:
            if isinstance(event, (Stored, Evicted)):
                tally[event.kind, event.tier.label] += 1
            elif isinstance(event, Moved):
                tally[event.kind, event.target.label] += 1
            elif isinstance(event, Removed):
                tally[event.kind, "none"] += 1
        for (kind, tier), n in tally.items():
            self.store_events.labels(kind, tier).inc(n)

    def watch_event_bus(self, read_subscriptions: Callable[[], Iterable[Subscription]]) -> None:
        """Export each store-event subscriber's queue and loss counters, read at scrape time."""
        self.registry.register(_EventBusCollector(read_subscriptions))

    def watch_ram_recovery(self, tiers: dict) -> None:
        """Export what each arena's crash-safe host tier (:class:`~kvstore.tiers.ram.HostRamTier`,
        by arena name) re-adopted at start and what it could not make crash-safe, read at scrape
        time. Tiers without a recovery record are left out."""
        tiers = {name: t for name, t in tiers.items() if getattr(t, "recovery", None) is not None}
        if tiers:
            self.registry.register(_RamRecoveryCollector(tiers))

    def watch_tiers(self, read_stats: Callable[[], Iterable[TierStats]], read_queue_depth: Callable[[], int]) -> None:
        self.registry.register(_TierCollector(read_stats, read_queue_depth))

    def watch_arenas(self, read_stats: Callable[[], Iterable[tuple[str, TierStats]]]) -> None:
        """Per-arena tier gauges (``arena`` is a configured name: a bounded label)."""
        self.registry.register(_ArenaCollector(read_stats))


class _TierCollector(Collector):
    def __init__(self, read_stats: Callable[[], Iterable[TierStats]], read_queue_depth: Callable[[], int]) -> None:
        self._read_stats = read_stats
        self._read_queue_depth = read_queue_depth

    def collect(self):
        used = GaugeMetricFamily("strata_tier_used_bytes", "Bytes held by a tier (blocks and reserved slots)", labels=["tier"])
        cap = GaugeMetricFamily(
            "strata_tier_capacity_bytes",
            "Capacity of a tier: as configured, or what its filesystem can hold when that is less",
            labels=["tier"],
        )
        blocks = GaugeMetricFamily("strata_tier_blocks", "Blocks held by a tier", labels=["tier"])
        degraded = GaugeMetricFamily(
            "strata_tier_degraded",
            "1 while a tier cannot do its job (a full filesystem, a device that failed a write); "
            "Stats and the health service strata.tier.<tier> say why",
            labels=["tier"],
        )
        for s in self._read_stats():
            used.add_metric([s.tier.label], s.used_bytes)
            cap.add_metric([s.tier.label], s.capacity_bytes)
            blocks.add_metric([s.tier.label], s.blocks)
            degraded.add_metric([s.tier.label], 1 if s.degraded else 0)
        depth = GaugeMetricFamily("strata_kv_demotion_queue_blocks", "Blocks waiting to be written down to disk")
        depth.add_metric([], self._read_queue_depth())
        return [used, cap, blocks, degraded, depth]


class _ArenaCollector(Collector):
    def __init__(self, read_stats: Callable[[], Iterable[tuple[str, TierStats]]]) -> None:
        self._read_stats = read_stats

    def collect(self):
        labels = ["arena", "tier"]
        used = GaugeMetricFamily("strata_arena_tier_used_bytes", "Bytes held by one arena's tier", labels=labels)
        cap = GaugeMetricFamily("strata_arena_tier_capacity_bytes", "Capacity of one arena's tier", labels=labels)
        blocks = GaugeMetricFamily("strata_arena_tier_blocks", "Blocks held by one arena's tier", labels=labels)
        for arena, s in self._read_stats():
            used.add_metric([arena, s.tier.label], s.used_bytes)
            cap.add_metric([arena, s.tier.label], s.capacity_bytes)
            blocks.add_metric([arena, s.tier.label], s.blocks)
        return [used, cap, blocks]


class _RamRecoveryCollector(Collector):
    """What every arena's crash-safe RAM tier re-adopted at start (``arena``: a configured name, bounded)."""

    def __init__(self, tiers: dict[str, object]) -> None:
        self._tiers = tiers  # arena name → its HostRamTier

    def collect(self):
        kept = GaugeMetricFamily(
            "strata_ram_arena_readopted", "1 when the RAM tier started on the arena its previous run left, 0 when empty",
            labels=["arena"],
        )
        blocks = CounterMetricFamily(
            "strata_ram_recovered_blocks",
            "Blocks found at start in the arena a previous run left: adopted, or discarded as corrupt (bytes failed "
            "their checksum), torn (record torn by the crash) or conflicting (overlapping, repeated or out of range)",
            labels=["arena", "outcome"],
        )
        adopted = CounterMetricFamily("strata_ram_recovered_bytes", "Payload bytes of the blocks adopted at start",
                                      labels=["arena"])
        slots = CounterMetricFamily(
            "strata_ram_recovered_slots",
            "In-flight slots of the previous run found at start (discarded; extents held until their leases end)",
            labels=["arena"],
        )
        held = GaugeMetricFamily("strata_ram_held_bytes",
                                 "Arena bytes kept from reuse while a previous run's writers may still write them",
                                 labels=["arena"])
        unrecorded = CounterMetricFamily(
            "strata_ram_unrecorded_blocks",
            "Blocks refused (never stored, never acknowledged) because the block table could not record them: "
            "its shared-memory directory full, or the table failed",
            labels=["arena"],
        )
        for arena, tier in self._tiers.items():
            r = tier.recovery
            kept.add_metric([arena], int(r.kept))
            for outcome, n in (("adopted", r.adopted_blocks), ("corrupt", r.corrupt), ("torn", r.torn),
                               ("conflicting", r.conflicting)):
                blocks.add_metric([arena, outcome], n)
            adopted.add_metric([arena], r.adopted_bytes)
            slots.add_metric([arena], r.slots)
            held.add_metric([arena], tier.held_bytes)
            unrecorded.add_metric([arena], tier.unrecorded_blocks)
        return [kept, blocks, adopted, slots, held, unrecorded]


class _EventBusCollector(Collector):
    def __init__(self, read_subscriptions: Callable[[], Iterable[Subscription]]) -> None:
        self._read = read_subscriptions

    def collect(self):
        label = ["subscriber"]
        delivered = CounterMetricFamily(
            "strata_store_event_delivered_total", "Store events handed to a subscriber's callback", labels=label
        )
        dropped = CounterMetricFamily(
            "strata_store_event_dropped_total", "Store events a subscriber lost to a full queue", labels=label
        )
        overflows = CounterMetricFamily(
            "strata_store_event_overflows_total", "Times a subscriber's queue overflowed (a Resync follows)", labels=label
        )
        resyncs = CounterMetricFamily(
            "strata_store_event_resyncs_total",
            "Resync deliveries: the subscriber was told to rebuild from a store snapshot",
            labels=label,
        )
        failures = CounterMetricFamily(
            "strata_store_event_callback_errors_total", "Batches whose subscriber callback raised", labels=label
        )
        queued = GaugeMetricFamily("strata_store_event_queue_events", "Store events waiting for a subscriber", labels=label)
        for sub in self._read():
            delivered.add_metric([sub.name], sub.delivered_events)
            dropped.add_metric([sub.name], sub.dropped_events)
            overflows.add_metric([sub.name], sub.overflows)
            resyncs.add_metric([sub.name], sub.resyncs)
            failures.add_metric([sub.name], sub.errors)
            queued.add_metric([sub.name], sub.pending)
        return [delivered, dropped, overflows, resyncs, failures, queued]
