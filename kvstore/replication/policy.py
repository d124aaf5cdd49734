"""Replication policy: how many copies (k, on distinct live nodes) a namespace's blocks ask for.

Rules are exact namespaces (``r``), prefixes (``team-a-*``) or ``*``, as in
``[replication] namespaces``. Unlike arenas, rules may overlap, because
"every namespace twice, this one three times" is a natural thing to ask:
the most specific rule wins, an exact name before the longest matching
prefix before ``*``, so the answer never depends on the order rules were
written in. A namespace no rule names has no policy (k = 1: the copy it
has), and the replicator never pushes its blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

WILDCARD = "*"


@dataclass(frozen=True, slots=True)
class Replicas:
    """What a namespace asks for: ``k`` copies, by the rule ``rule``."""

    rule: str
    k: int


class ReplicationPolicy:
    """Namespace → :class:`Replicas` (or None). Rules are checked by the config
    (:func:`kvstore.config.replication.check_replica_rule`)."""

    def __init__(self, rules: Mapping[str, int]) -> None:
        self.rules = dict(rules)
        self._exact = {r: k for r, k in rules.items() if not r.endswith(WILDCARD)}
        # Longest prefix first: the first match is the most specific one ("*" is the empty prefix, last).
        self._prefixes = sorted(((r[:-1], r, k) for r, k in rules.items() if r.endswith(WILDCARD)),
                                key=lambda p: -len(p[0]))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def replicas(self, namespace: str) -> Replicas | None:
        k = self._exact.get(namespace)
        if k is not None:
            return Replicas(namespace, k)
        for prefix, rule, k in self._prefixes:
            if namespace.startswith(prefix):
                return Replicas(rule, k)
        return None
