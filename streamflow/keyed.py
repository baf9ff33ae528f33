"""The device runner's implementation of the keyed process function (:mod:`operators.process`).

State lives in plain dicts, one per state descriptor, keyed by the stream key; timers in two heaps
(event time, processing time). One :class:`KeyedRuntime` runs one function over a keyed stream:

- ``process(key, item)`` sets the current key, runs ``on_event``, then advances the watermark
  (largest event time seen - ``out_of_orderness`` - 1 ms, as Flink's bounded-out-of-orderness
  generator) and fires the event-time timers it passed, and the processing-time timers that are due.
- ``finish()`` is the end of the input: the watermark jumps to +infinity and every event-time timer
  fires (processing-time timers do not, as in Flink when a bounded job ends).
- **Bounded state**: state with a TTL expires on the stream clock (see :mod:`operators.process`);
  each store keeps its keys in write order, so expired keys are reclaimed from the front in O(1) as
  the clock moves. ``max_keys`` caps the keys held: the least recently seen key is evicted (all its
  state) and counted in :attr:`KeyedRuntime.evicted`.
- ``snapshot()`` / ``restore()`` give the whole state as one picklable object (checkpoints).

Example:
    >>> from operators.process import KeyedProcessFunction, ValueStateDescriptor
    >>> class Remind(KeyedProcessFunction):
    ...     def open(self, ctx):
    ...         self.last = ctx.get_state(ValueStateDescriptor("last"))
    ...     def on_event(self, event, ctx):
    ...         self.last.update(event["ts"])
    ...         ctx.register_event_time_timer(ctx.timestamp + 10_000)
    ...     def on_timer(self, time_ms, ctx):
    ...         ctx.emit({"user": ctx.key, "idle_since": self.last.value()})
    >>> runtime = KeyedRuntime(Remind())
    >>> runtime.process("u", {"ts": 1.0}), runtime.process("v", {"ts": 30.0})
    ([], [('emit', {'user': 'u', 'idle_since': 1.0})])
    >>> runtime.finish()
    [('emit', {'user': 'v', 'idle_since': 30.0})]
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from operator import itemgetter
from typing import Any

from operators.base import field_reader
from operators.process import KeyedProcessFunction, StateDescriptor
from operators.window import to_millis

END_OF_TIME = 2**63 - 1  # Long.MAX_VALUE, the final watermark
START_OF_TIME = -END_OF_TIME
Output = tuple[str, dict[str, Any]]  # ("emit", row) or (side output tag, row)
_tag_of, _row_of = itemgetter(0), itemgetter(1)


class KeyedStore:
    """One state's values by key; with a TTL, also each key's write time on the stream clock, oldest first.

    Example:
        >>> from operators.process import ValueStateDescriptor
        >>> store = KeyedStore(ValueStateDescriptor("last_ts", ttl_s=1))
        >>> store.set("u", 5.0, clock=1000)
        >>> store.get("u", clock=2000), store.expire(clock=2001, on_expire=print)
        u 5.0
        (5.0, 1)
    """

    __slots__ = ("name", "kind", "data", "ttl", "written")

    def __init__(self, descriptor: StateDescriptor):
        self.name = descriptor.name
        self.kind = descriptor.kind
        self.data: dict[Any, Any] = {}
        self.ttl = descriptor.ttl_ms
        self.written: OrderedDict[Any, int] | None = OrderedDict() if self.ttl is not None else None

    def get(self, key: Any, clock: int) -> Any:
        value = self.data.get(key)
        written = self.written  # not None exactly when there is a TTL
        if value is not None and written is not None and written[key] + (self.ttl or 0) < clock:
            self.delete(key)
            return None
        return value

    def touch(self, key: Any, clock: int) -> None:
        if self.written is not None:
            self.written[key] = clock
            self.written.move_to_end(key)

    def set(self, key: Any, value: Any, clock: int) -> None:
        self.data[key] = value
        self.touch(key, clock)

    def delete(self, key: Any) -> bool:
        if self.written is not None:
            self.written.pop(key, None)
        return self.data.pop(key, None) is not None

    def expire(self, clock: int, on_expire: Any = None) -> int:
        """Drop every value written before ``clock - ttl`` (telling ``on_expire(key, value)``); how many."""
        written, n = self.written, 0
        if written is None:
            return 0
        limit = clock - (self.ttl or 0)
        while written:
            key, at = next(iter(written.items()))
            if at >= limit:
                break
            value = self._drop(key)
            if on_expire is not None:
                on_expire(key, value)
            n += 1
        return n

    def _drop(self, key: Any) -> Any:
        """Drop what ``written``'s entry ``key`` stands for; its value."""
        if self.written is not None:
            del self.written[key]
        return self.data.pop(key)


