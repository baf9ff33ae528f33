"""The command line's tunnel parts: ``run --tunnel kafka`` and ``streamflow tunnel keys|consume``.

    streamflow tunnel keys add DEVICE | list | remove DEVICE     the per-device HMAC key registry
    streamflow tunnel consume --db CLOUD.duckdb [--idle-timeout S]  the cloud consumer group
    streamflow tunnel consume --db CLOUD.duckdb --runner flink      the same topic read by a Flink job
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

from connectors.storage import DEAD_LETTER_TABLE, CollectiveStorage
from connectors.tunnel.kafka import COMPRESSION, DEFAULT_TOPIC, bootstrap_servers
from connectors.tunnel.keys import KeyRegistry, check_device_id

TUNNELS = ("none", "kafka")


def default_device_id() -> str:
    """``$STREAMFLOW_DEVICE_ID``, else this machine's host name (made a valid device id)."""
    return os.environ.get("STREAMFLOW_DEVICE_ID") or re.sub(r"[^A-Za-z0-9_.:@-]", "-", socket.gethostname())[:128]


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    """``streamflow run``'s tunnel options."""
    group = run.add_argument_group("tunnel (device runner: ship feature rows to the cloud over Kafka)")
    group.add_argument("--tunnel", choices=TUNNELS, default="none",
                       help="kafka: also send every task's rows to the features topic ($STREAMFLOW_KAFKA_BOOTSTRAP)")
    group.add_argument("--device-id", default=None,
                       help="this device's id (default: $STREAMFLOW_DEVICE_ID or the host name)")
    _registry_argument(group)
    group.add_argument("--topic", default=DEFAULT_TOPIC, help=f"features topic (default: {DEFAULT_TOPIC})")
    group.add_argument("--compression", choices=COMPRESSION, default="zstd", help="Kafka compression (default: zstd)")
    group.add_argument("--spool", default=None,
                       help="durable send queue for rows the broker has not acknowledged (default: DB.tunnel-spool)")
    group.add_argument("--tunnel-wait", type=float, default=30.0,
                       help="seconds to wait at the end for the broker to acknowledge every row (the rest stays "
                            "spooled and is sent by the next run)")


def add_commands(commands: Any) -> None:
    """``streamflow tunnel ...``."""
    tunnel = commands.add_parser("tunnel", help="the Kafka tunnel's key registry and cloud consumer")
    actions = tunnel.add_subparsers(dest="tunnel_command", required=True)
    keys = actions.add_parser("keys", help="per-device signing keys")
    keys.add_argument("action", choices=("add", "list", "remove"))
    keys.add_argument("device", nargs="?")
    _registry_argument(keys)
    consume = actions.add_parser("consume", help="store the features topic in a cloud DuckDB (consumer group)")
    consume.add_argument("--db", required=True, help="cloud DuckDB file (offline tables, <table>_online, "
                                                     "tunnel_dead_letter)")
    consume.add_argument("--topic", default=DEFAULT_TOPIC)
    consume.add_argument("--group", default="streamflow-cloud", help="consumer group id")
    consume.add_argument("--online-key", default="user_id", help="comma-separated columns keying the online tables")
    consume.add_argument("--idle-timeout", type=float, default=None,
                         help="python: stop when nothing arrived for this many seconds (default: run until Ctrl-C)")
    consume.add_argument("--runner", choices=("python", "flink"), default="python",
                         help="python: a kafka-python consumer group member (runs until stopped); flink: a PyFlink "
                              "job from the stored offsets to the offsets latest at its start")
    consume.add_argument("--cluster", metavar="HOST:PORT", help="flink: submit to this JobManager")
    consume.add_argument("--parallelism", type=int, default=1, help="flink: readers and decoders")
    _registry_argument(consume)


def _registry_argument(parser: Any) -> None:
    parser.add_argument("--key-registry", default=None,
                        help="key registry file (default: $STREAMFLOW_KEY_REGISTRY or .streamflow/keys.json)")


