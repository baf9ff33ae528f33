"""The cloud side of the tunnel attacked by a device with a valid key (issue 26: items 1, 2, 9; issue 25: values
stored as sent), against the real cloud store (DuckDB) and, where the consumer is the target, the real broker."""

from __future__ import annotations

import stat
import time
import uuid

import duckdb
import pyarrow as pa
import pytest

pytest.importorskip("kafka")

from kafka import KafkaProducer  # noqa: E402

from connectors.tunnel.cloud import CloudConsumer, CloudStore, open_message  # noqa: E402
from connectors.tunnel.envelope import Batch, encode  # noqa: E402
from connectors.tunnel.kafka import CLIENT_TIMEOUTS, ensure_topic  # noqa: E402
from connectors.tunnel.keys import KeyRegistry  # noqa: E402

KEY = bytes(range(32))
KEYS = {"phone-1": KEY, "phone-2": bytes(reversed(range(32)))}


def _topic() -> str:
    return f"sec.{uuid.uuid4().hex[:12]}"


def _rows(first: int, n: int, **extra) -> pa.Table:
    return pa.table({"user_id": [f"u{i % 3}" for i in range(first, first + n)], "n": list(range(first, first + n)),
                     **{k: [v] * n for k, v in extra.items()}})


def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, **CLIENT_TIMEOUTS)
    try:
        for value in values:
            producer.send(topic, value=value, partition=0)
        producer.flush(timeout=10)
    finally:
        producer.close()


def _consume(db, keys: KeyRegistry, topic: str, bootstrap: str, *, until, max_s: float = 20.0, **options):
    consumer = CloudConsumer(db, keys, topic=topic, bootstrap=bootstrap, group_id=f"g-{uuid.uuid4().hex}",
                             partitions=1, **options)
    try:
        deadline = time.monotonic() + max_s
        while not until(consumer.stats) and time.monotonic() < deadline:
            consumer.poll_once(0.2)
    finally:
        consumer.close()
    return consumer


# -- item 1: the store's own tables are out of the devices' namespace -----------------------------------
@pytest.mark.parametrize("table", ["TUNNEL_OFFSETS", "Tunnel_Online_Marks", "tunnel_batches", "IPV_ONLINE", "offsets"])
def test_a_device_naming_the_stores_tables_in_any_case_cannot_stop_ingestion(tmp_path, kafka_bootstrap, table):
    """A signed batch for ``TUNNEL_OFFSETS`` with one more column used to add that column to ``tunnel_offsets``,
    after which every offset insert failed and the consumer gave up, for good (issue 26, item 1)."""
    registry, topic = KeyRegistry(tmp_path / "keys.json"), _topic()
    key = registry.add("phone-1")
    ensure_topic(kafka_bootstrap, topic, partitions=1)
    attack = pa.table({"topic": ["x"], "kafka_partition": [0], "next_offset": [0], "table_name": ["x"],
                       "applied_through": [0], "evil": [1]})
    _produce(kafka_bootstrap, topic, [encode("phone-1", "ipv", 0, _rows(0, 2), key),
                                      encode("phone-1", table, 2, attack, key),
                                      encode("phone-1", "ipv", 3, _rows(3, 2), key)])
    db = tmp_path / "cloud.duckdb"
    first = _consume(db, registry, topic, kafka_bootstrap, until=lambda s: s.messages >= 3)
    plain = table == "offsets"  # not reserved: a table of the device's own, beside tunnel.offsets
    assert (first.stats.stored, dict(first.stats.dead)) == ((5, {}) if plain else (4, {"bad_schema": 1}))
    _produce(kafka_bootstrap, topic, [encode("phone-1", "ipv", 5, _rows(5, 1), key)])
    second = _consume(db, registry, topic, kafka_bootstrap, until=lambda s: s.stored >= 1)  # resumes, stores on
    assert (second.stats.messages, second.stats.stored) == (1, 1)
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT seq FROM ipv ORDER BY seq").fetchall() == [(0,), (1,), (3,), (4,), (5,)]
        assert con.execute("SELECT arg_max(next_offset, rowid) FROM tunnel.offsets").fetchone() == (4,)
        assert [c for (c,) in con.execute("SELECT column_name FROM (DESCRIBE tunnel.offsets)").fetchall()] == [
            "topic", "kafka_partition", "next_offset"]


