"""Same job, two runners: the device runner and Flink (real PyFlink MiniCluster) emit the same rows.

Every test goes through ``streamflow.testing.assert_same_on_runners``, which compares every table
and the run counters (events in, tasks fired, rejected records, per-task counts). All tests run in
this pytest process, so they share one JVM (PyFlink starts it once; each run gets a local MiniCluster).
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="needs the flink extra: pip install 'streamflow[flink]'", exc_type=ImportError)
if shutil.which("java") is None:
    pytest.skip("the Flink runner needs a Java runtime", allow_module_level=True)

from operators import Aggregate, Count, CountDistinct, Filter, KeyBy, Last, Map, TimeWindow  # noqa: E402
from streamflow.events import Event  # noqa: E402
from streamflow.job import Job, Task, load_job  # noqa: E402
from streamflow.testing import assert_same_on_runners  # noqa: E402
from tests.test_ipv_job import COLUMNS, reference_ipv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"
ACTIVITY = ROOT / "tests" / "data" / "activity.jsonl"


@pytest.fixture(scope="module")
def sample_in_time_order(tmp_path_factory):
    """A slice of the shared sample with all users' lines in time order (each user's own order kept):
    with no event out of order, Flink's periodic watermarks make no event late, as on the device."""
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()[:3000]
    path = tmp_path_factory.mktemp("sample") / "slice_by_time.csv"
    path.write_text("\n".join(sorted(lines, key=lambda line: int(line.rsplit(",", 1)[1]))) + "\n", encoding="utf-8")
    return path


def test_ipv_job_gives_the_same_rows_on_both_runners_and_the_independent_reference(tmp_path):
    events = tmp_path / "sample_with_bad_lines.csv"
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    lines[100:100] = ["999477,1,2,pv", "999477,1,2,teleport,1511848894", "999477,1,2,pv,1e9"]  # malformed
    lines.insert(5000, lines[4999].rsplit(",", 1)[0] + ",1511000000")  # goes back in time for that user
    events.write_text("\n".join(lines) + "\n", encoding="utf-8")

    rows = assert_same_on_runners(load_job(ROOT / "jobs" / "ipv.py"), events)

    expected, rejected = reference_ipv(events)
    assert len(rows["ipv"]) == len(expected) == 10_000
    assert Counter(tuple(row[c] for c in COLUMNS) for row in rows["ipv"]) == Counter(expected)
    assert len(rows["dead_letter"]) == rejected == 4


def test_sliding_window_job_with_out_of_order_and_late_events():
    """Events of user u3 arrive 8 s after their time (beyond the 5 s watermark bound, within the 10 s
    allowed lateness: late firings), u4's 90 s after (too late for every window: late_events)."""
    rows = assert_same_on_runners(load_job(ROOT / "jobs" / "activity_windows.py"), ACTIVITY, pace_ms=150)

    # The input really exercises lateness: u3 has windows fired twice, u4 has events no window took.
    fired = Counter((row["user_id"], row["window_start"]) for row in rows["activity"])
    assert any(n > 1 for (user, _), n in fired.items() if user == "u3")
    assert rows["late_events"] and all('"user_id": "u4"' in row["item"] for row in rows["late_events"])


def test_activity_windows_job_on_the_shared_sample(sample_in_time_order):
    rows = assert_same_on_runners(load_job(ROOT / "jobs" / "activity_windows.py"), sample_in_time_order)
    assert len(rows["activity"]) > 1000 and "late_events" not in rows
    assert any(row["buys"] > 0 for row in rows["activity"]) and any(row["items"] > 1 for row in rows["activity"])


def test_fractional_windows_and_an_offset_beyond_the_slide_on_both_runners(sample_in_time_order):
    """Windows of 2.5 s sliding by 0.75 s, offset 7.3 s (Flink itself takes only |offset| < slide).
    Page exits are left out: the adapter emits them at the page's last activity, out of time order."""
    job = Job("fractional", [Task("views", None, [
        Filter(lambda e: e.event_id != "page_exit"),
        Map(lambda e: {"user_id": e.user_id, "ts": e.ts, "item_id": e["item_id"]}),
        KeyBy("user_id"), TimeWindow(2.5, slide=0.75, offset=7.3), Aggregate(n=Count(), items=CountDistinct("item_id")),
    ], input="stream")])
    rows = assert_same_on_runners(job, sample_in_time_order)
    starts = {round(row["window_start"] * 1000) for row in rows["views"]}
    assert all((start - 7300) % 750 == 0 for start in starts) and len(starts) > 100
    assert "late_events" not in rows


