"""Which arena a namespace belongs to: exact names and prefix patterns, checked once for overlap.

An arena (see :mod:`kvstore.store.group`) names its namespaces as exact
names (``llama-3-8b``) or prefix patterns (``team-a-*``: every namespace
starting with ``team-a-``). A ``*`` may only end a pattern: anything richer
(globs, regular expressions) would make "do these two arenas overlap?"
undecidable at a glance, and an overlap must be a config error, never a
silent first-match. Every namespace no arena names belongs to the default
arena. With no overlap allowed, at most one rule matches a namespace, so the
order of rules does not matter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvstore.block import validate_namespace
from kvstore.errors import InvalidNamespace

WILDCARD = "*"
# The default arena's namespace list: every namespace no other arena names.
EVERYTHING_ELSE = (WILDCARD,)


def check_rule(rule: str) -> str:
    """An exact namespace or ``PREFIX*``; raises ValueError saying what is wrong."""
    if not isinstance(rule, str):
        raise ValueError(f"arena namespace {rule!r} is not text: give a name such as 'llama-3-8b' or a prefix 'team-a-*'")
    prefix = rule[:-1] if rule.endswith(WILDCARD) else rule
    if WILDCARD in prefix:
        raise ValueError(f"arena namespace {rule!r}: a '*' may only end a prefix pattern, such as 'team-a-*'")
    if not prefix:
        raise ValueError(
            f"arena namespace {rule!r} matches every namespace: the default arena already holds every "
            "namespace no arena names; give a prefix such as 'team-a-*'"
        )
    try:
        validate_namespace(prefix)
    except InvalidNamespace as err:
        raise ValueError(f"arena namespace {rule!r}: {err}") from None
    return rule


def overlaps(a: str, b: str) -> bool:
    """Whether some namespace matches both rules."""
    a_prefix, b_prefix = a.endswith(WILDCARD), b.endswith(WILDCARD)
    if not a_prefix and not b_prefix:
        return a == b
    if a_prefix and b_prefix:
        return a[:-1].startswith(b[:-1]) or b[:-1].startswith(a[:-1])
    pattern, name = (a, b) if a_prefix else (b, a)
    return name.startswith(pattern[:-1])


def check_disjoint(arenas: Iterable[tuple[str, Sequence[str]]]) -> None:
    """Raise ValueError naming both arenas (and both rules) when one namespace could belong to two."""
    seen: list[tuple[str, str]] = []
    for arena, rules in arenas:
        for rule in rules:
            for other_arena, other in seen:
                if overlaps(rule, other):
                    where = "twice in arena " + repr(arena) if other_arena == arena else (
                        f"in arenas {other_arena!r} ({other!r}) and {arena!r} ({rule!r})"
                    )
                    raise ValueError(
                        f"namespace rule {rule!r} overlaps {other!r} {where}: a namespace belongs to one arena; "
                        "remove it from one of them"
                    )
            seen.append((arena, rule))


class NamespaceRules:
    """Namespace → arena name. ``arenas`` holds (name, rules) of the named arenas; any other
    namespace goes to ``default``."""

    def __init__(self, arenas: Sequence[tuple[str, Sequence[str]]], default: str) -> None:
        for _, rules in arenas:
            for rule in rules:
                check_rule(rule)
        check_disjoint(arenas)
        self.default = default
        self._exact = {rule: name for name, rules in arenas for rule in rules if not rule.endswith(WILDCARD)}
        self._prefixes = [(rule[:-1], name) for name, rules in arenas for rule in rules if rule.endswith(WILDCARD)]

    def arena_of(self, namespace: str) -> str:
        name = self._exact.get(namespace)
        if name is not None:
            return name
        for prefix, name in self._prefixes:
            if namespace.startswith(prefix):
                return name
        return self.default
