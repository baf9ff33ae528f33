"""Event-time windows over an unbounded stream, with Flink's semantics, for the device runner.

A *stream task* (``Task(..., input="stream")``) runs continuously over every event::

    [Filter | Map ...] → KeyBy → [Filter | Map ...] → TimeWindow → Aggregate → [Filter | Map ...]

On Flink the windowed part is Flink's own ``WindowOperator`` (``key_by().window().allowed_lateness()
.side_output_late_data().aggregate()``). :class:`KeyedEventTimeWindows` is the device runner's
equivalent and follows the same rules, so both runners emit the same rows:

- Time is in integer milliseconds. A window is ``[start, end)``; its last timestamp is ``end - 1``.
  Windows are aligned as Flink aligns them (:func:`operators.window.window_starts_ms`).
- The watermark is ``max event time seen - out_of_orderness - 1 ms`` (Flink's bounded-out-of-orderness
  generator), advanced after every event, and never goes back.
- An event is added to each of its windows that is not *late*: a window is late once
  ``end - 1 + allowed_lateness <= watermark``. Adding to a window whose end already passed the
  watermark fires it at once with its updated contents (a late firing: one more row for the same
  window). An event all of whose windows are late goes to the late side output.
- When the watermark reaches ``end - 1`` the window fires once; its state is dropped when the
  watermark reaches ``end - 1 + allowed_lateness``. At the end of the input the watermark jumps to
  +infinity: every window still open fires.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from connectors.storage import to_json
from operators import Aggregate, Filter, KeyBy, Map, Operator, TimeWindow
from operators.base import field_reader
from operators.window import to_millis, window_starts_ms

END_OF_TIME = 2**63 - 1  # Long.MAX_VALUE, the final watermark


@dataclass
class StreamPlan:
    """A stream task's pipeline cut into the parts a runner wires up."""

    before_key: list[Filter | Map]
    key_by: KeyBy
    before_window: list[Filter | Map]
    window: TimeWindow
    aggregate: Aggregate
    after_window: list[Filter | Map]

    @classmethod
    def of(cls, task_name: str, pipeline: Sequence[Operator]) -> StreamPlan:
        """Split and check ``pipeline``; the error says what a stream task's pipeline must look like."""
        shape = "[Filter|Map ...], KeyBy, [Filter|Map ...], TimeWindow, Aggregate, [Filter|Map ...]"
        ops = list(pipeline)
        kinds = [type(op) for op in ops]
        if kinds.count(KeyBy) != 1 or kinds.count(TimeWindow) != 1 or kinds.count(Aggregate) != 1:
            raise ValueError(f"stream task {task_name!r}: the pipeline must be {shape}")
        k, w = kinds.index(KeyBy), kinds.index(TimeWindow)
        if not (k < w and kinds[w + 1] is Aggregate):
            raise ValueError(f"stream task {task_name!r}: the pipeline must be {shape}")
        for op in ops[:k] + ops[k + 1:w] + ops[w + 2:]:
            if not isinstance(op, (Filter, Map)):
                raise ValueError(f"stream task {task_name!r}: {op!r} cannot run outside a window; "
                                 f"the pipeline must be {shape}")
        return cls(ops[:k], ops[k], ops[k + 1:w], ops[w], ops[w + 1], ops[w + 2:])


def apply_elementwise(ops: Sequence[Filter | Map], item: Any) -> Any | None:
    """``item`` through Filter/Map operators, or ``None`` if a Filter drops it."""
    for op in ops:
        if isinstance(op, Filter):
            if not op.predicate(item):
                return None
        else:
            item = op.fn(item)
    return item


