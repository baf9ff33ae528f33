"""Three jobs on streamflow's device runner vs the same jobs hand-written for Bytewax 0.21.1.

``python -m bench.peers [--quick] [--jobs ipv,windows,sessions]``

``--jobs`` runs only the jobs named (default: all three, written to ``bench/results/peers.json``); a run of some
of them writes its keys, the same keys, to ``peers_<jobs>.json`` instead (``peers_ipv.json``), so the full
results stay as they were. Without ``ipv`` the start-up runs, the sample and the bare loop are skipped too.

The jobs, each against its own Bytewax dataflow (the ``dev`` extra), over the same CSV:

- ``ipv``: ``jobs/ipv.py`` vs :mod:`bench.bytewax_ipv` (FileSource, a parse, per-user ``StatefulLogic``, a
  DuckDB sink);
- ``windows``: ``jobs/activity_windows.py`` (sliding event-time windows 60 s / 20 s by user, 5 s out of
  orderness, 10 s allowed lateness) vs :mod:`bench.bytewax_windows`;
- ``sessions``: the ``sessions`` task of ``jobs/sessions.py`` alone (:mod:`bench.sessions_job`; session windows,
  30 s gap) vs :mod:`bench.bytewax_sessions`.

The window dataflows map the Taobao lines to app events themselves (:mod:`bench.bytewax_app_events`: the item
pages of streamflow's Taobao source) and follow our window rules (Flink's: the stream's watermark, allowed
lateness with late firings, late events as rows); their module docstrings say why not Bytewax's own windowing.

Both sides run as whole processes, in turn (the order alternates between pairs; ``--rounds`` pairs, default 5,
``--quick`` 2):

- streamflow: ``python -m streamflow.cli run JOB --events CSV --db DB --show 0 --mode streaming`` (the
  ``streamflow run`` command: job loading, the Taobao source, the device runner, collective storage); for
  ``ipv`` also the default mode (``--mode automatic``: batch for this job and input, ``runtime_mode`` says
  which ran) as a third process per pair, the top-level keys;
- Bytewax: ``python -m bytewax.run "bench.bytewax_J:build_flow(CSV, DB)"``.

Inputs: the shared Taobao sample (10k lines, ``ipv`` only; not in ``--quick``) and a larger version of it
(~200k lines; quick: ~20k) made of copies of the sample, copy ``r`` with every user id offset by ``r`` times
(the largest user id + 1) and every timestamp by ``r`` times (the sample's time span + an hour), written to a
temp dir. The sample is grouped by user (each user's lines in time order), so for the window jobs the
stream's watermark runs ahead of most users' events: most of them are late events (rows of ``late_events``).
A live stream arrives in time order, where nearly every event lands in open windows and each fires: the window
jobs also run over the large input sorted by timestamp (stable; lines without one at the end), keys
``J_time_ordered_*`` (``J`` in ``windows|sessions``; the same comparison, its own rows compared).

The large input has 0.1% bad lines mixed in (:data:`BAD_LINES`: a wrong field count, an empty field, an unknown
behaviour, a timestamp that is no integer or absurd; both sides refuse them). Issue 24's keys, per job ``J`` in
``ipv|windows|sessions``, describe the default mode (``--mode automatic``) over it: ``J_speedup_vs_bytewax`` (and
``_cpu``), ``J_runtime_mode`` (``batch`` when it ran batch), ``J_peak_mb``, ``J_default_rows_equal`` (the job's
table and the late events against Bytewax's).

Keys, per job ``J`` in ``ipv|windows|sessions`` (large input): ``J_streaming_speedup_vs_bytewax`` (Bytewax's
median wall time over ours with ``--mode streaming``; ``J_streaming_speedup_vs_bytewax_cpu`` the same in CPU
time, steadier on a shared machine), ``J_streaming_wall_s``, ``J_bytewax_wall_s``, ``J_streaming_peak_mb``,
``J_bytewax_peak_mb``, ``J_rows`` and ``J_rows_equal`` (the job's table, ours in streaming mode vs Bytewax's, in
every pair); the window jobs also ``J_late_events`` and ``J_late_events_equal`` (the ``late_events`` rows).

The ``ipv`` job's other keys (unprefixed, as before): ``events_per_s`` is input CSV lines over the process's
wall time (start-up included), median over the pairs; ``events_per_cpu_s`` the same over its CPU time (user
+ system, all threads); ``*_after_startup`` subtracts the median wall time of the same command over a
one-line CSV (``startup_s``). Peak RSS is each process's own ``ru_maxrss`` (``os.wait4`` in a small
launcher). After every run the ``ipv`` tables of all three are compared row for row (sorted): ``rows_equal``.
The top-level keys describe the large input; the ``*_10k`` keys the sample (``None`` in ``--quick``).
``bare_loop_events_per_s``: the Bytewax IPV dataflow's own logic as a bare Python loop over the large input
(CPU time, nothing stored); ``needed_events_per_s_after_startup_for_1_5``: the rate after start-up ours
would need for 1.5x Bytewax's whole process. Side by side they show how much room a per-event engine has.

Both run from bytecode, as installed packages do: the bench compiles the repository's packages first
(Bytewax, DuckDB and the rest of site-packages were compiled when pip installed them); a checkout run
with ``PYTHONDONTWRITEBYTECODE=1`` would otherwise compile streamflow's sources at every start.
"""

