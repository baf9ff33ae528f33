"""Batch mode a chunk of the file at a time (streamflow.runners.batch, issue 24 item 3): with chunks of a few bytes,
so that users, their open pages and their guard state straddle many borders and bad lines fall on them, the rows,
dead letters, counters and row order equal the streaming run's."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connectors import CollectiveStorage
from streamflow import Job
from streamflow.runners import DeviceRunner, batch
from streamflow.sources import TaobaoBehaviorSource
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


def test_a_later_chunk_batch_mode_cannot_compute_stops_the_run(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    csv = tmp_path / "in.csv"
    csv.write_text("7,10,30,pv,1511848800\n7, 10,30,pv,1511848900\n")  # the second is taken after trimming
    monkeypatch.setattr(batch, "CHUNK_BYTES", 1)
    runner = DeviceRunner(Job("j", [IPV]), CollectiveStorage(tmp_path / "b.duckdb"), runtime_mode="batch")
    with pytest.raises(RuntimeError, match="taken only after trimming"):
        runner.run(TaobaoBehaviorSource(csv))
