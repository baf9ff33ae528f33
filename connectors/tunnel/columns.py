"""The tunnel's compact column codec: the values of a batch whose schema both sides know, as varints and bytes.

Arrow IPC spends ~900 bytes on a one-row IPV batch (flatbuffer metadata, 8-byte aligned buffers) to carry
~25 bytes of information. The schema is registered once (:mod:`.registry`), so an envelope needs only the
values. Layout for ``n`` rows, every varint unsigned LEB128::

    null section (only when the envelope's N flag is set):
        varint k, then k times: varint column index, ceil(n/8) bytes of its validity bitmap (LSB first)
    then each column in schema order, its m non-null values:
        int-like (integers, timestamps, dates, times, durations):
                 m varints: zigzag of the difference to the previous value (the first to 0), 64-bit wrapping
        float:   m varints: 0 = not integral, its IEEE bytes are in the raw section that follows the varints;
                 odd 2z+1 = integral, z the zigzag difference to the previous integral value (|value| < 2**53)
        string:  m varints: odd 2v+1 = the canonical decimal number v (ids like "2200475", up to 18 digits),
                 even 2l = a string of l bytes in the raw section that follows the varints
        binary:  m varints (lengths), then the bytes
        bool:    ceil(m/8) bytes, a bitmap LSB first
        other types (lists, structs, decimals, dictionaries, ...): varint length, then an Arrow IPC record
                 batch of the column's n rows (it carries its own validity: never in the null section)

Encoding and decoding are vectorized with NumPy and Arrow compute. :func:`decode` raises ``ValueError`` on a
payload that does not fit the schema, whatever part of it (NumPy, Arrow's IPC reader) noticed.

Example:
    >>> import pyarrow as pa
    >>> rows = pa.table({"user_id": ["999477", "u-7", None], "ts": [1511848908.0, 1511848951.0, 0.5], "n": [0, 1, 2]})
    >>> payload, has_nulls = encode(rows)
    >>> len(payload), has_nulls
    (29, True)
    >>> decode(payload, rows.schema, 3, has_nulls).equals(rows)
    True
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_DECIMAL = r"^(0|[1-9][0-9]{0,17})$"  # canonical decimal numbers below 10**18 (they fit 2v+1 in 64 bits)
_DECIMAL_RE = re.compile(r"(?:0|[1-9][0-9]{0,17})\Z", re.ASCII)
_FLOAT_EXACT = 2.0**53
_U64 = np.uint64
#: Up to this many values, strings are sorted out in Python (Arrow compute costs ~10 us a call, whatever the size).
_FEW = 16
#: Up to this many rows, columns are encoded value by value in Python (a one-row envelope: ~40 us instead of ~400).
_FEW_ROWS = 8
_MASK64 = (1 << 64) - 1


def encode(rows: pa.Table, vectorized: bool | None = None) -> tuple[bytes, bool]:
    """``rows`` as a compact payload, and whether it has a null section (the envelope's N flag).

    ``vectorized``: encode with NumPy (True) or value by value in Python (False), the same bytes either way;
    default: Python up to ``_FEW_ROWS`` rows.
    """
    rows = rows.combine_chunks()
    n = rows.num_rows
    encode_column = _encode_column if (n > _FEW_ROWS if vectorized is None else vectorized) else _encode_column_few
    columns = [c.chunk(0) if c.num_chunks else pa.array([], c.type) for c in rows.columns]
    nullable = [i for i, (field, column) in enumerate(zip(rows.schema, columns, strict=True))
                if column.null_count and _kind(field.type) != "arrow"]
    parts: list[bytes] = []
    if nullable:
        parts.append(_varints(np.array([len(nullable)], _U64)))
        for i in nullable:
            valid = np.asarray(columns[i].is_valid(), dtype=bool)
            parts.append(_varints(np.array([i], _U64)) + np.packbits(valid, bitorder="little").tobytes())
    for field, column in zip(rows.schema, columns, strict=True):
        parts.append(encode_column(field, column, n))
    return b"".join(parts), bool(nullable)


def decode(payload: bytes, schema: pa.Schema, n: int, has_nulls: bool) -> pa.Table:
    """The ``n`` rows of ``schema`` in ``payload`` (see the module docstring); ``ValueError`` if it does not fit."""
    try:
        return _decode(payload, schema, n, has_nulls)
    except ValueError:
        raise
    except (pa.ArrowException, OSError, EOFError, IndexError, OverflowError, TypeError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from exc


def _decode(payload: bytes, schema: pa.Schema, n: int, has_nulls: bool) -> pa.Table:
    buf = np.frombuffer(payload, dtype=np.uint8)
    pos = 0
    valid: dict[int, np.ndarray] = {}
    if has_nulls:
        (k,), pos = _read_varints(buf, pos, 1)
        if not 0 < k <= len(schema):
            raise ValueError(f"null section names {k} columns, the schema has {len(schema)}")
        width = (n + 7) // 8
        for _ in range(int(k)):
            (index,), pos = _read_varints(buf, pos, 1)
            if index >= len(schema) or pos + width > len(buf):
                raise ValueError(f"null section: column {index} or its bitmap is out of range")
            valid[int(index)] = np.unpackbits(buf[pos:pos + width], count=n, bitorder="little").astype(bool)
            pos += width
    arrays = []
    for i, field in enumerate(schema):
        mask = valid.get(i)
        m = n if mask is None else int(mask.sum())
        values, pos = _decode_column(field, buf, pos, m, n)
        if mask is not None:
            index = np.cumsum(mask, dtype=np.int64) - 1
            values = values.take(pa.array(index, mask=~mask))
        arrays.append(values)
    if pos != len(buf):
        raise ValueError(f"{len(buf) - pos} bytes left over after the last column")
    return pa.Table.from_arrays(arrays, schema=schema)


def supported_compactly(schema: pa.Schema) -> bool:
    """Whether every column has a compact encoding (else some travel as Arrow IPC, still correct, just bigger)."""
    return all(_kind(field.type) != "arrow" for field in schema)


# -- per column -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def _kind(t: pa.DataType) -> str:
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_integer(t) or pa.types.is_temporal(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "binary"
    return "arrow"


def _storage(t: pa.DataType) -> pa.DataType:
    """The integer type holding an int-like type's values (itself for integers)."""
    if pa.types.is_integer(t):
        return t
    return pa.int64() if t.bit_width == 64 else pa.int32()


def _encode_column(field: pa.Field, column: pa.Array, n: int) -> bytes:
    kind = _kind(field.type)
    if kind == "arrow":
        body = pa.RecordBatch.from_arrays([column], schema=pa.schema([field])).serialize().to_pybytes()
        return _varints(np.array([len(body)], _U64)) + body
    values = column.drop_null() if column.null_count else column
    if kind == "int":
        return _varints(_zigzag(_delta(_as_int64(values, field.type))))
    if kind == "float":
        x = values.to_numpy(zero_copy_only=False)
        wide = x.astype(np.float64)
        integral = (np.isfinite(wide) & (wide == np.trunc(wide)) & (np.abs(wide) < _FLOAT_EXACT)
                    & ~((wide == 0) & np.signbit(wide)))
        codes = np.zeros(len(x), _U64)
        ints = wide[integral].astype(np.int64)
        codes[integral] = (_zigzag(_delta(ints)) << _U64(1)) | _U64(1)
        raw = x[~integral].astype(x.dtype.newbyteorder("<"), copy=False).tobytes()
        return _varints(codes) + raw
    if kind == "bool":
        return np.packbits(np.asarray(values.to_numpy(zero_copy_only=False), dtype=bool), bitorder="little").tobytes()
    if kind == "string" and len(values) <= _FEW:
        codes_, raw_ = [], []
        for v in values.to_pylist():
            if _DECIMAL_RE.match(v):
                codes_.append(2 * int(v) + 1)
            else:
                b = v.encode()
                codes_.append(2 * len(b))
                raw_.append(b)
        return _varints(np.array(codes_, _U64)) + b"".join(raw_)
    if kind == "string":
        numeric = np.asarray(pc.match_substring_regex(values, _DECIMAL).to_numpy(zero_copy_only=False), dtype=bool)
        codes = np.zeros(len(values), _U64)
        if numeric.any():
            codes[numeric] = (values.filter(pa.array(numeric)).cast(pa.uint64()).to_numpy().astype(_U64)
                              << _U64(1)) | _U64(1)
        raw = values.filter(pa.array(~numeric)) if numeric.any() else values
    else:
        numeric, raw = np.zeros(len(values), dtype=bool), values
        codes = np.zeros(len(values), _U64)
    lengths, blob = _lengths_and_bytes(raw)
    codes[~numeric] = lengths.astype(_U64) << _U64(1 if kind == "string" else 0)
    return _varints(codes) + blob


def _encode_column_few(field: pa.Field, column: pa.Array, n: int) -> bytes:
    """:func:`_encode_column` value by value in Python: the same bytes, without NumPy's per-call cost."""
    kind = _kind(field.type)
    if kind in ("arrow", "bool"):
        return _encode_column(field, column, n)
    values = column.drop_null() if column.null_count else column
    out = bytearray()
    if kind == "int":
        storage = _storage(field.type)
        previous = 0
        for v in (values if storage == field.type else values.view(storage)).to_pylist():
            v = v - (1 << 64) if v >= 1 << 63 else v  # uint64: its bits as int64
            d = (v - previous + (1 << 63)) % (1 << 64) - (1 << 63)
            previous = v
            _put_varint(out, ((d << 1) ^ (d >> 63)) & _MASK64)
        return bytes(out)
    if kind == "float":
        x = values.to_numpy(zero_copy_only=False)
        raw, previous = [], 0
        for i, v in enumerate(x.tolist()):
            if math.isfinite(v) and v == math.floor(v) and abs(v) < _FLOAT_EXACT and not (
                    v == 0 and math.copysign(1.0, v) < 0):
                d, previous = int(v) - previous, int(v)
                _put_varint(out, (((d << 1) ^ (d >> 63)) & _MASK64) << 1 | 1)
            else:
                out.append(0)
                raw.append(x[i:i + 1].astype(x.dtype.newbyteorder("<"), copy=False).tobytes())
        return bytes(out) + b"".join(raw)
    raw = []
    for v in values.to_pylist():
        if kind == "string" and _DECIMAL_RE.match(v):
            _put_varint(out, 2 * int(v) + 1)
            continue
        b = v.encode() if kind == "string" else v
        _put_varint(out, len(b) << (1 if kind == "string" else 0))
        raw.append(b)
    return bytes(out) + b"".join(raw)


def _decode_few(t: pa.DataType, kind: str, codes: list[int]) -> pa.Array:
    """A few int-like values, or a few floats that are all integral, value by value in Python."""
    values, total = [], 0
    for code in codes if kind == "int" else [c >> 1 for c in codes]:
        d = (code >> 1) ^ -(code & 1)
        total = (total + d + (1 << 63)) % (1 << 64) - (1 << 63)  # wrapping at 64 bits, as the encoder did
        values.append(total)
    if kind == "float":
        return pa.array([float(v) for v in values], type=t)
    storage = _storage(t)
    if storage == pa.uint64():
        return pa.array([v % (1 << 64) for v in values], type=t)
    array = pa.array(values, type=storage)  # checks the range of narrower types
    return array if storage == t else array.view(t)


def _put_varint(out: bytearray, x: int) -> None:
    while x > 0x7F:
        out.append((x & 0x7F) | 0x80)
        x >>= 7
    out.append(x)


def _decode_column(field: pa.Field, buf: np.ndarray, pos: int, m: int, n: int) -> tuple[pa.Array, int]:
    t, kind = field.type, _kind(field.type)
    if kind == "arrow":
        (size,), pos = _read_varints(buf, pos, 1)
        end = pos + int(size)
        if end > len(buf):
            raise ValueError(f"column {field.name}: {size} bytes of Arrow IPC run past the payload")
        batch = pa.ipc.read_record_batch(pa.py_buffer(buf[pos:end].tobytes()), pa.schema([field]))
        if batch.num_rows != n:
            raise ValueError(f"column {field.name}: {batch.num_rows} rows, the envelope says {n}")
        return batch.column(0), end
    if kind == "bool":
        width = (m + 7) // 8
        if pos + width > len(buf):
            raise ValueError(f"column {field.name}: bitmap runs past the payload")
        bits = np.unpackbits(buf[pos:pos + width], count=m, bitorder="little").astype(bool)
        return pa.array(bits, type=t), pos + width
    codes, pos = _read_varints(buf, pos, m)
    if m <= _FEW_ROWS and (kind == "int" or (kind == "float" and t != pa.float16() and (codes & _U64(1)).all())):
        return _decode_few(t, kind, codes.tolist()), pos
    if kind == "int":
        ints = np.cumsum(_unzigzag(codes), dtype=np.int64)
        storage = _storage(t)
        if storage == pa.uint64():
            return pa.array(ints.view(_U64), type=t), pos
        array = pa.array(ints, type=storage)  # checks the range of narrower types
        return (array if storage == t else array.view(t)), pos
    if kind == "float":
        odd = (codes & _U64(1)).astype(bool)
        raw_count = int((~odd).sum())
        if (codes[~odd] != 0).any():
            raise ValueError(f"column {field.name}: a float code that is neither 0 nor odd")
        dtype = np.dtype(t.to_pandas_dtype()).newbyteorder("<")
        end = pos + raw_count * dtype.itemsize
        if end > len(buf):
            raise ValueError(f"column {field.name}: raw floats run past the payload")
        x = np.empty(m, dtype=dtype)
        x[odd] = np.cumsum(_unzigzag(codes[odd] >> _U64(1)), dtype=np.int64)
        x[~odd] = np.frombuffer(buf[pos:end].tobytes(), dtype=dtype)
        return pa.array(x.astype(dtype.newbyteorder("="), copy=False), type=t), end
    if kind == "string" and m <= _FEW:
        out, at = [], pos
        for code in codes.tolist():
            if code & 1:
                out.append(str(code >> 1))
            else:
                size = code >> 1
                if at + size > len(buf):
                    raise ValueError(f"column {field.name}: a string runs past the payload")
                out.append(buf[at:at + size].tobytes().decode())
                at += size
        return pa.array(out, type=t), at
    numeric = (codes & _U64(1)).astype(bool) if kind == "string" else np.zeros(m, dtype=bool)
    lengths = (codes[~numeric] >> _U64(1 if kind == "string" else 0)).astype(np.int64)
    total = int(lengths.sum()) if len(lengths) else 0
    if total < 0 or pos + total > len(buf) or (len(lengths) and lengths.max() > len(buf)):
        raise ValueError(f"column {field.name}: {total} bytes of values run past the payload")
    large = pa.types.is_large_string(t) or pa.types.is_large_binary(t) or total >= 1 << 31
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64 if large else np.int32)
    blob = pa.py_buffer(buf[pos:pos + total].tobytes())
    base = (pa.large_string() if large else pa.string()) if kind == "string" else (
        pa.large_binary() if large else pa.binary())
    raw = pa.Array.from_buffers(base, len(lengths), [None, pa.py_buffer(offsets.tobytes()), blob])
    raw.validate(full=True)  # UTF-8 of strings
    if numeric.any():
        numbers = pa.array(codes[numeric] >> _U64(1), type=pa.uint64()).cast(base)
        order = np.empty(m, dtype=np.int64)
        order[numeric] = np.arange(len(numbers))
        order[~numeric] = len(numbers) + np.arange(len(raw))
        raw = pa.concat_arrays([numbers, raw]).take(pa.array(order))
    return (raw if raw.type == t else raw.cast(t)), pos + total


