"""The keyed process function on the device (KeyedRuntime): state, TTL, timers, the cap on keys, checkpoints,
and the windows built on it against the operators' own batch semantics as the reference."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators import (
    Aggregate,
    Count,
    CountWindow,
    KeyBy,
    KeyedProcessFunction,
    ListStateDescriptor,
    MapStateDescriptor,
    Max,
    Min,
    Process,
    SessionWindow,
    Sum,
    TimeWindow,
    ValueStateDescriptor,
    run_pipeline,
)
from streamflow.job import Task
from streamflow.keyed import KeyedRuntime
from streamflow.windowing import CountWindows, EventTimeWindows, SessionWindows


class Counter(KeyedProcessFunction):
    def __init__(self, ttl_s=None):
        self.ttl_s = ttl_s

    def open(self, ctx):
        self.n = ctx.get_state(ValueStateDescriptor("n", ttl_s=self.ttl_s))
        self.seen = ctx.get_state(ListStateDescriptor("seen"))
        self.by_kind = ctx.get_state(MapStateDescriptor("by_kind"))

    def on_event(self, event, ctx):
        n = (self.n.value() or 0) + 1
        self.n.update(n)
        self.seen.add(event["ts"])
        self.by_kind.put(event.get("kind"), self.by_kind.get(event.get("kind"), 0) + 1)
        ctx.emit({"key": ctx.key, "n": n, "seen": len(self.seen.get()), "kinds": dict(self.by_kind.items())})


def test_state_is_per_key_and_typed():
    runtime = KeyedRuntime(Counter())
    runtime.process("a", {"ts": 1.0, "kind": "x"})
    runtime.process("b", {"ts": 2.0, "kind": "x"})
    out = runtime.process("a", {"ts": 3.0, "kind": "y"})
    assert out == [("emit", {"key": "a", "n": 2, "seen": 2, "kinds": {"x": 1, "y": 1}})]
    assert runtime.keys_held == 2


def test_ttl_expires_on_the_stream_clock_not_the_wall_clock():
    runtime = KeyedRuntime(Counter(ttl_s=10))
    runtime.process("a", {"ts": 100.0})
    runtime.process("b", {"ts": 105.0})  # clock 105: a's n (written at 100) still live
    assert runtime.process("a", {"ts": 109.0})[0][1]["n"] == 2  # rewritten at 109
    runtime.process("b", {"ts": 120.0})  # clock 120: a's n (109) is 11 s old: expired and reclaimed
    assert runtime.expired == 2  # and b's (written at 105)
    assert runtime.process("a", {"ts": 121.0})[0][1]["n"] == 1  # starts over
    assert runtime.process("a", {"ts": 50.0})[0][1]["n"] == 2  # an old event time does not move the clock back


def test_max_keys_evicts_the_least_recently_seen_key_and_counts_it():
    runtime = KeyedRuntime(Counter(), max_keys=2)
    for key in ["a", "b", "a", "c"]:  # c evicts b (a was seen more recently)
        runtime.process(key, {"ts": 1.0})
    assert runtime.evicted == 1 and runtime.keys_held == 2
    assert runtime.process("a", {"ts": 2.0})[0][1]["n"] == 3
    assert runtime.process("b", {"ts": 2.0})[0][1]["n"] == 1  # its state was dropped


class Timers(KeyedProcessFunction):
    def on_event(self, event, ctx):
        if event.get("cancel"):
            ctx.delete_event_time_timer(event["cancel"])
        else:
            ctx.register_event_time_timer(ctx.timestamp + 5000)
            ctx.register_event_time_timer(ctx.timestamp + 5000)  # one timer per key and time
        if event.get("now"):
            ctx.register_processing_time_timer(ctx.current_processing_time() - 1)

    def on_timer(self, time_ms, ctx):
        ctx.emit({"key": ctx.key, "at": time_ms, "watermark": ctx.current_watermark()})


def test_event_time_timers_fire_when_the_watermark_passes_them_once_per_key_and_time():
    runtime = KeyedRuntime(Timers(), out_of_orderness_s=1)
    assert runtime.process("a", {"ts": 10.0}) == []
    assert runtime.process("b", {"ts": 12.0}) == []
    assert runtime.process("b", {"ts": 16.0}) == []  # watermark 14.999: a's timer at 15 s not yet
    assert runtime.process("b", {"ts": 16.001}) == [("emit", {"key": "a", "at": 15000, "watermark": 15000})]
    runtime.process("b", {"ts": 16.5, "cancel": 17000})  # b's timer at 17 s deleted
    runtime.process("c", {"ts": 16.6, "cancel": 21000})  # a timer is deleted for its own key only
    assert [(row["key"], row["at"]) for _, row in runtime.finish()] == [("b", 21000), ("b", 21001)]


def test_processing_time_timers_fire_when_due():
    runtime = KeyedRuntime(Timers())
    out = runtime.process("a", {"ts": 1.0, "now": True})
    assert [row["key"] for _, row in out] == ["a"]


def test_snapshot_restore_continues_exactly():
    events = [(k, {"ts": float(t), "kind": k * 2}) for t, k in enumerate("abcabcaab")]
    whole = KeyedRuntime(Counter(ttl_s=3), max_keys=2)
    expected = [whole.process(k, e) for k, e in events]
    for split in range(len(events)):
        first = KeyedRuntime(Counter(ttl_s=3), max_keys=2)
        got = [first.process(k, e) for k, e in events[:split]]
        second = KeyedRuntime(Counter(ttl_s=3), max_keys=2)
        second.restore(pickle.loads(pickle.dumps(first.snapshot())))
        got += [second.process(k, e) for k, e in events[split:]]
        assert got == expected, split


def _stream(function, items, key="k", bound=0.0):
    runtime = KeyedRuntime(function, out_of_orderness_s=bound)
    rows = []
    for item in items:
        rows += [row for tag, row in runtime.process(item[key], item) if tag == "emit"]
    rows += [row for tag, row in runtime.finish() if tag == "emit"]
    return rows


def _sorted(rows):
    return sorted(rows, key=lambda row: sorted(row.items()))


items_strategy = st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 400), st.integers(0, 9)),
                          max_size=60).map(lambda raw: [{"k": k, "ts": t / 4, "x": x} for k, t, x in
                                                        sorted(raw, key=lambda r: r[1])])


# Gaps off the items' 0.25 s grid: an item exactly at a session's end (ts == end) merges in the batch operator,
# but in a stream another key's item at that time has already moved the watermark to end - 1 ms and fired the
# session, so the item opens a new one; Flink does the same. Only that tie differs, so the property avoids it.
@settings(max_examples=150, deadline=None)
@given(items_strategy, st.sampled_from([0.3, 1.1, 7.6, 30.1]))
def test_session_windows_in_order_equal_the_batch_operator(items, gap):
    aggregate = Aggregate(n=Count(), total=Sum("x"), first=Min("ts"), last=Max("ts"))
    streamed = _stream(SessionWindows(SessionWindow(gap), aggregate, "k"), items)
    batch = run_pipeline([KeyBy("k"), SessionWindow(gap), aggregate], items)
    assert _sorted(streamed) == _sorted(batch)


@settings(max_examples=150, deadline=None)
@given(items_strategy, st.integers(1, 5), st.one_of(st.none(), st.integers(1, 5)))
def test_count_windows_equal_the_batch_operator(items, size, slide):
    if slide is not None and slide > size:
        slide = size
    aggregate = Aggregate(n=Count(), total=Sum("x"))
    streamed = _stream(CountWindows(CountWindow(size, slide), aggregate, "k"), items)
    batch = run_pipeline([KeyBy("k"), CountWindow(size, slide), aggregate], items)
    assert _sorted(streamed) == _sorted(batch)


@settings(max_examples=100, deadline=None)
@given(items_strategy, st.sampled_from([(10.0, None), (10.0, 2.5), (1.0, 0.25)]))
def test_time_windows_in_order_equal_the_batch_operator(items, size_slide):
    size, slide = size_slide
    aggregate = Aggregate(n=Count(), total=Sum("x"))
    streamed = _stream(EventTimeWindows(TimeWindow(size, slide), aggregate, "k"), items)
    batch = run_pipeline([KeyBy("k"), TimeWindow(size, slide), aggregate], items)
    assert _sorted(streamed) == _sorted(batch)


def test_session_window_lateness_merges_refires_and_sends_the_too_late_aside():
    function = SessionWindows(SessionWindow(10, allowed_lateness=5), Aggregate(n=Count()), "k")
    runtime = KeyedRuntime(function)
    runtime.process("u", {"ts": 0.0})
    assert runtime.process("u", {"ts": 13.0}) == [
        ("emit", {"k": "u", "window_start": 0.0, "window_end": 10.0, "n": 1})]
    # within the allowed lateness: merges into [0, 10) -> [0, 12) and fires again at once
    assert runtime.process("u", {"ts": 2.0}) == [
        ("emit", {"k": "u", "window_start": 0.0, "window_end": 12.0, "n": 2})]
    assert runtime.process("u", {"ts": 100.0}) == [
        ("emit", {"k": "u", "window_start": 13.0, "window_end": 23.0, "n": 1})]
    assert runtime.process("u", {"ts": 1.0}) == [("late_events", {"ts": 1.0})]


def test_process_runs_only_in_stream_tasks():
    with pytest.raises(TypeError, match="stream task"):
        Task("t", ["fav"], [Process(lambda event, ctx: None)])
    task = Task("t", None, [KeyBy("user_id"), Process(lambda event, ctx: None)], input="stream")
    assert task.input == "stream"
    with pytest.raises(ValueError, match="must be followed by Aggregate"):
        Task("t", None, [KeyBy("user_id"), SessionWindow(5)], input="stream")


def test_a_failing_stream_task_is_recorded_and_the_run_goes_on(tmp_path):
    from connectors.storage import CollectiveStorage
    from streamflow.events import Event
    from streamflow.job import Job
    from streamflow.runners.device import DeviceRunner

    def flaky(event, ctx):
        if event.event_id == "buy":
            raise RuntimeError("cannot handle a buy")
        ctx.side("bad table!", {"x": 1}) if event.event_id == "cart" else ctx.emit({"user_id": ctx.key})

    job = Job("j", [Task("flaky", None, [KeyBy("user_id"), Process(flaky)], input="stream")])
    with CollectiveStorage(tmp_path / "j.duckdb") as storage:
        runner = DeviceRunner(job, storage)
        kinds = ["fav", "buy", "cart", "fav"]
        summary = runner.run([Event("u", kind, "item", 1.6e9 + i) for i, kind in enumerate(kinds)])
        errors = storage.query("SELECT task, error FROM task_errors ORDER BY trigger_ts")
        assert storage.query("SELECT count(*) FROM flaky") == [(2,)]
    assert [e[1].split(":")[0] for e in errors] == ["RuntimeError", "ValueError"]
    assert "bad table!" in errors[1][1] and summary.task_stats["flaky"].errors == 2
