"""The Flink runner: the same job file, translated into a PyFlink DataStream program.

Translation of a job's trigger tasks (no feature logic here; every step calls the code the device
runner calls)::

    events file ─ FileSource (text lines), or kafka://TOPIC ─ KafkaSource (one line per record value)
      ─ ParseLines        parallelism 1, chained to the source: numbers the lines as the device
                          runner does; the format's stateless ``parse``; a user's consecutive lines go
                          on as one run (one record) when the input's last line is known
    or, at parallelism N > 1 (see :func:`parallel_readers`):
    file_splits ─ ReadSplits  N readers, a byte range of the file each, its lines numbered and parsed as the
                          device does; a run's first line number is its event time (a watermark per reader)
    kafka://TOPIC ─ kafka_records ─ KafkaRuns  a reader per partition, a record numbered offset + 1
      ─ key_by(user)      (malformed lines under the key "", passed through as dead letters)
      ─ UserTasks         KeyedProcessFunction (read from file splits: a user's runs held until the
                          watermark passed them, then taken in line order): per line the timestamp
                          check and the format's per-user adapter, then TaskExecution (trie + task
                          pipelines from ``operators/``) over the run's events, the user's state in
                          Flink keyed state (one write per run); an event-time timer fires at the end
                          of the input (the final watermark) to emit what is still owed (page exits)
      ─ ShipRows          with ``sink="kafka:TOPIC"`` (:mod:`streamflow.flink.sinks`), at the job's
                          parallelism: feature rows out in the tunnel's envelope, the rest on
      ─ ParquetRows       with ``sink="parquet:DIR"``, at the job's parallelism: the shipped tables' rows as
                          ``Row``s of their declared columns (side outputs), each to a ``FileSink`` into
                          ``DIR/<table>/``; rows that do not fit as dead letters, the rest on
      ─ StorageWriter     parallelism 1: CollectiveStorage, the device runner's DuckDB schema
      ─ discarding sink

A stream task takes UserTasks' events (a side output) through the same steps as on the device
(:mod:`streamflow.windowing`): ``StreamEvents`` (the steps before the keyed step, ``StreamInput``), the
keyed step (a time window: Flink's ``WindowOperator`` with ``WindowAggregate`` and ``WindowRows``; any
other: ``FlinkKeyed`` over ``GuardedFunction``), then a flat_map over ``StreamOutput``. Every user
function is called inside a ``try`` there, as on the device: a failure is a ``task_errors`` row, never a
failed job; each step (operator instance) counts its consecutive failures and quarantines itself.

PyFlink pitfalls handled here, not in jobs: ``python.executable`` is the running interpreter;
``python.execution-mode`` defaults to ``thread``; the embedded interpreter of thread mode does not
read the virtualenv's ``.pth`` files, so ``python.pythonpath`` gives it site-packages and the
repository root; Python functions return iterables; results go through a sink, not ``execute_and_collect``.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle

from connectors.json_values import to_json
from connectors.storage import DEAD_LETTER_TABLE, CollectiveStorage
from operators import TimeWindow
from operators.base import field_reader
from operators.process import LATE
from operators.process import ValueStateDescriptor as TypedValue
from operators.window import to_millis
from streamflow.events import TimestampGuard
from streamflow.execution import TaskExecution, TriggerTasks
from streamflow.flink import connector_jars
from streamflow.flink.cluster import python_path, remote_environment
from streamflow.flink.kafka_source import add_kafka_jars, kafka_lines, kafka_records, kafka_topic
from streamflow.flink.keyed import FlinkKeyed
from streamflow.flink.sinks import (
    ParquetColumns,
    TunnelShipper,
    device_keys,
    flink_devices,
    parquet_tables,
    parse_sink,
)
from streamflow.job import Job
from streamflow.keyed import rows_by_output
from streamflow.settings import settings
from streamflow.sources import FORMATS, LineSource, invalid_utf8, open_source
from streamflow.summary import TASK_ERRORS_TABLE, RunSummary, TaskStats
from streamflow.windowing import (
    QUARANTINED,
    Failure,
    GuardedFunction,
    Streak,
    StreamInput,
    StreamOutput,
    StreamPlan,
    stream_error_row,
    window_row,
)

try:
    from pyflink.common import Configuration, Row, Types, WatermarkStrategy
    from pyflink.common.time import Duration, Time
    from pyflink.common.watermark_strategy import TimestampAssigner
    from pyflink.datastream import DataStream, OutputTag, StreamExecutionEnvironment, TimeDomain
    from pyflink.datastream.connectors.base import Sink
    from pyflink.datastream.connectors.file_system import (
        BucketAssigner,
        FileSink,
        FileSource,
        OutputFileConfig,
        StreamFormat,
    )
    from pyflink.datastream.formats.parquet import ParquetBulkWriters
    from pyflink.datastream.functions import (
        AggregateFunction,
        FlatMapFunction,
        KeyedProcessFunction,
        ProcessFunction,
        ProcessWindowFunction,
        RuntimeContext,
    )
    from pyflink.datastream.state import ValueStateDescriptor
    from pyflink.datastream.window import SlidingEventTimeWindows
    from pyflink.java_gateway import get_gateway
    from pyflink.table.types import DataTypes
except ImportError as exc:  # the `flink` extra is optional
    raise ImportError("the Flink runner needs PyFlink: pip install 'streamflow[flink]'") from exc

#: Keyed state of a user unseen for this long is dropped (Flink state TTL).
DEFAULT_STATE_TTL_DAYS = 30
_EVENTS = OutputTag("events", Types.PICKLED_BYTE_ARRAY())  # accepted app events, for stream tasks
_PICKLED = Types.PICKLED_BYTE_ARRAY()
#: A file split (see file_splits): path, start byte, end byte, first line number, lines.
_SPLIT = Types.TUPLE([Types.STRING(), Types.LONG(), Types.LONG(), Types.LONG(), Types.LONG()])
_NO_SOURCE_STATE = (None, None)
#: Longest run of one user's lines ParseLines hands on as one record.
MAX_RUN_LINES = 512
#: Pseudo-table of a user's counts (events, fired, rows, errors per task), sent when the user's input ends.
_STATS = "__stats__"
#: Pseudo-table of a list of ``(table, row)``: the rows of one call of UserTasks.
_ROWS = "__rows__"
#: The end-of-input timer of a user when runs carry line numbers as event time (Long.MAX_VALUE: the final watermark).
_END_OF_INPUT = 2**63 - 1
#: How the Java sources hand a line's bytes to Python: one character per byte, so none is replaced on the way.
LINE_CHARSET = "ISO-8859-1"
#: Bytes a split reader decodes at a time (then up to the end of the line it is in).
_SLAB_BYTES = 1 << 22
#: About how many bytes of the file one split holds: readers take splits in turn (reader i the splits i, i + N,
#: ...), so all readers move through the file together and a user's runs wait for at most a few splits' lines.
SPLIT_BYTES = 1 << 20


def flink_environment(cluster: str | None = None, parallelism: int = 1,
                      execution_mode: str | None = None, checkpoint_dir: str | os.PathLike[str] | None = None,
                      checkpoint_interval_ms: int = 10_000,
                      restore_from: str | os.PathLike[str] | None = None) -> StreamExecutionEnvironment:
    """A StreamExecutionEnvironment on the local MiniCluster, or submitting to ``cluster`` (``HOST:PORT``
    of a JobManager's REST endpoint, e.g. one started by ``streamflow flink-cluster start``).

    The job's ``python.pythonpath`` lets thread mode's embedded interpreter import our code. A remote
    cluster's TaskManagers also need it in their own environment (``streamflow.flink.cluster`` sets it when it
    starts them) and a ``python.executable`` that exists on their machine (``$STREAMFLOW_FLINK_PYTHON``,
    default: this interpreter).

    With ``checkpoint_dir``, Flink checkpoints the job's state every ``checkpoint_interval_ms`` into
    that directory (kept when the job fails or is cancelled); ``restore_from`` starts the job from a
    checkpoint or savepoint there (``execution.savepoint.path``).
    """
    conf = Configuration()
    if checkpoint_dir is not None:
        conf.set_string("execution.checkpointing.interval", f"{int(checkpoint_interval_ms)} ms")
        conf.set_string("execution.checkpointing.dir", Path(checkpoint_dir).resolve().as_uri())
        conf.set_string("execution.checkpointing.externalized-checkpoint-retention", "RETAIN_ON_CANCELLATION")
        # With checkpoints Flink's default is to restart a failing job without end; fail after a few tries.
        conf.set_string("restart-strategy.type", "fixed-delay")
        conf.set_string("restart-strategy.fixed-delay.attempts", "2")
        conf.set_string("restart-strategy.fixed-delay.delay", "1 s")
    if restore_from is not None:
        conf.set_string("execution.savepoint.path", Path(restore_from).resolve().as_uri())
    chosen = settings(flink_execution_mode=execution_mode)
    conf.set_string("python.execution-mode", chosen.flink_execution_mode)
    conf.set_string("python.executable", chosen.flink_python)
    conf.set_string("python.pythonpath", os.pathsep.join(python_path()))
    if cluster:
        return remote_environment(cluster, conf, parallelism=parallelism)
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    env.set_parallelism(parallelism)
    return env


class ParseLines(ProcessFunction):
    """Numbers the lines, parses each and hands them on in runs: ``(key, [(line number, line, parsed), ...])``,
    consecutive lines of one user (rejects: key ``""``, passed through as dead letters, so that nothing
    needs a union). Blank lines are not records (as on the device).

    A run ends when the key changes, at ``max_run`` lines, and at line ``last_line``, the input's last
    (known when a file is read once: :func:`_line_count`); without ``last_line`` every line is a run of
    its own, since nothing would tell that the input ended. A run crosses into the keyed operator as one
    record (one conversion, one state write per run, not per line); ``UserTasks`` still takes its lines
    one by one, in order, so the rows are the same.
    """

    def __init__(self, source: LineSource, pace_s: float = 0.0, last_line: int | None = None,
                 max_run: int = MAX_RUN_LINES):
        self.source = source
        self.pace_s = pace_s
        self.last_line = last_line
        self.max_run = max_run

    def open(self, runtime_context: RuntimeContext) -> None:
        self.line_no = 0
        self._key = ""  # the user of the current run (read only while there is one)
        self._run: list[tuple[int, str, Any]] = []

    def process_element(self, line: str, ctx: ProcessFunction.Context) -> list[tuple[str, list[Any]]]:
        """``line``: a line's bytes as Latin-1 characters (how :func:`_event_lines` reads), so that it is decoded
        here as the device decodes it: UTF-8, a line that is not UTF-8 a dead letter (Java would have put
        U+FFFD in place of its bad bytes and parsed the rest)."""
        self.line_no = line_no = self.line_no + 1
        if self.pace_s:
            time.sleep(self.pace_s)  # paced replay: see run_flink(pace_ms=...)
        if not line.isascii():
            line = line.encode("latin-1").decode("utf-8", "surrogateescape")
        return self.take(line_no, *_read(self.source, line))

    def take(self, line_no: int, line: str, parsed: Any) -> list[tuple[str, list[Any]]]:
        """Line ``line_no`` (``parsed``: the format's record, or a reason for a reject) into the current run;
        the runs it ended out."""
        self.line_no = line_no
        out: list[tuple[str, list[Any]]] = []
        run = self._run
        if type(parsed) is not str or line.strip():  # a blank line is nothing, but may end the input
            key = "" if type(parsed) is str else self.source.user_of(parsed)
            if run and (key != self._key or len(run) >= self.max_run):
                out.append((self._key, run))
                run = self._run = []
            self._key = key
            run.append((line_no, line, parsed))
        if run and (self.last_line is None or line_no >= self.last_line):
            out.append((self._key, run))
            self._run = []
        return out

    def close(self) -> None:
        if self._run:  # the input had fewer lines than counted (changed while read): say so, drop nothing silently
            raise RuntimeError(f"{self.source.name}: {len(self._run)} lines from line {self._run[0][0]} on were "
                               f"still held at the end of the input ({self.line_no} lines read, "
                               f"{self.last_line} counted before the run): was the file changed while read?")


def file_splits(path: str | os.PathLike[str], n: int) -> list[tuple[str, int, int, int, int]]:
    """``path`` cut into at most ``n`` byte ranges at line starts, for ``n`` readers:
    ``(path, start byte, end byte, first line number, lines)`` each. Lines are counted as the device runner
    reads them (Python's universal newlines: ``\\n``, ``\\r\\n`` and a lone ``\\r`` end a line; a last line
    without one is a line), so every reader numbers its lines as the device does. A range ends after a
    ``\\n``, never inside ``\\r\\n``; a file whose lines end only in ``\\r`` stays one range.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("wb", suffix=".csv", delete=False) as f:
        ...     _ = f.write(b"a\\nbb\\r\\nc\\rd\\n\\ne")
        >>> [split[1:] for split in file_splits(f.name, 3)]
        [(0, 6, 1, 2), (6, 10, 3, 2), (10, 12, 5, 2)]
        >>> os.unlink(f.name)
    """
    name = str(Path(path).resolve())
    size = os.path.getsize(name)
    with open(name, "rb") as f:
        bounds = [0]
        for k in range(1, max(1, n)):
            target = size * k // n
            if target <= bounds[-1]:
                continue
            f.seek(target - 1)
            f.readline()  # to just after the line end at or after the target
            if bounds[-1] < f.tell() < size:
                bounds.append(f.tell())
        bounds.append(size)
        splits, first = [], 1
        for start, end in zip(bounds, bounds[1:], strict=False):
            lines = _count_lines(f, start, end)
            splits.append((name, start, end, first, lines))
            first += lines
    return splits


def split_count(path: str | os.PathLike[str], readers: int) -> int:
    """How many splits ``readers`` readers take of ``path``: a multiple of ``readers``, about :data:`SPLIT_BYTES`
    each. Handed out in turn (``rebalance``), each reader's splits come in line order, so its record timestamps
    (line numbers) only grow, and the slowest reader holds the others back by about one split each, not by
    half the file (one split per reader would hold every line after the first split until it was read).
    """
    size = os.path.getsize(path)
    return readers * max(1, -(-size // (SPLIT_BYTES * readers)))


def _count_lines(f: Any, start: int, end: int) -> int:
    """Lines of the byte range ``[start, end)`` of binary file ``f``, in universal newlines."""
    f.seek(start)
    n, remaining, prev_cr, last = 0, end - start, False, b""
    while remaining > 0:
        chunk = f.read(min(_SLAB_BYTES, remaining))
        if not chunk:
            break
        remaining -= len(chunk)
        n += chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n")
        if prev_cr and chunk[:1] == b"\n":
            n -= 1  # a \r\n cut between two chunks
        prev_cr, last = chunk.endswith(b"\r"), chunk[-1:]
    return n + (1 if last and last not in (b"\n", b"\r") else 0)


def _split_lines(split: tuple[str, int, int, int, int]) -> Any:
    """``(line number, line without its line end)`` for every line of a split, decoded as the device runner
    decodes (UTF-8, bad bytes kept as lone surrogates for :func:`_read`)."""
    name, start, end, first, _ = split
    line_no = first - 1
    with open(name, "rb") as f:
        f.seek(start)
        while f.tell() < end:
            data = f.read(min(_SLAB_BYTES, end - f.tell()))
            if not data:
                break
            if not data.endswith(b"\n") and f.tell() < end:
                data += f.readline()  # whole lines only (the split's end is a line end)
            for line in io.StringIO(data.decode("utf-8", "surrogateescape"), newline=None):
                line_no += 1
                yield line_no, line.rstrip("\r\n")


def _read(source: LineSource, line: str) -> tuple[str, Any]:
    """``(line, parsed)`` as the device runner's ``read_line`` has them: a line that is not UTF-8 is a reject
    with its bad bytes escaped, any other line goes to the format's ``parse``."""
    if not line.isascii() and (bad := invalid_utf8(line)) is not None:
        return bad[1], bad[0]
    return line, source.parse(line)


class ReadSplits(FlatMapFunction):
    """Reads a file split (see :func:`file_splits`) and hands its lines on as :class:`ParseLines` does, in runs of
    one user's consecutive lines, numbered as the device numbers them; a run never crosses a split's end."""

    def __init__(self, source: LineSource, max_run: int = MAX_RUN_LINES):
        self.source = source
        self.max_run = max_run

    def flat_map(self, split: tuple[str, int, int, int, int]) -> Any:
        _, _, _, first, lines = split
        if not lines:
            return
        parse = ParseLines(self.source, last_line=first + lines - 1, max_run=self.max_run)
        parse.open(None)
        for line_no, raw in _split_lines(split):
            line, parsed = _read(self.source, raw)
            yield from parse.take(line_no, line, parsed)
        parse.close()


class KafkaRuns(FlatMapFunction):
    """A Kafka record (``kafka_records``' row) as a run of one line, numbered ``offset + 1`` (a fresh
    single-partition topic's records numbered as a file's lines, as at parallelism 1)."""

    def __init__(self, source: LineSource):
        self.source = source

    def open(self, runtime_context: RuntimeContext) -> None:
        self.parse = ParseLines(self.source)
        self.parse.open(runtime_context)

    def flat_map(self, record: Any) -> Any:
        value = record[4]
        line, parsed = _read(self.source, bytes(value or b"").decode("utf-8", "surrogateescape"))
        return self.parse.take(int(record[2]) + 1, line, parsed)


class RunOrder(TimestampAssigner):
    """A run's first line number as its event time: a split's runs come in line order, so each reader's
    watermark says up to which line it has read (Flink's watermark per split)."""

    def extract_timestamp(self, value: tuple[str, list[Any]], record_timestamp: int) -> int:
        return value[1][0][0]


class UserTasks(FlinkKeyed):
    """One user's records through the format adapter and the timestamp check, then the job's trigger
    tasks (:class:`~streamflow.execution.TriggerTasks`, the same keyed process function the device runs,
    its state in small typed Flink states). An event-time timer fires at the end of the input (the
    final watermark) to emit what is still owed (the last page exits) and this subtask's counts."""

    function: TriggerTasks

    def __init__(self, job: Job, source: LineSource, state_ttl_days: int, quarantine_after: int = 5,
                 ordered: bool = False):
        execution = TaskExecution(job.trigger_tasks, quarantine_after)
        # Tasks that keep no history hold one page per user at most: pack the user's states in one
        # Flink state, one write per record (FlinkKeyed(packed=True)); with history, lists stay ListStates.
        super().__init__(TriggerTasks(execution), state_ttl_days=state_ttl_days,
                         packed=not execution.max_events and not execution.max_pages)
        self.source = source
        self.emit_events = bool(job.stream_tasks)
        # Runs from several readers (ReadSplits): a user's runs are held until the watermark passed their first
        # line, then taken in line order; the end of the input is then the final watermark's timer.
        self.ordered = ordered
        self.end_timer = _END_OF_INPUT if ordered else 0

    def open(self, runtime_context: RuntimeContext) -> None:
        super().open(runtime_context)
        self.source_state = self.get_state(TypedValue("source"))  # (last timestamp, the format's user state)
        execution = self.function.execution
        # A record's events through on_block (TriggerTasks.on_block, as on the device) when nothing else
        # needs them one by one; the trie's single_step can change (a quarantined task), so it is read per record.
        self._block = (self.can_call_block() and not self.emit_events and not execution.max_events
                       and not execution.max_pages)
        self.guard = TimestampGuard()
        self.events = 0
        self._reported: dict[str, TaskStats] = {}
        if self.ordered:
            self.pending = runtime_context.get_state(ValueStateDescriptor("pending", _PICKLED))

    def process_element(self, value: tuple[str, list[tuple[int, str, Any]]], ctx: KeyedProcessFunction.Context
                        ) -> list[tuple[str, Any]]:
        if not self.ordered:
            return self._take(value, ctx)
        self.pending.update([*(self.pending.value() or ()), value])
        ctx.timer_service().register_event_time_timer(value[1][0][0])  # fires once every reader passed the line
        return []

    def _take_due(self, timestamp: int, ctx: Any) -> list[tuple[str, Any]]:
        """The current user's held runs that begin at or before line ``timestamp``, taken in line order."""
        held = self.pending.value() or []
        due = sorted((run for run in held if run[1][0][0] <= timestamp), key=lambda run: run[1][0][0])
        rest = [run for run in held if run[1][0][0] > timestamp]
        if rest:
            self.pending.update(rest)
        else:
            self.pending.clear()
        out: list[tuple[str, Any]] = []
        for run in due:
            out += self._take(run, ctx)
        return out

    def _take(self, value: tuple[str, list[tuple[int, str, Any]]], ctx: Any) -> list[tuple[str, Any]]:
        user, lines = value  # a run of one user's lines (see ParseLines)
        out: list[tuple[str, Any]] = []
        self._ctx = ctx
        self.set_key(user)  # the key_by key (ParseLines keys a record by source.user_of)
        try:
            events = self._events(ctx, user, lines, out)
            if events:
                out += self._run(ctx, events)
        finally:
            self.commit()  # one state write for the run: no checkpoint falls inside a call
        # One record for the run's rows; events for stream tasks go to their side output one by one.
        return out if self.emit_events or len(out) < 2 else [(_ROWS, out)]

    def _events(self, ctx: Any, user: str, lines: list[tuple[int, str, Any]], out: list[tuple[str, Any]]) -> list:
        """The app events of a run's lines in order, each line through the timestamp check and the format's
        adapter as on the device; a rejected line's dead-letter row goes to ``out``. The tasks then take the
        events as they would line by line: they depend on nothing but the events and their own state."""
        source, guard = self.source, self.guard
        last_ts, adapter = self.source_state.value() or _NO_SOURCE_STATE
        if last_ts is None:
            ctx.timer_service().register_event_time_timer(self.end_timer)  # fires with the final watermark
        events: list = []
        accepted = False
        for line_no, raw, parsed in lines:
            if type(parsed) is str:
                out.append((DEAD_LETTER_TABLE, _dead_letter(source.name, line_no, parsed, raw)))
                continue
            ts = source.ts_of(parsed)
            if not guard.min_ts <= ts <= guard.max_ts or (last_ts is not None and ts < last_ts):
                reason = guard.reason(user, ts, last_ts)  # the bound may only need the clock read again
                if reason is not None:
                    out.append((DEAD_LETTER_TABLE, _dead_letter(source.name, line_no, reason, raw)))
                    continue
            adapter, produced = source.user_events(adapter, parsed)
            events += produced
            last_ts, accepted = ts, True
        if accepted:
            self.source_state.update((last_ts, adapter))
        return events

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext) -> list[tuple[str, Any]]:
        if (self.ordered and timestamp != _END_OF_INPUT
                and ctx.time_domain() == TimeDomain.EVENT_TIME):
            return self._take_due(timestamp, ctx)
        self._ctx = ctx
        self.set_key(ctx.get_current_key())
        if self.backstop_fired(ctx):
            return []
        try:
            adapter = (self.source_state.value() or (None, None))[1]
            out = self._run(ctx, self.source.end_events(self.key, adapter))
            out.append((_STATS, self._counts()))
            self.clear_all()
        finally:
            self.commit()
        return out

    def _run(self, ctx: Any, events: list) -> list[tuple[str, Any]]:
        if self._block and events and self.function.execution.trie.single_step:
            self.events += len(events)
            return self.call_block(ctx, events, round(events[-1].ts * 1000), events[-1].user_id)
        out: list[tuple[str, Any]] = []
        for event in events:
            self.events += 1
            if self.emit_events:
                out.append((_EVENTS, event))
            out += self.call(ctx, event, round(event.ts * 1000), event.user_id)
        return out

    def _counts(self) -> dict[str, Any]:
        """What this subtask counted since it last reported (the per-task stats live per subtask)."""
        tasks = {}
        for name, stats in self.function.execution.stats.items():
            seen = self._reported.setdefault(name, TaskStats())
            tasks[name] = {"fired": stats.fired - seen.fired, "rows": stats.rows - seen.rows,
                           "errors": stats.errors - seen.errors, "quarantined": stats.quarantined}
            seen.fired, seen.rows, seen.errors = stats.fired, stats.rows, stats.errors
        events, self.events = self.events, 0
        return {"events": events, "tasks": tasks}


