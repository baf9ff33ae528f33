"""Task bundles: verify a signed manifest, install its files, load its job — in that order, never another.

A bundle on disk (what ``streamflow bundle build`` writes, what a device installs)::

    <task>/<version>/manifest.json   canonical JSON (:mod:`streamflow.deploy.manifest`)
    <task>/<version>/manifest.sig    raw 64-byte Ed25519 signature of manifest.json
    <task>/<version>/files/<name>    every file the manifest lists, nothing else

The order of trust: :func:`verify_manifest` checks the signature with a trusted key before the
manifest's contents are believed; :func:`install_bundle` checks every file's size and sha256 before
anything is written where the device will look; :func:`load_installed` checks all of that again on
disk, and only then :func:`load_bundle_job` runs the job module: the bytes it checked, compiled, never
imported from the disk again; the job's other files, read through ``__bundle__``, are checked at every
read. Nothing is ever unpickled. Each refusal is a :class:`~streamflow.deploy.errors.BundleError` with
a reason code.

Example (a bundle built from a git repository, then installed elsewhere and loaded):

    >>> import subprocess, tempfile, pathlib
    >>> from streamflow.deploy.release.build import build_bundle
    >>> from streamflow.deploy.signing import generate_key, public_key_path, TrustedKeys
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> repo = tmp / "repo"; repo.mkdir()
    >>> _ = (repo / "job.py").write_text("from streamflow import Job, Task\\n"
    ...     "from operators import Aggregate, Count\\n"
    ...     "job = Job('favs', [Task('favs', ['fav'], [Aggregate(n=Count())])])\\n")
    >>> _ = (repo / "streamflow-bundle.toml").write_text('task = "favs"\\n')
    >>> git = lambda *args: subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)
    >>> _ = git("init", "-q"); _ = git("add", "."); _ = git("-c", "user.name=t", "-c", "user.email=t@t",
    ...     "commit", "-qm", "v1"); _ = git("tag", "v1")
    >>> key_id = generate_key(tmp / "release.key")
    >>> built = build_bundle(repo, "v1", signing_key=tmp / "release.key", out=tmp / "out")
    >>> trusted = TrustedKeys.from_files([public_key_path(tmp / "release.key")])
    >>> manifest = verify_manifest(*read_signed(built), trusted)
    >>> manifest.label, [f.name for f in manifest.files]
    ('favs@1', ['job.py'])
    >>> installed = install_bundle(manifest, directory_fetcher(built), tmp / "device" / "favs" / "1",
    ...                            signature=read_signed(built)[1])
    >>> load_bundle_job(installed, load_installed(installed, trusted)).task_names()
    ['favs']
"""

from __future__ import annotations

import hashlib
import itertools
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol

from streamflow.deploy.errors import (
    BundleError,
    BundleTooLarge,
    DigestMismatch,
    Downgrade,
    KeyOutOfScope,
    LoadFailed,
    ManifestInvalid,
    SignatureInvalid,
    UnknownKey,
    UnsafePath,
)
from streamflow.deploy.layout import FILES, MANIFEST, SIGNATURE, assemble, read_regular
from streamflow.deploy.manifest import (
    MAX_MANIFEST_BYTES,
    FileEntry,
    Limits,
    Manifest,
    check_file_name,
    parse_json,
    version_key,
)
from streamflow.deploy.signing import SIGNATURE_BYTES, TrustedKeys
from streamflow.job import Job, JobLoadError, load_job

__all__ = [
    "BundleError", "FileEntry", "Limits", "Manifest", "check_version", "directory_fetcher",
    "install_bundle", "load_bundle_job", "load_installed", "read_signed", "verify_manifest",
]

_module_ids = itertools.count(1)


class FileCache(Protocol):
    """Where installed files come from when their digest is known (a device's
    :class:`~streamflow.deploy.device.store.ContentCache`)."""

    def holds(self, sha256: str) -> bool: ...

    def path(self, sha256: str) -> Path: ...

    def put(self, sha256: str, data: bytes) -> None: ...


