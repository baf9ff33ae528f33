"""Where the tunnel's broker is, and the topics it uses.

The code talks to any Kafka-protocol broker, named by the ``bootstrap`` its callers give
(``host:port[,host:port]``); a client given none uses :data:`DEFAULT_BOOTSTRAP`, Kafka's own ``127.0.0.1:9092``
(the docker compose broker, or ``make broker-up``'s noida-db). The CLI passes ``streamflow.settings``'
``kafka_bootstrap`` (``$STREAMFLOW_KAFKA_BOOTSTRAP``, then the same default).
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from typing import Literal, TypedDict

log = logging.getLogger("streamflow.tunnel")

DEFAULT_TOPIC = "streamflow.features"
#: The broker a tunnel client given no ``bootstrap`` talks to: Kafka's conventional local listener.
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
#: Kafka record-batch codecs the sink offers (``none`` is for measuring what compression saves).
COMPRESSION = ("zstd", "gzip", "lz4", "none")
#: A codec as kafka-python's ``compression_type`` names it (``None``: none).
KafkaCodec = Literal["zstd", "gzip", "lz4"] | None
KAFKA_CODECS: dict[str, KafkaCodec] = {"zstd": "zstd", "gzip": "gzip", "lz4": "lz4", "none": None}


class ClientTimeouts(TypedDict):
    bootstrap_timeout_ms: int
    reconnect_backoff_max_ms: int
    request_timeout_ms: int


#: kafka-python settings for every client: give up on an unreachable broker within seconds (the sink's
#: spool and the consumer's retry loop wait for it), reconnect at least every second once it is back.
CLIENT_TIMEOUTS: ClientTimeouts = {"bootstrap_timeout_ms": 3000, "reconnect_backoff_max_ms": 1000,
                                   "request_timeout_ms": 5000}
_known_topics: set[tuple[str, str]] = set()


class TunnelUnavailable(ConnectionError):
    """The broker did not answer within the retry budget; what was not delivered is kept (spool, topic)."""


def probe_broker(bootstrap: str, timeout_s: float = 3.0) -> str:
    """The first of ``bootstrap``'s ``HOST:PORT`` servers that answers Kafka's ApiVersions request within
    ``timeout_s``; ``ConnectionError`` naming each server's failure when none does (a client would retry on).

    >>> probe_broker("127.0.0.1:1", timeout_s=1)
    Traceback (most recent call last):
    ...
    ConnectionError: 127.0.0.1:1: Connection refused
    """
    reasons = []
    for server in filter(None, (part.strip() for part in bootstrap.split(","))):
        try:
            _api_versions(server, timeout_s)
            return server
        except (OSError, ValueError) as exc:
            reasons.append(f"{server}: {getattr(exc, 'strerror', None) or exc}")
    raise ConnectionError("; ".join(reasons) or f"no broker in {bootstrap!r}")


def _api_versions(server: str, timeout_s: float) -> None:
    """Send ApiVersions (v0: every broker answers it, before any authentication) and check the answer's id."""
    host, _, port = server.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not HOST:PORT: {server!r}")
    client = b"streamflow-probe"
    request = struct.pack(">hhih", 18, 0, 0x5F10, len(client)) + client
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as conn:
        conn.settimeout(timeout_s)
        conn.sendall(struct.pack(">i", len(request)) + request)
        head = b""
        while len(head) < 8:  # the response's size and correlation id
            chunk = conn.recv(8 - len(head))
            if not chunk:
                raise ValueError("closed the connection: not a Kafka broker")
            head += chunk
    if struct.unpack(">i", head[4:])[0] != 0x5F10:
        raise ValueError("answered, but not as a Kafka broker")


class Retry:
    """Bounded exponential backoff with a give-up budget, for a loop that talks to the broker.

    :meth:`failed` returns how long to wait before the next attempt (``first_s``, doubling, at most
    ``max_s``) and raises :class:`TunnelUnavailable` once failures have lasted ``give_up_after_s``
    without a success in between (``None``: never give up); :meth:`succeeded` resets both. ``max_s`` is
    1 s by default, as Kafka's own clients cap theirs (``reconnect.backoff.max.ms``): a broker back after an
    outage is found within a second.

    Example:
        >>> retry = Retry("sending to 127.0.0.1:9", first_s=0.1, max_s=0.3, give_up_after_s=60)
        >>> [retry.failed(OSError("refused")) for _ in range(4)]
        [0.1, 0.2, 0.3, 0.3]
        >>> retry.succeeded(); retry.failed(OSError("refused"))
        0.1
        >>> Retry("sending", give_up_after_s=0).failed(OSError("refused"))
        Traceback (most recent call last):
        ...
        connectors.tunnel.kafka.TunnelUnavailable: sending: failed 1 times over 0 s, giving up; last error: refused
    """

    def __init__(self, what: str, first_s: float = 0.1, max_s: float = 1.0, give_up_after_s: float | None = 300.0):
        self.what = what
        self.first_s = first_s
        self.max_s = max_s
        self.give_up_after_s = give_up_after_s
        self.failures = 0
        self._since = 0.0

    def failed(self, exc: BaseException) -> float:
        """Count a failure: the delay before the next attempt, or :class:`TunnelUnavailable` past the budget."""
        now = time.monotonic()
        if not self.failures:
            self._since = now
        self.failures += 1
        failing_for = now - self._since
        if self.give_up_after_s is not None and failing_for >= self.give_up_after_s:
            raise TunnelUnavailable(f"{self.what}: failed {self.failures} times over {failing_for:.0f} s, "
                                    f"giving up; last error: {exc}")
        return min(self.max_s, self.first_s * 2 ** min(self.failures - 1, 30))

    def succeeded(self) -> None:
        self.failures = 0


def dead_letter_topic(topic: str) -> str:
    """The topic a consumer of ``topic`` sends refused messages to."""
    return f"{topic}.dlq"


def ensure_topic(bootstrap: str, topic: str, partitions: int = 4, config: dict[str, str] | None = None) -> None:
    """Create ``topic`` (with the topic ``config``) if the broker does not have it (once per process and topic)."""
    if (bootstrap, topic) in _known_topics:
        return
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="streamflow-admin", **CLIENT_TIMEOUTS)
    try:
        if topic not in admin.list_topics():
            try:
                admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1,
                                              topic_configs=config or {})])
                log.info("created topic %s (%d partitions) on %s", topic, partitions, bootstrap)
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()
    _known_topics.add((bootstrap, topic))
