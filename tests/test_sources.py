"""Event model, sequences, the Taobao adapter, the JSON-lines source and every bad-input case.

Bad input must never crash a source or a run, never be dropped silently: each bad record becomes a
``Rejected`` naming the line and the reason, lands in the ``dead_letter`` table and is counted, and
the good records around it still produce features.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.storage import CollectiveStorage
from operators import Aggregate, Count, Filter, KeyBy, LastN, TimeWindow
from streamflow.events import MIN_PLAUSIBLE_TS, PAGE_ENTER, PAGE_EXIT, Event, Rejected, TimestampGuard
from streamflow.job import Job, Task, load_job
from streamflow.runners.device import DeviceRunner
from streamflow.sequences import PageVisit, UserSequence
from streamflow.sources import (
    DEFAULT_INACTIVITY_GAP_S,
    JsonLinesSource,
    TaobaoBehaviorSource,
    item_page_events,
    open_source,
    page_exit,
)

T = 1511848894  # a real timestamp of the Taobao sample (2017-11-28)
YEAR_2100 = 4102444800


def taobao(lines, **kwargs):
    return list(TaobaoBehaviorSource.from_lines(lines, **kwargs))


def jsonl(lines):
    return list(JsonLinesSource.from_lines(lines))


def brief(records):
    """Events as (user, event_id, item, ts); rejected records as ("REJECTED", line)."""
    return [("REJECTED", r.line) if isinstance(r, Rejected) else (r.user_id, r.event_id, r.contents["item_id"], r.ts)
            for r in records]


def jline(**fields):
    return json.dumps(fields)


# --------------------------------------------------------------------------------------------------
# Event, Rejected, TimestampGuard


def test_event_field_reads_attributes_then_contents():
    e = Event("u1", "fav", "item", 1511848951.0, {"item_id": "77460", "ts": "shadowed"})
    assert e.field("item_id") == "77460"
    assert e.field("event_id") == "fav" and e.field("page_id") == "item" and e.field("user_id") == "u1"
    assert e.field("ts") == 1511848951.0  # attributes win over contents keys
    with pytest.raises(KeyError, match=r"event 'fav' of user 'u1' at ts=1511848951.0 has no field 'price'"):
        e.field("price")


def test_event_to_dict_is_json_ready_and_copies_contents():
    e = Event("u", "buy", "item", 5.0, {"item_id": "1"})
    d = e.to_dict()
    assert d == {"user_id": "u", "event_id": "buy", "page_id": "item", "ts": 5.0, "contents": {"item_id": "1"}}
    d["contents"]["item_id"] = "changed"
    assert e.contents["item_id"] == "1"
    assert json.loads(json.dumps(d))["ts"] == 5.0


def test_rejected_describe_names_source_line_and_reason():
    assert Rejected("f.csv", 7, "bad value: x", "raw").describe() == "f.csv:7: bad value: x"


@pytest.mark.parametrize("ts", [0.0, -1.0, -1511848894.0, MIN_PLAUSIBLE_TS - 1, float(YEAR_2100), math.nan,
                                math.inf, -math.inf])
def test_guard_rejects_absurd_timestamps(ts):
    reason = TimestampGuard().check("u", ts)
    assert reason is not None and reason.startswith("absurd timestamp")


def test_guard_rejects_backwards_per_user_only_and_forgets_rejected():
    guard = TimestampGuard()
    assert guard.check("u1", float(T)) is None
    assert guard.check("u1", float(T)) is None  # equal is fine
    assert guard.check("u2", T - 1000.0) is None  # other users have their own clock
    reason = guard.check("u1", T - 1.0)
    assert reason == f"timestamp goes backwards: {float(T - 1)} < {float(T)}, the previous event of user u1"
    assert guard.check("u1", float(YEAR_2100)) is not None
    assert guard.check("u1", T + 1) is None  # neither rejected stamp moved u1's clock


def test_guard_upper_bound_follows_the_clock():
    """A runtime that runs longer than the allowed skew still takes events stamped now (defect: the
    bound was fixed at start-up, so every later event became 'absurd')."""
    guard = TimestampGuard(max_future_skew_s=0.05)
    time.sleep(0.2)  # the runtime has been up longer than the skew
    assert guard.check("u", time.time()) is None
    reason = guard.check("u", time.time() + 60)
    assert reason is not None and reason.startswith("absurd timestamp")  # the future is still refused


# --------------------------------------------------------------------------------------------------
# sequences


def test_page_visit_aggregates_enter_to_exit():
    events = [Event("u", PAGE_ENTER, "item", 10.0, {"item_id": "x"}), Event("u", "fav", "item", 12.0),
              Event("u", PAGE_EXIT, "item", 25.0)]
    v = PageVisit.of(events)
    assert (v.user_id, v.page_id, v.enter_ts, v.exit_ts, v.dwell_s, v.n_events) == ("u", "item", 10.0, 25.0, 15.0, 3)
    assert v.field("ts") == 25.0 and v.field("dwell_s") == 15.0 and v.field("item_id") == "x"


def test_user_sequence_page_visits():
    seq = UserSequence()
    assert seq.append(Event("u", PAGE_ENTER, "A", 1.0)) is None
    assert seq.append(Event("u", "fav", "A", 2.0)) is None
    assert [e.event_id for e in seq.current_page()] == [PAGE_ENTER, "fav"]
    visit = seq.append(Event("u", PAGE_EXIT, "A", 3.0))
    assert visit is not None and [e.event_id for e in visit.events] == [PAGE_ENTER, "fav", PAGE_EXIT]
    assert seq.current_page() == visit.events  # the visit just completed
    # a page_enter while B is open ends B at its last event
    seq.append(Event("u", PAGE_ENTER, "B", 4.0))
    seq.append(Event("u", "cart", "B", 5.0))
    seq.append(Event("u", PAGE_ENTER, "C", 6.0))
    assert [(p.page_id, p.enter_ts, p.exit_ts) for p in seq.recent_pages()] == [("A", 1.0, 3.0), ("B", 4.0, 5.0)]
    seq.append(Event("u", PAGE_EXIT, "C", 7.0))
    # a page_exit with no open page is a visit of that one event
    lone = seq.append(Event("u", PAGE_EXIT, "D", 8.0))
    assert lone.n_events == 1 and lone.page_id == "D"
    assert [p.page_id for p in seq.recent_pages()] == ["A", "B", "C", "D"]
    assert [p.page_id for p in seq.recent_pages(since_ts=7.0)] == ["C", "D"]
    assert [p.page_id for p in seq.recent_pages(limit=1)] == ["D"]


def test_user_sequence_exit_of_another_page_does_not_drop_the_open_visit():
    """A is open and the exit of B arrives: A's visit must not vanish from the page-level sequence.

    The module docstring: a page_enter while another page is open ends the open visit at its last
    event; a page_exit with no matching open page is a visit of that one event. Nothing may be
    silently dropped, so A's visit should end at its last event (like the page_enter case).
    """
    seq = UserSequence()
    seq.append(Event("u", PAGE_ENTER, "A", 1.0))
    seq.append(Event("u", "fav", "A", 2.0))
    seq.append(Event("u", PAGE_EXIT, "B", 3.0))
    assert [(p.page_id, p.enter_ts, p.exit_ts, p.n_events) for p in seq.recent_pages()] == [
        ("A", 1.0, 2.0, 2), ("B", 3.0, 3.0, 1)]


def test_user_sequence_recent_events_bounds():
    seq = UserSequence(max_events=3, max_pages=2)
    for t in range(1, 6):
        seq.append(Event("u", "fav", "item", float(t)))
    assert [e.ts for e in seq.recent_events()] == [3.0, 4.0, 5.0]
    assert [e.ts for e in seq.recent_events(since_ts=4.0)] == [4.0, 5.0]
    assert [e.ts for e in seq.recent_events(limit=1)] == [5.0]
    assert [e.ts for e in seq.current_page()] == [5.0]  # no page open: the latest event
    seq.resize(5, 2)
    seq.append(Event("u", "fav", "item", 6.0))
    # a bound raised keeps the most recent events still held (up to twice the old bound are held)
    assert [e.ts for e in seq.recent_events()] == [2.0, 3.0, 4.0, 5.0, 6.0]
    for t in range(7, 20):
        seq.append(Event("u", "fav", "item", float(t)))
    assert [e.ts for e in seq.recent_events()] == [15.0, 16.0, 17.0, 18.0, 19.0]
    assert len(seq.recent.get()) <= 10  # trimmed at twice the bound


# --------------------------------------------------------------------------------------------------
# Taobao adapter: the page mapping


def test_taobao_docstring_example():
    src = TaobaoBehaviorSource.from_lines([f"1,10,7,pv,{T}", f"1,10,7,buy,{T + 6}"])
    assert [(e.event_id, e.page_id, e.ts) for e in src] == [
        (PAGE_ENTER, "item", float(T)), ("buy", "item", float(T + 6)), (PAGE_EXIT, "item", float(T + 6))]


def test_taobao_every_event_carries_item_and_category():
    for e in taobao([f"1,10,7,pv,{T}", f"1,20,8,fav,{T + 1}"]):
        assert isinstance(e, Event) and e.page_id == "item"
        assert e.contents["item_id"] in ("10", "20") and e.contents["category_id"] == {"10": "7", "20": "8"}[
            e.contents["item_id"]]
        assert isinstance(e.user_id, str) and e.user_id == "1"


def test_taobao_pv_of_open_item_is_a_reload():
    recs = taobao([f"1,10,7,pv,{T}", f"1,10,7,pv,{T + 5}", f"1,10,7,fav,{T + 9}"])
    assert brief(recs) == [("1", PAGE_ENTER, "10", T), ("1", "pv", "10", T + 5), ("1", "fav", "10", T + 9),
                           ("1", PAGE_EXIT, "10", T + 9)]


def test_taobao_entering_another_item_exits_at_that_moment():
    recs = taobao([f"1,10,7,pv,{T}", f"1,20,8,pv,{T + 30}"])
    assert brief(recs) == [("1", PAGE_ENTER, "10", T), ("1", PAGE_EXIT, "10", T + 30),
                           ("1", PAGE_ENTER, "20", T + 30), ("1", PAGE_EXIT, "20", T + 30)]


@pytest.mark.parametrize("behavior", ["fav", "cart", "buy"])
def test_taobao_click_on_item_whose_page_is_not_open_enters_it_implicitly(behavior):
    recs = taobao([f"1,10,7,pv,{T}", f"1,20,8,{behavior},{T + 3}"])
    assert brief(recs) == [("1", PAGE_ENTER, "10", T), ("1", PAGE_EXIT, "10", T + 3),
                           ("1", PAGE_ENTER, "20", T + 3), ("1", behavior, "20", T + 3),
                           ("1", PAGE_EXIT, "20", T + 3)]
    assert recs[2].contents == {"item_id": "20", "category_id": "8", "implicit": True}  # no behavior: not the line
    assert recs[3].contents == {"item_id": "20", "category_id": "8", "behavior": behavior}
    assert "implicit" not in recs[0].contents and "implicit" not in recs[3].contents
    # also as the very first record of a user
    recs = taobao([f"1,20,8,{behavior},{T}"])
    assert [(e.event_id, e.contents.get("implicit", False)) for e in recs] == [
        (PAGE_ENTER, True), (behavior, False), (PAGE_EXIT, False)]


def test_taobao_inactivity_gap_exits_at_last_activity():
    recs = taobao([f"1,10,7,pv,{T}", f"1,10,7,fav,{T + 100}", f"1,10,7,pv,{T + 100 + 1801}"])
    assert brief(recs) == [("1", PAGE_ENTER, "10", T), ("1", "fav", "10", T + 100), ("1", PAGE_EXIT, "10", T + 100),
                           ("1", PAGE_ENTER, "10", T + 1901), ("1", PAGE_EXIT, "10", T + 1901)]
    # a gap of exactly inactivity_gap_s is not "more than": still the same visit (a reload)
    recs = taobao([f"1,10,7,pv,{T}", f"1,10,7,pv,{T + 1800}"])
    assert [e.event_id for e in recs] == [PAGE_ENTER, "pv", PAGE_EXIT]
    # after a gap, a different item: exit at the last activity, not at the new event
    recs = taobao([f"1,10,7,pv,{T}", f"1,20,8,cart,{T + 5000}"])
    assert brief(recs) == [("1", PAGE_ENTER, "10", T), ("1", PAGE_EXIT, "10", T),
                           ("1", PAGE_ENTER, "20", T + 5000), ("1", "cart", "20", T + 5000),
                           ("1", PAGE_EXIT, "20", T + 5000)]


def test_taobao_inactivity_gap_is_configurable():
    recs = taobao([f"1,10,7,pv,{T}", f"1,10,7,pv,{T + 61}"], inactivity_gap_s=60)
    assert [e.event_id for e in recs] == [PAGE_ENTER, PAGE_EXIT, PAGE_ENTER, PAGE_EXIT]
    recs = taobao([f"1,10,7,pv,{T}", f"1,10,7,pv,{T + 61}"], inactivity_gap_s=3600)
    assert [e.event_id for e in recs] == [PAGE_ENTER, "pv", PAGE_EXIT]


def test_taobao_end_of_input_exits_every_open_page_at_its_last_activity():
    recs = taobao([f"1,10,7,pv,{T}", f"2,20,8,pv,{T + 1}", f"1,10,7,cart,{T + 50}", f"3,30,9,fav,{T + 60}"])
    exits = [(e.user_id, e.contents["item_id"], e.ts) for e in recs if e.event_id == PAGE_EXIT]
    assert sorted(exits) == [("1", "10", T + 50), ("2", "20", T + 1), ("3", "30", T + 60)]
    assert all(e.event_id == PAGE_EXIT for e in recs[-3:])  # after every input record


def test_taobao_interleaved_users_keep_separate_pages():
    lines = [f"1,10,7,pv,{T}", f"2,10,7,pv,{T + 1}", f"1,10,7,buy,{T + 2}", f"2,21,8,pv,{T + 3}",
             f"1,11,7,pv,{T + 4}", f"2,21,8,pv,{T + 5}"]
    recs = taobao(lines)
    per_user = {u: [(e, i, ts) for (uu, e, i, ts) in brief(recs) if uu == u] for u in ("1", "2")}
    assert per_user["1"] == [(PAGE_ENTER, "10", T), ("buy", "10", T + 2), (PAGE_EXIT, "10", T + 4),
                             (PAGE_ENTER, "11", T + 4), (PAGE_EXIT, "11", T + 4)]
    assert per_user["2"] == [(PAGE_ENTER, "10", T + 1), (PAGE_EXIT, "10", T + 3), (PAGE_ENTER, "21", T + 3),
                             ("pv", "21", T + 5), (PAGE_EXIT, "21", T + 5)]
    # the same lines with users grouped give the same per-user sequences
    grouped = taobao(sorted(lines, key=lambda line: line.split(",")[0]))  # stable: per-user order kept
    assert sorted(brief(grouped)) == sorted(brief(recs))


def test_taobao_reads_files_with_crlf_and_blank_lines(tmp_path):
    path = tmp_path / "events.csv"
    path.write_bytes(f"1,10,7,pv,{T}\r\n\r\n1,10,7,fav,{T + 1}\r\n".encode())
    recs = list(TaobaoBehaviorSource(path))
    assert [e.event_id for e in recs] == [PAGE_ENTER, "fav", PAGE_EXIT]
    assert recs[0].contents == {"item_id": "10", "category_id": "7", "behavior": "pv"}


# --------------------------------------------------------------------------------------------------
# Taobao adapter: bad input


BAD_TAOBAO = {
    "too few fields": ("1,10,7,pv", "malformed CSV line: expected 5 comma-separated fields"),
    "too many fields": (f"1,10,7,pv,{T},extra", "malformed CSV line: expected 5 comma-separated fields"),
    "one field": ("garbage", "malformed CSV line"),
    "missing user": (f",10,7,pv,{T}", "missing field: user_id is empty"),
    "missing item": (f"1,,7,pv,{T}", "missing field: item_id is empty"),
    "missing category": (f"1,10, ,pv,{T}", "missing field: category_id is empty"),
    "missing timestamp": ("1,10,7,pv,", "wrong type: timestamp '' is not an integer"),
    "unknown behavior": (f"1,10,7,click,{T}", "bad value: unknown behavior 'click'"),
    "empty behavior": (f"1,10,7,,{T}", "bad value: unknown behavior ''"),
    "float timestamp": (f"1,10,7,pv,{T}.5", "wrong type: timestamp"),
    "text timestamp": ("1,10,7,pv,yesterday", "wrong type: timestamp 'yesterday' is not an integer"),
    "zero timestamp": ("1,10,7,pv,0", "absurd timestamp"),
    "negative timestamp": ("1,10,7,pv,-1511848894", "absurd timestamp"),
    "year 2100": (f"1,10,7,pv,{YEAR_2100}", "absurd timestamp"),
    "milliseconds": (f"1,10,7,pv,{T}000", "absurd timestamp"),
    "backwards": (f"1,10,7,fav,{T - 100}", "timestamp goes backwards"),
}


@pytest.mark.parametrize("case", sorted(BAD_TAOBAO))
def test_taobao_bad_line_is_rejected_with_line_and_reason_and_the_rest_goes_on(case):
    bad, reason = BAD_TAOBAO[case]
    lines = [f"1,10,7,pv,{T}", "", bad, f"1,10,7,buy,{T + 10}", f"2,20,8,pv,{T + 5}"]
    recs = taobao(lines)
    rejected = [r for r in recs if isinstance(r, Rejected)]
    assert len(rejected) == 1
    assert rejected[0].line == 3  # 1-based, blank lines count
    assert rejected[0].raw == bad and rejected[0].source == "<lines>"
    assert rejected[0].reason.startswith(reason), rejected[0].reason
    events = [r for r in recs if isinstance(r, Event)]
    assert [(e.user_id, e.event_id, e.ts) for e in events] == [
        ("1", PAGE_ENTER, T), ("1", "buy", T + 10), ("2", PAGE_ENTER, T + 5), ("1", PAGE_EXIT, T + 10),
        ("2", PAGE_EXIT, T + 5)]


def test_taobao_rejected_records_keep_their_place_in_file_order(tmp_path):
    path = tmp_path / "mixed.csv"
    path.write_text(f"1,10,7,pv,{T}\nbad\n1,10,7,fav,{T + 1}\n1,10,7,pv,0\n")
    recs = list(TaobaoBehaviorSource(path))
    assert brief(recs) == [("1", PAGE_ENTER, "10", T), ("REJECTED", 2), ("1", "fav", "10", T + 1), ("REJECTED", 4),
                           ("1", PAGE_EXIT, "10", T + 1)]
    assert recs[1].source == str(path)


def test_taobao_huge_integer_timestamp_is_rejected_not_a_crash():
    """int(...) of 400 digits fits, float(int(...)) overflows: must be a Rejected, not OverflowError."""
    recs = taobao(["1,10,7,pv," + "9" * 400, f"1,10,7,pv,{T}"])
    assert isinstance(recs[0], Rejected) and recs[0].line == 1
    assert [e.event_id for e in recs[1:]] == [PAGE_ENTER, PAGE_EXIT]


def test_taobao_timestamp_with_digit_separators_is_not_an_integer():
    """Python's int() accepts '1_511_848_894'; a CSV timestamp with underscores is malformed."""
    recs = taobao(["1,10,7,pv,1_511_848_894"])
    assert len(recs) == 1 and isinstance(recs[0], Rejected)
    assert recs[0].reason.startswith("wrong type: timestamp")


