"""The Flink runner: the same job file, translated into a PyFlink DataStream program.

Translation of a job's trigger tasks (no feature logic here; every step calls the code the device
runner calls)::

    events file ─ FileSource (text lines)
      ─ ParseLines        parallelism 1, chained to the source: numbers the lines as the device
                          runner does; the format's stateless ``parse``; rejects → side output
      ─ key_by(user)
      ─ UserTasks         KeyedProcessFunction: the format's per-user adapter, the timestamp check and
                          TaskExecution (trie + task pipelines from ``operators/``), the user's state in
                          Flink keyed state with TTL; an event-time timer fires at the end of the input
                          (the final watermark) to emit what is still owed (the last page exits)
      ─ union(rejects)
      ─ StorageWriter     parallelism 1: CollectiveStorage, the device runner's DuckDB schema
      ─ discarding sink

PyFlink pitfalls handled here, not in jobs: ``python.executable`` is the running interpreter;
``python.execution-mode`` defaults to ``thread``; the embedded interpreter of thread mode does not
read the virtualenv's ``.pth`` files, so its ``PYTHONPATH`` gets site-packages and the repository
root; Python functions return iterables; results go through a sink, not ``execute_and_collect``.
"""

from __future__ import annotations

import json
import os
import site
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import cloudpickle

import streamflow
from connectors.storage import DEAD_LETTER_TABLE, CollectiveStorage, resolve_db_path
from streamflow.events import TimestampGuard
from streamflow.execution import TaskExecution
from streamflow.job import Job
from streamflow.sources import LineSource, open_source
from streamflow.summary import TASK_ERRORS_TABLE, RunSummary, TaskStats

try:
    from pyflink.common import Configuration, Types, WatermarkStrategy
    from pyflink.common.time import Time
    from pyflink.datastream import OutputTag, StreamExecutionEnvironment
    from pyflink.datastream.connectors.base import Sink
    from pyflink.datastream.connectors.file_system import FileSource, StreamFormat
    from pyflink.datastream.functions import KeyedProcessFunction, ProcessFunction, RuntimeContext
    from pyflink.datastream.state import StateTtlConfig, ValueStateDescriptor
    from pyflink.java_gateway import get_gateway
except ImportError as exc:  # the `flink` extra is optional
    raise ImportError("the Flink runner needs PyFlink: pip install 'streamflow[flink]'") from exc

#: Keyed state of a user unseen for this long is dropped (Flink state TTL).
DEFAULT_STATE_TTL_DAYS = 30
_REJECTED = OutputTag("rejected", Types.PICKLED_BYTE_ARRAY())
_PICKLED = Types.PICKLED_BYTE_ARRAY()


def python_path_for_workers() -> str:
    """``PYTHONPATH`` that lets Flink's embedded interpreter import streamflow and its dependencies."""
    repo_root = str(Path(streamflow.__file__).resolve().parents[1])
    entries = [repo_root, *site.getsitepackages()]
    if os.environ.get("PYTHONPATH"):
        entries.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(dict.fromkeys(entries))


def flink_environment(cluster: str | None = None, parallelism: int = 1,
                      execution_mode: str | None = None) -> StreamExecutionEnvironment:
    """A StreamExecutionEnvironment on the local MiniCluster, or on ``cluster`` (``HOST:PORT`` of
    a JobManager's REST endpoint). Must be the first PyFlink call of the process: the JVM it
    starts inherits ``PYTHONPATH``."""
    os.environ["PYTHONPATH"] = python_path_for_workers()
    conf = Configuration()
    conf.set_string("python.execution-mode", execution_mode or os.environ.get(
        "STREAMFLOW_FLINK_EXECUTION_MODE", "thread"))
    conf.set_string("python.executable", sys.executable)
    if cluster:
        host, _, port = cluster.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--cluster must be HOST:PORT of the JobManager's REST endpoint, got {cluster!r}")
        conf.set_string("execution.target", "remote")
        conf.set_string("rest.address", host)
        conf.set_string("rest.port", port)
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    env.set_parallelism(parallelism)
    return env


class ParseLines(ProcessFunction):
    """Numbers the lines and parses each; rejects go to the side output as dead-letter rows."""

    def __init__(self, source: LineSource):
        self.source = source

    def open(self, runtime_context: RuntimeContext) -> None:
        self.line_no = 0

    def process_element(self, line: str, ctx: ProcessFunction.Context):
        self.line_no += 1
        if not line.strip():
            return  # blank lines are not records (as on the device)
        parsed = self.source.parse(line)
        if isinstance(parsed, str):
            yield _REJECTED, _dead_letter(self.source.name, self.line_no, parsed, line)
        else:
            yield self.line_no, line, parsed


