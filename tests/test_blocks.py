"""The device runner's block path gives what the per-event path gives: the same rows in the same order,
the same dead letters, task errors, counters and quarantines, whatever the block size."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.storage import CollectiveStorage
from operators import Aggregate, Count, CountBy, First, Last, Map, Max, Sum
from streamflow.events import PAGE_ENTER, PAGE_EXIT, Event, Rejected
from streamflow.job import Job, Task
from streamflow.runners.device import DeviceRunner
from streamflow.summary import SYSTEM_TABLES

T0 = 1_600_000_000.0
KINDS = [PAGE_ENTER, PAGE_EXIT, "fav", "buy", "cart", "pv"]


def _boom(row):
    raise ValueError(f"no row for {row['n']}")


def _job(with_recent: bool) -> Job:
    tasks = [
        Task("visit", ["item"], [Aggregate(item=First("item_id"), enter=First("ts"), exit=Last("ts"),
                                           kinds=CountBy("event_id"), n=Count()),
                                 Map(lambda r: {**r, "kinds": sorted(r["kinds"].items())})]),
        Task("home", ["home"], [Aggregate(n=Count(), hi=Max("ts"), total=Sum("ts"))]),
        Task("favs", ["fav"], [Aggregate(n=Count(where=lambda e: e.event_id == "fav"), last=Last("ts"))]),
        Task("no_field", ["cart"], [Aggregate(x=First("missing"))]),  # a task error per firing, then quarantine
        Task("fails", ["buy"], [Aggregate(n=Count()), Map(_boom)]),
        Task("also_item", ["item"], [Aggregate(n=Count())]),  # fires with "visit" on the same event
    ]
    if with_recent:
        tasks.append(Task("recent", ["fav"], [Aggregate(n=Count())], input="recent", history_events=3))
    return Job("blocks", tasks)


events = st.lists(
    st.tuples(st.sampled_from(["u", "v", "w"]), st.sampled_from(KINDS), st.sampled_from(["item", "home"]),
              st.sampled_from([0, 1, 1, 2, 3, 5, -1]), st.sampled_from(["i1", "i2"]), st.booleans()),
    min_size=1, max_size=60)


def _records(raw) -> list[Event | Rejected]:
    out: list[Event | Rejected] = []
    t = 0.0
    for n, (user, kind, page, step, item, bad) in enumerate(raw):
        t += step  # steps back too: the runner's guard rejects those
        if bad and step == 5:
            out.append(Rejected("test", n, "malformed: a bad record", "x,y"))
        else:
            out.append(Event(user, kind, page, T0 + t, {"item_id": item}))
    return out


def _tables(store: CollectiveStorage, job: Job) -> dict[str, list[tuple]]:
    present = set(store.tables())
    out = {}
    for table in [t.sink for t in job.tasks] + list(SYSTEM_TABLES):
        if table in present:
            columns = [c for (c,) in store.query(
                "SELECT column_name FROM information_schema.columns WHERE table_name = ? ORDER BY ordinal_position",
                [table]) if c != "traceback"]
            out[table] = store.query(f'SELECT {", ".join(columns)} FROM "{table}" ORDER BY rowid')
    return out


def _per_event(records, job, db) -> tuple[dict, dict]:
    with CollectiveStorage(db, flush_rows=7) as store:
        runner = DeviceRunner(job, store, quarantine_after=3)
        for record in records:
            if isinstance(record, Event):
                runner.process(record)
            else:
                runner.reject(record)
        runner.finish()
        runner.close()
        stats = {name: vars(s) for name, s in runner.summary.task_stats.items()}
        return _tables(store, job), {"stats": stats, "in": runner.summary.events_in,
                                     "rejected": dict(runner.summary.rejected)}


def _in_blocks(records, job, db, size) -> tuple[dict, dict]:
    with CollectiveStorage(db, flush_rows=7) as store:
        runner = DeviceRunner(job, store, quarantine_after=3)
        runner.block_size = size
        summary = runner.run(records)
        runner.close()
        stats = {name: vars(s) for name, s in summary.task_stats.items()}
        return _tables(store, job), {"stats": stats, "in": summary.events_in, "rejected": dict(summary.rejected)}


@pytest.mark.parametrize("with_recent", [False, True])
@settings(max_examples=40, deadline=None)
@given(raw=events, size=st.sampled_from([1, 2, 5, 256]))
def test_blocks_store_what_the_per_event_path_stores(tmp_path_factory, with_recent, raw, size):
    records = _records(raw)
    job = _job(with_recent)
    tmp = tmp_path_factory.mktemp("blocks")
    expected = _per_event(records, job, tmp / "per_event.duckdb")
    got = _in_blocks(records, job, tmp / "blocks.duckdb", size)
    assert got == expected


def test_the_ipv_sample_in_blocks_equals_per_event(tmp_path):
    from streamflow.job import load_job
    from streamflow.sources import open_source

    job = load_job("jobs/ipv.py")
    records = list(open_source("jobs/data/taobao_user_behavior_10k.csv"))
    assert _in_blocks(records, job, tmp_path / "b.duckdb", 256) == _per_event(records, job, tmp_path / "e.duckdb")


def test_source_checked_events_skip_only_an_equal_runner_guard(tmp_path):
    """A source's default guard already checked its events: the runner's default guard is not asked again,
    but a guard of the caller's own (here stricter) still judges every event."""
    from streamflow.events import TimestampGuard
    from streamflow.sources import TaobaoBehaviorSource

    lines = ["1,10,7,pv,1511848894", "1,10,7,buy,1511848900", "2,11,7,pv,1511848901"]
    job = Job("j", [Task("visit", ["item"], [Aggregate(n=Count())])])
    with CollectiveStorage(tmp_path / "a.duckdb") as store:
        runner = DeviceRunner(job, store)
        summary = runner.run(TaobaoBehaviorSource.from_lines(lines))
        assert summary.events_in == 5 and runner.guard.users_held == 0  # not checked twice
    with CollectiveStorage(tmp_path / "b.duckdb") as store:
        strict = TimestampGuard(min_ts=1511848901.0)
        summary = DeviceRunner(job, store, guard=strict).run(TaobaoBehaviorSource.from_lines(lines))
        assert summary.events_in == 2 and summary.rejected_total == 3  # user 1's events are too early for it
        assert {r[0] for r in store.query("SELECT source FROM dead_letter")} == {"runner"}
