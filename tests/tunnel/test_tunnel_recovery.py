"""The tunnel recovers within bounds, on a real broker (noida-db), no mocks (issue 10, defects 8, 9, 11, 12, 13).

A stalled broker never holds rows back from the spool; two processes cannot share a spool; the device's
sender and the cloud consumer give up with a clear error instead of retrying forever, keeping what they
did not deliver; a killed consumer's successor resumes within seconds; a consumer's idle time counts
from its last record.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("kafka")

from connectors.tunnel.cloud import CloudConsumer  # noqa: E402
from connectors.tunnel.kafka import TunnelUnavailable  # noqa: E402
from connectors.tunnel.keys import KeyRegistry  # noqa: E402
from connectors.tunnel.sink import TunnelSink  # noqa: E402
from connectors.tunnel.spool import Spool, SpoolLocked  # noqa: E402
from tests.kafka_broker import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _topic() -> str:
    return f"recovery.{uuid.uuid4().hex[:12]}"


def _rows(start: int, n: int) -> list[dict]:
    return [{"user_id": f"u{i % 10}", "i": i} for i in range(start, start + n)]


def _kafka_threads() -> int:
    return sum(1 for t in threading.enumerate() if "kafka" in t.name.lower())


# -- defect 11 (and 9): a stalled broker never holds rows back from the spool -----------------------
def test_rows_are_sealed_within_the_linger_while_the_broker_stalls(tmp_path, private_broker):
    registry = KeyRegistry(tmp_path / "keys.json")
    topic = _topic()
    sink = TunnelSink("phone-1", registry.add("phone-1"), tmp_path / "spool", topic=topic,
                      bootstrap=private_broker.bootstrap, linger_s=0.01, send_timeout_s=3.0)
    broker_pid = private_broker.pid()
    try:
        sink.write("ipv", _rows(0, 10))
        assert sink.wait_delivered(20)
        threads_before = _kafka_threads()
        os.kill(broker_pid, signal.SIGSTOP)  # the broker stalls: connections open, no answers
        try:
            sink.write("ipv", _rows(10, 10))  # sealed, sent, then the sender waits for an ack that never comes
            time.sleep(0.3)
            sink.write("ipv", _rows(20, 10))
            deadline = time.monotonic() + 1.0  # 100 lingers; today's code sealed them after send_timeout_s
            while sink.stats.rows_sealed < 30 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert sink.stats.rows_sealed == 30, "rows waited in memory behind a send to a stalled broker"
            assert sink.spool.rows_pending == 20
            time.sleep(3.5)  # past the delivery timeout: the batch in flight expires, the producer is replaced
        finally:
            os.kill(broker_pid, signal.SIGCONT)
        assert sink.wait_delivered(30), f"{sink.spool.rows_pending} rows not delivered after the stall"
        assert sink.stats.send_failures >= 1 and sink.stats.rows_acked == 30
        # the replaced producers were closed with public calls and left no I/O thread behind
        assert _kafka_threads() <= threads_before
    finally:
        sink.close(timeout_s=10)


def test_the_sink_calls_no_private_kafka_api():
    sources = [(path.name, path.read_text()) for path in (ROOT / "connectors" / "tunnel").glob("*.py")]
    assert [name for name, text in sources if "force_close" in text or "._sender" in text] == []


# -- defect 12: one process per spool ------------------------------------------------------------
def test_a_second_process_on_one_spool_gets_a_clear_error_at_start(tmp_path):
    spool = tmp_path / "spool"
    first = Spool(spool)
    second = subprocess.run([sys.executable, "-c", (
        "import sys\nfrom connectors.tunnel.sink import TunnelSink\n"
        f"TunnelSink('phone-1', b'k' * 32, {str(spool)!r}, bootstrap='127.0.0.1:{free_port()}')")],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert second.returncode != 0
    assert "SpoolLocked" in second.stderr and f"in use by another process (pid {os.getpid()})" in second.stderr
    with pytest.raises(SpoolLocked):
        Spool(spool)  # a second open in the same process too
    first.seal("ipv", 1, lambda seq: b"x")
    first.close()
    again = Spool(spool)  # free once the holder closed it (or died)
    assert again.rows_pending == 1
    again.close()


# -- defect 8: retry loops give up ---------------------------------------------------------------
def test_the_sender_gives_up_with_a_clear_error_and_the_rows_stay_spooled(tmp_path):
    bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens
    sink = TunnelSink("phone-1", b"k" * 32, tmp_path / "spool", topic=_topic(), bootstrap=bootstrap,
                      linger_s=0.01, send_timeout_s=2.0, retry_for_s=2.0)
    sink.write("ipv", _rows(0, 5))
    deadline = time.monotonic() + 30
    while sink.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sink.error is not None, "the sender is still retrying"
    message = str(sink.error)
    assert bootstrap in message and "giving up" in message and "5 rows in 1 batches stay in the spool" in message
    with pytest.raises(TunnelUnavailable, match="giving up"):
        sink.write("ipv", _rows(5, 1))
    assert not sink.close(timeout_s=1)
    kept = Spool(tmp_path / "spool")
    assert (kept.rows_pending, kept.batches_pending) == (5, 1)
    kept.close()


def test_the_consumer_gives_up_with_a_clear_error(tmp_path):
    bootstrap = f"127.0.0.1:{free_port()}"
    consumer = CloudConsumer(tmp_path / "cloud.duckdb", KeyRegistry(tmp_path / "keys.json"), topic=_topic(),
                             bootstrap=bootstrap)
    started = time.monotonic()
    try:
        with pytest.raises(TunnelUnavailable, match=f"cloud consumer of .* on {bootstrap}: failed .* giving up"):
            consumer.run(retry_for_s=2.0, max_s=60)
    finally:
        consumer.close()
    assert time.monotonic() - started < 30


# -- defect 13: the consumer after a crash -------------------------------------------------------
_CONSUMER = r"""
import sys
from connectors.tunnel.cloud import CloudConsumer
from connectors.tunnel.keys import KeyRegistry

