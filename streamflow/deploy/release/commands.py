"""``streamflow deploy-server`` and ``streamflow release publish|pin|start|status|advance|rollback``.

    streamflow deploy-server --trusted-key KEY.pub[=TASK,...] [--dir DIR] [--host 127.0.0.1] [--port 8470]
                             [--key-registry F] [--replay-events FILE] [--tunnel-reports [--topic T]]
    streamflow release publish BUNDLE_DIR
    streamflow release pin TASK VERSION
    streamflow release start TASK VERSION [--steps 1,5,20,50,100] [--beta DEV,...] [--rule os=android ...]
                             [--users U,...] [--step-interval S | --manual] [--max-failure-rate 0.05]
                             [--min-samples 20] [--no-simulate]
    streamflow release status [--json]
    streamflow release advance TASK
    streamflow release rollback TASK [--reason TEXT] [--block]

The release commands talk to the server (``--server``, default ``$STREAMFLOW_DEPLOY_SERVER``) with its
admin token (``--token-file``, default ``<$STREAMFLOW_DEPLOY_DIR>/admin.token``). Exit codes: 0 done,
1 the server could not be reached, 2 the server refused the command (the reason is printed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from streamflow.prerequisites import require_broker, require_extra, require_server
from streamflow.settings import env_name, settings

release_app = typer.Typer(help="staged releases of task bundles on the release server", no_args_is_help=True)

ServerOption = Annotated[str | None, typer.Option(help="release server URL (default: $STREAMFLOW_DEPLOY_SERVER or "
                                                       "http://127.0.0.1:8470)")]
TokenOption = Annotated[Path | None, typer.Option(help="the server's admin token file (default: "
                                                       "<$STREAMFLOW_DEPLOY_DIR>/admin.token)")]


def _admin(server: str | None, token_file: Path | None) -> Any:
    require_extra("deploy", what="streamflow release")  # admin requests are signed
    from streamflow.deploy.release.admin import AdminClient

    config = settings(deploy_server=server)
    path = token_file or config.deploy_dir / "admin.token"
    if not path.is_file():
        raise FileNotFoundError(f"admin token {path} not found: give --token-file (the release server writes "
                                "admin.token into its --dir)")
    require_server(config.deploy_server, "streamflow release", "start one with `streamflow deploy-server "
                   f"--trusted-key KEY.pub`, or give --server (or {env_name('deploy_server')})")
    return AdminClient(config.deploy_server, path.read_text())


def _run(call: Any) -> int:
    from streamflow.deploy.release.admin import AdminError

    try:
        result = call()
    except AdminError as exc:
        print(f"streamflow: error: {exc}", file=sys.stderr)
        return 1 if exc.status is None or exc.status >= 500 else 2
    if result is not None:
        print(result)
    return 0


def deploy_server(
    trusted_key: Annotated[list[str], typer.Option(help="public key (KEY.pub) whose signatures the server accepts "
                                                        "on publish (repeatable); KEY.pub=TASK,TASK accepts it "
                                                        "only for those tasks")],
    directory: Annotated[Path | None, typer.Option("--dir", help="state directory (default: $STREAMFLOW_DEPLOY_DIR"
                                                                 " or .streamflow/deploy)")] = None,
    host: Annotated[str, typer.Option(help="address to bind (127.0.0.1: this machine only)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port")] = 8470,
    replay_events: Annotated[Path | None, typer.Option(help="recorded events (CSV/JSONL) the simulation stage "
                                                            "replays through the stable and the new version")] = None,
    tunnel_reports: Annotated[bool, typer.Option("--tunnel-reports", help="also read device reports (table "
                              "deploy_reports) off the Kafka tunnel ($STREAMFLOW_KAFKA_BOOTSTRAP)")] = False,
    key_registry: Annotated[str | None, typer.Option(help="the devices' keys, which their requests and reports "
                                                          "are signed with: the tunnel's key registry (default: "
                                                          "$STREAMFLOW_KEY_REGISTRY or .streamflow/keys.json)")]
    = None,
    topic: Annotated[str | None, typer.Option(help="the tunnel's topic (default: its features topic)")] = None,
) -> int:
    """Serve release directives, bundles and the status page (``/deploy/status``) until interrupted."""
    require_extra("deploy-server", what="streamflow deploy-server")
    if tunnel_reports:
        require_broker("deploy-server --tunnel-reports")
    from streamflow.deploy.release.server import DeployServer, run
    from streamflow.deploy.release.simulation import ReplaySimulator
    from streamflow.deploy.signing import TrustedKeys

    config = settings(deploy_dir=directory)
    trusted = TrustedKeys.from_files(trusted_key)
    simulator = None
    if replay_events is not None:
        if not replay_events.is_file():
            raise FileNotFoundError(f"--replay-events {replay_events}: no such file")
        simulator = ReplaySimulator(replay_events, config.deploy_dir / "simulation", trusted)
    from connectors.tunnel.keys import KeyRegistry

    devices = KeyRegistry(settings(key_registry=key_registry).key_registry)
    server = DeployServer(config.deploy_dir, trusted, devices=devices, simulator=simulator)
    if tunnel_reports:
        server.read_tunnel_reports(topic=topic)
    print(f"release server on http://{host}:{port} (status page /deploy/status), state in {config.deploy_dir}, "
          f"admin token in {config.deploy_dir / 'admin.token'}, device keys in {devices.path} "
          f"({len(devices.devices())} devices)", flush=True)
    run(server, host, port)
    return 0


@release_app.command("publish", help="upload a built bundle (the server verifies its signature and files)")
def publish(bundle_dir: Annotated[Path, typer.Argument(help="OUT/<task>/<version> of `streamflow bundle build`")],
            server: ServerOption = None, token_file: TokenOption = None) -> int:
    admin = _admin(server, token_file)
    return _run(lambda: "published {task}@{version} (manifest sha256 {digest})".format(**admin.publish(bundle_dir)))


@release_app.command("pin", help="make a published version a task's stable version at once (a first version)")
def pin(task: str, version: str, server: ServerOption = None, token_file: TokenOption = None) -> int:
    admin = _admin(server, token_file)
    return _run(lambda: "task {task}: stable version {stable}".format(**admin.pin(task, version)))


@release_app.command("start", help="start a staged release: simulation, beta, gray steps")
def start(
    task: str, version: str,
    steps: Annotated[str, typer.Option(help="gray steps in percent, comma separated, ending at 100")]
    = "1,5,20,50,100",
    beta: Annotated[str, typer.Option(help="beta allow-list of device ids, comma separated (empty: no beta)")] = "",
    rule: Annotated[list[str] | None, typer.Option(help="device attribute rule, e.g. os=android, app_version>=7.2,"
                                                        " model=a|b (repeatable; all must match)")] = None,
    users: Annotated[str | None, typer.Option(help="only these users' devices, comma separated")] = None,
    step_interval: Annotated[float, typer.Option(help="seconds a stage lasts before it advances on its own "
                                                      "(given min-samples within the guardrail)")] = 600.0,
    manual: Annotated[bool, typer.Option("--manual", help="advance only with `streamflow release advance`")]
    = False,
    max_failure_rate: Annotated[float, typer.Option(help="guardrail: roll back when a cohort's failure rate is "
                                                         "above this")] = 0.05,
    min_samples: Annotated[int, typer.Option(help="devices a cohort needs before its failure rate counts")] = 20,
    simulate: Annotated[bool, typer.Option(help="run the simulation stage (if the server replays events)")] = True,
    server: ServerOption = None, token_file: TokenOption = None,
) -> int:
    try:
        fractions = [float(s) / 100 for s in steps.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--steps {steps!r} must be percentages separated by commas, e.g. 1,5,20,50,100") from None
    plan: dict[str, Any] = {"steps": fractions, "beta": [d.strip() for d in beta.split(",") if d.strip()],
                            "rules": rule or [], "step_interval_s": None if manual else step_interval,
                            "max_failure_rate": max_failure_rate, "min_samples": min_samples, "simulate": simulate}
    if users is not None:
        plan["users"] = [u.strip() for u in users.split(",") if u.strip()]
    admin = _admin(server, token_file)
    return _run(lambda: _describe(admin.start(task, version, plan)))


@release_app.command("status", help="tasks, releases, cohorts and blocked digests")
def status(as_json: Annotated[bool, typer.Option("--json", help="the raw JSON")] = False,
           server: ServerOption = None, token_file: TokenOption = None) -> int:
    admin = _admin(server, token_file)
    return _run(lambda: json.dumps(admin.status(), indent=2) if as_json else format_status(admin.status()))


@release_app.command("advance", help="move a task's release to its next stage now")
def advance(task: str, server: ServerOption = None, token_file: TokenOption = None) -> int:
    admin = _admin(server, token_file)
    return _run(lambda: _describe(admin.advance(task)))


@release_app.command("rollback", help="roll a task's release back (devices on it go back to the stable version)")
def rollback(task: str, reason: Annotated[str, typer.Option(help="why (recorded)")] = "by command",
             block: Annotated[bool, typer.Option("--block", help="also block the bundle's digest for good")] = False,
             server: ServerOption = None, token_file: TokenOption = None) -> int:
    admin = _admin(server, token_file)
    return _run(lambda: _describe(admin.rollback(task, reason, block)))


def _describe(release: dict[str, Any]) -> str:
    line = (f"release {release['release_id']}: {release['task']}@{release['version']} {release['status']}, stage "
            f"{release['stage']}, gray {release['fraction']:.0%}")
    return line + (f" ({release['reason']})" if release.get("reason") else "")


def format_status(status: dict[str, Any]) -> str:
    """``streamflow release status`` as text."""
    lines = ["tasks:"]
    for task, info in status["tasks"].items():
        versions = ", ".join(f"{v}: {n}" for v, n in info["versions"].items() if n) or "no devices seen"
        lines.append(f"  {task}: stable {info['stable'] or '-'}, release {info['active'] or '-'}, "
                     f"{info['devices']} devices ({versions})")
    lines.append("releases:")
    for r in status["releases"]:
        lines.append(f"  {_describe(r)}; {r['samples']} devices reporting, {r['failed']} failed "
                     f"({r['failure_rate']:.1%})")
        for name, c in r["cohorts"].items():
            lines.append(f"    cohort {name}: {c['samples']} devices, {c['failed']} failed ({c['failure_rate']:.1%})")
    if status["blocked"]:
        lines.append("blocked digests:")
        lines += [f"  {b['digest'][:16]} {b['task']}@{b['version']}: {b['reason']}" for b in status["blocked"]]
    return "\n".join(lines)
