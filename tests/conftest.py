"""Suite-wide collection rules, the property-test profile, the brokers, and the background compiles."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from tests.kafka_broker import LocalBroker

# CI explores the same examples on every run (a red CI then means a change broke something, not that
# a new random example turned up); locally the examples vary, so edge cases keep being looked for.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


_warmers: list[tuple[subprocess.Popen, Path | None]] = []
ENGINE_TESTS = Path(__file__).resolve().parent / "engine"


def pytest_sessionstart(session: pytest.Session) -> None:
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        _start_warmers()  # xdist's controller: its workers' engine tests come last and load what this compiles


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The engine's tests last. Under xdist (``make test``: two workers, a file at a time) the files holding a
    ``slow`` test first, so that no long file starts last and ends alone."""
    items.sort(key=lambda item: item.path.is_relative_to(ENGINE_TESTS))
    if hasattr(config, "workerinput"):
        slow = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in slow)
    elif not getattr(config.option, "numprocesses", None) and items and items[-1].path.is_relative_to(ENGINE_TESTS) \
            and not items[0].path.is_relative_to(ENGINE_TESTS):
        _start_warmers()  # one process, other tests before the engine's: compile while they run


def _start_warmers() -> None:
    """Compile the engine's numba loops (the JIT cache, and the ahead-of-time module the cold path loads) in
    niced child processes: ~1.5 min of CPU on a fresh checkout, taken on the core the suite leaves idle while it
    waits on brokers and JVMs, instead of by the first engine test (or by every xdist worker at once)."""
    if importlib.util.find_spec("numba") is None:
        return
    _warmers.append((subprocess.Popen([sys.executable, str(ENGINE_TESTS / "warm_kernels.py")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      preexec_fn=lambda: os.nice(10)), None))
    from engine.cache.store import default_dir
    from engine.kernels import aot

    if aot.load(default_dir()) is None:
        build = aot.build_in_background(default_dir())
        if build is not None:
            _warmers.append((build, aot.lock_path(default_dir())))


def pytest_sessionfinish(session: pytest.Session) -> None:
    for process, lock in _warmers:
        if process.poll() is None:  # the run ended before the compiles did
            process.kill()
            process.wait()
            if lock is not None:
                lock.unlink(missing_ok=True)  # a killed build's lock would make the next run wait for it


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    # --doctest-modules (for the packages' docstring examples) would also import the suite's helper
    # modules; under tests/ only test_*.py files hold tests.
    if collection_path.suffix == ".py" and not collection_path.name.startswith(("test_", "conftest")):
        return True
    return None


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory):
    """``host:port`` of a running Kafka-protocol broker: ``make test``'s, or one started for this session.

    Each xdist worker past the first starts its own: the tests name fixed topics (the serving worker's requests and
    dead letters, say), and two workers' tests on one broker would read each other's records."""
    bootstrap = os.environ.get("STREAMFLOW_KAFKA_BOOTSTRAP")
    if bootstrap and os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":
        yield bootstrap
        return
    broker = LocalBroker(tmp_path_factory.mktemp("broker")).up()
    try:
        yield broker.bootstrap
    finally:
        broker.down()


@pytest.fixture
def private_broker(tmp_path):
    """A broker of this test's own, free to be taken down and up again."""
    broker = LocalBroker(tmp_path / "broker").up()
    try:
        yield broker
    finally:
        broker.down()