# --------------------------------------------------------------------------------------------------
# JSON-lines source


def test_jsonl_id_normalisation():
    # ts=5 (the JsonLinesSource docstring example) is 1970: rejected as absurd, as the guard documents
    recs = jsonl([jline(user_id=1, event_id="fav", page_id="item", ts=5)])
    assert isinstance(recs[0], Rejected) and recs[0].reason.startswith("absurd timestamp")
    assert "5.0" in recs[0].reason
    recs = jsonl([jline(user_id=1, event_id="fav", page_id=3, ts=T, contents={"item_id": "9"}),
                  jline(user_id="u2", event_id="buy", page_id="item", ts=T + 0.25),
                  jline(user_id="u2", event_id="buy", page_id="item", ts=T + 1, contents=None)])
    assert recs == [Event("1", "fav", "3", float(T), {"item_id": "9"}), Event("u2", "buy", "item", T + 0.25, {}),
                    Event("u2", "buy", "item", float(T + 1), {})]
    assert isinstance(recs[0].ts, float)


BASE = {"user_id": "u", "event_id": "fav", "page_id": "item", "ts": T}


def _with(**changes):
    obj = {**BASE, **changes}
    return json.dumps({k: v for k, v in obj.items() if v is not _DROP})


_DROP = object()

BAD_JSONL = {
    "malformed json": ('{"user_id": "u", "event_id": ', "malformed JSON"),
    "trailing garbage": (_with() + " x", "malformed JSON"),
    "single quotes": ("{'user_id': 'u'}", "malformed JSON"),
    "array": ('[1, 2, 3]', "wrong type: expected a JSON object, got list"),
    "string": ('"hello"', "wrong type: expected a JSON object, got str"),
    "number": ("42", "wrong type: expected a JSON object, got int"),
    "null": ("null", "wrong type: expected a JSON object, got NoneType"),
    "missing user_id": (_with(user_id=_DROP), "missing field: user_id"),
    "missing ts and page": (_with(ts=_DROP, page_id=_DROP), "missing field: page_id, ts"),
    "empty object": ("{}", "missing field: user_id, event_id, page_id, ts"),
    "user_id float": (_with(user_id=1.5), "wrong type: user_id"),
    "user_id bool": (_with(user_id=True), "wrong type: user_id"),
    "user_id null": (_with(user_id=None), "wrong type: user_id"),
    "event_id list": (_with(event_id=["fav"]), "wrong type: event_id"),
    "page_id object": (_with(page_id={"p": 1}), "wrong type: page_id"),
    "event_id empty": (_with(event_id=""), "wrong type: event_id"),
    "ts string": (_with(ts=str(T)), "wrong type: ts must be a number"),
    "ts bool": (_with(ts=True), "wrong type: ts"),
    "ts null": (_with(ts=None), "wrong type: ts"),
    "contents list": (_with(contents=[1]), "wrong type: contents must be a JSON object, got list"),
    "contents string": (_with(contents="x"), "wrong type: contents must be a JSON object, got str"),
    "ts zero": (_with(ts=0), "absurd timestamp"),
    "ts negative": (_with(ts=-T), "absurd timestamp"),
    "ts year 2100": (_with(ts=YEAR_2100), "absurd timestamp"),
    "ts NaN": (_with().replace(str(T), "NaN"), "absurd timestamp"),
    "ts Infinity": (_with().replace(str(T), "Infinity"), "absurd timestamp"),
    "ts -Infinity": (_with().replace(str(T), "-Infinity"), "absurd timestamp"),
    "ts 1e400": (_with().replace(str(T), "1e400"), "absurd timestamp"),
    "backwards": (_with(ts=T - 1), "timestamp goes backwards"),
}