def _dead_letter(source: str, line: int, reason: str, raw: str) -> dict[str, Any]:
    return {"source": source, "line": line, "reason": reason, "raw": raw}


class EventTime(TimestampAssigner):
    """Flink record timestamps (ms) from a stream task's window ``ts`` field."""

    def __init__(self, read_ts: Any):
        self.read_ts = read_ts

    def extract_timestamp(self, value: tuple[Any, Any], record_timestamp: int) -> int:
        return to_millis(self.read_ts(value[1]))


class WindowAggregate(AggregateFunction):
    """An ``Aggregate`` operator's named aggregations as one Flink AggregateFunction.

    An event reaches it only once ``StreamInput`` checked that the aggregation takes it; should an ``add``
    still raise (it depends on what the window already holds: ``Max`` of mixed types) or a ``result``,
    the window's accumulator becomes that :class:`~streamflow.windowing.Failure`, and :class:`WindowRows`
    stores a ``task_errors`` row for the window instead of its row. The job goes on. (On the device such an
    ``add`` fails its event alone, as the per-event check would: the one case the runners report apart.)
    """

    def __init__(self, aggregations: dict[str, Any]):
        self.aggregations = list(aggregations.items())

    def create_accumulator(self) -> list[Any]:
        return [agg.create() for _, agg in self.aggregations]

    def add(self, value: tuple[Any, Any], accumulator: list[Any] | Failure) -> list[Any] | Failure:
        if type(accumulator) is Failure:
            return accumulator
        item = value[1]
        try:
            for i, (_, agg) in enumerate(self.aggregations):
                if agg.where is None or agg.where(item):
                    accumulator[i] = agg.add(accumulator[i], item)
        except Exception as exc:
            return Failure.of(exc)
        return accumulator

    def get_result(self, accumulator: list[Any] | Failure) -> dict[str, Any] | Failure:
        if type(accumulator) is Failure:
            return accumulator
        try:
            return {name: agg.result(acc) for (name, agg), acc in zip(self.aggregations, accumulator, strict=True)}
        except Exception as exc:
            return Failure.of(exc)

    def merge(self, a: list[Any] | Failure, b: list[Any] | Failure) -> list[Any] | Failure:
        if type(a) is Failure or type(b) is Failure:
            return a if type(a) is Failure else b
        try:
            return [agg.merge(x, y) for (_, agg), x, y in zip(self.aggregations, a, b, strict=True)]
        except Exception as exc:
            return Failure.of(exc)


