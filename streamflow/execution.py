"""A job's trigger tasks compiled for execution, and run as one keyed process function.

:class:`TaskExecution` holds the trigger trie, each task's own copy of its pipeline and the bounds
of the user sequences the tasks need. :class:`TriggerTasks` is the keyed process function (key:
the user) every runner executes: per event it appends to the user's sequences and steps the user's
trie state, both in keyed state (a value state for the dynamic pending list, list states for the
sequences), then runs each task that fired over the input it asked for. Rows go out as side outputs
named by their table. Runners add plumbing only: where events come from, where rows go, threads,
state backends.
"""

from __future__ import annotations

import copy
import logging
import traceback
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from connectors.json_values import to_json
from operators import Aggregate, Operator
from operators.base import compile_pipeline
from operators.process import KeyedProcessFunction, ListStateDescriptor, ValueStateDescriptor
from streamflow.events import PAGE_ENTER, PAGE_EXIT, Event, event_reader
from streamflow.job import Task
from streamflow.sequences import UserSequence
from streamflow.summary import TASK_ERRORS_TABLE, TaskStats
from streamflow.trie import TriggerTrie

log = logging.getLogger("streamflow.execution")


class TaskExecution:
    """The trigger tasks of a job, ready to step users' events.

    Example:
        >>> from operators import Aggregate, Count
        >>> execution = TaskExecution([Task("favs", ["fav"], [Aggregate(n=Count())], input="recent")])
        >>> event = Event("u", "fav", "item", 1.6e9)
        >>> execution.run_task("favs", event, [event])
        [{'user_id': 'u', 'trigger_ts': 1600000000.0, 'n': 1}]
    """

    def __init__(self, tasks: list[Task] | tuple[Task, ...] = (), quarantine_after: int = 5):
        if quarantine_after < 1:
            raise ValueError(f"quarantine_after must be >= 1, got {quarantine_after}")
        self.quarantine_after = quarantine_after
        self.trie = TriggerTrie()
        self.tasks: dict[str, Task] = {}
        self.stats: dict[str, TaskStats] = {}
        self._pipelines: dict[str, list[Operator]] = {}
        self._runs: dict[str, Any] = {}  # each task's pipeline, compiled (operators.base.compile_pipeline)
        self._firing: dict[str, tuple[Any, TaskStats, str]] = {}  # (compiled pipeline, stats, sink) by task
        #: How many recent events / completed page visits the tasks need (0: none).
        self.max_events = 0
        self.max_pages = 0
        self.on_resize: list[Any] = []  # callbacks(max_events, max_pages) of the sequences kept
        for task in tasks:
            self.register(task)

    def register(self, task: Task) -> None:
        """Add a task; it runs from the next event on. Its pipeline is copied: no operator state is
        shared between tasks."""
        self.replace((), [task])

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_runs"], state["_firing"]  # compiled again where it is unpickled
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._runs = {name: compile_pipeline(pipeline) for name, pipeline in self._pipelines.items()}
        self._firing = {name: (run, self.stats[name], self.tasks[name].sink) for name, run in self._runs.items()}

    def unregister(self, name: str) -> None:
        """Remove a task."""
        self.replace([name], ())

    def replace(self, remove: Iterable[str], add: Iterable[Task]) -> None:
        """Remove tasks ``remove`` and add ``add`` as one change (see :meth:`TriggerTrie.replace`).

        A task added again under a name it had (a new version) keeps its counters, with its run of
        consecutive failures and its quarantine cleared. Nothing changes if anything is refused.
        """
        remove, add = list(remove), list(add)
        pipelines = {task.name: copy.deepcopy(list(task.pipeline)) for task in add}  # may raise: before any change
        for task in add:
            if task.input in ("page", "recent"):
                _read_events_directly(pipelines[task.name])
        runs = {name: compile_pipeline(pipeline) for name, pipeline in pipelines.items()}
        self.trie.replace(remove, {task.name: task.trigger for task in add})
        for name in remove:
            del self.tasks[name]
            del self._pipelines[name]
            del self._runs[name]
            del self._firing[name]
        for task in add:
            self.tasks[task.name] = task
            self._pipelines[task.name] = pipelines[task.name]
            stats = self.stats.setdefault(task.name, TaskStats())
            stats.consecutive_errors, stats.quarantined = 0, False
            self._runs[task.name] = runs[task.name]
            self._firing[task.name] = (runs[task.name], stats, task.sink)
            # A "page" task needs only the current visit; keep as much history as the others ask for.
            events = task.history_events if task.input == "recent" else 0
            pages = task.history_events if task.input == "pages" else 0
            if events > self.max_events or pages > self.max_pages:
                self.max_events = max(self.max_events, events)
                self.max_pages = max(self.max_pages, pages)
                for resize in self.on_resize:
                    resize(self.max_events, self.max_pages)

    def pipeline(self, name: str) -> tuple[Operator, ...]:
        """Task ``name``'s own copy of its pipeline, the operators its compiled run was made from.

        Example:
            >>> from operators import Aggregate, Count
            >>> TaskExecution([Task("favs", ["fav"], [Aggregate(n=Count())])]).pipeline("favs")
            (Aggregate(aggregations={'n': Count()}),)
        """
        return tuple(self._pipelines[name])

    def inputs(self, name: str, event: Event, sequence: UserSequence) -> list[Any]:
        """What task ``name``, fired by ``event``, runs over (see ``Task.input``)."""
        task = self.tasks[name]
        if task.input == "page":
            return sequence.current_page()
        since = event.ts - task.history_s if task.history_s is not None else None
        if task.input == "recent":
            return sequence.recent_events(since, task.history_events)
        return sequence.recent_pages(since, task.history_events)

    def run_task(self, name: str, event: Event, items: list[Any]) -> list[dict[str, Any]] | Exception:
        """Run task ``name`` fired by ``event`` over ``items``: its rows (``user_id`` and ``trigger_ts``
        first), or the exception its pipeline raised (a task's failure is data for the runner, not a crash)."""
        try:
            rows = self._runs[name](items)
        except Exception as exc:
            return exc
        head = {"user_id": event.user_id, "trigger_ts": event.ts}
        return [{**head, **row} for row in rows]

    def fire(self, name: str, event: Event, items: list[Any]) -> tuple[str, list[dict[str, Any]]]:
        """:meth:`run_task` and :meth:`settle` in one call: ``(table, rows)`` to store."""
        run, stats, sink = self._firing[name]
        try:
            rows = run(items)
        except Exception as exc:
            return self.settle(name, event, exc)
        stats.fired += 1
        stats.consecutive_errors = 0
        if len(rows) == 1:
            stats.rows += 1
            return sink, [{"user_id": event.user_id, "trigger_ts": event.ts, **rows[0]}]
        stats.rows += len(rows)
        user, ts = event.user_id, event.ts
        return sink, [{"user_id": user, "trigger_ts": ts, **row} for row in rows]

    def settle(self, name: str, event: Event, outcome: list[dict[str, Any]] | Exception
               ) -> tuple[str, list[dict[str, Any]]]:
        """Count a task's run and say what to store: ``(table, rows)``.

        Rows go to the task's sink; a failure becomes one ``task_errors`` row naming the task, the
        user and the triggering event. After ``quarantine_after`` consecutive failures the task is
        quarantined: unregistered, so it no longer fires.
        """
        stats = self.stats[name]
        stats.fired += 1
        if not isinstance(outcome, Exception):
            stats.consecutive_errors = 0
            stats.rows += len(outcome)
            return self.tasks[name].sink, outcome
        stats.errors += 1
        stats.consecutive_errors += 1
        error = f"{type(outcome).__name__}: {outcome}"
        log.warning("task %s failed on %s of user %s at ts=%s: %s", name, event.event_id, event.user_id,
                    event.ts, error)
        if stats.consecutive_errors >= self.quarantine_after:
            stats.quarantined = True
            self.unregister(name)
            log.error("task %s quarantined after %d consecutive failures; last: %s", name,
                      stats.consecutive_errors, error)
        return TASK_ERRORS_TABLE, [task_error_row(name, event, outcome)]


