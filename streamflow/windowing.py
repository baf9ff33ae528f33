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

A step that raises fails alone, on both runners: an event in the steps before the keyed step (Filter/Map,
the key, the aggregation's ``where``/``add``: :class:`StreamInput`), an event or a timer of the keyed step
(:class:`GuardedFunction`), a fired row in the steps after it (:class:`StreamOutput`). Each failure is one
``task_errors`` row (:func:`stream_error_row`: the task, the key, the window, the error); everything else
goes on. ``quarantine_after`` consecutive failures of a step (:class:`Streak`) quarantine it.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, final

from connectors.json_values import to_json
from connectors.sql import check_table_name
from operators import Aggregate, Count, CountWindow, KeyBy, Operator, Process, SessionWindow, TimeWindow
from operators.aggregate import Accumulators
from operators.aggregations import Aggregation, checked_field
from operators.base import EVENT_ATTRIBUTES, GENERATED_CODE, ElementStep, element_steps, field_reader, generated
from operators.process import LATE, KeyedProcessFunction, ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
from operators.window import to_millis, window_starts_ms
from streamflow.events import Event
from streamflow.keyed import END_OF_TIME, KeyedRuntime
from streamflow.summary import TASK_ERRORS_TABLE

log = logging.getLogger("streamflow.windowing")

WINDOWS = (TimeWindow, SessionWindow, CountWindow)


@dataclass
class StreamPlan:
    """A stream task's pipeline cut into the parts a runner wires up, its Filter and Map operators lowered
    to their :class:`~operators.base.ElementStep` (what the device's generated steps, batch mode and the
    Flink runner's operators all run).

    Example:
        >>> from operators import Count, Filter
        >>> plan = StreamPlan.of("n", [Filter(bool), KeyBy("user"), CountWindow(2), Aggregate(n=Count())])
        >>> plan.before_key, plan.after_window
        ((ElementStep(kind='filter', fn=<class 'bool'>),), ())
    """

    before_key: tuple[ElementStep, ...]
    key_by: KeyBy
    before_window: tuple[ElementStep, ...]
    window: TimeWindow | SessionWindow | CountWindow | Process
    aggregate: Aggregate | None
    after_window: tuple[ElementStep, ...]

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
        key_by, window = ops[k], ops[w]
        assert isinstance(key_by, KeyBy) and isinstance(window, (TimeWindow, SessionWindow, CountWindow, Process))
        aggregate: Aggregate | None = None
        after = w + 1
        if isinstance(window, WINDOWS):
            following = ops[w + 1] if len(ops) > w + 1 else None
            if not isinstance(following, Aggregate):
                raise ValueError(f"stream task {task_name!r}: {window!r} must be followed by Aggregate(...); "
                                 f"the pipeline must be {shape}")
            aggregate, after = following, w + 2
        for op in ops[:k] + ops[k + 1:w] + ops[after:]:
            if getattr(op, "element_step", None) is None:  # not a Filter or Map
                raise ValueError(f"stream task {task_name!r}: {op!r} cannot run outside a window; "
                                 f"the pipeline must be {shape}")
        return cls(element_steps(ops[:k]), key_by, element_steps(ops[k + 1:w]), window, aggregate,
                   element_steps(ops[after:]))

    @property
    def out_of_orderness(self) -> float:
        return getattr(self.window, "out_of_orderness", 0.0)

    @property
    def ts(self) -> Any:
        """The field (or function) with an item's event time, or ``None`` (count windows need none)."""
        if isinstance(self.window, Process):
            return self.window.function.ts
        return None if isinstance(self.window, CountWindow) else self.window.ts

    def function(self) -> KeyedProcessFunction:
        """The keyed step as a keyed process function (rows it emits are ``window_row``s or the
        user's rows, before ``after_window``)."""
        window, key_name = self.window, self.key_by.name
        if isinstance(window, Process):
            return window.function
        aggregate = self.aggregate
        assert aggregate is not None  # a window is followed by its Aggregate (of)
        if isinstance(window, TimeWindow):
            return EventTimeWindows(window, aggregate, key_name)
        if isinstance(window, SessionWindow):
            return SessionWindows(window, aggregate, key_name)
        return CountWindows(window, aggregate, key_name)


def elementwise(steps: Sequence[ElementStep]) -> Callable[[Any], Any]:
    """Element steps (Filter and Map lowered, :class:`~operators.base.ElementStep`) as one function: ``item``
    through them, or ``None`` if a filter drops it.

    Generated once per chain (each step a direct call, no loop over steps and no test per item); its frames
    count as the runner's, so a failure's traceback starts in the user's function.

    Example:
        >>> from operators import Filter, Map
        >>> steps = elementwise(element_steps([Filter(lambda x: x > 0), Map(lambda x: x * 10)]))
        >>> steps(2), steps(-1)
        (20, None)
    """
    namespace: dict[str, Any] = {}
    lines = ["def steps(item):", *_step_lines(steps, "s", namespace, "    ", ["return None"]), "    return item"]
    return generated("steps", lines, namespace)


def _step_lines(steps: Sequence[ElementStep], prefix: str, namespace: dict[str, Any], indent: str,
                dropped: list[str]) -> list[str]:
    """Source lines taking ``item`` through ``steps`` (their functions go into ``namespace`` as ``prefix{i}``);
    a filter that drops it runs the ``dropped`` lines."""
    lines = []
    for i, step in enumerate(steps):
        fn = step.fn
        namespace[f"{prefix}{i}"] = fn
        if step.maps:
            lines.append(f"{indent}item = {prefix}{i}(item)")
        else:
            lines += [f"{indent}if not {prefix}{i}(item):", *(f"{indent}    {line}" for line in dropped)]
    return lines


def _read_expression(spec: Any, name: str, namespace: dict[str, Any]) -> str:
    """An expression reading field ``spec`` of ``item``, what ``field_reader(spec)(item)`` gives: an
    :class:`Event`'s own attribute is read as one (``event[name]`` is a method call), anything else with
    ``item[name]``; a function ``spec`` goes into ``namespace`` as ``name`` and is called."""
    if isinstance(spec, str) and spec in EVENT_ATTRIBUTES:
        return f"(item.{spec} if type(item) is Event else item[{spec!r}])"
    if isinstance(spec, str) and spec:
        return f"item[{spec!r}]"
    namespace[name] = field_reader(spec)
    return f"{name}(item)"


class _AggregatingWindows(KeyedProcessFunction):
    """What the window functions share: the aggregations, and the row a window produces."""

    def __init__(self, aggregate: Aggregate, key_name: str):
        self.aggregations = list(aggregate.aggregations.items())
        self.key_name = key_name
        self._generate()

    def _generate(self) -> None:
        """``create()``, ``add(accs, item)``, ``merge(a, b)``, ``results(accs)``: see :class:`Accumulators`."""
        accumulators = Accumulators(dict(self.aggregations))
        self.create, self.add = accumulators.create, accumulators.add
        self.merge, self.results = accumulators.merge, accumulators.results

    def __getstate__(self) -> dict[str, Any]:
        return {name: value for name, value in self.__dict__.items()
                if name not in ("create", "add", "merge", "results")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._generate()  # again where it runs (a Flink worker)

    def row(self, key: Any, start_ms: int, end_ms: int, accs: list[Any]) -> dict[str, Any]:
        return window_row(self.key_name, key, start_ms / 1000, end_ms / 1000, self.results(accs))


class EventTimeWindows(_AggregatingWindows):
    """Tumbling and sliding event-time windows (rules in the module docstring), as a keyed process function.

    **Slices** (panes, as in Flink's sliding-window literature and Scotty): when every aggregation has a
    ``merge``, an event is added once, to its *slice* (``gcd(size, slide)`` wide, aligned as the windows
    are), not to each of the ``size / slide`` windows that hold it; a window's result merges the slices it
    covers. A key's slices are kept as *runs* in arrival order (a new run starts when an event's slice
    differs from the previous event's), and merged in that order, so order-sensitive aggregations (``First``,
    ``Last``, ``LastN``, ``Distinct``) give what adding each event to each window in arrival order gives,
    out-of-order events included; ``Sum`` is exact, so no rounding depends on the split. Firing timers are
    registered when a key's slice is created, not per event; a firing also drops the slices past their
    windows' lateness (one cleanup timer per key, after its last firing); a timer finds its window by
    arithmetic, not by a scan. Aggregations without ``merge`` keep one accumulator per window (each event
    added to each of its windows).

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
        self.pane = math.gcd(self.size, self.slide)
        self.sliced = all(type(agg).merge is not Aggregation.merge for _, agg in self.aggregations)

    def open(self, ctx: Any) -> None:
        if self.sliced:
            self.runs = ctx.get_state(ValueStateDescriptor("runs"))  # [[slice start, accumulators]], arrival order
        else:
            self.windows = ctx.get_state(MapStateDescriptor("windows"))  # window start -> accumulators

    def on_event(self, item: Any, ctx: Any) -> None:
        if not self.sliced:
            self._add_to_each_window(item, ctx)
            return
        ts, size, slide, watermark = ctx.timestamp, self.size, self.slide, ctx.current_watermark()
        newest = ts - (ts - self.offset) % slide  # the start of the newest window holding ts
        oldest_last = newest + size - 1 - slide * ((newest + size - 1 - ts) // slide)  # the first of them to end
        if oldest_last > watermark:  # none of ts's windows fired yet: nothing late, nothing to fire again
            self._add_to_slice(item, ts, watermark, ctx)
            return
        if newest + size - 1 + self.lateness <= watermark:  # even its newest window is past its lateness
            ctx.side(LATE, item)
            return
        starts = [start for start in window_starts_ms(ts, size, slide, self.offset)
                  if start + size - 1 + self.lateness > watermark]  # its windows that are not late
        if not starts:
            ctx.side(LATE, item)
            return
        runs = self._add_to_slice(item, ts, watermark, ctx)
        for start in starts:
            if start + size - 1 <= watermark:
                ctx.emit(self.row(ctx.key, start, start + size, self._window(runs, start)))  # late firing

    def _add_to_slice(self, item: Any, ts: int, watermark: int, ctx: Any) -> list[list[Any]]:
        """Add ``item`` to its slice's latest run (a new run if the key's last event was in another slice);
        a slice new to the key registers what its windows need (:meth:`_new_slice`). The key's runs."""
        runs = self.runs.value()
        pane_start = ts - (ts - self.offset) % self.pane
        if runs and runs[-1][0] == pane_start:
            self.add(runs[-1][1], item)
        else:
            if runs is None:
                runs = []
            for run in runs:
                if run[0] == pane_start:
                    break
            else:
                self._new_slice(runs, pane_start, watermark, ctx)
            runs.append([pane_start, self.add(self.create(), item)])
        self.runs.update(runs)
        return runs

    def _new_slice(self, runs: list[list[Any]], pane_start: int, watermark: int, ctx: Any) -> None:
        """Timers for a slice the key did not hold: the firing time of each of its windows still to fire,
        except those a slice of the key before it registered already (a window holding this slice and ending no
        later than the newest window of an earlier slice holds that slice too). Cleanup needs no timer of its
        own while a firing is still to come: each firing drops the slices past their windows' lateness
        (:meth:`on_timer`), and the key's last firing registers the one cleanup timer left."""
        size, slide, offset, lateness = self.size, self.slide, self.offset, self.lateness
        registered = -END_OF_TIME
        if runs:
            top = max([run[0] for run in runs])
            if top < pane_start:
                registered = top - (top - offset) % slide + size - 1
        newest_last = pane_start - (pane_start - offset) % slide + size - 1
        for start in window_starts_ms(pane_start, size, slide, offset):
            last = start + size - 1
            if last <= registered or last <= watermark:
                break  # the older windows (ending earlier) are registered, or have fired, too
            ctx.register_event_time_timer(last)
        if newest_last <= watermark < newest_last + lateness:
            ctx.register_event_time_timer(newest_last + lateness)  # every window of it fired: only cleanup is left

    def _window(self, runs: list[list[Any]], start: int) -> list[Any]:
        """The accumulators of window ``[start, start + size)``: its slices' runs merged in arrival order."""
        end = start + self.size
        return self._merged([accs for pane_start, accs in runs if start <= pane_start < end])

    def _merged(self, held: list[list[Any]]) -> list[Any]:
        """Runs' accumulators merged in order (a run alone is handed over as it is: ``results`` only reads it)."""
        if len(held) == 1:
            return held[0]
        merged = self.merge(held[0], held[1])
        for accs in held[2:]:
            merged = self.merge(merged, accs)
        return merged

    def on_timer(self, time_ms: int, ctx: Any) -> None:
        if not self.sliced:
            self._fire_each_window(time_ms, ctx)
            return
        runs = self.runs.value()
        if not runs:
            return
        size, slide, offset, lateness = self.size, self.slide, self.offset, self.lateness
        start = time_ms + 1 - size
        end = start + size if (start - offset) % slide == 0 else start  # [start, end): the window firing now
        # Every window starting at or before `done` is past its allowed lateness: the slices only they hold go.
        done = time_ms + 1 - size - lateness
        keep_from = done - (done - offset) % slide + slide
        held, kept, top = [], [], None
        for run in runs:
            pane_start = run[0]
            if start <= pane_start < end:
                held.append(run[1])
            if pane_start >= keep_from:
                kept.append(run)
                if top is None or pane_start > top:
                    top = pane_start
        if held:
            ctx.emit(self.row(ctx.key, start, end, self._merged(held)))
        if len(kept) != len(runs):
            self.runs.update(kept or None)
        if top is not None and lateness:
            newest_last = top - (top - offset) % slide + size - 1
            if newest_last <= time_ms:  # no firing to come for this key: its cleanup needs a timer
                ctx.register_event_time_timer(newest_last + lateness)

    def _add_to_each_window(self, item: Any, ctx: Any) -> None:
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

    def _fire_each_window(self, time_ms: int, ctx: Any) -> None:
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
        start, end, merged = ts, ts + self.gap, None
        kept, touched = [], []
        for session in self.sessions.value() or ():
            if session[0] <= end and session[1] >= start:  # Flink's TimeWindow.intersects: touching merges
                if session[0] < start:
                    start = session[0]
                if session[1] > end:
                    end = session[1]
                touched.append(session)
            else:
                kept.append(session)
        if end - 1 + self.lateness <= watermark:
            ctx.side(LATE, item)  # even merged, the session is past its allowed lateness
            return
        # The sessions merged in time order, then the new item: what adding each item in turn gives when
        # they arrived in time order.
        for session in touched:
            merged = session[2] if merged is None else self.merge(merged, session[2])
        accs = self.add(self.create() if merged is None else self.merge(merged, self.create()), item)
        if kept and kept[-1][0] > start:  # kept is by start, and no kept session starts where this one does
            kept.append([start, end, accs])
            kept.sort(key=_START)
        else:
            kept.append([start, end, accs])
        self.sessions.update(kept)
        if end - 1 <= watermark:
            ctx.emit(self.row(ctx.key, start, end, accs))  # late firing
            ctx.register_event_time_timer(end - 1 + self.lateness)
        elif not any(session[1] - 1 > watermark for session in touched):
            # A session it grew that has not fired still has its timer: when that fires, it finds the session
            # ended later and registers the new end (on_timer), so an item that only moves the end registers nothing.
            ctx.register_event_time_timer(end - 1)

    def on_timer(self, time_ms: int, ctx: Any) -> None:
        kept = []
        for start, end, accs in self.sessions.value() or []:
            if end - 1 == time_ms:
                ctx.emit(self.row(ctx.key, start, end, accs))
                if self.lateness:
                    ctx.register_event_time_timer(end - 1 + self.lateness)
            elif end - 1 > time_ms:
                ctx.register_event_time_timer(end - 1)  # the session grew since this timer was registered
            if end - 1 + self.lateness > time_ms:
                kept.append([start, end, accs])
        self.sessions.update(kept or None)  # a key without sessions holds no state


_START = itemgetter(0)


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


def late_row(task: str, ts: float | None, item: Any) -> dict[str, Any]:
    """The late side output's row for an item no window would take."""
    if type(item) is Event:
        return {"task": task, "ts": ts, "item": item.to_sorted_json()}
    body = item.to_dict() if hasattr(item, "to_dict") else item
    return {"task": task, "ts": ts, "item": to_json(body, sort_keys=True)}


#: Pseudo-table of a record saying a step of a stream task was quarantined (``{"task": name}``): on Flink each
#: step (operator instance) says so itself, and the writer marks the task quarantined in the summary.
QUARANTINED = "__quarantined__"
_RUNNER_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_NO_KEY = object()


@final  # (tested as `type(x) is Failure`)
@dataclass(frozen=True)
class Failure:
    """What a step of a stream task raised, as text (picklable: on Flink it may wait in a window's accumulator).

    The traceback starts at the first frame outside the runner (``streamflow/``) and its generated code
    (:data:`~operators.base.GENERATED_CODE`): the user's code and the operators it called, the same frames
    on every runner.
    """

    error: str
    traceback: str

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None and (
                tb.tb_frame.f_code.co_filename.startswith(_RUNNER_DIR)
                or tb.tb_frame.f_code.co_filename == GENERATED_CODE):
            tb = tb.tb_next
        return cls(f"{type(exc).__name__}: {exc}", "".join(traceback.format_exception(type(exc), exc, tb)))


def stream_error_row(task: str, failure: Failure | BaseException, item: Any = None, key: Any = _NO_KEY,
                     ts: float | None = None, window: tuple[float, float] | None = None) -> dict[str, Any]:
    """The ``task_errors`` row of a stream task's step that raised on ``item`` (an event, a fired window's
    row, or nothing for a timer), with the key (text; ``None`` before the key is known) and the window
    (``window_start``, ``window_end`` in seconds) when a window's row failed.

    Its first columns are those of a trigger task's row (:func:`streamflow.execution.task_error_row`):
    ``user_id`` and ``trigger_ts`` are the event's (else ``ts``: the item's time, a timer's), and
    ``trigger_event`` the item as JSON.

    Example:
        >>> row = stream_error_row("rates", ZeroDivisionError("division by zero"), {"user": "u", "n": 1},
        ...                        key="u", window=(0.0, 10.0))
        >>> [row[k] for k in ("task", "key", "window_start", "window_end", "error", "trigger_event")]
        ['rates', 'u', 0.0, 10.0, 'ZeroDivisionError: division by zero', '{"user": "u", "n": 1}']
    """
    if not isinstance(failure, Failure):
        failure = Failure.of(failure)
    user = None
    if isinstance(item, Event):
        user, ts = item.user_id, item.ts
        body: Any = item.to_dict()
    else:
        if isinstance(item, Mapping) and isinstance(item.get("user_id"), str):
            user = item["user_id"]
        body = item
    return {"task": task, "user_id": user, "trigger_ts": ts,
            "trigger_event": None if item is None else to_json(body),
            "error": failure.error, "traceback": failure.traceback,
            "key": None if key is _NO_KEY or key is None else key if isinstance(key, str) else to_json(key),
            "window_start": None if window is None else window[0], "window_end": None if window is None else window[1]}


class Streak:
    """Consecutive failures of one step of a stream task (on Flink: of one operator instance, so at
    parallelism 1 the same as on the device); ``quarantine_after`` of them in a row quarantine the step."""

    __slots__ = ("limit", "failures", "quarantined")

    def __init__(self, quarantine_after: int):
        if quarantine_after < 1:
            raise ValueError(f"quarantine_after must be >= 1, got {quarantine_after}")
        self.limit = quarantine_after
        self.failures = 0
        self.quarantined = False

    def failed(self, task: str, row: dict[str, Any]) -> bool:
        """Count the failure whose ``task_errors`` row is ``row``; True when it quarantines the step."""
        self.failures += 1
        log.warning("stream task %s failed (key %s%s): %s", task, row["key"],
                    "" if row["window_start"] is None else f", window [{row['window_start']}, {row['window_end']})",
                    row["error"])
        if self.failures < self.limit or self.quarantined:
            return False
        self.quarantined = True
        log.error("stream task %s quarantined after %d consecutive failures; last: %s", task, self.failures,
                  row["error"])
        return True

    def state(self) -> tuple[int, bool]:
        return self.failures, self.quarantined

    def restore(self, state: tuple[int, bool]) -> None:
        self.failures, self.quarantined = state


def _item_check(aggregation: Any) -> tuple[Any, Any] | None:
    """``(where, check)`` for what of ``aggregation`` may raise on an item (see ``Aggregation.check``): ``None``
    for ``Count()`` (nothing), only ``where`` for ``Count(where=...)`` (its ``add`` is ``+ 1``)."""
    if type(aggregation) is Count:
        return None if aggregation.where is None else (aggregation.where, None)
    return aggregation.where, aggregation.check


class StreamInput:
    """A stream task's steps before its keyed step, per event: Filter/Map, the key, Filter/Map, the event
    time, and a check that the aggregation takes the item (its ``where`` and ``Aggregation.check``, once per
    event: an event a window cannot take fails here once, on both runners, instead of in each of its
    windows). ``step(item)`` is ``(key, item, ts_ms)`` for the keyed step, or ``None``; what failed is
    in :attr:`out` as ``(table, row)`` records (``task_errors`` rows, and :data:`QUARANTINED` once).

    Example:
        >>> from operators import Count
        >>> plan = StreamPlan.of("n", [KeyBy("user"), TimeWindow(10), Aggregate(n=Count())])
        >>> steps = StreamInput("n", plan, quarantine_after=2)
        >>> steps.step({"user": "u", "ts": 1.5})
        ('u', {'user': 'u', 'ts': 1.5}, 1500)
        >>> steps.step({"ts": 2.0}), [(table, row["key"], row["error"]) for table, row in steps.out]
        (None, [('task_errors', None, "KeyError: 'user'")])
    """

    def __init__(self, task: str, plan: StreamPlan, quarantine_after: int = 5):
        self.task = task
        self.streak = Streak(quarantine_after)
        self.out: list[tuple[str, dict[str, Any]]] = []
        self.plan = plan
        self.step = self._generate(plan)

    def __getstate__(self) -> dict[str, Any]:
        return {name: value for name, value in self.__dict__.items() if name != "step"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Generated again where it runs (a Flink worker): its globals refer to this object and module.
        self.__dict__.update(state)
        self.step = self._generate(self.plan)

    def _generate(self, plan: StreamPlan) -> Callable[[Any], tuple[Any, Any, int | None] | None]:
        """``step``: the steps as one generated function (a step per line, fields read inline)."""
        namespace: dict[str, Any] = {"streak": self.streak, "failed": self._failed, "Event": Event,
                                     "NO_KEY": _NO_KEY}
        skip = ["streak.failures = 0", "return None"]

        def chain(steps: Sequence[ElementStep], prefix: str) -> list[str]:  # dropped by a Filter or a Map's None
            if not steps:
                return []
            return [*_step_lines(steps, prefix, namespace, "        ", skip), "        if item is None:",
                    *(f"            {line}" for line in skip)]

        lines = ["def step(event):", "    if streak.quarantined:", "        return None",
                 "    key, ts_ms, item = NO_KEY, None, event", "    try:", *chain(plan.before_key, "b"),
                 f"        key = {_read_expression(plan.key_by.key, 'read_key', namespace)}",
                 "        hash(key)",  # a key must be hashable: keyed state is held by key
                 *chain(plan.before_window, "w")]
        if plan.ts is not None:
            read_ts = _read_expression(plan.ts, "read_ts", namespace)
            lines.append(f"        ts_ms = round({read_ts} * 1000)")  # to_millis, inline
        aggregations = plan.aggregate.aggregations.values() if plan.aggregate is not None else ()
        for i, (where, check) in enumerate(filter(None, map(_item_check, aggregations))):
            indent = "        "
            if where is not None:
                namespace[f"where{i}"] = where
                lines.append(f"        if where{i}(item):")
                indent += "    "
            if check is None:
                lines.append(f"{indent}pass")
                continue
            reads = checked_field(check)
            if reads is not None:  # the check reads a named field (and hashes it): inline
                read = _read_expression(reads[0], f"read{i}", namespace)
                lines.append(f"{indent}{'hash(' + read + ')' if reads[1] else read}")
            else:
                namespace[f"check{i}"] = check
                lines.append(f"{indent}check{i}(item)")
        lines += ["    except Exception as exc:", "        failed(exc, event, key)", "        return None",
                  "    streak.failures = 0", "    return key, item, ts_ms"]
        return generated("step", lines, namespace)

    def _failed(self, exc: Exception, event: Any, key: Any) -> None:
        row = stream_error_row(self.task, exc, event, key)
        self.out.append((TASK_ERRORS_TABLE, row))
        if self.streak.failed(self.task, row):
            self.out.append((QUARANTINED, {"task": self.task}))


class GuardedFunction(KeyedProcessFunction):
    """A stream task's keyed step (a window function, or the user's ``Process``) whose ``on_event`` and
    ``on_timer`` failures are caught per call: each becomes a ``task_errors`` side output naming the key
    (and the window, for a time window's firing); what the call emitted before it raised is kept.
    Events and timers keep separate streaks (on Flink a time window's events and firings are two
    functions); either one quarantines the step, which then does nothing (:data:`QUARANTINED` is sent once).
    ``close()`` cannot output: its failure waits in :attr:`closing` (the device runner stores it).

    ``window_size_ms``: the size of a time window, whose firing timer at ``t`` is the window ``[t + 1 - size,
    t + 1)``.
    """

    def __init__(self, function: KeyedProcessFunction, task: str, quarantine_after: int = 5,
                 window_size_ms: int | None = None):
        self.function = function
        self.ts = function.ts
        self.task = task
        self.window_size_ms = window_size_ms
        self.events = Streak(quarantine_after)
        self.timers = Streak(quarantine_after)
        self.closing: list[dict[str, Any]] = []

    @property
    def quarantined(self) -> bool:
        return self.events.quarantined or self.timers.quarantined

    def open(self, ctx: Any) -> None:
        self.function.open(ctx)

    def on_event(self, event: Any, ctx: Any) -> None:
        if self.events.quarantined or self.timers.quarantined:
            return
        try:
            self.function.on_event(event, ctx)
        except Exception as exc:
            ts = ctx.timestamp / 1000 if self.ts is not None and ctx.timestamp is not None else None
            self._failed(self.events, ctx, stream_error_row(self.task, exc, event, ctx.key, ts))
        else:
            self.events.failures = 0

    def on_timer(self, time_ms: int, ctx: Any) -> None:
        if self.events.quarantined or self.timers.quarantined:
            return
        try:
            self.function.on_timer(time_ms, ctx)
        except Exception as exc:
            size = self.window_size_ms
            window = None if size is None else ((time_ms + 1 - size) / 1000, (time_ms + 1) / 1000)
            self._failed(self.timers, ctx, stream_error_row(self.task, exc, None, ctx.key,
                                                            None if window else time_ms / 1000, window))
        else:
            self.timers.failures = 0

    def _failed(self, streak: Streak, ctx: Any, row: dict[str, Any]) -> None:
        ctx.side(TASK_ERRORS_TABLE, row)
        if streak.failed(self.task, row):
            ctx.side(QUARANTINED, {"task": self.task})

    def close(self) -> None:
        try:
            self.function.close()
        except Exception as exc:
            row = stream_error_row(self.task, exc)
            log.warning("stream task %s failed closing: %s", self.task, row["error"])
            self.closing.append(row)


class StreamOutput:
    """A stream task's outputs after its keyed step, to ``(table, row)`` records: a fired row through the
    Filter/Map after the window (each row on its own: one that raises becomes a ``task_errors`` row naming
    the key and the window), late items as ``late_events`` rows, side outputs by table (a table name no
    table can have is a failure too), failures and :data:`QUARANTINED` as they are.

    Example:
        >>> from operators import Count, Map
        >>> plan = StreamPlan.of("r", [KeyBy("user"), TimeWindow(10), Aggregate(n=Count()), Map(lambda r: 1 / 0)])
        >>> [(table, row["window_start"], row["error"]) for table, row in StreamOutput("r", "r", plan).records(
        ...     "emit", {"user": "u", "window_start": 0.0, "window_end": 10.0, "n": 1})]
        [('task_errors', 0.0, 'ZeroDivisionError: division by zero')]
    """

    def __init__(self, task: str, sink: str, plan: StreamPlan, quarantine_after: int = 5):
        self.task = task
        self.sink = sink
        self.after = elementwise(plan.after_window) if plan.after_window else None
        self.key_name = plan.key_by.name
        self.read_ts = field_reader(plan.ts) if plan.ts is not None else None
        self.streak = Streak(quarantine_after)

    def route(self, tag: str, value: Any, rows: list[dict[str, Any]], sides: list[tuple[str, Any]]) -> None:
        """One output of the keyed step: a row for the sink into ``rows``, anything else into ``sides``."""
        if tag == "emit":
            streak = self.streak
            if streak.quarantined:
                return
            try:
                row = self.after(value) if self.after is not None else value
            except Exception as exc:
                self._failed(exc, value, sides)
                return
            streak.failures = 0
            if row is not None:
                rows.append(row)
        elif tag == LATE:
            sides.append((LATE, late_row(self.task, self.read_ts(value) if self.read_ts else None, value)))
        elif tag in (TASK_ERRORS_TABLE, QUARANTINED):
            sides.append((tag, value))
        else:
            try:
                sides.append((check_table_name(tag), value))
            except ValueError as exc:
                self._failed(exc, value, sides)

    def records(self, tag: str, value: Any) -> list[tuple[str, Any]]:
        """:meth:`route` as ``(table, row)`` records (Flink's flat_map after the keyed step)."""
        rows: list[dict[str, Any]] = []
        sides: list[tuple[str, Any]] = []
        self.route(tag, value, rows, sides)
        return [(self.sink, row) for row in rows] + sides if rows else sides

    def _failed(self, exc: Exception, value: Any, sides: list[tuple[str, Any]]) -> None:
        key, window = _NO_KEY, None
        if isinstance(value, Mapping):
            key = value.get(self.key_name, _NO_KEY)
            if "window_start" in value and "window_end" in value:
                window = (value["window_start"], value["window_end"])
        row = stream_error_row(self.task, exc, value, key, window=window)
        sides.append((TASK_ERRORS_TABLE, row))
        if self.streak.failed(self.task, row):
            sides.append((QUARANTINED, {"task": self.task}))


class StreamTaskRun:
    """A stream task on the device runner: element operators, the keyed step, row operators.

    Each step that raises fails alone (see :class:`StreamInput`, :class:`GuardedFunction`,
    :class:`StreamOutput`): its ``task_errors`` row is among the side rows, every other row goes on;
    ``quarantine_after`` consecutive failures of a step quarantine it (:attr:`quarantined`).

    Example:
        >>> from operators import Count
        >>> from streamflow.job import Task
        >>> run = StreamTaskRun(Task("n", None, [KeyBy("user"), TimeWindow(10), Aggregate(n=Count())], input="stream"))
        >>> run.process({"user": "u", "ts": 1.0}), run.finish()
        (([], []), ([{'user': 'u', 'window_start': 0.0, 'window_end': 10.0, 'n': 1}], []))
    """

    def __init__(self, task: Any, max_keys: int | None = None, quarantine_after: int = 5):
        self.name = task.name
        self.sink = task.sink
        self.plan = plan = StreamPlan.of(task.name, copy.deepcopy(list(task.pipeline)))
        self.input = StreamInput(task.name, plan, quarantine_after)
        size = to_millis(plan.window.size) if isinstance(plan.window, TimeWindow) else None
        self.keyed = GuardedFunction(plan.function(), task.name, quarantine_after, size)
        self.runtime = KeyedRuntime(self.keyed, plan.out_of_orderness, max_keys)
        self.output = StreamOutput(task.name, task.sink, plan, quarantine_after)
        self.read_ts = self.runtime.read_ts
        #: True once a step is quarantined (it has stopped; the others go on with what they hold).
        self.quarantined = False

    @property
    def consecutive_errors(self) -> int:
        """The longest current run of failures among the task's steps."""
        keyed = self.keyed
        return max(self.input.streak.failures, keyed.events.failures, keyed.timers.failures,
                   self.output.streak.failures)

    def process(self, item: Any) -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, Any]]]]:
        """One event in: ``(feature rows, side rows as (table, row))``; late items go to ``late_events``,
        failures to ``task_errors``."""
        entry = self.input.step(item)
        if entry is None:
            return [], self._failures(self.input.out) if self.input.out else []
        return self.route(self.runtime.process(*entry))

    def process_block(self, items: list[Any]) -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, Any]]],
                                                         list[tuple[Any, Exception]]]:
        """:meth:`process` for each item in order, the rows and side rows of all of them in their order, and
        ``(item, exception)`` for an item whose processing raised past its steps' own handling (a backstop:
        the runner reports it; the items after it go on).

        Example:
            >>> from operators import Count
            >>> from streamflow.job import Task
            >>> run = StreamTaskRun(Task("n", None, [KeyBy("user"), TimeWindow(10), Aggregate(n=Count())],
            ...                          input="stream"))
            >>> run.process_block([{"user": "u", "ts": 1.0}, {"user": "u", "ts": 12.0}, {"user": "u", "ts": 2.0}])
            ([{'user': 'u', 'window_start': 0.0, 'window_end': 10.0, 'n': 1}], [('late_events', {'task': 'n', \
'ts': 2.0, 'item': '{"ts": 2.0, "user": "u"}'})], [])
        """
        rows: list[dict[str, Any]] = []
        sides: list[tuple[str, Any]] = []
        failed: list[tuple[Any, Exception]] = []
        step, process, route, out = self.input.step, self.runtime.process, self.output.route, self.input.out
        for item in items:
            try:
                entry = step(item)
                if entry is None:
                    if out:
                        sides += self._failures(out)
                    continue
                for tag, value in process(*entry):
                    route(tag, value, rows, sides)
            except Exception as exc:
                failed.append((item, exc))
        return rows, self._quarantines(sides), failed

    def finish(self) -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, Any]]]]:
        """End of input: the rows of every window still open (the final watermark's timers)."""
        rows, sides = self.route(self.runtime.finish())
        if self.keyed.closing:
            sides += [(TASK_ERRORS_TABLE, row) for row in self.keyed.closing]
            self.keyed.closing.clear()
        return rows, sides

    def steps_state(self) -> dict[str, tuple[int, bool]]:
        """Each step's streak and quarantine (for a checkpoint; the keyed state is :attr:`runtime`'s)."""
        keyed = self.keyed
        return {"input": self.input.streak.state(), "events": keyed.events.state(),
                "timers": keyed.timers.state(), "output": self.output.streak.state()}

    def restore_steps(self, state: dict[str, tuple[int, bool]]) -> None:
        keyed = self.keyed
        for name, streak in (("input", self.input.streak), ("events", keyed.events), ("timers", keyed.timers),
                             ("output", self.output.streak)):
            streak.restore(state[name])
        self.quarantined = any(quarantined for _, quarantined in state.values())

    def step_failures(self) -> list[tuple[str, dict[str, Any]]]:
        """The ``(table, row)`` failures the steps before the keyed step recorded since the last call (a step
        that quarantined marks the task quarantined)."""
        return self._failures(self.input.out) if self.input.out else []

    def _failures(self, out: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
        sides = [record for record in out if record[0] != QUARANTINED]
        if len(sides) < len(out):
            self.quarantined = True
        out.clear()
        return sides

    def route(self, outputs: list[tuple[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[str, dict[str, Any]]]]:
        """The keyed step's ``(tag, value)`` outputs through the steps after it: ``(feature rows, side rows)``."""
        rows: list[dict[str, Any]] = []
        sides: list[tuple[str, Any]] = []
        route = self.output.route
        for tag, value in outputs:
            route(tag, value, rows, sides)
        return rows, self._quarantines(sides)

    def _quarantines(self, sides: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """``sides`` without the :data:`QUARANTINED` records, which mark the task quarantined."""
        if sides and any(table == QUARANTINED for table, _ in sides):
            self.quarantined = True
            return [record for record in sides if record[0] != QUARANTINED]
        return sides
