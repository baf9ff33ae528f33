"""A JSON-lines file's events as NumPy columns, a chunk at a time (the device runner's batch mode reads so).

The JSON-lines counterpart of :mod:`streamflow.csv_columns`: each line of
:class:`~streamflow.sources.JsonLinesSource` is one event, and a chunk's events become text columns
(:class:`~streamflow.columnar.TextColumn`: ``user_id``, ``event_id``, ``page_id`` and the ``contents`` keys
asked for) and a float64 ``ts``, in line order, with each event's line number and where its line lies in the
chunk's bytes (for the dead letters the timestamp guard makes).

Two parsers, one result. Plain lines (printable ASCII, no backslash, ``{`` first and ``}`` last, at most
:data:`MAX_OPENERS` brackets and :data:`MAX_PLAIN_BYTES` bytes) go to pyarrow's
JSON reader (a core dependency) with an explicit schema, a few thousand at a time; the lines it refuses (its error
names the row), and every line it takes where the streaming parser could decide otherwise (a missing or null id or
``ts``, an empty id, ``|ts| >= 1e15``, a missing or null ``contents`` key asked for), go through the streaming
run's own reader (:meth:`~streamflow.sources.LineSource.read_line`), line by line: a line it rejects is the same
:class:`~streamflow.events.Rejected` (reason, line number, text) as when streaming, a line it takes joins the
columns. pyarrow takes only objects whose ids and ``ts`` have the schema's types, so a value it reads is the
value ``json.loads`` reads (an integer id is read line by line: the streaming parser makes it text).

A ``contents`` key asked for whose value is not text (missing, null, a number) is marked in ``odd``: the batch
mode cannot hold it in a text column.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "e.jsonl")
    >>> _ = open(path, "w").write('{"user_id": "u", "event_id": "page_enter", "page_id": "item", "ts": 1511848894,'
    ...                           ' "contents": {"item_id": "9"}}\\n{"user_id": "u"}\\n\\n'
    ...                           '{"user_id": 7, "event_id": "fav", "page_id": "item", "ts": 1511848900}\\n')
    >>> (chunk,) = json_chunks(path, "e.jsonl", ["item_id"], 1 << 20)
    >>> chunk.line_numbers.tolist(), chunk.text("user_id"), chunk.text("item_id"), chunk.odd.tolist()
    ([1, 4], ['u', '7'], ['9', ''], [False, True])
    >>> [(r.line, r.reason) for r in chunk.rejected]
    [(2, 'missing field: event_id, page_id, ts')]
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamflow.columnar import TextColumn, append_text, select_rows
from streamflow.csv_columns import Fields
from streamflow.events import Event, Rejected
from streamflow.sources import JsonLinesSource, whole_line_chunks

_NEWLINE, _OPEN, _CLOSE, _BACKSLASH, _OPEN_LIST = 10, ord("{"), ord("}"), ord("\\"), ord("[")
#: The most ``{`` and ``[`` a line pyarrow reads may hold (a deeper value is json.loads's to refuse).
MAX_OPENERS = 64
#: The longest line pyarrow reads (a longer one may hold an integer too long for json.loads).
MAX_PLAIN_BYTES = 4096
#: Lines pyarrow parses at a time (one line it refuses makes it parse the rest of their piece again; the row it names
#: is the piece's).
PIECE_LINES = 1024
#: Event attributes read as text columns (``contents`` keys are asked for by name).
ID_FIELDS = ("user_id", "event_id", "page_id")
_ROW = re.compile(r"in row (\d+)")
#: The largest ``|ts|`` pyarrow's value is taken for (``event_from_json`` refuses an integer of more digits).
_TS_BOUND = 1e15


@dataclass
class JsonChunk:
    """A chunk's events as columns, in line order, and its lines the parser rejected.

    ``columns``: ``user_id``, ``event_id``, ``page_id`` and each ``contents`` key asked for as text (``""`` where
    ``odd``), ``ts`` as float64. ``fields`` gives each event's line (one field: the whole line) in ``data``, as
    :func:`streamflow.runners.batch_rows.guarded_lines` reads it."""

    columns: dict[str, Any]
    line_numbers: np.ndarray
    fields: Fields
    #: Events with a ``contents`` key asked for whose value is not text.
    odd: np.ndarray
    rejected: list[Rejected] = field(default_factory=list)
    last: bool = True
    lines_before: int = 0
    last_line: int = 0

    @property
    def ts(self) -> np.ndarray:
        ts: np.ndarray = self.columns["ts"]
        return ts

    def __len__(self) -> int:
        return len(self.line_numbers)

    def text(self, name: str) -> list[str]:
        """Text column ``name`` as a list (tests, examples)."""
        column = self.columns[name]
        values: list[str] = column.dictionary[column.codes].tolist()
        return values


def json_chunks(path: Any, name: str, contents_keys: Sequence[str], chunk_bytes: int) -> Iterator[JsonChunk | str]:
    """The file at ``path`` (a JSON-lines source named ``name``) a chunk of about ``chunk_bytes`` bytes at a time
    (whole lines, cut after a line break, line numbers counted on), each as a :class:`JsonChunk`; a chunk that
    cannot be read so gives the reason instead (a lone carriage return), and nothing more is read."""
    for data, lines_before, lines_after, last in whole_line_chunks(path, chunk_bytes):
        chunk = json_chunk(data, name, contents_keys, lines_before)
        if isinstance(chunk, str):
            yield chunk
            return
        chunk.last, chunk.last_line = last, lines_after
        yield chunk


def _schema(contents_keys: Sequence[str]) -> Any:
    import pyarrow as pa

    fields = [(name, pa.string()) for name in ID_FIELDS] + [("ts", pa.float64())]
    # contents always, an object even when no key is read: pyarrow then refuses what the streaming parser refuses
    # (a list, a string, a number: "contents must be a JSON object")
    fields.append(("contents", pa.struct([(key, pa.string()) for key in contents_keys])))
    return pa.schema(fields)


def json_chunk(data: bytes, name: str, contents_keys: Sequence[str], lines_before: int = 0) -> JsonChunk | str:
    """One chunk (whole lines of the file after its first ``lines_before``) as a :class:`JsonChunk`, or why not."""
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n")
        if b"\r" in data:
            return "a lone carriage return"
    if not data.endswith(b"\n"):
        data += b"\n"
    buf = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(buf == _NEWLINE)
    starts = np.empty_like(ends)
    starts[:1] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts
    nonempty = lengths > 0
    plain = nonempty.copy()
    plain[nonempty] = (buf[starts[nonempty]] == _OPEN) & (buf[ends[nonempty] - 1] == _CLOSE)
    odd_byte = (buf < 0x20) | (buf > 0x7E) | (buf == _BACKSLASH)
    odd_byte[ends] = False
    plain[np.unique(np.searchsorted(ends, np.flatnonzero(odd_byte)))] = False
    # json.loads refuses a value nested past Python's recursion limit (about 1,000 deep), pyarrow takes it: a line
    # with many brackets is read line by line
    openers = np.flatnonzero((buf == _OPEN) | (buf == _OPEN_LIST))
    plain &= np.bincount(np.searchsorted(ends, openers), minlength=len(ends))[:len(ends)] <= MAX_OPENERS
    plain &= lengths <= MAX_PLAIN_BYTES  # (json.loads refuses an integer of more than 4,300 digits, pyarrow takes it)
    fast = np.flatnonzero(plain)
    parsed, fast_ts, slow = _parse_plain(buf, plain, starts[fast], ends[fast], contents_keys)
    slow_lines = np.sort(np.concatenate([fast[slow], np.flatnonzero(nonempty & ~plain)]))
    # The other lines, as the streaming run reads them: a rejection, or an event that joins the columns.
    reader = JsonLinesSource.from_lines([], name=name)
    rejected: list[Rejected] = []
    taken: list[int] = []
    events: list[Event] = []
    for i in slow_lines.tolist():
        record = reader.read_line(lines_before + i + 1, data[starts[i]:ends[i]].decode("utf-8", "surrogateescape"))
        if record is None:
            continue
        if type(record) is Rejected:
            rejected.append(record)
        else:
            taken.append(i)
            events.append(record)
    good = np.ones(len(fast), dtype=bool)
    good[slow] = False
    rows = np.concatenate([fast[good], np.array(taken, dtype=fast.dtype)])
    order = np.argsort(rows, kind="stable")
    rows = rows[order]
    columns: dict[str, Any] = {}
    odd = np.zeros(len(rows), dtype=bool)
    for key in (*ID_FIELDS, *contents_keys):
        if key in ID_FIELDS:
            extra = [getattr(event, key) for event in events]
        else:
            raw = [event.contents.get(key) for event in events]
            extra = [value if type(value) is str else "" for value in raw]
            odd[len(rows) - len(events):] |= np.array([type(value) is not str for value in raw], dtype=bool)
        columns[key] = _text(select_rows(parsed[key], good), extra, order)
    odd = odd[order]
    ts = np.concatenate([fast_ts[good], np.array([event.ts for event in events], dtype=np.float64)])
    columns["ts"] = ts[order]
    fields = Fields(data, buf, starts[rows][:, None], ends[rows][:, None])
    return JsonChunk(columns, rows + 1 + lines_before, fields, odd, rejected, lines_before=lines_before)


def _text(fast: TextColumn, extra: list[str], order: np.ndarray) -> TextColumn:
    """A text column of ``fast``'s rows then ``extra``, in ``order``."""
    if not extra:
        return TextColumn(fast.codes[order], fast.dictionary)
    return select_rows(append_text(fast, extra), order)


