"""The layout: the device core, the operators and the connectors never import Flink."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEVICE_JOB = textwrap.dedent("""
    import json, sys
    import streamflow, streamflow.runners.device, operators, connectors
    from connectors.storage import CollectiveStorage
    from operators import Aggregate, Count
    from streamflow.events import PAGE_ENTER, PAGE_EXIT, Event
    from streamflow.job import Job, Task
    from streamflow.runners.device import DeviceRunner

    store = CollectiveStorage(sys.argv[1])
    job = Job("tiny", [Task("visits", ["item"], [Aggregate(n=Count())], input="page")])
    DeviceRunner(job, store).run([Event("u", PAGE_ENTER, "item", 1.6e9 + 1, {"item_id": "i"}),
                                  Event("u", "fav", "item", 1.6e9 + 2, {"item_id": "i"}),
                                  Event("u", PAGE_EXIT, "item", 1.6e9 + 3, {"item_id": "i"})])
    rows = store.query("SELECT n FROM visits")
    store.close()
    flink = sorted(m for m in sys.modules if m.startswith(("pyflink", "streamflow.flink")))
    print(json.dumps({"rows": rows, "flink_modules": flink}))
""")


def test_device_core_never_imports_flink(tmp_path):
    done = subprocess.run([sys.executable, "-c", DEVICE_JOB, str(tmp_path / "tiny.duckdb")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["rows"] == [[3]]  # the job really ran: one visit of three events
    assert report["flink_modules"] == []


def test_the_device_side_of_deployment_never_imports_the_release_server():
    """streamflow/deploy/device/ and the shared modules beside it import nothing of streamflow/deploy/release/ (the
    server, staged release, policy, the publisher's tools), anywhere in their code; importing the device side loads
    neither the release side nor aiohttp."""
    deploy = ROOT / "streamflow" / "deploy"
    device_side = [*deploy.glob("*.py"), *(deploy / "device").glob("*.py")]
    assert len(device_side) > 8
    for path in device_side:
        reaching = sorted(m for m in _imported_modules(path) if m.startswith("streamflow.deploy.release"))
        assert reaching == [], f"{path.relative_to(ROOT)} imports the release side: {reaching}"
    modules = ", ".join(f"streamflow.deploy.{p.stem}" if p.parent == deploy else f"streamflow.deploy.device.{p.stem}"
                        for p in device_side if p.stem != "__init__")
    code = (f"import json, sys; import {modules}; print(json.dumps(sorted(m for m in sys.modules "
            "if m.startswith(('aiohttp', 'streamflow.deploy.release')))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def _imported_modules(path: Path) -> set[str]:
    """The modules ``path`` imports anywhere in its code (``if TYPE_CHECKING:`` blocks and function bodies
    included; docstrings' examples are not code), each ``from m import n`` as both ``m`` and ``m.n``."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.update([node.module] + [f"{node.module}.{alias.name}" for alias in node.names])
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_connectors_import_nothing_of_the_framework():
    """No module under connectors/ imports streamflow anywhere in its code (function bodies included): connectors
    take their configuration as arguments, and the framework resolves the settings it hands them."""
    modules = sorted((ROOT / "connectors").rglob("*.py"))
    assert len(modules) > 20
    for path in modules:
        reaching = sorted(m for m in _imported_modules(path) if m == "streamflow" or m.startswith("streamflow."))
        assert reaching == [], f"{path.relative_to(ROOT)} imports the framework: {reaching}"


def _runner_imports() -> dict[str, set[str]]:
    """Each module of ``streamflow/runners/`` and the modules of that package it imports anywhere in its code."""
    folder = ROOT / "streamflow" / "runners"
    names = {path.stem for path in folder.glob("*.py")} - {"__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        found: set[str] = set()
        for module in _imported_modules(folder / f"{name}.py"):
            if module == "streamflow.runners":  # the package's __init__ imports the device runner
                found.add("device")
            elif module.startswith("streamflow.runners.") and module.split(".")[2] in names:
                found.add(module.split(".")[2])
        graph[name] = found - {name}
    return graph


def test_the_batch_modes_and_the_device_runner_import_one_way():
    """device.py imports the batch modes and the plan it hands them (runners/plan.py); the batch modes import the
    plan, never the device runner, so no module of the runners imports itself back through another."""
    graph = _runner_imports()
    assert {"batch", "batch_streams", "plan"} <= graph["device"]
    for name in ("batch", "batch_streams", "plan"):
        assert "device" not in graph[name], f"runners/{name}.py imports runners/device.py"

    def reaches(start: str, goal: str, seen: frozenset[str] = frozenset()) -> bool:
        return any(step == goal or (step not in seen and reaches(step, goal, seen | {step}))
                   for step in graph.get(start, ()))

    cycles = sorted(name for name in graph if reaches(name, name))
    assert cycles == [], f"runners modules in an import cycle: {cycles}"
