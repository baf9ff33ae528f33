"""The sliding-window job (``jobs/activity_windows.py``) hand-written as a Bytewax 0.21.1 dataflow: the peer
``bench.peers`` measures streamflow's ``windows`` job against.

What it computes, as the job on streamflow does: the app events of the Taobao CSV (:mod:`bench.bytewax_app_events`),
page entries and fav/cart/buy clicks only, each as an interaction ``{user_id, kind, item_id, ts, weight}``;
per user, sliding event-time windows of 60 s every 20 s (aligned to the epoch in integer milliseconds, as
Flink aligns them), 5 s out of orderness, 10 s allowed lateness; per window the events, the distinct items,
the summed weight, the buys and the last time, then ``score_per_event``; a row for every window with an
event. Items too late for all their windows go to ``late_events``.

The window rules are Flink's ``WindowOperator``'s (as :mod:`streamflow.windowing` states them):

- the watermark is the *stream's*: the largest event time seen - 5 s - 1 ms, before each item
  (:func:`bench.bytewax_app_events.watermark`);
- an item is added to each of its windows that is not late (a window is late once ``end - 1 + lateness <=
  watermark``); added to a window whose ``end - 1`` the watermark already passed, it fires that window again
  at once (a late firing, one more row); an item all of whose windows are late is a late event;
- a window fires when the watermark reaches ``end - 1`` and is dropped when it reaches ``end - 1 +
  lateness``; at the end of the input every window still open fires.

Why not Bytewax's own ``bytewax.operators.windowing`` (``EventClock`` + ``SlidingWindower``): its watermark is
kept per key and moves with the system clock as well (``wait_for_system_duration``: the watermark of a replay
depends on how fast it runs), a window closes once (no allowed lateness, no late firing), and an item is late
when its own time is behind the key's watermark, not when its windows are. So the windows are a
``StatefulLogic`` per user, written for these rules. Bytewax calls a key's logic only for that key's items
(other keys' items never reach it), so a user's window fires at the user's next item, or at the end of the
input, once the watermark it carries has passed the window: the same rows, emitted later than the watermark
allowed.

Run it:  python -m bytewax.run "bench.bytewax_windows:build_flow('events.csv', 'out.duckdb')"
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from bytewax import operators as op
from bytewax.connectors.files import FileSource
from bytewax.dataflow import Dataflow
from bytewax.operators import StatefulLogic

from bench.bytewax_app_events import LATE_SCHEMA, AppEvents, DuckDBSink, late_row, parse, watermark

TABLE = "activity"
LATE = "late_events"
WEIGHTS = {"page_enter": 1, "fav": 2, "cart": 3, "buy": 5}
SIZE_MS, SLIDE_MS, LATENESS_MS = 60_000, 20_000, 10_000
OUT_OF_ORDERNESS_S = 5.0
SCHEMA = pa.schema([("user_id", pa.string()), ("window_start", pa.float64()), ("window_end", pa.float64()),
                    ("events", pa.int64()), ("items", pa.int64()), ("score", pa.int64()), ("buys", pa.int64()),
                    ("last_ts", pa.float64()), ("score_per_event", pa.float64())])


def interaction(event: dict[str, Any]) -> dict[str, Any]:
    kind = event["event_id"]
    return {"user_id": event["user_id"], "kind": kind, "item_id": event["contents"]["item_id"], "ts": event["ts"],
            "weight": WEIGHTS[kind]}


class SlidingWindows(StatefulLogic):
    """One user's windows: start (ms) -> ``[events, item ids, score, buys, last ts, fires when the watermark
    reaches its end]``."""

    def __init__(self, resume: tuple[str, dict[int, list[Any]]] | None):
        self.user, self.windows = resume if resume is not None else ("", {})

    def _row(self, start: int, window: list[Any]) -> tuple[str, dict[str, Any]]:
        return TABLE, {"user_id": self.user, "window_start": start / 1000, "window_end": (start + SIZE_MS) / 1000,
                       "events": window[0], "items": len(window[1]), "score": window[2], "buys": window[3],
                       "last_ts": window[4]}

    def _passed(self, watermark: int, out: list[tuple[str, dict[str, Any]]]) -> None:
        """What the watermark did since this user's last item: fire the windows it reached, drop the old."""
        windows = self.windows
        for start in list(windows):
            last = start + SIZE_MS - 1
            if last <= watermark:
                window = windows[start]
                if window[5]:
                    window[5] = False
                    out.append(self._row(start, window))
                if last + LATENESS_MS <= watermark:
                    del windows[start]

    def on_item(self, value: tuple[dict[str, Any], int, int]) -> tuple[list[tuple[str, Any]], bool]:
        item, ts, watermark = value
        self.user = item["user_id"]
        windows = self.windows
        out: list[tuple[str, Any]] = []
        if windows:
            self._passed(watermark, out)
        taken = False
        start = ts - ts % SLIDE_MS
        while start > ts - SIZE_MS:
            last = start + SIZE_MS - 1
            if last + LATENESS_MS > watermark:  # else this window is late
                taken = True
                window = windows.get(start)
                if window is None:
                    window = windows[start] = [0, set(), 0, 0, None, False]
                window[0] += 1
                window[1].add(item["item_id"])
                window[2] += item["weight"]
                if item["kind"] == "buy":
                    window[3] += 1
                if window[4] is None or item["ts"] > window[4]:
                    window[4] = item["ts"]
                if last <= watermark:
                    out.append(self._row(start, window))  # a late firing
                else:
                    window[5] = True
            start -= SLIDE_MS
        if not taken:
            out.append((LATE, item))
        return out, StatefulLogic.RETAIN

    def on_eof(self) -> tuple[list[tuple[str, Any]], bool]:
        return [self._row(start, window) for start, window in self.windows.items() if window[5]], StatefulLogic.DISCARD

    def snapshot(self) -> tuple[str, dict[int, list[Any]]]:
        return self.user, {start: [w[0], set(w[1]), *w[2:]] for start, w in self.windows.items()}


def score_per_event(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "score_per_event": round(row["score"] / row["events"], 6)}


def build_flow(events: str, db: str) -> Dataflow:
    """The sliding-window dataflow from the Taobao CSV ``events`` into tables ``activity`` and ``late_events``
    of DuckDB file ``db``."""
    flow = Dataflow("activity_windows")
    lines = op.input("csv", flow, FileSource(events))
    rows = op.filter_map("parse", lines, parse)
    app_events = op.stateful("app_events", op.key_on("stream", rows, lambda _: "stream"), AppEvents)
    activity = op.filter_value("activity_only", app_events, lambda event: event["event_id"] in WEIGHTS)
    interactions = op.map_value("interaction", activity, interaction)
    timed = op.stateful_map("watermark", interactions, watermark(OUT_OF_ORDERNESS_S))
    by_user = op.key_on("user", op.key_rm("unkey_stream", timed), lambda value: value[0]["user_id"])
    fired = op.key_rm("unkey_user", op.stateful("windows", by_user, SlidingWindows))
    split = op.branch("late", fired, lambda out: out[0] == LATE)
    windows = op.map("score_per_event", op.map("window_rows", split.falses, lambda out: out[1]), score_per_event)
    active = op.filter("active", windows, lambda row: row["events"] >= 1)
    op.output("activity_table", active, DuckDBSink(db, TABLE, SCHEMA))
    late = op.map("late_rows", split.trues, lambda out: late_row(TABLE, out[1]))
    op.output("late_table", late, DuckDBSink(db, LATE, LATE_SCHEMA))
    return flow
