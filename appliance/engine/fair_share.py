"""Weighted fair admission across tenants among waiting requests: start-time fair queueing (SFQ).

Each waiting request gets a virtual start tag when it is added: its tenant's flow starts at
max(virtual time, the finish tag of that tenant's previous request), and finishes cost / weight later
(cost = prompt + max_tokens, the work it may ask for). The scheduler scans the waiting queue in tag
order; admitting a request advances the virtual time to its tag. A tenant that floods the queue
lines its own requests up behind each other, far into virtual time, while a steady tenant's new
request starts at the current virtual time: it is admitted ahead of the flood's backlog, and over a
busy period each tenant is admitted in proportion to its weight. With one flow (no tenants, or one
tenant) tags grow with arrival, so the order is plain FIFO. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Share:
    """Whose request it is, for fair admission: a tenant name and its weight (> 0)."""

    tenant: str
    weight: float = 1.0


# Requests that name no tenant form one flow of weight 1.
NO_SHARE = Share("", 1.0)


class FairShare:
    def __init__(self) -> None:
        self.vtime = 0.0
        self._finish: dict[str, float] = {}  # tenant -> finish tag of its last tagged request

    def tag(self, share: Optional[Share], cost: int) -> float:
        """The start tag of a new request of `share` that may cost `cost` tokens."""
        s = share or NO_SHARE
        start = max(self.vtime, self._finish.get(s.tenant, 0.0))
        self._finish[s.tenant] = start + max(1, cost) / s.weight
        return start

    def admitted(self, tag: float) -> None:
        self.vtime = max(self.vtime, tag)

    def forget_idle(self) -> None:
        """Nothing waits: drop finish tags at or behind the virtual time (they cannot matter again),
        so the map holds only tenants with work ahead of it."""
        self._finish = {t: f for t, f in self._finish.items() if f > self.vtime}
