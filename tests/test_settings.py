"""One settings object (explicit > STREAMFLOW_* > default), read by every part; the CLI's exit codes for
a bad setting, a spool another process holds and a broker that stays away."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from connectors.storage import DEFAULT_DB_PATH, CollectiveStorage
from connectors.tunnel.kafka import DEFAULT_BOOTSTRAP
from connectors.tunnel.keys import DEFAULT_REGISTRY_PATH, KeyRegistry
from connectors.tunnel.spool import Spool
from streamflow.cli import main
from streamflow.settings import FIELDS, SettingsError, env_name, settings

ROOT = Path(__file__).resolve().parents[1]
IPV_JOB = ROOT / "jobs" / "ipv.py"
SOURCE_DIRS = ("streamflow", "connectors", "operators")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for field in FIELDS:
        monkeypatch.delenv(env_name(field), raising=False)


def test_explicit_beats_the_environment_beats_the_default(monkeypatch, tmp_path):
    assert settings().db == Path("streamflow.duckdb") and settings().runner == "device"
    monkeypatch.setenv("STREAMFLOW_DB", str(tmp_path / "env.duckdb"))
    monkeypatch.setenv("STREAMFLOW_RUNNER", "flink")
    assert settings().db == tmp_path / "env.duckdb" and settings().runner == "flink"
    assert settings(db="explicit.duckdb", runner="device").db == Path("explicit.duckdb")
    assert settings(runner=None).runner == "flink"  # None means "not given"
    monkeypatch.setenv("STREAMFLOW_DB", "")  # empty counts as unset
    assert settings().db == Path("streamflow.duckdb")


def test_the_settings_resolve_what_the_connectors_are_given(monkeypatch, tmp_path):
    """The database, the broker and the key registry the framework hands the connectors: explicit, then the
    environment, then the connectors' own defaults."""
    s = settings()
    assert (s.db, s.kafka_bootstrap, s.key_registry) == (DEFAULT_DB_PATH, DEFAULT_BOOTSTRAP, DEFAULT_REGISTRY_PATH)
    monkeypatch.setenv("STREAMFLOW_DB", str(tmp_path / "a.duckdb"))
    monkeypatch.setenv("STREAMFLOW_KAFKA_BOOTSTRAP", "broker-a:9092")
    monkeypatch.setenv("STREAMFLOW_KEY_REGISTRY", str(tmp_path / "keys.json"))
    s = settings()
    assert (s.db, s.kafka_bootstrap, s.key_registry) == (tmp_path / "a.duckdb", "broker-a:9092", tmp_path / "keys.json")
    s = settings(db="b.duckdb", kafka_bootstrap="broker-b:1", key_registry="k.json")
    assert (s.db, s.kafka_bootstrap, s.key_registry) == (Path("b.duckdb"), "broker-b:1", Path("k.json"))


def test_a_connector_given_nothing_uses_its_plain_default_whatever_the_environment(monkeypatch, tmp_path):
    """Connectors take their configuration as arguments: the STREAMFLOW_* variables are the framework's to read."""
    from connectors.tunnel.cloud import CloudConsumer
    from connectors.tunnel.sink import TunnelSink

    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv("STREAMFLOW_DB", str(elsewhere / "env.duckdb"))
    monkeypatch.setenv("STREAMFLOW_KAFKA_BOOTSTRAP", "broker-a:9092")
    monkeypatch.setenv("STREAMFLOW_KEY_REGISTRY", str(elsewhere / "keys.json"))
    assert Path("streamflow.duckdb") == DEFAULT_DB_PATH and DEFAULT_BOOTSTRAP == "127.0.0.1:9092"
    assert Path(".streamflow") / "keys.json" == DEFAULT_REGISTRY_PATH
    with CollectiveStorage() as store:
        store.write("t", [{"a": 1}])
    assert store.path == DEFAULT_DB_PATH and (tmp_path / "streamflow.duckdb").is_file()
    registry = KeyRegistry()
    key = registry.add("phone-1")
    assert registry.path == DEFAULT_REGISTRY_PATH and (tmp_path / ".streamflow" / "keys.json").is_file()
    consumer = CloudConsumer(tmp_path / "cloud.duckdb", registry)  # connects only when it runs
    try:
        assert consumer.bootstrap == DEFAULT_BOOTSTRAP and consumer.receipts.bootstrap == DEFAULT_BOOTSTRAP
    finally:
        consumer.close()
    sink = TunnelSink("phone-1", key, tmp_path / "spool", receipts=False)  # nothing written: nothing sent
    try:
        assert sink.bootstrap == DEFAULT_BOOTSTRAP
    finally:
        sink.close(timeout_s=0)
    assert not elsewhere.exists()


