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

from collections import deque
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


class UserSequence:
    """The recent time-level and page-level sequences of one user.

    Example:
        >>> seq = UserSequence(max_events=10, max_pages=5)
        >>> for e in [Event("u", "page_enter", "item", 1.0), Event("u", "fav", "item", 2.0)]:
        ...     _ = seq.append(e)
        >>> [e.event_id for e in seq.current_page()]
        ['page_enter', 'fav']
    """

    __slots__ = ("recent", "pages", "_open")

    def __init__(self, max_events: int = 256, max_pages: int = 32):
        self.recent: deque[Event] = deque(maxlen=max_events)
        self.pages: deque[PageVisit] = deque(maxlen=max_pages)
        self._open: list[Event] | None = None

    def __reduce__(self) -> tuple:
        return _restore_sequence, (self.recent.maxlen, self.pages.maxlen, list(self.recent), list(self.pages),
                                   self._open)

    def resize(self, max_events: int, max_pages: int) -> None:
        """Change the bounds, keeping the most recent events and visits."""
        self.recent = deque(self.recent, maxlen=max_events)
        self.pages = deque(self.pages, maxlen=max_pages)

    def append(self, event: Event) -> PageVisit | None:
        """Add the next event; return the page visit it completes, if it is a page exit."""
        self.recent.append(event)
        kind = event.event_id
        if kind == PAGE_ENTER:
            if self._open is not None:
                self.pages.append(PageVisit.of(self._open))
            self._open = [event]
            return None
        if kind == PAGE_EXIT:
            opened = self._open
            if opened is not None and opened[0].page_id == event.page_id:
                opened.append(event)
                visit = PageVisit.of(opened)
            else:
                if opened is not None:  # that page's exit was never reported: it ends at its last event
                    self.pages.append(PageVisit.of(opened))
                visit = PageVisit.of([event])
            self._open = None
            self.pages.append(visit)
            return visit
        if self._open is not None:
            self._open.append(event)
        return None

    def current_page(self) -> list[Event]:
        """Events of the page visit in progress (or just completed by the latest event).

        If the latest event is a page exit, that completed visit; if no page is open, just the
        latest event.
        """
        if self._open is not None:
            return list(self._open)
        if self.recent and self.recent[-1].event_id == PAGE_EXIT and self.pages:
            return list(self.pages[-1].events)
        return list(self.recent)[-1:]

    def recent_events(self, since_ts: float | None = None, limit: int | None = None) -> list[Event]:
        """The time-level sequence, oldest first, optionally only events at or after ``since_ts``
        and only the last ``limit``."""
        return _tail(self.recent, lambda e: e.ts, since_ts, limit)

    def recent_pages(self, since_ts: float | None = None, limit: int | None = None) -> list[PageVisit]:
        """The page-level sequence (completed visits), oldest first, filtered like :meth:`recent_events`
        (by exit time)."""
        return _tail(self.pages, lambda p: p.exit_ts, since_ts, limit)


def _tail(items: Iterable[T], ts_of: Callable[[T], float], since_ts: float | None, limit: int | None) -> list[T]:
    out = list(items)
    if since_ts is not None:
        out = [item for item in out if ts_of(item) >= since_ts]
    return out[-limit:] if limit is not None else out


def _restore_sequence(max_events: int, max_pages: int, recent: list[Event], pages: list[PageVisit],
                      open_page: list[Event] | None) -> UserSequence:
    sequence = UserSequence(max_events, max_pages)
    sequence.recent.extend(recent)
    sequence.pages.extend(pages)
    sequence._open = open_page
    return sequence
