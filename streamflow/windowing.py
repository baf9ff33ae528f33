"""Stream tasks: keyed windows and process functions over an unbounded stream, for the device runner.

A *stream task* (``Task(..., input="stream")``) runs continuously over every event::

    [Filter | Map ...] → KeyBy → [Filter | Map ...] → <keyed step> → [Filter | Map ...]

where the keyed step is ``TimeWindow``, ``SessionWindow`` or ``CountWindow`` followed by
``Aggregate``, or a ``Process`` (a user's keyed process function). Every keyed step is a
:class:`~operators.process.KeyedProcessFunction`, run on the device by
:class:`~streamflow.keyed.KeyedRuntime`; the Flink runner runs the same functions in its own
``KeyedProcessFunction``, except ``TimeWindow``, which it gives to Flink's own ``WindowOperator``
(``key_by().window().allowed_lateness().side_output_late_data().aggregate()``).
:class:`EventTimeWindows` follows that operator's rules, so both runners emit the same rows:

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

Session windows follow Flink's ``EventTimeSessionWindows`` (each item opens ``[ts, ts + gap)``,
windows that touch or overlap merge) with the same lateness rules; count windows follow
``countWindow(size[, slide])`` (a window fires on the item that completes it; incomplete windows
never fire).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from connectors.storage import check_table_name, to_json
from operators import Aggregate, CountWindow, Filter, KeyBy, Map, Operator, Process, SessionWindow, TimeWindow
from operators.base import field_reader
from operators.process import LATE, KeyedProcessFunction, ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from operators.window import to_millis, window_starts_ms
from streamflow.keyed import KeyedRuntime

WINDOWS = (TimeWindow, SessionWindow, CountWindow)


@dataclass
class StreamPlan:
    """A stream task's pipeline cut into the parts a runner wires up."""

    before_key: list[Filter | Map]
    key_by: KeyBy
    before_window: list[Filter | Map]
    window: TimeWindow | SessionWindow | CountWindow | Process
    aggregate: Aggregate | None
    after_window: list[Filter | Map]

    @classmethod
    def of(cls, task_name: str, pipeline: Sequence[Operator]) -> StreamPlan:
        """Split and check ``pipeline``; the error says what a stream task's pipeline must look like."""
        shape = ("[Filter|Map ...], KeyBy, [Filter|Map ...], TimeWindow|SessionWindow|CountWindow, Aggregate "
                 "(or Process), [Filter|Map ...]")
        ops = list(pipeline)
        keyed = [i for i, op in enumerate(ops) if isinstance(op, (*WINDOWS, Process))]
        keys = [i for i, op in enumerate(ops) if isinstance(op, KeyBy)]
        if len(keys) != 1 or len(keyed) != 1 or keys[0] > keyed[0]:
            raise ValueError(f"stream task {task_name!r}: the pipeline must be {shape}")
        k, w = keys[0], keyed[0]
        aggregate = None
        after = w + 1
        if isinstance(ops[w], WINDOWS):
            if not (len(ops) > w + 1 and isinstance(ops[w + 1], Aggregate)):
                raise ValueError(f"stream task {task_name!r}: {ops[w]!r} must be followed by Aggregate(...); "
                                 f"the pipeline must be {shape}")
            aggregate, after = ops[w + 1], w + 2
        for op in ops[:k] + ops[k + 1:w] + ops[after:]:
            if not isinstance(op, (Filter, Map)):
                raise ValueError(f"stream task {task_name!r}: {op!r} cannot run outside a window; "
                                 f"the pipeline must be {shape}")
        return cls(ops[:k], ops[k], ops[k + 1:w], ops[w], aggregate, ops[after:])

    @property
    def out_of_orderness(self) -> float:
        return getattr(self.window, "out_of_orderness", 0.0)

    def function(self) -> KeyedProcessFunction:
        """The keyed step as a keyed process function (rows it emits are ``window_row``s or the
        user's rows, before ``after_window``)."""
        window, key_name = self.window, self.key_by.name
        if isinstance(window, Process):
            return window.function
        if isinstance(window, TimeWindow):
            return EventTimeWindows(window, self.aggregate, key_name)
        if isinstance(window, SessionWindow):
            return SessionWindows(window, self.aggregate, key_name)
        return CountWindows(window, self.aggregate, key_name)


def apply_elementwise(ops: Sequence[Filter | Map], item: Any) -> Any | None:
    """``item`` through Filter/Map operators, or ``None`` if a Filter drops it."""
    for op in ops:
        if isinstance(op, Filter):
            if not op.predicate(item):
                return None
        else:
            item = op.fn(item)
    return item


