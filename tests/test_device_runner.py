"""The device runner: task inputs, isolation, quarantine, the worker pool, run-time registration."""

from __future__ import annotations

import json
import threading

import pytest

from connectors.storage import CollectiveStorage
from operators import Aggregate, Count, KeyBy, Last, Map, Operator, Sum, TimeWindow
from streamflow.events import PAGE_ENTER, PAGE_EXIT, Event
from streamflow.job import Job, Task
from streamflow.runners.device import DeviceRunner
from streamflow.summary import TASK_ERRORS_TABLE

T0 = 1_600_000_000.0


def ev(user: str, kind: str, t: float, page: str = "item", **contents) -> Event:
    return Event(user, kind, page, T0 + t, contents)


@pytest.fixture
def store(tmp_path):
    s = CollectiveStorage(tmp_path / "features.duckdb", flush_rows=3)
    yield s
    s.close()


def visit(user: str, start: float, clicks=("fav",), item="i1") -> list[Event]:
    events = [ev(user, PAGE_ENTER, start, item_id=item)]
    events += [ev(user, kind, start + 1 + i, item_id=item) for i, kind in enumerate(clicks)]
    events.append(ev(user, PAGE_EXIT, start + 1 + len(clicks), item_id=item))
    return events


def test_task_inputs_page_recent_and_pages(store):
    job = Job("inputs", [
        Task("on_page", ["item"], [Aggregate(n=Count(), item=Last("item_id"))], input="page"),
        Task("recent", ["item"], [Aggregate(n=Count())], input="recent", history_events=4),
        Task("recent_10s", ["item"], [Aggregate(n=Count())], input="recent", history_s=10),
        Task("pages", ["item"], [Aggregate(n=Count(), dwell=Sum("dwell_s"))], input="pages"),
    ])
    runner = DeviceRunner(job, store)
    runner.run(visit("u", 0, ("fav", "cart")) + visit("u", 100, ("buy",), item="i2"))
    assert store.query("SELECT n, item FROM on_page ORDER BY trigger_ts") == [(4, "i1"), (3, "i2")]
    assert store.query("SELECT n FROM recent ORDER BY trigger_ts") == [(4,), (4,)]
    assert store.query("SELECT n FROM recent_10s ORDER BY trigger_ts") == [(4,), (3,)]
    assert store.query("SELECT n, dwell FROM pages ORDER BY trigger_ts") == [(1, 3.0), (2, 5.0)]
    assert store.query("SELECT DISTINCT user_id FROM on_page") == [("u",)]


def test_users_are_matched_separately(store):
    job = Job("j", [Task("fav_then_buy", ["fav", "buy"], [Aggregate(n=Count())], input="recent")])
    runner = DeviceRunner(job, store)
    # u's fav and v's buy interleave: contiguity is per user, so only u's own fav->buy fires.
    runner.run([ev("u", "fav", 0), ev("v", "buy", 1), ev("u", "buy", 2), ev("v", "fav", 3)])
    assert store.query("SELECT user_id, trigger_ts FROM fav_then_buy") == [("u", T0 + 2)]


class Boom(Operator):
    """Fails on the items a predicate picks."""

    def __init__(self, fail_when):
        self.fail_when = fail_when

    def apply(self, groups):
        for _, items in groups:
            for item in items:
                if self.fail_when(item):
                    raise RuntimeError(f"boom on {item['event_id']}")
        return groups


def test_failing_task_is_recorded_and_does_not_stop_others(store):
    job = Job("j", [
        Task("flaky", ["fav"], [Boom(lambda e: e["bad"]), Aggregate(n=Count())], input="page"),
        Task("steady", ["fav"], [Aggregate(n=Count())], input="page"),
    ])
    runner = DeviceRunner(job, store, quarantine_after=3)
    summary = runner.run([
        ev("u", "fav", 0, bad=False), ev("u", "fav", 1, bad=True), ev("u", "fav", 2, bad=False),
    ])
    assert summary.task_stats["flaky"].errors == 1 and summary.task_stats["flaky"].rows == 2
    assert summary.task_stats["steady"].rows == 3
    assert not summary.quarantined
    [(task, user, trigger_ts, trigger_event, error)] = store.query(
        f"SELECT task, user_id, trigger_ts, trigger_event, error FROM {TASK_ERRORS_TABLE}")
    assert (task, user, trigger_ts) == ("flaky", "u", T0 + 1)
    assert json.loads(trigger_event)["contents"] == {"bad": True}
    assert error == "RuntimeError: boom on fav"