def test_a_column_added_to_an_internal_table_changes_no_insert(tmp_path):
    """Every internal INSERT names its columns, so a table with one more column still takes them."""
    with CloudStore(tmp_path / "c.duckdb") as store:
        for table in ("batches", "offsets", "dead_letter", "registry"):
            store.query(f"ALTER TABLE tunnel.{table} ADD COLUMN evil INTEGER")
        dead = open_message("t", 0, 1, b"garbage", KEYS)
        result = store.apply([Batch("phone-1", "ipv", 0, _rows(0, 2))], [dead], {("t", 0): 2})
        assert (result.stored, result.dead) == (2, 1)
        assert store.offsets("t") == {0: 2}


def test_a_store_written_with_the_old_table_names_is_moved_into_the_tunnel_schema(tmp_path):
    """A cloud DuckDB from before the move (``main.tunnel_*``, one of them with a column a device added) opens:
    its batches, offsets, dead letters and registry are in ``tunnel.*``, the old tables gone, and a resend of a
    stored batch is still a repeat."""
    db = tmp_path / "c.duckdb"
    with duckdb.connect(str(db)) as con:
        con.execute("CREATE TABLE tunnel_batches (device_id VARCHAR, first_seq BIGINT, n_rows BIGINT, mac BLOB, "
                    "table_name VARCHAR, ingested_at TIMESTAMP)")
        con.execute("INSERT INTO tunnel_batches VALUES ('phone-1', 0, 2, NULL, 'ipv', now())")
        con.execute("CREATE TABLE tunnel_offsets (topic VARCHAR, kafka_partition INTEGER, next_offset BIGINT, "
                    "evil INTEGER)")
        con.execute("INSERT INTO tunnel_offsets VALUES ('t', 0, 7, 1)")
        con.execute("CREATE TABLE tunnel_dead_letter (topic VARCHAR, kafka_partition INTEGER, kafka_offset BIGINT, "
                    "device_id VARCHAR, reason VARCHAR, detail VARCHAR, raw BLOB, refused_at TIMESTAMP)")
        con.execute("INSERT INTO tunnel_dead_letter VALUES ('t', 0, 3, NULL, 'garbage', 'x', 'y', now())")
        con.execute("CREATE TABLE ipv (device_id VARCHAR, seq BIGINT, ingested_at TIMESTAMP, user_id VARCHAR, "
                    "n BIGINT)")
        con.execute("INSERT INTO ipv VALUES ('phone-1', 0, now(), 'u0', 0), ('phone-1', 1, now(), 'u1', 1)")
    with CloudStore(db) as store:
        assert store.offsets("t") == {0: 7}
        assert store.query("SELECT reason, resolved_at FROM tunnel.dead_letter") == [("garbage", None)]
        assert store.query("SELECT device_id, first_seq, outcome FROM tunnel.batches") == [("phone-1", 0, "stored")]
        assert store.query("SELECT count(*) FROM information_schema.tables WHERE table_name LIKE 'tunnel_%'") == [(0,)]
        assert store.apply([Batch("phone-1", "ipv", 0, _rows(0, 2))]).stored == 0  # numbers taken: not stored again
        assert store.apply([Batch("phone-1", "ipv", 2, _rows(2, 1))]).stored == 1


