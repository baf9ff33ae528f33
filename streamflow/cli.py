"""The ``streamflow`` command: run a job, describe a job, run a local Flink cluster.

    streamflow run JOB --events FILE [--runner device|flink] [--cluster HOST:PORT] [--db PATH]
    streamflow describe JOB
    streamflow flink-cluster start|stop|status
    streamflow tunnel keys|consume   (see streamflow.tunnel_commands)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from connectors.storage import CollectiveStorage, flush_on_signals
from streamflow import tunnel_commands
from streamflow.checkpoint import discard_checkpoint
from streamflow.flink_kafka import kafka_topic
from streamflow.job import Job, JobLoadError, load_job
from streamflow.progress import track
from streamflow.runners.device import DeviceRunner
from streamflow.sources import FORMATS, open_source
from streamflow.summary import SYSTEM_TABLES, RunSummary
from streamflow.trie import TriggerTrie

RUNNERS = ("device", "flink")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamflow", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run a job over an events file")
    run.add_argument("job", help="job file (a Python module defining `job = Job(...)`)")
    run.add_argument("--events", required=True, help="events file: Taobao CSV (.csv) or JSON lines (.jsonl); "
                                                     "flink runner: also kafka://TOPIC (one raw line per record, "
                                                     "--format required)")
    run.add_argument("--format", choices=sorted(FORMATS), help="events format (default: from the extension)")
    run.add_argument("--runner", choices=RUNNERS, default=os.environ.get("STREAMFLOW_RUNNER", "device"),
                     help="where to run (default: device, or $STREAMFLOW_RUNNER)")
    run.add_argument("--db", help="DuckDB file for feature rows (default: $STREAMFLOW_DB or ./streamflow.duckdb)")
    run.add_argument("--workers", type=int, default=2, help="worker threads for tasks fired together")
    run.add_argument("--quarantine-after", type=int, default=5,
                     help="consecutive failures after which a task is quarantined")
    run.add_argument("--cluster", metavar="HOST:PORT",
                     help="flink runner: submit to this JobManager (REST endpoint) instead of a local MiniCluster")
    run.add_argument("--parallelism", type=int, default=1, help="flink runner: job parallelism")
    run.add_argument("--pace-ms", type=float, default=0.0,
                     help="flink runner: replay one record per N ms, so that periodic watermarks decide "
                          "lateness per event as the device runner does")
    run.add_argument("--replace", action="store_true",
                     help="drop the job's tables (and dead_letter, task_errors) and its checkpoint before running")
    run.add_argument("--checkpoint-interval", type=float, metavar="SECONDS",
                     help="device runner: checkpoint state and source position into the DuckDB file every "
                          "SECONDS (and on exit); a run over the same file into the same file resumes from it; "
                          "flink runner: Flink's checkpoint interval (with --checkpoint-dir, default 10 s)")
    run.add_argument("--checkpoint-dir", help="flink runner: enable Flink checkpointing into this directory")
    run.add_argument("--show", type=int, default=3, help="sample rows to print per table")
    tunnel_commands.add_run_arguments(run)

    describe = commands.add_parser("describe", help="show a job's tasks and the trie of their triggers")
    describe.add_argument("job")

    cluster = commands.add_parser("flink-cluster", help="start/stop/status of a local Flink cluster (PyFlink's jars)")
    cluster.add_argument("action", choices=("start", "stop", "status"))
    cluster.add_argument("--port", type=int, default=None, help="REST port (default: 8081; status/stop: as started)")
    cluster.add_argument("--dir", default=None,
                         help="state dir (default: $STREAMFLOW_FLINK_HOME_DIR or ./.flink-cluster)")
    tunnel_commands.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    tunnel_commands.quiet_kafka_logs(args.verbose)
    if args.command == "flink-cluster":
        return _flink_cluster(args)
    try:
        if args.command == "tunnel":
            return tunnel_commands.run_command(args)
        job = load_job(args.job)
        if args.command == "describe":
            print(describe(job))
            return 0
        return _run(job, args)
    except (JobLoadError, FileNotFoundError, ValueError) as exc:
        print(f"streamflow: error: {exc}", file=sys.stderr)
        return 2


def describe(job: Job) -> str:
    """The job's tasks and the trie of their trigger conditions, as text."""
    trie = TriggerTrie()
    lines = [f"job {job.name}" + (f": {job.description}" if job.description else ""), "", "tasks:"]
    for task in job.tasks:
        trie.register(task.name, task.trigger)
        history = f", history {task.history_events} events" + (
            f" / {task.history_s:g}s" if task.history_s is not None else "")
        lines.append(f"  {task.name}: trigger {list(task.trigger)}, input {task.input}"
                     f"{history if task.input != 'page' else ''}, sink table {task.sink}")
        for op in task.pipeline:
            lines.append(f"    | {op!r}")
    lines += ["", "trigger trie:", trie.render()]
    return "\n".join(lines)


