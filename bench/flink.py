"""The IPV job on Flink: streamflow's translated job vs a hand-written PyFlink job vs the device runtime.

``python -m bench.flink [--quick]``

Input: the Taobao sample (``jobs/data/taobao_user_behavior_10k.csv``, 10,000 rows, ~21k app events)
replayed into a temp CSV (full: 5 replays, ~105k events; quick: 1 replay, ~21k), replay ``r``
shifted by ``r`` times the sample's time span plus an hour so each user's time keeps going forward.
"Events" are app events (page enters, clicks, page exits), the unit the device benchmark counts.

Measured in one process, on the local PyFlink MiniCluster (parallelism 1, ``thread`` execution mode):

- ``jvm_startup_s``: the first :func:`flink_environment` call, which launches the JVM (py4j gateway);
  every later Flink run in the process reuses that JVM;
- ``streamflow_events_per_s``: :func:`run_flink` on the IPV job file, timed over ``env.execute()``
  (the MiniCluster start, the job, the DuckDB sink's close), not the JVM start; ``run_flink``'s count
  of the file's lines before ``execute()`` (so that ``ParseLines`` can hand a user's consecutive lines
  on as one run) is in ``streamflow_run_flink_wall_s``, with the building of the job;
- ``handwritten_events_per_s``: what a PyFlink user would write by hand for the same features —
  FileSource text lines, a plain Python parse, ``key_by(user)``, a KeyedProcessFunction whose
  ValueState holds only the open item page, emitting the IPV row on exit, an end-of-input event-time
  timer (registered at 0 when a key is first seen; with ``no_watermarks()`` it fires with the final
  watermark) closing open pages, and a parallelism-1 ProcessFunction sink writing the rows to DuckDB
  on close. Same environment (``flink_environment()``), same timing. Its table must equal (a)'s,
  sorted, with the same column types, or the benchmark aborts;
- ``device_events_per_s``: :class:`DeviceRunner` over the same CSV through
  :class:`TaobaoBehaviorSource` (parsing included), with its own DuckDB file.

Before the timed rounds, untimed one-line jobs: the first Flink job of the JVM (the hand-written job
on one line, ``first_flink_job_s``: the MiniCluster's classes, the JIT, the embedded interpreter's
first imports) — a cost of the process, not of either job — then ``run_flink`` on one line twice
(``streamflow_first_one_line_job_s`` includes streamflow's first imports in the embedded interpreter;
``streamflow_one_line_job_s``, the second, is its fixed cost per run), then the hand-written job
again (``handwritten_one_line_job_s``).
The per-run fixed cost (MiniCluster start, Python operator set-up, teardown) is inside both rates;
``ratio_vs_handwritten_excl_one_line_job`` subtracts each job's one-line time.

``--scaling`` measures only ``run_flink`` at parallelism 1 and 2 (the file split across two readers at 2; rows
compared) on the local MiniCluster: ``events_per_s_p1``, ``events_per_s_p2``, ``scaling_p2_vs_p1`` and the CPU
seconds per event of this process and the JVM (``bench/results/flink_scaling.json``). Not yet the issue's
figures on the standalone cluster with two TaskManagers.

``state_bytes_per_user``: the keyed state the IPV job keeps per user on the Flink runner (``run_flink`` with
checkpoints, parallelism 1), measured from Flink's own checkpoints (the runner's default heap state backend: full
checkpoints). One input of levels (full: 2, 6 and 12 copies of the sample; quick: 1 and 2), copy ``r`` with every
user id offset by ``r`` times (the largest user id + 1), 114 distinct users a copy, each left with the state its
last line leaves (an open item page); after each level's copies a filler of one more user whose lines alternate
two items at the sample's last timestamp (one event a page: its state keeps its size), long enough for a few
checkpoints (every 50 ms) to complete with every user so far in state. A thread reads each completed checkpoint's
size while the job runs (every file of its ``chk-N`` directory, ``_metadata`` included: small state is inlined
there; Flink keeps only the latest); a level's size is the stretch of checkpoints within 64 bytes of each other
during its filler. Bytes per user: the least-squares slope of size against users, so the fixed part (operator
state, the source's position, metadata) cancels (``state_points``: users, bytes, checkpoints in the stretch).
``device_state_bytes_per_user``: the same slope for the device runner's checkpoint (the ``state`` blob of its
checkpoint: every keyed runtime, the guard, the source's position with its per-user open pages) over the same
input, its first checkpoint in each filler (asked for after every block).

``--quick`` replays the sample once (~21k events, fewer than the full run's >= 100k) in one round;
the JVM launch (~4-6 s) plus the first job (~15-20 s on this 2-core machine) are a fixed ~25 s of it, the
state job ~15 s.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from bench.common import TAOBAO_SAMPLE, cpu_count, finish, log, median, parse_args, progress
from bench.device import replay_csv, sample_period
from connectors.storage import CollectiveStorage
from streamflow import load_job
from streamflow.runners.device import DeviceRunner
from streamflow.sources import TaobaoBehaviorSource

REPO = Path(__file__).resolve().parent.parent
JOB_FILE = REPO / "jobs" / "ipv.py"
REPLAYS = {False: 5, True: 1}  # by --quick
ROUNDS = {False: 3, True: 1}
TABLE = "ipv"
GAP_S = 1800  # TaobaoBehaviorSource's default inactivity gap

# The IPV table as the device runner and run_flink store it (CollectiveStorage infers it from the rows).
IPV_SCHEMA = pa.schema([
    ("user_id", pa.string()), ("trigger_ts", pa.float64()), ("item_id", pa.string()),
    ("category_id", pa.string()), ("enter_ts", pa.float64()), ("dwell_s", pa.float64()),
    ("n_reload", pa.int64()), ("n_fav", pa.int64()), ("n_cart", pa.int64()), ("n_buy", pa.int64()),
])

_EXECUTE_TIMES: list[float] = []


def _time_execute() -> None:
    """Record the wall time of every ``StreamExecutionEnvironment.execute`` call (run_flink's too)."""
    from pyflink.datastream import StreamExecutionEnvironment

    original = StreamExecutionEnvironment.execute
    if getattr(original, "_bench_timed", False):
        return

    def execute(self: Any, job_name: str | None = None) -> Any:
        started = time.perf_counter()
        try:
            return original(self, job_name)
        finally:
            _EXECUTE_TIMES.append(time.perf_counter() - started)

    execute._bench_timed = True  # type: ignore[attr-defined]
    StreamExecutionEnvironment.execute = execute


# -- (b) the hand-written PyFlink job ------------------------------------------------------------------
def _handwritten_classes() -> tuple[type, type]:
    """The job's functions (defined after the JVM is up: PyFlink's imports are lazy here)."""
    from pyflink.common import Types
    from pyflink.datastream.functions import KeyedProcessFunction, ProcessFunction, RuntimeContext
    from pyflink.datastream.state import ValueStateDescriptor

    page_type = Types.TUPLE([Types.STRING(), Types.STRING(), Types.LONG(), Types.LONG(),
                             Types.INT(), Types.INT(), Types.INT(), Types.INT()])

    class IpvPages(KeyedProcessFunction):
        """Per user, the open item page: (item, category, enter ts, last ts, n_pv, n_fav, n_cart, n_buy)."""

        def open(self, runtime_context: RuntimeContext) -> None:
            self.page = runtime_context.get_state(ValueStateDescriptor("page", page_type))

        def process_element(self, value: tuple, ctx: KeyedProcessFunction.Context):
            user, item, category, behavior, ts = value
            page = self.page.value()
            out = []
            if page is None:
                ctx.timer_service().register_event_time_timer(0)  # fires with the final watermark
            else:
                if ts - page[3] > GAP_S:  # inactive: the page was left at its last activity
                    out.append(_row(user, page, page[3]))
                    page = None
                elif page[0] == item:  # a reload or a click on the open page
                    n = list(page)
                    n[3] = ts
                    n[4 + ("pv", "fav", "cart", "buy").index(behavior)] += 1
                    self.page.update(tuple(n))
                    return out
                else:  # another item page: this one is left now
                    out.append(_row(user, page, ts))
            self.page.update((item, category, ts, ts, 0, int(behavior == "fav"), int(behavior == "cart"),
                              int(behavior == "buy")))
            return out

        def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext):
            page = self.page.value()
            self.page.clear()
            return [_row(ctx.get_current_key(), page, page[3])] if page is not None else []

    class DuckDBSink(ProcessFunction):
        """Collects the rows; writes them to one DuckDB table when the input ends."""

        def __init__(self, db_path: str):
            self.db_path = db_path

        def open(self, runtime_context: RuntimeContext) -> None:
            self.rows: list[tuple] = []

        def process_element(self, value: tuple, ctx: ProcessFunction.Context):
            self.rows.append(value)
            return []

        def close(self) -> None:
            columns = list(zip(*self.rows, strict=True)) if self.rows else [[] for _ in IPV_SCHEMA]
            batch = pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(columns, IPV_SCHEMA, strict=True)],
                                         schema=IPV_SCHEMA)
            with duckdb.connect(self.db_path) as con:
                con.register("batch", batch)
                con.execute(f'CREATE TABLE "{TABLE}" AS SELECT * FROM batch')

    return IpvPages, DuckDBSink


