"""Suite-wide collection rule and the property-test profile."""

import os
from pathlib import Path

import pytest
from hypothesis import settings

from tests.kafka_broker import LocalBroker

# CI explores the same examples on every run (a red CI then means a change broke something, not that
# a new random example turned up); locally the examples vary, so edge cases keep being looked for.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


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
