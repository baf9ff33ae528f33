"""A stream task that raises loses only what failed (issue 23, defect 2).

Every step of a stream task may raise: a Filter/Map before ``KeyBy`` or before the window (per event), the
key function, the aggregation's ``add``/``where`` (per event), a ``Process`` function's ``on_event`` and
``on_timer`` (per event, per timer), and the Map/Filter after the window (per fired row). Each failure is
caught where it happens and becomes one ``task_errors`` row naming the task, the key and, for a window's
row, the window; every other row is stored, ``quarantine_after`` consecutive failures quarantine the task,
and the run ends normally with the failures counted. The same rows and counters on both runners.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import textwrap
from collections import defaultdict

import pytest

from connectors.storage import CollectiveStorage
from operators import Aggregate, Count, Filter, KeyBy, Map, Max, Process, Sum, TimeWindow
from operators.aggregations import Aggregation
from operators.process import KeyedProcessFunction, ValueStateDescriptor
from streamflow.cli import main
from streamflow.events import Event
from streamflow.job import Job, Task
from streamflow.runners.device import DeviceRunner
from streamflow.summary import TASK_ERRORS_TABLE
from streamflow.testing import read_tables
from streamflow.windowing import StreamTaskRun

T0 = 1_600_000_000.0  # a multiple of every window size used here: windows start at T0 + k * size
USERS = ("u0", "u1", "u2", "u3")

needs_flink = pytest.mark.skipif(importlib.util.find_spec("pyflink") is None or shutil.which("java") is None,
                                 reason="needs the flink extra (pip install 'streamflow[flink]') and a Java runtime")


def events(n: int = 120, step: float = 0.8) -> list[Event]:
    """``n`` events of four users in time order; every 11th is a buy, the rest favs; every 7th has no
    ``amount``."""
    out = []
    for i in range(n):
        contents = {"item_id": f"i{i % 5}"} | ({} if i % 7 == 3 else {"amount": i % 13})
        out.append(Event(USERS[i % 4], "buy" if i % 11 == 0 else "fav", "item", T0 + i * step, contents))
    return out


def windows_of(evs: list[Event], size: float) -> dict[tuple[str, float], list[Event]]:
    """Events by (user, window start), tumbling windows of ``size`` seconds: a reference for the test."""
    out: dict[tuple[str, float], list[Event]] = defaultdict(list)
    for event in evs:
        out[(event.user_id, T0 + (event.ts - T0) // size * size)].append(event)
    return out


def run_device(job: Job, evs: list[Event], tmp_path, **options):
    with CollectiveStorage(tmp_path / "features.duckdb") as storage:
        runner = DeviceRunner(job, storage, **options)
        try:
            summary = runner.run(evs)
        finally:
            runner.close()
    return summary, read_tables(tmp_path / "features.duckdb")


def buy_rate_task(name: str = "rates") -> Task:
    """A window's final Map that divides by zero for every window without a buy."""
    return Task(name, None, [KeyBy("user_id"), TimeWindow(10),
                             Aggregate(n=Count(), buys=Count(where=lambda e: e.event_id == "buy")),
                             Map(lambda row: {**row, "views_per_buy": row["n"] / row["buys"]})], input="stream")


def errors_of(rows, task: str) -> list[dict]:
    """Task ``task``'s rows in ``task_errors`` in time order, with every column (a column no row has a value
    for is not created)."""
    columns = ("key", "window_start", "window_end", "trigger_ts", "trigger_event")
    errors = [{c: None for c in columns} | row for row in rows.get(TASK_ERRORS_TABLE, []) if row["task"] == task]
    return sorted(errors, key=lambda e: (e["trigger_ts"] or 0, e["window_start"] or 0, e["key"] or ""))


