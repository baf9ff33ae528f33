"""A job's trigger tasks compiled for execution: what every runner does per user and per event.

:class:`TaskExecution` holds the trigger trie, each task's own copy of its pipeline and the bounds
of the user sequences the tasks need. A runner keeps one :class:`UserState` per user (the device
runner in a dict, the Flink runner in keyed state) and for every event calls :meth:`step`, then
:meth:`run_task` for each task that fired. Runners add plumbing only: where events come from, where
rows go, threads, state backends.
"""

from __future__ import annotations

import copy
import logging
import traceback
from typing import Any

from connectors.storage import to_json
from operators import Operator, run_pipeline
from streamflow.events import Event
from streamflow.job import Task
from streamflow.sequences import UserSequence
from streamflow.summary import TASK_ERRORS_TABLE, TaskStats
from streamflow.trie import MatchState, TriggerTrie

log = logging.getLogger("streamflow.execution")


class UserState:
    """One user's position: the trie match state and the recent sequences."""

    __slots__ = ("match", "sequence")

    def __init__(self, match: MatchState, sequence: UserSequence):
        self.match = match
        self.sequence = sequence


class TaskExecution:
    """The trigger tasks of a job, ready to step users' events.

    Example:
        >>> from operators import Aggregate, Count
        >>> execution = TaskExecution([Task("favs", ["fav"], [Aggregate(n=Count())], input="recent")])
        >>> user = execution.user("u")
        >>> event = Event("u", "fav", "item", 1.6e9)
        >>> fired = execution.step(user, event)
        >>> fired, execution.run_task(fired[0], event, user.sequence)
        (('favs',), [{'user_id': 'u', 'trigger_ts': 1600000000.0, 'n': 1}])
    """

    def __init__(self, tasks: list[Task] | tuple[Task, ...] = (), quarantine_after: int = 5):
        if quarantine_after < 1:
            raise ValueError(f"quarantine_after must be >= 1, got {quarantine_after}")
        self.quarantine_after = quarantine_after
        self.trie = TriggerTrie()
        self.tasks: dict[str, Task] = {}
        self.stats: dict[str, TaskStats] = {}
        self._pipelines: dict[str, list[Operator]] = {}
        self._max_events = 1
        self._max_pages = 1
        #: Users this execution keeps in memory (the device runner's); runners that persist user
        #: state elsewhere (Flink keyed state) restore it with :meth:`new_user` instead.
        self.users: dict[str, UserState] = {}
        for task in tasks:
            self.register(task)

    def register(self, task: Task) -> None:
        """Add a task; it runs from the next event on. Its pipeline is copied: no operator state is
        shared between tasks."""
        if task.name in self.tasks:
            raise ValueError(f"task {task.name!r} is already registered")
        self.trie.register(task.name, task.trigger)
        self.tasks[task.name] = task
        self._pipelines[task.name] = copy.deepcopy(list(task.pipeline))
        self.stats.setdefault(task.name, TaskStats())
        # A "page" task needs only the current visit; keep as much history as the others ask for.
        events = task.history_events if task.input == "recent" else 1
        pages = task.history_events if task.input == "pages" else 1
        if events > self._max_events or pages > self._max_pages:
            self._max_events = max(self._max_events, events)
            self._max_pages = max(self._max_pages, pages)
            for user in self.users.values():
                user.sequence.resize(self._max_events, self._max_pages)

    def unregister(self, name: str) -> None:
        """Remove a task."""
        self.trie.unregister(name)
        del self.tasks[name]
        del self._pipelines[name]

    def user(self, user_id: str) -> UserState:
        """The in-memory state of ``user_id`` (new if unseen)."""
        user = self.users.get(user_id)
        if user is None:
            user = self.users[user_id] = self.new_user()
        return user

    def new_user(self, sequence: UserSequence | None = None, pending_nodes: frozenset[int] = frozenset()) -> UserState:
        """State for a user seen for the first time, or restored from a persisted sequence and
        dynamic pending list. Not kept: see :meth:`user`."""
        if sequence is None:
            sequence = UserSequence(self._max_events, self._max_pages)
        return UserState(self.trie.restore(pending_nodes), sequence)

    def step(self, user: UserState, event: Event) -> tuple[str, ...]:
        """Append ``event`` to the user's sequences and advance the trie; the tasks that fire."""
        user.sequence.append(event)
        user.match, fired = self.trie.step(user.match, event)
        return fired

    def run_task(self, name: str, event: Event, sequence: UserSequence) -> list[dict[str, Any]] | Exception:
        """Run task ``name`` fired by ``event``: its rows (``user_id`` and ``trigger_ts`` first), or
        the exception its pipeline raised (a task's failure is data for the runner, not a crash)."""
        task = self.tasks[name]
        try:
            if task.input == "page":
                items: list[Any] = sequence.current_page()
            else:
                since = event.ts - task.history_s if task.history_s is not None else None
                if task.input == "recent":
                    items = sequence.recent_events(since, task.history_events)
                else:
                    items = sequence.recent_pages(since, task.history_events)
            rows = run_pipeline(self._pipelines[name], items)
        except Exception as exc:
            return exc
        head = {"user_id": event.user_id, "trigger_ts": event.ts}
        return [{**head, **row} for row in rows]

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
        return TASK_ERRORS_TABLE, [{
            "task": name, "user_id": event.user_id, "trigger_ts": event.ts,
            "trigger_event": to_json(event.to_dict()), "error": error,
            "traceback": "".join(traceback.format_exception(outcome)),
        }]