class WindowRows(ProcessWindowFunction):
    """A fired window's aggregates as the row every runner produces (see ``window_row``), as ``("emit", row)``
    for the steps after the window; a failed window as a ``task_errors`` row naming the key and the window.
    Its failures in a row quarantine it, as ``GuardedFunction``'s timers do on the device."""

    def __init__(self, task: str, key_name: str, quarantine_after: int = 5):
        self.task = task
        self.key_name = key_name
        self.streak = Streak(quarantine_after)

    def process(self, key: Any, context: ProcessWindowFunction.Context, elements: Any
                ) -> Iterator[tuple[str, dict[str, Any]]]:
        streak = self.streak
        if streak.quarantined:
            return
        window = context.window()
        start, end = window.start / 1000, window.end / 1000
        for results in elements:
            if type(results) is Failure:
                row = stream_error_row(self.task, results, None, key, window=(start, end))
                yield TASK_ERRORS_TABLE, row
                if streak.failed(self.task, row):
                    yield QUARANTINED, {"task": self.task}
                    return
            else:
                streak.failures = 0
                yield "emit", window_row(self.key_name, key, start, end, results)


class StreamEvents(ProcessFunction):
    """A stream task's steps before its keyed step (:class:`~streamflow.windowing.StreamInput`, as on the
    device): ``(key, item)`` out; failures (``(table, row)`` records) to the side output ``failed``."""

    def __init__(self, steps: StreamInput, failed: OutputTag):
        self.steps = steps
        self.failed = failed

    def process_element(self, event: Any, ctx: ProcessFunction.Context) -> list[Any]:
        entry = self.steps.step(event)
        out = self.steps.out
        if out:
            records = [(self.failed, record) for record in out]
            out.clear()
            return records
        return [] if entry is None else [(entry[0], entry[1])]