def _as_int64(values: pa.Array, t: pa.DataType) -> np.ndarray:
    storage = _storage(t)
    if storage != t:
        values = values.view(storage)
    ints = values.to_numpy(zero_copy_only=False)
    return ints.view(np.int64) if ints.dtype == np.uint64 else ints.astype(np.int64, copy=False)


def _lengths_and_bytes(values: pa.Array) -> tuple[np.ndarray, bytes]:
    """Each value's length and all values' bytes, back to back, straight from the Arrow buffers."""
    if not len(values):
        return np.zeros(0, np.int64), b""
    large = pa.types.is_large_string(values.type) or pa.types.is_large_binary(values.type)
    _, offsets_buffer, data = values.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64 if large else np.int32,
                            count=len(values) + 1, offset=values.offset * (8 if large else 4)).astype(np.int64)
    blob = b"" if data is None else memoryview(data)[offsets[0]:offsets[-1]].tobytes()
    return np.diff(offsets), blob


# -- varints and zigzag ---------------------------------------------------------------------------
def _delta(x: np.ndarray) -> np.ndarray:
    """Each value minus the one before it (the first minus 0), wrapping at 64 bits."""
    d = x.astype(np.int64, copy=True)
    d[1:] -= x[:-1]
    return d


def _zigzag(d: np.ndarray) -> np.ndarray:
    d = d.astype(np.int64, copy=False)
    return ((d << np.int64(1)) ^ (d >> np.int64(63))).view(_U64)