class _AggregatingWindows(KeyedProcessFunction):
    """What the window functions share: the aggregations, and the row a window produces."""

    def __init__(self, aggregate: Aggregate, key_name: str):
        self.aggregations = list(aggregate.aggregations.items())
        self.key_name = key_name

    def create(self) -> list[Any]:
        return [agg.create() for _, agg in self.aggregations]

    def add(self, accs: list[Any], item: Any) -> list[Any]:
        for i, (_, agg) in enumerate(self.aggregations):
            if agg.where is None or agg.where(item):
                accs[i] = agg.add(accs[i], item)
        return accs

    def merge(self, a: list[Any], b: list[Any]) -> list[Any]:
        return [agg.merge(x, y) for (_, agg), x, y in zip(self.aggregations, a, b, strict=True)]

    def results(self, accs: list[Any]) -> dict[str, Any]:
        return {name: agg.result(acc) for (name, agg), acc in zip(self.aggregations, accs, strict=True)}

    def row(self, key: Any, start_ms: int, end_ms: int, accs: list[Any]) -> dict[str, Any]:
        return window_row(self.key_name, key, start_ms / 1000, end_ms / 1000, self.results(accs))


class EventTimeWindows(_AggregatingWindows):
    """Tumbling and sliding event-time windows (rules in the module docstring), as a keyed process function.

    Example:
        >>> from operators import Count
        >>> runtime = KeyedRuntime(EventTimeWindows(TimeWindow(10), Aggregate(n=Count()), "user"))
        >>> runtime.process("u", {"ts": 3.0}), runtime.process("u", {"ts": 12.0})  # [0, 10) fires
        ([], [('emit', {'user': 'u', 'window_start': 0.0, 'window_end': 10.0, 'n': 1})])
        >>> runtime.process("u", {"ts": 4.0})  # its only window is late (no allowed lateness)
        [('late_events', {'ts': 4.0})]
    """

    def __init__(self, window: TimeWindow, aggregate: Aggregate, key_name: str):
        super().__init__(aggregate, key_name)
        self.ts = window.ts
        self.size, self.slide = to_millis(window.size), to_millis(window.slide)
        self.offset, self.lateness = to_millis(window.offset), to_millis(window.allowed_lateness)

    def open(self, ctx: Any) -> None:
        self.windows = ctx.get_state(MapStateDescriptor("windows"))  # window start -> accumulators

    def on_event(self, item: Any, ctx: Any) -> None:
        ts, watermark, windows = ctx.timestamp, ctx.current_watermark(), self.windows
        skipped = True
        for start in window_starts_ms(ts, self.size, self.slide, self.offset):
            last = start + self.size - 1
            if last + self.lateness <= watermark:
                continue  # this window is late
            skipped = False
            accs = self.add(windows.get(start) or self.create(), item)
            windows.put(start, accs)
            if last <= watermark:
                ctx.emit(self.row(ctx.key, start, start + self.size, accs))  # late firing
            else:
                ctx.register_event_time_timer(last)
            ctx.register_event_time_timer(last + self.lateness)
        if skipped:
            ctx.side(LATE, item)

    def on_timer(self, time_ms: int, ctx: Any) -> None:
        for start, accs in self.windows.items():
            last = start + self.size - 1
            if last == time_ms:
                ctx.emit(self.row(ctx.key, start, start + self.size, accs))
            if last + self.lateness <= time_ms:
                self.windows.remove(start)


class SessionWindows(_AggregatingWindows):
    """Event-time session windows (Flink's ``EventTimeSessionWindows.withGap``), as a keyed process function.

    Example:
        >>> from operators import Count
        >>> runtime = KeyedRuntime(SessionWindows(SessionWindow(30), Aggregate(n=Count()), "user"))
        >>> runtime.process("u", {"ts": 10.0}), runtime.process("u", {"ts": 30.0})
        ([], [])
        >>> runtime.process("u", {"ts": 100.0})  # the watermark passed 59.999 s: session [10, 60) fires
        [('emit', {'user': 'u', 'window_start': 10.0, 'window_end': 60.0, 'n': 2})]
    """

    def __init__(self, window: SessionWindow, aggregate: Aggregate, key_name: str):
        super().__init__(aggregate, key_name)
        self.ts = window.ts
        self.gap, self.lateness = to_millis(window.gap), to_millis(window.allowed_lateness)

    def open(self, ctx: Any) -> None:
        self.sessions = ctx.get_state(ValueStateDescriptor("sessions"))  # [[start, end, accs]], by start

    def on_event(self, item: Any, ctx: Any) -> None:
        ts, watermark = ctx.timestamp, ctx.current_watermark()
        start, end, accs = ts, ts + self.gap, self.add(self.create(), item)
        kept = []
        for session in self.sessions.value() or []:
            if session[0] <= end and session[1] >= start:  # Flink's TimeWindow.intersects: touching merges
                start, end, accs = min(start, session[0]), max(end, session[1]), self.merge(session[2], accs)
            else:
                kept.append(session)
        if end - 1 + self.lateness <= watermark:
            ctx.side(LATE, item)  # even merged, the session is past its allowed lateness
            return
        kept.append([start, end, accs])
        kept.sort(key=lambda session: session[0])
        self.sessions.update(kept)
        if end - 1 <= watermark:
            ctx.emit(self.row(ctx.key, start, end, accs))  # late firing
        else:
            ctx.register_event_time_timer(end - 1)
        ctx.register_event_time_timer(end - 1 + self.lateness)

    def on_timer(self, time_ms: int, ctx: Any) -> None:
        kept = []
        for start, end, accs in self.sessions.value() or []:
            if end - 1 == time_ms:
                ctx.emit(self.row(ctx.key, start, end, accs))
            if end - 1 + self.lateness > time_ms:
                kept.append([start, end, accs])
        self.sessions.update(kept)


