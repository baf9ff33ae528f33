"""The device's Kafka process (see :mod:`streamflow.serve.child` for why it is a process of its own).

It holds the device's kafka-python producer and reply consumer. From the parent it takes
``("send", request_id, (sla_ms, window_ms, policy, height, width, image bytes))`` and sends the signed
request with the device's measured upload time (:class:`UploadTime`) and the device clock; it reports
``("acked", id, upload ms)``, ``("send_failed", id, reason)`` (not delivered within the delivery timeout)
or ``("unsent", id, reason)`` (not even handed to Kafka). It reads the device's reply partition and passes
on each verified reply (``("reply", id, Reply)``) or, for one that does not verify, ``("dead_letter", 0,
(reason, message, raw bytes))``. Replies for other devices on the same partition are skipped.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from typing import Any

import numpy as np

from streamflow.serve.child import ChildSide

log = logging.getLogger("streamflow.serve.network")


class UploadTime:
    """The device's measured upload time, as each request reports it to the cloud.

    What the device can measure of a request's network time is its round trip: from handing the request to
    Kafka to the reply's arrival, less the inference time the reply reports. Half of that is one way: the
    upload time the cloud doubles back into its network estimate (MDInference). It takes in everything
    that is not the model — the link both ways, the broker, the worker's queue and its Kafka client, the
    device's reply fetch — which a produce acknowledgement alone (used until the first reply) misses. Replies
    the cloud sent without running a model (``expired``: no time was left) count too, or an estimate blown
    up by a stall would starve every later request of its budget and never be measured down again; a
    one-way time is capped at the request's SLA (beyond it, how far is the stall's, not the link's). A
    request cannot carry its own round trip, so it carries an EWMA (``alpha``) of those measured so far, and
    their spread (:attr:`std`, an EWMA of the variance like the cloud's model profiles; None until
    ``min_samples`` replies), from which the cloud's expected-accuracy rule judges how far to trust the estimate.

    Example:
        >>> upload = UploadTime(alpha=0.5)
        >>> upload.acked(8.0); upload.value
        4.0
        >>> upload.replied(round_trip_ms=50.0, inference_ms=10.0); upload.value   # first reply: 20 ms one way
        20.0
        >>> upload.replied(round_trip_ms=70.0, inference_ms=10.0); upload.value   # 30 ms: the EWMA moves half way
        25.0
        >>> upload.replied(round_trip_ms=10_000.0, inference_ms=float("nan"), cap_ms=150.0); upload.value
        87.5
        >>> upload.std is None, UploadTime(alpha=0.5, min_samples=2).std
        (True, None)
    """

    def __init__(self, alpha: float = 0.3, min_samples: int = 5):
        self.alpha = alpha
        self.min_samples = min_samples
        self.mean: float | None = None
        self.var = 0.0
        self.samples = 0
        self._ack_ms: float | None = None

    @property
    def std(self) -> float | None:
        """The spread of the one-way times (EWMA of the variance); None while fewer than ``min_samples``."""
        return math.sqrt(self.var) if self.samples >= self.min_samples else None

    @property
    def value(self) -> float | None:
        if self.mean is None:
            return None if self._ack_ms is None else self._ack_ms / 2.0
        return self.mean

    def acked(self, round_trip_ms: float) -> None:
        self._ack_ms = round_trip_ms

    def replied(self, round_trip_ms: float, inference_ms: float, cap_ms: float = math.inf) -> None:
        one_way = min(max(round_trip_ms - (inference_ms if inference_ms == inference_ms else 0.0), 0.0) / 2.0,
                      cap_ms)
        self.samples += 1
        if self.mean is None:
            self.mean = one_way
            return
        delta = one_way - self.mean
        self.mean += self.alpha * delta
        self.var = (1.0 - self.alpha) * (self.var + self.alpha * delta * delta)


def serve(side: ChildSide) -> None:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    from connectors.tunnel.kafka import CLIENT_TIMEOUTS, ensure_topic
    from streamflow.serve.messages import (
        REPLY_PARTITIONS,
        REPLY_TOPIC,
        REQUEST_TOPIC,
        MessageError,
        Request,
        decode_reply,
        encode_request,
        reply_partition,
    )

    hello = side.hello
    device, key, bootstrap, image_format = hello["device"], hello["key"], hello["bootstrap"], hello["image_format"]
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # an outage is the client's to handle and count
    try:
        ensure_topic(bootstrap, REQUEST_TOPIC, partitions=1)
        ensure_topic(bootstrap, REPLY_TOPIC, partitions=REPLY_PARTITIONS)
        producer = KafkaProducer(bootstrap_servers=bootstrap, client_id=f"serve-{device}", linger_ms=0, acks=1,
                                 enable_idempotence=False, max_block_ms=200, delivery_timeout_ms=30_000,
                                 **CLIENT_TIMEOUTS)
        consumer = KafkaConsumer(bootstrap_servers=bootstrap, client_id=f"serve-{device}", group_id=None,
                                 enable_auto_commit=False, fetch_max_wait_ms=100, **CLIENT_TIMEOUTS)
        partitions = consumer.partitions_for_topic(REPLY_TOPIC) or set(range(REPLY_PARTITIONS))
        mine = TopicPartition(REPLY_TOPIC, reply_partition(device, len(partitions)))
        consumer.assign([mine])
        consumer.seek_to_end(mine)
        consumer.position(mine)  # resolve "end" now: replies to this session's requests come after it
        producer.partitions_for(REQUEST_TOPIC)  # metadata now, not on the first request
    except Exception as exc:
        side.send("failed", 0, f"could not connect to the broker at {bootstrap}: {exc}")
        return
    side.send("ready", 0, None)
    stopping = threading.Event()
    upload = UploadTime()
    # request id → [when handed to Kafka, its SLA, produce round trip once acknowledged]; popped on its reply
    sent_at: dict[int, list[float]] = {}

    def read_replies() -> None:
        keys = {device: key}
        own = device.encode()
        while not stopping.is_set():
            try:
                batches = consumer.poll(timeout_ms=50)
            except Exception as exc:  # the broker is away: kafka-python reconnects on the next poll
                log.debug("reply poll failed: %s", exc)
                time.sleep(0.05)
                continue
            for records in batches.values():
                for record in records:
                    if record.key != own:
                        continue  # another device's reply on the same partition
                    try:
                        reply = decode_reply(record.value, keys)
                        if reply.device != device:
                            raise MessageError("wrong_device", f"reply {reply.request_id} is for {reply.device!r}")
                    except MessageError as exc:
                        side.send("dead_letter", 0, (exc.reason, str(exc), record.value))
                        continue
                    sent = sent_at.pop(reply.request_id, None)
                    # a request whose upload took longer than its SLA sat in the producer through an outage:
                    # its round trip measures the outage, not the link, and would blind the next requests
                    if sent is not None and reply.status in ("ok", "expired") and sent[2] <= sent[1]:
                        upload.replied((time.perf_counter() - sent[0]) * 1000.0, reply.inference_ms, sent[1])
                    side.send("reply", reply.request_id, reply)

    def acked(request_id: int, at: float) -> None:
        round_trip = (time.perf_counter() - at) * 1000.0
        if (sent := sent_at.get(request_id)) is not None:
            sent[2] = round_trip
        upload.acked(round_trip)
        side.send("acked", request_id, upload.value)

    reader = threading.Thread(target=read_replies, name="serve-replies", daemon=True)
    reader.start()
    while (message := side.recv()) is not None:
        _, request_id, (sla_ms, window_ms, policy, height, width, data) = message
        request = Request(device, request_id, sla_ms, upload.value, int(time.time() * 1000), policy,
                          _shape_only(height, width), window_ms, upload.std, hello.get("local_accuracy"))
        try:
            value = encode_request(request, key, image_format, encoded=data)
            now = time.perf_counter()
            future = producer.send(REQUEST_TOPIC, key=device.encode(), value=value)
        except Exception as exc:  # no metadata / buffer full during an outage: the local model answers
            side.send("unsent", request_id, str(exc))
            continue
        sent_at[request_id] = [now, sla_ms, math.inf]
        if len(sent_at) > 10_000:  # requests the cloud never replied to (an outage): forget the oldest
            for old in sorted(sent_at)[:5_000]:
                del sent_at[old]
        future.add_callback(lambda _meta, rid=request_id, at=now: acked(rid, at))
        future.add_errback(lambda exc, rid=request_id: side.send("send_failed", rid, str(exc)))
    stopping.set()
    reader.join(timeout=5)
    producer.close(timeout=2)
    consumer.close()


def _shape_only(height: int, width: int) -> Any:
    """An array of the image's shape without its pixels (the request is built from encoded bytes)."""
    return np.broadcast_to(np.zeros((1, 1, 3), np.uint8), (height, width, 3))


if __name__ == "__main__":
    serve(ChildSide(int(sys.argv[1])))
