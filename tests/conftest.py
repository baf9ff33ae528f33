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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The engine's tests last, and the numba loops they run compiled in the background meanwhile (the JIT
    cache, and the ahead-of-time module the cold path loads): ~1.5 min of CPU on a fresh checkout, taken on the
    core the suite leaves idle while it waits on brokers and JVMs. Only when other tests run first."""
    engine = Path(__file__).resolve().parent / "engine"
    items.sort(key=lambda item: item.path.is_relative_to(engine))
    if (hasattr(config, "workerinput") or not items or items[0].path.is_relative_to(engine)
            or not items[-1].path.is_relative_to(engine) or importlib.util.find_spec("numba") is None):
        return  # an xdist worker (its controller starts them), nothing to overlap with, or nothing to compile
    _warmers.append((subprocess.Popen([sys.executable, str(engine / "warm_kernels.py")], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, preexec_fn=lambda: os.nice(10)), None))
    from engine.coldstart.store import default_dir
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
    """``host:port`` of a running Kafka-protocol broker: ``make test``'s, or one started for this session."""
    bootstrap = os.environ.get("STREAMFLOW_KAFKA_BOOTSTRAP")
    if bootstrap:
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
