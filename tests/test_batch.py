"""Batch mode (streamflow.runners.batch, streamflow.columnar): the same rows as streaming, or it streams."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from connectors import CollectiveStorage
from operators import Aggregate, Count, CountBy, Filter, First, Last, Map, Max, Min
from operators.base import ElementStep
from streamflow import Job, Task, load_job
from streamflow.columnar import Column, ColumnRow, NotColumnar, run_row_steps
from streamflow.runners import DeviceRunner
from streamflow.sources import LineSource, TaobaoBehaviorSource
from streamflow.summary import RunSummary

REPO = Path(__file__).resolve().parents[1]
IPV = load_job(REPO / "jobs" / "ipv.py").tasks[0]
T0 = 1_511_848_800


def _visit_counts(row: dict) -> dict:
    return {"n": row["n"], "views": row["kinds"].get("pv", 0) * 2 - 1, "last": row["last"],
            "span_min": (row["hi"] - row["lo"]) / 60, "buys": row["kinds"].get("buy", 0) > 0}


COUNTS = Task("counts", ["item"], [
    Aggregate(n=Count(), kinds=CountBy("event_id"), last=Last("event_id"), lo=Min("ts"), hi=Max("ts"),
              user=First("user_id")),
    Map(_visit_counts),
    Filter(lambda row: row["n"] % 3 != 0),
], input="page")


def _run(csv: Path | LineSource, db: Path, tasks: list[Task], mode: str) -> tuple[RunSummary, dict]:
    """The run's summary and its tables (columns, rows in physical order); ``csv`` a Taobao CSV or any source."""
    runner = DeviceRunner(Job("j", tasks), CollectiveStorage(db), runtime_mode=mode)
    summary = runner.run(csv if isinstance(csv, LineSource) else TaobaoBehaviorSource(csv))
    runner.close()
    tables = {}
    for name in runner.storage.tables():
        columns = runner.storage.query(f"SELECT column_name, data_type FROM information_schema.columns "
                                       f"WHERE table_name = '{name}' ORDER BY ordinal_position")
        tables[name] = (columns, runner.storage.query(f"SELECT * FROM {name}"))  # physical order, as written
    runner.storage.close()
    return summary, tables


def _compare_modes(tmp_path: Path, lines: list[str], tasks: list[Task], expect: str = "batch") -> dict:
    csv = tmp_path / "in.csv"
    csv.write_text("".join(line + "\n" for line in lines), errors="surrogateescape")  # \udcff: the byte 0xff
    for db in tmp_path.glob("*.duckdb*"):
        db.unlink()
    streamed, stream_tables = _run(csv, tmp_path / "s.duckdb", tasks, "streaming")
    batched, batch_tables = _run(csv, tmp_path / "b.duckdb", tasks, "automatic")
    _assert_same_run(batched, batch_tables, streamed, stream_tables, expect)
    return batch_tables


def _assert_same_run(batched: RunSummary, batch_tables: dict, streamed: RunSummary, stream_tables: dict,
                     expect: str) -> None:
    """The default mode's run (``expect``: the runtime mode it must have taken) wrote what streaming did: tables,
    dead letters, counters, each task's stats."""
    assert batched.runtime_mode == expect
    assert _clockless(batch_tables) == _clockless(stream_tables)
    assert (batched.events_in, batched.rejected, batched.rows_written) == (
        streamed.events_in, streamed.rejected, streamed.rows_written)
    assert {n: vars(s) for n, s in batched.task_stats.items()} == {n: vars(s) for n, s in streamed.task_stats.items()}


def _clockless(tables: dict) -> dict:
    """The tables with the guard's upper bound (the wall clock when the run read it) out of dead-letter reasons."""
    if "dead_letter" not in tables:
        return tables
    columns, rows = tables["dead_letter"]
    bound = re.compile(r", \d+\] \(2000")
    rows = [tuple(bound.sub(", NOW] (2000", v) if isinstance(v, str) else v for v in row) for row in rows]
    return {**tables, "dead_letter": (columns, rows)}


# ids of one to eight bytes and longer (one word or several), "007" next to "7"
_USERS = st.lists(st.tuples(st.sampled_from(["7", "007", "u9", "user-with-a-long-id-0001"]),
                            st.sampled_from(["10", "010", "11", "item:a-much-longer-identifier"]),
                            st.sampled_from(["pv", "pv", "fav", "cart", "buy"]),
                            st.sampled_from([0, 0, 5, 60, 1800, 1801, 4000])), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_USERS)
def test_batch_mode_writes_what_streaming_writes(tmp_path: Path, steps: list) -> None:
    clock: dict[str, int] = {}
    lines = []
    for user, item, behavior, gap in steps:  # per user never backwards; users interleave
        clock[user] = clock.get(user, T0) + gap
        lines.append(f"{user},{item},c{len(item)},{behavior},{clock[user]}")
    _compare_modes(tmp_path, lines, [IPV, COUNTS])


