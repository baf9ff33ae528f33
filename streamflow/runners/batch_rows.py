"""What the device runner's two batch modes share (:mod:`.batch` over a Taobao CSV, :mod:`.batch_jsonl` over JSON
lines): the timestamp guard over columns and the dead letters it makes, a trigger task's rows from its aggregated
columns, the check of a sample of them against the task's own pipeline, and a chunk's writes and counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from connectors.storage import DEAD_LETTER_TABLE
from operators.base import ElementStep
from streamflow.columnar import Column, TextColumn, run_row_steps, select_rows, to_numpy
from streamflow.csv_columns import Fields
from streamflow.events import Rejected, TimestampGuard
from streamflow.runners.plan import BatchHost, RunPlan


class Lines(Protocol):
    """A chunk's lines as :func:`guarded_lines` reads them (a CSV's :class:`~streamflow.sources.PlainLines`, a
    JSON-lines :class:`~streamflow.jsonl_columns.JsonChunk`): each line's timestamp, number and bytes."""

    @property
    def ts(self) -> np.ndarray: ...

    line_numbers: np.ndarray
    fields: Fields


#: Firings per task and chunk recomputed the streaming way before anything is written.
SAMPLE_FIRINGS = 16


@dataclass
class DeadLetters:
    """Dead letters as columns, in line order: what :meth:`DeviceRunner.reject()
    <streamflow.runners.device.DeviceRunner.reject>` stores of each :class:`~streamflow.events.Rejected`, without
    an object per line (a backfill's bad lines may be many: every line past the guard's clock)."""

    sources: list[str]
    lines: list[int]
    reasons: list[str]
    raws: list[str]

    def __len__(self) -> int:
        return len(self.lines)

    def merged(self, records: list[Rejected]) -> DeadLetters:
        """These and ``records``, in line order."""
        if not records:
            return self
        columns = (self.sources + [r.source for r in records], self.lines + [r.line for r in records],
                   self.reasons + [r.reason for r in records], self.raws + [r.raw for r in records])
        order = np.argsort(np.array(columns[1], dtype=np.int64), kind="stable").tolist()
        return DeadLetters(*([column[i] for i in order] for column in columns))

    def table(self) -> dict[str, np.ndarray]:
        """The dead-letter table's columns."""
        return {"source": np.array(self.sources, dtype=object), "line": np.array(self.lines, dtype=np.int64),
                "reason": np.array(self.reasons, dtype=object), "raw": np.array(self.raws, dtype=object)}


