"""The testing harness on the device runner: rows of every table, sorted, from a list of events or a
file; and the diff ``assert_same_on_runners`` reports. Its runs on Flink are in test_flink_parity.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from operators import Aggregate, Count
from streamflow.events import Event, Rejected
from streamflow.job import Job, Task, load_job
from streamflow.sources import TaobaoBehaviorSource
from streamflow.summary import RunSummary, TaskStats
from streamflow.testing import rows_diff, run_job, summary_diff

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"
T = 1511848894.0


@pytest.fixture(scope="module")
def sample_slice(tmp_path_factory):
    path = tmp_path_factory.mktemp("slice") / "slice.csv"
    path.write_text("\n".join(SAMPLE.read_text().splitlines()[:1500]) + "\n")
    return path


def test_a_file_and_the_same_events_as_a_list_give_the_same_sorted_rows(sample_slice):
    job = load_job(ROOT / "jobs" / "ipv.py")
    from_file = run_job(job, sample_slice)
    events = [r for r in TaobaoBehaviorSource(sample_slice) if not isinstance(r, Rejected)]
    from_list = run_job(job, events)
    assert list(from_file) == ["ipv"] and len(from_file["ipv"]) > 300
    assert from_list == from_file
    keys = [tuple(row.values()) for row in from_file["ipv"]]
    assert keys == sorted(keys)  # sorted by their values, in column order
    assert run_job(job, list(reversed(events))) != from_file  # the input order matters (times go backwards)...
    by_user = sorted(events, key=lambda e: e.user_id)  # ...but not how users interleave
    assert run_job(job, by_user) == from_file


def test_events_as_dicts_and_bad_ones_in_dead_letter():
    job = Job("favs", [Task("favs", ["fav"], [Aggregate(n=Count())], input="recent")])
    events = [{"user_id": 1, "event_id": "fav", "page_id": "item", "ts": T},
              {"user_id": 1, "event_id": "fav", "page_id": "item", "ts": T - 5},  # goes back in time
              {"user_id": 1, "event_id": "fav", "page_id": "item", "ts": "soon"},
              Event("1", "fav", "item", T + 1, {"item_id": "x"})]
    rows = run_job(job, events)
    assert rows["favs"] == [{"user_id": "1", "trigger_ts": T, "n": 1}, {"user_id": "1", "trigger_ts": T + 1, "n": 2}]
    assert [(r["source"], r["line"], r["reason"].split(":")[0]) for r in rows["dead_letter"]] == [
        ("events", 2, "timestamp goes backwards"), ("events", 3, "wrong type")]


def test_harness_refuses_unknown_runners_and_events_json_cannot_carry():
    job = Job("favs", [Task("favs", ["fav"], [Aggregate(n=Count())], input="recent")])
    with pytest.raises(ValueError, match="unknown runner 'spark'"):
        run_job(job, [Event("u", "fav", "item", T)], runner="spark")
    with pytest.raises(ValueError, match="event 1 .* cannot be written as a JSON line"):
        run_job(job, [Event("u", "fav", "item", T), Event("u", "fav", "item", T, {"when": object()})])


def test_diff_names_tables_rows_and_counters_that_differ(sample_slice):
    job = load_job(ROOT / "jobs" / "ipv.py")
    rows = run_job(job, sample_slice)
    assert rows_diff(rows, copy.deepcopy(rows)) == []
    doctored = copy.deepcopy(rows)
    doctored["ipv"][0]["dwell_s"] += 1.0  # one value changed
    del doctored["ipv"][-1]  # one row missing
    doctored["late_events"] = [{"task": "x", "ts": T, "item": "{}"}]
    diff = rows_diff(rows, doctored)
    assert diff[0] == "table ipv: 2 rows only on the device, 1 only on Flink"
    assert f"  device only: {rows['ipv'][0]}" in diff and f"  device only: {rows['ipv'][-1]}" in diff
    assert f"  Flink only:  {doctored['ipv'][0]}" in diff
    assert diff[-1] == "table late_events: only Flink wrote it (1 rows)"

    ours = RunSummary("a", events_in=5, tasks_fired=2, task_stats={"ipv": TaskStats(fired=2, rows=2)})
    theirs = RunSummary("b", events_in=5, tasks_fired=2, task_stats={"ipv": TaskStats(fired=2, rows=1, errors=1)})
    assert summary_diff(ours, ours) == []
    assert summary_diff(ours, theirs) == ["task ipv (fired, rows, errors): device (2, 2, 0), Flink (2, 1, 1)"]
