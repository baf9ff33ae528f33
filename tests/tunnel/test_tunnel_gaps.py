"""Per-device sequence gaps in the cloud (issue 25): noticed when a batch lands past missing numbers, the later
batches stored meanwhile, filled when the missing ones arrive, reported lost after a bounded wait, on the real
broker and the real store."""

from __future__ import annotations

import time
import uuid

import duckdb
import pyarrow as pa
import pytest

pytest.importorskip("kafka")

from kafka import KafkaProducer  # noqa: E402

from connectors.tunnel.cloud import CloudConsumer, CloudStore  # noqa: E402
from connectors.tunnel.envelope import Batch, encode  # noqa: E402
from connectors.tunnel.kafka import CLIENT_TIMEOUTS, ensure_topic  # noqa: E402
from connectors.tunnel.keys import KeyRegistry  # noqa: E402


def _rows(first: int, n: int) -> pa.Table:
    return pa.table({"user_id": [f"u{i}" for i in range(first, first + n)], "n": list(range(first, first + n))})


def _send(bootstrap: str, topic: str, key: bytes, spans: list[tuple[int, int]]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, **CLIENT_TIMEOUTS)
    try:
        for first, n in spans:
            producer.send(topic, value=encode("phone-1", "ipv", first, _rows(first, n), key), partition=0)
        producer.flush(timeout=10)
    finally:
        producer.close()


def _poll_until(consumer: CloudConsumer, until, max_s: float = 15.0) -> None:
    deadline = time.monotonic() + max_s
    while not until(consumer.stats) and time.monotonic() < deadline:
        consumer.poll_once(0.1)


def test_a_gap_is_noticed_filled_when_its_batches_arrive_and_reported_lost_when_they_never_do(tmp_path,
                                                                                            kafka_bootstrap):
    registry, topic = KeyRegistry(tmp_path / "keys.json"), f"gaps.{uuid.uuid4().hex[:12]}"
    key = registry.add("phone-1")
    ensure_topic(kafka_bootstrap, topic, partitions=1)
    db = tmp_path / "cloud.duckdb"
    consumer = CloudConsumer(db, registry, topic=topic, bootstrap=kafka_bootstrap, group_id=f"g-{uuid.uuid4().hex}",
                             partitions=1, gap_wait_s=1.5)
    try:
        _send(kafka_bootstrap, topic, key, [(0, 2), (5, 2)])  # 2..4 missing
        _poll_until(consumer, lambda s: s.stored >= 4)
        assert dict(consumer.stats.gaps) == {"noticed": 1} and consumer.store.ledger.mark("phone-1") == 2
        _send(kafka_bootstrap, topic, key, [(2, 3), (9, 1)])  # the missing ones (a resend), and 7..8 now missing
        _poll_until(consumer, lambda s: s.stored >= 8)
        assert dict(consumer.stats.gaps) == {"noticed": 2, "filled": 1}
        started = time.monotonic()
        _poll_until(consumer, lambda s: s.gaps["lost"] >= 1)  # 7..8 never come: reported, not waited on for ever
        assert time.monotonic() - started < 5
        assert (dict(consumer.stats.gaps), consumer.stats.rows_lost) == ({"noticed": 2, "filled": 1, "lost": 1}, 2)
        assert consumer.store.ledger.mark("phone-1") == 10
    finally:
        consumer.close()
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT seq FROM ipv ORDER BY seq").fetchall() == [(s,) for s in (0, 1, 2, 3, 4, 5, 6, 9)]
        assert con.execute("SELECT device_id, from_seq, to_seq, outcome, missing_rows FROM tunnel.gaps ORDER BY 2"
                           ).fetchall() == [("phone-1", 2, 5, "filled", 0), ("phone-1", 7, 9, "lost", 2)]


def test_a_reopened_store_knows_its_gaps_and_its_lost_numbers(tmp_path):
    db = tmp_path / "c.duckdb"
    with CloudStore(db, gap_wait_s=0) as store:
        store.apply([Batch("phone-1", "ipv", 0, _rows(0, 2)), Batch("phone-1", "ipv", 4, _rows(4, 1))])
        assert [g.outcome for g in store.expire_gaps().gaps] == ["lost"]
        store.apply([Batch("phone-1", "ipv", 7, _rows(7, 1))])  # 5..6 missing, still open at close
    with CloudStore(db, gap_wait_s=60) as store:
        result = store.apply([Batch("phone-1", "ipv", 8, _rows(8, 1))])
        assert result.gaps == [] and store.ledger.mark("phone-1") == 5  # the lost 2..3 passed, 5..6 awaited
        assert [(g.start, g.end) for g in store.ledger.open_gaps()] == [(5, 7)]
        filled = store.apply([Batch("phone-1", "ipv", 5, _rows(5, 2))])
        assert [(g.start, g.outcome) for g in filled.gaps] == [(5, "filled")] and store.ledger.mark("phone-1") == 9
        assert store.query("SELECT from_seq, outcome FROM tunnel.gaps ORDER BY 1") == [(2, "lost"), (5, "filled")]


def test_an_idle_consumer_writes_the_wal_into_the_file_and_a_stream_does_not(tmp_path, kafka_bootstrap):
    """DuckDB's checkpoint stalls the commit that runs it (tenths of a second): the consumer runs it when idle."""
    import numpy as np

    from connectors.tunnel import cloud

    registry, topic = KeyRegistry(tmp_path / "keys.json"), f"ckpt.{uuid.uuid4().hex[:12]}"
    key = registry.add("phone-1")
    ensure_topic(kafka_bootstrap, topic, partitions=1)
    db = tmp_path / "cloud.duckdb"
    consumer = CloudConsumer(db, registry, topic=topic, bootstrap=kafka_bootstrap, group_id=f"g-{uuid.uuid4().hex}",
                             partitions=1)
    wal = tmp_path / "cloud.duckdb.wal"
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(400 * 768, dtype=np.float32)), 768)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, **CLIENT_TIMEOUTS)
    try:
        for first in range(0, 400, 50):
            rows = pa.table({"user_id": [f"u{i}" for i in range(first, first + 50)], "vec": vectors[first:first + 50]})
            producer.send(topic, value=encode("phone-1", "vec", first, rows, key), partition=0)
        producer.flush(timeout=10)
        _poll_until(consumer, lambda s: s.stored >= 400)
        assert wal.stat().st_size > cloud.IDLE_CHECKPOINT_BYTES  # no checkpoint while records flow
        consumer.poll_once(0.1)
        assert wal.stat().st_size > cloud.IDLE_CHECKPOINT_BYTES  # nor right after the last of them
        time.sleep(cloud.IDLE_AFTER_S)
        consumer.poll_once(0.1)  # idle now
        assert not wal.exists() or wal.stat().st_size < cloud.IDLE_CHECKPOINT_BYTES
        assert consumer.store.query("SELECT count(*), max(seq) FROM vec") == [(400, 399)]
    finally:
        producer.close()
        consumer.close()
