"""Settings: flags over environment over config file over defaults, one section per component,
and errors that name the flag, variable or config key to change."""

from __future__ import annotations

import re
import socket

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ByteSize

from kvstore.cli.common import group_title, serve_overrides
from kvstore.cli.main import build_parser, main
from kvstore.config import SETTINGS, Section, Settings, SettingsError, StoreSettings, load_settings
from kvstore.config.section import iter_settings, setting
from kvstore.config.tiers import TierSettings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "strata.example.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "strata.toml"
    path.write_text(text)
    return path


def test_precedence_flag_env_file_default(tmp_path, monkeypatch):
    cfg = write(tmp_path, """
[node]
id = "from-file"
[server]
listen = "10.0.0.1:1"
[tiers.ram]
bytes = "64MiB"
[tiers.disk]
bytes = "1GiB"
[store]
namespaces = ["a", "b"]
""")
    monkeypatch.setenv("STRATA_LISTEN", "127.0.0.1:2")
    monkeypatch.setenv("STRATA_NODE_ID", "from-env")
    monkeypatch.setenv("STRATA_TIERS__DISK__BYTES", "2GiB")
    s = load_settings(cfg, node_id="from-flag")
    assert s.node.id == "from-flag"  # flag beats env
    assert s.server.listen == "127.0.0.1:2"  # flat env beats file
    assert s.tiers.disk.bytes == 2 << 30  # nested env beats file
    assert s.tiers.ram.bytes == 64 << 20  # file beats default
    assert s.store.namespaces == ["a", "b"]
    assert s.store.lease_seconds == 30.0  # default
    assert s.server.metrics_listen == "127.0.0.1:9464"  # the rest of a section the file names keeps its defaults


def test_a_flag_overrides_one_key_of_a_section(tmp_path):
    cfg = write(tmp_path, '[tiers.disk]\nbytes = "1GiB"\ndir = "/srv/strata"\n')
    s = load_settings(cfg, environ={}, disk_bytes="3GiB")
    assert s.tiers.disk.bytes == 3 << 30 and s.tiers.disk.dir == Path("/srv/strata")


def test_overrides_take_a_section_as_a_dict():
    s = load_settings(environ={}, store={"demotion_threads": 0, "lease_seconds": 7}, ram_bytes="128MiB")
    assert s.store.demotion_threads == 0 and s.store.lease_seconds == 7 and s.tiers.ram.bytes == 128 << 20


def test_env_lists_are_comma_separated(monkeypatch):
    monkeypatch.setenv("STRATA_NAMESPACES", "llama-3-8b, qwen2")
    assert load_settings().store.namespaces == ["llama-3-8b", "qwen2"]


def test_env_names_are_case_insensitive_and_booleans_parse():
    s = load_settings(environ={"strata_disk_fsync": "true", "STRATA_store__verify_commits": "0"})
    assert s.tiers.disk.fsync is True and s.store.verify_commits is False


def test_flat_and_nested_variables_that_disagree_are_refused():
    with pytest.raises(SettingsError, match="both STRATA_RAM_BYTES='64MiB' and STRATA_TIERS__RAM__BYTES='32MiB'"):
        load_settings(environ={"STRATA_RAM_BYTES": "64MiB", "STRATA_TIERS__RAM__BYTES": "32MiB"})
    assert load_settings(environ={"STRATA_RAM_BYTES": "64MiB", "STRATA_TIERS__RAM__BYTES": "64MiB"}).tiers.ram.bytes == 64 << 20


def test_unknown_nested_variable_lists_the_known_ones():
    with pytest.raises(SettingsError) as info:
        load_settings(environ={"STRATA_TIERS__RAM__BYTS": "1GiB"})
    assert "STRATA_TIERS__RAM__BYTS names no setting" in str(info.value)
    assert "STRATA_TIERS__RAM__BYTES, STRATA_TIERS__RAM__SHM_DIR" in str(info.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"ram_bytes": "lots"}, "ram_bytes (flag --ram-bytes, env STRATA_RAM_BYTES), config [tiers.ram] bytes: could not parse"),
        ({"ram_bytes": "1MiB"}, "at least 16MiB"),
        ({"ram_bytes": "32MiB", "max_block_bytes": "64MiB"}, "raise ram_bytes or lower max_block_bytes"),
        ({"max_in_flight": "0"}, "max_in_flight (flag --max-in-flight"),
        ({"chunk_bytes": "1KiB"}, "chunk_bytes (flag --chunk-bytes"),
        ({"lease_seconds": "4000"}, "[store]: max_lease_seconds must be at least lease_seconds"),
        ({"low_watermark": "0.96"}, "low_watermark (0.96) must be below high_watermark (0.95)"),
        ({"score_weights": "gpu=1,tpu=2"}, "score_weights (flag --score-weights, env STRATA_SCORE_WEIGHTS"),
        ({"score_weights": "host=-1"}, "non-negative"),
        ({"kv_events": "tcp://h:1?engine=e"}, "kv_events entry 'tcp://h:1?engine=e' must look like"),
        ({"log_level": "LOUD"}, "log_level (flag --log-level, env STRATA_LOG_LEVEL), config [logging] level"),
        ({"unknown_setting": 1}, "unknown_setting: unknown setting; known: node_id, listen"),
    ],
)
def test_invalid_settings_say_what_to_change(overrides, message):
    with pytest.raises(SettingsError) as info:
        load_settings(environ={}, **overrides)
    assert message in str(info.value)