class MapStore(KeyedStore):
    """A map state's maps by key. With a TTL, each *entry* expires ``ttl`` after its last ``put``, as Flink's
    ``StateTtlConfig`` expires map entries (not the whole map of a key): ``written`` holds each
    ``(key, entry key)``'s write time, oldest first. Expired entries are dropped by :meth:`expire`, which
    :class:`KeyedRuntime` calls whenever its clock moves, so a read never sees one.

    Example:
        >>> from operators.process import MapStateDescriptor
        >>> store = MapStore(MapStateDescriptor("seen", ttl_s=1))
        >>> store.data["u"] = {"a": 1, "b": 2}
        >>> store.touch_entry("u", "a", clock=0); store.touch_entry("u", "b", clock=500)
        >>> store.expire(clock=1001), store.data
        (1, {'u': {'b': 2}})
    """

    __slots__ = ()

    def get(self, key: Any, clock: int) -> Any:
        return self.data.get(key)

    def touch(self, key: Any, clock: int) -> None:
        pass  # entries carry their own write times (touch_entry)

    def touch_entry(self, key: Any, entry: Any, clock: int) -> None:
        written = self.written
        if written is not None:
            written[key, entry] = clock
            written.move_to_end((key, entry))

    def delete_entry(self, key: Any, entry: Any) -> None:
        mapping = self.data[key]
        del mapping[entry]
        if self.written is not None:
            self.written.pop((key, entry), None)
        if not mapping:
            del self.data[key]

    def delete(self, key: Any) -> bool:
        mapping = self.data.pop(key, None)
        if mapping is not None and self.written is not None:
            for entry in mapping:
                self.written.pop((key, entry), None)
        return mapping is not None

    def _drop(self, slot: tuple[Any, Any]) -> Any:
        key, entry = slot
        value = self.data[key][entry]
        self.delete_entry(key, entry)
        return value


class _Handle:
    __slots__ = ("store", "runtime")

    def __init__(self, store: KeyedStore, runtime: KeyedRuntime):
        self.store = store
        self.runtime = runtime

    def clear(self) -> None:
        self.store.delete(self.runtime.key)


class ValueHandle(_Handle):
    """``ValueState`` of the current key."""

    __slots__ = ()

    def value(self) -> Any:
        store = self.store
        if store.written is None:  # no TTL: nothing can have expired
            return store.data.get(self.runtime.key)
        return store.get(self.runtime.key, self.runtime.clock)

    def update(self, value: Any) -> None:
        store = self.store
        if value is None:
            store.delete(self.runtime.key)
        elif store.written is None:
            store.data[self.runtime.key] = value
        else:
            store.set(self.runtime.key, value, self.runtime.clock)


class ListHandle(_Handle):
    """``ListState`` of the current key (``get()`` returns a copy-free list: do not keep it)."""

    __slots__ = ()

    def get(self) -> list[Any]:
        return self.store.get(self.runtime.key, self.runtime.clock) or []

    def add(self, value: Any) -> None:
        runtime = self.runtime
        values = self.store.get(runtime.key, runtime.clock)
        if values is None:
            self.store.set(runtime.key, [value], runtime.clock)
        else:
            values.append(value)
            self.store.touch(runtime.key, runtime.clock)

    def add_all(self, values: Iterable[Any]) -> None:
        for value in values:
            self.add(value)

    def update(self, values: Iterable[Any]) -> None:
        values = list(values)
        if values:
            self.store.set(self.runtime.key, values, self.runtime.clock)
        else:
            self.clear()


