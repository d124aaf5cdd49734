"""Who may reach the daemon as configured: protected mode, and the secret files it reads at start.

In a container the policy file, certificates and tokens are mounted from
Secrets; a Secret not mounted (or mounted at another path) is found here,
with the setting that names the file, before the daemon refuses to start.
"""

from __future__ import annotations

import os

from kvstore.auth.exposure import FIX, is_loopback, refusal, split_host
from kvstore.config import Settings
from kvstore.doctor.host import Host
from kvstore.doctor.report import Finding, fail, ok, warn


def secret_files(settings: Settings) -> list[tuple[str, str]]:
    """(flag, path) of every file the daemon reads credentials from, as configured."""
    a, peer = settings.auth, settings.tiers.peer
    pairs = [("--auth-file", a.file), ("--tls-cert", a.tls_cert), ("--tls-key", a.tls_key),
             ("--tls-client-ca", a.tls_client_ca), ("--peer-token-file", peer.token_file),
             ("--peer-tls-ca", peer.tls_ca), ("--handoff-token-file", settings.handoff.token_file)]
    return [(flag, path) for flag, path in pairs if path]


def beyond_loopback(address: str) -> bool:
    """Whether a listener on ``address`` (host:port) can be reached from other hosts."""
    if not address or address.startswith("unix:"):
        return False
    host, _ = split_host(address if not address.startswith(":") else "127.0.0.1" + address)
    return not is_loopback(host)


def check_access(settings: Settings, host: Host) -> list[Finding]:
    a = settings.auth
    findings = []
    guarded = (("--listen", settings.server.listen), ("--peer-listen", settings.peers.listen),
               ("--peer-ucx-listen", settings.peers.ucx_listen))
    for flag, address in guarded:
        # ucxx's listener binds a port on every interface, whatever host --peer-ucx-listen names.
        exposed = bool(address) and (flag == "--peer-ucx-listen" or beyond_loopback(address))
        if exposed and not (a.authenticated or a.insecure):
            findings.append(fail("auth", f"{flag} {address} is not a loopback address and no authentication is "
                                         "configured: the daemon refuses to start (protected mode)",
                                 FIX.replace("--listen 127.0.0.1:PORT", f"{flag} 127.0.0.1:PORT")))
        elif exposed and not a.authenticated:
            findings.append(warn("auth", f"{flag} {address} is reachable beyond loopback without authentication "
                                         "(--insecure): anyone who reaches it reads and writes every namespace",
                                 "configure --auth-file (tokens, certificates), or listen on 127.0.0.1"))
    metrics = settings.server.metrics_listen
    if beyond_loopback(metrics):
        findings.append(warn("auth", f"--metrics-listen {metrics} is reachable beyond loopback and /metrics has no "
                                     "authentication: it shows no keys, namespaces or tokens, but it shows load "
                                     "and capacity",
                             "let only your Prometheus reach it (a NetworkPolicy), or listen on 127.0.0.1"))
    for flag, path in secret_files(settings):
        if not os.path.isfile(path):
            findings.append(fail("auth", f"{flag} {path} does not exist",
                                 "mount the Secret that holds it at that path (volumeMounts), or fix the path"))
        elif not os.access(path, os.R_OK):
            findings.append(fail("auth", f"{flag} {path} is not readable by uid {os.getuid()}",
                                 "give the daemon's user read access (the Secret volume's defaultMode, fsGroup)"))
        else:
            findings.append(ok("auth", f"{flag} {path} is readable"))
    if not findings:
        findings.append(ok("auth", "loopback only, no authentication needed (protected mode)"))
    return findings