def verify_manifest(manifest: bytes, signature: bytes, trusted: TrustedKeys) -> Manifest:
    """The manifest, once its signature verifies with a trusted key and every field checks out.

    Refuses with :class:`ManifestInvalid` (not JSON, not canonical, a bad field), :class:`UnknownKey`,
    :class:`SignatureInvalid`, :class:`KeyOutOfScope` (a trusted key limited to other tasks) or
    :class:`UnsafePath` (a file name that could leave the bundle).
    """
    if not isinstance(manifest, (bytes, bytearray)) or len(manifest) > MAX_MANIFEST_BYTES:
        raise ManifestInvalid(f"a manifest is at most {MAX_MANIFEST_BYTES} bytes")
    manifest = bytes(manifest)
    value = parse_json(manifest, "manifest")
    kid = value.get("key_id") if isinstance(value, dict) else None
    label = f"{value.get('task')}@{value.get('version')}" if isinstance(value, dict) else None
    if not isinstance(kid, str):
        raise ManifestInvalid("manifest names no key_id", bundle=label)
    if kid not in trusted:
        raise UnknownKey(f"signed by key {kid[:32]!r}, which this device does not trust", bundle=label)
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_BYTES:
        raise SignatureInvalid(f"signature must be {SIGNATURE_BYTES} raw bytes", bundle=label)
    if not trusted.verify(kid, manifest, bytes(signature)):
        raise SignatureInvalid(f"signature does not verify with key {kid}", bundle=label)
    parsed = Manifest.from_bytes(manifest)
    if not trusted.allows(kid, parsed.task):
        raise KeyOutOfScope(f"key {kid} may sign only {', '.join(trusted.scope(kid) or ())}, not task "
                            f"{parsed.task}", bundle=label)
    return parsed


def check_version(new: Manifest, current: Manifest | None, *, rollback: bool = False,
                  kept: Iterable[str | None] = (), highest: str | None = None) -> None:
    """Refuse a downgrade that is not the one allowed rollback (:class:`Downgrade`).

    A newer version is accepted unless it is older than ``highest``, the highest version this device
    ever accepted for the task (a device that lost its running version is not provisioned with an old
    one). An older one only when the server marks it a rollback *and* it is the version this device
    ran before and kept (``kept``: its N-1, which the caller forgets once it is rolled back to): however
    many "rollback" directives come, a device goes back one step, once — never along the chain of
    signed ``previous`` versions to a bundle it never ran.

    Example:
        >>> m = lambda v, prev=None: Manifest("t", v, "job.py", (FileEntry("job.py", "0" * 64, 1),), "0" * 16, prev)
        >>> check_version(m("3", "2"), m("2"))
        >>> check_version(m("2"), m("3", "2"), rollback=True, kept=["2"])
        >>> check_version(m("2"), m("3", "2"), rollback=True)
        Traceback (most recent call last):
        ...
        streamflow.deploy.errors.Downgrade: t@2: version 2 is older than the running 3 and not its kept N-1 (none)
        >>> check_version(m("1"), None, highest="3")
        Traceback (most recent call last):
        ...
        streamflow.deploy.errors.Downgrade: t@1: version 1 is older than 3, the highest this device has accepted
    """
    kept_versions = {v for v in kept if v is not None}
    if current is None or version_key(new.version) > version_key(current.version):
        if highest is not None and version_key(new.version) < version_key(highest) and not (
                rollback and new.version in kept_versions):
            raise Downgrade(f"version {new.version} is older than {highest}, the highest this device has accepted",
                            bundle=new.label)
        return
    if new.version == current.version:
        raise Downgrade(f"version {new.version} is already running", bundle=new.label)
    if not rollback:
        raise Downgrade(f"version {new.version} is older than the running {current.version} and the server did "
                        f"not mark it a rollback", bundle=new.label)
    if new.version not in kept_versions:
        raise Downgrade(f"version {new.version} is older than the running {current.version} and not its kept "
                        f"N-1 ({', '.join(sorted(kept_versions, key=version_key)) or 'none'})",
                        bundle=new.label)