from __future__ import annotations

import argparse
import compileall
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from bench.common import REPO, TAOBAO_SAMPLE, cpu_count, finish, log, median, parse_args, progress

JOB_FILE = REPO / "jobs" / "ipv.py"
TABLE = "ipv"
COLUMNS = ("user_id", "trigger_ts", "item_id", "category_id", "enter_ts", "dwell_s",
           "n_reload", "n_fav", "n_cart", "n_buy")
LARGE_LINES = {False: 200_000, True: 20_000}
STARTUP_RUNS = {False: 5, True: 1}
QUICK_PAIRS = 2  # --quick runs 7 processes per pair: 3 pairs took ~50 s on the shared 2-core machine
LATE_TABLE = "late_events"


@dataclass(frozen=True)
class WindowJob:
    """A window job: our job file, its Bytewax dataflow's module (``build_flow(csv, db)``), the table compared."""

    name: str
    job_file: Path
    bytewax: str
    table: str
    columns: tuple[str, ...]


WINDOW_JOBS = (
    WindowJob("windows", REPO / "jobs" / "activity_windows.py", "bench.bytewax_windows", "activity",
              ("user_id", "window_start", "window_end", "events", "items", "score", "buys", "last_ts",
               "score_per_event")),
    WindowJob("sessions", REPO / "bench" / "sessions_job.py", "bench.bytewax_sessions", "sessions",
              ("user_id", "window_start", "window_end", "events", "buys", "first_ts", "last_ts")),
)
LATE_COLUMNS = ("task", "ts", "item")


# -- inputs ----------------------------------------------------------------------------------------
def shifted_copies(lines: list[str], copies: int, path: Path) -> int:
    """Write ``copies`` copies of the CSV ``lines``, copy ``r`` with users and times shifted; lines written."""
    fields = [line.split(",") for line in lines]
    users = [int(f[0]) for f in fields if f[0].strip().isdigit()]
    stamps = [int(f[4]) for f in fields if len(f) == 5 and f[4].strip().lstrip("-").isdigit()]
    user_step = max(users, default=0) + 1
    period = max(stamps) - min(stamps) + 3_600
    written = 0
    with open(path, "w", encoding="utf-8") as out:
        for r in range(copies):
            for line, f in zip(lines, fields, strict=True):
                if len(f) != 5:
                    out.write(line + "\n")  # a malformed line stays malformed
                else:
                    user = str(int(f[0]) + r * user_step) if f[0].strip().isdigit() else f"{f[0]}~{r}"
                    try:
                        ts = str(int(f[4]) + r * period)
                    except ValueError:
                        ts = f[4]
                    out.write(f"{user},{f[1]},{f[2]},{f[3]},{ts}\n")
                written += 1
    return written


#: Bad lines mixed into the large input, of the kinds both sides refuse (wrong field count, an empty field, an unknown
#: behaviour, a timestamp that is no integer or is absurd): ``{ts}`` is a plausible time, so only the named field fails.
BAD_LINES = ("{u},{i},{c},pv", "{u},{i},{c},pv,{ts},x", "{u},,{c},pv,{ts}", "{u},{i},{c},nap,{ts}",
             "{u},{i},{c},pv,17x", "{u},{i},{c},fav,99999999999")
BAD_FRACTION = 0.001


