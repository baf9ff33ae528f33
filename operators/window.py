"""TimeWindow: event-time tumbling and sliding windows."""

from __future__ import annotations

from typing import Any

from operators.base import FieldSpec, Group, Operator, field_reader


def to_millis(seconds: float) -> int:
    """Event time in integer milliseconds, as Flink keeps it (and every runner aligns windows in)."""
    return round(seconds * 1000)


def window_starts_ms(ts: int, size: int, slide: int, offset: int = 0) -> list[int]:
    """Starts (ms) of the windows ``[start, start + size)`` containing ``ts`` (ms), newest first.

    Flink's sliding assigner: the last start is ``TimeWindow.getWindowStartWithOffset(ts, offset,
    slide)``, then one window per ``slide`` back while the window still holds ``ts``. Integers, so
    exact: Python's ``%`` floors, which is what Flink's negative-remainder branch does.

    Example:
        >>> window_starts_ms(125_000, size=60_000, slide=30_000)
        [120000, 90000]
    """
    last = ts - (ts - offset) % slide
    return list(range(last, ts - size, -slide))


def window_starts(ts: float, size: float, slide: float, offset: float = 0.0) -> list[float]:
    """Starts (seconds) of the windows ``[start, start + size)`` that contain ``ts``, earliest first.

    Windows are aligned to ``offset`` (epoch by default) in integer milliseconds
    (:func:`window_starts_ms`), as Flink aligns its window assigners, so the same event lands in
    the same windows on every runner, fractional sizes included.

    Example:
        >>> window_starts(125.0, size=60, slide=30)
        [90.0, 120.0]
        >>> window_starts(1533402464.58, size=0.03, slide=0.03)
        [1533402464.58]
    """
    starts = window_starts_ms(to_millis(ts), to_millis(size), to_millis(slide), to_millis(offset))
    return [start / 1000 for start in reversed(starts)]


class TimeWindow(Operator):
    """Split each group into event-time windows; ``window_start``/``window_end`` join the group key.

    ``size`` and ``slide`` are seconds (kept to the millisecond, as Flink keeps event time); without
    ``slide`` the windows tumble (``slide = size``).
    With ``slide < size`` an item belongs to every window that contains it (``size / slide`` of them
    when ``slide`` divides ``size``). Windows without items
    are not produced. ``ts`` names the event-time field (``"ts"`` by default) or computes it.

    In a stream task (``input="stream"``) windows close as the watermark passes them:
    ``out_of_orderness`` is how far (seconds) events may arrive out of order before they count as
    late, ``allowed_lateness`` how long a fired window still takes late events (each one fires it
    again); later events go to the ``late_events`` table (see :mod:`streamflow.windowing`). A trigger
    task refuses both options: its pipeline runs over a finite sequence, so nothing there is late.

    Example:
        >>> from operators import Aggregate, Count, run_pipeline
        >>> rows = run_pipeline([TimeWindow(60), Aggregate(n=Count())],
        ...                     [{"ts": 10}, {"ts": 50}, {"ts": 70}])
        >>> [(r["window_start"], r["n"]) for r in rows]
        [(0.0, 2), (60.0, 1)]
    """

    def __init__(self, size: float, slide: float | None = None, ts: FieldSpec = "ts", offset: float = 0.0,
                 allowed_lateness: float = 0.0, out_of_orderness: float = 0.0):
        slide = size if slide is None else slide
        if not (size > 0 and slide > 0):
            raise ValueError(f"window size and slide must be positive, got size={size}, slide={slide}")
        if to_millis(slide) < 1:
            raise ValueError(f"window size and slide must be at least a millisecond (event time is kept "
                             f"in milliseconds), got size={size}, slide={slide}")
        if slide > size:
            raise ValueError(f"slide {slide} > size {size} would leave gaps between windows")
        if allowed_lateness < 0 or out_of_orderness < 0:
            raise ValueError("allowed_lateness and out_of_orderness must be >= 0 seconds")
        self.allowed_lateness = float(allowed_lateness)
        self.out_of_orderness = float(out_of_orderness)
        self.size = float(size)
        self.slide = float(slide)
        self.offset = float(offset)
        self.ts = ts
        self._read_ts = field_reader(ts)

    def apply(self, groups: list[Group]) -> list[Group]:
        size, slide, offset = to_millis(self.size), to_millis(self.slide), to_millis(self.offset)
        out: list[Group] = []
        for key, items in groups:
            windows: dict[int, list[Any]] = {}
            for item in items:
                for start in window_starts_ms(to_millis(self._read_ts(item)), size, slide, offset):
                    windows.setdefault(start, []).append(item)
            for start in sorted(windows):
                bounds = {"window_start": start / 1000, "window_end": (start + size) / 1000}
                out.append(({**key, **bounds}, windows[start]))
        return out


