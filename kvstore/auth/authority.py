"""The daemon's authority: turns credentials into identities and says yes or no per namespace.

One object per daemon, shared by the gRPC interceptor and the same-host
server, so both transports answer the same way. It holds the policy file's
current rules and reloads them without a restart: on SIGHUP
(:meth:`Authority.reload`) and when the file's modification time changes
(checked at most every ``reload_s`` seconds, on the next request). A file
that fails to load keeps the rules already in force and logs an error; a
daemon never starts on a broken file.

Refusals never tell one namespace from another: the check runs before the
store is touched and the PERMISSION_DENIED text depends only on what the
caller sent, so a namespace that exists and one that does not read the
same, at the same cost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from kvstore.auth.identity import ANONYMOUS, Identity
from kvstore.auth.policy import ALL, NOTHING, Policy, PolicyError, load_policy
from kvstore.errors import PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)

HOW_TO_AUTHENTICATE = (
    "send a bearer token (Client(token_file=...), strata --token-file or STRATA_TOKEN) "
    "or a client certificate the daemon's --tls-client-ca signed"
)


class Authority:
    """Identities for tokens, certificates and local uids; per-namespace checks.

    ``policy_file`` empty and ``mtls`` False: nobody needs to authenticate
    (protected mode keeps the daemon local), everyone is :data:`ANONYMOUS`.
    With ``mtls`` and no policy file, every certificate the client CA signed
    may use every namespace. ``trusted_uids`` (the daemon's own uid) are
    allowed everything on the same-host socket: a process running as the
    daemon's user can read its arena and disk files anyway.
    """

    def __init__(self, policy_file: str = "", *, mtls: bool = False, reload_s: float = 2.0,
                 trusted_uids: Iterable[int] = (), clock=time.monotonic) -> None:
        self._path = Path(policy_file) if policy_file else None
        self.mtls = mtls
        self._reload_s = reload_s
        self._trusted = frozenset(trusted_uids)
        self._clock = clock
        self._lock = threading.Lock()
        self._policy: Policy | None = None
        self._stamp: tuple[int, int, int] | None = None
        self._next_check = 0.0
        self.reloads = {"ok": 0, "error": 0}
        if self._path is not None:
            self._policy = load_policy(self._path)  # raises: a daemon never starts on a broken file
            self._stamp = self._file_stamp()
            self._next_check = clock() + reload_s

    @property
    def required(self) -> bool:
        """Whether callers must authenticate (a policy file or mTLS is configured)."""
        return self._path is not None or self.mtls

    @property
    def policy(self) -> Policy | None:
        self._maybe_reload()
        return self._policy

    # ---- reloading -------------------------------------------------------------

    def reload(self) -> bool:
        """Load the policy file again; on failure keep the rules in force and log why. True when loaded."""
        if self._path is None:
            return False
        with self._lock:
            stamp = self._file_stamp()
            try:
                policy = load_policy(self._path)
            except PolicyError as err:
                self.reloads["error"] += 1
                self._stamp = stamp  # do not retry the same broken file every request
                log.error("auth policy not reloaded, the previous rules stay in force: %s", err)
                return False
            self._policy, self._stamp = policy, stamp
            self.reloads["ok"] += 1
        log.info("auth policy reloaded from %s: %r", self._path, policy)
        return True

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _maybe_reload(self) -> None:
        if self._path is None or not self._reload_s:
            return
        now = self._clock()
        if now < self._next_check:
            return
        self._next_check = now + self._reload_s
        if self._file_stamp() != self._stamp:
            self.reload()

    # ---- identities ------------------------------------------------------------

    def anonymous(self) -> Identity:
        if self.required:
            raise Unauthenticated(f"this daemon requires authentication: {HOW_TO_AUTHENTICATE}")
        return ANONYMOUS

    def from_token(self, token: str) -> Identity:
        policy = self.policy
        rule = policy.by_token(token) if policy is not None else None
        if rule is None:
            # Never quote the token: it may be a real one of another daemon, or a typo of one.
            raise Unauthenticated(
                "the bearer token is not one this daemon knows: check the client's token file "
                "(--token-file, STRATA_TOKEN) against the daemon's --auth-file"
            )
        return Identity(rule.name, rule.grant)

    def from_certificate(self, subjects: list[str]) -> Identity:
        """A client certificate the TLS layer verified against the client CA: CN first, then SANs."""
        policy = self.policy
        shown = subjects[0] if subjects else "?"
        if policy is None:
            return Identity(f"cert:{shown}", ALL)
        rule = policy.by_subjects(subjects)
        return Identity(f"cert:{shown}", NOTHING) if rule is None else Identity(rule.name, rule.grant)

    def from_peer(self, uid: int) -> Identity:
        """A local process by its uid (SO_PEERCRED on the same-host socket)."""
        if uid in self._trusted:
            return Identity(f"uid:{uid}", ALL)
        policy = self.policy
        rule = policy.by_uid(uid) if policy is not None else None
        if rule is not None:
            return Identity(rule.name, rule.grant)
        if not self.required:
            return ANONYMOUS
        raise Unauthenticated(
            f"uid {uid} has no [[peer]] rule in the daemon's auth policy: add one (uid = {uid}), "
            "or use gRPC with a bearer token"
        )

    # ---- checks ------------------------------------------------------------------

    @staticmethod
    def check(identity: Identity, namespace: str, action: str) -> None:
        """PERMISSION_DENIED unless ``identity`` may ``action`` the namespace; the text is the same
        whether or not the namespace exists."""
        if not identity.may(namespace, action):
            raise PermissionDenied(
                f"{identity.principal} may not {action} namespace {namespace!r}: "
                "ask the daemon's operator to grant it in the auth policy (--auth-file)"
            )

    @staticmethod
    def check_node(identity: Identity, what: str) -> None:
        """Node-wide answers (every namespace's figures) need an identity allowed on every namespace."""
        if not identity.grant.admin:
            raise PermissionDenied(
                f"{what} covers every namespace and {identity.principal} is not allowed on all of them "
                "(namespaces = [\"*\"]): ask about one namespace instead (strata stats --namespace NS)"
            )
