"""The policy file: who may read and write which namespaces.

One TOML file maps each credential the daemon accepts to the namespaces it
may use. Three kinds of rule, one table array each::

    [[token]]                       # a bearer token (gRPC metadata "authorization: Bearer ...")
    name = "vllm-team-a"            # what logs, metrics and lease owners call it
    token_sha256 = "9f86d0..."      # hex SHA-256 of the token (or: token = "the token itself")
    namespaces = ["team-a-*", "shared"]
    actions = ["read", "write"]     # default: both

    [[cert]]                        # a client certificate (mTLS), by its subject CN or any SAN
    subject = "router.prod.example"
    namespaces = ["*"]
    actions = ["read"]

    [[peer]]                        # a process on this host, by its uid (SO_PEERCRED, same-host socket)
    uid = 1000                      # or: user = "vllm"
    namespaces = ["team-a-*"]

Namespace patterns are shell-style (``fnmatch``, case-sensitive): ``*``
matches every namespace. An identity allowed to read and write ``*`` is an
*admin*: it sees node-wide statistics and may map an arena that holds every
namespace.

Why digests: a file holding ``token_sha256`` can be read by more people
than the tokens themselves (a config repository); the daemon keeps only
digests either way, so a token never sits in its memory longer than one
request. Tokens are looked up by digest and the digests compared with
:func:`hmac.compare_digest`: a timing difference can only tell an attacker
about a SHA-256 output, never about a token's characters.

A token or digest never appears in an error, a log line or a repr: errors
name the rule by its ``name`` or its position in the file.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import pwd
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import AuthError

MAX_POLICY_FILE_BYTES = 1 << 20
MAX_RULES = 10_000
MAX_PATTERNS = 256
MIN_TOKEN_CHARS = 16
ACTIONS = ("read", "write")

_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
_KINDS = {"token", "cert", "peer"}


class PolicyError(AuthError):
    """A policy file that cannot be used; the message says which rule and what to change."""


@dataclass(frozen=True, slots=True)
class Grant:
    """The namespaces an identity may read, and those it may write."""

    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    _read_re: re.Pattern | None = field(default=None, repr=False, compare=False)
    _write_re: re.Pattern | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, patterns: Iterable[str], actions: Iterable[str] = ACTIONS) -> Grant:
        patterns, actions = tuple(patterns), set(actions)
        read = patterns if "read" in actions else ()
        write = patterns if "write" in actions else ()
        return cls(read, write, _compile(read), _compile(write))

    def allows(self, namespace: str, action: str) -> bool:
        pattern = self._read_re if action == "read" else self._write_re
        return pattern is not None and pattern.match(namespace) is not None

    @property
    def admin(self) -> bool:
        """Allowed to read and write every namespace."""
        return "*" in self.read and "*" in self.write


def _compile(patterns: tuple[str, ...]) -> re.Pattern | None:
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


ALL = Grant.of(["*"])
NOTHING = Grant()


@dataclass(frozen=True, slots=True)
class Rule:
    """One entry of the file: the name it goes by, and what it may do."""

    name: str
    grant: Grant
    digest: bytes = field(default=b"", repr=False)  # token rules: the token's SHA-256


def token_digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


@dataclass(frozen=True)
class Policy:
    """The rules of one policy file, looked up per request. Immutable: a reload builds a new one."""

    tokens: Mapping[bytes, Rule] = field(default_factory=dict, repr=False)
    certs: Mapping[str, Rule] = field(default_factory=dict)
    uids: Mapping[int, Rule] = field(default_factory=dict)

    def __repr__(self) -> str:  # never the digests
        return f"Policy({len(self.tokens)} tokens, {len(self.certs)} certificate subjects, {len(self.uids)} uids)"

    def by_token(self, token: str | bytes) -> Rule | None:
        digest = token_digest(token)
        rule = self.tokens.get(digest)
        # The dict found a candidate by the digest's hash; say yes only on a constant-time comparison.
        return rule if rule is not None and hmac.compare_digest(rule.digest, digest) else None

    def by_subjects(self, subjects: Iterable[str]) -> Rule | None:
        for subject in subjects:
            rule = self.certs.get(subject)
            if rule is not None:
                return rule
        return None

    def by_uid(self, uid: int) -> Rule | None:
        return self.uids.get(uid)


def load_policy(path: str | Path) -> Policy:
    """The policy in ``path``, or PolicyError saying what is wrong (never quoting a secret)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_POLICY_FILE_BYTES + 1)
    except OSError as err:
        raise PolicyError(f"cannot read the auth policy file {path} ({err.strerror}): check --auth-file") from None
    if len(data) > MAX_POLICY_FILE_BYTES:
        raise PolicyError(f"auth policy file {path} is over {MAX_POLICY_FILE_BYTES >> 20}MiB; is it the right file?")
    try:
        doc = tomllib.loads(data.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        # tomllib's message names a line and column, never the value found there.
        raise PolicyError(f"auth policy file {path} is not valid TOML: {err}") from None
    return parse_policy(doc, str(path))


def parse_policy(doc: Mapping[str, Any], where: str = "the auth policy") -> Policy:
    unknown = set(doc) - _KINDS
    if unknown:
        raise PolicyError(f"{where}: unknown table(s) {', '.join(sorted(unknown))}; known: [[token]], [[cert]], [[peer]]")
    entries = {kind: doc.get(kind, []) for kind in _KINDS}
    for kind, rows in entries.items():
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise PolicyError(f"{where}: {kind} must be an array of tables, written [[{kind}]]")
    if sum(len(rows) for rows in entries.values()) > MAX_RULES:
        raise PolicyError(f"{where}: more than {MAX_RULES} rules; group clients under shared names")
    tokens: dict[bytes, Rule] = {}
    certs: dict[str, Rule] = {}
    uids: dict[int, Rule] = {}
    for i, row in enumerate(entries["token"], 1):
        at = f"{where}: [[token]] #{i}"
        _keys(row, at, {"name", "token", "token_sha256", "namespaces", "actions"})
        name = _name(row, at)
        at = f"{where}: [[token]] {name!r}"
        digest = _digest(row, at)
        if digest in tokens:
            raise PolicyError(f"{at}: the same token as {tokens[digest].name!r}; give each client its own token")
        tokens[digest] = Rule(f"token:{name}", _grant(row, at), digest)
    for i, row in enumerate(entries["cert"], 1):
        at = f"{where}: [[cert]] #{i}"
        _keys(row, at, {"subject", "name", "namespaces", "actions"})
        subject = row.get("subject")
        if not isinstance(subject, str) or not subject:
            raise PolicyError(f"{at}: needs subject = \"...\", the certificate's CN or one of its SANs")
        if subject in certs:
            raise PolicyError(f"{at}: subject {subject!r} appears twice")
        certs[subject] = Rule(f"cert:{row.get('name') or subject}", _grant(row, at))
    for i, row in enumerate(entries["peer"], 1):
        at = f"{where}: [[peer]] #{i}"
        _keys(row, at, {"uid", "user", "name", "namespaces", "actions"})
        uid = _uid(row, at)
        if uid in uids:
            raise PolicyError(f"{at}: uid {uid} appears twice")
        uids[uid] = Rule(f"uid:{row.get('name') or uid}", _grant(row, at))
    return Policy(tokens, certs, uids)


def _keys(row: Mapping[str, Any], at: str, known: set[str]) -> None:
    extra = set(row) - known
    if extra:
        raise PolicyError(f"{at}: unknown key(s) {', '.join(sorted(extra))}; known: {', '.join(sorted(known))}")


def _name(row: Mapping[str, Any], at: str) -> str:
    name = row.get("name")
    if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9._@+=-]{1,64}$", name):
        raise PolicyError(f"{at}: needs name = \"...\" (1-64 of A-Z a-z 0-9 . _ @ + = -), the name logs show")
    return name


