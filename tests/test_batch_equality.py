"""Equality is the contract (issue 24 item 5): over generated jobs and dirty inputs, the default mode (batch where
it applies, streaming where it does not) writes every table row for row, in the order written, the same dead
letters with the same reasons, and the same summary counters as ``--mode streaming``.

The jobs are drawn from the operator set: trigger tasks with any trigger sequence (``*`` gaps included) over
``input="page"``, ``"recent"`` or ``"pages"``; stream tasks keyed by different fields with a tumbling or sliding
``TimeWindow``, a ``SessionWindow`` or a ``CountWindow``, out-of-orderness and allowed lateness; every aggregation
(with and without ``where=``); Map and Filter steps before and after the keyed step, some that no column can follow
(text made of a count, a lambda on an event's contents, a step that raises on some rows). The inputs are small
Taobao CSV files and JSON-lines files of interleaved users whose clocks disagree (events out of order across users),
with bad lines anywhere: a wrong field count, an empty field, bad UTF-8, an unknown behaviour, a bad or absurd
timestamp, a timestamp going backwards within a user, malformed JSON. Both runs use chunks small enough that users,
windows and open pages straddle chunk borders.

A job is drawn as a spec (plain data, so that a failing example prints readably) and built into tasks here. Shapes
batch mode has no columnar form for stream (the whole run, or the tasks concerned): the comparison holds all the
same, and the shapes that batch mode does compute are asserted to run columnar (:func:`_expected_columnar`), so the
test cannot pass by everything streaming.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from connectors import CollectiveStorage
from operators import (
    Aggregate,
    Count,
    CountBy,
    CountDistinct,
    CountWindow,
    Distinct,
    Filter,
    First,
    KeyBy,
    Last,
    LastN,
    Map,
    Max,
    Min,
    SessionWindow,
    Sum,
    TimeWindow,
)
from streamflow import Event, Job, Task
from streamflow.runners import DeviceRunner, batch, batch_streams
from streamflow.runners.batch_streams import COLUMNAR
from streamflow.sources import JsonLinesSource, TaobaoBehaviorSource, event_from_json

T0 = 1_511_848_800

# -- inputs ----------------------------------------------------------------------------------------------------------

_USERS = ["7", "007", "u9", "8"]
#: each user's clock starts this far after T0: users interleave with clocks that disagree (disorder across users)
_STARTS = st.sampled_from([0, 0, 3, 40, 700])
_STEPS = st.lists(st.tuples(st.sampled_from(_USERS), st.sampled_from(["10", "11", "12"]),
                            st.sampled_from(["pv", "pv", "fav", "cart", "buy"]),
                            st.sampled_from([0, 0, 1, 5, 13, 60, 1800, 1801, 4000])), min_size=1, max_size=50)

#: bad lines: @U a user, @TS a time near the user's clock (the line is refused for another reason), @EARLY a time
#: before every clock (backwards within a user that has a line before it; a first line otherwise)
_CSV_BAD = [
    "@U,10,c2,nap,@TS",  # an unknown behaviour
    "@U,10,c2,pv",  # a wrong field count
    "@U,10,c2,pv,@TS,",
    "@U,,c2,pv,@TS",  # an empty field
    "@U,1\udcff,c2,pv,@TS",  # a byte that is not UTF-8
    "@U,10,c2,pv,15118x8800",  # a timestamp that is no integer
    "@U,10,c2,pv,3",  # before 2000
    "@U,10,c2,pv,99999999999999",  # far in the future
    "@U,10,c2,buy,@EARLY",  # backwards within the user
    "@U,11,c3,pv,@EARLY",
    "",  # a blank line is no record
]
#: taken only after trimming or decoding: batch mode streams from the chunk that holds it
_CSV_STREAMS = ["@U, 10,c2,pv,@TS", "@U\u00e9,10,c2,pv,@TS"]
_JSON_BAD = [
    '{"user_id": "@U", "event_id": "pv"',  # malformed
    '{"user_id": "@U", "event_id": "pv", "ts": @TS}',  # a missing field
    '{"user_id": true, "event_id": "pv", "page_id": "item", "ts": @TS}',  # a wrong type
    '{"user_id": "", "event_id": "pv", "page_id": "item", "ts": @TS}',
    '{"user_id": "@U", "event_id": "pv", "page_id": "item", "ts": "@TS"}',
    '{"user_id": "@U", "event_id": "p\udcffv", "page_id": "item", "ts": @TS}',  # a byte that is not UTF-8
    '{"user_id": "@U", "event_id": "pv", "page_id": "item", "ts": 3}',  # before 2000
    '{"user_id": "@U", "event_id": "pv", "page_id": "item", "ts": 99999999999999}',
    '{"user_id": "@U", "event_id": "buy", "page_id": "item", "ts": @EARLY, "contents": {"item_id": "10"}}',
    '{"user_id": "@U", "event_id": "pv", "page_id": "item", "ts": @TS, "contents": [1]}',
    "[1, 2]",
    "",
    # not bad, but without the contents the steps read: their steps raise
    '{"user_id": "@U", "event_id": "fav", "page_id": "item", "ts": @LATER}',
    # odd but taken (or not) as json.loads takes them
    '{"user_id": "@U", "event_id": "pv", "page_id": "item", "ts": NaN}',
    '{"user_id": "@U", "event_id": "pv", "page_id": "item", "ts": -Infinity}',
    '{"user_id": "@U", "event_id": "pv", "page_id": "item", "ts": 99999999999999999999}',
    '{"user_id": "@U", "event_id": "cart", "page_id": "item", "ts": @TS, "ts": 3}',  # the last key counts
    '{"user_id": "\\u0037", "event_id": "fav", "page_id": "item", "ts": @LATER, "contents": {"item_id": "10"}}',
    '{"user_id": "@U", "event_id": 5, "page_id": "item", "ts": @LATER.5e0, "contents": null}',
    '{"user_id": "@U", "event_id": "pv", "page_id": "item", "ts": @LATER, "contents": {"item_id": 10}}',
    ' {"user_id": "@U", "event_id": "buy", "page_id": "item", "ts": @LATER, "contents": {"item_id": "11"}} ',
    '{"user_id": "@U", "event_id": "pv", "page_id": "item", "ts": true}',
]
_DIRTY = st.lists(st.tuples(st.integers(0, 40), st.sampled_from(_USERS), st.integers(0, len(_JSON_BAD) - 1)),
                  max_size=8)


def _csv_line(user: str, item: str, behavior: str, ts: int) -> str:
    return f"{user},{item},c{int(item) % 3},{behavior},{ts}"


def _json_line(user: str, item: str, behavior: str, ts: float) -> str:
    uid: Any = int(user) if user == "8" else user  # ids may be integers
    return json.dumps({"user_id": uid, "event_id": behavior, "page_id": "item" if item != "12" else "home",
                       "ts": ts, "contents": {"item_id": item, "category_id": f"c{int(item) % 3}"}})


@st.composite
def _inputs(draw: st.DrawFn) -> tuple[str, list[str]]:
    """``(format, lines)``: one user's lines never go backwards but for the bad lines; users interleave."""
    fmt = draw(st.sampled_from(["csv", "csv", "jsonl"]))
    starts = {user: draw(_STARTS) for user in _USERS}
    clock = dict.fromkeys(_USERS, 0)
    lines = []
    for user, item, behavior, gap in draw(_STEPS):
        clock[user] = clock[user] + gap
        ts = T0 + starts[user] + clock[user]
        if fmt == "csv":
            lines.append(_csv_line(user, item, behavior, ts))
            continue
        if behavior == "pv" and gap in (0, 1801):  # JSON lines carry what they carry: page events too
            behavior = "page_enter" if gap == 0 else "page_exit"
        elif behavior == "cart" and gap == 13:
            behavior = "page_exit"
        lines.append(_json_line(user, item, behavior, ts + 0.25 * (gap == 1)))  # and times between seconds
    bad = _CSV_BAD if fmt == "csv" else _JSON_BAD
    for at, user, which in draw(_DIRTY):
        ts = T0 + starts[user] + clock[user]
        line = bad[which % len(bad)]
        if fmt == "csv" and draw(st.integers(0, 30)) == 0:
            line = draw(st.sampled_from(_CSV_STREAMS))
        for mark, value in (("@U", user), ("@TS", str(ts)), ("@EARLY", str(T0 - 3600 + at)),
                            ("@LATER", str(ts + 9000))):
            line = line.replace(mark, value)
        lines.insert(min(at, len(lines)), line)
    return fmt, lines


