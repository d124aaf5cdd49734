"""KV hints: what an orchestrator's actions on a request (vLLM's ``ReqContext.kv_hints``) ask of its chunks.

vLLM 0.33 carries a versioned envelope (``KvHintsEnvelope``: a
``protocol_version``, a ``message_id`` and actions, each with an
``action_type``, an ``action_version`` and a JSON ``payload``) and leaves
each action's meaning to the component that implements it. The Strata tier
implements envelope protocol ``1`` and these actions, version ``1``:

============  =========================================  ==============================================
action_type   payload                                    what the daemon does
============  =========================================  ==============================================
``pin``       ``ttl_s`` (default 300)                    once the request is done and its chunks stored:
                                                         read them into host RAM, and pin them there
                                                         for ``ttl_s`` (never evicted)
``retain``    ``ttl_s`` (default 1800)                   the same pin, wherever the chunks are (RAM or
                                                         disk), without moving them
``share``     ``replicas`` (default 2), ``ttl_s`` (300)  the same pin, with copies kept pinned on
                                                         ``replicas - 1`` other live nodes, so engines
                                                         of this layout there read them locally
``prefetch``  ``block_hashes`` (optional: hex of         read the chunks into host RAM from disk, a
              vLLM's offload keys)                       peer or S3: the named ones at once, else the
                                                         request's own as its lookups name them
``demote``    none                                       once the request is done: move its chunks out
                                                         of host RAM into the tier below
============  =========================================  ==============================================

Each action is answered, logged and counted (``vllm:kv_offload_strata_kv_hints``):
``accepted``; ``clipped`` (accepted with a ``ttl_s`` beyond ``hint_max_hold_s`` or
more ``block_hashes`` than :data:`MAX_PREFETCH_KEYS`, cut to the limit);
``deferred`` (a prefetch of the request's own chunks: done when its lookups
run); ``rejected`` (another protocol or action version, an action this tier
does not implement, a payload it cannot read, or ``demote`` beside ``pin`` or
``retain`` in one envelope). What each applied action did to how many chunks
is counted too (``vllm:kv_offload_strata_kv_hint_chunks``: done, missing, failed).
A request's chunks are the ones its lookups, stores and loads name, at most
:data:`MAX_KEYS` of them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey

from kvstore.integrations.vllm.mapping import block_key

PROTOCOL = "1"
ACTION_VERSION = "1"
ACTIONS = ("pin", "retain", "share", "prefetch", "demote")
OUTCOMES = ("accepted", "clipped", "deferred", "rejected")
DEFAULT_HOLD_S = {"pin": 300.0, "retain": 1800.0, "share": 300.0}
MAX_KEYS = 4096  # chunks remembered per hinted request
MAX_PREFETCH_KEYS = 1024  # block_hashes one prefetch may name
MAX_REPLICAS = 8
_PAYLOAD_KEYS = {"pin": {"ttl_s"}, "retain": {"ttl_s"}, "share": {"ttl_s", "replicas"},
                 "prefetch": {"block_hashes"}, "demote": set()}


@dataclass(frozen=True)
class Answer:
    """What the tier made of one action."""

    action_id: str
    action_type: str
    outcome: str  # one of OUTCOMES
    reason: str = ""


@dataclass
class HintPlan:
    """What one request's hints ask of its chunks, and the chunks so far; shared by the tier's threads."""

    pin_s: float = 0.0
    retain_s: float = 0.0
    share_s: float = 0.0
    share_replicas: int = 0
    demote: bool = False
    prefetch: bool = False  # the request's own chunks, as its lookups name them
    prefetch_keys: list[OffloadKey] = field(default_factory=list)  # named in the hint: read in at once
    finished: bool = False
    applied: bool = False
    stores: set = field(default_factory=set)  # store jobs of this request still running
    keys: dict[OffloadKey, None] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def at_finish(self) -> bool:
        return bool(self.pin_s or self.retain_s or self.share_s or self.demote)

    def remember(self, keys: Iterable[OffloadKey]) -> None:
        with self.lock:
            for key in keys:
                if len(self.keys) >= MAX_KEYS:
                    return
                self.keys[key] = None

    def ready(self) -> list[OffloadKey] | None:
        """The request's chunks, once: when it has finished and its stores are done."""
        with self.lock:
            if self.applied or not self.finished or self.stores or not self.at_finish:
                return None
            self.applied = True
            return list(self.keys)


