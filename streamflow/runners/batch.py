"""The device runner's batch mode: a bounded input computed column by column.

Flink runs a DataStream program over bounded input in BATCH execution mode, with other operator
implementations and the same final results. The device runner does the same for a file, a chunk of
:data:`CHUNK_BYTES` at a time: a chunk's lines are read as NumPy columns (:mod:`streamflow.csv_columns`),
every user's item-page visits are found with array operations, each task's aggregation becomes one array
per column and its Map and Filter steps run over columns (:mod:`streamflow.columnar`); each task's rows of
the chunk go to storage in one insert, in the order the streaming run would write them. What a chunk
leaves the next is per user: the lines of the item page still open (it fires when the user's next line is
read, or at the end), the last accepted timestamp (the guard) and the place in the order users first
appeared (the exits at the end), so memory is set by the chunk and the users, not the file. On the IPV job
over 200k lines it is ~2.5x faster than streaming at a lower peak memory (``bench.peers``).

No checkpoint is taken: a run stopped midway is run again with ``--replace``.

It applies (otherwise the runner streams, and says why) when:

- the source is a Taobao CSV file read with the default timestamp guard. Its plain lines are read as
  columns (:meth:`~streamflow.sources.TaobaoBehaviorSource.plain_lines`); the others (a wrong field count,
  an empty field, bad UTF-8, an unknown behaviour, a timestamp that is no integer) go through the
  streaming run's own line reader (``read_line``), and the guard's rejections (a timestamp outside its
  bounds, or earlier than the user's previous one) are found over the columns
  (:func:`~streamflow.runners.batch_rows.guarded_lines`):
  each becomes the same dead letter, with the same reason and line number, as when streaming. Only a
  line the parser takes after trimming or decoding it (spaces around a field, non-ASCII text), or a lone
  carriage return, makes the run stream;
- the run keeps no state across runs or users: no checkpoints, state TTL, cap on users, tunnel,
  latency recording, stream tasks, task swaps or safe-point hooks;
- every task fires on the exit of the item page (``trigger=["item"]``) over the page
  (``input="page"``), and its pipeline is an :class:`~operators.Aggregate` of ``First``/``Last``
  (of an event field), ``Count``, ``Min``/``Max("ts")`` or ``CountBy("event_id")``, without
  ``where=``, followed by Map and Filter steps that run over columns.

Before a chunk's rows are written, the rows of a sample of its firings of every task are computed again
the streaming way (the source's per-line mapping, the task's own compiled pipeline) and compared, value
and type; a difference in the first chunk makes the run stream (nothing was written yet); in a later chunk,
as whatever else batch mode cannot compute there (a line taken only after trimming it, a step a column
cannot follow), the rest of the file streams from that chunk's first line, from the state the chunks
before left (:meth:`_Carried.stream_rest`).

Example:
    >>> import os, tempfile
    >>> from connectors import CollectiveStorage
    >>> from operators import Aggregate, CountBy, First, Map
    >>> from streamflow import Job, Task
    >>> from streamflow.runners import DeviceRunner
    >>> from streamflow.sources import TaobaoBehaviorSource
    >>> folder = tempfile.mkdtemp()
    >>> path = os.path.join(folder, "b.csv")
    >>> _ = open(path, "w").write("1,10,7,pv,1511848800\\n1,10,7,fav,1511848860\\n1,11,7,pv,1511848900\\n")
    >>> task = Task("favs", ["item"], [Aggregate(item=First("item_id"), n=CountBy("event_id")),
    ...                                Map(lambda r: {"item": r["item"], "favs": r["n"].get("fav", 0)})], input="page")
    >>> runner = DeviceRunner(Job("j", [task]), CollectiveStorage(os.path.join(folder, "f.duckdb")),
    ...                       runtime_mode="batch")
    >>> runner.run(TaobaoBehaviorSource(path)).runtime_mode
    'batch'
    >>> runner.storage.query("SELECT user_id, trigger_ts, item, favs FROM favs")
    [('1', 1511848900.0, '10', 1), ('1', 1511848900.0, '11', 0)]
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from operators import Aggregate, Count, CountBy, First, Last, Max, Min
from operators.process import ValueStateDescriptor
from streamflow.columnar import (
    Column,
    CountsColumn,
    NotColumnar,
    TextColumn,
    constant,
    prepend_text,
    select_rows,
)
from streamflow.events import PAGE_ENTER, PAGE_EXIT, Rejected
from streamflow.keyed import KeyedStore
from streamflow.runners.batch_jsonl import run_jsonl_batch, trigger_page
from streamflow.runners.batch_rows import DeadLetters, guarded_lines, sample_difference, task_output, write_chunk
from streamflow.runners.plan import BatchHost, RunPlan, TriggerTaskPlan
from streamflow.sources import (
    ITEM_PAGE,
    JsonLinesSource,
    PlainLines,
    SourcePosition,
    TaobaoBehaviorSource,
    item_page_events,
)

log = logging.getLogger("streamflow.runners")

_LIBC: ctypes.CDLL | None
try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # noqa: B018 - glibc only
except (OSError, AttributeError):
    _LIBC = None
#: Event fields every event of an item page carries (``Event`` attributes and ``contents`` keys).
EVENT_FIELDS = ("user_id", "event_id", "page_id", "ts", "item_id", "category_id")


def refusal(plan: RunPlan, source: Any) -> str | None:
    """Why batch mode cannot run the job of ``plan`` (:meth:`DeviceRunner.plan()
    <streamflow.runners.device.DeviceRunner.plan>`) over ``source`` (before reading it), or ``None``."""
    jsonl = isinstance(source, JsonLinesSource) and source._lines is None
    if not isinstance(source, TaobaoBehaviorSource) and not jsonl:
        return f"the input is not a Taobao CSV or JSON-lines file but {type(source).__name__}"
    settings = {"checkpoints": plan.checkpoint_interval_s, "a state TTL": plan.state_ttl_s or source.state_ttl_s,
                "a cap on users": plan.max_users, "the tunnel": plan.tunnel,
                "latency recording": plan.record_latency, "stream tasks": plan.streams,
                "a safe-point hook or task swap": plan.swaps_or_hooks,
                "a timestamp guard of its own": not plan.default_guard or source.guard is not None}
    for what, on in settings.items():
        if on:
            return f"the run has {what}"
    for name, trigger in plan.triggers.items():
        task = trigger.task
        if jsonl and (task.input != "page" or trigger_page(trigger) is None):  # (runners/batch_jsonl.py)
            return f"task {name} does not fire on a page's exit over the page"
        if not jsonl and (task.input != "page" or tuple(task.trigger) != (ITEM_PAGE,)):
            return f"task {name} does not fire on the item page's exit over the page"
        why = _pipeline_refusal(trigger)
        if why is not None:
            return f"task {name}: {why}"
    return None


def _pipeline_refusal(trigger: TriggerTaskPlan) -> str | None:
    aggregate = trigger.aggregate
    if aggregate is None:
        return "its pipeline does not start with Aggregate"
    for name, aggregation in aggregate.aggregations.items():
        kind, field = type(aggregation), aggregation.field
        if aggregation.where is not None:
            return f"{name}={aggregation!r} has a where= condition"
        if field not in (*EVENT_FIELDS, None):
            return f"{name}={aggregation!r} reads something else than an event field"
        if not (kind in (First, Last, Count) or (kind in (Min, Max) and field == "ts")
                or (kind is CountBy and field == "event_id")):
            return f"{name}={aggregation!r} has no column form here"
    if trigger.steps is None:
        return "a step after Aggregate is not a Map or Filter"
    return None


@dataclass
class PageVisits:
    """Every item-page visit of a file, one array entry per visit, in the order the streaming run
    fires them (each exit is fired when the user's next line is read; the exits still open at the
    end come last, in the order the users first appeared)."""

    users: TextColumn
    items: TextColumn
    categories: TextColumn
    enter_ts: np.ndarray
    exit_ts: np.ndarray
    n_events: np.ndarray
    #: Per behaviour, how many events of it each page holds (``pv``: reloads, not the entering view).
    behaviors: dict[str, np.ndarray]
    #: Each page's first and last line, and the line after it (``-1``: none of the user's), indexing
    #: ``lines``: the file's rows sorted by user (stable), for recomputing a firing.
    first_line: np.ndarray
    last_line: np.ndarray
    next_line: np.ndarray
    lines: dict[str, Any]

    def __len__(self) -> int:
        return len(self.enter_ts)


def page_visits(columns: dict[str, Any], gap: float, ranks: np.ndarray | None = None) -> PageVisits:
    """The page visits of the accepted lines' columns (:meth:`PlainLines.columns`), as
    :func:`~streamflow.sources.item_page_events` makes them line by line. ``ranks``: each user code's place in the
    order the users first appeared, which orders the exits still open at the end (default: the codes' order)."""
    ts = columns["ts"]
    n = len(ts)
    users = columns["user_id"]  # codes in order of first appearance
    order = np.argsort(users.codes, kind="stable")
    user, ts = users.codes[order], ts[order]
    new_user = np.ones(n, dtype=bool)
    new_user[1:] = user[1:] != user[:-1]
    step = np.zeros(n)
    step[1:] = np.diff(ts)
    items, categories, behaviors = columns["item_id"], columns["category_id"], columns["behavior"]
    item, category, behavior = items.codes[order], categories.codes[order], behaviors.codes[order]
    new_page = new_user.copy()
    new_page[1:] |= (item[1:] != item[:-1]) | (step[1:] > gap)
    starts = np.flatnonzero(new_page)
    ends = np.append(starts[1:], n)[:len(starts)] - 1  # no line, no page
    after = ends + 1
    same_user_next = after < n
    same_user_next[same_user_next] = ~new_user[after[same_user_next]]
    next_line = np.where(same_user_next, after, -1)
    after_or_last = np.minimum(after, n - 1)  # an index to read at, where only same_user_next rows count
    within_gap = same_user_next & (step[after_or_last] <= gap)
    exit_ts = np.where(within_gap, ts[after_or_last], ts[ends])
    names = behaviors.dictionary.tolist()
    first_viewed = (behavior[starts] == names.index("pv")).astype(np.int64) if "pv" in names else 0 * starts
    counts = {}
    for code, name in enumerate(names):
        per_page = np.add.reduceat((behavior == code).astype(np.int64), starts)
        counts[name] = per_page - first_viewed if name == "pv" else per_page  # the entering view is no pv event
    # The streaming run fires an exit when the user's next line is read, or at the end (users in first-seen order).
    first_seen = user[starts] if ranks is None else ranks[user[starts]]
    fired = np.argsort(np.where(same_user_next, order[after_or_last], n + first_seen), kind="stable")
    starts, ends, next_line, exit_ts = starts[fired], ends[fired], next_line[fired], exit_ts[fired]
    first_viewed = first_viewed[fired]
    counts = {name: per_page[fired] for name, per_page in counts.items()}
    return PageVisits(
        users=TextColumn(user[starts], users.dictionary), items=TextColumn(item[starts], items.dictionary),
        categories=TextColumn(category[starts], categories.dictionary), enter_ts=ts[starts], exit_ts=exit_ts,
        n_events=ends - starts + 3 - first_viewed, behaviors=counts, first_line=starts, last_line=ends,
        next_line=next_line,
        lines={"users": TextColumn(user, users.dictionary), "items": TextColumn(item, items.dictionary),
               "categories": TextColumn(category, categories.dictionary),
               "behaviors": TextColumn(behavior, behaviors.dictionary), "ts": ts})


def aggregate_columns(aggregate: Aggregate, visits: PageVisits) -> dict[str, Any]:
    """One column per aggregation of ``aggregate`` over every page (see :func:`refusal` for which)."""
    size = len(visits)
    enter = {"user_id": visits.users, "event_id": constant(PAGE_ENTER, size), "page_id": constant(ITEM_PAGE, size),
             "ts": Column(visits.enter_ts), "item_id": visits.items, "category_id": visits.categories}
    leave = {**enter, "event_id": constant(PAGE_EXIT, size), "ts": Column(visits.exit_ts)}
    columns: dict[str, Any] = {}
    for name, aggregation in aggregate.aggregations.items():
        kind, field = type(aggregation), aggregation.field
        if kind in (First, Min):
            assert isinstance(field, str)  # refusal lets through only named fields
            columns[name] = enter[field]
        elif kind in (Last, Max):
            assert isinstance(field, str)
            columns[name] = leave[field]
        elif kind is Count:
            columns[name] = Column(visits.n_events)
        else:  # CountBy("event_id"): page_enter, then the page's behaviours, then page_exit
            ones = np.ones(size, dtype=np.int64)
            columns[name] = CountsColumn({PAGE_ENTER: ones, **visits.behaviors, PAGE_EXIT: ones}, size)
    return columns


def task_rows(trigger: TriggerTaskPlan, visits: PageVisits) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The task's rows over every page, as NumPy columns, and the pages they come from; or :class:`NotColumnar`.
    Its aggregation becomes columns, its element steps (its Map and Filter, lowered) run over them."""
    aggregate, steps = trigger.aggregate, trigger.steps
    if aggregate is None or steps is None:  # refusal() has said so already
        raise NotColumnar(f"task {trigger.task.name}'s pipeline is not an Aggregate and element steps")
    return task_output(steps, aggregate_columns(aggregate, visits), visits.users, visits.exit_ts)


def streaming_rows(plan: RunPlan, source: TaobaoBehaviorSource, name: str, visits: PageVisits,
                   page: int) -> list[dict[str, Any]] | Exception:
    """What the streaming run makes of page ``page`` for task ``name``: the source's per-line events, the task."""
    lines = visits.lines

    def line(i: int) -> tuple[str, str, str, str, float]:
        values = [lines[key].dictionary[lines[key].codes[i]] for key in ("users", "items", "categories", "behaviors")]
        return (*values, float(lines["ts"][i]))

    state, events = None, []
    for i in range(visits.first_line[page], visits.last_line[page] + 1):
        state, more = item_page_events(state, *line(i), source.inactivity_gap_s)
        events += more
    user = line(visits.first_line[page])[0]
    if visits.next_line[page] >= 0:
        exit_event = item_page_events(state, *line(visits.next_line[page]), source.inactivity_gap_s)[1][0]
    else:
        exit_event = source.end_events(user, state)[0]
    return plan.run_task(name, exit_event, [*events, exit_event])


def _release_free_memory() -> None:
    """Hand the memory freed so far back to the system (glibc keeps freed heap for reuse), so that
    DuckDB's insert does not add to the peak of the steps before it."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


#: Bytes of the file read and computed at a time (about 220k lines of a Taobao CSV): the run's memory is set by
#: it and by what is carried from one chunk to the next (each user's open page's lines, last timestamp, place).
CHUNK_BYTES = 8 << 20
_TEXT_FIELDS = ("user_id", "item_id", "category_id", "behavior")


class _Carried:
    """What one chunk leaves the next: the lines of every user's item page still open (a page fires when the
    user's next line is read, or at the end), each user's last accepted timestamp (the guard) and each user's
    place in the order users first appeared (the end's exits)."""

    def __init__(self) -> None:
        self.last_ts: dict[str, float] = {}
        self.ranks: dict[str, int] = {}
        empty = np.empty(0, dtype=object)
        #: the open pages' lines, each user's in line order: text fields (``str``), ``ts``, the user's rank
        self.text: dict[str, np.ndarray] = dict.fromkeys(_TEXT_FIELDS, empty)
        self.ts, self.rank = np.empty(0), np.empty(0, dtype=np.int64)

    def copy(self) -> _Carried:
        """A copy that the next chunk's changes leave as it is."""
        carried = _Carried()
        carried.last_ts, carried.ranks = dict(self.last_ts), dict(self.ranks)
        carried.text, carried.ts, carried.rank = dict(self.text), self.ts, self.rank  # arrays are replaced, not changed
        return carried

    def stream_rest(self, runner: BatchHost, source: TaobaoBehaviorSource, lines_before: int) -> None:
        """Stream the file after line ``lines_before`` as the streaming run does, from the state these lines left:
        the source's open pages (in the order users first appeared, as the streaming reader holds them) and the
        guard's last timestamps; the open pages' events go through the runner first, so that each trigger task
        holds them (nothing fires: a page fires on its exit). Those events are counted now, as batch mode counts
        a page's events when it fires."""
        pages = KeyedStore(ValueStateDescriptor("adapter"))
        last = KeyedStore(ValueStateDescriptor("last_ts"))
        last.data.update(self.last_ts)
        order = np.argsort(self.rank, kind="stable")  # by user's place, each user's lines in order
        users, items, categories, behaviors = (self.text[name][order].tolist() for name in _TEXT_FIELDS)
        events: list[Any] = []
        for user, item, category, behavior, ts in zip(users, items, categories, behaviors, self.ts[order].tolist(),
                                                      strict=True):
            page, more = item_page_events(pages.data.get(user), user, item, category, behavior, ts,
                                          source.inactivity_gap_s)
            pages.data[user] = page
            events += more
        clock = round(max(self.last_ts.values(), default=0.0) * 1000)
        runner.process_block(events)
        for block in runner.blocks(source.read(SourcePosition(lines_before, pages, (last, clock), [], clock))):
            runner.process_block(block)
        runner.finish()

    def join(self, columns: dict[str, Any], final: bool) -> tuple[dict[str, Any], np.ndarray]:
        """The carried lines of the users in ``columns`` (every carried line when ``final``) before ``columns``'
        lines, and each user code's rank; the lines taken are no longer carried."""
        users = columns["user_id"]
        present, first_at = np.unique(users.codes, return_index=True)
        names, ranks = users.dictionary, self.ranks
        seen = present[np.argsort(first_at)].tolist()  # the users of these lines in the order they first appear
        chunk_ranks = np.fromiter((ranks.setdefault(names[code], len(ranks)) for code in seen), np.int64, len(seen))
        take = np.ones(len(self.ts), dtype=bool) if final else np.isin(self.rank, chunk_ranks)
        joined: dict[str, Any] = {}
        for name in _TEXT_FIELDS:
            joined[name] = prepend_text(self.text[name][take], columns[name])
            self.text[name] = self.text[name][~take]
        joined["ts"] = np.concatenate([self.ts[take], columns["ts"]])
        self.ts, self.rank = self.ts[~take], self.rank[~take]
        # (a user of the dictionary without a line here, only rejected ones, has no place yet: -1, never read)
        user_ranks = np.fromiter((ranks.get(user, -1) for user in joined["user_id"].dictionary.tolist()), np.int64)
        return joined, user_ranks

    def keep_open(self, visits: PageVisits, ranks: np.ndarray) -> PageVisits:
        """Carry the lines of the pages of ``visits`` still open (no next line yet); the others, which fired."""
        open_pages = visits.next_line < 0
        first, last = visits.first_line[open_pages], visits.last_line[open_pages]
        lengths = last - first + 1
        rows = np.repeat(first - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
        lines = visits.lines
        for name, key in zip(_TEXT_FIELDS, ("users", "items", "categories", "behaviors"), strict=True):
            column = lines[key]
            self.text[name] = np.concatenate([self.text[name], column.dictionary[column.codes[rows]]])
        self.ts = np.concatenate([self.ts, lines["ts"][rows]])
        self.rank = np.concatenate([self.rank, ranks[lines["users"].codes[rows]]])
        return _select(visits, ~open_pages)


def _select(visits: PageVisits, keep: np.ndarray) -> PageVisits:
    """The visits ``keep`` selects, in their order."""
    return PageVisits(
        users=select_rows(visits.users, keep), items=select_rows(visits.items, keep),
        categories=select_rows(visits.categories, keep), enter_ts=visits.enter_ts[keep],
        exit_ts=visits.exit_ts[keep], n_events=visits.n_events[keep],
        behaviors={name: counts[keep] for name, counts in visits.behaviors.items()},
        first_line=visits.first_line[keep], last_line=visits.last_line[keep], next_line=visits.next_line[keep],
        lines=visits.lines)


def _no_columns() -> dict[str, Any]:
    empty = TextColumn(np.empty(0, dtype=np.int64), np.empty(0, dtype=object))
    return {**dict.fromkeys(_TEXT_FIELDS, empty), "ts": np.empty(0)}


#: One chunk's result: its dead letters (in line order), its pages that fired, and each task's rows of them.
_Chunk = tuple[DeadLetters, PageVisits, dict[str, dict[str, np.ndarray]]]


def _run_chunk(plan: RunPlan, source: TaobaoBehaviorSource, lines: PlainLines, carried: _Carried,
               final: bool) -> _Chunk | str:
    """One chunk's dead letters, fired pages and rows (the pages still open are carried, unless ``final``), or
    why batch mode cannot compute it."""
    rejected: list[Rejected] = []
    for line_no, line in lines.others:  # the few lines that are not plain: as the streaming run reads them
        record = source.read_line(line_no, line)
        if record is not None and type(record) is not Rejected:
            return f"line {line_no} is taken only after trimming or decoding it ({line[:40]!r})"
        if record is not None:
            rejected.append(record)
    columns = lines.columns() if len(lines.ts) else _no_columns()
    if isinstance(columns, str):
        return f"the input has {columns}"
    accepted, refused = guarded_lines(lines, columns["user_id"], plan.guard, source.name, carried.last_ts)
    dead = refused.merged(rejected)
    if len(refused):  # the accepted lines' rows (dictionaries may keep text only refused lines had)
        columns = {name: select_rows(column, accepted) if name in _TEXT_FIELDS else column[accepted]
                   for name, column in columns.items()}
    joined, ranks = carried.join(columns, final)
    visits = page_visits(joined, source.inactivity_gap_s, ranks)
    del columns, joined
    if not final:
        visits = carried.keep_open(visits, ranks)
    outputs = {}
    for name, trigger in plan.triggers.items():
        try:
            rows, pages = task_rows(trigger, visits)
        except NotColumnar as exc:
            return f"task {name}'s steps do not run over columns ({exc})"
        except Exception as exc:  # the streaming run raises it again, per row, where it belongs
            return f"task {name}'s steps raised {type(exc).__name__} over columns"
        if len(visits):
            difference = sample_difference(name, len(visits), rows, pages,
                                           partial(streaming_rows, plan, source, name, visits))
            if difference is not None:
                return f"a sample row differs: {difference}"
        outputs[name] = rows
    return dead, visits, outputs


def run_batch(runner: BatchHost, source: object, chunk_bytes: int | None = None) -> str | None:
    """Run ``runner``'s job over ``source`` in batch mode, ``chunk_bytes`` of the file at a time (default
    :data:`CHUNK_BYTES`); ``None`` when it ran (rows written, summary counted), else why not (then nothing was
    written or counted; any source but a Taobao CSV file is refused). Each chunk's rows are written before the
    next is read; from a chunk after the first that batch mode cannot compute (a line taken only after trimming
    it, steps that do not run over its columns) the file streams on, from the state the chunks before left."""
    plan = runner.plan()
    why = refusal(plan, source)
    if why is not None:
        return why
    if isinstance(source, JsonLinesSource):  # one event a line: the pages are the events' own
        return run_jsonl_batch(runner, plan, source, chunk_bytes or CHUNK_BYTES)
    assert isinstance(source, TaobaoBehaviorSource)  # refusal() said so
    carried, written, lines_before, lines_after = _Carried(), False, 0, 0
    for lines in source.plain_chunks(chunk_bytes or CHUNK_BYTES):
        before = carried.copy() if written else carried
        if isinstance(lines, str):  # (after the lines of the chunk before)
            chunk: _Chunk | str = f"the input has {lines}"
        else:
            lines_before, lines_after = lines.lines_before, lines.last_line
            chunk = _run_chunk(plan, source, lines, carried, final=lines.last)
            del lines
        if isinstance(chunk, str):
            if not written:
                return chunk
            log.info("job %s streams from line %d: batch mode cannot compute the lines after it (%s)",
                     plan.job, lines_before + 1, chunk)
            before.stream_rest(runner, source, lines_before)
            return None
        _write_chunk(runner, plan, *chunk)
        del chunk
        written, lines_before = True, lines_after
        runner.summary.runtime_mode = "batch"
    return None


def _write_chunk(runner: BatchHost, plan: RunPlan, rejected: DeadLetters, visits: PageVisits,
                 outputs: dict[str, dict[str, np.ndarray]]) -> None:
    """A chunk's dead letters and rows stored, and counted (every task fired on every page of the chunk)."""
    events, pages_seen = int(visits.n_events.sum()), len(visits)
    del visits
    _release_free_memory()
    write_chunk(runner, plan, rejected, events, {name: (pages_seen, rows) for name, rows in outputs.items()})