def test_task_that_keeps_failing_is_quarantined(store):
    job = Job("j", [
        Task("broken", ["fav"], [Map(lambda e: 1 / 0)], input="page"),
        Task("steady", ["fav"], [Aggregate(n=Count())], input="page"),
    ])
    runner = DeviceRunner(job, store, quarantine_after=3)
    summary = runner.run([ev("u", "fav", t) for t in range(6)])
    assert summary.quarantined == ["broken"]
    assert summary.task_stats["broken"].fired == 3  # not run again once quarantined
    assert summary.task_stats["steady"].rows == 6
    assert store.query(f"SELECT count(*) FROM {TASK_ERRORS_TABLE}") == [(3,)]
    assert "broken" not in runner.trie.conditions
    assert "QUARANTINED" in str(summary)


def test_success_resets_the_failure_streak(store):
    job = Job("j", [Task("flaky", ["fav"], [Boom(lambda e: e["bad"]), Aggregate(n=Count())], input="page")])
    runner = DeviceRunner(job, store, quarantine_after=2)
    summary = runner.run([ev("u", "fav", t, bad=(t % 2 == 0)) for t in range(6)])
    assert not summary.quarantined and summary.task_stats["flaky"].errors == 3


UNSTORABLE = {"tuple_key": {(1, 2): "no JSON key"}, "huge_int": 2**70, "object": object(), "set": {1, 2}}


@pytest.mark.parametrize("bad", list(UNSTORABLE))
@pytest.mark.parametrize("kind", ["trigger", "stream"])
def test_unstorable_row_goes_to_dead_letter_naming_task_and_row_and_the_run_goes_on(tmp_path, kind, bad):
    """User x's rows carry a value no table column can take (used to crash the whole run in the
    storage flush): each such row is dead-lettered with the task and the row, counted, and every
    other row is stored."""
    def mark(row):
        return {**row, "extra": UNSTORABLE[bad] if row["who"] == "x" else 7}

    if kind == "trigger":
        pipeline = [Aggregate(n=Count(), who=Last("user_id")), Map(mark)]
        task = Task("t", ["fav"], pipeline, input="recent")
    else:
        pipeline = [KeyBy("user_id"), TimeWindow(10), Aggregate(n=Count(), who=Last("user_id")), Map(mark)]
        task = Task("t", None, pipeline, input="stream")
    store = CollectiveStorage(tmp_path / "f.duckdb", flush_rows=2)  # flushes in the middle of the run too
    runner = DeviceRunner(Job("j", [task, Task("steady", ["fav"], [Aggregate(n=Count())], input="page")]), store)
    events = [ev(user, "fav", t) for t in (0, 15, 30) for user in ("a", "x", "b")]
    summary = runner.run(events)
    runner.close()

    assert store.query("SELECT DISTINCT user_id FROM t ORDER BY 1") == [("a",), ("b",)]
    assert store.query("SELECT count(*) FROM t") == [(6,)]
    assert store.query("SELECT count(*) FROM steady") == [(9,)]
    dead = store.query("SELECT source, reason, raw FROM dead_letter")
    assert len(dead) == 3 and summary.refused_rows == {"t": 3}
    for source, reason, raw in dead:
        assert source == "storage:t" and reason.startswith("row of task t refused by table t: "), reason
        assert json.loads(raw)["user_id"] == "x"
    assert "rows refused     3  (in table dead_letter)" in str(summary)


def test_late_item_json_cannot_take_is_still_stored(store):
    """A late item whose dict mixes key types (sort_keys fails) or has tuple keys (JSON has none)."""
    def item(event):
        return {"user_id": event.user_id, "ts": event.ts, "odd": {1: "a", "b": 2, (3, 4): "c"}}

    job = Job("j", [Task("w", None, [Map(item), KeyBy("user_id"), TimeWindow(10), Aggregate(n=Count())],
                         input="stream")])
    runner = DeviceRunner(job, store)
    runner.run([ev("u", "fav", 0), ev("u", "fav", 100), ev("v", "fav", 1)])  # v's event is late
    [(task, raw)] = store.query("SELECT task, item FROM late_events")
    assert task == "w" and json.loads(raw)["odd"] == {"1": "a", "b": 2, "(3, 4)": "c"}


