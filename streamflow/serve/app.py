"""The cloud side of serving: a faust-streaming worker that answers signed requests with a zoo model chosen
by MDInference's policy.

- an **agent** over the request topic (``serve.requests``, one partition: the profiles below are one state)
  verifies each request, asks the policy (:mod:`streamflow.serve.policy`; ``rule`` ``"expected"`` by default,
  ``"paper"`` for the paper's fit test) for a model — its budget counts from the time the device still waits
  when the request leaves (``window_ms``) rather than the whole SLA, less the time the request has already
  waited in this worker (MDInference assumes an idle server; this one measures its queue), and a request the
  policy would not run a model for (:meth:`~streamflow.serve.policy.MDInference.worth_running`: no budget
  left, or too small a chance of arriving in time) is answered ``expired`` — runs it on our
  engine (in a thread, so the event loop keeps fetching and heartbeating), and sends a signed reply to
  ``serve.replies`` keyed by the device, on the device's partition
  (:func:`~streamflow.serve.messages.reply_partition`);
- a **Faust table** ``serve-profiles`` holds each model's EWMA latency profile (mean and variance, seeded
  from the zoo's measured profile), changelogged to the broker, so a restarted worker resumes with them;
  a second table ``serve-counters`` counts what was served (and how much of it left within the device's wait),
  expired and dead-lettered; with ``metrics_port`` they are Prometheus metrics (:mod:`streamflow.metrics.serve`);
- a request that does not verify or parse goes whole to ``serve.requests.dlq`` with its reason in the
  headers and is counted (``dead_letter.<reason>``); a request whose wait had already passed when the worker
  got to it (after an outage, say; judged by the device's clock at sending against the worker's, so the two
  are assumed NTP-close) is answered ``expired`` without running a model, so the worker catches
  up with a backlog at once instead of spending its models on answers nobody waits for;
- consumed requests and replies older than ``reply_retention_s`` are deleted from the broker (DeleteRecords):
  serving data is worthless after its deadline and the log must not grow without end.

Start it with ``streamflow serve`` or ``faust -A streamflow.serve.app worker --without-web``; the broker,
the key registry, the zoo and the policy's knobs come from :mod:`streamflow.settings`. The web server is off
(``web_port`` turns it on, bound to 127.0.0.1). A model missing from the zoo stops the start with a
:class:`~streamflow.serve.zoo.ZooError` naming it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamflow.serve.fetch_pause import pausing_transport
from streamflow.serve.messages import (
    MAX_DETAIL,
    MAX_TEXT_FIELD,
    REPLY_PARTITIONS,
    REPLY_TOPIC,
    REQUEST_TOPIC,
    MessageError,
    Reply,
    Request,
    decode_request,
    encode_reply,
    reply_partition,
    short,
)
from streamflow.serve.policy import POLICIES, Choice, MDInference, Profile, RuleName

if TYPE_CHECKING:
    import faust

    from streamflow.serve.zoo import Zoo, ZooModel

log = logging.getLogger("streamflow.serve")

DEAD_LETTER_TOPIC = REQUEST_TOPIC + ".dlq"
PROFILES_TABLE = "serve-profiles"
COUNTERS_TABLE = "serve-counters"
#: How often ``run_worker`` checks that the broker answers.
BROKER_WATCH_S = 5.0


@dataclass(frozen=True)
class ServeConfig:
    """Everything the worker needs; :meth:`from_settings` fills it from :mod:`streamflow.settings`."""

    bootstrap: str
    app_id: str = "streamflow-serve"
    zoo_path: Path | None = None
    models: tuple[str, ...] | None = None  # None: every model of the zoo
    temperature: float = 0.002
    alpha: float = 0.2
    explore: float = 0.02
    rule: RuleName = "expected"  # MDInference's model-choice rule: "expected" or "paper" (streamflow.serve.policy)
    seed: int = 0
    key_registry: Path | None = None
    skip_expired: bool = True
    reply_retention_s: float = 30.0
    cleanup_every_s: float = 5.0
    web_port: int | None = None  # None: no web server
    metrics_port: int | None = None  # Prometheus /metrics, /healthz, /readyz on faust's web server there; None: off
    warm_up: bool = True
    empty_fetch_pause_ms: float = 2.0  # see streamflow.serve.fetch_pause; 0: off

    @classmethod
    def from_settings(cls, **overrides: Any) -> ServeConfig:
        from streamflow.settings import settings

        s = settings()
        names = tuple(n.strip() for n in s.serve_models.split(",") if n.strip()) if s.serve_models else None
        values: dict[str, Any] = {
            "bootstrap": s.kafka_bootstrap, "app_id": s.serve_app_id, "zoo_path": s.zoo_dir / "zoo.json",
            "models": names, "temperature": s.serve_temperature, "alpha": s.serve_alpha,
            "rule": s.serve_rule, "key_registry": s.key_registry,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass
class Server:
    """The worker's state outside faust: the models, the policy, the keys, what to clean up on the broker."""

    config: ServeConfig
    zoo: Zoo
    models: list[ZooModel]
    policy: MDInference
    rng: random.Random
    registry: Any
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "serve-model"))
    admin_executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "serve-admin"))
    consumed: dict[int, int] = field(default_factory=dict)  # request partition → next offset to delete up to
    replies_sent: collections.deque = field(default_factory=collections.deque)  # (monotonic, partition, offset)

    def initial_profile(self, name: str) -> Profile:
        m = self.zoo.get(name)
        return Profile(m.latency_mean_ms, m.latency_std_ms**2, 0)

    @property
    def largest(self) -> str:
        """The static baseline's model: the most work per image (:attr:`ZooModel.compute`: input pixels ×
        rotations); among equals, the most accurate."""
        return max(self.models, key=lambda m: (m.compute, m.accuracy)).name

    def choose(self, request: Request, profiles: dict[str, Profile], queued_ms: float = 0.0) -> Choice:
        """The policy's choice for ``request``, which has waited ``queued_ms`` in this worker already."""
        wait = request.wait_ms - queued_ms
        if request.policy == "largest":
            return self.policy.static(self.largest, wait, request.upload_ms)
        return self.policy.choose(self.models, profiles, wait, request.upload_ms, self.rng,
                                  upload_std_ms=request.upload_std_ms, local_accuracy=request.local_accuracy)

    def run_model(self, name: str, request: Request) -> tuple[int, float]:
        predict = self.zoo.predictor(name)
        start = time.perf_counter()
        label = predict(request.image)
        return label, (time.perf_counter() - start) * 1000.0


