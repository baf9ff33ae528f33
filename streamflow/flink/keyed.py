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


class _Handle:
    __slots__ = ("state", "written", "ttl", "owner")

    def __init__(self, state: Any, written: Any, ttl: int | None, owner: FlinkKeyed):
        self.state = state
        self.written = written  # a ValueState of the clock at the last write, with a TTL
        self.ttl = ttl
        self.owner = owner

    def _live(self) -> bool:
        """False (and the state cleared) if the current key's value expired."""
        if self.ttl is None:
            return True
        at = self.written.value()
        if at is not None and at + self.ttl < self.owner.clock:
            self.clear()
            return False
        return True

    def _touch(self) -> None:
        if self.ttl is not None:
            self.written.update(self.owner.clock)

    def clear(self) -> None:
        self.state.clear()
        if self.ttl is not None:
            self.written.clear()


class _Value(_Handle):
    __slots__ = ()

    def value(self) -> Any:
        return self.state.value() if self._live() else None

    def update(self, value: Any) -> None:
        if value is None:
            self.clear()
        else:
            self.state.update(value)
            self._touch()


class _List(_Handle):
    __slots__ = ()

    def get(self) -> list[Any]:
        if not self._live():
            return []
        values = self.state.get()
        return list(values) if values is not None else []

    def add(self, value: Any) -> None:
        self._live()
        self.state.add(value)
        self._touch()

    def add_all(self, values: Any) -> None:
        self._live()
        self.state.add_all(list(values))
        self._touch()

    def update(self, values: Any) -> None:
        values = list(values)
        if values:
            self.state.update(values)
            self._touch()
        else:
            self.clear()


class _Map(_Handle):
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
    """

    def __init__(self, function: StreamflowFunction, state_ttl_days: int | None = None):
        self.function = function
        self.state_ttl_days = state_ttl_days

    # -- our RuntimeContext ------------------------------------------------------------------------
    def open(self, runtime_context: RuntimeContext) -> None:
        self._runtime = runtime_context
        self._read_ts = field_reader(self.function.ts) if self.function.ts is not None else None
        self.clock = START_OF_TIME
        self.key: Any = None
        self.timestamp: int | None = None
        self._ctx: Any = None
        self._out: list[tuple[str, Any]] = []
        self._handles: list[_Handle] = []
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

    def clear_all(self) -> None:
        """Drop every state of the current key."""
        for handle in self._handles:
            handle.clear()

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
        self._ctx, self.key, self.timestamp = ctx, ctx.get_current_key() if key is None else key, ts_ms
        out = self._out = []
        self.function.on_event(item, self)
        return out

    def process_element(self, value: tuple[Any, Any], ctx: KeyedProcessFunction.Context):
        yield from self.call(ctx, value[1])

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext):
        self._ctx, self.key, self.timestamp = ctx, ctx.get_current_key(), timestamp
        out = self._out = []
        self.function.on_timer(timestamp, self)
        yield from out

    def close(self) -> None:
        self.function.close()