def _row(user: str, page: tuple, exit_ts: int) -> tuple:
    item, category, enter_ts, _, n_pv, n_fav, n_cart, n_buy = page
    return (user, float(exit_ts), item, category, float(enter_ts), float(exit_ts - enter_ts),
            n_pv, n_fav, n_cart, n_buy)


def _parse(line: str) -> tuple[str, str, str, str, int]:
    user, item, category, behavior, ts = line.split(",")
    return user, item, category, behavior, int(ts)


def run_handwritten(csv_path: Path, db: Path) -> None:
    """The IPV features as a plain PyFlink DataStream job; rows in ``db`` table ``ipv``."""
    from pyflink.common import Types, WatermarkStrategy
    from pyflink.datastream.connectors.base import Sink
    from pyflink.datastream.connectors.file_system import FileSource, StreamFormat
    from pyflink.java_gateway import get_gateway

    from streamflow.flink.runner import flink_environment

    ipv_pages, duckdb_sink = _handwritten_classes()
    env = flink_environment(parallelism=1)
    row_type = Types.TUPLE([Types.STRING(), Types.DOUBLE(), Types.STRING(), Types.STRING(), Types.DOUBLE(),
                            Types.DOUBLE(), Types.INT(), Types.INT(), Types.INT(), Types.INT()])
    lines = env.from_source(
        FileSource.for_record_stream_format(StreamFormat.text_line_format(), str(csv_path)).build(),
        WatermarkStrategy.no_watermarks(), "taobao csv")
    records = lines.map(_parse, output_type=Types.TUPLE([Types.STRING()] * 4 + [Types.LONG()]))
    rows = records.key_by(lambda r: r[0], key_type=Types.STRING()).process(ipv_pages(), output_type=row_type)
    (rows.process(duckdb_sink(str(db)), output_type=Types.BOOLEAN()).set_parallelism(1)
     .sink_to(Sink(get_gateway().jvm.org.apache.flink.streaming.api.functions.sink.v2.DiscardingSink())))
    env.execute("handwritten ipv")