def load_server(config: ServeConfig) -> Server:
    """Open the zoo and the served models (:class:`ZooError` for a missing one), warm them up."""
    from connectors.tunnel.keys import KeyRegistry
    from streamflow.serve.zoo import Zoo
    from streamflow.settings import settings

    zoo = Zoo.load(config.zoo_path)
    models = [zoo.get(name) for name in config.models] if config.models else list(zoo.models)
    if config.warm_up:
        zoo.warm_up([m.name for m in models])
    return Server(config, zoo, models, MDInference(config.temperature, config.alpha, config.explore,
                                                          rule=config.rule),
                  random.Random(config.seed),
                  KeyRegistry(settings(key_registry=config.key_registry).key_registry))


def faust_broker(bootstrap: str) -> list[str]:
    """``host:port[,host:port]`` as faust's broker URLs."""
    return [f"kafka://{part.strip()}" for part in bootstrap.split(",") if part.strip()]


def create_app(config: ServeConfig, server: Server | None = None) -> faust.App:
    """The faust app: topics, tables, the serving agent and the clean-up timer."""
    import faust

    server = server or load_server(config)
    if config.metrics_port is not None and config.web_port not in (None, config.metrics_port):
        raise ValueError("the metrics are served on faust's web server: give --web-port and --metrics-port the same "
                         "port, or only one of them")
    port = config.metrics_port if config.metrics_port is not None else config.web_port
    web: dict[str, Any] = {"web_enabled": port is not None, "web_bind": "127.0.0.1", "web_host": "127.0.0.1"}
    if port is not None:
        web["web_port"] = port
    app = faust.App(
        config.app_id, broker=faust_broker(config.bootstrap), store="memory://", topic_partitions=1,
        datadir=Path(tempfile.gettempdir()) / f"streamflow-serve-{config.app_id}",
        producer_linger=0.0, consumer_auto_offset_reset="earliest", **web)
    if config.empty_fetch_pause_ms > 0:  # before the first topic: it builds the app's transport
        app.transport = pausing_transport(config.empty_fetch_pause_ms)(app.conf.broker_consumer, app)
    raw: dict[str, Any] = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
    requests = app.topic(REQUEST_TOPIC, partitions=1, **raw)
    replies = app.topic(REPLY_TOPIC, partitions=REPLY_PARTITIONS, **raw)
    dead_letters = app.topic(DEAD_LETTER_TOPIC, partitions=1, **raw)
    profiles = app.Table(PROFILES_TABLE, default=None, partitions=1)
    counters = app.Table(COUNTERS_TABLE, default=int, partitions=1)
    loop_executor = server.executor
    metrics = None
    if config.metrics_port is not None:
        from streamflow.metrics.serve import wire

        metrics = wire(app, counters, config.metrics_port)

    def count(name: str) -> None:
        counters[name] += 1

    async def dead_letter(event: Any, exc: MessageError) -> None:
        count(f"dead_letter.{exc.reason}")
        log.warning("request at %s[%d]@%d dead-lettered: %s", event.message.topic, event.message.partition,
                    event.message.offset, exc)
        headers = {"reason": exc.reason.encode()[:MAX_TEXT_FIELD], "detail": str(exc).encode()[:MAX_DETAIL]}
        try:
            await dead_letters.send(key=event.key, value=event.value, headers=headers)
        except Exception as failed:  # noqa: BLE001 - a dead letter lost is counted; the agent must go on serving
            count("dead_letter.send_failed")
            log.error("request at %s[%d]@%d: its dead letter could not be sent: %s", event.message.topic,
                      event.message.partition, event.message.offset, short(failed))

    async def reply(request: Request, answer: Reply) -> None:
        key = server.registry.key_for(request.device)
        if key is None:  # removed from the registry since its request was verified: nobody to sign for
            count("error.device_removed")
            return
        partition = reply_partition(request.device)
        sent = await replies.send(key=request.device.encode(), value=encode_reply(answer, key), partition=partition)
        if metrics is not None:
            metrics.replied(request.sent_ms, answer.inference_ms, answer.model)

        def delivered(f: asyncio.Future[Any]) -> None:
            if not f.exception():
                server.replies_sent.append((time.monotonic(), f.result().topic_partition.partition, f.result().offset))

        asyncio.ensure_future(sent).add_done_callback(delivered)  # (faust's send gives a Future: handed back as is)

    async def handle(event: Any) -> None:
        server.consumed[event.message.partition] = event.message.offset + 1
        try:
            request = decode_request(event.value, server.registry)
        except MessageError as exc:
            await dead_letter(event, exc)
            return
        base: dict[str, Any] = {"device": request.device, "request_id": request.request_id}
        if request.policy not in POLICIES:
            count("error.policy")
            await reply(request, Reply(**base, status="error", detail=f"unknown policy {request.policy!r}"))
            return
        if config.skip_expired and time.time() * 1000.0 - request.sent_ms > request.wait_ms:
            count("expired")
            await reply(request, Reply(**base, status="expired", detail="the SLA had passed when the worker got it"))
            return
        current = {m.name: Profile.from_dict(stored) if (stored := profiles.get(m.name)) else
                   server.initial_profile(m.name) for m in server.models}
        arrived = getattr(event.message, "time_in", None)  # set by faust's monitor when the consumer got it
        queued_ms = max(time.monotonic() - arrived, 0.0) * 1000.0 if arrived is not None else 0.0
        choice = server.choose(request, current, queued_ms)
        if config.skip_expired and not server.policy.worth_running(choice):  # the reply would not be in time
            count("expired")
            await reply(request, Reply(**base, status="expired", budget_ms=choice.budget_ms,
                                       network_ms=choice.network_ms, detail="no time left for a model"))
            return
        try:
            label, inference_ms = await asyncio.get_running_loop().run_in_executor(
                loop_executor, server.run_model, choice.model, request)
        except ValueError as exc:  # an image the model cannot take
            count("error.model")
            await reply(request, Reply(**base, status="error", model=choice.model, detail=str(exc)))
            return
        profiles[choice.model] = server.policy.update(current[choice.model], inference_ms).to_dict()
        count("served")
        count(f"model.{choice.model}")
        if time.time() * 1000.0 <= request.sent_ms + request.wait_ms:  # the answer leaves within the device's wait
            count("in_time")
        await reply(request, Reply(**base, status="ok", model=choice.model, label=label, budget_ms=choice.budget_ms,
                                   network_ms=choice.network_ms, inference_ms=inference_ms,
                                   candidates=choice.candidates))

    @app.agent(requests, name="serve")
    async def serve(stream: Any) -> None:
        async for event in stream.events():
            await handle(event)

    @app.timer(interval=config.cleanup_every_s)
    async def delete_old_records() -> None:
        await asyncio.get_running_loop().run_in_executor(server.admin_executor, _delete_old_records, server)

    app.serve_state = server  # type: ignore[attr-defined]  # for tests and the CLI
    return app


