"""The Kafka tunnel's parts and its happy path, on a real broker: envelope, keys, spool, cloud store, sink → consumer,
and ``streamflow run --tunnel kafka`` → ``streamflow tunnel consume`` end to end. Faults: test_tunnel_faults.py."""

from __future__ import annotations

import logging
import os
import random
import stat
import time
import uuid
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from connectors.tunnel.cloud import CloudConsumer, CloudStore, DeadLetter, open_message
from connectors.tunnel.envelope import REASONS, Batch, EnvelopeError, decode, encode, encode_v1
from connectors.tunnel.keys import KeyRegistry
from connectors.tunnel.registry import Registration
from connectors.tunnel.sink import MAX_ENVELOPE_BYTES, TunnelSink
from connectors.tunnel.spool import Spool, SpoolFull
from streamflow.cli import main

ROOT = Path(__file__).resolve().parents[2]
KEY = bytes(range(32))
KEYS = {"phone-1": KEY, "phone-2": bytes(reversed(range(32)))}
ROWS = pa.table({"user_id": ["u1", "u2", "u1"], "item_id": [7, 8, 9], "dwell_s": [1.5, None, 3.0]})


def _topic() -> str:
    return f"test.{uuid.uuid4().hex[:12]}"


# -- envelope --------------------------------------------------------------------------------------
def test_envelope_round_trip_keeps_rows_types_and_sequence_numbers():
    batch = decode(encode("phone-1", "ipv", 41, ROWS, KEY), KEYS)
    assert (batch.device, batch.table, batch.first_seq, batch.last_seq) == ("phone-1", "ipv", 41, 43)
    assert batch.rows.equals(ROWS)


def _flip(value: bytes, at: int) -> bytes:
    return value[:at] + bytes([value[at] ^ 0x01]) + value[at + 1:]


@pytest.mark.parametrize(("mutate", "reason"), [
    (lambda v: b"", "garbage"),
    (lambda v: b"not an envelope at all, just some bytes that are long enough to parse" * 2, "garbage"),
    (lambda v: v[:1] + bytes([v[1] & ~0x07 | 3]) + v[2:], "bad_version"),
    (lambda v: encode_v1("phone-1", "ipv", 0, ROWS, KEY)[:3] + b"\x02" + v[4:], "bad_version"),  # format 1's
    (lambda v: _flip(v, -40), "bad_signature"),                                     # a payload byte
    (lambda v: _flip(v, -1), "bad_signature"),                                      # the MAC
    (lambda v: _flip(v, 6), "bad_signature"),                                       # first_seq
    (lambda v: _flip(v, 7), "bad_signature"),                                       # n_rows
    (lambda v: _flip(v, 8), "bad_signature"),                                       # the schema id
    (lambda v: _flip(v, 40), "bad_signature"),                                      # inside the inline schema
    (lambda v: _flip(v, 2), "unknown_device"),                                      # the device tag
    (lambda v: encode("phone-1", "ipv", 0, ROWS, KEYS["phone-2"]), "bad_signature"),  # signed with another key
    (lambda v: encode("phone-9", "ipv", 0, ROWS, KEY), "unknown_device"),
])
def test_envelope_refusals_name_the_reason(mutate, reason):
    with pytest.raises(EnvelopeError) as refused:
        decode(mutate(encode("phone-1", "ipv", 0, ROWS, KEY)), KEYS)
    assert refused.value.reason == reason


def test_a_compact_envelope_has_a_binary_header_and_a_full_hmac():
    value = encode("phone-1", "ipv", 300, ROWS.slice(0, 1), KEY, announce=False)
    assert value[0] == 0xF5 and value[1] & 0x07 == 2 and value[1] & 0x10  # format 2, one row
    # magic, flags, device tag (4), first_seq 300 (2-byte varint), schema id (4), payload, HMAC-SHA256 (32)
    assert len(value) == 1 + 1 + 4 + 2 + 4 + len(value[12:-32]) + 32
    import hashlib
    import hmac

    assert value[-32:] == hmac.digest(KEY, b"phone-1" + value[:-32], hashlib.sha256)