def with_bad_lines(path: Path, fraction: float = BAD_FRACTION, seed: int = 24) -> int:
    """Mix ``fraction`` of bad lines (:data:`BAD_LINES`, in turn) into the CSV at ``path`` at seeded random places,
    each next to a good line whose fields it borrows; how many were added."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rng = random.Random(seed)
    places = sorted(rng.sample(range(len(lines)), max(1, round(len(lines) * fraction))), reverse=True)
    for n, at in enumerate(places):
        u, i, c, _, ts = lines[at].split(",")
        lines.insert(at, BAD_LINES[n % len(BAD_LINES)].format(u=u, i=i, c=c, ts=ts))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(places)


def time_ordered(source: Path, path: Path) -> None:
    """``source``'s lines sorted by their timestamp field (stable: a user's lines of one second keep their order),
    lines without an integer timestamp last, written to ``path``."""
    lines = source.read_text(encoding="utf-8").splitlines()

    def stamp(line: str) -> tuple[int, int]:
        fields = line.split(",")
        try:
            return (0, int(fields[4])) if len(fields) == 5 else (1, 0)
        except ValueError:
            return (1, 0)

    path.write_text("\n".join(sorted(lines, key=stamp)) + "\n", encoding="utf-8")


# -- one whole process --------------------------------------------------------------------------------
def compile_sources() -> None:
    """Bytecode for the repository's packages both processes import (see the module docstring)."""
    for package in ("streamflow", "connectors", "operators", "jobs", "bench"):
        compileall.compile_dir(REPO / package, quiet=1)


def streamflow_command(csv: Path, db: Path, mode: str = "automatic", job_file: Path = JOB_FILE) -> list[str]:
    return [sys.executable, "-m", "streamflow.cli", "run", str(job_file), "--events", str(csv), "--db", str(db),
            "--show", "0", "--mode", mode]


def bytewax_command(csv: Path, db: Path, module: str = "bench.bytewax_ipv") -> list[str]:
    return [sys.executable, "-m", "bytewax.run", f"{module}:build_flow({str(csv)!r}, {str(db)!r})"]


