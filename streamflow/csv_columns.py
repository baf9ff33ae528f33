"""The fields of a comma-separated file as NumPy columns (the device runner's batch mode reads so).

Plain lines (printable ASCII, no quoting, the same number of fields) are found and split at once; the
other lines are left to a line-by-line parser. Everything works on the file's bytes as one array, a
column of fields at a time, so memory stays a few arrays of one entry per line. (pyarrow's CSV reader
would do the parsing, but importing pyarrow costs ~30 MB and ~60 ms, as much as the rest of the device
runtime's start-up.)

Example:
    >>> fields = plain_lines(b"7,ab,-12\\n8,ab,5\\n", 3)[0]
    >>> column = text_codes(fields, 1)
    >>> column.codes.tolist(), column.dictionary.tolist(), integer_values(fields, 2, 15)[0].tolist()
    ([0, 0], ['ab'], [-12, 5])
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from streamflow.columnar import TextColumn

_NEWLINE, _COMMA, _MINUS, _ZERO = 10, 44, 45, 48
#: Bytes of a clean line (printable ASCII but the space) and the newline: ``bytes.translate`` deletes
#: them to find any other.
PLAIN_BYTES = bytes(range(0x21, 0x7F)) + b"\n"
_HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
#: The widest field window read (text fields longer than this are refused).
MAX_WIDTH = 64
#: ``_LOW_BYTES[n]``: the mask of a little-endian word's first ``n`` bytes (0 to 8).
_LOW_BYTES = np.array([(1 << (8 * n)) - 1 for n in range(9)], dtype=np.uint64)


@dataclass
class Fields:
    """Where each field of each line lies in ``data`` (``buf``, as an array): ``[starts[:, k], ends[:, k])``."""

    data: bytes
    buf: np.ndarray
    starts: np.ndarray
    ends: np.ndarray

    def __len__(self) -> int:
        return len(self.starts)

    def lengths(self, k: int) -> np.ndarray:
        return self.ends[:, k] - self.starts[:, k]

    def select(self, rows: np.ndarray) -> Fields:
        """The fields of the lines ``rows`` (a boolean mask or indices) only."""
        return Fields(self.data, self.buf, self.starts[rows], self.ends[rows])

    def first_word(self, k: int) -> np.ndarray:
        """The first 8 bytes of field ``k`` of each line as one little-endian ``uint64``, zeros past the field's
        end: :meth:`window` ``(k, 8)`` as words, read as unaligned words of ``buf`` (no row of bytes per line)."""
        starts = self.starts[:, k]
        words: np.ndarray = np.ndarray((len(self.buf) - 7,), dtype="<u8", buffer=self.buf, strides=(1,))
        return words[starts] & _LOW_BYTES[np.minimum(self.ends[:, k] - starts, 8)]

    def window(self, k: int, width: int) -> np.ndarray:
        """The first ``width`` bytes (at most :data:`MAX_WIDTH`) of field ``k``, a row per line, zeros past
        the field's end."""
        starts = self.starts[:, k]
        block = sliding_window_view(self.buf, width)[starts]  # buf ends in MAX_WIDTH spare bytes
        block *= np.arange(width) < (self.ends[:, k] - starts)[:, None]
        return block


def plain_lines(data: bytes, n_fields: int) -> tuple[Fields, np.ndarray, np.ndarray, np.ndarray]:
    """The lines of ``data`` (``\\n``-separated, the last newline optional) of plain fields,
    whatever the other lines hold: ``(their fields, their indices among all lines, where every line starts
    and ends in the fields' data)``.

    A plain line has only printable ASCII but the space, exactly ``n_fields`` non-empty comma-separated
    fields, none longer than :data:`MAX_WIDTH`; the others are for a line-by-line parser.

    Example:
        >>> fields, rows, starts, ends = plain_lines(b"7,ab\\n8,\\n\\nx y,1\\n9,cd", 2)
        >>> rows.tolist(), len(starts), text_codes(fields, 1).dictionary.tolist()
        ([0, 4], 5, ['ab', 'cd'])
    """
    data += (b"" if data.endswith(b"\n") else b"\n") + bytes(MAX_WIDTH)  # spare bytes for Fields.window
    buf = np.frombuffer(data, dtype=np.uint8)
    body = buf[:-MAX_WIDTH]
    position = np.int32 if len(buf) < 2**31 else np.int64
    line_ends: np.ndarray = np.flatnonzero(body == _NEWLINE).astype(position)
    n = len(line_ends)
    line_starts = np.empty(n, dtype=position)
    line_starts[:1] = 0
    line_starts[1:] = line_ends[:-1] + 1
    plain = np.zeros(256, dtype=bool)
    plain[np.frombuffer(PLAIN_BYTES, dtype=np.uint8)] = True
    # Per line: its commas, and whether it holds a byte that is not plain (few: they are found, then their lines).
    commas = np.flatnonzero(body == _COMMA).astype(position)
    line_of_comma = np.searchsorted(line_ends, commas)
    candidate = np.bincount(line_of_comma, minlength=n) == n_fields - 1
    candidate[np.searchsorted(line_ends, np.flatnonzero(~plain[body]))] = False
    commas = commas[candidate[line_of_comma]].reshape(-1, n_fields - 1)
    rows = np.flatnonzero(candidate)
    starts = np.column_stack([line_starts[rows], commas + 1])
    ends = np.column_stack([commas, line_ends[rows]])
    widths = ends - starts
    good = np.all((widths > 0) & (widths <= MAX_WIDTH), axis=1)
    return Fields(data, buf, starts[good], ends[good]), rows[good], line_starts, line_ends