class MapHandle(_Handle):
    """``MapState`` of the current key. With a TTL each entry expires on its own (see :class:`MapStore`)."""

    __slots__ = ()
    store: MapStore

    def _map(self) -> dict[Any, Any] | None:
        return self.store.data.get(self.runtime.key)

    def get(self, key: Any, default: Any = None) -> Any:
        return (self._map() or {}).get(key, default)

    def put(self, key: Any, value: Any) -> None:
        data = self.store.data
        mapping = data.get(self.runtime.key)
        if mapping is None:
            mapping = data[self.runtime.key] = {}
        mapping[key] = value
        self.store.touch_entry(self.runtime.key, key, self.runtime.clock)

    def remove(self, key: Any) -> None:
        mapping = self._map()
        if mapping is not None and key in mapping:
            self.store.delete_entry(self.runtime.key, key)

    def contains(self, key: Any) -> bool:
        return key in (self._map() or {})

    def items(self) -> Iterator[tuple[Any, Any]]:
        return iter(list((self._map() or {}).items()))

    def is_empty(self) -> bool:
        return not self._map()


_HANDLES = {"value": ValueHandle, "list": ListHandle, "map": MapHandle}


def rows_by_output(outputs: Iterable[Output]) -> dict[str, list[dict[str, Any]]]:
    """``(output tag, row)`` pairs grouped by tag, each tag's rows in their order (a runner stores them a
    table at a time).

    Example:
        >>> rows_by_output([("ipv", {"n": 1}), ("task_errors", {"e": "x"}), ("ipv", {"n": 2})])
        {'ipv': [{'n': 1}, {'n': 2}], 'task_errors': [{'e': 'x'}]}
    """
    if type(outputs) is list and outputs and len(set(map(_tag_of, outputs))) == 1:  # one table (the usual block)
        return {outputs[0][0]: list(map(_row_of, outputs))}
    grouped: dict[str, list[dict[str, Any]]] = {}
    for tag, row in outputs:
        rows = grouped.get(tag)
        if rows is None:
            grouped[tag] = [row]
        else:
            rows.append(row)
    return grouped


