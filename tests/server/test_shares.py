"""Per-identity shares of daemon-wide limits (kvstore.shares): no one caller takes all of one."""

from __future__ import annotations

import pytest

from kvstore import Client
from kvstore.errors import Overloaded
from kvstore.shares import Shares
from tests.support.identities import TOKEN_A, TOKEN_ADMIN, TOKEN_B


def test_a_holder_gets_its_share_and_no_more_and_others_keep_theirs():
    shares = Shares(2, "open handoffs", "--handoff-max-open-per-identity")
    shares.take("token:a")
    shares.take("token:a")
    with pytest.raises(Overloaded, match=r"token:a holds 2 open handoffs.*share.* is 2 \(--handoff-max-open-per-identity\)") as refused:
        shares.take("token:a")
    assert refused.value.retry_after_s > 0
    shares.take("token:b", 2)  # another holder is untouched by a's
    shares.give("token:a")
    shares.take("token:a")  # what was given back can be taken again
    assert (shares.held("token:a"), shares.held("token:b")) == (2, 2)


def test_the_table_keeps_only_holders_that_hold_something():
    shares = Shares(3, "pulls", "--handoff-max-pulls-per-identity")
    for i in range(100):
        with shares.hold(f"conn:{i}"):
            pass
    shares.give("never-took")  # never below zero, never an entry
    assert len(shares) == 0 and shares.held("never-took") == 0
    with pytest.raises(ValueError, match="at least 1"):
        Shares(0, "pulls", "--x")


def test_one_tenant_cannot_hold_every_handoff_slot(make_daemon, policy_file):
    """team-a opens its share of the daemon's handoffs and is refused beyond it, by name; team-b,
    and the admin, still open theirs; a completed handoff gives its share back."""
    daemon = make_daemon(auth_file=str(policy_file), handoff_max_open=5, handoff_max_open_per_identity=2)
    with Client(daemon.target, token=TOKEN_A, use_shm=False, retries=0) as a, \
            Client(daemon.target, token=TOKEN_B, use_shm=False, retries=0) as b:
        a.put("a", b"k", b"x" * 4096)
        b.put("b", b"k", b"y" * 4096)
        first, _ = a.open_handoff("a", [b"k"], lease_s=60)
        a.open_handoff("a", [b"k"], lease_s=60)
        with pytest.raises(Overloaded, match="token:team-a holds 2 open handoffs.*--handoff-max-open-per-identity"):
            a.open_handoff("a", [b"k"], lease_s=60)
        b.open_handoff("b", [b"k"], lease_s=60)
        b.open_handoff("b", [b"k"], lease_s=60)
        a.complete_handoff("a", first.handoff_id)
        a.open_handoff("a", [b"k"], lease_s=60)
    with Client(daemon.target, token=TOKEN_ADMIN, use_shm=False, retries=0) as admin:
        admin.put("c", b"k", b"z" * 4096)
        admin.open_handoff("c", [b"k"], lease_s=60)  # the fifth: the daemon-wide limit is full now
        with pytest.raises(Overloaded, match="--handoff-max-open\\)"):
            admin.open_handoff("c", [b"k"], lease_s=60)


def test_one_tenants_pins_cannot_take_every_lease(make_daemon, policy_file):
    """Pins are leases of the node's table: team-a's long pins stop at its share, by name, while
    team-b still pins, and an unpin gives the share back. (A READ-only token once took all 65,536.)"""
    daemon = make_daemon(auth_file=str(policy_file), max_leases=16, max_leases_per_identity=4)
    with Client(daemon.target, token=TOKEN_A, use_shm=False, retries=0) as a, \
            Client(daemon.target, token=TOKEN_B, use_shm=False, retries=0) as b:
        a.put("a", b"k", b"x" * 4096)
        b.put("b", b"k", b"y" * 4096)
        pins = [a.pin("a", [b"k"], lease_s=3600) for _ in range(4)]
        with pytest.raises(Overloaded, match="token:team-a holds 4 leases.*--max-leases-per-identity") as refused:
            a.pin("a", [b"k"], lease_s=3600)
        assert refused.value.retry_after_s > 0
        assert [b.pin("b", [b"k"], lease_s=3600).lease_id for _ in range(4)]  # b's share is its own
        assert a.unpin(pins[0].lease_id)
        assert a.pin("a", [b"k"], lease_s=3600).lease_id
        assert a.get("a", b"k") == b"x" * 4096  # reads that take no lease of their own are untouched


def test_the_lease_share_is_a_quarter_of_the_table_unless_set():
    from kvstore.config import load_settings

    limits = load_settings(environ={}, max_leases=1000).store.limits()
    assert limits["max_leases_per_owner"] == 250
    assert load_settings(environ={}, max_leases=1000, max_leases_per_identity=5000).store.limits()["max_leases_per_owner"] == 1000


def test_a_byte_budget_share_bounds_each_holder_and_the_budget_bounds_them_all():
    from kvstore.wire.budget import ByteBudget

    budget = ByteBudget(100, "puts", "--put-budget-bytes", share_bytes=60, share_setting="--per-identity")
    budget.take(50, "a")
    with pytest.raises(Overloaded, match=r"a holds 50 bytes of puts, its share .* is 60 \(--per-identity\)") as info:
        budget.take(20, "a")
    assert info.value.retry_after_s > 0
    budget.take(40, "b")
    with pytest.raises(Overloaded, match="--put-budget-bytes"):
        budget.take(20, "c")  # within c's share, beyond the budget
    budget.take(10)  # no holder: the budget alone
    budget.give(50, "a")
    assert (budget.held_by("a"), budget.held_by("b"), budget.used_bytes) == (0, 40, 50)
    budget.take(50, "a")  # its share is whole again, and the budget is full
    assert budget.used_bytes == budget.capacity_bytes == 100
