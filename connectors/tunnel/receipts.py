"""Receipts: what the cloud has stored of each device, signed, for the device to trim its spool and resend by.

The second line of defence (the first is Kafka's acknowledgement). The cloud consumer publishes, per device, a
:class:`Receipt` to the compacted topic ``<topic>.receipts`` (:func:`receipts_topic`), keyed by the device id:

- ``stored_mark``: every number below it is accounted for (stored, or refused whole after verification);
- ``seen_end``: one past the highest number accounted for;
- ``holes``: the spans between them the cloud does not have (a gap still awaited, or one given up as lost
  whose numbers never arrived), sorted, at most :data:`MAX_HOLES`; ``exact_end``: the listing is complete
  below it (``seen_end``, or where the first unlisted hole starts);
- ``announce``: the cloud holds envelopes of the device it cannot open (parked as ``unknown_schema``: the
  broker lost the envelope that announced their schema or dictionary, a topic was reset, the cloud's registry
  was wiped). The device announces its registrations again at once (zero-row envelopes,
  :meth:`~connectors.tunnel.codebook.Codebook.announcements`), and the cloud opens the parked ones.

A device keeps a sealed batch in its spool until a receipt :meth:`~Receipt.covers` it, resends at once a batch a
receipt shows in a hole (:meth:`~Receipt.lacks`: the cloud read later numbers of the same partition, so this
one is gone), and resends on a timeout what no receipt has reached (lost at the end, or a topic reset).

A receipt is signed with the device's tunnel key (:func:`~connectors.tunnel.keys.sign`, the same HMAC as the
envelopes) over a domain of its own (``b"SFR1"`` after the device id: no envelope starts so), so only the cloud
(or the device itself) can make one, and a receipt can never pass for an envelope or for another device's.

Example:
    >>> key = b"k" * 32
    >>> receipt = Receipt("phone-1", stored_mark=10, seen_end=30, holes=((10, 12), (20, 25)), exact_end=30)
    >>> value = encode_receipt(receipt, key)
    >>> opened = decode_receipt(value, "phone-1", key)
    >>> opened == receipt, decode_receipt(value, "phone-2", key), decode_receipt(value[:-1] + b"x", "phone-1", key)
    (True, None, None)
    >>> decode_receipt(encode_receipt(Receipt("phone-1", 10, 30, announce=True), key), "phone-1", key).announce
    True
    >>> receipt.covers(0, 10), receipt.covers(12, 20), receipt.covers(18, 22), receipt.covers(25, 31)
    (True, True, False, False)
    >>> receipt.lacks(10, 12), receipt.lacks(12, 20), receipt.lacks(30, 32)
    (True, False, False)
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from connectors.tunnel.kafka import CLIENT_TIMEOUTS, ensure_topic
from connectors.tunnel.keys import MAC_BYTES, KeyRegistry, sign, verify

log = logging.getLogger("streamflow.cloud")

#: the first bytes of a receipt's body (and its signing domain after the device id)
MAGIC = b"SFR1"
#: holes listed in one receipt; a device with more waits for the first ones to fill before it learns of the rest
MAX_HOLES = 64
#: a device's receipt is published at most this often (the last change waits at most this long)
DEFAULT_EVERY_S = 0.25
#: a receipt the broker has not acknowledged this long after its send fails and is published again (more than
#: CLIENT_TIMEOUTS' request timeout, as kafka-python requires)
DELIVERY_TIMEOUT_MS = CLIENT_TIMEOUTS["request_timeout_ms"] + 1000
#: the receipts topic is compacted: the newest receipt of each device is what a device needs
TOPIC_CONFIG = {"cleanup.policy": "compact"}


def receipts_topic(topic: str) -> str:
    """The compacted topic the cloud publishes the receipts for ``topic``'s devices to."""
    return f"{topic}.receipts"


@dataclass(frozen=True)
class Receipt:
    """What the cloud has of ``device``'s numbers (see the module docstring)."""

    device: str
    stored_mark: int
    seen_end: int
    holes: tuple[tuple[int, int], ...] = ()
    exact_end: int = 0
    announce: bool = False

    def covers(self, first: int, end: int) -> bool:
        """Whether the cloud has every number ``first..end-1``."""
        if end <= self.stored_mark:
            return True
        if end > self.exact_end:
            return False
        return not any(a < end and first < b for a, b in self.holes)

    def lacks(self, first: int, end: int) -> bool:
        """Whether the cloud is known to miss some of ``first..end-1``: a listed hole meets it."""
        return any(a < end and first < b for a, b in self.holes)


def encode_receipt(receipt: Receipt, key: bytes) -> bytes:
    """The receipt as a Kafka message value: ``SFR1``, its JSON, and the HMAC of the device id and both."""
    fields: dict[str, Any] = {"m": receipt.stored_mark, "e": receipt.seen_end, "x": receipt.exact_end,
                              "h": [list(h) for h in receipt.holes]}
    if receipt.announce:  # only then: a device of an earlier version reads the receipt as before
        fields["a"] = 1
    body = MAGIC + json.dumps(fields, separators=(",", ":")).encode()
    return body + sign(key, receipt.device.encode() + body)


