"""Windows against a brute-force reference written for this test (not the windowing code): generated event
streams (out of order, late, ties, fractional sizes and offsets) through tumbling and sliding event-time
windows and count windows, with every aggregation, on the device runner (many examples) and on Flink (a few
paced runs, so that its periodic watermarks decide lateness per event as the device does). Rows, re-fires
and the late side output must match.

The reference keeps every window's events in a list, in arrival order, and recomputes each firing from
that list with plain Python; the watermark is the largest event time seen - out_of_orderness - 1 ms, moved
after each event; a window ``[s, s + size)`` fires when the watermark reaches ``s + size - 1``, takes late
events (each fires it again) until the watermark reaches ``s + size - 1 + allowed_lateness``, and an event
whose every window is past that goes to ``late_events``.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from operators import (
    Aggregate,
    Count,
    CountBy,
    CountDistinct,
    CountWindow,
    Distinct,
    First,
    KeyBy,
    Last,
    LastN,
    Max,
    Min,
    SessionWindow,
    Sum,
    TimeWindow,
)
from streamflow.events import Event
from streamflow.job import Job, Task
from streamflow.testing import run_job
from streamflow.windowing import StreamTaskRun

START_MS = 1_600_000_000_000
AGGREGATIONS = dict(n=Count(), total=Sum("v"), lo=Min("v"), hi=Max("v"), first=First("v"), last=Last("v"),
                    last2=LastN("v", 2), seen=Distinct("tag"), kinds=CountDistinct("tag"), by_tag=CountBy("tag"),
                    big=Count(where=lambda e: e["v"] > 2))


def fold(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The aggregations over a window's events (arrival order), computed directly."""
    values, tags = [e["v"] for e in events], [e["tag"] for e in events]
    exact_sum = sum(values) if all(type(v) is int for v in values) else math.fsum(values)
    return {"n": len(events), "total": exact_sum, "lo": min(values), "hi": max(values), "first": values[0],
            "last": values[-1], "last2": values[-2:], "seen": list(dict.fromkeys(tags)), "kinds": len(set(tags)),
            "by_tag": dict(Counter(tags)), "big": sum(1 for v in values if v > 2)}


def reference_time_windows(events: list[dict[str, Any]], size: int, slide: int, offset: int, lateness: int,
                           out_of_orderness: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows, late events) of keyed event-time windows, by brute force (times in ms)."""
    contents: dict[tuple[str, int], list[dict[str, Any]]] = {}  # (key, start) -> events
    fired: set[tuple[str, int]] = set()
    watermark, top = -(2**63), -(2**63)
    rows, late = [], []

    def row(key: str, start: int) -> dict[str, Any]:
        return {"k": key, "window_start": start / 1000, "window_end": (start + size) / 1000,
                **fold(contents[key, start])}

    for event in events:
        ts, key = event["ms"], event["k"]
        starts = [s for s in range(ts - size + 1, ts + 1) if (s - offset) % slide == 0]
        live = [s for s in starts if s + size - 1 + lateness > watermark]
        if not live:
            late.append(event)
        for s in live:
            contents.setdefault((key, s), []).append(event)
            if s + size - 1 <= watermark:
                fired.add((key, s))
                rows.append(row(key, s))  # fires at once (late, or never fired before): no timer for it
        top = max(top, ts)
        watermark = max(watermark, top - out_of_orderness - 1)
        for (k, s) in sorted(contents):
            if (k, s) not in fired and s + size - 1 <= watermark:
                fired.add((k, s))
                rows.append(row(k, s))
        for (k, s) in [w for w in contents if w[1] + size - 1 + lateness <= watermark]:
            del contents[k, s]
    for (k, s) in sorted(contents):
        if (k, s) not in fired:
            rows.append(row(k, s))
    return rows, late


def reference_session_windows(events: list[dict[str, Any]], gap: int, lateness: int, out_of_orderness: int
                              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows, late events) of keyed session windows (Flink's withGap: each event opens ``[ts, ts + gap)``, windows
    that overlap or touch merge, their events concatenated in time order of the sessions, the new event
    last), by brute force."""
    sessions: dict[str, list[tuple[int, int, list[dict[str, Any]]]]] = {}
    fired: set[tuple[str, int, int]] = set()
    watermark, top = -(2**63), -(2**63)
    rows, late = [], []

    def row(key: str, start: int, end: int, contents: list[dict[str, Any]]) -> dict[str, Any]:
        fired.add((key, start, end))
        return {"k": key, "window_start": start / 1000, "window_end": end / 1000, **fold(contents)}

    for event in events:
        ts, key = event["ms"], event["k"]
        held = sessions.setdefault(key, [])
        start, end = ts, ts + gap
        touching = []
        for session in sorted(held):  # by start; merging may widen the window and reach the next session
            if session[0] <= end and session[1] >= start:
                touching.append(session)
                start, end = min(start, session[0]), max(end, session[1])
        if end - 1 + lateness <= watermark:
            late.append(event)
        else:
            contents = [e for session in touching for e in session[2]] + [event]
            held[:] = [s for s in held if s not in touching] + [(start, end, contents)]
            if end - 1 <= watermark:
                rows.append(row(key, start, end, contents))
        top = max(top, ts)
        watermark = max(watermark, top - out_of_orderness - 1)
        for k, held_k in sessions.items():
            for start, end, contents in sorted(held_k):
                if (k, start, end) not in fired and end - 1 <= watermark:
                    rows.append(row(k, start, end, contents))
            held_k[:] = [s for s in held_k if s[1] - 1 + lateness > watermark]
    for k, held_k in sessions.items():
        rows += [row(k, start, end, contents) for start, end, contents in sorted(held_k)
                 if (k, start, end) not in fired]
    return rows, late