# -- runs ----------------------------------------------------------------------------------------------
def run_streamflow(job: Any, csv_path: Path, db: Path, parallelism: int = 1,
                   cluster: str | None = None) -> tuple[float, float, int]:
    """(execute() seconds, run_flink wall seconds, events in) of the translated job."""
    from streamflow.flink.runner import run_flink

    before = len(_EXECUTE_TIMES)
    started = time.perf_counter()
    summary = run_flink(job, csv_path, db=db, parallelism=parallelism, cluster=cluster)
    wall = time.perf_counter() - started
    if len(_EXECUTE_TIMES) != before + 1:
        raise RuntimeError("run_flink did not call env.execute() exactly once")
    if summary.rejected_total:
        raise RuntimeError(f"run_flink rejected {summary.rejected_total} records: {dict(summary.rejected)}")
    return _EXECUTE_TIMES[-1], wall, summary.events_in


def timed_handwritten(csv_path: Path, db: Path) -> tuple[float, float]:
    """(execute() seconds, wall seconds incl. building the job) of the hand-written job."""
    before = len(_EXECUTE_TIMES)
    started = time.perf_counter()
    run_handwritten(csv_path, db)
    wall = time.perf_counter() - started
    assert len(_EXECUTE_TIMES) == before + 1
    return _EXECUTE_TIMES[-1], wall