@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_jsonl_bad_line_is_rejected_with_line_and_reason_and_the_rest_goes_on(case):
    bad, reason = BAD_JSONL[case]
    lines = [_with(), "   ", bad, _with(event_id="buy", ts=T + 3)]
    recs = jsonl(lines)
    assert [type(r).__name__ for r in recs] == ["Event", "Rejected", "Event"]
    rejected = recs[1]
    assert (rejected.line, rejected.raw, rejected.source) == (3, bad, "<lines>")
    assert rejected.reason.startswith(reason), rejected.reason
    assert recs[2] == Event("u", "buy", "item", float(T + 3), {})


def test_jsonl_nan_timestamp_is_named_in_the_reason():
    recs = jsonl([_with().replace(str(T), "NaN")])
    assert "nan" in recs[0].reason


def test_jsonl_huge_integer_timestamp_is_rejected_not_a_crash():
    """``"ts": 10**400`` is a valid JSON number; float() of it overflows: must be a Rejected."""
    recs = jsonl([_with().replace(str(T), "9" * 400), _with()])
    assert [type(r).__name__ for r in recs] == ["Rejected", "Event"]
    assert recs[0].line == 1


def test_jsonl_huge_integer_id_is_rejected_not_a_crash():
    """json.loads raises a plain ValueError (int digit limit), not JSONDecodeError, for a 5000-digit id."""
    recs = jsonl([_with(user_id=0).replace('"user_id": 0', '"user_id": ' + "9" * 5000), _with()])
    assert [type(r).__name__ for r in recs] == ["Rejected", "Event"]


