"""One typed settings object for every part of streamflow: explicit arguments first, ``STREAMFLOW_*``
environment variables second, defaults last.

Each field ``name`` is read from ``$STREAMFLOW_<NAME>`` (an empty variable counts as unset). The
environment is read on every :func:`settings` call, so a variable set while a process runs (a test's
``monkeypatch.setenv``) is seen by the next call.

Example:
    >>> settings(db="explicit.duckdb").db
    PosixPath('explicit.duckdb')
    >>> settings(kafka_bootstrap="broker:9092", device_id=None).kafka_bootstrap
    'broker:9092'
    >>> env_name("flink_home_dir")
    'STREAMFLOW_FLINK_HOME_DIR'
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "STREAMFLOW_"


class Settings(BaseSettings):
    """streamflow's settings; build one with :func:`settings` (it drops explicit ``None`` values).

    Example:
        >>> Settings(runner="flink").runner
        'flink'
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="ignore", frozen=True)

    db: Path = Field(Path("streamflow.duckdb"), description="DuckDB file for feature rows")
    runner: Literal["device", "flink"] = Field("device", description="where `streamflow run` runs a job")
    kafka_bootstrap: str = Field("127.0.0.1:9092", description="Kafka broker(s) of the tunnel, host:port[,...]")
    key_registry: Path = Field(Path(".streamflow") / "keys.json", description="the tunnel's device key registry")
    device_id: str | None = Field(None, description="this device's id in the tunnel (default: the host name)")
    consumer_retry_s: float = Field(300.0, gt=0, description="seconds `streamflow tunnel consume` retries an "
                                                             "unreachable broker before it gives up (exit 1)")
    flink_home_dir: Path = Field(Path(".flink-cluster"), description="state dir of the local Flink cluster")
    flink_jars_dir: Path = Field(Path.home() / ".cache" / "streamflow" / "flink-kafka-2.0",
                                 description="cache of the verified Flink Kafka connector jars")
    flink_python: str = Field(sys.executable, description="the Python the Flink workers run")
    flink_execution_mode: Literal["thread", "process"] = Field("thread", description="PyFlink's Python mode")
    zoo_dir: Path = Field(Path.home() / ".cache" / "streamflow" / "zoo",
                          description="the serving model zoo: zoo.json and its model files (streamflow.serve.zoo)")
    deploy_server: str = Field("http://127.0.0.1:8470", description="the release server `streamflow release` talks to")
    deploy_dir: Path = Field(Path(".streamflow") / "deploy", description="the release server's state directory "
                             "(its SQLite file, file store and admin.token)")
    # the serving worker (streamflow/serve/app.py, `streamflow serve`)
    serve_app_id: str = Field("streamflow-serve", pattern=r"^[A-Za-z0-9._-]{1,100}$",
                              description="the serving worker's faust app id: its consumer group and table topics")
    serve_models: str | None = Field(None, description="comma-separated zoo models the serving worker runs "
                                                       "(default: every model of the zoo)")
    serve_temperature: float = Field(0.005, ge=0, description="MDInference: softmax temperature over the "
                                                             "candidates' accuracies (0 = always the most accurate)")
    serve_alpha: float = Field(0.2, gt=0, le=1, description="MDInference: EWMA weight of a new latency sample")


def settings(**explicit: Any) -> Settings:
    """The settings, with ``explicit`` values (``None`` or ``""`` meaning not given) over the environment."""
    return Settings(**{name: value for name, value in explicit.items() if value is not None and value != ""})


def env_name(field: str) -> str:
    """The environment variable a field is read from."""
    if field not in Settings.model_fields:
        raise KeyError(f"no setting named {field!r}")
    return ENV_PREFIX + field.upper()


__all__ = ["ENV_PREFIX", "Settings", "env_name", "settings"]