def test_events_json_cannot_take_are_still_dead_lettered_and_their_task_errors_recorded(store):
    job = Job("j", [Task("broken", ["fav"], [Map(lambda e: 1 / 0)], input="page")])
    runner = DeviceRunner(job, store)
    odd = {(1, 2): "tuple key"}
    summary = runner.run([Event("u", "fav", "item", 12.0, odd), ev("u", "fav", 1, **{"k": odd})])
    assert summary.rejected_total == 1 and summary.task_stats["broken"].errors == 1
    [(raw,)] = store.query("SELECT raw FROM dead_letter")
    assert json.loads(raw)["contents"] == {"(1, 2)": "tuple key"}
    [(trigger_event,)] = store.query(f"SELECT trigger_event FROM {TASK_ERRORS_TABLE}")
    assert json.loads(trigger_event)["contents"] == {"k": {"(1, 2)": "tuple key"}}


class Rendezvous(Operator):
    """Passes only when ``parties`` tasks are inside it at once: proves they run concurrently."""

    def __init__(self, barrier: threading.Barrier):
        self.barrier = barrier

    def apply(self, groups):
        self.barrier.wait(timeout=10)
        return groups

    def __deepcopy__(self, memo):  # the barrier is the point: share it between the task copies
        return self


def test_tasks_fired_together_run_on_the_worker_pool(store):
    barrier = threading.Barrier(2)
    job = Job("j", [
        Task("a", ["fav"], [Rendezvous(barrier), Aggregate(n=Count())], input="page"),
        Task("b", ["fav"], [Rendezvous(barrier), Aggregate(n=Count())], input="page"),
    ])
    runner = DeviceRunner(job, store, workers=2)
    summary = runner.run([ev("u", "fav", 0), ev("u", "fav", 1)])
    runner.close()
    assert summary.task_stats["a"].errors == 0 and summary.task_stats["b"].errors == 0
    assert store.query("SELECT count(*) FROM a") == [(2,)] and store.query("SELECT count(*) FROM b") == [(2,)]


class Counting(Operator):
    """A stateful operator: counts the groups it has seen."""

    def __init__(self):
        self.seen = 0

    def apply(self, groups):
        self.seen += 1
        return [(key, [{"seen": self.seen}]) for key, _ in groups]


def test_each_task_gets_its_own_operator_state(store):
    shared = Counting()
    job = Job("j", [Task("x", ["fav"], [shared]), Task("y", ["buy"], [shared])])
    runner = DeviceRunner(job, store)
    runner.run([ev("u", "fav", 0), ev("u", "fav", 1), ev("u", "buy", 2)])
    assert store.query("SELECT seen FROM x ORDER BY trigger_ts") == [(1,), (2,)]
    assert store.query("SELECT seen FROM y") == [(1,)]  # not 3: y's copy of the operator is its own
    assert shared.seen == 0


def test_register_and_unregister_at_run_time(store):
    runner = DeviceRunner(Job("j", [Task("favs", ["fav"], [Aggregate(n=Count())], input="recent")]), store)
    runner.process(ev("u", "fav", 0))
    runner.register(Task("buys", ["buy"], [KeyBy("user_id"), Aggregate(n=Count())], input="recent"))
    runner.process(ev("u", "buy", 1))
    runner.unregister("favs")
    runner.process(ev("u", "fav", 2))
    runner.close()
    assert store.query("SELECT trigger_ts FROM favs") == [(T0,)]
    assert store.query("SELECT user_id, n FROM buys") == [("u", 2)]


def test_runner_rejects_bad_timestamps_from_any_source(store):
    job = Job("j", [Task("favs", ["fav"], [Aggregate(n=Count())], input="page")])
    runner = DeviceRunner(job, store)
    summary = runner.run([ev("u", "fav", 10), ev("u", "fav", 5), Event("u", "fav", "item", 12.0), ev("u", "fav", 11)])
    assert summary.events_in == 2 and summary.rejected_total == 2
    assert set(summary.rejected) == {"timestamp goes backwards", "absurd timestamp"}
    reasons = [r[0] for r in store.query("SELECT reason FROM dead_letter ORDER BY line")]
    assert reasons[0].startswith("timestamp goes backwards") and reasons[1].startswith("absurd timestamp")
    assert store.query("SELECT count(*) FROM favs") == [(2,)]
