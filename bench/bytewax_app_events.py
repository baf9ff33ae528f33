"""What the hand-written Bytewax 0.21.1 window dataflows share (:mod:`bench.bytewax_windows`,
:mod:`bench.bytewax_sessions`): the Taobao CSV as app events, the stream's watermark, a DuckDB sink.

Written as a Bytewax user would write it, sharing no code with streamflow (so ``bench.peers``'s row
comparison is a real check):

- :func:`parse` (from :mod:`bench.bytewax_ipv`): a line's fields, or ``None`` for a line the job cannot use.
- :class:`AppEvents`: the Taobao lines as the app's events, in the stream's order. Per user: time must not go
  backwards (a line earlier than the user's last accepted one is dropped), and the item-page mapping: a ``pv``
  of a new item leaves the open page (``page_exit``, at that moment, or at the page's last activity after 30
  minutes idle) and enters the item's page (``page_enter``); a ``pv`` of the open item is a reload (``pv``); a
  ``fav``/``cart``/``buy`` of the open item is that click, of another item an implicit ``page_enter``
  (``contents["implicit"]``) then the click. An event is a dict ``{user_id, event_id, page_id, ts,
  contents}``; the event that is a line keeps its behaviour in ``contents["behavior"]``.
- :func:`watermark`: the stream's watermark as Flink's bounded-out-of-orderness generator makes it (largest
  event time seen - out_of_orderness - 1 ms, integer milliseconds), handed on with each item as it stood
  *before* the item.

Both steps are one *stream-wide* state (one key, ``"stream"``): the watermark is the whole stream's, as on
Flink at parallelism 1 and on streamflow's device runner, not a user's, so it needs the items in the input's
order. A Bytewax keyed step hands each key's items on in order but groups a batch by key, so after a step keyed
by user the order across users is gone; one key keeps it. (Bytewax's own ``EventClock`` keeps a watermark per
key that also moves with the system clock, see :mod:`bench.bytewax_windows`.)

- :class:`DuckDBSink` (from :mod:`bench.bytewax_ipv`): rows (dicts) into one DuckDB table, inserted as Arrow batches.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
from bytewax.operators import StatefulLogic

from bench.bytewax_ipv import GAP_S, DuckDBSink, Row, parse

__all__ = ["AppEvents", "DuckDBSink", "LATE_SCHEMA", "late_row", "parse", "watermark"]

ITEM_PAGE = "item"
START_OF_TIME = -(2**63 - 1)  # the watermark before any item (Long.MIN_VALUE + 1, as Flink's)
LATE_SCHEMA = pa.schema([("task", pa.string()), ("ts", pa.float64()), ("item", pa.string())])
_NOTHING: tuple[()] = ()

Event = dict[str, Any]


class AppEvents(StatefulLogic):
    """The whole stream's Taobao lines as app events (one key): each user's open item page and last time."""

    def __init__(self, resume: tuple[dict[str, list[Any]], dict[str, float]] | None):
        # user -> [item, category, last activity]; user -> last accepted time
        self.pages, self.last_ts = resume if resume is not None else ({}, {})

    def on_item(self, value: Row) -> tuple[list[Event], bool]:
        user, item, category, behavior, ts = value
        previous = self.last_ts.get(user)
        if previous is not None and ts < previous:
            return [], StatefulLogic.RETAIN  # time went backwards for this user: drop the line
        self.last_ts[user] = ts
        contents = {"item_id": item, "category_id": category, "behavior": behavior}
        page = self.pages.get(user)
        events = []
        if page is not None:
            if ts - page[2] > GAP_S:
                events.append(_event(user, "page_exit", page[2], {"item_id": page[0], "category_id": page[1]}))
            elif page[0] == item:
                page[2] = ts
                return [_event(user, behavior, ts, contents)], StatefulLogic.RETAIN
            else:
                events.append(_event(user, "page_exit", ts, {"item_id": page[0], "category_id": page[1]}))
        self.pages[user] = [item, category, ts]
        if behavior == "pv":
            events.append(_event(user, "page_enter", ts, contents))
        else:  # the click's button is on the item page: the user is back on it
            events.append(_event(user, "page_enter", ts, {"item_id": item, "category_id": category, "implicit": True}))
            events.append(_event(user, behavior, ts, contents))
        return events, StatefulLogic.RETAIN

    def on_eof(self) -> tuple[list[Event], bool]:
        exits = [_event(user, "page_exit", page[2], {"item_id": page[0], "category_id": page[1]})
                 for user, page in self.pages.items()]
        return exits, StatefulLogic.DISCARD

    def snapshot(self) -> tuple[dict[str, list[Any]], dict[str, float]]:
        return {user: list(page) for user, page in self.pages.items()}, dict(self.last_ts)


def _event(user: str, event_id: str, ts: float, contents: dict[str, Any]) -> Event:
    return {"user_id": user, "event_id": event_id, "page_id": ITEM_PAGE, "ts": ts, "contents": contents}


def watermark(out_of_orderness_s: float):
    """A ``stateful_map`` mapper over the whole stream (one key): each item as ``(item, its time in ms, the
    watermark before it)``; the state is the largest time seen (ms)."""
    behind = round(out_of_orderness_s * 1000) + 1

    def step(top: int | None, item: dict[str, Any]) -> tuple[int, tuple[dict[str, Any], int, int]]:
        ts = round(item["ts"] * 1000)
        if top is None:
            return ts, (item, ts, START_OF_TIME)
        return (ts if ts > top else top), (item, ts, top - behind)

    return step


def late_row(task: str, item: dict[str, Any]) -> dict[str, Any]:
    """The ``late_events`` row of an item no window would take: the task, its time, the item as JSON."""
    return {"task": task, "ts": item["ts"], "item": json.dumps(item, sort_keys=True)}
