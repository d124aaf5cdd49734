"""``strata auth init``: the files it writes are what a real ``strata serve --auth-file`` accepts.

The command runs as a user runs it (a child process); a real daemon process then starts on its
policy file, and clients present each token: the engine's and the peer's may use every namespace
(the engine maps the arena), the pre-fetch token only "weights", a token the command did not write
is refused. Its kubectl commands name every file it wrote under the keys the manifests mount
(tests/test_k8s_manifests.py checks the manifests' side).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import Client
from kvstore.auth import load_policy, token_digest
from kvstore.cli.auth import POLICY_FILE, ROLES, secret_commands
from kvstore.errors import PermissionDenied, Unauthenticated, UnknownNamespace

REPO = Path(__file__).resolve().parents[2]


def strata(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture
def credentials(tmp_path) -> Path:
    out = tmp_path / "auth"
    done = strata("auth", "init", str(out))
    assert done.returncode == 0, done.stderr
    return out


def token(directory: Path, name: str) -> str:
    return (directory / f"{name}.token").read_text().strip()


def test_it_writes_private_tokens_a_policy_of_their_digests_and_the_kubectl_commands(tmp_path):
    out = tmp_path / "auth"
    done = strata("auth", "init", str(out), "--kube-namespace", "inference")
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for name in (POLICY_FILE, *(role.file for role in ROLES)):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name
    policy_text = (out / POLICY_FILE).read_text()
    policy = load_policy(out / POLICY_FILE)
    for role in ROLES:
        secret = token(out, role.name)
        assert len(secret) == 64 and secret not in policy_text, "the policy holds digests, never tokens"
        assert token_digest(secret).hex() in policy_text
        assert policy.by_token(secret).name == f"token:{role.name}"
    commands = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("kubectl ")]
    assert commands == secret_commands(out, "inference")
    assert "strata-auth" in commands[0] and "strata-engine-token" in commands[1]
    for name in (POLICY_FILE, *(role.file for role in ROLES)):
        assert f"={out / name}" in done.stdout, f"{name} is in no kubectl command"


def test_a_second_run_keeps_the_tokens_unless_forced(credentials):
    before = token(credentials, "engine")
    done = strata("auth", "init", str(credentials))
    assert done.returncode == 1 and "--force" in done.stderr
    assert token(credentials, "engine") == before
    done = strata("auth", "init", str(credentials), "--force")
    assert done.returncode == 0, done.stderr
    assert token(credentials, "engine") != before
    assert load_policy(credentials / POLICY_FILE).by_token(before) is None


def test_a_real_daemon_accepts_the_tokens_on_their_namespaces_and_refuses_others(credentials, daemon_process):
    proc = daemon_process("--auth-file", str(credentials / POLICY_FILE))
    for name in ("engine", "peer"):
        with Client(proc.target, token_file=str(credentials / f"{name}.token"), use_shm=False, retries=0) as kv:
            assert kv.put(f"ns-{name}", b"k", b"bytes of " + name.encode())
            assert kv.get(f"ns-{name}", b"k") == b"bytes of " + name.encode()
            kv.stats()  # node-wide figures: an identity on every namespace
    with Client(proc.target, token=token(credentials, "prefetch"), use_shm=False, retries=0) as kv:
        with pytest.raises(PermissionDenied):
            kv.put("ns-engine", b"k2", b"x")
        with pytest.raises(UnknownNamespace):  # allowed to ask: the daemon answers for "weights" (never used here)
            kv.exists("weights", [b"k"])
    with Client(proc.target, token="not-a-token-strata-auth-init-wrote", use_shm=False, retries=0) as kv:
        with pytest.raises(Unauthenticated):
            kv.get("ns-engine", b"k")
    with Client(proc.target, use_shm=False, retries=0) as kv:
        with pytest.raises(Unauthenticated):
            kv.get("ns-engine", b"k")
    done = strata("stats", "--target", proc.target, "--token-file", str(credentials / "engine.token"), "--json")
    assert done.returncode == 0, done.stderr
    done = strata("stats", "--target", proc.target, "--token-file", str(credentials / "prefetch.token"))
    assert done.returncode != 0