def _parse_plain(buf: np.ndarray, plain: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                 contents_keys: Sequence[str]) -> tuple[dict[str, TextColumn], np.ndarray, np.ndarray]:
    """pyarrow's reading of the plain lines (``plain``: which lines; ``[starts, ends)``: where those lie in
    ``buf``): per field a text column of every plain line (meaningless where slow), ``ts`` float64, and the
    indices (among the plain lines) of those to read line by line instead. No value becomes a Python object but
    the dictionaries' (nor goes through pyarrow's ``to_numpy``, which imports pandas)."""
    keys = (*ID_FIELDS, *contents_keys)
    n = len(starts)
    slow = np.zeros(n, dtype=bool)
    if not n:
        empty = TextColumn(np.empty(0, dtype=np.int64), np.empty(0, dtype=object))
        return dict.fromkeys(keys, empty), np.zeros(0), np.flatnonzero(slow)
    text = buf[np.repeat(plain, np.diff(np.append(-1, np.flatnonzero(buf == _NEWLINE))))].tobytes()
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(ends - starts + 1)
    schema = _schema(contents_keys)
    tables: list[tuple[int, int, Any]] = []
    pending = [(a, min(a + PIECE_LINES, n)) for a in range(0, n, PIECE_LINES)][::-1]
    while pending:
        lo, hi = pending.pop()
        if lo >= hi:
            continue
        table, error_row = _read(text[offsets[lo]:offsets[hi]], schema)
        if table is not None and table.num_rows == hi - lo:
            tables.append((lo, hi, table))
        elif table is not None or error_row is None or error_row >= hi - lo:
            slow[lo:hi] = True  # a line holds two values, or pyarrow names no row: every line on its own
        else:  # the lines before the one refused again (one of them may hold two values), then those after it
            slow[lo + error_row] = True
            pending += [(lo + error_row + 1, hi), (lo, lo + error_row)]
    import pyarrow as pa
    import pyarrow.compute as pc

    tables.sort(key=lambda piece: piece[0])
    parsed = np.concatenate([np.arange(lo, hi) for lo, hi, _ in tables]) if tables else np.zeros(0, dtype=np.int64)
    slow[np.setdiff1d(np.arange(n), parsed)] = True
    columns: dict[str, TextColumn] = {}
    ts = np.zeros(n)
    if not tables:
        empty = TextColumn(np.zeros(n, dtype=np.int64), np.array([""], dtype=object))
        return dict.fromkeys(keys, empty), ts, np.flatnonzero(slow)
    table = pa.concat_tables([piece for _, _, piece in tables])
    # where the streaming parser could decide otherwise: a null or empty id, no ts or a huge one, a key asked for null
    # (computed in NumPy from the buffers: a Python scalar given to pyarrow.compute imports pandas)
    ts[parsed] = _numbers(table.column("ts"), np.float64)
    doubt = _bools(pc.is_null(table.column("ts"))) | ~(np.abs(ts[parsed]) < _TS_BOUND)
    by_key = {key: table.column(key) for key in ID_FIELDS}
    for key in ID_FIELDS:
        doubt |= _bools(pc.is_null(by_key[key])) | (_numbers(pc.utf8_length(by_key[key]), np.int32) == 0)
    if contents_keys:
        contents = table.column("contents").combine_chunks()
        for key in contents_keys:
            by_key[key] = pc.struct_field(contents, [key])
            doubt |= _bools(pc.is_null(by_key[key]))
    slow[parsed[doubt]] = True
    for key in keys:
        encoded = pc.dictionary_encode(by_key[key])  # (a null's code is never read: its line is slow)
        if isinstance(encoded, pa.ChunkedArray):
            encoded = encoded.combine_chunks() if encoded.num_chunks != 1 else encoded.chunk(0)
        if isinstance(encoded, pa.ChunkedArray):  # no chunk: nothing parsed
            encoded = pa.DictionaryArray.from_arrays(pa.array([], pa.int32()), pa.array([], pa.string()))
        codes = np.zeros(n, dtype=np.int64)
        codes[parsed] = _numbers(encoded.indices, np.int32)
        columns[key] = TextColumn(codes, np.array(encoded.dictionary.to_pylist() or [""], dtype=object))
    return columns, ts, np.flatnonzero(slow)


