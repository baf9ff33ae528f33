"""The tunnel's wire format: one signed envelope per Kafka message, carrying a batch of rows of one table.

Format 2, written (a compact binary header; the schema and the zstd dictionary named by id, see :mod:`.registry`)::

    0xF5  flags:u8  device_tag:4  first_seq:varint  [n_rows:varint]  schema_id:4  [dictionary_id:4]
    [registrations]  payload  hmac:32

- ``flags``: bits 0-2 the version (2); bit 3 ``R``, registrations follow the ids; bit 4 ``S``, a single row
  (``n_rows`` left out); bit 5 ``N``, the payload has a null section; bits 6-7 the payload's compression:
  0 none, 1 zstd, 2 zstd with the dictionary ``dictionary_id`` (present only then).
- ``device_tag``: :func:`~connectors.tunnel.keys.device_tag` of the device id (4 bytes whatever its length);
  the cloud tries the key of each registered device with that tag, the signature decides.
- ``registrations``: varint count, then per registration: kind (1 byte), id (4), varint length, body. The device
  puts a schema or dictionary here the first time an envelope of its session uses it (then again after
  a reconnect and every ``announce_every_s``), so the cloud learns it before, or with, the first rows that need it.
- ``payload``: the rows in the compact column codec (:mod:`.columns`), zstd-compressed if that is smaller.
- ``hmac``: HMAC-SHA256 with the device's key (:mod:`.keys`) over the device id (UTF-8) followed by every
  byte before it. The full 32 bytes: the key scheme stays as it was, nothing is truncated.

Row ``i`` has sequence number ``first_seq + i``; a device numbers its rows 0, 1, 2, ... across all tables, so
(device, seq) names a row. The Kafka message has no key: the sink picks the partition from the device id as
Kafka's default partitioner would from a key, so a device's envelopes share a partition, in order.

Format 1, read (envelopes spooled by an older device) and written by :func:`encode_v1` only for comparisons::

    b"SFT" 0x01  device_len:u16 device  table_len:u16 table  first_seq:u64  n_rows:u32  Arrow IPC stream  hmac:32

Decoding checks, in this order, and raises :class:`EnvelopeError` with one of the :data:`REASONS`: size and
magic (``garbage``), version (``bad_version``), header (``garbage``), device known to the key registry
(``unknown_device``), signature (``bad_signature``), the rows it claims within the cloud's budget
(``over_budget``, :mod:`.budget`), registrations (``bad_registration``: an id that does not
match its body, or a known id with another body), schema and dictionary known (``unknown_schema``: the
cloud parks such an envelope and stores it once the registration arrives), the payload's decompressed and
decoded size within the budget (``over_budget``), payload (``bad_payload``).
Nothing beyond the header is parsed before the signature checks out, and nothing is decompressed or decoded
beyond the budget.

Example:
    >>> import pyarrow as pa
    >>> key = b"k" * 32
    >>> rows = pa.table({"user_id": ["u1", "u2"], "dwell_s": [3.0, 9.5]})
    >>> value = encode("phone-1", "ipv", 7, rows, key)  # the schema travels inline: a self-contained envelope
    >>> batch = decode(value, {"phone-1": key})
    >>> batch.device, batch.table, list(batch.seqs), batch.rows.column("dwell_s").to_pylist()
    ('phone-1', 'ipv', [7, 8], [3.0, 9.5])
    >>> registry = Registry()  # what the cloud knows; the next envelope of the schema leaves it out
    >>> _ = decode(value, {"phone-1": key}, registry)
    >>> len(encode("phone-1", "ipv", 9, rows, key, announce=False)) < len(value)
    True
    >>> decode(encode("phone-1", "ipv", 9, rows, key, announce=False), {"phone-1": key}, registry).first_seq
    9
    >>> decode(value[:-1] + bytes([value[-1] ^ 1]), {"phone-1": key})
    Traceback (most recent call last):
    ...
    connectors.tunnel.envelope.EnvelopeError: bad_signature: HMAC does not match device 'phone-1'
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa

from connectors.tunnel import columns
from connectors.tunnel.budget import DEFAULT, Budget
from connectors.tunnel.keys import MAC_BYTES, KeyRegistry, device_tag, key_candidates, sign, verify
from connectors.tunnel.registry import (
    DICTIONARY,
    ID_BYTES,
    KINDS,
    SCHEMA,
    PayloadTooLarge,
    Registration,
    RegistrationError,
    Registry,
    compress,
    decompress,
    read_varint,
    varint,
)

MAGIC = 0xF5
FORMAT_VERSION = 2
LEGACY_MAGIC = b"SFT"
LEGACY_VERSION = 1
_R, _S, _N = 0x08, 0x10, 0x20
_NONE, _ZSTD, _ZSTD_DICT = 0, 1, 2
#: An envelope claiming more rows than this is garbage (a 1 MB message cannot hold them).
MAX_ROWS = 1 << 24
_LEGACY_HEAD = struct.Struct(">3sB")
_LEGACY_TAIL = struct.Struct(">QI")
#: Why an envelope can be refused (the prefix of :class:`EnvelopeError`'s message).
REASONS = ("garbage", "bad_version", "unknown_device", "bad_signature", "over_budget", "bad_registration",
           "unknown_schema", "bad_payload")

Keys = KeyRegistry | Mapping[str, bytes]


class EnvelopeError(ValueError):
    """An envelope the cloud must not accept; ``reason`` is one of :data:`REASONS`.

    ``registrations``: those a verified envelope carried (valid whatever else is wrong with it).
    """

    def __init__(self, reason: str, detail: str, device: str | None = None,
                 registrations: tuple[Registration, ...] = (), seqs: tuple[int, int] | None = None):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.device = device
        self.registrations = registrations
        #: (first_seq, n_rows) of a verified envelope refused for what it holds, else None
        self.seqs = seqs


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
    set by a consumer that read it from Kafka. ``registrations``: the schemas and dictionaries the envelope
    carried (the cloud stores them).
    """

    device: str
    table: str
    first_seq: int
    rows: pa.Table
    mac: bytes = b""
    origin: Origin | None = None
    registrations: tuple[Registration, ...] = ()

    @property
    def seqs(self) -> range:
        return range(self.first_seq, self.first_seq + self.rows.num_rows)

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.rows.num_rows - 1


