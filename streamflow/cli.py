"""The ``streamflow`` command: run a job, describe a job, the tunnel, a local Flink cluster.

    streamflow run JOB --events FILE [--runner device|flink] [--cluster HOST:PORT] [--db PATH]
    streamflow describe JOB
    streamflow tunnel keys add DEVICE | list | remove DEVICE
    streamflow tunnel consume --db CLOUD.duckdb [--idle-timeout S] [--runner python|flink]
    streamflow flink-cluster start|stop|status
    streamflow bundle keygen [--out KEY] | build REPO --tag v3 --key KEY --out DIR
    streamflow deploy-server --trusted-key KEY.pub [--dir DIR] [--port 8470] [--replay-events FILE]
    streamflow release publish BUNDLE | pin TASK V | start TASK V [...] | status | advance TASK | rollback TASK
    streamflow serve [--models A,B] [--temperature T] [--alpha A] [--explore P] [--zoo ZOO.json]

One command line (Typer), every default from :mod:`streamflow.settings` (explicit option first,
``STREAMFLOW_*`` second, built-in default last). :func:`main` returns the exit code: 0 done, 1 the
broker or the spool is unavailable or a cluster failed, 2 bad input (job file, events file, options) or a
missing prerequisite (an extra, a JVM, a Kafka broker or a Flink cluster that does not answer:
:mod:`streamflow.prerequisites`).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from connectors.sql import quote_identifier
from connectors.storage import CollectiveStorage, flush_on_signals
from connectors.tunnel.kafka import TunnelUnavailable
from connectors.tunnel.spool import SpoolLocked
from operators import CountWindow, Process
from operators.process import LATE, _FunctionProcess
from streamflow import tunnel_commands
from streamflow.checkpoint import discard_checkpoint, has_checkpoint
from streamflow.deploy.errors import BundleError
from streamflow.deploy.release.bundle_commands import bundle_app
from streamflow.deploy.release.commands import deploy_server, release_app
from streamflow.flink.connector_jars import kafka_topic  # reads kafka://TOPIC without PyFlink
from streamflow.job import Job, JobLoadError, Task, load_job
from streamflow.prerequisites import MissingPrerequisite, require_broker, require_extra, require_flink, require_java
from streamflow.progress import Track
from streamflow.runners.device import DeviceRunner, RuntimeMode
from streamflow.settings import SettingsError, env_name, settings
from streamflow.sources import FORMATS, open_source
from streamflow.summary import SYSTEM_TABLES, RunSummary
from streamflow.trie import TriggerTrie
from streamflow.tunnel_commands import TunnelOptions
from streamflow.windowing import StreamPlan

RUNNERS = ("device", "flink")
TUNNEL_PANEL = "tunnel (device runner: ship feature rows to the cloud over Kafka)"

app = typer.Typer(name="streamflow", help=__doc__.splitlines()[0], add_completion=False, no_args_is_help=True,
                  pretty_exceptions_enable=False, rich_markup_mode=None)
tunnel_app = typer.Typer(help="the Kafka tunnel's key registry and cloud consumer", no_args_is_help=True)
app.add_typer(tunnel_app, name="tunnel")
app.add_typer(bundle_app, name="bundle")
app.add_typer(release_app, name="release")
app.command("deploy-server", help="the release server: deploy directives, bundles, status page (127.0.0.1)")(
    deploy_server)

if typing.TYPE_CHECKING:  # choices made at run time: Typer reads them, the type checker sees the names
    FormatName = str
    CompressionName = str
else:
    FormatName = Literal[tuple(sorted(FORMATS))]
    CompressionName = Literal[tuple(tunnel_commands.COMPRESSION)]
KeyRegistryOption = Annotated[str | None, typer.Option(
    "--key-registry", help="key registry file (default: $STREAMFLOW_KEY_REGISTRY or .streamflow/keys.json)")]
MetricsPortOption = Annotated[int | None, typer.Option(
    min=0, help="serve Prometheus /metrics, /healthz and /readyz on 127.0.0.1:PORT (default: off; the metrics extra)")]


@dataclass(frozen=True)
class RunOptions:
    """What ``streamflow run`` was asked to do (besides the job and the tunnel)."""

    events: str
    fmt: str | None
    runner: str
    db: Path
    workers: int
    quarantine_after: int
    cluster: str | None
    parallelism: int
    pace_ms: float
    state_ttl: float | None
    max_users: int | None
    replace: bool
    checkpoint_interval: float | None
    checkpoint_dir: str | None
    show: int
    mode: RuntimeMode = "automatic"
    metrics_port: int | None = None
    sink: str | None = None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code.

    A plain ``streamflow run`` command line (:func:`_plain_run`) calls :func:`run` without Typer, whose command
    building and per-option validation (Pydantic) cost ~0.15 s of every run's start-up; anything else, help and
    usage errors included, goes through Typer."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        plain = _plain_run(args)
        if plain is None:
            code = app(args=args, prog_name="streamflow", standalone_mode=False)
        else:
            try:
                _options()
                code = run(**plain)
            except (EOFError, KeyboardInterrupt) as exc:  # as Click's main does
                print(file=sys.stderr)
                raise typer.Abort() from exc
    except (JobLoadError, FileNotFoundError, FileExistsError, ValueError, BundleError, MissingPrerequisite) as exc:
        return _error(_message(exc), 2)
    except (SpoolLocked, TunnelUnavailable) as exc:  # the spool is another process's, the broker stayed away
        return _error(str(exc), 1)
    except typer.Abort:
        return _error("aborted", 1)
    except typer.TyperException as exc:  # a usage error: the usage and what was wrong, as argparse printed it
        show = getattr(exc, "show", None)
        if show is None:
            raise
        show()
        return int(getattr(exc, "exit_code", 2))
    return code if isinstance(code, int) else 0


def _run_parameters() -> dict[str, tuple[str, Any, Any]]:
    """:func:`run`'s parameters as Typer reads them from its signature: ``{option: (parameter, type, default)}``,
    the job argument under ``""``; the type ``None`` where Typer checks more than the type (``min=``, ...)."""
    hints = typing.get_type_hints(run, include_extras=True)
    parameters: dict[str, tuple[str, Any, Any]] = {}
    for name, parameter in inspect.signature(run).parameters.items():
        kind, info = typing.get_args(hints[name])[:2]
        declared = info.default if isinstance(info.default, str) and info.default.startswith("-") else None
        option = "" if isinstance(info, typer.models.ArgumentInfo) else declared or "--" + name.replace("_", "-")
        if any(getattr(info, field, None) is not None for field in ("min", "max", "parser", "callback", "envvar")):
            kind = None
        parameters[option] = (name, kind, parameter.default)
    return parameters


_INTEGER_TEXT = re.compile(r"-?(0|[1-9][0-9]{0,17})").fullmatch
_FLOAT_TEXT = re.compile(r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,17})?").fullmatch


def _plain_value(kind: Any, text: str) -> tuple[bool, Any]:
    """``(True, value)`` if Typer gives ``text``, an option of type ``kind``, as ``value`` beyond doubt (text, a
    choice, plain digits), else ``(False, None)``."""
    args = getattr(kind, "__args__", None)
    if args is not None and type(None) in args:  # Optional[X]: X
        rest = [arg for arg in args if arg is not type(None)]
        if len(rest) != 1:
            return False, None
        kind = rest[0]
    if getattr(kind, "__origin__", None) is Literal:
        choices = typing.get_args(kind)
        return (True, text) if text in choices and all(type(c) is str for c in choices) else (False, None)
    if kind is str:
        return True, text
    if kind is int and _INTEGER_TEXT(text):
        return True, int(text)
    if kind is float and _FLOAT_TEXT(text):
        return True, float(text)
    return False, None


def _plain_run(args: list[str]) -> dict[str, Any] | None:
    """:func:`run`'s keyword arguments for ``args`` if they are a plain ``run`` command line: the job and known
    options as ``--name VALUE`` or ``--name=VALUE``, each once, no value starting with ``-``, flags (``--replace``)
    bare, values :func:`_plain_value` reads; every other parameter its default. ``None`` for anything else: Typer
    parses it (and gives its help or usage error). ``tests/test_cli.py`` checks both give the same arguments."""
    if not args or args[0] != "run":
        return None
    parameters = _run_parameters()
    given: dict[str, Any] = {}
    rest = iter(args[1:])
    for arg in rest:
        if not arg.startswith("-"):
            option, text = "", arg
        else:
            option, equals, text = arg.partition("=")
            if option == "" or option not in parameters:
                return None
            if parameters[option][1] is bool:
                if equals or parameters[option][0] in given:
                    return None
                given[parameters[option][0]] = True
                continue
            if not equals:
                text = next(rest, "-")
                if text.startswith("-"):
                    return None
        name, kind, _ = parameters[option]
        plain, value = _plain_value(kind, text)
        if not plain or name in given:
            return None
        given[name] = value
    for name, _, default in parameters.values():
        if name not in given:
            if default is inspect.Parameter.empty:
                return None  # a required parameter is missing: Typer says so
            given[name] = default
    return given


def _error(message: str, code: int) -> int:
    print(f"streamflow: error: {message}", file=sys.stderr)
    return code


def _message(exc: Exception) -> str:
    if isinstance(exc, SettingsError):  # a bad STREAMFLOW_* value
        return f"{env_name(exc.name)}: {exc.reason}"
    return str(exc)


@app.callback()
def _options(verbose: Annotated[bool, typer.Option("-v", "--verbose", help="debug logging")] = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    tunnel_commands.quiet_kafka_logs(verbose)


@app.command(help="run a job over an events file")
def run(
    job: Annotated[str, typer.Argument(help="job file (a Python module defining `job = Job(...)`)")],
    events: Annotated[str, typer.Option(help="events file: Taobao CSV (.csv) or JSON lines (.jsonl); flink runner: "
                                             "also kafka://TOPIC (one raw line per record, --format required)")],
    fmt: Annotated[FormatName | None, typer.Option("--format", help="events format (default: from the extension)")]
    = None,
    runner: Annotated[Literal["device", "flink"] | None, typer.Option(
        help="where to run (default: device, or $STREAMFLOW_RUNNER)")] = None,
    db: Annotated[str | None, typer.Option(help="DuckDB file for feature rows (default: $STREAMFLOW_DB or "
                                                "./streamflow.duckdb)")] = None,
    workers: Annotated[int, typer.Option(help="worker threads for tasks fired together")] = 2,
    quarantine_after: Annotated[int, typer.Option(help="consecutive failures after which a task is quarantined")]
    = 5,
    cluster: Annotated[str | None, typer.Option(metavar="HOST:PORT", help="flink runner: submit to this JobManager "
                                                "(REST endpoint) instead of a local MiniCluster")] = None,
    parallelism: Annotated[int, typer.Option(help="flink runner: job parallelism")] = 1,
    sink: Annotated[str | None, typer.Option(metavar="URI", help="flink runner: where rows go: duckdb:PATH (as "
                                             "--db), kafka:TOPIC (feature rows in the tunnel's envelope at the "
                                             "job's parallelism, one device flink-JOB-i per subtask; the rest in "
                                             "--db), or parquet:DIR (feature rows as Parquet files in DIR/TABLE/ "
                                             "at the job's parallelism, committed on checkpoints and at the end; "
                                             "each shipped task declares its columns=; the rest in --db)")] = None,
    pace_ms: Annotated[float, typer.Option(help="flink runner: replay one record per N ms, so that periodic "
                                                "watermarks decide lateness per event as the device runner does")]
    = 0.0,
    state_ttl: Annotated[float | None, typer.Option(metavar="SECONDS", help="device runner: drop a user's state "
                         "after this long of event time without an event of theirs (at least the source's page "
                         "inactivity gap, 1800 s for Taobao CSV)")] = None,
    max_users: Annotated[int | None, typer.Option(help="device runner: cap on users held in memory (the least "
                                                       "recently seen are evicted)")] = None,
    replace: Annotated[bool, typer.Option("--replace", help="drop the job's tables (and dead_letter, task_errors) "
                                                            "and its checkpoint before running")] = False,
    checkpoint_interval: Annotated[float | None, typer.Option(metavar="SECONDS", help="device runner: checkpoint "
                                   "state and source position into the DuckDB file every SECONDS (and on exit); a "
                                   "run over the same file into the same file resumes from it; flink runner: Flink's "
                                   "checkpoint interval with --checkpoint-dir, default 10 s)")] = None,
    checkpoint_dir: Annotated[str | None, typer.Option(help="flink runner: enable Flink checkpointing into this "
                                                            "directory")] = None,
    show: Annotated[int, typer.Option(help="sample rows to print per table")] = 3,
    mode: Annotated[RuntimeMode, typer.Option(help="device runner: streaming (event by event), batch (the whole file "
                                                   "column by column, for jobs and clean inputs that allow it; an "
                                                   "error otherwise), automatic (batch where allowed, else "
                                                   "streaming)")] = "automatic",
    metrics_port: MetricsPortOption = None,
    tunnel: Annotated[Literal["none", "kafka"], typer.Option(rich_help_panel=TUNNEL_PANEL, help="kafka: also send "
                      "every task's rows to the features topic ($STREAMFLOW_KAFKA_BOOTSTRAP)")] = "none",
    device_id: Annotated[str | None, typer.Option(rich_help_panel=TUNNEL_PANEL, help="this device's id (default: "
                                                  "$STREAMFLOW_DEVICE_ID or the host name)")] = None,
    key_registry: KeyRegistryOption = None,
    topic: Annotated[str, typer.Option(rich_help_panel=TUNNEL_PANEL, help="features topic")]
    = tunnel_commands.DEFAULT_TOPIC,
    compression: Annotated[CompressionName, typer.Option(
        rich_help_panel=TUNNEL_PANEL, help="Kafka record-batch compression on top of the envelopes' own zstd "
        "(none: it would only add a frame)")] = "none",
    spool: Annotated[str | None, typer.Option(rich_help_panel=TUNNEL_PANEL, help="durable send queue for rows the "
                                              "broker has not acknowledged (default: DB.tunnel-spool)")] = None,
    tunnel_wait: Annotated[float, typer.Option(rich_help_panel=TUNNEL_PANEL, help="seconds to wait at the end for "
                           "the broker to acknowledge every row (the rest stays spooled and is sent by the next "
                           "run)")] = 30.0,
) -> int:
    if sink is not None and sink.startswith("duckdb:"):
        db = sink.partition(":")[2]  # the file the summary's sample rows are read from, too
    resolved = settings(runner=runner, db=db)
    options = RunOptions(events, fmt, resolved.runner, resolved.db, workers, quarantine_after, cluster,
                         parallelism, pace_ms, state_ttl, max_users, replace, checkpoint_interval, checkpoint_dir,
                         show, mode, metrics_port, sink)
    if sink is not None and options.runner != "flink":
        raise ValueError("--sink is the flink runner's; on the device runner use --db, and --tunnel kafka")
    tunnel_options = TunnelOptions(tunnel, device_id, key_registry, topic, compression, spool, tunnel_wait)
    return _run(load_job(job), options, tunnel_options)


@app.command("describe", help="show a job's tasks and the trie of their triggers")
def describe_command(job: str) -> int:
    print(describe(load_job(job)))
    return 0


@tunnel_app.command("keys", help="per-device signing keys")
def tunnel_keys(action: Literal["add", "list", "remove"], device: Annotated[str | None, typer.Argument()] = None,
                key_registry: KeyRegistryOption = None) -> int:
    return tunnel_commands.keys(action, device, key_registry)


@tunnel_app.command("consume", help="store the features topic in a cloud DuckDB (consumer group)")
def tunnel_consume(
    db: Annotated[str, typer.Option(help="cloud DuckDB file (offline tables, <table>_online, tunnel.dead_letter)")],
    topic: str = tunnel_commands.DEFAULT_TOPIC,
    group: Annotated[str, typer.Option(help="consumer group id")] = "streamflow-cloud",
    online_key: Annotated[str, typer.Option(help="comma-separated columns keying the online tables")] = "user_id",
    idle_timeout: Annotated[float | None, typer.Option(help="python: stop when nothing arrived for this many "
                                                            "seconds (default: run until Ctrl-C)")] = None,
    runner: Annotated[Literal["python", "flink"], typer.Option(help="python: a kafka-python consumer group member "
                      "(runs until stopped); flink: a PyFlink job from the stored offsets to the offsets latest at "
                      "its start")] = "python",
    cluster: Annotated[str | None, typer.Option(metavar="HOST:PORT", help="flink: submit to this JobManager")]
    = None,
    parallelism: Annotated[int, typer.Option(help="flink: readers and decoders")] = 1,
    key_registry: KeyRegistryOption = None,
    online_lag_ms: Annotated[float, typer.Option(min=0, help="python: the online tables follow the offline ones "
                             "within about this; 0 upserts them in the transaction that stores the rows")] = 100.0,
    schema: Annotated[str | None, typer.Option(metavar="FILE.json", help="declared tables, columns and types: "
                      '{"ipv": {"user_id": "VARCHAR", "dwell_s": "DOUBLE"}}; other tables and columns are refused, '
                      "and a value its declared type would change is refused by row")] = None,
    metrics_port: MetricsPortOption = None,
) -> int:
    return tunnel_commands.consume(db, topic, group, online_key, idle_timeout, runner, cluster, parallelism,
                                   key_registry, online_lag_ms / 1000, schema, metrics_port)


@app.command("serve", help="the serving worker (faust-streaming): answer serve.requests with a zoo model chosen "
                            "by MDInference (broker: $STREAMFLOW_KAFKA_BOOTSTRAP)")
def serve_command(
    models: Annotated[str | None, typer.Option(help="comma-separated zoo models to serve (default: "
                                                    "$STREAMFLOW_SERVE_MODELS, else every model of the zoo)")] = None,
    temperature: Annotated[float | None, typer.Option(help="softmax temperature over accuracies (default: "
                                                           "$STREAMFLOW_SERVE_TEMPERATURE or 0.002)")] = None,
    alpha: Annotated[float | None, typer.Option(help="EWMA weight of a new latency sample (default: "
                                                     "$STREAMFLOW_SERVE_ALPHA or 0.2)")] = None,
    explore: Annotated[float, typer.Option(help="probability of running a model that does not fit the budget, "
                                               "to measure it again")] = 0.02,
    rule: Annotated[Literal["expected", "paper"] | None, typer.Option(
        help="model choice: expected (most expected accuracy, the device's answer counted in) or paper (most "
             "accurate model whose mean + std fits); default $STREAMFLOW_SERVE_RULE or expected")] = None,
    zoo: Annotated[str | None, typer.Option(help="the zoo's zoo.json (default: in $STREAMFLOW_ZOO_DIR)")] = None,
    app_id: Annotated[str | None, typer.Option(help="faust app id: consumer group and table topics")] = None,
    seed: Annotated[int, typer.Option(help="seed of the policy's sampling")] = 0,
    web_port: Annotated[int | None, typer.Option(help="serve faust's web views on 127.0.0.1:PORT (default: off)")]
    = None,
    metrics_port: MetricsPortOption = None,
    key_registry: KeyRegistryOption = None,
    loglevel: Annotated[Literal["debug", "info", "warning", "error"], typer.Option()] = "warning",
) -> int:
    """``streamflow serve``: see :mod:`streamflow.serve.app`. A model missing from the zoo is exit code 2."""
    require_extra("serve", what="streamflow serve")
    from streamflow.serve.app import ServeConfig, run_worker, served_models
    from streamflow.serve.zoo import ZooError

    names = tuple(n.strip() for n in models.split(",") if n.strip()) if models else None
    s = settings(serve_temperature=temperature, serve_alpha=alpha, serve_app_id=app_id,
                 serve_rule=rule)  # validates the knobs
    config = ServeConfig.from_settings(models=names, temperature=s.serve_temperature, alpha=s.serve_alpha,
                                       rule=s.serve_rule,
                                       app_id=s.serve_app_id, zoo_path=Path(zoo) if zoo else None, seed=seed,
                                       explore=explore,
                                       web_port=web_port, metrics_port=metrics_port,
                                       key_registry=Path(key_registry) if key_registry else None)
    require_broker("streamflow serve", config.bootstrap)
    try:
        served = served_models(config)
    except ZooError as exc:
        return _error(str(exc), 2)
    print(f"serving {', '.join(served)} (zoo {config.zoo_path}) from {config.bootstrap}, app {config.app_id}"
          + (f"; metrics on http://127.0.0.1:{metrics_port}/metrics (and /healthz, /readyz)" if metrics_port else ""),
          file=sys.stderr)
    try:
        run_worker(config, loglevel)
    except ZooError as exc:  # a model file went missing or does not match its checksum
        return _error(str(exc), 2)
    return 0


@app.command("flink-cluster", help="start/stop/status of a local Flink cluster (PyFlink's jars)")
def flink_cluster_command(
    action: Literal["start", "stop", "status"],
    port: Annotated[int | None, typer.Option(help="REST port (default: 8081; status/stop: as started)")] = None,
    directory: Annotated[str | None, typer.Option("--dir", help="state dir (default: $STREAMFLOW_FLINK_HOME_DIR "
                                                                "or ./.flink-cluster)")] = None,
) -> int:
    """``streamflow flink-cluster start|stop|status``: see :mod:`streamflow.flink.cluster`."""
    from streamflow.flink import cluster as flink_cluster

    if action == "start":
        require_extra("flink", what="flink-cluster start")
        require_java("flink-cluster start")
    try:
        if action == "start":
            started = flink_cluster.start(port=port or flink_cluster.DEFAULT_PORT, directory=directory)
            print(f"Flink cluster up: http://127.0.0.1:{port or flink_cluster.DEFAULT_PORT} {started}")
        elif action == "stop":
            print("stopped" if flink_cluster.stop(directory) else "no cluster running")
        else:
            overview = flink_cluster.status(port, directory)
            print(overview if overview is not None else "no Flink cluster answers")
            return 0 if overview is not None else 1
    except flink_cluster.ClusterError as exc:
        return _error(str(exc), 1)
    return 0


def describe(job: Job) -> str:
    """The job's tasks (each with its pipeline and the fields of its rows) and the trie of their trigger
    conditions, as text.

    Example:
        >>> from operators import Aggregate, Count, KeyBy, TimeWindow
        >>> from streamflow.job import Task
        >>> print(describe(Job("j", [Task("n", None, [KeyBy("user_id"), TimeWindow(60), Aggregate(n=Count())],
        ...                                input="stream")])))
        job j
        <BLANKLINE>
        tasks:
          n: input stream (every event, no trigger), key user_id, TimeWindow + Aggregate, sink table n
            | KeyBy(key='user_id', name='user_id')
            | TimeWindow(allowed_lateness=0.0, out_of_orderness=0.0, size=60.0, slide=60.0, offset=0.0, ts='ts')
            | Aggregate(aggregations={'n': Count()})
            rows: user_id, window_start, window_end, n; late items to table late_events
        <BLANKLINE>
        trigger trie:
        (no trigger tasks)
    """
    trie = TriggerTrie()
    lines = [f"job {job.name}" + (f": {job.description}" if job.description else ""), "", "tasks:"]
    for task in job.tasks:
        if task.input == "stream":
            lines += _describe_stream_task(task)
            continue
        trie.register(task.name, task.trigger)
        history = f", history {task.history_events} events" + (
            f" / {task.history_s:g}s" if task.history_s is not None else "")
        lines.append(f"  {task.name}: trigger {list(task.trigger)}, input {task.input}"
                     f"{history if task.input != 'page' else ''}, sink table {task.sink}")
        lines += [f"    | {_operator_text(op)}" for op in task.pipeline]
        lines.append("    rows: user_id, trigger_ts (the firing event's), then the fields the pipeline makes")
    lines += ["", "trigger trie:", trie.render() if job.trigger_tasks else "(no trigger tasks)"]
    return "\n".join(lines)


def _describe_stream_task(task: Task) -> list[str]:
    plan = StreamPlan.of(task.name, task.pipeline)
    step = type(plan.window).__name__ + (" + Aggregate" if plan.aggregate is not None else "")
    lines = [f"  {task.name}: input stream (every event, no trigger), key {plan.key_by.name}, {step}, "
             f"sink table {task.sink}"]
    lines += [f"    | {_operator_text(op)}" for op in task.pipeline]
    if isinstance(plan.window, Process):
        rows = f"what {_function_name(plan.window)} emits (ctx.emit); its side outputs to their own tables"
    else:
        bounds = [] if isinstance(plan.window, CountWindow) else ["window_start", "window_end"]
        assert plan.aggregate is not None  # a window is followed by its Aggregate
        rows = ", ".join([plan.key_by.name, *bounds, *plan.aggregate.aggregations])
        if plan.after_window:
            rows += ", then what the steps after Aggregate make of them"
        if not isinstance(plan.window, CountWindow):
            rows += f"; late items to table {LATE}"
    return [*lines, f"    rows: {rows}"]


_ADDRESS = re.compile(r"<function ([\w.<>]+) at 0x[0-9a-f]+>|<([\w.]+) object at 0x[0-9a-f]+>")
_MAX_OPERATOR_TEXT = 400


def _operator_text(op: object) -> str:
    """An operator's repr on one line, functions and objects by name instead of address, cut if very long (a
    model's weights)."""
    if isinstance(op, Process):
        return f"Process(function={_function_name(op)}, out_of_orderness={op.out_of_orderness!r})"
    text = _ADDRESS.sub(lambda m: m.group(1) or m.group(2).rsplit(".", 1)[-1], re.sub(r"\s*\n\s*", " ", repr(op)))
    return text if len(text) <= _MAX_OPERATOR_TEXT else text[:_MAX_OPERATOR_TEXT - 4] + " ..."


