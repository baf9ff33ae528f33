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

import base64
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
    from pyflink.datastream import TimeDomain
    from pyflink.datastream.functions import KeyedProcessFunction, RuntimeContext
    from pyflink.datastream.state import ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor
except ImportError as exc:  # the `flink` extra is optional
    raise ImportError("the Flink runner needs PyFlink: pip install 'streamflow[flink]'") from exc

_PICKLED = Types.PICKLED_BYTE_ARRAY()


_UNREAD = object()  # a state not read yet in this call

#: Decoded states kept per handle (keys); past it a handle's cache starts over.
DEFAULT_STATE_CACHE_KEYS = 10_000


class _Handle:
    """A state of the current key, read at most once per call and written back once at its end
    (:meth:`FlinkKeyed.commit`): each read or write crosses into the JVM (and unpickles or pickles),
    and one record often touches the same state several times (a page exit, then an enter).

    What a key's state holds is also kept decoded in ``cache`` (by key) after a read or a write, so
    a key seen again is not read from Flink: this operator instance is the only writer of its keys'
    state, and every change is written through at the end of the call, so Flink's state is always
    current (checkpoints see every change; a restored job starts with empty caches)."""

    __slots__ = ("state", "written", "ttl", "owner", "cache", "written_cache", "_written_at", "_written_dirty",
                 "_touched")

    def __init__(self, state: Any, written: Any, ttl: int | None, owner: FlinkKeyed):
        self.state = state
        self.written = written  # a ValueState of the clock at the last write, with a TTL
        self.ttl = ttl
        self.owner = owner
        self.cache: dict[Any, Any] = {}  # key -> decoded value (None: absent)
        self.written_cache: dict[Any, Any] = {}  # key -> clock at the last write (None: none)
        self._written_at: Any = _UNREAD
        self._written_dirty = False
        self._touched = False  # used in this call: to commit at its end

    def _use(self) -> None:
        if not self._touched:
            self._touched = True
            self.owner.touched.append(self)

    def _live(self) -> bool:
        """False (and the state cleared) if the current key's value expired."""
        if not self._touched:
            self._use()
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
        if not self._touched:
            self._use()
        if self.ttl is not None:
            self._written_at, self._written_dirty = self.owner.clock, True

    def clear(self) -> None:
        if not self._touched:
            self._use()
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
        self._touched = False
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
    """Like the device's list state, ``get()`` returns the held list itself: do not keep it past the call;
    appending to it (``add`` or in place) is written back as an append, never as a rewrite."""

    __slots__ = ("_values", "_base", "_replaced", "_added")

    def __init__(self, *args: Any):
        super().__init__(*args)
        self._values: Any = _UNREAD  # the whole list, once read
        self._base = 0               # ... of which this many were stored
        self._replaced = False       # written back whole (update / clear) ...
        self._added: list[Any] = []  # ... or appended to before any read

    def get(self) -> list[Any]:
        if not self._live():
            return []
        if self._values is _UNREAD:
            key = self.owner.cache_key
            stored = self.cache.get(key)
            if stored is None:
                stored = self.cache[key] = list(self.state.get() or ())
            self._base = len(stored)
            self._values = [*stored, *self._added]
            self._added = []
        return self._values

    def add(self, value: Any) -> None:
        self._live()
        if self._values is _UNREAD:
            self._added.append(value)
        else:
            self._values.append(value)
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
        key, values = self.owner.cache_key, self._values
        if self._replaced:
            stored = self.cache.get(key)
            self.cache[key] = values
            if stored is None or stored:
                self.state.clear()  # clear + add crosses twice but costs less than one update
            self._append(values)
        elif values is not _UNREAD:
            if len(values) > self._base:
                self.cache[key] = values
                self._append(values[self._base:])
        elif self._added:
            cached = self.cache.get(key)
            if cached is not None:
                cached.extend(self._added)
            self._append(self._added)
        self._values, self._base, self._replaced, self._added = _UNREAD, 0, False, []

    def _append(self, values: list[Any]) -> None:
        if len(values) == 1:
            self.state.add(values[0])
        elif values:
            self.state.add_all(values)


