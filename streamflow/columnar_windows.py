"""Event-time windows a block of items at a time: what a stream task's ``TimeWindow`` + ``Aggregate`` emits, in the
order the streaming run emits it (the device runner's batch mode for stream tasks).

Streaming, :class:`~streamflow.windowing.EventTimeWindows` decides per item under the watermark (rules in
:mod:`streamflow.windowing`). Every one of those decisions is a function of the items' order and times up to that
item, so they are made for a whole block of items at once, with NumPy, carrying to the next block only the items
of the windows still within their lateness (what any later firing can hold):

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
gives exactly what it gives streaming). One difference: an aggregation that raises (``Max`` over a number and a
string, say) fails the firing (a :data:`FAILED` output naming the key and the window), where streaming fails the
event whose ``add`` raised. When the allowed lateness is a positive multiple of the slide, a key's
cleanup timer can share the time of one of its firings and reorder firings of equal time: such a window
streams (:func:`refusal`).

Example:
    >>> from operators import Aggregate, Count, TimeWindow
    >>> windows = BatchTimeWindows(TimeWindow(10), Aggregate(n=Count()), "user")
    >>> windows.add(["u", "u"], [{"ts": 3.0}, {"ts": 12.0}], [3000, 12000])  # items 0 and 1
    [(1, 'emit', {'user': 'u', 'window_start': 0.0, 'window_end': 10.0, 'n': 1})]
    >>> windows.add(["u"], [{"ts": 4.0}], [4000]), windows.finish()  # item 2, then the end (3)
    ([(2, 'late_events', {'ts': 4.0})], [(3, 'emit', {'user': 'u', 'window_start': 10.0, 'window_end': 20.0, 'n': 1})])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from operators import Aggregate, Count, CountDistinct, CountWindow, First, Last, Max, Min, Sum, TimeWindow
from operators.aggregations import Aggregation
from operators.process import LATE
from operators.window import to_millis
from streamflow.keyed import START_OF_TIME
from streamflow.windowing import window_row

#: The tag of a firing whose aggregation raised; its value is ``(key, (window start, window end), exception)``.
FAILED = "failed"
#: Integer sums below this are exact in int64 (and in Python's int).
_EXACT_SUM = 2 ** 62
#: Event times (ms) within this bound keep every sum of the arithmetic below inside int64 (36 million years).
TIME_BOUND = 2 ** 60


def refusal(window: TimeWindow) -> str | None:
    """Why ``window`` runs streaming only, or ``None``."""
    lateness, slide = to_millis(window.allowed_lateness), to_millis(window.slide)
    if lateness > 0 and lateness % slide == 0:
        return (f"its allowed lateness ({window.allowed_lateness} s) is a multiple of its slide: cleanup timers may "
                "share a firing's time")
    return None


class BatchTimeWindows:
    """A ``TimeWindow`` + ``Aggregate`` keyed step a block of items at a time (see the module docstring)."""

    def __init__(self, window: TimeWindow, aggregate: Aggregate, key_name: str):
        self.size, self.slide = to_millis(window.size), to_millis(window.slide)
        self.offset, self.lateness = to_millis(window.offset), to_millis(window.allowed_lateness)
        self.bound = to_millis(window.out_of_orderness)
        self.fold = aggregate.fold_one
        self.aggregations = list(aggregate.aggregations.items())
        self.key_name = key_name
        self.seen = 0  # items added so far: the next item's number
        self._clock: int | None = None  # the largest time seen
        self._codes: dict[Any, int] = {}  # key -> its number
        # the (item, window) pairs of the windows still within their lateness: item number, key number, window
        # start, whether the item came on time for the window
        self._pairs = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, bool))
        self._held: dict[int, tuple[Any, Any]] = {}  # item number -> (key, item), for the pairs above

    def outputs(self, keys: Sequence[Any], items: Sequence[Any], ts_ms: Sequence[int]) -> list[tuple[int, str, Any]]:
        """:meth:`add` of a whole input, then :meth:`finish`."""
        return self.add(keys, items, ts_ms) + self.finish()

    def add(self, keys: Sequence[Any], items: Sequence[Any], ts_ms: Sequence[int]) -> list[tuple[int, str, Any]]:
        """The next items (numbered on from :attr:`seen`), of key ``keys[i]`` at ``ts_ms[i]`` each: the keyed
        step's outputs up to the last of them, in order, as ``(n, tag, value)``: ``n`` the number of the item it
        came with, ``tag`` ``"emit"`` (a window's row), ``late_events`` (the item) or :data:`FAILED`.
        ``ValueError`` for times past ±2**60 ms (nothing added)."""
        m = len(items)
        if m == 0:
            return []
        try:
            ts = np.asarray(ts_ms, dtype=np.int64)
        except OverflowError:
            raise ValueError("event times past 2**60 ms") from None
        if np.abs(ts).max() >= TIME_BOUND:
            raise ValueError("event times past 2**60 ms")
        size, slide, lateness, first = self.size, self.slide, self.lateness, self.seen
        running = np.maximum.accumulate(ts)
        watermark = np.empty(m, dtype=np.int64)
        if self._clock is None:
            watermark[0] = START_OF_TIME
        else:
            running = np.maximum(running, self._clock)
            watermark[0] = self._clock - self.bound - 1
        watermark[1:] = running[:-1] - self.bound - 1
        newest = ts - np.mod(ts - self.offset, slide)
        late_event = newest + (size - 1 + lateness) <= watermark

        # the new (item, window) pairs: each item not late with each of its windows not past its lateness
        added = np.flatnonzero(~late_event)
        new_item, new_window, new_start = [], [], []
        for j in range(-(-size // slide)):
            starts = newest[added] - j * slide
            ok = (starts > ts[added] - size) & (starts + (size - 1 + lateness) > watermark[added])
            new_item.append(added[ok])
            new_window.append(np.full(int(ok.sum()), j, dtype=np.int64))
            new_start.append(starts[ok])
        local, window_no, start = (np.concatenate(parts) for parts in (new_item, new_window, new_start))
        codes = self._codes
        key_code = np.fromiter((codes.setdefault(key, len(codes)) for key in keys), dtype=np.int64, count=m)
        held = self._held
        for i in added.tolist():
            held[first + i] = (keys[i], items[i])
        on_time = start + (size - 1) > watermark[local]
        late = np.flatnonzero(~on_time)
        late_item, late_window = local[late] + first, window_no[late]

        # every pair, carried and new, by key, window and arrival
        carried_item, carried_key, carried_start, carried_on_time = self._pairs
        pair_item = np.concatenate([carried_item, local + first])
        pair_key = np.concatenate([carried_key, key_code[local]])
        pair_start = np.concatenate([carried_start, start])
        pair_on_time = np.concatenate([carried_on_time, on_time])
        order = np.lexsort((pair_item, pair_start, pair_key))
        pair_item, pair_key, pair_start, pair_on_time = (a[order] for a in (pair_item, pair_key, pair_start,
                                                                             pair_on_time))
        n_pairs = len(pair_item)
        group, group_start = _runs(pair_key, pair_start)
        end_item = first + m  # past the items there are so far
        arrival = group * (end_item + 1) + pair_item  # sorted: groups in order, items in order within each

        # on-time firings in this block: windows whose first item came on time (its timer), when the watermark
        # first reaches the window's end - 1 after one of this block's items
        fire_time = pair_start[group_start] + (size - 1)
        fire_after = np.searchsorted(running, fire_time + self.bound + 1, side="left")
        fires = np.flatnonzero(pair_on_time[group_start] & (fire_time > watermark[0]) & (fire_after < m))
        fire_end = np.searchsorted(arrival, fires * (end_item + 1) + first + fire_after[fires], side="right")
        # late firings: each new pair added after its window fired, with the window's items up to it
        sorted_at = np.empty(n_pairs, dtype=np.int64)
        sorted_at[order] = np.arange(n_pairs)
        late_position = sorted_at[len(carried_item) + late]  # where each late pair is among the sorted pairs
        late_events = np.flatnonzero(late_event)

        out = self._emit(
            kinds=[np.zeros(len(fires), np.int8), np.ones(len(late), np.int8), np.full(len(late_events), 2, np.int8)],
            where=[fires, late_position, late_events + first],
            at=[first + fire_after[fires], late_item, late_events + first],
            phase=[np.ones(len(fires), np.int8), np.zeros(len(late) + len(late_events), np.int8)],
            tie=[fire_time[fires], late_window, np.zeros(len(late_events), np.int64)],
            registered=[pair_item[group_start[fires]], np.zeros(len(late) + len(late_events), np.int64)],
            group=group, group_start=group_start, fire_end=(fires, fire_end), pair_item=pair_item,
            pair_start=pair_start, items={i + first: items[i] for i in late_events.tolist()})

        # carry the pairs of the windows still within their lateness after the block
        now = running[-1] - self.bound - 1
        keep = pair_start + (size - 1 + lateness) > now
        self._pairs = (pair_item[keep], pair_key[keep], pair_start[keep], pair_on_time[keep])
        self._held = {n: held[n] for n in self._pairs[0].tolist()}
        self.seen, self._clock = end_item, int(running[-1])
        return out

    def finish(self) -> list[tuple[int, str, Any]]:
        """The end of the input: the windows whose on-time firing is still to come fire, by time and registration,
        each with all its items (numbered :attr:`seen`)."""
        pair_item, pair_key, pair_start, pair_on_time = self._pairs
        if not len(pair_item) or self._clock is None:  # (a block with pairs has set the clock)
            return []
        group, group_start = _runs(pair_key, pair_start)
        fire_time = pair_start[group_start] + (self.size - 1)
        watermark = self._clock - self.bound - 1
        fires = np.flatnonzero(pair_on_time[group_start] & (fire_time > watermark))
        group_end = np.append(group_start[1:], len(pair_item))
        out = self._emit(
            kinds=[np.zeros(len(fires), np.int8)], where=[fires], at=[np.full(len(fires), self.seen, np.int64)],
            phase=[np.ones(len(fires), np.int8)], tie=[fire_time[fires]], registered=[pair_item[group_start[fires]]],
            group=group, group_start=group_start, fire_end=(fires, group_end[fires]), pair_item=pair_item,
            pair_start=pair_start, items={})
        self._pairs = (pair_item[:0], pair_key[:0], pair_start[:0], pair_on_time[:0])
        self._held.clear()
        return out

    def _emit(self, *, kinds: list[np.ndarray], where: list[np.ndarray], at: list[np.ndarray],
              phase: list[np.ndarray], tie: list[np.ndarray], registered: list[np.ndarray], group: np.ndarray,
              group_start: np.ndarray, fire_end: tuple[np.ndarray, np.ndarray], pair_item: np.ndarray,
              pair_start: np.ndarray, items: dict[int, Any]) -> list[tuple[int, str, Any]]:
        """The outputs in the streaming run's order: by item, then during it (late firings, newest window first, or
        its late event) before after it (timers by time, then by registration). ``kinds``: 0 an on-time firing
        (``where`` its group), 1 a late firing (``where`` its pair), 2 a late event (``where`` the item)."""
        kind, place, position = np.concatenate(kinds), np.concatenate(where), np.concatenate(at)
        emitted = np.lexsort((np.concatenate(registered), np.concatenate(tie), np.concatenate(phase), position))
        kind, place, position = kind[emitted], place[emitted], position[emitted]
        firing = kind != 2
        fired_kind, fired_place = kind[firing], place[firing]
        ends = np.zeros(len(group_start), dtype=np.int64)
        ends[fire_end[0]] = fire_end[1]
        on_time = fired_kind == 0
        firing_group = np.where(on_time, fired_place, group[fired_place])  # a late firing's place is its pair
        begin = group_start[firing_group]
        end = np.where(on_time, ends[firing_group], fired_place + 1)
        key_item = np.where(on_time, pair_item[begin], position[firing])
        results = self._results(begin, end, pair_item, group)
        held, key_name, size = self._held, self.key_name, self.size
        starts = pair_start[begin].tolist()
        firings = zip(starts, key_item.tolist(), results, strict=True)
        out: list[tuple[int, str, Any]] = []
        for k, w, n in zip(kind.tolist(), place.tolist(), position.tolist(), strict=True):
            if k == 2:
                out.append((n, LATE, items[w]))
                continue
            window_start, key_at, result = next(firings)
            window = (window_start / 1000, (window_start + size) / 1000)
            key = held[key_at][0]
            if isinstance(result, Exception):  # the firing fails alone (see the module docstring)
                out.append((n, FAILED, (key, window, result)))
            else:
                out.append((n, "emit", window_row(key_name, key, *window, result)))
        return out

    def _results(self, begin: np.ndarray, end: np.ndarray, pair_item: np.ndarray,
                 group: np.ndarray | None) -> list[dict[str, Any] | Exception]:
        """Each firing's aggregation results (the items of pairs ``begin[f]:end[f]``, a window's first pair on), or
        the exception its fold raised: common aggregations over arrays (prefix sums and reductions over the pairs),
        the others with their own fold per firing. ``group``: each pair's window, when every range starts at its
        window's first pair (``None``: ranges start anywhere)."""
        n = len(begin)
        if n == 0:
            return []
        held = self._held
        items = [held[i][1] for i in pair_item.tolist()]
        columns: dict[str, list[Any]] = {}
        folded: list[tuple[str, Any]] = []
        for name, aggregation in self.aggregations:
            column = _column(aggregation, items, begin, end, group)
            if column is None:
                folded.append((name, aggregation))
            else:
                columns[name] = column
        if not columns:
            return _fold_each(self.fold, items, begin, end)
        names = [name for name, _ in self.aggregations]
        rows: list[dict[str, Any] | Exception] = [dict(zip(columns, values, strict=True))
                                                   for values in zip(*columns.values(), strict=True)]
        if folded:
            for f, (b, e) in enumerate(zip(begin.tolist(), end.tolist(), strict=True)):
                part, row = items[b:e], rows[f]
                assert not isinstance(row, Exception)  # each firing's row is filled here, once
                try:
                    row.update((name, aggregation.fold(part)) for name, aggregation in folded)
                except Exception as exc:  # noqa: BLE001 - the firing fails alone
                    rows[f] = exc
        if list(columns) != names:
            rows = [row if isinstance(row, Exception) else {name: row[name] for name in names} for row in rows]
        return rows


