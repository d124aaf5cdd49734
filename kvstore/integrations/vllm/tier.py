"""``StrataTier``: the ``SecondaryTierManager`` vLLM's tiering manager calls (see the package docstring).

Every method runs on vLLM's scheduler thread (or its tier-poll thread,
under the manager's lock) and returns at once: it answers from memory,
queues work for :mod:`.jobs`, or hands back what the workers finished. The
daemon is called only from the tier's own threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Any, ClassVar

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.errors import StrataError
from kvstore.integrations.health import DaemonHealth, failure_reason
from kvstore.integrations.vllm import hints, metrics
from kvstore.integrations.vllm.chunks import ChunkStore, Outcome
from kvstore.integrations.vllm.jobs import Job, JobRunner, Kind
from kvstore.integrations.vllm.lookups import StrataLookups
from kvstore.integrations.vllm.mapping import KVLayout
from kvstore.integrations.vllm.settings import StrataTierSettings

log = logging.getLogger(__name__)

MAX_TOUCHED = 4096  # chunk keys whose recency is reported per step; beyond it the hint is partial
MAX_ANNOUNCED = 1 << 16  # stored chunks remembered, so finding one gone can be announced as removed


class StrataTier(SecondaryTierManager):
    """A Strata daemon as one of vLLM's secondary KV offload tiers."""

    # The daemon's head tier is host RAM (its shared arena); what it holds
    # may also be on its disk or peers, so hits are reported as external.
    medium: ClassVar[Medium] = Medium.CPU
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = StrataTierSettings.from_options(options)
        self.locality = Locality(self.settings.locality) if self.settings.locality else None
        self.layout = KVLayout.of(offloading_spec, self.block_size_bytes, self.settings.namespace)
        self._health = DaemonHealth(self.settings.down_backoff_s, engine="vLLM")
        self._metrics = metrics.TierMetrics()
        self._chunks = ChunkStore(self.settings, self.layout, primary_kv_view.cast("B"), self._health, self._metrics)
        self._runner = JobRunner(self.settings.io_threads, self.settings.max_queued_jobs, name=f"strata-{tier_type}")
        self._lookups = StrataLookups(self._chunks, tier_type, before_batch=self._hinted_lookup)
        self._hinted_stores: dict[JobId, hints.HintPlan] = {}  # store jobs of requests with hints
        self._answered: list[JobResult] = []  # jobs answered without running (the daemon down, the queue full)
        self._load_keys: dict[JobId, list[OffloadKey]] = {}
        self._touched: dict[OffloadKey, None] = {}
        want_events = self.settings.enable_kv_events
        if want_events and not offloading_spec.kv_events_config.enable_kv_cache_events:
            log.warning("enable_kv_events is set on the Strata tier but KV cache events are off in vLLM: no events")
        self._events: list[OffloadingEvent] | None = (
            [] if want_events and offloading_spec.kv_events_config.enable_kv_cache_events else None
        )
        self._announced: OrderedDict[OffloadKey, None] = OrderedDict()
        self._events_lock = threading.Lock()
        log.info("Strata tier %s: daemon %s, namespaces %s, chunks of %d bytes", tier_type, self.settings.target,
                 self.layout.namespace(0).rsplit("/g", 1)[0] + "/g<group>", self.block_size_bytes)

    # ---- lookups ------------------------------------------------------------------

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._chunks.usable():
            return LookupResult.MISS  # backing off: answered here, no lookup queued
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        room = MAX_TOUCHED - len(self._touched)
        if room > 0:
            self._touched.update(dict.fromkeys(list(keys)[:room]))

    # ---- transfers ------------------------------------------------------------------

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        job_id, keys = job_metadata.job_id, list(job_metadata.keys)
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        plan = _plan_of(job_metadata.req_context)
        if plan is not None:
            plan.remember(keys)
            with plan.lock:
                plan.stores.add(job_id)
            self._hinted_stores[job_id] = plan
        self._submit(Kind.STORE, job_id, keys, lambda: self._store(job_id, keys, chunk_ids), self._metrics.dropped)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id, keys = job_metadata.job_id, list(job_metadata.keys)
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        if (plan := _plan_of(job_metadata.req_context)) is not None:
            plan.remember(keys)
        self._load_keys[job_id] = keys
        self._submit(Kind.LOAD, job_id, keys, lambda: self._load(job_id, keys, chunk_ids), self._metrics.failed_load)

    def _submit(self, kind: Kind, job_id: JobId, keys: list[OffloadKey], run, count) -> None:
        def give_up(reason: str) -> JobResult:
            count(reason, len(keys))
            return JobResult(job_id=job_id, success=False)

        if not self._chunks.usable():
            self._answered.append(give_up("down"))
            return
        deadline = time.monotonic() + self.settings.job_timeout_s
        if not self._runner.submit(kind, Job(run, give_up, deadline)):
            self._answered.append(give_up("queue_full"))

    def _store(self, job_id: JobId, keys: list[OffloadKey], chunk_ids: list[int]) -> JobResult:
        out = self._chunks.store(keys, chunk_ids)
        self._announce([keys[i] for i in out.done], removed=False)
        return _result(job_id, out, None)

    def _load(self, job_id: JobId, keys: list[OffloadKey], chunk_ids: list[int]) -> JobResult:
        out = self._chunks.load(keys, chunk_ids)
        self._announce([keys[i] for i in out.failed.get("missing", ())], removed=True)
        return _result(job_id, out, [keys[i] for i in out.done])

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._answered = self._answered + self._runner.finished(), []
        for result in results:
            plan = self._hinted_stores.pop(result.job_id, None)
            if plan is not None:
                with plan.lock:
                    plan.stores.discard(result.job_id)
                self._apply_when_done(plan)
            keys = self._load_keys.pop(result.job_id, None)
            if keys is not None and not result.success:
                # Only the chunks that did not load become misses (vLLM recomputes them), so
                # the scheduler stops promoting a chunk that cannot come.
                loaded = set(result.successful_keys or ())
                self._lookups.mark_miss([k for k in keys if k not in loaded])
        return results

    @override
    def drain_jobs(self) -> None:
        self._runner.drain()

    # ---- the request and step lifecycle ------------------------------------------------

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if req_context.kv_hints is not None:
            self._read_hints(req_context)
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        if (plan := _plan_of(req_context)) is not None:
            with plan.lock:
                plan.finished = True
            self._apply_when_done(plan)
        self._lookups.cleanup(req_context.req_id)
        leases = self._lookups.release(req_context.req_id)
        if leases:
            self._runner.chore(lambda: self._chunks.unpin(leases))

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()  # this step's unknown keys, one batch per request, to the lookup thread
        if self._touched:
            touched, self._touched = list(self._touched), {}
            if self._chunks.usable():
                self._runner.chore(lambda: self._chunks.touch(touched))

    # ---- KV hints (see kvstore.integrations.vllm.hints) --------------------------------------

    def _read_hints(self, req_context: ReqContext) -> None:
        """Answer each action of the request's envelope; keep what applies for the request's chunks."""
        if self.settings.kv_hints:
            plan, answers = hints.read(req_context.kv_hints, self.settings.hint_max_hold_s)
        else:
            plan, answers = None, [hints.Answer(str(a.action_id), str(a.action_type), "rejected",
                                                "kv_hints is off in this Strata tier's options")
                                   for a in req_context.kv_hints.actions]
        for answer in answers:
            self._metrics.hint(answer.action_type, answer.outcome)
            level = logging.INFO if answer.outcome in ("rejected", "clipped") else logging.DEBUG
            log.log(level, "KV hint %s (%s) of request %s: %s%s", answer.action_id, answer.action_type,
                    req_context.req_id, answer.outcome, f": {answer.reason}" if answer.reason else "",
                    extra={"hint_action": answer.action_type, "hint_outcome": answer.outcome,
                           "request_id": req_context.req_id})
        if plan is None:
            return
        req_context._state[hints.HintPlan] = plan  # vLLM's per-request scratch for a tier's parsed hints
        if plan.prefetch_keys:
            keys = plan.prefetch_keys
            self._chore(["prefetch"], keys, lambda: self._apply("prefetch", keys, lambda: self._chunks.place(keys, "ram")))

    def _hinted_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> None:
        """On the lookup thread, before a request's lookup batch: its chunks are known now, and a prefetch of them
        is done before the lookup pins them, so the load that follows reads host RAM."""
        plan = _plan_of(req_context)
        if plan is None:
            return
        plan.remember(keys)
        if plan.prefetch and self._chunks.usable():
            self._apply("prefetch", keys, lambda: self._chunks.place(keys, "ram"))

    def _apply_when_done(self, plan: hints.HintPlan) -> None:
        keys = plan.ready()
        if keys:
            actions = [a for a, on in (("pin", plan.pin_s), ("retain", plan.retain_s), ("share", plan.share_s),
                                       ("demote", plan.demote)) if on]
            self._chore(actions, keys, lambda: self._apply_at_finish(plan, keys))

    def _apply_at_finish(self, plan: hints.HintPlan, keys: list[OffloadKey]) -> None:
        if plan.pin_s:
            def pin() -> tuple[int, int]:
                self._chunks.place(keys, "ram")
                return self._chunks.hold(keys, plan.pin_s)
            self._apply("pin", keys, pin)
        if plan.retain_s:
            self._apply("retain", keys, lambda: self._chunks.hold(keys, plan.retain_s))
        if plan.share_s:
            self._apply("share", keys, lambda: self._chunks.hold(keys, plan.share_s, plan.share_replicas))
        if plan.demote:
            self._apply("demote", keys, lambda: self._chunks.place(keys, "below"))

    def _apply(self, action: str, keys: list[OffloadKey], do) -> None:
        """Run one hint's daemon calls; count what they did to the chunks."""
        try:
            done, missing = do()
        except StrataError as err:
            self._metrics.hint_chunks(action, "failed", len(keys))
            if failure_reason(err) != "down":  # down: DaemonHealth logs it once
                log.warning("KV hint %s of %d chunks refused by the Strata daemon: %s", action, len(keys), err,
                            extra={"hint_action": action, "chunks": len(keys), "error": type(err).__name__})
            return
        self._metrics.hint_chunks(action, "done", done)
        self._metrics.hint_chunks(action, "missing", missing)

    def _chore(self, actions: list[str], keys: list[OffloadKey], fn) -> None:
        if not self._runner.chore(fn):  # too many chores wait: the hint is not applied
            for action in actions:
                self._metrics.hint_chunks(action, "failed", len(keys))

    # ---- events and metrics ---------------------------------------------------------------

    def _announce(self, keys: list[OffloadKey], *, removed: bool) -> None:
        """Record KV events (from the worker threads): chunks stored, and stored ones found gone."""
        if self._events is None or not keys:
            return
        with self._events_lock:
            if removed:  # only chunks this tier said it stored
                keys = [k for k in keys if k in self._announced]
                for k in keys:
                    del self._announced[k]
            else:
                for k in keys:
                    self._announced[k] = None
                    self._announced.move_to_end(k)
                while len(self._announced) > MAX_ANNOUNCED:
                    self._announced.popitem(last=False)
            if keys:
                self._events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=removed,
                                                    locality=self.locality, ownership=self.tier_type))

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return ()
        with self._events_lock:
            events, self._events = self._events, []
        return events

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return metrics.definitions()

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        return self._metrics.take(self._chunks.usable() and not self._health.down, self._runner.pending())

    @property
    def counts(self) -> dict[str, int]:
        """Chunks dropped and failed by reason since start (``dropped:down`` ...)."""
        return dict(self._metrics.totals)

    @classmethod
    @override
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("strata_target", "strata_layout")

    @override
    def config_info(self) -> ConfigInfoMapping:
        return {"strata_target": self.settings.target, "strata_layout": self.layout.digest}

    # ---- the end -----------------------------------------------------------------------

    @override
    def shutdown(self) -> None:
        """Stop the lookup thread, answer or finish every job, close the client."""
        self._lookups.shutdown()
        self._runner.shutdown()
        self._chunks.close()


def _result(job_id: JobId, out: Outcome, loaded: list[OffloadKey] | None) -> JobResult:
    partial = loaded if (loaded and not out.complete) else None
    return JobResult(job_id=job_id, success=out.complete, successful_keys=partial,
                     transfer_time=out.seconds, transfer_bytes=out.nbytes or None)


def _plan_of(req_context: ReqContext | None) -> hints.HintPlan | None:
    return None if req_context is None else req_context._state.get(hints.HintPlan)

