"""Who is calling: an identity (what it may do) and a caller (the identity on one connection).

An :class:`Identity` is what a credential proved: a principal name that
logs and lease owners may show (``token:NAME``, ``cert:SUBJECT``,
``uid:N``; never the credential itself) and the :class:`Grant` of
namespaces it may read and write. A daemon without authentication serves
every caller as :data:`ANONYMOUS`, allowed everything (protected mode keeps
those callers local).

A :class:`Caller` adds the owner its slots and leases are bound to: on
gRPC the principal when authenticated (the same client may reconnect),
else its connection (the gRPC peer); on the same-host socket the
connecting process (SO_PEERCRED's pid). A stranger cannot end them either way. The caller of the
request being served sits in a context variable, set by the gRPC
interceptor for the call or by the same-host server for its connection's
thread, so a servicer asks :func:`owner_of` without carrying it through.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from kvstore.auth.policy import ALL, Grant

READ = "read"
WRITE = "write"


class _Every:
    """The namespaces of an arena that holds every namespace (today's one arena)."""

    def __repr__(self) -> str:
        return "EVERY_NAMESPACE"


EVERY_NAMESPACE = _Every()


@dataclass(frozen=True, slots=True)
class Identity:
    principal: str
    grant: Grant
    authenticated: bool = True

    def may(self, namespace: str, action: str) -> bool:
        return self.grant.allows(namespace, action)

    def covers(self, namespace: str, action: str) -> bool:
        """May ``action`` every namespace ``namespace`` stands for (a name, or a pattern such as 'team-*')."""
        if not any(c in namespace for c in "*?["):
            return self.may(namespace, action)
        patterns = self.grant.read if action == READ else self.grant.write
        return any(p == namespace or _prefix_covers(p, namespace) for p in patterns)


def _prefix_covers(pattern: str, namespace: str) -> bool:
    """'team-*' covers 'team-a-*'; other pattern pairs are not compared (the answer is no)."""
    stem = pattern[:-1]
    return pattern.endswith("*") and not any(c in stem for c in "*?[") and namespace.startswith(stem)


ANONYMOUS = Identity("anonymous", ALL, authenticated=False)


@dataclass(frozen=True, slots=True)
class Caller:
    identity: Identity
    owner: str
    share: str = ""  # whose share of a listener's limits the caller's calls count against (a peer node)


_caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("strata_caller", default=None)


def current_caller() -> Caller | None:
    return _caller.get()


def current_identity() -> Identity:
    caller = _caller.get()
    return ANONYMOUS if caller is None else caller.identity


def set_caller(caller: Caller | None) -> contextvars.Token:
    return _caller.set(caller)


def reset_caller(token: contextvars.Token) -> None:
    _caller.reset(token)


def owner_of(context=None) -> str:
    """Whom slots and leases taken in the current request belong to.

    The caller's owner (the authenticated principal, or the process the
    same-host server saw connect), else the gRPC peer of ``context``
    (``ipv4:127.0.0.1:54321``, one per TCP connection). gRPC reports every
    Unix-socket peer as ``unix:``, so unauthenticated callers on the gRPC
    Unix socket share one owner; the same-host socket tells its connections apart.
    """
    caller = _caller.get()
    if caller is not None:
        return caller.owner
    return "conn:" + context.peer() if context is not None else ""


def may_attach(identity: Identity, arena_namespaces) -> bool:
    """Whether ``identity`` may map an arena: only when it may read and write EVERY namespace in it.

    A process that maps an arena can read and overwrite every byte in it,
    so the arena's path goes only to an identity the policy already lets do
    that to each namespace the arena holds; any other gets an Attach answer
    without a path and streams its bytes. ``arena_namespaces`` is the
    arena's namespace names or patterns (a collection, or a callable
    returning one), or :data:`EVERY_NAMESPACE` for an arena that holds every
    namespace, which needs an identity allowed on ``*``.
    """
    names = arena_namespaces() if callable(arena_namespaces) else arena_namespaces
    if names is EVERY_NAMESPACE:
        return identity.grant.admin
    return all(identity.covers(ns, READ) and identity.covers(ns, WRITE) for ns in names)
