"""The keyed process function (:mod:`operators.process`) on Flink: one PyFlink ``KeyedProcessFunction``.

:class:`FlinkKeyed` runs one of our functions inside Flink, one to one: each state descriptor becomes
its own small Flink ``ValueState`` / ``ListState`` / ``MapState`` (pickled values, so a list state's
``add`` appends one element and never rewrites the rest), timers are Flink's timer service, and what
the function emits comes out as ``(tag, row)`` records (``"emit"`` or the side output's name).

TTL runs on the stream clock, as on the device: the largest event time this subtask has seen. A
value written with a TTL is stored with the clock at its write; a read past ``written + ttl`` clears
it and reads as absent. At parallelism 1 the clock moves exactly as the device runner's, so state
expires at the same events on both runners.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from operators.base import field_reader
from operators.process import KeyedProcessFunction as StreamflowFunction
from operators.process import StateDescriptor
from operators.window import to_millis
from streamflow.keyed import START_OF_TIME

try:
    from pyflink.common import Types
    from pyflink.common.time import Time
    from pyflink.datastream.functions import KeyedProcessFunction, RuntimeContext
    from pyflink.datastream.state import ListStateDescriptor, MapStateDescriptor, StateTtlConfig, ValueStateDescriptor
except ImportError as exc:  # the `flink` extra is optional
    raise ImportError("the Flink runner needs PyFlink: pip install 'streamflow[flink]'") from exc

_PICKLED = Types.PICKLED_BYTE_ARRAY()


_UNREAD = object()  # a state not read yet in this call

#: Decoded states kept per handle (keys); past it a handle's cache starts over.
DEFAULT_STATE_CACHE_KEYS = 10_000
#: Seconds after which every cache starts over (see :class:`FlinkKeyed`).
STATE_CACHE_MAX_AGE_S = 60.0


class _Handle:
    """A state of the current key, read at most once per call and written back once at its end
    (:meth:`FlinkKeyed.commit`): each read or write crosses into the JVM (and unpickles or pickles),
    and one record often touches the same state several times (a page exit, then an enter).

    What a key's state holds is also kept decoded in ``cache`` (by key) after a read or a write, so
    a key seen again is not read from Flink: this operator instance is the only writer of its keys'
    state, and every change is written through at the end of the call, so Flink's state is always
    current (checkpoints see every change; a restored job starts with empty caches)."""

    __slots__ = ("state", "written", "ttl", "owner", "cache", "written_cache", "_written_at", "_written_dirty")

    def __init__(self, state: Any, written: Any, ttl: int | None, owner: FlinkKeyed):
        self.state = state
        self.written = written  # a ValueState of the clock at the last write, with a TTL
        self.ttl = ttl
        self.owner = owner
        self.cache: dict[Any, Any] = {}  # key -> decoded value (None: absent)
        self.written_cache: dict[Any, Any] = {}  # key -> clock at the last write (None: none)
        self._written_at: Any = _UNREAD
        self._written_dirty = False

    def _live(self) -> bool:
        """False (and the state cleared) if the current key's value expired."""
        if self.ttl is None:
            return True
        at = self._written_at
        if at is _UNREAD:
            key = self.owner.cache_key
            at = self.written_cache.get(key, _UNREAD)
            if at is _UNREAD:
                at = self.written_cache[key] = self.written.value()
            self._written_at = at
        if at is not None and at + self.ttl < self.owner.clock:
            self.clear()
            return False
        return True

    def _touch(self) -> None:
        if self.ttl is not None:
            self._written_at, self._written_dirty = self.owner.clock, True

    def clear(self) -> None:
        self._clear_value()
        if self.ttl is not None:
            self._written_at, self._written_dirty = None, True

    def commit(self) -> None:
        """Write what this call changed back to Flink; the next call may be for another key."""
        if self._written_dirty:
            at = self.written_cache[self.owner.cache_key] = self._written_at
            if at is None:
                self.written.clear()
            else:
                self.written.update(at)
            self._written_dirty = False
        self._written_at = _UNREAD
        self._commit_value()

    def forget(self) -> None:
        """Drop the cached values (they are read from Flink again)."""
        self.cache.clear()
        self.written_cache.clear()

    def _clear_value(self) -> None:
        self.state.clear()

    def _commit_value(self) -> None:
        pass