def test_a_window_whose_final_map_divides_by_zero_fails_alone(tmp_path):
    evs = events()
    expected = windows_of(evs, 10)
    good = {key: ws for key, ws in expected.items() if any(e.event_id == "buy" for e in ws)}
    bad = sorted(key for key in expected if key not in good)
    assert len(good) >= 5 and len(bad) >= 20  # the input exercises both

    summary, rows = run_device(Job("j", [buy_rate_task()]), evs, tmp_path, quarantine_after=1000)

    assert sorted((r["user_id"], r["window_start"], r["n"], r["buys"]) for r in rows["rates"]) == sorted(
        (user, start, len(ws), sum(e.event_id == "buy" for e in ws)) for (user, start), ws in good.items())
    errors = errors_of(rows, "rates")
    assert sorted((e["key"], e["window_start"], e["window_end"]) for e in errors) == [
        (user, start, start + 10) for user, start in bad]
    assert {e["error"] for e in errors} == {"ZeroDivisionError: division by zero"}
    assert all("views_per_buy" in e["traceback"] for e in errors)  # the user's line, not the runner's
    assert all(json.loads(e["trigger_event"])["n"] >= 1 for e in errors)  # the window's row that failed
    stats = summary.task_stats["rates"]
    assert (stats.rows, stats.errors, stats.quarantined) == (len(good), len(bad), False)
    assert f"task errors      {len(bad)}" in str(summary)


def test_a_filter_that_raises_on_every_event_is_quarantined_and_the_run_goes_on(tmp_path):
    evs = events(40)
    job = Job("j", [
        Task("bad", None, [Filter(lambda e: e["colour"] == "red"), KeyBy("user_id"), TimeWindow(10),
                           Aggregate(n=Count())], input="stream"),
        Task("counts", None, [KeyBy("user_id"), TimeWindow(10), Aggregate(n=Count())], input="stream"),
        Task("favs", ["fav"], [Aggregate(n=Count())], input="recent"),
    ])
    summary, rows = run_device(job, evs, tmp_path, quarantine_after=3)

    assert summary.quarantined == ["bad"] and "QUARANTINED" in str(summary)
    assert summary.task_stats["bad"].errors == 3 and summary.task_stats["bad"].rows == 0
    errors = errors_of(rows, "bad")
    assert [(e["user_id"], e["trigger_ts"], e["key"]) for e in errors] == [(ev.user_id, ev.ts, None) for ev in evs[:3]]
    assert all(e["error"].startswith("KeyError: ") and "colour" in e["error"] for e in errors)
    assert [json.loads(e["trigger_event"])["ts"] for e in errors] == [ev.ts for ev in evs[:3]]
    assert sum(r["n"] for r in rows["counts"]) == len(evs)  # the other tasks lose nothing
    assert len(rows["favs"]) == sum(ev.event_id == "fav" for ev in evs)


def test_each_step_before_the_window_fails_per_event(tmp_path):
    """The key function, a Map before the window and the aggregation's where=: each failing event goes to
    task_errors alone (naming the key when there is one) and is in no window; the windows keep the rest."""
    evs = events()
    no_amount = [ev for ev in evs if "amount" not in ev.contents]
    job = Job("j", [
        Task("by_amount", None, [KeyBy(lambda e: e["amount"] % 2), TimeWindow(30), Aggregate(n=Count())],
             input="stream"),
        Task("mapped", None, [KeyBy("user_id"), Map(lambda e: {"ts": e.ts, "big": e["amount"] > 6}),
                              TimeWindow(10), Aggregate(n=Count())], input="stream"),
        Task("where", None, [KeyBy("user_id"), TimeWindow(10),
                             Aggregate(n=Count(), big=Count(where=lambda e: e["amount"] > 6), total=Sum("amount"))],
             input="stream"),
    ])
    summary, rows = run_device(job, evs, tmp_path, quarantine_after=1000)

    clean = windows_of([ev for ev in evs if "amount" in ev.contents], 10)
    for task in ("mapped", "where"):
        assert sorted((r["user_id"], r["window_start"], r["n"]) for r in rows[task]) == sorted(
            (user, start, len(ws)) for (user, start), ws in clean.items()), task
    assert sorted((r["user_id"], r["window_start"], r["big"], r["total"]) for r in rows["where"]) == sorted(
        (user, start, sum(e["amount"] > 6 for e in ws), sum(e["amount"] for e in ws))
        for (user, start), ws in clean.items())
    assert sum(r["n"] for r in rows["by_amount"]) == len(evs) - len(no_amount)
    for task, key in (("by_amount", None), ("mapped", "user"), ("where", "user")):
        errors = errors_of(rows, task)
        assert [(e["user_id"], e["trigger_ts"]) for e in errors] == [(ev.user_id, ev.ts) for ev in no_amount], task
        assert [e["key"] for e in errors] == [None if key is None else ev.user_id for ev in no_amount], task
        assert all(e["error"].startswith("KeyError: ") and "'amount'" in e["error"] for e in errors), task
        assert summary.task_stats[task].errors == len(no_amount), task


