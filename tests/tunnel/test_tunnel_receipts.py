"""End-to-end acknowledgement (issue 25, the second line of defence), on the real broker (noida-db), no mocks.

The broker loses records it acknowledged (SIGKILL before it wrote them; its data dir rolled back; the topic
deleted and made again): the device keeps every batch until the cloud's receipt covers it and resends what the
cloud lacks, so every row acknowledged to the application is in the cloud exactly once. A gap nobody can fill (the
device's spool deleted) is reported lost, and the receipts keep naming it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path

import duckdb
import pytest

pytest.importorskip("kafka")

from kafka import KafkaConsumer, TopicPartition  # noqa: E402
from kafka.admin import KafkaAdminClient, NewTopic  # noqa: E402
from kafka.errors import TopicAlreadyExistsError  # noqa: E402

from connectors.tunnel.cloud import CloudConsumer  # noqa: E402
from connectors.tunnel.kafka import CLIENT_TIMEOUTS  # noqa: E402
from connectors.tunnel.keys import KeyRegistry  # noqa: E402
from connectors.tunnel.sink import TunnelSink  # noqa: E402
from tests.kafka_broker import LocalBroker  # noqa: E402

ROWS = 10_000
CHUNK = 50


def _rows(start: int, n: int) -> list[dict]:
    return [{"user_id": f"u{i % 10:04d}", "i": i} for i in range(start, start + n)]


class _Cloud:
    """A cloud consumer polled by a thread of its own until :meth:`stop`; ``paused`` holds its polling."""

    def __init__(self, db: Path, registry: KeyRegistry, topic: str, bootstrap: str, gap_wait_s: float = 120.0):
        self.consumer = CloudConsumer(db, registry, topic=topic, bootstrap=bootstrap,
                                      group_id=f"g-{uuid.uuid4().hex}", gap_wait_s=gap_wait_s)
        self.paused = threading.Event()
        self._idle = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.paused.is_set():
                self._idle.set()
                time.sleep(0.05)
                continue
            self._idle.clear()
            try:
                self.consumer.poll_once(0.1)
            except Exception:  # noqa: BLE001 - the broker was killed: reconnect, as CloudConsumer.run does
                self.consumer._reset()
                time.sleep(0.2)

    def pause(self) -> None:
        """Stop polling (returns once the poll under way, if any, is done)."""
        self.paused.set()
        self._idle.wait(30)

    def wait_stored(self, rows: int, max_s: float) -> None:
        deadline = time.monotonic() + max_s
        while self.consumer.stats.stored < rows and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.consumer.close()


def _stored(db: Path) -> list[tuple[int, int]]:
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute("SELECT seq, i FROM ipv ORDER BY seq").fetchall()


def _write(sink: TunnelSink, start: int, end: int, pause_s: float = 0.005) -> None:
    for first in range(start, end, CHUNK):
        sink.write("ipv", _rows(first, min(CHUNK, end - first)))
        time.sleep(pause_s)


def _wait_acked(sink: TunnelSink, rows: int, max_s: float = 60.0) -> None:
    deadline = time.monotonic() + max_s
    sink.flush()
    while sink.stats.rows_acked < rows and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.stats.rows_acked >= rows, f"the broker acknowledged only {sink.stats.rows_acked} of {rows} rows"


def _kill(broker: LocalBroker) -> None:
    os.kill(broker.pid(), signal.SIGKILL)
    while broker.listening():
        time.sleep(0.02)


def _audit(db: Path, acked: set[int]) -> None:
    stored = _stored(db)
    seqs = [seq for seq, _ in stored]
    assert len(seqs) == len(set(seqs)), "a row was stored twice"
    missing = acked - set(seqs)
    assert not missing, f"{len(missing)} acknowledged rows are not in the cloud (seq {min(missing)}..{max(missing)})"
    assert all(seq == i for seq, i in stored)  # one device writing rows i = 0.. in order: seq is i


@pytest.mark.slow
def test_broker_killed_three_times_and_rolled_back_once_loses_no_acknowledged_row(tmp_path, private_broker):
    """SIGKILL three times mid-run (noida-db loses its last acknowledged records), then once more with its data
    dir rolled back to the copy taken at the second kill (every record since is gone, its offsets handed to new
    ones): every acknowledged row is in the cloud exactly once."""
    broker = private_broker
    registry = KeyRegistry(tmp_path / "keys.json")
    topic, db, acked = f"receipts.{uuid.uuid4().hex[:12]}", tmp_path / "cloud.duckdb", set()
    cloud = _Cloud(db, registry, topic, broker.bootstrap)
    sink = TunnelSink("phone-1", registry.add("phone-1"), tmp_path / "spool", topic=topic, bootstrap=broker.bootstrap,
                      linger_s=0.01, batch_rows=CHUNK, send_timeout_s=2.0,
                      on_ack=lambda e: acked.update(range(e.first_seq, e.first_seq + e.n_rows)))
    snapshot = tmp_path / "broker-at-kill-2"
    try:
        for n, at in enumerate((2000, 4000, 6000, 8000), start=1):
            cloud.pause()  # the cloud lags: what the broker loses now it never read
            _write(sink, at - 2000, at)
            _wait_acked(sink, at)  # the broker acknowledged them; killed now, it loses the last of them
            _kill(broker)
            if n == 2:
                shutil.copytree(broker.data_dir, snapshot)
            if n == 4:
                shutil.rmtree(broker.data_dir)
                shutil.copytree(snapshot, broker.data_dir)
            time.sleep(1.0)
            broker.up()
            cloud.paused.clear()
        _write(sink, 8000, ROWS)
        _wait_acked(sink, ROWS)
        cloud.wait_stored(ROWS, max_s=60)
        time.sleep(1.0)  # a repeat stored now would show in the audit
    finally:
        sink.close(timeout_s=5)
        cloud.stop()
    assert len(acked) == ROWS
    _audit(db, acked)
    # the faults were real: the rolled-back broker lost what it had acknowledged since the second kill
    assert sink.stats.rows_resent >= 2000 and cloud.consumer.stats.gaps["noticed"] >= 1


def test_a_topic_deleted_and_made_again_mid_run_loses_no_acknowledged_row(tmp_path, kafka_bootstrap):
    """The topic is deleted while the cloud lags behind (every acknowledged batch it had not read is gone) and made
    again: the device resends what the cloud lacks."""
    registry = KeyRegistry(tmp_path / "keys.json")
    topic, db, acked = f"receipts.{uuid.uuid4().hex[:12]}", tmp_path / "cloud.duckdb", set()
    cloud = _Cloud(db, registry, topic, kafka_bootstrap)
    sink = TunnelSink("phone-1", registry.add("phone-1"), tmp_path / "spool", topic=topic, bootstrap=kafka_bootstrap,
                      linger_s=0.01, batch_rows=CHUNK, send_timeout_s=2.0,
                      on_ack=lambda e: acked.update(range(e.first_seq, e.first_seq + e.n_rows)))
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, **CLIENT_TIMEOUTS)
    try:
        _write(sink, 0, 3000)
        _wait_acked(sink, 3000)
        cloud.wait_stored(3000, max_s=30)
        cloud.pause()  # the cloud falls behind
        _write(sink, 3000, 6000)
        _wait_acked(sink, 6000)
        admin.delete_topics([topic])
        deadline = time.monotonic() + 10
        while topic in admin.list_topics() and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(TopicAlreadyExistsError):  # a producer's metadata request made it first
            admin.create_topics([NewTopic(topic, num_partitions=4, replication_factor=1)])
        cloud.paused.clear()
        _write(sink, 6000, ROWS)
        _wait_acked(sink, ROWS)
        cloud.wait_stored(ROWS, max_s=60)
        time.sleep(1.0)
    finally:
        admin.close()
        sink.close(timeout_s=5)
        cloud.stop()
    assert len(acked) == ROWS
    _audit(db, acked)
    assert sink.stats.rows_resent >= 3000  # what the deleted topic held and the cloud had not read
    assert sink.stats.offsets_reused == 1  # the device saw the partition start again, no send having failed


@pytest.mark.slow
def test_a_receipts_topic_lost_with_the_broker_is_followed_where_it_is_made_again(tmp_path, private_broker):
    """The broker goes down having lost the receipts topic (deleted here before the kill; noida-db loses a topic
    made in its last second the same way) and the cloud's next receipt makes it again as the broker makes a topic
    nobody created: one partition, so this device's receipts land on another partition than the one it read. After
    the outage the device looks its partition up again and reads the receipts within seconds, not at its next
    probe (``receipt_timeout_s`` 30 s here)."""
    broker = private_broker
    registry = KeyRegistry(tmp_path / "keys.json")
    topic, db = f"receipts.{uuid.uuid4().hex[:12]}", tmp_path / "cloud.duckdb"
    device = "phone-1"  # on partition 3 of the receipts topic's four; on 0 once it has one
    cloud = _Cloud(db, registry, topic, broker.bootstrap)
    sink = TunnelSink(device, registry.add(device), tmp_path / "spool", topic=topic, bootstrap=broker.bootstrap,
                      linger_s=0.01, batch_rows=CHUNK, send_timeout_s=2.0, receipt_timeout_s=30.0)
    try:
        _write(sink, 0, 1000)
        assert sink.wait_receipted(30), "the first receipts never came"
        cloud.pause()
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, **CLIENT_TIMEOUTS)
        try:
            admin.delete_topics([f"{topic}.receipts"])
        finally:
            admin.close()
        time.sleep(1.5)  # noida-db writes its state about once a second: the deletion survives the kill
        _kill(broker)
        _write(sink, 1000, 1500)
        time.sleep(3.0)  # past send_timeout_s: the sender fails while the broker is down, and sees it answer again
        broker.up()
        cloud.paused.clear()
        _wait_acked(sink, 1500)
        assert sink.wait_receipted(15), (f"no receipt read since the outage: {sink.spool.rows_held} rows wait for "
                                         f"one; the cloud stored {cloud.consumer.stats.stored} rows and published "
                                         f"{cloud.consumer.receipts.published} receipts")
        consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap, **CLIENT_TIMEOUTS)
        try:
            assert consumer.partitions_for_topic(f"{topic}.receipts") == {0}  # the case tested
        finally:
            consumer.close()
    finally:
        sink.close(timeout_s=5)
        cloud.stop()
    assert [seq for seq, _ in _stored(db)] == list(range(1500))


def _receipt_values(bootstrap: str, topic: str, devices: tuple[str, ...] = ("phone-1",)) -> list[bytes]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                             consumer_timeout_ms=2000, **CLIENT_TIMEOUTS)
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        consumer.assign([TopicPartition(topic, p) for p in partitions])
        return [m.value for m in consumer if m.key.decode() in devices]
    finally:
        consumer.close()


def test_a_gap_nobody_can_fill_is_reported_lost_and_the_receipts_keep_naming_it(tmp_path, kafka_bootstrap):
    """The broker drops acknowledged batches before the lagging cloud read them (retention: the log's start moved
    past them), and the device is gone with its spool: the cloud stores the rest, reports the gap lost after
    gap_wait_s instead of waiting for ever, and its receipts say those numbers are missing (a device that still
    held them would resend them), not stored."""
    from connectors.tunnel.receipts import decode_receipt, receipts_topic

    registry = KeyRegistry(tmp_path / "keys.json")
    key = registry.add("phone-1")
    topic, db = f"receipts.{uuid.uuid4().hex[:12]}", tmp_path / "cloud.duckdb"
    cloud = _Cloud(db, registry, topic, kafka_bootstrap, gap_wait_s=2.0)
    sink = TunnelSink("phone-1", key, tmp_path / "spool", topic=topic, bootstrap=kafka_bootstrap, linger_s=0.01,
                      batch_rows=100, send_timeout_s=2.0)
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, **CLIENT_TIMEOUTS)
    try:
        _write(sink, 0, 300)
        _wait_acked(sink, 300)
        cloud.wait_stored(300, max_s=30)
        cloud.pause()
        _write(sink, 300, 600)
        _wait_acked(sink, 600)
        ends = _end_offsets(kafka_bootstrap, topic)
        admin.delete_records(ends)  # 300..599 (and the stored 0..299) gone from the broker
        _write(sink, 600, 900)
        _wait_acked(sink, 900)
    finally:
        admin.close()
        sink.close(timeout_s=5)
    for leftover in tmp_path.glob("spool*"):  # the device is gone with its spool: nobody holds 300..599
        leftover.unlink()
    cloud.paused.clear()
    started = time.monotonic()
    try:
        cloud.wait_stored(600, max_s=30)
        while not cloud.consumer.stats.gaps["lost"] and time.monotonic() - started < 30:
            time.sleep(0.1)
        reported_s = time.monotonic() - started
        time.sleep(0.5)  # the receipt after the loss
    finally:
        cloud.stop()
    assert cloud.consumer.stats.gaps["lost"] == 1 and cloud.consumer.stats.rows_lost == 300, "the gap was not reported"
    assert reported_s < 15
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT from_seq, to_seq, outcome, missing_rows FROM tunnel.gaps").fetchall() == [
            (300, 600, "lost", 300)]
    assert [seq for seq, _ in _stored(db)] == [*range(300), *range(600, 900)]
    receipts = [decode_receipt(v, "phone-1", key) for v in _receipt_values(kafka_bootstrap, receipts_topic(topic))]
    newest = receipts[-1]
    assert (newest.stored_mark, newest.seen_end, newest.holes) == (300, 900, ((300, 600),))


def test_envelopes_parked_for_a_lost_schema_are_opened_once_the_receipt_asks_the_device_to_announce(
        tmp_path, kafka_bootstrap):
    """The cloud's registry is wiped between two consumer runs (the schema's announcement went with it, and the
    device announces on its own only every ``announce_every_s``): the next envelopes are parked as
    ``unknown_schema``; the receipt says ``announce``, the device sends its registrations again in a zero-row
    envelope, and the cloud opens the parked envelopes: every row stored, none twice, nothing left parked."""
    registry = KeyRegistry(tmp_path / "keys.json")
    topic, db = f"receipts.{uuid.uuid4().hex[:12]}", tmp_path / "cloud.duckdb"
    sink = TunnelSink("phone-1", registry.add("phone-1"), tmp_path / "spool", topic=topic, bootstrap=kafka_bootstrap,
                      linger_s=0.01, batch_rows=CHUNK, send_timeout_s=2.0, announce_every_s=3600.0)
    try:
        cloud = _Cloud(db, registry, topic, kafka_bootstrap)
        try:
            _write(sink, 0, 500)
            assert sink.wait_receipted(30), "the first cloud run did not confirm the first rows"
        finally:
            cloud.stop()
        with duckdb.connect(str(db)) as con:
            con.execute("DELETE FROM tunnel.registry")
        _write(sink, 500, 1000)
        _wait_acked(sink, 1000)
        cloud = _Cloud(db, registry, topic, kafka_bootstrap)
        try:
            assert sink.wait_receipted(30), "the parked envelopes were never opened"
        finally:
            cloud.stop()
    finally:
        sink.close(timeout_s=5)
    assert sink.stats.announcements >= 1
    _audit(db, set(range(1000)))
    assert len(_stored(db)) == 1000
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM tunnel.dead_letter WHERE reason = 'unknown_schema' "
                           "AND resolved_at IS NULL").fetchone() == (0,)
        assert con.execute("SELECT count(*) FROM tunnel.dead_letter WHERE reason = 'unknown_schema'").fetchone()[0] > 0


def _end_offsets(bootstrap: str, topic: str) -> dict[TopicPartition, int]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, **CLIENT_TIMEOUTS)
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        return {tp: end for tp, end in consumer.end_offsets(partitions).items() if end}
    finally:
        consumer.close()


def test_a_reader_that_runs_and_ends_publishes_every_devices_receipt_with_its_holes(tmp_path, kafka_bootstrap):
    """What the Flink reader does when its job ended (``publish_receipts``): a receipt per device the store holds,
    signed with that device's key, naming what it lacks."""
    import pyarrow as pa

    from connectors.tunnel.cloud import CloudStore, publish_receipts
    from connectors.tunnel.envelope import Batch
    from connectors.tunnel.receipts import decode_receipt, receipts_topic

    registry = KeyRegistry(tmp_path / "keys.json")
    keys = {d: registry.add(d) for d in ("phone-1", "phone-2")}
    topic = f"receipts.{uuid.uuid4().hex[:12]}"
    rows = pa.table({"user_id": ["u1", "u2"], "i": [1, 2]})
    with CloudStore(tmp_path / "cloud.duckdb") as store:
        store.apply([Batch("phone-1", "ipv", 0, rows), Batch("phone-1", "ipv", 4, rows),
                     Batch("phone-2", "ipv", 0, rows)])
    with CloudStore(tmp_path / "cloud.duckdb") as store:  # a new process: the ledger comes from the tables
        assert publish_receipts(store, topic, registry, kafka_bootstrap) == 2
    published = {}
    for value in _receipt_values(kafka_bootstrap, receipts_topic(topic), devices=tuple(keys)):
        for device, key in keys.items():
            published[device] = decode_receipt(value, device, key) or published.get(device)
    assert {d: (r.stored_mark, r.seen_end, r.holes) for d, r in published.items()} == {
        "phone-1": (2, 6, ((2, 4),)), "phone-2": (2, 2, ())}