def run_device(job: Any, csv_path: Path, db: Path) -> tuple[float, int]:
    storage = CollectiveStorage(db)
    runner = DeviceRunner(job, storage)
    try:
        started = time.perf_counter()
        runner.run(TaobaoBehaviorSource(csv_path))
        seconds = time.perf_counter() - started
    finally:
        runner.close()
        storage.close()
    if runner.summary.rejected_total:
        raise RuntimeError(f"the device runner rejected {runner.summary.rejected_total} records")
    return seconds, runner.summary.events_in


def table(db: Path) -> tuple[list[tuple[str, str]], list[tuple[Any, ...]]]:
    """(column names and types, rows sorted) of the ``ipv`` table."""
    with duckdb.connect(str(db), read_only=True) as con:
        columns = [(r[0], r[1]) for r in con.execute(f'DESCRIBE "{TABLE}"').fetchall()]
        names = ", ".join(f'"{name}"' for name, _ in columns)
        return columns, sorted(con.execute(f'SELECT {names} FROM "{TABLE}"').fetchall())


def check_same(label: str, a: Path, b: Path, a_name: str, b_name: str) -> int:
    """Abort loudly unless the two ``ipv`` tables hold the same rows (and column types); the row count."""
    (cols_a, rows_a), (cols_b, rows_b) = table(a), table(b)
    if cols_a != cols_b or rows_a != rows_b:
        only_a = sorted(set(rows_a) - set(rows_b))[:5]
        only_b = sorted(set(rows_b) - set(rows_a))[:5]
        print(f"MISMATCH ({label}): {a_name} and {b_name} stored different IPV rows\n"
              f"  columns {a_name}: {cols_a}\n  columns {b_name}: {cols_b}\n"
              f"  rows {a_name}: {len(rows_a):,}, {b_name}: {len(rows_b):,}\n"
              f"  only in {a_name} (first 5): {only_a}\n  only in {b_name} (first 5): {only_b}", file=sys.stderr)
        raise SystemExit(1)
    return len(rows_a)


