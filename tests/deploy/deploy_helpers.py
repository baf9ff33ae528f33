"""Helpers of the deployment tests: job versions, git repositories, re-signing a manifest."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

from connectors.tunnel.keys import KeyRegistry
from streamflow.deploy.device.client import DeployClient
from streamflow.deploy.manifest import canonical_json
from streamflow.deploy.signing import load_signing_key, sign

#: A job module template: one trigger task counting the user's recent "fav" events, tagged with a version.
COUNTER_JOB = '''
from operators import Aggregate, Count, Map
from streamflow import Job, Task

VERSION = {version!r}
job = Job("counter", [Task("{task}", ["fav"], [Aggregate(n=Count()), Map(lambda r: {{**r, "v": VERSION}})],
                           input="recent", history_events=1000)])
'''


def counter_job(version: str, task: str = "counter") -> str:
    return COUNTER_JOB.format(version=version, task=task)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.com",
                           *args], check=True, capture_output=True, text=True).stdout


class Repo:
    """A git repository a test commits and tags job versions in."""

    def __init__(self, path: Path):
        self.path = path
        path.mkdir(parents=True)
        git(path, "init", "-q", "-b", "main")

    def commit(self, files: Mapping[str, str | bytes], tag: str | None = None) -> None:
        for name, content in files.items():
            target = self.path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                target.write_bytes(content)
            else:
                target.write_text(content)
        git(self.path, "add", "-A")
        git(self.path, "commit", "-qm", f"version {tag}")
        if tag:
            git(self.path, "tag", tag)


def resign(value: dict, key_path: Path) -> tuple[bytes, bytes]:
    """A manifest (as a dict) in canonical bytes, signed with the key at ``key_path``."""
    data = canonical_json(value)
    return data, sign(load_signing_key(key_path), data)


def device_client(base_url: str, registry: KeyRegistry, name: str, **options) -> DeployClient:
    """A device's client, signing with its key in ``registry`` (the tunnel's key registry; added if missing)."""
    key = registry.key_for(name) or registry.add(name)
    return DeployClient(base_url, name, key, **options)
