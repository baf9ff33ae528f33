"""The device runner's batch mode over a JSON-lines file: trigger tasks computed column by column.

A JSON-lines line is one app event as written (:class:`~streamflow.sources.JsonLinesSource`), so the pages are the
events' own: a ``page_enter`` opens a user's page, the user's other events join it, and a ``page_exit`` of the
open page's page closes it with its events (the page a task with ``input="page"`` reads); a ``page_exit`` of
another page (or with none open) drops the open page and is a page of one event (:mod:`streamflow.sequences`).
A task that fires on a page id fires on each ``page_exit`` of that page, in line order.

A chunk of :data:`~streamflow.runners.batch.CHUNK_BYTES` is read as columns (:mod:`streamflow.jsonl_columns`):
the lines its parser rejects and the guard's rejections become the streaming run's dead letters, each user's
events are grouped (a stable sort), the pages are found with array operations, each task's aggregation becomes
one array per column and its Map and Filter steps run over columns. Each user's page still open at a chunk's end
is carried to the next chunk, with each user's last accepted timestamp. A sample of each chunk's firings is
computed again the streaming way (the events rebuilt from the columns, the task's own pipeline) and compared.

What batch mode cannot compute in a chunk (an event of a trigger id that is no page exit, a ``contents`` key a task
reads that is not text, steps that do not run over columns, a sample that differs) makes the run stream, from
that chunk's first line on when chunks before it were written (:meth:`_Carried.stream_rest`).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import numpy as np

from operators import Count, CountBy, First, Last, Max, Min
from operators.process import ValueStateDescriptor
from streamflow.columnar import (
    Column,
    CountsColumn,
    NotColumnar,
    TextColumn,
    prepend_text,
    select_rows,
)
from streamflow.events import EVENT_ATTRIBUTES, PAGE_ENTER, PAGE_EXIT, Event, Rejected
from streamflow.jsonl_columns import ID_FIELDS, JsonChunk, json_chunks
from streamflow.keyed import KeyedStore
from streamflow.runners.batch_rows import DeadLetters, guarded_lines, sample_difference, task_output, write_chunk
from streamflow.runners.plan import BatchHost, RunPlan, TriggerTaskPlan
from streamflow.sources import JsonLinesSource, SourcePosition

log = logging.getLogger("streamflow.runners")


def trigger_page(trigger: TriggerTaskPlan) -> str | None:
    """The page id a task fires on the exit of (its trigger is that one id), or ``None``."""
    ids = tuple(trigger.task.trigger)
    if len(ids) == 1 and ids[0] not in (PAGE_ENTER, PAGE_EXIT, "*"):
        return ids[0]
    return None


def contents_keys(plan: RunPlan) -> list[str]:
    """The ``contents`` keys the tasks' aggregations read."""
    keys: list[str] = []
    for trigger in plan.triggers.values():
        assert trigger.aggregate is not None  # refusal() said so
        for aggregation in trigger.aggregate.aggregations.values():
            name = aggregation.field
            if isinstance(name, str) and name not in EVENT_ATTRIBUTES and name not in keys:
                keys.append(name)
    return keys


class _Carried:
    """What one chunk leaves the next: each user's open page (its events, in order) and last accepted time."""

    def __init__(self, keys: list[str]) -> None:
        self.last_ts: dict[str, float] = {}
        self.text: dict[str, np.ndarray] = {key: np.empty(0, dtype=object) for key in (*ID_FIELDS, *keys)}
        self.ts = np.empty(0)

    def copy(self) -> _Carried:
        carried = _Carried([])
        carried.last_ts, carried.text, carried.ts = dict(self.last_ts), dict(self.text), self.ts
        return carried

    def stream_rest(self, runner: BatchHost, source: JsonLinesSource, lines_before: int) -> None:
        """Stream the file after line ``lines_before`` from the state these lines left: the open pages' events
        go through the runner first (they fire nothing: a task fires on an exit), then the rest of the file, read
        with each user's last accepted time."""
        last = KeyedStore(ValueStateDescriptor("last_ts"))
        last.data.update(self.last_ts)
        keys = [key for key in self.text if key not in ID_FIELDS]
        events: list[Event | Rejected] = [Event(user, event_id, page, ts, {key: self.text[key][i] for key in keys})
                  for i, (user, event_id, page, ts) in enumerate(zip(*(self.text[k].tolist() for k in ID_FIELDS),
                                                                     self.ts.tolist(), strict=True))]
        counted = runner.summary.events_in
        runner.process_block(events)
        runner.summary.events_in = counted  # counted when their chunk was
        clock = round(max(self.last_ts.values(), default=0.0) * 1000)
        states = KeyedStore(ValueStateDescriptor("adapter"))
        for block in runner.blocks(source.read(SourcePosition(lines_before, states, (last, clock), [], clock))):
            runner.process_block(block)
        runner.finish()


