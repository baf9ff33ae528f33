"""What one envelope, and one poll, may cost the cloud: budgets checked at the door.

zstd lets a 1 KB envelope claim millions of rows, so the cloud checks the cost of an envelope before it pays
it: the rows its header claims (before anything is decompressed), the bytes its payload inflates to
(decompressed as a stream, stopped at the budget), and the memory its columns would take once decoded (the
rows times the schema's fixed widths, plus the payload). An envelope over any of them is the dead letter
``over_budget``, counted like any other. A consumer also stops opening messages within one poll once their rows
or decoded bytes pass the poll's budget; the rest are read by the next poll.

A device's own limits stay well inside these: the sink seals at most ``batch_rows`` (1,000) rows and 900 KB
an envelope.

Example:
    >>> import pyarrow as pa
    >>> budget = Budget(max_rows_per_envelope=1000, max_row_bytes=64)
    >>> print(budget.envelope_problem(5000))
    5000 rows claimed, more than the budget of 1000 rows per envelope
    >>> schema = pa.schema([("user_id", pa.string()), ("n", pa.int64())])
    >>> budget.decoded_bytes(schema, 10, payload=120), budget.payload_limit(10)
    (240, 640)
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

#: Rows one envelope may claim (a device seals 1,000 by default).
MAX_ROWS_PER_ENVELOPE = 100_000
#: Bytes one row may take, decompressed or decoded.
MAX_ROW_BYTES = 1 << 20
#: Bytes one envelope may take once decompressed or decoded, whatever its rows.
MAX_ENVELOPE_BYTES = 64 << 20
MAX_ROWS_PER_POLL = 500_000
MAX_BYTES_PER_POLL = 256 << 20


@dataclass(frozen=True)
class Budget:
    """The cloud's limits per envelope and per poll (see the module docstring)."""

    max_rows_per_envelope: int = MAX_ROWS_PER_ENVELOPE
    max_row_bytes: int = MAX_ROW_BYTES
    max_envelope_bytes: int = MAX_ENVELOPE_BYTES
    max_rows_per_poll: int = MAX_ROWS_PER_POLL
    max_bytes_per_poll: int = MAX_BYTES_PER_POLL

    def envelope_problem(self, n_rows: int) -> str | None:
        """Why an envelope claiming ``n_rows`` is refused before its payload is looked at, or None."""
        if n_rows > self.max_rows_per_envelope:
            return f"{n_rows} rows claimed, more than the budget of {self.max_rows_per_envelope} rows per envelope"
        return None

    def payload_limit(self, n_rows: int) -> int:
        """The most bytes the payload of an envelope of ``n_rows`` may decompress to."""
        return min(self.max_envelope_bytes, max(1, n_rows) * self.max_row_bytes)

    def decoded_bytes(self, schema: pa.Schema, n_rows: int, payload: int) -> int:
        """A floor on what ``n_rows`` rows of ``schema`` take once decoded: each column's fixed width per row
        (a string's 4-byte offset, a validity bit rounded up to a byte) plus the ``payload`` bytes the
        variable-length values come from."""
        width = sum(_fixed_width(field.type) for field in schema)
        return n_rows * width + payload

    def decoded_problem(self, schema: pa.Schema, n_rows: int, payload: int) -> str | None:
        """Why rows of ``schema`` would cost too much to decode, or None."""
        size = self.decoded_bytes(schema, n_rows, payload)
        limit = min(self.max_envelope_bytes, max(1, n_rows) * self.max_row_bytes)
        if size > limit:
            return (f"{n_rows} rows of {len(schema)} columns would take at least {size} bytes decoded, more than "
                    f"the budget of {limit}")
        return None


def _fixed_width(t: pa.DataType) -> int:
    try:
        return max(1, t.bit_width // 8)
    except ValueError:  # variable width (strings, lists) or nested: at least an offset per row
        return 4


DEFAULT = Budget()
