"""The device runner's batch mode for a job of stream tasks: each task's keyed step over the whole bounded input.

Flink runs a DataStream program over bounded input in BATCH execution mode with other operator implementations
and the same results; so does this, for a job whose tasks are all stream tasks:

- the records are read in blocks and checked as when streaming (the source's parse and the runner's timestamp
  guard: the same dead letters, written as they come);
- each event goes through each task's steps before its keyed step (Filter/Map, the key, the event time: the
  streaming code itself, :class:`~streamflow.windowing.StreamInput`, so a step that raises makes the same
  ``task_errors`` row);
- a task whose keyed step is a ``TimeWindow`` or ``CountWindow`` + ``Aggregate`` takes the items of
  ``CHUNK_EVENTS`` events at a time and makes their firings, late firings and late events at once
  (:mod:`streamflow.columnar_windows`: only the items of windows still within their lateness, or a key's last
  count-window items, are carried to the next chunk, so memory is set by the chunk and the windows, not the
  input). Any other keyed step (a session window, a ``Process``) runs item by item as when streaming, in the same
  run;
- every output goes through the steps after the keyed step, and each table gets its rows in the streaming run's
  order (tasks interleaved per event, as when streaming), written a chunk at a time.

No checkpoint is taken: a run stopped before its end is run again with ``--replace``. The summary says how each
task's keyed step ran (:attr:`~streamflow.summary.TaskStats.mode`).

Example:
    >>> import os, tempfile
    >>> from connectors import CollectiveStorage
    >>> from operators import Aggregate, Count, KeyBy, TimeWindow
    >>> from streamflow import Event, Job, Task
    >>> from streamflow.runners import DeviceRunner
    >>> task = Task("n", None, [KeyBy("user_id"), TimeWindow(10), Aggregate(n=Count())], input="stream")
    >>> runner = DeviceRunner(Job("j", [task]), CollectiveStorage(os.path.join(tempfile.mkdtemp(), "f.duckdb")),
    ...                       runtime_mode="batch")
    >>> events = [Event("u", "fav", "item", 1.6e9 + t) for t in (1, 2, 12)]
    >>> summary = runner.run(events)
    >>> summary.runtime_mode, summary.task_stats["n"].mode
    ('batch', 'columnar windows')
    >>> runner.storage.query("SELECT user_id, window_start, n FROM n ORDER BY window_start")
    [('u', 1600000000.0, 2), ('u', 1600000010.0, 1)]
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from operators import CountWindow, TimeWindow
from streamflow.columnar_windows import FAILED, TIME_BOUND, BatchCountWindows, BatchTimeWindows
from streamflow.columnar_windows import refusal as window_refusal
from streamflow.events import Event
from streamflow.runners.plan import BatchHost, RunPlan
from streamflow.sources import LineSource
from streamflow.summary import TASK_ERRORS_TABLE
from streamflow.windowing import StreamTaskRun, stream_error_row

log = logging.getLogger("streamflow.runners")

COLUMNAR = "columnar windows"
#: (position in the input, task index, feature rows, side rows): one event's (or the end's) outputs of one task
Outputs = tuple[int, int, list[dict[str, Any]], list[tuple[str, dict[str, Any]]]]


def refusal(plan: RunPlan, records: Any = ()) -> str | None:
    """Why this batch mode cannot run the job of ``plan`` (:meth:`DeviceRunner.plan()
    <streamflow.runners.device.DeviceRunner.plan>`) over ``records``, or ``None``."""
    if plan.triggers or not plan.streams:
        return "the job is not made of stream tasks only"
    if not isinstance(records, (LineSource, list, tuple)):
        return f"the input is not a file or a list (a {type(records).__name__} may never end)"
    settings = {"checkpoints": plan.checkpoint_interval_s, "a state TTL": plan.state_ttl_s,
                "a cap on users": plan.max_users, "the tunnel": plan.tunnel,
                "latency recording": plan.record_latency,
                "a safe-point hook or task swap": plan.swaps_or_hooks}
    for what, on in settings.items():
        if on:
            return f"the run has {what}"
    reasons = {name: keyed_refusal(run) for name, run in plan.streams.items()}
    if all(reasons.values()):
        return "no stream task has a keyed step batch mode computes at once (" + "; ".join(
            f"{name}: {why}" for name, why in reasons.items()) + ")"
    return None


def keyed_refusal(run: StreamTaskRun) -> str | None:
    """Why ``run``'s keyed step runs item by item in batch mode, or ``None`` (it is computed at once)."""
    window = run.plan.window
    if isinstance(window, CountWindow):
        return None
    if not isinstance(window, TimeWindow):
        return f"{type(window).__name__} runs item by item"
    return window_refusal(window)


