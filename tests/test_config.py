"""Settings: flags over environment over config file over defaults, and errors that name the fix."""

from __future__ import annotations

import pytest

from kvstore.cli.main import build_parser
from kvstore.config import SettingsError, load_settings


def test_precedence_flag_env_file_default(tmp_path, monkeypatch):
    cfg = tmp_path / "strata.toml"
    cfg.write_text('ram_bytes = "64MiB"\nlisten = "10.0.0.1:1"\nnode_id = "from-file"\nnamespaces = ["a", "b"]\n')
    monkeypatch.setenv("STRATA_LISTEN", "127.0.0.1:2")
    monkeypatch.setenv("STRATA_NODE_ID", "from-env")
    s = load_settings(cfg, node_id="from-flag")
    assert s.node_id == "from-flag"  # flag beats env
    assert s.listen == "127.0.0.1:2"  # env beats file
    assert s.ram_bytes == 64 << 20  # file beats default
    assert s.namespaces == ["a", "b"]
    assert s.disk_bytes == 10 << 30  # default


def test_env_lists_are_comma_separated(monkeypatch):
    monkeypatch.setenv("STRATA_NAMESPACES", "llama-3-8b, qwen2")
    assert load_settings().namespaces == ["llama-3-8b", "qwen2"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"ram_bytes": "lots"}, "ram_bytes (flag --ram-bytes, env STRATA_RAM_BYTES)"),
        ({"ram_bytes": "1MiB"}, "at least 16MiB"),
        ({"ram_bytes": "32MiB", "max_block_bytes": "64MiB"}, "raise ram_bytes or lower max_block_bytes"),
        ({"max_in_flight": "0"}, "max_in_flight (flag --max-in-flight"),
        ({"unknown_setting": 1}, "unknown_setting"),
    ],
)
def test_invalid_settings_say_what_to_change(overrides, message):
    with pytest.raises(SettingsError) as info:
        load_settings(**overrides)
    assert message in str(info.value)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


def test_every_setting_has_a_flag_with_help():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {a.dest: a for a in serve._actions}
    from kvstore.config import Settings

    for name, field in Settings.model_fields.items():
        assert name in flags, name
        assert field.description and f"STRATA_{name.upper()}" in flags[name].help