def test_a_row_no_table_can_take_is_dead_lettered_alike_on_both_runners():
    """User x's rows carry an integer beyond 64 bits (it used to crash the run in the storage flush)."""
    def mark(row):
        return {**row, "extra": 2**70 if row["who"] == "x" else 7}

    job = Job("unstorable", [Task("t", ["fav"], [Aggregate(n=Count(), who=Last("user_id")), Map(mark)],
                                  input="recent")])
    events = [Event(user, "fav", "item", 1511848894.0 + t) for t in (0, 15, 30) for user in ("a", "x", "b")]
    rows = assert_same_on_runners(job, events)
    assert [row["who"] for row in rows["t"]] == ["a"] * 3 + ["b"] * 3
    assert len(rows["dead_letter"]) == 3
    assert all(row["reason"].startswith("row of task t refused by table t: OverflowError") and '"user_id": "x"'
               in row["raw"] for row in rows["dead_letter"])


def test_assert_same_on_runners_catches_a_job_whose_rows_differ_between_runners():
    """A job keeping state outside the runner (a counter in a closure) numbers rows 1, 2, 3 on the
    device; Flink gets its own copy of the closure, shipped after the device run: 4, 5, 6."""
    calls = {"n": 0}

    def number(row):
        calls["n"] += 1
        return {**row, "call": calls["n"]}

    job = Job("hidden_state", [Task("favs", ["fav"], [Aggregate(n=Count()), Map(number)], input="recent")])
    events = [Event("u", "fav", "item", 1511848894.0 + i) for i in range(3)]
    with pytest.raises(AssertionError) as failure:
        assert_same_on_runners(job, events)
    message = str(failure.value)
    assert message.startswith("job 'hidden_state': the device and Flink runners disagree")
    assert "table favs: 3 rows only on the device, 3 only on Flink" in message
    assert "device only: {'user_id': 'u', 'trigger_ts': 1511848894.0, 'n': 1, 'call': 1}" in message
    assert "Flink only:  {'user_id': 'u', 'trigger_ts': 1511848894.0, 'n': 1, 'call': 4}" in message


def test_session_count_and_process_tasks_give_the_same_rows_on_both_runners():
    """jobs/sessions.py: session windows (merging, late events), count windows and a user's keyed process
    function with state, TTL and event-time timers, all on the keyed-state primitive on both runners."""
    rows = assert_same_on_runners(load_job(ROOT / "jobs" / "sessions.py"), ACTIVITY, pace_ms=150)
    for name in ("sessions", "every_3_items", "cart_abandoned", "late_events"):
        assert rows[name], name  # the input exercises every task


def test_line_ends_blank_lines_and_a_last_line_without_newline_read_alike(tmp_path):
    """The Flink runner hands a user's consecutive lines on in runs, and ends the last run at the line
    count it takes before the job (as Flink's text line format reads: CRLF, a lone CR, blank lines, no
    final newline): miscounted, a run would be held back (the job fails) or rows would differ here."""
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()[:400]
    body = "\r\n".join(lines[:150]) + "\r" + "\n".join(lines[150:300]) + "\n\n\n" + "\n".join(lines[300:])
    events = tmp_path / "line_ends.csv"
    events.write_bytes(body.encode("utf-8"))  # no newline after the last line
    rows = assert_same_on_runners(load_job(ROOT / "jobs" / "ipv.py"), events)
    assert len(rows["ipv"]) == 400 and "dead_letter" not in rows


def test_a_line_that_is_not_utf8_is_a_dead_letter_on_flink_as_on_the_device(tmp_path):
    """Flink's text line format would read bad bytes as U+FFFD and parse the rest of the line; lines go to Python
    as their bytes, so the line is rejected as on the device and a valid non-ASCII line keeps its characters."""
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()[:200]
    lines[50] = lines[50].replace(",pv,", ",p\udcffv,", 1)  # a lone 0xff byte (written back by surrogateescape)
    lines[51] = lines[51].rsplit(",", 1)[0] + ",1511é00000"  # UTF-8, but not a timestamp
    events = tmp_path / "bad_bytes.csv"
    events.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"))
    rows = assert_same_on_runners(load_job(ROOT / "jobs" / "ipv.py"), events)
    reasons = sorted(row["reason"] for row in rows["dead_letter"])
    assert len(reasons) == 2 and reasons[0].startswith("invalid UTF-8"), reasons
    assert any("1511é00000" in row["raw"] for row in rows["dead_letter"])


def test_a_run_held_back_at_the_end_of_the_input_fails_the_job_loudly(tmp_path, monkeypatch):
    """Should the file have fewer lines than counted before the job (it changed in between), the last run
    would be held back: the job fails naming the lines, it does not end with rows missing."""
    from streamflow.flink import runner

    events = tmp_path / "shrunk.csv"
    events.write_text("\n".join(SAMPLE.read_text(encoding="utf-8").splitlines()[:50]) + "\n", encoding="utf-8")
    monkeypatch.setattr(runner, "_line_count", lambda path: 60)
    with pytest.raises(Exception, match="lines from line .* on were still held at the end of the input"):
        runner.run_flink(load_job(ROOT / "jobs" / "ipv.py"), events, db=tmp_path / "flink.duckdb")
