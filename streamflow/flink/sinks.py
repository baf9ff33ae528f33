"""Where the Flink runner's rows go, chosen by a URI (``streamflow run --runner flink --sink URI``).

- ``duckdb:PATH`` (the default, ``--db``): every row to one DuckDB file, one writer (parallelism 1) on the
  machine that runs it: a local run's sink, as on the device.
- ``kafka:TOPIC``: the feature rows of the job's tasks (those not marked ``tunnel=False``) in the tunnel's own
  envelope (:mod:`connectors.tunnel`), written at the job's parallelism: subtask ``i`` is the tunnel device
  ``flink-<job>-<i>`` (its key from the key registry, as a device's), numbering its rows 0, 1, 2, ... so the
  cloud consumer (``streamflow tunnel consume``, or the Flink features job) stores each once by (device, seq),
  a device's envelopes in one partition, in order. Dead letters, task errors and the run's counts are few and
  stay in the local DuckDB file (as ``streamflow run --tunnel kafka`` keeps them on the device).
- ``parquet:DIR``: the rows of the job's shipped tasks (those not marked ``tunnel=False``) as Parquet files, one
  directory per table (``DIR/<table>/``), through Flink's ``FileSink`` (bulk format, ``ParquetBulkWriters``) at the
  job's parallelism, with the jars of :func:`streamflow.flink.connector_jars.parquet_jar_urls`. The writer needs
  each table's schema when the job is built, so every shipped task declares its ``columns``
  (:class:`streamflow.job.Task`); a job that has one without is refused before any JVM starts
  (:func:`parquet_tables`). Each row is made a row of the declared columns in order (:class:`ParquetColumns`);
  one that does not fit (a missing or extra key, a value of another type: an int widens to ``double`` when a
  double holds it exactly, nothing else converts) is a dead letter (``source`` ``parquet:<table>``, reason
  ``parquet: ...``) in the local DuckDB file, counted under ``rejected["parquet"]``. Dead letters, task errors and
  the run's counts stay in the local DuckDB file, as with ``kafka:``.

  Guarantees: a part file is written in progress (hidden: ``.part-<uuid>-<n>.parquet.inprogress.<uuid>``) and
  committed (renamed to ``part-<uuid>-<subtask>-<n>.parquet``) on a completed checkpoint, or when a bounded input
  ends (Flink 2.x's final flush, with or without ``--checkpoint-dir``); readers that skip hidden files see committed
  rows only. With checkpoints, a job restored from one rewrites nothing committed: the in-progress files of the
  failed attempt are left behind, hidden, and the rows after the checkpoint are written again into new part files,
  so the committed files hold every row exactly once. Without checkpoints a failed run commits nothing it had in
  progress; rerun it into an empty directory (a rerun into the same one adds a second copy).

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
    return SinkSpec(scheme, target)


def parquet_tables(job: Any) -> dict[str, dict[str, str]]:
    """The tables ``parquet:DIR`` writes: each shipped task's sink (``tunnel=True``) and its declared columns;
    ``ValueError`` naming the shipped tasks that declare none (checked before a JVM starts).

    Example:
        >>> from operators import Aggregate, Count
        >>> from streamflow.job import Job, Task
        >>> cols = {"user_id": "string", "trigger_ts": "double", "n": "bigint"}
        >>> parquet_tables(Job("j", [Task("a", ["item"], [Aggregate(n=Count())], columns=cols),
        ...                         Task("b", ["item"], [Aggregate(n=Count())], tunnel=False)]))
        {'a': {'user_id': 'string', 'trigger_ts': 'double', 'n': 'bigint'}}
        >>> parquet_tables(Job("j", [Task("b", ["item"], [Aggregate(n=Count())])]))
        Traceback (most recent call last):
        ...
        ValueError: parquet:DIR needs the output columns of every shipped task: task 'b' declares none; give it \
columns={...} (see streamflow.job.Task), or tunnel=False to keep its rows in the local DuckDB file
    """
    missing = [task.name for task in job.tasks if task.tunnel and task.columns is None]
    if missing:
        names = ", ".join(f"task {name!r}" for name in missing)
        one = len(missing) == 1
        raise ValueError(f"parquet:DIR needs the output columns of every shipped task: {names} "
                         f"declare{'s' if one else ''} none; give {'it' if one else 'them'} "
                         f"columns={{...}} (see streamflow.job.Task), or tunnel=False to keep its rows in the local "
                         f"DuckDB file")
    tables: dict[str, dict[str, str]] = {}
    for task in job.tasks:
        if not task.tunnel:
            continue
        if task.sink in tables and tables[task.sink] != task.columns:
            raise ValueError(f"parquet:DIR: tasks writing table {task.sink!r} declare different columns "
                             f"(task {task.name!r}: {task.columns})")
        tables[task.sink] = dict(task.columns or {})
    return tables


_INT64 = (-(2**63), 2**63 - 1)


class ParquetColumns:
    """A table's declared columns: :meth:`fit` makes a row dict the tuple of its values in column order, or
    says why it does not fit (no silent coercion: an int widens to ``double`` when a double holds it exactly;
    nothing else converts; ``None``
    is a null of any type).

    Example:
        >>> cols = ParquetColumns("t", {"user_id": "string", "n": "bigint", "x": "double", "ok": "boolean"})
        >>> cols.fit({"user_id": "u", "n": 3, "x": 2, "ok": True})
        (('u', 3, 2.0, True), None)
        >>> cols.fit({"user_id": "u", "n": "3", "x": 2.5, "ok": None})[1]
        "column 'n' is bigint; got str '3'"
        >>> cols.fit({"user_id": "u", "n": 3, "x": 2**53 + 1, "ok": None})[1]  # no double holds it exactly
        "column 'x' is double; got int 9007199254740993"
        >>> cols.fit({"user_id": "u", "n": 3, "x": 2.5})[1]
        "missing column 'ok'"
        >>> cols.fit({"user_id": "u", "n": 3, "x": 2.5, "ok": False, "y": 1})[1]
        "key 'y' is not a declared column"
    """

    def __init__(self, table: str, columns: dict[str, str]):
        self.table = table
        self.columns = dict(columns)
        self.names = list(columns)
        self.kinds = list(columns.values())

    def fit(self, row: dict[str, Any]) -> tuple[tuple[Any, ...] | None, str | None]:
        if not isinstance(row, dict):
            return None, f"row is a {type(row).__name__}, not a dict"
        values = []
        for name, kind in zip(self.names, self.kinds, strict=True):
            if name not in row:
                return None, f"missing column {name!r}"
            value = row[name]
            if value is not None:
                value, ok = _typed(kind, value)
                if not ok:
                    return None, f"column {name!r} is {kind}; got {type(row[name]).__name__} {row[name]!r:.80}"
            values.append(value)
        if len(row) != len(self.names):
            extra = [key for key in row if key not in self.columns]
            return None, f"key {extra[0]!r} is not a declared column"
        return tuple(values), None


def _typed(kind: str, value: Any) -> tuple[Any, bool]:
    if kind == "string":
        return value, isinstance(value, str)
    if kind == "boolean":
        return value, isinstance(value, bool)
    if isinstance(value, bool):
        return value, False
    if kind == "bigint":
        return value, isinstance(value, int) and _INT64[0] <= value <= _INT64[1]
    if isinstance(value, int):  # double: an int widens if a double holds it exactly (as the tunnel's strict.py)
        try:
            widened = float(value)
        except OverflowError:
            return value, False
        return widened, int(widened) == value
    return value, isinstance(value, float)


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
