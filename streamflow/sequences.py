"""A user's event sequences: the time-level sequence and the page-level sequence.

- The **time-level sequence** is the user's events in time order; a bounded number of the most
  recent ones is kept.
- The **page-level sequence** is the user's page visits in order. A visit is the events from a
  ``page_enter`` up to and including the matching ``page_exit`` of the same page, aggregated into a
  :class:`PageVisit`. A ``page_enter`` while another page is open ends the open visit at its last
  event (the exit was never reported); a ``page_exit`` of a page that is not the open one also ends
  the open visit that way, and is itself a visit of that one event.

:class:`UserSequence` holds both for one user and is what a task's input is cut from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from streamflow.events import PAGE_ENTER, PAGE_EXIT, Event

T = TypeVar("T")


@dataclass(slots=True)
class PageVisit:
    """One page-level element: a page's enter-to-exit events, aggregated.

    Example:
        >>> v = PageVisit.of([Event("u", "page_enter", "item", 10.0), Event("u", "page_exit", "item", 25.0)])
        >>> v.page_id, v.dwell_s, v.n_events
        ('item', 15.0, 2)
    """

    user_id: str
    page_id: str
    enter_ts: float
    exit_ts: float
    events: list[Event]

    @classmethod
    def of(cls, events: list[Event]) -> PageVisit:
        first, last = events[0], events[-1]
        return cls(first.user_id, first.page_id, first.ts, last.ts, events)

    @property
    def dwell_s(self) -> float:
        return self.exit_ts - self.enter_ts

    @property
    def n_events(self) -> int:
        return len(self.events)

    def field(self, name: str) -> Any:
        """Attribute (``page_id``, ``enter_ts``, ``dwell_s``, ...) or ``contents`` key of the enter event."""
        if name in ("user_id", "page_id", "enter_ts", "exit_ts", "dwell_s", "n_events", "events"):
            return getattr(self, name)
        if name == "ts":
            return self.exit_ts
        return self.events[0].field(name)

    __getitem__ = field

    def __reduce__(self) -> tuple:
        return PageVisit, (self.user_id, self.page_id, self.enter_ts, self.exit_ts, self.events)


class MemoryList:
    """A list state of one key, in memory: what :class:`UserSequence` keeps when no runner gives it state."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: list[Any] = []

    def get(self) -> list[Any]:
        return self.values

    def add(self, value: Any) -> None:
        self.values.append(value)

    def update(self, values: Iterable[Any]) -> None:
        self.values = list(values)

    def clear(self) -> None:
        self.values = []


class UserSequence:
    """The recent time-level and page-level sequences of one user, kept in three list states.

    ``recent``, ``pages`` and ``open_page`` are list-state handles (``get``, ``add``, ``update``,
    ``clear``): a runner's keyed state, so a sequence is never stored as one blob, or in-memory lists
    by default. ``max_events`` / ``max_pages`` bound what is kept (0: that sequence is not kept at
    all); a bounded list is trimmed when it reaches twice its bound, so an append costs O(1) amortized.

    Example:
        >>> seq = UserSequence(max_events=10, max_pages=5)
        >>> for e in [Event("u", "page_enter", "item", 1.0), Event("u", "fav", "item", 2.0)]:
        ...     _ = seq.append(e)
        >>> [e.event_id for e in seq.current_page()]
        ['page_enter', 'fav']
    """

    __slots__ = ("recent", "pages", "open_page", "max_events", "max_pages", "_current")

    def __init__(self, max_events: int = 256, max_pages: int = 32, recent: Any = None, pages: Any = None,
                 open_page: Any = None):
        self.recent = recent if recent is not None else MemoryList()
        self.pages = pages if pages is not None else MemoryList()
        self.open_page = open_page if open_page is not None else MemoryList()
        self.max_events = max_events
        self.max_pages = max_pages
        self._current: list[Event] = []  # the current page, as of the latest append

    def resize(self, max_events: int, max_pages: int) -> None:
        """Change the bounds (of every user's sequences, when the handles are keyed state)."""
        self.max_events = max_events
        self.max_pages = max_pages

    def append(self, event: Event) -> PageVisit | None:
        """Add the next event; return the page visit it completes, if it is a page exit."""
        if self.max_events:
            _append_bounded(self.recent, event, self.max_events)
        kind = event.event_id
        if kind == PAGE_ENTER:
            opened = self.open_page.get()
            if opened:
                self._add_page(PageVisit.of(list(opened)))
            self.open_page.update([event])
            self._current = [event]
            return None
        if kind == PAGE_EXIT:
            opened = self.open_page.get()
            if opened and opened[0].page_id == event.page_id:
                visit = PageVisit.of([*opened, event])
            else:
                if opened:  # that page's exit was never reported: it ends at its last event
                    self._add_page(PageVisit.of(list(opened)))
                visit = PageVisit.of([event])
            if opened:
                self.open_page.clear()
            self._add_page(visit)
            self._current = visit.events
            return visit
        opened = self.open_page.get()
        if opened:
            self._current = [*opened, event]
            self.open_page.add(event)
        else:
            self._current = [event]
        return None

    def _add_page(self, visit: PageVisit) -> None:
        if self.max_pages:
            _append_bounded(self.pages, visit, self.max_pages)

    def current_page(self) -> list[Event]:
        """Events of the page visit in progress (or just completed by the latest event).

        If the latest event is a page exit, that completed visit; if no page is open, just the
        latest event.
        """
        return list(self._current)

    def recent_events(self, since_ts: float | None = None, limit: int | None = None) -> list[Event]:
        """The time-level sequence, oldest first, optionally only events at or after ``since_ts``
        and only the last ``limit``."""
        return _tail(self.recent.get()[-self.max_events:] if self.max_events else [], lambda e: e.ts, since_ts, limit)

    def recent_pages(self, since_ts: float | None = None, limit: int | None = None) -> list[PageVisit]:
        """The page-level sequence (completed visits), oldest first, filtered like :meth:`recent_events`
        (by exit time)."""
        return _tail(self.pages.get()[-self.max_pages:] if self.max_pages else [], lambda p: p.exit_ts,
                     since_ts, limit)


def _append_bounded(values: Any, item: Any, bound: int) -> None:
    held = values.get()
    if len(held) >= 2 * bound:
        values.update(held[-(bound - 1):] if bound > 1 else [])
    values.add(item)


def _tail(items: Iterable[T], ts_of: Callable[[T], float], since_ts: float | None, limit: int | None) -> list[T]:
    out = list(items)
    if since_ts is not None:
        out = [item for item in out if ts_of(item) >= since_ts]
    return out[-limit:] if limit is not None else out
