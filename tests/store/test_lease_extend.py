"""Extending a lease (what a handoff's heartbeat does): the later deadline holds, expiry still comes."""

from __future__ import annotations

import pytest

from kvstore.errors import LeaseExpired, UnknownLease
from kvstore.store.leases import LeaseKind, LeaseTable

HANDOFF = LeaseKind("handoff")


def test_an_extended_lease_outlives_its_first_deadline_and_then_expires():
    table = LeaseTable(8)
    lease = table.issue(HANDOFF, deadline=1.0)
    table.extend(lease.id, HANDOFF, deadline=3.0, now=0.5)
    assert table.pop_expired(2.0) == []  # the first deadline's heap entry is skipped
    assert len(table) == 1
    table.extend(lease.id, HANDOFF, deadline=2.5, now=2.0)  # never earlier than it was
    assert table.pop_expired(2.9) == []
    assert [x.id for x in table.pop_expired(3.0)] == [lease.id]
    with pytest.raises(LeaseExpired):
        table.extend(lease.id, HANDOFF, deadline=9.0, now=3.1)


def test_a_lease_past_its_deadline_or_released_cannot_be_extended():
    table = LeaseTable(8)
    late = table.issue(HANDOFF, deadline=1.0)
    with pytest.raises(LeaseExpired):
        table.extend(late.id, HANDOFF, deadline=5.0, now=1.5)
    gone = table.issue(HANDOFF, deadline=10.0)
    table.take(gone.id, HANDOFF, now=0.0)
    with pytest.raises(UnknownLease, match="already released"):
        table.extend(gone.id, HANDOFF, deadline=20.0, now=1.0)
