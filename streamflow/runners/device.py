"""The device runner: a job's tasks over one device's event stream, embedded, no JVM, no broker.

Per event: check its timestamp, append it to the user's sequences, step the user's trie state;
every task whose trigger condition completes runs its pipeline over the input it asked for, and
its rows go to collective storage. Records are taken in blocks of ``block_size`` (see
:meth:`DeviceRunner.process_block`): the trigger tasks step a block in one call and its rows are
written once per table, in order; ``block_size=1`` hands every event over on its own. By default a
file source is read in blocks and any other iterable (a live stream) one event at a time, so an event
never waits for a block to fill.

``runtime_mode`` (as Flink's): ``streaming`` runs what follows; ``batch`` computes a bounded, clean file
column by column (:mod:`streamflow.runners.batch`, the same rows); ``automatic`` takes batch where it
applies and streams otherwise.

Execution model: the job's trigger tasks are one keyed process function
(:class:`~streamflow.execution.TriggerTasks`), each stream task another, each run by a
:class:`~streamflow.keyed.KeyedRuntime` (state in dicts, timers in a heap), keyed by user.

Bounded state: ``state_ttl_s`` drops a user's state (trie position, sequences, last timestamp) after
that long of stream time without an event of the user; ``max_users`` caps the users held in memory,
evicting the least recently seen (counted in the summary's ``evicted_users``).

Isolation: every task gets its own copy of its pipeline (operator state is never shared between
tasks) and writes its own table. A task's exception is caught and stored in ``task_errors`` with
the triggering event; the other tasks and the stream go on. After ``quarantine_after`` consecutive
failures the task is quarantined: unregistered from the trie and reported in the summary. A stream
task fails per event, per timer and per fired window (:mod:`streamflow.windowing`): its row names the
key and the window, every other row is stored, and a step that fails ``quarantine_after`` times in a
row is quarantined (reported alike).

With a ``tunnel`` (a :class:`~connectors.tunnel.sink.TunnelSink`), the feature rows of every task
(but those with ``tunnel=False``) are also shipped to the cloud over Kafka; dead letters, task
errors and late events stay on the device.

Tasks change while events flow at the *safe point* before each event: :meth:`DeviceRunner.swap_tasks`
(callable from any thread) replaces tasks there, all or nothing, keeping every other task's state
and the users' sequences; safe-point hooks (:meth:`DeviceRunner.add_safe_point_hook`) look at what
the last event did before the next one (deployment judges a new task version that way). Both wait in
:class:`~streamflow.runners.swaps.SafePoint` (``runner.safe_point``); the change of tasks itself is the runner's.

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
again). When a checkpoint is due, where it goes, the resume and the signals are
:class:`~streamflow.runners.checkpointing.Checkpointer`'s (``runner.checkpoints``); what the state holds is the
runner's (:meth:`DeviceRunner.checkpoint`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from itertools import islice
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Literal, get_args

from connectors.json_values import to_json
from connectors.sql import check_table_name
from connectors.storage import DEAD_LETTER_TABLE, CollectiveStorage
from streamflow.events import Event, Rejected, TimestampGuard
from streamflow.execution import TaskExecution, TriggerTasks, task_error_row
from streamflow.job import Job, Task
from streamflow.keyed import KeyedRuntime, rows_by_output
from streamflow.runners.batch import run_batch
from streamflow.runners.batch_streams import run_stream_batch
from streamflow.runners.checkpointing import Checkpointer, refuse_resumable
from streamflow.runners.plan import RunPlan, TriggerTaskPlan
from streamflow.runners.swaps import Hook, SafePoint, TaskSwap
from streamflow.sources import LineSource, SourcePosition, SourceReader
from streamflow.summary import TASK_ERRORS_TABLE, RunSummary, TaskStats
from streamflow.windowing import StreamTaskRun, stream_error_row

if TYPE_CHECKING:
    from connectors.tunnel.sink import TunnelSink

log = logging.getLogger("streamflow.device")
#: Records processed per block (see DeviceRunner.process_block).
BLOCK_SIZE = 64
#: How a run executes (as Flink's ``execution.runtime-mode``): ``streaming`` event by event; ``batch`` the
#: bounded input column by column (:mod:`streamflow.runners.batch`: refused when the job or input does not
#: allow it); ``automatic`` batch where it is allowed, else streaming.
RuntimeMode = Literal["streaming", "batch", "automatic"]
RUNTIME_MODES: tuple[str, ...] = get_args(RuntimeMode)
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
                 checkpoint_interval_s: float | None = None, block_size: int | None = None,
                 runtime_mode: RuntimeMode = "streaming"):
        if runtime_mode not in RUNTIME_MODES:
            raise ValueError(f"runtime_mode must be one of {', '.join(RUNTIME_MODES)}, got {runtime_mode!r}")
        self.runtime_mode = runtime_mode
        #: The run's checkpoints (None: checkpoints are off).
        self.checkpoints = None if checkpoint_interval_s is None else Checkpointer(storage, checkpoint_interval_s)
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
        self._source: Any = None  # what the current run reads
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size  # None: BLOCK_SIZE for a file source, 1 for a live iterable
        self._streams: dict[str, StreamTaskRun] = {}
        self._held: dict[str, list[dict[str, Any]]] | None = None  # rows held for the block's end, by table
        self._shipped: set[str] = set()  # sink tables whose rows also go to the tunnel
        self.max_users = max_users
        self.state_ttl_s = state_ttl_s
        #: The tasks this runner runs, by name (quarantined ones included); see :meth:`swap_tasks`.
        self.tasks: dict[str, Task] = {}
        #: Where swaps and safe-point hooks wait for the safe point between two events.
        self.safe_point = SafePoint(self._replace)
        self._replace((), job.tasks, initial=True)

    # -- tasks at run time -----------------------------------------------------------------------
    def register(self, task: Task) -> None:
        """Start running ``task`` (from the next event on); from the thread that feeds the events."""
        self._replace((), [task])

    def unregister(self, name: str) -> None:
        """Stop running task ``name``; from the thread that feeds the events."""
        self._replace([name], ())

    def swap_tasks(self, add: Iterable[Task] = (), remove: Iterable[str] = (),
                   on_applied: Callable[[], None] | None = None) -> TaskSwap:
        """Replace tasks at the safe point between two events; callable from any thread.

        During :meth:`run` the swap is applied before the next event (so no event is seen by neither
        version, nor by both); outside a run it is applied at once. Either way it is all or nothing:
        a refused swap (an unknown name, a name clash, an operator checkpoints cannot hold) changes
        nothing and leaves its error on the returned :class:`TaskSwap`. ``on_applied`` is called right
        after a swap is applied, at the same safe point (before any event reaches the new tasks).

        What is kept: every task not named keeps its state, and so do the users' sequences and trie
        positions (a new version of a trigger task goes on matching its condition where the old one
        was, and its input includes events from before the swap; a runner that had no trigger task keeps no
        sequences, so a trigger task added to it sees the events from the swap on). A replaced stream task's open
        windows fire as at the end of the input (their events are counted in the old version's rows);
        the new version starts with empty windows. A name replaced keeps its counters in the summary.

        Example:
            >>> import os, tempfile
            >>> from operators import Aggregate, Count
            >>> from connectors import CollectiveStorage
            >>> store = CollectiveStorage(os.path.join(tempfile.mkdtemp(), "f.duckdb"))
            >>> runner = DeviceRunner(Job("demo", [Task("favs", ["fav"], [Aggregate(n=Count())])]), store)
            >>> swap = runner.swap_tasks(add=[Task("favs", ["fav"], [Aggregate(n=Count(), m=Count())])],
            ...                          remove=["favs"])
            >>> swap.wait(1.0), swap.error, runner.job.task_names()
            (True, None, ['favs'])
            >>> runner.close()
        """
        return self.safe_point.request(add, remove, on_applied)

    def add_safe_point_hook(self, hook: Hook) -> None:
        """Call ``hook()`` at every safe point from now on (before each event, on the thread that feeds
        them, before pending swaps are applied) until it returns False.

        A hook watches what the last event did and may react before the next one: a swap it requests
        is applied at this same safe point. It must be quick; it runs once per event.
        """
        self.safe_point.add_hook(hook)

    def _replace(self, remove: Sequence[str], add: Sequence[Task], initial: bool = False) -> None:
        """Remove and add tasks as one change; everything is checked before anything changes."""
        remove, add = list(dict.fromkeys(remove)), list(add)
        unknown = [name for name in remove if name not in self.tasks]
        if unknown:
            raise ValueError(f"tasks {unknown} are not running")
        names = [task.name for task in add]
        staying = self.tasks.keys() - set(remove)
        clash = sorted({name for name in names if name in staying or names.count(name) > 1})
        if clash:
            raise ValueError(f"tasks {clash} are already running (or named twice)")
        if self.checkpoints is not None:
            self.checkpoints.check_tasks(add)
        for task in add:
            check_table_name(task.sink)
        streams = {task.name: StreamTaskRun(task, self.max_users, self.execution.quarantine_after)
                   for task in add if task.input == "stream"}
        self.execution.replace([name for name in remove if name in self.execution.tasks],
                               [task for task in add if task.input != "stream"])
        for name in remove:
            stream = self._streams.pop(name, None)
            if stream is not None:
                self._write_stream(stream, *stream.finish())
            del self.tasks[name]
        for task in add:
            self.tasks[task.name] = task
            if task.name in streams:
                self._streams[task.name] = streams[task.name]
                stats = self.summary.task_stats.setdefault(task.name, TaskStats())
                stats.consecutive_errors, stats.quarantined = 0, False  # a new version starts afresh
            self.storage.name_writer(task.sink, f"task {task.name}")
        self._shipped = {task.sink for task in self.tasks.values() if task.tunnel}
        if not initial:
            job = Job(self.job.name, list(self.tasks.values()), self.job.description)
            job.module = self.job.module
            self.job = job

    # -- the stream --------------------------------------------------------------------------
    def run(self, records: Iterable[Event | Rejected] | LineSource,
            progress: Callable[[Iterable[Any]], Iterator[Any]] | None = None) -> RunSummary:
        """Process every record (events and rejected records) and flush storage.

        ``progress`` wraps the record iterator (e.g. :func:`streamflow.progress.track`); one with a
        ``blocks`` method (:class:`streamflow.progress.Track`) wraps the iterator of blocks (lists of
        records) instead, so that a file source can hand its records over a block at a time. With
        checkpoints, ``records`` must be a :class:`~streamflow.sources.LineSource` (a file, whose
        position is checkpointed): the run resumes from the job's checkpoint in the storage, if any.
        Without, a storage holding a checkpoint of the job is refused (a run would duplicate its rows).
        """
        self._started = time.perf_counter()
        with self.safe_point.run():  # swaps wait for the safe point between two events, and after the last
            return self._run(records, progress)

    def _run(self, records: Iterable[Event | Rejected] | LineSource,
             progress: Callable[[Iterable[Any]], Iterator[Any]] | None) -> RunSummary:
        reader = None
        source = self._source = records
        if self.checkpoints is None:
            refuse_resumable(self.storage, self.job)
        else:
            records = reader = self.checkpoints.resume(self.job, records, self._restore)
        # With a TTL the two guards may forget a user at different times: both check then.
        self._prechecked = (self._own_guard and isinstance(source, LineSource) and source.events_checked
                            and source.guard is None and source.state_ttl_s is None and self.state_ttl_s is None)
        try:
            if self.runtime_mode != "streaming" and reader is None and self._run_batch(source, progress):
                return self.summary
            self.summary.runtime_mode = "streaming"
            self._run_blocks(records, reader, progress)
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

    def plan(self) -> RunPlan:
        """The run as a batch mode takes it (:class:`~streamflow.runners.plan.RunPlan`): the trigger tasks with
        their own pipelines, the stream tasks' steps, the guard and what only streaming honours.

        Example:
            >>> import os, tempfile
            >>> from operators import Aggregate, Count
            >>> from connectors import CollectiveStorage
            >>> store = CollectiveStorage(os.path.join(tempfile.mkdtemp(), "f.duckdb"))
            >>> plan = DeviceRunner(Job("demo", [Task("favs", ["fav"], [Aggregate(n=Count())])]), store).plan()
            >>> list(plan.triggers), list(plan.streams), plan.swaps_or_hooks
            (['favs'], [], False)
        """
        execution = self.execution
        return RunPlan(
            job=self.job.name,
            triggers={name: TriggerTaskPlan(task, execution.pipeline(name)) for name, task in execution.tasks.items()},
            streams=dict(self._streams), guard=self.guard, default_guard=self._own_guard,
            checkpoint_interval_s=self.checkpoint_interval_s, state_ttl_s=self.state_ttl_s, max_users=self.max_users,
            tunnel=self.tunnel is not None, record_latency=self.latencies_s is not None,
            swaps_or_hooks=self.safe_point.waiting, run_task=execution.run_task)

    def _run_batch(self, source: Iterable[Event | Rejected] | LineSource,
                   progress: Callable[[Iterable[Any]], Iterator[Any]] | None = None) -> bool:
        """Run in batch mode if the job and input allow it (see :mod:`streamflow.runners.batch`, and
        :mod:`streamflow.runners.batch_streams` for a job of stream tasks): whether it ran."""
        if self._streams and not self.execution.tasks:
            refusal = run_stream_batch(self, source, progress)
        else:
            refusal = run_batch(self, source)
        if refusal is None:
            log.info("job %s ran in batch mode", self.job.name)
            return True
        if self.runtime_mode == "batch":
            raise ValueError(f"batch mode cannot run job {self.job.name!r}: {refusal}")
        log.info("job %s streams: batch mode does not apply (%s)", self.job.name, refusal)
        return False

    # -- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoint_interval_s(self) -> float | None:
        """Seconds between two checkpoints (None: checkpoints are off)."""
        return None if self.checkpoints is None else self.checkpoints.interval_s

    def checkpoint(self, position: SourcePosition, complete: bool = False) -> None:
        """Store the run's state at ``position`` with the rows buffered so far, in one transaction (a run with
        checkpoints on takes them itself: see :class:`~streamflow.runners.checkpointing.Checkpointer`)."""
        if self.checkpoints is None:
            raise ValueError("this runner has checkpoints off (checkpoint_interval_s=None)")
        state = None if complete else {
            "triggers": self.triggers.snapshot(),
            "streams": {name: stream.runtime.snapshot() for name, stream in self._streams.items()},
            "stream_steps": {name: stream.steps_state() for name, stream in self._streams.items()},
            "guard": self.guard.snapshot(),
            "summary": {"events_in": self.summary.events_in, "rejected": self.summary.rejected,
                        "task_stats": self.summary.task_stats,
                        "elapsed_s": self.summary.elapsed_s + time.perf_counter() - self._started},
            "rows_written": self.storage.rows_written,  # pickled inside the commit: after refusals are counted
            "source": position,
        }
        self.checkpoints.save(self.job, position, state, complete)

    def _restore(self, state: dict[str, Any]) -> None:
        """Put the state of a checkpoint (as :meth:`checkpoint` stores it) back in place."""
        self.triggers.restore(state["triggers"])
        for name, snapshot in state["streams"].items():
            self._streams[name].runtime.restore(snapshot)
        for name, steps in state.get("stream_steps", {}).items():  # (checkpoints from before it had none)
            self._streams[name].restore_steps(steps)
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

    def _run_blocks(self, records: Iterable[Event | Rejected], reader: SourceReader | None,
                    progress: Callable[[Iterable[Any]], Iterator[Any]] | None = None) -> None:
        """The record loop: records in blocks of ``block_size`` (see :meth:`process_block`); with a
        ``reader``, checkpoints between blocks, and SIGTERM/SIGINT checkpoint, then stop.

        A file source hands its records over a block at a time (:meth:`SourceReader.blocks`: each block
        ends with a line's last record) unless ``block_size`` is 1 or ``progress`` wraps the records one
        by one (a progress with a ``blocks`` method wraps the blocks instead, see :meth:`run`)."""
        checkpoints = self.checkpoints
        self._block_started = time.perf_counter()
        with checkpoints.signals() if checkpoints is not None and reader is not None else nullcontext():
            for block in self.blocks(records, progress):
                self.process_block(block)
                if reader is not None and checkpoints is not None and checkpoints.due:
                    self.checkpoint(reader.position_after(block[-1]))
                    checkpoints.stop_if_signalled(self.job)

    def blocks(self, records: Iterable[Event | Rejected] | LineSource | SourceReader,
               progress: Callable[[Iterable[Any]], Iterator[Any]] | None = None) -> Iterator[list[Event | Rejected]]:
        """``records`` in blocks of ``block_size`` records, as the record loop takes them (see :meth:`_run_blocks`)."""
        size = self.block_size or (BLOCK_SIZE if isinstance(self._source, LineSource) else 1)
        wrap_blocks = getattr(progress, "blocks", None)  # a progress that counts blocks (progress.Track)
        if size > 1 and isinstance(records, (LineSource, SourceReader)) and (progress is None or callable(wrap_blocks)):
            blocks = (records if isinstance(records, SourceReader) else records.read()).blocks(size)
            return iter(blocks if wrap_blocks is None else wrap_blocks(blocks))
        it = iter(records if progress is None else progress(records))
        return iter(lambda: list(islice(it, size)), [])

    def reject(self, record: Rejected) -> None:
        """Store a rejected record in the dead-letter table and count it."""
        self.summary.rejected[record.reason.split(":", 1)[0]] += 1
        log.debug("rejected %s", record.describe())
        self.write(DEAD_LETTER_TABLE, [
            {"source": record.source, "line": record.line, "reason": record.reason, "raw": record.raw}
        ])

    def process_block(self, records: list[Event | Rejected]) -> None:
        """Process a block of records (events and rejected records) in order.

        The same as :meth:`process` / :meth:`reject` per record, but the trigger tasks step the whole
        block in one call (:meth:`~streamflow.keyed.KeyedRuntime.process_block`) and its rows are
        written once per table (rows keep their order within each table). With stream tasks every
        event goes through :meth:`process`, so that the rows of both kinds interleave as they come; so
        does it while a task swap is pending or a safe-point hook watches (a new version on probation is
        judged after every event, not every block).
        With ``record_latency``, each row's latency is from the end of the previous block (when this
        block's first record was asked for) to the block's rows handed to storage (a buffer flush, when
        one happens, is inside it). A live stream whose events arrive one by one wants ``block_size=1``.
        """
        watched = self.safe_point.waiting
        if len(self._streams) == 1 and not (self.execution.tasks or watched or self.latencies_s is not None):
            self._stream_block(records)  # a job of one stream task: its tables are its own
            return
        if self._streams or watched:
            # Rows are held and written once per table at the end of the block, unless something watches
            # each event's effect (a hook, a swap on probation, latency recording).
            hold = not (watched or self.latencies_s is not None)
            held: dict[str, list[dict[str, Any]]] | None = {} if hold else None
            self._held = held
            try:
                for record in records:
                    if isinstance(record, Event):
                        self.process(record)
                    else:
                        self.reject(record)
            finally:
                self._held = None
                if held:
                    for table, rows in held.items():
                        self.write(table, rows)
            return
        events = self.accepted(records)
        outputs = self.triggers.process_block(events, _user_of, _ts_of)
        if outputs:
            for table, rows in rows_by_output(outputs).items():
                self.write(table, rows)
            if self.latencies_s is not None:
                self.latencies_s.extend([time.perf_counter() - self._block_started] * len(outputs))
        if self.latencies_s is not None:
            self._block_started = time.perf_counter()

    def _stream_block(self, records: list[Event | Rejected]) -> None:
        """The block through the job's one stream task in one call; its rows and side rows are written once
        per table, in their order (:meth:`process` for each event writes the same rows)."""
        events = self.accepted(records)
        (stream,) = self._streams.values()
        rows, sides, failed = stream.process_block(events)
        self._write_stream(stream, rows, sides)
        for event, exc in failed:
            self.stream_failed(stream, event, exc)

    def accepted(self, records: list[Event | Rejected]) -> list[Event]:
        """The block's events the guard accepts, counted in; the rejected records and events are dead letters."""
        check = None if self._prechecked else self.guard.check
        events = [record for record in records if type(record) is Event] if check is None else None
        if events is None or len(events) != len(records):  # a guard to ask, or records to reject
            events = self._accept(records, check)
        self.summary.events_in += len(events)
        return events

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
        if self.safe_point.waiting:  # the safe point: between the previous event and this one
            self.safe_point.reach()
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
            except Exception as exc:  # a backstop: each step's failure is caught where it happens
                self.stream_failed(stream, event, exc)
        if not self.execution.tasks:
            return  # a job of stream tasks only: no user sequences or trie state to keep
        outputs = self.triggers.process(event.user_id, event, round(event.ts * 1000))
        if not outputs:
            return
        for table, row in outputs:
            self.write(table, [row])
        if self.latencies_s is not None:
            self.latencies_s.append(time.perf_counter() - started)

    def finish(self) -> None:
        """End of input: close every stream task's open windows (later events count as late)."""
        for stream in self._streams.values():
            try:
                self._write_stream(stream, *stream.finish())
            except Exception as exc:  # a backstop, as in process()
                self.stream_failed(stream, None, exc)
        for table, row in self.triggers.finish():
            self.write(table, [row])

    @property
    def evicted_users(self) -> int:
        """Users whose state was dropped over ``max_users``, trigger and stream tasks (any thread may read it)."""
        return self.triggers.evicted + sum(s.runtime.evicted for s in list(self._streams.values()))

    def _count(self) -> None:
        summary = self.summary
        summary.tasks_fired = sum(stats.fired for stats in summary.task_stats.values())
        summary.evicted_users = self.evicted_users
        for stream in self._streams.values():  # the run of failures at the end (counted per block while it ran)
            stats = summary.task_stats[stream.name]
            if stats.errors:
                stats.consecutive_errors = stream.consecutive_errors

    def _write_stream(self, stream: StreamTaskRun, rows: list[dict[str, Any]],
                      sides: list[tuple[str, dict[str, Any]]]) -> None:
        self.count_stream(stream, len(rows), sides)
        if rows:
            self.write(stream.sink, rows)
        if sides:
            for table, table_rows in rows_by_output(sides).items():
                self.write(table, table_rows)

    def count_stream(self, stream: StreamTaskRun, rows: int, sides: list[tuple[str, dict[str, Any]]]) -> None:
        """Count ``rows`` feature rows and the task's failures among ``sides`` in the summary (as Flink's writer)."""
        stats = self.summary.task_stats[stream.name]
        if rows:
            stats.fired += rows
            stats.rows += rows
        errors = sum(1 for table, row in sides if table == TASK_ERRORS_TABLE and row.get("task") == stream.name)
        if errors:
            stats.errors += errors
            stats.consecutive_errors = stream.consecutive_errors
            stats.quarantined = stats.quarantined or stream.quarantined

    def stream_failed(self, stream: StreamTaskRun, event: Event | None, exc: Exception) -> None:
        """Count and store a stream task's failure past its steps' own handling (``event``: the event it was on)."""
        self.summary.task_stats[stream.name].errors += 1
        log.warning("stream task %s failed%s: %s", stream.name,
                    "" if event is None else f" on {event.event_id} of user {event.user_id}", exc)
        row = task_error_row(stream.name, event, exc) if event is not None else stream_error_row(stream.name, exc)
        self.write(TASK_ERRORS_TABLE, [row])

    def write(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Write ``rows`` to ``table`` (and ship them through the tunnel when the table is a task's that ships);
        held for the block's end while a block holds its rows."""
        held = self._held
        if held is not None:
            if table in held:
                held[table] += rows
            else:
                held[table] = list(rows)
            return
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