def _delete_old_records(server: Server) -> None:
    """Delete answered requests and replies older than the retention from the broker."""
    from kafka import TopicPartition
    from kafka.admin import KafkaAdminClient

    from connectors.tunnel.kafka import CLIENT_TIMEOUTS

    cutoff = time.monotonic() - server.config.reply_retention_s
    upto: dict[TopicPartition, int] = {TopicPartition(REQUEST_TOPIC, p): o for p, o in server.consumed.items()}
    while server.replies_sent and server.replies_sent[0][0] < cutoff:
        _, partition, offset = server.replies_sent.popleft()
        upto[TopicPartition(REPLY_TOPIC, partition)] = offset + 1
    if not upto:
        return
    try:
        admin = KafkaAdminClient(bootstrap_servers=server.config.bootstrap, client_id="streamflow-serve-admin",
                                 **CLIENT_TIMEOUTS)
        try:
            admin.delete_records(upto)
        finally:
            admin.close()
    except Exception as exc:  # the broker may be away; the next round deletes up to a later offset
        log.info("could not delete old serving records (%s); trying again later", exc)


def run_worker(config: ServeConfig, loglevel: str = "warning", give_up_s: float | None = None) -> None:
    """Run the worker in this process until it is stopped (SIGINT/SIGTERM), or until the broker has not answered
    for ``give_up_s`` (default ``STREAMFLOW_CONSUMER_RETRY_S``, 300 s): then it says so and exits with status 1.

    Faust's Kafka client retries a lost broker forever, logging each failed connection at ERROR (tens of lines a
    second), and a worker told to stop waits for the broker to commit. So below ``info`` its log is quieted and
    a thread probes the broker every :data:`BROKER_WATCH_S` seconds instead, saying once per probe that it is
    away and for how much longer the worker waits."""
    import faust

    from streamflow.settings import settings

    app = create_app(config)
    if loglevel not in ("debug", "info"):
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    give_up_s = settings().consumer_retry_s if give_up_s is None else give_up_s
    threading.Thread(target=_watch_broker, args=(config.bootstrap, give_up_s), name="serve-broker-watch",
                     daemon=True).start()
    faust.Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False).execute_from_commandline()


