"""Event-time windows over a whole bounded input at once: what a stream task's ``TimeWindow`` + ``Aggregate`` emits,
in the order the streaming run emits it (the device runner's batch mode for stream tasks).

Streaming, :class:`~streamflow.windowing.EventTimeWindows` decides per item under the watermark (rules in
:mod:`streamflow.windowing`). Over a bounded input every one of those decisions is a function of the items' order
and times, so they are made for all items at once, with NumPy:

- the watermark while item ``i`` is added is ``max(ts[:i]) - out_of_orderness - 1`` (a running maximum);
- item ``i`` is a late event when even its newest window is late then (``end - 1 + lateness <= watermark``);
- a window of a key fires on time when the watermark first reaches its ``end - 1`` (a sorted search over the
  running maximum: right after the item that moved it there), or at the end of the input, if an item of the key
  reached the window before then; and once more (a late firing) for each item added to it after that while the
  window is within its lateness;
- a window's contents at a firing are the items of its key in it up to that point, in arrival order: an item
  added to a window stays until the window is past its lateness, when it can fire no more, and a late event is in
  no window;
- the outputs come out in the streaming run's order: per item its late firings (its newest window first) or its
  late event, then the firings of the timers the watermark passed after it, in (time, registration) order; a
  window's timer is registered by the first item of its key added to it on time.

Only the aggregation runs per firing, with the aggregate's own fold over the window's items (so each aggregation
gives exactly what it gives streaming). When the allowed lateness is a positive multiple of the slide, a key's
cleanup timer can share the time of one of its firings and reorder firings of equal time: such a window
streams (:func:`refusal`).

Example:
    >>> from operators import Aggregate, Count, TimeWindow
    >>> windows = BatchTimeWindows(TimeWindow(10), Aggregate(n=Count()), "user")
    >>> windows.outputs(["u", "u", "u"], [{"ts": 3.0}, {"ts": 12.0}, {"ts": 4.0}], [3000, 12000, 4000])
    [(1, 'emit', {'user': 'u', 'window_start': 0.0, 'window_end': 10.0, 'n': 1}), (2, 'late_events', {'ts': 4.0}), \
(3, 'emit', {'user': 'u', 'window_start': 10.0, 'window_end': 20.0, 'n': 1})]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from operators import Aggregate, TimeWindow
from operators.process import LATE
from operators.window import to_millis
from streamflow.keyed import START_OF_TIME
from streamflow.windowing import window_row

#: Event times (ms) within this bound keep every sum of the arithmetic below inside int64.
_TIME_BOUND = 2 ** 60


def refusal(window: TimeWindow) -> str | None:
    """Why ``window`` runs streaming only, or ``None``."""
    lateness, slide = to_millis(window.allowed_lateness), to_millis(window.slide)
    if lateness > 0 and lateness % slide == 0:
        return (f"its allowed lateness ({window.allowed_lateness} s) is a multiple of its slide: cleanup timers may "
                "share a firing's time")
    return None


class BatchTimeWindows:
    """A ``TimeWindow`` + ``Aggregate`` keyed step over a whole input (see the module docstring)."""

    def __init__(self, window: TimeWindow, aggregate: Aggregate, key_name: str):
        self.size, self.slide = to_millis(window.size), to_millis(window.slide)
        self.offset, self.lateness = to_millis(window.offset), to_millis(window.allowed_lateness)
        self.bound = to_millis(window.out_of_orderness)
        self.fold = aggregate.fold_one
        self.key_name = key_name

    def outputs(self, keys: Sequence[Any], items: Sequence[Any], ts_ms: Sequence[int]) -> list[tuple[int, str, Any]]:
        """The keyed step's outputs for items ``i`` of key ``keys[i]`` at ``ts_ms[i]``, in order: ``(i, tag,
        value)``, ``i`` the item it came with (``len(items)``: the end of the input), ``tag`` ``"emit"`` (a window's
        row) or ``late_events`` (the item). ``ValueError`` for times past ±2**60 ms; the fold's own exception if
        an aggregation raises."""
        n = len(items)
        if n == 0:
            return []
        ts = np.asarray(ts_ms, dtype=np.int64)
        if np.abs(ts).max() >= _TIME_BOUND:
            raise ValueError("event times past 2**60 ms")
        size, slide, lateness = self.size, self.slide, self.lateness
        running = np.maximum.accumulate(ts)
        watermark = np.empty(n, dtype=np.int64)
        watermark[0] = START_OF_TIME
        watermark[1:] = running[:-1] - self.bound - 1
        newest = ts - np.mod(ts - self.offset, slide)
        late_event = newest + (size - 1 + lateness) <= watermark

        # (item, window) pairs: each item not late with each of its windows not past its lateness
        added = np.flatnonzero(~late_event)
        item_of, window_no, start_of = [], [], []
        for j in range(-(-size // slide)):
            starts = newest[added] - j * slide
            ok = (starts > ts[added] - size) & (starts + (size - 1 + lateness) > watermark[added])
            item_of.append(added[ok])
            window_no.append(np.full(int(ok.sum()), j, dtype=np.int64))
            start_of.append(starts[ok])
        pair_item, pair_window, pair_start = (np.concatenate(parts) for parts in (item_of, window_no, start_of))
        codes: dict[Any, int] = {}
        key_code = np.fromiter((codes.setdefault(key, len(codes)) for key in keys), dtype=np.int64, count=n)
        order = np.lexsort((pair_item, pair_start, key_code[pair_item]))  # by key, window, arrival
        pair_item, pair_window, pair_start = pair_item[order], pair_window[order], pair_start[order]
        pair_key = key_code[pair_item]
        first = np.ones(len(order), dtype=bool)
        first[1:] = (pair_key[1:] != pair_key[:-1]) | (pair_start[1:] != pair_start[:-1])
        group = np.cumsum(first) - 1
        group_start = np.flatnonzero(first)
        on_time = pair_start + (size - 1) > watermark[pair_item]

        # on-time firings: windows whose first item came on time (its timer), after the item that moves the
        # watermark to the window's end - 1 (n: the end of the input), with the window's items up to that one
        fires = np.flatnonzero(on_time[group_start])
        fire_time = pair_start[group_start[fires]] + (size - 1)
        fire_after = np.searchsorted(running, fire_time + self.bound + 1, side="left")
        arrival = group * (n + 1) + pair_item  # sorted: groups in order, items in order within each
        fire_end = np.searchsorted(arrival, fires * (n + 1) + fire_after, side="right")
        # late firings: each pair added after its window fired, with the window's items up to it
        late = np.flatnonzero(~on_time)

        kinds = np.concatenate([np.zeros(len(fires), dtype=np.int8), np.ones(len(late), dtype=np.int8),
                                np.full(n - len(added), 2, dtype=np.int8)])
        where = np.concatenate([fires, late, np.flatnonzero(late_event)])
        at = np.concatenate([fire_after, pair_item[late], where[len(fires) + len(late):]])
        phase = np.concatenate([np.ones(len(fires), dtype=np.int8), np.zeros(n - len(added) + len(late), np.int8)])
        tie = np.concatenate([fire_time, pair_window[late], np.zeros(n - len(added), dtype=np.int64)])
        registered = np.concatenate([pair_item[group_start[fires]], np.zeros(len(late) + n - len(added), np.int64)])
        emitted = np.lexsort((registered, tie, phase, at))

        fold, key_name, items_at = self.fold, self.key_name, items.__getitem__
        starts_of = group_start.tolist()
        ends_of = np.zeros(len(group_start), dtype=np.int64)
        ends_of[fires] = fire_end
        ends_of = ends_of.tolist()
        out: list[tuple[int, str, Any]] = []
        for k, w, i in zip(kinds[emitted].tolist(), where[emitted].tolist(), at[emitted].tolist(), strict=True):
            if k == 2:
                out.append((i, LATE, items[i]))
                continue
            if k == 0:
                begin, end = starts_of[w], ends_of[w]
            else:
                begin, end = starts_of[group[w]], w + 1
            members = pair_item[begin:end].tolist()
            start = int(pair_start[begin])
            out.append((i, "emit", window_row(key_name, keys[members[0] if k == 0 else i], start / 1000,
                                              (start + size) / 1000, fold(list(map(items_at, members))))))
        return out


__all__ = ["BatchTimeWindows", "refusal"]
