"""Authentication, authorization and protected mode of the node daemon.

    policy.py       the policy file: [[token]], [[cert]], [[peer]] rules → namespace grants
    identity.py     Identity (what a credential proved), Caller (+ the owner of its ids), may_attach
    authority.py    credentials → identities, per-namespace checks, reloading the policy
    interceptor.py  the gRPC server interceptor: every /strata.* call, before its servicer
    peers.py        SO_PEERCRED on the same-host socket
    exposure.py     protected mode: which addresses a daemon without authentication may serve
    credentials.py  the client side: bearer tokens and TLS on the clients' channels

What each transport proves: TCP gRPC a bearer token or a client
certificate (mTLS); the same-host socket the connecting uid; gRPC's Unix
socket a bearer token (gRPC gives no uid there). Every refusal is
UNAUTHENTICATED (no or unknown credentials) or PERMISSION_DENIED (known,
not allowed), decided before the store is touched.
"""

from kvstore.auth.authority import Authority
from kvstore.auth.identity import (
    ANONYMOUS, EVERY_NAMESPACE, READ, WRITE, Caller, Identity, current_caller, current_identity, may_attach, owner_of,
)
from kvstore.auth.policy import Grant, Policy, PolicyError, load_policy, token_digest

__all__ = [
    "ANONYMOUS",
    "EVERY_NAMESPACE",
    "READ",
    "WRITE",
    "Authority",
    "Caller",
    "Grant",
    "Identity",
    "Policy",
    "PolicyError",
    "current_caller",
    "current_identity",
    "load_policy",
    "may_attach",
    "owner_of",
    "token_digest",
]
