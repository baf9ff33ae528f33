"""``streamflow tunnel consume --metrics-port``: scraped over HTTP during a real run on the session's broker, parsed
with prometheus_client's parser; the counters equal the consumer's summary line; health and readiness answer."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("kafka")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from connectors.tunnel.keys import KeyRegistry  # noqa: E402
from connectors.tunnel.sink import TunnelSink  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by (name, sorted labels), parsed by prometheus_client."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_for(predicate, timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_consumer_metrics_match_its_summary_line(tmp_path, kafka_bootstrap):
    topic = f"test.metrics.{uuid.uuid4().hex[:10]}"
    registry = KeyRegistry(tmp_path / "keys.json")
    key = registry.add("phone-1")
    port = free_port()
    env = {**os.environ, "STREAMFLOW_KAFKA_BOOTSTRAP": kafka_bootstrap, "STREAMFLOW_KEY_REGISTRY": str(registry.path),
           "PYTHONPATH": str(ROOT)}
    consumer = subprocess.Popen(
        [sys.executable, "-m", "streamflow.cli", "tunnel", "consume", "--db", str(tmp_path / "cloud.duckdb"),
         "--topic", topic, "--idle-timeout", "4", "--metrics-port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def answers() -> bool:
            assert consumer.poll() is None, consumer.communicate()[1]
            try:
                return get(base + "/healthz")[0] == 200
            except OSError:
                return False

        wait_for(answers, what="/healthz")
        wait_for(lambda: get(base + "/readyz")[0] == 200, what="/readyz (partitions assigned)")
        sink = TunnelSink("phone-1", key, tmp_path / "spool", topic=topic, bootstrap=kafka_bootstrap, batch_rows=50)
        for i in range(600):
            sink.write("ipv" if i % 2 else "favs", [{"user_id": f"u{i % 9}", "i": i}])
        assert sink.close(timeout_s=30)
        from kafka import KafkaProducer

        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
        producer.send(topic, value=b"not an envelope").get(timeout=10)  # one dead letter
        producer.close()

        def stored_everything() -> bool:
            got = samples(get(base + "/metrics")[1])
            return got.get(("streamflow_cloud_rows_stored_total", ())) == 600 and \
                got.get(("streamflow_cloud_dead_letters_total", (("reason", "garbage"),))) == 1

        wait_for(stored_everything, what="600 rows and a dead letter on /metrics")
        status, text = get(base + "/metrics")  # the last scrape, while the consumer still runs
        assert status == 200
    finally:
        out, err = consumer.communicate(timeout=60)
    assert consumer.returncode == 0, err
    summary = re.search(r"cloud: (\d+) messages, (\d+) rows stored, (\d+) duplicates dropped, (\d+) dead letters",
                        out)
    assert summary, out
    messages, stored, duplicates, dead = map(int, summary.groups())
    got = samples(text)
    assert got[("streamflow_cloud_messages_total", ())] == messages == sink.stats.batches_acked + 1
    assert got[("streamflow_cloud_rows_stored_total", ())] == stored == 600
    assert got[("streamflow_cloud_duplicate_rows_total", ())] == duplicates == 0
    assert sum(v for (name, _), v in got.items() if name == "streamflow_cloud_dead_letters_total") == dead == 1
    assert got[("streamflow_cloud_sequence_gaps_total", (("outcome", "lost"),))] == 0
    # every envelope's seal → stored was observed, and every transaction that stored them
    assert got[("streamflow_cloud_end_to_end_latency_seconds_count", ())] == sink.stats.batches_acked
    assert got[("streamflow_cloud_store_transaction_seconds_count", ())] >= 1
    lag = {labels: v for (name, labels), v in got.items() if name == "streamflow_cloud_consumer_lag_messages"}
    assert lag and set(lag.values()) == {0}  # everything stored
    assert "phone-1" not in text  # never a device id as a label


def test_metrics_port_without_the_metrics_extra_is_one_line_naming_it(tmp_path):
    code = ("import sys; sys.modules['prometheus_client'] = None; from streamflow.cli import main; "
            f"sys.exit(main(['tunnel', 'consume', '--db', {str(tmp_path / 'c.duckdb')!r}, '--metrics-port', '0']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2
    assert "pip install 'streamflow[metrics]'" in done.stderr and len(done.stderr.strip().splitlines()) == 1