class UserTasks(KeyedProcessFunction):
    """One user's events through the format adapter, the timestamp check and the job's tasks."""

    def __init__(self, job: Job, source: LineSource, state_ttl_days: int):
        self.job = job
        self.source = source
        self.state_ttl_days = state_ttl_days

    def open(self, runtime_context: RuntimeContext) -> None:
        descriptor = ValueStateDescriptor("user", _PICKLED)
        descriptor.enable_time_to_live(StateTtlConfig.new_builder(Time.days(self.state_ttl_days)).build())
        self.state = runtime_context.get_state(descriptor)
        self.execution = TaskExecution(self.job.tasks)
        self.guard = TimestampGuard()

    def process_element(self, value: tuple[int, str, Any], ctx: KeyedProcessFunction.Context):
        line_no, raw, parsed = value
        saved = self.state.value()
        if saved is None:
            ctx.timer_service().register_event_time_timer(0)  # fires with the final watermark
            saved = {"last_ts": None, "adapter": None, "pending": frozenset(), "sequence": None, "events": 0}
        user_id = self.source.user_of(parsed)
        reason = self.guard.reason(user_id, self.source.ts_of(parsed), saved["last_ts"])
        if reason is not None:
            yield DEAD_LETTER_TABLE, _dead_letter(self.source.name, line_no, reason, raw)
            return
        saved["last_ts"] = self.source.ts_of(parsed)
        saved["adapter"], events = self.source.user_events(saved["adapter"], parsed)
        yield from self._run(saved, events)
        self.state.update(saved)

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext):
        saved = self.state.value()
        if saved is None:
            return
        yield from self._run(saved, self.source.end_events(ctx.get_current_key(), saved["adapter"]))
        saved["adapter"] = None
        yield _STATS, {"events": saved["events"]}
        self.state.clear()

    def _run(self, saved: dict[str, Any], events: list) -> Any:
        execution = self.execution
        user = execution.new_user(saved["sequence"], saved["pending"], track=False)
        for event in events:
            saved["events"] += 1
            for name in execution.step(user, event):
                table, rows = execution.settle(name, event, execution.run_task(name, event, user.sequence))
                yield _FIRED, {"task": name, "failed": table == TASK_ERRORS_TABLE, "rows": len(rows)}
                for row in rows:
                    yield table, row
        saved["sequence"], saved["pending"] = user.sequence, user.match.pending_nodes


_STATS = "__stats__"
_FIRED = "__fired__"


def _dead_letter(source: str, line: int, reason: str, raw: str) -> dict[str, Any]:
    return {"source": source, "line": line, "reason": reason, "raw": raw}


class StorageWriter(ProcessFunction):
    """Writes ``(table, row)`` records to collective storage and counts what the run did."""

    def __init__(self, db_path: str, report_path: str):
        self.db_path = db_path
        self.report_path = report_path

    def open(self, runtime_context: RuntimeContext) -> None:
        self.storage = CollectiveStorage(self.db_path)
        self.events = 0
        self.rejected: Counter[str] = Counter()
        self.tasks: dict[str, dict[str, Any]] = {}

    def process_element(self, value: tuple[str, dict[str, Any]], ctx: ProcessFunction.Context):
        table, row = value
        if table == _STATS:
            self.events += row["events"]
        elif table == _FIRED:
            stats = self.tasks.setdefault(row["task"], {"fired": 0, "rows": 0, "errors": 0})
            stats["fired"] += 1
            if row["failed"]:
                stats["errors"] += 1
            else:
                stats["rows"] += row["rows"]
        else:
            if table == DEAD_LETTER_TABLE:
                self.rejected[row["reason"].split(":", 1)[0]] += 1
            self.storage.write(table, [row])
        return []

    def close(self) -> None:
        self.storage.close()
        report = {"events_in": self.events, "rejected": dict(self.rejected), "tasks": self.tasks,
                  "rows_written": self.storage.rows_written}
        Path(self.report_path).write_text(json.dumps(report), encoding="utf-8")


def run_flink(job: Job, events: str | os.PathLike[str], fmt: str | None = None,
              db: str | os.PathLike[str] | None = None, cluster: str | None = None, parallelism: int = 1,
              state_ttl_days: int = DEFAULT_STATE_TTL_DAYS) -> RunSummary:
    """Run ``job`` over an events file on Flink and write its rows to DuckDB ``db``.

    Example (starts a JVM, so not run as a doctest)::

        summary = run_flink(load_job("jobs/ipv.py"), "jobs/data/taobao_user_behavior_10k.csv",
                            db="out/ipv_flink.duckdb")
    """
    source = open_source(events, fmt)
    db_path = resolve_db_path(db).resolve()
    report = db_path.with_suffix(".flink-run.json")
    report.unlink(missing_ok=True)
    if job.module and job.module in sys.modules:
        cloudpickle.register_pickle_by_value(sys.modules[job.module])  # workers cannot import it
    started = time.perf_counter()
    env = flink_environment(cluster, parallelism)
    lines = env.from_source(
        FileSource.for_record_stream_format(StreamFormat.text_line_format(), str(Path(events).resolve())).build(),
        WatermarkStrategy.no_watermarks(), "events").set_parallelism(1)
    parsed = lines.process(ParseLines(source), output_type=_PICKLED).set_parallelism(1)
    outputs = (parsed.key_by(lambda value: source.user_of(value[2]), key_type=Types.STRING())
               .process(UserTasks(job, source, state_ttl_days), output_type=_PICKLED)
               .union(parsed.get_side_output(_REJECTED).map(lambda row: (DEAD_LETTER_TABLE, row),
                                                              output_type=_PICKLED)))
    (outputs.process(StorageWriter(str(db_path), str(report)), output_type=_PICKLED)
     .set_parallelism(1)
     .sink_to(Sink(get_gateway().jvm.org.apache.flink.streaming.api.functions.sink.v2.DiscardingSink())))
    env.execute(f"streamflow {job.name}")
    return _summary(job, db_path, report, time.perf_counter() - started)


def _summary(job: Job, db_path: Path, report_path: Path, elapsed_s: float) -> RunSummary:
    report = json.loads(report_path.read_text(encoding="utf-8"))
    summary = RunSummary(db_path=str(db_path), events_in=report["events_in"], elapsed_s=elapsed_s,
                         rows_written=report["rows_written"], rejected=Counter(report["rejected"]))
    for task in job.tasks:
        counts = report["tasks"].get(task.name, {})
        summary.task_stats[task.name] = TaskStats(fired=counts.get("fired", 0), rows=counts.get("rows", 0),
                                                  errors=counts.get("errors", 0))
        summary.tasks_fired += counts.get("fired", 0)
    return summary
