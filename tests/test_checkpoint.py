"""Checkpoints, piece by piece: keyed runtimes, source positions, held storage, validation on resume, the CLI."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.storage import DEAD_LETTER_TABLE, CollectiveStorage
from operators import Aggregate, Count, KeyBy, Last, SessionWindow, TimeWindow, Train
from operators.process import KeyedProcessFunction, ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from streamflow.checkpoint import CHECKPOINT_TABLE, CheckpointError, has_checkpoint, load_checkpoint
from streamflow.cli import main
from streamflow.job import Job, Task, load_job
from streamflow.keyed import KeyedRuntime
from streamflow.runners.device import DeviceRunner
from streamflow.sources import JsonLinesSource, TaobaoBehaviorSource, open_source
from streamflow.windowing import EventTimeWindows, SessionWindows

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "jobs" / "data" / "taobao_user_behavior_10k.csv"
IPV_JOB = ROOT / "jobs" / "ipv.py"


# -- keyed runtime --------------------------------------------------------------------------------
class Everything(KeyedProcessFunction):
    """Value state with a TTL, list and map state, event-time timers set and deleted: all in a snapshot."""

    ts = "ts"

    def open(self, ctx):
        self.last = ctx.get_state(ValueStateDescriptor("last", ttl_s=30))
        self.seen = ctx.get_state(ListStateDescriptor("seen"))
        self.kinds = ctx.get_state(MapStateDescriptor("kinds", ttl_s=90))

    def on_event(self, item, ctx):
        previous = self.last.value()
        self.last.update(item["ts"])
        self.seen.add(item["kind"])
        self.kinds.put(item["kind"], self.kinds.get(item["kind"], 0) + 1)
        if previous is not None:
            ctx.delete_event_time_timer(round(previous * 1000) + 20_000)
        ctx.register_event_time_timer(ctx.timestamp + 20_000)
        ctx.emit({"key": ctx.key, "previous": previous, "n": len(self.seen.get())})

    def on_timer(self, time_ms, ctx):
        ctx.emit({"key": ctx.key, "idle_at": time_ms, "kinds": dict(self.kinds.items())})
        self.seen.update(self.seen.get()[-3:])


FUNCTIONS = {
    "everything": lambda: Everything(),
    "sliding": lambda: EventTimeWindows(TimeWindow(30, slide=10, allowed_lateness=15), Aggregate(n=Count()), "k"),
    "session": lambda: SessionWindows(SessionWindow(20, allowed_lateness=5), Aggregate(n=Count()), "k"),
}

items = st.lists(st.tuples(st.sampled_from("abcde"), st.floats(0, 40), st.sampled_from(["x", "y", "z"])),
                 min_size=1, max_size=60)


def _events(raw):
    ts, out = 1_000.0, []
    for key, step, kind in raw:
        ts += step - 8  # mostly forward, sometimes back: late items, late firings
        out.append((key, {"ts": round(ts, 3), "kind": kind}))
    return out


@settings(max_examples=60, deadline=None)
@given(raw=items, split=st.integers(0, 60), name=st.sampled_from(sorted(FUNCTIONS)),
       max_keys=st.sampled_from([None, 2]))
def test_a_run_split_by_snapshot_pickle_restore_equals_an_unsplit_run(raw, split, name, max_keys):
    events = _events(raw)
    split = min(split, len(events))
    whole = KeyedRuntime(FUNCTIONS[name](), out_of_orderness_s=3, max_keys=max_keys)
    expected = [whole.process(key, item) for key, item in events] + [whole.finish()]

    first = KeyedRuntime(FUNCTIONS[name](), out_of_orderness_s=3, max_keys=max_keys)
    got = [first.process(key, item) for key, item in events[:split]]
    blob = pickle.dumps(first.snapshot())
    second = KeyedRuntime(FUNCTIONS[name](), out_of_orderness_s=3, max_keys=max_keys)
    second.restore(pickle.loads(blob))
    got += [second.process(key, item) for key, item in events[split:]] + [second.finish()]
    assert got == expected
    assert (second.evicted, second.expired) == (whole.evicted, whole.expired)


def test_restore_refuses_state_the_function_does_not_declare():
    runtime = KeyedRuntime(Everything())
    runtime.process("a", {"ts": 1.0, "kind": "x"})
    other = KeyedRuntime(SessionWindows(SessionWindow(20), Aggregate(n=Count()), "k"))
    with pytest.raises(ValueError, match="does not declare"):
        other.restore(runtime.snapshot())


# -- source positions ----------------------------------------------------------------------------
def _lines():
    lines = SAMPLE.read_text().splitlines()[:150]
    lines[10] = "1,2,3"  # malformed
    lines[20] = lines[5].split(",")[0] + ",1,1,pv,1000000000"  # goes back in that user's time
    lines[30] = ""
    return lines


def test_a_read_resumed_after_any_record_yields_the_rest_exactly():
    source = TaobaoBehaviorSource.from_lines(_lines())
    whole = list(source)
    assert any(not hasattr(r, "user_id") for r in whole) and whole[-1].event_id == "page_exit"
    for cut in range(len(whole)):
        reader = source.read()
        records = iter(reader)
        taken = [next(records) for _ in range(cut + 1)]
        position = pickle.loads(pickle.dumps(reader.position_after(taken[-1])))
        assert taken + list(source.read(position)) == whole, cut


def test_jsonl_reads_resume_too():
    lines = [f'{{"user_id": "u{i % 3}", "event_id": "fav", "page_id": "item", "ts": {1.6e9 + i}}}' for i in range(9)]
    source = JsonLinesSource.from_lines(lines)
    reader = source.read()
    records = iter(reader)
    taken = [next(records) for _ in range(4)]
    assert taken + list(source.read(reader.position_after(taken[-1]))) == list(source)


# -- held storage ---------------------------------------------------------------------------------
def _save(con):
    con.execute("CREATE TABLE IF NOT EXISTS marks (n INTEGER)")
    con.execute("INSERT INTO marks VALUES (1)")


def test_held_storage_stores_rows_only_with_a_commit(tmp_path):
    due = []
    store = CollectiveStorage(tmp_path / "f.duckdb", flush_rows=2, flush_interval_s=3600)
    store.write("t", [{"n": 0}])
    store.hold(lambda: due.append(True))
    assert store.query("SELECT n FROM t") == [(0,)]  # rows before hold() were flushed by it
    store.write("t", [{"n": 1}, {"n": 2}])  # a full buffer calls on_due instead of flushing
    assert due == [True] and store.pending() == 2
    assert store.query("SELECT count(*) FROM t") == [(1,)]  # reads see committed rows only
    store.commit(_save)
    assert store.pending() == 0 and store.query("SELECT n FROM t ORDER BY n") == [(0,), (1,), (2,)]
    assert store.query("SELECT * FROM marks") == [(1,)]
    store.write("t", [{"n": 3}])
    store.close()  # not covered by a commit: dropped
    with CollectiveStorage(tmp_path / "f.duckdb") as again:
        assert again.query("SELECT count(*) FROM t") == [(3,)]


def test_a_failed_commit_stores_nothing(tmp_path):
    store = CollectiveStorage(tmp_path / "f.duckdb")
    store.hold(lambda: None)
    store.write("t", [{"n": 1}])
    store.write("u", [{"m": "x"}])

    def broken(con):
        _save(con)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        store.commit(broken)
    assert store.tables() == []
    store.commit(_save)  # the rows are still buffered and go with the next commit
    assert store.query("SELECT n FROM t") == [(1,)] and store.query("SELECT m FROM u") == [("x",)]
    store.close()


def test_a_commit_sends_refused_rows_to_the_dead_letter_and_keeps_the_rest(tmp_path):
    store = CollectiveStorage(tmp_path / "f.duckdb")
    store.hold(lambda: None)
    store.write("t", [{"n": 1}])
    store.commit(_save)
    store.write("t", [{"n": 2}, {"n": "not a number"}, {"n": 3}])
    store.write("u", [{"m": 1}])
    store.commit(_save)
    assert store.query("SELECT n FROM t ORDER BY n") == [(1,), (2,), (3,)]
    assert store.query("SELECT m FROM u") == [(1,)]
    assert store.query("SELECT count(*) FROM marks") == [(2,)]
    dead = store.query(f"SELECT source, raw FROM {DEAD_LETTER_TABLE}")
    assert dead == [("storage:t", '{"n": "not a number"}')]
    assert store.rows_written == {"t": 3, "u": 1, DEAD_LETTER_TABLE: 1}
    store.close()


# -- the runner: resume in process, validation -------------------------------------------------------
class Crash(Exception):
    pass


def _crash_after(n):
    def wrap(records):
        for i, record in enumerate(records):
            if i == n:
                raise Crash
            yield record
    return wrap


def _rows(db, tables):
    with CollectiveStorage(db) as store:
        present = store.tables()
        return {t: sorted(store.query(f"SELECT * FROM {t}"), key=repr) for t in tables if t in present}


WINDOW_JOB = Job("win", [Task("per_user", None, [KeyBy("user_id"), TimeWindow(3600, slide=1800),
                                                 Aggregate(n=Count(), last=Last("event_id"))], input="stream")])


@pytest.mark.parametrize("crashes", [[700, 900], [3]])
def test_crashed_runs_resume_to_the_rows_of_an_uninterrupted_run(crashes, tmp_path):
    source = TaobaoBehaviorSource.from_lines(SAMPLE.read_text().splitlines()[:1500])
    job = Job("both", [*load_job(IPV_JOB).tasks, *WINDOW_JOB.tasks])
    tables = ["ipv", "per_user", "dead_letter", "late_events"]
    with CollectiveStorage(tmp_path / "ref.duckdb") as store:
        reference = DeviceRunner(job, store).run(source)
    expected = _rows(tmp_path / "ref.duckdb", tables)

    db = tmp_path / "run.duckdb"
    for crash in crashes:  # each crash is a failure mid-record loop: rows after the last checkpoint are dropped
        with CollectiveStorage(db, flush_rows=40) as store:  # full buffers call checkpoints every 40 rows
            runner = DeviceRunner(job, store, checkpoint_interval_s=3600)
            with pytest.raises(Crash):
                runner.run(source, progress=_crash_after(crash))
            runner.close()
    with CollectiveStorage(db, flush_rows=40) as store:
        runner = DeviceRunner(job, store, checkpoint_interval_s=3600)
        summary = runner.run(source)
        runner.close()
    assert _rows(db, tables) == expected
    assert summary.events_in == reference.events_in and summary.rows_written == reference.rows_written
    assert summary.rejected == reference.rejected


def test_checkpointing_off_leaves_the_storage_untouched_by_checkpoints(tmp_path):
    with CollectiveStorage(tmp_path / "f.duckdb") as store:
        DeviceRunner(load_job(IPV_JOB), store).run(open_source(SAMPLE))
        assert CHECKPOINT_TABLE not in store.tables()


def _checkpointed_run(db, job, source, **kwargs):
    with CollectiveStorage(db) as store:
        runner = DeviceRunner(job, store, checkpoint_interval_s=60, **kwargs)
        try:
            return runner.run(source)
        finally:
            runner.close()


def test_resume_validates_job_input_and_completion(tmp_path):
    db = tmp_path / "f.duckdb"
    lines = SAMPLE.read_text().splitlines()[:500]
    job = load_job(IPV_JOB)
    with CollectiveStorage(db, flush_rows=20) as store:
        runner = DeviceRunner(job, store, checkpoint_interval_s=3600)
        with pytest.raises(Crash):
            runner.run(TaobaoBehaviorSource.from_lines(lines), progress=_crash_after(300))
    other_job = Job("ipv", [*job.tasks, *WINDOW_JOB.tasks])
    with pytest.raises(CheckpointError, match="other tasks"):
        _checkpointed_run(db, other_job, TaobaoBehaviorSource.from_lines(lines))
    with pytest.raises(CheckpointError, match="another input file"):
        _checkpointed_run(db, job, TaobaoBehaviorSource.from_lines(lines[:-1]))
    with CollectiveStorage(db) as store, pytest.raises(CheckpointError, match="holds a checkpoint"):
        DeviceRunner(job, store).run(TaobaoBehaviorSource.from_lines(lines))  # checkpointing off would duplicate
    _checkpointed_run(db, job, TaobaoBehaviorSource.from_lines(lines))
    with CollectiveStorage(db) as store:
        assert load_checkpoint(store, "ipv").complete and has_checkpoint(store, "ipv")
    with pytest.raises(CheckpointError, match="already ran to completion"):
        _checkpointed_run(db, job, TaobaoBehaviorSource.from_lines(lines))


def test_checkpoints_refuse_what_they_cannot_cover(tmp_path):
    from engine import GraphBuilder

    b = GraphBuilder()
    b.output(b.linear(b.input("x", (None, 1)), np.zeros((1, 2), "float32"), np.zeros(2, "float32")))
    train = Train(b.build(), features=lambda r: [r["n"]], label=lambda r: 0, batch_size=2)
    job = Job("learn", [Task("learn", ["fav"], [Aggregate(n=Count()), train], input="recent")])
    with CollectiveStorage(tmp_path / "f.duckdb") as store:
        with pytest.raises(ValueError, match="learn: Train"):
            DeviceRunner(job, store, checkpoint_interval_s=5)
        with pytest.raises(TypeError, match="file source"):
            DeviceRunner(load_job(IPV_JOB), store, checkpoint_interval_s=5).run([])
        with pytest.raises(ValueError, match="must be > 0"):
            DeviceRunner(load_job(IPV_JOB), store, checkpoint_interval_s=0)


def test_cli_checkpoint_interval_refuses_a_finished_run_and_replace_starts_over(tmp_path, capsys):
    db = tmp_path / "f.duckdb"
    events = tmp_path / "events.csv"
    events.write_text("\n".join(SAMPLE.read_text().splitlines()[:300]) + "\n")
    args = ["run", str(IPV_JOB), "--events", str(events), "--db", str(db), "--checkpoint-interval", "0.01"]
    assert main(args) == 0
    first = _rows(db, ["ipv"])
    assert main(args) == 2
    assert "already ran to completion" in capsys.readouterr().err
    assert main([*args, "--replace"]) == 0
    assert _rows(db, ["ipv"]) == first
