"""The compact envelope (format 2) on a real broker (noida-db), no mocks: schemas and dictionaries registered once,
envelopes naming an unknown schema parked and recovered, a trained zstd dictionary end to end, tampering refused,
format-1 envelopes still read. The column codec against Arrow for every type it takes."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("kafka")

from kafka import KafkaConsumer, KafkaProducer  # noqa: E402
from kafka.partitioner import murmur2  # noqa: E402

from connectors.tunnel import columns  # noqa: E402
from connectors.tunnel.cloud import CloudConsumer  # noqa: E402
from connectors.tunnel.codebook import Codebook  # noqa: E402
from connectors.tunnel.envelope import EnvelopeError, decode, encode, encode_v1  # noqa: E402
from connectors.tunnel.kafka import CLIENT_TIMEOUTS, dead_letter_topic, ensure_topic  # noqa: E402
from connectors.tunnel.keys import KeyRegistry  # noqa: E402
from connectors.tunnel.registry import DICTIONARY, SCHEMA, Registry  # noqa: E402
from connectors.tunnel.sink import TunnelSink  # noqa: E402
from connectors.tunnel.spool import Spool  # noqa: E402

FAST = {"linger_s": 0.005, "send_timeout_s": 2.0}
_R, _COMPRESSION_SHIFT = 0x08, 6


def _topic() -> str:
    return f"format.{uuid.uuid4().hex[:12]}"


def _ipv(start: int, n: int) -> list[dict]:
    return [{"user_id": str(100000 + i % 7), "item_id": str(2200475 + 13 * i), "trigger_ts": 1511848908.0 + 30 * i,
             "dwell_s": float(i % 60), "n_cart": i % 3} for i in range(start, start + n)]


def _events(start: int, n: int) -> list[dict]:
    """Text-heavy rows (what an app logs): a dictionary finds their repeated structure."""
    pages = ["home", "item", "cart", "search", "profile"]
    return [{"user_id": f"user-{i % 40:04d}", "page": pages[i % 5],
             "url": f"https://shop.example.com/{pages[i % 5]}/{i % 97}?ref=app&utm_source=push&lang=en-US",
             "agent": "Mozilla/5.0 (Linux; Android 14; Pixel 8) AppleWebKit/537.36 Chrome/126.0 Mobile",
             "i": i} for i in range(start, start + n)]


def _one_per_envelope(sink: TunnelSink, table: str, rows: list[dict]) -> None:
    for row in rows:
        sink.write(table, [row])
        sink.flush()


def _raw(bootstrap: str, topic: str, n: int, timeout_s: float = 20.0) -> list:
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, **CLIENT_TIMEOUTS)
    try:
        out: list = []
        deadline = time.monotonic() + timeout_s
        while len(out) < n and time.monotonic() < deadline:
            for messages in consumer.poll(timeout_ms=300).values():
                out += messages
        return sorted(out, key=lambda m: (m.partition, m.offset))
    finally:
        consumer.close()


def _consume(db, registry: KeyRegistry, topic: str, bootstrap: str, *, until, max_s: float = 30.0) -> CloudConsumer:
    consumer = CloudConsumer(db, registry, topic=topic, bootstrap=bootstrap, group_id=f"g-{uuid.uuid4().hex}")
    try:
        deadline = time.monotonic() + max_s
        while not until(consumer.stats) and time.monotonic() < deadline:
            consumer.poll_once(0.2)
        for _ in range(3):
            consumer.poll_once(0.2)
    finally:
        consumer.close()
    return consumer


# -- schemas registered once ---------------------------------------------------------------------------
def test_the_schema_travels_with_the_first_envelope_only_and_the_cloud_keeps_it(tmp_path, kafka_bootstrap):
    registry, topic = KeyRegistry(tmp_path / "keys.json"), _topic()
    sink = TunnelSink("phone-1", registry.add("phone-1"), tmp_path / "spool", topic=topic, bootstrap=kafka_bootstrap,
                      **FAST)
    _one_per_envelope(sink, "ipv", _ipv(0, 6))
    assert sink.close(timeout_s=20) and sink.stats.batches_acked == 6
    messages = _raw(kafka_bootstrap, topic, 6)
    assert [bool(m.value[1] & _R) for m in messages] == [True] + [False] * 5
    assert all(m.key is None for m in messages)  # the envelope names its device; the partition is the device's
    reader = KafkaConsumer(bootstrap_servers=kafka_bootstrap, **CLIENT_TIMEOUTS)
    partitions = sorted(reader.partitions_for_topic(topic))
    reader.close()
    assert {m.partition for m in messages} == {partitions[(murmur2(b"phone-1") & 0x7FFFFFFF) % len(partitions)]}
    first, later = len(messages[0].value), [len(m.value) for m in messages[1:]]
    assert max(later) < 90 < first, (first, later)  # the schema costs its bytes once
    with pytest.raises(EnvelopeError, match="unknown_schema"):
        decode(messages[1].value, registry)  # the second envelope cannot be read alone: it names its schema

    consumer = _consume(tmp_path / "cloud.duckdb", registry, topic, kafka_bootstrap, until=lambda s: s.stored >= 6)
    assert (consumer.stats.stored, consumer.stats.dead_total, consumer.stats.registered) == (6, 0, 1)
    with duckdb.connect(str(tmp_path / "cloud.duckdb"), read_only=True) as con:
        assert con.execute("SELECT device_id, kind FROM tunnel.registry").fetchall() == [("phone-1", SCHEMA)]
        assert con.execute("SELECT seq, item_id, dwell_s FROM ipv ORDER BY seq").fetchall() == [
            (i, str(2200475 + 13 * i), float(i)) for i in range(6)]


def test_a_reconnected_sender_announces_the_schema_again(tmp_path, private_broker):
    registry, topic, bootstrap = KeyRegistry(tmp_path / "keys.json"), _topic(), private_broker.bootstrap
    sink = TunnelSink("phone-1", registry.add("phone-1"), tmp_path / "spool", topic=topic, bootstrap=bootstrap, **FAST)
    _one_per_envelope(sink, "ipv", _ipv(0, 3))
    assert sink.wait_delivered(20)
    private_broker.down()
    sink.write("ipv", _ipv(3, 1))  # sealed, then its send fails: the producer is dropped
    deadline = time.monotonic() + 20
    while sink.stats.send_failures == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sink.stats.send_failures >= 1
    _one_per_envelope(sink, "ipv", _ipv(4, 2))  # sealed after the reconnect began: the first announces again
    private_broker.up()
    assert sink.close(timeout_s=30)
    announced = [bool(m.value[1] & _R) for m in _raw(bootstrap, topic, 6)]
    assert announced[:4] == [True, False, False, False] and announced[4:] == [True, False], announced


# -- unknown schema: dead letter, then recovery ------------------------------------------------------------
def test_envelopes_of_an_unknown_schema_are_parked_counted_and_stored_once_the_schema_arrives(tmp_path,
                                                                                             kafka_bootstrap):
    """The cloud misses the envelope that announced the schema (a truncated topic, a wiped registry): the
    envelopes after it are dead letters ``unknown_schema``, counted and on the DLQ; the device's next session
    announces the schema again and the parked rows are stored, each once."""
    registry, topic = KeyRegistry(tmp_path / "keys.json"), _topic()
    key = registry.add("phone-1")
    ensure_topic(kafka_bootstrap, topic, partitions=1)
    sink = TunnelSink("phone-1", key, tmp_path / "spool", topic=topic, bootstrap=kafka_bootstrap, partitions=1, **FAST)
    _one_per_envelope(sink, "ipv", _ipv(0, 10))
    assert sink.close(timeout_s=20)

    db = tmp_path / "cloud.duckdb"
    with duckdb.connect(str(db)) as con:  # the cloud starts after the first message, as if the topic lost it
        con.execute("CREATE TABLE tunnel_offsets (topic VARCHAR, kafka_partition INTEGER, next_offset BIGINT)")
        con.execute("INSERT INTO tunnel_offsets VALUES (?, 0, 1)", [topic])
    first = _consume(db, registry, topic, kafka_bootstrap, until=lambda s: s.messages >= 9)
    assert (first.stats.messages, first.stats.stored, first.stats.dead) == (9, 0, Counter(unknown_schema=9))
    dlq = _raw(kafka_bootstrap, dead_letter_topic(topic), 9)
    assert [dict(m.headers)["reason"] for m in dlq] == [b"unknown_schema"] * 9

    sink = TunnelSink("phone-1", key, tmp_path / "spool", topic=topic, bootstrap=kafka_bootstrap, partitions=1, **FAST)
    _one_per_envelope(sink, "ipv", _ipv(10, 2))  # a new session: its first envelope announces the schema
    assert sink.close(timeout_s=20)
    second = _consume(db, registry, topic, kafka_bootstrap, until=lambda s: s.stored >= 11)
    assert (second.stats.stored, second.stats.resolved, second.stats.dead_total) == (11, 9, 0)
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT seq FROM ipv ORDER BY seq").fetchall() == [(s,) for s in range(1, 12)]
        assert con.execute("SELECT count(*), count(resolved_at) FROM tunnel.dead_letter").fetchone() == (9, 9)
        assert con.execute("SELECT user_id, seq FROM ipv_online ORDER BY user_id").fetchall() == [
            (str(100000 + u), max(s for s in range(1, 12) if s % 7 == u)) for u in range(7)]
    # nothing is parked any more: a third consumer stores nothing twice
    third = _consume(db, registry, topic, kafka_bootstrap, until=lambda s: False, max_s=1)
    assert (third.stats.stored, third.stats.resolved, third.stats.duplicates) == (0, 0, 0)


# -- the zstd dictionary -------------------------------------------------------------------------------
def test_a_dictionary_trained_on_a_tasks_rows_is_registered_used_and_decoded(tmp_path, kafka_bootstrap):
    registry, topic = KeyRegistry(tmp_path / "keys.json"), _topic()
    key = registry.add("phone-1")
    sink = TunnelSink("phone-1", key, tmp_path / "spool", topic=topic, bootstrap=kafka_bootstrap,
                      dictionary_rows=300, **FAST)
    sink.write("events", _events(0, 300))  # the samples
    sink.flush()
    sink.codebook.wait_trained()
    dictionary = sink.codebook.dictionaries["events"]
    assert dictionary is not None and sink.codebook.dictionary_gain["events"] >= 0.05
    _one_per_envelope(sink, "events", _events(300, 20))
    assert sink.close(timeout_s=20)
    messages = _raw(kafka_bootstrap, topic, 21)
    compression = [m.value[1] >> _COMPRESSION_SHIFT for m in messages]
    assert compression[1:] == [2] * 20, compression  # zstd with the dictionary
    assert [bool(m.value[1] & _R) for m in messages[1:3]] == [True, False]  # the dictionary announced once
    plain = [len(encode("phone-1", "events", 300 + i, pa.Table.from_pylist([row]), key, announce=False))
             for i, row in enumerate(_events(300, 20))]
    assert sum(len(m.value) for m in messages[2:]) < 0.9 * sum(plain[1:])

    consumer = _consume(tmp_path / "cloud.duckdb", registry, topic, kafka_bootstrap, until=lambda s: s.stored >= 320)
    assert (consumer.stats.stored, consumer.stats.dead_total) == (320, 0)
    with duckdb.connect(str(tmp_path / "cloud.duckdb"), read_only=True) as con:
        assert con.execute("SELECT kind FROM tunnel.registry ORDER BY kind").fetchall() == [(SCHEMA,), (DICTIONARY,)]
        stored = con.execute("SELECT user_id, page, url, agent, i FROM events ORDER BY seq").fetchall()
    assert stored == [tuple(row.values()) for row in _events(0, 320)]

    # a restarted device goes on with the same dictionary (kept in its spool) and announces it again
    again = TunnelSink("phone-1", key, tmp_path / "spool", topic=topic, bootstrap=kafka_bootstrap, **FAST)
    assert again.codebook.dictionaries["events"] == dictionary
    _one_per_envelope(again, "events", _events(320, 1))
    assert again.close(timeout_s=20)
    last = _raw(kafka_bootstrap, topic, 22)[-1].value
    assert last[1] >> _COMPRESSION_SHIFT == 2 and last[1] & _R
    known = Registry()
    assert decode(last, registry, known).rows.to_pylist() == _events(320, 1)
    assert known.get("phone-1", DICTIONARY, dictionary.id) == dictionary


def test_a_dictionary_that_does_not_beat_plain_zstd_is_not_used(tmp_path):
    from tests.kafka_broker import free_port

    sink = TunnelSink("phone-1", b"k" * 32, tmp_path / "spool", topic=_topic(), bootstrap=f"127.0.0.1:{free_port()}",
                      dictionary_rows=500, **FAST)
    try:
        rng = np.random.default_rng(0)
        sink.write("ipv", [{"user_id": str(rng.integers(10**6)), "item_id": str(rng.integers(10**7)),
                            "ts": float(rng.integers(1_500_000_000, 1_600_000_000)), "n": int(rng.integers(4))}
                           for _ in range(500)])
        sink.flush()
        sink.codebook.wait_trained()
        assert sink.codebook.dictionaries["ipv"] is None, sink.codebook.dictionary_gain
        assert sink.spool.dictionaries()["ipv"][1] is False  # remembered: not trained again next run
    finally:
        sink.close(timeout_s=0.1)


# -- tampering ---------------------------------------------------------------------------------------------
def test_tampered_compact_envelopes_are_dead_lettered_and_the_genuine_ones_stored(tmp_path, kafka_bootstrap):
    registry, topic = KeyRegistry(tmp_path / "keys.json"), _topic()
    key = registry.add("phone-1")
    ensure_topic(kafka_bootstrap, topic, partitions=1)
    spool = Spool(tmp_path / "spool")
    book = Codebook("phone-1", key, spool)
    genuine = []
    for seq, row in enumerate(_ipv(0, 4)):
        genuine.append(book.envelope("ipv", seq, pa.Table.from_pylist([row])))
        book.sealed()
    spool.close()

    def flip(value: bytes, at: int) -> bytes:
        return value[:at] + bytes([value[at] ^ 0x40]) + value[at + 1:]

    tampered = [flip(genuine[1], 6),    # its sequence number (a replay under another number)
                flip(genuine[1], 8),    # the schema id it names
                flip(genuine[2], -35),  # a payload byte
                flip(genuine[0], 40),   # inside the schema it announces
                genuine[3][:-1]]        # the signature cut short
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", **CLIENT_TIMEOUTS)
    for value in [genuine[0], *tampered, genuine[1], genuine[2], genuine[3], genuine[2]]:
        producer.send(topic, value=value, partition=0).get(timeout=10)
    producer.close()
    consumer = _consume(tmp_path / "cloud.duckdb", registry, topic, kafka_bootstrap, until=lambda s: s.messages >= 10)
    assert consumer.stats.dead == Counter(bad_signature=5)
    assert (consumer.stats.stored, consumer.stats.duplicates) == (4, 1)  # the last one is a resend
    with duckdb.connect(str(tmp_path / "cloud.duckdb"), read_only=True) as con:
        assert con.execute("SELECT seq, dwell_s FROM ipv ORDER BY seq").fetchall() == [(i, float(i)) for i in range(4)]
        dead = con.execute("SELECT raw FROM tunnel.dead_letter ORDER BY kafka_offset").fetchall()
    assert [raw for (raw,) in dead] == tampered


def test_format_1_envelopes_from_an_older_device_are_still_stored(tmp_path, kafka_bootstrap):
    registry, topic = KeyRegistry(tmp_path / "keys.json"), _topic()
    key = registry.add("phone-1")
    ensure_topic(kafka_bootstrap, topic, partitions=1)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", **CLIENT_TIMEOUTS)
    producer.send(topic, key=b"phone-1", value=encode_v1("phone-1", "ipv", 0, pa.Table.from_pylist(_ipv(0, 3)), key),
                  partition=0).get(timeout=10)
    producer.send(topic, value=encode("phone-1", "ipv", 3, pa.Table.from_pylist(_ipv(3, 2)), key),
                  partition=0).get(timeout=10)
    producer.close()
    consumer = _consume(tmp_path / "cloud.duckdb", registry, topic, kafka_bootstrap, until=lambda s: s.stored >= 5)
    assert (consumer.stats.stored, consumer.stats.dead_total) == (5, 0)


# -- the column codec ----------------------------------------------------------------------------------------
_INT64 = st.integers(-2**63, 2**63 - 1)
_VALUES = {
    pa.int64(): _INT64, pa.int8(): st.integers(-128, 127), pa.uint64(): st.integers(0, 2**64 - 1),
    pa.float64(): st.floats(width=64), pa.float32(): st.floats(width=32),
    pa.string(): st.one_of(st.text(max_size=12), st.integers(0, 10**19).map(str),
                           st.sampled_from(["0", "00", "-1", "007", "12a"])),
    pa.large_string(): st.text(max_size=5), pa.binary(): st.binary(max_size=12), pa.bool_(): st.booleans(),
    pa.timestamp("us"): st.integers(-2**62, 2**62), pa.date32(): st.integers(-2**31, 2**31 - 1),
    pa.list_(pa.float32()): st.lists(st.floats(width=32), max_size=3),
    pa.struct([("a", pa.int64())]): st.fixed_dictionaries({"a": _INT64}),
}


@st.composite
def _tables(draw) -> pa.Table:
    n = draw(st.integers(0, 40))  # across the one-row, few-row and vectorized paths
    arrays = []
    for t in draw(st.lists(st.sampled_from(list(_VALUES)), min_size=1, max_size=5)):
        nulls = draw(st.booleans())
        values = [None if nulls and draw(st.booleans()) else draw(_VALUES[t]) for _ in range(n)]
        if pa.types.is_temporal(t):
            arrays.append(pa.array(values, type=pa.int64() if t.bit_width == 64 else pa.int32()).view(t))
        else:
            arrays.append(pa.array(values, type=t))
    table = pa.table(arrays, names=[f"c{i}" for i in range(len(arrays))])
    return table.slice(draw(st.integers(0, 3))) if n > 3 else table


def _same(a: pa.Array, b: pa.Array) -> bool:
    """Equal values, NaN included (bit for bit for floats: -0.0 and NaN payloads survive)."""
    if a.type != b.type or not a.is_null().equals(b.is_null()):
        return False
    if pa.types.is_floating(a.type):
        return a.drop_null().to_numpy().tobytes() == b.drop_null().to_numpy().tobytes()
    return a.equals(b) or repr(a.to_pylist()) == repr(b.to_pylist())


@settings(max_examples=400, deadline=None)
@given(_tables())
def test_the_column_codec_round_trips_every_type_it_takes(table):
    payload, has_nulls = columns.encode(table)
    back = columns.decode(payload, table.schema, table.num_rows, has_nulls)
    assert all(_same(a.combine_chunks(), b.combine_chunks()) for a, b in zip(table.columns, back.columns, strict=True))


@settings(max_examples=300, deadline=None)
@given(_tables())
def test_the_value_by_value_encoder_writes_the_same_bytes_as_the_vectorized_one(table):
    assert columns.encode(table, vectorized=False) == columns.encode(table, vectorized=True)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80), st.integers(0, 9), st.booleans())
def test_a_payload_that_does_not_fit_its_schema_is_a_value_error_never_a_crash(payload, n, has_nulls):
    schema = pa.schema([("s", pa.string()), ("f", pa.float32()), ("t", pa.timestamp("ms")), ("b", pa.bool_()),
                        ("l", pa.list_(pa.int64())), ("i", pa.int8())])
    with contextlib.suppress(ValueError):  # anything else fails the test
        columns.decode(payload, schema, n, has_nulls)
