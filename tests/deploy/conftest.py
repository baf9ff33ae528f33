"""Fixtures for the deployment tests: a signing key the device trusts, and git repositories of job versions."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from deploy_helpers import Repo, counter_job

from connectors.tunnel.keys import KeyRegistry
from streamflow.deploy.signing import TrustedKeys, generate_key, public_key_path


@pytest.fixture
def signing_key(tmp_path) -> Path:
    path = tmp_path / "keys" / "release.key"
    generate_key(path)
    return path


@pytest.fixture
def trusted(signing_key) -> TrustedKeys:
    return TrustedKeys.from_files([public_key_path(signing_key)])


@pytest.fixture
def device_keys(tmp_path) -> KeyRegistry:
    """The devices' keys (the tunnel's key registry) the release server authenticates them with."""
    return KeyRegistry(tmp_path / "keys.json")


@pytest.fixture
def make_repo(tmp_path) -> Callable[[str], Repo]:
    return lambda name="repo": Repo(tmp_path / name)


@pytest.fixture
def counter_repo(make_repo) -> Repo:
    """Task "counter": v1 and v2 of the counter job, a shared model file, an exclusive config file."""
    repo = make_repo("counter")
    repo.commit({"streamflow-bundle.toml": 'task = "counter"\nexclusive = ["config/*"]\n',
                 "job.py": counter_job("1"), "models/weights.bin": bytes(range(256)) * 64,
                 "config/device.json": '{"threshold": 1}', "README.md": "not a job file, still shipped",
                 ".gitignore": "*.pyc\n"}, tag="v1")
    repo.commit({"job.py": counter_job("2")}, tag="v2")
    return repo
