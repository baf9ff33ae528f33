"""The deploy protocol both sides speak: the piggyback headers, a directive, header pairs, report rows.

The device (:mod:`streamflow.deploy.device`) and the release server (:mod:`streamflow.deploy.release.stages`) each
import this module, never each other: a device install carries none of the server.

Example:
    >>> directive("ipv", "3", "update")["manifest"]
    '/deploy/bundles/ipv/3/manifest.json'
    >>> format_pairs(parse_pairs("ipv=2,sessions=1"))
    'ipv=2,sessions=1'
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from streamflow.deploy.manifest import check_task_name, version_key

#: Headers of the piggyback protocol.
TASKS_HEADER = "X-Streamflow-Tasks"
DEVICE_HEADER = "X-Streamflow-Device"
ATTRS_HEADER = "X-Streamflow-Attrs"
USER_HEADER = "X-Streamflow-User"
DEPLOY_HEADER = "X-Streamflow-Deploy"


def valid_version(value: object) -> str:
    """``value`` if it is a version (:func:`~streamflow.deploy.manifest.version_key`), else ``ValueError``."""
    version_key(value)
    assert isinstance(value, str)  # (version_key refuses anything else)
    return value


def directive(task: str, version: str, action: str) -> dict[str, str]:
    """What a device is told to do with one task (an element of ``X-Streamflow-Deploy``)."""
    base = f"/deploy/bundles/{task}/{version}"
    return {"task": task, "version": version, "manifest": f"{base}/manifest.json",
            "signature": f"{base}/manifest.sig", "action": action}


def parse_pairs(header: str) -> dict[str, str]:
    """``"ipv=2, sessions=1"`` → ``{"ipv": "2", "sessions": "1"}``; malformed items are skipped.

    Example:
        >>> parse_pairs("ipv=2,sessions=1,junk,=3")
        {'ipv': '2', 'sessions': '1'}
    """
    if " " not in header:  # the usual, well-formed header: one split per item
        try:
            pairs = dict(item.split("=", 1) for item in header.split(","))
        except ValueError:  # an item without "=": the careful path below
            pass
        else:
            if "" not in pairs:
                return pairs
    pairs = {}
    for item in header.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if sep and key:
            pairs[key] = value.strip()
    return pairs


def format_pairs(pairs: Mapping[str, str]) -> str:
    """The header form of ``pairs`` (the inverse of :func:`parse_pairs`)."""
    for key, value in pairs.items():
        if not key or any(c in f"{key}{value}" for c in ",=\r\n"):
            raise ValueError(f"header pair {key!r}={value!r} may not hold ',', '=' or a line break")
    return ",".join(f"{k}={v}" for k, v in pairs.items())


REPORTS_TABLE = "deploy_reports"
#: ``report(device, task, version, ok, reason)``: where verified reports go.
Report = Callable[[str, str, str, bool, str], None]


def report_row(task: str, version: str, ok: bool, reason: str | None = None) -> dict[str, Any]:
    """The ``deploy_reports`` row a device writes to its tunnel.

    Example:
        >>> sorted(report_row("ipv", "3", False, "load_failed: ipv@3: ImportError"))
        ['ok', 'reason', 'reported_at', 'task', 'version']
    """
    return {"task": task, "version": version, "ok": bool(ok), "reason": (reason or "")[:2000],
            "reported_at": time.time()}


def row_problem(row: dict[str, Any]) -> str | None:
    """Why a ``deploy_reports`` row is not a report (None if it is one)."""
    try:
        check_task_name(row.get("task"))
        version_key(row.get("version"))
    except ValueError as exc:
        return str(exc)
    if not isinstance(row.get("ok"), bool):
        return f"'ok' must be a boolean, got {row.get('ok')!r}"
    if row.get("reason") is not None and not isinstance(row.get("reason"), str):
        return f"'reason' must be a string, got {type(row.get('reason')).__name__}"
    return None
