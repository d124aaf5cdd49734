"""Settings of authentication, TLS and protected mode: ``[auth]``.

Config checks that the values fit together; the files are read by
:mod:`kvstore.auth` when the daemon starts (a missing or broken file stops
the start with a message naming the flag).
"""

from __future__ import annotations

from pydantic import field_validator, model_validator

from kvstore.config.section import Section, setting


class AuthSettings(Section):
    flag_prefix = "auth_"
    title = "authentication (bearer tokens, mTLS, peer uids), authorization by namespace, protected mode"

    file: str = setting(
        "", "policy file (TOML) of [[token]], [[cert]] and [[peer]] rules, each mapping a credential to the "
        "namespaces it may read and write; reloaded on SIGHUP and when it changes. Empty: no authentication, "
        "and protected mode serves loopback and Unix sockets only"
    )
    reload_seconds: float = setting(
        2.0, "look for a changed policy file this often (on the next request); 0: only on SIGHUP", ge=0, le=3600
    )
    tls_cert: str = setting("", "server certificate (PEM) for TLS on the TCP listener; empty: plaintext", flag="tls_cert")
    tls_key: str = setting("", "private key (PEM) of --tls-cert", flag="tls_key")
    tls_client_ca: str = setting(
        "", "CA (PEM) that signs client certificates: mTLS, every TCP client must present one; identity is its "
        "subject CN or a SAN, mapped by [[cert]] rules (without a policy file: every namespace)", flag="tls_client_ca",
    )
    insecure: bool = setting(
        False, "serve a non-loopback --listen address without authentication (protected mode off; logs a warning)",
        flag="insecure",
    )
    trust_own_uid: bool = setting(
        True, "on the same-host socket, allow every namespace to processes of the daemon's own uid (they can read "
        "its arena and disk files anyway)",
    )
    socket_mode: str = setting(
        "0600", "file mode of the daemon's Unix sockets (gRPC and same-host), octal; widen it (0660, 0666) only "
        "with [[peer]] rules or tokens in the policy", flag="unix_socket_mode",
    )

    @field_validator("socket_mode")
    @classmethod
    def _octal_mode(cls, value: str) -> str:
        try:
            mode = int(value, 8)
        except ValueError:
            mode = -1
        if not 0 <= mode <= 0o777:
            raise ValueError(f"{value!r} is not an octal file mode such as 0600 or 0660")
        return value

    @model_validator(mode="after")
    def _tls_parts(self) -> AuthSettings:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key ([auth] tls_cert, tls_key)")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mTLS) needs TLS: set --tls-cert and --tls-key too")
        return self

    @property
    def mode(self) -> int:
        return int(self.socket_mode, 8)

    @property
    def authenticated(self) -> bool:
        """Whether callers must prove who they are: a policy file, or client certificates."""
        return bool(self.file or self.tls_client_ca)
