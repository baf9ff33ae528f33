"""Operators: Filter, Map, KeyBy, TimeWindow (+ window_starts), Aggregate and every aggregation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators import (
    Aggregate,
    Count,
    CountBy,
    CountDistinct,
    Distinct,
    ElementStep,
    Filter,
    First,
    KeyBy,
    Last,
    LastN,
    Map,
    Max,
    Min,
    Sum,
    TimeWindow,
    get_field,
    run_pipeline,
    window_starts,
)
from streamflow.events import Event
from streamflow.job import Task

# --------------------------------------------------------------------------------------------------
# Filter / Map


def test_filter_keeps_only_accepted_items_in_order():
    items = [{"n": i} for i in range(10)]
    assert run_pipeline([Filter(lambda r: r["n"] % 3 == 0)], items) == [{"n": 0}, {"n": 3}, {"n": 6}, {"n": 9}]


def test_filter_applies_within_every_group():
    items = [{"k": "a", "v": 1}, {"k": "b", "v": 5}, {"k": "a", "v": 7}, {"k": "b", "v": 2}]
    rows = run_pipeline([KeyBy("k"), Filter(lambda r: r["v"] > 1)], items)  # keys keep first-seen order
    assert rows == [{"k": "a", "v": 7}, {"k": "b", "v": 5}, {"k": "b", "v": 2}]


def test_filter_that_rejects_everything_yields_no_rows():
    assert run_pipeline([Filter(lambda r: False)], [{"a": 1}, {"a": 2}]) == []


def test_map_transforms_every_item():
    rows = run_pipeline([Map(lambda r: {"total": r["a"] + r["b"]})], [{"a": 1, "b": 2}, {"a": 10, "b": 20}])
    assert rows == [{"total": 3}, {"total": 30}]


def test_map_turns_events_into_rows():
    events = [Event("u", "fav", "item", 1.6e9, {"item_id": "x"}),
              Event("u", "buy", "item", 1.6e9 + 1, {"item_id": "y"})]
    rows = run_pipeline([Map(lambda e: {"kind": e.event_id, "item": e.field("item_id")})], events)
    assert rows == [{"kind": "fav", "item": "x"}, {"kind": "buy", "item": "y"}]


@pytest.mark.parametrize("op", [Filter, Map])
def test_filter_and_map_refuse_non_callables(op):
    with pytest.raises(TypeError, match="function of the item"):
        op(42)


# --------------------------------------------------------------------------------------------------
# KeyBy


def test_keyby_splits_in_first_seen_order_and_adds_key_column():
    items = [{"page": "home"}, {"page": "item"}, {"page": "home"}, {"page": "cart"}]
    rows = run_pipeline([KeyBy("page"), Aggregate(views=Count())], items)
    assert rows == [{"page": "home", "views": 2}, {"page": "item", "views": 1}, {"page": "cart", "views": 1}]


def test_keyby_function_key_default_and_explicit_name():
    items = [{"v": 1}, {"v": 2}, {"v": 3}, {"v": 4}, {"v": 5}]
    rows = run_pipeline([KeyBy(lambda r: r["v"] % 2), Aggregate(n=Count())], items)
    assert rows == [{"key": 1, "n": 3}, {"key": 0, "n": 2}]
    rows = run_pipeline([KeyBy(lambda r: r["v"] % 2, name="parity"), Aggregate(s=Sum("v"))], items)
    assert rows == [{"parity": 1, "s": 9}, {"parity": 0, "s": 6}]


def test_keyby_on_event_attribute_and_contents_key():
    events = [
        Event("u1", "fav", "item", 1.6e9, {"cat": "c1"}),
        Event("u2", "fav", "item", 1.6e9, {"cat": "c2"}),
        Event("u1", "buy", "item", 1.6e9 + 1, {"cat": "c2"}),
    ]
    assert run_pipeline([KeyBy("user_id"), Aggregate(n=Count())], events) == [
        {"user_id": "u1", "n": 2}, {"user_id": "u2", "n": 1}]
    assert run_pipeline([KeyBy("cat"), Aggregate(n=Count())], events) == [{"cat": "c1", "n": 1}, {"cat": "c2", "n": 2}]


def test_nested_keyby_composes_keys():
    items = [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 1, "b": "x"}]
    rows = run_pipeline([KeyBy("a"), KeyBy("b"), Aggregate(n=Count())], items)
    assert rows == [{"a": 1, "b": "x", "n": 2}, {"a": 1, "b": "y", "n": 1}, {"a": 2, "b": "x", "n": 1}]


def test_keyby_refuses_bad_field_spec():
    with pytest.raises(TypeError):
        KeyBy("")
    with pytest.raises(TypeError):
        KeyBy(3)


def test_keyby_on_missing_field_raises_keyerror_naming_it():
    with pytest.raises(KeyError, match="nope"):
        run_pipeline([KeyBy("nope"), Aggregate(n=Count())], [{"a": 1}])
    with pytest.raises(KeyError, match="nope"):
        run_pipeline([KeyBy("nope"), Aggregate(n=Count())], [Event("u", "fav", "item", 1.6e9)])


# --------------------------------------------------------------------------------------------------
# window_starts / TimeWindow


def test_window_starts_docstring_example_and_tumbling():
    assert window_starts(125.0, size=60, slide=30) == [90.0, 120.0]
    assert window_starts(125.0, size=60, slide=60) == [120.0]
    assert window_starts(120.0, size=60, slide=60) == [120.0]  # start is inclusive
    assert window_starts(119.999, size=60, slide=60) == [60.0]  # end is exclusive


def test_window_starts_offset_and_negative_time():
    assert window_starts(125.0, size=60, slide=60, offset=10) == [70.0]
    assert window_starts(130.0, size=60, slide=60, offset=10) == [130.0]
    assert window_starts(-5.0, size=10, slide=10) == [-10.0]
    assert window_starts(-10.0, size=10, slide=10) == [-10.0]
    assert window_starts(-5.0, size=10, slide=5) == [-10.0, -5.0]


@settings(max_examples=300, deadline=None)
@given(ts=st.one_of(st.integers(-10**6, 2 * 10**9), st.integers(0, 2 * 10**9).map(lambda x: x + 0.5)),
       slide=st.integers(1, 3600), k=st.integers(1, 6), offset=st.integers(-1000, 1000))
def test_window_starts_matches_brute_force(ts, slide, k, offset):
    """[start, start+size) contains ts, starts aligned to offset, ceil(size/slide) windows, none missing."""
    size = slide * k
    starts = window_starts(ts, size, slide, offset)
    assert len(starts) == math.ceil(size / slide) == k
    assert starts == sorted(starts)
    for s in starts:
        assert s <= ts < s + size
        assert (s - offset) % slide == 0
    # brute force: every aligned start whose window holds ts
    first = math.floor((ts - size - offset) / slide) - 1
    last = math.floor((ts - offset) / slide) + 1
    candidates = (offset + n * slide for n in range(first, last + 1))
    expected = [s for s in candidates if s <= ts < s + size]
    assert starts == [float(s) for s in expected]


@settings(max_examples=200, deadline=None)
@given(ts=st.integers(0, 10**6), slide=st.integers(1, 50), size=st.integers(1, 200))
def test_window_starts_brute_force_when_slide_does_not_divide_size(ts, slide, size):
    if slide > size:
        size = slide
    starts = window_starts(ts, size, slide)
    expected = [s for s in range(ts - size, ts + 1) if s % slide == 0 and s <= ts < s + size]
    assert starts == [float(s) for s in expected]


def test_tumbling_window_docstring_example():
    rows = run_pipeline([TimeWindow(60), Aggregate(n=Count())], [{"ts": 10}, {"ts": 50}, {"ts": 70}])
    assert [(r["window_start"], r["window_end"], r["n"]) for r in rows] == [(0.0, 60.0, 2), (60.0, 120.0, 1)]


def test_tumbling_window_boundaries_are_start_inclusive_end_exclusive():
    items = [{"ts": 0}, {"ts": 59.999}, {"ts": 60}, {"ts": 119}, {"ts": 120}]
    rows = run_pipeline([TimeWindow(60), Aggregate(ts=LastN("ts", 10))], items)
    assert [(r["window_start"], r["ts"]) for r in rows] == [(0.0, [0, 59.999]), (60.0, [60, 119]), (120.0, [120])]


def test_tumbling_window_aligned_to_epoch_not_to_first_item():
    rows = run_pipeline([TimeWindow(3600), Aggregate(n=Count())], [{"ts": 1511848894}, {"ts": 1511849999}])
    assert [(r["window_start"], r["window_end"], r["n"]) for r in rows] == [
        (1511848800.0, 1511852400.0, 2)]


def test_sliding_window_item_in_ceil_size_over_slide_windows():
    rows = run_pipeline([TimeWindow(60, slide=20), Aggregate(n=Count())], [{"ts": 65}])
    assert [(r["window_start"], r["window_end"]) for r in rows] == [(20.0, 80.0), (40.0, 100.0), (60.0, 120.0)]
    assert all(r["n"] == 1 for r in rows)


def test_sliding_window_counts():
    items = [{"ts": t} for t in (5, 25, 45, 65)]
    rows = run_pipeline([TimeWindow(40, slide=20), Aggregate(n=Count(), first=First("ts"), last=Last("ts"))], items)
    got = [(r["window_start"], r["n"], r["first"], r["last"]) for r in rows]
    assert got == [(-20.0, 1, 5, 5), (0.0, 2, 5, 25), (20.0, 2, 25, 45), (40.0, 2, 45, 65), (60.0, 1, 65, 65)]


def test_windows_without_items_are_not_produced():
    rows = run_pipeline([TimeWindow(10), Aggregate(n=Count())], [{"ts": 1}, {"ts": 95}])
    assert [r["window_start"] for r in rows] == [0.0, 90.0]


def test_time_window_over_events_and_computed_ts():
    events = [Event("u", "fav", "item", 1_600_000_000.0 + t) for t in (0, 30, 61)]
    rows = run_pipeline([TimeWindow(60), Aggregate(n=Count())], events)
    assert [(r["window_start"], r["n"]) for r in rows] == [(1_600_000_000 - 40.0, 1), (1_600_000_020.0, 2)]
    rows = run_pipeline([TimeWindow(10, ts=lambda r: r["t_ms"] / 1000), Aggregate(n=Count())],
                        [{"t_ms": 1500}, {"t_ms": 12_000}])
    assert [(r["window_start"], r["n"]) for r in rows] == [(0.0, 1), (10.0, 1)]


def test_time_window_offset():
    rows = run_pipeline([TimeWindow(60, offset=15), Aggregate(n=Count())], [{"ts": 10}, {"ts": 20}])
    assert [(r["window_start"], r["window_end"], r["n"]) for r in rows] == [(-45.0, 15.0, 1), (15.0, 75.0, 1)]


@pytest.mark.parametrize(("size", "slide"), [(0, None), (-5, None), (10, 0), (10, -1), (10, 20)])
def test_time_window_refuses_bad_sizes(size, slide):
    with pytest.raises(ValueError):
        TimeWindow(size, slide=slide)


@pytest.mark.parametrize("option", [{"allowed_lateness": 10}, {"out_of_orderness": 5}])
@pytest.mark.parametrize("task_input", ["page", "recent", "pages"])
def test_trigger_task_refuses_stream_only_window_options(option, task_input):
    """A trigger task's pipeline runs over a finite sequence once per firing: no watermark, nothing
    late, so these options would be silently ignored there; the job is refused instead."""
    window = TimeWindow(60, **option)
    with pytest.raises(ValueError, match=rf"task 't': .*{next(iter(option))}.* finite sequence once per firing"):
        Task("t", ["fav"], [window, Aggregate(n=Count())], input=task_input)
    Task("t", None, [KeyBy("user_id"), window, Aggregate(n=Count())], input="stream")  # where they mean something
    Task("t", ["fav"], [TimeWindow(60), Aggregate(n=Count())], input=task_input)  # plain windows are fine


def test_keyby_then_sliding_window_then_aggregate():
    items = [{"u": "a", "ts": 5, "v": 1}, {"u": "b", "ts": 7, "v": 10}, {"u": "a", "ts": 15, "v": 2},
             {"u": "a", "ts": 25, "v": 4}, {"u": "b", "ts": 28, "v": 20}]
    rows = run_pipeline([KeyBy("u"), TimeWindow(20, slide=10), Aggregate(s=Sum("v"), n=Count())], items)
    got = sorted((r["u"], r["window_start"], r["window_end"], r["s"], r["n"]) for r in rows)
    assert got == [
        ("a", -10.0, 10.0, 1, 1), ("a", 0.0, 20.0, 3, 2), ("a", 10.0, 30.0, 6, 2), ("a", 20.0, 40.0, 4, 1),
        ("b", -10.0, 10.0, 10, 1), ("b", 0.0, 20.0, 10, 1), ("b", 10.0, 30.0, 20, 1), ("b", 20.0, 40.0, 20, 1),
    ]


def test_window_then_keyby_composes_the_other_way():
    items = [{"u": "a", "ts": 1}, {"u": "b", "ts": 2}, {"u": "a", "ts": 11}]
    rows = run_pipeline([TimeWindow(10), KeyBy("u"), Aggregate(n=Count())], items)
    assert rows == [
        {"window_start": 0.0, "window_end": 10.0, "u": "a", "n": 1},
        {"window_start": 0.0, "window_end": 10.0, "u": "b", "n": 1},
        {"window_start": 10.0, "window_end": 20.0, "u": "a", "n": 1},
    ]


# --------------------------------------------------------------------------------------------------
# Aggregate and pipelines


def test_aggregate_docstring_example():
    rows = run_pipeline([KeyBy("user"), Aggregate(n=Count(), last_ts=Max("ts"))],
                        [{"user": "a", "ts": 1}, {"user": "a", "ts": 5}])
    assert rows == [{"user": "a", "n": 2, "last_ts": 5}]


def test_aggregate_without_keyby_folds_everything_into_one_row():
    assert run_pipeline([Aggregate(n=Count(), s=Sum("v"))], [{"v": 2}, {"v": 3}]) == [{"n": 2, "s": 5}]


def test_aggregate_over_no_items_gives_empty_values():
    row = run_pipeline([Aggregate(n=Count(), s=Sum("v"), lo=Min("v"), hi=Max("v"), f=First("v"), la=Last("v"),
                                  ln=LastN("v", 2), d=Distinct("v"), cd=CountDistinct("v"))], [])
    assert row == [{"n": 0, "s": 0, "lo": None, "hi": None, "f": None, "la": None, "ln": [], "d": [], "cd": 0}]


def test_aggregate_refuses_no_aggregations_and_non_aggregations():
    with pytest.raises(ValueError):
        Aggregate()
    with pytest.raises(TypeError, match="n="):
        Aggregate(n=len)


def test_map_and_filter_after_aggregate_post_process_rows():
    items = [{"k": k, "v": v} for k, v in [("a", 1), ("b", 2), ("a", 3), ("c", 10), ("b", 4)]]
    rows = run_pipeline([
        KeyBy("k"),
        Aggregate(s=Sum("v"), n=Count()),
        Filter(lambda r: r["n"] > 1),
        Map(lambda r: {"k": r["k"], "mean": r["s"] / r["n"]}),
    ], items)
    assert rows == [{"k": "a", "mean": 2.0}, {"k": "b", "mean": 3.0}]


def test_pipeline_that_does_not_end_in_rows_raises_clear_type_error():
    events = [Event("u", "fav", "item", 1.6e9)]
    with pytest.raises(TypeError, match="must end in rows"):
        run_pipeline([Filter(lambda e: True)], events)
    with pytest.raises(TypeError, match="Aggregate"):
        run_pipeline([Map(lambda r: r["v"] * 2)], [{"v": 1}])


def test_empty_pipeline_over_rows_returns_the_rows():
    assert run_pipeline([], [{"a": 1}, {"b": 2}]) == [{"a": 1}, {"b": 2}]


def test_get_field_reads_rows_events_and_attributes():
    e = Event("u", "fav", "item", 1.6e9, {"item_id": "7"})
    assert get_field(e, "item_id") == "7" and get_field(e, "page_id") == "item"
    assert get_field({"a": 1}, "a") == 1
    with pytest.raises(KeyError, match="row has no field 'b'"):
        get_field({"a": 1}, "b")


# --------------------------------------------------------------------------------------------------
# Aggregations


ROWS = [{"v": 3, "c": "x"}, {"v": -1, "c": "y"}, {"v": 7, "c": "x"}, {"v": 2, "c": "z"}, {"v": 7, "c": "y"}]


@pytest.mark.parametrize(("agg", "expected"), [
    (Count(), 5),
    (Sum("v"), 18),
    (Min("v"), -1),
    (Max("v"), 7),
    (First("c"), "x"),
    (Last("c"), "y"),
    (LastN("v", 3), [7, 2, 7]),
    (LastN("v", 10), [3, -1, 7, 2, 7]),
    (Distinct("c"), ["x", "y", "z"]),
    (CountDistinct("c"), 3),
    (CountDistinct("v"), 4),
    (Sum(lambda r: r["v"] * 10), 180),
])
def test_aggregation_fold(agg, expected):
    assert agg.fold(ROWS) == expected


@pytest.mark.parametrize(("agg", "expected"), [
    (Count(where=lambda r: r["c"] == "x"), 2),
    (Sum("v", where=lambda r: r["v"] > 2), 17),
    (Min("v", where=lambda r: r["c"] != "y"), 2),
    (Max("v", where=lambda r: r["c"] == "z"), 2),
    (First("v", where=lambda r: r["c"] == "y"), -1),
    (Last("v", where=lambda r: r["c"] == "x"), 7),
    (LastN("c", 2, where=lambda r: r["v"] > 0), ["z", "y"]),
    (Distinct("v", where=lambda r: r["c"] != "x"), [-1, 2, 7]),
    (CountDistinct("c", where=lambda r: r["v"] == 7), 2),
    (Min("v", where=lambda r: False), None),
])
def test_aggregation_where(agg, expected):
    assert agg.fold(ROWS) == expected


def test_count_where_on_events_counts_a_behaviour():
    events = [Event("u", k, "item", 1.6e9 + i) for i, k in enumerate(["fav", "buy", "fav", "cart"])]
    assert run_pipeline([Aggregate(favs=Count(where=lambda e: e.event_id == "fav"))], events) == [{"favs": 2}]


@pytest.mark.parametrize("cls", [Sum, Min, Max, First, Last, Distinct, CountDistinct])
def test_aggregations_without_a_field_raise_type_error(cls):
    with pytest.raises(TypeError, match="needs the field"):
        cls()


def test_bad_where_and_bad_lastn():
    with pytest.raises(TypeError, match="where="):
        Sum("v", where=5)
    with pytest.raises(ValueError):
        LastN("v", 0)


def test_aggregation_state_is_fresh_per_group():
    """LastN mutates its accumulator; two groups must not share it."""
    items = [{"k": "a", "v": 1}, {"k": "b", "v": 2}, {"k": "a", "v": 3}]
    rows = run_pipeline([KeyBy("k"), Aggregate(vs=LastN("v", 5))], items)
    assert rows == [{"k": "a", "vs": [1, 3]}, {"k": "b", "vs": [2]}]
    # and the same Aggregate run twice starts over
    agg = Aggregate(vs=LastN("v", 5))
    assert run_pipeline([agg], items) == run_pipeline([agg], items) == [{"vs": [1, 2, 3]}]


def _acc(agg, items):
    acc = agg.create()
    for item in items:
        if agg.where is None or agg.where(item):
            acc = agg.add(acc, item)
    return acc


def _all_aggregations():
    even = lambda r: r["v"] % 2 == 0  # noqa: E731
    return [Count(), Count(where=even), Sum("v"), Sum("v", where=even), Min("v"), Max("v"), Min("v", where=even),
            First("v"), Last("v"), First("c", where=even), Last("c", where=even), LastN("v", 1), LastN("v", 3),
            LastN("c", 4, where=even), Distinct("c"), Distinct("v", where=even), CountDistinct("c"),
            CountDistinct("v")]


@settings(max_examples=150, deadline=None)
@given(items=st.lists(st.fixed_dictionaries({"v": st.integers(-50, 50), "c": st.sampled_from("abcde")}),
                      max_size=30),
       cut=st.integers(0, 30))
def test_merge_of_two_halves_equals_fold_of_all(items, cut):
    cut = min(cut, len(items))
    left, right = items[:cut], items[cut:]
    for agg in _all_aggregations():
        merged = agg.merge(_acc(agg, left), _acc(agg, right))
        assert agg.result(merged) == agg.fold(items), agg


@settings(max_examples=100, deadline=None)
@given(items=st.lists(st.fixed_dictionaries({"v": st.integers(-50, 50), "c": st.sampled_from("abc")}),
                      max_size=20),
       cuts=st.tuples(st.integers(0, 20), st.integers(0, 20)))
def test_merge_is_associative_over_three_parts(items, cuts):
    a, b = sorted(min(c, len(items)) for c in cuts)
    parts = items[:a], items[a:b], items[b:]
    for agg in _all_aggregations():
        x, y, z = (_acc(agg, p) for p in parts)
        left = agg.merge(agg.merge(x, y), z)
        x, y, z = (_acc(agg, p) for p in parts)
        right = agg.merge(x, agg.merge(y, z))
        assert agg.result(left) == agg.result(right) == agg.fold(items), agg


def test_merge_with_empty_accumulators():
    for agg in _all_aggregations():
        full = _acc(agg, ROWS)
        assert agg.result(agg.merge(agg.create(), full)) == agg.fold(ROWS), agg
        full = _acc(agg, ROWS)
        assert agg.result(agg.merge(full, agg.create())) == agg.fold(ROWS), agg


# -- the generated fold (Aggregate.fold_one) == Aggregate.fold, values and errors -------------------------
_AGGREGATIONS = {
    "first": lambda f: First(f), "last": lambda f: Last(f), "count": lambda f: Count(),
    "count_where": lambda f: Count(where=lambda r: f in r), "sum": lambda f: Sum(f), "min": lambda f: Min(f),
    "max": lambda f: Max(f), "count_by": lambda f: CountBy(f), "distinct": lambda f: Distinct(f),
    "last_n": lambda f: LastN(f, 2), "first_fn": lambda f: First(lambda r: r[f]),
}


def _outcome(fn, items):
    try:
        return fn(items)
    except Exception as exc:
        return type(exc), str(exc), getattr(exc, "__notes__", None)


@settings(max_examples=200, deadline=None)
@given(aggs=st.lists(st.tuples(st.sampled_from(sorted(_AGGREGATIONS)), st.sampled_from(["a", "b"])), min_size=1,
                     max_size=6),
       items=st.lists(st.dictionaries(st.sampled_from(["a", "b"]), st.one_of(st.integers(-5, 5), st.just("x"))),
                      max_size=5))
def test_the_generated_fold_gives_what_fold_gives(aggs, items):
    aggregate = Aggregate(**{f"c{i}": _AGGREGATIONS[kind](field) for i, (kind, field) in enumerate(aggs)})
    assert _outcome(aggregate.fold_one, items) == _outcome(lambda x: aggregate.fold(x, {}), items)


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(sorted(_AGGREGATIONS)), field=st.sampled_from(["a", "b"]),
       item=st.dictionaries(st.sampled_from(["a", "b"]),
                            st.one_of(st.integers(-5, 5), st.floats(allow_nan=False), st.just("x"), st.just([1]),
                                      st.none())))
def test_check_raises_what_adding_to_a_new_accumulator_raises(kind, field, item):
    """A stream task checks each event with ``check`` before any window adds it (the cheap form of the add)."""
    agg = _AGGREGATIONS[kind](field)
    assert _outcome(lambda i: agg.check(i), item) == _outcome(lambda i: (agg.add(agg.create(), i), None)[1], item)


# -- the generated fold reading event fields inline (a task over events: TaskExecution sets _event_field) ------
_EVENT_AGGREGATIONS = {"first": First, "last": Last, "min": Min, "max": Max, "count_by": CountBy,
                       "count": lambda f: Count()}
_EVENTS = st.lists(st.builds(Event, st.sampled_from(["u", "v"]), st.sampled_from(["page_enter", "fav", "page_exit"]),
                             st.just("item"), st.sampled_from([1.0, 2.0, 3.5]),
                             st.dictionaries(st.sampled_from(["item_id", "n"]), st.sampled_from(["7", "8"]))),
                   max_size=4)


@settings(max_examples=200, deadline=None)
@given(aggs=st.lists(st.tuples(st.sampled_from(sorted(_EVENT_AGGREGATIONS)),
                               st.sampled_from(["ts", "event_id", "user_id", "item_id", "n"])), min_size=1, max_size=5),
       items=_EVENTS)
def test_the_generated_fold_reading_events_inline_gives_what_fold_gives(aggs, items):
    from streamflow.execution import _read_events_directly

    def aggregate():
        return Aggregate(**{f"c{i}": _EVENT_AGGREGATIONS[kind](field) for i, (kind, field) in enumerate(aggs)})

    plain, inline = aggregate(), aggregate()
    _read_events_directly([inline])
    expected = _outcome(lambda x: plain.fold(x, {}), items)
    assert _outcome(inline.fold_one, items) == expected
    rows = _outcome(inline.fold_rows([ElementStep("map", lambda r: {"n": len(r)}),
                                      ElementStep("filter", lambda r: r["n"] > 0)]), items)
    assert rows == (expected if isinstance(expected, tuple) else [{"n": len(expected)}])