def _stream_task(events: DataStream, task: Any, quarantine_after: int = 5) -> DataStream:
    """A stream task as Flink operators: its steps before the keyed step, key_by, the keyed step, its steps
    after it; ``(table, row)`` records out. A time window is Flink's own ``WindowOperator`` (watermarks,
    allowed lateness, a late side output, the aggregate); any other keyed step is our keyed process function
    in :class:`FlinkKeyed`. Each step catches what the user's functions raise (see the module docstring)."""
    plan = StreamPlan.of(task.name, task.pipeline)
    failed = OutputTag(f"failed_{task.name}", _PICKLED)
    pairs = events.process(StreamEvents(StreamInput(task.name, plan, quarantine_after), failed),
                           output_type=_PICKLED)
    failures = pairs.get_side_output(failed)
    if plan.ts is not None:
        pairs = pairs.assign_timestamps_and_watermarks(
            WatermarkStrategy.for_bounded_out_of_orderness(Duration.of_millis(to_millis(plan.out_of_orderness)))
            .with_timestamp_assigner(EventTime(field_reader(plan.ts))))
    keyed = pairs.key_by(lambda pair: pair[0])
    output = StreamOutput(task.name, task.sink, plan, quarantine_after)
    if isinstance(plan.window, TimeWindow):
        window, aggregate = plan.window, plan.aggregate
        assert aggregate is not None  # a window is followed by its Aggregate (StreamPlan.of)
        late = OutputTag(f"late_{task.name}", _PICKLED)
        size, slide = to_millis(window.size), to_millis(window.slide)
        offset = to_millis(window.offset) % slide  # the same alignment; Flink takes only |offset| < slide
        outputs = (keyed.window(SlidingEventTimeWindows.of(Time.milliseconds(size), Time.milliseconds(slide),
                                                           Time.milliseconds(offset)))
                   .allowed_lateness(to_millis(window.allowed_lateness))
                   .side_output_late_data(late)
                   .aggregate(WindowAggregate(aggregate.aggregations),
                              WindowRows(task.name, plan.key_by.name, quarantine_after),
                              accumulator_type=_PICKLED, output_type=_PICKLED))
        lates = outputs.get_side_output(late).flat_map(lambda pair: output.records(LATE, pair[1]),
                                                       output_type=_PICKLED)
        failures = failures.union(lates)
    else:
        function = GuardedFunction(plan.function(), task.name, quarantine_after)
        outputs = keyed.process(FlinkKeyed(function), output_type=_PICKLED)
    return outputs.flat_map(lambda tagged: output.records(*tagged), output_type=_PICKLED).union(failures)


