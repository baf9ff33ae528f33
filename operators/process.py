"""The keyed process function: the one stateful primitive every runner executes.

As Flink's ``KeyedProcessFunction``: a stream is keyed (``KeyBy``), and for each element the
function's :meth:`~KeyedProcessFunction.on_event` runs with a :class:`Context` scoped to the
element's key. It keeps explicit, typed state (:class:`ValueStateDescriptor`,
:class:`ListStateDescriptor`, :class:`MapStateDescriptor`, each with an optional TTL), registers
event-time and processing-time timers (:meth:`~KeyedProcessFunction.on_timer` runs when they fire,
with the key they were registered for), emits rows (``ctx.emit``) and writes side outputs
(``ctx.side("late_events", row)``).

State handles are declared once, in :meth:`~KeyedProcessFunction.open`, and always read and write
the state of the key being processed, as in Flink. Times are integer milliseconds.

**TTL** is measured on the stream's clock: the largest event time the function instance has seen
(``ctx.current_time()``), not the wall clock, so a replay expires state exactly as the live stream
did and both runners agree. A value or list written (or appended to) at clock ``c`` reads as absent
once the clock passes ``c + ttl``; a map state's entries expire one by one, each ``ttl`` after its
last ``put`` (as Flink's ``StateTtlConfig`` expires map entries). Runners also reclaim the memory.

The device runner implements the primitive with plain dicts and a timer heap
(:mod:`streamflow.keyed`); the Flink runner maps it one to one onto PyFlink's
``KeyedProcessFunction`` with one small ``ValueState``/``ListState``/``MapState`` per descriptor.
Trigger tasks, session and count windows are built on it, and users get it as :class:`Process`.

Example:
    >>> class CountPerUser(KeyedProcessFunction):
    ...     def open(self, ctx):
    ...         self.seen = ctx.get_state(ValueStateDescriptor("seen"))
    ...     def on_event(self, event, ctx):
    ...         n = (self.seen.value() or 0) + 1
    ...         self.seen.update(n)
    ...         ctx.emit({"user_id": ctx.key, "n": n})
    >>> from streamflow.keyed import KeyedRuntime
    >>> runtime = KeyedRuntime(CountPerUser())
    >>> [runtime.process(key, {"ts": ts}) for key, ts in [("a", 1.0), ("b", 2.0), ("a", 3.0)]][-1]
    [('emit', {'user_id': 'a', 'n': 2})]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, overload

from operators.base import FieldSpec, Group, Operator

if TYPE_CHECKING:
    # A state's value type defaults to Any: ``ValueStateDescriptor("seen")`` needs no annotation, and
    # ``ValueStateDescriptor[int]("seen")`` gives a ``ValueState[int]``. (TypeVar defaults are Python 3.13's;
    # the checker reads them from typing_extensions, the runtime needs none.)
    from typing_extensions import TypeVar

    T = TypeVar("T", default=Any)
    K = TypeVar("K", default=Any)
    V = TypeVar("V", default=Any)
else:
    from typing import TypeVar

    T, K, V = TypeVar("T"), TypeVar("K"), TypeVar("V")

#: Side output of items too late for any window.
LATE = "late_events"
#: Side output of items a function refuses, with the reason.
DEAD_LETTER = "dead_letter"


@dataclass(frozen=True)
class StateDescriptor:
    """Names a piece of keyed state; ``ttl_s`` (seconds of stream time) makes it expire."""

    name: str
    ttl_s: float | None = None
    kind: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a state name must be a non-empty string, got {self.name!r}")
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise ValueError(f"state {self.name!r}: ttl_s must be > 0 seconds, got {self.ttl_s!r}")

    @property
    def ttl_ms(self) -> int | None:
        return None if self.ttl_s is None else round(self.ttl_s * 1000)


@dataclass(frozen=True)
class ValueStateDescriptor(StateDescriptor, Generic[T]):
    """One value per key (``value()``, ``update(v)``, ``clear()``): ``ValueStateDescriptor[int]("seen")``
    declares a :class:`ValueState` of ints (the type is for the checker; state holds any picklable value)."""

    kind: ClassVar[str] = "value"


@dataclass(frozen=True)
class ListStateDescriptor(StateDescriptor, Generic[T]):
    """A list per key (``get()``, ``add(v)``, ``add_all(vs)``, ``update(vs)``, ``clear()``):
    ``ListStateDescriptor[str]("pages")`` declares a :class:`ListState` of strings."""

    kind: ClassVar[str] = "list"


@dataclass(frozen=True)
class MapStateDescriptor(StateDescriptor, Generic[K, V]):
    """A map per key (``get(k)``, ``put(k, v)``, ``remove(k)``, ``contains(k)``, ``items()``, ``is_empty()``,
    ``clear()``); entry keys compare as a dict's do. With ``ttl_s`` each entry expires on its own.
    ``MapStateDescriptor[str, int]("counts")`` declares a :class:`MapState` from strings to ints."""

    kind: ClassVar[str] = "map"


# The handles ``ctx.get_state`` gives, generic in what they hold as PyFlink's ``ValueState[T]``,
# ``ListState[T]`` and ``MapState[K, V]`` are.

class ValueState(Protocol[T]):
    """The value of the current key: ``None`` when it has none (never written, cleared or expired)."""

    def value(self) -> T | None: ...
    def update(self, value: T) -> None: ...
    def clear(self) -> None: ...


class ListState(Protocol[T]):
    """The list of the current key (empty when it has none)."""

    def get(self) -> list[T]: ...
    def add(self, value: T) -> None: ...
    def add_all(self, values: Iterable[T]) -> None: ...
    def update(self, values: Iterable[T]) -> None: ...
    def clear(self) -> None: ...


class MapState(Protocol[K, V]):
    """The map of the current key."""

    def get(self, key: K, default: V | None = None) -> V | None: ...
    def put(self, key: K, value: V) -> None: ...
    def remove(self, key: K) -> None: ...
    def contains(self, key: K) -> bool: ...
    def items(self) -> Iterator[tuple[K, V]]: ...
    def is_empty(self) -> bool: ...
    def clear(self) -> None: ...


class RuntimeContext(Protocol):
    """What :meth:`KeyedProcessFunction.open` receives: where state handles come from, each typed by its
    descriptor."""

    @overload
    def get_state(self, descriptor: ValueStateDescriptor[T]) -> ValueState[T]: ...
    @overload
    def get_state(self, descriptor: ListStateDescriptor[T]) -> ListState[T]: ...
    @overload
    def get_state(self, descriptor: MapStateDescriptor[K, V]) -> MapState[K, V]: ...
    @overload
    def get_state(self, descriptor: StateDescriptor) -> Any: ...


class Context(Protocol):
    """What ``on_event`` and ``on_timer`` receive: the key, time, timers and outputs."""

    key: Any
    #: Event time (ms) of the element being processed, or the firing time in ``on_timer``.
    timestamp: int | None

    def current_watermark(self) -> int: ...
    def current_time(self) -> int: ...
    def current_processing_time(self) -> int: ...
    def register_event_time_timer(self, time_ms: int) -> None: ...
    def register_processing_time_timer(self, time_ms: int) -> None: ...
    def delete_event_time_timer(self, time_ms: int) -> None: ...
    def delete_processing_time_timer(self, time_ms: int) -> None: ...
    def emit(self, row: dict[str, Any]) -> None: ...
    def side(self, tag: str, row: dict[str, Any]) -> None: ...


class KeyedProcessFunction:
    """Subclass and override :meth:`open`, :meth:`on_event` and, with timers, :meth:`on_timer`.

    An instance is copied for every task (and serialised to Flink workers): keep state in state
    handles, not in attributes, or it is neither per key nor checkpointed.

    Example: see the module docstring.
    """

    #: The field with an element's event time (seconds): watermarks and ``ctx.timestamp`` come from it;
    #: ``None`` for a function that needs no event time.
    ts: FieldSpec | None = "ts"

    def open(self, ctx: RuntimeContext) -> None:
        """Declare state handles with ``ctx.get_state(descriptor)``."""

    def on_event(self, event: Any, ctx: Context) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement on_event(event, ctx)")

    def on_timer(self, time_ms: int, ctx: Context) -> None:
        """A timer registered for ``ctx.key`` fired at ``time_ms``."""

    def close(self) -> None:
        """End of the run (after the final watermark's timers fired)."""


class _FunctionProcess(KeyedProcessFunction):
    """:class:`Process` over a plain function ``fn(event, ctx)``."""

    def __init__(self, fn: Callable[[Any, Context], None]):
        self.fn = fn

    def on_event(self, event: Any, ctx: Context) -> None:
        self.fn(event, ctx)


class Process(Operator):
    """A keyed process function as a step of a stream task (``input="stream"``), after ``KeyBy``.

    ``function`` is a :class:`KeyedProcessFunction` (state, timers) or a plain ``fn(event, ctx)``
    that only emits. ``out_of_orderness`` (seconds) bounds the watermark, as for ``TimeWindow``:
    watermark = largest event time seen - ``out_of_orderness`` - 1 ms. Rows it emits go through
    the operators after it (Filter, Map) to the task's table; ``ctx.side(tag, row)`` writes table
    ``tag``.

    Example:
        >>> from operators import KeyBy
        >>> def big(event, ctx):
        ...     if event["amount"] > 10:
        ...         ctx.emit({"user_id": ctx.key, "amount": event["amount"]})
        >>> step = Process(big)
        >>> from streamflow.job import Task
        >>> Task("big", None, [KeyBy("user_id"), step], input="stream").input
        'stream'
    """

    def __init__(self, function: KeyedProcessFunction | Callable[[Any, Context], None], out_of_orderness: float = 0.0):
        if isinstance(function, KeyedProcessFunction):
            self.function = function
        elif callable(function):
            self.function = _FunctionProcess(function)
        else:
            raise TypeError(f"Process takes a KeyedProcessFunction or a function (event, ctx), got {function!r}")
        if out_of_orderness < 0:
            raise ValueError("out_of_orderness must be >= 0 seconds")
        self.out_of_orderness = float(out_of_orderness)

    def apply(self, groups: list[Group]) -> list[Group]:
        raise TypeError("Process is a streaming step: it keeps state across events and fires timers, so it runs "
                        "in a stream task (Task(..., input='stream')), not over a trigger task's finite list")
