"""Test a job the way it will run: in memory over a list of events, on the device runner or on Flink.

:func:`run_job` runs a job over events and returns the rows of every table it wrote, sorted, so a
test compares them with ``==``; :func:`assert_same_on_runners` runs it on both runners and fails with
a readable diff when they disagree. Both use the real runners: the device runner with a temporary
DuckDB :class:`~connectors.storage.CollectiveStorage`, and the Flink runner (PyFlink's local
MiniCluster; imported only when asked for, so the device core never imports Flink).

Events are :class:`~streamflow.events.Event` objects or dicts of the same fields (``user_id,
event_id, page_id, ts, contents``); both runners read them as the same JSON lines, so an event that
is not valid is dead-lettered the same way on both. They may also be the path of an events file in
any format :func:`~streamflow.sources.open_source` reads.

Example:
    >>> from operators import Aggregate, Count
    >>> from streamflow.job import Job, Task
    >>> job = Job("favs", [Task("favs", ["fav"], [Aggregate(n=Count())], input="recent")])
    >>> rows = run_job(job, [Event("u", "fav", "item", 1.6e9),
    ...                      {"user_id": "u", "event_id": "fav", "page_id": "item", "ts": 1.6e9 + 1},
    ...                      {"user_id": "v", "event_id": "fav"}])
    >>> rows["favs"]
    [{'user_id': 'u', 'trigger_ts': 1600000000.0, 'n': 1}, {'user_id': 'u', 'trigger_ts': 1600000001.0, 'n': 2}]
    >>> [(r["source"], r["line"], r["reason"]) for r in rows["dead_letter"]]
    [('events', 3, 'missing field: page_id, ts')]
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import duckdb

from connectors.storage import DEAD_LETTER_TABLE, CollectiveStorage
from streamflow.events import Event
from streamflow.job import Job
from streamflow.runners.device import DeviceRunner
from streamflow.sources import open_source
from streamflow.summary import RunSummary

RUNNERS = ("device", "flink")
#: The ``source`` of dead letters of events given as a list (instead of a temporary file's path).
EVENTS_SOURCE = "events"
Events = Iterable[Event | Mapping[str, Any]] | str | os.PathLike[str]
Rows = dict[str, list[dict[str, Any]]]


def run_job(job: Job, events: Events, runner: str = "device", fmt: str | None = None, pace_ms: float = 0.0) -> Rows:
    """Run ``job`` over ``events`` on ``runner`` (``"device"`` or ``"flink"``): the rows of every table
    it wrote, by table (each task's sink, and ``dead_letter``, ``task_errors``, ``late_events`` when
    they have rows), each table's rows sorted by their values.

    ``fmt`` is the format of an events file (default: from its extension); ``pace_ms`` replays the
    events to Flink one per ``pace_ms`` ms, which makes its watermarks, and so which events are late,
    the same as on the device (see ``run_flink``).
    """
    with tempfile.TemporaryDirectory(prefix="streamflow-testing-") as tmp:
        return _run(job, _events_file(events, Path(tmp)), fmt, runner, Path(tmp), pace_ms)[0]


def assert_same_on_runners(job: Job, events: Events, fmt: str | None = None, pace_ms: float = 0.0) -> Rows:
    """Run ``job`` over ``events`` on the device runner and on Flink; ``AssertionError`` with a diff
    (tables, rows only one runner wrote, run counters) unless both wrote the same rows and counted
    the same. Returns the rows (as :func:`run_job` does) for further checks.

    Example (starts a JVM, so not run as a doctest)::

        rows = assert_same_on_runners(load_job("jobs/ipv.py"), "jobs/data/taobao_user_behavior_10k.csv")
        assert len(rows["ipv"]) == 10_000
    """
    with tempfile.TemporaryDirectory(prefix="streamflow-testing-") as tmp:
        path = _events_file(events, Path(tmp))
        results = {name: _run(job, path, fmt, name, Path(tmp) / name, pace_ms) for name in RUNNERS}
    diff = rows_diff(results["device"][0], results["flink"][0]) + summary_diff(results["device"][1],
                                                                                results["flink"][1])
    if diff:
        raise AssertionError(f"job {job.name!r}: the device and Flink runners disagree\n" + "\n".join(diff)
                             + _pace_hint(job, pace_ms))
    return results["device"][0]


PACE_HINT = ("\nhint: Flink emits watermarks periodically, so which events are late depends on how fast they "
             "arrive; pace_ms=150 replays one event per 150 ms so that lateness is decided per event, as on the "
             "device")


def _pace_hint(job: Job, pace_ms: float) -> str:
    """Why an unpaced job with stream tasks may disagree (README: "The same job on Apache Flink")."""
    return PACE_HINT if pace_ms <= 0 and any(task.input == "stream" for task in job.tasks) else ""


def rows_diff(device: Rows, flink: Rows, limit: int = 10, labels: tuple[str, str] = ("device", "Flink"),
              names: tuple[str, str] = ("the device", "Flink")) -> list[str]:
    r"""What differs between two runs' rows, one line per difference (at most ``limit`` rows per side
    and table); empty when they agree. ``labels`` and ``names`` (in sentences) name the two runs.

    Example:
        >>> print("\n".join(rows_diff({"t": [{"n": 1}, {"n": 2}]},
        ...                            {"t": [{"n": 1}, {"n": 3}], "late_events": [{"ts": 1.0}]})))
        table late_events: only Flink wrote it (1 rows)
        table t: 1 rows only on the device, 1 only on Flink
          device only: {'n': 2}
          Flink only:  {'n': 3}
    """
    lines = []
    for table in sorted(device.keys() | flink.keys()):
        if table not in flink:
            lines.append(f"table {table}: only {names[0]} wrote it ({len(device[table])} rows)")
            continue
        if table not in device:
            lines.append(f"table {table}: only {names[1]} wrote it ({len(flink[table])} rows)")
            continue
        ours, theirs = Counter(map(_canonical, device[table])), Counter(map(_canonical, flink[table]))
        only_device, only_flink = ours - theirs, theirs - ours
        if not (only_device or only_flink):
            continue
        lines.append(f"table {table}: {only_device.total()} rows only on {names[0]}, "
                     f"{only_flink.total()} only on {names[1]}")
        width = max(len(label) for label in labels) + len(" only:")
        for label, rows, extra in ((f"{labels[0]} only:".ljust(width), device[table], only_device),
                                   (f"{labels[1]} only:".ljust(width), flink[table], only_flink)):
            shown = [row for row in rows if extra[_canonical(row)] > 0][:limit]
            lines.extend(f"  {label} {row}" for row in shown)
            if extra.total() > len(shown):
                lines.append(f"  {label} ... and {extra.total() - len(shown)} more")
    return lines


def summary_diff(device: RunSummary, flink: RunSummary) -> list[str]:
    """The run counters (events in, tasks fired, rejected and refused records, per-task counts and quarantine)
    that differ."""
    lines = []
    for what, ours, theirs in _counters(device, flink):
        if ours != theirs:
            lines.append(f"{what}: device {ours}, Flink {theirs}")
    return lines


def _counters(device: RunSummary, flink: RunSummary) -> Iterable[tuple[str, Any, Any]]:
    yield "events in", device.events_in, flink.events_in
    yield "tasks fired", device.tasks_fired, flink.tasks_fired
    yield "rejected records", dict(device.rejected), dict(flink.rejected)
    yield "rows refused", device.refused_rows, flink.refused_rows
    for name in sorted(device.task_stats.keys() | flink.task_stats.keys()):
        ours, theirs = device.task_stats.get(name), flink.task_stats.get(name)
        yield (f"task {name} (fired, rows, errors)", ours and (ours.fired, ours.rows, ours.errors),
               theirs and (theirs.fired, theirs.rows, theirs.errors))
        yield f"task {name} quarantined", ours and ours.quarantined, theirs and theirs.quarantined


def _run(job: Job, events: Path | str, fmt: str | None, runner: str, workdir: Path, pace_ms: float
         ) -> tuple[Rows, RunSummary]:
    if runner not in RUNNERS:
        raise ValueError(f"unknown runner {runner!r}; expected one of {', '.join(RUNNERS)}")
    workdir.mkdir(parents=True, exist_ok=True)
    db = workdir / "features.duckdb"
    if runner == "device":
        with CollectiveStorage(db) as storage:
            device = DeviceRunner(job, storage)
            try:
                summary = device.run(open_source(events, fmt))
            finally:
                device.close()
    else:
        summary = _flink_runner()(job, events, fmt=fmt, db=db, pace_ms=pace_ms)
    rows = read_tables(db)
    if isinstance(events, Path) and DEAD_LETTER_TABLE in rows:  # the harness's own file: name it "events"
        for row in rows[DEAD_LETTER_TABLE]:
            if row.get("source") == str(events):
                row["source"] = EVENTS_SOURCE
        rows[DEAD_LETTER_TABLE].sort(key=_order)
    return rows, summary


def _flink_runner() -> Any:
    """``run_flink``, imported only now: the device core never imports Flink."""
    return importlib.import_module("streamflow.flink.runner").run_flink


def read_tables(db: str | os.PathLike[str]) -> Rows:
    """Every non-empty table of a DuckDB file as sorted row dicts."""
    with duckdb.connect(str(db), read_only=True) as con:
        tables = [row[0] for row in con.execute(
            "SELECT table_name FROM information_schema.tables ORDER BY 1").fetchall()]
        out = {}
        for table in tables:
            rows = con.sql(f'SELECT * FROM "{table}"').to_arrow_table().to_pylist()
            if rows:
                out[table] = sorted(rows, key=_order)
    return out


def _events_file(events: Events, tmp: Path) -> Path | str:
    """A caller's events file path as a ``str``, or the events written as JSON lines to a file in
    ``tmp`` (a ``Path``: dead letters naming it are renamed ``"events"``)."""
    if isinstance(events, (str, os.PathLike)):
        return os.fspath(events)
    path = tmp / f"{EVENTS_SOURCE}.jsonl"
    with open(path, "w", encoding="utf-8") as out:
        for i, event in enumerate(events):
            record = event.to_dict() if isinstance(event, Event) else event
            try:
                out.write(json.dumps(record) + "\n")
            except (TypeError, ValueError) as exc:
                raise ValueError(f"event {i} ({record!r}) cannot be written as a JSON line, which both runners "
                                 f"read: {exc}") from exc
    return path


def _order(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """A sort key for rows of one table: values in column order, None first, numbers, strings, the rest."""
    return tuple(_value_order(v) for v in row.values())


def _value_order(value: Any) -> tuple[Any, ...]:
    if value is None:
        return (0, 0)
    if isinstance(value, (bool, int, float)) and not (isinstance(value, float) and math.isnan(value)):
        return (1, value)
    if isinstance(value, str):
        return (2, value)
    return (3, repr(value))


def _canonical(row: Mapping[str, Any]) -> str:
    """Equal rows, equal text (NaN included, column order aside)."""
    return repr(sorted(row.items()))