def install_bundle(manifest: Manifest, fetch: Callable[[FileEntry], bytes], dest: Path, *,
                   max_bytes: int | None = None, max_files: int | None = None, limits: Limits | None = None,
                   signature: bytes | None = None, cache: FileCache | None = None) -> Path:
    """Fetch, check and write every file of a verified ``manifest`` into ``dest``; returns ``dest``.

    Limits (``max_bytes``/``max_files``, or ``limits``) are checked on the declared sizes before
    anything is fetched, and each fetched file must have exactly its declared size and sha256
    (:class:`BundleTooLarge`, :class:`DigestMismatch`). Files come from ``cache`` when it holds
    their digest, and fetched ones go into it (installed files are hard links to the cache's). The
    bundle is assembled in a temporary directory beside ``dest`` and renamed into place, so ``dest``
    is complete or absent; an existing ``dest`` holding the same manifest is kept.
    """
    limits = limits or Limits()
    max_bytes = limits.max_bytes if max_bytes is None else max_bytes
    max_files = limits.max_files if max_files is None else max_files
    label = manifest.label
    if len(manifest.files) > max_files:
        raise BundleTooLarge(f"{len(manifest.files)} files, more than the limit of {max_files}", bundle=label)
    if manifest.total_bytes > max_bytes:
        raise BundleTooLarge(f"{manifest.total_bytes} bytes, more than the limit of {max_bytes}", bundle=label)
    dest = Path(dest)
    if (dest / MANIFEST).is_file() and (dest / MANIFEST).read_bytes() == manifest.to_bytes():
        try:
            _check_files(dest, manifest)
            return dest
        except BundleError:
            shutil.rmtree(dest)  # damaged on disk: install it again
    if dest.exists():
        shutil.rmtree(dest)
    assemble(dest, _checked_files(manifest, fetch, cache), manifest.to_bytes(), signature)
    return dest


def read_signed(bundle_dir: Path) -> tuple[bytes, bytes]:
    """``(manifest bytes, signature)`` of a bundle directory (size-capped, never followed through a symlink)."""
    bundle_dir = Path(bundle_dir)
    return (read_regular(bundle_dir / MANIFEST, MAX_MANIFEST_BYTES, None),
            read_regular(bundle_dir / SIGNATURE, SIGNATURE_BYTES, None))


def directory_fetcher(bundle_dir: Path) -> Callable[[FileEntry], bytes]:
    """A ``fetch`` for :func:`install_bundle` reading a bundle directory (e.g. ``streamflow bundle build``'s output).

    It reads at most the declared size + 1 bytes and never follows a symlink; the digest is checked
    by whoever calls it.
    """
    root = Path(bundle_dir) / FILES

    def fetch(entry: FileEntry) -> bytes:
        return read_regular(root / check_file_name(entry.name), entry.size + 1, root)

    return fetch


def load_installed(bundle_dir: Path, trusted: TrustedKeys, *, limits: Limits | None = None) -> Manifest:
    """Verify an installed bundle again as it is on disk: signature, limits, every file's size and sha256,
    and no file that the manifest does not list. Returns its manifest."""
    bundle_dir = Path(bundle_dir)
    try:
        manifest = verify_manifest(*read_signed(bundle_dir), trusted)
    except FileNotFoundError as exc:
        raise ManifestInvalid(f"{bundle_dir} is not an installed bundle: {exc.filename} is missing") from None
    limits = limits or Limits()
    if manifest.total_bytes > limits.max_bytes or len(manifest.files) > limits.max_files:
        raise BundleTooLarge(f"{manifest.total_bytes} bytes in {len(manifest.files)} files, more than the limits "
                             f"({limits.max_bytes} bytes, {limits.max_files} files)", bundle=manifest.label)
    _check_files(bundle_dir, manifest)
    return manifest


def load_bundle_job(bundle_dir: Path, manifest: Manifest) -> Job:
    """Run the job module of a verified, installed bundle under a module name of its own.

    Call it only with the manifest :func:`load_installed` returned for ``bundle_dir``. The job file is
    read once, checked against the manifest's size and sha256, and those very bytes are compiled and
    run (never imported from the disk again: no window between the check and the import, and no
    ``__pycache__`` written into the bundle, which would make it fail its next check). The module is
    not put on ``sys.path``; its other files are at ``__bundle__.read(name)`` (:class:`BundleFiles`:
    checked against the manifest at every read). Two versions of a task live side by side as two
    modules. :class:`LoadFailed` for an import error, a job file defining no Job, or a job without tasks.
    """
    bundle_dir = Path(bundle_dir)
    root = bundle_dir / FILES
    entry = manifest.entry(manifest.job)
    try:
        source = read_regular(root / entry.name, entry.size + 1, root)
    except FileNotFoundError:
        raise DigestMismatch(f"file {entry.name!r} is missing", bundle=manifest.label) from None
    _check_bytes(entry, source, manifest.label)
    safe_version = re.sub(r"[^0-9]", "_", manifest.version)
    module_name = f"streamflow_bundle_{manifest.task}_{safe_version}_{next(_module_ids)}"
    try:
        job = load_job(root / entry.name, module_name=module_name, source=source,
                       namespace={"__bundle__": BundleFiles(bundle_dir, manifest)})
    except JobLoadError as exc:
        sys.modules.pop(module_name, None)
        raise LoadFailed(str(exc), bundle=manifest.label) from None
    if not job.tasks:
        sys.modules.pop(module_name, None)
        raise LoadFailed(f"job {job.name!r} in {manifest.job} has no tasks", bundle=manifest.label)
    return job


