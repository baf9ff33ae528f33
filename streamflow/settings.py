"""One typed settings object for every part of streamflow: explicit arguments first, ``STREAMFLOW_*``
environment variables second, defaults last.

Each field ``name`` is read from ``$STREAMFLOW_<NAME>`` (the name's case does not matter; an empty
variable counts as unset). The environment is read on every :func:`settings` call, so a variable set
while a process runs (a test's ``monkeypatch.setenv``) is seen by the next call. Every value (given,
from the environment or default) is converted to its field's type and checked; a value that does not
fit raises :class:`SettingsError` naming the field.

Plain standard library on purpose: every ``streamflow`` command reads the settings at start-up, and
pydantic-settings (asyncio, ssl, dotenv, argparse and a model class to build) cost about 0.1 s of CPU
there, as much as the IPV job spends on 20,000 events.

Example:
    >>> settings(db="explicit.duckdb").db
    PosixPath('explicit.duckdb')
    >>> settings(kafka_bootstrap="broker:9092", device_id=None).kafka_bootstrap
    'broker:9092'
    >>> env_name("flink_home_dir")
    'STREAMFLOW_FLINK_HOME_DIR'
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ENV_PREFIX = "STREAMFLOW_"


class SettingsError(ValueError):
    """A setting whose value its field refuses; ``name`` is the field, ``reason`` what was expected."""

    def __init__(self, name: str, value: Any, reason: str):
        self.name, self.value, self.reason = name, value, f"{reason}, got {value!r}"
        super().__init__(f"setting {name}: {self.reason}")


def _setting(default: Any, description: str, convert: Callable[[Any], Any] = str, *, choices: tuple[str, ...] = (),
             gt: float | None = None, ge: float | None = None, le: float | None = None, pattern: str | None = None,
             optional: bool = False) -> Any:
    return dataclasses.field(default=default, metadata={
        "description": description, "convert": convert, "choices": choices, "gt": gt, "ge": ge, "le": le,
        "pattern": pattern, "optional": optional})


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("a number")
    return float(value)


@dataclass(frozen=True)
class Settings:
    """streamflow's settings; build one with :func:`settings` (it drops explicit ``None`` values).

    Example:
        >>> Settings(runner="flink").runner
        'flink'
    """

    # db, kafka_bootstrap and key_registry default to what the connectors use when given nothing (DEFAULT_DB_PATH,
    # DEFAULT_BOOTSTRAP, DEFAULT_REGISTRY_PATH; tests/test_settings.py checks they agree): the framework resolves
    # them here and passes the values, the connectors never read the settings.
    db: Path = _setting(Path("streamflow.duckdb"), "DuckDB file for feature rows", Path)
    runner: Literal["device", "flink"] = _setting("device", "where `streamflow run` runs a job",
                                                  choices=("device", "flink"))
    kafka_bootstrap: str = _setting("127.0.0.1:9092", "Kafka broker(s) of the tunnel, host:port[,...]")
    key_registry: Path = _setting(Path(".streamflow") / "keys.json", "the tunnel's device key registry", Path)
    device_id: str | None = _setting(None, "this device's id in the tunnel (default: the host name)", optional=True)
    consumer_retry_s: float = _setting(300.0, "seconds `streamflow tunnel consume` and `streamflow serve` retry a "
                                              "broker gone away before they give up (exit 1)", _number, gt=0)
    flink_home_dir: Path = _setting(Path(".flink-cluster"), "state dir of the local Flink cluster", Path)
    flink_jars_dir: Path = _setting(Path.home() / ".cache" / "streamflow" / "flink-kafka-2.0",
                                    "cache of the verified Flink Kafka connector jars", Path)
    flink_python: str = _setting(sys.executable, "the Python the Flink workers run")
    flink_execution_mode: Literal["thread", "process"] = _setting("thread", "PyFlink's Python mode",
                                                                  choices=("thread", "process"))
    zoo_dir: Path = _setting(Path.home() / ".cache" / "streamflow" / "zoo",
                             "the serving model zoo: zoo.json and its model files (streamflow.serve.zoo)", Path)
    deploy_server: str = _setting("http://127.0.0.1:8470", "the release server `streamflow release` talks to")
    deploy_dir: Path = _setting(Path(".streamflow") / "deploy", "the release server's state directory (its SQLite "
                                "file, file store and admin.token)", Path)
    # the serving worker (streamflow/serve/app.py, `streamflow serve`)
    serve_app_id: str = _setting("streamflow-serve", "the serving worker's faust app id: its consumer group and "
                                 "table topics", pattern=r"^[A-Za-z0-9._-]{1,100}$")
    serve_models: str | None = _setting(None, "comma-separated zoo models the serving worker runs (default: every "
                                              "model of the zoo)", optional=True)
    serve_temperature: float = _setting(0.002, "MDInference: softmax temperature over the candidates' accuracies "
                                               "(0 = always the most accurate)", _number, ge=0)
    serve_alpha: float = _setting(0.2, "MDInference: EWMA weight of a new latency sample", _number, gt=0, le=1)
    serve_rule: Literal["expected", "paper"] = _setting(
        "expected", "MDInference's model choice: `expected` (the most expected accuracy, the device's answer counted "
        "in) or `paper` (the most accurate model whose mean + std fits the budget)", choices=("expected", "paper"))

    def __post_init__(self) -> None:
        for field in FIELDS.values():
            object.__setattr__(self, field.name, _checked(field, getattr(self, field.name)))


FIELDS: dict[str, dataclasses.Field[Any]] = {field.name: field for field in dataclasses.fields(Settings)}


def _checked(field: dataclasses.Field[Any], value: Any) -> Any:
    """``value`` converted to ``field``'s type, or :class:`SettingsError`."""
    meta, name = field.metadata, field.name
    if value is None:
        if meta["optional"]:
            return None
        raise SettingsError(name, value, "a value is required")
    if meta["choices"]:
        if value not in meta["choices"]:
            raise SettingsError(name, value, "expected one of " + ", ".join(map(repr, meta["choices"])))
        return value
    try:
        converted = meta["convert"](value)
    except (TypeError, ValueError):
        raise SettingsError(name, value, "expected " + ("a number" if meta["convert"] is _number else
                                                        f"a {meta['convert'].__name__}")) from None
    for bound, holds in (("gt", lambda x, b: x > b), ("ge", lambda x, b: x >= b), ("le", lambda x, b: x <= b)):
        limit = meta[bound]
        if limit is not None and (math.isnan(converted) or not holds(converted, limit)):
            raise SettingsError(name, value, f"expected a number {dict(gt='>', ge='>=', le='<=')[bound]} {limit:g}")
    if meta["pattern"] is not None and re.search(meta["pattern"], converted) is None:
        raise SettingsError(name, value, f"expected text matching {meta['pattern']}")
    return converted


def settings(**explicit: Any) -> Settings:
    """The settings, with ``explicit`` values (``None`` or ``""`` meaning not given) over the environment."""
    unknown = explicit.keys() - FIELDS.keys()
    if unknown:
        raise TypeError(f"no settings named {sorted(unknown)}")
    environment = {key.upper(): value for key, value in os.environ.items()
                   if key[:len(ENV_PREFIX)].upper() == ENV_PREFIX and value != ""}
    values: dict[str, Any] = {}
    for name in FIELDS:
        value = explicit.get(name)
        if value is None or value == "":
            value = environment.get(ENV_PREFIX + name.upper())
        if value is not None:
            values[name] = value
    return Settings(**values)


def env_name(field: str) -> str:
    """The environment variable a field is read from."""
    if field not in FIELDS:
        raise KeyError(f"no setting named {field!r}")
    return ENV_PREFIX + field.upper()


__all__ = ["ENV_PREFIX", "FIELDS", "Settings", "SettingsError", "env_name", "settings"]