#: A chunk's dead letters, its accepted events, and per task (pages fired, rows).
_Chunk = tuple[DeadLetters, int, dict[str, tuple[int, dict[str, np.ndarray]]]]


def _run_chunk(plan: RunPlan, source: JsonLinesSource, chunk: JsonChunk, carried: _Carried, keys: list[str]
               ) -> _Chunk | str:
    """A chunk's dead letters, accepted events and per task (fired pages, rows), or why batch mode cannot."""
    accepted, refused = guarded_lines(chunk, chunk.columns["user_id"], plan.guard, source.name, carried.last_ts)
    dead = refused.merged(chunk.rejected)
    if np.any(chunk.odd & accepted):
        return f"an event of the input has a contents key among {', '.join(keys)} that is not text"
    columns = {name: select_rows(column, np.flatnonzero(accepted)) if name != "ts" else column[accepted]
               for name, column in chunk.columns.items()}
    n_new = int(accepted.sum())
    pages_of = {name: trigger_page(trigger) for name, trigger in plan.triggers.items()}
    event_names = columns["event_id"].dictionary.tolist()
    for name, page in pages_of.items():
        if page in event_names and np.any(columns["event_id"].codes == event_names.index(page)):
            return f"an event's event_id is {page!r}, task {name}'s trigger (fired outside a page exit)"
    n_old = len(carried.ts)
    joined = {key: prepend_text(carried.text[key], columns[key]) for key in (*ID_FIELDS, *keys)}
    ts = np.concatenate([carried.ts, columns["ts"]])
    n = len(ts)
    order = np.argsort(joined["user_id"].codes, kind="stable")  # by user, each user's events in line order
    user = joined["user_id"].codes[order]
    kinds = joined["event_id"]
    names = kinds.dictionary.tolist()
    kind = kinds.codes[order]
    page_ids = joined["page_id"]
    page_of = page_ids.codes[order]
    enter = kind == names.index(PAGE_ENTER) if PAGE_ENTER in names else np.zeros(n, dtype=bool)
    leave = kind == names.index(PAGE_EXIT) if PAGE_EXIT in names else np.zeros(n, dtype=bool)
    index = np.arange(n)
    new_user = np.ones(n, dtype=bool)
    new_user[1:] = user[1:] != user[:-1]
    user_start = np.maximum.accumulate(np.where(new_user, index, 0))
    # The latest enter and the latest exit before each event, within its user (-1: none).
    last_enter = np.maximum.accumulate(np.where(enter, index, -1))
    last_enter = np.where(last_enter >= user_start, last_enter, -1)
    exit_before = np.full(n, -1)
    exit_before[1:] = np.maximum.accumulate(np.where(leave, index, -1))[:-1]
    exit_before = np.where(exit_before >= user_start, exit_before, -1)
    open_at = (last_enter >= 0) & (last_enter > exit_before)  # a page is open when the event comes
    exits = np.flatnonzero(leave)
    matched = open_at[exits] & (page_of[np.maximum(last_enter[exits], 0)] == page_of[exits])
    first = np.where(matched, last_enter[exits], exits)
    position = order[exits] - n_old  # the exit's place among the chunk's events (carried events never exit)
    outputs: dict[str, tuple[int, dict[str, np.ndarray]]] = {}
    for name, trigger in plan.triggers.items():
        target = pages_of[name]
        code = page_ids.dictionary.tolist().index(target) if target in page_ids.dictionary.tolist() else -1
        fired = np.flatnonzero(page_of[exits] == code)
        fired = fired[np.argsort(position[fired], kind="stable")]  # in line order, as streaming fires them
        starts, ends = first[fired], exits[fired]
        try:
            rows, kept = _task_rows(trigger, joined, order, ts, kind, names, starts, ends)
        except NotColumnar as exc:
            return f"task {name}'s steps do not run over columns ({exc})"
        except Exception as exc:  # the streaming run raises it again, per row, where it belongs
            return f"task {name}'s steps raised {type(exc).__name__} over columns"
        difference = sample_difference(name, len(fired), rows, kept,
                                       partial(_streaming_rows, plan, name, joined, order, ts, keys, starts, ends))
        if difference is not None:
            return f"a sample row differs: {difference}"
        outputs[name] = (len(fired), rows)
    if not chunk.last:  # each user's open page at the chunk's end, carried
        user_end = np.append(np.flatnonzero(new_user)[1:], n)[:int(new_user.sum())] - 1
        still = open_at[user_end] | enter[user_end]
        still &= ~leave[user_end]
        begin = np.where(enter[user_end], user_end, last_enter[user_end])[still]
        lengths = user_end[still] - begin + 1
        rows_open = np.repeat(begin - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
        at = order[rows_open]
        carried.text = {key: column.dictionary[column.codes[at]] for key, column in joined.items()}
        carried.ts = ts[at]
    return dead, n_new, outputs


def _task_rows(trigger: TriggerTaskPlan, joined: dict[str, TextColumn], order: np.ndarray, ts: np.ndarray,
               kind: np.ndarray, names: list[str], starts: np.ndarray, ends: np.ndarray
               ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    aggregate, steps = trigger.aggregate, trigger.steps
    if aggregate is None or steps is None:
        raise NotColumnar(f"task {trigger.task.name}'s pipeline is not an Aggregate and element steps")
    size = len(starts)
    first_at, last_at = order[starts], order[ends]

    def value(name: str, at: np.ndarray) -> Any:
        return Column(ts[at]) if name == "ts" else select_rows(joined[name], at)

    columns: dict[str, Any] = {}
    for name, aggregation in aggregate.aggregations.items():
        kind_of, field = type(aggregation), aggregation.field
        if kind_of in (First, Min):
            assert isinstance(field, str)
            columns[name] = value(field, first_at)
        elif kind_of in (Last, Max):
            assert isinstance(field, str)
            columns[name] = value(field, last_at)
        elif kind_of is Count:
            columns[name] = Column((ends - starts + 1).astype(np.int64))
        elif kind_of is CountBy:
            counts = {}
            for code, event_name in enumerate(names):
                running = np.concatenate([[0], np.cumsum(kind == code)])
                per_page = running[ends + 1] - running[starts]
                if per_page.any():
                    counts[event_name] = per_page.astype(np.int64)
            columns[name] = CountsColumn(counts, size)
        else:
            raise NotColumnar(f"{name}={aggregation!r} has no column form here")
    return task_output(steps, columns, select_rows(joined["user_id"], last_at), ts[last_at])


def _streaming_rows(plan: RunPlan, name: str, joined: dict[str, TextColumn], order: np.ndarray, ts: np.ndarray,
                    keys: list[str], starts: np.ndarray, ends: np.ndarray, page: int
                    ) -> list[dict[str, Any]] | Exception:
    """What task ``name``'s own pipeline makes of firing ``page``: its events ``order[starts[page]:ends[page] + 1]``,
    rebuilt from the columns."""

    def text(key: str, i: int) -> str:
        column = joined[key]
        return str(column.dictionary[column.codes[i]])

    events = [Event(text("user_id", i), text("event_id", i), text("page_id", i), float(ts[i]),
                    {key: text(key, i) for key in keys}) for i in order[starts[page]:ends[page] + 1].tolist()]
    return plan.run_task(name, events[-1], events)


def run_jsonl_batch(runner: BatchHost, plan: RunPlan, source: JsonLinesSource, chunk_bytes: int) -> str | None:
    """Run ``plan``'s trigger tasks over the JSON-lines ``source`` in batch mode, ``chunk_bytes`` at a time;
    ``None`` when it ran, else why not (nothing written or counted)."""
    keys = contents_keys(plan)
    carried, written, lines_before = _Carried(keys), False, 0
    for chunk in json_chunks(source.path, source.name, keys, chunk_bytes):
        before = carried.copy() if written else carried
        result = f"the input has {chunk}" if isinstance(chunk, str) else _run_chunk(plan, source, chunk, carried,
                                                                                     keys)
        if isinstance(result, str):
            if not written:
                return result
            log.info("job %s streams from line %d: batch mode cannot compute the lines after it (%s)",
                     plan.job, lines_before + 1, result)
            before.stream_rest(runner, source, lines_before)
            return None
        assert not isinstance(chunk, str)
        write_chunk(runner, plan, *result)
        written, lines_before = True, chunk.last_line
        runner.summary.runtime_mode = "batch"
    return None


__all__ = ["run_jsonl_batch"]
