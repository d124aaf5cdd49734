"""Settings of the prefill/decode handoff: ``[handoff]`` (kvstore.handoff)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from kvstore.config.section import Section, setting
from kvstore.config.values import split_commas


class HandoffSettings(Section):
    flag_prefix = "handoff_"
    title = ("prefill/decode handoff: a request's blocks held under a lease for a decode node to pull "
             "(OpenHandoff on the prefill daemon, PullHandoff on the decode daemon)")

    lease_seconds: float = setting(
        30.0, "default handoff lease: blocks stay pinned this long for the decode side to come; each heartbeat "
        "of a pulling decode side extends it by this much again", gt=0, le=3600,
    )
    max_lease_seconds: float = setting(
        120.0, "longest lease_ms an OpenHandoff may ask for; more is refused (INVALID_ARGUMENT)", gt=0, le=3600,
    )
    max_total_seconds: float = setting(
        600.0, "heartbeats never hold a handoff's blocks longer than this after it opened", gt=0, le=86400,
    )
    max_open: int = setting(
        256, "handoffs open at once on this daemon; one more is refused with RESOURCE_EXHAUSTED and a retry "
        "delay", ge=1, le=65536,
    )
    max_open_per_identity: int = setting(
        64, "handoffs one identity (a token, a certificate, or an unauthenticated connection) may hold open at "
        "once, so that no tenant takes all of --handoff-max-open (one larger than that means all of it)", ge=1,
        le=65536,
    )
    max_blocks: int = setting(4096, "blocks one handoff may hold", ge=1, le=65536)
    max_pulls: int = setting(
        8, "pulls this daemon runs at once as a decode side; one more is refused with RESOURCE_EXHAUSTED",
        ge=1, le=1024,
    )
    max_pulls_per_identity: int = setting(
        4, "pulls one identity may run at once on this daemon, so that no caller takes every pull slot (one "
        "larger than --handoff-max-pulls means all of them)", ge=1, le=1024,
    )
    pull_seconds: float = setting(
        120.0, "the longest one pull may run (and hold a pull slot): the deadline when the caller gives none, "
        "and the cap on the one it gives", gt=0, le=3600)
    token_file: str = setting(
        "", "file holding the bearer token this daemon presents to prefill daemons when it pulls (their "
        "policy must let it read and write the namespace); empty: [tiers.peer] token_file",
    )
    transports: Annotated[list[str], Field(min_length=1, max_length=8)] = setting(
        default_factory=lambda: ["tcp", "grpc"],
        description="data planes this daemon pulls handoffs over, preferred first, comma-separated: a pull takes "
        "the first one the prefill node offers and falls back to the next when it cannot be reached (tcp: a "
        "prefill node with --peer-listen; ucx: one with --peer-ucx-listen, and ucxx here; grpc: every daemon)",
    )

    _split = field_validator("transports", mode="before")(split_commas)

    @field_validator("transports")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        from kvstore.peer.registry import PEER_CLIENTS

        unknown = [scheme for scheme in value if scheme not in PEER_CLIENTS]
        if unknown:
            raise ValueError(f"handoff transports {unknown} are unknown; pick from {', '.join(PEER_CLIENTS)}")
        if len(set(value)) != len(value):
            raise ValueError(f"handoff transports {value}: list each scheme once")
        return value

    @model_validator(mode="after")
    def _leases(self) -> HandoffSettings:
        if not self.lease_seconds <= self.max_lease_seconds <= self.max_total_seconds:
            raise ValueError(
                f"handoff_lease_seconds ({self.lease_seconds:g}) <= handoff_max_lease_seconds "
                f"({self.max_lease_seconds:g}) <= handoff_max_total_seconds ({self.max_total_seconds:g}) "
                "must hold: raise the larger ones"
            )
        return self