def test_jsonl_deeply_nested_line_is_rejected_not_a_crash():
    """A line of 100,000 '[' is malformed JSON; json.loads raises RecursionError on it."""
    recs = jsonl(["[" * 100_000, _with()])
    assert [type(r).__name__ for r in recs] == ["Rejected", "Event"]
    assert recs[0].line == 1


def test_jsonl_reads_a_file(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(_with() + "\n\n" + "{oops\n" + _with(ts=T + 1) + "\n")
    recs = list(JsonLinesSource(path))
    assert [type(r).__name__ for r in recs] == ["Event", "Rejected", "Event"]
    assert (recs[1].source, recs[1].line) == (str(path), 3)


# --------------------------------------------------------------------------------------------------
# open_source


def test_open_source_by_extension_and_format(tmp_path):
    for name, cls in [("a.csv", TaobaoBehaviorSource), ("a.jsonl", JsonLinesSource), ("a.json", JsonLinesSource),
                      ("a.NDJSON", JsonLinesSource)]:
        (tmp_path / name).write_text("")
        assert type(open_source(tmp_path / name)) is cls
    (tmp_path / "events.txt").write_text(_with() + "\n")
    src = open_source(tmp_path / "events.txt", "jsonl")
    assert isinstance(src, JsonLinesSource) and [type(r) for r in src] == [Event]
    assert type(open_source(tmp_path / "a.csv", "jsonl")) is JsonLinesSource


def test_open_source_errors(tmp_path):
    (tmp_path / "events.txt").write_text("")
    with pytest.raises(ValueError, match="cannot tell the format"):
        open_source(tmp_path / "events.txt")
    with pytest.raises(ValueError, match="unknown event format 'xml'"):
        open_source(tmp_path / "events.txt", "xml")
    with pytest.raises(FileNotFoundError, match="events file not found"):
        open_source(tmp_path / "missing.csv")


# --------------------------------------------------------------------------------------------------
# through the device runner: dead_letter table, summary counters, the run goes on


@pytest.fixture(scope="module")
def ipv_job():
    return load_job("jobs/ipv.py")


def _run(job, source, db):
    with CollectiveStorage(db) as store:
        runner = DeviceRunner(job, store)
        summary = runner.run(source)
        runner.close()
        dead = store.query("SELECT source, line, reason, raw FROM dead_letter ORDER BY line") \
            if "dead_letter" in store.tables() else []
        tables = store.tables()
        rows = {t: store.read(t).to_pylist() for t in tables if t != "dead_letter"}
    return summary, dead, rows


def test_each_bad_taobao_line_lands_in_dead_letter_and_good_records_around_it_produce_ipv_rows(ipv_job, tmp_path):
    cases = sorted(BAD_TAOBAO)
    lines = [f"1,10,7,pv,{T}"]  # user 1's open page; the bad lines are user 1's (or no one's)
    for i, case in enumerate(cases):  # every bad line between two good records of another user
        lines += [f"g{i},{100 + i},7,pv,{T + i}", BAD_TAOBAO[case][0], f"g{i},{100 + i},7,buy,{T + i + 10}"]
    path = tmp_path / "events.csv"
    path.write_text("\n".join(lines) + "\n")
    summary, dead, rows = _run(ipv_job, open_source(path), tmp_path / "f.duckdb")

    assert len(dead) == len(cases)
    for i, (case, (source, line, reason, raw)) in enumerate(zip(cases, dead, strict=True)):
        bad, expected_reason = BAD_TAOBAO[case]
        assert (source, line, raw) == (str(path), 3 + 3 * i, bad), case
        assert reason.startswith(expected_reason), (case, reason)
    assert summary.rejected_total == len(cases) == summary.rows_written["dead_letter"]
    assert summary.events_in == 2 + 3 * len(cases)  # user 1: enter, exit; each g user: enter, buy, exit
    ipv = sorted((r["user_id"], r["item_id"], r["dwell_s"], r["n_reload"], r["n_buy"]) for r in rows["ipv"])
    assert ipv == sorted([("1", "10", 0.0, 0, 0)] + [(f"g{i}", str(100 + i), 10.0, 0, 1) for i in range(len(cases))])
    assert summary.rows_written["ipv"] == 1 + len(cases)
    text = str(summary)
    assert f"rejected records {len(cases)}" in text and "dead_letter" in text
    assert "malformed CSV line" in text and "timestamp goes backwards" in text


def test_each_bad_jsonl_line_lands_in_dead_letter_and_the_run_goes_on(tmp_path):
    cases = sorted(BAD_JSONL)
    job = Job("favs", [Task("favs", ["fav"], [Aggregate(n=Count(), ts=LastN("ts", 2))], input="recent")])
    lines = []
    for i, case in enumerate(cases):
        lines += [_with(ts=T + i), BAD_JSONL[case][0]]
    lines.append(_with(ts=T + len(cases)))
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    summary, dead, rows = _run(job, open_source(path), tmp_path / "f.duckdb")

    assert len(dead) == len(cases)
    for i, (case, (source, line, reason, raw)) in enumerate(zip(cases, dead, strict=True)):
        bad, expected_reason = BAD_JSONL[case]
        assert (source, line, raw) == (str(path), 2 + 2 * i, bad), case
        assert reason.startswith(expected_reason), (case, reason)
    assert summary.rejected_total == len(cases) and summary.events_in == len(cases) + 1
    assert [(r["user_id"], r["n"]) for r in rows["favs"]] == [("u", n) for n in range(1, len(cases) + 2)]
    assert rows["favs"][-1]["ts"] == [T + len(cases) - 1, T + len(cases)]


def test_bad_utf8_line_goes_to_dead_letter_and_the_rest_of_the_file_is_read(ipv_job, tmp_path):
    """A line that is not valid UTF-8 is not rewritten (it used to be read with errors="replace" and
    its item id silently became '10\ufffd\ufffd'): it is rejected with the byte offset and the bad
    bytes, its raw text kept with those bytes escaped; valid UTF-8 (also multi-byte) reads normally."""
    path = tmp_path / "events.csv"
    path.write_bytes(b"\n".join([
        f"1,10,7,pv,{T}".encode(),
        f"2,10,7,pv,{T}".encode().replace(b"10", b"10\xff\xfe", 1),  # item id with invalid bytes
        f"3,caf\u00e9,7,pv,{T}".encode(),  # valid two-byte UTF-8
        f"4,20,7,pv,{T}".encode() + b"\xc3",  # a multi-byte sequence cut short at the end of the line
        f"1,10,7,buy,{T + 4}".encode(),
    ]) + b"\n")
    summary, dead, rows = _run(ipv_job, open_source(path), tmp_path / "f.duckdb")

    assert dead == [
        (str(path), 2, "invalid UTF-8: invalid start byte b'\\xff' at byte 4 of the line", f"2,10\\xff\\xfe,7,pv,{T}"),
        (str(path), 4, f"invalid UTF-8: unexpected end of data b'\\xc3' at byte {len(f'4,20,7,pv,{T}')} of the line",
         f"4,20,7,pv,{T}\\xc3"),
    ]
    assert summary.rejected == {"invalid UTF-8": 2}
    ipv = sorted((r["user_id"], r["item_id"], r["n_buy"]) for r in rows["ipv"])
    assert ipv == [("1", "10", 1), ("3", "caf\u00e9", 0)]
    # in-memory lines cannot hold bad bytes, but can hold a lone surrogate no encoder takes
    recs = taobao([f"1,10\ud800,7,pv,{T}", f"1,10,7,pv,{T}"])
    assert recs[0].reason == "invalid UTF-8: unpaired surrogate '\\ud800' at character 4 of the line"
    assert [e.event_id for e in recs[1:]] == [PAGE_ENTER, PAGE_EXIT]


def test_runner_rejects_absurd_and_backward_events_given_directly(tmp_path):
    """Events that bypass a source still meet the runner's own TimestampGuard."""
    job = Job("favs", [Task("favs", ["fav"], [Aggregate(n=Count())], input="recent")])
    events = [Event("u", "fav", "item", float(T)), Event("u", "fav", "item", 0.0),
              Event("u", "fav", "item", float(T - 5)), Event("u", "fav", "item", math.nan),
              Event("u", "fav", "item", float(T + 1))]
    summary, dead, rows = _run(job, events, tmp_path / "f.duckdb")
    assert summary.events_in == 2 and summary.rejected_total == 3
    assert [d[0] for d in dead] == ["runner"] * 3
    reasons = [d[2] for d in dead]
    assert sum(r.startswith("absurd timestamp") for r in reasons) == 2
    assert sum(r.startswith("timestamp goes backwards") for r in reasons) == 1
    assert all(json.loads(d[3])["user_id"] == "u" for d in dead)
    assert [r["n"] for r in rows["favs"]] == [1, 2]


# --------------------------------------------------------------------------------------------------
# Taobao adapter: each line's own event keeps the line's behaviour (issue 23, defect 4)

SAMPLE = Path(__file__).resolve().parents[1] / "jobs" / "data" / "taobao_user_behavior_10k.csv"
TAOBAO_BEHAVIORS = {"pv", "fav", "cart", "buy"}


def test_taobao_the_event_a_line_becomes_carries_its_behavior_and_no_other_does():
    recs = taobao([f"1,10,7,pv,{T}", f"1,10,7,pv,{T + 5}", f"1,10,7,fav,{T + 9}", f"1,20,8,cart,{T + 12}",
                   f"1,30,9,pv,{T + 20}", f"1,30,9,buy,{T + 21}"])
    assert [(e.event_id, e.behavior) for e in recs] == [
        (PAGE_ENTER, "pv"), ("pv", "pv"), ("fav", "fav"),
        (PAGE_EXIT, None), (PAGE_ENTER, None), ("cart", "cart"),  # the implicit enter is not the cart line
        (PAGE_EXIT, None), (PAGE_ENTER, "pv"), ("buy", "buy"), (PAGE_EXIT, None)]
    assert [e.behavior for e in recs] == [e.contents.get("behavior") for e in recs]
    assert [e.event_id for e in recs if e.contents.get("implicit")] == [PAGE_ENTER]
    # read as a row field too, where it is there
    assert recs[0]["behavior"] == "pv"
    with pytest.raises(KeyError, match="has no field 'behavior'"):
        recs[3]["behavior"]


def test_jsonl_events_carry_only_what_their_line_has():
    a, b = jsonl([jline(user_id="u", event_id="fav", page_id="item", ts=T, contents={"item_id": "1"}),
                  jline(user_id="u", event_id="x", page_id="p", ts=T, contents={"behavior": "fav"})])
    assert (a.behavior, a.contents) == (None, {"item_id": "1"})
    assert b.behavior == "fav"


def _sample_behaviors() -> Counter:
    """An independent count of the sample's behaviour column (the CSV's 4th field)."""
    with open(SAMPLE, newline="") as f:
        return Counter(row[3] for row in csv.reader(f))


def test_a_filter_on_behavior_counts_every_line_of_the_sample_once(tmp_path):
    """The first filter a Taobao user writes: over ``event_id`` it keeps ~1% of the views (a view that opens a
    page is a page_enter); over ``behavior`` it keeps exactly one event per line."""
    lines = Task("lines", None, input="stream", pipeline=[
        Filter(lambda e: e.behavior in TAOBAO_BEHAVIORS), KeyBy("behavior"), TimeWindow(10 ** 9), Aggregate(n=Count())])
    per_page = Task("per_page", ["item"], [Aggregate(
        pv=Count(where=lambda e: e.behavior == "pv"), fav=Count(where=lambda e: e.behavior == "fav"),
        cart=Count(where=lambda e: e.behavior == "cart"), buy=Count(where=lambda e: e.behavior == "buy"))])
    with CollectiveStorage(tmp_path / "f.duckdb") as store:
        runner = DeviceRunner(Job("j", [lines, per_page]), store)
        summary = runner.run(open_source(SAMPLE))
        runner.close()
        assert summary.rejected == {} and sum(s.errors for s in summary.task_stats.values()) == 0
        counted = dict(store.query("SELECT behavior, sum(n)::INT FROM lines GROUP BY ALL"))
        summed = store.query("SELECT sum(pv)::INT, sum(fav)::INT, sum(cart)::INT, sum(buy)::INT FROM per_page")[0]
    expected = _sample_behaviors()
    assert counted == dict(expected) and sum(expected.values()) == 10_000
    assert dict(zip(("pv", "fav", "cart", "buy"), summed, strict=True)) == dict(expected)


def test_every_path_gives_the_same_events_with_their_behavior():
    """The source's fast loop (default guard, no TTL), its per-line step (a guard of the caller's own) and
    ``item_page_events`` per line give the same events, contents included."""
    fast = list(open_source(SAMPLE))
    per_line = list(TaobaoBehaviorSource(SAMPLE, guard=_OwnGuard()))
    state: dict = {}
    by_function = []
    with open(SAMPLE, newline="") as f:
        for user, item, category, behavior, ts in csv.reader(f):
            state[user], events = item_page_events(state.get(user), user, item, category, behavior, float(ts),
                                                   DEFAULT_INACTIVITY_GAP_S)
            by_function += events
    by_function += [page_exit(user, page, page.last_ts) for user, page in state.items()]
    assert fast == per_line == by_function
    assert Counter(e.behavior for e in fast if e.behavior is not None) == _sample_behaviors()


class _OwnGuard(TimestampGuard):
    """The default checks, as a guard of the caller's own (so the source reads line by line)."""


def test_the_readme_worked_example_is_what_the_source_gives():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("```\n1,10,7,pv,", 1)[1].split("```", 1)[0]
    lines, documented = [], []
    for text in ("1,10,7,pv," + block).splitlines():
        if "→" in text:
            line, text = (part.strip() for part in text.split("→"))
            if not line.startswith("("):
                lines.append(line)
        words = text.split()
        documented.append((words[0], words[2], words[words.index("behavior") + 1] if "behavior" in words else None,
                           "implicit" in words))
    assert [(e.event_id, e["item_id"], e.behavior, e.contents.get("implicit", False)) for e in taobao(lines)
            ] == documented


# --------------------------------------------------------------------------------------------------
# Taobao adapter: the parse fast path


_LINE_PARTS = st.sampled_from(["1", "10", "7", "999477", "pv", "fav", "cart", "buy", "click", "PV", "1511848894",
                               "-5", "1.5", "0" * 16, "\u0661\u0662", " ", "\t", "\u3000", "\x1c", "", "a b", "_"])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(_LINE_PARTS, max_size=3).map("".join), min_size=1, max_size=7).map(",".join))
