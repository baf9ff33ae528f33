"""Keyed state behaves the same on both runners: generated sequences of state operations (value, list and
map states, with and without TTL) run in a user's ``Process`` function on the device runner and on Flink
(a real MiniCluster), each checked against a plain model of the semantics written here (not the runners'
code): what every read returns, after every write, TTL measured on the stream clock, a map's entries
expiring one by one (as Flink's ``StateTtlConfig`` expires them)."""

from __future__ import annotations

import json
import random
import shutil
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from operators import (
    KeyBy,
    KeyedProcessFunction,
    ListStateDescriptor,
    MapStateDescriptor,
    Process,
    ValueStateDescriptor,
)
from streamflow.events import Event
from streamflow.job import Job, Task
from streamflow.testing import run_job
from streamflow.windowing import StreamTaskRun

TTL_S = 5
STATES = {
    "v": ValueStateDescriptor("v"), "vt": ValueStateDescriptor("vt", ttl_s=TTL_S),
    "l": ListStateDescriptor("l"), "lt": ListStateDescriptor("lt", ttl_s=TTL_S),
    "m": MapStateDescriptor("m"), "mt": MapStateDescriptor("mt", ttl_s=TTL_S),
}
START_MS = 1_600_000_000_000


def _canonical(result: Any) -> str:
    if isinstance(result, list) and result and isinstance(result[0], list):  # map items: in no order
        result = sorted(result, key=repr)
    return json.dumps(result)


class StateScript(KeyedProcessFunction):
    """Runs the operations an event carries (``contents["ops"]``: ``[state, op, *args]``) on the current
    key's states and emits what each returned."""

    def open(self, ctx):
        self.states = {name: ctx.get_state(descriptor) for name, descriptor in STATES.items()}

    def on_event(self, event, ctx):
        for i, (name, op, *args) in enumerate(event["ops"]):
            result = getattr(self.states[name], op)(*args)
            if op == "items":
                result = [list(item) for item in result]
            ctx.emit({"user_id": ctx.key, "step": event["step"], "i": i, "op": f"{name}.{op}",
                      "result": _canonical(result)})


def model(events: list[Event]) -> list[dict[str, Any]]:
    """What a script's reads return, from the semantics alone: the clock is the largest event time seen; a
    value or list written (or appended to) at ``c`` is absent once the clock passes ``c + ttl``; so is a
    map entry put at ``c``."""
    ttl = TTL_S * 1000
    held: dict[tuple[str, str], Any] = {}  # (user, state) -> (value, written) | {entry: (value, written)}
    clock, rows = -1, []
    for event in events:
        clock = max(clock, round(event.ts * 1000))
        for i, (name, op, *args) in enumerate(event["ops"]):
            slot = (event.user_id, name)
            timed = name.endswith("t")
            if name.startswith("m"):
                entries = held.setdefault(slot, {})
                for entry in [k for k, (_, at) in entries.items() if timed and at + ttl < clock]:
                    del entries[entry]
                result = _map_operation(entries, op, args, clock)
            else:
                value, at = held.get(slot, (None, None))
                if timed and at is not None and at + ttl < clock:
                    value = None
                is_list = name.startswith("l")
                result = None
                if op in ("value", "get"):
                    result = value if not is_list else list(value or [])
                elif op == "clear" or (op == "update" and (args[0] is None or is_list and not args[0])):
                    value = None
                elif op == "update":
                    value, at = (list(args[0]) if is_list else args[0]), clock
                elif op in ("add", "add_all") and (op == "add" or args[0]):
                    value, at = [*(value or []), *(args[0] if op == "add_all" else args)], clock
                held[slot] = (value, at)
            rows.append({"user_id": event.user_id, "step": event["step"], "i": i, "op": f"{name}.{op}",
                         "result": _canonical(result)})
    return sorted(rows, key=lambda row: (row["user_id"], row["step"], row["i"]))


def _map_operation(entries: dict[Any, tuple[Any, int]], op: str, args: list[Any], clock: int) -> Any:
    """A map state's operation on ``entries`` (entry -> (value, written)) in the model."""
    if op == "get":
        return entries[args[0]][0] if args[0] in entries else None
    if op == "put":
        entries[args[0]] = (args[1], clock)
    elif op == "remove":
        entries.pop(args[0], None)
    elif op == "clear":
        entries.clear()
    elif op == "contains":
        return args[0] in entries
    elif op == "items":
        return [[k, v] for k, (v, _) in entries.items()]
    elif op == "is_empty":
        return not entries
    return None


_values = st.integers(0, 3)
_entry_keys = st.sampled_from([0, 1, "0", "a", "b"])
_operation = st.one_of(
    st.tuples(st.sampled_from(["v", "vt"]), st.just("value")),
    st.tuples(st.sampled_from(["v", "vt"]), st.just("update"), _values),
    st.tuples(st.sampled_from(["v", "vt", "l", "lt", "m", "mt"]), st.just("clear")),
    st.tuples(st.sampled_from(["l", "lt"]), st.just("get")),
    st.tuples(st.sampled_from(["l", "lt"]), st.just("add"), _values),
    st.tuples(st.sampled_from(["l", "lt"]), st.sampled_from(["add_all", "update"]), st.lists(_values, max_size=3)),
    st.tuples(st.sampled_from(["m", "mt"]), st.sampled_from(["get", "contains", "remove"]), _entry_keys),
    st.tuples(st.sampled_from(["m", "mt"]), st.just("put"), _entry_keys, _values),
    st.tuples(st.sampled_from(["m", "mt"]), st.sampled_from(["items", "is_empty"])),
).map(list)
_step = st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 3000), st.lists(_operation, min_size=1, max_size=5))