def tree_cpu_s(extra: list[int] = ()) -> float:  # type: ignore[assignment]
    """CPU seconds (user + system) of this process and its live descendants (the gateway JVM, where the
    MiniCluster and, in thread mode, the Python operators run), and of the ``extra`` pids (a standalone
    cluster's JVMs), from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        parent[pid], cpu[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
    ours = {os.getpid(), *extra}
    for pid in sorted(parent):  # a child's pid may be lower than its parent's: walk up from each
        chain, at = [], pid
        while at in parent and at not in ours and at > 1:
            chain.append(at)
            at = parent[at]
        if at in ours:
            ours.update(chain)
    return sum(cpu.get(pid, 0.0) for pid in ours)


#: Copies of the sample (114 users each) in state at each level of the state job, by --quick; filler lines per level.
STATE_COPIES = {False: (2, 6, 12), True: (1, 2)}
STATE_FILLER = {False: 15_000, True: 6_000}
CHECKPOINT_INTERVAL_MS = 50
PLATEAU_BYTES = 64


def users_input(lines: list[str], levels: tuple[int, ...], path: Path, filler: int) -> list[tuple[int, int]]:
    """Copies of the sample, copy ``r`` with user ids offset by ``r`` times (the largest + 1), up to ``levels[0]``
    copies, then ``filler`` lines of one more user alternating two items at the sample's last timestamp, then the
    copies up to ``levels[1]``, a filler, and so on: (distinct users of the copies, last line number of the
    level's copies) per level."""
    fields = [line.split(",") for line in lines]
    step = max(int(f[0]) for f in fields) + 1
    last_ts = max(int(f[4]) for f in fields)
    filler_user = levels[-1] * step
    users: set[int] = set()
    marks, line, done = [], 0, 0
    with open(path, "w", encoding="utf-8") as out:
        for copies in levels:
            for r in range(done, copies):
                for f in fields:
                    user = int(f[0]) + r * step
                    users.add(user)
                    out.write(f"{user},{','.join(f[1:])}\n")
                line += len(fields)
            done = copies
            marks.append((len(users), line))
            for i in range(filler):
                out.write(f"{filler_user},{1 + i % 2},1,pv,{last_ts}\n")
            line += filler
    return marks


def _completed_sizes(directory: Path, seen: dict[int, int], stop: threading.Event) -> None:
    """Until ``stop``: the size in bytes of every completed checkpoint under ``directory`` (by number), read
    while it exists (Flink keeps only the latest)."""
    while not stop.is_set():
        for chk in directory.glob("*/chk-*"):
            number = int(chk.name.split("-")[1])
            if number in seen or not (chk / "_metadata").is_file():
                continue
            try:
                seen[number] = sum(f.stat().st_size for f in chk.rglob("*") if f.is_file())
            except OSError:  # replaced by the next one while we read it
                continue
        stop.wait(0.02)


def plateaus(sizes: list[int], count: int) -> list[tuple[int, int]]:
    """(size, length) of the ``count`` longest stretches of consecutive sizes within :data:`PLATEAU_BYTES` of the
    stretch's first (the fillers: a filler's one user changes a few bytes of the state, a new user ~300), in the
    order they came; sizes must grow from one to the next."""
    runs: list[tuple[int, int, int]] = []  # (start, size, length)
    for i, size in enumerate(sizes):
        if runs and abs(runs[-1][1] - size) <= PLATEAU_BYTES:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, size, 1))
    longest = sorted(sorted(runs, key=lambda run: -run[2])[:count])
    if len(longest) < count or any(run[2] < 2 for run in longest) or \
            any(b[1] <= a[1] for a, b in zip(longest, longest[1:], strict=False)):
        raise RuntimeError(f"no {count} growing stretches of like checkpoints in {sizes}: fillers too short?")
    return [(size, length) for _, size, length in longest]


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of bytes against users."""
    n = len(points)
    mx = sum(u for u, _ in points) / n
    my = sum(b for _, b in points) / n
    return sum((u - mx) * (b - my) for u, b in points) / sum((u - mx) ** 2 for u, _ in points)


def flink_state_bytes(job: Any, csv_path: Path, tmp: Path, levels: int) -> tuple[list[tuple[int, int]], list[int]]:
    """(size, checkpoints) of the IPV job's checkpoints at each level (every user of its copies in state, during
    its filler), and every completed checkpoint's size seen."""
    from streamflow.flink.runner import run_flink

    directory = tmp / "checkpoints"
    seen: dict[int, int] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_completed_sizes, args=(directory, seen, stop), daemon=True)
    watcher.start()
    try:
        run_flink(job, csv_path, db=tmp / "state.duckdb", checkpoint_dir=directory,
                  checkpoint_interval_ms=CHECKPOINT_INTERVAL_MS)
    finally:
        stop.set()
        watcher.join()
        shutil.rmtree(directory, ignore_errors=True)
    sizes = [seen[n] for n in sorted(seen)]
    return plateaus(sizes, levels), sizes