def _read_events_directly(pipeline: list[Operator]) -> None:
    """A leading Aggregate over events reads named fields with :func:`~streamflow.events.event_reader`
    (the same values and errors as ``event[name]``, several times faster); ``_event_field`` tells its
    generated fold (:func:`operators.aggregate._generated_fold`) that it may read them inline."""
    if pipeline and isinstance(pipeline[0], Aggregate):
        for aggregation in pipeline[0].aggregations.values():
            if isinstance(aggregation.field, str):
                aggregation._read = event_reader(aggregation.field)
                aggregation._event_field = aggregation.field


def task_error_row(task: str, event: Event, error: Exception) -> dict[str, Any]:
    """The ``task_errors`` row of a task that raised on ``event``."""
    return {"task": task, "user_id": event.user_id, "trigger_ts": event.ts,
            "trigger_event": to_json(event.to_dict()), "error": f"{type(error).__name__}: {error}",
            "traceback": "".join(traceback.format_exception(error))}


class TriggerTasks(KeyedProcessFunction):
    """A job's trigger tasks as one keyed process function over app events, keyed by user.

    State per user: ``match`` (the dynamic pending list in the trie) and the sequences
    (:class:`~streamflow.sequences.UserSequence` over the list states ``recent``, ``pages`` and
    ``open_page``), each dropped after ``state_ttl_s`` of stream time without a write. Rows go to
    ``ctx.side(table, row)``: the task's sink, or ``task_errors``.
    With ``workers > 1``, tasks that fire on the same event run concurrently (useful when their
    operators release the GIL, as model inference does); their rows still come out in task order.

    Example:
        >>> from operators import Aggregate, Count
        >>> from streamflow.keyed import KeyedRuntime
        >>> tasks = TriggerTasks(TaskExecution([Task("favs", ["fav"], [Aggregate(n=Count())], input="recent")]))
        >>> runtime = KeyedRuntime(tasks)
        >>> runtime.process("u", Event("u", "fav", "item", 1.6e9))
        [('favs', {'user_id': 'u', 'trigger_ts': 1600000000.0, 'n': 1})]
    """

    def __init__(self, execution: TaskExecution, workers: int = 1, state_ttl_s: float | None = None):
        self.execution = execution
        self.workers = workers
        self.state_ttl_s = state_ttl_s
        self._pool: ThreadPoolExecutor | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_pool", "match", "sequence"):  # threads and state handles are per runtime
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool = None

    def open(self, ctx: Any) -> None:
        execution = self.execution
        ttl = self.state_ttl_s
        self.match = ctx.get_state(ValueStateDescriptor("match", ttl))
        self.sequence = UserSequence(execution.max_events, execution.max_pages,
                                     recent=ctx.get_state(ListStateDescriptor("recent", ttl)),
                                     pages=ctx.get_state(ListStateDescriptor("pages", ttl)),
                                     open_page=ctx.get_state(ListStateDescriptor("open_page", ttl)))
        execution.on_resize.append(self.sequence.resize)

    def on_event(self, event: Event, ctx: Any) -> None:
        execution, sequence = self.execution, self.sequence
        sequence.append(event)
        trie = execution.trie
        if trie.single_step:  # nothing to remember between events: no state access
            fired = trie.step(trie.initial_state(), event)[1]
        else:
            before = self.match.value() or trie.initial_state()
            state, fired = trie.step(before, event)
            if state is not before:
                self.match.update(state)
        if fired:
            self._run(event, fired, [execution.inputs(name, event, sequence) for name in fired], ctx)

    def on_block(self, events: list[Event], ctx: Any) -> None:
        """``on_event`` for each event in order (the device runtime's block path, see
        :meth:`~streamflow.keyed.KeyedRuntime.process_block`).

        When every task reads the page (no time- or page-level sequence is kept) and every trigger is
        one id (no partial match is kept), the events are stepped in one loop over the raw ``open_page``
        state, which holds what ``UserSequence`` would hold; otherwise ``on_event`` runs per event.
        """
        execution = self.execution
        trie = execution.trie
        if not trie.single_step or execution.max_events or execution.max_pages:
            for event in events:
                ctx.key = event.user_id
                self.on_event(event, ctx)
            return
        open_pages = ctx.state_data("open_page")
        fire, side = execution.fire, ctx.side
        state = trie.initial_state()
        steps, exit_steps = state.steps, state.exit_steps
        for event in events:
            kind = event.event_id
            if kind == PAGE_ENTER:
                open_pages[event.user_id] = page = [event]
                hit = steps.get(kind)
            elif kind == PAGE_EXIT:
                page = open_pages.pop(event.user_id, None)  # popped: no other holder, so appended in place
                if page and page[0].page_id == event.page_id:
                    page.append(event)
                else:
                    page = [event]
                hit = exit_steps.get(event.page_id)
            else:
                page = open_pages.get(event.user_id)
                if page:
                    page.append(event)
                else:
                    page = [event]
                hit = steps.get(kind)
            if hit is None:
                hit = trie.step(state, event)
            fired = hit[1]
            if not fired:
                continue
            ctx.key = event.user_id
            if len(fired) == 1:
                table, rows = fire(fired[0], event, page if kind == PAGE_EXIT else list(page))
                for row in rows:
                    side(table, row)
            else:
                self._run(event, fired, [list(page) for _ in fired], ctx)
            if trie.initial_state() is not state:  # a task was quarantined: the trie changed
                state = trie.initial_state()
                steps, exit_steps = state.steps, state.exit_steps

    def _run(self, event: Event, fired: tuple[str, ...], inputs: list[list[Any]], ctx: Any) -> None:
        """Run the tasks ``fired`` by ``event`` over their ``inputs``; their rows (or errors) as side outputs."""
        execution = self.execution
        if len(fired) == 1:
            table, rows = execution.fire(fired[0], event, inputs[0])
            for row in rows:
                ctx.side(table, row)
            return
        if self.workers <= 1:
            outcomes = [execution.run_task(name, event, items) for name, items in zip(fired, inputs, strict=True)]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="streamflow-task")
            futures = [self._pool.submit(execution.run_task, name, event, items)
                       for name, items in zip(fired, inputs, strict=True)]
            outcomes = [future.result() for future in futures]
        for name, outcome in zip(fired, outcomes, strict=True):
            table, rows = execution.settle(name, event, outcome)
            for row in rows:
                ctx.side(table, row)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
