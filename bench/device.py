"""The IPV job end to end on the device runner, and buffered collective storage vs one INSERT per row.

``python -m bench.device [--quick]``

Input: the Taobao sample (``jobs/data/taobao_user_behavior_10k.csv``) replayed until >= 1,000,000
events (quick: >= 200,000). Replay round ``r`` shifts every timestamp by ``r`` times the sample's
time span plus an hour, so each user's time keeps going forward and every page of round ``r`` is
left before round ``r + 1`` starts. Measured side by side, each round with a fresh runner and a fresh
DuckDB file in a temp dir:

- ``events_per_s``: :meth:`DeviceRunner.run` over pre-parsed events (the job's work: sequences,
  trie, the IPV task, rows handed to collective storage, the final flush);
- ``events_per_s_with_csv_parsing``: the same over the replayed CSV read through
  :class:`TaobaoBehaviorSource` (parsing, timestamp checks, page enter/exit derivation included);
- ``events_per_cpu_s`` and ``events_per_cpu_s_with_csv_parsing``: the same events over the process's
  CPU time during the run (all threads) instead of wall time: steadier on a shared, busy machine;
- trigger-to-row-stored latency, ``DeviceRunner(record_latency=True).latencies_s`` (a buffer flush,
  when one happens, is inside it), pooled over the rounds, two ways: ``trigger_to_stored_*`` as a live
  stream sees it, events handed over one at a time (``block_size=1``: from taking the event to its rows
  in storage), in a run of its own; ``trigger_to_stored_block_*`` in the throughput runs over the
  backlog (blocks of ``BLOCK_SIZE`` events: from taking a block's first event to the block's rows in
  storage, so every row is charged its whole block); the storage stores full buffers on its background
  writer thread, as ``streamflow run`` has it;
- ``peak_mb_1m_users``: peak RSS of a process running the IPV job over one million distinct users
  (time-ordered, a new user every 2 s of event time) with a 30-minute state TTL, next to the same
  without a TTL (every user's state kept to the end); ``--quick`` runs 100,000 users
  (``bench/many_users.py``);
- storage: the same IPV feature rows written one row per write (as the runner writes them) into
  :class:`CollectiveStorage` (buffered Arrow batches, flushed at the end) vs a writer doing one
  ``INSERT INTO ipv VALUES (?, ...)`` per row through duckdb (autocommit, table created up front and
  not timed). Both files are then compared row for row.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb

from bench.common import TAOBAO_SAMPLE, cpu_count, finish, log, median, parse_args, percentile, progress
from connectors.storage import CollectiveStorage
from streamflow import Event, load_job
from streamflow.job import Job
from streamflow.runners.device import BLOCK_SIZE, DeviceRunner
from streamflow.sources import TaobaoBehaviorSource

REPO = Path(__file__).resolve().parent.parent
JOB_FILE = REPO / "jobs" / "ipv.py"
MIN_EVENTS = {False: 1_000_000, True: 200_000}  # per run, by --quick
STORAGE_ROWS = {False: 10_000, True: 600}
LIVE_EVENTS = {False: 1_000_000, True: 60_000}  # per round, handed over one at a time (latency)
TABLE = "ipv"
MANY_USERS = {False: 1_000_000, True: 100_000}
STATE_TTL_S = 1800


def many_users(n_users: int, ttl_s: float | None) -> dict[str, Any]:
    """``bench.many_users`` in a fresh process (its peak RSS is that process's own)."""
    out = subprocess.run([sys.executable, "-m", "bench.many_users", str(n_users), str(ttl_s or "none")],
                         cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- input ------------------------------------------------------------------------------------------
def sample_period(lines: list[str]) -> int:
    """Seconds to shift each replay round by: the sample's time span plus an hour."""
    stamps = []
    for line in lines:
        try:
            stamps.append(int(line.rsplit(",", 1)[1]))
        except (IndexError, ValueError):
            continue  # a malformed row: the source rejects it, it does not bound the span
    return max(stamps) - min(stamps) + 3_600


def replay_events(events: list[Event], rounds: int, period: int) -> list[Event]:
    """``rounds`` copies of ``events``, copy ``r`` shifted by ``r * period`` seconds."""
    return [Event(e.user_id, e.event_id, e.page_id, e.ts + r * period, e.contents)
            for r in range(rounds) for e in events]


def replay_csv(lines: list[str], rounds: int, period: int, path: Path) -> None:
    """The CSV replayed ``rounds`` times, timestamps shifted like :func:`replay_events`."""
    with open(path, "w", encoding="utf-8") as out:
        for r in range(rounds):
            shift = r * period
            for line in lines:
                head, sep, ts = line.rpartition(",")
                try:
                    out.write(f"{head},{int(ts) + shift}\n" if sep else line + "\n")
                except ValueError:
                    out.write(line + "\n")  # a malformed timestamp stays malformed


# -- timed runs ------------------------------------------------------------------------------------
def run_job(job: Job, records: Any, db: Path, record_latency: bool, block_size: int = BLOCK_SIZE
            ) -> tuple[float, float, DeviceRunner]:
    """Wall and CPU seconds for ``DeviceRunner.run(records)`` (final flush included), and the runner. The
    storage has its background writer, as ``streamflow run`` uses it."""
    storage = CollectiveStorage(db, background=True)
    runner = DeviceRunner(job, storage, record_latency=record_latency, block_size=block_size)
    try:
        started, cpu_started = time.perf_counter(), time.process_time()
        runner.run(records)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    finally:
        runner.close()
        storage.close()
    return seconds, cpu_seconds, runner


def write_buffered(rows: list[dict[str, Any]], db: Path) -> float:
    """Seconds to write ``rows`` one per call through CollectiveStorage and flush at the end."""
    storage = CollectiveStorage(db)
    try:
        started = time.perf_counter()
        for row in rows:
            storage.write(TABLE, [row])
        storage.flush()
        return time.perf_counter() - started
    finally:
        storage.close()


def write_row_inserts(rows: list[dict[str, Any]], schema_source: Any, db: Path) -> float:
    """Seconds to write ``rows`` with one autocommitted ``INSERT ... VALUES (?, ...)`` each."""
    con = duckdb.connect(str(db))
    try:
        con.register("_schema", schema_source)
        con.execute(f'CREATE TABLE "{TABLE}" AS SELECT * FROM _schema WHERE false')
        con.unregister("_schema")
        columns = schema_source.column_names
        sql = f'INSERT INTO "{TABLE}" VALUES ({", ".join("?" * len(columns))})'
        execute = con.execute
        started = time.perf_counter()
        for row in rows:
            execute(sql, [row[c] for c in columns])
        return time.perf_counter() - started
    finally:
        con.close()


def table_rows(db: Path, columns: list[str]) -> list[tuple[Any, ...]]:
    names = ", ".join(f'"{c}"' for c in columns)
    with duckdb.connect(str(db), read_only=True) as con:
        return sorted(con.execute(f'SELECT {names} FROM "{TABLE}"').fetchall(), key=repr)


def main(argv: list[str] | None = None) -> None:
    args = parse_args("The IPV job on the device runner: events/s, trigger-to-stored latency, storage writes.", argv)
    quick = args.quick
    job = load_job(JOB_FILE)
    lines = [line.rstrip("\r\n") for line in TAOBAO_SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = list(TaobaoBehaviorSource(TAOBAO_SAMPLE))
    events = [r for r in records if isinstance(r, Event)]
    replays = -(-MIN_EVENTS[quick] // len(events))
    period = sample_period(lines)
    stream = replay_events(events, replays, period)
    log(f"{len(lines):,} CSV rows -> {len(events):,} events ({len(records) - len(events)} rejected); "
        f"replayed {replays}x -> {len(stream):,} events per run")

    tmp = Path(tempfile.mkdtemp(prefix="streamflow-bench-device-"))
    try:
        csv_path = tmp / "replay.csv"
        replay_csv(lines, replays, period, csv_path)
        rates, csv_rates, latencies, block_latencies, fired, rows_stored, csv_events = [], [], [], [], 0, 0, 0
        cpu_rates, csv_cpu_rates = [], []
        storage_rows: list[dict[str, Any]] = []
        schema = None
        for r in progress(range(args.rounds), "rounds (pre-parsed, csv)", total=args.rounds):
            db = tmp / f"events_{r}.duckdb"
            seconds, cpu_seconds, runner = run_job(job, stream, db, record_latency=True)
            summary = runner.summary
            rates.append(summary.events_in / seconds)
            cpu_rates.append(summary.events_in / cpu_seconds)
            block_latencies.extend(runner.latencies_s or [])
            fired, rows_stored = summary.tasks_fired, summary.rows_written.get(TABLE, 0)
            if summary.events_in != len(stream) or summary.rejected_total:
                print(f"the runner took {summary.events_in:,} of {len(stream):,} events and rejected "
                      f"{summary.rejected_total:,}: {dict(summary.rejected)}", file=sys.stderr)
                raise SystemExit(1)
            if r == 0:
                with duckdb.connect(str(db), read_only=True) as con:
                    schema = con.sql(f'SELECT * FROM "{TABLE}" LIMIT {STORAGE_ROWS[quick]}').to_arrow_table()
                storage_rows = schema.to_pylist()
            db.unlink()
            seconds, cpu_seconds, runner = run_job(job, TaobaoBehaviorSource(csv_path), tmp / f"csv_{r}.duckdb",
                                                   record_latency=False)
            csv_events = runner.summary.events_in
            csv_rates.append(csv_events / seconds)
            csv_cpu_rates.append(csv_events / cpu_seconds)
            (tmp / f"csv_{r}.duckdb").unlink()
            live = stream[:LIVE_EVENTS[quick]]
            _, _, runner = run_job(job, live, tmp / f"live_{r}.duckdb", record_latency=True, block_size=1)
            latencies.extend(runner.latencies_s or [])
            (tmp / f"live_{r}.duckdb").unlink()
            log(f"  pre-parsed {rates[-1]:,.0f} events/s ({fired:,} tasks fired, {rows_stored:,} rows); "
                f"with CSV parsing {csv_rates[-1]:,.0f} events/s ({csv_events:,} events)")

        assert schema is not None
        n_rows = len(storage_rows)
        buffered_rates, insert_rates = [], []
        for r in progress(range(args.rounds), f"storage rounds ({n_rows:,} rows)", total=args.rounds):
            a, b = tmp / f"buffered_{r}.duckdb", tmp / f"inserts_{r}.duckdb"
            buffered_rates.append(n_rows / write_buffered(storage_rows, a))
            insert_rates.append(n_rows / write_row_inserts(storage_rows, schema, b))
            if r == 0 and table_rows(a, schema.column_names) != table_rows(b, schema.column_names):
                print("buffered storage and row inserts stored different rows", file=sys.stderr)
                raise SystemExit(1)
            a.unlink()
            b.unlink()
            log(f"  buffered {buffered_rates[-1]:,.0f} rows/s, one INSERT per row {insert_rates[-1]:,.0f} rows/s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    n_users = MANY_USERS[quick]
    log(f"{n_users:,} distinct users, state TTL {STATE_TTL_S} s vs none (one process each)")
    bounded, unbounded = many_users(n_users, STATE_TTL_S), many_users(n_users, None)
    if bounded["rows"] != unbounded["rows"]:
        print(f"the TTL changed the IPV rows: {bounded['rows']:,} vs {unbounded['rows']:,}", file=sys.stderr)
        raise SystemExit(1)
    log(f"  with TTL: peak {bounded['peak_mb']} MB ({bounded['users_held_at_end']:,} users held at the end, "
        f"{bounded['seconds']} s); without: peak {unbounded['peak_mb']} MB ({unbounded['users_held_at_end']:,} held)")

    latencies.sort()
    block_latencies.sort()
    eps = median(rates)
    p50_ms, p99_ms = percentile(latencies, 50) * 1e3, percentile(latencies, 99) * 1e3
    buffered, inserts = median(buffered_rates), median(insert_rates)
    metrics = {
        "events_per_s": round(eps),
        "events_per_s_with_csv_parsing": round(median(csv_rates)),
        "events_per_cpu_s": round(median(cpu_rates)),
        "events_per_cpu_s_with_csv_parsing": round(median(csv_cpu_rates)),
        "trigger_to_stored_p50_ms": round(p50_ms, 4),
        "trigger_to_stored_p99_ms": round(p99_ms, 4),
        "trigger_to_stored_p999_ms": round(percentile(latencies, 99.9) * 1e3, 4),
        "trigger_to_stored_max_ms": round(latencies[-1] * 1e3, 3) if latencies else None,
        "latency_samples": len(latencies),
        "trigger_to_stored_block_p50_ms": round(percentile(block_latencies, 50) * 1e3, 4),
        "trigger_to_stored_block_p99_ms": round(percentile(block_latencies, 99) * 1e3, 4),
        "block_size": BLOCK_SIZE,
        "buffered_vs_row_inserts_speedup": round(buffered / inserts, 1),
        "buffered_rows_per_s": round(buffered),
        "row_inserts_rows_per_s": round(inserts, 1),
        "storage_rows": n_rows,
        "events_per_run": len(stream),
        "csv_events_per_run": csv_events,
        "tasks_fired_per_run": fired,
        "rows_stored_per_run": rows_stored,
        "replays": replays,
        "rounds": args.rounds,
        "peak_mb_1m_users": bounded["peak_mb"] if n_users == 1_000_000 else None,
        f"peak_mb_{n_users // 1000}k_users_ttl": bounded["peak_mb"],
        f"peak_mb_{n_users // 1000}k_users_no_ttl": unbounded["peak_mb"],
        "many_users_events": bounded["events_in"],
        "many_users_rows": bounded["rows"],
        "many_users_held_at_end_ttl": bounded["users_held_at_end"],
        "many_users_seconds_ttl": bounded["seconds"],
        "target_200k_events_per_s_met": eps >= 200_000,
        "target_peak_1gb_1m_users_met": bounded["peak_mb"] <= 1024 if n_users == 1_000_000 else None,
        "target_p99_1ms_met": p99_ms <= 1.0,
        "cpu_count": cpu_count(),
        "quick": quick,
    }
    finish("device", metrics, quick=args.quick)


if __name__ == "__main__":
    main()