def test_unknown_key_in_a_config_file_is_named_with_the_known_ones(tmp_path):
    cfg = write(tmp_path, '[tiers.ram]\nbyts = "1GiB"\n[tiers.tape]\nbytes = "8GiB"\n[sever]\nlisten = ":1"\n')
    with pytest.raises(SettingsError) as info:
        load_settings(cfg, environ={})
    text = str(info.value)
    assert "tiers.ram.byts: unknown section or key; known in [tiers.ram]: bytes, shm_dir" in text
    assert "tiers.tape: unknown section or key; known in [tiers]: chain, ram, disk" in text
    assert "sever: unknown section or key; known at the top level: node, server, tiers, store, index, auth, logging" in text


def test_a_flat_key_of_the_old_file_layout_says_where_it_went(tmp_path):
    cfg = write(tmp_path, 'ram_bytes = "64MiB"\n')
    with pytest.raises(SettingsError, match=r"ram_bytes is the flag --ram-bytes; in a config file it is \[tiers.ram\] bytes"):
        load_settings(cfg, environ={})


def test_missing_or_malformed_config_file_is_named(tmp_path):
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")
    with pytest.raises(SettingsError, match="strata.toml is not valid TOML"):
        load_settings(write(tmp_path, "[tiers.ram\n"))


def test_example_config_file_loads():
    s = load_settings(EXAMPLE, environ={})
    assert s.tiers.ram.bytes == 1 << 30
    assert s.tiers.disk.bytes == 10 << 30 and s.tiers.disk.dir == Path("/var/cache/strata")
    assert s.index.url == "redis://redis:6379/0"
    assert s.index.event_sources() == [{
        "endpoint": "tcp://vllm-0:5557", "engine_id": "vllm-0", "namespace": "llama-3-8b",
        "replay_endpoint": "tcp://vllm-0:5558", "topic": "",
    }]
    assert s.server.unix_socket == "/run/strata/strata.sock"
    assert s.tiers.chain == ["ram", "disk", "peer", "object"] and s.server.advertise_address == "10.0.0.2:50051"
    assert s.tiers.peer.edge() == {"demote": False, "write_through": False, "promote": True}
    assert s.tiers.peer.transports == ["tcp", "grpc"] and s.tiers.peer.token_file == "/etc/strata/peer.token"
    assert (s.tiers.object.bucket, s.tiers.object.prefix) == ("my-kv-cache", "strata/prod")
    assert s.tiers.object.edge() == {"demote": True, "write_through": False, "promote": True}


def test_object_settings_are_checked_and_handed_down_as_plain_values(tmp_path):
    s = load_settings(environ={"STRATA_OBJECT_BUCKET": "kv"}, tiers="ram,disk,object",
                      object_endpoint="http://minio:9000", object_queue_bytes="64MiB")
    options = s.tiers.object.tier_options(tmp_path)
    assert options["bucket"] == "kv" and options["endpoint"] == "http://minio:9000"
    assert options["queue_bytes"] == 64 << 20 and options["prefix"] == "strata" and options["call_s"] == 5.0
    assert "secret" not in " ".join(options)  # credentials come from the environment at start, never from here
    for bad, says in [
        (dict(tiers="ram,disk,object"), "set [tiers.object] bucket"),
        (dict(tiers="ram,object", object_bucket="kv", object_part_bytes="1MiB"), "at least 5MiB"),
        (dict(tiers="ram,object", object_bucket="kv", object_max_uploads=32, object_max_requests=32),
         "reads need requests of their own"),
    ]:
        with pytest.raises(SettingsError, match=re.escape(says)):
            load_settings(environ={}, **bad)