#: Events read before each task's keyed step takes them as one block (what a chunk holds is all that is kept of it).
CHUNK_EVENTS = 8192


class _BatchTask:
    """One stream task in batch mode: its steps per event, its keyed step a chunk at a time or item by item."""

    def __init__(self, run: StreamTaskRun, index: int, failed: Callable[[StreamTaskRun, Event, Exception], None],
                 alone: bool):
        self.run, self.index, self._failed = run, index, failed
        self.alone = alone  # the job's only task: no other task's rows to interleave with
        why = keyed_refusal(run)
        plan = run.plan
        self.windows: BatchTimeWindows | None = None
        if why is None:
            window, aggregate, key_name = plan.window, plan.aggregate, plan.key_by.name
            # what keyed_refusal lets through: a count or time window, with its Aggregate (StreamPlan.of)
            assert isinstance(window, (CountWindow, TimeWindow)) and aggregate is not None
            self.windows = (BatchCountWindows(window, aggregate, key_name) if isinstance(window, CountWindow)
                            else BatchTimeWindows(window, aggregate, key_name))
        self.mode = COLUMNAR if why is None else f"item by item: {why}"
        #: what the task made so far and nobody took yet, in order
        self.outputs: list[Outputs] = []

    def take(self, events: list[Event], first: int) -> None:
        """The events at positions ``first``, ``first + 1``... through the task."""
        run, index, outputs = self.run, self.index, self.outputs
        if self.windows is None:
            for k, event in enumerate(events):
                try:
                    rows, sides = run.process(event)
                except Exception as exc:  # a backstop, as when streaming
                    self._failed(run, event, exc)
                    continue
                if rows or sides:
                    outputs.append((first + k, index, rows, sides))
            return
        step, failed = run.input.step, run.input.out
        entries: list[tuple[Any, Any, Any]] = []  # (key, item, event time: None for a count window)
        at: list[int] = []
        keep, place = entries.append, at.append
        for k, event in enumerate(events, first):
            entry = step(event)
            if entry is not None:
                keep(entry)
                place(k)
            elif failed:  # dropped by a Filter (the usual case) or failed
                outputs.append((k, index, [], run.step_failures()))
        if entries and not isinstance(self.windows, BatchCountWindows) and not all(
                -TIME_BOUND < ts < TIME_BOUND for _, _, ts in entries):
            entries, at = self._out_of_range(entries, at)
        numbered = self.windows.seen
        keys, items, times = zip(*entries, strict=True) if entries else ((), (), ())
        self._route(self.windows.add(keys, items, times), lambda n: at[n - numbered])

    def _out_of_range(self, entries: list[tuple[Any, Any, int]], at: list[int]) -> tuple[list[Any], list[int]]:
        """The entries whose event time batch mode can window, and a ``task_errors`` row for each other one (past
        ±2**60 ms, 36 million years: streaming would window it; the one place batch mode differs)."""
        kept, kept_at = [], []
        for entry, k in zip(entries, at, strict=True):
            if -TIME_BOUND < entry[2] < TIME_BOUND:
                kept.append(entry)
                kept_at.append(k)
                continue
            error = ValueError(f"event time {entry[2]} ms is past ±2**60 ms: batch mode does not window it")
            self.outputs.append((k, self.index, [], [(TASK_ERRORS_TABLE, stream_error_row(
                self.run.name, error, entry[1], entry[0]))]))
        self.outputs.sort(key=_position)
        return kept, kept_at

    def finish(self, end: int) -> None:
        """The end of the input (at position ``end``)."""
        if self.windows is not None:
            self._route(self.windows.finish(), lambda n: end)
        rows, sides = self.run.finish()
        if rows or sides:
            self.outputs.append((end, self.index, rows, sides))

    def _route(self, keyed: list[tuple[int, str, Any]], position: Callable[[int], int]) -> None:
        """The keyed step's outputs through the steps after it, merged by position with the failures before it.

        The job's only task with no failure before the keyed step in the chunk has nothing to interleave them
        with: they are routed in one call."""
        if not keyed:
            return
        run, index = self.run, self.index
        for i, (n, tag, value) in enumerate(keyed):
            if tag == FAILED:
                key, window, exc = value
                keyed[i] = (n, TASK_ERRORS_TABLE, stream_error_row(run.name, exc, None, key, window=window))
        if self.alone and not self.outputs:
            rows, sides = run.route([(tag, value) for _, tag, value in keyed])
            if rows or sides:
                self.outputs.append((position(keyed[0][0]), index, rows, sides))
            return
        routed = []
        for n, tag, value in keyed:
            rows, sides = run.route([(tag, value)])
            if rows or sides:
                routed.append((position(n), index, rows, sides))
        self.outputs = list(heapq.merge(self.outputs, routed, key=_position))