def device_state_bytes(job: Any, csv_path: Path, tmp: Path, after_lines: list[int]) -> list[int]:
    """Bytes of the device runner's checkpoint state (its ``state`` blob: keyed runtimes, guard, the source's
    position with its per-user open pages) at its first checkpoint after each of ``after_lines`` (in a filler:
    every user of the copies before it in state); checkpoints are asked for after every block, only those taken."""
    db = tmp / "device_state.duckdb"
    storage = CollectiveStorage(db)
    runner = DeviceRunner(job, storage, checkpoint_interval_s=1e-9)
    checkpoint, taken = runner.checkpoint, []

    def at_marks(position: Any, complete: bool = False) -> None:
        if not complete and len(taken) < len(after_lines) and position.line > after_lines[len(taken)]:
            checkpoint(position)
            taken.append(storage.query("SELECT octet_length(state) FROM streamflow_checkpoints")[0][0])

    runner.checkpoint = at_marks  # type: ignore[method-assign]
    try:
        runner.run(TaobaoBehaviorSource(csv_path))
    finally:
        runner.close()
        storage.close()
        db.unlink(missing_ok=True)
    if len(taken) < len(after_lines):
        raise RuntimeError(f"the device runner took {len(taken)} checkpoints, not {len(after_lines)}")
    return taken


def state_per_user(job: Any, lines: list[str], tmp: Path, quick: bool) -> dict[str, Any]:
    """``state_bytes_per_user`` and its points (see the module docstring); a JVM must be up."""
    csv_path = tmp / "users.csv"
    marks = users_input(lines, STATE_COPIES[quick], csv_path, STATE_FILLER[quick])
    started = time.perf_counter()
    levels, sizes = flink_state_bytes(job, csv_path, tmp, len(marks))
    log(f"  state job {time.perf_counter() - started:.1f} s, checkpoint sizes {sizes}")
    points = [(users, size, length) for (users, _), (size, length) in zip(marks, levels, strict=True)]
    device = device_state_bytes(job, csv_path, tmp, [line + 1 for _, line in marks])
    device_points = [(users, size) for (users, _), size in zip(marks, device, strict=True)]
    csv_path.unlink()
    return {
        "state_bytes_per_user": round(slope([(u, b) for u, b, _ in points]), 1),
        "state_points": [list(p) for p in points],
        "state_backend": "hashmap (heap), full checkpoints",
        "device_state_bytes_per_user": round(slope(device_points), 1),
        "device_state_points": [list(p) for p in device_points],
    }