# -- writing ----------------------------------------------------------------------------------------
def encode(device: str, table: str, first_seq: int, rows: pa.Table, key: bytes, *,
           schema: Registration | None = None, dictionary: Registration | None = None,
           announce: bool | Callable[[Registration], bool] = True, carry: Sequence[Registration] = ()) -> bytes:
    """Sign and frame ``rows`` of ``table`` (sequence numbers from ``first_seq``) as one format-2 envelope.

    ``schema``: the registration of ``(table, rows.schema)`` (made here if not given); ``dictionary``: a zstd
    dictionary to compress with (used only if that beats plain bytes). ``announce`` says which of the
    registrations the envelope uses travel in it: all (True, a self-contained envelope), none (False), or
    those a callable returns True for. ``carry``: registrations it carries whether it uses them or not (a
    zero-row envelope announcing a dictionary, which compresses nothing).
    """
    schema = schema or Registration.for_schema(table, rows.schema)
    payload, has_nulls = columns.encode(rows)
    compression, body = _NONE, payload
    if payload:
        packed = compress(payload, dictionary)
        if len(packed) + (ID_BYTES if dictionary is not None else 0) < len(payload):
            compression, body = (_ZSTD_DICT if dictionary is not None else _ZSTD), packed
    used_dictionary = dictionary if compression == _ZSTD_DICT else None
    used = [schema] + ([used_dictionary] if used_dictionary is not None else [])
    inline = [r for r in used if (announce(r) if callable(announce) else announce)]
    inline += [r for r in carry if r not in inline]
    n = rows.num_rows
    flags = (FORMAT_VERSION | (_R if inline else 0) | (_S if n == 1 else 0) | (_N if has_nulls else 0)
             | compression << 6)
    head = [bytes([MAGIC, flags]), device_tag(device), varint(first_seq)]
    if n != 1:
        head.append(varint(n))
    head.append(schema.id)
    if used_dictionary is not None:
        head.append(used_dictionary.id)
    if inline:
        head.append(varint(len(inline)))
        for r in inline:
            head += [bytes([r.kind]), r.id, varint(len(r.body)), r.body]
    signed = b"".join(head) + body
    return signed + sign(key, device.encode() + signed)


def encode_v1(device: str, table: str, first_seq: int, rows: pa.Table, key: bytes) -> bytes:
    """The same batch in format 1 (schema, names and 8-byte numbers in every envelope), for comparisons."""
    device_b, table_b = device.encode(), table.encode()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema) as writer:
        writer.write_table(rows)
    body = b"".join((_LEGACY_HEAD.pack(LEGACY_MAGIC, LEGACY_VERSION), struct.pack(">H", len(device_b)), device_b,
                     struct.pack(">H", len(table_b)), table_b, _LEGACY_TAIL.pack(first_seq, rows.num_rows),
                     sink.getvalue().to_pybytes()))
    return body + sign(key, body)