class StorageWriter(ProcessFunction):
    """Writes ``(table, row)`` records to collective storage and counts what the run did."""

    def __init__(self, db_path: str, report_path: str, stream_sinks: dict[str, str], tasks: dict[str, str]):
        self.db_path = db_path
        self.report_path = report_path
        self.stream_sinks = stream_sinks  # sink table -> stream task
        self.stream_tasks = set(stream_sinks.values())
        self.tasks_by_name = tasks  # task -> sink table

    def open(self, runtime_context: RuntimeContext) -> None:
        self.storage = CollectiveStorage(self.db_path)
        for name, sink in self.tasks_by_name.items():
            self.storage.name_writer(sink, f"task {name}")
        self.events = 0
        self.rejected: Counter[str] = Counter()
        self.tasks: dict[str, dict[str, Any]] = {}
        self.quarantined: set[str] = set()

    def process_element(self, value: tuple[str, Any], ctx: ProcessFunction.Context) -> list[Any]:
        table, row = value
        if table == _ROWS:  # a run's rows (UserTasks): stored a table at a time, each table's rows in order
            for name, rows in rows_by_output(row).items():
                self._write(name, rows)
        elif table == _STATS:
            self.events += row["events"]
            for name, counts in row["tasks"].items():
                if counts.pop("quarantined", False):
                    self.quarantined.add(name)
                totals = self.tasks.setdefault(name, {"fired": 0, "rows": 0, "errors": 0})
                for what, n in counts.items():
                    totals[what] += n
        elif table == QUARANTINED:  # a step of a stream task quarantined itself
            self.quarantined.add(row["task"])
        else:
            self._write(table, [row])
        return []

    def _write(self, table: str, rows: list[dict[str, Any]]) -> None:
        if table == DEAD_LETTER_TABLE:
            for row in rows:
                self.rejected[row["reason"].split(":", 1)[0]] += 1
        elif table in self.stream_sinks:  # a stream task's window fired
            stats = self.tasks.setdefault(self.stream_sinks[table], {"fired": 0, "rows": 0, "errors": 0})
            stats["fired"] += len(rows)
            stats["rows"] += len(rows)
        elif table == TASK_ERRORS_TABLE:  # a stream task's failures (a trigger task's are in its _STATS)
            for row in rows:
                name = row.get("task")
                if name in self.stream_tasks:
                    self.tasks.setdefault(name, {"fired": 0, "rows": 0, "errors": 0})["errors"] += 1
        self.storage.write(table, rows)

    def close(self) -> None:
        self.storage.close()
        report = {"events_in": self.events, "rejected": dict(self.rejected), "tasks": self.tasks,
                  "quarantined": sorted(self.quarantined), "rows_written": self.storage.rows_written,
                  "refused": self.storage.refused}
        Path(self.report_path).write_text(json.dumps(report), encoding="utf-8")


