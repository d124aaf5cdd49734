"""An engine behind the router: its address, its index ids, and what the router knows of its state.

The state is owned by the router's event loop (no locks): ``in_flight`` is
counted by the proxy around each request, ``healthy`` is set by the health
checks and by a proxied request whose connection was refused, ``queue_depth``
is the engine's own waiting queue as last scraped from its /metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Endpoint:
    index: int  # its position in --endpoint order: the metrics' label, bounded by MAX_ENDPOINTS
    url: str  # http://host:port, no trailing slash
    ids: tuple[str, ...]  # prefix-index node ids whose holdings count as this endpoint's
    healthy: bool = True
    in_flight: int = 0
    queue_depth: float = 0.0
    last_error: str = field(default="", repr=False)

    @property
    def label(self) -> str:
        return str(self.index)

    @property
    def load(self) -> float:
        """Requests waiting on this engine as the router sees them: its own outstanding ones plus the scraped queue."""
        return self.in_flight + self.queue_depth