def _unzigzag(u: np.ndarray) -> np.ndarray:
    u = u.astype(_U64, copy=False)
    return ((u >> _U64(1)) ^ (_U64(0) - (u & _U64(1)))).view(np.int64)


_THRESHOLDS = np.array([1 << (7 * k) for k in range(1, 10)], dtype=_U64)  # a varint needs k+1 bytes from here
_SHIFTS = np.arange(0, 70, 7, dtype=_U64)


def _varints(values: np.ndarray) -> bytes:
    """Unsigned LEB128 of each value, back to back."""
    if not len(values):
        return b""
    v = values.astype(_U64, copy=False)
    if len(v) == 1:  # the one-row envelope: skip the array machinery
        x, out = int(v[0]), bytearray()
        while x > 0x7F:
            out.append((x & 0x7F) | 0x80)
            x >>= 7
        out.append(x)
        return bytes(out)
    size = np.searchsorted(_THRESHOLDS, v, side="right") + 1
    width = int(size.max())
    digits = ((v[:, None] >> _SHIFTS[:width]) & _U64(0x7F)).astype(np.uint8)  # (n, width), low 7 bits first
    position = np.arange(width)
    digits[position < (size[:, None] - 1)] |= 0x80  # more bytes follow
    return digits[position < size[:, None]].tobytes()  # row by row: each value's bytes in order


