"""Protected mode: a daemon without authentication serves only its own host.

As Redis does since 3.2: with no policy file and no client CA, any client
that can reach the listener may read and overwrite every namespace, so the
daemon refuses to listen anywhere but a loopback address (and its Unix
sockets, guarded by their file mode). Serving another address needs
authentication configured, or ``--insecure``, which says so in the log.
"""

from __future__ import annotations

import ipaddress
import socket

FIX = (
    "configure authentication (--auth-file with bearer tokens, or --tls-cert/--tls-key/--tls-client-ca for mTLS), "
    "listen on loopback (--listen 127.0.0.1:PORT), or pass --insecure to serve every client that can reach it"
)


def split_host(address: str) -> tuple[str, str]:
    """``host:port``, ``[v6]:port`` or ``:port`` → (host, port); host '' for ``:port``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address ('' and wildcards are not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def refusal(listen: str, authenticated: bool, insecure: bool, flag: str = "--listen") -> str | None:
    """Why the daemon must not listen on ``listen`` (given by ``flag``) as configured; None when it may."""
    if authenticated or insecure or listen.startswith("unix:"):
        return None
    host, _ = split_host(listen)
    if is_loopback(host):
        return None
    fix = FIX if flag == "--listen" else FIX.replace("--listen 127.0.0.1:PORT", f"{flag} 127.0.0.1:PORT")
    return f"protected mode: {flag} {listen} is not a loopback address and no authentication is configured: {fix}"
