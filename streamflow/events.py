"""The event model: what an app reports about a user, one record at a time.

An :class:`Event` is ``(user_id, event_id, page_id, ts, contents)``:

- ``event_id`` is the kind of event (``page_enter``, ``page_exit``, ``fav``, ``click_buy`` ...),
- ``page_id`` is the page the user was on when it happened,
- ``ts`` is event time in Unix seconds (float),
- ``contents`` carries everything else (item id, category, ...); a source that maps a record of its
  own vocabulary to app events keeps that record's kind under ``contents["behavior"]`` on the one
  event that is the record itself (:attr:`Event.behavior`; see :mod:`streamflow.sources`).

A user's events in time order form the *time-level sequence*. The events from a page's
``page_enter`` up to and including its ``page_exit`` form one *page-level sequence*
(see :mod:`streamflow.sequences`).

Records that cannot become events are not dropped: sources yield a :class:`Rejected` naming the
source, the line and the reason, and the runner stores it in the dead-letter table.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_text
from operator import attrgetter
from typing import Any

from connectors.json_values import JSON_ERRORS, encode_json, to_json
from operators.base import EVENT_ATTRIBUTES
from operators.process import ValueStateDescriptor
from streamflow.keyed import KeyedStore

PAGE_ENTER = "page_enter"
PAGE_EXIT = "page_exit"
#: The ``contents`` key under which a source keeps the kind of the record an event is (:attr:`Event.behavior`).
BEHAVIOR = "behavior"

#: Earliest plausible event time (2000-01-01T00:00:00Z); older stamps are rejected as absurd.
MIN_PLAUSIBLE_TS = 946_684_800.0
#: How far into the future (seconds past the wall clock) an event may claim to be.
MAX_FUTURE_SKEW_S = 86_400.0


@dataclass(slots=True)
class Event:
    """One app event of one user.

    Example:
        >>> e = Event("u1", "fav", "item", 1511848951.0, {"item_id": "77460"})
        >>> e.field("item_id"), e["event_id"]
        ('77460', 'fav')
    """

    user_id: str
    event_id: str
    page_id: str
    ts: float
    contents: dict[str, Any] = field(default_factory=dict)

    def field(self, name: str) -> Any:
        """Value of a top-level attribute, or else of a key in ``contents``.

        A missing name raises ``KeyError`` naming the event, so a pipeline error says what was
        missing and where.
        """
        if name in EVENT_ATTRIBUTES:
            return getattr(self, name)
        try:
            return self.contents[name]
        except KeyError:
            raise KeyError(f"event {self.event_id!r} of user {self.user_id!r} at ts={self.ts} "
                           f"has no field {name!r}") from None

    __getitem__ = field  # events read like rows: event["item_id"], as operators do

    @property
    def behavior(self) -> str | None:
        """The source record's own kind, ``contents["behavior"]``, on the event that is that record; ``None``
        on events a source adds around it (page exits, an implicit page enter) and on events that carry none.

        Counting events by it counts each source record once: ``Filter(lambda e: e.behavior in
        {"pv", "fav", "cart", "buy"})`` keeps one event per Taobao line.

        Example:
            >>> Event("u1", "page_enter", "item", 1511848894.0, {"item_id": "10", "behavior": "pv"}).behavior
            'pv'
            >>> Event("u1", "page_exit", "item", 1511848900.0, {"item_id": "10"}).behavior is None
            True
        """
        return self.contents.get(BEHAVIOR)

    def __reduce__(self) -> tuple[Any, ...]:
        # A plain constructor call pickles several times faster than the slots dataclass default,
        # and runners that keep sequences in keyed state (Flink) pickle them on every event.
        return Event, (self.user_id, self.event_id, self.page_id, self.ts, self.contents)

    def to_sorted_json(self) -> str:
        """``to_json(self.to_dict(), sort_keys=True)`` (a late event's ``item``), the same text built from the
        fields: only ``contents`` goes through the JSON encoder (a late event costs ~2 us less).

        Example:
            >>> Event("u1", "fav", "item", 1.5, {"item_id": "7", "a": [1]}).to_sorted_json()
            '{"contents": {"a": [1], "item_id": "7"}, "event_id": "fav", "page_id": "item", "ts": 1.5, "user_id": "u1"}'
        """
        user, kind, page, ts = self.user_id, self.event_id, self.page_id, self.ts
        if type(user) is str and type(kind) is str and type(page) is str and type(ts) is float and ts - ts == 0:
            try:
                contents = encode_json(self.contents, sort_keys=True)
            except JSON_ERRORS:
                pass
            else:  # json writes a finite float as its repr, a str as encode_basestring_ascii does
                return (f'{{"contents": {contents}, "event_id": {_json_text(kind)}, "page_id": {_json_text(page)}, '
                        f'"ts": {ts!r}, "user_id": {_json_text(user)}}}')
        return to_json(self.to_dict(), sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        """The event as a plain dict (for JSON lines and dead-letter records)."""
        return {"user_id": self.user_id, "event_id": self.event_id, "page_id": self.page_id,
                "ts": self.ts, "contents": dict(self.contents)}




def event_reader(name: str) -> Callable[[Event], Any]:
    """A function reading field ``name`` of an :class:`Event`: what ``event[name]`` gives (the same value,
    the same ``KeyError`` for a missing field), without a Python-level ``__getitem__`` for attributes.

    Example:
        >>> event = Event("u", "fav", "item", 1.0, {"item_id": "7"})
        >>> event_reader("ts")(event), event_reader("item_id")(event)
        (1.0, '7')
    """
    if name in EVENT_ATTRIBUTES:
        return attrgetter(name)

    def read(event: Event) -> Any:
        try:
            return event.contents[name]
        except KeyError:
            return event.field(name)  # raises the KeyError naming the event

    return read


@dataclass(slots=True, frozen=True)
class Rejected:
    """A record that could not be accepted: where it came from, what it was and why not."""

    source: str
    line: int
    reason: str
    raw: str

    def describe(self) -> str:
        return f"{self.source}:{self.line}: {self.reason}"


class TimestampGuard:
    """Rejects absurd timestamps and timestamps that go backwards within a user's stream.

    Event time must be plausible (after 2000-01-01 and at most ``max_future_skew_s`` ahead of the
    wall clock at the time of the check) and non-decreasing per user: the device runtime processes
    each user's events in the order the app produced them, so a step back in time means a broken
    clock or a corrupt record, not a late event.

    Example:
        >>> guard = TimestampGuard()
        >>> guard.check("u1", 1511848894.0) is None
        True
        >>> guard.check("u1", 1511848000.0)
        'timestamp goes backwards: 1511848000.0 < 1511848894.0, the previous event of user u1'
    """

    def __init__(self, min_ts: float = MIN_PLAUSIBLE_TS, max_future_skew_s: float = MAX_FUTURE_SKEW_S,
                 state_ttl_s: float | None = None):
        self.min_ts = min_ts
        self.max_future_skew_s = max_future_skew_s
        #: The upper bound as of the last clock reading; the clock is read again only when a stamp
        #: exceeds it (the bound only grows, so a stamp within it is within the true bound too).
        self.max_ts = time.time() + max_future_skew_s
        #: Each user's last accepted timestamp; with ``state_ttl_s``, forgotten after that long of stream
        #: time (the largest timestamp accepted) without an event of the user.
        self._last = KeyedStore(ValueStateDescriptor("last_ts", ttl_s=state_ttl_s))
        self._clock = 0

    def check(self, user_id: str, ts: float) -> str | None:
        """The reason ``ts`` is rejected for ``user_id``, or ``None`` (and remember it) if fine."""
        last = self._last
        if last.written is None:  # no TTL: the usual accepted event in a few dict operations
            data = last.data
            previous = data.get(user_id)
            if self.min_ts <= ts <= self.max_ts and (previous is None or ts >= previous):
                data[user_id] = ts
                if ts * 1000 > self._clock:  # else round(ts * 1000) <= the (integer) clock too
                    self._clock = max(self._clock, round(ts * 1000))
                return None
        reason = self.reason(user_id, ts, last.get(user_id, self._clock))
        if reason is None:
            clock = round(ts * 1000)
            if clock > self._clock:
                self._clock = clock
                last.expire(clock)
            last.set(user_id, ts, self._clock)
        return reason

    @property
    def users_held(self) -> int:
        """Users whose last timestamp is remembered."""
        return len(self._last.data)

    def snapshot(self) -> tuple[KeyedStore, int]:
        """Each user's last accepted timestamp and the stream clock (for a checkpoint; the bounds follow
        the wall clock, not it)."""
        return self._last, self._clock

    def restore(self, snapshot: tuple[KeyedStore, int]) -> None:
        """Continue from a :meth:`snapshot`."""
        self._last, self._clock = snapshot
    def outside_reason(self, ts: float) -> str:
        """Why ``ts``, outside the bounds, is rejected (the bounds as they are: :meth:`reason` reads the clock first).

        Example:
            >>> TimestampGuard().outside_reason(5.0)[:43]
            'absurd timestamp: 5.0 is outside [946684800'
        """
        return f"absurd timestamp: {ts!r} is outside [{self.min_ts:.0f}, {self.max_ts:.0f}] (2000-01-01 .. now + skew)"

    def reason(self, user_id: str, ts: float, last_ts: float | None) -> str | None:
        """The same check against a user's last accepted ``last_ts`` kept by the caller (e.g. in
        a runner's keyed state)."""
        if ts > self.max_ts:
            self.max_ts = time.time() + self.max_future_skew_s
        if not (self.min_ts <= ts <= self.max_ts):  # also catches NaN
            return self.outside_reason(ts)
        if last_ts is not None and ts < last_ts:
            return f"timestamp goes backwards: {ts} < {last_ts}, the previous event of user {user_id}"
        return None