def _numbers(array: Any, dtype: Any) -> np.ndarray:
    """A primitive pyarrow array without nulls (one chunk or several) as NumPy, from its buffers."""
    chunks = array.chunks if hasattr(array, "chunks") else [array]
    parts = [np.frombuffer(chunk.buffers()[1], dtype=dtype, count=chunk.offset + len(chunk))[chunk.offset:]
             for chunk in chunks if len(chunk)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _bools(array: Any) -> np.ndarray:
    """A boolean pyarrow array without nulls (one chunk or several) as NumPy, from its bitmaps."""
    parts = []
    for chunk in array.chunks if hasattr(array, "chunks") else [array]:
        if len(chunk):
            span = slice(chunk.offset, chunk.offset + len(chunk))
            parts.append(np.unpackbits(np.frombuffer(chunk.buffers()[1], dtype=np.uint8), bitorder="little")[span])
    return np.concatenate(parts).astype(bool) if parts else np.zeros(0, dtype=bool)


def _read(text: bytes, schema: Any) -> tuple[Any, int | None]:
    """pyarrow's table of ``text``, or ``(None, the row it names in its error)``."""
    import pyarrow as pa
    import pyarrow.json as pj

    try:
        table = pj.read_json(io.BytesIO(text), read_options=pj.ReadOptions(use_threads=False,
                                                                           block_size=max(len(text), 1 << 20)),
                             parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        found = _ROW.search(str(exc))
        return None, int(found.group(1)) if found else None
    return table, None