# -- item 2: budgets at the door ----------------------------------------------------------------------------
def _bomb(first_seq: int = 0, rows: int = 1 << 22, key: bytes = KEY) -> bytes:
    """A signed envelope of a few hundred bytes whose rows (all null: a bitmap of zeros) decode to ``rows`` rows."""
    return encode("phone-1", "ipv", first_seq, pa.table({"user_id": pa.nulls(rows, pa.string()),
                                                         "n": pa.nulls(rows, pa.int64())}), key)


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_zstd_bomb_is_refused_over_budget_before_it_is_decoded(tmp_path):
    """A 300-byte envelope claiming 4 M rows is refused from its header; one claiming 20,000 rows of 3,000 int
    columns (240 MB decoded) from its schema; one whose zstd frame inflates past the bytes its rows may take
    (a 60 MB frame in a 4 KB envelope) while it is being decompressed. The default budgets."""
    wide = pa.table({f"c{i}": pa.nulls(20_000, pa.int64()) for i in range(3_000)})
    padded = pa.table({"user_id": ["x" * (60 << 20)], "n": [1]})  # one row of 60 MB: zstd makes it ~2 KB
    bombs = [_bomb(), encode("phone-1", "wide", 0, wide, KEY), encode("phone-1", "padded", 0, padded, KEY)]
    assert len(bombs[0]) < 1_000 and len(bombs[2]) < 8_000  # (the wide one carries its 3,000-column schema)
    before, started = _peak_rss_mb(), time.monotonic()
    opened = [open_message("t", 0, i, bomb, KEYS) for i, bomb in enumerate(bombs)]
    assert [getattr(o, "reason", None) for o in opened] == ["over_budget"] * 3
    assert "4194304 rows claimed" in opened[0].detail
    assert "would take at least" in opened[1].detail
    assert "inflating past" in opened[2].detail or "claiming" in opened[2].detail
    assert time.monotonic() - started < 2.0
    assert _peak_rss_mb() - before < 100, "opening the bombs took memory"
    assert opened[0].seqs == (0, 1 << 22)  # verified: the device and its numbers are known


def test_a_consumer_polled_bombs_dead_letters_them_and_stores_the_rows_beside_them(tmp_path, kafka_bootstrap):
    registry, topic = KeyRegistry(tmp_path / "keys.json"), _topic()
    key = registry.add("phone-1")
    ensure_topic(kafka_bootstrap, topic, partitions=1)
    values = []
    for i in range(4):
        values += [encode("phone-1", "ipv", 10 * i, _rows(10 * i, 2), key), _bomb(10 * i + 2, key=key)]
    _produce(kafka_bootstrap, topic, values)
    before, started = _peak_rss_mb(), time.monotonic()
    consumer = _consume(tmp_path / "cloud.duckdb", registry, topic, kafka_bootstrap, until=lambda s: s.messages >= 8)
    assert (consumer.stats.stored, dict(consumer.stats.dead)) == (8, {"over_budget": 4})
    assert time.monotonic() - started < 10
    assert _peak_rss_mb() - before < 150


def test_a_poll_stops_opening_messages_at_its_budget_and_the_next_poll_goes_on(tmp_path, kafka_bootstrap):
    from connectors.tunnel.budget import Budget

    registry, topic = KeyRegistry(tmp_path / "keys.json"), _topic()
    key = registry.add("phone-1")
    ensure_topic(kafka_bootstrap, topic, partitions=1)
    _produce(kafka_bootstrap, topic, [encode("phone-1", "ipv", 3 * i, _rows(3 * i, 3), key) for i in range(10)])
    consumer = CloudConsumer(tmp_path / "cloud.duckdb", registry, topic=topic, bootstrap=kafka_bootstrap,
                             group_id=f"g-{uuid.uuid4().hex}", partitions=1, budget=Budget(max_rows_per_poll=5))
    per_poll = []
    try:
        deadline = time.monotonic() + 20
        while consumer.stats.stored < 30 and time.monotonic() < deadline:
            stored = consumer.poll_once(0.2).stored
            if stored:
                per_poll.append(stored)
    finally:
        consumer.close()
    assert sum(per_poll) == 30 and max(per_poll) <= 6  # the batch that passed the budget, then the poll stops
    with duckdb.connect(str(tmp_path / "cloud.duckdb"), read_only=True) as con:
        assert con.execute("SELECT count(DISTINCT seq) FROM ipv").fetchone() == (30,)