def test_peer_settings_are_checked_and_the_advertised_address_derived():
    s = load_settings(environ={}, tiers="ram,peer", peer_transports="tcp,grpc", listen="10.1.2.3:7000")
    assert s.tiers.peer.transports == ["tcp", "grpc"] and s.tiers.peer.write_policy == "off"
    assert s.server.advertised(7000) == "10.1.2.3:7000" and s.server.advertised_host() == "10.1.2.3"
    wild = load_settings(environ={}, listen="0.0.0.0:7000", insecure=True)
    assert wild.server.advertised(7001) == f"{socket.gethostname()}:7001"
    told = load_settings(environ={}, advertise_address="[fd00::5]:9000")
    assert told.server.advertised(1) == "[fd00::5]:9000" and told.server.advertised_host() == "fd00::5"
    for bad, says in [
        (dict(peer_fetch_seconds=10, peer_deadline_seconds=5), "peer_deadline_seconds"),
        (dict(peer_transports="grpc,GRPC"), "scheme name"),
        (dict(peer_transports="grpc,grpc"), "each scheme once"),
        (dict(advertise_address="10.0.0.1"), "host:port"),
    ]:
        with pytest.raises(SettingsError, match=says):
            load_settings(environ={}, **bad)


def example_keys(text: str) -> set[tuple[str, ...]]:
    """Every ``key =`` of a TOML file, set or commented out (``# key = ...``), by its path: the tables,
    commented-out ones (``# [[arenas]]``) included, name where each key is."""
    keys, table = set(), ()
    for line in text.splitlines():
        header = re.match(r"^\s*(?:#\s*)?\[\[?([\w.-]+)\]\]?\s*(?:#.*)?$", line)
        if header:
            table = tuple(header.group(1).split("."))
            keys.add(table)
            continue
        key = re.match(r"^\s*(#\s*)?([a-z_][a-z0-9_]*)\s+=\s", line)
        if key:
            keys.add((*table, key.group(2)))
    return keys


def test_the_example_config_file_names_every_setting():
    """deploy/strata.example.toml is where operators look for a key: each setting is there, set or
    commented out, in its own table; and nothing there, even commented out, names a key that is not."""
    keys = example_keys(EXAMPLE.read_text())
    missing = [s.toml for s in SETTINGS if s.path not in keys]
    assert not missing, f"add to deploy/strata.example.toml (as a key or a commented-out key): {', '.join(missing)}"
    from kvstore.config.arenas import ArenaSettings

    known = {s.path for s in SETTINGS} | {s.path[:-1] for s in SETTINGS} | {
        ("arenas", name) for name in ArenaSettings.model_fields}
    unknown = sorted(".".join(k) for k in keys if k not in known)
    assert not unknown, f"deploy/strata.example.toml names keys no setting has: {', '.join(unknown)}"


def test_example_keys_reads_set_and_commented_keys():
    keys = example_keys('[a]\nx = 1  # c\n# y = "2"\n# [[arenas]]\n# name = "t"\n# prose = is not a key\n')
    assert keys == {("a",), ("a", "x"), ("a", "y"), ("arenas",), ("arenas", "name"), ("arenas", "prose")}


def test_configuration_guide_example_loads(tmp_path):
    guide = (ROOT / "docs" / "guide" / "configuration.md").read_text()
    block = guide.split("```toml\n", 1)[1].split("```", 1)[0]
    s = load_settings(write(tmp_path, block), environ={})
    assert s.tiers.disk.dir == Path("/var/cache/strata") and s.logging.format == "text"


def test_deploy_manifest_flags_still_parse():
    yaml = pytest.importorskip("yaml")
    pod = yaml.safe_load((ROOT / "deploy" / "lmcache" / "vllm-strata-pod.yaml").read_text())
    (strata,) = [c for c in pod["spec"]["containers"] if c["name"] == "strata"]
    args = build_parser().parse_args(strata["args"])
    s = load_settings(environ={}, **serve_overrides(args))
    assert (s.server.listen, s.tiers.ram.bytes, s.tiers.disk.bytes) == ("127.0.0.1:50051", 32 << 30, 500 << 30)
    assert s.tiers.disk.dir == Path("/var/cache/strata") and s.tiers.ram.shm_dir == Path("/dev/shm")


def test_every_setting_has_a_flag_with_help_in_its_section_group():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    groups = {g.title: {a.dest: a for a in g._group_actions} for g in serve._action_groups}
    for s in SETTINGS:
        group = groups[group_title(s.path[:-1])]
        assert s.flag in group, s.flag
        assert s.field.description and s.env in group[s.flag].help and s.option in group[s.flag].option_strings