class SessionWindow(Operator):
    """Split each key's items into sessions: a session ends after ``gap`` seconds without an item.

    Flink's ``EventTimeSessionWindows.withGap``: each item opens the window ``[ts, ts + gap)`` and
    windows that touch or overlap merge, so a session's bounds are its first item's time and its
    last item's time plus ``gap``. In a stream task a session fires when the watermark passes its end;
    ``out_of_orderness`` and ``allowed_lateness`` work as for :class:`TimeWindow`.

    Example:
        >>> from operators import Aggregate, Count, run_pipeline
        >>> rows = run_pipeline([SessionWindow(30), Aggregate(n=Count())],
        ...                     [{"ts": 10}, {"ts": 30}, {"ts": 100}])
        >>> [(r["window_start"], r["window_end"], r["n"]) for r in rows]
        [(10.0, 60.0, 2), (100.0, 130.0, 1)]
    """

    def __init__(self, gap: float, ts: FieldSpec = "ts", allowed_lateness: float = 0.0, out_of_orderness: float = 0.0):
        if not gap > 0:
            raise ValueError(f"session gap must be positive seconds, got {gap!r}")
        if allowed_lateness < 0 or out_of_orderness < 0:
            raise ValueError("allowed_lateness and out_of_orderness must be >= 0 seconds")
        self.gap = float(gap)
        self.ts = ts
        self.allowed_lateness = float(allowed_lateness)
        self.out_of_orderness = float(out_of_orderness)
        self._read_ts = field_reader(ts)

    def apply(self, groups: list[Group]) -> list[Group]:
        out: list[Group] = []
        for key, items in groups:
            sessions: list[list[Any]] = []  # [start, end, items], by start
            for item in sorted(items, key=self._read_ts):
                ts = float(self._read_ts(item))
                if sessions and ts <= sessions[-1][1]:  # touching windows merge, as in Flink
                    sessions[-1][1] = max(sessions[-1][1], ts + self.gap)
                    sessions[-1][2].append(item)
                else:
                    sessions.append([ts, ts + self.gap, [item]])
            out.extend(({**key, "window_start": s, "window_end": e}, its) for s, e, its in sessions)
        return out


class CountWindow(Operator):
    """Windows of ``size`` items per key, as Flink's ``countWindow(size[, slide])``.

    Tumbling (no ``slide``): every ``size`` items of a key form one window. Sliding: every ``slide``
    items, a window of the key's last ``size`` items (fewer at the start). Incomplete tumbling
    windows never fire, as in Flink. The row carries the key and the aggregates.

    Example:
        >>> from operators import Aggregate, KeyBy, Sum, run_pipeline
        >>> run_pipeline([KeyBy("k"), CountWindow(2), Aggregate(total=Sum("x"))],
        ...              [{"k": "a", "x": 1}, {"k": "a", "x": 2}, {"k": "a", "x": 3}])
        [{'k': 'a', 'total': 3}]
    """

    def __init__(self, size: int, slide: int | None = None):
        for name, value in (("size", size), ("slide", size if slide is None else slide)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"count window {name} must be a positive integer, got {value!r}")
        self.size = size
        self.slide = slide

    def ends(self, n_items: int) -> range:
        """After which items (1-based counts) of a key a window fires."""
        return range(self.slide or self.size, n_items + 1, self.slide or self.size)

    def apply(self, groups: list[Group]) -> list[Group]:
        return [(dict(key), items[max(0, end - self.size):end])
                for key, items in groups for end in self.ends(len(items))]