# Runs the command as its own child and reports that child's wall time, CPU time and peak RSS. A child
# forked straight from the bench would count the bench's own memory (its pages before exec) in ru_maxrss.
_LAUNCHER = """
import os, sys, time
started = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as out:
    out.write(f"{time.perf_counter() - started} {usage.ru_utime + usage.ru_stime} {usage.ru_maxrss}")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_process(command: list[str], log_path: Path) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS in MiB) of ``command`` run to completion; exits the bench if it
    fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    usage_path = log_path.with_suffix(".usage")
    with open(log_path, "wb") as out:
        proc = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, str(usage_path), *command], cwd=REPO, env=env,
                              stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        print(f"{' '.join(command)} failed ({proc.returncode}):\n{log_path.read_text(errors='replace')[-3000:]}",
              file=sys.stderr)
        raise SystemExit(1)
    wall, cpu, max_rss_kib = (float(x) for x in usage_path.read_text().split())
    return wall, cpu, max_rss_kib / 1024  # ru_maxrss is in KiB on Linux


def ipv_rows(db: Path) -> list[tuple[Any, ...]]:
    names = ", ".join(f'"{c}"' for c in COLUMNS)
    with duckdb.connect(str(db), read_only=True) as con:
        return sorted(con.execute(f'SELECT {names} FROM "{TABLE}"').fetchall(), key=repr)


def compare(csv: Path, lines: int, pairs: int, tmp: Path, label: str) -> dict[str, Any]:
    """``pairs`` side-by-side runs of both over ``csv``: medians of rate and peak RSS, rows equal in all."""
    ours, theirs, ours_cpu, theirs_cpu, ours_mb, theirs_mb = [], [], [], [], [], []
    streaming_s, streaming_cpu, streaming_mb, modes = [], [], [], set()
    rows_equal, streaming_rows_equal, n_rows = True, True, 0
    for p in progress(range(pairs), f"{label}: pairs", total=pairs):
        sf_db, bw_db, st_db = (tmp / f"{name}_{label}_{p}.duckdb" for name in ("sf", "bw", "st"))
        runs = [("streamflow", streamflow_command(csv, sf_db)), ("bytewax", bytewax_command(csv, bw_db)),
                ("streaming", streamflow_command(csv, st_db, "streaming"))]
        measured = {}
        for name, command in runs if p % 2 == 0 else runs[::-1]:
            measured[name] = run_process(command, tmp / f"{name}.log")
            if name == "streamflow":
                modes.add("batch" if "runtime mode     batch" in (tmp / f"{name}.log").read_text() else "streaming")
        (sf_s, sf_cpu, sf_mb), (bw_s, bw_cpu, bw_mb) = measured["streamflow"], measured["bytewax"]
        streaming_s.append(measured["streaming"][0])
        streaming_cpu.append(measured["streaming"][1])
        streaming_mb.append(measured["streaming"][2])
        ours.append(sf_s)
        theirs.append(bw_s)
        ours_cpu.append(sf_cpu)
        theirs_cpu.append(bw_cpu)
        ours_mb.append(sf_mb)
        theirs_mb.append(bw_mb)
        sf_rows, bw_rows, st_rows = ipv_rows(sf_db), ipv_rows(bw_db), ipv_rows(st_db)
        rows_equal = rows_equal and sf_rows == bw_rows == st_rows and bool(sf_rows)
        streaming_rows_equal = streaming_rows_equal and st_rows == bw_rows and bool(st_rows)
        n_rows = len(sf_rows)
        for db in (sf_db, bw_db, st_db):
            db.unlink()
        log(f"  {label}: streamflow {sf_s:.2f} s (CPU {sf_cpu:.2f} s) {sf_mb:.0f} MiB, "
            f"bytewax {bw_s:.2f} s (CPU {bw_cpu:.2f} s) {bw_mb:.0f} MiB, "
            f"{len(sf_rows):,} vs {len(bw_rows):,} rows, equal: {sf_rows == bw_rows}; "
            f"streamflow --mode streaming {measured['streaming'][0]:.2f} s {measured['streaming'][2]:.0f} MiB")
    sf_s, bw_s = median(ours), median(theirs)
    return {"lines": lines, "wall_s": sf_s, "bytewax_wall_s": bw_s, "events_per_s": lines / sf_s,
            "bytewax_events_per_s": lines / bw_s, "events_per_cpu_s": lines / median(ours_cpu),
            "bytewax_events_per_cpu_s": lines / median(theirs_cpu),
            "peak_mb": median(ours_mb), "bytewax_peak_mb": median(theirs_mb),
            "rows": n_rows, "rows_equal": rows_equal, "runtime_mode": "/".join(sorted(modes)),
            "streaming_events_per_s": lines / median(streaming_s), "streaming_peak_mb": median(streaming_mb),
            "streaming_wall_s": median(streaming_s), "streaming_cpu_s": median(streaming_cpu),
            "bytewax_cpu_s": median(theirs_cpu), "streaming_rows_equal": streaming_rows_equal,
            "cpu_s": median(ours_cpu)}


def table_rows(con: duckdb.DuckDBPyConnection, database: str, table: str) -> int | None:
    """Rows of ``database.table`` in ``con``, ``None`` if there is no such table (streamflow creates a table
    with its first row: a run without late events has no ``late_events``)."""
    exists = con.execute("SELECT count(*) FROM duckdb_tables() WHERE database_name = ? AND table_name = ?",
                         [database, table]).fetchone()[0]
    return con.execute(f'SELECT count(*) FROM {database}."{table}"').fetchone()[0] if exists else None


def same_rows(ours: Path, theirs: Path, table: str, columns: tuple[str, ...]) -> tuple[bool, int, int]:
    """(the two files' ``table`` hold the same rows, as a multiset; our rows; theirs). A missing table holds none."""
    with duckdb.connect() as con:
        for name, path in (("ours", ours), ("theirs", theirs)):
            con.execute(f"ATTACH '{str(path).replace(chr(39), chr(39) * 2)}' AS {name} (READ_ONLY)")
        n_ours, n_theirs = table_rows(con, "ours", table), table_rows(con, "theirs", table)
        if not n_ours or not n_theirs:
            return (n_ours or 0) == (n_theirs or 0), n_ours or 0, n_theirs or 0
        names = ", ".join(f'"{c}"' for c in columns)
        differ = con.execute(f'SELECT count(*) FROM (SELECT {names} FROM ours."{table}" '
                             f'EXCEPT ALL SELECT {names} FROM theirs."{table}")').fetchone()[0]
        return n_ours == n_theirs and differ == 0, n_ours, n_theirs


def compare_windows(job: WindowJob, csv: Path, lines: int, pairs: int, tmp: Path,
                    default_mode: bool = False) -> dict[str, Any]:
    """``pairs`` side-by-side runs of ``job`` over ``csv``, ours with ``--mode streaming`` (and, with
    ``default_mode``, also with the default mode): medians of wall time, CPU time and peak RSS; the job's table and
    ``late_events`` equal in all."""
    ours_s, theirs_s, ours_cpu, theirs_cpu, ours_mb, theirs_mb = [], [], [], [], [], []
    default_s, default_cpu, default_mb, modes, default_equal = [], [], [], set(), True
    rows_equal, late_equal, n_rows, n_late = True, True, 0, 0
    for p in progress(range(pairs), f"{job.name}: pairs", total=pairs):
        st_db, bw_db, df_db = (tmp / f"{side}_{job.name}_{p}.duckdb" for side in ("st", "bw", "df"))
        runs = [("streaming", streamflow_command(csv, st_db, "streaming", job.job_file)),
                ("bytewax", bytewax_command(csv, bw_db, job.bytewax))]
        if default_mode:
            runs.append(("default", streamflow_command(csv, df_db, "automatic", job.job_file)))
        measured = {name: run_process(command, tmp / f"{job.name}_{name}.log")
                    for name, command in (runs if p % 2 == 0 else runs[::-1])}
        if default_mode:
            df_s, df_cpu, df_mb = measured["default"]
            default_s.append(df_s)
            default_cpu.append(df_cpu)
            default_mb.append(df_mb)
            log_text = (tmp / f"{job.name}_default.log").read_text()
            modes.add("batch" if "runtime mode     batch" in log_text else "streaming")
            default_equal = (default_equal and same_rows(df_db, bw_db, job.table, job.columns)[0]
                             and same_rows(df_db, bw_db, LATE_TABLE, LATE_COLUMNS)[0])
            df_db.unlink()
        (st_s, st_cpu, st_mb), (bw_s, bw_cpu, bw_mb) = measured["streaming"], measured["bytewax"]
        ours_s.append(st_s)
        theirs_s.append(bw_s)
        ours_cpu.append(st_cpu)
        theirs_cpu.append(bw_cpu)
        ours_mb.append(st_mb)
        theirs_mb.append(bw_mb)
        equal, n_rows, bw_rows = same_rows(st_db, bw_db, job.table, job.columns)
        rows_equal = rows_equal and equal and n_rows > 0
        equal_late, n_late, bw_late = same_rows(st_db, bw_db, LATE_TABLE, LATE_COLUMNS)
        late_equal = late_equal and equal_late
        for db in (st_db, bw_db):
            db.unlink()
        log(f"  {job.name}: streamflow --mode streaming {st_s:.2f} s (CPU {st_cpu:.2f} s) {st_mb:.0f} MiB, "
            f"bytewax {bw_s:.2f} s (CPU {bw_cpu:.2f} s) {bw_mb:.0f} MiB; {job.table} {n_rows:,} vs {bw_rows:,} "
            f"rows, equal: {equal}; late events {n_late:,} vs {bw_late:,}, equal: {equal_late}")
    result = {"lines": lines, "streaming_wall_s": median(ours_s), "bytewax_wall_s": median(theirs_s),
              "streaming_cpu_s": median(ours_cpu), "bytewax_cpu_s": median(theirs_cpu),
              "streaming_peak_mb": median(ours_mb), "bytewax_peak_mb": median(theirs_mb),
              "rows": n_rows, "rows_equal": rows_equal, "late_events": n_late, "late_events_equal": late_equal}
    if default_mode:
        result.update({"wall_s": median(default_s), "cpu_s": median(default_cpu), "peak_mb": median(default_mb),
                       "runtime_mode": "/".join(sorted(modes)), "default_rows_equal": default_equal})
    return result


def job_metrics(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """The ``J_*`` keys of job ``name`` from its comparison over the large input."""
    metrics = {
        f"{name}_streaming_speedup_vs_bytewax": round(result["bytewax_wall_s"] / result["streaming_wall_s"], 3),
        f"{name}_rows_equal": result["streaming_rows_equal" if name == "ipv" else "rows_equal"],
        f"{name}_streaming_peak_mb": round(result["streaming_peak_mb"], 1),
        f"{name}_bytewax_peak_mb": round(result["bytewax_peak_mb"], 1),
        f"{name}_streaming_speedup_vs_bytewax_cpu": round(result["bytewax_cpu_s"] / result["streaming_cpu_s"], 3),
        f"{name}_streaming_wall_s": round(result["streaming_wall_s"], 3),
        f"{name}_bytewax_wall_s": round(result["bytewax_wall_s"], 3),
        f"{name}_rows": result["rows"],
    }
    if "late_events" in result:
        metrics[f"{name}_late_events"] = result["late_events"]
        metrics[f"{name}_late_events_equal"] = result["late_events_equal"]
    if "runtime_mode" in result:  # the default mode (issue 24's keys)
        metrics[f"{name}_speedup_vs_bytewax"] = round(result["bytewax_wall_s"] / result["wall_s"], 3)
        metrics[f"{name}_speedup_vs_bytewax_cpu"] = round(result["bytewax_cpu_s"] / result["cpu_s"], 3)
        metrics[f"{name}_runtime_mode"] = result["runtime_mode"]
        metrics[f"{name}_peak_mb"] = round(result["peak_mb"], 1)
        metrics[f"{name}_default_rows_equal"] = result.get("default_rows_equal", result.get("rows_equal"))
    return metrics


def startup(one_line: Path, pairs: int, tmp: Path) -> tuple[float, float]:
    """Median wall seconds of each whole process over a one-line CSV: (streamflow, bytewax)."""
    ours, theirs = [], []
    for p in range(pairs):
        ours.append(run_process(streamflow_command(one_line, tmp / f"sf_start_{p}.duckdb"), tmp / "sf.log")[0])
        theirs.append(run_process(bytewax_command(one_line, tmp / f"bw_start_{p}.duckdb"), tmp / "bw.log")[0])
    return median(ours), median(theirs)


def bare_loop_seconds(csv: Path, runs: int = 3) -> float:
    """Median CPU seconds of the Bytewax dataflow's own logic as one bare Python loop over ``csv``: its parse
    and its per-user :class:`~bench.bytewax_ipv.ItemPage`, rows kept in a list, no framework, nothing stored.

    Not a peer: the floor any per-event Python engine stands on (what is left to win by engineering).
    """
    from bench.bytewax_ipv import ItemPage, parse

    seconds = []
    for _ in range(runs):
        started = time.process_time()
        pages: dict[str, ItemPage] = {}
        rows: list[dict[str, Any]] = []
        with open(csv, encoding="utf-8") as lines:
            for line in lines:
                row = parse(line)
                if row is not None:
                    page = pages.get(row[0])
                    if page is None:
                        page = pages[row[0]] = ItemPage(None)
                    rows += page.on_item(row)[0]
        for page in pages.values():
            rows += page.on_eof()[0]
        seconds.append(time.process_time() - started)
    return median(seconds)


JOBS = ("ipv", *(job.name for job in WINDOW_JOBS))


def _jobs_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", default=",".join(JOBS),
                        help=f"comma-separated jobs to run, of {', '.join(JOBS)} (default: all)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args("Three jobs (ipv, windows, sessions): streamflow's device runner vs hand-written Bytewax "
                      "dataflows.", argv, _jobs_option)
    jobs = [name.strip() for name in args.jobs.split(",") if name.strip()]
    unknown = sorted(set(jobs) - set(JOBS))
    if unknown or not jobs:
        raise SystemExit(f"--jobs: unknown {', '.join(unknown) or 'nothing'}; choose from {', '.join(JOBS)}")
    window_jobs = [job for job in WINDOW_JOBS if job.name in jobs]
    with_ipv = "ipv" in jobs
    given = argv if argv is not None else sys.argv[1:]
    rounds_given = any(arg == "--rounds" or arg.startswith("--rounds=") for arg in given)
    pairs = QUICK_PAIRS if args.quick and not rounds_given else args.rounds
    lines = [line.rstrip("\r\n") for line in TAOBAO_SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="streamflow-bench-peers-"))
    compile_sources()
    try:
        large = tmp / "large.csv"
        copies = -(-LARGE_LINES[args.quick] // len(lines))
        large_lines = shifted_copies(lines, copies, large)
        bad = with_bad_lines(large)
        large_lines += bad
        one_line = tmp / "one.csv"
        one_line.write_text(lines[0] + "\n", encoding="utf-8")
        log(f"inputs: the sample ({len(lines):,} lines) and {copies} shifted copies ({large_lines:,} lines, {bad} of "
            "them bad)")
        if with_ipv:
            sf_start, bw_start = startup(one_line, STARTUP_RUNS[args.quick], tmp)
            log(f"start-up (one-line input): streamflow {sf_start:.2f} s, bytewax {bw_start:.2f} s")
            small = None if args.quick else compare(TAOBAO_SAMPLE, len(lines), pairs, tmp, "10k")
            big = compare(large, large_lines, pairs, tmp, "large")
        windowed = {job.name: compare_windows(job, large, large_lines, pairs, tmp, default_mode=True)
                    for job in window_jobs}
        time_windowed = {}
        if window_jobs:
            in_time = tmp / "large_time_ordered.csv"
            time_ordered(large, in_time)
            log("the window jobs over the same lines in time order")
            time_windowed = {job.name: compare_windows(job, in_time, large_lines, pairs, tmp) for job in window_jobs}
        if with_ipv:
            bare_s = bare_loop_seconds(large)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    per_job = {
        **{key: value for name, result in windowed.items() for key, value in job_metrics(name, result).items()},
        **{key: value for name, result in time_windowed.items()
           for key, value in job_metrics(f"{name}_time_ordered", result).items()},
        "pairs": pairs,
        "cpu_count": cpu_count(),
        "quick": args.quick,
    }
    name = "peers" if set(jobs) == set(JOBS) else "peers_" + "_".join(job for job in JOBS if job in jobs)
    if not with_ipv:
        finish(name, per_job, quick=args.quick)
        return

    def after_startup(result: dict[str, Any], ours: bool) -> float | None:
        seconds = result["wall_s"] - sf_start if ours else result["bytewax_wall_s"] - bw_start
        return round(result["lines"] / seconds) if seconds > 0 else None  # start-up noise exceeded the run

    metrics = {
        "events_per_s": round(big["events_per_s"]),
        "bytewax_events_per_s": round(big["bytewax_events_per_s"]),
        "speedup_vs_bytewax": round(big["events_per_s"] / big["bytewax_events_per_s"], 3),
        "peak_mb": round(big["peak_mb"], 1),
        "bytewax_peak_mb": round(big["bytewax_peak_mb"], 1),
        "rows_equal": big["rows_equal"] and (small is None or small["rows_equal"]),
        "runtime_mode": big["runtime_mode"],
        "streaming_speedup_vs_bytewax": round(big["streaming_events_per_s"] / big["bytewax_events_per_s"], 3),
        "streaming_peak_mb": round(big["streaming_peak_mb"], 1),
        "events_per_cpu_s": round(big["events_per_cpu_s"]),
        "bytewax_events_per_cpu_s": round(big["bytewax_events_per_cpu_s"]),
        "speedup_vs_bytewax_cpu": round(big["events_per_cpu_s"] / big["bytewax_events_per_cpu_s"], 3),
        "events_per_s_after_startup": after_startup(big, True),
        "bytewax_events_per_s_after_startup": after_startup(big, False),
        "wall_s": round(big["wall_s"], 3),
        "bytewax_wall_s": round(big["bytewax_wall_s"], 3),
        "startup_s": round(sf_start, 3),
        "bytewax_startup_s": round(bw_start, 3),
        "lines": big["lines"],
        "rows": big["rows"],
        # the sample (not in --quick)
        "events_per_s_10k": round(small["events_per_s"]) if small else None,
        "bytewax_events_per_s_10k": round(small["bytewax_events_per_s"]) if small else None,
        "speedup_vs_bytewax_10k": round(small["events_per_s"] / small["bytewax_events_per_s"], 3) if small else None,
        "peak_mb_10k": round(small["peak_mb"], 1) if small else None,
        "bytewax_peak_mb_10k": round(small["bytewax_peak_mb"], 1) if small else None,
        "rows_equal_10k": small["rows_equal"] if small else None,
        "rows_10k": small["rows"] if small else None,
        # what 1.5x Bytewax's whole process asks of ours after its start-up, next to the bare loop's rate
        "needed_events_per_s_after_startup_for_1_5": after_startup(
            {**big, "wall_s": big["bytewax_wall_s"] / 1.5}, True),
        "bare_loop_events_per_s": round(big["lines"] / bare_s),
        "target_speedup_1_5_met": big["events_per_s"] / big["bytewax_events_per_s"] >= 1.5,
        "target_peak_mb_met": big["peak_mb"] <= big["bytewax_peak_mb"],
        # per job, ours with --mode streaming (the ipv job's ipv_* keys too: its streaming process)
        **job_metrics("ipv", big),
        **per_job,
    }
    finish(name, metrics, quick=args.quick)


if __name__ == "__main__":
    main()