def test_a_signed_envelope_whose_payload_does_not_fit_its_schema_is_bad_payload():
    other = Registration.for_schema("ipv", pa.schema([("user_id", pa.int64()), ("item_id", pa.list_(pa.int8()))]))
    with pytest.raises(EnvelopeError) as refused:
        decode(encode("phone-1", "ipv", 0, ROWS, KEY, schema=other), KEYS)
    assert refused.value.reason == "bad_payload" and refused.value.device == "phone-1"


def test_a_format_1_envelope_from_an_older_spool_still_opens_and_is_still_checked():
    old = encode_v1("phone-1", "ipv", 41, ROWS, KEY)
    batch = decode(old, KEYS)
    assert (batch.device, batch.table, batch.first_seq) == ("phone-1", "ipv", 41) and batch.rows.equals(ROWS)
    with pytest.raises(EnvelopeError) as refused:
        decode(_flip(old, 30), KEYS)
    assert refused.value.reason == "bad_signature"


@given(st.binary(max_size=400))
def test_any_bytes_decode_or_are_refused_never_crash(value):
    for candidate in (value, b"\xf5" + bytes([0x0A]) + value[2:], b"SFT\x01" + value[4:]):
        try:
            decode(candidate, KEYS)
        except EnvelopeError as exc:
            assert exc.reason in REASONS


# -- keys ------------------------------------------------------------------------------------------
def test_key_registry_file_is_private_and_validated(tmp_path):
    registry = KeyRegistry(tmp_path / "keys.json")
    key = registry.add("phone-1")
    assert stat.S_IMODE(os.stat(registry.path).st_mode) == 0o600
    assert KeyRegistry(registry.path).key_for("phone-1") == key
    with pytest.raises(ValueError, match="already registered"):
        registry.add("phone-1")
    with pytest.raises(ValueError, match="device id"):
        registry.add("no spaces please")
    (tmp_path / "broken.json").write_text('{"devices": {"phone-1": "not hex"}}')
    with pytest.raises(ValueError, match="not valid"):
        KeyRegistry(tmp_path / "broken.json")


# -- spool -----------------------------------------------------------------------------------------
def test_spool_keeps_batches_and_the_counter_across_reopen_and_refuses_past_its_bound(tmp_path):
    spool = Spool(tmp_path / "s.sqlite", max_bytes=100)
    assert spool.seal("t", 3, lambda seq: b"a" * 60) == 0
    with pytest.raises(SpoolFull):
        spool.seal("t", 2, lambda seq: b"b" * 60)
    assert spool.seal("t", 2, lambda seq: b"c" * 40) == 3  # the refused seal numbered nothing
    spool.ack(0)
    spool.close()
    again = Spool(tmp_path / "s.sqlite", max_bytes=100)
    assert [(e.first_seq, e.n_rows, e.value) for e in again.oldest(5)] == [(3, 2, b"c" * 40)]
    assert (again.next_seq, again.rows_pending, again.bytes_pending) == (5, 2, 40)


# -- cloud store -----------------------------------------------------------------------------------
def test_store_drops_exact_repeats_and_dead_letters_other_rows_under_stored_numbers(tmp_path):
    signed = decode(encode("phone-1", "ipv", 0, ROWS, KEY), KEYS)
    with CloudStore(tmp_path / "c.duckdb") as store:
        assert store.apply([signed], []).stored == 3
        assert (store.apply([signed]).duplicates, store.apply([signed]).stored) == (3, 0)  # a resend
        other = pa.table({"user_id": ["u1", "u3", "u3"], "item_id": [9, 10, 11], "dwell_s": [3.0, 4.0, 5.0]})
        overlapping = decode(encode("phone-1", "ipv", 2, other, KEY), KEYS)   # seq 2 is taken
        same_numbers = decode(encode("phone-1", "ipv", 0, other, KEY), KEYS)  # a wiped device starting over
        next_ok = decode(encode("phone-1", "ipv", 3, other, KEY), KEYS)
        result = store.apply([overlapping, same_numbers, next_ok, next_ok, Batch("phone-2", "ipv", 0, ROWS)])
        assert (result.stored, result.duplicates) == (3 + 3, 3)
        assert [(d.reason, d.device) for d in result.dead_letters] == [("seq_reused", "phone-1")] * 2
        assert store.query("SELECT device_id, seq, item_id FROM ipv ORDER BY device_id, seq") == [
            ("phone-1", 0, 7), ("phone-1", 1, 8), ("phone-1", 2, 9), ("phone-1", 3, 9), ("phone-1", 4, 10),
            ("phone-1", 5, 11), ("phone-2", 0, 7), ("phone-2", 1, 8), ("phone-2", 2, 9)]
        assert store.query("SELECT count(*) FROM tunnel.dead_letter WHERE reason = 'seq_reused'") == [(2,)]


