"""Settings of replication: ``[replication]``, k copies of a namespace's (or a pin's) blocks on distinct nodes.

Config checks the syntax (each rule an exact namespace, a prefix ``team-*``
or ``*``; each k a whole number from 1 to :data:`MAX_REPLICAS`) and hands
the replicator plain values (:meth:`ReplicationSettings.options`);
:mod:`kvstore.replication.policy` decides which rule a namespace falls under.
"""

from __future__ import annotations

from typing import Any

from pydantic import ByteSize, field_validator

from kvstore.block import validate_namespace
from kvstore.config.section import Section, setting
from kvstore.errors import InvalidNamespace

MAX_REPLICAS = 16
MAX_RULES = 1024
REPLICATE_SYNTAX = "NAMESPACE:K[,PREFIX*:K...] (e.g. r:2,team-a-*:3)"


def check_replica_rule(rule: str) -> str:
    """An exact namespace, ``PREFIX*`` or ``*``; raises ValueError saying what is wrong."""
    if not isinstance(rule, str) or not rule:
        raise ValueError(f"replication rule {rule!r} is not a namespace: give one such as 'r', 'team-a-*' or '*'")
    if rule == "*":
        return rule
    prefix = rule[:-1] if rule.endswith("*") else rule
    if "*" in prefix:
        raise ValueError(f"replication rule {rule!r}: a '*' may only end a prefix pattern, such as 'team-a-*'")
    try:
        validate_namespace(prefix)
    except InvalidNamespace as err:
        raise ValueError(f"replication rule {rule!r}: {err}") from None
    return rule


def parse_replicas(value: Any) -> Any:
    """``"r:2, team-*:3"`` (a flag or a variable) → ``{"r": 2, "team-*": 3}``; a TOML table passes as it is."""
    if not isinstance(value, str):
        return value
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        rule, sep, k = part.rpartition(":")
        if not sep or not rule.strip() or not k.strip():
            raise ValueError(f"replicate entry {part!r} is not {REPLICATE_SYNTAX}")
        if rule.strip() in out:
            raise ValueError(f"replicate entry {part!r}: namespace rule {rule.strip()!r} is given twice")
        out[rule.strip()] = k.strip()
    return out


class ReplicationSettings(Section):
    flag_prefix = "replication_"
    title = ("replication: keep k copies of the blocks of chosen namespaces, and of pins that ask for replicas, on "
             "distinct live nodes (pushed over the TCP peer data plane; needs a shared [index] url and --peer-listen "
             "on every node)")

    namespaces: dict[str, int] = setting(
        default_factory=dict,
        description=f"namespaces to replicate and their copy count k, {REPLICATE_SYNTAX}; k counts distinct live "
        "nodes holding the block, this one included; the most specific rule wins (exact, then the longest "
        "prefix, then '*'); empty: no replication",
        flag="replicate",
    )
    interval_seconds: float = setting(1.0, "time between replication rounds", gt=0, le=3600)
    blocks_per_round: int = setting(
        256, "blocks whose holders one round checks (the index is asked once per batch)", ge=1, le=1 << 16
    )
    bytes_per_round: ByteSize = setting(
        ByteSize(256 << 20), "block bytes one round pushes to other nodes at most (one block in flight at a time)",
    )
    push_seconds: float = setting(10.0, "deadline of one block's push to a peer", gt=0, le=600)
    max_pin_replicas: int = setting(
        4, f"the most copies a Pin may ask for (its replicas, this node counted; more is refused); 1: pins are "
        f"never replicated; at most {MAX_REPLICAS}", ge=1, le=MAX_REPLICAS,
    )
    max_replicated_pins: int = setting(
        4096, "pins asking for copies this node keeps at once; one more is refused as overloaded until one ends",
        ge=1, le=1 << 20,
    )

    _parse = field_validator("namespaces", mode="before")(lambda cls, v: parse_replicas(v))

    @field_validator("namespaces")
    @classmethod
    def _rules(cls, value: dict[str, int]) -> dict[str, int]:
        if len(value) > MAX_RULES:
            raise ValueError(f"{len(value)} replication rules; at most {MAX_RULES}")
        for rule, k in value.items():
            check_replica_rule(rule)
            if not 1 <= k <= MAX_REPLICAS:
                raise ValueError(f"replication rule {rule!r}: k is {k}; give a number of copies from 1 to {MAX_REPLICAS}")
        return value

    @field_validator("bytes_per_round")
    @classmethod
    def _positive(cls, value: ByteSize) -> ByteSize:
        if value < 1:
            raise ValueError("bytes_per_round must be at least one byte (and at least the largest block to push it)")
        return value

    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``kvstore.replication.replicator.ReplicationLimits``, plus the rules."""
        return {
            "rules": dict(self.namespaces), "interval_s": self.interval_seconds,
            "blocks_per_round": self.blocks_per_round, "bytes_per_round": int(self.bytes_per_round),
            "push_s": self.push_seconds, "max_pin_replicas": self.max_pin_replicas,
            "max_pins": self.max_replicated_pins,
        }