def test_the_shared_sample_gives_the_same_rows_in_both_modes(tmp_path: Path) -> None:
    lines = (REPO / "jobs" / "data" / "taobao_user_behavior_10k.csv").read_text().splitlines()
    tables = _compare_modes(tmp_path, lines, [IPV, COUNTS])
    assert len(tables["ipv"][1]) == 10_000


@pytest.mark.parametrize(("line", "dead_letters"), [
    ("7,10,30,nap,1511848900", 1),
    ("7,10,30,pv", 1),
    ("", 0),  # a blank line is no record
    ("   ", 0),
    ("7,10,30,pv,1511848000", 1),  # earlier than the user's previous line
    ("7,10,30,pv,0000000000000001511848900", 1),  # more than 15 digits
    ("7,10,30,pv,15118489x0", 1),
    ("7,10,30,pv,-", 1),
    ("7,,30,pv,1511848900", 1),
    ("7,10,30,pv,1511848900,", 1),
    ("7,10,30,pv,5", 1),  # before 2000
    ("7,10,30,pv,99999999999999", 1),  # far in the future
    ("7,10\udcff,30,pv,1511848900", 1),  # a byte that is not UTF-8
    ("7,10," + "x" * 70 + ",pv,1511848900", 0),  # wider than a column window: plain to the parser
])
def test_a_line_the_streaming_run_rejects_is_the_same_dead_letter_in_batch_mode(
        tmp_path: Path, line: str, dead_letters: int) -> None:
    lines = ["7,10,30,pv,1511848800", line, "7,11,33,buy,1511849000"]
    if len(line) > 64:
        tables = _compare_modes(tmp_path, lines, [IPV], expect="streaming")
    else:
        tables = _compare_modes(tmp_path, lines, [IPV])
    assert len(tables.get("dead_letter", ((), ()))[1]) == dead_letters


@pytest.mark.parametrize(("line", "why", "dead_letters"), [
    ("7, 10,30,pv,1511848900", "taken only after trimming", 0),  # streaming strips the space
    ("7,10,30\r,pv,1511848900", "a lone carriage return", 2),  # two lines when read as text
    ("7\u00e9,10,30,pv,1511848900", "taken only after trimming or decoding", 0),  # a user id not in ASCII
])
def test_a_line_only_the_line_reader_reads_makes_the_run_stream_and_says_why(
        tmp_path: Path, line: str, why: str, dead_letters: int) -> None:
    lines = ["7,10,30,pv,1511848800", line, "7,11,33,buy,1511849000"]
    tables = _compare_modes(tmp_path, lines, [IPV], expect="streaming")
    assert len(tables.get("dead_letter", ((), ()))[1]) == dead_letters
    csv = tmp_path / "in.csv"
    runner = DeviceRunner(Job("j", [IPV]), CollectiveStorage(tmp_path / "x.duckdb"), runtime_mode="batch")
    with pytest.raises(ValueError, match=why):
        runner.run(TaobaoBehaviorSource(csv))


