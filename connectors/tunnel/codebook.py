"""A device's codebook: the schemas and zstd dictionaries it encodes with, and which of them it has announced.

- **Schemas.** Each (table, Arrow schema) the device seals gets a :class:`~connectors.tunnel.registry.Registration`
  (its id is a digest, so the same schema has the same id in every run).
- **Dictionaries.** Per table, the codebook keeps the first ``dictionary_rows`` rows it sees as samples and,
  once it has them, trains a zstd dictionary on them (each row encoded alone, as a one-row envelope
  carries it) in a thread of its own. The dictionary is kept only if it makes the held-out samples at least
  ``MIN_DICTIONARY_GAIN`` smaller than plain zstd does (a dense binary row leaves it little to find); until
  then, and for a table whose dictionary did not help, envelopes use plain zstd (or no compression when
  that is smaller). Dictionaries are kept in the spool, so a restarted device goes on with the same one.
- **Announcing.** An envelope carries a registration the first time it uses it in this session, again after
  the sender reconnected (:meth:`Codebook.forget_announced`), and again when the last announcement is older
  than ``announce_every_s``. A registration counts as announced only once its envelope is in the spool
  (:meth:`Codebook.sealed`): the spool sends in order, so the cloud reads the announcement before the rows
  that need it, or, if it lost it (a wiped registry, a truncated topic), parks those rows until the next one.

Example:
    >>> import os, tempfile, pyarrow as pa
    >>> from connectors.tunnel.envelope import decode
    >>> from connectors.tunnel.spool import Spool
    >>> spool = Spool(os.path.join(tempfile.mkdtemp(), "spool"))
    >>> book = Codebook("phone-1", b"k" * 32, spool)
    >>> rows = pa.table({"user_id": ["u1"], "dwell_s": [3.0]})
    >>> first = book.envelope("ipv", 0, rows); book.sealed()
    >>> second = book.envelope("ipv", 1, rows); book.sealed()
    >>> len(first), len(second)  # the schema travelled with the first only
    (236, 47)
    >>> decode(second, {"phone-1": b"k" * 32}).rows.num_rows  # the cloud needs the schema from before
    Traceback (most recent call last):
    ...
    connectors.tunnel.envelope.EnvelopeError: unknown_schema: schema be1ed62e of device 'phone-1' is not registered
    >>> book.forget_announced(); len(book.envelope("ipv", 2, rows))  # after a reconnect: announced again
    236
    >>> spool.close()
"""

from __future__ import annotations

import logging
import threading
import time

import pyarrow as pa

from connectors.tunnel import columns
from connectors.tunnel.envelope import encode
from connectors.tunnel.registry import (
    DICTIONARY,
    Registration,
    RegistrationError,
    Registry,
    compress,
    train_dictionary,
)
from connectors.tunnel.spool import Spool

log = logging.getLogger("streamflow.tunnel")

#: A dictionary must make held-out one-row payloads this much smaller than plain zstd, or it is not used.
MIN_DICTIONARY_GAIN = 0.05
#: Dictionary size: a tenth of the samples' bytes, within these bounds.
DICTIONARY_BYTES = (1 << 10, 16 << 10)
_HELD_OUT = 0.2  # of the samples, to judge the dictionary on rows it was not trained on


