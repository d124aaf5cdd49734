"""Who may reach the daemon as configured: protected mode, and the secret files it reads at start.

In a container the policy file, certificates and tokens are mounted from
Secrets; a Secret not mounted (or mounted at another path) is found here,
with the setting that names the file, before the daemon refuses to start.
"""

from __future__ import annotations

import os

from kvstore.auth.exposure import FIX, refusal
from kvstore.config import Settings
from kvstore.doctor.host import Host
from kvstore.doctor.report import Finding, fail, ok


def secret_files(settings: Settings) -> list[tuple[str, str]]:
    """(flag, path) of every file the daemon reads credentials from, as configured."""
    a, peer = settings.auth, settings.tiers.peer
    pairs = [("--auth-file", a.file), ("--tls-cert", a.tls_cert), ("--tls-key", a.tls_key),
             ("--tls-client-ca", a.tls_client_ca), ("--peer-token-file", peer.token_file),
             ("--peer-tls-ca", peer.tls_ca), ("--handoff-token-file", settings.handoff.token_file)]
    return [(flag, path) for flag, path in pairs if path]


def check_access(settings: Settings, host: Host) -> list[Finding]:
    a = settings.auth
    findings = []
    for flag, address in (("--listen", settings.server.listen), ("--peer-listen", settings.peers.listen)):
        if address and refusal(address, a.authenticated, a.insecure, flag=flag) is not None:
            findings.append(fail("auth", f"{flag} {address} is not a loopback address and no authentication is "
                                         "configured: the daemon refuses to start (protected mode)",
                                 FIX.replace("--listen 127.0.0.1:PORT", f"{flag} 127.0.0.1:PORT")))
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