def test_a_bad_value_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("STREAMFLOW_FLINK_EXECUTION_MODE", "fibres")
    with pytest.raises(ValueError, match="flink_execution_mode"):
        settings()


def test_values_are_converted_and_checked(monkeypatch):
    monkeypatch.setenv("STREAMFLOW_CONSUMER_RETRY_S", "2.5")
    monkeypatch.setenv("streamflow_serve_alpha", "1")  # the variable's case does not matter
    s = settings()
    assert s.consumer_retry_s == 2.5 and s.serve_alpha == 1.0 and isinstance(s.zoo_dir, Path)
    for name, value, reason in [("consumer_retry_s", "soon", "expected a number"), ("consumer_retry_s", "0", "> 0"),
                                ("serve_alpha", "1.5", "<= 1"), ("serve_temperature", "nan", ">= 0"),
                                ("serve_app_id", "a b", "matching"), ("runner", "cloud", "'device', 'flink'")]:
        monkeypatch.setenv(env_name(name), value)
        with pytest.raises(SettingsError, match=reason) as caught:
            settings()
        assert caught.value.name == name and repr(value) in str(caught.value)
        monkeypatch.delenv(env_name(name))
    with pytest.raises(SettingsError, match="serve_alpha"):
        settings(serve_alpha=0)  # explicit values are checked too
    with pytest.raises(TypeError, match="no settings named"):
        settings(databse="typo.duckdb")


def test_no_part_reads_streamflow_variables_itself():
    """Only streamflow/settings.py turns STREAMFLOW_* variables into values."""
    direct = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\s*\()\s*["']STREAMFLOW_""")
    offenders = [f"{path.relative_to(ROOT)}:{n}" for top in SOURCE_DIRS for path in sorted((ROOT / top).rglob("*.py"))
                 for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if direct.search(line)]
    assert offenders == []


def test_cli_refuses_a_bad_setting_with_exit_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("STREAMFLOW_RUNNER", "cloud")
    events = tmp_path / "e.csv"
    events.write_text("1,10,7,pv,1511848894\n")
    assert main(["run", str(IPV_JOB), "--events", str(events), "--db", str(tmp_path / "f.duckdb")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamflow: error: STREAMFLOW_RUNNER:") and "Traceback" not in err


def test_cli_says_the_spool_is_taken_and_exits_1(tmp_path, capsys, kafka_bootstrap, monkeypatch):
    pytest.importorskip("kafka")
    monkeypatch.setenv("STREAMFLOW_KAFKA_BOOTSTRAP", kafka_bootstrap)  # the run checks for a broker first
    registry = tmp_path / "keys.json"
    KeyRegistry(registry).add("phone-1")
    events = tmp_path / "e.csv"
    events.write_text("1,10,7,pv,1511848894\n")
    spool = tmp_path / "device.spool"
    held = Spool(spool)  # another open spool: the kernel's flock refuses a second one
    try:
        code = main(["run", str(IPV_JOB), "--events", str(events), "--db", str(tmp_path / "f.duckdb"),
                     "--tunnel", "kafka", "--device-id", "phone-1", "--key-registry", str(registry),
                     "--spool", str(spool), "--tunnel-wait", "0"])
    finally:
        held.close()
    assert code == 1
    err = capsys.readouterr().err
    assert re.search(r"^streamflow: error: tunnel spool .* is in use by another process", err, re.MULTILINE), err
    assert "Traceback" not in err


def test_cli_fails_at_once_on_an_absent_broker_with_exit_2(monkeypatch, tmp_path, capsys):
    pytest.importorskip("kafka")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("STREAMFLOW_KAFKA_BOOTSTRAP", f"127.0.0.1:{port}")
    monkeypatch.setenv("STREAMFLOW_CONSUMER_RETRY_S", "1")
    code = main(["tunnel", "consume", "--db", str(tmp_path / "cloud.duckdb"), "--key-registry",
                 str(tmp_path / "keys.json")])
    assert code == 2  # a broker lost later is retried for STREAMFLOW_CONSUMER_RETRY_S (test_cli_prerequisites)
    err = capsys.readouterr().err
    assert re.search(rf"^streamflow: error: tunnel consume needs a Kafka broker and none answers at 127.0.0.1:{port}",
                     err, re.MULTILINE), err
    assert "Traceback" not in err