def text_codes(fields: Fields, k: int) -> TextColumn | str:
    """Field ``k`` of every line as a text column (codes in order of first appearance)."""
    width = int(fields.lengths(k).max())
    if width > MAX_WIDTH:
        return f"a field longer than {MAX_WIDTH} bytes"
    if width <= 8:
        words = None
        key = fields.first_word(k)  # the bytes themselves: distinct fields, distinct keys
    else:
        words = fields.window(k, -(-width // 8) * 8).view("<u8")  # the field's bytes, 8 to a word
        key = words[:, 0].copy()
        for j in range(1, words.shape[1]):
            key = key * _HASH_MULTIPLIER + words[:, j]
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    if words is not None and np.any(words != words[first[inverse]]):
        return "two distinct fields with one hash"
    by_appearance = np.argsort(first)
    rank = np.empty_like(by_appearance)
    rank[by_appearance] = np.arange(len(by_appearance))
    line_of, data = first[by_appearance], fields.data
    values = [data[s:e].decode("ascii") for s, e in zip(fields.starts[line_of, k].tolist(),
                                                          fields.ends[line_of, k].tolist(), strict=True)]
    return TextColumn(rank[inverse.ravel()], np.array(values, dtype=object))


def integer_values(fields: Fields, k: int, max_digits: int = 15) -> tuple[np.ndarray, np.ndarray]:
    """Field ``k`` of every line as int64 where it is an optional ``-`` and 1 to ``max_digits`` (at most 15)
    ASCII digits, and where it is (``(values, valid)``; an invalid line's value is meaningless).

    Example:
        >>> fields = plain_lines(b"a,12\\nb,1x\\nc,-3\\n", 2)[0]
        >>> values, valid = integer_values(fields, 1)
        >>> values[valid].tolist(), valid.tolist()
        ([12, -3], [True, False, True])
    """
    block = fields.window(k, 16).astype(np.int16) - _ZERO
    negative = block[:, 0] == _MINUS - _ZERO
    digits = fields.lengths(k) - negative
    max_digits = min(max_digits, 15)  # the window read is 16 bytes: a sign and 15 digits
    valid = (digits >= 1) & (digits <= max_digits)
    value = np.zeros(len(fields), dtype=np.int64)
    shape = np.where(valid, digits * 2 + negative, -1)
    for code in np.unique(shape[valid]).tolist():  # a few: sign and number of digits
        sign, length = code % 2, code // 2
        rows = np.flatnonzero(shape == code)
        numerals = block[rows, sign:sign + length]
        numeric = np.all((numerals >= 0) & (numerals <= 9), axis=1)
        valid[rows[~numeric]] = False
        value[rows] = np.where(numeric, numerals.astype(np.int64) @ 10 ** np.arange(length - 1, -1, -1,
                                                                                        dtype=np.int64), 0)
    return np.where(negative, -value, value), valid


def one_of(fields: Fields, k: int, values: Iterable[str]) -> np.ndarray:
    """Whether field ``k`` of each line is one of ``values`` (ASCII words of at most 8 bytes).

    Example:
        >>> fields = plain_lines(b"a,pv\\nb,nap\\nc,buy\\n", 2)[0]
        >>> one_of(fields, 1, ["pv", "buy"]).tolist()
        [True, False, True]
    """
    words = np.frombuffer(b"".join(value.encode("ascii").ljust(8, b"\0") for value in values), dtype="<u8")
    return (fields.lengths(k) <= 8) & np.isin(fields.first_word(k), words)
