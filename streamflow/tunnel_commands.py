"""The tunnel's command-line parts (the commands themselves are declared in :mod:`streamflow.cli`):
``run --tunnel kafka`` and ``streamflow tunnel keys|consume``.

    streamflow tunnel keys add DEVICE | list | remove DEVICE     the per-device HMAC key registry
    streamflow tunnel consume --db CLOUD.duckdb [--idle-timeout S]  the cloud consumer group
    streamflow tunnel consume --db CLOUD.duckdb --runner flink      the same topic read by a Flink job
"""

from __future__ import annotations

import json
import logging
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from connectors.json_values import to_json
from connectors.storage import DEAD_LETTER_TABLE, CollectiveStorage
from connectors.tunnel.kafka import COMPRESSION, DEFAULT_TOPIC, TunnelUnavailable
from connectors.tunnel.keys import KeyRegistry, check_device_id
from streamflow.prerequisites import require_broker, require_extra, require_flink
from streamflow.settings import env_name, settings

TUNNELS = ("none", "kafka")
__all__ = ["COMPRESSION", "DEFAULT_TOPIC", "TUNNELS", "TunnelOptions", "check_tunnel", "close_tunnel", "consume",
           "key_registry", "keys", "open_tunnel", "quiet_kafka_logs"]


def default_device_id() -> str:
    """``$STREAMFLOW_DEVICE_ID``, else this machine's host name (made a valid device id)."""
    return settings().device_id or re.sub(r"[^A-Za-z0-9_.:@-]", "-", socket.gethostname())[:128]


def key_registry(path: str | None = None) -> KeyRegistry:
    """The device key registry at ``path``, else ``$STREAMFLOW_KEY_REGISTRY``, else the default
    (:mod:`streamflow.settings`)."""
    return KeyRegistry(settings(key_registry=path).key_registry)


@dataclass(frozen=True)
class TunnelOptions:
    """``streamflow run``'s tunnel options.

    Example:
        >>> TunnelOptions().tunnel
        'none'
    """

    tunnel: Literal["none", "kafka"] = "none"
    device_id: str | None = None
    key_registry: str | None = None
    topic: str = DEFAULT_TOPIC
    compression: str = "none"
    spool: str | None = None
    wait_s: float = 30.0


def check_tunnel(options: TunnelOptions, runner: str) -> None:
    """Fail before anything is written if the tunnel asked for cannot run: another runner, no kafka extra, no key
    for the device, no broker answering (a broker lost during the run is ridden out: the rows wait in the spool)."""
    if options.tunnel == "none":
        return
    if runner != "device":
        raise ValueError("--tunnel ships the device runner's rows; on Flink, read the features topic instead")
    require_extra("kafka", what="--tunnel kafka")  # here, with the extra to install, not in the sender thread
    _device_key(options)
    require_broker("--tunnel kafka")


def _device_key(options: TunnelOptions) -> tuple[str, bytes]:
    device = check_device_id(options.device_id or default_device_id())
    registry = key_registry(options.key_registry)
    key = registry.key_for(device)
    if key is None:
        raise ValueError(f"device {device!r} has no key in {registry.path}: "
                         f"run `streamflow tunnel keys add {device}` (and give the cloud the same registry)")
    return device, key


def open_tunnel(options: TunnelOptions, runner: str, storage: CollectiveStorage) -> Any:
    """The TunnelSink ``streamflow run --tunnel kafka`` asked for (None without ``--tunnel``; call
    :func:`check_tunnel` first).

    Rows the sink refuses (spool full, a row over the message size limit) go to the device's
    ``dead_letter`` table with the reason.
    """
    if options.tunnel == "none":
        return None
    from connectors.tunnel.sink import TunnelSink

    device, key = _device_key(options)

    def refused(table: str, rows: list[dict[str, Any]], reason: str) -> None:
        storage.write(DEAD_LETTER_TABLE, [{"source": f"tunnel:{table}", "line": i, "reason": reason,
                                           "raw": to_json(row)} for i, row in enumerate(rows)])

    spool = options.spool or f"{storage.path}.tunnel-spool"
    return TunnelSink(device, key, spool, topic=options.topic, bootstrap=settings().kafka_bootstrap,
                      compression=options.compression, on_refused=refused)


def close_tunnel(tunnel: Any, wait_s: float) -> str:
    """Wait for delivery, close, and say what happened (a line for the run summary)."""
    delivered = tunnel.close(timeout_s=wait_s)
    s = tunnel.stats
    line = (f"tunnel: {s.rows_acked} rows in {s.batches_acked} batches acknowledged by {tunnel.bootstrap} "
            f"(topic {tunnel.topic}, device {tunnel.device}, {s.bytes_acked} envelope bytes, Kafka compression "
            f"{tunnel.compression})")
    if s.rows_refused:
        line += f"; {s.rows_refused} rows REFUSED (in dead_letter)"
    if not delivered:
        line += f"; {tunnel.spool.rows_pending} rows NOT YET ACKNOWLEDGED, kept in {tunnel.spool.path}"
    if s.rows_resent:
        line += f"; {s.rows_resent} rows sent again (the cloud's receipts showed them missing)"
    unconfirmed = tunnel.spool.rows_held - tunnel.spool.rows_pending
    if unconfirmed:
        line += (f"; {unconfirmed} rows await the cloud's receipt, kept in {tunnel.spool.path} (the next run resends "
                 "what the cloud lacks)")
    return line