def test_a_batch_lost_at_the_end_is_resent_after_the_receipt_timeout(tmp_path, kafka_bootstrap, caplog):
    """The broker drops the last acknowledged batches before the cloud read them and nothing follows them, so no
    receipt shows a hole: the device probes after its receipt timeout (the newest batch again), the cloud then sees
    the hole and the device fills it."""
    registry = KeyRegistry(tmp_path / "keys.json")
    topic, db = f"receipts.{uuid.uuid4().hex[:12]}", tmp_path / "cloud.duckdb"
    cloud = _Cloud(db, registry, topic, kafka_bootstrap)
    sink = TunnelSink("phone-1", registry.add("phone-1"), tmp_path / "spool", topic=topic, bootstrap=kafka_bootstrap,
                      linger_s=0.01, batch_rows=100, send_timeout_s=2.0, receipt_timeout_s=1.0)
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, **CLIENT_TIMEOUTS)
    try:
        _write(sink, 0, 300)
        _wait_acked(sink, 300)
        cloud.wait_stored(300, max_s=30)
        assert sink.wait_receipted(10), "the cloud's receipt never covered what it stored"
        cloud.pause()
        _write(sink, 300, 600)
        _wait_acked(sink, 600)
        admin.delete_records(_end_offsets(kafka_bootstrap, topic))  # 300..599 gone before the cloud read them
        cloud.paused.clear()
        started = time.monotonic()
        assert sink.wait_receipted(30), f"{sink.spool.rows_held} rows never confirmed"
        took = time.monotonic() - started
    finally:
        admin.close()
        sink.close(timeout_s=5)
        cloud.stop()
    assert [seq for seq, _ in _stored(db)] == list(range(600))
    assert sink.stats.rows_resent >= 300 and took < 15
    assert "acknowledged more than 1 s ago" in caplog.text  # the probe, then the hole it showed


def test_at_its_bound_the_spool_evicts_acknowledged_unconfirmed_batches_oldest_first(tmp_path, caplog):
    from connectors.tunnel.spool import Spool, SpoolFull

    spool = Spool(tmp_path / "spool", max_bytes=100, keep_acked=True)
    for _ in range(4):
        spool.seal("ipv", 5, lambda first_seq: b"x" * 25)
    spool.ack(0)
    spool.ack(5)
    with caplog.at_level("WARNING", logger="streamflow.tunnel"):
        assert spool.seal("ipv", 5, lambda first_seq: b"y" * 30) == 20  # 30 bytes: two acknowledged batches go
    assert [e.first_seq for e in spool.oldest(10)] == [10, 15, 20] and spool.acked() == []
    assert (spool.rows_evicted, spool.batches_evicted, spool.bytes_held) == (10, 2, 80)
    assert "evicted 10 rows (seq 0..9" in caplog.text
    with pytest.raises(SpoolFull):  # nothing the broker has not acknowledged is ever dropped
        spool.seal("ipv", 5, lambda first_seq: b"z" * 25)
    spool.close()
