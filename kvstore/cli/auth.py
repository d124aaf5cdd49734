"""``strata auth init DIR``: the tokens and the policy file a cluster's daemons authenticate by.

A daemon beyond loopback serves only callers its policy file names
(protected mode, ``docs/guide/authentication.md``). The Kubernetes manifests
mount two Secrets: ``strata-auth`` (the policy, the token each daemon and
weight node presents to its peers, the weight pre-fetch Job's token) and
``strata-engine-token`` (the token engine pods give the node's daemon). This
writes their files into DIR and prints the ``kubectl create secret`` commands:

    policy.toml      one [[token]] rule per token, holding its SHA-256 digest (never the token)
    peer.token       daemons to daemons and weight nodes to weight nodes: read and write on every namespace
                     (peer reads, replication's copies, handoff pulls)
    engine.token     engines to their node's daemon: every namespace (mapping the arena needs that)
    prefetch.token   the weight pre-fetch: namespace "weights", read and write (Prefetch, then Status)

Why digests in the policy: the policy can be read by whoever reads the
Secret's policy key or a config repository; a token is 32 random bytes, so
its digest tells nothing. Why files the command refuses to overwrite: a
second run would lock out every pod holding the first run's tokens (``--force``
says that is meant). The policy is loaded back through the daemon's own
loader before the command reports success, so what it wrote is what
``strata serve --auth-file`` accepts.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

TOKEN_BYTES = 32  # 64 hex characters; the policy asks at least 16


@dataclass(frozen=True)
class Role:
    """One credential the manifests use: its token file, its rule, and the Secret key it goes under."""

    name: str
    namespaces: tuple[str, ...]
    why: str
    secret: str
    key: str

    @property
    def file(self) -> str:
        return f"{self.name}.token"


ROLES = (
    Role("peer", ("*",), "daemons and weight nodes to their peers: peer reads, replication, handoff pulls",
         "strata-auth", "peer.token"),
    Role("engine", ("*",), "engines to their node's daemon: mapping the arena needs every namespace",
         "strata-engine-token", "token"),
    Role("prefetch", ("weights",), "the weight pre-fetch Job: Prefetch (write) and its wait (Status, read)",
         "strata-auth", "prefetch.token"),
)
POLICY_FILE = "policy.toml"
INIT_DESCRIPTION = """\
Write into DIR the files of the Secrets the Kubernetes manifests mount, and print the kubectl
commands that create them:
  policy.toml      a [[token]] rule per token below, with its SHA-256 digest (never the token)
  peer.token       daemons and weight nodes to their peers: every namespace, read and write
  engine.token     engines to their node's daemon: every namespace (mapping the arena needs it)
  prefetch.token   the weight pre-fetch Job: namespace "weights", read and write
Tokens are 32 random bytes in hex, files mode 0600. Existing files are kept unless --force.
"""
POLICY_SECRET = "strata-auth"


def add_parser(sub) -> None:
    auth = sub.add_parser("auth", help="credentials for daemons with authentication: auth init",
                          description="Credentials for daemons with authentication (docs/guide/authentication.md).")
    auth_sub = auth.add_subparsers(dest="auth_command", required=True, metavar="AUTH_COMMAND")
    init = auth_sub.add_parser(
        "init", help="write the peer, engine and prefetch tokens and the policy file the manifests' Secrets hold",
        description=INIT_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    init.add_argument("dir", metavar="DIR", help="directory to write into (created, mode 0700)")
    init.add_argument("--kube-namespace", default="strata", metavar="NS",
                      help="the Kubernetes namespace the printed kubectl commands create the Secrets in [strata]")
    init.add_argument("--force", action="store_true", help="replace files a previous run wrote (new tokens: every "
                      "pod holding the old ones is refused until its Secret is replaced)")
    init.set_defaults(func=cmd_init)


def policy_text(digests: dict[str, str]) -> str:
    """The policy file for ``digests`` (role name → hex SHA-256 of its token)."""
    lines = ["# The Strata auth policy written by `strata auth init`: `strata serve --auth-file` and",
             "# `strata weights serve --auth-file` read it. It holds the tokens' SHA-256 digests, never",
             "# the tokens (those are in the .token files beside it). Add rules for other clients here.", ""]
    for role in ROLES:
        patterns = ", ".join(f'"{p}"' for p in role.namespaces)
        lines += ["[[token]]", f"# {role.why}", f'name = "{role.name}"', f'token_sha256 = "{digests[role.name]}"',
                  f"namespaces = [{patterns}]", 'actions = ["read", "write"]', ""]
    return "\n".join(lines)


def secret_commands(directory: Path, kube_namespace: str) -> list[str]:
    """The ``kubectl create secret`` commands that hold the files of ``directory``, one per Secret."""
    keys: dict[str, list[tuple[str, str]]] = {POLICY_SECRET: [("policy.toml", POLICY_FILE)]}
    for role in ROLES:
        keys.setdefault(role.secret, []).append((role.key, role.file))
    return [f"kubectl -n {shlex.quote(kube_namespace)} create secret generic {secret} "
            + " ".join(f"--from-file={key}={shlex.quote(str(directory / name))}" for key, name in files)
            for secret, files in keys.items()]


def _write_private(path: Path, text: str, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file (--force) keeps no wider mode


def cmd_init(args: argparse.Namespace) -> int:
    from kvstore.auth.policy import PolicyError, load_policy, token_digest

    directory = Path(args.dir).expanduser().absolute()
    names = [POLICY_FILE, *(role.file for role in ROLES)]
    present = [n for n in names if (directory / n).exists()]
    if present and not args.force:
        print(f"strata auth init: {directory} already holds {', '.join(present)}: new tokens would lock out every "
              "pod that holds these; give --force to replace them, or another DIR", file=sys.stderr)
        return 1
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        tokens = {role.name: secrets.token_hex(TOKEN_BYTES) for role in ROLES}
        digests = {name: token_digest(token).hex() for name, token in tokens.items()}
        for role in ROLES:
            _write_private(directory / role.file, tokens[role.name] + "\n", args.force)
        _write_private(directory / POLICY_FILE, policy_text(digests), args.force)
    except OSError as err:
        print(f"strata auth init: cannot write into {directory} ({err.strerror})", file=sys.stderr)
        return 1
    try:
        policy = load_policy(directory / POLICY_FILE)
    except PolicyError as err:  # a bug here, never the user's input: say so rather than hand out a bad file
        print(f"strata auth init: the policy written does not load: {err}", file=sys.stderr)
        return 1
    if any(policy.by_token(t) is None for t in tokens.values()):
        print("strata auth init: the policy written does not name every token", file=sys.stderr)
        return 1
    print(f"wrote {directory}: {POLICY_FILE} ({len(ROLES)} token digests), "
          f"{', '.join(role.file for role in ROLES)} (mode 0600)")
    print("create the Secrets the manifests mount:")
    for command in secret_commands(directory, args.kube_namespace):
        print(f"  {command}")
    return 0