def reference_count_windows(events: list[dict[str, Any]], size: int, slide: int | None) -> list[dict[str, Any]]:
    """Rows of keyed count windows (Flink's countWindow(size[, slide])), by brute force."""
    seen: dict[str, list[dict[str, Any]]] = {}
    rows = []
    for event in events:
        items = seen.setdefault(event["k"], [])
        items.append(event)
        if len(items) % (slide or size) == 0:
            rows.append({"k": event["k"], **fold(items[-size:])})
    return rows


# -- generated streams ------------------------------------------------------------------------------------
_value = st.one_of(st.integers(-3, 5), st.sampled_from([0.1, 0.2, 0.3, 1e16, -1e16, 2.5]))
_event = st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(-4000, 6000), _value, st.sampled_from("xyz"))


def stream(steps: list[tuple[str, int, Any, str]]) -> list[dict[str, Any]]:
    """Events from generated ``(key, ms from the previous event's time, v, tag)``: times go back as well as on
    (out of order), repeat (ties) and jump."""
    events, now = [], START_MS
    for key, delta, v, tag in steps:
        now = max(START_MS, now + delta)
        events.append({"k": key, "ms": now, "v": v, "tag": tag})
    return events


def device_rows(task: Task, events: list[dict[str, Any]], settled_ms: int | None = None
                ) -> tuple[list[dict[str, Any]], list[Any]]:
    """The device's stream-task code over ``events``: (rows, late side output items). With ``settled_ms``, the
    watermark first moves that far past the last event time, where every window is past its lateness: no
    key may hold state any more (the cleanup timers reclaimed it)."""
    run = StreamTaskRun(task)
    rows, late = [], []
    for event in events:
        out, sides = run.process({**event, "ts": event["ms"] / 1000})
        rows += out
        late += [json.loads(row["item"]) for table, row in sides if table == "late_events"]
    if settled_ms is not None:
        out, sides = run.route(run.runtime.advance(max(e["ms"] for e in events) + settled_ms))
        rows += out
        assert run.runtime.keys_held == 0 and not sides
    out, sides = run.finish()
    return rows + out, late


def _sorted(rows: list[dict[str, Any]]) -> list[str]:
    return sorted(json.dumps(row, sort_keys=True) for row in rows)


_window_shape = st.sampled_from([
    (10_000, 10_000, 0), (10_000, 5_000, 0), (6_000, 4_000, 1_000), (2_500, 750, 7_300),  # fractional, offset
    (60_000, 20_000, 0), (1_000, 1_000, 0), (3_000, 1_000, 500),
])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_event, min_size=1, max_size=40), shape=_window_shape,
       lateness=st.sampled_from([0, 2_000, 5_000]), out_of_orderness=st.sampled_from([0, 1_000, 3_000]))
def test_time_windows_on_the_device_match_the_reference(steps, shape, lateness, out_of_orderness):
    size, slide, offset = shape
    events = stream(steps)
    task = Task("w", None, [KeyBy("k"), TimeWindow(size / 1000, slide / 1000, offset=offset / 1000,
                                                   allowed_lateness=lateness / 1000,
                                                   out_of_orderness=out_of_orderness / 1000),
                            Aggregate(**AGGREGATIONS)], input="stream")
    expected_rows, expected_late = reference_time_windows(events, size, slide, offset, lateness, out_of_orderness)
    rows, late = device_rows(task, events, settled_ms=size + lateness)
    assert _sorted(rows) == _sorted(expected_rows)
    assert sorted(e["ms"] for e in late) == sorted(e["ms"] for e in expected_late)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_event, min_size=1, max_size=40), gap=st.sampled_from([1, 500, 2_000, 2_500, 7_000]),
       lateness=st.sampled_from([0, 2_000, 5_000]), out_of_orderness=st.sampled_from([0, 1_000, 3_000]))
def test_session_windows_on_the_device_match_the_reference(steps, gap, lateness, out_of_orderness):
    events = stream(steps)
    task = Task("s", None, [KeyBy("k"), SessionWindow(gap / 1000, allowed_lateness=lateness / 1000,
                                                      out_of_orderness=out_of_orderness / 1000),
                            Aggregate(**AGGREGATIONS)], input="stream")
    expected_rows, expected_late = reference_session_windows(events, gap, lateness, out_of_orderness)
    rows, late = device_rows(task, events, settled_ms=gap + lateness)
    assert _sorted(rows) == _sorted(expected_rows)
    assert sorted(e["ms"] for e in late) == sorted(e["ms"] for e in expected_late)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_event, min_size=1, max_size=40), size=st.integers(1, 4), slide=st.sampled_from([None, 1, 2]))