def test_taobao_parse_fast_path_gives_what_the_field_checks_give(raw):
    assert TaobaoBehaviorSource.parse(raw) == TaobaoBehaviorSource.parse_checked(raw)


def test_taobao_parse_fast_path_keeps_the_clean_line_fields():
    assert TaobaoBehaviorSource.parse(f"1,10,7,cart,{T}") == ("1", "10", "7", "cart", float(T))
    assert TaobaoBehaviorSource.parse(f" 1,10,7,cart,{T}") == ("1", "10", "7", "cart", float(T))  # stripped


# --------------------------------------------------------------------------------------------------
# Blocks: what the device runner reads a file in


_TAOBAO_LINES = st.lists(st.one_of(
    st.builds(lambda user, item, behavior, step: f"{user},{item},7,{behavior},{T + step}",
              st.sampled_from(["1", "2"]), st.sampled_from(["10", "11"]), st.sampled_from(["pv", "fav", "buy"]),
              st.sampled_from([0, 5, 4000, -3])),
    st.sampled_from(["", "1,10,7,nap,1511848894", " 2, 10 ,7,pv,1511848899", "garbage"])), max_size=25)


def _describe(record):
    return ("REJECTED", record.line, record.reason) if isinstance(record, Rejected) else record


@settings(max_examples=150, deadline=None)
@given(lines=_TAOBAO_LINES, size=st.sampled_from([1, 2, 3, 64]), own_guard=st.booleans(),
       cut=st.integers(min_value=0, max_value=30))
def test_blocks_hold_the_records_in_order_end_on_lines_and_resume_after_any_block(lines, size, own_guard, cut):
    """``SourceReader.blocks(size)``, on the fast loop and on the per-line step: the records iterating gives,
    in lists of at least ``size`` (but the last), each list ending a line; a reader resumed after any
    list's last record gives the rest."""
    def source():
        return TaobaoBehaviorSource.from_lines(lines, guard=_OwnGuard() if own_guard else None)

    expected = [_describe(r) for r in source()]
    reader = source().read()
    blocks = list(reader.blocks(size))
    assert [_describe(r) for block in blocks for r in block] == expected
    assert all(len(block) >= size for block in blocks[:-1])
    if size == 1:  # one line's records each: a line number per list
        lines_of = [{r.line for r in block if isinstance(r, Rejected)} for block in blocks]
        assert all(len(numbers) <= 1 for numbers in lines_of)
    if not blocks:
        return
    stop = cut % len(blocks)
    reader = source().read()
    taken = []
    for block in reader.blocks(size):
        taken += block
        if len(taken) >= sum(len(b) for b in blocks[:stop + 1]):
            position = reader.position_after(block[-1])
            break
    rest = list(source().read(position))
    assert [_describe(r) for r in taken + rest] == expected
