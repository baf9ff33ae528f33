"""Schemas and zstd dictionaries, registered once per device and named in every envelope by a 4-byte id.

A :class:`Registration` is ``(kind, id, body)``: a :data:`SCHEMA` (a table name and its Arrow schema) or a
:data:`DICTIONARY` (a zstd dictionary trained on rows of one task). Its id is the first 4 bytes of
SHA-256 over the kind and the body, so the cloud checks an id against what it names. Ids live in the
namespace of the device that registered them: the cloud keys them by (device, kind, id), and only an
envelope signed by that device can add one, so a device can confuse nobody but itself. Four bytes are
enough in a namespace that holds a handful of entries (two colliding by chance: ~1e-8 for ten); the
device refuses to reuse an id for another body (:meth:`Registry.learn` raises), and bumps the body's salt
byte for a newcomer that would collide with one of its own.

Bodies: SCHEMA = salt (1 byte), varint table length, table (UTF-8), the Arrow schema as an IPC message;
DICTIONARY = salt (1 byte), the dictionary as zstandard trains it.

Payloads are compressed as zstd frames without the magic number, checksum or dictionary id (the envelope
names the dictionary and its HMAC covers every byte), with the content size (the decoder refuses a frame
that claims more than :data:`MAX_PAYLOAD_BYTES`).

Example:
    >>> import pyarrow as pa
    >>> schema = Registration.for_schema("ipv", pa.schema([("user_id", pa.string()), ("dwell_s", pa.float64())]))
    >>> schema.kind == SCHEMA, len(schema.id), schema.table, schema.schema.names
    (True, 4, 'ipv', ['user_id', 'dwell_s'])
    >>> registry = Registry()
    >>> registry.learn("phone-1", schema), registry.learn("phone-1", schema)  # new, then known
    (True, False)
    >>> registry.get("phone-1", SCHEMA, schema.id) is schema, registry.get("phone-2", SCHEMA, schema.id)
    (True, None)
    >>> decompress(compress(b"abc" * 100, None), None) == b"abc" * 100
    True
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import pyarrow as pa

SCHEMA = 1
DICTIONARY = 2
KINDS = {SCHEMA: "schema", DICTIONARY: "dictionary"}
ID_BYTES = 4
#: A compressed payload may not claim to grow beyond this (a zstd frame states its content size).
MAX_PAYLOAD_BYTES = 64 << 20
ZSTD_LEVEL = 3


class PayloadTooLarge(ValueError):
    """A zstd frame that claims, or inflates to, more bytes than it may."""


class RegistrationError(ValueError):
    """A registration whose id does not match its body, whose body is unreadable, or that reuses a known id."""


@dataclass(frozen=True)
class Registration:
    """A schema or a dictionary and its id (see the module docstring)."""

    kind: int
    id: bytes
    body: bytes

    @classmethod
    def of(cls, kind: int, body: bytes) -> Registration:
        return cls(kind, registration_id(kind, body), body)

    @classmethod
    def for_schema(cls, table: str, schema: pa.Schema, salt: int = 0) -> Registration:
        name = table.encode()
        return cls.of(SCHEMA, bytes([salt]) + varint(len(name)) + name + schema.serialize().to_pybytes())

    @classmethod
    def for_dictionary(cls, dictionary: bytes, salt: int = 0) -> Registration:
        return cls.of(DICTIONARY, bytes([salt]) + dictionary)

    def salted(self) -> Registration:
        """The same content under another id (the salt byte bumped), for a newcomer colliding with a known id."""
        return Registration.of(self.kind, bytes([(self.body[0] + 1) % 256]) + self.body[1:])

    def check(self) -> Registration:
        """This registration if its id matches its body and its body reads; else :class:`RegistrationError`."""
        if self.kind not in KINDS:
            raise RegistrationError(f"unknown registration kind {self.kind}")
        if registration_id(self.kind, self.body) != self.id:
            raise RegistrationError(f"{self.name} does not match its body")
        try:
            _ = self.schema if self.kind == SCHEMA else self.zstd_dictionary
        except (ValueError, IndexError, UnicodeDecodeError, pa.ArrowException, OSError) as exc:
            raise RegistrationError(f"{self.name} is unreadable: {type(exc).__name__}: {exc}") from exc
        return self

    @property
    def name(self) -> str:
        return f"{KINDS.get(self.kind, self.kind)} {self.id.hex()}"

    @cached_property
    def _schema_parts(self) -> tuple[str, pa.Schema]:
        if self.kind != SCHEMA or len(self.body) < 2:
            raise ValueError(f"{self.name} is not a schema")
        size, at = read_varint(self.body, 1)
        table = self.body[at:at + size].decode()
        return table, pa.ipc.read_schema(pa.py_buffer(self.body[at + size:]))

    @property
    def table(self) -> str:
        return self._schema_parts[0]

    @property
    def schema(self) -> pa.Schema:
        return self._schema_parts[1]

    @cached_property
    def zstd_dictionary(self) -> Any:
        import zstandard

        if self.kind != DICTIONARY or len(self.body) < 2:
            raise ValueError(f"{self.name} is not a dictionary")
        return zstandard.ZstdCompressionDict(self.body[1:])


def registration_id(kind: int, body: bytes) -> bytes:
    return hashlib.sha256(bytes([kind]) + body).digest()[:ID_BYTES]


class Registry:
    """(device, kind, id) → :class:`Registration`, thread-safe; what one side knows of every device's registrations."""

    def __init__(self, known: Iterable[tuple[str, Registration]] = ()):
        self._entries: dict[tuple[str, int, bytes], Registration] = {}
        self._lock = threading.Lock()
        for device, registration in known:
            self.learn(device, registration)

    def get(self, device: str, kind: int, id_: bytes) -> Registration | None:
        return self._entries.get((device, kind, id_))

    def learn(self, device: str, registration: Registration) -> bool:
        """Add a checked registration; True if it was new. :class:`RegistrationError` if its id names another body."""
        key = (device, registration.kind, registration.id)
        with self._lock:
            known = self._entries.get(key)
            if known is not None:
                if known.body != registration.body:
                    raise RegistrationError(f"device {device!r} registered {registration.name} again with another "
                                            "body (a 4-byte digest collision, or a device that lost its spool)")
                return False
            self._entries[key] = registration.check()
            return True

    def entries(self) -> list[tuple[str, Registration]]:
        with self._lock:
            return [(device, r) for (device, _, _), r in self._entries.items()]

    def __len__(self) -> int:
        return len(self._entries)


