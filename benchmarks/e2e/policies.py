"""The five serving policies the benchmark compares, as the fleet each one needs.

- ``a`` round robin, each engine keeping only its last prompt's KV (a
  one-slot cache: what a server without prefix caching across requests
  reuses at best);
- ``b`` round robin, each engine with its own LRU cache of full blocks (vLLM's
  automatic prefix caching, per replica);
- ``c`` cache-aware routing: the engines publish KV events to their node's
  daemon, the daemons share one Redis index, and the router asks it which
  replica holds the longest prefix of each prompt;
- ``d`` round robin over a shared pool: each engine also stores its full
  blocks to its node's daemon and loads what it misses from there; a daemon
  that lacks a block fetches it from the peer that holds it (peer tier), so
  a prefix computed on one replica is loaded, not recomputed, on another;
- ``e`` cache-aware routing and the shared pool together;
- ``f`` prefill/decode disaggregation: the router (``--prefill-endpoint``)
  prefills each prompt on replica 0, whose engine stores its full blocks to
  its daemon and opens a handoff; then sends the request with the handoff's
  ``kv_transfer_params`` to a decode replica (the others, round robin),
  whose engine pulls the blocks through its own daemon (Strata's handoff,
  over the peer data plane), loads them and decodes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    key: str
    label: str
    router_policy: str  # strata route --policy
    prefix_cache: str  # the engines' --prefix-cache
    kv_events: bool  # engines publish KV events, their daemons index them, the router scores with them
    pool: bool  # engines store/load blocks through their node daemon; daemons read from each other
    disaggregated: bool = False  # replica 0 prefills, the others decode (the router's --prefill-endpoint)

    @property
    def name(self) -> str:
        return f"({self.key}) {self.label}"


POLICIES: dict[str, Policy] = {
    p.key: p
    for p in (
        Policy("a", "round robin, last prompt cached", "round-robin", "last", kv_events=False, pool=False),
        Policy("b", "round robin, per-replica prefix cache", "round-robin", "blocks", kv_events=False, pool=False),
        Policy("c", "cache-aware (Strata index)", "cache-aware", "blocks", kv_events=True, pool=False),
        Policy("d", "round robin + shared pool", "round-robin", "blocks", kv_events=False, pool=True),
        Policy("e", "cache-aware + shared pool", "cache-aware", "blocks", kv_events=True, pool=True),
        Policy("f", "P/D: prefill on one replica, decode on the other", "round-robin", "blocks", kv_events=False,
               pool=True, disaggregated=True),
    )
}


def parse_policies(text: str) -> list[Policy]:
    """``"a,c,e"`` or ``"all"`` -> the policies, in the order given."""
    if text.strip() in ("", "all"):
        return list(POLICIES.values())
    out = []
    for key in (k.strip() for k in text.split(",")):
        if key not in POLICIES:
            raise ValueError(f"unknown policy {key!r}: choose from {', '.join(POLICIES)} (or 'all')")
        out.append(POLICIES[key])
    return out