def subtask_index(runtime_context: RuntimeContext) -> int:
    """This subtask's index. PyFlink 2.3's thread-mode context asks Java for ``getIndexOfThisSubtask``, which
    Flink 2 moved to ``getTaskInfo()``; that is asked then."""
    try:
        return runtime_context.get_index_of_this_subtask()
    except AttributeError:
        return int(runtime_context._runtime_context.getTaskInfo().getIndexOfThisSubtask())


class ShipRows(ProcessFunction):
    """The ``kafka:TOPIC`` sink (:mod:`streamflow.flink.sinks`), at the job's parallelism: the rows of the shipped
    tables go out in the tunnel's envelope, one tunnel device per subtask; every other record (dead letters, task
    errors, counts) goes on to the run's local DuckDB writer."""

    def __init__(self, shipper: TunnelShipper, shipped: set[str]):
        self.shipper = shipper
        self.shipped = shipped

    def open(self, runtime_context: RuntimeContext) -> None:
        self.shipper.open(subtask_index(runtime_context))

    def process_element(self, value: tuple[str, Any], ctx: ProcessFunction.Context) -> list[tuple[str, Any]]:
        table, row = value
        if table == _ROWS:
            kept = []
            for name, rows in rows_by_output(row).items():
                if name in self.shipped:
                    self.shipper.write(name, rows)
                else:
                    kept += [(name, r) for r in rows]
            return [(_ROWS, kept)] if kept else []
        if table in self.shipped:
            self.shipper.write(table, [row])
            return []
        return [value]

    def close(self) -> None:
        self.shipper.close()


#: A declared column type (:data:`streamflow.job.COLUMN_TYPES`) as Flink's type information and Parquet's type.
_COLUMN_TYPES = {"string": (Types.STRING, DataTypes.STRING), "bigint": (Types.LONG, DataTypes.BIGINT),
                 "double": (Types.DOUBLE, DataTypes.DOUBLE), "boolean": (Types.BOOLEAN, DataTypes.BOOLEAN)}


def parquet_tag(table: str, columns: dict[str, str]) -> OutputTag:
    """The side output of ``ParquetRows`` that carries table ``table``'s rows."""
    return OutputTag(f"parquet-{table}", Types.ROW_NAMED(list(columns),
                                                         [_COLUMN_TYPES[kind][0]() for kind in columns.values()]))


def parquet_file_sink(directory: Path, columns: dict[str, str]) -> FileSink:
    """Flink's ``FileSink`` of one table: Parquet part files (Snappy) in ``directory``, committed on checkpoints
    and at the end of a bounded input."""
    row_type = DataTypes.ROW([DataTypes.FIELD(name, _COLUMN_TYPES[kind][1]()) for name, kind in columns.items()])
    hadoop = Configuration()
    hadoop.set_string("parquet.compression", "SNAPPY")
    writer = ParquetBulkWriters.for_row_type(row_type, hadoop_config=hadoop, utc_timestamp=True)
    return (FileSink.for_bulk_format(str(directory), writer)
            .with_bucket_assigner(BucketAssigner.base_path_bucket_assigner())  # no date-hour folders
            .with_output_file_config(OutputFileConfig.builder().with_part_prefix("part")
                                     .with_part_suffix(".parquet").build())
            .build())


