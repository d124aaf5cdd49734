"""The connection table the daemon's threaded servers share: limit, swap, stop."""

from __future__ import annotations

import threading

import pytest

from kvstore.wire.listeners import Admission, ConnectionTable


def _held(release: threading.Event):
    def serve():
        release.wait(10)
    return serve


def test_admits_up_to_the_limit_then_refuses_and_frees_a_slot_when_a_thread_ends():
    table, release = ConnectionTable(2), threading.Event()
    assert table.admit("a", _held(release), (), "t") is Admission.SERVED
    assert table.admit("b", _held(release), (), "t") is Admission.SERVED
    assert table.admit("c", _held(release), (), "t") is Admission.FULL
    conns = table.close()
    assert sorted(c for c, _ in conns) == ["a", "b"]
    release.set()
    for _, thread in conns:
        thread.join(5)
    assert len(table) == 0
    assert table.admit("d", _held(release), (), "t") is Admission.STOPPING


def test_a_serving_thread_that_raises_still_leaves_the_table():
    table = ConnectionTable(1)
    done = threading.Event()

    def serve():
        try:
            raise RuntimeError("a bug in one connection")
        finally:
            done.set()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(threading, "excepthook", lambda args: None)
        assert table.admit("a", serve, (), "t") is Admission.SERVED
        done.wait(5)
        for _, thread in table.close():
            thread.join(5)
    assert len(table) == 0


def test_swap_keeps_one_slot_and_the_swapped_in_object_leaves_with_its_thread():
    table, swapped, release = ConnectionTable(1), threading.Event(), threading.Event()
    seen = []

    def serve():
        seen.append(table.swap("socket", "link"))
        swapped.set()
        release.wait(10)

    assert table.admit("socket", serve, (), "t") is Admission.SERVED
    swapped.wait(5)
    assert seen == [True]
    conns = table.close()
    assert [c for c, _ in conns] == ["link"]
    release.set()
    conns[0][1].join(5)
    assert len(table) == 0


def test_swap_after_stop_tracks_nothing():
    table = ConnectionTable(1)
    table.close()
    assert table.swap("socket", "link") is False
    assert len(table) == 0