def scaling(args: Any) -> None:
    """``--scaling``: the IPV job by ``run_flink`` at parallelism 1 and 2 on the local MiniCluster (file split
    across two readers at 2), rows compared; events/s over ``execute()``, CPU seconds of the process tree per event.
    Written as ``flink_scaling`` (not the issue's standalone-cluster figures: those need two TaskManagers)."""
    load_start = os.getloadavg()
    job = load_job(JOB_FILE)
    lines = [line.rstrip("\r\n") for line in TAOBAO_SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    replays = args.replays or REPLAYS[args.quick]
    tmp = Path(tempfile.mkdtemp(prefix="streamflow-bench-flink-scaling-"))
    metrics: dict[str, Any] = {}
    cluster, pids = None, []
    try:
        csv_path = tmp / "replay.csv"
        replay_csv(lines, replays, sample_period(lines), csv_path)
        from streamflow.flink import cluster as flink_cluster
        from streamflow.flink.runner import flink_environment
        if args.standalone:  # two TaskManagers of one slot each, JVMs of their own
            port = flink_cluster._free_port()
            overview = flink_cluster.start(port=port, directory=tmp / "cluster", slots=1, taskmanagers=2,
                                           timeout=240)
            cluster, pids = f"127.0.0.1:{port}", [pid for _, pid in flink_cluster.process_ids(tmp / "cluster")]
            log(f"standalone cluster: {overview.get('taskmanagers')} TaskManagers, {overview.get('slots-total')} "
                f"slots, pids {pids}")
        flink_environment(parallelism=1)
        _time_execute()
        run_streamflow(job, _one_line(lines, tmp), tmp / "warm.duckdb", cluster=cluster)  # first imports, untimed
        for p in (1, 2):
            seconds, cpus = [], []
            for r in range(args.rounds):
                db = tmp / f"p{p}_{r}.duckdb"
                cpu0 = tree_cpu_s(pids)
                s_exec, _, events = run_streamflow(job, csv_path, db, parallelism=p, cluster=cluster)
                cpus.append(tree_cpu_s(pids) - cpu0)
                seconds.append(s_exec)
                log(f"  parallelism {p} round {r}: {events / s_exec:,.0f} ev/s ({s_exec:.2f} s execute, "
                    f"{cpus[-1]:.1f} CPU s)")
                if p == 2 and r == 0:
                    check_same("p2 vs p1", db, tmp / "p1_0.duckdb", "parallelism 2", "parallelism 1")
            metrics[f"events_per_s_p{p}"] = round(events / median(seconds))
            metrics[f"cpu_us_per_event_p{p}"] = round(median(cpus) / events * 1e6, 1)
            metrics[f"execute_s_p{p}"] = round(median(seconds), 2)
    finally:
        if cluster is not None:
            flink_cluster.stop(tmp / "cluster")
        shutil.rmtree(tmp, ignore_errors=True)
    load_end = os.getloadavg()
    metrics.update({
        "scaling_p2_vs_p1": round(metrics["events_per_s_p2"] / metrics["events_per_s_p1"], 3),
        "rows_match": True, "events": events, "csv_rows": len(lines) * replays, "rounds": args.rounds,
        "where": ("standalone cluster: two TaskManagers of one slot each" if args.standalone
                  else "local MiniCluster (one JVM, slots shared)"),
        "load_avg_1m_start": round(load_start[0], 2), "load_avg_1m_end": round(load_end[0], 2),
        "cpu_count": cpu_count(), "quick": args.quick,
    })
    finish("flink_scaling_standalone" if args.standalone else "flink_scaling", metrics, quick=args.quick)


def _scaling_options(parser: Any) -> None:
    parser.add_argument("--scaling", action="store_true", help="only parallelism 1 vs 2 (flink_scaling results)")
    parser.add_argument("--standalone", action="store_true", help="with --scaling: on a standalone cluster of two "
                        "TaskManagers, one slot each, started and stopped here (flink_scaling_standalone)")
    parser.add_argument("--replays", type=int, default=None, help="with --scaling: times the sample is replayed "
                        "(default 5, quick 1; 20 gives ~200k lines)")


def _one_line(lines: list[str], tmp: Path) -> Path:
    path = tmp / "one_line.csv"
    path.write_text(lines[0] + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args("The IPV job on the Flink MiniCluster: streamflow vs hand-written PyFlink vs device.", argv,
                      extra=_scaling_options)
    quick = args.quick
    if not any(a == "--rounds" or a.startswith("--rounds=") for a in raw):
        args.rounds = ROUNDS[quick]
    if args.scaling:
        scaling(args)
        return
    load_start = os.getloadavg()
    started_all = time.perf_counter()
    job = load_job(JOB_FILE)
    lines = [line.rstrip("\r\n") for line in TAOBAO_SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    replays = REPLAYS[quick]
    tmp = Path(tempfile.mkdtemp(prefix="streamflow-bench-flink-"))
    try:
        csv_path = tmp / "replay.csv"
        replay_csv(lines, replays, sample_period(lines), csv_path)
        one_line = tmp / "one_line.csv"
        one_line.write_text(lines[0] + "\n", encoding="utf-8")
        log(f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} on {cpu_count()} cores; "
            f"{len(lines):,} sample rows replayed {replays}x -> {len(lines) * replays:,} CSV rows")

        # JVM start-up: the first flink_environment() launches the gateway JVM.
        from streamflow.flink.runner import flink_environment
        jvm_startup_s, _ = _timed(lambda: flink_environment(parallelism=1))
        _time_execute()
        log(f"JVM up in {jvm_startup_s:.2f} s")

        # Warm-up (untimed in the rates): one-line jobs. The first Flink job of the JVM loads the MiniCluster's
        # classes and the embedded interpreter's modules: reported as first_job_s, paid by the hand-written job.
        first_job_s, _ = timed_handwritten(one_line, tmp / "first.duckdb")
        sf_first_s, _, _ = run_streamflow(job, one_line, tmp / "sf_first.duckdb")  # streamflow's first imports
        sf_one_s, _, _ = run_streamflow(job, one_line, tmp / "sf_one.duckdb")
        check_same("one-line warm-up", tmp / "sf_one.duckdb", tmp / "first.duckdb", "streamflow", "handwritten")
        hw_one_s, _ = timed_handwritten(one_line, tmp / "hw_one.duckdb")
        log(f"first Flink job (one line, hand-written) {first_job_s:.2f} s; then one-line jobs: streamflow "
            f"{sf_first_s:.2f} s then {sf_one_s:.2f} s, hand-written {hw_one_s:.2f} s")

        sf_s, sf_wall, hw_s, hw_wall, dev_s = [], [], [], [], []
        events = rows = 0
        for r in progress(range(args.rounds), "rounds (streamflow, handwritten, device)", total=args.rounds):
            sf_db, hw_db, dev_db = tmp / f"sf_{r}.duckdb", tmp / f"hw_{r}.duckdb", tmp / f"dev_{r}.duckdb"
            order = ("sf", "hw") if r % 2 == 0 else ("hw", "sf")  # alternate: same drift for both
            for which in order:
                if which == "sf":
                    seconds, wall, events = run_streamflow(job, csv_path, sf_db)
                    sf_s.append(seconds)
                    sf_wall.append(wall)
                else:
                    seconds, wall = timed_handwritten(csv_path, hw_db)
                    hw_s.append(seconds)
                    hw_wall.append(wall)
            seconds, dev_events = run_device(job, csv_path, dev_db)
            dev_s.append(seconds)
            if dev_events != events:
                print(f"MISMATCH: device runner took {dev_events:,} events, run_flink {events:,}", file=sys.stderr)
                raise SystemExit(1)
            rows = check_same(f"round {r}", sf_db, hw_db, "streamflow", "handwritten")
            check_same(f"round {r}", sf_db, dev_db, "streamflow", "device")
            for db in (sf_db, hw_db, dev_db):
                db.unlink()
            log(f"  round {r}: streamflow {events / sf_s[-1]:,.0f} ev/s ({sf_s[-1]:.2f} s execute, "
                f"{sf_wall[-1]:.2f} s run_flink), handwritten {events / hw_s[-1]:,.0f} ev/s ({hw_s[-1]:.2f} s), "
                f"device {events / dev_s[-1]:,.0f} ev/s ({dev_s[-1]:.2f} s); {rows:,} IPV rows identical")
        state = state_per_user(job, lines, tmp, quick)
        log(f"state per user: {state['state_bytes_per_user']:,} B on Flink (heap), "
            f"{state['device_state_bytes_per_user']:,} B on the device")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    sf, hw, dev = median(sf_s), median(hw_s), median(dev_s)
    load_end = os.getloadavg()
    metrics = {
        "streamflow_events_per_s": round(events / sf),
        "handwritten_events_per_s": round(events / hw),
        "device_events_per_s": round(events / dev),
        "ratio_vs_handwritten": round(hw / sf, 3),
        "ratio_vs_handwritten_excl_one_line_job": round((hw - hw_one_s) / (sf - sf_one_s), 3),
        "target_ratio_1_met": hw / sf >= 1.0,
        "jvm_startup_s": round(jvm_startup_s, 2),
        "first_flink_job_s": round(first_job_s, 2),
        "streamflow_first_one_line_job_s": round(sf_first_s, 2),
        "streamflow_one_line_job_s": round(sf_one_s, 2),
        "handwritten_one_line_job_s": round(hw_one_s, 2),
        "streamflow_execute_s": round(sf, 2),
        "streamflow_run_flink_wall_s": round(median(sf_wall), 2),
        "handwritten_execute_s": round(hw, 2),
        "device_s": round(dev, 2),
        "events": events,
        "csv_rows": len(lines) * replays,
        "ipv_rows": rows,
        "rows_match": True,
        **state,
        "replays": replays,
        "rounds": args.rounds,
        "total_s": round(time.perf_counter() - started_all, 1),
        "load_avg_1m_start": round(load_start[0], 2),
        "load_avg_1m_end": round(load_end[0], 2),
        "cpu_count": cpu_count(),
        "quick": quick,
    }
    finish("flink", metrics, quick=args.quick)


def _timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


if __name__ == "__main__":
    main()
