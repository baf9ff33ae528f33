"""The Flink runner at parallelism 2: the file read by two readers (byte ranges, a user's lines put back in line
order by watermarks), and the device runner's rows.

Real PyFlink MiniCluster (one JVM for the session's Flink tests; each run gets a MiniCluster of its own).
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="needs the flink extra: pip install 'streamflow[flink]'", exc_type=ImportError)
if shutil.which("java") is None:
    pytest.skip("the Flink runner needs a Java runtime", allow_module_level=True)

from connectors.storage import CollectiveStorage  # noqa: E402
from streamflow.flink.runner import file_splits, parallel_readers, run_flink  # noqa: E402
from streamflow.job import load_job  # noqa: E402
from streamflow.runners.device import DeviceRunner  # noqa: E402
from streamflow.sources import open_source  # noqa: E402
from streamflow.testing import read_tables, rows_diff, summary_diff  # noqa: E402
from tests.kafka_broker import publish_lines  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"
IPV = ROOT / "jobs" / "ipv.py"


def awkward_sample(path: Path) -> Path:
    """The shared sample with what tells a reader apart: malformed lines, a line back in time for its user (only
    rejected if the user's lines are taken in order), a line that is not UTF-8, CRLF, a lone CR, blank lines, no
    final newline. The file's users have lines all over it, so both halves hold lines of the same users."""
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    lines[100:100] = ["999477,1,2,pv", "999477,1,2,teleport,1511848894", "999477,1,2,pv,1e9"]
    lines.insert(7000, lines[6999].rsplit(",", 1)[0] + ",1511000000")
    body = ("\r\n".join(lines[:3000]) + "\r" + "\n".join(lines[3000:6000]) + "\n\n\n" + "\n".join(lines[6000:]))
    data = body.encode("utf-8").replace(b"999477,1,2,pv\r\n", b"999477,1,\xff2,pv\r\n", 1)
    path.write_bytes(data)
    return path


def test_file_splits_number_every_line_as_the_device_reads_it(tmp_path):
    events = awkward_sample(tmp_path / "awkward.csv")
    for n in (1, 2, 5):
        splits = file_splits(events, n)
        assert len(splits) == n and splits[0][1] == 0 and splits[-1][2] == events.stat().st_size
        assert all(a[2] == b[1] and a[3] + a[4] == b[3] for a, b in zip(splits, splits[1:], strict=False))
    with open(events, encoding="utf-8", errors="surrogateescape") as f:
        assert sum(1 for _ in f) == splits[-1][3] + splits[-1][4] - 1


def test_parallel_readers_only_where_the_rows_stay_the_device_runners():
    job = load_job(IPV)
    assert parallel_readers(job, SAMPLE, 2, once=True) == 2
    assert parallel_readers(job, "kafka://events", 2, once=False) == 2
    assert parallel_readers(job, SAMPLE, 2, once=False) == 1  # paced or checkpointed: Flink's FileSource
    assert parallel_readers(load_job(ROOT / "jobs" / "activity_windows.py"), SAMPLE, 2, once=True) == 1
    assert parallel_readers(job, SAMPLE, 1, once=True) == 1


@pytest.mark.slow
def test_ipv_job_read_by_two_readers_gives_the_device_runners_rows(tmp_path, monkeypatch):
    """Splits of about 64 KiB (six of the file): each reader takes three in turn, a watermark per reader."""
    from streamflow.flink import runner as flink_runner

    monkeypatch.setattr(flink_runner, "SPLIT_BYTES", 64 << 10)
    events = awkward_sample(tmp_path / "awkward.csv")
    assert flink_runner.split_count(events, 2) == 6
    job = load_job(IPV)
    with CollectiveStorage(tmp_path / "device.duckdb") as storage:
        runner = DeviceRunner(job, storage)
        device_summary = runner.run(open_source(events))
        runner.close()
    summary = run_flink(job, events, db=tmp_path / "flink.duckdb", parallelism=2)
    device, flink = read_tables(tmp_path / "device.duckdb"), read_tables(tmp_path / "flink.duckdb")
    assert not rows_diff(device, flink) + summary_diff(device_summary, summary)
    reasons = sorted(row["reason"] for row in device["dead_letter"])
    assert len(reasons) == 4 and any(reason.startswith("invalid UTF-8") for reason in reasons), reasons
    assert any("1511000000" in row["raw"] for row in device["dead_letter"])  # taken in order: rejected as on the device
    assert len(device["ipv"]) > 9_000


@pytest.mark.slow
def test_a_topic_read_at_parallelism_2_gives_the_device_runners_rows(kafka_bootstrap, tmp_path, monkeypatch):
    """Each partition by one reader: a one-partition topic leaves the second reader idle (it ends at once, so
    the watermark is the busy reader's), records numbered by offset as the device numbers lines."""
    pytest.importorskip("kafka")
    from streamflow.flink import connector_jars
    from streamflow.sources import TaobaoBehaviorSource

    connector_jars.fetch()
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()[:2000]
    lines[100:100] = ["999477,1,2,pv", "999477,1,2,teleport,1511848894", ""]
    lines.insert(1500, lines[1499].rsplit(",", 1)[0] + ",1511000000")
    topic = f"events-{uuid.uuid4().hex[:10]}"
    publish_lines(kafka_bootstrap, topic, lines)
    events, job = f"kafka://{topic}", load_job(IPV)
    with CollectiveStorage(tmp_path / "device.duckdb") as storage:
        runner = DeviceRunner(job, storage)
        device_summary = runner.run(TaobaoBehaviorSource.from_lines(lines, name=events))
        runner.close()
    monkeypatch.setenv("STREAMFLOW_KAFKA_BOOTSTRAP", kafka_bootstrap)
    summary = run_flink(job, events, fmt="taobao", db=tmp_path / "flink.duckdb", parallelism=2)
    device, flink = read_tables(tmp_path / "device.duckdb"), read_tables(tmp_path / "flink.duckdb")
    assert not rows_diff(device, flink) + summary_diff(device_summary, summary)
    assert len(device["dead_letter"]) == 3 and len(device["ipv"]) > 1000


@pytest.mark.slow
def test_kafka_sink_at_parallelism_2_ships_the_device_runners_rows_once(kafka_bootstrap, tmp_path, monkeypatch):
    """``sink="kafka:TOPIC"``: each of the two subtasks is a tunnel device of its own; the cloud consumer stores
    the device runner's feature rows, each once; dead letters stay in the local DuckDB file."""
    pytest.importorskip("kafka")
    from connectors.tunnel.cloud import CloudConsumer
    from connectors.tunnel.keys import KeyRegistry
    from streamflow.flink.sinks import flink_devices

    lines = SAMPLE.read_text(encoding="utf-8").splitlines()[:3000]
    lines[100:100] = ["999477,1,2,pv", "999477,1,2,teleport,1511848894"]
    events = tmp_path / "events.csv"
    events.write_text("\n".join(lines) + "\n", encoding="utf-8")
    job = load_job(IPV)
    with CollectiveStorage(tmp_path / "device.duckdb") as storage:
        runner = DeviceRunner(job, storage)
        runner.run(open_source(events))
        runner.close()
    device = read_tables(tmp_path / "device.duckdb")

    registry = KeyRegistry(tmp_path / "keys.json")
    for name in flink_devices(job.name, 2):
        registry.add(name)
    monkeypatch.setenv("STREAMFLOW_KEY_REGISTRY", str(registry.path))
    monkeypatch.setenv("STREAMFLOW_KAFKA_BOOTSTRAP", kafka_bootstrap)
    topic = f"features-{uuid.uuid4().hex[:10]}"
    summary = run_flink(job, events, db=tmp_path / "flink.duckdb", parallelism=2, sink=f"kafka:{topic}")
    local = read_tables(tmp_path / "flink.duckdb")
    assert local["dead_letter"] == device["dead_letter"] and "ipv" not in local
    assert summary.task_stats["ipv"].rows == len(device["ipv"])

    consumer = CloudConsumer(tmp_path / "cloud.duckdb", registry, topic=topic, bootstrap=kafka_bootstrap)
    try:
        stats = consumer.run(idle_timeout_s=3, max_s=120)
        columns = list(device["ipv"][0])
        cloud = consumer.store.query(f"SELECT {', '.join(columns)}, device_id FROM ipv")
        assert (stats.stored, stats.duplicates, stats.dead_total) == (len(device["ipv"]), 0, 0)
    finally:
        consumer.close()
    assert sorted(tuple(row[:-1]) for row in cloud) == sorted(tuple(row[c] for c in columns) for row in device["ipv"])
    assert {row[-1] for row in cloud} == set(flink_devices(job.name, 2))  # both subtasks shipped rows


def test_sink_uris_are_checked_before_a_job_starts(tmp_path, capsys):
    from streamflow.cli import main

    base = ["run", str(IPV), "--events", str(SAMPLE), "--db", str(tmp_path / "d.duckdb")]
    assert main([*base, "--sink", "kafka:t"]) == 2  # the device runner has --tunnel kafka instead
    assert main([*base, "--runner", "flink", "--sink", "parquet:out/"]) == 2
    assert main([*base, "--runner", "flink", "--sink", "s3:bucket"]) == 2
    err = capsys.readouterr().err
    assert "--sink is the flink runner's" in err and "unknown sink" in err
    assert "parquet:DIR needs the output columns of every shipped task: task 'ipv' declares none" in err