db, keys, topic, bootstrap, group = sys.argv[1:]
consumer = CloudConsumer(db, KeyRegistry(keys), topic=topic, bootstrap=bootstrap, group_id=group)
while True:  # until SIGKILL
    consumer.poll_once(0.5)
    print(consumer.stats.stored, flush=True)
"""


def test_a_consumer_killed_mid_poll_is_replaced_by_one_that_resumes_within_seconds(tmp_path, kafka_bootstrap):
    registry = KeyRegistry(tmp_path / "keys.json")
    topic, group, db = _topic(), f"g-{uuid.uuid4().hex}", tmp_path / "cloud.duckdb"
    sink = TunnelSink("phone-1", registry.add("phone-1"), tmp_path / "spool", topic=topic,
                      bootstrap=kafka_bootstrap, linger_s=0.01)
    try:
        sink.write("ipv", _rows(0, 100))
        assert sink.wait_delivered(20)
        killed = subprocess.Popen([sys.executable, "-c", _CONSUMER, str(db), str(registry.path), topic,
                                   kafka_bootstrap, group], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
        try:
            for line in killed.stdout:
                if int(line) >= 100:
                    break
            time.sleep(0.3)  # now it waits in poll() for more
        finally:
            killed.send_signal(signal.SIGKILL)
            killed.wait(10)
        assert killed.returncode == -signal.SIGKILL
        sink.write("ipv", _rows(100, 100))
        assert sink.wait_delivered(20)
    finally:
        sink.close(timeout_s=10)

    successor = CloudConsumer(db, registry, topic=topic, bootstrap=kafka_bootstrap, group_id=group)
    started = time.monotonic()
    try:
        while successor.stats.stored < 100 and time.monotonic() - started < 30:
            successor.poll_once(0.2)
        resumed_s = time.monotonic() - started
        assert successor.stats.stored == 100, f"the successor stored {successor.stats.stored} rows in {resumed_s:.0f} s"
        assert resumed_s < 30
        assert successor.store.query("SELECT min(i), max(i), count(*) FROM ipv") == [(0, 199, 200)]
    finally:
        successor.close()


def test_idle_time_counts_from_the_last_record_not_from_the_start(tmp_path, private_broker):
    registry = KeyRegistry(tmp_path / "keys.json")
    topic = _topic()
    sink = TunnelSink("phone-1", registry.add("phone-1"), tmp_path / "spool", topic=topic,
                      bootstrap=private_broker.bootstrap, linger_s=0.01)
    sink.write("ipv", _rows(0, 50))
    assert sink.close(timeout_s=20)
    private_broker.down()  # the records wait on the broker, which is away when the consumer starts
    consumer = CloudConsumer(tmp_path / "cloud.duckdb", registry, topic=topic, bootstrap=private_broker.bootstrap)
    result: dict = {}
    running = threading.Thread(target=lambda: result.update(stats=consumer.run(idle_timeout_s=1.5, max_s=60)))
    running.start()
    try:
        time.sleep(3.0)  # longer than the idle timeout: today's consumer exits at its first successful poll
        private_broker.up()
        running.join(timeout=60)
    finally:
        consumer.stop()
        running.join(timeout=30)
        consumer.close()
    assert result["stats"].stored == 50
