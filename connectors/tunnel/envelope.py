"""The tunnel's wire format: one signed, versioned envelope per Kafka message, carrying a batch of rows.

Layout (big-endian)::

    b"SFT"  version:u8  device_len:u16 device  table_len:u16 table  first_seq:u64  n_rows:u32
    payload: an Arrow IPC stream of the n_rows rows (schema included)
    hmac:   32 bytes, HMAC-SHA256 with the device's key over everything before it

Row ``i`` of the payload has sequence number ``first_seq + i``; a device numbers its rows 0, 1, 2, ...
across all tables, so (device, seq) names a row. The payload is not compressed here: the producer
compresses whole Kafka record batches (zstd by default), which sees across envelopes.

Decoding checks, in this order, and raises :class:`EnvelopeError` with one of the :data:`REASONS`:
size and magic (``garbage``), version (``bad_version``), header (``garbage``), device known to the
registry (``unknown_device``), signature (``bad_signature``), payload (``bad_payload``). Nothing is
parsed beyond the header before the signature checks out.

Example:
    >>> import pyarrow as pa
    >>> key = b"k" * 32
    >>> value = encode("phone-1", "ipv", 7, pa.table({"user_id": ["u1", "u2"], "dwell_s": [3.0, 9.5]}), key)
    >>> batch = decode(value, {"phone-1": key}.get)
    >>> batch.device, batch.table, list(batch.seqs), batch.rows.column("dwell_s").to_pylist()
    ('phone-1', 'ipv', [7, 8], [3.0, 9.5])
    >>> decode(value[:-1] + bytes([value[-1] ^ 1]), {"phone-1": key}.get)
    Traceback (most recent call last):
    ...
    connectors.tunnel.envelope.EnvelopeError: bad_signature: HMAC does not match device 'phone-1'
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

MAGIC = b"SFT"
FORMAT_VERSION = 1
_HEAD = struct.Struct(">3sB")
_TAIL = struct.Struct(">QI")
_MAC_BYTES = 32
#: Why an envelope can be refused (the prefix of :class:`EnvelopeError`'s message).
REASONS = ("garbage", "bad_version", "unknown_device", "bad_signature", "bad_payload")


class EnvelopeError(ValueError):
    """An envelope the cloud must not accept; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str, device: str | None = None):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.device = device


@dataclass(frozen=True)
class Origin:
    """Where a message was read: its Kafka position and its bytes (kept to dead-letter it whole)."""

    topic: str
    partition: int
    offset: int
    raw: bytes


@dataclass(frozen=True)
class Batch:
    """A verified batch: whose rows, for which table, and their sequence numbers.

    ``mac`` (its signature) identifies the exact envelope: a resend carries the same one. ``origin`` is
    set by a consumer that read it from Kafka.
    """

    device: str
    table: str
    first_seq: int
    rows: pa.Table
    mac: bytes = b""
    origin: Origin | None = None

    @property
    def seqs(self) -> range:
        return range(self.first_seq, self.first_seq + self.rows.num_rows)

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.rows.num_rows - 1


def arrow_payload(rows: pa.Table) -> bytes:
    """``rows`` as an Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema) as writer:
        writer.write_table(rows)
    return sink.getvalue().to_pybytes()


def encode(device: str, table: str, first_seq: int, rows: pa.Table, key: bytes) -> bytes:
    """Sign and frame ``rows`` (sequence numbers from ``first_seq``) as one envelope."""
    device_b, table_b = device.encode(), table.encode()
    head = b"".join((
        _HEAD.pack(MAGIC, FORMAT_VERSION),
        struct.pack(">H", len(device_b)), device_b,
        struct.pack(">H", len(table_b)), table_b,
        _TAIL.pack(first_seq, rows.num_rows),
    ))
    body = head + arrow_payload(rows)
    return body + hmac.digest(key, body, hashlib.sha256)


def peek_device(value: bytes) -> str | None:
    """The device id an envelope claims, without verifying anything (for dead-letter records)."""
    try:
        return _header(value)[0]
    except EnvelopeError:
        return None


def decode(value: bytes | None, key_for: Callable[[str], bytes | None]) -> Batch:
    """Verify and open an envelope; ``key_for(device)`` gives a device's key or None if unknown."""
    device, table, first_seq, n_rows, payload_at = _header(value)
    key = key_for(device)
    if key is None:
        raise EnvelopeError("unknown_device", f"device {device!r} is not in the key registry", device)
    body, mac = value[:-_MAC_BYTES], value[-_MAC_BYTES:]
    if not hmac.compare_digest(hmac.digest(key, body, hashlib.sha256), mac):
        raise EnvelopeError("bad_signature", f"HMAC does not match device {device!r}", device)
    try:
        rows = pa.ipc.open_stream(body[payload_at:]).read_all()
    except (pa.ArrowException, ValueError) as exc:
        raise EnvelopeError("bad_payload", f"signed payload is not an Arrow IPC stream: {exc}", device) from exc
    if rows.num_rows != n_rows:
        raise EnvelopeError("bad_payload", f"header says {n_rows} rows, payload has {rows.num_rows}", device)
    return Batch(device, table, first_seq, rows, mac)


def _header(value: bytes | None) -> tuple[str, str, int, int, int]:
    if not isinstance(value, bytes | bytearray | memoryview) or len(value) < _HEAD.size + 4 + _TAIL.size + _MAC_BYTES:
        raise EnvelopeError("garbage", f"{0 if value is None else len(value)} bytes is too short for an envelope")
    value = bytes(value)
    magic, version = _HEAD.unpack_from(value)
    if magic != MAGIC:
        raise EnvelopeError("garbage", f"does not start with {MAGIC!r}: {value[:8]!r}")
    if version != FORMAT_VERSION:
        raise EnvelopeError("bad_version", f"format version {version} (this side reads {FORMAT_VERSION})")
    try:
        at = _HEAD.size
        (n,) = struct.unpack_from(">H", value, at)
        device = value[at + 2:at + 2 + n].decode()
        at += 2 + n
        (n,) = struct.unpack_from(">H", value, at)
        table = value[at + 2:at + 2 + n].decode()
        at += 2 + n
        first_seq, n_rows = _TAIL.unpack_from(value, at)
        at += _TAIL.size
    except (struct.error, UnicodeDecodeError) as exc:
        raise EnvelopeError("garbage", f"unreadable header: {exc}") from exc
    if at > len(value) - _MAC_BYTES or not device or not table:
        raise EnvelopeError("garbage", "header runs into the signature or names no device/table")
    return device, table, first_seq, n_rows, at
