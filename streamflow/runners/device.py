"""The device runner: a job's tasks over one device's event stream, embedded, no JVM, no broker.

Per event: check its timestamp, append it to the user's sequences, step the user's trie state;
every task whose trigger condition completes runs its pipeline over the input it asked for, and
its rows go to collective storage.

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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from connectors.storage import DEAD_LETTER_TABLE, CollectiveStorage, to_json
from streamflow.events import Event, Rejected, TimestampGuard
from streamflow.execution import TaskExecution
from streamflow.job import Job, Task
from streamflow.summary import LATE_EVENTS_TABLE, RunSummary, TaskStats
from streamflow.windowing import StreamTaskRun

if TYPE_CHECKING:
    from connectors.tunnel.sink import TunnelSink

log = logging.getLogger("streamflow.device")


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
                 guard: TimestampGuard | None = None, record_latency: bool = False, tunnel: TunnelSink | None = None):
        self.job = job
        self.storage = storage
        self.tunnel = tunnel
        self.workers = workers
        self.execution = TaskExecution(quarantine_after=quarantine_after)
        self.trie = self.execution.trie
        self.summary = RunSummary(db_path=str(storage.path), task_stats=self.execution.stats)
        self.latencies_s: list[float] | None = [] if record_latency else None
        self._guard = guard or TimestampGuard()
        self._streams: dict[str, StreamTaskRun] = {}
        self._shipped: set[str] = set()  # sink tables whose rows also go to the tunnel
        self._pool: ThreadPoolExecutor | None = None
        for task in job.tasks:
            self.register(task)

    # -- tasks at run time -----------------------------------------------------------------------
    def register(self, task: Task) -> None:
        """Start running ``task`` (from the next event on)."""
        if task.input == "stream":
            if task.name in self._streams or task.name in self.execution.tasks:
                raise ValueError(f"task {task.name!r} is already registered")
            self._streams[task.name] = StreamTaskRun(task)
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
    def run(self, records: Iterable[Event | Rejected]) -> RunSummary:
        """Process every record (events and rejected records) and flush storage."""
        started = time.perf_counter()
        try:
            for record in records:
                if isinstance(record, Event):
                    self.process(record)
                else:
                    self.reject(record)
            self.finish()
        finally:
            self.summary.elapsed_s += time.perf_counter() - started
            self.storage.flush()
            self.summary.rows_written = dict(self.storage.rows_written)
            self.summary.refused_rows = dict(self.storage.refused)
        return self.summary

    def reject(self, record: Rejected) -> None:
        """Store a rejected record in the dead-letter table and count it."""
        self.summary.rejected[record.reason.split(":", 1)[0]] += 1
        log.debug("rejected %s", record.describe())
        self.storage.write(DEAD_LETTER_TABLE, [
            {"source": record.source, "line": record.line, "reason": record.reason, "raw": record.raw}
        ])

    def process(self, event: Event) -> None:
        """Process one event of any user."""
        started = time.perf_counter() if self.latencies_s is not None else 0.0
        summary = self.summary
        reason = self._guard.check(event.user_id, event.ts)
        if reason is not None:
            self.reject(Rejected("runner", summary.events_in + summary.rejected_total + 1, reason,
                                 to_json(event.to_dict())))
            return
        summary.events_in += 1
        for stream in self._streams.values():
            self._write_stream(stream, *stream.process(event))
        user = self.execution.user(event.user_id)
        fired = self.execution.step(user, event)
        if not fired:
            return
        run_task = self.execution.run_task
        if len(fired) == 1:
            self._record(fired[0], event, run_task(fired[0], event, user.sequence))
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="streamflow-task")
            futures = [self._pool.submit(run_task, name, event, user.sequence) for name in fired]
            for name, future in zip(fired, futures, strict=True):
                self._record(name, event, future.result())
        if self.latencies_s is not None:
            self.latencies_s.append(time.perf_counter() - started)

    def finish(self) -> None:
        """End of input: close every stream task's open windows (later events count as late)."""
        for stream in self._streams.values():
            self._write_stream(stream, stream.finish(), [])

    def _write_stream(self, stream: StreamTaskRun, rows: list[dict[str, Any]], late: list[dict[str, Any]]) -> None:
        if rows:
            stats = self.summary.task_stats[stream.name]
            stats.fired += len(rows)
            stats.rows += len(rows)
            self.summary.tasks_fired += len(rows)
            self._write(stream.sink, rows)
        if late:
            self.storage.write(LATE_EVENTS_TABLE, late)

    def _record(self, name: str, event: Event, outcome: list[dict[str, Any]] | Exception) -> None:
        self.summary.tasks_fired += 1
        table, rows = self.execution.settle(name, event, outcome)
        if rows:
            self._write(table, rows)

    def _write(self, table: str, rows: list[dict[str, Any]]) -> None:
        self.storage.write(table, rows)
        if self.tunnel is not None and table in self._shipped:
            self.tunnel.write(table, rows)

    def close(self) -> None:
        """Flush storage, seal the tunnel's open batch, stop the worker pool (storage stays open for reading)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.tunnel is not None:
            self.tunnel.flush()
        self.storage.flush()
        self.summary.rows_written = dict(self.storage.rows_written)
        self.summary.refused_rows = dict(self.storage.refused)