def read(envelope: Any, max_hold_s: float) -> tuple[HintPlan | None, list[Answer]]:
    """The plan of one envelope (None when nothing in it applies) and an answer per action."""
    if envelope is None:
        return None, []
    actions = list(getattr(envelope, "actions", None) or ())
    version = str(getattr(envelope, "protocol_version", ""))
    if version.split(".")[0] != PROTOCOL:
        reason = f"envelope protocol_version {version!r}: the Strata tier speaks {PROTOCOL}"
        return None, [Answer(str(a.action_id), str(a.action_type), "rejected", reason) for a in actions]
    plan, answers = HintPlan(), []
    for action in actions:
        answers.append(_read_action(plan, action, max_hold_s))
    for i, (action, answer) in enumerate(zip(actions, answers)):
        if answer.outcome != "rejected" and answer.action_type == "demote" and (plan.pin_s or plan.retain_s):
            plan.demote = False
            answers[i] = Answer(answer.action_id, "demote", "rejected", "demote conflicts with pin or retain "
                                "in the same envelope: the chunks cannot be held in place and moved down")
    applies = plan.at_finish or plan.prefetch or plan.prefetch_keys
    return (plan if applies else None), answers


def _read_action(plan: HintPlan, action: Any, max_hold_s: float) -> Answer:
    kind = str(action.action_type).lower()
    action_id = str(action.action_id)

    def no(reason: str) -> Answer:
        return Answer(action_id, kind, "rejected", reason)

    if kind not in ACTIONS:
        return no(f"action_type {action.action_type!r} is not one the Strata tier implements ({', '.join(ACTIONS)})")
    if str(action.action_version).split(".")[0] != ACTION_VERSION:
        return no(f"{kind} version {action.action_version!r}: the Strata tier implements {ACTION_VERSION}")
    payload = action.payload if isinstance(action.payload, dict) else None
    if payload is None:
        return no(f"{kind}'s payload is not an object")
    unknown = sorted(set(payload) - _PAYLOAD_KEYS[kind])
    if unknown:
        takes = ", ".join(sorted(_PAYLOAD_KEYS[kind])) or "nothing"
        return no(f"{kind}'s payload has {', '.join(unknown)}; it takes {takes}")
    clipped = ""
    if kind in DEFAULT_HOLD_S:
        ttl = payload.get("ttl_s", DEFAULT_HOLD_S[kind])
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
            return no(f"{kind}'s ttl_s must be a number of seconds > 0, not {ttl!r}")
        if ttl > max_hold_s:
            ttl, clipped = max_hold_s, f"ttl_s cut to hint_max_hold_s ({max_hold_s:g})"
        if kind == "share":
            replicas = payload.get("replicas", 2)
            if isinstance(replicas, bool) or not isinstance(replicas, int) or not 2 <= replicas <= MAX_REPLICAS:
                return no(f"share's replicas must be a whole number 2..{MAX_REPLICAS}, not {replicas!r}")
            plan.share_s, plan.share_replicas = max(plan.share_s, ttl), max(plan.share_replicas, replicas)
        elif kind == "pin":
            plan.pin_s = max(plan.pin_s, ttl)
        else:
            plan.retain_s = max(plan.retain_s, ttl)
    elif kind == "demote":
        plan.demote = True
    else:  # prefetch
        hashes = payload.get("block_hashes")
        if hashes is None:
            plan.prefetch = True
            return Answer(action_id, kind, "deferred", "the request's chunks are read in as its lookups name them")
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            return no("prefetch's block_hashes must be a list of hex strings (vLLM's offload keys)")
        if len(hashes) > MAX_PREFETCH_KEYS:
            hashes, clipped = hashes[:MAX_PREFETCH_KEYS], f"block_hashes cut to the first {MAX_PREFETCH_KEYS}"
        try:
            keys = [OffloadKey(bytes.fromhex(h)) for h in hashes]
            for key in keys:
                block_key(key)
        except ValueError:
            return no("prefetch's block_hashes must be hex strings of vLLM's offload keys (block hash and group)")
        plan.prefetch_keys += keys
    return Answer(action_id, kind, "clipped" if clipped else "accepted", clipped)