class Reminder(KeyedProcessFunction):
    """Counts a user's events (raising on a buy) and, 5 s after each, emits a reminder (raising for u1)."""

    def open(self, ctx):
        self.seen = ctx.get_state(ValueStateDescriptor("seen"))

    def on_event(self, event, ctx):
        if event.event_id == "buy":
            raise ValueError(f"cannot remind of a buy at {event.ts}")
        seen = (self.seen.value() or 0) + 1
        self.seen.update(seen)
        ctx.register_event_time_timer(ctx.timestamp + 5000)
        ctx.emit({"user_id": ctx.key, "kind": "event", "at": event.ts, "seen": seen})

    def on_timer(self, time_ms, ctx):
        if ctx.key == "u1":
            raise RuntimeError(f"no reminder for u1 at {time_ms}")
        ctx.emit({"user_id": ctx.key, "kind": "timer", "at": time_ms / 1000})  # (when it fires is the runner's)


def reminder_task(name: str = "remind") -> Task:
    return Task(name, None, [KeyBy("user_id"), Process(Reminder())], input="stream")


def test_a_process_function_fails_per_event_and_per_timer(tmp_path):
    evs = events(60)
    summary, rows = run_device(Job("j", [reminder_task()]), evs, tmp_path, quarantine_after=1000)

    good = [ev for ev in evs if ev.event_id != "buy"]
    buys = [ev for ev in evs if ev.event_id == "buy"]
    assert sorted(r["at"] for r in rows["remind"] if r["kind"] == "event") == sorted(ev.ts for ev in good)
    assert sorted(round(r["at"], 3) for r in rows["remind"] if r["kind"] == "timer") == sorted(
        round(ev.ts + 5, 3) for ev in good if ev.user_id != "u1")
    errors = errors_of(rows, "remind")
    on_event = [e for e in errors if e["error"].startswith("ValueError")]
    on_timer = [e for e in errors if e["error"].startswith("RuntimeError")]
    assert [(e["key"], e["trigger_ts"]) for e in on_event] == [(ev.user_id, ev.ts) for ev in buys]
    assert sorted((e["key"], round(e["trigger_ts"], 3), e["trigger_event"]) for e in on_timer) == sorted(
        ("u1", round(ev.ts + 5, 3), None) for ev in good if ev.user_id == "u1")
    assert summary.task_stats["remind"].errors == len(errors) == len(buys) + len(on_timer)


class CloseFails(KeyedProcessFunction):
    def on_event(self, event, ctx):
        ctx.emit({"user_id": ctx.key, "ts": event.ts})

    def close(self):
        raise OSError("the function's file is gone")


def test_failures_at_the_end_of_the_input_are_rows_too():
    """finish() (the final watermark: every open window fires, then close()) raises nothing: a window that
    fails there and a close() that raises are task_errors rows, the other windows' rows are returned."""
    run = StreamTaskRun(buy_rate_task(), quarantine_after=100)
    for event in [Event("u", "fav", "item", T0), Event("u", "buy", "item", T0 + 1), Event("v", "fav", "item", T0 + 2)]:
        assert run.process(event) == ([], [])
    rows, sides = run.finish()
    assert [(r["user_id"], r["n"], r["buys"]) for r in rows] == [("u", 2, 1)]
    [(table, error)] = sides
    assert table == TASK_ERRORS_TABLE
    assert (error["task"], error["key"], error["window_start"], error["window_end"]) == ("rates", "v", T0, T0 + 10)

    run = StreamTaskRun(Task("closing", None, [KeyBy("user_id"), Process(CloseFails())], input="stream"))
    assert run.process(Event("u", "fav", "item", T0)) == ([{"user_id": "u", "ts": T0}], [])
    rows, [(table, error)] = run.finish()
    assert rows == [] and table == TASK_ERRORS_TABLE
    assert (error["task"], error["error"]) == ("closing", "OSError: the function's file is gone")