# -- zstd -----------------------------------------------------------------------------------------
_codecs = threading.local()  # zstandard's (de)compressors are not safe to share between threads


def _codec_for(dictionary: Registration | None) -> tuple[Any, Any]:
    """This thread's (compressor, decompressor) for ``dictionary`` (or none)."""
    cache = getattr(_codecs, "cache", None)
    if cache is None:
        cache = _codecs.cache = {}
    key = b"" if dictionary is None else dictionary.body
    codec = cache.get(key)
    if codec is None:
        import zstandard

        data = None if dictionary is None else dictionary.zstd_dictionary
        params = zstandard.ZstdCompressionParameters.from_level(
            ZSTD_LEVEL, format=zstandard.FORMAT_ZSTD1_MAGICLESS, write_checksum=0, write_content_size=1,
            write_dict_id=0)
        codec = cache[key] = (zstandard.ZstdCompressor(dict_data=data, compression_params=params),
                              zstandard.ZstdDecompressor(dict_data=data, format=zstandard.FORMAT_ZSTD1_MAGICLESS))
    return codec


def compress(payload: bytes, dictionary: Registration | None) -> bytes:
    """``payload`` as a zstd frame (see the module docstring), with ``dictionary`` if given."""
    return _codec_for(dictionary)[0].compress(payload)


def decompress(frame: bytes, dictionary: Registration | None, limit: int = MAX_PAYLOAD_BYTES) -> bytes:
    """The payload of a frame made by :func:`compress`; ``ValueError`` if it is not one, :class:`PayloadTooLarge`
    if it claims or inflates to more than ``limit`` bytes (decompressed as a stream, never past ``limit`` + 1)."""
    import zstandard

    limit = min(limit, MAX_PAYLOAD_BYTES)
    try:
        size = zstandard.get_frame_parameters(frame, format=zstandard.FORMAT_ZSTD1_MAGICLESS).content_size
        if size > limit:  # also the "unknown" marker, 2**64 - 1: every frame states its size
            raise PayloadTooLarge(f"a zstd frame claiming {size} bytes (at most {limit})")
        out = bytearray()
        with _codec_for(dictionary)[1].stream_reader(frame) as reader:
            while len(out) <= limit:
                chunk = reader.read(min(1 << 20, limit + 1 - len(out)))
                if not chunk:
                    break
                out += chunk
        if len(out) > limit:  # a frame whose content outgrows the size it states
            raise PayloadTooLarge(f"a zstd frame inflating past {limit} bytes")
        return bytes(out)
    except zstandard.ZstdError as exc:
        raise ValueError(f"not a zstd frame of this dictionary: {exc}") from exc


def train_dictionary(samples: Sequence[bytes], size: int) -> bytes | None:
    """A zstd dictionary of at most ``size`` bytes trained on ``samples``; None if zstd cannot train one from them."""
    import zstandard

    try:
        return zstandard.train_dictionary(size, list(samples), level=ZSTD_LEVEL).as_bytes()
    except zstandard.ZstdError:
        return None


# -- varints (headers and bodies) -------------------------------------------------------------------
def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at ``data[at:]`` and the position after it; ``IndexError``/``ValueError`` if there is none."""
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")
