"""The scoring policy: blocks × tier weight, deterministic ties, candidates kept."""

from __future__ import annotations

import math

import pytest

from kvstore.block import TierName
from kvstore.errors import InvalidArgument
from kvstore.index.base import NodeMatch
from kvstore.index.scoring import DEFAULT_TIER_WEIGHTS, NodeScore, ScoringPolicy

GPU, HOST, DISK = TierName.GPU, TierName.HOST, TierName.DISK


def test_rank_by_blocks_times_weight_then_blocks_then_node():
    policy = ScoringPolicy()
    matches = [NodeMatch("disk-long", 8, DISK), NodeMatch("gpu-short", 4, GPU), NodeMatch("b", 5, HOST), NodeMatch("a", 5, HOST)]
    ranked = policy.rank(matches, candidates=["b", "idle", "idle"])
    # all four score 4.0: the longer prefix wins, then the node id
    assert [s.node_id for s in ranked] == ["disk-long", "a", "b", "gpu-short", "idle"]
    assert ranked[0] == NodeScore("disk-long", 8, DISK, 8 * 0.5)
    assert ranked[-1] == NodeScore("idle", 0, None, 0.0)  # a candidate listed once, last


def test_weights_override_and_are_checked():
    policy = ScoringPolicy({DISK: 0.0})
    assert policy.weights[DISK] == 0.0 and policy.weights[GPU] == DEFAULT_TIER_WEIGHTS[GPU]
    per_request = policy.with_weights({HOST: 2.0})
    assert per_request.weights[HOST] == 2.0 and policy.weights[HOST] == DEFAULT_TIER_WEIGHTS[HOST]
    assert policy.with_weights({}) is policy
    assert [s.node_id for s in per_request.rank([NodeMatch("g", 3, GPU), NodeMatch("h", 2, HOST)])] == ["h", "g"]
    for bad in (-1.0, math.nan):
        with pytest.raises(InvalidArgument, match="non-negative"):
            ScoringPolicy({HOST: bad})
