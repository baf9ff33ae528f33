"""Event sources: files that become app events, with every bad record reported, never dropped.

Each source iterates ``Event | Rejected`` in file order (a line that is not valid UTF-8 is a
``Rejected`` too, never rewritten). Two formats:

- :class:`TaobaoBehaviorSource` reads the Taobao UserBehavior CSV and turns it into app events (item
  page visits; each line's own event keeps its behaviour in ``contents["behavior"]``).
- :class:`JsonLinesSource` reads one JSON event per line (``user_id, event_id, page_id, ts,
  contents``), the format for anything else.

:func:`open_source` picks one by format name or by the file's extension.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Self

import numpy as np

from operators.process import ValueStateDescriptor
from streamflow.csv_columns import Fields, integer_values, one_of, plain_lines, text_codes
from streamflow.events import BEHAVIOR, PAGE_ENTER, PAGE_EXIT, Event, Rejected, TimestampGuard
from streamflow.keyed import KeyedStore

ITEM_PAGE = "item"
TAOBAO_BEHAVIORS = frozenset(("pv", "fav", "cart", "buy"))
#: Default inactivity after which the open item page counts as left (seconds).
DEFAULT_INACTIVITY_GAP_S = 1800.0
# Plain ASCII digits, at most 15 of them (int() would also take "1_000", "١٢" or 5,000 digits).
_INTEGER = re.compile(r"-?[0-9]{1,15}")
# A line TaobaoBehaviorSource.parse accepts without stripping anything (its fast path).
_CLEAN_LINE = re.compile(r"([^,\s]+),([^,\s]+),([^,\s]+),(pv|fav|cart|buy),(-?[0-9]{1,15})").fullmatch
_IDENTITY_BYTES = 1 << 20
#: A format's own read loop (:meth:`LineSource.fast_blocks`): ``(line number, line)`` pairs in, lists of records
#: out, the last records (fewer than a block) returned.
FastBlocks = Callable[[Iterator[tuple[int, str]]], Generator[list[Event | Rejected], None, list[Any]]]



def whole_line_chunks(path: str | os.PathLike[str], chunk_bytes: int) -> Iterator[tuple[bytes, int, int, bool]]:
    """The file at ``path`` about ``chunk_bytes`` bytes at a time, cut after a line break (at least one whole line
    a chunk; the last may lack its line break): ``(data, lines before it, lines up to its end, whether it is the
    last)``, the batch readers' chunks.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "l.txt")
        >>> _ = open(path, "wb").write(b"a\\nbb\\nccc")
        >>> list(whole_line_chunks(path, 3))
        [(b'a\\n', 0, 1, False), (b'bb\\n', 1, 2, False), (b'ccc', 2, 3, True)]
    """
    lines_before, rest = 0, b""
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        while True:
            block = file.read(max(chunk_bytes, 1))
            data = rest + block
            if not data:
                return
            cut = data.rfind(b"\n") + 1 if block else len(data)
            if not cut:  # no whole line yet
                rest = data
                continue
            data, rest = data[:cut], data[cut:]
            last = not rest and file.tell() >= size
            lines_after = lines_before + data.count(b"\n") + (not data.endswith(b"\n"))
            yield data, lines_before, lines_after, last
            if last:
                return
            lines_before = lines_after

class LineSource:
    """A file (or in-memory lines) read line by line, each line one record.

    A format defines four steps, which every runner drives the same way (the device runner through
    ``__iter__``, the Flink runner per key in keyed state):

    - ``parse(raw)``: the record's fields, or the reason it is rejected (stateless, per line);
    - ``user_of(parsed)`` and ``ts_of(parsed)``: whose record it is and its event time;
    - ``user_events(state, parsed)``: ``(new per-user state, app events)``;
    - ``end_events(user, state)``: the events still owed at the end of the input.

    ``events_checked``: a format whose events never step back in time per user and carry the time
    of a line its reader's guard accepted (or an earlier time of the same user that was accepted)
    says so, and a runner with a default guard of its own need not check them again.
    """

    events_checked = False

    def __init__(self, path: str | os.PathLike[str], guard: TimestampGuard | None = None,
                 state_ttl_s: float | None = None):
        self.path = Path(path)
        self.name = str(path)
        self.guard = guard
        self._lines: list[str] | None = None
        #: A user's per-user state (and last timestamp) is dropped after this long of stream time (the
        #: largest timestamp read) without a record of the user, once its owed events (``end_events``)
        #: are out: memory stays bounded by the users active within the TTL. It assumes records arrive
        #: roughly in time order across users (as on a live device); by default nothing is dropped.
        self.state_ttl_s = state_ttl_s

    @classmethod
    def from_lines(cls, lines: list[str], name: str = "<lines>", **kwargs: Any) -> Self:
        """A source over in-memory lines (tests, replays)."""
        src = cls(name, **kwargs)
        src._lines = lines
        return src

    def numbered_lines(self) -> Iterator[tuple[int, str]]:
        """(1-based line number, line without its newline) for every non-blank line."""
        yield from _numbered(self.raw_lines())

    def raw_lines(self) -> Iterator[str]:
        """Every line as read (with its newline, if any)."""
        if self._lines is not None:
            yield from self._lines
        else:
            # Bytes that are not UTF-8 become lone surrogates, so that reading can reject their line.
            with open(self.path, encoding="utf-8", errors="surrogateescape") as f:
                yield from f

    def read_line(self, line_no: int, line: str) -> Any:
        """What line ``line_no`` holds, before any state sees it: ``None`` for a blank line (not a record), a
        :class:`Rejected` for a line the format refuses (bad UTF-8, or :meth:`parse`'s reason), else the
        parsed record.

        Example:
            >>> src = TaobaoBehaviorSource.from_lines([])
            >>> src.read_line(3, "1,10,7,pv,1511848894\\n"), src.read_line(4, "  \\n")
            (('1', '10', '7', 'pv', 1511848894.0), None)
            >>> src.read_line(5, "1,10,7,nap,1").reason
            "bad value: unknown behavior 'nap' (expected one of pv, fav, cart, buy)"
        """
        raw = line.rstrip("\r\n")
        if not raw.strip():  # blank lines carry nothing; they are not records
            return None
        if not raw.isascii() and (bad := invalid_utf8(raw)) is not None:
            return Rejected(self.name, line_no, *bad)
        parsed = self.parse(raw)
        return Rejected(self.name, line_no, parsed, raw) if type(parsed) is str else parsed

    def fast_blocks(self, reader: SourceReader, step: Callable[[int, str], Sequence[Event | Rejected]], size: int
                    ) -> FastBlocks | None:
        """A format's own loop over ``(line number, line)`` giving what ``step`` per line gives, in lists
        as :meth:`SourceReader.blocks` hands them out (and moving ``reader`` the same way), returning the
        last records (fewer than ``size``); or ``None`` (then ``step`` runs per line)."""
        return None

    def __iter__(self) -> Iterator[Event | Rejected]:
        return iter(self.read())

    def read(self, resume: SourcePosition | None = None) -> SourceReader:
        """The records, from the start or from where a checkpoint's ``resume`` position left off."""
        return SourceReader(self, resume)

    def identity(self) -> dict[str, Any]:
        """What identifies this input across runs (checkpoints): its size and a digest of its first MiB."""
        if self._lines is None:
            with open(self.path, "rb") as f:
                head = f.read(_IDENTITY_BYTES)
            size = self.path.stat().st_size
        else:
            text = "\n".join(self._lines).encode()
            head, size = text[:_IDENTITY_BYTES], len(text)
        return {"size": size, "head_sha256": hashlib.sha256(head).hexdigest()}

    def parse(self, raw: str) -> Any:
        raise NotImplementedError

    def user_of(self, parsed: Any) -> str:
        raise NotImplementedError

    def ts_of(self, parsed: Any) -> float:
        raise NotImplementedError

    def user_events(self, state: Any, parsed: Any) -> tuple[Any, list[Event]]:
        raise NotImplementedError

    def end_events(self, user: str, state: Any) -> list[Event]:
        return []


def invalid_utf8(raw: str) -> tuple[str, str] | None:
    r"""``(reason, the line with its bad bytes escaped)`` for a line read with ``surrogateescape``
    that was not valid UTF-8, or ``None`` for a good line.

    Example:
        >>> reason, raw = invalid_utf8(b"1,10\xff,7".decode("utf-8", "surrogateescape"))
        >>> print(reason, raw, sep="\n")
        invalid UTF-8: invalid start byte b'\xff' at byte 4 of the line
        1,10\xff,7
    """
    try:
        raw.encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    try:
        data = raw.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exc:  # a surrogate that no undecodable byte made (in-memory lines)
        return (f"invalid UTF-8: unpaired surrogate {raw[exc.start:exc.end]!r} at character {exc.start} of the line",
                raw.encode("utf-8", "backslashreplace").decode("utf-8"))
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = f"invalid UTF-8: {exc.reason} {data[exc.start:exc.end]!r} at byte {exc.start} of the line"
        return reason, data.decode("utf-8", "backslashreplace")
    return None


@dataclass
class SourcePosition:
    """Where a read of a :class:`LineSource` stands, as a checkpoint keeps it.

    ``line``: the last line read (1-based; later lines are still to come); ``states``: the format's
    per-user state; ``last_ts``: the source's timestamp guard (each user's last accepted time);
    ``pending``: records of the last line (or of the end of the input) not handed out yet; ``clock``:
    the largest timestamp read (ms), on which per-user state expires (``state_ttl_s``).
    """

    line: int = 0
    states: KeyedStore | None = None
    last_ts: Any = None
    pending: list[Event | Rejected] = field(default_factory=list)
    clock: int = 0


class SourceReader:
    """One read of a :class:`LineSource`: iterate it for the records; :meth:`position_after` says where
    it stands, so that a checkpoint can resume it (:meth:`LineSource.read`).

    Example:
        >>> src = TaobaoBehaviorSource.from_lines(["1,10,7,pv,1511848894", "1,10,7,buy,1511848900"])
        >>> reader = src.read()
        >>> records = iter(reader)
        >>> first = next(records)
        >>> position = reader.position_after(first)
        >>> [e.event_id for e in src.read(position)]
        ['buy', 'page_exit']
    """

    def __init__(self, source: LineSource, resume: SourcePosition | None = None):
        self.source = source
        start = resume or SourcePosition()
        self.line = start.line
        self.states = start.states or KeyedStore(ValueStateDescriptor("adapter", ttl_s=source.state_ttl_s))
        self.clock = start.clock
        self.guard = source.guard or TimestampGuard(state_ttl_s=source.state_ttl_s)
        if resume is not None and start.last_ts is not None:
            self.guard.restore(start.last_ts)
        self.pending: list[Event | Rejected] = start.pending

    def position_after(self, record: Event | Rejected | None) -> SourcePosition:
        """The position once ``record`` (the last record taken from this reader) is processed."""
        pending = self.pending
        remaining = next((pending[i + 1:] for i, p in enumerate(pending) if p is record), [])
        return SourcePosition(self.line, self.states, self.guard.snapshot(), remaining, self.clock)

    def __iter__(self) -> Iterator[Event | Rejected]:
        for records in self.blocks(1):  # one line's records at a time
            self.pending = records
            yield from records
        self.pending = []

    def blocks(self, size: int) -> Iterator[list[Event | Rejected]]:
        """The records in lists of at least ``size`` (the last one may be shorter), each ending with the
        last record of a line: a checkpoint taken after a list's last record (:meth:`position_after`)
        resumes at the next line. The same records in the same order as iterating the reader; with
        ``size`` 1, each list is one line's records.

        Example:
            >>> src = TaobaoBehaviorSource.from_lines(["1,10,7,pv,1511848894", "1,11,7,pv,1511848900"])
            >>> [[e.event_id for e in block] for block in src.read().blocks(1)]
            [['page_enter'], ['page_exit', 'page_enter'], ['page_exit']]
        """
        source, states = self.source, self.states
        if self.pending:  # a resumed read: the rest of the line a checkpoint fell in
            rest, self.pending = self.pending, []
            yield rest
        lines: Iterator[tuple[int, str]] = enumerate(source.raw_lines(), start=1)
        if self.line:
            lines = islice(lines, self.line, None)
        step = self._line_step()
        fast = source.fast_blocks(self, step, size)
        out: list[Event | Rejected]
        if fast is not None:
            out = yield from fast(lines)
        else:
            out = []
            for line_no, line in lines:
                records = step(line_no, line)
                if records:
                    out += records
                    if len(out) >= size:
                        yield out
                        out = []
        self.pending = [event for user, state in states.data.items() for event in source.end_events(user, state)]
        states.data.clear()
        if states.written is not None:
            states.written.clear()
        if out or self.pending:
            yield out + self.pending  # the last lines' records and what the end of the input owes

    def _line_step(self) -> Callable[[int, str], Sequence[Event | Rejected]]:
        """The records of one line (a blank line: none), with the reader's state moved past it."""
        source, states = self.source, self.states
        owed: list[Event] = []

        def expired(user: str, state: Any) -> None:
            owed.extend(source.end_events(user, state))

        # bound once: this runs per line
        name, read_line, user_of, ts_of, user_events = source.name, source.read_line, source.user_of, source.ts_of, \
            source.user_events
        check, ttl = self.guard.check, states.ttl

        def step(line_no: int, line: str) -> Sequence[Event | Rejected]:
            parsed = read_line(line_no, line)
            if parsed is None:
                return []
            self.line = line_no
            if type(parsed) is Rejected:
                return [parsed]
            raw = line.rstrip("\r\n")
            user, ts = user_of(parsed), ts_of(parsed)
            reason = check(user, ts)
            if reason is not None:
                return [Rejected(name, line_no, reason, raw)]
            if ttl is not None and round(ts * 1000) > self.clock:
                self.clock = round(ts * 1000)
                states.expire(self.clock, expired)  # the pages idle users still owe come out first
            state, events = user_events(states.get(user, self.clock), parsed)
            states.set(user, state, self.clock)
            if owed:
                events = [*owed, *events]
                owed.clear()
            return events

        return step


def _numbered(lines: Iterable[str]) -> Iterator[tuple[int, str]]:
    for line_no, line in enumerate(lines, start=1):
        raw = line.rstrip("\r\n")
        if raw.strip():  # blank lines carry nothing; they are not records
            yield line_no, raw


@dataclass(slots=True)
class OpenPage:
    """The item page a user is on: which item, and when they last did something there."""

    item_id: str
    category_id: str
    last_ts: float

    def __reduce__(self) -> tuple:
        # A constructor call pickles several times faster than the slots dataclass default; the Flink
        # runner keeps it in keyed state and writes it on every record.
        return OpenPage, (self.item_id, self.category_id, self.last_ts)


@dataclass
class PlainLines:
    """A CSV file's plain lines as fields (see :meth:`TaobaoBehaviorSource.plain_lines`), each one's line number
    and timestamp (seconds), and every other line as ``(line number, text)``."""

    fields: Fields
    line_numbers: np.ndarray
    ts: np.ndarray
    others: list[tuple[int, str]]
    #: Whether these are the file's last lines, the number of the line before them and of their last line
    #: (:meth:`TaobaoBehaviorSource.plain_chunks`).
    last: bool = True
    lines_before: int = 0
    last_line: int = 0

    def text(self, i: int) -> str:
        """Plain line ``i`` as read."""
        return self.fields.data[self.fields.starts[i, 0]:self.fields.ends[i, -1]].decode("ascii")

    def columns(self, keep: np.ndarray | None = None) -> dict[str, Any] | str:
        """The plain lines (those ``keep`` selects) as columns in their order: ``user_id``, ``item_id``,
        ``category_id``, ``behavior`` as :class:`~streamflow.columnar.TextColumn` s (codes in order of first
        appearance among them), ``ts`` seconds as float64; or why not."""
        fields = self.fields if keep is None else self.fields.select(keep)
        columns: dict[str, Any] = {}
        for k, name in enumerate(("user_id", "item_id", "category_id", "behavior")):
            column = text_codes(fields, k)
            if isinstance(column, str):
                return column
            columns[name] = column
        columns["ts"] = self.ts if keep is None else self.ts[keep]
        return columns


class TaobaoBehaviorSource(LineSource):
    """Taobao UserBehavior CSV (``user_id,item_id,category_id,behavior,timestamp``) as app events.

    The mapping, per user (rows need not be grouped by user):

    - ``pv`` of item X enters X's detail page: a ``page_enter`` event on page ``item``.
      A ``pv`` of the item whose page is already open is a reload: event ``pv`` on that page.
    - ``fav``/``cart``/``buy`` of the open item are clicks on its page: events ``fav``/``cart``/``buy``
      on page ``item``. Those buttons live on the item detail page, so the same behaviour on an item
      whose page is not open means the user is back on that item's page: the adapter enters it
      (a ``page_enter`` with ``implicit: True`` in ``contents``) and records the click there.
    - The open page is exited (``page_exit`` on page ``item``) when the user enters another item page
      (at that moment) or is inactive for more than ``inactivity_gap_s`` (at the time of the page's
      last activity). At the end of the input every page still open is exited at its last activity.

    Every event carries ``item_id`` and ``category_id`` in ``contents``. The event that *is* a line (the
    ``page_enter`` of a ``pv`` that opens a page, the ``pv`` reload, the ``fav``/``cart``/``buy`` click)
    also carries the line's behaviour as ``contents["behavior"]`` (:attr:`~streamflow.events.Event.behavior`);
    the events added around it (``page_exit``, the implicit ``page_enter``) carry none, so
    ``Filter(lambda e: e.behavior in {"pv", "fav", "cart", "buy"})`` keeps exactly one event per line.
    Malformed lines, unknown behaviours, non-integer, absurd or backward timestamps are yielded as
    :class:`Rejected`.

    Example:
        >>> src = TaobaoBehaviorSource.from_lines(["1,10,7,pv,1511848894", "1,10,7,buy,1511848900"])
        >>> [(e.event_id, e.behavior, e.ts) for e in src]
        [('page_enter', 'pv', 1511848894.0), ('buy', 'buy', 1511848900.0), ('page_exit', None, 1511848900.0)]
    """

    def __init__(self, path: str | os.PathLike[str], inactivity_gap_s: float = DEFAULT_INACTIVITY_GAP_S,
                 guard: TimestampGuard | None = None, state_ttl_s: float | None = None):
        if state_ttl_s is not None and state_ttl_s < inactivity_gap_s:
            raise ValueError(f"state_ttl_s ({state_ttl_s}) must be >= the page inactivity gap ({inactivity_gap_s} s): "
                             "a page is exited after that gap, and its state must live until then")
        super().__init__(path, guard, state_ttl_s)
        self.inactivity_gap_s = inactivity_gap_s

    #: Exits carry the page's last activity, the time of the user's latest accepted line.
    events_checked = True

    def user_of(self, parsed: tuple[str, str, str, str, float]) -> str:
        return parsed[0]

    def fast_blocks(self, reader: SourceReader, step: Callable[[int, str], Sequence[Event | Rejected]], size: int
                    ) -> FastBlocks | None:
        """Clean lines (those :data:`_CLEAN_LINE` matches once the line break is stripped, narrowed to printable ASCII
        without spaces and an unsigned timestamp) in one loop that inlines the guard's check and
        :func:`item_page_events`; any other line through ``step``. Without a TTL and with the default guard."""
        guard = reader.guard
        if self.state_ttl_s is not None or type(guard) is not TimestampGuard or guard._last.written is not None:
            return None
        return lambda lines: _taobao_blocks(self, reader, step, lines, size)

    def ts_of(self, parsed: tuple[str, str, str, str, float]) -> float:
        return parsed[4]

    def user_events(self, state: OpenPage | None, parsed: tuple[str, str, str, str, float]
                    ) -> tuple[OpenPage, list[Event]]:
        return item_page_events(state, *parsed, self.inactivity_gap_s)

    def end_events(self, user: str, state: OpenPage | None) -> list[Event]:
        return [page_exit(user, state, state.last_ts)] if state is not None else []

    def plain_lines(self) -> PlainLines | str:
        """The file's lines split for column-wise reading, or why it cannot be (lines in memory; a lone
        carriage return, which the line reader would take as a line break).

        Plain lines are those :meth:`parse` takes as they are: five non-empty fields of printable ASCII
        without spaces, a known behaviour, an integer timestamp of at most 15 digits. Every other line is
        kept with its line number for the line-by-line parser (:meth:`LineSource.parse_line`); line numbers
        count every line, blank ones included, as the line reader does. The device runner's batch mode
        reads files so.

        Example:
            >>> import os, tempfile
            >>> path = os.path.join(tempfile.mkdtemp(), "b.csv")
            >>> _ = open(path, "w").write("1,10,7,pv,1511848894\\n1,10,7,nap,1511848900\\n\\n1,11,7,buy,1511848950\\n")
            >>> lines = TaobaoBehaviorSource(path).plain_lines()
            >>> lines.line_numbers.tolist(), lines.others, lines.text(1)
            ([1, 4], [(2, '1,10,7,nap,1511848900'), (3, '')], '1,11,7,buy,1511848950')
            >>> lines.columns()["behavior"].dictionary.tolist()
            ['pv', 'buy']
        """
        if self._lines is not None:
            return "lines in memory, not a file"
        return self.plain_chunk(self.path.read_bytes(), 0)

    def plain_chunks(self, chunk_bytes: int) -> Iterator[PlainLines | str]:
        """:meth:`plain_lines` a chunk of the file at a time: chunks of about ``chunk_bytes`` bytes (at least one
        whole line each), cut after a line break, line numbers counted on from the chunks before. A chunk that
        cannot be read so gives the reason instead (then nothing more is read).

        Example:
            >>> import os, tempfile
            >>> path = os.path.join(tempfile.mkdtemp(), "b.csv")
            >>> _ = open(path, "w").write("1,10,7,pv,1511848894\\n1,10,7,nap,1511848900\\n1,11,7,buy,1511848950")
            >>> [(c.line_numbers.tolist(), c.others) for c in TaobaoBehaviorSource(path).plain_chunks(30)]
            [([1], []), ([], [(2, '1,10,7,nap,1511848900')]), ([3], [])]
        """
        if self._lines is not None:
            yield "lines in memory, not a file"
            return
        for data, lines_before, lines_after, last in whole_line_chunks(self.path, chunk_bytes):
            chunk = self.plain_chunk(data, lines_before)
            if isinstance(chunk, str):
                yield chunk
                return
            chunk.last, chunk.last_line = last, lines_after
            yield chunk

    def plain_chunk(self, data: bytes, lines_before: int) -> PlainLines | str:
        """:meth:`plain_lines` of ``data``, whole lines of the file after its first ``lines_before`` ones."""
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
            if b"\r" in data:
                return "a lone carriage return"
        fields, rows, line_starts, line_ends = plain_lines(data, 5)
        ts, digits_ok = integer_values(fields, 4, max_digits=15)
        plain = digits_ok & one_of(fields, 3, sorted(TAOBAO_BEHAVIORS))
        fields, rows, ts = fields.select(plain), rows[plain], ts[plain]
        other = np.ones(len(line_starts), dtype=bool)
        other[rows] = False
        others = [(lines_before + i + 1, fields.data[line_starts[i]:line_ends[i]].decode("utf-8", "surrogateescape"))
                  for i in np.flatnonzero(other).tolist()]
        return PlainLines(fields, rows + 1 + lines_before, ts.astype(np.float64), others, lines_before=lines_before)

    @staticmethod
    def parse(raw: str) -> tuple[str, str, str, str, float] | str:
        clean = _CLEAN_LINE(raw)
        if clean is not None:  # the usual line, accepted in one regex match: what parse_checked gives it
            user, item, category, behavior, ts_text = clean.groups()
            return user, item, category, behavior, float(ts_text)
        return TaobaoBehaviorSource.parse_checked(raw)

    @staticmethod
    def parse_checked(raw: str) -> tuple[str, str, str, str, float] | str:
        """:meth:`parse` field by field: the fields, or the reason for the first check that fails."""
        parts = raw.split(",")
        if len(parts) != 5:
            return (f"malformed CSV line: expected 5 comma-separated fields "
                    f"(user_id,item_id,category_id,behavior,timestamp), got {len(parts)}")
        user, item, category, behavior, ts_text = (p.strip() for p in parts)
        for name, value in (("user_id", user), ("item_id", item), ("category_id", category)):
            if not value:
                return f"missing field: {name} is empty"
        if behavior not in TAOBAO_BEHAVIORS:
            return f"bad value: unknown behavior {behavior!r} (expected one of pv, fav, cart, buy)"
        if not _INTEGER.fullmatch(ts_text):
            return f"wrong type: timestamp {ts_text[:40]!r} is not an integer number of seconds"
        ts = float(ts_text)
        return user, item, category, behavior, ts


def _taobao_blocks(source: TaobaoBehaviorSource, reader: SourceReader, step: Callable[[int, str], Sequence[Any]],
                   lines: Iterator[tuple[int, str]], size: int
                   ) -> Generator[list[Event | Rejected], None, list[Event | Rejected]]:
    """:meth:`TaobaoBehaviorSource.fast_blocks`: per clean line what ``step`` does (``TimestampGuard.check``
    without a TTL, then ``item_page_events``), inlined; the records in lists as :meth:`SourceReader.blocks`
    hands them out, and returns the last records (fewer than ``size``). A user's open page
    (:class:`OpenPage`) is changed in place when they enter another item page (``item_page_events`` makes a
    new one: the same values)."""
    name, gap, guard, pages = source.name, source.inactivity_gap_s, reader.guard, reader.states.data
    last_ts, min_ts, max_ts = guard._last.data, guard.min_ts, guard.max_ts
    top = guard._clock / 1000  # the largest accepted time (the guard keeps it in ms)
    behaviors, new = TAOBAO_BEHAVIORS, object.__new__
    out: list[Event | Rejected] = []
    add = out.append
    line_no = reader.line
    for line_no, line in lines:
        # A clean line (what _CLEAN_LINE matches once the line break is stripped, narrowed to printable ASCII without
        # spaces and a timestamp without a sign), checked with str methods: a regex match cost twice as much. Any
        # other line takes `step`.
        fields = None
        if line.isascii():
            raw = line.rstrip("\r\n")
            fields = raw.split(",")
            if len(fields) == 5:
                user, item, category, behavior, ts_text = fields
                if not (user and item and category and behavior in behaviors and ts_text.isdigit()
                        and len(ts_text) <= 15 and raw.isprintable() and " " not in raw):
                    fields = None
            else:
                fields = None
        if fields is None:
            records = step(line_no, line)
            top, max_ts = guard._clock / 1000, guard.max_ts
            if not records:
                continue
            out += records
        else:
            ts = float(ts_text)
            previous = last_ts.get(user)
            reason = None
            if ts > max_ts or ts < min_ts or (previous is not None and ts < previous):
                reason = guard.reason(user, ts, previous)  # it may read the clock again: a new upper bound
                max_ts = guard.max_ts
            if reason is not None:
                add(Rejected(name, line_no, reason, line.rstrip("\r\n")))
            else:
                if ts > top:
                    clock = round(ts * 1000)
                    if clock > guard._clock:
                        guard._clock = clock
                    top = ts
                last_ts[user] = ts
                contents = {"item_id": item, "category_id": category, BEHAVIOR: behavior}
                page = pages.get(user)
                if page is not None and ts - page.last_ts <= gap and page.item_id == item:
                    page.last_ts = ts  # on the open page: a reload or a click
                    add(Event(user, behavior, ITEM_PAGE, ts, contents))
                else:
                    if page is None:
                        pages[user] = OpenPage(item, category, ts)
                    else:
                        # Event(user, PAGE_EXIT, ITEM_PAGE, exit time, contents) with its five slots set here:
                        # CPython 3.11 does not specialize a call of a class, and its generated __init__ costs a frame.
                        last = page.last_ts
                        event = new(Event)
                        event.user_id, event.event_id, event.page_id = user, PAGE_EXIT, ITEM_PAGE
                        event.ts, event.contents = last if ts - last > gap else ts, {"item_id": page.item_id,
                                                                                       "category_id": page.category_id}
                        add(event)
                        page.item_id, page.category_id, page.last_ts = item, category, ts
                    if behavior == "pv":  # Event(user, PAGE_ENTER, ITEM_PAGE, ts, contents), as above
                        event = new(Event)
                        event.user_id, event.event_id, event.page_id, event.ts, event.contents = \
                            user, PAGE_ENTER, ITEM_PAGE, ts, contents
                        add(event)
                    else:
                        add(Event(user, PAGE_ENTER, ITEM_PAGE, ts, {"item_id": item, "category_id": category,
                                                                    "implicit": True}))
                        add(Event(user, behavior, ITEM_PAGE, ts, contents))
        if len(out) >= size:
            reader.line, reader.pending = line_no, []
            yield out
            out = []
            add = out.append
    reader.line, reader.pending = line_no, []
    return out


def item_page_events(page: OpenPage | None, user: str, item: str, category: str, behavior: str, ts: float,
                     gap: float) -> tuple[OpenPage, list[Event]]:
    """One user's next Taobao row as app events: ``(the user's open page after it, events)``.

    The per-user state machine of :class:`TaobaoBehaviorSource` (see its docstring), separate so
    that a runner can keep ``page`` in its own per-user state.

    Example:
        >>> page, events = item_page_events(None, "1", "10", "7", "cart", 1511848894.0, 1800.0)
        >>> [(e.event_id, e.behavior, e.contents.get("implicit", False)) for e in events]
        [('page_enter', None, True), ('cart', 'cart', False)]
    """
    contents = {"item_id": item, "category_id": category, BEHAVIOR: behavior}
    if page is None:
        events = []
    elif ts - page.last_ts > gap:
        events = [page_exit(user, page, page.last_ts)]
    elif page.item_id == item:
        page.last_ts = ts
        return page, [Event(user, behavior, ITEM_PAGE, ts, contents)]
    else:
        events = [page_exit(user, page, ts)]
    page = OpenPage(item, category, ts)
    if behavior == "pv":
        events.append(Event(user, PAGE_ENTER, ITEM_PAGE, ts, contents))
    else:
        events.append(Event(user, PAGE_ENTER, ITEM_PAGE, ts, {"item_id": item, "category_id": category,
                                                              "implicit": True}))
        events.append(Event(user, behavior, ITEM_PAGE, ts, contents))
    return page, events


def page_exit(user: str, page: OpenPage, ts: float) -> Event:
    """The exit event of a user's open item page."""
    return Event(user, PAGE_EXIT, ITEM_PAGE, ts, {"item_id": page.item_id, "category_id": page.category_id})


_REQUIRED_JSON_FIELDS = ("user_id", "event_id", "page_id", "ts")


class JsonLinesSource(LineSource):
    """One JSON object per line: ``{"user_id", "event_id", "page_id", "ts", "contents"?}``.

    Ids may be strings or integers (integers become strings); ``ts`` is a number of Unix seconds,
    plausible and non-decreasing per user (:class:`~streamflow.events.TimestampGuard`);
    ``contents`` is an optional object. Each line is one event, as written: nothing is added around it
    and nothing is added to its ``contents`` (its :attr:`~streamflow.events.Event.behavior` is
    ``contents["behavior"]`` if the line has one). Anything else is yielded as :class:`Rejected`.

    Example:
        >>> src = JsonLinesSource.from_lines(['{"user_id": 1, "event_id": "fav", "page_id": "item", "ts": 1511848951}'])
        >>> next(iter(src))
        Event(user_id='1', event_id='fav', page_id='item', ts=1511848951.0, contents={})
    """

    events_checked = True  # each line is one event, checked as it is

    @staticmethod
    def parse(raw: str) -> Event | str:
        return event_from_json(raw)

    def user_of(self, parsed: Event) -> str:
        return parsed.user_id

    def ts_of(self, parsed: Event) -> float:
        return parsed.ts

    def user_events(self, state: None, parsed: Event) -> tuple[None, list[Event]]:
        return None, [parsed]


def event_from_json(raw: str) -> Event | str:
    """One JSON line as an event, or the reason it cannot be one."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return f"malformed JSON: {exc.msg} at column {exc.colno}"
    except (RecursionError, ValueError) as exc:  # nesting too deep, an integer of > 4300 digits
        return f"malformed JSON: {type(exc).__name__}: {str(exc)[:120]}"
    if not isinstance(obj, dict):
        return f"wrong type: expected a JSON object, got {type(obj).__name__}"
    missing = [name for name in _REQUIRED_JSON_FIELDS if name not in obj]
    if missing:
        return f"missing field: {', '.join(missing)}"
    ids = {}
    for name in ("user_id", "event_id", "page_id"):
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
            return f"wrong type: {name} must be a non-empty string or integer, got {value!r}"
        ids[name] = str(value)
    ts = obj["ts"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return f"wrong type: ts must be a number of Unix seconds, got {str(ts)[:40]!r}"
    if isinstance(ts, int) and not -1e15 < ts < 1e15:
        return f"absurd timestamp: an integer of {len(str(ts))} digits"
    contents = obj.get("contents", {})
    if contents is None:
        contents = {}
    if not isinstance(contents, dict):
        return f"wrong type: contents must be a JSON object, got {type(contents).__name__}"
    return Event(ids["user_id"], ids["event_id"], ids["page_id"], float(ts), contents)


FORMATS = {"taobao": TaobaoBehaviorSource, "jsonl": JsonLinesSource}


def open_source(path: str | os.PathLike[str], fmt: str | None = None,
                state_ttl_s: float | None = None) -> TaobaoBehaviorSource | JsonLinesSource:
    """The source for ``path``: ``fmt`` if given, else ``.csv`` → taobao, ``.jsonl``/``.json`` → jsonl.

    Example:
        >>> open_source("jobs/data/taobao_user_behavior_10k.csv").__class__.__name__
        'TaobaoBehaviorSource'
    """
    if fmt is None:
        suffix = Path(path).suffix.lower()
        fmt = {".csv": "taobao", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}.get(suffix)
        if fmt is None:
            raise ValueError(f"cannot tell the format of {path} from its extension; "
                             f"pass --format one of {', '.join(FORMATS)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown event format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"events file not found: {path}")
    return FORMATS[fmt](path, state_ttl_s=state_ttl_s)