class BundleFiles:
    """The files of a loaded bundle as its job reads them: ``__bundle__.read("config/device.json")``.

    Each read is checked against the signed manifest's size and sha256 (:class:`DigestMismatch` if the
    file changed on disk since it was installed; a symlink is refused), so a job reading its data
    through this gets the bytes that were verified, never a file swapped in later.
    """

    def __init__(self, bundle_dir: Path, manifest: Manifest):
        self._root = Path(bundle_dir) / FILES
        self._manifest = manifest

    def names(self) -> list[str]:
        """The bundle's file names, as the manifest lists them."""
        return [entry.name for entry in self._manifest.files]

    def read(self, name: str) -> bytes:
        """The verified bytes of file ``name`` (``KeyError`` if the manifest lists no such file)."""
        try:
            entry = self._manifest.entry(name)
        except KeyError:
            raise KeyError(f"{self._manifest.label} has no file {name!r}") from None
        try:
            data = read_regular(self._root / entry.name, entry.size + 1, self._root)
        except FileNotFoundError:
            raise DigestMismatch(f"file {entry.name!r} is missing", bundle=self._manifest.label) from None
        _check_bytes(entry, data, self._manifest.label)
        return data


def unload_bundle_job(job: Job) -> None:
    """Forget the module of a job :func:`load_bundle_job` loaded (its tasks may still run until swapped out)."""
    if job.module and job.module.startswith("streamflow_bundle_"):
        sys.modules.pop(job.module, None)


# -- files ----------------------------------------------------------------------------------------
def _checked_files(manifest: Manifest, fetch: Callable[[FileEntry], bytes], cache: FileCache | None
                   ) -> Iterator[tuple[str, bytes | Path]]:
    """Each file as checked bytes, or as the path of its checked copy in the cache (linked, not copied)."""
    for entry in manifest.files:
        if cache is not None and cache.holds(entry.sha256):
            yield entry.name, cache.path(entry.sha256)
            continue
        data = fetch(entry)
        _check_bytes(entry, data, manifest.label)
        if cache is None:
            yield entry.name, data
        else:
            cache.put(entry.sha256, data)
            yield entry.name, cache.path(entry.sha256)


def _check_bytes(entry: FileEntry, data: object, label: str) -> None:
    if not isinstance(data, (bytes, bytearray)):
        raise DigestMismatch(f"file {entry.name!r}: got {type(data).__name__}, not bytes", bundle=label)
    if len(data) != entry.size:
        raise DigestMismatch(f"file {entry.name!r} is {len(data)} bytes, the manifest says {entry.size}",
                             bundle=label)
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.sha256:
        raise DigestMismatch(f"sha256 of {entry.name!r} is {digest}, the manifest says {entry.sha256}",
                             bundle=label)


def _check_files(bundle_dir: Path, manifest: Manifest) -> None:
    root = bundle_dir / FILES
    for entry in manifest.files:
        try:
            data = read_regular(root / entry.name, entry.size + 1, root)
        except FileNotFoundError:
            raise DigestMismatch(f"file {entry.name!r} is missing", bundle=manifest.label) from None
        _check_bytes(entry, data, manifest.label)
    listed = {entry.name for entry in manifest.files}
    for path in root.rglob("*"):
        name = path.relative_to(root).as_posix()
        if path.is_symlink():
            raise UnsafePath(f"{name!r} is a symlink", bundle=manifest.label)
        if not path.is_dir() and name not in listed:
            raise DigestMismatch(f"file {name!r} is not in the manifest", bundle=manifest.label)
