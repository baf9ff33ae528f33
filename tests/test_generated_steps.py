"""The stream task's generated code against plain interpretations of the same operators.

A stream task's steps before its keyed step run as one generated function (``StreamInput.step``), a
Filter/Map chain as another (``elementwise``), a block of events through ``StreamTaskRun.process_block``
and a late event's JSON from its fields (``Event.to_sorted_json``). Each must give exactly what the
operators give when interpreted one by one: the same item, key, time, the same failure (text and key), the
same rows in the same order.
"""

from __future__ import annotations

import copy
import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.json_values import to_json
from operators import Aggregate, Count, CountDistinct, Filter, KeyBy, Map, Max, Min, Sum, TimeWindow
from operators.base import element_steps
from operators.window import to_millis
from streamflow.events import Event
from streamflow.job import Task
from streamflow.windowing import StreamInput, StreamPlan, StreamTaskRun, elementwise

texts = st.text(max_size=6)
values = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), texts,
                   st.floats(allow_nan=True, allow_infinity=True), st.lists(st.integers(), max_size=2))
contents = st.dictionaries(st.sampled_from(["item_id", "amount", "ts", "a", "é"]), values, max_size=4)
timestamps = st.one_of(st.floats(0, 100, allow_nan=False), st.integers(0, 100), st.just(float("nan")),
                       st.just(float("inf")), texts)
events = st.builds(Event, st.one_of(texts, st.integers(0, 3)), st.sampled_from(["pv", "buy", "fav"]),
                   st.sampled_from(["item", "home"]), timestamps, contents)
dicts = st.fixed_dictionaries({"user_id": st.sampled_from(["u1", "u2"]), "ts": timestamps},
                              optional={"item_id": values, "amount": values})


@settings(max_examples=300)
@given(events)
def test_an_events_sorted_json_is_its_dicts(event: Event) -> None:
    assert event.to_sorted_json() == to_json(event.to_dict(), sort_keys=True)
    json.loads(event.to_sorted_json())  # JSON text, whatever the fields hold (NaN as json writes it)


# Steps a user might write; each may raise on some items (a missing field, arithmetic on a string).
def _big(item):
    return item["amount"] > 1


def _tag(item):
    return {**(item.to_dict() if isinstance(item, Event) else item), "tag": str(item["ts"])[:3]}


def _seconds(item):
    return item["ts"] / 2


STEPS = [Filter(lambda item: item["user_id"] != "u2"), Filter(_big), Map(_tag), Map(lambda item: None),
         Map(lambda item: item)]
KEYS = ["user_id", "item_id", "ts", lambda item: item["user_id"], "contents"]
AGGREGATIONS = [Count(), Count(where=_big), Max("ts"), Min("amount"), Sum("amount"), CountDistinct("item_id"),
                Max(_seconds), CountDistinct("user_id", where=lambda item: item["ts"] != 3)]


def _chain(ops, item):
    """Filter/Map in turn: a Filter that drops the item ends the chain (a Map's ``None`` goes on, and drops it
    at the end)."""
    for op in ops:
        if isinstance(op, Map):
            item = op.fn(item)
        elif not op.predicate(item):
            return None
    return item


def _interpreted(plan: StreamPlan, before_key, before_window, item):
    """What StreamInput.step computes, operator by operator (``before_key`` and ``before_window``: the Filter and Map
    operators the plan lowered): (key, item, ts_ms) or None; raises as a step does."""
    item = _chain(before_key, item)
    if item is None:
        return None
    key = plan.key_by.key(item) if callable(plan.key_by.key) else item[plan.key_by.key]
    hash(key)
    item = _chain(before_window, item)
    if item is None:
        return None
    ts_ms = to_millis(item[plan.ts] if isinstance(plan.ts, str) else plan.ts(item))
    for agg in plan.aggregate.aggregations.values():
        if agg.where is None or agg.where(item):
            agg.add(agg.create(), item)
    return key, item, ts_ms


@settings(max_examples=300, deadline=None)
@given(before_key=st.lists(st.sampled_from(STEPS), max_size=3), key=st.sampled_from(KEYS),
       before_window=st.lists(st.sampled_from(STEPS), max_size=2),
       aggregations=st.lists(st.sampled_from(AGGREGATIONS), min_size=1, max_size=3),
       items=st.lists(st.one_of(events, dicts), max_size=8))
def test_the_generated_step_is_the_operators_one_by_one(before_key, key, before_window, aggregations, items) -> None:
    pipeline = [*before_key, KeyBy(key), *before_window, TimeWindow(10),
                Aggregate(**{f"a{i}": agg for i, agg in enumerate(aggregations)})]
    plan = StreamPlan.of("t", pipeline)
    steps = StreamInput("t", plan, quarantine_after=1_000)
    for item in items:
        try:
            expected = _interpreted(plan, before_key, before_window, copy.deepcopy(item))
        except Exception as exc:
            expected = f"{type(exc).__name__}: {exc}"
        got = steps.step(copy.deepcopy(item))
        if isinstance(expected, str):
            assert got is None and len(steps.out) == 1
            assert steps.out[0][1]["error"] == expected
            steps.out.clear()
        else:
            assert not steps.out
            assert got == expected or (got and expected and _same_nan(got, expected))


def _same_nan(a, b) -> bool:
    return all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)) or repr(x) == repr(y)
               for x, y in zip(a, b, strict=True))


@given(st.lists(st.sampled_from(STEPS), max_size=4), st.lists(dicts, max_size=6))
def test_an_elementwise_chain_is_its_operators_in_turn(ops, items) -> None:
    chain = elementwise(element_steps(ops))
    for item in items:
        try:
            expected = _chain(ops, item)
        except Exception as exc:
            expected = repr(exc)
        try:
            got = chain(item)
        except Exception as exc:
            got = repr(exc)
        assert got == expected or repr(got) == repr(expected)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["u1", "u2", "u3"]), st.integers(0, 60), st.sampled_from([0, 1, "x"])),
                max_size=40))
def test_a_block_gives_what_each_event_gives(stream) -> None:
    task = Task("t", None, input="stream", pipeline=[
        Filter(lambda e: e.event_id != "home"), KeyBy("user_id"), TimeWindow(10, slide=5, allowed_lateness=3),
        Aggregate(n=Count(), amount=Sum("amount"), last=Max("ts")), Map(lambda row: {**row, "r": 1 / row["amount"]})])
    items = [Event(user, "pv", "item", float(ts), {"amount": amount}) for user, ts, amount in stream]
    one_by_one, block = StreamTaskRun(task), StreamTaskRun(task)
    rows, sides = [], []
    for item in items:
        r, s = one_by_one.process(item)
        rows += r
        sides += s
    got_rows, got_sides, failed = block.process_block(items)
    assert not failed
    assert (got_rows, _errors(got_sides)) == (rows, _errors(sides))
    assert block.finish() == one_by_one.finish()


def _errors(sides):
    return [(table, {k: v for k, v in row.items() if k != "traceback"}) for table, row in sides]
