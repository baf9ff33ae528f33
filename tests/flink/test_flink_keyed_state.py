"""FlinkKeyed's state layer without a JVM: PyFlink's state objects replaced by an in-memory backend that,
like Flink's, stores pickled bytes per (state, serialised key) and counts every call (each is a crossing
into the JVM on a real TaskManager). The device runtime (KeyedRuntime) is the reference for what a
function outputs and keeps; the Flink runs themselves are in test_flink_parity.py."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("pyflink", reason="needs the flink extra: pip install 'streamflow[flink]'", exc_type=ImportError)

from pyflink.datastream import TimeDomain  # noqa: E402

from operators import KeyedProcessFunction, ListStateDescriptor, ValueStateDescriptor  # noqa: E402
from streamflow.flink import keyed as flink_keyed  # noqa: E402
from streamflow.flink.keyed import FlinkKeyed  # noqa: E402
from streamflow.keyed import KeyedRuntime  # noqa: E402


class Backend:
    """Keyed state as Flink keeps it: bytes by (state name, serialised current key)."""

    def __init__(self) -> None:
        self.data: dict[tuple[str, bytes], bytes] = {}
        self.key: object = None
        self.calls = 0
        self.reads = 0
        self.timers: list[tuple[object, int]] = []

    def slot(self, name: str) -> tuple[str, bytes]:
        return name, pickle.dumps(self.key)

    def names(self, key: object) -> set[str]:
        return {name for name, k in self.data if k == pickle.dumps(key)}


class Value:
    def __init__(self, backend: Backend, name: str):
        self.backend, self.name = backend, name

    def value(self):
        self.backend.calls += 1
        self.backend.reads += 1
        raw = self.backend.data.get(self.backend.slot(self.name))
        return None if raw is None else pickle.loads(raw)

    def update(self, value) -> None:
        self.backend.calls += 1
        self.backend.data[self.backend.slot(self.name)] = pickle.dumps(value)

    def clear(self) -> None:
        self.backend.calls += 1
        self.backend.data.pop(self.backend.slot(self.name), None)


class ListState(Value):
    def get(self):
        self.backend.calls += 1
        self.backend.reads += 1
        raw = self.backend.data.get(self.backend.slot(self.name))
        return None if raw is None else iter(pickle.loads(raw))  # PyFlink returns an iterator

    def _held(self) -> list:
        raw = self.backend.data.get(self.backend.slot(self.name))
        return [] if raw is None else pickle.loads(raw)

    def add(self, value) -> None:
        self.backend.calls += 1
        self.backend.data[self.backend.slot(self.name)] = pickle.dumps([*self._held(), value])

    def add_all(self, values) -> None:
        self.backend.calls += 1
        self.backend.data[self.backend.slot(self.name)] = pickle.dumps([*self._held(), *values])

    def update(self, values) -> None:
        self.backend.calls += 1
        self.backend.data[self.backend.slot(self.name)] = pickle.dumps(list(values))


class Runtime:
    def __init__(self, backend: Backend):
        self.backend = backend

    def get_state(self, descriptor):
        return Value(self.backend, descriptor.name)

    def get_list_state(self, descriptor):
        return ListState(self.backend, descriptor.name)


class Timers:
    def __init__(self, backend: Backend):
        self.backend = backend

    def register_processing_time_timer(self, time_ms: int) -> None:
        self.backend.timers.append((self.backend.key, time_ms))

    def register_event_time_timer(self, time_ms: int) -> None:
        raise AssertionError("not used here")


class Ctx:
    def __init__(self, backend: Backend, domain: TimeDomain = TimeDomain.EVENT_TIME):
        self.backend, self.domain = backend, domain

    def timer_service(self) -> Timers:
        return Timers(self.backend)

    def get_current_key(self):
        return self.backend.key

    def time_domain(self) -> TimeDomain:
        return self.domain


class Pages(KeyedProcessFunction):
    """Touches state the way trigger tasks do: a value read and rewritten, a list appended to (by ``add``
    and in place), replaced, cleared, and read back."""

    ts = None

    def open(self, ctx):
        self.n = ctx.get_state(ValueStateDescriptor("n"))
        self.page = ctx.get_state(ListStateDescriptor("page"))

    def on_event(self, item, ctx):
        n = (self.n.value() or 0) + 1
        self.n.update(n)
        kind = item["kind"]
        if kind == "enter":
            self.page.update([item["v"]])
        elif kind == "click":
            self.page.add(item["v"])
        elif kind == "append":
            self.page.get().append(item["v"])  # in place, as TriggerTasks.on_block does
        elif kind == "exit":
            ctx.emit({"key": ctx.key, "n": n, "page": list(self.page.get())})
            self.page.clear()


def _run_flink(function: KeyedProcessFunction, records: list[tuple[object, dict]], **kwargs) -> tuple[list, Backend]:
    backend = Backend()
    keyed = FlinkKeyed(function, **kwargs)
    keyed.open(Runtime(backend))
    out = []
    for key, item in records:
        backend.key = key
        out += list(keyed.process_element((key, item), Ctx(backend)))
    return out, backend


RECORDS = [("a", {"kind": "enter", "v": 1}), ("b", {"kind": "enter", "v": 10}), ("a", {"kind": "click", "v": 2}),
           ("a", {"kind": "append", "v": 3}), ("b", {"kind": "exit"}), ("a", {"kind": "exit"}),
           ("b", {"kind": "click", "v": 11}), ("a", {"kind": "enter", "v": 4}), ("a", {"kind": "enter", "v": 5}),
           ("b", {"kind": "append", "v": 12}), ("b", {"kind": "exit"}), ("a", {"kind": "exit"})]


@pytest.mark.parametrize("packed", [False, True], ids=["a_state_each", "packed"])
def test_cached_states_give_what_the_device_gives_and_flink_holds_every_change(packed):
    runtime = KeyedRuntime(Pages())
    expected = [o for key, item in RECORDS for o in runtime.process(key, item)]
    out, backend = _run_flink(Pages(), RECORDS, packed=packed)
    assert out == expected
    assert [row["page"] for _, row in out] == [[10], [1, 2, 3], [11, 12], [5]]
    # Flink's copy is current after every call (a checkpoint could be taken there): a fresh instance
    # reading only from the backend carries on exactly as the device runtime does.
    fresh = FlinkKeyed(Pages(), packed=packed)
    fresh.open(Runtime(backend))
    more = [("a", {"kind": "click", "v": 6}), ("a", {"kind": "exit"})]
    got = []
    for key, item in more:
        backend.key = key
        got += list(fresh.process_element((key, item), Ctx(backend)))
    assert got == [o for key, item in more for o in runtime.process(key, item)]


def test_a_key_seen_again_reads_nothing_from_flink():
    _, cached = _run_flink(Pages(), RECORDS)
    _, uncached = _run_flink(Pages(), RECORDS, state_cache_keys=0)  # the cache starts over after every call
    assert cached.reads == 2  # "n" of each key; each page is written before it is first read
    assert uncached.reads > 4 * cached.reads
    assert cached.data == uncached.data


def test_packed_states_cross_into_flink_once_per_call():
    _, apart = _run_flink(Pages(), RECORDS)
    _, packed = _run_flink(Pages(), RECORDS, packed=True)
    assert packed.names("a") == {"packed"}
    assert packed.calls == len(RECORDS) + 2  # one write per record, one read per key
    assert apart.calls > 2 * len(RECORDS)


def test_keys_flink_tells_apart_stay_apart_in_the_cache():
    out, _ = _run_flink(Pages(), [(1, {"kind": "enter", "v": "int"}), (1.0, {"kind": "enter", "v": "float"}),
                                  (1, {"kind": "exit"}), (1.0, {"kind": "exit"})])
    assert [(row["key"], row["page"]) for _, row in out] == [(1, ["int"]), (1.0, ["float"])]


def test_the_backstop_drops_the_state_of_an_idle_key_and_moves_the_timer_of_an_active_one(monkeypatch):
    day_ms = 86_400_000
    now = {"ms": 1_000 * day_ms}
    monkeypatch.setattr(flink_keyed.time, "time", lambda: now["ms"] / 1000)
    backend = Backend()
    keyed = FlinkKeyed(Pages(), state_ttl_days=1)
    keyed.open(Runtime(backend))

    def record(key, item):
        backend.key = key
        return list(keyed.process_element((key, item), Ctx(backend)))

    def fire(key, at_ms):
        now["ms"], backend.key = at_ms, key
        return keyed.on_timer(at_ms, Ctx(backend, TimeDomain.PROCESSING_TIME))

    start = now["ms"]
    record("a", {"kind": "enter", "v": 1})
    record("b", {"kind": "enter", "v": 2})
    assert backend.timers == [("a", start + day_ms), ("b", start + day_ms)]
    now["ms"] = start + day_ms // 2
    record("a", {"kind": "click", "v": 3})  # "a" active half a day later
    assert fire("b", start + day_ms) == []
    assert backend.names("b") == set()  # idle a day: every state dropped
    assert fire("a", start + day_ms) == []
    assert backend.names("a") == {"n", "page", "backstop"}  # kept, its timer moved to a day after its activity
    assert backend.timers[-1] == ("a", start + day_ms // 2 + day_ms)
    assert fire("a", start + day_ms // 2 + day_ms) == []
    assert backend.names("a") == set()
    record("a", {"kind": "enter", "v": 4})  # a new life: a new timer
    assert backend.timers[-1] == ("a", now["ms"] + day_ms)


def test_with_the_backstop_a_function_may_not_register_processing_time_timers():
    class Remind(KeyedProcessFunction):
        ts = None

        def on_event(self, item, ctx):
            ctx.register_processing_time_timer(5)

    with pytest.raises(NotImplementedError, match="state_ttl_days"):
        _run_flink(Remind(), [("a", {})], state_ttl_days=30)
