"""Device checkpoints: what they cost the IPV job, and what a checkpoint and a resume cost.

``python -m bench.checkpoint [--quick]``

Input: the Taobao sample replayed (as in :mod:`bench.device`) to >= 1,000,000 events (quick: >= 200,000),
read from CSV. Side by side, alternating, each round with a fresh DuckDB file:

- ``events_per_s_off``: :meth:`DeviceRunner.run` without checkpoints;
- ``events_per_s_on``: with ``checkpoint_interval_s=1`` (checkpoints every second, on full storage
  buffers and at the end); ``overhead_on`` = 1 - on / off;
- ``checkpoint_ms``: median time of one checkpoint (state pickled, rows and state committed) and
  ``checkpoint_mb``: the pickled state half-way through the input;
- ``resume_s``: a run stopped half-way (SIGTERM-like, by an exception after a checkpoint) then
  resumed: time from the new runner's start to its first event processed (checkpoint read, unpickled,
  restored, input skipped to the position); ``rows_equal``: that resumed run's rows equal the
  uninterrupted run's.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from bench.common import TAOBAO_SAMPLE, cpu_count, finish, log, median, parse_args, progress
from bench.device import sample_period
from connectors.storage import CollectiveStorage
from streamflow import load_job
from streamflow.checkpoint import CHECKPOINT_TABLE
from streamflow.runners.device import DeviceRunner
from streamflow.sources import open_source

JOB_FILE = Path(__file__).resolve().parents[1] / "jobs" / "ipv.py"
MIN_EVENTS = {False: 1_000_000, True: 200_000}
EVENTS_PER_SAMPLE = 20_954  # app events the 10k-line sample becomes


class Stop(Exception):
    pass


def replay_csv(lines: list[str], rounds: int, period: int, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for r in range(rounds):
            for line in lines:
                head, _, ts = line.rpartition(",")
                out.write(f"{head},{int(ts) + r * period}\n" if ts.isdigit() else line + "\n")


def run(db: Path, csv: Path, interval: float | None, stop_after: int | None = None, timing: dict | None = None):
    with CollectiveStorage(db) as storage:
        runner = DeviceRunner(load_job(JOB_FILE), storage, checkpoint_interval_s=interval)
        if interval is not None:
            commit = storage.commit

            def timed_commit(also):
                started = time.perf_counter()
                commit(also)
                timing.setdefault("ms", []).append((time.perf_counter() - started) * 1000)
            storage.commit = timed_commit

        def stop(records):
            for n, record in enumerate(records):
                if n == 0 and timing is not None:
                    timing["first_record"] = time.perf_counter()
                if stop_after is not None and n == stop_after:
                    raise Stop
                yield record
        started = time.perf_counter()
        try:
            summary = runner.run(open_source(csv), progress=stop)
        except Stop:
            return None, None
        finally:
            runner.close()
        seconds = time.perf_counter() - started
        return summary.events_in / seconds, started


def main(argv: list[str] | None = None) -> None:
    args = parse_args("Device checkpoints on the IPV job: overhead, checkpoint and resume cost.", argv)
    lines = [line for line in TAOBAO_SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    replays = -(-MIN_EVENTS[args.quick] // EVENTS_PER_SAMPLE)
    tmp = Path(tempfile.mkdtemp(prefix="streamflow-bench-checkpoint-"))
    try:
        csv = tmp / "replay.csv"
        replay_csv(lines, replays, sample_period(lines), csv)
        log(f"{replays}x the sample: {replays * len(lines):,} CSV rows")
        off, on, timing = [], [], {}
        for r in progress(range(args.rounds), "rounds (off, on)", total=args.rounds):
            off.append(run(tmp / f"off_{r}.duckdb", csv, None)[0])
            on.append(run(tmp / f"on_{r}.duckdb", csv, 1.0, timing=timing)[0])
        resumed_db = tmp / "resumed.duckdb"
        run(resumed_db, csv, 1.0, stop_after=replays * len(lines), timing={})
        with CollectiveStorage(resumed_db) as store:  # the state half-way (a finished run's holds none)
            state_mb = store.query(f"SELECT octet_length(state) FROM {CHECKPOINT_TABLE}")[0][0] / 1e6
        resume = {}
        started = run(resumed_db, csv, 1.0, timing=resume)[1]
        with CollectiveStorage(tmp / "off_0.duckdb") as a, CollectiveStorage(resumed_db) as b:
            sql = "SELECT * FROM ipv ORDER BY ALL"
            rows_equal = a.query(sql) == b.query(sql)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    metrics = {
        "events_per_s_off": round(median(off)), "events_per_s_on": round(median(on)),
        "overhead_on": round(1 - median(on) / median(off), 4),
        "checkpoint_ms": round(median(timing["ms"]), 2), "checkpoints": len(timing["ms"]),
        "checkpoint_mb": round(state_mb, 3), "resume_s": round(resume["first_record"] - started, 3),
        "rows_equal": rows_equal, "rounds": args.rounds, "events_per_run": replays * EVENTS_PER_SAMPLE,
        "cpu_count": cpu_count(),
    }
    finish("checkpoint", metrics, quick=args.quick)


if __name__ == "__main__":
    main()
