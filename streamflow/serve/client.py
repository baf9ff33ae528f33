"""The device side of serving: send a request to the cloud worker and race it against the local model.

:class:`ServeClient` sends each input, signed with the device's key, with its SLA and the device's latest
measured upload time (kafka-python), and at the same moment runs the fastest zoo model on the device (our
engine). The model and the Kafka clients run in helper processes (:mod:`streamflow.serve.child` says why);
this process keeps the deadlines. It answers each request exactly once:

- with the cloud's reply as soon as one arrives before the deadline — unless the model that answered is less
  accurate (by the zoo) than the device's own: then with the local result, as soon as it is there (the
  cloud's reply if the local model fails, or if the deadline comes first), counted as ``cloud_less_accurate``
  (MDInference's paper rule picks the fastest cloud model when none fits the budget, which may be no better
  than the device's);
- otherwise, at the deadline, with the local model's result (or, if even that is not ready, with whichever
  of the two comes first after the deadline — an SLA miss, counted);
- a cloud reply that arrives after its request was answered is counted (``late_replies``) and dropped; one
  that does not verify goes to :attr:`ServeClient.dead_letters` and is counted by reason.

The time budget: a request carries its SLA and the time the device will still wait for the reply when the
request leaves (the SLA less the encoding time and the guard below); the cloud counts its budget from the
latter. The upload time: a request is one Kafka message and cannot carry its own upload time, so each
request carries the device's measurement so far (:class:`streamflow.serve.network.UploadTime`: half the
non-model round trip of the replies so far, an EWMA), which the cloud doubles into its network estimate
(MDInference). A device's first request carries none and the cloud assumes half the wait is network.

``policy="local"`` sends nothing and answers with the local model (the always-local baseline).

Example (needs a broker, a running worker and the zoo; see ``streamflow serve``)::

    with ServeClient("phone-1", key) as client:
        client.warm(image)                      # else the first answers are the device's (the cloud path is cold)
        answer = client.infer(image, sla_ms=150)
        answer.answered_by, answer.model, answer.label, answer.latency_ms
"""

from __future__ import annotations

import collections
import gc
import heapq
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from streamflow.serve.child import Child
from streamflow.serve.messages import Reply
from streamflow.settings import settings

if TYPE_CHECKING:
    from streamflow.serve.zoo import Zoo

log = logging.getLogger("streamflow.serve.client")

CLIENT_POLICIES = ("mdinference", "largest", "local")
WARM_SLA_MS = 3000.0  # a warm-up request's SLA: long enough for a cold cloud path


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
    network_ms: float = math.nan  # the cloud's network estimate (2 × the upload time the request carried)
    local_ready_ms: float = math.nan  # from submission until the local model's result was here (device answers)


class _Pending:
    __slots__ = ("request_id", "start", "deadline", "sla_ms", "policy", "future", "local", "local_ms", "local_at",
                 "reply",
                 "cloud", "done", "past_deadline", "shape", "local_error")

    def __init__(self, request_id: int, start: float, sla_ms: float, guard_ms: float, policy: str,
                 shape: tuple[int, ...]):
        self.request_id = request_id
        self.start = start
        self.deadline = start + max(sla_ms - guard_ms, 0.0) / 1000.0
        self.sla_ms = sla_ms
        self.policy = policy
        self.future: Future[Answer] = Future()
        self.local: int | None = None
        self.local_ms = math.nan
        self.local_at = math.nan  # ms from submission to the local result's arrival
        self.reply: Reply | None = None
        self.cloud = "none" if policy == "local" else "pending"
        self.done = False
        self.past_deadline = False
        self.shape = shape
        self.local_error: str | None = None


