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


#: Each floor and the packages above it, which it imports nothing of anywhere in its code (function bodies
#: included): the engine knows nothing of streams; connectors take their configuration as arguments, and the
#: framework resolves the settings it hands them; an operator is written once for every runner.
NOTHING_ABOVE = {
    "engine": ("streamflow", "operators", "connectors"),
    "connectors": ("streamflow", "operators"),
    "operators": ("streamflow", "connectors"),
}


def test_each_floor_imports_nothing_above_it():
    """engine/, connectors/ and operators/ import nothing of the packages above them, and the engine's ground
    floor (engine/cache/, the machine-keyed cache the kernels, the session and tuning keep their results in)
    nothing else of the engine."""
    for floor, above in NOTHING_ABOVE.items():
        modules = sorted((ROOT / floor).rglob("*.py"))
        assert len(modules) > 10
        for path in modules:
            reaching = sorted(m for m in _imported_modules(path) if m.split(".")[0] in above)
            assert reaching == [], f"{path.relative_to(ROOT)} imports a floor above {floor}/: {reaching}"
    cache = sorted((ROOT / "engine" / "cache").glob("*.py"))
    assert len(cache) == 3
    for path in cache:
        reaching = sorted(m for m in _imported_modules(path)
                          if m.split(".")[0] == "engine" and m.split(".")[:2] != ["engine", "cache"])
        assert reaching == [], f"{path.relative_to(ROOT)} (the engine's ground floor) imports {reaching}"


PACKAGES = ("streamflow", "operators", "connectors", "engine")


def _module_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` under ``root`` by its dotted name (a package by its ``__init__.py``)."""
    found = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Each module of ``files`` and the modules of ``files`` it imports, anywhere in its code (function bodies
    and ``if TYPE_CHECKING:`` blocks included: a reader follows those too).

    How packages count: importing ``a.b.c`` first runs ``a/__init__.py`` and ``a/b/__init__.py``, so an import
    is an edge to the module it names and to each package above that module, except the importer's own
    packages (those have started before it runs: counting them would make a circle of every package whose
    ``__init__`` imports its modules). ``from a.b import n`` names the module ``a.b.n`` if there is one, else
    the package ``a.b`` itself, which is an edge even from a module inside ``a.b``: that module reads a name
    of the package's ``__init__``, which may be importing that very module and not have defined it yet."""
    import ast

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        named = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                named += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importer's package, one level up per further dot
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                named += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = set()
        for target in named:
            while target and target not in files:  # a name of a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                parts = target.split(".")
                graph[name].add(target)
                graph[name].update(p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                                   if p in files and p not in own and p != name)
    return graph


def _import_circles(graph: dict[str, set[str]]) -> list[str]:
    """Each group of modules that import one another back, directly or through a chain (a strongly connected
    component of ``graph`` with more than one module, Tarjan's algorithm), as its shortest circle through its
    first module in import order, and the modules of the group."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = {stack.pop()}
            while v not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    circles = []
    for group in groups:
        start = min(group)
        way, todo, circle = {start: [start]}, [start], []
        while not circle:  # breadth first, inside the group: the shortest way back to its first module
            v = todo.pop(0)
            for w in sorted(graph[v] & group):
                if w == start:
                    circle = [*way[v], start]
                    break
                if w not in way:
                    way[w] = [*way[v], w]
                    todo.append(w)
        circles.append(" -> ".join(circle) + f"  (the group: {', '.join(sorted(group))})")
    return sorted(circles)


def test_no_module_imports_itself_back():
    """No module of streamflow/, operators/, connectors/ or engine/ imports another that imports it back, directly
    or through a chain, anywhere in their code (see :func:`_import_graph` for how a package's ``__init__``
    counts): the code reads from the top down, and a module can be moved or tested with what it imports alone."""
    graph = _import_graph(_module_files(ROOT))
    assert len(graph) > 150
    assert {"engine.kernels", "engine.kernels.accel"} <= graph["engine.session"]  # the package and its module
    circles = _import_circles(graph)
    assert circles == [], "modules that import themselves back:\n" + "\n".join(circles)


def test_the_circle_finder_counts_a_package_as_its_init_runs(tmp_path):
    """The finder of :func:`test_no_module_imports_itself_back` on a made-up package: a module that takes a name
    from its own package, whose ``__init__`` imports that module, is a circle; a module importing a sibling,
    through the package or by its full name, is not; a chain is named in import order."""
    files = {"pkg/__init__.py": "from pkg.a import f\nVALUE = 1\n",
             "pkg/a.py": "def f():\n    from pkg.b import g\n",
             "pkg/b.py": "from pkg import VALUE\n",
             "pkg/c.py": "from pkg import a\nimport pkg.b\n",
             "top/__init__.py": "", "top/d.py": "from top import e\n", "top/e.py": "import top.d\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = _import_graph(_module_files(tmp_path, ("pkg", "top")))
    assert graph["pkg.c"] == {"pkg.a", "pkg.b"}
    assert _import_circles(graph) == ["pkg -> pkg.a -> pkg.b -> pkg  (the group: pkg, pkg.a, pkg.b)",
                                      "top.d -> top.e -> top.d  (the group: top.d, top.e)"]


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
    """device.py imports the batch modes, the plan it hands them (runners/plan.py) and its collaborators (the safe
    point, runners/swaps.py; the checkpoints, runners/checkpointing.py); the batch modes import the plan, and none
    of them the device runner (that no module anywhere imports itself back through another:
    :func:`test_no_module_imports_itself_back`)."""
    graph = _runner_imports()
    assert {"batch", "batch_streams", "plan", "swaps", "checkpointing"} <= graph["device"]
    for name in ("batch", "batch_streams", "plan", "swaps", "checkpointing"):
        assert "device" not in graph[name], f"runners/{name}.py imports runners/device.py"