class _Value(_Handle):
    __slots__ = ("_value", "_dirty")

    def __init__(self, *args: Any):
        super().__init__(*args)
        self._value: Any = _UNREAD
        self._dirty = False

    def value(self) -> Any:
        if not self._live():
            return None
        value = self._value
        if value is _UNREAD:
            key = self.owner.cache_key
            value = self.cache.get(key, _UNREAD)
            if value is _UNREAD:
                value = self.cache[key] = self.state.value()
            self._value = value
        return value

    def update(self, value: Any) -> None:
        if value is None:
            self.clear()
        else:
            self._value, self._dirty = value, True
            self._touch()

    def _clear_value(self) -> None:
        self._value, self._dirty = None, True

    def _commit_value(self) -> None:
        if self._dirty:
            value = self.cache[self.owner.cache_key] = self._value
            if value is None:
                self.state.clear()
            else:
                self.state.update(value)
            self._dirty = False
        self._value = _UNREAD


class _List(_Handle):
    """Like the device's list state, ``get()`` returns the held list itself: do not keep it."""

    __slots__ = ("_values", "_replaced", "_added")

    def __init__(self, *args: Any):
        super().__init__(*args)
        self._values: Any = _UNREAD  # the whole list, once read
        self._replaced = False       # written back whole (update / clear) ...
        self._added: list[Any] = []  # ... or only these appended (one add / add_all, never a rewrite)

    def get(self) -> list[Any]:
        if not self._live():
            return []
        if self._values is _UNREAD:
            self._values = [*self._stored(), *self._added]
        return self._values

    def _stored(self) -> list[Any]:
        key = self.owner.cache_key
        stored = self.cache.get(key)
        if stored is None:
            stored = self.cache[key] = list(self.state.get() or ())
        return stored

    def add(self, value: Any) -> None:
        self._live()
        if self._values is not _UNREAD:
            self._values.append(value)
        if not self._replaced:
            self._added.append(value)
        self._touch()

    def add_all(self, values: Any) -> None:
        for value in values:
            self.add(value)

    def update(self, values: Any) -> None:
        values = list(values)
        if values:
            self._values, self._replaced, self._added = values, True, []
            self._touch()
        else:
            self.clear()

    def _clear_value(self) -> None:
        self._values, self._replaced, self._added = [], True, []

    def _commit_value(self) -> None:
        key = self.owner.cache_key
        if self._replaced:
            values = self._values
            self.cache[key] = values
            if values:
                self.state.update(values)
            else:
                self.state.clear()
        elif self._added:
            added = self._added
            if self._values is not _UNREAD:
                self.cache[key] = self._values
            else:
                cached = self.cache.get(key)
                if cached is not None:
                    cached.extend(added)
            if len(added) == 1:
                self.state.add(added[0])
            else:
                self.state.add_all(added)
        self._values, self._replaced, self._added = _UNREAD, False, []


class _Map(_Handle):
    """Not cached: a map is read and written per entry."""

    __slots__ = ()

    def get(self, key: Any, default: Any = None) -> Any:
        if not self._live() or not self.state.contains(key):
            return default
        return self.state.get(key)

    def put(self, key: Any, value: Any) -> None:
        self._live()
        self.state.put(key, value)
        self._touch()

    def remove(self, key: Any) -> None:
        self.state.remove(key)

    def contains(self, key: Any) -> bool:
        return self._live() and self.state.contains(key)

    def items(self) -> Any:
        return iter(list(self.state.items())) if self._live() else iter(())

    def is_empty(self) -> bool:
        return not self._live() or self.state.is_empty()


