"""Batch mode a chunk of the file at a time (streamflow.runners.batch, issue 24 item 3): with chunks of a few bytes,
so that users, their open pages and their guard state straddle many borders and bad lines fall on them, the rows,
dead letters, counters and row order equal the streaming run's."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from operators import Aggregate, Count, CountBy, Map
from streamflow import Task
from streamflow.runners import batch
from tests.test_batch import _DIRTY, _USERS, COUNTS, IPV, REPO, T0, _clockless, _run

#: chunk sizes in bytes: one line or less a chunk (a line longer than the chunk is read whole), a few lines
_CHUNKS = st.sampled_from([1, 17, 40, 64, 150, 1000])


def _compare(tmp_path: Path, lines: list[str], chunk_bytes: int, monkeypatch: pytest.MonkeyPatch) -> dict:
    csv = tmp_path / "in.csv"
    csv.write_text("".join(line + "\n" for line in lines), errors="surrogateescape")
    for db in tmp_path.glob("*.duckdb*"):
        db.unlink()
    streamed, stream_tables = _run(csv, tmp_path / "s.duckdb", [IPV, COUNTS], "streaming")
    with monkeypatch.context() as patch:
        patch.setattr(batch, "CHUNK_BYTES", chunk_bytes)
        batched, batch_tables = _run(csv, tmp_path / "b.duckdb", [IPV, COUNTS], "batch")
    assert batched.runtime_mode == "batch"
    assert _clockless(batch_tables) == _clockless(stream_tables)
    assert (batched.events_in, batched.rejected, batched.rows_written) == (
        streamed.events_in, streamed.rejected, streamed.rows_written)
    assert {n: vars(s) for n, s in batched.task_stats.items()} == {n: vars(s) for n, s in streamed.task_stats.items()}
    return batch_tables


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_USERS, st.lists(st.tuples(st.integers(0, 40), _DIRTY), max_size=8), _CHUNKS)
def test_chunks_give_the_streaming_rows_with_dirty_lines_on_the_borders(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: list, dirty: list, chunk_bytes: int) -> None:
    clock: dict[str, int] = {}
    lines = []
    for user, item, behavior, gap in steps:  # per user never backwards; users interleave; gaps past the page's
        clock[user] = clock.get(user, T0) + gap
        lines.append(f"{user},{item},c{len(item)},{behavior},{clock[user]}")
    for at, line in dirty:  # bad lines, blank lines and steps back in time anywhere, so on chunk borders too
        lines.insert(min(at, len(lines)), line.format(ts=T0 + 10 * at, early=T0 - 3600 + at))
    _compare(tmp_path, lines, chunk_bytes, monkeypatch)


@pytest.mark.parametrize("chunk_bytes", [1, 333, 4096])
def test_the_shared_sample_in_chunks_gives_the_streaming_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              chunk_bytes: int) -> None:
    lines = (REPO / "jobs" / "data" / "taobao_user_behavior_10k.csv").read_text().splitlines()[:2000]
    lines[5:5] = ["7,10,30,nap,1511848900", "", "7,10,30,pv,5"]
    tables = _compare(tmp_path, lines, chunk_bytes, monkeypatch)
    assert len(tables["dead_letter"][1]) == 2


def test_a_file_without_a_last_line_break_or_any_good_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    csv = tmp_path / "in.csv"
    csv.write_text("7,10,30,pv,1511848800\n7,10,30,buy,1511848900")
    for chunk_bytes in (1, 30, 10_000):
        for db in tmp_path.glob("*.duckdb*"):
            db.unlink()
        with monkeypatch.context() as patch:
            patch.setattr(batch, "CHUNK_BYTES", chunk_bytes)
            summary, tables = _run(csv, tmp_path / "b.duckdb", [IPV], "batch")
        assert (summary.events_in, len(tables["ipv"][1])) == (3, 1)  # enter, buy, exit
    _compare(tmp_path, ["x,y", "", "7,10,30,nap,1511848900"], 5, monkeypatch)


@pytest.mark.parametrize("bad", [
    "7, 10,30,pv,{ts}",  # taken only after trimming it
    "7,10,30\r,pv,{ts}",  # a lone carriage return
    "7\u00e9,10,30,pv,{ts}",  # taken only after decoding it
])
@pytest.mark.parametrize("at", [1, 3, 6])
def test_what_a_later_chunk_cannot_compute_streams_from_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               bad: str, at: int) -> None:
    lines = [f"{u},{i},30,{b},{T0 + 100 * n}" for n, (u, i, b) in enumerate(
        [("7", "10", "pv"), ("8", "10", "pv"), ("7", "10", "buy"), ("8", "11", "cart"), ("9", "10", "pv"),
         ("7", "12", "pv"), ("8", "11", "pv"), ("9", "10", "fav")])]
    lines.insert(at, bad.format(ts=T0 + 100 * at + 50))
    _compare(tmp_path, lines, 30, monkeypatch)


def test_a_step_a_later_chunk_cannot_compute_streams_from_there(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A zero divisor only in a later chunk: that task raises per row when streaming (task errors)."""
    task = Task("ratio", ["item"], [Aggregate(n=Count(), kinds=CountBy("event_id")),
                                    Map(lambda row: {"per_pv": row["n"] / row["kinds"].get("pv", 0)})], input="page")
    lines = [f"{u},{i},30,pv,{T0 + 100 * n}" for n, (u, i) in enumerate([("7", "10"), ("8", "10"), ("7", "10")])]
    lines += [f"9,10,30,buy,{T0 + 1000}", f"9,11,30,pv,{T0 + 1100}", f"7,13,30,pv,{T0 + 1200}"]
    csv = tmp_path / "in.csv"
    csv.write_text("".join(line + "\n" for line in lines))
    streamed, stream_tables = _run(csv, tmp_path / "s.duckdb", [task], "streaming")
    monkeypatch.setattr(batch, "CHUNK_BYTES", 60)
    batched, batch_tables = _run(csv, tmp_path / "b.duckdb", [task], "batch")
    assert "task_errors" in stream_tables
    assert _without_times(batch_tables) == _without_times(stream_tables)
    assert (batched.events_in, batched.rows_written) == (streamed.events_in, streamed.rows_written)
    assert {n: vars(s) for n, s in batched.task_stats.items()} == {n: vars(s) for n, s in streamed.task_stats.items()}


def _without_times(tables: dict) -> dict:
    """The tables without task errors' times and tracebacks' line numbers of the generated code."""
    columns, rows = tables.get("task_errors", ((), ()))
    names = [name for name, _ in columns]
    keep = [k for k, name in enumerate(names) if name not in ("ts", "error_ts", "traceback", "failed_at")]
    return {**tables, "task_errors": [tuple(row[k] for k in keep) for row in rows]}