# -- reading ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Header:
    flags: int
    tag: bytes
    first_seq: int
    n_rows: int
    schema_id: bytes
    dictionary_id: bytes | None
    registrations_at: int  # where the registrations (or the payload) start


def decode(value: bytes | None, keys: Keys, registry: Registry | None = None, budget: Budget = DEFAULT) -> Batch:
    """Verify and open an envelope (either format).

    ``keys``: the device keys (a :class:`~connectors.tunnel.keys.KeyRegistry` or a device → key mapping);
    ``registry``: the schemas and dictionaries known so far, which learns those the envelope carries
    (default: an empty one, so only a self-contained envelope opens); ``budget``: what opening it may cost.
    """
    if not isinstance(value, bytes | bytearray | memoryview):
        raise EnvelopeError("garbage", "no bytes (a null message)")
    value = bytes(value)
    if value[:3] == LEGACY_MAGIC:
        return _decode_v1(value, keys, budget)
    head = _header(value)
    candidates = key_candidates(keys, head.tag)
    if not candidates:
        raise EnvelopeError("unknown_device", f"no device in the key registry has tag {head.tag.hex()}")
    signed, mac = value[:-MAC_BYTES], value[-MAC_BYTES:]
    device = next((d for d, key in candidates if verify(key, d.encode() + signed, mac)), None)
    if device is None:
        claimed = candidates[0][0] if len(candidates) == 1 else None
        raise EnvelopeError("bad_signature", "HMAC does not match device " + (
            repr(claimed) if claimed else f"any of {sorted(d for d, _ in candidates)}"), claimed)
    seqs = (head.first_seq, head.n_rows)
    problem = budget.envelope_problem(head.n_rows)
    if problem is not None:
        raise EnvelopeError("over_budget", problem, device, seqs=seqs)
    registry = registry if registry is not None else Registry()
    inline, payload_at = _registrations(value, head, device)
    for registration in inline:
        try:
            registry.learn(device, registration)
        except RegistrationError as exc:
            raise EnvelopeError("bad_registration", str(exc), device, inline, seqs) from exc
    schema = _known(registry, device, SCHEMA, head.schema_id, inline, seqs)
    dictionary = None if head.dictionary_id is None else _known(registry, device, DICTIONARY, head.dictionary_id,
                                                                 inline, seqs)
    body = signed[payload_at:]
    try:
        payload = body if head.flags >> 6 == _NONE else decompress(body, dictionary, budget.payload_limit(head.n_rows))
    except PayloadTooLarge as exc:
        raise EnvelopeError("over_budget", f"payload of {head.n_rows} rows: {exc}", device, inline, seqs) from exc
    except ValueError as exc:
        raise EnvelopeError("bad_payload", f"signed payload of {schema.name} of table {schema.table}: {exc}", device,
                            inline, seqs) from exc
    problem = budget.decoded_problem(schema.schema, head.n_rows, len(payload))
    if problem is not None:
        raise EnvelopeError("over_budget", problem, device, inline, seqs)
    try:
        rows = columns.decode(payload, schema.schema, head.n_rows, bool(head.flags & _N))
    except ValueError as exc:
        raise EnvelopeError("bad_payload", f"signed payload does not fit {schema.name} of table "
                                           f"{schema.table}: {exc}", device, inline, seqs) from exc
    return Batch(device, schema.table, head.first_seq, rows, mac, registrations=inline)


def _known(registry: Registry, device: str, kind: int, id_: bytes, inline: tuple[Registration, ...],
           seqs: tuple[int, int]) -> Registration:
    registration = registry.get(device, kind, id_)
    if registration is None:  # with its numbers: the cloud's receipt tells the device to announce again
        raise EnvelopeError("unknown_schema", f"{KINDS[kind]} {id_.hex()} of device {device!r} is not registered",
                            device, inline, seqs)
    return registration