def script_events(steps: list[tuple[str, int, list[list[Any]]]]) -> list[Event]:
    """The events of generated steps ``(user, ms since the previous event, operations)``, in time order."""
    events, now = [], START_MS
    for n, (user, gap_ms, ops) in enumerate(steps):
        now += gap_ms
        events.append(Event(user, "script", "app", now / 1000, {"ops": ops, "step": n}))
    return events


JOB = Job("state_script", [Task("state", None, [KeyBy("user_id"), Process(StateScript())], input="stream")])


def device_rows(events: list[Event]) -> list[dict[str, Any]]:
    """The device's stream-task code (no storage: many examples) over ``events``, rows in the model's order."""
    run = StreamTaskRun(JOB.tasks[0])
    rows = [row for event in events for row in run.process(event)[0]] + run.finish()[0]
    return sorted(rows, key=lambda row: (row["user_id"], row["step"], row["i"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_step, min_size=1, max_size=40))
def test_every_state_kind_on_the_device_follows_the_model(steps):
    events = script_events(steps)
    assert device_rows(events) == model(events)


def test_the_device_runner_stores_what_the_model_says():
    """The same, once, through the whole device runner and its storage."""
    events = script_events([("a", 0, [["m", "put", 1, 2], ["m", "get", 1]]), ("b", 10, [["lt", "add", 3]]),
                            ("a", 6000, [["mt", "put", "x", 1], ["m", "items"], ["lt", "get"]])])
    assert run_job(JOB, events)["state"] == model(events)


def test_a_map_entry_expires_on_its_own_not_with_the_whole_map():
    """Flink's StateTtlConfig expires each map entry; the device did the whole map of a key at once."""
    ops = [[["mt", "put", "old", 1]], [["mt", "put", "new", 2]], [["mt", "items"], ["mt", "get", "new"]]]
    events = script_events([("u", 0, ops[0]), ("u", 4000, ops[1]), ("u", 2000, ops[2])])
    rows = run_job(JOB, events)["state"]
    assert [row["result"] for row in rows if row["step"] == 2] == ['[["new", 2]]', "2"]
    assert rows == model(events)


class FirstView(KeyedProcessFunction):
    """Remembers the items a user viewed; emits the first view of each (the job that found Flink's map
    state never finding a stored key: 0 rows, no error)."""

    def open(self, ctx):
        self.seen = ctx.get_state(MapStateDescriptor("seen"))

    def on_event(self, event, ctx):
        item = event["item_id"]
        if not self.seen.contains(item):
            self.seen.put(item, event.ts)
            ctx.emit({"user_id": ctx.key, "item_id": item, "first_ts": event.ts})
        assert self.seen.get(item) is not None


FIRST_VIEWS = Job("first_views", [Task("first_views", None, [KeyBy("user_id"), Process(FirstView())],
                                       input="stream")])

flink = pytest.mark.skipif(shutil.which("java") is None, reason="the Flink runner needs a Java runtime")


def _needs_pyflink() -> None:
    pytest.importorskip("pyflink", reason="needs the flink extra: pip install 'streamflow[flink]'",
                        exc_type=ImportError)
    import cloudpickle  # the functions above go to Flink's workers by value, as a job file's do

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


@flink
def test_a_map_state_finds_the_keys_it_stored_on_flink():
    _needs_pyflink()
    events = [Event(user, "view", "item", 1_600_000_000 + t, {"item_id": item})
              for t, (user, item) in enumerate([("u", "x"), ("u", "y"), ("u", "x"), ("v", "x"), ("u", "y"),
                                                 ("v", "x"), ("u", "z")])]
    rows = run_job(FIRST_VIEWS, events, runner="flink")
    assert [(row["user_id"], row["item_id"]) for row in rows["first_views"]] == [
        ("u", "x"), ("u", "y"), ("u", "z"), ("v", "x")]
    assert "task_errors" not in rows


@flink
@pytest.mark.parametrize("seed", [1, 2])
def test_every_state_kind_on_flink_follows_the_model(seed: int):
    """One Flink job per seed, each over many generated steps (a job's start-up costs seconds, so not one
    per Hypothesis example)."""
    _needs_pyflink()
    rng = random.Random(seed)
    steps = [_random_step(rng) for _ in range(400)]
    events = script_events(steps)
    rows = run_job(JOB, events, runner="flink").get("state", [])
    assert rows == model(events)


def _random_step(rng: random.Random) -> tuple[str, int, list[list[Any]]]:
    """A step as ``_step`` draws them, from ``rng`` (many steps per Flink run)."""
    def value() -> int:
        return rng.randint(0, 3)

    def entry() -> Any:
        return rng.choice([0, 1, "0", "a", "b"])

    def operation() -> list[Any]:
        name = rng.choice(list(STATES))
        if name.startswith("v"):
            return rng.choice([[name, "value"], [name, "update", value()], [name, "clear"]])
        if name.startswith("l"):
            return rng.choice([[name, "get"], [name, "add", value()], [name, "clear"],
                               [name, rng.choice(["add_all", "update"]), [value() for _ in range(rng.randint(0, 3))]]])
        return rng.choice([[name, rng.choice(["get", "contains", "remove"]), entry()], [name, "put", entry(), value()],
                           [name, rng.choice(["items", "is_empty", "clear"])]])

    return rng.choice("abcdefgh"), rng.randint(0, 2500), [operation() for _ in range(rng.randint(1, 5))]