# -- strict types: values stored as sent (issue 25 item 2, issue 26 item 9) ---------------------------------
def _opened(first_seq: int, rows: pa.Table, table: str = "t", offset: int = 0):
    return open_message("topic", 0, offset, encode("phone-1", table, first_seq, rows, KEY), KEYS)


def test_a_value_its_column_would_change_sends_its_row_to_the_dead_letter_and_the_rows_beside_it_are_stored(tmp_path):
    """``rid`` is BIGINT (the first batch's integers): the string '-31' was stored as -31 (issue 25); now its row
    is a ``bad_value`` dead letter with the reason, and the NULL beside it is stored. Floats widen the column to
    DOUBLE (nothing lost, as the device's own storage does), after which an integer past 2**53 is refused."""
    with CloudStore(tmp_path / "c.duckdb") as store:
        assert store.apply([_opened(0, pa.table({"user_id": ["a"], "rid": [5]}))]).stored == 1
        strings = store.apply([_opened(1, pa.table({"user_id": ["b", "c"], "rid": ["-31", None]}), offset=1)])
        assert strings.stored == 1 and [d.reason for d in strings.dead_letters] == ["bad_value"]
        assert strings.dead_letters[0].detail == "seq 1, column rid: '-31' (VARCHAR) is not a BIGINT"
        assert b'"rid":"-31"' in strings.dead_letters[0].raw.replace(b" ", b"")
        floats = store.apply([_opened(3, pa.table({"user_id": ["d"], "rid": [-32.7]}))])
        assert floats.stored == 1 and not floats.dead_letters
        huge = store.apply([_opened(4, pa.table({"user_id": ["e", "f"], "rid": [2**53 + 1, 7]}))])
        assert huge.stored == 1
        assert "9007199254740993 (BIGINT) is not a DOUBLE without loss" in huge.dead_letters[0].detail
        assert store.query("SELECT seq, rid, typeof(rid) FROM t ORDER BY seq") == [
            (0, 5.0, "DOUBLE"), (2, None, "DOUBLE"), (3, -32.7, "DOUBLE"), (5, 7.0, "DOUBLE")]
        assert store.query("SELECT reason, device_id FROM tunnel.dead_letter") == [("bad_value", "phone-1")] * 2


def test_declared_column_types_are_enforced_whoever_writes_first(tmp_path):
    """A device creating ``dwell_s`` as BOOLEAN typed it for everyone, and a good device's 3.5 was stored as True
    (issue 26, item 9). With declared types the column is DOUBLE from the start; a lossy value (a float into
    BIGINT, 300 into TINYINT, a string into a number, a boolean into DOUBLE) is refused row by row."""
    schemas = {"t": {"user_id": "VARCHAR", "rid": "BIGINT", "dwell_s": "double", "small": "TINYINT"}}
    with CloudStore(tmp_path / "c.duckdb", schemas=schemas) as store:
        evil = store.apply([_opened(0, pa.table({"user_id": ["x"], "dwell_s": [True]}))])
        assert evil.stored == 0 and "True (BOOLEAN) is not a DOUBLE" in evil.dead_letters[0].detail
        good = store.apply([_opened(1, pa.table({"user_id": ["a", "b", "c", "d"], "dwell_s": [3.5, 1.0, 2.0, 4.0],
                                                 "rid": [4.0, -32.7, 8.0, 9.0], "small": [7, 7, 300, 7]}))])
        assert good.stored == 2
        assert sorted(d.detail for d in good.dead_letters) == [
            "seq 2, column rid: -32.7 (DOUBLE) is not a BIGINT without loss",
            "seq 3, column small: 300 (BIGINT) is not a TINYINT without loss"]
        assert store.query("SELECT seq, dwell_s, rid, small FROM t ORDER BY seq") == [(1, 3.5, 4, 7), (4, 4.0, 9, 7)]
        assert store.query("SELECT column_name, column_type FROM (DESCRIBE t) WHERE column_name IN "
                           "('dwell_s', 'rid', 'small') ORDER BY 1") == [
            ("dwell_s", "DOUBLE"), ("rid", "BIGINT"), ("small", "TINYINT")]
        store.flush_online()
        assert store.query("SELECT typeof(rid) FROM t_online LIMIT 1") == [("BIGINT",)]


