"""Batch mode for jobs of stream tasks (streamflow/runners/batch_streams.py): every table, row for row and in the
order written, and every counter as when streaming; over generated jobs and inputs with dirty lines."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors import CollectiveStorage
from operators import (
    Aggregate,
    Count,
    CountBy,
    CountDistinct,
    CountWindow,
    Filter,
    First,
    KeyBy,
    Last,
    Map,
    Max,
    SessionWindow,
    Sum,
    TimeWindow,
)
from streamflow import Job, Task, load_job
from streamflow.runners import DeviceRunner
from streamflow.runners.batch_streams import CHUNK_EVENTS, COLUMNAR
from streamflow.sources import JsonLinesSource, TaobaoBehaviorSource
from tests.test_batch import _DIRTY, _USERS, REPO, T0, _clockless

ACTIVITY = load_job(REPO / "jobs" / "activity_windows.py").tasks[0]
SESSIONS = load_job(REPO / "jobs" / "sessions.py").tasks[0]


def _run(source, db: Path, tasks: list[Task], mode: str):
    runner = DeviceRunner(Job("j", tasks), CollectiveStorage(db), runtime_mode=mode)
    summary = runner.run(source)
    runner.close()
    tables = {name: runner.storage.query(f"SELECT * FROM {name}") for name in runner.storage.tables()}
    runner.storage.close()
    return summary, tables


def _compare(tmp_path: Path, make_source, tasks: list[Task], expect: str = "batch") -> tuple:
    for db in tmp_path.glob("*.duckdb*"):
        db.unlink()
    streamed, stream_tables = _run(make_source(), tmp_path / "s.duckdb", tasks, "streaming")
    batched, batch_tables = _run(make_source(), tmp_path / "b.duckdb", tasks, "automatic")
    assert batched.runtime_mode == expect
    assert _clockless({k: ((), v) for k, v in batch_tables.items()}) == _clockless(
        {k: ((), v) for k, v in stream_tables.items()})
    assert (batched.events_in, batched.rejected, batched.rows_written, batched.refused_rows) == (
        streamed.events_in, streamed.rejected, streamed.rows_written, streamed.refused_rows)
    assert {n: {**vars(s), "mode": ""} for n, s in batched.task_stats.items()} == {
        n: vars(s) for n, s in streamed.task_stats.items()}
    return batched, batch_tables


def _csv(tmp_path: Path, lines: list[str]):
    csv = tmp_path / "in.csv"
    csv.write_text("".join(line + "\n" for line in lines), errors="surrogateescape")
    return lambda: TaobaoBehaviorSource(csv)


def _lines(steps: list, dirty: list = ()) -> list[str]:
    clock: dict[str, int] = {}
    lines = []
    for user, item, behavior, gap in steps:  # per user never backwards; users interleave
        clock[user] = clock.get(user, T0) + gap
        lines.append(f"{user},{item},c{len(item)},{behavior},{clock[user]}")
    for at, line in dirty:
        lines.insert(min(at, len(lines)), line.format(ts=T0 + 10 * at, early=T0 - 3600 + at))
    return lines


def _weight(event) -> dict:
    if event.event_id == "cart" and event.ts % 7 == 0:
        raise ValueError("a cart at a multiple of 7 s")  # a step that fails on some events
    return {"user_id": event.user_id, "kind": event.event_id, "item_id": event["item_id"], "ts": event.ts,
            "w": len(event.event_id) if event.event_id != "fav" else 2.5}


@st.composite
def _windows_task(draw, name: str = "w") -> Task:
    slide = draw(st.sampled_from([5, 20, 60]))
    size = slide * draw(st.integers(1, 3))
    lateness = draw(st.sampled_from([0, 7, 30]))
    if lateness and lateness % slide == 0:
        lateness += 1
    aggregate = Aggregate(n=Count(), items=CountDistinct("item_id"), w=Sum("w"), top=Max("ts"),
                          first=First("kind"), last=Last("kind"), kinds=CountBy("kind"),
                          buys=Count(where=lambda row: row["kind"] == "buy"))
    after = draw(st.sampled_from([
        [],
        [Map(lambda row: {**row, "rate": row["w"] / (row["n"] - 1)})],  # fails on one-item windows
        [Filter(lambda row: row["n"] > 1), Map(lambda row: {"user_id": row["user_id"], "n": row["n"]})],
    ]))
    return Task(name, None, [Filter(lambda event: event.event_id != "page_exit"), Map(_weight), KeyBy("user_id"),
                             TimeWindow(size, slide=slide, out_of_orderness=draw(st.sampled_from([0, 5, 60])),
                                        allowed_lateness=lateness), aggregate, *after], input="stream")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_USERS, st.lists(st.tuples(st.integers(0, 40), _DIRTY), max_size=6), _windows_task())
def test_a_generated_windows_job_over_dirty_lines_writes_what_streaming_writes(tmp_path: Path, steps: list,
                                                                             dirty: list, task: Task) -> None:
    batched, _ = _compare(tmp_path, _csv(tmp_path, _lines(steps, dirty)), [task])
    assert batched.task_stats["w"].mode == COLUMNAR


def test_the_shared_sample_with_the_readme_windows_job(tmp_path: Path) -> None:
    lines = (REPO / "jobs" / "data" / "taobao_user_behavior_10k.csv").read_text().splitlines()
    _, tables = _compare(tmp_path, _csv(tmp_path, lines), [ACTIVITY])
    assert len(tables["activity"]) > 100 and len(tables["late_events"]) > 100


def test_a_job_whose_input_is_sorted_by_time_fires_every_window_in_order(tmp_path: Path) -> None:
    """Time order: nearly every event lands in open windows, thousands of firings, several chunks."""
    lines = (REPO / "jobs" / "data" / "taobao_user_behavior_10k.csv").read_text().splitlines()
    lines.sort(key=lambda line: int(line.rsplit(",", 1)[1]))
    _, tables = _compare(tmp_path, _csv(tmp_path, lines * 3), [ACTIVITY])
    assert len(tables["activity"]) > 10_000 and CHUNK_EVENTS < 3 * 10_000


def test_tasks_batch_mode_cannot_compute_at_once_run_item_by_item_in_the_same_run(tmp_path: Path) -> None:
    """A session window beside two time windows: its rows and theirs interleave in the shared tables (late events,
    task errors) as when streaming; the summary says how each ran."""
    lines = (REPO / "jobs" / "data" / "taobao_user_behavior_10k.csv").read_text().splitlines()[:3000]
    other = Task("fast", None, [Map(_weight), KeyBy("user_id"), TimeWindow(10, slide=5), Aggregate(n=Count()),
                                Map(lambda row: {**row, "inverse": 1 / (row["n"] - 1)})], input="stream")
    batched, tables = _compare(tmp_path, _csv(tmp_path, lines), [ACTIVITY, SESSIONS, other])
    modes = {name: stats.mode for name, stats in batched.task_stats.items()}
    assert modes["activity"] == modes["fast"] == COLUMNAR
    assert modes["sessions"].startswith("item by item: SessionWindow")
    assert {row[0] for row in tables["late_events"]} >= {"activity", "sessions", "fast"}


def test_count_windows_run_in_batch_mode_too(tmp_path: Path) -> None:
    lines = (REPO / "jobs" / "data" / "taobao_user_behavior_10k.csv").read_text().splitlines()[:4000]
    task = Task("c", None, [Filter(lambda event: event.event_id != "page_exit"), Map(_weight), KeyBy("kind"),
                            CountWindow(3, 2), Aggregate(n=Count(), w=Sum("w"), kinds=CountDistinct("kind"),
                                                         first=First("item_id")),
                            Map(lambda row: {**row, "per": row["w"] / (row["n"] - 2)})], input="stream")
    batched, tables = _compare(tmp_path, _csv(tmp_path, lines), [task])
    assert batched.task_stats["c"].mode == COLUMNAR and len(tables["c"]) > 100 and len(tables["task_errors"]) > 10


def test_json_lines_run_in_batch_mode_too(tmp_path: Path) -> None:
    _compare(tmp_path, lambda: JsonLinesSource(REPO / "tests" / "data" / "activity.jsonl"), [ACTIVITY])


def test_a_job_of_process_functions_only_streams_and_says_why(tmp_path: Path, caplog) -> None:
    task = Task("s", None, [KeyBy("user_id"), SessionWindow(30), Aggregate(n=Count())], input="stream")
    lines = ["7,10,30,pv,1511848800", "7,10,30,fav,1511848860"]
    _compare(tmp_path, _csv(tmp_path, lines), [task], expect="streaming")
    with pytest.raises(ValueError, match="no stream task has a keyed step batch mode computes at once"):
        DeviceRunner(Job("j", [task]), CollectiveStorage(tmp_path / "x.duckdb"), runtime_mode="batch").run(
            _csv(tmp_path, lines)())


def test_an_input_that_may_never_end_streams(tmp_path: Path) -> None:
    runner = DeviceRunner(Job("j", [ACTIVITY]), CollectiveStorage(tmp_path / "g.duckdb"), runtime_mode="automatic")
    events = iter(JsonLinesSource(REPO / "tests" / "data" / "activity.jsonl"))  # a generator: a live feed, say
    assert runner.run(events).runtime_mode == "streaming"


def test_an_event_time_past_what_batch_mode_windows_is_a_task_error_not_a_crash(tmp_path: Path) -> None:
    task = Task("far", None, [Map(lambda event: {"user_id": event.user_id, "t": 1e16 if event.event_id == "fav"
                                                 else event.ts}), KeyBy("user_id"), TimeWindow(60, ts="t"),
                              Aggregate(n=Count())], input="stream")
    lines = ["7,10,30,pv,1511848800", "7,10,30,fav,1511848860", "7,11,33,pv,1511848900"]
    runner = DeviceRunner(Job("j", [task]), CollectiveStorage(tmp_path / "f.duckdb"), runtime_mode="batch")
    summary = runner.run(_csv(tmp_path, lines)())
    assert summary.runtime_mode == "batch" and summary.task_stats["far"].errors == 1
    assert "past ±2**60 ms" in runner.storage.query("SELECT error FROM task_errors")[0][0]
    assert runner.storage.query("SELECT n FROM far") == [(1,), (3,)]  # the other items, windowed