class KeyedEventTimeWindows:
    """Keyed event-time windows with watermark, allowed lateness and a late side output.

    Example:
        >>> from operators import Count
        >>> windows = KeyedEventTimeWindows(TimeWindow(10, out_of_orderness=0), Aggregate(n=Count()))
        >>> windows.add("u", {"ts": 3.0})
        ([], False)
        >>> windows.add("u", {"ts": 12.0})  # watermark passes 9.999 s: window [0, 10) fires
        ([('u', 0.0, 10.0, {'n': 1})], False)
        >>> windows.add("u", {"ts": 4.0})   # its only window is late (no allowed lateness)
        ([], True)
        >>> windows.finish()
        [('u', 10.0, 20.0, {'n': 1})]
    """

    def __init__(self, window: TimeWindow, aggregate: Aggregate):
        self.size = to_millis(window.size)
        self.slide = to_millis(window.slide)
        self.offset = to_millis(window.offset)
        self.lateness = to_millis(window.allowed_lateness)
        self.bound = to_millis(window.out_of_orderness)
        self.read_ts: Callable[[Any], Any] = field_reader(window.ts)
        self.aggregations = list(aggregate.aggregations.items())
        self.watermark = -END_OF_TIME
        self._max_ts = -END_OF_TIME
        self._state: dict[tuple[Any, int], list[Any]] = {}  # (key, window start) -> accumulators
        self._timers: list[tuple[int, int, Any, int]] = []  # (time, kind, key, start); kind 0 fire, 1 clean
        self._timer_set: set[tuple[int, int, Any, int]] = set()

    def add(self, key: Any, item: Any) -> tuple[list[tuple[Any, float, float, dict[str, Any]]], bool]:
        """Process one item: ``(rows fired, whether the item was late)``, then advance the watermark."""
        ts = to_millis(self.read_ts(item))
        fired = []
        skipped = True
        for start in window_starts_ms(ts, self.size, self.slide, self.offset):
            last = start + self.size - 1
            if last + self.lateness <= self.watermark:
                continue  # this window is late
            skipped = False
            accs = self._state.get((key, start))
            if accs is None:
                accs = self._state[(key, start)] = [agg.create() for _, agg in self.aggregations]
            for i, (_, agg) in enumerate(self.aggregations):
                if agg.where is None or agg.where(item):
                    accs[i] = agg.add(accs[i], item)
            if last <= self.watermark:
                fired.append(self._row(key, start, accs))  # late firing
            else:
                self._timer(last, 0, key, start)
            self._timer(last + self.lateness, 1, key, start)
        late = skipped and ts + self.lateness <= self.watermark
        fired.extend(self.advance(max(self._max_ts, ts) - self.bound - 1))
        self._max_ts = max(self._max_ts, ts)
        return fired, late

    def advance(self, watermark: int) -> list[tuple[Any, float, float, dict[str, Any]]]:
        """Move the watermark forward and fire the windows whose time has come."""
        if watermark <= self.watermark:
            return []
        self.watermark = watermark
        fired = []
        while self._timers and self._timers[0][0] <= watermark:
            timer = heapq.heappop(self._timers)
            self._timer_set.discard(timer)
            _, kind, key, start = timer
            accs = self._state.get((key, start))
            if accs is None:
                continue
            if kind == 0:
                fired.append(self._row(key, start, accs))
            if kind == 1 or self.lateness == 0:
                del self._state[(key, start)]
        return fired

    def finish(self) -> list[tuple[Any, float, float, dict[str, Any]]]:
        """End of input: the final watermark fires every window still open."""
        return self.advance(END_OF_TIME)

    def _timer(self, time: int, kind: int, key: Any, start: int) -> None:
        timer = (time, kind, key, start)
        if timer not in self._timer_set:
            self._timer_set.add(timer)
            heapq.heappush(self._timers, timer)

    def _row(self, key: Any, start: int, accs: list[Any]) -> tuple[Any, float, float, dict[str, Any]]:
        results = {name: agg.result(acc) for (name, agg), acc in zip(self.aggregations, accs, strict=True)}
        return key, start / 1000, (start + self.size) / 1000, results


def window_row(key_name: str, key: Any, start: float, end: float, results: dict[str, Any]) -> dict[str, Any]:
    """The row a fired window produces, on every runner: key, window bounds (seconds), aggregates."""
    return {key_name: key, "window_start": start, "window_end": end, **results}


def late_row(task: str, ts: float, item: Any) -> dict[str, Any]:
    """The late side output's row for an item no window would take."""
    body = item.to_dict() if hasattr(item, "to_dict") else item
    return {"task": task, "ts": ts, "item": to_json(body, sort_keys=True)}


class StreamTaskRun:
    """A stream task on the device runner: element operators, keyed event-time windows, row operators.

    Example:
        >>> from operators import Count
        >>> from streamflow.job import Task
        >>> run = StreamTaskRun(Task("n", None, [KeyBy("user"), TimeWindow(10), Aggregate(n=Count())], input="stream"))
        >>> run.process({"user": "u", "ts": 1.0}), run.finish()
        (([], []), [{'user': 'u', 'window_start': 0.0, 'window_end': 10.0, 'n': 1}])
    """

    def __init__(self, task: Any):
        self.name = task.name
        self.sink = task.sink
        self.plan = StreamPlan.of(task.name, copy.deepcopy(list(task.pipeline)))
        self.windows = KeyedEventTimeWindows(self.plan.window, self.plan.aggregate)
        self.read_key = field_reader(self.plan.key_by.key)

    def process(self, item: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """One event in: ``(feature rows, late rows)``."""
        plan = self.plan
        item = apply_elementwise(plan.before_key, item)
        if item is None:
            return [], []
        key = self.read_key(item)
        item = apply_elementwise(plan.before_window, item)
        if item is None:
            return [], []
        fired, late = self.windows.add(key, item)
        lates = [late_row(self.name, self.windows.read_ts(item), item)] if late else []
        return self._rows(fired), lates

    def finish(self) -> list[dict[str, Any]]:
        """End of input: the rows of every window still open."""
        return self._rows(self.windows.finish())

    def _rows(self, fired: list[tuple[Any, float, float, dict[str, Any]]]) -> list[dict[str, Any]]:
        rows = []
        for key, start, end, results in fired:
            row = apply_elementwise(self.plan.after_window, window_row(self.plan.key_by.name, key, start, end, results))
            if row is not None:
                rows.append(row)
        return rows