class _CurrentKeyList:
    """A list state as ``on_block`` reads it on the device (:meth:`KeyedRuntime.state_data`: lists by key),
    for the current key only; an absent or empty list reads as absent."""

    __slots__ = ("handle",)

    def __init__(self, handle: _List | _PackedList):
        self.handle = handle

    def get(self, key: Any, default: Any = None) -> Any:
        values = self.handle.get()
        return values if values else default

    def pop(self, key: Any, default: Any = None) -> Any:
        values = self.handle.get()
        if not values:
            return default
        self.handle.clear()
        return values

    def __setitem__(self, key: Any, values: list[Any]) -> None:
        self.handle.update(values)


class _Packed:
    """The value and list states of the current key packed into one Flink ``ValueState``, one slot each:
    a call that changed several of them writes one record, one crossing into the JVM. A list is then
    rewritten on every append, so only functions whose lists stay short are packed (see ``FlinkKeyed``).
    The record is cached decoded per key like the handles' states."""

    __slots__ = ("state", "owner", "cache", "size", "_slots", "dirty")

    def __init__(self, state: Any, owner: FlinkKeyed):
        self.state = state
        self.owner = owner
        self.cache: dict[Any, list[Any]] = {}
        self.size = 0
        self._slots: Any = _UNREAD
        self.dirty = False

    def slot(self) -> int:
        self.size += 1
        return self.size - 1

    def slots(self) -> list[Any]:
        slots = self._slots
        if slots is _UNREAD:
            key = self.owner.cache_key
            slots = self.cache.get(key)
            if slots is None:
                stored = self.state.value()
                slots = self.cache[key] = [*(stored or ()), *[None] * (self.size - len(stored or ()))]
            self._slots = slots
        return slots

    def set(self, index: int, value: Any) -> None:
        self.slots()[index] = value
        self.dirty = True

    def commit(self) -> None:
        if self.dirty:
            slots = self._slots
            if slots.count(None) < len(slots):
                self.state.update(slots)
            else:
                self.state.clear()
            self.dirty = False
        self._slots = _UNREAD


class _ValueSlot:
    """A slot of :class:`_Packed` with PyFlink's ``ValueState`` calls."""

    __slots__ = ("packed", "index")

    def __init__(self, packed: _Packed):
        self.packed = packed
        self.index = packed.slot()

    def value(self) -> Any:
        return self.packed.slots()[self.index]

    def update(self, value: Any) -> None:
        self.packed.set(self.index, value)

    def clear(self) -> None:
        self.packed.set(self.index, None)


class _ListSlot(_ValueSlot):
    """A slot of :class:`_Packed` with PyFlink's ``ListState`` calls (an empty list is stored as absent)."""

    __slots__ = ()

    def get(self) -> list[Any] | None:
        return self.packed.slots()[self.index]

    def add(self, value: Any) -> None:
        self.add_all([value])

    def add_all(self, values: list[Any]) -> None:
        held = self.packed.slots()[self.index]
        self.packed.set(self.index, [*(held or ()), *values])

    def update(self, values: Any) -> None:
        self.packed.set(self.index, list(values) or None)


class _PackedValue(_ValueSlot):
    """A value state without TTL kept in a slot of :class:`_Packed`: each call is a list access, nothing is
    tracked per call (the packed record is written once, at :meth:`FlinkKeyed.commit`)."""

    __slots__ = ()
    ttl = None


class _PackedList(_PackedValue):
    """A list state without TTL in a slot of :class:`_Packed`, read as the device's list state reads:
    ``get()`` returns the held list itself (or a new empty list, not held, if there is none); changing it
    in place changes the state, so a ``get`` marks the record for writing. An empty list is held as absent."""

    __slots__ = ()

    def get(self) -> list[Any]:
        packed = self.packed
        values = packed.slots()[self.index]
        if values is None:
            return []
        packed.dirty = True
        return values

    def add(self, value: Any) -> None:
        packed = self.packed
        slots = packed.slots()
        values = slots[self.index]
        if values is None:
            slots[self.index] = [value]
        else:
            values.append(value)
        packed.dirty = True

    def add_all(self, values: Any) -> None:
        for value in values:
            self.add(value)

    def update(self, values: Any) -> None:
        self.packed.set(self.index, list(values) or None)