class CountWindows(_AggregatingWindows):
    """Count windows (Flink's ``countWindow(size[, slide])``), as a keyed process function.

    Example:
        >>> from operators import Count
        >>> runtime = KeyedRuntime(CountWindows(CountWindow(2), Aggregate(n=Count()), "user"))
        >>> runtime.process("u", {}), runtime.process("u", {})
        ([], [('emit', {'user': 'u', 'n': 2})])
    """

    ts = None  # count windows need no event time

    def __init__(self, window: CountWindow, aggregate: Aggregate, key_name: str):
        super().__init__(aggregate, key_name)
        self.window = window

    def open(self, ctx: Any) -> None:
        self.seen = ctx.get_state(ValueStateDescriptor("seen"))
        self.items = ctx.get_state(ListStateDescriptor("items"))

    def on_event(self, item: Any, ctx: Any) -> None:
        size, seen = self.window.size, (self.seen.value() or 0) + 1
        self.seen.update(seen)
        self.items.add(item)
        if seen not in self.window.ends(seen)[-1:]:
            if self.window.slide is not None and len(self.items.get()) > size:
                self.items.update(self.items.get()[-size:])
            return
        items = self.items.get()[-size:]
        accs = self.create()
        for element in items:
            self.add(accs, element)
        ctx.emit({self.key_name: ctx.key, **self.results(accs)})
        if self.window.slide is None:
            self.items.clear()
        else:
            self.items.update(items)


def window_row(key_name: str, key: Any, start: float, end: float, results: dict[str, Any]) -> dict[str, Any]:
    """The row a fired window produces, on every runner: key, window bounds (seconds), aggregates."""
    return {key_name: key, "window_start": start, "window_end": end, **results}


def late_row(task: str, ts: float, item: Any) -> dict[str, Any]:
    """The late side output's row for an item no window would take."""
    body = item.to_dict() if hasattr(item, "to_dict") else item
    return {"task": task, "ts": ts, "item": to_json(body, sort_keys=True)}


class StreamTaskRun:
    """A stream task on the device runner: element operators, the keyed step, row operators.

    Example:
        >>> from operators import Count
        >>> from streamflow.job import Task
        >>> run = StreamTaskRun(Task("n", None, [KeyBy("user"), TimeWindow(10), Aggregate(n=Count())], input="stream"))
        >>> run.process({"user": "u", "ts": 1.0}), run.finish()
        (([], []), ([{'user': 'u', 'window_start': 0.0, 'window_end': 10.0, 'n': 1}], []))
    """

    def __init__(self, task: Any, max_keys: int | None = None):
        self.name = task.name
        self.sink = task.sink
        self.plan = StreamPlan.of(task.name, copy.deepcopy(list(task.pipeline)))
        function = self.plan.function()
        self.runtime = KeyedRuntime(function, self.plan.out_of_orderness, max_keys)
        self.read_key = field_reader(self.plan.key_by.key)
        self.read_ts = self.runtime.read_ts

    def process(self, item: Any) -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, Any]]]]:
        """One event in: ``(feature rows, side rows as (table, row))``; late items go to ``late_events``."""
        plan = self.plan
        item = apply_elementwise(plan.before_key, item)
        if item is None:
            return [], []
        key = self.read_key(item)
        item = apply_elementwise(plan.before_window, item)
        if item is None:
            return [], []
        return self._split(self.runtime.process(key, item))

    def finish(self) -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, Any]]]]:
        """End of input: the rows of every window still open (the final watermark's timers)."""
        return self._split(self.runtime.finish())

    def _split(self, outputs: list[tuple[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, Any]]]]:
        rows, sides = [], []
        for tag, value in outputs:
            if tag == "emit":
                row = apply_elementwise(self.plan.after_window, value)
                if row is not None:
                    rows.append(row)
            elif tag == LATE:
                sides.append((LATE, late_row(self.name, self.read_ts(value) if self.read_ts else None, value)))
            else:
                sides.append((check_table_name(tag), value))
        return rows, sides