#: a map with a key twice: Arrow takes it, DuckDB refuses the whole batch
DUPLICATE_KEYS = pa.array([[("a", 1), ("a", 2)]], pa.map_(pa.string(), pa.int64()))


def test_a_batch_the_tables_refuse_becomes_a_dead_letter_and_the_others_are_stored(tmp_path):
    with CloudStore(tmp_path / "c.duckdb") as store:
        store.apply([Batch("phone-1", "t", 0, pa.table({"user_id": ["u"], "n": [1]}))])
        clash = open_message("topic", 0, 7, encode("phone-1", "t", 1, pa.table({"user_id": ["u"], "m": DUPLICATE_KEYS}),
                                                   KEY), KEYS)
        fine = Batch("phone-1", "t", 2, pa.table({"user_id": ["v"], "n": [2]}))
        result = store.apply([clash, fine], [], {("topic", 0): 8})
        assert result.stored == 1 and [(d.reason, d.offset) for d in result.dead_letters] == [("unstorable", 7)]
        assert "refused the batch" in result.dead_letters[0].detail and result.dead_letters[0].raw
        assert store.query("SELECT seq, n FROM t ORDER BY seq") == [(0, 1), (2, 2)]
        assert store.offsets("topic") == {0: 8}


def test_numpy_vectors_travel_as_fixed_size_arrays_and_a_vector_of_another_length_is_a_dead_letter(tmp_path):
    """An embedding column becomes DuckDB ``FLOAT[4]`` in the offline and online tables (see
    ``connectors.storage._arrow_array`` for why not a LIST)."""
    import numpy as np

    from connectors.row_buffer import RowBuffer

    def envelope(first_seq: int, vectors: list) -> bytes:
        buffer = RowBuffer()
        buffer.extend([{"user_id": f"u{i}", "vec": v} for i, v in enumerate(vectors)])
        (rows,) = buffer.to_arrow()
        return encode("phone-1", "emb", first_seq, rows, KEY)

    vectors = [np.arange(4, dtype=np.float32) + i for i in range(3)]
    with CloudStore(tmp_path / "c.duckdb", online_lag_s=0.1) as store:
        store.apply([decode(envelope(0, vectors), KEYS)])
        store.flush_online()
        assert store.query("SELECT DISTINCT typeof(vec) FROM emb UNION ALL SELECT DISTINCT typeof(vec) "
                           "FROM emb_online") == [("FLOAT[4]",), ("FLOAT[4]",)]
        assert store.query("SELECT vec FROM emb ORDER BY seq") == [(tuple(v.tolist()),) for v in vectors]
        longer = open_message("topic", 0, 5, envelope(3, [np.zeros(5, np.float32)]), KEYS)
        result = store.apply([longer], [], {("topic", 0): 6})
        assert result.stored == 0 and [(d.reason, d.offset) for d in result.dead_letters] == [("bad_value", 5)]
        assert "(FLOAT[5]) is not a FLOAT[4]" in result.dead_letters[0].detail
        assert store.query("SELECT count(*) FROM emb") == [(3,)]


def test_online_table_keeps_the_newest_row_per_key_whatever_the_arrival_order(tmp_path):
    with CloudStore(tmp_path / "c.duckdb") as store:
        store.apply([Batch("phone-1", "ipv", 10, pa.table({"user_id": ["u1"], "item_id": [99]}))], [])
        store.apply([Batch("phone-1", "ipv", 0, ROWS)], [])  # older rows arriving later
        assert store.query("SELECT user_id, seq, item_id FROM ipv_online ORDER BY user_id") == [
            ("u1", 10, 99), ("u2", 1, 8)]
        # a new column appears: both tables grow it
        store.apply([Batch("phone-1", "ipv", 11, pa.table({"user_id": ["u2"], "item_id": [5], "n_buy": [1]}))], [])
        assert store.query("SELECT user_id, item_id, n_buy FROM ipv_online ORDER BY user_id") == [
            ("u1", 99, None), ("u2", 5, 1)]
        assert store.query("SELECT count(*), count(n_buy) FROM ipv") == [(5, 1)]