class KeyedRuntime:
    """Runs one :class:`~operators.process.KeyedProcessFunction` over a keyed stream, in memory.

    It is the function's ``RuntimeContext`` (in ``open``) and its ``Context`` (in ``on_event`` and
    ``on_timer``). Example: see the module docstring.
    """

    def __init__(self, function: KeyedProcessFunction, out_of_orderness_s: float = 0.0,
                 max_keys: int | None = None, read_ts: Any = None):
        if max_keys is not None and max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.function = function
        self.bound = to_millis(out_of_orderness_s)
        self.max_keys = max_keys
        #: Reads an item's event time (seconds); ``None`` for functions without event time (count windows).
        self.read_ts = read_ts or (field_reader(function.ts) if function.ts is not None else None)
        self.key: Any = None
        self.timestamp: int | None = None
        self.clock = START_OF_TIME  # the stream clock: the largest event time seen
        self.watermark = START_OF_TIME
        self.evicted = 0  # keys dropped by the max_keys cap
        self.expired = 0  # state values dropped by their TTL
        self._stores: dict[str, KeyedStore] = {}
        self._ttl_stores: list[KeyedStore] = []
        self._recent: OrderedDict[Any, None] | None = OrderedDict() if max_keys is not None else None
        self._event_timers: list[tuple[int, int, Any]] = []  # (time, sequence, key)
        self._processing_timers: list[tuple[int, int, Any]] = []
        self._timer_keys: set[tuple[int, bool, Any]] = set()  # (time, is_event_time, key): one timer each
        self._sequence = 0
        self._out: list[Output] = []
        function.open(self)

    # -- RuntimeContext ---------------------------------------------------------------------------
    def get_state(self, descriptor: StateDescriptor) -> Any:
        store = self._stores.get(descriptor.name)
        if store is None:
            store = self._stores[descriptor.name] = (MapStore if descriptor.kind == "map" else KeyedStore)(descriptor)
            if store.ttl is not None:
                self._ttl_stores.append(store)
        elif store.kind != descriptor.kind or store.ttl != descriptor.ttl_ms:
            raise ValueError(f"state {descriptor.name!r} is already declared as a different {store.kind} state")
        return _HANDLES[descriptor.kind](store, self)

    # -- Context ------------------------------------------------------------------------------------
    def current_watermark(self) -> int:
        return self.watermark

    def current_time(self) -> int:
        return self.clock

    def current_processing_time(self) -> int:
        return int(time.time() * 1000)

    def register_event_time_timer(self, time_ms: int) -> None:
        self._register(self._event_timers, int(time_ms), True)

    def register_processing_time_timer(self, time_ms: int) -> None:
        self._register(self._processing_timers, int(time_ms), False)

    def delete_event_time_timer(self, time_ms: int) -> None:
        self._timer_keys.discard((int(time_ms), True, self.key))  # the heap entry is skipped when it surfaces

    def delete_processing_time_timer(self, time_ms: int) -> None:
        self._timer_keys.discard((int(time_ms), False, self.key))

    def emit(self, row: dict[str, Any]) -> None:
        self._out.append(("emit", row))

    def side(self, tag: str, row: dict[str, Any]) -> None:
        self._out.append((tag, row))

    # -- driving -----------------------------------------------------------------------------------
    def process(self, key: Any, item: Any, ts_ms: int | None = None) -> list[Output]:
        """Run ``on_event`` for ``item`` of ``key``, then fire the timers that are due; the outputs."""
        out = self._out = []
        if ts_ms is None:
            ts_ms = to_millis(self.read_ts(item)) if self.read_ts is not None else self.clock
        ts = ts_ms
        if ts > self.clock:
            self.clock = ts
            for store in self._ttl_stores:
                self.expired += store.expire(ts)
        recent = self._recent
        if recent is not None:
            self._see(recent, key)
        self.key, self.timestamp = key, ts
        self.function.on_event(item, self)
        if self._processing_timers and self._processing_timers[0][0] <= time.time() * 1000:
            self._fire(self._processing_timers, int(time.time() * 1000), False)
        watermark = self.clock - self.bound - 1
        if watermark > self.watermark:  # _advance, its test inline: most events move no watermark
            self._advance(watermark)
        return out

    def process_block(self, items: list[Any], key_of: Callable[[Any], Any], ts_of: Callable[[Any], float]
                      ) -> list[Output]:
        """``process(key_of(item), item, to_millis(ts_of(item)))`` for each item in order; all the outputs.

        A function that defines ``on_block(items, ctx)`` gets the whole block in one call while no
        per-item step is needed: no state with a TTL, no cap on keys, no timer pending. Its contract:
        do what ``on_event`` would do for each item in order (keyed by ``key_of``), register no timer
        and read neither the clock nor the watermark; the clock moves to the block's largest time after it.

        Example:
            >>> from operators.process import KeyedProcessFunction
            >>> class Echo(KeyedProcessFunction):
            ...     def on_event(self, item, ctx):
            ...         ctx.emit({"key": ctx.key, "n": item["n"]})
            >>> runtime = KeyedRuntime(Echo())
            >>> runtime.process_block([{"k": "a", "n": 1, "ts": 2.0}], lambda i: i["k"], lambda i: i["ts"])
            [('emit', {'key': 'a', 'n': 1})]
        """
        on_block = getattr(self.function, "on_block", None)
        if (on_block is None or self._ttl_stores or self._recent is not None or self._event_timers
                or self._processing_timers):
            out: list[Output] = []
            for item in items:
                out += self.process(key_of(item), item, to_millis(ts_of(item)))
            return out
        out = self._out = []
        if items:
            on_block(items, self)
            top = to_millis(max(map(ts_of, items)))
            if top > self.clock:
                self.clock = top
            self.key, self.timestamp = key_of(items[-1]), top
            self._advance(self.clock - self.bound - 1)
        return out

    def state_data(self, name: str) -> dict[Any, Any]:
        """The values of state ``name`` by key, as stored (for ``on_block``: no TTL, no key cap then)."""
        return self._stores[name].data

    def advance(self, watermark: int) -> list[Output]:
        """Move the watermark to ``watermark`` (never back) and fire the event-time timers it passed."""
        out = self._out = []
        self._advance(watermark)
        return out

    def finish(self) -> list[Output]:
        """End of input: the final watermark fires every event-time timer; then ``close()``."""
        out = self.advance(END_OF_TIME)
        self.function.close()
        return out

    @property
    def keys_held(self) -> int:
        """Distinct keys with some state."""
        keys: set[Any] = set()
        for store in self._stores.values():
            keys.update(store.data)
        return len(keys)

    def snapshot(self) -> dict[str, Any]:
        """The whole state (values, write times, timers, clocks) as one picklable object."""
        return {"stores": {name: (s.data, s.written) for name, s in self._stores.items()},
                "event_timers": self._event_timers, "processing_timers": self._processing_timers,
                "timer_keys": self._timer_keys, "sequence": self._sequence, "clock": self.clock,
                "watermark": self.watermark, "recent": self._recent, "evicted": self.evicted,
                "expired": self.expired}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Continue from a :meth:`snapshot` (of a runtime of the same function)."""
        for name, (data, written) in snapshot["stores"].items():
            store = self._stores.get(name)
            if store is None:
                raise ValueError(f"the checkpoint has state {name!r}, which this function does not declare")
            store.data = data
            store.written = written if store.ttl is not None else None
        for name in ("event_timers", "processing_timers", "timer_keys", "sequence"):
            setattr(self, f"_{name}", snapshot[name])
        self.clock, self.watermark = snapshot["clock"], snapshot["watermark"]
        self.evicted, self.expired = snapshot["evicted"], snapshot["expired"]
        if self.max_keys is not None:
            self._recent = snapshot["recent"] if snapshot["recent"] is not None else OrderedDict()

    # -- internals ---------------------------------------------------------------------------------
    def _register(self, heap: list[tuple[int, int, Any]], time_ms: int, event_time: bool) -> None:
        marker = (time_ms, event_time, self.key)
        if marker not in self._timer_keys:
            self._timer_keys.add(marker)
            self._sequence += 1
            heapq.heappush(heap, (time_ms, self._sequence, self.key))

    def _advance(self, watermark: int) -> None:
        if watermark > self.watermark:
            self.watermark = watermark
            if self._event_timers and self._event_timers[0][0] <= watermark:
                self._fire(self._event_timers, watermark, True)

    def _fire(self, heap: list[tuple[int, int, Any]], until: int, event_time: bool) -> None:
        while heap and heap[0][0] <= until:
            time_ms, _, key = heapq.heappop(heap)
            marker = (time_ms, event_time, key)
            if marker not in self._timer_keys:
                continue  # deleted
            self._timer_keys.discard(marker)
            self.key, self.timestamp = key, time_ms
            self.function.on_timer(time_ms, self)

    def _see(self, recent: OrderedDict[Any, None], key: Any) -> None:
        """``key`` is the most recently seen of ``recent`` (the keys held, kept under ``max_keys``)."""
        if key in recent:
            recent.move_to_end(key)
            return
        recent[key] = None
        if len(recent) > (self.max_keys or 0):
            old, _ = recent.popitem(last=False)
            for store in self._stores.values():
                store.delete(old)
            self.evicted += 1
