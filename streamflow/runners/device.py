"""The device runner: a job's tasks over one device's event stream, embedded, no JVM, no broker.

Per event: check its timestamp, append it to the user's sequences, step the user's trie state;
every task whose trigger condition completes runs its pipeline over the input it asked for, and
its rows go to collective storage.

Isolation: every task gets its own copy of its pipeline (operator state is never shared between
tasks) and writes its own table. A task's exception is caught and stored in ``task_errors`` with
the triggering event; the other tasks and the stream go on. After ``quarantine_after`` consecutive
failures the task is quarantined: unregistered from the trie and reported in the summary.

When several tasks fire on one event they run concurrently on a small worker pool (useful when
their operators release the GIL, as model inference does); the runner waits for all of them
before the next event, so every task sees the user's events in order and output order is
deterministic. A single fired task runs inline.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from connectors.storage import DEAD_LETTER_TABLE, CollectiveStorage
from streamflow.events import Event, Rejected, TimestampGuard
from streamflow.execution import TaskExecution, UserState
from streamflow.job import Job, Task

log = logging.getLogger("streamflow.device")

TASK_ERRORS_TABLE = "task_errors"
#: Tables the runner itself writes: refused records and task failures.
SYSTEM_TABLES = (DEAD_LETTER_TABLE, TASK_ERRORS_TABLE)


@dataclass
class TaskStats:
    fired: int = 0
    rows: int = 0
    errors: int = 0
    consecutive_errors: int = 0
    quarantined: bool = False


@dataclass
class RunSummary:
    """What a run did; ``str()`` is the human-readable report the CLI prints."""

    db_path: str
    events_in: int = 0
    tasks_fired: int = 0
    rows_written: dict[str, int] = field(default_factory=dict)
    rejected: Counter[str] = field(default_factory=Counter)
    task_stats: dict[str, TaskStats] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    @property
    def quarantined(self) -> list[str]:
        return [name for name, s in self.task_stats.items() if s.quarantined]

    def __str__(self) -> str:
        rate = self.events_in / self.elapsed_s if self.elapsed_s > 0 else 0.0
        lines = [
            f"events in        {self.events_in:,}  ({rate:,.0f} events/s)",
            f"tasks fired      {self.tasks_fired:,}",
            f"rows written     {sum(n for t, n in self.rows_written.items() if t not in SYSTEM_TABLES):,}  "
            f"to {self.db_path}",
        ]
        for name, stats in self.task_stats.items():
            state = "  QUARANTINED" if stats.quarantined else ""
            lines.append(f"  task {name:<18} fired {stats.fired:>7,}  rows {stats.rows:>7,}  "
                         f"errors {stats.errors:,}{state}")
        lines.append(f"rejected records {self.rejected_total:,}" +
                     (f"  (in table {DEAD_LETTER_TABLE})" if self.rejected_total else ""))
        for reason, n in self.rejected.most_common():
            lines.append(f"  {n:>7,}  {reason}")
        errors = sum(s.errors for s in self.task_stats.values())
        if errors:
            lines.append(f"task errors      {errors:,}  (in table {TASK_ERRORS_TABLE})")
        return "\n".join(lines)



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
                 guard: TimestampGuard | None = None, record_latency: bool = False):
        if quarantine_after < 1:
            raise ValueError(f"quarantine_after must be >= 1, got {quarantine_after}")
        self.job = job
        self.storage = storage
        self.workers = workers
        self.quarantine_after = quarantine_after
        self.execution = TaskExecution()
        self.trie = self.execution.trie
        self.summary = RunSummary(db_path=str(storage.path))
        self.latencies_s: list[float] | None = [] if record_latency else None
        self._guard = guard or TimestampGuard()
        self._users: dict[str, UserState] = {}
        self._pool: ThreadPoolExecutor | None = None
        for task in job.tasks:
            self.register(task)

    # -- tasks at run time -----------------------------------------------------------------------
    def register(self, task: Task) -> None:
        """Start running ``task`` (from the next event on)."""
        self.execution.register(task)
        self.summary.task_stats.setdefault(task.name, TaskStats())

    def unregister(self, name: str) -> None:
        """Stop running task ``name``."""
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
        finally:
            self.summary.elapsed_s += time.perf_counter() - started
            self.storage.flush()
            self.summary.rows_written = dict(self.storage.rows_written)
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
                                 json.dumps(event.to_dict(), default=str)))
            return
        summary.events_in += 1
        user = self._users.get(event.user_id)
        if user is None:
            user = self._users[event.user_id] = self.execution.new_user()
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

    def _record(self, name: str, event: Event, outcome: list[dict[str, Any]] | BaseException) -> None:
        stats = self.summary.task_stats[name]
        stats.fired += 1
        self.summary.tasks_fired += 1
        if not isinstance(outcome, BaseException):
            stats.consecutive_errors = 0
            if outcome:
                stats.rows += len(outcome)
                self.storage.write(self.execution.tasks[name].sink, outcome)
            return
        stats.errors += 1
        stats.consecutive_errors += 1
        error = f"{type(outcome).__name__}: {outcome}"
        self.storage.write(TASK_ERRORS_TABLE, [{
            "task": name, "user_id": event.user_id, "trigger_ts": event.ts,
            "trigger_event": json.dumps(event.to_dict(), default=str), "error": error,
            "traceback": "".join(traceback.format_exception(outcome)),
        }])
        log.warning("task %s failed on %s of user %s at ts=%s: %s", name, event.event_id, event.user_id,
                    event.ts, error)
        if stats.consecutive_errors >= self.quarantine_after:
            stats.quarantined = True
            self.unregister(name)
            log.error("task %s quarantined after %d consecutive failures; last: %s", name,
                      stats.consecutive_errors, error)

    def close(self) -> None:
        """Flush storage and stop the worker pool (storage stays open for reading)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.storage.flush()
        self.summary.rows_written = dict(self.storage.rows_written)