def _mixed_batches() -> list[Batch]:
    """Two devices, out-of-order and gap-filling sequence numbers, a column that comes and goes, NULL keys."""
    rng = random.Random(7)
    batches, next_seq = [], {"phone-1": 0, "phone-2": 0}
    for i in range(60):
        device = rng.choice(sorted(next_seq))
        n = rng.randint(1, 4)
        columns = {"user_id": [rng.choice(["u1", "u2", "u3", None]) for _ in range(n)],
                   "item_id": [rng.randint(0, 99) for _ in range(n)]}
        if i % 3 == 0:
            columns["n_buy"] = [rng.randint(0, 3) for _ in range(n)]
        batches.append(Batch(device, "ipv", next_seq[device] + 100, pa.table(columns)))  # seq 100.. first
        next_seq[device] += n
    batches += [Batch(d, "ipv", 0, pa.table({"user_id": ["u1", "u2"], "item_id": [1, 2]})) for d in next_seq]
    return batches


ONLINE = "SELECT device_id, user_id, seq, item_id, n_buy FROM ipv_online ORDER BY ALL"


def test_a_deferred_online_upsert_gives_the_online_table_an_upsert_per_transaction_gives(tmp_path):
    batches = _mixed_batches()
    with CloudStore(tmp_path / "now.duckdb") as now, CloudStore(tmp_path / "later.duckdb", online_lag_s=3600) as later:
        for i in range(0, len(batches), 3):
            now.apply(batches[i:i + 3])
            later.apply(batches[i:i + 3])
            if i == 30:
                later.flush_online()  # one deferred upsert half-way, the rest at the query
        assert later._con.execute(ONLINE).fetchall() != now.query(ONLINE)  # still deferred
        assert later.query(ONLINE) == now.query(ONLINE) and len(now.query(ONLINE)) == 6
        assert later.query("SELECT * EXCLUDE (ingested_at) FROM ipv ORDER BY ALL") == \
            now.query("SELECT * EXCLUDE (ingested_at) FROM ipv ORDER BY ALL")


def test_a_deferred_online_upsert_runs_once_its_lag_passed(tmp_path):
    with CloudStore(tmp_path / "c.duckdb", online_lag_s=0.2) as store:
        store.apply([Batch("phone-1", "ipv", 0, ROWS)])
        store.flush_online(due_only=True)
        tables = {t for (t,) in store._con.execute("SHOW TABLES").fetchall()}
        assert "ipv" in tables and "ipv_online" not in tables  # created by the first upsert
        time.sleep(0.25)
        store.flush_online(due_only=True)
        assert store._con.execute("SELECT count(*) FROM ipv_online").fetchone() == (2,)


def test_the_online_thread_upserts_on_its_own_and_gives_the_online_table_an_upsert_per_transaction_gives(tmp_path):
    batches = _mixed_batches()
    with CloudStore(tmp_path / "now.duckdb") as now, \
            CloudStore(tmp_path / "later.duckdb", online_lag_s=0.05, online_thread=True) as later:
        for i in range(0, len(batches), 3):
            now.apply(batches[i:i + 3])
            later.apply(batches[i:i + 3])
            later.flush_online(due_only=True)  # the thread's job: returns at once
            if i == 30:
                later.checkpoint_if_idle()  # waits for an upsert in flight (CHECKPOINT wants no other transaction)
        deadline = time.monotonic() + 10
        while later._con.execute(ONLINE).fetchall() != now.query(ONLINE) and time.monotonic() < deadline:
            time.sleep(0.02)  # no query() here: that would flush on this thread
        assert later._con.execute(ONLINE).fetchall() == now.query(ONLINE) and len(now.query(ONLINE)) == 6
        assert later._online_worker is not None and later._online_worker.is_alive()
        later.apply([Batch("phone-1", "ipv", 500, pa.table({"user_id": ["u9"], "item_id": [1]}))])
    with CloudStore(tmp_path / "later.duckdb") as reopened:  # close() flushed what waited
        assert reopened._con.execute("SELECT seq FROM ipv_online WHERE user_id = 'u9'").fetchall() == [(500,)]


