"""The device runner's safe point: where tasks change and hooks look, between two events.

:class:`SafePoint` holds the task swaps requested from any thread (:class:`TaskSwap`) and the safe-point hooks;
the runner reaches it before each event (:meth:`SafePoint.reach`). During a run a swap waits for that point, so
no event is seen by neither version of a task, nor by both; outside a run it is applied at once. The change
itself (which tasks run, with what state) is the runner's: the safe point calls it back with the names to
remove and the tasks to add, and it raises to refuse.

Example:
    >>> point = SafePoint(lambda remove, add: print("replace", list(remove), [t.name for t in add]))
    >>> point.add_hook(lambda: False)  # looks once, then is done
    >>> with point.run():
    ...     swap = point.request(remove=["a"])
    ...     point.waiting, swap.done()
    (True, False)
    replace ['a'] []
    >>> swap.done(), swap.error, point.waiting, point.hooks
    (True, None, False, ())
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamflow.job import Task

log = logging.getLogger("streamflow.device")

#: What a hook is: called at every safe point until it returns False.
Hook = Callable[[], bool]


class TaskSwap:
    """A request to replace tasks at a runner's next safe point (:meth:`DeviceRunner.swap_tasks
    <streamflow.runners.device.DeviceRunner.swap_tasks>`).

    ``wait(timeout)`` is True once the swap was applied or refused; ``error`` is then the reason it
    was refused (None: applied).
    """

    def __init__(self, add: tuple[Task, ...], remove: tuple[str, ...], on_applied: Callable[[], None] | None = None):
        self.add = add
        self.remove = remove
        self.on_applied = on_applied
        self.error: Exception | None = None
        self._done = threading.Event()

    def done(self) -> bool:
        """Whether the swap was applied or refused."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the swap to be applied or refused; whether it was."""
        return self._done.wait(timeout)

    def _finish(self, error: Exception | None) -> None:
        self.error = error
        self._done.set()


class SafePoint:
    """The task swaps and hooks waiting for the runner's next safe point (see the module docstring).

    ``replace(remove, add)`` changes the runner's tasks as one change, or raises and changes nothing.
    """

    def __init__(self, replace: Callable[[Sequence[str], Sequence[Task]], None]) -> None:
        self._replace = replace
        self._lock = threading.Lock()
        self._swaps: list[TaskSwap] = []
        self._hooks: tuple[Hook, ...] = ()
        self._in_run = False
        #: Whether a swap is pending or a hook watches: the next safe point has something to do. A plain attribute
        #: (kept under the lock, read without it), as the runner reads it before every event; do not set it.
        self.waiting = False

    @property
    def hooks(self) -> tuple[Hook, ...]:
        """The hooks still watching (each called at every safe point until it returns False)."""
        return self._hooks

    def request(self, add: Iterable[Task] = (), remove: Iterable[str] = (),
                on_applied: Callable[[], None] | None = None) -> TaskSwap:
        """Ask for a swap, from any thread: applied at the next safe point during a run, at once outside one."""
        swap = TaskSwap(tuple(add), tuple(remove), on_applied)
        with self._lock:
            self._swaps.append(swap)
            self.waiting = True
            if not self._in_run:
                self._apply_locked()
        return swap

    def add_hook(self, hook: Hook) -> None:
        """Call ``hook()`` at every safe point from now on, before pending swaps are applied, until it returns False."""
        with self._lock:
            self._hooks = (*self._hooks, hook)
            self.waiting = True

    def reach(self) -> None:
        """The safe point: call the hooks (dropping those done), then apply the pending swaps in order."""
        hooks = self._hooks
        if hooks:
            done = [hook for hook in hooks if not hook()]
            if done:
                with self._lock:
                    self._hooks = tuple(h for h in self._hooks if h not in done)
                    self.waiting = bool(self._swaps or self._hooks)
        if self._swaps:
            with self._lock:
                self._apply_locked()

    @contextmanager
    def run(self) -> Iterator[None]:
        """A run: meanwhile swaps wait for :meth:`reach`; at its end the safe point is reached once more (hooks see
        the last event, swaps requested since apply)."""
        with self._lock:
            self._in_run = True
        try:
            yield
        finally:
            with self._lock:
                self._in_run = False
            self.reach()

    def _apply_locked(self) -> None:
        swaps, self._swaps = self._swaps, []
        for swap in swaps:
            try:
                self._replace(swap.remove, swap.add)
            except Exception as exc:  # refused: nothing changed, the caller reads why
                log.warning("task swap refused (adding %s, removing %s): %s", [t.name for t in swap.add],
                            list(swap.remove), exc)
                swap._finish(exc)
            else:
                log.info("tasks swapped: added %s, removed %s", [t.name for t in swap.add], list(swap.remove))
                if swap.on_applied is not None:
                    try:
                        swap.on_applied()
                    except Exception:  # the swap stands; the caller's callback is its own business
                        log.exception("on_applied callback of a task swap failed")
                swap._finish(None)
        self.waiting = bool(self._swaps or self._hooks)


__all__ = ["Hook", "SafePoint", "TaskSwap"]