def _header(value: bytes) -> _Header:
    if len(value) < 2 + 4 + 1 + ID_BYTES + MAC_BYTES or value[0] != MAGIC:
        raise EnvelopeError("garbage", f"{len(value)} bytes starting {value[:8]!r} is no envelope")
    flags = value[1]
    if flags & 0x07 != FORMAT_VERSION:
        raise EnvelopeError("bad_version", f"format version {flags & 0x07} (this side reads {FORMAT_VERSION} "
                                           f"and {LEGACY_VERSION})")
    if flags >> 6 > _ZSTD_DICT:
        raise EnvelopeError("garbage", f"unknown payload compression {flags >> 6}")
    try:
        at = 6
        first_seq, at = read_varint(value, at)
        n_rows = 1
        if not flags & _S:
            n_rows, at = read_varint(value, at)
        schema_id, at = value[at:at + ID_BYTES], at + ID_BYTES
        dictionary_id = None
        if flags >> 6 == _ZSTD_DICT:
            dictionary_id, at = value[at:at + ID_BYTES], at + ID_BYTES
    except (IndexError, ValueError) as exc:
        raise EnvelopeError("garbage", f"unreadable header: {exc}") from exc
    if at > len(value) - MAC_BYTES or first_seq >= 1 << 63 or n_rows > MAX_ROWS:
        raise EnvelopeError("garbage", "header runs into the signature or its numbers are out of range")
    return _Header(flags, value[2:6], first_seq, n_rows, schema_id, dictionary_id, at)


def _registrations(value: bytes, head: _Header, device: str) -> tuple[tuple[Registration, ...], int]:
    """The registrations of a verified envelope and where its payload starts."""
    at, end = head.registrations_at, len(value) - MAC_BYTES
    if not head.flags & _R:
        return (), at
    out = []
    try:
        count, at = read_varint(value, at)
        for _ in range(count):
            kind, id_ = value[at], value[at + 1:at + 1 + ID_BYTES]
            size, at = read_varint(value, at + 1 + ID_BYTES)
            if at + size > end:
                raise ValueError("a registration runs into the signature")
            out.append(Registration(kind, id_, value[at:at + size]))
            at += size
    except (IndexError, ValueError) as exc:
        raise EnvelopeError("bad_registration", f"unreadable registrations: {exc}", device) from exc
    return tuple(out), at


def _decode_v1(value: bytes, keys: Keys, budget: Budget) -> Batch:
    # Format 1 is read for spools written before format 2; its Arrow IPC body is bounded by the message size
    # and its row count by the budget (IPC buffer compression, which no device of ours wrote, is not bounded)
    if len(value) < _LEGACY_HEAD.size + 4 + _LEGACY_TAIL.size + MAC_BYTES:
        raise EnvelopeError("garbage", f"{len(value)} bytes is too short for an envelope")
    _, version = _LEGACY_HEAD.unpack_from(value)
    if version != LEGACY_VERSION:
        raise EnvelopeError("bad_version", f"format version {version} (this side reads {FORMAT_VERSION} and "
                                           f"{LEGACY_VERSION})")
    try:
        at = _LEGACY_HEAD.size
        (n,) = struct.unpack_from(">H", value, at)
        device = value[at + 2:at + 2 + n].decode()
        at += 2 + n
        (n,) = struct.unpack_from(">H", value, at)
        table = value[at + 2:at + 2 + n].decode()
        at += 2 + n
        first_seq, n_rows = _LEGACY_TAIL.unpack_from(value, at)
        at += _LEGACY_TAIL.size
    except (struct.error, UnicodeDecodeError) as exc:
        raise EnvelopeError("garbage", f"unreadable header: {exc}") from exc
    if at > len(value) - MAC_BYTES or not device or not table:
        raise EnvelopeError("garbage", "header runs into the signature or names no device/table")
    key = next((k for d, k in key_candidates(keys, device_tag(device)) if d == device), None)
    if key is None:
        raise EnvelopeError("unknown_device", f"device {device!r} is not in the key registry", device)
    body, mac = value[:-MAC_BYTES], value[-MAC_BYTES:]
    if not verify(key, body, mac):
        raise EnvelopeError("bad_signature", f"HMAC does not match device {device!r}", device)
    problem = budget.envelope_problem(n_rows)
    if problem is not None:
        raise EnvelopeError("over_budget", problem, device, seqs=(first_seq, n_rows))
    try:
        rows = pa.ipc.open_stream(body[at:]).read_all()
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise EnvelopeError("bad_payload", f"signed payload is not an Arrow IPC stream: {exc}", device) from exc
    if rows.num_rows != n_rows:
        raise EnvelopeError("bad_payload", f"header says {n_rows} rows, payload has {rows.num_rows}", device)
    return Batch(device, table, first_seq, rows, mac)