def _position(outputs: Outputs) -> tuple[int, int]:
    return outputs[0], outputs[1]


def run_stream_batch(runner: BatchHost, records: Iterable[Any],
                     progress: Callable[[Iterable[Any]], Iterator[Any]] | None = None) -> str | None:
    """Run ``runner``'s job of stream tasks over ``records`` in batch mode; ``None`` when it ran (rows written,
    summary counted), else why not (nothing read, written or counted)."""
    plan = runner.plan()
    why = refusal(plan, records)
    if why is not None:
        return why
    runs = list(plan.streams.values())
    tasks = [_BatchTask(run, i, runner.stream_failed, len(runs) == 1) for i, run in enumerate(runs)]
    position = 0
    chunk: list[Event] = []

    def through(final: bool) -> None:
        nonlocal position
        for task in tasks:
            task.take(chunk, position)
        position += len(chunk)
        chunk.clear()
        for task in tasks:
            if final:
                task.finish(position)
        _write(runner, tasks)

    for block in runner.blocks(records, progress):
        chunk += runner.accepted(block)
        if len(chunk) >= CHUNK_EVENTS:
            through(final=False)
    through(final=True)
    for task in tasks:
        runner.summary.task_stats[task.run.name].mode = task.mode
    runner.summary.runtime_mode = "batch"
    log.info("job %s ran in batch mode: %s", plan.job,
             "; ".join(f"{task.run.name} {task.mode}" for task in tasks))
    return None


def _write(runner: BatchHost, tasks: list[_BatchTask]) -> None:
    """The tasks' outputs so far, by position (tasks in order within one), counted and written once per table."""
    by_table: dict[str, list[dict[str, Any]]] = {}
    for _, index, rows, sides in heapq.merge(*(task.outputs for task in tasks), key=_position):
        run = tasks[index].run
        runner.count_stream(run, len(rows), sides)
        if rows:
            by_table.setdefault(run.sink, []).extend(rows)
        for table, row in sides:
            by_table.setdefault(table, []).append(row)
    for task in tasks:
        task.outputs = []
    for table, rows in by_table.items():
        runner.write(table, rows)


__all__ = ["CHUNK_EVENTS", "COLUMNAR", "keyed_refusal", "refusal", "run_stream_batch"]