def _run(job: Job, args: argparse.Namespace) -> int:
    from_kafka = kafka_topic(args.events) is not None
    if from_kafka and args.runner != "flink":
        raise ValueError(f"{args.events}: the device runner reads files; events from Kafka need --runner flink")
    source = None if from_kafka else open_source(args.events, args.format)  # a missing file fails before any JVM
    flush_on_signals()
    tunnel_line = ""
    with CollectiveStorage(args.db) as storage:
        if args.replace:
            storage.drop([task.sink for task in job.tasks] + list(SYSTEM_TABLES))
            discard_checkpoint(storage, job.name)
        if args.runner == "flink":
            storage.close()  # the Flink job's writer opens the file itself
            summary = _run_on_flink(job, args, storage.path)
        else:
            tunnel = tunnel_commands.open_tunnel(args, storage)
            runner = DeviceRunner(job, storage, workers=args.workers, quarantine_after=args.quarantine_after,
                                  tunnel=tunnel, checkpoint_interval_s=args.checkpoint_interval)
            try:
                summary = runner.run(source, progress=lambda records: track(records, desc=f"{job.name} on device"))
            finally:
                runner.close()
                if tunnel is not None:
                    tunnel_line = tunnel_commands.close_tunnel(tunnel, args.tunnel_wait)
    where = f" (cluster {args.cluster})" if args.runner == "flink" and args.cluster else ""
    print(f"job {job.name} ran on the {args.runner} runner{where} over {args.events}")
    print(summary)
    if tunnel_line:
        print(tunnel_line)
    with CollectiveStorage(summary.db_path) as storage:
        for task in job.tasks:
            if summary.task_stats[task.name].rows and args.show > 0:
                print(f"\nfirst rows of table {task.sink}:")
                for row in storage.read(task.sink).slice(0, args.show).to_pylist():
                    print("  " + ", ".join(f"{k}={_show(v)}" for k, v in row.items()))
    if job.tasks:
        sql = f"SELECT * FROM {job.tasks[0].sink} LIMIT 10"
        print(f"\nquery them: python -c \"import duckdb; print(duckdb.connect('{summary.db_path}', "
              f"read_only=True).sql('{sql}'))\"")
    return 0


def _show(value: object) -> str:
    return f"<{len(value)} bytes>" if isinstance(value, bytes) else str(value)


def _run_on_flink(job: Job, args: argparse.Namespace, db: Path) -> RunSummary:
    try:
        from streamflow.runners.flink import run_flink
    except ImportError as exc:
        raise ValueError(str(exc)) from exc
    return run_flink(job, args.events, args.format, db, cluster=args.cluster, parallelism=args.parallelism,
                     pace_ms=args.pace_ms, checkpoint_dir=args.checkpoint_dir,
                     checkpoint_interval_ms=round((args.checkpoint_interval or 10) * 1000))


def _flink_cluster(args: argparse.Namespace) -> int:
    """``streamflow flink-cluster start|stop|status``: see :mod:`streamflow.flink_cluster`."""
    from streamflow import flink_cluster

    try:
        if args.action == "start":
            overview = flink_cluster.start(port=args.port or flink_cluster.DEFAULT_PORT, directory=args.dir)
            print(f"Flink cluster up: http://127.0.0.1:{args.port or flink_cluster.DEFAULT_PORT} {overview}")
        elif args.action == "stop":
            print("stopped" if flink_cluster.stop(args.dir) else "no cluster running")
        else:
            overview = flink_cluster.status(args.port, args.dir)
            print(overview if overview is not None else "no Flink cluster answers")
            return 0 if overview is not None else 1
    except flink_cluster.ClusterError as exc:
        print(f"streamflow: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
