"""Where the Flink runner's rows go, chosen by a URI (``streamflow run --runner flink --sink URI``).

- ``duckdb:PATH`` (the default, ``--db``): every row to one DuckDB file, one writer (parallelism 1) on the
  machine that runs it: a local run's sink, as on the device.
- ``kafka:TOPIC``: the feature rows of the job's tasks (those not marked ``tunnel=False``) in the tunnel's own
  envelope (:mod:`connectors.tunnel`), written at the job's parallelism: subtask ``i`` is the tunnel device
  ``flink-<job>-<i>`` (its key from the key registry, as a device's), numbering its rows 0, 1, 2, ... so the
  cloud consumer (``streamflow tunnel consume``, or the Flink features job) stores each once by (device, seq),
  a device's envelopes in one partition, in order. Dead letters, task errors and the run's counts are few and
  stay in the local DuckDB file (as ``streamflow run --tunnel kafka`` keeps them on the device).
- ``parquet:DIR``: not built yet. The jars are there: ``flink-sql-parquet`` and Hadoop's shaded client, fetched and
  verified by :func:`streamflow.flink.connector_jars.fetch_parquet`, load in PyFlink 2.3, and PyFlink's
  ``FileSink.for_bulk_format`` with ``ParquetBulkWriters.for_row_type`` writes part files committed on checkpoints,
  exactly once across a failure (``tests/flink/test_flink_parquet_jars.py``). What is missing is each table's
  schema: that writer takes a fixed ``RowType`` when the job graph is built, and a task declares no output
  columns or types (its rows are whatever its ``Map``/``Aggregate`` steps return, known only when they run).

What ``kafka:`` does not give yet: exactly-once across a TaskManager's loss. A subtask's sequence numbers live in
its spool on the TaskManager's disk (``<db>.tunnel-spool/``), not in Flink's checkpoints, so rows replayed after a
restore are sent under new numbers. A rerun over the same input ships the rows again, as a device's rerun does.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from connectors.tunnel.keys import KeyRegistry
from streamflow.settings import settings

#: The schemes ``--sink`` takes.
SCHEMES = ("duckdb", "kafka", "parquet")


@dataclass(frozen=True)
class SinkSpec:
    """A parsed ``--sink``: ``scheme`` and its ``target`` (a path, a topic)."""

    scheme: str
    target: str


def parse_sink(uri: str | None) -> SinkSpec | None:
    """``--sink``'s URI as a :class:`SinkSpec` (``None``: none given, the DuckDB file ``--db``).

    Example:
        >>> parse_sink("kafka:streamflow.features"), parse_sink("duckdb:out/f.duckdb").target, parse_sink(None)
        (SinkSpec(scheme='kafka', target='streamflow.features'), 'out/f.duckdb', None)
        >>> parse_sink("s3:bucket")
        Traceback (most recent call last):
        ...
        ValueError: unknown sink 's3:bucket': expected duckdb:PATH, kafka:TOPIC or parquet:DIR
    """
    if uri is None:
        return None
    scheme, _, target = uri.partition(":")
    if scheme not in SCHEMES or not target:
        raise ValueError(f"unknown sink {uri!r}: expected duckdb:PATH, kafka:TOPIC or parquet:DIR")
    if scheme == "parquet":
        raise ValueError("parquet:DIR is not built yet (issue 29): Flink's Parquet FileSink needs each table's "
                         "columns and types when the job is built, and tasks do not declare them; use "
                         "kafka:TOPIC on a cluster, or duckdb:PATH locally")
    return SinkSpec(scheme, target)


def flink_devices(job_name: str, parallelism: int) -> list[str]:
    """The tunnel device ids of a job's Kafka sink, one per subtask.

    Example:
        >>> flink_devices("ipv encoder", 2)
        ['flink-ipv_encoder-0', 'flink-ipv_encoder-1']
    """
    slug = re.sub(r"[^A-Za-z0-9_.@-]", "_", job_name)[:100]
    return [f"flink-{slug}-{i}" for i in range(parallelism)]


def device_keys(devices: list[str], registry: str | os.PathLike[str] | None = None) -> dict[str, bytes]:
    """Each device's key from the key registry (``$STREAMFLOW_KEY_REGISTRY``, default ``.streamflow/keys.json``);
    ``ValueError`` naming the command that adds the missing ones."""
    keys = KeyRegistry(settings(key_registry=registry).key_registry)
    found = {device: keys.key_for(device) for device in devices}
    missing = [device for device, key in found.items() if key is None]
    if missing:
        adds = "; ".join(f"streamflow tunnel keys add {device}" for device in missing)
        raise ValueError(f"the Kafka sink's devices have no key in {keys.path}: run {adds} "
                         f"(and give the cloud the same registry)")
    return {device: key for device, key in found.items() if key is not None}


class TunnelShipper:
    """One subtask's share of the Kafka sink: a :class:`~connectors.tunnel.sink.TunnelSink` of its own device.
    Used by the runner's ``ShipRows`` operator (kept free of PyFlink here)."""

    def __init__(self, keys: dict[str, bytes], topic: str, bootstrap: str, spool_dir: str):
        self.keys = keys
        self.devices = sorted(keys, key=lambda device: int(device.rsplit("-", 1)[1]))
        self.topic = topic
        self.bootstrap = bootstrap
        self.spool_dir = spool_dir
        self.sink: Any = None

    def open(self, subtask: int) -> None:
        from connectors.tunnel.sink import TunnelSink

        device = self.devices[subtask]
        Path(self.spool_dir).mkdir(parents=True, exist_ok=True)
        # No receipts: a subtask ends with its job, and the broker's acknowledgement (acks=all) is what it waits for.
        self.sink = TunnelSink(device, self.keys[device], Path(self.spool_dir) / f"{device}.spool", topic=self.topic,
                               bootstrap=self.bootstrap, receipts=False)

    def write(self, table: str, rows: list[dict[str, Any]]) -> None:
        self.sink.write(table, rows)

    def close(self, timeout_s: float = 60.0) -> None:
        if self.sink is None:
            return
        delivered = self.sink.close(timeout_s=timeout_s)
        if not delivered:
            raise RuntimeError(f"Kafka sink {self.sink.device}: {self.sink.spool.rows_pending} rows not acknowledged "
                               f"by the broker within {timeout_s:.0f} s (kept in {self.sink.spool.path})")
