"""Fixtures of the daemon's tests: the tenants' policy file (tests/support/identities.py)."""

from __future__ import annotations

import pytest

from tests.support.identities import policy_text


@pytest.fixture
def policy_file(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(policy_text())
    return path
