"""Collective storage against a real DuckDB file: buffering, flush triggers, schema, refused rows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import duckdb
import pytest

from connectors.storage import DEAD_LETTER_TABLE, CollectiveStorage, check_table_name, resolve_db_path


def rows_in_file(path, table: str) -> int:
    """Count rows through a separate read-only connection: what is durable in the file."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        return con.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0] if table in tables else 0
    finally:
        con.close()


def test_rows_stay_buffered_until_the_threshold(tmp_path):
    db = tmp_path / "f.duckdb"
    store = CollectiveStorage(db, flush_rows=10, flush_interval_s=3600)
    store.write("ipv", [{"user_id": "u", "n": i} for i in range(9)])
    assert store.pending() == 9 and store.flushes == 0
    store.write("ipv", [{"user_id": "u", "n": 9}])
    assert store.pending() == 0 and store.flushes == 1
    store.close()
    assert rows_in_file(db, "ipv") == 10


def test_any_read_flushes_first(tmp_path):
    store = CollectiveStorage(tmp_path / "f.duckdb", flush_rows=1000, flush_interval_s=3600)
    store.write("ipv", [{"user_id": "u", "n": 1}, {"user_id": "v", "n": 2}])
    assert store.pending() == 2
    assert store.query("SELECT user_id, n FROM ipv ORDER BY n") == [("u", 1), ("v", 2)]
    assert store.pending() == 0
    store.write("ipv", [{"user_id": "w", "n": 3}])
    assert store.read("ipv").num_rows == 3
    assert "ipv" in store.tables()
    store.close()


def test_age_threshold_flushes_on_the_next_write(tmp_path):
    store = CollectiveStorage(tmp_path / "f.duckdb", flush_rows=1000, flush_interval_s=0.05)
    store.write("a", [{"x": 1}])
    assert store.pending() == 1
    time.sleep(0.1)
    store.write("b", [{"y": 2}])
    assert store.pending() == 0
    store.close()


def test_close_flushes_and_is_idempotent(tmp_path):
    db = tmp_path / "f.duckdb"
    store = CollectiveStorage(db, flush_rows=1000)
    store.write("ipv", [{"n": 1}])
    store.close()
    store.close()
    assert rows_in_file(db, "ipv") == 1
    with pytest.raises(RuntimeError, match="closed"):
        store.write("ipv", [{"n": 2}])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_flushes_buffered_rows(tmp_path, sig):
    db = tmp_path / "f.duckdb"
    script = textwrap.dedent(f"""
        import sys, time
        from connectors.storage import CollectiveStorage, flush_on_signals
        flush_on_signals()
        with CollectiveStorage({str(db)!r}, flush_rows=1000, flush_interval_s=3600) as store:
            store.write("ipv", [{{"n": i}} for i in range(7)])
            print("ready", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, sig)
    proc.wait(timeout=30)
    assert rows_in_file(db, "ipv") == 7


def test_sigkill_loses_at_most_the_buffer(tmp_path):
    db = tmp_path / "f.duckdb"
    script = textwrap.dedent(f"""
        import time
        from connectors.storage import CollectiveStorage
        store = CollectiveStorage({str(db)!r}, flush_rows=5, flush_interval_s=3600)
        store.write("ipv", [{{"n": i}} for i in range(12)])  # 12 >= 5: flushed as one batch
        store.write("ipv", [{{"n": 100}}])                    # buffered
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.kill()
    proc.wait(timeout=30)
    assert rows_in_file(db, "ipv") == 12


def test_new_columns_nulls_and_lists(tmp_path):
    store = CollectiveStorage(tmp_path / "f.duckdb", flush_rows=2)
    store.write("t", [{"a": 1, "b": None}, {"a": 2, "b": None}])  # b has no type yet
    store.write("t", [{"a": 3, "b": "x", "tags": ["p", "q"]}, {"a": 4}])
    assert store.query("SELECT a, b, tags FROM t ORDER BY a") == [
        (1, None, None), (2, None, None), (3, "x", ["p", "q"]), (4, None, None)]
    store.close()


def test_rows_a_table_cannot_take_go_to_dead_letter(tmp_path):
    store = CollectiveStorage(tmp_path / "f.duckdb", flush_rows=100)
    store.write("t", [{"user_id": "u1", "n": 1}])
    store.flush()
    store.write("t", [{"user_id": "u2", "n": 2}, {"user_id": "u3", "n": "not a number"}, {"user_id": "u4", "n": 4}])
    assert store.query("SELECT user_id FROM t ORDER BY 1") == [("u1",), ("u2",), ("u4",)]
    dead = store.query(f"SELECT source, reason, raw FROM {DEAD_LETTER_TABLE}")
    assert len(dead) == 1
    source, reason, raw = dead[0]
    assert source == "storage:t" and "refused by table t" in reason and "u3" in raw
    assert store.rows_written["t"] == 3 and store.rows_written[DEAD_LETTER_TABLE] == 1
    store.close()


def test_table_names_are_checked(tmp_path):
    store = CollectiveStorage(tmp_path / "f.duckdb")
    with pytest.raises(ValueError, match="letters, digits"):
        store.write('x"; DROP TABLE y; --', [{"a": 1}])
    assert check_table_name("ipv_2") == "ipv_2"
    store.close()


def test_db_path_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("STREAMFLOW_DB", raising=False)
    assert str(resolve_db_path()) == "streamflow.duckdb"
    monkeypatch.setenv("STREAMFLOW_DB", str(tmp_path / "env.duckdb"))
    assert resolve_db_path() == tmp_path / "env.duckdb"
    assert str(resolve_db_path("explicit.duckdb")) == "explicit.duckdb"


def test_column_names_are_quoted_so_a_name_with_sql_in_it_is_just_a_name(tmp_path):
    store = CollectiveStorage(tmp_path / "f.duckdb", flush_rows=1)
    store.write("keep", [{"user_id": "u"}])
    store.write("t", [{"user_id": "u"}])
    evil = 'user_id") FROM _sf_batch; COMMIT; DROP TABLE keep; SELECT typeof("user_id'
    store.write("t", [{"user_id": "v", evil: 1}])
    assert "keep" in store.tables()
    assert store.query(f'SELECT user_id, "{evil.replace(chr(34), chr(34) * 2)}" FROM t ORDER BY user_id') == [
        ("u", None), ("v", 1)]
    assert DEAD_LETTER_TABLE not in store.tables()
    store.close()


def test_quote_identifier_doubles_quotes():
    from connectors.storage import quote_identifier

    con = duckdb.connect()
    name = 'a"b""; DROP TABLE x; --'
    con.execute(f"CREATE TABLE x ({quote_identifier(name)} INTEGER)")
    assert con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'x'").fetchall() == [
        (name,)]