def map_key_text(key: Any) -> str:
    """A map state's entry key as the string Flink keeps it by: Flink's heap backend compares keys by
    ``equals``, which a ``byte[]`` (a pickled key) does only by identity, so a stored key would never be
    found again; strings compare by value. A ``str`` key is kept as it is after an ``s``, any other key as
    its pickle (base64) after a ``p``: deterministic for the keys a map is keyed by (strings, numbers,
    tuples of them).

    Example:
        >>> map_key_text("item-1"), map_key_text((1, "a")) == map_key_text((1, "a"))
        ('sitem-1', True)
        >>> map_key_from_text(map_key_text((1, "a")))
        (1, 'a')
    """
    if type(key) is str:
        return "s" + key
    return "p" + base64.b64encode(pickle.dumps(key, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def map_key_from_text(text: str) -> Any:
    """The entry key :func:`map_key_text` made ``text`` of."""
    if text[0] == "s":
        return text[1:]
    return pickle.loads(base64.b64decode(text[1:]))  # our own encoding of our own state


class _Map(_Handle):
    """A map state of the current key, read from Flink whole at its first use (one crossing for the
    entries) and kept decoded per key as the other handles keep theirs; the entries a call changed are
    written (put or removed) at its end. Lookups are a Python dict's, as on the device.

    With a TTL each entry expires on its own, ``ttl`` after its last ``put`` on the stream clock (as
    Flink's ``StateTtlConfig`` and the device's :class:`~streamflow.keyed.MapStore`): it is stored with
    its write time and dropped when a read finds it expired."""

    __slots__ = ("_entries", "_changed", "_wiped")

    def __init__(self, *args: Any):
        super().__init__(*args)
        self._entries: Any = _UNREAD
        self._changed: set[Any] = set()  # entry keys put or removed in this call
        self._wiped = False  # cleared in this call (before the changes)

    def _map(self) -> dict[Any, Any]:
        """The current key's live entries (entry key -> value, or (value, written) with a TTL)."""
        entries = self._entries
        if entries is _UNREAD:
            if not self._touched:
                self._use()
            key = self.owner.cache_key
            entries = self.cache.get(key)
            if entries is None:
                entries = self.cache[key] = {map_key_from_text(k): v for k, v in self.state.items()}
            self._entries = entries
            if self.ttl is not None and entries:  # once a call: the clock does not move within one
                limit = self.owner.clock - self.ttl
                for expired in [k for k, (_, at) in entries.items() if at < limit]:
                    del entries[expired]
                    self._changed.add(expired)
        return entries

    def get(self, key: Any, default: Any = None) -> Any:
        entries = self._map()
        if key not in entries:
            return default
        return entries[key] if self.ttl is None else entries[key][0]

    def put(self, key: Any, value: Any) -> None:
        self._map()[key] = value if self.ttl is None else (value, self.owner.clock)
        self._changed.add(key)

    def remove(self, key: Any) -> None:
        entries = self._map()
        if key in entries:
            del entries[key]
            self._changed.add(key)

    def contains(self, key: Any) -> bool:
        return key in self._map()

    def items(self) -> Any:
        entries = self._map()
        if self.ttl is None:
            return iter(list(entries.items()))
        return iter([(key, value) for key, (value, _) in entries.items()])

    def is_empty(self) -> bool:
        return not self._map()

    def clear(self) -> None:
        entries = self._map()
        if entries:
            entries.clear()
            self._wiped = True
        self._changed.clear()

    def commit(self) -> None:
        entries = self._entries
        if entries is not _UNREAD:
            state = self.state
            if self._wiped:
                state.clear()
            for key in self._changed:
                if key in entries:
                    state.put(map_key_text(key), entries[key])
                elif not self._wiped:
                    state.remove(map_key_text(key))
        self._entries, self._wiped, self._touched = _UNREAD, False, False
        self._changed = set()


class _Backstop:
    """Drops every state of a key idle for ``ttl_ms`` of processing time, with one processing-time timer
    per key (Flink's state-cleanup-with-timers pattern). Flink's own state TTL would do it too, but it
    wraps every value and makes each list-state access several times dearer (measured: 2-3x).

    A key's ``(last activity, timer)`` lives in one small value state, rewritten only when the last
    activity moved by more than 1/30 of the TTL, so an idle key goes between ``ttl`` and ``ttl * 31/30``
    after its last record."""

    def __init__(self, runtime: RuntimeContext, ttl_ms: int, owner: FlinkKeyed):
        self.state = runtime.get_state(ValueStateDescriptor("backstop", _PICKLED))
        self.ttl_ms = ttl_ms
        self.owner = owner
        self.cache: dict[Any, Any] = {}

    def _entry(self) -> tuple[int, int] | None:
        key = self.owner.cache_key
        entry = self.cache.get(key, _UNREAD)
        if entry is _UNREAD:
            entry = self.cache[key] = self.state.value()
        return entry

    def _write(self, entry: tuple[int, int] | None) -> None:
        self.cache[self.owner.cache_key] = entry
        if entry is None:
            self.state.clear()
        else:
            self.state.update(entry)

    def active(self, ctx: Any) -> None:
        """The current key had a record now: start its timer, or note the activity."""
        now = int(time.time() * 1000)
        entry = self._entry()
        if entry is None:
            timer = now + self.ttl_ms
            ctx.timer_service().register_processing_time_timer(timer)
            self._write((now, timer))
        elif now - entry[0] > self.ttl_ms // 30:
            self._write((now, entry[1]))

    def cleared(self) -> None:
        """Every state of the current key was dropped (its timer finds nothing when it fires)."""
        if self._entry() is not None:
            self._write(None)

    def fired(self, ctx: Any) -> bool:
        """The current key's timer fired: True if its states are to be dropped, else its timer is moved on."""
        entry = self._entry()
        if entry is None:
            return False
        last = entry[0]
        if int(time.time() * 1000) - last >= self.ttl_ms:
            return True
        timer = last + self.ttl_ms
        ctx.timer_service().register_processing_time_timer(timer)
        self._write((last, timer))
        return False


class FlinkKeyed(KeyedProcessFunction):
    """Runs ``function`` (ours) as a Flink keyed process function over ``(key, item)`` records.

    ``state_ttl_days`` drops every state of a key idle for that many days of processing time: a backstop
    that reclaims the state of keys that never come back (:class:`_Backstop`; processing-time timers are
    then the backstop's alone, a function may not register its own).

    Each state handle keeps the decoded states of up to ``state_cache_keys`` keys (see :class:`_Handle`),
    so a key seen again reads nothing from Flink; writes always go through.

    ``packed=True`` keeps the function's value and list states of a key in one Flink ``ValueState``
    (:class:`_Packed`): one write per call instead of one per state changed, but a list is rewritten on
    each append. For functions whose lists stay short (the runner packs trigger tasks that keep only
    the open page); map states are never packed.
    """

    def __init__(self, function: StreamflowFunction, state_ttl_days: int | None = None,
                 state_cache_keys: int = DEFAULT_STATE_CACHE_KEYS, packed: bool = False):
        self.function = function
        self.state_ttl_days = state_ttl_days
        self.state_cache_keys = state_cache_keys
        self.packed = packed

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
        self._handles: list[Any] = []  # _Handle, or _PackedValue / _PackedList
        self._by_name: dict[str, Any] = {}
        self._views: dict[str, _CurrentKeyList] = {}
        self.touched: list[_Handle] = []  # the handles used in this call
        self._cleared = False
        self._backstop = (None if self.state_ttl_days is None
                          else _Backstop(runtime_context, self.state_ttl_days * 86_400_000, self))
        self._packed = (_Packed(runtime_context.get_state(ValueStateDescriptor("packed", _PICKLED)), self)
                        if self.packed else None)
        self.function.open(self)

    def get_state(self, descriptor: StateDescriptor) -> Any:
        name, ttl = descriptor.name, descriptor.ttl_ms
        runtime, packed = self._runtime, self._packed
        if packed is not None and ttl is None and descriptor.kind != "map":
            lean = (_PackedValue if descriptor.kind == "value" else _PackedList)(packed)
            self._handles.append(lean)
            self._by_name[name] = lean
            return lean
        handle: type[_Handle]
        if descriptor.kind == "value":
            state = _ValueSlot(packed) if packed else runtime.get_state(ValueStateDescriptor(name, _PICKLED))
            handle = _Value
        elif descriptor.kind == "list":
            state = _ListSlot(packed) if packed else runtime.get_list_state(ListStateDescriptor(name, _PICKLED))
            handle = _List
        else:
            state = runtime.get_map_state(MapStateDescriptor(name, Types.STRING(), _PICKLED))
            handle = _Map
        written = None
        if ttl is not None and descriptor.kind != "map":  # a map's entries carry their own write times
            written = (_ValueSlot(packed) if packed
                       else runtime.get_state(ValueStateDescriptor(f"{name}.written", Types.LONG())))
        self._handles.append(handle(state, written, ttl, self))
        self._by_name[name] = self._handles[-1]
        return self._handles[-1]

    def state_data(self, name: str) -> _CurrentKeyList:
        """List state ``name`` of the current key as ``on_block`` reads it (see :meth:`call_block`)."""
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = _CurrentKeyList(self._by_name[name])
        return view

    def set_key(self, key: Any) -> None:
        """Say which key the next state accesses are for (the key Flink set for this call)."""
        self.key = key
        # Flink tells keys apart by their serialised form; so does the cache (1 and 1.0 are two keys there).
        self.cache_key = key if type(key) is str else pickle.dumps(key)

    def clear_all(self) -> None:
        """Drop every state of the current key."""
        for handle in self._handles:
            handle.clear()
        self._cleared = True

    def commit(self) -> None:
        """Write back what the call changed (see :class:`_Handle`); call it before leaving the key."""
        limit = self.state_cache_keys
        self._write_back()
        packed = self._packed
        if packed is not None and len(packed.cache) > limit:
            packed.cache.clear()
        backstop = self._backstop
        if backstop is not None:
            if self._cleared:
                backstop.cleared()
            elif self._ctx is not None:
                backstop.active(self._ctx)
            if len(backstop.cache) > limit:
                backstop.cache.clear()
        self._cleared = False

    def _write_back(self) -> None:
        limit = self.state_cache_keys
        touched = self.touched
        if touched:
            for handle in touched:
                handle.commit()
                if len(handle.cache) > limit:
                    handle.forget()
            touched.clear()
        if self._packed is not None:
            self._packed.commit()

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
        if self._backstop is not None:
            raise NotImplementedError("with state_ttl_days, processing-time timers are the state backstop's; "
                                      "run this function without state_ttl_days")
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

    def can_call_block(self) -> bool:
        """True if the function has ``on_block`` and no state has a TTL (its contract on the device)."""
        return hasattr(self.function, "on_block") and all(handle.ttl is None for handle in self._handles)

    def call_block(self, ctx: Any, items: list[Any], ts_ms: int, key: Any) -> list[tuple[str, Any]]:
        """Run the function's ``on_block`` for ``items`` of the current key ``key`` (each as ``on_event`` would,
        in order; see :meth:`can_call_block`), the latest at ``ts_ms``; what it output."""
        if ts_ms > self.clock:
            self.clock = ts_ms
        self._ctx, self.timestamp = ctx, ts_ms
        self.set_key(key)
        out = self._out = []
        self.function.on_block(items, self)  # type: ignore[attr-defined]  # can_call_block checked it has one
        return out

    def process_element(self, value: tuple[Any, Any], ctx: KeyedProcessFunction.Context) -> list[tuple[str, Any]]:
        try:
            return self.call(ctx, value[1], key=value[0])  # the key_by key: no crossing into the JVM for it
        finally:
            self.commit()

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext) -> list[tuple[str, Any]]:
        self._ctx, self.timestamp = ctx, timestamp
        self.set_key(ctx.get_current_key())
        if self.backstop_fired(ctx):
            return []
        out = self._out = []
        try:
            self.function.on_timer(timestamp, self)
        finally:
            self.commit()
        return out

    def backstop_fired(self, ctx: Any) -> bool:
        """True if this timer was the backstop's (then the current key's states are dropped if it was idle)."""
        if self._backstop is None or ctx.time_domain() != TimeDomain.PROCESSING_TIME:
            return False
        if self._backstop.fired(ctx):
            self.clear_all()
            self._write_back()
            self._backstop.cleared()
            self._cleared = False
        return True

    def close(self) -> None:
        self.function.close()