class BatchCountWindows(BatchTimeWindows):
    """A ``CountWindow`` + ``Aggregate`` keyed step a block of items at a time (as
    :class:`~streamflow.windowing.CountWindows`: a window of a key's last ``size`` items fires on the item that
    completes it, every ``slide`` (else ``size``) items of the key; nothing fires at the end). Carried to the next
    block: each key's count and its last ``size - 1`` items.

    Example:
        >>> from operators import Aggregate, CountWindow, Sum
        >>> windows = BatchCountWindows(CountWindow(2), Aggregate(total=Sum("x")), "k")
        >>> windows.add(["a", "b", "a"], [{"x": 1}, {"x": 5}, {"x": 2}], [0, 0, 0])
        [(2, 'emit', {'k': 'a', 'total': 3})]
        >>> windows.add(["b"], [{"x": 6}], [0]), windows.finish()
        ([(3, 'emit', {'k': 'b', 'total': 11})], [])
    """

    def __init__(self, window: CountWindow, aggregate: Aggregate, key_name: str):
        self.size, self.step = window.size, window.slide or window.size
        self.fold = aggregate.fold_one
        self.aggregations = list(aggregate.aggregations.items())
        self.key_name = key_name
        self.seen = 0
        self._codes: dict[Any, int] = {}
        self._counts = np.zeros(0, dtype=np.int64)  # key number -> its items so far
        self._recent = np.empty(0, np.int64)  # the carried items' numbers (each key's last size - 1)
        self._held: dict[int, tuple[Any, Any]] = {}

    def add(self, keys: Sequence[Any], items: Sequence[Any], ts_ms: Sequence[int]) -> list[tuple[int, str, Any]]:
        """The next items of keys ``keys[i]`` (``ts_ms`` is not read): the windows they complete, in order."""
        m = len(items)
        if m == 0:
            return []
        first, codes, held = self.seen, self._codes, self._held
        key_code = np.fromiter((codes.setdefault(key, len(codes)) for key in keys), dtype=np.int64, count=m)
        counts = np.zeros(len(codes), dtype=np.int64)
        counts[:len(self._counts)] = self._counts
        for i, (key, item) in enumerate(zip(keys, items, strict=True)):
            held[first + i] = (key, item)
        number = np.concatenate([self._recent, np.arange(first, first + m, dtype=np.int64)])
        code = np.concatenate([np.fromiter((codes[held[n][0]] for n in self._recent.tolist()), np.int64,
                                           len(self._recent)), key_code])
        order = np.lexsort((number, code))  # by key, then arrival
        number, code = number[order], code[order]
        key_block, block_start = _runs(code)
        position_in_key = np.arange(len(number)) - block_start[key_block]
        carried = np.bincount(code, weights=number < first, minlength=len(codes)).astype(np.int64)
        # the key's count after each of its items: earlier blocks' count, less what is carried, plus the position
        count = counts[code] - carried[code] + position_in_key + 1
        fires = np.flatnonzero((number >= first) & (count % self.step == 0) & (count >= min(self.size, self.step)))
        fires = fires[np.argsort(number[fires], kind="stable")]
        end = fires + 1
        begin = end - np.minimum(count[fires], self.size)
        results = self._results(begin, end, number, None)
        key_name = self.key_name
        out: list[tuple[int, str, Any]] = []
        for n, result in zip(number[fires].tolist(), results, strict=True):
            key = held[n][0]
            out.append((n, FAILED, (key, None, result)) if isinstance(result, Exception)
                       else (n, "emit", {key_name: key, **result}))
        # carry each key's last size - 1 items
        from_end = (block_start[key_block] + np.bincount(code, minlength=len(codes))[code] - 1
                    - np.arange(len(number)))
        self._recent = np.sort(number[from_end < self.size - 1])
        self._held = {n: held[n] for n in self._recent.tolist()}
        self._counts = counts + np.bincount(key_code, minlength=len(codes))
        self.seen = first + m
        return out

    def finish(self) -> list[tuple[int, str, Any]]:
        """Nothing fires at the end (an incomplete count window never fires, as in Flink)."""
        self._held.clear()
        self._recent = self._recent[:0]
        return []