class Codebook:
    """The device side of the schema and dictionary registry (see the module docstring). Not thread-safe: the sink
    calls it under its lock; the dictionary trainer only hands its result over through :meth:`_install`."""

    def __init__(self, device: str, key: bytes, spool: Spool, *, dictionary_rows: int = 1000,
                 announce_every_s: float = 600.0):
        self.device = device
        self.key = key
        self.spool = spool
        self.dictionary_rows = dictionary_rows
        self.announce_every_s = announce_every_s
        self._own = Registry()  # this device's namespace, to keep an id from naming two bodies
        self._schemas: dict[tuple[str, pa.Schema], Registration] = {}
        #: table → its dictionary, or None once it was judged unhelpful (or could not be trained)
        self.dictionaries: dict[str, Registration | None] = {}
        #: table → how much smaller the dictionary made held-out one-row payloads than plain zstd (this run)
        self.dictionary_gain: dict[str, float] = {}
        for table, (body, useful) in spool.dictionaries().items():
            registration = self._own_registration(Registration.of(DICTIONARY, body))
            self.dictionaries[table] = registration if useful else None
        self._samples: dict[str, list[pa.Table]] = {}
        self._sampled: dict[str, int] = {}
        self._training: dict[str, threading.Thread] = {}
        self._announced: dict[tuple[int, bytes], float] = {}
        self._pending: list[Registration] = []
        self._install_lock = threading.Lock()

    # -- the sink's calls --------------------------------------------------------------------------
    def envelope(self, table: str, first_seq: int, rows: pa.Table) -> bytes:
        """The envelope of ``rows``; the registrations it announces count once :meth:`sealed` is called."""
        schema = self._schema(table, rows.schema)
        self._pending = []
        now = time.monotonic()

        def announce(registration: Registration) -> bool:
            last = self._announced.get((registration.kind, registration.id))
            if last is not None and now - last < self.announce_every_s:
                return False
            self._pending.append(registration)
            return True

        with self._install_lock:
            dictionary = self.dictionaries.get(table)
        return encode(self.device, table, first_seq, rows, self.key, schema=schema, dictionary=dictionary,
                      announce=announce)

    def sealed(self, table: str | None = None, rows: pa.Table | None = None) -> None:
        """The last :meth:`envelope` is in the spool: its announcements count; its rows may become samples."""
        now = time.monotonic()
        for registration in self._pending:
            self._announced[(registration.kind, registration.id)] = now
        self._pending = []
        if table is not None and rows is not None:
            self._sample(table, rows)

    def forget_announced(self) -> None:
        """Announce every registration again (the sender reconnected: the cloud may have lost its registry)."""
        self._announced.clear()

    def announcements(self, first_seq: int) -> list[bytes]:
        """Zero-row envelopes carrying every schema this device encoded with in this run, each with its table's
        dictionary (for a cloud that parked envelopes it could not open: its receipt asked for them). They use
        no sequence number: ``first_seq`` is the next one, and the cloud stores nothing but the registrations.

        Example:
            >>> import os, tempfile, pyarrow as pa
            >>> from connectors.tunnel.envelope import decode
            >>> from connectors.tunnel.registry import Registry
            >>> spool = Spool(os.path.join(tempfile.mkdtemp(), "spool"))
            >>> book = Codebook("phone-1", b"k" * 32, spool)
            >>> _ = book.envelope("ipv", 0, pa.table({"user_id": ["u1"]})); book.sealed()
            >>> [announcement] = book.announcements(1)
            >>> registry = Registry(); batch = decode(announcement, {"phone-1": b"k" * 32}, registry)
            >>> batch.rows.num_rows, len(batch.registrations)
            (0, 1)
            >>> spool.close()
        """
        with self._install_lock:
            dictionaries = dict(self.dictionaries)
        out = []
        for (table, schema), registration in self._schemas.items():
            dictionary = dictionaries.get(table)
            out.append(encode(self.device, table, first_seq, schema.empty_table(), self.key, schema=registration,
                              carry=[dictionary] if dictionary is not None else ()))
        return out

    def wait_trained(self, timeout_s: float = 30.0) -> None:
        """Wait for dictionaries being trained (for tests and benchmarks)."""
        for thread in list(self._training.values()):
            thread.join(timeout_s)

    # -- schemas -----------------------------------------------------------------------------------
    def _schema(self, table: str, schema: pa.Schema) -> Registration:
        registration = self._schemas.get((table, schema))
        if registration is None:
            registration = self._schemas[(table, schema)] = self._own_registration(
                Registration.for_schema(table, schema))
        return registration

    def _own_registration(self, registration: Registration) -> Registration:
        """``registration`` in this device's namespace, salted until its id names nothing else."""
        for _ in range(256):
            try:
                self._own.learn(self.device, registration)
                return registration
            except RegistrationError:
                registration = registration.salted()
        raise RegistrationError(f"no free id for {registration.name} after 256 salts")

    # -- dictionaries ------------------------------------------------------------------------------
    def _sample(self, table: str, rows: pa.Table) -> None:
        if table in self.dictionaries or table in self._training or self.dictionary_rows <= 0:
            return
        taken = self._sampled.get(table, 0)
        want = self.dictionary_rows - taken
        if want > 0:
            self._samples.setdefault(table, []).append(rows.slice(0, want))
            self._sampled[table] = taken + min(want, rows.num_rows)
        if self._sampled[table] >= self.dictionary_rows:
            samples = self._samples.pop(table)
            thread = threading.Thread(target=self._train, args=(table, samples), name=f"tunnel-dict-{table}",
                                      daemon=True)
            self._training[table] = thread
            thread.start()

    def _train(self, table: str, samples: list[pa.Table]) -> None:
        try:
            payloads = [columns.encode(batch.slice(i, 1))[0] for batch in samples for i in range(batch.num_rows)]
            held = max(1, int(len(payloads) * _HELD_OUT))
            train, test = payloads[:-held], payloads[-held:]
            size = max(DICTIONARY_BYTES[0], min(DICTIONARY_BYTES[1], sum(map(len, train)) // 10))
            trained = train_dictionary(train, size)
            registration = gain = None
            if trained is not None:
                registration = self._own_registration(Registration.for_dictionary(trained))
                gain = _gain(test, registration)
            self._install(table, registration, gain)
        except Exception as exc:  # noqa: BLE001 - a failed training means plain zstd, never a stopped sink
            log.warning("tunnel: training a zstd dictionary for table %s failed (%s: %s); using plain zstd",
                        table, type(exc).__name__, exc)
            self._install(table, None, None)

    def _install(self, table: str, registration: Registration | None, gain: float | None) -> None:
        useful = registration is not None and gain is not None and gain >= MIN_DICTIONARY_GAIN
        if registration is not None:
            self.spool.save_dictionary(table, registration.body, useful)
        with self._install_lock:
            self.dictionaries[table] = registration if useful else None
            if gain is not None:
                self.dictionary_gain[table] = gain
        log.info("tunnel: zstd dictionary for table %s: %s", table,
                 "none could be trained" if registration is None else
                 f"{len(registration.body)} bytes, {gain:.1%} smaller one-row payloads than plain zstd, "
                 + ("used" if useful else f"not used (below {MIN_DICTIONARY_GAIN:.0%})"))


def _gain(payloads: list[bytes], dictionary: Registration) -> float:
    """How much smaller ``payloads`` get with ``dictionary`` than with plain zstd (each as an envelope would carry
    it: compressed only when that is smaller, the dictionary's id counted)."""
    plain = sum(min(len(p), len(compress(p, None))) for p in payloads)
    with_dictionary = sum(min(len(p), len(compress(p, dictionary)) + 4) for p in payloads)
    return 1 - with_dictionary / plain if plain else 0.0