_DIRTY = st.sampled_from(["7,10,30,nap,{ts}", "7,10,30,pv", "", "7,,30,pv,{ts}", "u9,11,c2,buy,{ts},", "x,y,z,pv,1x",
                          "7,10,30,pv,3", "007,10,30,pv,99999999999999", "u9,10,30,cart,{early}", "\udcff,1,2,pv,{ts}"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_USERS, st.lists(st.tuples(st.integers(0, 40), _DIRTY), max_size=8))
def test_dirty_lines_anywhere_are_dead_letters_and_the_rest_runs_in_batch(tmp_path: Path, steps: list,
                                                                          dirty: list) -> None:
    clock: dict[str, int] = {}
    lines = []
    for user, item, behavior, gap in steps:
        clock[user] = clock.get(user, T0) + gap
        lines.append(f"{user},{item},c{len(item)},{behavior},{clock[user]}")
    for at, line in dirty:  # a step back in time too: the user's clock minus an hour
        lines.insert(min(at, len(lines)), line.format(ts=T0 + 10 * at, early=T0 - 3600 + at))
    tables = _compare_modes(tmp_path, lines, [IPV, COUNTS])
    refused = sum(1 for _, line in dirty if line and "{early}" not in line)
    steps_back = sum("{early}" in line for _, line in dirty)  # refused only after a later line of the user
    assert refused <= len(tables.get("dead_letter", ((), ()))[1]) <= refused + steps_back


def test_rows_a_table_refuses_are_dead_letters_in_both_modes(tmp_path: Path) -> None:
    csv = tmp_path / "in.csv"
    csv.write_text("7,10,30,pv,1511848800\n7,11,33,pv,1511848860\n7,12,36,pv,1511848900\n")
    found = {}
    for mode in ("streaming", "batch"):
        storage = CollectiveStorage(tmp_path / f"{mode}.duckdb")
        storage.query("CREATE TABLE ipv (user_id VARCHAR, trigger_ts DOUBLE, item_id VARCHAR CHECK (item_id <> '11'))")
        runner = DeviceRunner(Job("j", [IPV]), storage, runtime_mode=mode)
        summary = runner.run(TaobaoBehaviorSource(csv))
        runner.close()
        found[mode] = (summary.runtime_mode, summary.refused_rows, storage.query("SELECT item_id FROM ipv"),
                       storage.query("SELECT source, reason LIKE '%CHECK%' FROM dead_letter"))
        storage.close()
    assert found["batch"][0] == "batch"
    assert found["batch"][1:] == found["streaming"][1:] == (
        {"ipv": 1}, [("10",), ("12",)], [("storage:ipv", True)])


def test_windows_line_ends_run_in_batch_mode(tmp_path: Path) -> None:
    _compare_modes(tmp_path, ["7,10,30,pv,1511848800\r", "7,10,30,cart,1511848860\r", "7,11,33,buy,1511849000"], [IPV])


@pytest.mark.parametrize("step", [
    Map(lambda row: {"log_n": math.log1p(row["n"])}),                      # a conversion: per row
    Map(lambda row: {"x": 1 if isinstance(row["n"], int) else 2}),          # caught by the sample check
    Map(lambda row: {"inverse": 1 / (row["kinds"].get("fav", 0))}),         # 0 in some rows: task errors
    Map(lambda row: {"f": row["kinds"]["fav"]}),                            # a KeyError in some rows
    Map(lambda row: {"big": row["n"] * 2 ** 60}),                           # past 2**53
    Map(lambda row: {"n": row["n"], "who": row["kinds"] == "x"}),           # a dict compared with text
])
def test_a_step_columns_cannot_follow_streams_with_the_same_rows(tmp_path: Path, step: Map) -> None:
    task = Task("t", ["item"], [Aggregate(n=Count(), kinds=CountBy("event_id")), step], input="page")
    lines = ["7,10,30,pv,1511848800", "7,10,30,fav,1511848860", "7,11,33,pv,1511848900", "8,12,36,cart,1511848900"]
    _compare_modes(tmp_path, lines, [task], expect="streaming")


def test_a_job_batch_mode_does_not_cover_streams(tmp_path: Path) -> None:
    task = Task("favs", ["fav"], [Aggregate(n=Count())], input="recent")
    _compare_modes(tmp_path, ["7,10,30,fav,1511848800", "7,10,30,fav,1511848860"], [task], expect="streaming")


_NUMBERS = st.one_of(st.integers(-1000, 1000), st.floats(-1e6, 1e6, allow_nan=False), st.booleans())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_NUMBERS, _NUMBERS), min_size=1, max_size=8),
       st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "==", "<", ">=", "&", "|"]))
@example([(2, 64)], "**")  # 2**64 wraps to 0 in int64
@example([(3_000_000_000, 4_000_000_000)], "*")
@example([(True, False)], "&")
def test_column_arithmetic_is_python_arithmetic_or_refused(pairs: list, op: str) -> None:
    a = [x for x, _ in pairs]
    b = [y for _, y in pairs]
    if len({type(v) for v in a}) > 1 or len({type(v) for v in b}) > 1:
        return  # a column holds one type
    fn = eval(f"lambda r: {{'out': r['a'] {op} r['b']}}")  # noqa: S307 - the operator comes from the list above
    try:
        expected = [fn({"a": x, "b": y})["out"] for x, y in pairs]
    except (ZeroDivisionError, OverflowError, TypeError, ValueError):
        expected = None
    row = {"a": Column(np.array(a)), "b": Column(np.array(b))}
    try:
        out, _ = run_row_steps([ElementStep("map", fn)], row, len(pairs))
    except NotColumnar:
        return  # refused: the rows run one by one
    assert expected is not None, f"{op} over {pairs} should have been refused"
    got = out["out"].values.tolist()
    assert [type(v) for v in got] == [type(v) for v in expected]
    assert got == expected


def test_a_missing_field_read_with_get_gives_the_default_in_both_modes(tmp_path: Path) -> None:
    task = Task("t", ["item"], [Aggregate(n=Count()), Map(lambda row: {"n": row["n"], "x": row.get("x", 7)})],
                input="page")
    tables = _compare_modes(tmp_path, ["7,10,30,pv,1511848800", "7,11,30,fav,1511848860"], [task])
    assert [row[-1] for row in tables["t"][1]] == [7, 7]


def test_a_row_of_columns_refuses_what_a_value_would_decide() -> None:
    row = ColumnRow({"n": Column(np.array([1, 2]))})
    for use in (bool, int, float, str, repr, hash, math.log1p, lambda c: f"{c}", lambda c: c if c > 1 else 0):
        with pytest.raises(NotColumnar):
            use(row["n"])
    with pytest.raises(NotColumnar):
        row["missing"]