SAMPLE = Path(__file__).resolve().parents[1] / "jobs" / "data" / "taobao_user_behavior_10k.csv"


@st.composite
def _sample_inputs(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A stretch of the shared Taobao sample (real users, items and pages; the file is grouped by user), its users'
    lines interleaved at random (each user's in order), bad lines anywhere; as CSV or as JSON lines."""
    rows = [line.split(",") for line in SAMPLE.read_text().splitlines()]
    start = draw(st.integers(0, len(rows) - 50))
    rows = rows[start:start + draw(st.integers(50, 400))]
    rng = draw(st.randoms(use_true_random=False))
    by_user: dict[str, list[list[str]]] = {}
    for row in rows:
        by_user.setdefault(row[0], []).append(row)
    queues = [iter(lines) for lines in by_user.values()]
    pulls = [k for k, lines in enumerate(by_user.values()) for _ in lines]
    rng.shuffle(pulls)
    fmt = draw(st.sampled_from(["csv", "jsonl"]))
    lines: list[str] = []
    viewing: dict[str, str] = {}  # JSON lines: each user's item page open, closed when the user views another
    for k in pulls:
        user, item, category, behavior, ts = next(queues[k])
        if fmt == "csv":
            lines.append(",".join((user, item, category, behavior, ts)))
            continue
        contents = {"item_id": item, "category_id": category}
        if viewing.get(user, item) != item:
            lines.append(json.dumps({"user_id": user, "event_id": "page_exit", "page_id": "item", "ts": int(ts),
                                     "contents": {"item_id": viewing[user], "category_id": category}}))
        if behavior == "pv" and viewing.get(user) != item:
            behavior = "page_enter"
        viewing[user] = item
        lines.append(json.dumps({"user_id": user, "event_id": behavior, "page_id": "item", "ts": int(ts),
                                 "contents": contents}))
    bad = _CSV_BAD if fmt == "csv" else _JSON_BAD
    users = list(by_user)
    for _ in range(draw(st.integers(0, 12))):
        at, user = rng.randrange(len(lines) + 1), rng.choice(users)
        line = bad[rng.randrange(len(bad))]
        for mark, value in (("@U", user), ("@TS", str(T0 + 3600)), ("@EARLY", str(T0 - 3600)),
                            ("@LATER", str(T0 + 9000))):
            line = line.replace(mark, value)
        lines.insert(at, line)
    return fmt, lines


# -- jobs ------------------------------------------------------------------------------------------------------------

def _not_exit(item: Any) -> bool:
    return item["event_id"] != "page_exit"


def _even_second(item: Any) -> bool:
    return int(item["ts"]) % 2 == 0


def _event_length(item: Any) -> int:
    return len(item["event_id"])


WHERE = {None: None, "not_exit": _not_exit, "even_second": _even_second}
#: every aggregation, with the fields it reads (events' attributes and contents; a page visit reads its enter event)
AGGREGATIONS: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "Count": (lambda field, where: Count(where=where), (None,)),
    "Sum": (lambda field, where: Sum(field, where=where), ("ts", _event_length)),
    "Min": (lambda field, where: Min(field, where=where), ("ts", "item_id", "event_id")),
    "Max": (lambda field, where: Max(field, where=where), ("ts", "category_id", "event_id")),
    "First": (lambda field, where: First(field, where=where), ("item_id", "event_id", "ts", "category_id", "user_id")),
    "Last": (lambda field, where: Last(field, where=where), ("event_id", "item_id", "ts", "page_id")),
    "LastN": (lambda field, where: LastN(field, 2, where=where), ("event_id", "ts")),
    "Distinct": (lambda field, where: Distinct(field, where=where), ("item_id", "event_id")),
    "CountBy": (lambda field, where: CountBy(field, where=where), ("event_id", "item_id")),
    "CountDistinct": (lambda field, where: CountDistinct(field, where=where), ("item_id", "category_id")),
}


def _as_row(event: Any) -> dict[str, Any]:
    return {"user_id": event.user_id, "event_id": event.event_id, "page_id": event.page_id, "ts": event.ts,
            "item_id": event["item_id"], "category_id": event["category_id"]}  # a KeyError without contents


def _contents(item: Any) -> bool:
    return getattr(item, "contents", {}).get("category_id") != "c2"  # a lambda on an event's contents


#: element steps before an Aggregate (a trigger task's) or before the key (a stream task's)
BEFORE = {"not_exit": lambda: Filter(_not_exit), "contents": lambda: Filter(_contents), "as_row": lambda: Map(_as_row)}
#: element steps after an Aggregate or a window: each row has ``n`` (every aggregate counts)
AFTER = {
    "odd": lambda: Filter(lambda row: row["n"] % 2 == 1),
    "half": lambda: Map(lambda row: {**row, "half": row["n"] / 2}),
    "project": lambda: Map(lambda row: {"n": row["n"], "many": row["n"] > 2}),
    "inverse": lambda: Map(lambda row: {**row, "inverse": 1 / (row["n"] - 1)}),  # raises on one-item rows
    "text": lambda: Map(lambda row: {**row, "tag": "n=" + str(row["n"])}),  # no column follows str()
    "log": lambda: Map(lambda row: {**row, "log": math.log1p(row["n"])}),
    "favs": lambda: Map(_favs),
}
#: what batch mode computes over columns after a trigger task's Aggregate
COLUMNAR_AFTER = {"odd", "half", "project", "favs"}


def _favs(row: Any) -> dict[str, Any]:
    """The row with each CountBy's dict (no column takes one) as its count of ``fav``."""
    return {name.replace("countby", "favs"): value.get("fav", 0) if name.endswith("countby") else value
            for name, value in row.items()}
KEYS = {"user_id": "user_id", "item_id": "item_id", "event_id": "event_id",
        "initial": lambda item: item["user_id"][:1], "parity": lambda item: int(item["ts"]) % 2}  # (a number)
#: a window's event time: the event's, or one between milliseconds (rounded half to even, as to_millis does)
TIMES = {"ts": "ts", "half_ms": lambda item: item["ts"] + 0.0005, "back": lambda item: item["ts"] - 0.0015}
TRIGGER_IDS = ["item", "page_enter", "page_exit", "pv", "fav", "cart", "buy", "*"]

_aggregations = st.lists(st.sampled_from(sorted(AGGREGATIONS)).flatmap(
    lambda kind: st.tuples(st.just(kind), st.sampled_from(range(len(AGGREGATIONS[kind][1]))),
                           st.sampled_from([None, None, "not_exit", "even_second"]))), max_size=4)


@st.composite
def _trigger_spec(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.booleans()):  # the columnar shape: an item page's exit over the page
        trigger, task_input = ("item",), "page"
    else:
        trigger = tuple(draw(st.lists(st.sampled_from(TRIGGER_IDS), min_size=1, max_size=3)))
        if all(t == "*" for t in trigger) or trigger[-1] == "*":
            trigger = (*trigger, "item")
        task_input = draw(st.sampled_from(["page", "recent", "pages"]))
    return {"kind": "trigger", "trigger": trigger, "input": task_input,
            "history_s": draw(st.sampled_from([None, 120.0])),
            "before": draw(st.lists(st.sampled_from(sorted(BEFORE)), max_size=1)) if draw(st.integers(0, 4)) == 0
            else [], "aggregations": draw(_aggregations),
            "after": draw(st.lists(st.sampled_from(sorted(AFTER)), max_size=2))}


@st.composite
def _stream_spec(draw: st.DrawFn) -> dict[str, Any]:
    shape = draw(st.sampled_from(["time", "time", "session", "count"]))
    if shape == "time":
        slide = draw(st.sampled_from([5, 20, 60]))
        window = ("time", slide * draw(st.integers(1, 3)), slide, draw(st.sampled_from([0, 5, 60])),
                  draw(st.sampled_from([0, 0, 7, 30, 60])), draw(st.sampled_from([0, 0, 2.5])),
                  draw(st.sampled_from(["ts", "ts", "half_ms", "back"])))
    elif shape == "session":
        window = ("session", draw(st.sampled_from([10, 100, 1800])), draw(st.sampled_from([0, 5, 60])),
                  draw(st.sampled_from([0, 7, 30])), draw(st.sampled_from(["ts", "half_ms"])))
    else:
        window = ("count", draw(st.integers(1, 4)), draw(st.sampled_from([None, 1, 2, 5])))
    return {"kind": "stream", "before": draw(st.lists(st.sampled_from(sorted(BEFORE)), max_size=2, unique=True)),
            "key": draw(st.sampled_from(sorted(KEYS))), "window": window, "aggregations": draw(_aggregations),
            "after": draw(st.lists(st.sampled_from(sorted(AFTER)), max_size=2))}


_COLUMN_AGGREGATIONS = st.lists(st.sampled_from([
    ("First", 0, None), ("First", 2, None), ("First", 3, None), ("Last", 0, None), ("Last", 1, None),
    ("Last", 3, None), ("Min", 0, None), ("Max", 0, None), ("CountBy", 0, None), ("Count", 0, None)]), max_size=4)
#: the shapes batch mode computes over columns, drawn more often: trigger tasks on the item page's exit over the
#: page, stream tasks with a time or count window
_COLUMNAR_JOBS = st.one_of(
    st.lists(st.fixed_dictionaries({
        "kind": st.just("trigger"), "trigger": st.just(("item",)), "input": st.just("page"),
        "history_s": st.just(None), "before": st.just([]),
        "aggregations": st.one_of(_COLUMN_AGGREGATIONS, _aggregations),
        "after": st.lists(st.sampled_from(sorted(AFTER)), max_size=3)}), min_size=1, max_size=3),
    st.lists(_stream_spec().filter(lambda spec: spec["window"][0] != "session"), min_size=1, max_size=3))
_JOBS = st.one_of(_COLUMNAR_JOBS, st.lists(_trigger_spec(), min_size=1, max_size=2),
                  st.lists(_stream_spec(), min_size=1, max_size=3),
                  st.tuples(_trigger_spec(), _stream_spec()).map(list))


def _aggregate(spec: dict[str, Any]) -> Aggregate:
    aggregations: dict[str, Any] = {"n": Count()}
    for k, (kind, field, where) in enumerate(spec["aggregations"]):
        make, fields = AGGREGATIONS[kind]
        aggregations[f"a{k}_{kind.lower()}"] = make(fields[field], WHERE[where])
    return Aggregate(**aggregations)


def _build(specs: list[dict[str, Any]]) -> list[Task]:
    tasks = []
    for k, spec in enumerate(specs):
        before = [BEFORE[name]() for name in spec["before"]]
        after = [AFTER[name]() for name in spec["after"]]
        if spec["kind"] == "trigger":
            tasks.append(Task(f"t{k}", list(spec["trigger"]), [*before, _aggregate(spec), *after],
                              input=spec["input"], history_s=spec["history_s"]))
            continue
        if spec["window"][0] == "time":
            _, size, slide, disorder, lateness, offset, ts = spec["window"]
            window: Any = TimeWindow(size, slide=slide, ts=TIMES[ts], out_of_orderness=disorder,
                                     allowed_lateness=lateness, offset=offset)
        elif spec["window"][0] == "session":
            _, gap, disorder, lateness, ts = spec["window"]
            window = SessionWindow(gap, ts=TIMES[ts], out_of_orderness=disorder, allowed_lateness=lateness)
        else:
            window = CountWindow(spec["window"][1], spec["window"][2])
        tasks.append(Task(f"t{k}", None, [*before, KeyBy(KEYS[spec["key"]], name="key"), window, _aggregate(spec),
                                          *after], input="stream"))
    return tasks


def _expected_columnar(specs: list[dict[str, Any]], fmt: str, lines: list[str]) -> dict[str, bool]:
    """Per task, whether batch mode must compute it over columns: the shapes it has a columnar form for."""
    kinds = {spec["kind"] for spec in specs}
    if kinds == {"stream"}:
        return {f"t{k}": spec["window"][0] == "count" or (
            spec["window"][0] == "time" and not (spec["window"][4] and spec["window"][4] % spec["window"][2] == 0))
            for k, spec in enumerate(specs)}
    if kinds == {"trigger"} and (fmt == "csv" and not any(" " in line or "\u00e9" in line for line in lines) or (
            fmt == "jsonl" and not any(map(_json_streams, lines)))):
        simple = all(
            spec["trigger"] == ("item",) and spec["input"] == "page" and not spec["before"]
            and set(spec["after"]) <= COLUMNAR_AFTER and all(_column_form(*agg) for agg in spec["aggregations"])
            and not (any(kind == "CountBy" for kind, _, _ in spec["aggregations"]) and _dicts_written(spec["after"]))
            for spec in specs)
        return {f"t{k}": simple for k in range(len(specs))}
    return {f"t{k}": False for k in range(len(specs))}


def _json_streams(line: str) -> bool:
    """Whether batch mode streams a JSON-lines job of trigger tasks over ``line`` (runners/batch_jsonl.py): an event
    whose contents lack a key a task may read, or hold one that is not text."""
    event = event_from_json(line)
    return isinstance(event, Event) and not all(
        isinstance(event.contents.get(key), str) for key in ("item_id", "category_id"))


def _dicts_written(after: list[str]) -> bool:
    """Whether a CountBy's dict reaches the table (no column takes it: batch mode streams then)."""
    return all(name not in ("project", "favs") for name in after)


def _column_form(kind: str, field: int, where: str | None) -> bool:
    """What batch.py computes over a trigger task's page (its module docstring)."""
    name = AGGREGATIONS[kind][1][field]
    return where is None and (kind in ("First", "Last", "Count") or (kind in ("Min", "Max") and name == "ts")
                              or (kind == "CountBy" and name == "event_id"))


# -- the two runs ----------------------------------------------------------------------------------------------------

#: columns that say when or where the process was, not what it computed: the wall clock in the guard's upper bound
#: (dead-letter reasons, below) and a failure's traceback (the runner's own frames differ between the modes)
_BOUND = re.compile(r", \d+\] \(2000")


def _run(source: Any, db: Path, tasks: list[Task], mode: str) -> tuple[Any, dict[str, list[tuple]]]:
    runner = DeviceRunner(Job("j", tasks), CollectiveStorage(db), runtime_mode=mode)
    summary = runner.run(source)
    runner.close()
    tables = {}
    for name in runner.storage.tables():
        columns = runner.storage.query(f"SELECT column_name, data_type FROM information_schema.columns "
                                       f"WHERE table_name = '{name}' ORDER BY ordinal_position")
        rows = runner.storage.query(f"SELECT * FROM {name}")  # physical order: the order written
        keep = [k for k, (column, _) in enumerate(columns) if column != "traceback"]
        tables[name] = [tuple(columns[k] for k in keep)] + [
            tuple(_BOUND.sub(", NOW] (2000", v) if isinstance(v, str) else v for v in (row[k] for k in keep))
            for row in rows]
    runner.storage.close()
    return summary, tables


def _counters(summary: Any) -> dict[str, Any]:
    counted = {key: value for key, value in vars(summary).items() if key not in ("elapsed_s", "runtime_mode",
                                                                                    "db_path", "task_stats")}
    return {**counted, "task_stats": {name: {**vars(stats), "mode": ""} for name, stats in summary.task_stats.items()}}


_CHUNK_BYTES = st.sampled_from([64, 300, 8 << 20])
_CHUNK_EVENTS = st.sampled_from([3, 17, 8192])


@settings(max_examples=40, deadline=None)
@given(_inputs(), _JOBS, _CHUNK_BYTES, _CHUNK_EVENTS)
def test_a_generated_job_over_dirty_input_writes_what_streaming_writes(data: tuple[str, list[str]],
                                                                       specs: list[dict[str, Any]],
                                                                       chunk_bytes: int, chunk_events: int) -> None:
    check(data, specs, chunk_bytes, chunk_events)


@settings(max_examples=15, deadline=None)
@given(_sample_inputs(), _COLUMNAR_JOBS, _CHUNK_BYTES, _CHUNK_EVENTS)
def test_a_generated_job_over_the_shared_sample_writes_what_streaming_writes(
        data: tuple[str, list[str]], specs: list[dict[str, Any]], chunk_bytes: int, chunk_events: int) -> None:
    check(data, specs, chunk_bytes, chunk_events)


def check(data: tuple[str, list[str]], specs: list[dict[str, Any]], chunk_bytes: int, chunk_events: int,
          quiet: bool = False) -> None:
    """Both runs of the job ``specs`` over ``data`` (batch mode in chunks of ``chunk_bytes`` of a file, or
    ``chunk_events`` events for stream tasks): equal tables, dead letters and counters; the shapes batch mode
    computes ran columnar. ``quiet``: outside a Hypothesis test (no notes, no events)."""
    fmt, lines = data
    say = (lambda text: None) if quiet else note
    say(f"lines = {lines!r}")
    say(f"specs = {specs!r}")
    tasks = _build(specs)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"in.{fmt}"
        path.write_text("".join(line + "\n" for line in lines), errors="surrogateescape")  # \udcff: the byte 0xff
        make = (lambda: TaobaoBehaviorSource(path)) if fmt == "csv" else (lambda: JsonLinesSource(path))
        streamed, stream_tables = _run(make(), Path(folder) / "s.duckdb", tasks, "streaming")
        with mock.patch.object(batch, "CHUNK_BYTES", chunk_bytes), \
                mock.patch.object(batch_streams, "CHUNK_EVENTS", chunk_events):
            batched, batch_tables = _run(make(), Path(folder) / "b.duckdb", _build(specs), "automatic")
    assert batch_tables == stream_tables
    assert _counters(batched) == _counters(streamed)
    ran = {name: batched.runtime_mode == "batch" and (stats.mode in ("", COLUMNAR))
           for name, stats in batched.task_stats.items()}
    for name, columnar in ran.items():
        if not quiet:
            event(f"{'columnar' if columnar else 'streamed'}: {_shape(specs[int(name[1:])])}")
    for name, expected in _expected_columnar(specs, fmt, lines).items():
        if expected:
            assert ran[name], (f"task {name} ({_shape(specs[int(name[1:])])}) should have run columnar: "
                               f"{batched.runtime_mode}, {batched.task_stats[name].mode!r}")


def _shape(spec: dict[str, Any]) -> str:
    if spec["kind"] == "trigger":
        return f"trigger {'/'.join(spec['trigger'])} over {spec['input']}"
    return f"stream {spec['window'][0]} window"


def test_contents_that_is_no_object_is_a_dead_letter_in_batch_mode_when_no_task_reads_it() -> None:
    """Found by the generated test: with no contents key read, pyarrow's schema had no contents field and took
    ``"contents": [1]`` (an event in batch mode, a dead letter when streaming)."""
    lines = ['{"user_id": "7", "event_id": "pv", "page_id": "item", "ts": 1511848800, "contents": [1]}',
             '{"user_id": "7", "event_id": "page_enter", "page_id": "item", "ts": 1511848800, "contents": "x"}',
             '{"user_id": "7", "event_id": "page_exit", "page_id": "item", "ts": 1511848801, "contents": 5}',
             '{"user_id": "7", "event_id": "page_enter", "page_id": "item", "ts": 1511848802}',
             '{"user_id": "7", "event_id": "page_exit", "page_id": "item", "ts": 1511848803, "contents": null}']
    spec = {"kind": "trigger", "trigger": ("item",), "input": "page", "history_s": None, "before": [],
            "aggregations": [], "after": []}
    check(("jsonl", lines), [spec], 8 << 20, 8192, quiet=True)
