"""The Redis index's URL: where the server is, how to authenticate, how to use TLS.

::

    redis://[USER:PASSWORD@]HOST:PORT/DB            one server
    rediss://[USER:PASSWORD@]HOST:PORT/DB?tls_ca_file=/etc/strata/redis-ca.pem
    redis+cluster://[USER:PASSWORD@]HOST:PORT       a Cluster (any one master); rediss+cluster:// with TLS
    unix://[USER:PASSWORD@]/run/redis.sock?db=0

Authentication is Redis's own: ``AUTH PASSWORD`` (the ``default`` user, a
server started with ``requirepass``) when the URL has only a password
(``redis://:PASSWORD@HOST``), ``AUTH USER PASSWORD`` (an ACL user) when it has
both. A password with URL-reserved characters is percent-encoded
(``urllib.parse.quote(password, safe="")``).

TLS options are query parameters of a ``rediss://`` URL, so that the one
``index_url`` setting (``--index-url``, ``STRATA_INDEX_URL``) says everything
about the connection:

- ``tls_ca_file``: PEM file of the CA(s) that signed the server's certificate
  (default: the system's trust store); the certificate must also name the
  URL's host (hostname or IP address);
- ``tls_cert_file`` and ``tls_key_file``: the client's certificate chain and
  key, PEM, for a server that requires client certificates
  (``tls-auth-clients yes``, Redis's default once TLS is on).

The files are read when the index is opened, so a missing or unreadable file,
or a key that does not match its certificate, is refused at start with a
message naming the parameter, not at the first connection.

Every string that leaves this package (log lines, error messages, reprs)
carries :func:`redact` of the URL: the password is replaced by ``***``.
Other query parameters go to redis-py as they did before (``socket_timeout``,
``protocol``, ...).
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvstore.errors import InvalidArgument

SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
TLS_PARAMS = {"tls_ca_file": "ssl_ca_certs", "tls_cert_file": "ssl_certfile", "tls_key_file": "ssl_keyfile"}


@dataclass(frozen=True)
class RedisURL:
    """A parsed index URL: what redis-py is given, and what may be shown."""

    client_url: str  # scheme without "+cluster" and without this module's parameters
    cluster: bool
    tls: bool
    where: str  # the URL redacted: for messages
    options: dict[str, Any] = field(default_factory=dict)  # redis-py keyword arguments (TLS files)

    def __repr__(self) -> str:
        return f"RedisURL({self.where!r})"


def parse(url: str) -> RedisURL:
    where = redact(url)
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise InvalidArgument(
            f"index URL {where}: use redis://[USER:PASSWORD@]HOST:PORT/DB, rediss://… (TLS), "
            "unix:///PATH or redis+cluster://HOST:PORT"
        )
    scheme = parts.scheme.removesuffix("+cluster")
    query = parse_qsl(parts.query, keep_blank_values=True)
    tls_files = {k: v for k, v in query if k in TLS_PARAMS}
    rest = [(k, v) for k, v in query if k not in TLS_PARAMS]
    tls = scheme == "rediss"
    if tls_files and not tls:
        raise InvalidArgument(
            f"index URL {where}: {', '.join(sorted(tls_files))} apply to TLS connections: "
            f"use rediss:// (or rediss+cluster://) instead of {parts.scheme}://"
        )
    if ("tls_cert_file" in tls_files) != ("tls_key_file" in tls_files):
        raise InvalidArgument(f"index URL {where}: give tls_cert_file and tls_key_file together (the client's certificate and key)")
    if tls:
        _check_tls_files(where, tls_files)
    client_url = urlunsplit(parts._replace(scheme=scheme, query=urlencode(rest)))
    options = {TLS_PARAMS[k]: v for k, v in tls_files.items()}
    return RedisURL(client_url, parts.scheme.endswith("+cluster"), tls, where, options)


def _check_tls_files(where: str, files: dict[str, str]) -> None:
    """Load the files as the connection will, so a bad one is named now."""
    for name, path in files.items():
        try:
            with open(path, "rb"):
                pass
        except OSError as err:
            raise InvalidArgument(f"index URL {where}: {name} {path!r} cannot be read ({err.strerror}): fix the path") from None
    ca = files.get("tls_ca_file")
    try:
        context = ssl.create_default_context(cafile=ca)
    except (ssl.SSLError, ValueError) as err:
        raise InvalidArgument(f"index URL {where}: tls_ca_file {ca!r} holds no PEM certificate ({err})") from None
    if "tls_cert_file" in files:
        try:
            context.load_cert_chain(files["tls_cert_file"], files["tls_key_file"])
        except ssl.SSLError as err:
            raise InvalidArgument(
                f"index URL {where}: tls_cert_file and tls_key_file are not a PEM certificate and its key ({err})"
            ) from None


def redact(url: str) -> str:
    """The URL with its password replaced by ``***``: in the authority, or a ``password`` parameter.

    Works on the text, not on a parse: a password with an unencoded ``/``, ``?`` or ``#``
    splits a parsed URL in the wrong place, and would then show in its path. Everything
    before the last ``@`` is user information; of it only the user name is kept.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    userinfo, at, tail = rest.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        rest = f"{user}:***@{tail}" if colon else f"{userinfo}@{tail}"
    rest = _PASSWORD_PARAM.sub(r"\1***", rest)
    return f"{scheme}{sep}{rest}"


_PASSWORD_PARAM = re.compile(r"([?&]password=)[^&#]*")
