"""Kafka topics as bounded Flink streams: the connector jars on the job, and two ways to read a topic.

Both read from the earliest offset up to the offsets that are the latest when the job starts, so a job
over a topic ends like a job over a file (``set_bounded(KafkaOffsetsInitializer.latest())``).

- :func:`kafka_lines`: the DataStream ``KafkaSource`` with a value-only deserializer; each record's value
  is one text line (raw events for the Flink runner).
- :func:`kafka_records`: ``(topic, partition, offset, key, value)`` per record, key and value as raw
  bytes. PyFlink has a byte-array schema (``ByteArraySchema``, which :func:`kafka_source` uses), but a
  value-only deserializer forgets where a record came from, and a ``KafkaSource`` takes only Java
  deserialization schemas (a Python one cannot run inside the Java reader); the connector has no Java
  schema that keeps the metadata with a binary value (``JSONKeyValueDeserializationSchema`` parses the
  value as JSON). The connector's table source does: a ``kafka`` table with ``topic``, ``partition``
  and ``offset`` metadata columns and the ``raw`` format for key and value (``BYTES``, untouched),
  turned into a DataStream of ``Row``s. Dead letters then name the record they came from.

Example (starts a JVM, so not run as a doctest)::

    env = flink_environment(parallelism=2)
    add_kafka_jars(env)
    records = kafka_records(env, "streamflow.features", "127.0.0.1:9092", "my-group")
"""

from __future__ import annotations

import re
import uuid
from urllib.parse import urlparse

from pyflink.common import WatermarkStrategy
from pyflink.common.serialization import ByteArraySchema, DeserializationSchema, SimpleStringSchema
from pyflink.datastream import DataStream, StreamExecutionEnvironment
from pyflink.datastream.connectors.kafka import KafkaOffsetsInitializer, KafkaSource
from pyflink.java_gateway import get_gateway

from streamflow.flink.connector_jars import kafka_jar_urls, kafka_topic
from streamflow.settings import settings

__all__ = ["add_kafka_jars", "kafka_lines", "kafka_records", "kafka_source", "kafka_topic"]


def add_kafka_jars(env: StreamExecutionEnvironment) -> list[str]:
    """Put the verified connector jars on ``env``'s job (once); returns their URLs.

    ``env.add_jars`` does both things needed: it adds the jars to this client's class loader (the
    builders below are Java objects made through the gateway, and the table planner finds the
    ``kafka`` factory there) and to ``pipeline.jars`` of the environment's own configuration, which
    the MiniCluster loads and a remote cluster receives with the job graph (``remote_environment``
    builds a plain Java environment around the same kind of configuration).
    """
    urls = kafka_jar_urls()
    jars_key = get_gateway().jvm.org.apache.flink.configuration.PipelineOptions.JARS.key()
    config = get_gateway().jvm.org.apache.flink.python.util.PythonConfigUtil.getEnvironmentConfig(
        env._j_stream_execution_environment)
    # pipeline.jars may hold a jar as file:/x or file:///x (the table environment rewrites it): compare paths
    present = {urlparse(url.strip(" '[]")).path for url in re.split(r"[;,]", config.getString(jars_key, None) or "")}
    missing = [url for url in urls if urlparse(url).path not in present]
    if missing:
        env.add_jars(*missing)
    return urls


def kafka_source(topic: str, bootstrap: str | None = None, group_id: str | None = None,
                 deserializer: DeserializationSchema | None = None) -> KafkaSource:
    """A bounded ``KafkaSource`` of ``topic``'s record values: earliest offsets to the latest at job start.

    ``deserializer`` defaults to :class:`ByteArraySchema` (values as ``bytes`` in Python); pass
    ``SimpleStringSchema()`` for UTF-8 text. The group id only names the consumer (no offsets are
    committed without checkpoints); default: a fresh ``streamflow-<uuid>``. ``bootstrap``: the broker (default:
    the settings' ``kafka_bootstrap``, :mod:`streamflow.settings`), as for :func:`kafka_records`.
    """
    return (KafkaSource.builder()
            .set_bootstrap_servers(settings(kafka_bootstrap=bootstrap).kafka_bootstrap)
            .set_topics(topic)
            .set_group_id(group_id or f"streamflow-{uuid.uuid4().hex[:12]}")
            .set_starting_offsets(KafkaOffsetsInitializer.earliest())
            .set_bounded(KafkaOffsetsInitializer.latest())
            .set_value_only_deserializer(deserializer or ByteArraySchema())
            .build())


def kafka_lines(env: StreamExecutionEnvironment, topic: str, bootstrap: str | None = None,
                group_id: str | None = None, charset: str = "UTF-8") -> DataStream:
    """One text line per record value (decoded from ``charset``), read by one reader (parallelism 1): with one
    partition, in offset order, like the lines of a file; with several, partitions interleave."""
    add_kafka_jars(env)
    return env.from_source(kafka_source(topic, bootstrap, group_id, SimpleStringSchema(charset)),
                           WatermarkStrategy.no_watermarks(), f"kafka {topic}").set_parallelism(1)


def kafka_records(env: StreamExecutionEnvironment, topic: str, bootstrap: str | None = None,
                  group_id: str | None = None, start_offsets: dict[int, int] | None = None) -> DataStream:
    """``Row(topic, partition, offset, key, value)`` per record of ``topic`` (key and value: ``bytes`` or
    None), up to the latest offsets at job start; read at the environment's parallelism, each partition
    by one reader in offset order.

    ``start_offsets`` (partition -> first offset to read) resumes where an earlier run stopped; other
    partitions start at the group's committed offset, else the earliest (the connector's
    ``specific-offsets`` mode).
    """
    from pyflink.table import StreamTableEnvironment  # the table planner: loaded only when needed

    add_kafka_jars(env)
    t_env = StreamTableEnvironment.create(env)
    table = f"kafka_{uuid.uuid4().hex}"

    def quoted(text: str) -> str:
        return "'" + text.replace("'", "''") + "'"

    if start_offsets:
        specific = ";".join(f"partition:{int(p)},offset:{int(o)}" for p, o in sorted(start_offsets.items()))
        startup = f"'scan.startup.mode' = 'specific-offsets', 'scan.startup.specific-offsets' = '{specific}'"
    else:
        startup = "'scan.startup.mode' = 'earliest-offset'"
    t_env.execute_sql(f"""
        CREATE TEMPORARY TABLE {table} (
            `topic` STRING METADATA VIRTUAL,
            `partition` INT METADATA VIRTUAL,
            `offset` BIGINT METADATA VIRTUAL,
            `key` BYTES,
            `value` BYTES
        ) WITH (
            'connector' = 'kafka',
            'topic' = {quoted(topic)},
            'properties.bootstrap.servers' = {quoted(settings(kafka_bootstrap=bootstrap).kafka_bootstrap)},
            'properties.group.id' = {quoted(group_id or f"streamflow-{uuid.uuid4().hex[:12]}")},
            {startup},
            'scan.bounded.mode' = 'latest-offset',
            'key.format' = 'raw',
            'key.fields' = 'key',
            'value.format' = 'raw',
            'value.fields-include' = 'EXCEPT_KEY'
        )""")
    return t_env.to_data_stream(t_env.from_path(table))
