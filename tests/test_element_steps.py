"""One plan per element-wise operator: every consumer of a Map or Filter runs its ElementStep, with the same rows.

A Map or a Filter is lowered once, when it is made, to an :class:`~operators.base.ElementStep`; the groups of
``run_pipeline``, a trigger task's compiled pipeline (with and without a leading Aggregate, whose generated fold
runs the steps), the columnar runner (``run_row_steps``), a stream task's steps before its key and after its window
(the generated steps the Flink runner's operators call too), and the device runner streaming and in batch mode
(columnar count windows) must all give what the operators give interpreted by hand, in the same order.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors import CollectiveStorage
from operators import Aggregate, CountWindow, ElementStep, Filter, KeyBy, Last, Map, run_pipeline
from operators.base import compile_pipeline, element_steps
from streamflow.columnar import Column, run_row_steps
from streamflow.events import Event
from streamflow.job import Job, Task
from streamflow.runners import DeviceRunner
from streamflow.windowing import StreamPlan, StreamTaskRun

# Steps a user might write over rows {"k", "a", "b"} of integers; each runs over a row of columns as well.
POOL = [
    Map(lambda r: {"k": r["k"], "a": r["a"] + r["b"], "b": r["b"]}),
    Map(lambda r: {"k": r["k"], "a": r["a"] * 2, "b": r["b"] - 1}),
    Map(lambda r: {"k": r["k"], "a": r["b"], "b": r["a"]}),
    Filter(lambda r: r["a"] > r["b"]),
    Filter(lambda r: r["b"] >= 0),
    Filter(lambda r: r["a"] != 3),
]
pipelines = st.lists(st.sampled_from(POOL), max_size=4)
rows = st.lists(st.fixed_dictionaries({"k": st.integers(0, 2), "a": st.integers(-5, 5), "b": st.integers(-5, 5)}),
                max_size=12)


def _by_hand(ops: list[Map | Filter], items: list[dict]) -> list[dict]:
    """The operators interpreted one by one, item by item (the reference)."""
    out = []
    for item in items:
        for op in ops:
            if isinstance(op, Map):
                item = op.fn(item)
            elif not op.predicate(item):
                break
        else:
            out.append({"k": item["k"], "a": item["a"], "b": item["b"]})
    return out


def _plain(items: list) -> list[dict]:
    return [{"k": item["k"], "a": item["a"], "b": item["b"]} for item in items]


def test_map_and_filter_lower_once_to_a_frozen_step() -> None:
    double, keep = (lambda r: 2 * r), (lambda r: r > 0)
    assert Map(double).element_step == ElementStep("map", double)
    assert Filter(keep).element_step == ElementStep("filter", keep)
    step = Map(double).element_step
    with pytest.raises(AttributeError):
        step.fn = keep  # type: ignore[misc]
    with pytest.raises(ValueError, match="'map' or a 'filter'"):
        ElementStep("reduce", double)  # type: ignore[arg-type]
    assert repr(Map(abs)) == "Map(fn=<built-in function abs>)"  # the plan stays out of the operator's text
    plan = StreamPlan.of("t", [Filter(keep), KeyBy("k"), Map(double), CountWindow(2), Aggregate(n=Last("a")),
                               Map(double)])
    assert (plan.before_key, plan.before_window, plan.after_window) == (
        (ElementStep("filter", keep),), (ElementStep("map", double),), (ElementStep("map", double),))


@settings(max_examples=200, deadline=None)
@given(ops=pipelines, items=rows)
def test_every_consumer_of_the_steps_gives_the_same_rows(ops: list[Map | Filter], items: list[dict]) -> None:
    expected = _by_hand(ops, items)
    assert _plain(run_pipeline(ops, items)) == expected  # the groups (ElementOperator.apply)
    assert _plain(compile_pipeline(ops)(items)) == expected  # a compiled chain (apply_one)
    last = Aggregate(k=Last("k"), a=Last("a"), b=Last("b"))  # one row per firing, through the generated fold
    assert [row for item in items for row in _plain(compile_pipeline([last, *ops])([item]))] == expected

    # the columnar runner: each step called once with a row of columns
    columns = {name: Column(np.array([item[name] for item in items], dtype=np.int64)) for name in ("k", "a", "b")}
    out, kept = run_row_steps(element_steps(ops), columns, len(items))
    assert kept is None or len(kept) == len(expected)
    values = {name: out[name].values.tolist() for name in ("k", "a", "b")}
    assert [dict(zip(values, row, strict=True)) for row in zip(*values.values(), strict=True)] == expected

    # a stream task: the steps before its key, and after its window (a count window of one fires per item)
    window = [CountWindow(1), Aggregate(a=Last("a"), b=Last("b"))]
    before = StreamTaskRun(Task("t", None, [*ops, KeyBy("k"), *window], input="stream"))
    after = StreamTaskRun(Task("t", None, [KeyBy("k"), *window, *ops], input="stream"))
    for run in (before, after):
        got = [row for item in items for row in run.process(dict(item))[0]]
        assert _plain(got) == expected


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=pipelines, items=rows)
def test_the_device_runner_streaming_and_in_batch_mode_runs_the_same_steps(tmp_path, ops, items) -> None:
    """A job of one stream task whose Filter and Map steps come before its key and after its count window: the
    same rows in the same order streaming and in batch mode (columnar count windows)."""
    events = [Event(f"u{i % 3}", "pv", "item", 1.6e9 + i, dict(item)) for i, item in enumerate(items)]
    window = [CountWindow(1), Aggregate(a=Last("a"), b=Last("b"))]
    task = Task("t", None, [*ops, KeyBy("k"), *window, *ops], input="stream")
    expected = _by_hand(ops, _by_hand(ops, items))
    for mode in ("streaming", "batch"):
        path = tmp_path / f"{mode}-{len(list(tmp_path.iterdir()))}.duckdb"
        runner = DeviceRunner(Job("j", [task]), CollectiveStorage(path), runtime_mode=mode)
        summary = runner.run(events)
        runner.close()
        assert summary.runtime_mode == mode
        got = runner.storage.query("SELECT k, a, b FROM t ORDER BY rowid") if expected else []
        assert [{"k": k, "a": a, "b": b} for k, a, b in got] == expected, mode
        assert summary.task_stats["t"].rows == len(expected) and summary.task_stats["t"].errors == 0
        runner.storage.close()