@pytest.mark.parametrize("flushed_once", [False, True])
def test_rows_a_crash_kept_from_the_online_table_are_upserted_when_the_store_opens_again(tmp_path, flushed_once):
    batches = _mixed_batches()
    with CloudStore(tmp_path / "reference.duckdb") as reference:
        reference.apply(batches)
        expected = reference.query(ONLINE)
    store = CloudStore(tmp_path / "c.duckdb", online_lag_s=3600)
    store.apply(batches[:20])
    if flushed_once:
        store.flush_online()
    store.apply(batches[20:])
    store._con.close()  # the process dies: the deferred upsert never runs
    with CloudStore(tmp_path / "c.duckdb") as reopened:
        assert reopened._con.execute(ONLINE).fetchall() == expected


def test_dead_letters_and_offsets_are_stored_with_the_rows(tmp_path):
    with CloudStore(tmp_path / "c.duckdb") as store:
        dead = open_message("t", 0, 5, b"garbage", KEYS)
        reserved = open_message("t", 0, 6, encode("phone-1", "tunnel_offsets", 0, ROWS, KEY), KEYS)
        spoofed = open_message("t", 1, 0, encode("phone-1", "ipv", 0, ROWS, KEY), KEYS, message_key=b"phone-2")
        assert all(isinstance(d, DeadLetter) for d in (dead, reserved, spoofed))
        assert store.apply([], [dead, reserved, spoofed], {("t", 0): 7, ("t", 1): 1}).dead == 3
        assert store.query("SELECT kafka_offset, reason FROM tunnel.dead_letter ORDER BY kafka_partition, 1") == [
            (5, "garbage"), (6, "bad_schema"), (0, "bad_key")]
        assert store.offsets("t") == {0: 7, 1: 1}


# -- sink → broker → consumer ----------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["zstd", "gzip", "lz4"])
def test_rows_travel_device_to_cloud_once_and_in_order(tmp_path, kafka_bootstrap, compression):
    topic = _topic()
    registry = KeyRegistry(tmp_path / "keys.json")
    sink = TunnelSink("phone-1", registry.add("phone-1"), tmp_path / "spool", topic=topic, bootstrap=kafka_bootstrap,
                      compression=compression, batch_rows=100)
    for i in range(1000):
        sink.write("ipv" if i % 3 else "favs", [{"user_id": f"u{i % 7}", "i": i}])
    assert sink.close(timeout_s=30)
    assert (sink.stats.rows_acked, sink.spool.rows_pending) == (1000, 0)
    consumer = CloudConsumer(tmp_path / "cloud.duckdb", registry, topic=topic, bootstrap=kafka_bootstrap)
    try:
        stats = consumer.run(idle_timeout_s=2, max_s=60)
        assert (stats.stored, stats.duplicates, stats.dead_total) == (1000, 0, 0)
        assert sorted(consumer.store.query("SELECT seq FROM ipv UNION ALL SELECT seq FROM favs")) == \
            [(seq,) for seq in range(1000)]  # numbered per device, across its tables
        for table, first in (("ipv", 1), ("favs", 0)):  # a table's rows in write order
            assert [i for (i,) in consumer.store.query(f"SELECT i FROM {table} ORDER BY seq")] == \
                [i for i in range(1000) if (i % 3 != 0) == first]
        assert consumer.store.query("SELECT count(*) FROM ipv_online") == [(7,)]
        stored_offsets = consumer.store.offsets(topic)
    finally:
        consumer.close()
    # the offsets committed to Kafka (lag monitoring; throttled while running) reach the stored ones at close
    from kafka import KafkaConsumer, TopicPartition

    monitor = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=consumer.group_id, enable_auto_commit=False)
    try:
        assert {p: monitor.committed(TopicPartition(topic, p)) for p in stored_offsets} == stored_offsets
    finally:
        monitor.close()


