"""Where the tunnel's broker is, and the topics it uses.

The code talks to any Kafka-protocol broker: ``STREAMFLOW_KAFKA_BOOTSTRAP`` (``host:port[,host:port]``)
names it, ``127.0.0.1:9092`` otherwise (the docker compose broker, or ``make broker-up``'s noida-db).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("streamflow.tunnel")

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_TOPIC = "streamflow.features"
#: Kafka record-batch codecs the sink offers (``none`` is for measuring what compression saves).
COMPRESSION = ("zstd", "gzip", "lz4", "none")
#: kafka-python settings for every client: give up on an unreachable broker within seconds (the sink's
#: spool and the consumer's retry loop wait for it), reconnect at least every second once it is back.
CLIENT_TIMEOUTS = {"bootstrap_timeout_ms": 3000, "reconnect_backoff_max_ms": 1000, "request_timeout_ms": 5000}
_known_topics: set[tuple[str, str]] = set()


def bootstrap_servers(bootstrap: str | None = None) -> str:
    """Explicit value first, then ``STREAMFLOW_KAFKA_BOOTSTRAP``, then ``127.0.0.1:9092``."""
    return bootstrap or os.environ.get("STREAMFLOW_KAFKA_BOOTSTRAP") or DEFAULT_BOOTSTRAP


def dead_letter_topic(topic: str) -> str:
    """The topic a consumer of ``topic`` sends refused messages to."""
    return f"{topic}.dlq"


def ensure_topic(bootstrap: str, topic: str, partitions: int = 4) -> None:
    """Create ``topic`` if the broker does not have it (once per process and topic)."""
    if (bootstrap, topic) in _known_topics:
        return
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="streamflow-admin", **CLIENT_TIMEOUTS)
    try:
        if topic not in admin.list_topics():
            try:
                admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
                log.info("created topic %s (%d partitions) on %s", topic, partitions, bootstrap)
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()
    _known_topics.add((bootstrap, topic))
