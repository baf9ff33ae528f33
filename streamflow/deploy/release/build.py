"""Build a signed bundle from a git repository: a tag per version, files read from the tagged tree.

The files come from the tree the tag points to (``git ls-tree``/``git cat-file``), never from the
working copy, so what is built is exactly what was tagged. The repository may hold a bundle config,
``streamflow-bundle.toml``, at its root (in the tagged tree)::

    task = "ipv"                       # the task this repository's tags are versions of
    job = "job.py"                     # the job module (default: job.py)
    include = ["job.py", "models/*"]   # which files go in (default: all but dotfiles and this config)
    exclude = ["tests/*"]
    exclusive = ["config/*"]           # fetched per device through the API; the rest are shared (CDN)
    shared = ["models/*", "*.py"]      # optional: if given, whatever it does not match is exclusive

Patterns are ``fnmatch`` patterns over the whole path (``*`` also matches ``/``); ``exclusive``
wins over ``shared``. Options given to :func:`build_bundle` (or ``streamflow bundle build``) win
over the config. Tags name versions: ``v3``, ``3``, ``1.2.0``, or ``<task>/v3`` when one
repository holds several tasks. The manifest's ``previous`` is the highest version tagged before
this one, ``created`` the tagged commit's time, so building a tag again gives the same bytes
(Ed25519 signatures are deterministic).

Symlinks and submodules in the tree are refused (a bundle holds regular files only), and so is any
file name :func:`~streamflow.deploy.manifest.check_file_name` refuses.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import subprocess
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamflow.deploy.errors import BundleError, BundleTooLarge, ManifestInvalid, UnsafePath
from streamflow.deploy.layout import MANIFEST, assemble
from streamflow.deploy.manifest import (
    FileEntry,
    Limits,
    Manifest,
    check_file_name,
    check_task_name,
    version_key,
)
from streamflow.deploy.signing import key_id, load_signing_key, sign

CONFIG = "streamflow-bundle.toml"
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")
_VERSION_TAG = re.compile(r"^(?:(?P<task>[A-Za-z_][A-Za-z0-9_]{0,62})/)?v?(?P<version>[0-9][0-9.]*)$")
_CONFIG_KEYS = {"task", "job", "include", "exclude", "shared", "exclusive"}


class GitError(BundleError):
    """git failed, or the repository or tag is not usable."""

    reason = "git"


@dataclass(frozen=True)
class BundleConfig:
    """What goes into a bundle and how each file is shipped (see the module docstring)."""

    task: str | None = None
    job: str = "job.py"
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    shared: tuple[str, ...] | None = None
    exclusive: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> BundleConfig:
        try:
            value = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ManifestInvalid(f"{CONFIG} is not valid TOML: {exc}") from None
        unknown = value.keys() - _CONFIG_KEYS
        if unknown:
            raise ManifestInvalid(f"{CONFIG}: unknown keys {sorted(unknown)} (known: {sorted(_CONFIG_KEYS)})")
        for key in ("task", "job"):
            if key in value and not isinstance(value[key], str):
                raise ManifestInvalid(f"{CONFIG}: {key} must be a string")
        lists = {}
        for key in ("include", "exclude", "shared", "exclusive"):
            if key in value:
                if not isinstance(value[key], list) or not all(isinstance(p, str) for p in value[key]):
                    raise ManifestInvalid(f"{CONFIG}: {key} must be a list of patterns")
                lists[key] = tuple(value[key])
        return cls(task=value.get("task"), job=value.get("job", "job.py"), **lists)

    def includes(self, name: str) -> bool:
        if name == CONFIG or any(part.startswith(".") for part in name.split("/")):
            return False
        return _matches(name, self.include) and not _matches(name, self.exclude)

    def scope(self, name: str) -> str:
        if _matches(name, self.exclusive):
            return "exclusive"
        return "shared" if self.shared is None or _matches(name, self.shared) else "exclusive"


def build_bundle(repo: Path, tag: str, *, signing_key: Path, out: Path, shared: Iterable[str] | None = None,
                 exclusive: Iterable[str] | None = None, task: str | None = None, job: str | None = None,
                 limits: Limits | None = None) -> Path:
    """Build and sign the bundle of ``tag`` into ``out/<task>/<version>/``; returns that directory.

    ``shared``/``exclusive`` (patterns), ``task`` and ``job`` override the repository's bundle
    config. A bundle already built there with the same manifest is left as it is; one with a
    different manifest is refused (versions are immutable).
    """
    repo, out = Path(repo), Path(out)
    limits = limits or Limits()
    if not isinstance(tag, str) or not _TAG.match(tag) or ".." in tag or "@{" in tag or tag.endswith((".", "/")):
        raise GitError(f"tag {tag!r} is not a plain tag name")
    tag_task, version = _parse_tag(tag)
    commit = _git(repo, "rev-parse", "--verify", "--quiet", f"refs/tags/{tag}^{{commit}}").decode().strip()
    if not commit:
        raise GitError(f"{repo} has no tag {tag!r}")
    tree = _list_tree(repo, commit)
    config = BundleConfig()
    if CONFIG in tree:
        config = BundleConfig.parse(_read_blobs(repo, [tree[CONFIG][0]])[0].decode("utf-8", "replace"))
    overrides: dict[str, Any] = {}
    if shared is not None:
        overrides["shared"] = tuple(shared)
    if exclusive is not None:
        overrides["exclusive"] = tuple(exclusive)
    if task is not None:
        overrides["task"] = task
    if job is not None:
        overrides["job"] = job
    config = BundleConfig(**{**config.__dict__, **overrides})
    task_name = _task_name(tag, tag_task, config.task)
    names = sorted(name for name in tree if config.includes(name))
    if config.job not in names:
        raise ManifestInvalid(f"job module {config.job!r} is not among the files of tag {tag} "
                              f"({', '.join(names[:10]) or 'none'})", bundle=f"{task_name}@{version}")
    total = sum(tree[name][1] for name in names)
    if len(names) > limits.max_files or total > limits.max_bytes:
        raise BundleTooLarge(f"{total} bytes in {len(names)} files, more than the limits ({limits.max_bytes} "
                             f"bytes, {limits.max_files} files)", bundle=f"{task_name}@{version}")
    contents = dict(zip(names, _read_blobs(repo, [tree[name][0] for name in names]), strict=True))
    private = load_signing_key(signing_key)
    manifest = Manifest.from_json({
        "format": 1, "task": task_name, "version": version, "job": config.job,
        "created": _git(repo, "show", "-s", "--format=%cI", commit).decode().strip(),
        "files": [FileEntry(name, hashlib.sha256(contents[name]).hexdigest(), len(contents[name]),
                            config.scope(name)).to_json() for name in names],
        "key_id": key_id(private.public_key()),
        "previous": _previous_version(repo, tag_task, version),
    })
    manifest_bytes = manifest.to_bytes()
    return _write_bundle(out / task_name / version, manifest_bytes, sign(private, manifest_bytes), contents)


def _write_bundle(dest: Path, manifest_bytes: bytes, signature: bytes, contents: dict[str, bytes]) -> Path:
    if dest.exists():
        if (dest / MANIFEST).is_file() and (dest / MANIFEST).read_bytes() == manifest_bytes:
            return dest
        raise BundleError(f"{dest} already holds a different build of this version; versions are immutable "
                          "(tag a new version, or remove the directory)")
    return assemble(dest, contents.items(), manifest_bytes, signature)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _parse_tag(tag: str) -> tuple[str | None, str]:
    """``(task prefix or None, version)`` of a version tag."""
    match = _VERSION_TAG.match(tag)
    if match is None:
        raise GitError(f"tag {tag!r} does not name a version (v3, 3, 1.2.0 or <task>/v3)")
    try:
        version_key(match["version"])
    except ValueError as exc:
        raise GitError(f"tag {tag!r}: {exc}") from None
    return match["task"], match["version"]


def _task_name(tag: str, tag_task: str | None, task: str | None) -> str:
    if tag_task and task and tag_task != task:
        raise GitError(f"tag {tag!r} is a version of task {tag_task!r}, but the bundle config says {task!r}")
    task = task or tag_task
    if not task:
        raise GitError(f"no task name: put `task = \"...\"` in {CONFIG}, pass --task, or tag as <task>/v<N>")
    try:
        return check_task_name(task)
    except ValueError as exc:
        raise ManifestInvalid(str(exc)) from None


def _previous_version(repo: Path, task_prefix: str | None, version: str) -> str | None:
    """The highest version tagged (in the same form: ``<task>/v<N>`` or ``v<N>``) below ``version``."""
    lower = []
    for tag in _git(repo, "tag", "--list").decode().split():
        match = _VERSION_TAG.match(tag)
        if match is None or match["task"] != task_prefix:
            continue
        try:
            key = version_key(match["version"])
        except ValueError:
            continue
        if key < version_key(version):
            lower.append((key, match["version"]))
    return max(lower)[1] if lower else None


def _list_tree(repo: Path, commit: str) -> dict[str, tuple[str, int]]:
    """Every blob of the commit's tree: path → (object id, size); symlinks and submodules refused."""
    files = {}
    for record in _git(repo, "ls-tree", "-r", "-z", "-l", "--full-tree", commit).split(b"\0"):
        if not record:
            continue
        meta, _, raw_path = record.partition(b"\t")
        mode, kind, oid, size = meta.decode().split()
        try:
            path = raw_path.decode("utf-8")
        except UnicodeDecodeError:
            raise UnsafePath(f"file name {raw_path!r} is not UTF-8") from None
        if mode == "120000":
            raise UnsafePath(f"{path!r} is a symlink; a bundle holds regular files only")
        if kind != "blob":
            raise UnsafePath(f"{path!r} is a {kind} (submodule); a bundle holds regular files only")
        files[check_file_name(path)] = (oid, int(size))
    return files


def _read_blobs(repo: Path, oids: list[str]) -> list[bytes]:
    if not oids:
        return []
    output = _git(repo, "cat-file", "--batch", stdin="".join(f"{oid}\n" for oid in oids).encode())
    blobs, pos = [], 0
    for oid in oids:
        end = output.index(b"\n", pos)
        header = output[pos:end].decode().split()
        if len(header) != 3 or header[0] != oid or header[1] != "blob":
            raise GitError(f"git cat-file: unexpected answer {output[pos:end]!r} for {oid}")
        size = int(header[2])
        blobs.append(output[end + 1:end + 1 + size])
        pos = end + 1 + size + 1
    return blobs


def _git(repo: Path, *args: str, stdin: bytes | None = None) -> bytes:
    if not repo.is_dir():
        raise GitError(f"repository {repo} is not a directory")
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
    try:
        result = subprocess.run(["git", "-C", str(repo), *args], input=stdin, capture_output=True, env=env,
                                check=False)
    except FileNotFoundError:
        raise GitError("the git command is not installed") from None
    if result.returncode != 0 and not (args[:1] == ("rev-parse",) and result.returncode == 1):
        raise GitError(f"git {args[0]} failed in {repo}: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout

