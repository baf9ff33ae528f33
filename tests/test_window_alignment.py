"""Every item lands in exactly the windows Flink gives it, also with fractional sizes, slides and offsets.

The reference is written here from Flink's Java source, independently of ``operators.window``:
``TimeWindow.getWindowStartWithOffset`` (Java's ``%`` on longs keeps the dividend's sign, hence the
branch) and ``SlidingEventTimeWindows.assignWindows`` (from the last start down by ``slide`` while the
window still holds the timestamp). Flink keeps event time in integer milliseconds; the Flink runner
hands it ``round(seconds * 1000)``.

Checked on the three places that assign windows: ``window_starts`` (seconds), ``TimeWindow`` in a
trigger task's pipeline and the device runner's stream windows (``EventTimeWindows`` on ``KeyedRuntime``).
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from operators import Aggregate, Distinct, TimeWindow, run_pipeline, window_starts
from streamflow.keyed import KeyedRuntime
from streamflow.windowing import EventTimeWindows


def java_rem(a: int, b: int) -> int:
    """Java's ``a % b`` on longs: truncated division, the remainder has the sign of ``a``."""
    r = abs(a) % abs(b)
    return r if a >= 0 else -r


def flink_window_start(timestamp: int, offset: int, window_size: int) -> int:
    """``TimeWindow.getWindowStartWithOffset(timestamp, offset, windowSize)``."""
    remainder = java_rem(timestamp - offset, window_size)
    return timestamp - (remainder + window_size) if remainder < 0 else timestamp - remainder


def flink_windows(timestamp: int, size: int, slide: int, offset: int) -> list[tuple[int, int]]:
    """``SlidingEventTimeWindows.assignWindows``: the ``(start, end)`` ms windows of ``timestamp``."""
    windows = []
    start = flink_window_start(timestamp, offset, slide)
    while start > timestamp - size:
        windows.append((start, start + size))
        start -= slide
    return windows


def flink_ms(seconds: float) -> int:
    return round(seconds * 1000)


def expected_windows(ts: float, size: float, slide: float, offset: float) -> set[tuple[float, float]]:
    """The windows Flink assigns, in seconds as the runners report them (``ms / 1000``)."""
    return {(s / 1000, e / 1000) for s, e in flink_windows(flink_ms(ts), flink_ms(size), flink_ms(slide),
                                                            flink_ms(offset))}


# Seconds with up to microsecond digits; sizes from 1 ms to an hour.
timestamps = st.floats(946_684_800.0, 4_000_000_000.0, allow_nan=False, allow_infinity=False)
durations = st.floats(0.001, 3600.0, allow_nan=False, allow_infinity=False)
offsets = st.floats(-3600.0, 3600.0, allow_nan=False, allow_infinity=False)


@st.composite
def windowings(draw):
    size = draw(durations)
    slide = draw(st.one_of(st.just(size), st.floats(max(0.001, size / 50), size)))  # tumbling or sliding
    assume(flink_ms(slide) >= 1)
    return size, slide, draw(offsets)


def test_fractional_tumbling_window_takes_the_item():
    """The case that lost items with floating ``fmod``: ``window_starts`` returned no window."""
    assert window_starts(1533402464.58, 0.03, 0.03) == [1533402464.58]
    assert window_starts(0.3, 0.1, 0.1) == [0.3]


@settings(max_examples=1000, deadline=None)
@given(ts=timestamps, windowing=windowings())
def test_window_starts_are_flinks(ts, windowing):
    size, slide, offset = windowing
    starts = window_starts(ts, size, slide, offset)
    assert starts == sorted(starts)
    assert {(s, round(s * 1000 + flink_ms(size)) / 1000) for s in starts} == expected_windows(ts, size, slide, offset)
    assert len(starts) >= 1  # no item falls in no window


@settings(max_examples=300, deadline=None)
@given(ts=st.lists(timestamps, min_size=1, max_size=40), windowing=windowings())
def test_time_window_operator_puts_each_item_in_flinks_windows(ts, windowing):
    size, slide, offset = windowing
    items = [{"id": i, "ts": t} for i, t in enumerate(ts)]
    rows = run_pipeline([TimeWindow(size, slide, offset=offset), Aggregate(ids=Distinct("id"))], items)
    got: dict[int, set] = {i: set() for i in range(len(items))}
    for row in rows:
        for i in row["ids"]:
            got[i].add((row["window_start"], row["window_end"]))
    assert got == {i: expected_windows(t, size, slide, offset) for i, t in enumerate(ts)}


@settings(max_examples=300, deadline=None)
@given(ts=st.lists(timestamps, min_size=1, max_size=40), windowing=windowings())
def test_stream_windows_put_each_item_in_flinks_windows(ts, windowing):
    size, slide, offset = windowing
    windows = KeyedRuntime(EventTimeWindows(TimeWindow(size, slide, offset=offset), Aggregate(ids=Distinct("id")), "k"))
    fired = []
    for i, t in enumerate(sorted(ts)):  # in order: nothing is late
        outputs = windows.process("k", {"id": i, "ts": t})
        assert all(tag == "emit" for tag, _ in outputs)
        fired.extend(row for _, row in outputs)
    fired.extend(row for _, row in windows.finish())
    got: dict[int, set] = {i: set() for i in range(len(ts))}
    for row in fired:
        for i in row["ids"]:
            got[i].add((row["window_start"], row["window_end"]))
    assert got == {i: expected_windows(t, size, slide, offset) for i, t in enumerate(sorted(ts))}


@pytest.mark.parametrize("size, slide", [(0.0004, None), (1.0, 0.0004)])
def test_windows_finer_than_a_millisecond_are_refused(size, slide):
    with pytest.raises(ValueError, match="millisecond"):
        TimeWindow(size, slide)