def test_a_failing_map_after_the_window_is_quarantined_after_consecutive_failures(tmp_path):
    """Windows without a buy fail; with quarantine_after=3 the third failure in a row quarantines the task
    (its later rows are not computed), the summary says so, the run ends normally."""
    evs = [Event("u", "fav", "item", T0 + 10 * i) for i in range(8)]  # one window each, none with a buy
    summary, rows = run_device(Job("j", [buy_rate_task()]), evs, tmp_path, quarantine_after=3)
    assert summary.quarantined == ["rates"] and summary.task_stats["rates"].errors == 3
    assert [e["window_start"] for e in errors_of(rows, "rates")] == [T0, T0 + 10, T0 + 20]
    assert "rates" not in rows


def test_a_process_function_failing_on_every_event_is_quarantined_and_a_checkpoint_keeps_it_so():
    def boom(event, ctx):
        raise RuntimeError("no")

    task = Task("boom", None, [KeyBy("user_id"), Process(boom)], input="stream")
    run = StreamTaskRun(task, quarantine_after=2)
    outcomes = [run.process(Event("u", "fav", "item", T0 + i)) for i in range(4)]
    assert [len(sides) for _, sides in outcomes] == [1, 1, 0, 0] and run.quarantined
    assert [sides[0][1]["error"] for _, sides in outcomes[:2]] == ["RuntimeError: no"] * 2

    resumed = StreamTaskRun(task, quarantine_after=2)
    resumed.restore_steps(run.steps_state())
    assert resumed.quarantined and resumed.process(Event("u", "fav", "item", T0 + 5)) == ([], [])


