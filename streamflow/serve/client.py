"""The device side of serving: send a request to the cloud worker and race it against the local model.

:class:`ServeClient` sends each input, signed with the device's key, with its SLA and the device's latest
measured upload time (kafka-python), and at the same moment runs the fastest zoo model on the device (our
engine, a worker thread). It answers each request exactly once:

- with the cloud's reply as soon as one arrives before the deadline;
- otherwise, at the deadline, with the local model's result (or, if even that is not ready, with whichever
  of the two comes first after the deadline — an SLA miss, counted);
- a cloud reply that arrives after its request was answered is counted (``late_replies``) and dropped; one
  that does not verify goes to :attr:`ServeClient.dead_letters` and is counted by reason.

The upload time: a request is one Kafka message and cannot carry its own upload time, so each request
carries the latest measurement — half the produce round trip (send → broker acknowledgement) of the
previous request, which the cloud doubles into its network estimate (MDInference). A device's first
request carries none and the cloud assumes half the SLA is network.

``policy="local"`` sends nothing and answers with the local model (the always-local baseline).

Example (needs a broker, a running worker and the zoo; see ``streamflow serve``)::

    with ServeClient("phone-1", key) as client:
        answer = client.infer(image, sla_ms=150)
        answer.answered_by, answer.model, answer.label, answer.latency_ms
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from streamflow.serve.messages import (
    REPLY_PARTITIONS,
    REPLY_TOPIC,
    REQUEST_TOPIC,
    MessageError,
    Reply,
    Request,
    decode_reply,
    encode_request,
    reply_partition,
)

if TYPE_CHECKING:
    from streamflow.serve.zoo import Zoo

log = logging.getLogger("streamflow.serve.client")

CLIENT_POLICIES = ("mdinference", "largest", "local")


@dataclass(frozen=True)
class Answer:
    """The one answer to a request.

    ``answered_by`` is ``"cloud"`` or ``"device"``; ``model`` the model that produced ``label``;
    ``latency_ms`` from submission to answer; ``met_sla`` whether that was within ``sla_ms``. ``cloud`` says
    what became of the cloud's side at answer time: ``ok`` (it answered), ``pending`` (no reply by then),
    ``expired``/``error`` (the worker's reply status), ``unsent`` (the request could not be handed to Kafka),
    ``none`` (policy ``local``). ``budget_ms``/``inference_ms`` are the cloud's (NaN for a device answer's
    budget; the local model's time for a device answer).
    """

    request_id: int
    label: int
    answered_by: Literal["cloud", "device"]
    model: str
    latency_ms: float
    sla_ms: float
    met_sla: bool
    policy: str
    cloud: str
    budget_ms: float = math.nan
    inference_ms: float = math.nan


class _Pending:
    __slots__ = ("request_id", "start", "deadline", "sla_ms", "policy", "future", "local", "local_ms", "reply",
                 "cloud", "done", "past_deadline")

    def __init__(self, request_id: int, start: float, sla_ms: float, guard_ms: float, policy: str):
        self.request_id = request_id
        self.start = start
        self.deadline = start + max(sla_ms - guard_ms, 0.0) / 1000.0
        self.sla_ms = sla_ms
        self.policy = policy
        self.future: Future[Answer] = Future()
        self.local: int | None = None
        self.local_ms = math.nan
        self.reply: Reply | None = None
        self.cloud = "none" if policy == "local" else "pending"
        self.done = False
        self.past_deadline = False


class ServeClient:
    """A device's serving client (see the module docstring); :meth:`start` it or use it as a context manager.

    ``key`` is the device's signing key (default: its entry in the key registry). ``bootstrap`` the broker
    (default: the settings'), e.g. a :class:`~streamflow.serve.netshim.KafkaShim`'s. ``local_model`` a zoo
    model name (default: the fastest). ``guard_ms`` how long before the deadline the device stops waiting
    for the cloud, so that the answer is out by the deadline.
    """

    def __init__(self, device: str, key: bytes | None = None, *, bootstrap: str | None = None,
                 zoo: Zoo | None = None, zoo_path: Path | None = None, local_model: str | None = None,
                 key_registry: Path | None = None, image_format: str = "jpeg", quality: int = 90,
                 guard_ms: float = 4.0, dead_letter_limit: int = 1000):
        from connectors.tunnel.keys import KeyRegistry, check_device_id
        from streamflow.serve.zoo import Zoo

        self.device = check_device_id(device)
        self.key = key if key is not None else KeyRegistry(key_registry).key_for(device)
        if self.key is None:
            raise ValueError(f"device {device!r} has no key in the registry: `streamflow tunnel keys add {device}`")
        self.bootstrap = bootstrap
        self.zoo = zoo if zoo is not None else Zoo.load(zoo_path)
        self.local_model = self.zoo.get(local_model).name if local_model else self.zoo.fastest().name
        self.image_format = image_format
        self.quality = quality
        self.guard_ms = guard_ms
        self.counts: collections.Counter[str] = collections.Counter()
        self.dead_letters: collections.deque[tuple[str, str, bytes]] = collections.deque(maxlen=dead_letter_limit)
        self.upload_ms: float | None = None
        self._predict: Callable[[np.ndarray], int] | None = None
        self._pending: dict[int, _Pending] = {}
        self._answered_by_cloud: set[int] = set()
        self._deadlines: list[tuple[float, int]] = []
        self._lock = threading.Condition()
        self._next_id = (int(time.time() * 1000) << 20)  # unique across restarts of the same device
        self._first_id = self._next_id
        self._local = ThreadPoolExecutor(1, thread_name_prefix="serve-local")
        self._producer: Any = None
        self._consumer: Any = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self, warm_up: bool = True, connect: bool = True) -> ServeClient:
        """Load (and warm up) the local model, connect to the broker (unless only policy ``local`` will be
        used: ``connect=False``), start reading replies."""
        self._predict = self.zoo.predictor(self.local_model)
        if warm_up:
            self.zoo.warm_up([self.local_model])
        self._threads.append(threading.Thread(target=self._deadline_loop, name="serve-deadlines", daemon=True))
        if connect:
            self._connect()
            self._threads.append(threading.Thread(target=self._reply_loop, name="serve-replies", daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def _connect(self) -> None:
        from kafka import KafkaConsumer, KafkaProducer, TopicPartition

        from connectors.tunnel.kafka import CLIENT_TIMEOUTS, bootstrap_servers, ensure_topic

        bootstrap = bootstrap_servers(self.bootstrap)
        ensure_topic(bootstrap, REQUEST_TOPIC, partitions=1)
        ensure_topic(bootstrap, REPLY_TOPIC, partitions=REPLY_PARTITIONS)
        self._producer = KafkaProducer(bootstrap_servers=bootstrap, client_id=f"serve-{self.device}", linger_ms=0,
                                       acks=1, enable_idempotence=False, max_block_ms=200,
                                       delivery_timeout_ms=30_000, **CLIENT_TIMEOUTS)
        self._consumer = KafkaConsumer(bootstrap_servers=bootstrap, client_id=f"serve-{self.device}", group_id=None,
                                       enable_auto_commit=False, fetch_max_wait_ms=100, **CLIENT_TIMEOUTS)
        partitions = self._consumer.partitions_for_topic(REPLY_TOPIC) or set(range(REPLY_PARTITIONS))
        mine = TopicPartition(REPLY_TOPIC, reply_partition(self.device, len(partitions)))
        self._consumer.assign([mine])
        self._consumer.seek_to_end(mine)
        self._consumer.position(mine)  # resolve "end" now: replies to this session's requests come after it

    def close(self) -> None:
        """Answer what is pending (local results), stop the threads, close the Kafka clients."""
        self._stopping.set()
        with self._lock:
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        self._local.shutdown(wait=True)
        if self._producer is not None:
            self._producer.close(timeout=2)
        if self._consumer is not None:
            self._consumer.close()

    def __enter__(self) -> ServeClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -----------------------------------------------------------------------------------
    def submit(self, image: np.ndarray, sla_ms: float, policy: str = "mdinference") -> Future[Answer]:
        """Start one request; the future holds its :class:`Answer`."""
        if policy not in CLIENT_POLICIES:
            raise ValueError(f"policy is one of {CLIENT_POLICIES}, got {policy!r}")
        if not sla_ms > 0:
            raise ValueError(f"sla_ms must be positive, got {sla_ms}")
        if self._predict is None:
            raise RuntimeError("start() the client first")
        start = time.perf_counter()
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            pending = _Pending(request_id, start, sla_ms, self.guard_ms, policy)
            self._pending[request_id] = pending
            heapq.heappush(self._deadlines, (pending.deadline, request_id))
            self._lock.notify_all()
        self._local.submit(self._run_local, pending, image)
        if policy != "local":
            self._send(pending, image)
        self.counts["requests"] += 1
        return pending.future

    def infer(self, image: np.ndarray, sla_ms: float, policy: str = "mdinference") -> Answer:
        return self.submit(image, sla_ms, policy).result()

    def _send(self, pending: _Pending, image: np.ndarray) -> None:
        request = Request(self.device, pending.request_id, pending.sla_ms, self.upload_ms,
                          int(time.time() * 1000), pending.policy, image)
        try:
            value = encode_request(request, self.key, self.image_format, self.quality)
            sent_at = time.perf_counter()
            future = self._producer.send(REQUEST_TOPIC, key=self.device.encode(), value=value)
        except Exception as exc:  # no metadata / buffer full during an outage: the local model answers
            self.counts["unsent"] += 1
            log.debug("request %d not sent: %s", pending.request_id, exc)
            with self._lock:
                pending.cloud = "unsent"
            return
        future.add_callback(lambda _meta: self._acked(sent_at))
        future.add_errback(lambda exc: self.counts.update(["send_failed"]))

    def _acked(self, sent_at: float) -> None:
        self.upload_ms = (time.perf_counter() - sent_at) * 1000.0 / 2.0
        self.counts["acked"] += 1

    def _run_local(self, pending: _Pending, image: np.ndarray) -> None:
        start = time.perf_counter()
        label = self._predict(image)
        with self._lock:
            pending.local, pending.local_ms = label, (time.perf_counter() - start) * 1000.0
            if pending.done:
                return
            if pending.policy == "local" or pending.past_deadline:
                self._finish(pending, "device")

    # -- the two other threads ------------------------------------------------------------------------
    def _deadline_loop(self) -> None:
        with self._lock:
            while True:
                if self._stopping.is_set() and not self._pending:
                    return
                now = time.perf_counter()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, request_id = heapq.heappop(self._deadlines)
                    pending = self._pending.get(request_id)
                    if pending is None or pending.done:
                        continue
                    pending.past_deadline = True
                    if pending.local is not None:
                        self._finish(pending, "device")
                wait = self._deadlines[0][0] - now if self._deadlines else 0.1
                self._lock.wait(timeout=min(max(wait, 0.0), 0.1))

    def _reply_loop(self) -> None:
        key_for = {self.device: self.key}.get
        own = self.device.encode()
        while not self._stopping.is_set():
            try:
                batches = self._consumer.poll(timeout_ms=50)
            except Exception as exc:  # the broker is away: kafka-python reconnects on the next poll
                log.debug("reply poll failed: %s", exc)
                time.sleep(0.05)
                continue
            for records in batches.values():
                for record in records:
                    if record.key != own:
                        continue  # another device's reply on the same partition
                    self._on_reply(record.value, key_for)

    def _on_reply(self, value: bytes, key_for: Callable[[str], bytes | None]) -> None:
        try:
            reply = decode_reply(value, key_for)
            if reply.device != self.device:
                raise MessageError("wrong_device", f"reply {reply.request_id} is for {reply.device!r}")
        except MessageError as exc:
            self.counts[f"dead_letter.{exc.reason}"] += 1
            self.counts["dead_letters"] += 1
            self.dead_letters.append((exc.reason, str(exc), value))
            log.warning("reply dead-lettered: %s", exc)
            return
        with self._lock:
            pending = self._pending.get(reply.request_id)
            if pending is None or pending.done:
                known = self._first_id <= reply.request_id < self._next_id
                self.counts["duplicate_replies" if reply.request_id in self._answered_by_cloud
                            else "late_replies" if known else "unknown_replies"] += 1
                return
            if reply.status != "ok":
                pending.cloud = reply.status
                self.counts[f"cloud_{reply.status}"] += 1
                if pending.past_deadline and pending.local is not None:
                    self._finish(pending, "device")
                return
            pending.reply = reply
            pending.cloud = "ok"
            self._finish(pending, "cloud")

    def _finish(self, pending: _Pending, by: Literal["cloud", "device"]) -> None:
        """Answer ``pending`` (caller holds the lock); the one place a request is answered."""
        if pending.done:
            return
        pending.done = True
        latency = (time.perf_counter() - pending.start) * 1000.0
        if by == "cloud":
            reply = pending.reply
            assert reply is not None
            answer = Answer(pending.request_id, reply.label, "cloud", reply.model, latency, pending.sla_ms,
                            latency <= pending.sla_ms, pending.policy, "ok", reply.budget_ms, reply.inference_ms)
            self._answered_by_cloud.add(pending.request_id)
        else:
            assert pending.local is not None
            answer = Answer(pending.request_id, pending.local, "device", self.local_model, latency, pending.sla_ms,
                            latency <= pending.sla_ms, pending.policy, pending.cloud, math.nan, pending.local_ms)
        del self._pending[pending.request_id]
        self.counts[f"answered_by_{by}"] += 1
        if not answer.met_sla:
            self.counts["sla_missed"] += 1
        pending.future.set_result(answer)


__all__ = ["CLIENT_POLICIES", "Answer", "ServeClient"]
