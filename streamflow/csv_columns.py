"""The fields of a comma-separated file as NumPy columns (the device runner's batch mode reads so).

For files of plain lines only: printable ASCII, no quoting, every line the same number of fields.
Everything works on the file's bytes as one array, a column of fields at a time, so memory stays
a few arrays of one entry per line. (pyarrow's CSV reader would do the parsing, but importing
pyarrow costs ~30 MB and ~60 ms, as much as the rest of the device runtime's start-up.)

Example:
    >>> fields = split_lines(b"7,ab,-12\\n8,ab,5\\n", 3)
    >>> column = text_codes(fields, 1)
    >>> column.codes.tolist(), column.dictionary.tolist(), integers(fields, 2, 15).tolist()
    ([0, 0], ['ab'], [-12, 5])
"""

from __future__ import annotations

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

    def window(self, k: int, width: int) -> np.ndarray:
        """The first ``width`` bytes (at most :data:`MAX_WIDTH`) of field ``k``, a row per line, zeros past
        the field's end."""
        starts = self.starts[:, k]
        block = sliding_window_view(self.buf, width)[starts]  # buf ends in MAX_WIDTH spare bytes
        block *= np.arange(width) < (self.ends[:, k] - starts)[:, None]
        return block


def split_lines(data: bytes, n_fields: int) -> Fields | str:
    """The field bounds of ``data``'s lines (``\\n``-separated, the last newline optional), each of
    exactly ``n_fields`` non-empty comma-separated fields; or why not."""
    if data.translate(None, PLAIN_BYTES):
        return "bytes other than printable ASCII (a space, a tab, a carriage return, non-ASCII)"
    if data.startswith(b"\n") or b"\n\n" in data:
        return "a blank line"
    data += (b"" if data.endswith(b"\n") else b"\n") + bytes(MAX_WIDTH)  # spare bytes for Fields.window
    buf = np.frombuffer(data, dtype=np.uint8)
    position = np.int32 if len(buf) < 2**31 else np.int64  # half the memory for files under 2 GiB
    line_ends = np.flatnonzero(buf[:-MAX_WIDTH] == _NEWLINE).astype(position)
    commas = np.flatnonzero(buf[:-MAX_WIDTH] == _COMMA).astype(position)
    n = len(line_ends)
    if len(commas) != (n_fields - 1) * n:
        return f"a line without exactly {n_fields} fields"
    commas = commas.reshape(n, n_fields - 1)
    line_starts = np.empty(n, dtype=position)
    line_starts[0] = 0
    line_starts[1:] = line_ends[:-1] + 1
    # The commas are in order and as many as the lines need: every line has its own if each line's
    # first comma is after its start and its last one before its end.
    if np.any(commas[:, 0] < line_starts) or np.any(commas[:, -1] > line_ends):
        return f"a line without exactly {n_fields} fields"
    starts = np.column_stack([line_starts, commas + 1])
    ends = np.column_stack([commas, line_ends])
    if np.any(ends <= starts):
        return "an empty field"
    return Fields(data, buf, starts, ends)


def text_codes(fields: Fields, k: int) -> TextColumn | str:
    """Field ``k`` of every line as a text column (codes in order of first appearance)."""
    width = int(fields.lengths(k).max())
    if width > MAX_WIDTH:
        return f"a field longer than {MAX_WIDTH} bytes"
    words = fields.window(k, -(-width // 8) * 8).view("<u8")  # the field's bytes, 8 to a word
    if words.shape[1] == 1:
        key = words[:, 0]  # the bytes themselves: distinct fields, distinct keys
    else:
        key = words[:, 0].copy()
        for j in range(1, words.shape[1]):
            key = key * _HASH_MULTIPLIER + words[:, j]
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    if words.shape[1] > 1 and np.any(words != words[first[inverse]]):
        return "two distinct fields with one hash"
    by_appearance = np.argsort(first)
    rank = np.empty_like(by_appearance)
    rank[by_appearance] = np.arange(len(by_appearance))
    line_of, data = first[by_appearance], fields.data
    values = [data[s:e].decode("ascii") for s, e in zip(fields.starts[line_of, k].tolist(),
                                                          fields.ends[line_of, k].tolist(), strict=True)]
    return TextColumn(rank[inverse.ravel()], np.array(values, dtype=object))


def integers(fields: Fields, k: int, max_digits: int = 15) -> np.ndarray | str:
    """Field ``k`` of every line as int64: an optional ``-`` and 1 to ``max_digits`` (at most 15) ASCII
    digits; or why not."""
    block = fields.window(k, 16).astype(np.int16) - _ZERO
    negative = block[:, 0] == _MINUS - _ZERO
    digits = fields.lengths(k) - negative
    max_digits = min(max_digits, 15)  # the window read is 16 bytes: a sign and 15 digits
    if np.any(digits < 1) or np.any(digits > max_digits):
        return f"a number of no digit or more than {max_digits}"
    value = np.empty(len(fields), dtype=np.int64)
    shape = digits * 2 + negative
    for code in np.unique(shape).tolist():  # a few: sign and number of digits
        sign, length = code % 2, code // 2
        rows = np.flatnonzero(shape == code)
        numerals = block[rows, sign:sign + length]
        if np.any((numerals < 0) | (numerals > 9)):
            return "a number with a character other than a digit"
        value[rows] = numerals.astype(np.int64) @ 10 ** np.arange(length - 1, -1, -1, dtype=np.int64)
    return np.where(negative, -value, value)