def _read_varints(buf: np.ndarray, pos: int, count: int) -> tuple[np.ndarray, int]:
    """``count`` varints from ``buf[pos:]`` and the position after them."""
    if count == 0:
        return np.zeros(0, _U64), pos
    if count <= 4:  # the one-row envelope: skip the array machinery
        values = []
        for _ in range(count):
            value = shift = 0
            while True:
                if pos >= len(buf) or shift > 63:
                    raise ValueError(f"a varint at byte {pos} runs past the payload or 10 bytes")
                byte = int(buf[pos])
                pos += 1
                value |= (byte & 0x7F) << shift
                if byte < 0x80:
                    break
                shift += 7
            values.append(value & 0xFFFFFFFFFFFFFFFF)
        return np.array(values, _U64), pos
    head = buf[pos:pos + count]
    if len(head) == count and head.max() < 0x80:  # every value fits one byte (small counts, small deltas)
        return head.astype(_U64), pos + count
    window = buf[pos:pos + 10 * count]
    ends = np.flatnonzero(window < 0x80)[:count]
    if len(ends) < count:
        raise ValueError(f"{count} varints expected at byte {pos}, the payload ends first")
    starts = np.empty(count, np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    size = ends - starts + 1
    if size.max() > 10:
        raise ValueError(f"a varint longer than 10 bytes at byte {pos}")
    end = int(ends[-1]) + 1
    shifts = (np.arange(end, dtype=np.int64) - np.repeat(starts, size)) * 7
    parts = (window[:end] & 0x7F).astype(_U64) << shifts.astype(_U64)
    return np.add.reduceat(parts, starts), pos + end
