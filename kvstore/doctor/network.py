"""What the daemon reaches and is reached at: its listening ports, the Redis index, an S3 endpoint.

Ports are bound for a moment and let go, as the daemon would bind them
(SO_REUSEADDR, as gRPC and the HTTP server do), so a port that another
process holds is named before the daemon fails on it. Redis is asked what
the daemon's index needs first: a PING through the same URL parsing and
TLS files (``kvstore.index.redis_url``), and for a Cluster, that the
cluster is whole. S3 is asked nothing signed: any HTTP answer from the
endpoint shows it is reachable; credentials and buckets are the object
tier's to check when it exists.
"""

from __future__ import annotations

import errno
import socket
import urllib.error
import urllib.request
from urllib.parse import urlsplit
from pathlib import Path

from kvstore.auth.exposure import split_host
from kvstore.config import Settings
from kvstore.doctor.host import Host, daemon_running
from kvstore.doctor.report import Finding, fail, ok, skip
from kvstore.errors import InvalidArgument


def listeners(settings: Settings) -> list[tuple[str, str]]:
    """(flag, host:port) of every TCP listener the daemon opens as configured."""
    s = settings
    pairs = [("--listen", s.server.listen), ("--metrics-listen", s.server.metrics_listen),
             ("--peer-listen", s.peers.listen), ("--peer-ucx-listen", s.peers.ucx_listen)]
    return [(flag, address) for flag, address in pairs if address and not address.startswith("unix:")]


def _bind(address: str) -> OSError | None:
    host, port = split_host(address)
    host = host or "127.0.0.1"  # ':PORT' binds loopback, as the daemon does
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError) as err:
        return err if isinstance(err, OSError) else OSError(errno.EINVAL, str(err))
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
            sock.listen(1)
        except OSError as err:
            return err
    return None


def check_ports(settings: Settings, host: Host) -> list[Finding]:
    findings = []
    running = daemon_running(settings)
    for flag, address in listeners(settings):
        if split_host(address)[1] == "0":
            findings.append(skip("ports", f"{flag} {address}: any free port, chosen at start"))
            continue
        err = _bind(address)
        if err is None:
            findings.append(ok("ports", f"{flag} {address} is free"))
        elif err.errno == errno.EADDRINUSE and running:
            findings.append(ok("ports", f"{flag} {address} is served by the running strata daemon of these settings"))
        elif err.errno == errno.EADDRINUSE:
            findings.append(fail("ports", f"{flag} {address} is in use by another process",
                                 "stop what holds it (ss -ltnp shows it: a strata daemon already running?), or "
                                 f"give {flag} another port"))
        elif err.errno == errno.EADDRNOTAVAIL or isinstance(err, socket.gaierror):
            findings.append(fail("ports", f"{flag} {address}: this host has no such address ({err})",
                                 f"give {flag} an address of this host, or 0.0.0.0 for every interface"))
        elif err.errno == errno.EACCES:
            findings.append(fail("ports", f"{flag} {address}: not permitted ({err.strerror})",
                                 "use a port above 1023, or give the daemon CAP_NET_BIND_SERVICE"))
        else:
            findings.append(fail("ports", f"{flag} {address} cannot be bound ({err})", f"check {flag}"))
    for flag, path in (("--unix-socket", settings.server.unix_socket),):
        if path:
            parent = Path(path).parent
            if parent.is_dir():
                findings.append(ok("ports", f"{flag} {path}: its directory exists"))
            else:
                findings.append(fail("ports", f"{flag} {path}: {parent} does not exist",
                                     f"create {parent}, or mount the shared volume there"))
    return findings


def check_redis(settings: Settings, host: Host) -> list[Finding]:
    url = settings.index.url
    if not url or url.startswith("memory:"):
        return [skip("redis", f"--index-url {url or 'memory://'}: the embedded index, this node only")]
    import redis
    from redis import exceptions

    from kvstore.index.redis_url import parse

    try:
        target = parse(url)
    except InvalidArgument as err:
        return [fail("redis", str(err), "fix --index-url")]
    client = redis.Redis.from_url(target.client_url, socket_connect_timeout=host.timeout_s,
                                  socket_timeout=host.timeout_s, **target.options)
    try:
        client.ping()
        if target.cluster:
            info = client.execute_command("CLUSTER", "INFO")
            info = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in info:
                return [fail("redis", f"{target.where}: the Redis Cluster is not whole (cluster_state is not ok)",
                             "wait for the cluster to form, or fix it (redis-cli --cluster check HOST:PORT)")]
            return [ok("redis", f"{target.where}: the Redis Cluster answers and its state is ok")]
        return [ok("redis", f"{target.where} answers PING")]
    except (exceptions.AuthenticationError, exceptions.ResponseError) as err:
        if urlsplit(target.client_url).password is None and ("NOAUTH" in str(err) or "authenticat" in str(err)):
            return [fail("redis", f"{target.where} requires a password and --index-url gives none",
                         "put the password in --index-url (redis://:PASSWORD@HOST:PORT/0), from a Secret")]
        if isinstance(err, exceptions.AuthenticationError) or "WRONGPASS" in str(err):
            return [fail("redis", f"{target.where} refused the credentials ({err})",
                         "fix the password (or user) in --index-url; percent-encode reserved characters")]
        return [fail("redis", f"{target.where} answered an error ({err})", "check the server and --index-url")]
    except (exceptions.ConnectionError, exceptions.TimeoutError, OSError) as err:
        return [fail("redis", f"cannot reach {target.where} ({err})",
                     "is Redis running and reachable from here (its Service name, port, a NetworkPolicy)? "
                     "Without it the daemon serves its own blocks with the index degraded")]
    finally:
        client.close()


def check_s3(settings: Settings, host: Host) -> list[Finding]:
    endpoint = host.s3_endpoint
    if not endpoint:
        return [skip("s3", "no S3 endpoint to check (give --s3-endpoint URL)")]
    if not endpoint.startswith(("http://", "https://")):
        return [fail("s3", f"--s3-endpoint {endpoint!r} is not an http:// or https:// URL",
                     "give the endpoint as a URL, e.g. http://minio.strata.svc:9000")]
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint, method="GET"), timeout=host.timeout_s) as r:
            status = r.status
    except urllib.error.HTTPError as err:  # an answer: S3 refuses anonymous listing with 403
        status = err.code
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        return [fail("s3", f"cannot reach {endpoint} ({reason})",
                     "is the object store running and reachable from here (its Service name, port, TLS)?")]
    return [ok("s3", f"{endpoint} answers HTTP ({status})")]