class ParquetRows(ProcessFunction):
    """The ``parquet:DIR`` sink's first half (:mod:`streamflow.flink.sinks`), at the job's parallelism: each row of
    a shipped table made a ``Row`` of its declared columns, to that table's side output (and its ``FileSink``);
    a row that does not fit is a dead letter; every other record goes on to the run's local DuckDB writer. A
    stream task's shipped rows are counted for the run's summary (``_STATS``), as StorageWriter counts them."""

    def __init__(self, tables: dict[str, dict[str, str]], stream_sinks: dict[str, str]):
        self.tables = tables
        self.stream_sinks = stream_sinks  # sink table -> stream task
        self.tags = {table: parquet_tag(table, columns) for table, columns in tables.items()}

    def open(self, runtime_context: RuntimeContext) -> None:
        self.fits = {table: ParquetColumns(table, columns) for table, columns in self.tables.items()}

    def process_element(self, value: tuple[str, Any], ctx: ProcessFunction.Context) -> list[Any]:
        table, row = value
        out: list[Any] = []
        if table == _ROWS:
            kept = []
            for name, rows in rows_by_output(row).items():
                if name in self.fits:
                    self._ship(name, rows, out)
                else:
                    kept += [(name, r) for r in rows]
            if kept:
                out.append((_ROWS, kept))
        elif table in self.fits:
            self._ship(table, [row], out)
        else:
            out.append(value)
        return out

    def _ship(self, table: str, rows: list[dict[str, Any]], out: list[Any]) -> None:
        fit, tag = self.fits[table], self.tags[table]
        for row in rows:
            values, reason = fit.fit(row)
            if values is None:
                out.append((DEAD_LETTER_TABLE, _dead_letter(
                    f"parquet:{table}", 0, f"parquet: row does not fit table {table}'s declared columns: {reason}",
                    to_json(row))))
            else:
                out.append((tag, Row(*values)))
        task = self.stream_sinks.get(table)
        if task is not None and rows:
            out.append((_STATS, {"events": 0, "tasks": {task: {"fired": len(rows), "rows": len(rows)}}}))


def job_modules(job: Job) -> list[str]:
    """The modules a job file brought with it: the job's own module and every module loaded from a file
    in the job file's directory (e.g. ``jobs/ipv_encoder.py`` loads ``jobs/ipv.py``). The workers cannot
    import them by name, so :func:`run_flink` pickles them by value. Other job files of that directory
    loaded earlier in this process are listed too; that is harmless (by value only changes how what the job
    refers to is pickled).

    Example:
        >>> from streamflow.job import load_job
        >>> {"streamflow_job_ipv", "streamflow_job_ipv_encoder"} <= set(job_modules(load_job("jobs/ipv_encoder.py")))
        True
    """
    top = sys.modules.get(job.module or "")
    top_file = getattr(top, "__file__", None) if top is not None else None
    if not top_file:
        return []
    home = Path(top_file).resolve().parent
    names = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and Path(path).resolve().parent == home:
            names.append(name)
    return sorted(names)


def ship_job_modules(job: Job) -> None:
    """Register the job's own modules (:func:`job_modules`) with cloudpickle by value."""
    for name in job_modules(job):
        cloudpickle.register_pickle_by_value(sys.modules[name])


def run_flink(job: Job, events: str | os.PathLike[str], fmt: str | None = None,
              db: str | os.PathLike[str] | None = None, cluster: str | None = None, parallelism: int = 1,
              state_ttl_days: int = DEFAULT_STATE_TTL_DAYS, pace_ms: float = 0.0,
              checkpoint_dir: str | os.PathLike[str] | None = None, checkpoint_interval_ms: int = 10_000,
              restore_from: str | os.PathLike[str] | None = None, quarantine_after: int = 5,
              sink: str | None = None) -> RunSummary:
    """Run ``job`` over an events file on Flink and write its rows to DuckDB ``db``.

    ``sink``: where the rows go (:mod:`streamflow.flink.sinks`): ``duckdb:PATH`` (instead of ``db``), or
    ``kafka:TOPIC``, the feature rows in the tunnel's envelope at the job's parallelism (broker:
    ``$STREAMFLOW_KAFKA_BOOTSTRAP``; the subtasks' device keys from the key registry); the rest stays in ``db``;
    or ``parquet:DIR``, the shipped tasks' rows as Parquet part files in ``DIR/<table>/`` (each such task declares
    its ``columns``; refused here, before a JVM starts, if one does not).

    ``events`` may also be ``kafka://TOPIC`` (broker: ``$STREAMFLOW_KAFKA_BOOTSTRAP``, default
    ``127.0.0.1:9092``): each record's value is one line of the format ``fmt`` (required then), read from
    the earliest offset up to the latest at job start; with one partition, numbered as a file's lines.

    ``pace_ms`` replays the file at one record per ``pace_ms`` milliseconds. Flink emits
    watermarks periodically, so which events are late depends on how fast they arrive; paced, the
    watermark catches up after every record (the watermark interval is set to a tenth of the pace),
    and lateness is decided per event exactly as on the device runner.

    ``checkpoint_dir``, ``checkpoint_interval_ms`` and ``restore_from``: Flink checkpoints (see
    :func:`flink_environment`). Keyed state and the file source's position are restored; the DuckDB
    writer is not yet tied to the checkpoints (no two-phase commit): rows it had buffered when the job
    died are lost, rows it had flushed after the restored checkpoint are written again.

    ``quarantine_after``: consecutive failures after which a task is quarantined (a stream task's step,
    counted per operator instance: at parallelism 1 as on the device runner).

    Example (starts a JVM, so not run as a doctest)::

        summary = run_flink(load_job("jobs/ipv.py"), "jobs/data/taobao_user_behavior_10k.csv",
                            db="out/ipv_flink.duckdb")
    """
    source = _open_events(events, fmt)
    spec = parse_sink(sink)
    if spec is not None and spec.scheme == "duckdb":
        db = spec.target
    resolved = settings(db=db)
    db_path = resolved.db.resolve()
    shipper = None
    tables = parquet_tables(job) if spec is not None and spec.scheme == "parquet" else {}  # before a JVM starts
    if spec is not None and spec.scheme == "kafka":  # checked before a JVM starts
        # The broker resolved here: the JVM (and the Python it embeds) may be older than this process's environment.
        shipper = TunnelShipper(device_keys(flink_devices(job.name, parallelism)), spec.target,
                                resolved.kafka_bootstrap, str(db_path.with_name(db_path.name + ".tunnel-spool")))
    report = db_path.with_suffix(".flink-run.json")
    report.unlink(missing_ok=True)
    ship_job_modules(job)
    started = time.perf_counter()
    env = flink_environment(cluster, parallelism, checkpoint_dir=checkpoint_dir,
                            checkpoint_interval_ms=checkpoint_interval_ms, restore_from=restore_from)
    if pace_ms:
        env.get_config().set_auto_watermark_interval(max(1, int(pace_ms / 10)))
        env.set_buffer_timeout(1)
    # Runs of lines need the input's end: a file read once from its start, unpaced (pacing is per line).
    topic = kafka_topic(events)
    once = topic is None and restore_from is None and checkpoint_dir is None and not pace_ms
    readers = parallel_readers(job, events, parallelism, once)
    if readers > 1 and topic is None:  # split across readers, a user's runs put in order again
        parsed = (env.from_collection(file_splits(events, split_count(events, readers)), type_info=_SPLIT)
                  .rebalance().flat_map(ReadSplits(source), output_type=_PICKLED).set_parallelism(readers)
                  .assign_timestamps_and_watermarks(
                      WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner(RunOrder()))
                  .set_parallelism(readers))
    elif readers > 1 and topic is not None:  # each partition by one reader, in offset order
        add_kafka_jars(env)
        parsed = kafka_records(env, topic).flat_map(KafkaRuns(source), output_type=_PICKLED)
    else:
        parse = ParseLines(source, pace_ms / 1000, last_line=_line_count(events) if once else None)
        parsed = _event_lines(env, events).process(parse, output_type=_PICKLED).set_parallelism(1)
    ordered = readers > 1 and kafka_topic(events) is None
    outputs = per_user = (parsed.key_by(lambda value: value[0], key_type=Types.STRING())
                          .process(UserTasks(job, source, state_ttl_days, quarantine_after, ordered),
                                   output_type=_PICKLED))
    for task in job.stream_tasks:
        outputs = outputs.union(_stream_task(per_user.get_side_output(_EVENTS), task, quarantine_after))
    stream_sinks = {task.sink: task.name for task in job.stream_tasks}
    tasks = {task.name: task.sink for task in job.tasks}
    if shipper is not None:
        shipped = {task.sink for task in job.tasks if task.tunnel}
        outputs = outputs.process(ShipRows(shipper, shipped), output_type=_PICKLED)
    if spec is not None and spec.scheme == "parquet":
        env.add_jars(*connector_jars.parquet_jar_urls())
        parquet_rows = ParquetRows(tables, stream_sinks)
        outputs = outputs.process(parquet_rows, output_type=_PICKLED)
        for table, columns in tables.items():
            (outputs.get_side_output(parquet_rows.tags[table])
             .sink_to(parquet_file_sink(Path(spec.target).resolve() / table, columns)))
    (outputs.process(StorageWriter(str(db_path), str(report), stream_sinks, tasks), output_type=_PICKLED)
     .set_parallelism(1)
     .sink_to(Sink(get_gateway().jvm.org.apache.flink.streaming.api.functions.sink.v2.DiscardingSink())))
    env.execute(f"streamflow {job.name}")
    return _summary(job, db_path, report, time.perf_counter() - started)