def _watch_broker(bootstrap: str, give_up_s: float) -> None:
    """Probe the broker every :data:`BROKER_WATCH_S`; after ``give_up_s`` of failures, end the process (status 1)."""
    from connectors.tunnel.kafka import probe_broker

    away_since = None
    while True:
        time.sleep(BROKER_WATCH_S)
        try:
            probe_broker(bootstrap)
        except ConnectionError as exc:
            now = time.monotonic()
            away_since = now if away_since is None else away_since
            if now - away_since >= give_up_s:
                print(f"streamflow: error: the broker at {bootstrap} did not answer for {now - away_since:.0f} s "
                      f"({exc}); the serving worker stops", file=sys.stderr, flush=True)
                os._exit(1)  # a graceful stop would wait for the broker to commit
            log.warning("the broker at %s does not answer (%s); the worker gives up in %.0f s", bootstrap, exc,
                        give_up_s - (now - away_since))
            continue
        if away_since is not None:
            log.warning("the broker at %s answers again", bootstrap)
        away_since = None


def served_models(config: ServeConfig) -> Sequence[str]:
    """The names the worker would serve (checks them against the zoo without loading any model)."""
    from streamflow.serve.zoo import Zoo

    zoo = Zoo.load(config.zoo_path)
    return [zoo.get(n).name for n in config.models] if config.models else zoo.names


app: faust.App  # (not set at import: the module's __getattr__ builds it)


def __getattr__(name: str) -> Any:
    # `faust -A streamflow.serve.app worker` looks up `app` here: built on first use, from the settings.
    if name == "app":
        global app
        app = create_app(ServeConfig.from_settings())
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ServeConfig", "Server", "create_app", "load_server", "run_worker", "served_models"]