def test_count_windows_on_the_device_match_the_reference(steps, size, slide):
    if slide is not None and slide > size:
        slide = size
    events = stream(steps)
    task = Task("c", None, [KeyBy("k"), CountWindow(size, slide), Aggregate(**AGGREGATIONS)], input="stream")
    rows, late = device_rows(task, events)
    assert _sorted(rows) == _sorted(reference_count_windows(events, size, slide)) and not late


def test_the_reference_sees_what_a_sliding_window_must_give():
    """The reference itself, on a case worked by hand: 10 s windows sliding by 5 s, 3 s allowed lateness."""
    events = stream([("a", 6_000, 1, "x"), ("a", 11_000, 2, "y"), ("a", -9_000, 3, "x"), ("a", -5_000, 4, "x")])
    rows, late = reference_time_windows(events, 10_000, 5_000, 0, 3_000, 0)
    fired = [(round(r["window_start"] * 1000) - START_MS, r["n"]) for r in rows]
    # t=6 s: windows [0, 10) and [5, 15); t=17 s fires both (and [0, 10) is past its lateness at 12.999);
    # t=8 s: [0, 10) is gone, [5, 15) fires again with 2 events; t=3 s: [-5, 5) and [0, 10) are both past
    # their lateness: late_events; the end fires [10, 20) and [15, 25)
    assert fired == [(0, 1), (5_000, 1), (5_000, 2), (10_000, 1), (15_000, 1)]
    assert [e["ms"] - START_MS for e in late] == [3_000]


# -- Flink ------------------------------------------------------------------------------------------------
flink = pytest.mark.skipif(shutil.which("java") is None, reason="the Flink runner needs a Java runtime")


def _as_app_events(events: list[dict[str, Any]]) -> list[Event]:
    """The runners' input: each event its own user (the timestamp guard checks order per user, and the windows
    are keyed by ``k``, so any order across events gets through)."""
    return [Event(f"u{i}", "e", "p", e["ms"] / 1000, {"k": e["k"], "v": e["v"], "tag": e["tag"], "ms": e["ms"]})
            for i, e in enumerate(events)]


def _stored(rows: list[dict[str, Any]]) -> list[str]:
    """Rows as a table stores them: numbers in a column of floats and ints are floats; a dict column is a
    struct of every key seen (None where a row has none)."""
    def stored(value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, list):
            return [stored(v) for v in value]
        if isinstance(value, dict):
            return {k: stored(v) for k, v in value.items() if v is not None}
        return value
    return _sorted([stored(row) for row in rows])


@flink
@pytest.mark.parametrize("seed", [3, 4])
def test_windows_on_flink_match_the_reference(seed):
    """One paced Flink job per seed with three stream tasks over the same events: sliding time windows,
    session windows and sliding count windows."""
    pytest.importorskip("pyflink", reason="needs the flink extra", exc_type=ImportError)
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    rng = random.Random(seed)
    gaps = [-6000, -3000, -500, 0, 400, 1500, 2500, 7000]
    steps = [(rng.choice("ab"), rng.choice(gaps), rng.choice([1, 2, 0.1, 3, 5]), rng.choice("xy")) for _ in range(45)]
    events = stream(steps)
    size, slide, offset, lateness, ooo, gap = 6_000, 2_000, 500, 2_000, 1_000, 2_500
    job = Job("w", [
        Task("w", None, [KeyBy("k"), TimeWindow(size / 1000, slide / 1000, offset=offset / 1000,
                                                allowed_lateness=lateness / 1000, out_of_orderness=ooo / 1000),
                         Aggregate(**AGGREGATIONS)], input="stream"),
        Task("s", None, [KeyBy("k"), SessionWindow(gap / 1000, allowed_lateness=lateness / 1000,
                                                   out_of_orderness=ooo / 1000),
                         Aggregate(**AGGREGATIONS)], input="stream"),
        Task("c", None, [KeyBy("k"), CountWindow(3, 2), Aggregate(**AGGREGATIONS)], input="stream"),
    ])
    windows, windows_late = reference_time_windows(events, size, slide, offset, lateness, ooo)
    sessions, sessions_late = reference_session_windows(events, gap, lateness, ooo)
    assert windows_late and sessions_late and len(windows) > len({(r["k"], r["window_start"]) for r in windows})
    tables = run_job(job, _as_app_events(events), runner="flink", pace_ms=120)
    assert set(tables) == {"w", "s", "c", "late_events"}, tables.get("task_errors")
    assert _stored(tables["w"]) == _stored(windows)
    assert _stored(tables["s"]) == _stored(sessions)
    assert _stored(tables["c"]) == _stored(reference_count_windows(events, 3, 2))
    late = Counter((row["task"], json.loads(row["item"])["contents"]["ms"]) for row in tables["late_events"])
    assert late == Counter([("w", e["ms"]) for e in windows_late] + [("s", e["ms"]) for e in sessions_late])