def keys(action: str, device: str | None, registry_path: str | None) -> int:
    """``streamflow tunnel keys add DEVICE | list | remove DEVICE``."""
    registry = key_registry(registry_path)
    if action == "list":
        print("\n".join(registry.devices()) or f"no devices in {registry.path}")
    elif not device:
        raise ValueError(f"tunnel keys {action} needs a DEVICE")
    elif action == "add":
        registry.add(device)
        print(f"device {device} registered in {registry.path}")
    elif not registry.remove(device):
        raise ValueError(f"device {device!r} is not in {registry.path}")
    return 0


def consume(db: str, topic: str, group: str, online_key: str, idle_timeout: float | None, runner: str,
            cluster: str | None, parallelism: int, registry_path: str | None, online_lag_s: float = 0.1,
            schema: str | None = None, metrics_port: int | None = None) -> int:
    """``streamflow tunnel consume``: the features topic into a cloud DuckDB (``metrics_port``: Prometheus
    metrics, ``/healthz`` and ``/readyz`` on 127.0.0.1, :mod:`streamflow.metrics.cloud`)."""
    columns = [c for c in online_key.split(",") if c]
    schemas = read_schemas(schema) if schema else None
    if runner == "flink":
        if metrics_port is not None:
            raise ValueError("--metrics-port is the python consumer's; a Flink job reports through Flink's metrics")
        require_flink("tunnel consume --runner flink", cluster)
        require_broker("tunnel consume --runner flink")
        return _consume_on_flink(db, topic, group, columns, cluster, parallelism, registry_path, schemas)
    require_extra("kafka", what="tunnel consume")
    if metrics_port is not None:
        require_extra("metrics", what="tunnel consume --metrics-port")
    require_broker("tunnel consume")
    from connectors.tunnel.cloud import CloudConsumer

    resolved = settings()
    registry = key_registry(registry_path)
    if not registry.devices():
        print(f"streamflow: warning: the key registry {registry.path} is empty; every batch will be dead-lettered",
              file=sys.stderr)
    consumer = CloudConsumer(Path(db), registry, topic=topic, bootstrap=resolved.kafka_bootstrap, group_id=group,
                             online_key=columns, online_lag_s=online_lag_s, schemas=schemas)
    # With --idle-timeout the run is meant to end: a broker away that long ends it too, rather than the
    # consumer_retry_s a long-running consumer rides out a broker restart with.
    retry_s = resolved.consumer_retry_s
    if idle_timeout is not None:
        retry_s = min(retry_s, idle_timeout)
    print(f"consuming {topic} from {consumer.bootstrap} into {db} (group {group}; gives up after {retry_s:g} s "
          "without the broker)", file=sys.stderr)
    metrics = None
    if metrics_port is not None:
        from streamflow.metrics.cloud import serve_cloud_metrics

        metrics = serve_cloud_metrics(consumer, metrics_port)
        print(f"metrics on {metrics.url}/metrics (and /healthz, /readyz)", file=sys.stderr)
    try:
        stats = consumer.run(idle_timeout_s=idle_timeout, retry_for_s=retry_s)
    except KeyboardInterrupt:
        stats = consumer.stats
    except TunnelUnavailable as exc:
        raise TunnelUnavailable(f"{exc} (is a Kafka broker running there? `make broker-up` starts one; "
                                f"{env_name('kafka_bootstrap')} points at another)") from exc
    finally:
        consumer.close()
        if metrics is not None:
            metrics.close()
    print(f"cloud: {stats.messages} messages, {stats.stored} rows stored, {stats.duplicates} duplicates dropped, "
          f"{stats.dead_total} dead letters {dict(stats.dead)}"
          + (f", {stats.resolved} parked envelopes resolved" if stats.resolved else "")
          + (f"; sequence gaps {dict(stats.gaps)}, {stats.rows_lost} numbers LOST (see tunnel.gaps)" if stats.gaps
             else "")
          + (f"; {consumer.receipts.published} receipts published to {consumer.receipts.topic}" if consumer.receipts
             else ""))
    return 0


def read_schemas(path: str) -> dict[str, dict[str, str]]:
    """The declared tables of ``tunnel consume --schema FILE``: ``{table: {column: DuckDB type}}``."""
    try:
        schemas = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--schema {path}: {exc}") from exc
    if not isinstance(schemas, dict) or not all(
            isinstance(columns, dict) and all(isinstance(t, str) for t in columns.values())
            for columns in schemas.values()):
        raise ValueError(f'--schema {path}: expected {{"table": {{"column": "TYPE", ...}}, ...}}')
    return schemas


def _consume_on_flink(db: str, topic: str, group: str, online_key: list[str], cluster: str | None,
                      parallelism: int, key_registry: str | None, schemas: dict[str, dict[str, str]] | None) -> int:
    try:
        from streamflow.flink.tunnel import run_flink_features
    except ImportError as exc:
        raise ValueError(str(exc)) from exc
    summary = run_flink_features(topic, db, key_registry, group_id=group, cluster=cluster,
                                 parallelism=parallelism, online_key=online_key, schemas=schemas)
    print(f"cloud (flink): {summary.messages} messages, {summary.stored} rows stored, {summary.duplicates} "
          f"duplicates dropped, {summary.dead} dead letters {dict(summary.dead_reasons)}")
    return 0


def quiet_kafka_logs(verbose: bool) -> None:
    """kafka-python logs every reconnect at ERROR; the tunnel says what matters itself."""
    if not verbose:
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
