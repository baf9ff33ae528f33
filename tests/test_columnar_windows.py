"""Batch time windows (streamflow/columnar_windows.py) against the streaming window function they stand for.

Generated inputs (keys, times out of order, lateness, out-of-orderness, sliding and tumbling windows, offsets, cut
into blocks anywhere) and
every kind of aggregation: the outputs, their order and the item each comes with equal what
:class:`~streamflow.windowing.EventTimeWindows` under :class:`~streamflow.keyed.KeyedRuntime` emits item by item.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from operators import (
    Aggregate,
    Count,
    CountBy,
    CountDistinct,
    First,
    Last,
    LastN,
    Max,
    Min,
    Sum,
    TimeWindow,
)
from operators.window import CountWindow
from streamflow.columnar_windows import BatchCountWindows, BatchTimeWindows, refusal
from streamflow.keyed import KeyedRuntime
from streamflow.windowing import CountWindows, EventTimeWindows


def _aggregate() -> Aggregate:
    return Aggregate(n=Count(), total=Sum("v"), top=Max("v"), low=Min("v"), first=First("v"), last=Last("v"),
                     kinds=CountDistinct("k"), tail=LastN("v", 2), by=CountBy("k"),
                     odd=Count(where=lambda item: item["v"] % 2 == 1))


def _streamed(window: TimeWindow, keys, items, ts_ms) -> list:
    runtime = KeyedRuntime(EventTimeWindows(window, _aggregate(), "user"), window.out_of_orderness)
    out = []
    for i, (key, item, ts) in enumerate(zip(keys, items, ts_ms, strict=True)):
        out += [(i, tag, value) for tag, value in runtime.process(key, item, ts)]
    return out + [(len(items), tag, value) for tag, value in runtime.finish()]


@st.composite
def _inputs(draw):
    slide = draw(st.sampled_from([1_000, 2_000, 3_000, 5_000]))
    size = slide * draw(st.integers(1, 4)) + draw(st.sampled_from([0, 0, 500]))
    lateness = draw(st.sampled_from([0, 0, 700, 1_500, 4_200]))
    window = TimeWindow(size / 1000, slide=slide / 1000, offset=draw(st.sampled_from([0, 0, 0.25])),
                        out_of_orderness=draw(st.sampled_from([0, 0.5, 2.0])), allowed_lateness=lateness / 1000)
    n = draw(st.integers(0, 60))
    keys = draw(st.lists(st.sampled_from(["a", "b", "c", 1, 1.0]), min_size=n, max_size=n))
    base = draw(st.integers(-20_000, 1_600_000_000_000))
    ts_ms = [base + t for t in draw(st.lists(st.integers(0, 40_000), min_size=n, max_size=n))]
    if draw(st.booleans()):  # mostly in order, as a live stream is
        ts_ms.sort()
        for i in draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=5)):
            if n:
                ts_ms[i] -= draw(st.integers(0, 8_000))
    values = draw(st.lists(st.one_of(st.integers(-5, 5), st.floats(-5, 5, allow_nan=False)), min_size=n, max_size=n))
    kinds = draw(st.lists(st.sampled_from(["x", "y", "z"]), min_size=n, max_size=n))
    items = [{"v": v if isinstance(v, int) else round(v, 2), "k": k, "ts": t / 1000}
             for v, k, t in zip(values, kinds, ts_ms, strict=True)]
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
    return window, keys, items, ts_ms, cuts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_inputs())
def test_batch_windows_emit_what_the_streaming_windows_emit_in_the_same_order(case):
    """Whole, or cut into blocks anywhere (what a window holds at a cut is carried to the next block)."""
    window, keys, items, ts_ms, cuts = case
    if refusal(window) is not None:
        return
    expected = _streamed(window, keys, items, ts_ms)
    assert BatchTimeWindows(window, _aggregate(), "user").outputs(keys, items, ts_ms) == expected
    windows, out = BatchTimeWindows(window, _aggregate(), "user"), []
    for a, b in zip([0, *cuts], [*cuts, len(items)], strict=True):
        out += windows.add(keys[a:b], items[a:b], ts_ms[a:b])
    assert out + windows.finish() == expected


def test_a_lateness_that_is_a_multiple_of_the_slide_streams():
    assert refusal(TimeWindow(60, slide=20, allowed_lateness=40)) is not None
    assert refusal(TimeWindow(60, slide=20, allowed_lateness=10)) is None
    assert refusal(TimeWindow(60)) is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 5), st.one_of(st.none(), st.integers(1, 6)),
       st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(-5, 5)), max_size=50),
       st.lists(st.integers(0, 50), max_size=4))
def test_batch_count_windows_emit_what_the_streaming_count_windows_emit(size, slide, entries, cuts):
    window = CountWindow(size, slide)
    keys = [key for key, _ in entries]
    items = [{"v": v, "k": key} for key, v in entries]
    runtime = KeyedRuntime(CountWindows(window, _aggregate(), "user"))
    expected = [(i, tag, value) for i, (key, item) in enumerate(zip(keys, items, strict=True))
                for tag, value in runtime.process(key, item, 0)]
    windows, out = BatchCountWindows(window, _aggregate(), "user"), []
    cuts = sorted(min(c, len(items)) for c in cuts)
    for a, b in zip([0, *cuts], [*cuts, len(items)], strict=True):
        out += windows.add(keys[a:b], items[a:b], [0] * (b - a))
    assert out + windows.finish() == expected