class ServeClient:
    """A device's serving client (see the module docstring); :meth:`start` it or use it as a context manager.

    ``key`` is the device's signing key (default: its entry in the key registry). ``bootstrap`` the broker
    (default: the settings'), e.g. a :class:`~streamflow.serve.netshim.KafkaShim`'s. ``local_model`` a zoo
    model name (default: the fastest).

    The device stops waiting for the cloud a guard time before the deadline, so that its answer is out by
    the deadline even when a busy machine wakes the deadline thread late: ``max(guard_ms, guard_share × SLA,
    the worst lateness of the deadline thread's last 500 timed wake-ups + guard_ms)``, at most half the SLA.
    On this 2-core machine shared with other work, the thread wakes up to tens of ms late now and then.

    ``freeze_gc`` (default on): :meth:`start` moves every object alive then out of the garbage collector's
    reach (``gc.freeze()``). The deadlines are kept in this process, and a full collection walking an app's
    whole heap (numpy, pyarrow, the Kafka client: ~66 ms measured in ``bench.serve``) outlasts any guard;
    frozen, a collection walks only what was made since.
    """

    def __init__(self, device: str, key: bytes | None = None, *, bootstrap: str | None = None,
                 zoo: Zoo | None = None, zoo_path: Path | None = None, local_model: str | None = None,
                 key_registry: Path | None = None, image_format: str = "jpeg", quality: int = 90,
                 guard_ms: float = 5.0, guard_share: float = 0.1, dead_letter_limit: int = 1000,
                 freeze_gc: bool = True):
        from connectors.tunnel.keys import KeyRegistry, check_device_id
        from streamflow.serve.zoo import Zoo

        self.device = check_device_id(device)
        if key is None:
            key = KeyRegistry(settings(key_registry=key_registry).key_registry).key_for(device)
        self.key = key
        if self.key is None:
            raise ValueError(f"device {device!r} has no key in the registry: `streamflow tunnel keys add {device}`")
        self.bootstrap = bootstrap
        self.zoo = zoo if zoo is not None else Zoo.load(zoo_path)
        self.local_model = self.zoo.get(local_model).name if local_model else self.zoo.fastest().name
        self._accuracy = {m.name: m.accuracy for m in self.zoo.models}
        if self.zoo.path is None:
            raise ValueError("the client's zoo must be a saved one (Zoo.load or build_zoo): the device's model "
                             "process loads it from its file")
        self.image_format = image_format
        self.quality = quality
        self.guard_ms = guard_ms
        self.guard_share = guard_share
        self.freeze_gc = freeze_gc
        self.lateness_ms: collections.deque[float] = collections.deque([0.0], maxlen=500)  # of timed wake-ups
        self.counts: collections.Counter[str] = collections.Counter()
        self.dead_letters: collections.deque[tuple[str, str, bytes]] = collections.deque(maxlen=dead_letter_limit)
        self.upload_ms: float | None = None
        self.replied: set[int] = set()  # request ids the cloud replied to (any status, in time or late)
        self._pending: dict[int, _Pending] = {}
        self._answered_by_cloud: set[int] = set()
        self._deadlines: list[tuple[float, int]] = []
        self._lock = threading.Condition()
        self._next_id = (int(time.time() * 1000) << 20)  # unique across restarts of the same device
        self._first_id = self._next_id
        self._device: Child | None = None
        self._network: Child | None = None
        self._deadline_thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self, connect: bool = True) -> ServeClient:
        """Start the device model's process (it loads and warms up the local model) and, unless only policy
        ``local`` will be used (``connect=False``), the Kafka process (it connects to the broker)."""
        self._device = Child("streamflow.serve.device", self._on_device).start(
            {"zoo": str(self.zoo.path), "model": self.local_model, "image_format": self.image_format,
             "quality": self.quality})
        if connect:
            try:
                self._network = Child("streamflow.serve.network", self._on_network).start(
                    {"device": self.device, "key": self.key,
                     "bootstrap": settings(kafka_bootstrap=self.bootstrap).kafka_bootstrap,
                     "image_format": self.image_format, "local_accuracy": self._accuracy[self.local_model]})
            except Exception:
                self._device.close()
                raise
        if self.freeze_gc:
            gc.collect()
            gc.freeze()
        self._deadline_thread = threading.Thread(target=self._deadline_loop, name="serve-deadlines", daemon=True)
        self._deadline_thread.start()
        return self

    def close(self) -> None:
        """Answer what is pending (local results), then stop the helper processes."""
        self._stopping.set()
        with self._lock:
            self._lock.notify_all()
        if self._deadline_thread is not None:
            self._deadline_thread.join(timeout=10)
        for child in (self._network, self._device):
            if child is not None:
                child.close()
        if self.freeze_gc:
            gc.unfreeze()  # what start() froze can be collected again

    def __enter__(self) -> ServeClient:
        return self if self._device is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -----------------------------------------------------------------------------------
    def submit(self, image: np.ndarray, sla_ms: float, policy: str = "mdinference") -> Future[Answer]:
        """Start one request; the future holds its :class:`Answer`."""
        if policy not in CLIENT_POLICIES:
            raise ValueError(f"policy is one of {CLIENT_POLICIES}, got {policy!r}")
        if not sla_ms > 0:
            raise ValueError(f"sla_ms must be positive, got {sla_ms}")
        if self._device is None:
            raise RuntimeError("start() the client first")
        if policy != "local" and self._network is None:
            raise RuntimeError(f"policy {policy!r} needs the broker: start(connect=True)")
        image = np.asarray(image)
        start = time.perf_counter()
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            pending = _Pending(request_id, start, sla_ms, self.guard_for(sla_ms), policy, image.shape)
            self._pending[request_id] = pending
            heapq.heappush(self._deadlines, (pending.deadline, request_id))
            self._lock.notify_all()
            self.counts["requests"] += 1
        self._device.send((request_id, image, policy != "local"))
        return pending.future

    def infer(self, image: np.ndarray, sla_ms: float, policy: str = "mdinference") -> Answer:
        return self.submit(image, sla_ms, policy).result()

    def warm(self, image: np.ndarray, timeout_s: float = 120.0, settle: int = 10) -> Answer:
        """Pay the cloud path's cold costs (connections, the worker's first fetch) before the requests that count:
        send ``image`` with a long SLA until the cloud answers one (for at most ``timeout_s``), then ``settle``
        more, so that the device's upload-time estimate (an EWMA) forgets the cold first round trip. Without it
        a fresh client's first requests are answered by the device, the cloud's reply still pending at the
        deadline. Returns the last answer; its ``cloud`` is ``"ok"`` if the cloud answered."""
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = (deadline - time.monotonic()) * 1000
            answer = self.infer(image, sla_ms=max(1.0, min(WARM_SLA_MS, left_ms)))
            if answer.cloud == "ok":
                break
            if time.monotonic() >= deadline:
                log.warning("the cloud did not answer within %.0f s: the device answers meanwhile", timeout_s)
                return answer
        for _ in range(settle):
            answer = self.infer(image, sla_ms=WARM_SLA_MS)
        return answer

    def guard_for(self, sla_ms: float) -> float:
        late = max(self.lateness_ms) + self.guard_ms
        return min(0.5 * sla_ms, max(self.guard_ms, self.guard_share * sla_ms, late))

    # -- what the helper processes send -----------------------------------------------------------------
    def _on_device(self, kind: str, request_id: int, value: Any) -> None:
        if kind == "closed":
            self._device_gone()
            return
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is None:
                return
            if kind == "encoded":
                network = self._network
                shape = pending.shape
            else:
                if kind == "label":
                    pending.local, pending.local_ms = value
                    pending.local_at = (time.perf_counter() - pending.start) * 1000.0
                elif kind == "error":
                    pending.local_error = value
                if pending.done:
                    return
                if pending.reply is not None:  # a less accurate cloud answer waited for this result
                    self._finish(pending, "cloud" if pending.local is None else "device")
                elif pending.policy == "local" or pending.past_deadline:
                    self._finish(pending, "device")
                return
        window_ms = (pending.deadline - time.perf_counter()) * 1000.0  # what the device will still wait
        if window_ms < 1.0:
            self._count_late_send(pending)
        elif network is not None:  # outside the lock: a full socket buffer must not stall the deadlines
            network.send(("send", request_id, (pending.sla_ms, min(window_ms, pending.sla_ms), pending.policy,
                                               shape[0], shape[1], value)))

    def _count_late_send(self, pending: _Pending) -> None:
        with self._lock:
            self.counts["unsent"] += 1
            self.counts["unsent.no_time_left"] += 1
            if not pending.done:
                pending.cloud = "unsent"

    def _device_gone(self) -> None:
        """The model process exited: what waits for it gets the cloud's answer or, past its deadline, an error."""
        with self._lock:
            if not self._stopping.is_set():
                log.error("the device model process is gone; requests without a cloud answer fail")
            for pending in list(self._pending.values()):
                if pending.local is None and pending.local_error is None:
                    pending.local_error = "the device model process exited"
                    if pending.reply is not None:
                        self._finish(pending, "cloud")
                    elif pending.past_deadline or pending.policy == "local":
                        self._finish(pending, "device")

    def _on_network(self, kind: str, request_id: int, value: Any) -> None:
        with self._lock:
            if kind == "reply":
                self._on_reply(value)
            elif kind == "acked":
                self.upload_ms = value
                self.counts["acked"] += 1
            elif kind == "dead_letter":
                reason, message, raw = value
                self.counts[f"dead_letter.{reason}"] += 1
                self.counts["dead_letters"] += 1
                self.dead_letters.append((reason, message, raw))
                log.warning("reply dead-lettered: %s", message)
            elif kind in ("unsent", "send_failed"):
                self.counts[kind] += 1
                pending = self._pending.get(request_id)
                if pending is not None and not pending.done:
                    pending.cloud = "unsent"
            elif kind == "closed" and not self._stopping.is_set():
                log.error("the device's Kafka process is gone; the local model answers from now on")

    def _on_reply(self, reply: Reply) -> None:
        """A verified reply (caller holds the lock)."""
        self.replied.add(reply.request_id)
        pending = self._pending.get(reply.request_id)
        if pending is None or pending.done:
            known = self._first_id <= reply.request_id < self._next_id
            self.counts["duplicate_replies" if reply.request_id in self._answered_by_cloud
                        else "late_replies" if known else "unknown_replies"] += 1
            return
        if reply.status != "ok":
            pending.cloud = reply.status
            self.counts[f"cloud_{reply.status}"] += 1
            if pending.past_deadline and (pending.local is not None or pending.local_error is not None):
                self._finish(pending, "device")
            return
        pending.reply = reply
        pending.cloud = "ok"
        local_accuracy = self._accuracy[self.local_model]
        if pending.local_error is None and self._accuracy.get(reply.model, local_accuracy) < local_accuracy:
            self.counts["cloud_less_accurate"] += 1
            if pending.local is not None:
                self._finish(pending, "device")
            return  # else the local result (or the deadline) decides
        self._finish(pending, "cloud")

    # -- keeping time --------------------------------------------------------------------------------
    def _deadline_loop(self) -> None:
        with self._lock:
            while True:
                if self._stopping.is_set() and not self._pending:
                    return
                now = time.perf_counter()
                while self._deadlines and self._deadlines[0][0] <= now:
                    due, request_id = heapq.heappop(self._deadlines)
                    pending = self._pending.get(request_id)
                    if pending is None or pending.done:
                        continue
                    pending.past_deadline = True
                    if pending.local is not None:
                        self._finish(pending, "device")
                    elif pending.reply is not None:  # a less accurate cloud answer beats none
                        self._finish(pending, "cloud")
                    elif pending.local_error is not None:
                        self._finish(pending, "device")
                wait = min(max(self._deadlines[0][0] - now if self._deadlines else 0.1, 0.0), 0.1)
                if not self._lock.wait(timeout=wait):  # timed out: how late did this thread get to run?
                    self.lateness_ms.append(max((time.perf_counter() - now - wait) * 1000.0, 0.0))

    def _finish(self, pending: _Pending, by: Literal["cloud", "device"]) -> None:
        """Answer ``pending`` (caller holds the lock); the one place a request is answered."""
        if pending.done:
            return
        pending.done = True
        latency = (time.perf_counter() - pending.start) * 1000.0
        del self._pending[pending.request_id]
        if by == "cloud":
            reply = pending.reply
            assert reply is not None
            answer = Answer(pending.request_id, reply.label, "cloud", reply.model, latency, pending.sla_ms,
                            latency <= pending.sla_ms, pending.policy, "ok", reply.budget_ms, reply.inference_ms,
                            reply.network_ms)
            self._answered_by_cloud.add(pending.request_id)
        elif pending.local is None:  # the local model could not take the input and the cloud did not answer
            self.counts["failed"] += 1
            pending.future.set_exception(ValueError(f"request {pending.request_id}: {pending.local_error}"))
            return
        else:
            answer = Answer(pending.request_id, pending.local, "device", self.local_model, latency, pending.sla_ms,
                            latency <= pending.sla_ms, pending.policy, pending.cloud, math.nan, pending.local_ms,
                            local_ready_ms=pending.local_at)
        self.counts[f"answered_by_{by}"] += 1
        if not answer.met_sla:
            self.counts["sla_missed"] += 1
        pending.future.set_result(answer)


__all__ = ["CLIENT_POLICIES", "Answer", "ServeClient"]