def decode_receipt(value: bytes | None, device: str, key: bytes) -> Receipt | None:
    """The receipt ``value`` carries for ``device``, or None if it is not one signed with ``key`` for it."""
    if not value or len(value) < len(MAGIC) + MAC_BYTES or not value.startswith(MAGIC):
        return None
    body, mac = value[:-MAC_BYTES], value[-MAC_BYTES:]
    if not verify(key, device.encode() + body, mac):
        return None
    try:
        fields = json.loads(body[len(MAGIC):])
        holes = tuple((int(a), int(b)) for a, b in fields["h"])
        return Receipt(device, int(fields["m"]), int(fields["e"]), holes, int(fields["x"]), bool(fields.get("a")))
    except (ValueError, KeyError, TypeError):
        return None


class ReceiptPublisher:
    """The cloud's side: publishes the receipts of the devices noted (:meth:`note`), at most every ``every_s`` each.

    ``receipt_of(device)`` builds a device's receipt (``CloudStore.receipt``); ``keys`` signs it (a device the
    registry does not know gets none). Sends are asynchronous: a send that fails (the broker went away, or lost the
    receipts topic and made it again with other partitions) notes its device again, and the next call publishes
    it on a new producer (fresh metadata); a receipt the broker acknowledged and then lost is followed by the
    next one, and a device that hears nothing resends after its timeout, which makes the cloud publish again.

    Example (needs a broker)::

        publisher = ReceiptPublisher("127.0.0.1:9092", "streamflow.features", KeyRegistry())
        publisher.note(["phone-1"])
        publisher.publish_due(store.receipt)
    """

    def __init__(self, bootstrap: str, topic: str, keys: KeyRegistry | Mapping[str, bytes], *,
                 every_s: float = DEFAULT_EVERY_S, partitions: int = 4):
        self.bootstrap = bootstrap
        self.topic = receipts_topic(topic)
        self.keys = keys
        self.every_s = every_s
        self.partitions = partitions
        self.published = 0
        self._dirty: set[str] = set()
        # device → the producer a send of its receipt failed on (added by that producer's I/O thread)
        self._failed: dict[str, Any] = {}
        self._failed_lock = threading.Lock()
        self._sent_at: dict[str, float] = {}
        self._producer: Any = None

    def note(self, devices: Iterable[str]) -> None:
        """These devices' receipts changed (or must be sent again: a resend was dropped as a repeat)."""
        self._dirty.update(devices)

    def publish_due(self, receipt_of: Callable[[str], Receipt], force: bool = False) -> int:
        """Publish the noted receipts whose device had none for ``every_s`` (all of them with ``force``)."""
        with self._failed_lock:
            failed, self._failed = self._failed, {}
        if failed:
            log.info("cloud: the receipts of %d devices did not reach the broker; publishing them again", len(failed))
            if self._producer is not None and any(p is self._producer for p in failed.values()):
                self._drop_producer()  # not one dropped before: its records failed as it closed
            self._dirty |= failed.keys()
            for device in failed:
                self._sent_at.pop(device, None)
        if not self._dirty:
            return 0
        now = time.monotonic()
        due = [d for d in self._dirty if force or now - self._sent_at.get(d, float("-inf")) >= self.every_s]
        if not due:
            return 0
        producer = self._connect()
        for device in due:
            self._dirty.discard(device)
            key = self.keys.key_for(device) if isinstance(self.keys, KeyRegistry) else self.keys.get(device)
            if key is None:
                continue
            future = producer.send(self.topic, key=device.encode(), value=encode_receipt(receipt_of(device), key))
            future.add_errback(self._send_failed, device, producer)
            self._sent_at[device] = now
            self.published += 1
        return len(due)

    def _connect(self) -> Any:
        if self._producer is None:
            from kafka import KafkaProducer

            ensure_topic(self.bootstrap, self.topic, self.partitions, TOPIC_CONFIG)
            # max_block_ms: a broker away must not hold the consumer's loop (its next poll notices the outage)
            # delivery_timeout_ms: a receipt held for a partition the topic no longer has fails within seconds
            self._producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks=1, enable_idempotence=False,
                                           linger_ms=0, max_block_ms=2000, client_id="streamflow-cloud-receipts",
                                           delivery_timeout_ms=DELIVERY_TIMEOUT_MS, **CLIENT_TIMEOUTS)
        return self._producer

    def _send_failed(self, device: str, producer: Any, exc: BaseException) -> None:
        log.debug("cloud: the receipt of %s was not published (%s)", device, exc)
        with self._failed_lock:
            self._failed[device] = producer

    def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.close(timeout=0)

    def flush(self, timeout_s: float = 5.0) -> None:
        if self._producer is not None:
            with contextlib.suppress(Exception):  # a broker gone: the next receipt says the same, and more
                self._producer.flush(timeout=timeout_s)

    def close(self) -> None:
        """Stop (what was noted and not sent is sent by the next publisher, on the devices' next batch)."""
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                producer.close(timeout=2)