def guarded_lines(lines: Lines, users: TextColumn, guard: TimestampGuard, source: str,
                  last: dict[str, float] | None = None) -> tuple[np.ndarray, DeadLetters]:
    """Which plain lines ``guard`` accepts, and the others as the streaming run rejects them (line by line,
    :meth:`~streamflow.events.TimestampGuard.check`): a timestamp outside its bounds, or earlier than the
    user's previous accepted one. ``(accepted, the others' dead letters in line order)``.

    A user's accepted timestamps never decrease, so the previous accepted one is the largest before it among
    the user's lines within bounds (a line that goes backwards is below it and changes nothing). ``last``:
    each user's last accepted timestamp in the lines before these (a chunk's), updated with these."""
    ts, names = lines.ts, users.dictionary
    accepted = (ts >= guard.min_ts) & (ts <= guard.max_ts)
    reasons: dict[int, str] = {}
    outside = np.flatnonzero(~accepted)
    if len(outside):
        # The guard reads the clock once for the latest of them (a new upper bound, as the streaming run's check of
        # that line would), then every line outside the bounds gets the reason its check gives (streaming reads the
        # clock again at each: the bound in the text may differ by the seconds the run took).
        guard.reason(names[users.codes[outside[0]]], float(ts[outside].max()), None)
        accepted = (ts >= guard.min_ts) & (ts <= guard.max_ts)
        outside = np.flatnonzero(~accepted)
        why = guard.outside_reason
        reasons.update(zip(outside.tolist(), map(why, ts[outside].tolist()), strict=True))
    within = np.flatnonzero(accepted)
    order = within[np.argsort(users.codes[within], kind="stable")]  # by user, each user's lines in file order
    user, stamps = users.codes[order], ts[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = user[1:] != user[:-1]
    previous = np.full(len(order), -np.inf)
    if len(order):
        group = np.cumsum(first) - 1
        base = stamps.min()
        span = stamps.max() - base + 1
        if span * (group[-1] + 1) < 2**52:  # a running maximum per user in one pass, exact in float64
            shifted = np.maximum.accumulate(stamps - base + group * span) - group * span + base
        else:
            parts = np.split(stamps, np.flatnonzero(first)[1:])
            shifted = np.concatenate([np.maximum.accumulate(part) for part in parts])
        previous[1:] = shifted[:-1]
        previous[first] = -np.inf
        if last is not None:  # the lines before these: each user's running maximum starts at its last accepted
            carried = np.array([last.get(name, -np.inf) for name in names.tolist()])
            previous = np.maximum(previous, carried[user])
            ends = np.append(np.flatnonzero(first)[1:], len(order)) - 1
            for code, top in zip(user[ends].tolist(), np.maximum(shifted[ends], carried[user[ends]]).tolist(),
                                 strict=True):
                last[names[code]] = top
    backwards = stamps < previous
    for i, before in zip(order[backwards].tolist(), previous[backwards].tolist(), strict=True):
        reason = guard.reason(names[users.codes[i]], float(ts[i]), before)
        assert reason is not None  # an event before the user's last one is always refused
        reasons[i] = reason
        accepted[i] = False
    refused = sorted(reasons)
    at = np.array(refused, dtype=np.int64)
    data, begin, end = lines.fields.data, lines.fields.starts[at, 0].tolist(), lines.fields.ends[at, -1].tolist()
    return accepted, DeadLetters([source] * len(refused), lines.line_numbers[at].tolist(),
                                 [reasons[i] for i in refused],
                                 [data[b:e].decode("utf-8") for b, e in zip(begin, end, strict=True)])


def task_output(steps: Sequence[ElementStep], columns: dict[str, Any], users: TextColumn, trigger_ts: np.ndarray
                ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A trigger task's rows as NumPy columns, from its aggregation's ``columns`` (one entry per firing) through its
    element steps (``steps``, run over columns; :class:`~streamflow.columnar.NotColumnar` if one cannot), each row
    led by its firing's ``user_id`` and ``trigger_ts`` (``users``, ``trigger_ts``: one per firing); and the
    firings the rows come from."""
    size = len(trigger_ts)
    out, kept = run_row_steps(steps, columns, size)
    firings = np.arange(size) if kept is None else kept
    head = {"user_id": select_rows(users, firings), "trigger_ts": Column(trigger_ts[firings])}
    return {name: to_numpy(column) for name, column in {**head, **out}.items()}, firings


def sample_difference(name: str, size: int, rows: dict[str, np.ndarray], kept: np.ndarray,
                      expected: Callable[[int], list[dict[str, Any]] | Exception]) -> str | None:
    """How a sample of task ``name``'s rows (``rows``, from the firings ``kept`` of ``size``) differ from what the
    streaming run makes of the same firing (``expected(firing)``: the task's pipeline over its events), or
    ``None``."""
    if not size:
        return None
    position = np.full(size, -1)
    position[kept] = np.arange(len(kept))  # the row of each firing that has one
    for firing in np.unique(np.linspace(0, size - 1, min(SAMPLE_FIRINGS, size)).astype(np.int64)).tolist():
        want = expected(firing)
        row = int(position[firing])
        got = [{key: column[row] if column.dtype.kind == "O" else column[row].item()
                for key, column in rows.items()}] if row >= 0 else []
        if isinstance(want, Exception) or _typed(want) != _typed(got):
            return f"task {name}, page {firing}: the streaming pipeline gives {want!r}, the columns {got!r}"
    return None


def _typed(rows: list[dict[str, Any]]) -> list[list[tuple[str, type, Any]]]:
    return [[(key, type(value), value) for key, value in row.items()] for row in rows]


def write_chunk(runner: BatchHost, plan: RunPlan, dead: DeadLetters, events: int,
                outputs: dict[str, tuple[int, dict[str, np.ndarray]]]) -> None:
    """A chunk's dead letters and each task's rows (``outputs``: task -> (firings, rows)) stored, and counted as
    the streaming run counts them."""
    summary = runner.summary
    if len(dead):  # as runner.reject() of each, in one insert
        summary.rejected.update(Counter(reason.split(":", 1)[0] for reason in dead.reasons))
        runner.storage.write_table(DEAD_LETTER_TABLE, dead.table())
    summary.events_in += events
    for name, (fired, rows) in outputs.items():
        stats = summary.task_stats[name]
        stats.fired += fired
        stats.rows += len(rows["trigger_ts"])
        if len(rows["trigger_ts"]):  # as streaming: no row, no table
            runner.storage.write_table(plan.triggers[name].task.sink, rows)