def test_oversized_batches_are_split_and_an_oversized_row_is_refused_with_its_reason(tmp_path, kafka_bootstrap,
                                                                                    caplog):
    refused = []
    sink = TunnelSink("phone-1", KEY, tmp_path / "spool", topic=_topic(), bootstrap=kafka_bootstrap,
                      on_refused=lambda table, rows, reason: refused.append((table, len(rows), reason)))
    with caplog.at_level(logging.WARNING, logger="streamflow.tunnel"):  # ~2 MB zstd cannot shrink: split into envelopes
        sink.write("emb", [{"user_id": "u", "blob": os.urandom(200_000)} for _ in range(10)])
        sink.write("emb", [{"user_id": "u", "blob": os.urandom(MAX_ENVELOPE_BYTES)}])
        assert sink.close(timeout_s=30)
    assert sink.stats.rows_acked == 10 and sink.stats.batches_acked >= 3
    assert refused == [("emb", 1, f"row is larger than the {MAX_ENVELOPE_BYTES}-byte message limit")]
    assert sink.stats.rows_refused == 1 and "REFUSING ROWS" in caplog.text


def test_run_with_kafka_tunnel_and_consume_end_to_end(tmp_path, kafka_bootstrap, monkeypatch, capsys):
    monkeypatch.setenv("STREAMFLOW_KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("STREAMFLOW_KEY_REGISTRY", str(tmp_path / "keys.json"))
    topic = _topic()
    assert main(["tunnel", "keys", "add", "phone-1"]) == 0
    device_db, cloud_db = tmp_path / "device.duckdb", tmp_path / "cloud.duckdb"
    events = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"
    assert main(["run", str(ROOT / "jobs" / "ipv.py"), "--events", str(events), "--db", str(device_db),
                 "--tunnel", "kafka", "--device-id", "phone-1", "--topic", topic, "--show", "0"]) == 0
    assert "tunnel: 10000 rows in" in capsys.readouterr().out
    assert main(["tunnel", "consume", "--db", str(cloud_db), "--topic", topic, "--idle-timeout", "2"]) == 0
    assert "10000 rows stored, 0 duplicates dropped, 0 dead letters" in capsys.readouterr().out
    columns = "user_id, trigger_ts, item_id, category_id, enter_ts, dwell_s, n_reload, n_fav, n_cart, n_buy"
    device = duckdb.connect(str(device_db), read_only=True).execute(f"SELECT {columns} FROM ipv").fetchall()
    cloud = duckdb.connect(str(cloud_db), read_only=True)
    assert cloud.execute(f"SELECT {columns} FROM ipv ORDER BY seq").fetchall() == device
    assert cloud.execute("SELECT count(DISTINCT user_id) FROM ipv_online").fetchall() == \
        [(len({row[0] for row in device}),)]


def test_run_with_tunnel_for_an_unregistered_device_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STREAMFLOW_KEY_REGISTRY", str(tmp_path / "keys.json"))
    events = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"
    assert main(["run", str(ROOT / "jobs" / "ipv.py"), "--events", str(events), "--db", str(tmp_path / "d.duckdb"),
                 "--tunnel", "kafka", "--device-id", "phone-7"]) == 2
    assert "device 'phone-7' has no key" in capsys.readouterr().err


def test_a_task_with_tunnel_false_keeps_its_rows_on_the_device(tmp_path, kafka_bootstrap):
    from connectors.storage import CollectiveStorage
    from operators import Aggregate, Count
    from streamflow import Job, Task
    from streamflow.events import Event
    from streamflow.runners.device import DeviceRunner

    job = Job("two", [Task("shipped", ["fav"], [Aggregate(n=Count())], input="recent"),
                      Task("local", ["fav"], [Aggregate(n=Count())], input="recent", tunnel=False)])
    topic, registry = _topic(), KeyRegistry(tmp_path / "keys.json")
    sink = TunnelSink("phone-1", registry.add("phone-1"), tmp_path / "spool", topic=topic, bootstrap=kafka_bootstrap)
    with CollectiveStorage(tmp_path / "device.duckdb") as storage:
        runner = DeviceRunner(job, storage, tunnel=sink)
        runner.run([Event("u", "fav", "item", 1.6e9 + i) for i in range(5)])
        runner.close()
        assert storage.query("SELECT count(*) FROM local") == [(5,)]
    assert sink.close(timeout_s=30) and sink.stats.rows_acked == 5
    consumer = CloudConsumer(tmp_path / "cloud.duckdb", registry, topic=topic, bootstrap=kafka_bootstrap)
    try:
        assert consumer.run(idle_timeout_s=2, max_s=60).stored == 5
        tables = {row[0] for row in consumer.store.query("SELECT table_name FROM information_schema.tables")}
        assert {"shipped", "shipped_online"} <= tables and not {"local", "local_online"} & tables
    finally:
        consumer.close()


def test_rows_arrow_cannot_batch_together_travel_alone_and_unencodable_rows_are_refused(tmp_path, kafka_bootstrap):
    refused = []
    sink = TunnelSink("phone-1", KEY, tmp_path / "spool", topic=_topic(), bootstrap=kafka_bootstrap,
                      on_refused=lambda table, rows, reason: refused.append((table, rows, reason)))
    sink.write("t", [{"user_id": "u", "v": 1}, {"user_id": "u", "v": "one"}, {"user_id": "u", "v": object()}])
    assert sink.close(timeout_s=30)
    assert (sink.stats.rows_acked, sink.stats.batches_acked, sink.stats.rows_refused) == (2, 2, 1)
    assert refused[0][0] == "t" and refused[0][2].startswith("row cannot be encoded: ArrowInvalid")


def test_without_on_refused_refused_rows_land_in_a_json_lines_file_next_to_the_spool(tmp_path):
    import json

    from tests.kafka_broker import free_port

    sink = TunnelSink("phone-1", KEY, tmp_path / "spool", topic=_topic(), bootstrap=f"127.0.0.1:{free_port()}",
                      spool_max_bytes=1)  # nothing fits; no broker listens either
    sink.write("ipv", [{"user_id": "u1", "n": 1}, {"user_id": "u2", "n": 2}])
    assert sink.close(timeout_s=0.2)  # nothing was spooled, so nothing waits for the broker
    lines = [json.loads(line) for line in sink.refused_path.read_text().splitlines()]
    assert [(r["table"], r["row"]) for r in lines] == [("ipv", {"user_id": "u1", "n": 1}),
                                                      ("ipv", {"user_id": "u2", "n": 2})]
    assert lines[0]["reason"].startswith("tunnel spool full") and sink.stats.rows_refused == 2


# -- names from batches never reach SQL as code ------------------------------------------------------
#: a signed column name that, spliced into SQL, ends the transaction and drops a table (issue 10, defect 1)
INJECTION = 'n") FROM _sf_rows; COMMIT; DROP TABLE tunnel_dead_letter; SELECT typeof("n'


def test_a_column_name_with_sql_in_it_is_dead_lettered_and_the_good_rows_after_it_are_stored(tmp_path):
    good = lambda first, n: pa.table({"user_id": ["u"] * n, "n": list(range(first, first + n))})  # noqa: E731
    with CloudStore(tmp_path / "c.duckdb") as store:
        assert store.apply([open_message("t", 0, 0, encode("phone-1", "ipv", 0, good(0, 1), KEY), KEYS)]).stored == 1
        evil = encode("phone-1", "ipv", 1, pa.table({"user_id": ["u"], INJECTION: [1]}), KEY)
        # as the store sees it when a batch reaches apply() without open_message's checks (the Flink writer's path)
        evil_batch = decode(evil, KEYS)
        result = store.apply([evil_batch, open_message("t", 0, 2, encode("phone-1", "ipv", 2, good(2, 3), KEY), KEYS)],
                             [], {("t", 0): 3})
        tables = {name for (name,) in store.query("SELECT table_name FROM information_schema.tables")}
        assert {"dead_letter", "ipv", "ipv_online"} <= tables, "the column name ran as SQL"
        assert (result.stored, result.duplicates) == (3, 0)
        assert [(d.reason, d.device) for d in result.dead_letters] == [("bad_schema", "phone-1")]
        assert "not a plain identifier" in result.dead_letters[0].detail
        assert store.query("SELECT seq, n FROM ipv ORDER BY seq") == [(0, 0), (2, 2), (3, 3), (4, 4)]
        assert store.query("SELECT reason FROM tunnel.dead_letter") == [("bad_schema",)]
        # the refused batch is not recorded: a fixed resend under its numbers is stored, not called a repeat
        assert store.query("SELECT first_seq, outcome FROM tunnel.batches ORDER BY 1") == [
            (0, "stored"), (1, "dead"), (2, "stored")]
        assert store.offsets("t") == {0: 3}
        # open_message refuses it before the store, with the same reason
        opened = open_message("t", 0, 1, evil, KEYS)
        assert isinstance(opened, DeadLetter) and opened.reason == "bad_schema"


@pytest.mark.parametrize(("columns", "says"), [
    (["user_id", "seq"], "the store's own"),
    (["user_id", "dwell s"], "not a plain identifier"),
    (["user_id", "n\n"], "not a plain identifier"),
    (["user_id", "coupon"], "not in table ipv's declared schema"),
])
def test_undeclared_reserved_or_odd_columns_send_the_batch_to_the_dead_letter(tmp_path, columns, says):
    rows = pa.Table.from_arrays([pa.array(["u"]), pa.array([1])], names=columns)
    with CloudStore(tmp_path / "c.duckdb", schemas={"ipv": ["user_id", "n", "dwell_s"]}) as store:
        fine = Batch("phone-1", "ipv", 1, pa.table({"user_id": ["v"]}))
        result = store.apply([Batch("phone-1", "ipv", 0, rows), fine])
        assert result.stored == 1 and [d.reason for d in result.dead_letters] == ["bad_schema"]
        assert says in result.dead_letters[0].detail
        assert store.query("SELECT seq, user_id FROM ipv") == [(1, "v")]
        undeclared = store.apply([Batch("phone-1", "favs", 2, pa.table({"user_id": ["u"]}))])
        assert undeclared.stored == 0 and "not declared" in undeclared.dead_letters[0].detail


def test_a_batch_is_recorded_only_in_the_transaction_that_stores_its_rows(tmp_path):
    """A batch the tables refuse is recorded as dead, not stored, so its numbers stay free."""
    with CloudStore(tmp_path / "c.duckdb") as store:
        store.apply([Batch("phone-1", "t", 0, pa.table({"user_id": ["u"], "n": [1]}))])
        clash = Batch("phone-1", "t", 1, pa.table({"user_id": ["u"], "m": DUPLICATE_KEYS}))
        assert [d.reason for d in store.apply([clash]).dead_letters] == ["unstorable"]
        assert store.query("SELECT first_seq FROM tunnel.batches WHERE outcome = 'stored'") == [(0,)]
        fixed = store.apply([Batch("phone-1", "t", 1, pa.table({"user_id": ["u"], "n": [2]}))])
        assert (fixed.stored, fixed.duplicates) == (1, 0)


def test_rows_no_column_can_hold_are_refused_into_the_file_not_raised(tmp_path):
    """An int beyond int64 (OverflowError in Arrow) and a row with a tuple key are refused with the reason,
    and written to the dead-letter file (the JSON of a tuple key is its str), never raised into the runner."""
    import json

    from tests.kafka_broker import free_port

    sink = TunnelSink("phone-1", KEY, tmp_path / "spool", topic=_topic(), bootstrap=f"127.0.0.1:{free_port()}",
                      spool_max_bytes=1)  # nothing would fit, so a row that encodes is refused as "spool full"
    sink.write("t", [{"user_id": "u", "n": 2**70}])
    sink.write("t", [{"user_id": "u", "pair": {(1, 2): "x"}}])
    assert sink.close(timeout_s=0.2)
    lines = [json.loads(line) for line in sink.refused_path.read_text().splitlines()]
    assert lines[0]["reason"].startswith("row cannot be encoded: OverflowError")
    assert lines[0]["row"] == {"user_id": "u", "n": 2**70}
    assert [line["row"].get("pair") for line in lines[1:]] == [{"(1, 2)": "x"}]
    assert sink.stats.rows_refused == 2