def _function_name(step: Process) -> str:
    """The user's keyed process function (a class instance) or plain function of a ``Process`` step, by name."""
    function = step.function
    plain = function.fn if isinstance(function, _FunctionProcess) else None
    return plain.__qualname__ if plain is not None else type(function).__name__


def _run(job: Job, args: RunOptions, tunnel_options: TunnelOptions) -> int:
    from_kafka = kafka_topic(args.events) is not None
    if from_kafka and args.runner != "flink":
        raise ValueError(f"{args.events}: the device runner reads files; events from Kafka need --runner flink")
    # a missing file fails before any JVM
    source = None if from_kafka else open_source(args.events, args.fmt, state_ttl_s=args.state_ttl)
    tunnel_commands.check_tunnel(tunnel_options, args.runner)
    if args.runner == "flink":
        require_flink("--runner flink", args.cluster)
    if from_kafka:
        require_broker(f"--events {args.events}")
    if args.metrics_port is not None:
        if args.runner == "flink":
            raise ValueError("--metrics-port is the device runner's; a Flink job reports through Flink's metrics")
        require_extra("metrics", what="run --metrics-port")
    flush_on_signals()
    tunnel_line = ""
    with CollectiveStorage(args.db, background=True) as storage:  # COMMITs overlap the run
        if args.replace:
            storage.drop([task.sink for task in job.tasks] + list(SYSTEM_TABLES))
            discard_checkpoint(storage, job.name)
        elif not has_checkpoint(storage, job.name):  # a resumed run continues its rows; anything else adds to them
            _note_earlier_rows(storage, job)
        if args.runner == "flink":
            storage.close()  # the Flink job's writer opens the file itself
            summary = _run_on_flink(job, args, storage.path)
        else:
            tunnel = tunnel_commands.open_tunnel(tunnel_options, args.runner, storage)
            runner = DeviceRunner(job, storage, workers=args.workers, quarantine_after=args.quarantine_after,
                                  tunnel=tunnel, state_ttl_s=args.state_ttl, max_users=args.max_users,
                                  checkpoint_interval_s=args.checkpoint_interval, runtime_mode=args.mode)
            metrics = _device_metrics(runner, args.metrics_port)
            assert source is not None  # events from Kafka are the Flink runner's (checked above)
            try:
                summary = runner.run(source, progress=Track(f"{job.name} on device"))
            finally:
                runner.close()
                if metrics is not None:
                    metrics.close()
                if tunnel is not None:
                    tunnel_line = tunnel_commands.close_tunnel(tunnel, tunnel_options.wait_s)
    where = f" (cluster {args.cluster})" if args.runner == "flink" and args.cluster else ""
    print(f"job {job.name} ran on the {args.runner} runner{where} over {args.events}")
    print(summary)
    if tunnel_line:
        print(tunnel_line)
    shown = [task for task in job.tasks if summary.task_stats[task.name].rows] if args.show > 0 else []
    if shown:  # (with --show 0 the file is not opened again)
        with CollectiveStorage(summary.db_path) as storage:
            present = set(storage.tables())  # a --sink kafka:/parquet: run's shipped tables are elsewhere
            for task in shown:
                if task.sink not in present:
                    continue
                print(f"\nfirst rows of table {task.sink}:")
                for row in storage.read(task.sink).slice(0, args.show).to_pylist():
                    print("  " + ", ".join(f"{k}={_show(v)}" for k, v in row.items()))
    if args.sink is not None and args.sink.startswith("parquet:"):
        print(f"\nread them: {_python()} -c \"import pyarrow.dataset as ds; "
              f"print(ds.dataset('{args.sink.partition(':')[2]}/{job.tasks[0].sink}').to_table())\"")
    elif job.tasks:
        sql = f"SELECT * FROM {job.tasks[0].sink} LIMIT 10"
        print(f"\nquery them: {_python()} -c \"import duckdb; print(duckdb.connect('{summary.db_path}', "
              f"read_only=True).sql('{sql}'))\"")
    return 0