def parallel_readers(job: Job, events: str | os.PathLike[str], parallelism: int, once: bool) -> int:
    """How many readers read ``events`` (the rest of the job runs at ``parallelism`` regardless).

    A Kafka topic: ``parallelism`` (each partition by one reader, in offset order; a user's records keep their
    order when the producer keys them by user, as a partition is the only order Kafka has). A file read once
    from its start: ``parallelism`` byte ranges (:func:`file_splits`), each user's runs put back in line order
    before the keyed step (line numbers as event time, a watermark per reader). One reader otherwise: a paced
    or checkpointed run (Flink's ``FileSource`` keeps its position in the checkpoints; a split read does not),
    and a job with stream tasks (their steps take Flink's watermarks, which line numbers must not drive).
    """
    if parallelism <= 1 or job.stream_tasks:
        return 1
    if kafka_topic(events) is not None:
        return parallelism
    return parallelism if once else 1


def _open_events(events: str | os.PathLike[str], fmt: str | None) -> LineSource:
    """The format of ``events``: a file's (:func:`open_source`), or ``fmt`` for a ``kafka://TOPIC``."""
    if kafka_topic(events) is None:
        return open_source(events, fmt)
    if fmt is None:
        raise ValueError(f"the format of {events} cannot be told from a file extension; "
                         f"pass the format (--format) explicitly: one of {', '.join(FORMATS)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown event format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return FORMATS[fmt](os.fspath(events))


def _event_lines(env: StreamExecutionEnvironment, events: str | os.PathLike[str]) -> DataStream:
    """The raw lines of ``events``, read by one reader (``ParseLines`` numbers them in that order), each line's
    bytes as Latin-1 characters: every byte sequence reads, and ``ParseLines`` decodes it as the device does."""
    topic = kafka_topic(events)
    if topic is not None:
        return kafka_lines(env, topic, charset=LINE_CHARSET)
    text_lines = StreamFormat.text_line_format(LINE_CHARSET)
    return env.from_source(FileSource.for_record_stream_format(text_lines, str(Path(events).resolve())).build(),
                           WatermarkStrategy.no_watermarks(), "events").set_parallelism(1)


def _line_count(path: str | os.PathLike[str]) -> int | None:
    """How many lines Flink's file source gives for ``path``, read as its text line format reads them
    (``BufferedReader.readLine``: ``\\n``, ``\\r\\n`` and a lone ``\\r`` end a line), or ``None``
    when it cannot be told here (a file the source decompresses, a file this process cannot read)."""
    jvm = get_gateway().jvm
    name = str(Path(path).resolve())
    try:
        if jvm.org.apache.flink.connector.file.src.compression.StandardDeCompressors \
                .getDecompressorForFileName(name) is not None:
            return None
        io = jvm.java.io
        reader = io.BufferedReader(io.InputStreamReader(io.FileInputStream(name), LINE_CHARSET))
        try:
            return int(reader.lines().count())
        finally:
            reader.close()
    except Exception:  # noqa: BLE001 - py4j errors; lines then go one per record, nothing is lost
        return None


def _summary(job: Job, db_path: Path, report_path: Path, elapsed_s: float) -> RunSummary:
    report = json.loads(report_path.read_text(encoding="utf-8"))
    summary = RunSummary(db_path=str(db_path), events_in=report["events_in"], elapsed_s=elapsed_s,
                         rows_written=report["rows_written"], rejected=Counter(report["rejected"]),
                         refused_rows=report["refused"])
    for task in job.tasks:
        counts = report["tasks"].get(task.name, {})
        summary.task_stats[task.name] = TaskStats(fired=counts.get("fired", 0), rows=counts.get("rows", 0),
                                                  errors=counts.get("errors", 0),
                                                  quarantined=task.name in report.get("quarantined", ()))
        summary.tasks_fired += counts.get("fired", 0)
    return summary
