"""The ``sessions`` task of ``jobs/sessions.py`` hand-written as a Bytewax 0.21.1 dataflow: the peer
``bench.peers`` measures streamflow's ``sessions`` job (:mod:`bench.sessions_job`) against.

What it computes, as the task on streamflow does: the app events of the Taobao CSV
(:mod:`bench.bytewax_app_events`), page entries and fav/cart/buy clicks only; per user, event-time session
windows with a 30 s gap and 5 s out of orderness; per session the events, the buys, the first and the last
time. Events too late for their session go to ``late_events``.

The session rules are Flink's ``EventTimeSessionWindows.withGap`` under ``WindowOperator`` (as
:mod:`streamflow.windowing` states them): the watermark is the *stream's*, the largest event time seen - 5 s
- 1 ms, before each item (:func:`bench.bytewax_app_events.watermark`); each event opens ``[ts, ts + gap)`` in
integer milliseconds and merges with every session it touches or overlaps; if the merged session's ``end - 1
(+ allowed lateness, 0 here)`` is not past the watermark it is kept, else the event is late (and nothing
changes); a session fires when the watermark reaches ``end - 1``; at the end of the input every session still
open fires.

Why not Bytewax's own ``SessionWindower`` with an ``EventClock``: its watermark is per key and moves with the
system clock too, it closes a session only once the watermark is a gap past the session's last item (Flink's
session is ``[first, last + gap)`` and fires at its end), and it never calls an item late. So the sessions are
a ``StatefulLogic`` per user written for these rules; as in :mod:`bench.bytewax_windows`, a user's session
fires at the user's next item or at the end of the input once the watermark it carries has passed it (the
same rows, emitted later).

Run it:  python -m bytewax.run "bench.bytewax_sessions:build_flow('events.csv', 'out.duckdb')"
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from bytewax import operators as op
from bytewax.connectors.files import FileSource
from bytewax.dataflow import Dataflow
from bytewax.operators import StatefulLogic

from bench.bytewax_app_events import LATE_SCHEMA, AppEvents, DuckDBSink, late_row, parse, watermark

TABLE = "sessions"
LATE = "late_events"
KINDS = frozenset(("page_enter", "fav", "cart", "buy"))
GAP_MS, LATENESS_MS = 30_000, 0
OUT_OF_ORDERNESS_S = 5.0
SCHEMA = pa.schema([("user_id", pa.string()), ("window_start", pa.float64()), ("window_end", pa.float64()),
                    ("events", pa.int64()), ("buys", pa.int64()), ("first_ts", pa.float64()),
                    ("last_ts", pa.float64())])

# a session: [start ms, end ms, events, buys, first ts, last ts, fires when the watermark reaches its end]
Session = list[Any]


class Sessions(StatefulLogic):
    """One user's open sessions, by start."""

    def __init__(self, resume: tuple[str, list[Session]] | None):
        self.user, self.sessions = resume if resume is not None else ("", [])

    def _row(self, session: Session) -> tuple[str, dict[str, Any]]:
        start, end, events, buys, first, last, _ = session
        return TABLE, {"user_id": self.user, "window_start": start / 1000, "window_end": end / 1000,
                       "events": events, "buys": buys, "first_ts": first, "last_ts": last}

    def _passed(self, watermark: int, out: list[tuple[str, Any]]) -> None:
        """What the watermark did since this user's last item: fire the sessions it reached, drop the old."""
        kept = []
        for session in self.sessions:
            if session[1] - 1 <= watermark and session[6]:
                session[6] = False
                out.append(self._row(session))
            if session[1] - 1 + LATENESS_MS > watermark:
                kept.append(session)
        self.sessions = kept

    def on_item(self, value: tuple[dict[str, Any], int, int]) -> tuple[list[tuple[str, Any]], bool]:
        event, ts, watermark = value
        self.user = event["user_id"]
        out: list[tuple[str, Any]] = []
        if self.sessions:
            self._passed(watermark, out)
        at = event["ts"]
        merged = [ts, ts + GAP_MS, 1, 1 if event["event_id"] == "buy" else 0, at, at, False]
        kept = []
        for session in self.sessions:
            if session[0] <= merged[1] and session[1] >= merged[0]:  # touching sessions merge too
                merged = [min(merged[0], session[0]), max(merged[1], session[1]), merged[2] + session[2],
                          merged[3] + session[3], min(merged[4], session[4]), max(merged[5], session[5]), False]
            else:
                kept.append(session)
        if merged[1] - 1 + LATENESS_MS <= watermark:
            out.append((LATE, event))  # even merged, the session is past its allowed lateness
            return out, StatefulLogic.RETAIN
        kept.append(merged)
        kept.sort(key=lambda session: session[0])
        self.sessions = kept
        if merged[1] - 1 <= watermark:
            out.append(self._row(merged))  # a late firing
        else:
            merged[6] = True
        return out, StatefulLogic.RETAIN

    def on_eof(self) -> tuple[list[tuple[str, Any]], bool]:
        return [self._row(session) for session in self.sessions if session[6]], StatefulLogic.DISCARD

    def snapshot(self) -> tuple[str, list[Session]]:
        return self.user, [list(session) for session in self.sessions]


def build_flow(events: str, db: str) -> Dataflow:
    """The session dataflow from the Taobao CSV ``events`` into tables ``sessions`` and ``late_events`` of
    DuckDB file ``db``."""
    flow = Dataflow("sessions")
    lines = op.input("csv", flow, FileSource(events))
    rows = op.filter_map("parse", lines, parse)
    app_events = op.stateful("app_events", op.key_on("stream", rows, lambda _: "stream"), AppEvents)
    interactions = op.filter_value("interactions", app_events, lambda event: event["event_id"] in KINDS)
    timed = op.stateful_map("watermark", interactions, watermark(OUT_OF_ORDERNESS_S))
    by_user = op.key_on("user", op.key_rm("unkey_stream", timed), lambda value: value[0]["user_id"])
    fired = op.key_rm("unkey_user", op.stateful("user_sessions", by_user, Sessions))
    split = op.branch("late", fired, lambda out: out[0] == LATE)
    op.output("sessions_table", op.map("session_rows", split.falses, lambda out: out[1]), DuckDBSink(db, TABLE, SCHEMA))
    late = op.map("late_rows", split.trues, lambda out: late_row(TABLE, out[1]))
    op.output("late_table", late, DuckDBSink(db, LATE, LATE_SCHEMA))
    return flow