def _device_metrics(runner: DeviceRunner, port: int | None) -> Any:
    """The device runner's metrics server on 127.0.0.1:``port`` (:mod:`streamflow.metrics.device`), or None."""
    if port is None:
        return None
    from streamflow.metrics.device import serve_device_metrics

    server = serve_device_metrics(runner, port)
    print(f"metrics on {server.url}/metrics (and /healthz, /readyz)", file=sys.stderr)
    return server


def _note_earlier_rows(storage: CollectiveStorage, job: Job) -> None:
    """Say so when the job's tables already hold rows: a second run without --replace adds to them."""
    present = set(storage.tables())
    held = {sink: storage.query(f"SELECT count(*) FROM {quote_identifier(sink)}")[0][0]
            for sink in dict.fromkeys(task.sink for task in job.tasks) if sink in present}
    held = {sink: n for sink, n in held.items() if n}
    if held:
        tables = ", ".join(f"{sink} {n:,} rows" for sink, n in held.items())
        print(f"streamflow: note: {storage.path} already holds rows of job {job.name} ({tables}); this run adds to "
              "them (--replace starts over)", file=sys.stderr)


def _python() -> str:
    """The interpreter running streamflow (it has duckdb), relative to the working directory when inside it."""
    relative = os.path.relpath(sys.executable)
    return relative if not relative.startswith("..") else sys.executable


def _show(value: object) -> str:
    return f"<{len(value)} bytes>" if isinstance(value, bytes) else str(value)


def _run_on_flink(job: Job, args: RunOptions, db: Path) -> RunSummary:
    try:
        from streamflow.flink.runner import run_flink
    except ImportError as exc:
        raise ValueError(str(exc)) from exc
    where = f"the Flink cluster at {args.cluster}" if args.cluster else "a local Flink MiniCluster"
    print(f"streamflow: running job {job.name} on {where} (a JVM starts first; the summary follows when the job "
          "ends)", file=sys.stderr, flush=True)
    return run_flink(job, args.events, args.fmt, db, cluster=args.cluster, parallelism=args.parallelism,
                     pace_ms=args.pace_ms, checkpoint_dir=args.checkpoint_dir,
                     checkpoint_interval_ms=round((args.checkpoint_interval or 10) * 1000),
                     quarantine_after=args.quarantine_after, sink=args.sink)


if __name__ == "__main__":
    sys.exit(main())