def test_streamflow_run_over_a_failing_stream_task_exits_0_and_counts_the_errors(tmp_path, capsys):
    job = tmp_path / "rates.py"
    job.write_text(textwrap.dedent("""
        from operators import Aggregate, Count, KeyBy, Map, TimeWindow
        from streamflow import Job, Task

        job = Job("rates", [Task("rates", None, [
            KeyBy("user_id"), TimeWindow(10), Aggregate(n=Count(), buys=Count(where=lambda e: e.event_id == "buy")),
            Map(lambda row: {**row, "views_per_buy": row["n"] / row["buys"]})], input="stream")])
    """))
    path = tmp_path / "events.jsonl"
    evs = events()
    path.write_text("".join(json.dumps(ev.to_dict()) + "\n" for ev in evs))
    expected = windows_of(evs, 10)
    bad = sum(not any(e.event_id == "buy" for e in ws) for ws in expected.values())
    db = tmp_path / "out.duckdb"

    assert main(["run", str(job), "--events", str(path), "--db", str(db), "--quarantine-after", "1000"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"task rates +fired +{len(expected) - bad}  rows +{len(expected) - bad}  errors {bad}\n", out)
    assert f"task errors      {bad}  (in table task_errors)" in out
    assert len(read_tables(db)["rates"]) == len(expected) - bad


# -- the same on Flink ------------------------------------------------------------------------------------
# Fewer failures per step than quarantine_after (5, both runners' default) where a task is not meant to be
# quarantined: the order in which windows fire differs between the runners (Flink's watermarks are periodic).

@pytest.fixture
def shipped_by_value():
    """This module's classes (the Process function) go to the Flink workers by value, as a job file's do:
    they cannot import a test module by name."""
    import cloudpickle

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    yield
    cloudpickle.unregister_pickle_by_value(module)


def few_failures(n: int = 40) -> list[Event]:
    """Four users, one event a second: the first event of a user's 10 s window is a buy, but for four
    windows (which have none); events 5, 17 and 34 (favs) have no ``amount``."""
    out, seen = [], set()
    for i in range(n):
        window = (i % 4, i // 10)
        first, _ = window not in seen, seen.add(window)
        kind = "buy" if first and window not in {(1, 0), (2, 1), (3, 2), (0, 3)} else "fav"
        contents = {"item_id": f"i{i % 3}"} | ({} if i in (5, 17, 34) else {"amount": i % 9})
        out.append(Event(USERS[i % 4], kind, "item", T0 + i * 1.0, contents))
    return out


class ViewsPerBuy(Aggregation):
    """An aggregation of the user's own whose result divides by zero in a window without a buy."""

    needs_field = False

    def create(self):
        return [0, 0]

    def add(self, acc, item):
        return [acc[0] + 1, acc[1] + (item.event_id == "buy")]

    def merge(self, a, b):
        return [a[0] + b[0], a[1] + b[1]]

    def result(self, acc):
        return acc[0] / acc[1]


@needs_flink
def test_window_failures_give_the_same_rows_and_counters_on_both_runners(shipped_by_value):
    from streamflow.testing import assert_same_on_runners

    job = Job("windows", [
        buy_rate_task(),
        Task("result", None, [KeyBy("user_id"), TimeWindow(10), Aggregate(n=Count(), per_buy=ViewsPerBuy())],
             input="stream"),
        Task("where", None, [KeyBy("user_id"), TimeWindow(10, slide=5),
                             Aggregate(n=Count(), total=Sum("amount"), big=Count(where=lambda e: e["amount"] > 4))],
             input="stream"),
        Task("keyed", None, [Filter(lambda e: e.event_id != "buy"), KeyBy(lambda e: e["amount"] % 2),
                             Map(lambda e: {"ts": e.ts, "amount": e["amount"]}), TimeWindow(20),
                             Aggregate(n=Count(), total=Sum("amount"))], input="stream"),
    ])
    rows = assert_same_on_runners(job, few_failures())
    assert len(errors_of(rows, "rates")) == 4 and rows["rates"]
    assert [(e["key"], e["window_start"]) for e in errors_of(rows, "result")] == [
        (e["key"], e["window_start"]) for e in errors_of(rows, "rates")]  # a failing result() names its window
    assert len(errors_of(rows, "where")) == 3 and rows["where"]  # per event, not per sliding window
    assert len(errors_of(rows, "keyed")) == 3 and rows["keyed"]


@needs_flink
def test_quarantine_and_process_failures_give_the_same_rows_and_counters_on_both_runners(shipped_by_value):
    from streamflow.testing import assert_same_on_runners

    evs = few_failures()
    job = Job("quarantine", [
        Task("bad", None, [Filter(lambda e: e["colour"] == "red"), KeyBy("user_id"), TimeWindow(10),
                           Aggregate(n=Count())], input="stream"),
        reminder_task(),
        Task("counts", None, [KeyBy("user_id"), TimeWindow(10), Aggregate(n=Count())], input="stream"),
    ])
    rows = assert_same_on_runners(job, evs[:16])  # 6 buys (on_event fails), u1's 3 favs (their timers fail)
    assert len(errors_of(rows, "bad")) == 5  # quarantined after 5, on both (the counters compare that too)
    assert errors_of(rows, "remind") and rows["remind"]
    assert sum(r["n"] for r in rows["counts"]) == 16


@needs_flink
def test_an_add_that_fails_on_what_a_window_holds_fails_that_window_on_flink():
    """Past the per-event check, an add can still raise on what the window holds (Max of a str, then an int).
    Flink's WindowOperator calls add per window and cannot output there: the window's accumulator becomes
    the failure and WindowRows stores a task_errors row for the window; the job goes on. (On the device
    such an event fails alone: the one place where the runners differ.)"""
    from streamflow.flink.runner import WindowAggregate

    aggregate = WindowAggregate({"n": Count(), "top": Max("v")})
    acc = aggregate.create_accumulator()
    acc = aggregate.add(("u", {"v": "x"}), acc)
    failed = aggregate.add(("u", {"v": 3}), acc)
    assert failed.error == "TypeError: '>' not supported between instances of 'int' and 'str'"
    assert "runner.py" not in failed.traceback and "aggregations.py" in failed.traceback  # from the user's side
    assert aggregate.add(("u", {"v": 4}), failed) is failed and aggregate.get_result(failed) is failed
    assert aggregate.merge(aggregate.create_accumulator(), failed) is failed