def test_a_declared_type_is_given_to_a_column_a_first_writer_typed_before(tmp_path):
    db = tmp_path / "c.duckdb"
    with CloudStore(db) as store:
        store.apply([_opened(0, pa.table({"user_id": ["x"], "dwell_s": [True]}))])
    with CloudStore(db, schemas={"t": {"user_id": "VARCHAR", "dwell_s": "DOUBLE"}}) as store:
        result = store.apply([_opened(1, pa.table({"user_id": ["a"], "dwell_s": [3.5]}))])
        assert (result.stored, result.dead) == (1, 0)
        assert store.query("SELECT seq, dwell_s FROM t ORDER BY seq") == [(0, 1.0), (1, 3.5)]


def test_a_declared_type_that_is_no_type_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="not a"):
        CloudStore(tmp_path / "c.duckdb", schemas={"t": {"n": "BIGINT); DROP TABLE t; --"}})


def test_the_consumer_refuses_by_row_what_a_device_sent_in_the_wrong_type(tmp_path, kafka_bootstrap):
    """The issue-25 case through the broker: a signed batch with the string '-31' in an integer column."""
    registry, topic = KeyRegistry(tmp_path / "keys.json"), _topic()
    key = registry.add("phone-1")
    ensure_topic(kafka_bootstrap, topic, partitions=1)
    _produce(kafka_bootstrap, topic, [encode("phone-1", "ipv", 0, pa.table({"user_id": ["a"], "rid": [1]}), key),
                                      encode("phone-1", "ipv", 1, pa.table({"user_id": ["b", "c"],
                                                                            "rid": ["-31", "2"]}), key)])
    consumer = _consume(tmp_path / "cloud.duckdb", registry, topic, kafka_bootstrap, until=lambda s: s.messages >= 2)
    assert (consumer.stats.stored, dict(consumer.stats.dead)) == (1, {"bad_value": 2})
    with duckdb.connect(str(tmp_path / "cloud.duckdb"), read_only=True) as con:
        assert con.execute("SELECT seq, rid FROM ipv").fetchall() == [(0, 1)]


def test_the_key_registry_never_leaks_through_a_planted_temporary_file(tmp_path):
    """Issue 26 item 10: keys.json was written through a fixed keys.json.tmp, opened without O_EXCL/O_NOFOLLOW: a
    leftover 0644 .tmp left keys.json at 0644, a symlinked .tmp sent the keys to its target."""
    path = tmp_path / "registry" / "keys.json"
    path.parent.mkdir()
    planted = path.with_name("keys.json.tmp")
    planted.write_text("{}")
    planted.chmod(0o644)  # a leftover anyone on the host may read
    key = KeyRegistry(path).add("phone-1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    planted.unlink()
    stolen = tmp_path / "elsewhere" / "stolen.json"
    stolen.parent.mkdir()
    planted.symlink_to(stolen)  # a symlink another local user planted
    KeyRegistry(path).add("phone-2")
    assert not stolen.exists(), "the keys were written to the symlink's target"
    assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert KeyRegistry(path).key_for("phone-1") == key and KeyRegistry(path).key_for("phone-2") is not None
    assert key.hex() not in "".join(p.read_text() for p in tmp_path.rglob("*") if p.is_file() and p != path)
    fresh = tmp_path / "new" / "keys.json"
    KeyRegistry(fresh).add("phone-1")
    assert stat.S_IMODE(fresh.parent.stat().st_mode) == 0o700  # a directory made for it is this user's only
