"""LMCache server mode's L2 adapters, built and driven as ``lmcache server`` builds and drives them.

``build`` goes through LMCache's own ``--l2-adapter`` argument parser, config
registry and ``create_l2_adapter`` (the plugin factory for ``"type":
"plugin"``); ``wait`` does what the server's store and prefetch controllers do
with a task: poll the operation's event fd, drain it, then pop or query the
result. Used by the Strata adapter's tests and by ``benchmarks.lmcache_l2``.
Import it after ``pytest.importorskip("lmcache")``.
"""

from __future__ import annotations

import argparse
import json
import select
import time

from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
from lmcache.v1.platform.event_notifier import consume_fd


def build(spec: dict):
    """The adapter ``lmcache server --l2-adapter '<json of spec>'`` would build."""
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    return create_l2_adapter(config.adapters[0])


def wait(adapter, op: str, task_id: int, timeout_s: float = 10.0):
    """A task's result (``op``: store, lookup or load), taken as LMCache's controllers take it."""
    fd = {"store": adapter.get_store_event_fd, "lookup": adapter.get_lookup_and_lock_event_fd,
          "load": adapter.get_load_event_fd}[op]()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.05)[0]:
            consume_fd(fd)
        if op == "store":
            done = adapter.pop_completed_store_tasks()
            if task_id in done:
                return done[task_id]
            continue
        result = (adapter.query_lookup_and_lock_result if op == "lookup" else adapter.query_load_result)(task_id)
        if result is not None:
            return result
    raise TimeoutError(f"the {op} task {task_id} was not answered in {timeout_s:g} s")