def open_tunnel(args: argparse.Namespace, storage: CollectiveStorage) -> Any:
    """The TunnelSink ``streamflow run --tunnel kafka`` asked for (None without ``--tunnel``).

    Rows the sink refuses (spool full, a row over the message size limit) go to the device's
    ``dead_letter`` table with the reason.
    """
    if args.tunnel == "none":
        return None
    if args.runner != "device":
        raise ValueError("--tunnel ships the device runner's rows; on Flink, read the features topic instead")
    try:
        import kafka  # noqa: F401 - fail here, with the extra to install, not in the sender thread

        from connectors.tunnel.sink import TunnelSink
    except ImportError as exc:
        raise ValueError(f"--tunnel kafka needs the kafka extra: pip install 'streamflow[kafka]' ({exc})") from exc
    device = check_device_id(args.device_id or default_device_id())
    registry = KeyRegistry(args.key_registry)
    key = registry.key_for(device)
    if key is None:
        raise ValueError(f"device {device!r} has no key in {registry.path}: "
                         f"run `streamflow tunnel keys add {device}` (and give the cloud the same registry)")

    def refused(table: str, rows: list[dict[str, Any]], reason: str) -> None:
        storage.write(DEAD_LETTER_TABLE, [{"source": f"tunnel:{table}", "line": i, "reason": reason,
                                           "raw": json.dumps(row, default=str)} for i, row in enumerate(rows)])

    spool = args.spool or f"{storage.path}.tunnel-spool"
    return TunnelSink(device, key, spool, topic=args.topic, compression=args.compression, on_refused=refused)


def close_tunnel(tunnel: Any, wait_s: float) -> str:
    """Wait for delivery, close, and say what happened (a line for the run summary)."""
    delivered = tunnel.close(timeout_s=wait_s)
    s = tunnel.stats
    line = (f"tunnel: {s.rows_acked} rows in {s.batches_acked} batches acknowledged by {tunnel.bootstrap} "
            f"(topic {tunnel.topic}, device {tunnel.device}, {tunnel.compression}, {s.bytes_acked} envelope bytes)")
    if s.rows_refused:
        line += f"; {s.rows_refused} rows REFUSED (in dead_letter)"
    if not delivered:
        line += f"; {tunnel.spool.rows_pending} rows NOT YET ACKNOWLEDGED, kept in {tunnel.spool.path}"
    return line


def run_command(args: argparse.Namespace) -> int:
    """``streamflow tunnel keys|consume``."""
    registry = KeyRegistry(args.key_registry)
    if args.tunnel_command == "keys":
        if args.action == "list":
            print("\n".join(registry.devices()) or f"no devices in {registry.path}")
        elif not args.device:
            raise ValueError(f"tunnel keys {args.action} needs a DEVICE")
        elif args.action == "add":
            registry.add(args.device)
            print(f"device {args.device} registered in {registry.path}")
        elif not registry.remove(args.device):
            raise ValueError(f"device {args.device!r} is not in {registry.path}")
        return 0
    online_key = [c for c in args.online_key.split(",") if c]
    if args.runner == "flink":
        return _consume_on_flink(args, online_key)
    from connectors.tunnel.cloud import CloudConsumer
    from connectors.tunnel.kafka import TunnelUnavailable

    if not registry.devices():
        print(f"streamflow: warning: the key registry {registry.path} is empty; every batch will be dead-lettered",
              file=sys.stderr)
    consumer = CloudConsumer(Path(args.db), registry, topic=args.topic, group_id=args.group, online_key=online_key)
    print(f"consuming {args.topic} from {bootstrap_servers()} into {args.db} (group {args.group})", file=sys.stderr)
    try:
        stats = consumer.run(idle_timeout_s=args.idle_timeout)
    except KeyboardInterrupt:
        stats = consumer.stats
    except TunnelUnavailable as exc:  # the broker stayed away past the retry budget
        print(f"streamflow: {exc}", file=sys.stderr)
        return 1
    finally:
        consumer.close()
    print(f"cloud: {stats.messages} messages, {stats.stored} rows stored, {stats.duplicates} duplicates dropped, "
          f"{stats.dead_total} dead letters {dict(stats.dead)}")
    return 0


def _consume_on_flink(args: argparse.Namespace, online_key: list[str]) -> int:
    try:
        from streamflow.flink.tunnel import run_flink_features
    except ImportError as exc:
        raise ValueError(str(exc)) from exc
    summary = run_flink_features(args.topic, args.db, args.key_registry, group_id=args.group, cluster=args.cluster,
                                 parallelism=args.parallelism, online_key=online_key)
    print(f"cloud (flink): {summary.messages} messages, {summary.stored} rows stored, {summary.duplicates} "
          f"duplicates dropped, {summary.dead} dead letters {dict(summary.dead_reasons)}")
    return 0


def quiet_kafka_logs(verbose: bool) -> None:
    """kafka-python logs every reconnect at ERROR; the tunnel says what matters itself."""
    if not verbose:
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
