"""The device runner: a job's tasks over one device's event stream, embedded, no JVM, no broker.

Per event: check its timestamp, append it to the user's sequences, step the user's trie state;
every task whose trigger condition completes runs its pipeline over the input it asked for, and
its rows go to collective storage. Records are taken in blocks of ``block_size`` (see
:meth:`DeviceRunner.process_block`): the trigger tasks step a block in one call and its rows are
written once per table, in order; ``block_size=1`` hands every event over on its own (a live stream).

Execution model: the job's trigger tasks are one keyed process function
(:class:`~streamflow.execution.TriggerTasks`), each stream task another, each run by a
:class:`~streamflow.keyed.KeyedRuntime` (state in dicts, timers in a heap), keyed by user.

Bounded state: ``state_ttl_s`` drops a user's state (trie position, sequences, last timestamp) after
that long of stream time without an event of the user; ``max_users`` caps the users held in memory,
evicting the least recently seen (counted in the summary's ``evicted_users``).

Isolation: every task gets its own copy of its pipeline (operator state is never shared between
tasks) and writes its own table. A task's exception is caught and stored in ``task_errors`` with
the triggering event; the other tasks and the stream go on. After ``quarantine_after`` consecutive
failures the task is quarantined: unregistered from the trie and reported in the summary.

With a ``tunnel`` (a :class:`~connectors.tunnel.sink.TunnelSink`), the feature rows of every task
(but those with ``tunnel=False``) are also shipped to the cloud over Kafka; dead letters, task
errors and late events stay on the device.

Stream tasks (``input="stream"``) see every event and close event-time windows as the watermark
passes them (:mod:`streamflow.windowing`); their late events go to ``late_events``.

When several tasks fire on one event they run concurrently on a small worker pool (useful when
their operators release the GIL, as model inference does); the runner waits for all of them
before the next event, so every task sees the user's events in order and output order is
deterministic. A single fired task runs inline.

**Checkpoints** (``checkpoint_interval_s``): the run's whole state (every keyed runtime, the
timestamp guard, the summary counters, the source's position and per-user adapter state) is stored
in the storage's DuckDB file every ``checkpoint_interval_s`` seconds, when the storage's buffers are
due a flush, at the end of the input (marked complete) and on SIGTERM/SIGINT (then the run stops),
each time in one transaction with the rows buffered since the previous checkpoint
(:mod:`streamflow.checkpoint`). A run of the same job over the same file into the same DuckDB file
resumes from the checkpoint: the rows come out as if the run had never stopped, none missing and
none twice. Not covered: operators that keep state between firings (``Train``; such jobs are
refused) and rows already shipped to the tunnel (a resumed run ships the rows after the checkpoint
again).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from connectors.storage import DEAD_LETTER_TABLE, CollectiveStorage, to_json
from streamflow.checkpoint import Checkpoint, CheckpointError, has_checkpoint, job_fingerprint, load_checkpoint
from streamflow.events import Event, Rejected, TimestampGuard
from streamflow.execution import TaskExecution, TriggerTasks, task_error_row
from streamflow.job import Job, Task
from streamflow.keyed import KeyedRuntime
from streamflow.sources import LineSource, SourcePosition, SourceReader
from streamflow.summary import TASK_ERRORS_TABLE, RunSummary, TaskStats
from streamflow.windowing import StreamTaskRun

if TYPE_CHECKING:
    from connectors.tunnel.sink import TunnelSink

log = logging.getLogger("streamflow.device")
#: Records processed per block (see DeviceRunner.process_block).
BLOCK_SIZE = 64
_user_of = attrgetter("user_id")
_ts_of = attrgetter("ts")


class DeviceRunner:
    """Runs a job embedded, writing feature rows to collective storage.

    Example:
        >>> import os, tempfile
        >>> from operators import Aggregate, Count
        >>> from connectors import CollectiveStorage
        >>> job = Job("demo", [Task("favs", ["fav"], [Aggregate(n=Count())], input="recent")])
        >>> store = CollectiveStorage(os.path.join(tempfile.mkdtemp(), "f.duckdb"))
        >>> runner = DeviceRunner(job, store)
        >>> summary = runner.run([Event("u", "fav", "item", 1.6e9), Event("u", "fav", "item", 1.6e9 + 1)])
        >>> store.query("SELECT user_id, n FROM favs ORDER BY trigger_ts")
        [('u', 1), ('u', 2)]
        >>> runner.close()
    """

    def __init__(self, job: Job, storage: CollectiveStorage, workers: int = 2, quarantine_after: int = 5,
                 guard: TimestampGuard | None = None, record_latency: bool = False, tunnel: TunnelSink | None = None,
                 max_users: int | None = None, state_ttl_s: float | None = None,
                 checkpoint_interval_s: float | None = None, block_size: int = BLOCK_SIZE):
        if checkpoint_interval_s is not None and not checkpoint_interval_s > 0:
            raise ValueError(f"checkpoint_interval_s must be > 0 seconds, got {checkpoint_interval_s!r}")
        if checkpoint_interval_s is not None:
            stateful = [f"{task.name}: {type(op).__name__}" for task in job.tasks for op in task.pipeline
                        if getattr(op, "keeps_state", False)]
            if stateful:
                raise ValueError(f"checkpoints do not cover operators that keep state between firings "
                                 f"({', '.join(stateful)}); run this job without checkpoints")
        self.job = job
        self.storage = storage
        self.tunnel = tunnel
        self.workers = workers
        self.execution = TaskExecution(quarantine_after=quarantine_after)
        self.trie = self.execution.trie
        self.triggers = KeyedRuntime(TriggerTasks(self.execution, workers, state_ttl_s), max_keys=max_users)
        self.summary = RunSummary(db_path=str(storage.path), task_stats=self.execution.stats)
        self.latencies_s: list[float] | None = [] if record_latency else None
        self.guard = guard or TimestampGuard(state_ttl_s=state_ttl_s)
        self._own_guard = guard is None
        #: Events that already passed an equal guard in their source (see ``LineSource.events_checked``)
        #: skip the runner's; set per run.
        self._prechecked = False
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._streams: dict[str, StreamTaskRun] = {}
        self._shipped: set[str] = set()  # sink tables whose rows also go to the tunnel
        self.max_users = max_users
        self.state_ttl_s = state_ttl_s
        self.checkpoint_interval_s = checkpoint_interval_s
        self.checkpoints_taken = 0
        self._next_checkpoint = float("inf")  # monotonic time of the next checkpoint
        self._stop_signal: int | None = None
        self._input: dict[str, Any] = {}
        for task in job.tasks:
            self.register(task)

    # -- tasks at run time -----------------------------------------------------------------------
    def register(self, task: Task) -> None:
        """Start running ``task`` (from the next event on)."""
        if task.input == "stream":
            if task.name in self._streams or task.name in self.execution.tasks:
                raise ValueError(f"task {task.name!r} is already registered")
            self._streams[task.name] = StreamTaskRun(task, self.max_users)
            self.summary.task_stats[task.name] = TaskStats()
        elif task.name in self._streams:
            raise ValueError(f"task {task.name!r} is already registered")
        else:
            self.execution.register(task)
        self.storage.name_writer(task.sink, f"task {task.name}")
        if task.tunnel:
            self._shipped.add(task.sink)

    def unregister(self, name: str) -> None:
        """Stop running task ``name``."""
        if self._streams.pop(name, None) is None:
            self.execution.unregister(name)

    # -- the stream --------------------------------------------------------------------------
    def run(self, records: Iterable[Event | Rejected] | LineSource,
            progress: Callable[[Iterable[Any]], Iterator[Any]] | None = None) -> RunSummary:
        """Process every record (events and rejected records) and flush storage.

        ``progress`` wraps the record iterator (e.g. :func:`streamflow.progress.track`). With
        checkpoints, ``records`` must be a :class:`~streamflow.sources.LineSource` (a file, whose
        position is checkpointed): the run resumes from the job's checkpoint in the storage, if any.
        Without, a storage holding a checkpoint of the job is refused (a run would duplicate its rows).
        """
        self._started = time.perf_counter()
        reader = None
        source = records
        if self.checkpoint_interval_s is None:
            if has_checkpoint(self.storage, self.job.name):
                raise CheckpointError(f"{self.storage.path} holds a checkpoint of job {self.job.name!r}: resume it "
                                      f"with checkpoints on (--checkpoint-interval), or start over with --replace")
        else:
            records = reader = self._resume(records)
        if progress is not None:
            records = progress(records)
        # With a TTL the two guards may forget a user at different times: both check then.
        self._prechecked = (self._own_guard and isinstance(source, LineSource) and source.events_checked
                            and source.guard is None and source.state_ttl_s is None and self.state_ttl_s is None)
        try:
            self._run_blocks(records, reader)
            self.finish()
            if reader is not None:
                self.checkpoint(reader.position_after(None), complete=True)
                self.storage.release()
        finally:
            self.summary.elapsed_s += time.perf_counter() - self._started
            self._count()
            self.storage.flush()
            self.summary.rows_written = dict(self.storage.rows_written)
            self.summary.refused_rows = dict(self.storage.refused)
        return self.summary

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self, position: SourcePosition, complete: bool = False) -> None:
        """Store the run's state at ``position`` with the rows buffered so far, in one transaction."""
        state = None if complete else {
            "triggers": self.triggers.snapshot(),
            "streams": {name: stream.runtime.snapshot() for name, stream in self._streams.items()},
            "guard": self.guard.snapshot(),
            "summary": {"events_in": self.summary.events_in, "rejected": self.summary.rejected,
                        "task_stats": self.summary.task_stats,
                        "elapsed_s": self.summary.elapsed_s + time.perf_counter() - self._started},
            "rows_written": self.storage.rows_written,  # pickled inside the commit: after refusals are counted
            "source": position,
        }
        saved = Checkpoint(self.job.name, job_fingerprint(self.job), self._input, complete, position.line, state)
        self.storage.commit(saved.save)
        self.checkpoints_taken += 1
        log.debug("checkpoint %d of job %s after line %d%s", self.checkpoints_taken, self.job.name, position.line,
                  " (complete)" if complete else "")
        self._next_checkpoint = time.monotonic() + self.checkpoint_interval_s

    def _resume(self, source: Iterable[Event | Rejected] | LineSource) -> SourceReader:
        """Restore the job's checkpoint, if any; hold the storage's rows for checkpoints; the reader."""
        if not isinstance(source, LineSource):
            raise TypeError("a checkpointed run reads a file source (streamflow.sources.open_source), whose "
                            f"position it can checkpoint, not a {type(source).__name__}")
        self._input = source.identity()
        saved = load_checkpoint(self.storage, self.job.name)
        position = None
        if saved is not None:
            saved.check(self.job, self._input, self.storage.path)
            self._restore(saved.state)
            position = saved.state["source"]
            log.info("job %s resumes from its checkpoint after line %d of %s", self.job.name, saved.line,
                     source.name)
        self.storage.hold(self._checkpoint_due)
        self._next_checkpoint = time.monotonic() + self.checkpoint_interval_s
        return source.read(position)

    def _restore(self, state: dict[str, Any]) -> None:
        self.triggers.restore(state["triggers"])
        for name, snapshot in state["streams"].items():
            self._streams[name].runtime.restore(snapshot)
        self.guard.restore(state["guard"])
        saved = state["summary"]
        self.summary.events_in, self.summary.rejected = saved["events_in"], saved["rejected"]
        self.summary.elapsed_s = saved["elapsed_s"]
        for name, stats in saved["task_stats"].items():
            vars(self.summary.task_stats[name]).update(vars(stats))  # the same objects the execution counts in
            if stats.quarantined and name in self.execution.tasks:
                self.execution.unregister(name)
        self.storage.rows_written.clear()
        self.storage.rows_written.update(state["rows_written"])

    def _run_blocks(self, records: Iterable[Event | Rejected], reader: SourceReader | None) -> None:
        """The record loop: records in blocks of ``block_size`` (see :meth:`process_block`); with a
        ``reader``, checkpoints between blocks, and SIGTERM/SIGINT checkpoint, then stop."""
        handlers = {}
        if reader is not None and threading.current_thread() is threading.main_thread():
            handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        size, it = self.block_size, iter(records)
        self._block_started = time.perf_counter()
        try:
            while block := list(islice(it, size)):
                self.process_block(block)
                if reader is not None and time.monotonic() >= self._next_checkpoint:
                    self._checkpoint_between(reader, block[-1])
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _checkpoint_between(self, reader: SourceReader, record: Event | Rejected) -> None:
        self.checkpoint(reader.position_after(record))
        if self._stop_signal is not None:
            log.info("job %s stopped by signal %d after a checkpoint", self.job.name, self._stop_signal)
            if self._stop_signal == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + self._stop_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        # Only flags: the checkpoint is taken between records, never in the middle of one.
        self._stop_signal = signum
        self._next_checkpoint = float("-inf")

    def _checkpoint_due(self) -> None:
        self._next_checkpoint = float("-inf")

    def reject(self, record: Rejected) -> None:
        """Store a rejected record in the dead-letter table and count it."""
        self.summary.rejected[record.reason.split(":", 1)[0]] += 1
        log.debug("rejected %s", record.describe())
        self.storage.write(DEAD_LETTER_TABLE, [
            {"source": record.source, "line": record.line, "reason": record.reason, "raw": record.raw}
        ])

    def process_block(self, records: list[Event | Rejected]) -> None:
        """Process a block of records (events and rejected records) in order.

        The same as :meth:`process` / :meth:`reject` per record, but the trigger tasks step the whole
        block in one call (:meth:`~streamflow.keyed.KeyedRuntime.process_block`) and its rows are
        written once per table (rows keep their order within each table). With stream tasks every
        event goes through :meth:`process`, so that the rows of both kinds interleave as they come.
        With ``record_latency``, each row's latency is from the end of the previous block (when this
        block's first record was asked for) to the block's rows handed to storage (a buffer flush, when
        one happens, is inside it). A live stream whose events arrive one by one wants ``block_size=1``.
        """
        if self._streams:
            for record in records:
                if isinstance(record, Event):
                    self.process(record)
                else:
                    self.reject(record)
            return
        check = None if self._prechecked else self.guard.check
        events = [record for record in records if type(record) is Event] if check is None else None
        if events is None or len(events) != len(records):  # a guard to ask, or records to reject
            events = self._accept(records, check)
        self.summary.events_in += len(events)
        outputs = self.triggers.process_block(events, _user_of, _ts_of)
        if outputs:
            tables: dict[str, list[dict[str, Any]]] = {}
            for table, row in outputs:
                rows = tables.get(table)
                if rows is None:
                    tables[table] = [row]
                else:
                    rows.append(row)
            for table, rows in tables.items():
                self._write(table, rows)
            if self.latencies_s is not None:
                self.latencies_s.extend([time.perf_counter() - self._block_started] * len(outputs))
        if self.latencies_s is not None:
            self._block_started = time.perf_counter()

    def _accept(self, records: list[Event | Rejected], check: Callable[[str, float], str | None] | None
                ) -> list[Event]:
        """The events of ``records`` that ``check`` accepts, in order; the others go to the dead letter."""
        summary = self.summary
        events: list[Event] = []
        for record in records:
            if not isinstance(record, Event):
                self.reject(record)
            elif check is not None and (reason := check(record.user_id, record.ts)) is not None:
                line = summary.events_in + len(events) + summary.rejected_total + 1  # the record's place in the run
                self.reject(Rejected("runner", line, reason, to_json(record.to_dict())))
            else:
                events.append(record)
        return events

    def process(self, event: Event) -> None:
        """Process one event of any user."""
        started = time.perf_counter() if self.latencies_s is not None else 0.0
        summary = self.summary
        reason = self.guard.check(event.user_id, event.ts) if not self._prechecked else None
        if reason is not None:
            self.reject(Rejected("runner", summary.events_in + summary.rejected_total + 1, reason,
                                 to_json(event.to_dict())))
            return
        summary.events_in += 1
        for stream in self._streams.values():
            try:
                self._write_stream(stream, *stream.process(event))
            except Exception as exc:  # a stream task's failure is data, as a trigger task's is
                self.summary.task_stats[stream.name].errors += 1
                log.warning("stream task %s failed on %s of user %s: %s", stream.name, event.event_id,
                            event.user_id, exc)
                self.storage.write(TASK_ERRORS_TABLE, [task_error_row(stream.name, event, exc)])
        outputs = self.triggers.process(event.user_id, event, round(event.ts * 1000))
        if not outputs:
            return
        for table, row in outputs:
            self._write(table, [row])
        if self.latencies_s is not None:
            self.latencies_s.append(time.perf_counter() - started)

    def finish(self) -> None:
        """End of input: close every stream task's open windows (later events count as late)."""
        for stream in self._streams.values():
            self._write_stream(stream, *stream.finish())
        for table, row in self.triggers.finish():
            self._write(table, [row])

    def _count(self) -> None:
        summary = self.summary
        summary.tasks_fired = sum(stats.fired for stats in summary.task_stats.values())
        summary.evicted_users = self.triggers.evicted + sum(s.runtime.evicted for s in self._streams.values())

    def _write_stream(self, stream: StreamTaskRun, rows: list[dict[str, Any]],
                      sides: list[tuple[str, dict[str, Any]]]) -> None:
        if rows:
            stats = self.summary.task_stats[stream.name]
            stats.fired += len(rows)
            stats.rows += len(rows)
            self._write(stream.sink, rows)
        for table, row in sides:
            self.storage.write(table, [row])

    def _write(self, table: str, rows: list[dict[str, Any]]) -> None:
        self.storage.write(table, rows)
        if self.tunnel is not None and table in self._shipped:
            self.tunnel.write(table, rows)

    def close(self) -> None:
        """Flush storage, seal the tunnel's open batch, stop the worker pool (storage stays open for reading)."""
        self.triggers.function.close()
        if self.tunnel is not None:
            self.tunnel.flush()
        self.storage.flush()
        self.summary.rows_written = dict(self.storage.rows_written)
        self.summary.refused_rows = dict(self.storage.refused)
