"""Batch mode over JSON lines (streamflow.jsonl_columns, streamflow.runners.batch_jsonl; issue 24 item 2): the same
trigger jobs over the same JSON-lines files, streaming and in batch mode, with bad lines of every kind and chunks
of a few bytes, give the same rows in the same order, the same dead letters (reason, line, text) and counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamflow.runners import batch
from streamflow.sources import JsonLinesSource, TaobaoBehaviorSource
from tests.test_batch import COUNTS, IPV, REPO, T0, _assert_same_run, _run


def _compare(tmp_path: Path, lines: list[str], chunk_bytes: int, monkeypatch: pytest.MonkeyPatch,
             expect: str = "batch") -> dict:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line + "\n" for line in lines), errors="surrogateescape")
    for db in tmp_path.glob("*.duckdb*"):
        db.unlink()
    streamed, stream_tables = _run(JsonLinesSource(path), tmp_path / "s.duckdb", [IPV, COUNTS], "streaming")
    with monkeypatch.context() as patch:
        patch.setattr(batch, "CHUNK_BYTES", chunk_bytes)
        batched, batch_tables = _run(JsonLinesSource(path), tmp_path / "b.duckdb", [IPV, COUNTS], "automatic")
    _assert_same_run(batched, batch_tables, streamed, stream_tables, expect)
    return batch_tables


def _line(user: str | int, event: str, page: str, ts: float | int, **contents: object) -> str:
    return json.dumps({"user_id": user, "event_id": event, "page_id": page, "ts": ts, "contents": contents})


#: Lines the streaming parser rejects, or takes only line by line ({ts}: a plausible time, {early}: one before it)
_BAD = st.sampled_from([
    '{"user_id": "7", "event_id": "pv", ',  # invalid JSON
    '{"user_id": "7", "event_id": "pv", "page_id": "item"}',  # a missing field
    '{"user_id": "7", "event_id": "pv", "page_id": "item", "ts": "x"}',  # a wrong type
    '{"user_id": "", "event_id": "pv", "page_id": "item", "ts": {ts}}',  # an empty id
    '{"user_id": true, "event_id": "pv", "page_id": "item", "ts": {ts}}',
    '{"user_id": "7", "event_id": "pv", "page_id": "item", "ts": 5, "contents": {"item_id": "10", "category_id": "c"}}',
    '{"user_id": "7", "event_id": "pv", "page_id": "item", "ts": 99999999999999999999}',  # absurd
    '{"user_id": "7", "event_id": "pv", "page_id": "item", "ts": NaN}',
    '{"user_id": "7", "event_id": "pv", "page_id": "item", "ts": {ts}, "contents": []}',
    '{"user_id": "7\udcff", "event_id": "pv", "page_id": "item", "ts": {ts}}',  # bad UTF-8
    '{"user_id": "7", "event_id": "page_exit", "page_id": "item", "ts": {early}, '
    '"contents": {"item_id": "10", "category_id": "c"}}',  # backwards
    '{"user_id": "7", "event_id": "pv", "page_id": "item", "ts": {ts}}{"a": 1}',  # two values
    '[1, 2]', '"text"', '', '   ', '{}',
    # nested too deep for json.loads, an integer too long for it
    '{"user_id": "7", "event_id": "pv", "page_id": "item", "ts": {ts}, "x": ' + "9" * 4400 + "}",
    '{"user_id": "7", "event_id": "pv", "page_id": "item", "ts": {ts}, "x": ' + "[" * 3000 + "]" * 3000 + "}",
    # taken, but only line by line: integer ids, spaces around, an escape, non-ASCII text, duplicate keys
    '{"user_id": 7, "event_id": "fav", "page_id": "item", "ts": {ts}, "contents": '
    '{"item_id": "10", "category_id": "c"}}',
    ' {"user_id": "7", "event_id": "fav", "page_id": "item", "ts": {ts}, "contents": '
    '{"item_id": "10", "category_id": "c"}} ',
    '{"user_id": "\\u0037", "event_id": "cart", "page_id": "item", "ts": {ts}, "contents": '
    '{"item_id": "10", "category_id": "c"}}',
    '{"user_id": "7", "event_id": "buy", "page_id": "item", "ts": {ts}, "contents": '
    '{"item_id": "10", "category_id": "caf\u00e9", "category_id": "c"}}',
])

_EVENTS = st.lists(st.tuples(st.sampled_from(["7", "007", "u9", "user-with-a-long-id-0001"]),
                             st.sampled_from(["page_enter", "page_exit", "pv", "fav", "buy", "nap"]),
                             st.sampled_from(["item", "item", "home"]),
                             st.sampled_from(["10", "11", "item:a-much-longer-identifier"]),
                             st.sampled_from([0, 0, 5, 60, 1801])), min_size=1, max_size=40)
_CHUNKS = st.sampled_from([1, 40, 150, 1000, 1 << 20])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_EVENTS, st.lists(st.tuples(st.integers(0, 40), _BAD), max_size=8), _CHUNKS)
def test_jsonl_batch_gives_the_streaming_rows_with_bad_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             events: list, bad: list, chunk_bytes: int) -> None:
    clock: dict[str, int] = {}
    lines = []
    for user, event, page, item, gap in events:  # per user never backwards; users interleave
        clock[user] = clock.get(user, T0) + gap
        lines.append(_line(user, event, page, clock[user], item_id=item, category_id="c" + item[-1]))
    for at, line in bad:  # anywhere, so on chunk borders too
        lines.insert(min(at, len(lines)), line.replace("{ts}", str(T0 + 10 * at)).replace("{early}", str(T0 - 99)))
    _compare(tmp_path, lines, chunk_bytes, monkeypatch)


@pytest.mark.parametrize("chunk_bytes", [333, 1 << 20])
def test_the_shared_sample_as_app_events_gives_the_streaming_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  chunk_bytes: int) -> None:
    csv = tmp_path / "in.csv"
    csv.write_text("\n".join((REPO / "jobs" / "data" / "taobao_user_behavior_10k.csv").read_text().splitlines()[:1500]))
    lines = [json.dumps(e.to_dict()) for e in TaobaoBehaviorSource(csv)]
    lines[5:5] = ['{"user_id": "7"}', "", _line("7", "pv", "item", 5), _line(8, "page_enter", "item", T0,
                                                                                item_id="1", category_id="2")]
    tables = _compare(tmp_path, lines, chunk_bytes, monkeypatch)
    assert len(tables["dead_letter"][1]) == 2 and len(tables["ipv"][1]) > 500


def test_a_contents_key_that_is_not_text_makes_the_run_stream(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [_line("7", "page_enter", "item", T0, item_id="10", category_id="c"),
             _line("7", "page_exit", "item", T0 + 5, item_id=10, category_id="c")]
    _compare(tmp_path, lines, 1 << 20, monkeypatch, expect="streaming")
    many = [_line("7", "page_enter", "item", T0 + i, item_id="10", category_id="c") for i in range(50)]
    _compare(tmp_path, many + lines[1:], 200, monkeypatch, expect="batch")  # the chunks before ran in batch mode


def test_a_lone_carriage_return_streams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [_line("7", "page_enter", "item", T0, item_id="10\r", category_id="c"),
             _line("7", "page_exit", "item", T0 + 5, item_id="10", category_id="c")]
    lines[0] = lines[0].replace("\\r", "\r")
    _compare(tmp_path, lines, 1 << 20, monkeypatch, expect="streaming")