def _digest(row: Mapping[str, Any], at: str) -> bytes:
    token, hexed = row.get("token"), row.get("token_sha256")
    if (token is None) == (hexed is None):
        raise PolicyError(f"{at}: give exactly one of token = \"...\" or token_sha256 = \"<64 hex digits>\"")
    if token is not None:
        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS or token != token.strip():
            raise PolicyError(
                f"{at}: the token must be a string of at least {MIN_TOKEN_CHARS} characters without surrounding "
                "spaces (e.g. from: openssl rand -hex 32)"
            )
        return token_digest(token)
    if not isinstance(hexed, str) or not _DIGEST_RE.match(hexed.lower()):
        raise PolicyError(f"{at}: token_sha256 must be 64 hex digits (sha256sum of the token, without a newline)")
    return bytes.fromhex(hexed)


def _grant(row: Mapping[str, Any], at: str) -> Grant:
    patterns = row.get("namespaces")
    if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns) or not patterns:
        raise PolicyError(f"{at}: needs namespaces = [\"ns\", \"team-*\"], a non-empty list of names or patterns")
    if len(patterns) > MAX_PATTERNS:
        raise PolicyError(f"{at}: more than {MAX_PATTERNS} namespace patterns; use wildcards")
    actions = row.get("actions", list(ACTIONS))
    if not isinstance(actions, list) or not actions or not set(actions) <= set(ACTIONS):
        raise PolicyError(f"{at}: actions must be a non-empty list of \"read\" and \"write\"")
    return Grant.of(patterns, actions)


def _uid(row: Mapping[str, Any], at: str) -> int:
    uid, user = row.get("uid"), row.get("user")
    if (uid is None) == (user is None):
        raise PolicyError(f"{at}: give exactly one of uid = N or user = \"name\"")
    if user is not None:
        try:
            return pwd.getpwnam(str(user)).pw_uid
        except KeyError:
            raise PolicyError(f"{at}: no user {user!r} on this host; give its uid instead") from None
    if not isinstance(uid, int) or isinstance(uid, bool) or uid < 0:
        raise PolicyError(f"{at}: uid must be a non-negative integer")
    return uid
