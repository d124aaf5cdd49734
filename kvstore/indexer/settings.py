"""The indexer HTTP API's settings (``strata index serve``'s flags), apart from its server so the
CLI builds its parser without aiohttp (the ``router`` extra)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvstore.auth.exposure import is_loopback, split_host
from kvstore.block import validate_namespace


class IndexerError(Exception):
    """The server cannot start as configured; the message says what to change."""


@dataclass(frozen=True, slots=True)
class IndexerSettings:
    index_url: str = "memory://"
    listen: str = "127.0.0.1:8090"
    hash_seed: str = ""  # the engines' PYTHONHASHSEED; "" leaves /query refused (use /query_by_hash)
    token_file: str = ""
    insecure: bool = False
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 10.0
    max_in_flight: int = 64
    index_timeout_s: float = 2.0
    max_engines: int = 1024
    event_ttl_s: float = 30.0
    registrations_file: str = ""  # where /register's registrations are kept across restarts; "": in memory only
    tier_namespace: str = ""  # vLLM's Strata tier namespace /query also asks when a body names none
    tier_blocks_per_chunk: int = 1  # blocks per chunk of vLLM's offloading there

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_in_flight", "max_engines", "tier_blocks_per_chunk"):
            if getattr(self, name) < 1:
                raise IndexerError(f"--{name.replace('_', '-')} is {getattr(self, name)}; give a positive integer")
        if self.tier_namespace:
            validate_namespace(self.tier_namespace)  # InvalidArgument names what is wrong with it
        for name in ("body_timeout_s", "index_timeout_s", "event_ttl_s"):
            if not 0 < getattr(self, name) <= 3600:
                flag = name.removesuffix("_s").replace("_", "-")
                raise IndexerError(f"--{flag}-seconds is {getattr(self, name)}; give seconds in (0, 3600]")

    @property
    def host(self) -> str:
        return split_host(self.listen)[0] or "127.0.0.1"

    @property
    def port(self) -> int:
        port = split_host(self.listen)[1]
        if not port.isdigit() or int(port) > 65535:
            raise IndexerError(f"--listen {self.listen!r} must be HOST:PORT, e.g. 127.0.0.1:8090")
        return int(port)

    def token(self) -> str | None:
        """The bearer token clients must send, read once at start; None: none needed (loopback or insecure)."""
        if self.token_file:
            try:
                token = Path(self.token_file).read_text().strip()
            except OSError as err:
                raise IndexerError(f"--token-file {self.token_file}: {err.strerror}") from None
            if len(token) < 16:
                raise IndexerError(f"--token-file {self.token_file} holds a token of {len(token)} characters; "
                                   "give one of at least 16 (e.g. openssl rand -hex 32)")
            return token
        if not self.insecure and not is_loopback(self.host):
            raise IndexerError(
                f"protected mode: --listen {self.listen} is not a loopback address and no --token-file is given; "
                "/register makes this server connect wherever a client says: give --token-file with a bearer "
                "token, listen on loopback (--listen 127.0.0.1:PORT), or pass --insecure")
        return None