def test_serve_with_a_bad_config_file_exits_2_naming_the_key(tmp_path, capsys):
    cfg = write(tmp_path, '[store]\nleese_seconds = 5\n')
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "store.leese_seconds: unknown section or key; known in [store]: max_block_bytes" in capsys.readouterr().err


def test_store_limits_come_from_the_store_section():
    """The store's limits type takes exactly the keys config gives it; its defaults are the section's."""
    from kvstore.store.tiered import StoreLimits

    limits = StoreSettings().limits()
    assert set(limits) == {f.name for f in dataclasses.fields(StoreLimits)}
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(StoreLimits)), "defaults live in config only"
    assert StoreLimits.from_settings() == StoreLimits(**limits)
    changed = StoreSettings(lease_seconds=7, disk_retry_seconds=2, demotion_threads=0).limits()
    assert (changed["lease_s"], changed["tier_retry_s"], changed["demotion_threads"]) == (7, 2, 0)
    assert StoreLimits.from_settings(StoreSettings(lease_seconds=7), lease_s=9).lease_s == 9


def test_daemon_uses_each_section(make_daemon, tmp_path):
    daemon = make_daemon(lease_seconds=7, store={"high_watermark": 0.9}, namespaces="pre-made", score_weights="host=0.25")
    assert daemon.store.limits.lease_s == 7 and daemon.store.limits.high_watermark == 0.9
    assert "pre-made" in daemon.store.stats().namespaces
    assert daemon.settings.tiers.disk.dir == Path(tmp_path / "d0")


def test_event_sources_build_the_index_type():
    from kvstore.index.events import EngineSource

    s = load_settings(environ={}, kv_events="tcp://a:1?engine=e1&namespace=m&topic=kv, tcp://b:2?engine=e2&namespace=m")
    sources = [EngineSource(**kw) for kw in s.index.event_sources()]
    assert [(x.endpoint, x.engine_id, x.topic, x.replay_endpoint) for x in sources] == [
        ("tcp://a:1", "e1", "kv", None), ("tcp://b:2", "e2", "", None)]
    assert load_settings(environ={}, score_weights="GPU=2, disk=0").index.tier_weights() == {"gpu": 2.0, "disk": 0.0}


@pytest.mark.system
def test_config_imports_no_index_module():
    code = "import sys, kvstore.config; print(sorted(m for m in sys.modules if m.startswith('kvstore.index')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_new_section_gets_its_names_from_its_fields():
    """Adding a component is a Section subclass and a field on its parent; names follow."""

    class TapeSettings(Section):
        flag_prefix = "tape_"
        bytes: ByteSize = setting(ByteSize(0), "tape tier size")

    class Tiers(TierSettings):
        tape: TapeSettings = setting(default_factory=TapeSettings)

    class WithTape(Settings):
        tiers: Tiers = setting(default_factory=Tiers)

    names = {s.flag: s for s in iter_settings(WithTape)}
    tape = names["tape_bytes"]
    assert (tape.option, tape.env, tape.nested_env, tape.toml) == (
        "--tape-bytes", "STRATA_TAPE_BYTES", "STRATA_TIERS__TAPE__BYTES", "[tiers.tape] bytes")
    assert set(names) == {s.flag for s in SETTINGS} | {"tape_bytes"}


def test_the_chain_and_its_edges_come_from_config(make_daemon):
    from kvstore.block import TierName

    daemon = make_daemon(disk_write_policy="through", disk_promote=False)
    edge = daemon.store.chain.edge_below(TierName.HOST)
    assert daemon.store.chain.names == [TierName.HOST, TierName.DISK]
    assert (edge.demote, edge.write_through, edge.promote) == (True, True, False)
    ram_only = make_daemon(tiers="ram")
    assert ram_only.store.chain.names == [TierName.HOST]
    no_disk = make_daemon(disk_bytes=0)
    assert no_disk.store.chain.names == [TierName.HOST], "a tier of size 0 is left out of the chain"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tiers": "disk,ram"}, "ram comes first"),
        ({"tiers": "ram,tape"}, "tier 'tape' in the chain is not a tier; the known tiers are ram, disk"),
        ({"disk_write_policy": "sideways"}, "disk_write_policy (flag --disk-write-policy"),
    ],
)
def test_a_bad_chain_says_what_to_change(overrides, message):
    with pytest.raises(SettingsError) as info:
        load_settings(environ={}, **overrides)
    assert message in str(info.value)