class FlinkKeyed(KeyedProcessFunction):
    """Runs ``function`` (ours) as a Flink keyed process function over ``(key, item)`` records.

    ``state_ttl_days`` also gives every Flink state Flink's own (processing-time) TTL: a backstop that
    reclaims the state of keys that never come back.

    Each state handle keeps the decoded states of up to ``state_cache_keys`` keys (see :class:`_Handle`),
    so a key seen again reads nothing from Flink; writes always go through. Every cache starts over
    after :data:`STATE_CACHE_MAX_AGE_S` seconds, so a value the backstop TTL expired in Flink is not
    served from memory for longer than that.
    """

    def __init__(self, function: StreamflowFunction, state_ttl_days: int | None = None,
                 state_cache_keys: int = DEFAULT_STATE_CACHE_KEYS):
        self.function = function
        self.state_ttl_days = state_ttl_days
        self.state_cache_keys = state_cache_keys

    # -- our RuntimeContext ------------------------------------------------------------------------
    def open(self, runtime_context: RuntimeContext) -> None:
        self._runtime = runtime_context
        self._read_ts = field_reader(self.function.ts) if self.function.ts is not None else None
        self.clock = START_OF_TIME
        self.key: Any = None
        self.cache_key: Any = None
        self.timestamp: int | None = None
        self._ctx: Any = None
        self._out: list[tuple[str, Any]] = []
        self._handles: list[_Handle] = []
        self._cache_since = time.monotonic()
        self.function.open(self)

    def get_state(self, descriptor: StateDescriptor) -> Any:
        name, ttl = descriptor.name, descriptor.ttl_ms
        runtime = self._runtime
        if descriptor.kind == "value":
            state = runtime.get_state(self._backstop(ValueStateDescriptor(name, _PICKLED)))
            handle = _Value
        elif descriptor.kind == "list":
            state = runtime.get_list_state(self._backstop(ListStateDescriptor(name, _PICKLED)))
            handle = _List
        else:
            state = runtime.get_map_state(self._backstop(MapStateDescriptor(name, _PICKLED, _PICKLED)))
            handle = _Map
        written = None
        if ttl is not None:
            written = runtime.get_state(self._backstop(ValueStateDescriptor(f"{name}.written", Types.LONG())))
        self._handles.append(handle(state, written, ttl, self))
        return self._handles[-1]

    def _backstop(self, descriptor: Any) -> Any:
        if self.state_ttl_days is not None:
            # Expired keys are cleaned incrementally on access. PyFlink's default background cleanup
            # builds a RocksDB compaction setting through the Py4J gateway, which a TaskManager's
            # embedded interpreter does not have (it fails on a standalone cluster).
            descriptor.enable_time_to_live(StateTtlConfig.new_builder(Time.days(self.state_ttl_days))
                                           .disable_cleanup_in_background().cleanup_incrementally(10, False)
                                           .build())
        return descriptor

    def set_key(self, key: Any) -> None:
        """Say which key the next state accesses are for (the key Flink set for this call)."""
        self.key = key
        # Flink tells keys apart by their serialised form; so does the cache (1 and 1.0 are two keys there).
        self.cache_key = key if type(key) is str else pickle.dumps(key)

    def clear_all(self) -> None:
        """Drop every state of the current key."""
        for handle in self._handles:
            handle.clear()

    def commit(self) -> None:
        """Write back what the call changed (see :class:`_Handle`); call it before leaving the key."""
        limit = self.state_cache_keys
        for handle in self._handles:
            handle.commit()
            if len(handle.cache) > limit:
                handle.forget()
        now = time.monotonic()
        if now - self._cache_since > STATE_CACHE_MAX_AGE_S:
            self._cache_since = now
            for handle in self._handles:
                handle.forget()

    # -- our Context ---------------------------------------------------------------------------------
    def current_watermark(self) -> int:
        return self._ctx.timer_service().current_watermark()

    def current_time(self) -> int:
        return self.clock

    def current_processing_time(self) -> int:
        return self._ctx.timer_service().current_processing_time()

    def register_event_time_timer(self, time_ms: int) -> None:
        self._ctx.timer_service().register_event_time_timer(int(time_ms))

    def register_processing_time_timer(self, time_ms: int) -> None:
        self._ctx.timer_service().register_processing_time_timer(int(time_ms))

    def delete_event_time_timer(self, time_ms: int) -> None:
        self._ctx.timer_service().delete_event_time_timer(int(time_ms))

    def delete_processing_time_timer(self, time_ms: int) -> None:
        self._ctx.timer_service().delete_processing_time_timer(int(time_ms))

    def emit(self, row: dict[str, Any]) -> None:
        self._out.append(("emit", row))

    def side(self, tag: str, row: dict[str, Any]) -> None:
        self._out.append((tag, row))

    # -- Flink ---------------------------------------------------------------------------------------
    def call(self, ctx: Any, item: Any, ts_ms: int | None = None, key: Any = None) -> list[tuple[str, Any]]:
        """Run ``on_event`` for ``item`` of the current key (``key``, if the caller read it already: each
        read crosses into the JVM); what it output."""
        if ts_ms is None:
            ts_ms = to_millis(self._read_ts(item)) if self._read_ts is not None else self.clock
        self.clock = max(self.clock, ts_ms)
        self._ctx, self.timestamp = ctx, ts_ms
        self.set_key(ctx.get_current_key() if key is None else key)
        out = self._out = []
        self.function.on_event(item, self)
        return out

    def process_element(self, value: tuple[Any, Any], ctx: KeyedProcessFunction.Context):
        try:
            out = self.call(ctx, value[1], key=value[0])  # the key_by key: no crossing into the JVM for it
        finally:
            self.commit()
        yield from out

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext):
        self._ctx, self.timestamp = ctx, timestamp
        self.set_key(ctx.get_current_key())
        out = self._out = []
        try:
            self.function.on_timer(timestamp, self)
        finally:
            self.commit()
        yield from out

    def close(self) -> None:
        self.function.close()
