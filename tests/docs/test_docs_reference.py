"""docs/reference/ is what ``python docs/generate.py`` renders from the code now.

The reference pages (every setting, command, metric and status code) are generated and
committed; this fails, naming each stale page and the command that regenerates them, when the
code changed without them. It runs the generator in this process (about a second).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def generate():
    spec = importlib.util.spec_from_file_location("strata_docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pages(generate) -> dict[str, str]:
    return generate.render()


def test_the_committed_reference_pages_are_current(generate, pages):
    stale = generate.stale(pages=pages)
    assert not stale, f"stale in docs/reference/: {', '.join(stale)}; regenerate with: {generate.COMMAND}"


def test_check_names_the_stale_page_and_the_command(generate, pages, tmp_path, monkeypatch, capsys):
    shutil.copytree(ROOT / "docs" / "reference", tmp_path, dirs_exist_ok=True)
    for name, text in pages.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(generate, "REFERENCE", tmp_path)
    monkeypatch.setattr(generate, "render", lambda: pages)
    assert generate.main(["--check"]) == 0
    (tmp_path / "metrics.md").write_text(pages["metrics.md"].replace("strata_kv_hits_total", "strata_kv_hit_total"))
    (tmp_path / "old-page.md").write_text("left over\n")
    capsys.readouterr()
    assert generate.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "docs/reference/metrics.md is stale" in err and "docs/reference/old-page.md" in err
    assert "python docs/generate.py" in err and "cli.md" not in err


def test_the_pages_carry_nothing_of_this_machine(pages):
    import os
    import socket

    text = "\n".join(pages.values())
    assert str(Path.home()) + "/" not in text and str(ROOT) not in text and f"-{os.getpid()}`" not in text
    if len(socket.gethostname()) >= 8:  # short names (a container's) could be any word
        assert socket.gethostname() not in text
    assert "`~/.cache/strata`" in pages["configuration.md"] and "the hostname" in pages["configuration.md"]


def test_every_setting_metric_and_error_is_on_its_page(pages):
    from kvstore.config import SETTINGS
    from kvstore.config.router import ROUTER_SETTINGS
    from kvstore.errors import StrataError, UnknownNamespace

    for s in SETTINGS:
        assert f"`{s.env}`" in pages["configuration.md"] and f"`{s.nested_env}`" in pages["configuration.md"], s.flag
    for s in ROUTER_SETTINGS:
        assert f"`{s.option}" in pages["router-configuration.md"], s.flag
    for name in ("strata_kv_hits_total", "strata_router_decisions_total", "strata_handoffs_opened_total",
                 "strata_weights_fetched_bytes_total", "strata_tier_used_bytes", "strata_index_degraded"):
        assert f"`{name}`" in pages["metrics.md"], name
    assert "`UnknownNamespace` | `kvstore.errors` | `NOT_FOUND`" in pages["status-codes.md"]
    assert issubclass(UnknownNamespace, StrataError)
    assert "`strata serve`" in pages["cli.md"] and "`strata weights serve`" in pages["cli.md"]
    assert "--peer-read-timeout" in pages["cli.md"] and "`--ram-bytes`" in pages["cli.md"]


def test_every_metric_the_code_declares_is_on_the_metrics_page(pages):
    """A metric declared anywhere in kvstore/ or weightcache/ (``Counter("strata_...")``, a collector's
    ``GaugeMetricFamily("strata_...")``) is one the generator renders: a new metrics class goes into
    ``docs/generate.py``'s list, not only into the code."""
    import re

    declared = set()
    for package in ("kvstore", "weightcache"):
        for path in (ROOT / package).rglob("*.py"):
            declared |= set(re.findall(r"(?:Counter|Gauge|Histogram|MetricFamily)\(\s*\"(strata_\w+)\"", path.read_text()))
    assert len(declared) > 50
    missing = sorted(n for n in declared if f"`{n}`" not in pages["metrics.md"] and f"`{n}_total`" not in pages["metrics.md"])
    assert not missing, f"declared in the code but not in docs/reference/metrics.md: {', '.join(missing)}"
