"""The Flink runner's ``--sink parquet:DIR`` (issue 29): the shipped tasks' rows as Parquet part files, one
directory per table, through Flink's ``FileSink`` at the job's parallelism.

The IPV job (its task from ``jobs/ipv.py`` with its columns declared) and a task whose rows do not all fit its
columns run at parallelism 2 on a MiniCluster into ``parquet:DIR``; the committed part files, read back with
pyarrow, hold the device runner's rows for the same job; the rows that do not fit are dead letters in the local
DuckDB file, counted. A shipped task without ``columns`` is refused before any JVM starts.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from operators import Aggregate, Count, First, Map
from streamflow.flink.sinks import SinkSpec, parquet_tables, parse_sink
from streamflow.job import Job, Task, load_job

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"
IPV_COLUMNS = {"user_id": "string", "trigger_ts": "double", "item_id": "string", "category_id": "string",
               "enter_ts": "double", "dwell_s": "double", "n_reload": "bigint", "n_fav": "bigint",
               "n_cart": "bigint", "n_buy": "bigint"}
ODD_COLUMNS = {"user_id": "string", "trigger_ts": "double", "n": "bigint", "twice": "double", "many": "boolean"}


def _misfit(row: dict) -> bool:
    return row["n"] == 3 or row["item"].endswith("7")


def _odd_row(row: dict) -> dict:
    """A row that fits ``ODD_COLUMNS`` (``twice`` an int: it widens to double) unless the visit had 3 events
    (``n`` then a string: no coercion) or its item id ends in 7 (an extra key)."""
    n = row["n"]
    out = {"n": str(n) if n == 3 else n, "twice": 2 * n, "many": n > 2}
    if row["item"].endswith("7"):
        out["extra"] = 1
    return out


def _clean_row(row: dict) -> dict:
    """``_odd_row`` as it would be if every row fitted (what the device runner is given, to compare)."""
    return {"n": row["n"], "twice": 2 * row["n"], "many": row["n"] > 2, "misfit": _misfit(row)}


def parquet_job(odd=_odd_row) -> Job:
    ipv = load_job(ROOT / "jobs" / "ipv.py")
    task = ipv.tasks[0]
    job = Job("ipv_parquet", [
        Task(task.name, task.trigger, task.pipeline, input=task.input, columns=IPV_COLUMNS),
        Task("odd", ["item"], [Aggregate(n=Count(), item=First("item_id")), Map(odd)], columns=ODD_COLUMNS),
        Task("local", ["item"], [Aggregate(n=Count())], tunnel=False),
    ])
    job.module = ipv.module  # ships jobs/ipv.py's functions to the workers by value
    return job


# --- no JVM ------------------------------------------------------------------------------------------------

def test_parse_sink_accepts_parquet_dir():
    assert parse_sink("parquet:out/features") == SinkSpec("parquet", "out/features")
    with pytest.raises(ValueError, match="expected duckdb:PATH, kafka:TOPIC or parquet:DIR"):
        parse_sink("parquet:")


@pytest.mark.parametrize(("columns", "message"), [
    ({"user_id": "string", "trigger_ts": "double", "n": "int"},
     "task 'c': column 'n' has type 'int'; expected one of string, bigint, double, boolean"),
    ({"user_id": "string", "n": "bigint"}, "task 'c': .* must declare 'trigger_ts' as 'double', got None"),
    ({"user_id": "string", "trigger_ts": "double", "bad name": "bigint"},
     "task 'c': column name 'bad name' must be letters"),
    ({}, "task 'c': columns must be a non-empty mapping"),
])
def test_task_columns_are_checked_when_the_task_is_made(columns, message):
    with pytest.raises(ValueError, match=message):
        Task("c", ["item"], [Aggregate(n=Count())], columns=columns)


def test_a_stream_task_declares_its_own_columns():
    from operators import KeyBy, TimeWindow
    task = Task("w", None, [KeyBy("user_id"), TimeWindow(10), Aggregate(n=Count())], input="stream",
                columns={"user_id": "string", "window_start": "double", "window_end": "double", "n": "bigint"})
    assert list(task.columns or {}) == ["user_id", "window_start", "window_end", "n"]


def test_a_shipped_task_without_columns_is_refused_before_any_jvm_starts(tmp_path):
    job = Job("j", [Task("with_cols", ["item"], [Aggregate(n=Count())],
                         columns={"user_id": "string", "trigger_ts": "double", "n": "bigint"}),
                    Task("no_cols", ["item"], [Aggregate(n=Count())])])
    refused = r"parquet:DIR needs the output columns of every shipped task: task 'no_cols' declares none"
    with pytest.raises(ValueError, match=refused):
        parquet_tables(job)
    pytest.importorskip("pyflink", exc_type=ImportError)
    from streamflow.flink import runner

    started = []
    original = runner.flink_environment
    runner.flink_environment = lambda *a, **k: started.append(1) or original(*a, **k)  # type: ignore[assignment]
    try:
        with pytest.raises(ValueError, match=refused):
            runner.run_flink(job, SAMPLE, db=tmp_path / "f.duckdb", sink=f"parquet:{tmp_path / 'out'}")
    finally:
        runner.flink_environment = original  # type: ignore[assignment]
    assert not started and not (tmp_path / "out").exists()


# --- on a MiniCluster ----------------------------------------------------------------------------------------

def _as_declared(rows: list[dict], columns: dict[str, str]) -> list[tuple]:
    cast = {"string": str, "bigint": int, "double": float, "boolean": bool}
    return sorted(tuple(None if row[c] is None else cast[kind](row[c]) for c, kind in columns.items())
                  for row in rows)


def test_ipv_into_parquet_at_parallelism_2_gives_the_device_runners_rows(tmp_path):
    pytest.importorskip("pyflink", reason="needs the flink extra", exc_type=ImportError)
    if shutil.which("java") is None:
        pytest.skip("the Flink runner needs a Java runtime")
    import cloudpickle
    import duckdb
    import pyarrow.dataset as pads

    from streamflow.flink import connector_jars
    from streamflow.flink.runner import run_flink
    from streamflow.testing import run_job

    connector_jars.fetch_parquet()
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _odd_row: the workers cannot import this file
    job = parquet_job()
    device = run_job(parquet_job(_clean_row), SAMPLE)
    out = tmp_path / "parquet"
    summary = run_flink(job, SAMPLE, db=tmp_path / "local.duckdb", parallelism=2, sink=f"parquet:{out}")

    assert sorted(p.name for p in out.iterdir()) == ["ipv", "odd"]  # the tunnel=False task stays in DuckDB
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {p.parent.parent for p in files} == {out}  # DIR/<table>/part-...: no date-hour folders
    assert files and all(p.name.startswith("part-") and p.suffix == ".parquet" for p in files)  # all committed
    assert not [p for p in files if ".inprogress" in p.name]

    ipv = pads.dataset(out / "ipv", format="parquet").to_table()
    assert ipv.schema.names == list(IPV_COLUMNS)
    assert len(device["ipv"]) == ipv.num_rows == 10_000
    assert _as_declared(ipv.to_pylist(), IPV_COLUMNS) == _as_declared(device["ipv"], IPV_COLUMNS)

    odd_device = device["odd"]
    fits = [r for r in odd_device if not r["misfit"]]
    misfits = [r for r in odd_device if r["misfit"]]
    assert fits and misfits
    odd = pads.dataset(out / "odd", format="parquet").to_table().to_pylist()
    assert _as_declared(odd, ODD_COLUMNS) == _as_declared(fits, ODD_COLUMNS)
    assert all(isinstance(r["twice"], float) for r in odd)  # the int widened

    with duckdb.connect(str(tmp_path / "local.duckdb"), read_only=True) as con:
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        assert "ipv" not in tables and "odd" not in tables
        assert con.execute("SELECT count(*) FROM local").fetchone()[0] == len(device["local"])
        dead = con.execute("SELECT source, reason FROM dead_letter").fetchall()
    assert len(dead) == len(misfits) == summary.rejected["parquet"]
    assert {source for source, _ in dead} == {"parquet:odd"}
    reasons = {reason for _, reason in dead}
    assert "parquet: row does not fit table odd's declared columns: column 'n' is bigint; got str '3'" in reasons
    assert "parquet: row does not fit table odd's declared columns: key 'extra' is not a declared column" in reasons
    assert summary.task_stats["ipv"].rows == 10_000 and summary.task_stats["odd"].rows == len(odd_device)


def test_a_stream_tasks_windows_into_parquet_give_the_device_runners_rows_and_counts(tmp_path):
    pytest.importorskip("pyflink", reason="needs the flink extra", exc_type=ImportError)
    if shutil.which("java") is None:
        pytest.skip("the Flink runner needs a Java runtime")
    import pyarrow.dataset as pads

    from operators import Filter, KeyBy, TimeWindow
    from streamflow.flink.runner import run_flink
    from streamflow.testing import run_job

    # All users' lines in time order (each user's own order kept): no event is late on either runner.
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()[:3000]
    events = tmp_path / "by_time.csv"
    events.write_text("\n".join(sorted(lines, key=lambda line: int(line.rsplit(",", 1)[1]))) + "\n", encoding="utf-8")
    columns = {"user_id": "string", "window_start": "double", "window_end": "double", "n": "bigint"}
    job = Job("hourly", [Task("hourly", None, [Filter(lambda e: e.event_id != "page_exit"), KeyBy("user_id"),
                                               TimeWindow(3600), Aggregate(n=Count())],
                              input="stream", columns=columns)])
    device = run_job(job, events)["hourly"]
    out = tmp_path / "parquet"
    summary = run_flink(job, events, db=tmp_path / "local.duckdb", parallelism=2, sink=f"parquet:{out}")

    rows = pads.dataset(out / "hourly", format="parquet").to_table().to_pylist()
    assert len(device) > 100 and _as_declared(rows, columns) == _as_declared(device, columns)
    assert summary.task_stats["hourly"].rows == summary.task_stats["hourly"].fired == len(device)
    assert not summary.rejected