def _runs(*columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For sorted ``columns``: each row's run of equal values (numbered from 0) and where each run starts."""
    first = np.ones(len(columns[0]), dtype=bool)
    first[1:] = np.logical_or.reduce([column[1:] != column[:-1] for column in columns])
    return np.cumsum(first) - 1, np.flatnonzero(first)


def _fold_each(fold: Any, items: list[Any], begin: np.ndarray, end: np.ndarray) -> list[dict[str, Any] | Exception]:
    out: list[dict[str, Any] | Exception] = []
    for b, e in zip(begin.tolist(), end.tolist(), strict=True):
        try:
            out.append(fold(items[b:e]))
        except Exception as exc:  # noqa: BLE001 - the firing fails alone
            out.append(exc)
    return out


def _column(aggregation: Aggregation, items: list[Any], begin: np.ndarray, end: np.ndarray,
            group: np.ndarray | None) -> list[Any] | None:
    """``aggregation``'s result for each range ``begin[f]:end[f]`` of ``items`` (each range starts where its window's
    items start; ``group``: each item's window), computed over arrays; ``None`` where its own fold must run (another
    kind of aggregation or one with ``where=``, values of mixed types, NaN, sums past what int64 holds exactly)."""
    kind, where = type(aggregation), aggregation.where
    if kind is Count:
        if where is None:
            return (end - begin).tolist()
        counts = np.concatenate([[0], np.cumsum(np.fromiter(map(bool, map(where, items)), bool, len(items)))])
        return (counts[end] - counts[begin]).tolist()
    if where is not None or kind not in (Sum, Max, Min, First, Last, CountDistinct) or (
            kind is CountDistinct and group is None):
        return None
    values = list(map(aggregation._read, items))
    if kind is First:
        return [values[b] for b in begin.tolist()]
    if kind is Last:
        return [values[e - 1] for e in end.tolist()]
    if kind is CountDistinct and group is not None:  # (checked above: it needs the windows)
        codes: dict[Any, int] = {}
        try:
            code = np.fromiter((codes.setdefault(v, len(codes)) for v in values), np.int64, len(values))
        except TypeError:  # unhashable: the fold says so
            return None
        order = np.lexsort((np.arange(len(values)), code, group))  # the first of each value in each window first
        first = np.ones(len(order), dtype=bool)
        first[1:] = (code[order][1:] != code[order][:-1]) | (group[order][1:] != group[order][:-1])
        new = np.zeros(len(values), dtype=np.int64)
        new[order[first]] = 1
        counts = np.concatenate([[0], np.cumsum(new)])
        return (counts[end] - counts[begin]).tolist()
    types = set(map(type, values))
    if types == {int}:
        array = np.array(values, dtype=object)
        if max(abs(min(values)), abs(max(values))) * len(values) >= _EXACT_SUM:
            return None
        array = array.astype(np.int64)
    elif types == {float}:
        array = np.array(values, dtype=np.float64)
        if kind is Sum or np.isnan(array).any():  # a float sum is exact (fsum) in the fold
            return None
    else:
        return None
    if kind is Sum:
        sums = np.concatenate([[0], np.cumsum(array)])
        return (sums[end] - sums[begin]).tolist()
    reduce = np.maximum if kind is Max else np.minimum
    padded = np.append(array, array[:1])  # reduceat's indices must stay below its length
    return reduce.reduceat(padded, np.column_stack([begin, end]).ravel())[::2].tolist()


__all__ = ["FAILED", "TIME_BOUND", "BatchCountWindows", "BatchTimeWindows", "refusal"]
