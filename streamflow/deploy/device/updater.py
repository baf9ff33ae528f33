"""The device side of deployment: the server's directives in, verified task versions hot-swapped in the runner.

On every app request the device tells the release server which task versions it runs
(:meth:`Updater.versions`, the ``X-Streamflow-Tasks`` header) and the response may carry directives
(``X-Streamflow-Deploy``: ``[{"task", "version", "manifest", "signature", "action"}]``). For each,
:meth:`Updater.apply`:

1. fetches the manifest and its signature and verifies them with the trusted keys; checks that it is
   the task and version the directive names, that it is not a downgrade other than the one allowed
   rollback — to the kept N-1, once; never below the highest version accepted otherwise
   (:func:`~streamflow.deploy.bundle.check_version`) — and not a manifest that already failed on this
   device;
2. installs its files into the store (shared files come from the cache when another version or task
   already brought them), each checked against its size and sha256;
3. verifies the installed bundle again from disk, imports its job module under a module name of
   its own, and swaps the job's tasks for the old version's at the runner's safe point between two
   events (:meth:`~streamflow.runners.device.DeviceRunner.swap_tasks`): no event lost, the other
   tasks' state untouched;
4. records the new version as current with the old one as N-1 (kept on disk), and reports.

A refusal at any step (each a :class:`~streamflow.deploy.errors.BundleError` with its reason code)
is reported to the server and changes nothing: the old version keeps running.

**Failing at load, and the local rollback.** A new version *fails at load* when its job module does
not import or defines no valid job (step 3, before the swap: the old version never stopped), when the
runner refuses its tasks (a name clash, an operator checkpoints cannot hold), or during its
*probation* — until each of its tasks has run ``probation_firings`` times without raising — when a
task is quarantined or has raised on ``probation_firings`` runs without one success. Probation is
judged at the runner's safe point (a hook armed by the swap itself, so it counts from the new
version's first event and does not wait for an app request): the device swaps the kept N-1 back in
before the next event, so the failing runs are the only events the new version saw (they are in
``task_errors`` with their events, as any task failure) and every later event runs on N-1. The
failed manifest is blocked locally (not installed again, however often the server names it; that
refusal is reported once) and ``failed_on_first_events`` is reported; :meth:`check` (called by every
:meth:`apply`) does the bookkeeping. A first install that fails is removed.

Example:
    >>> import tempfile, pathlib
    >>> from connectors import CollectiveStorage
    >>> from streamflow import Job
    >>> from streamflow.deploy.signing import TrustedKeys
    >>> from streamflow.runners.device import DeviceRunner
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> runner = DeviceRunner(Job("device"), CollectiveStorage(tmp / "f.duckdb"))
    >>> updater = Updater(runner, client=None, trusted=TrustedKeys(), store_dir=tmp / "store")
    >>> outcome = updater.apply([{"task": "ipv", "version": "x"}])[0]
    >>> outcome.status, outcome.reason.split(":")[0]
    ('refused', 'bad_directive')
    >>> updater.versions(), updater.tasks_header()
    ({}, '')
    >>> runner.close()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from streamflow.deploy.bundle import check_version, load_bundle_job, verify_manifest
from streamflow.deploy.device.store import BundleStore
from streamflow.deploy.errors import (
    BundleError,
    DirectiveInvalid,
    FailedOnFirstEvents,
    LoadFailed,
    LocallyBlocked,
)
from streamflow.deploy.manifest import FileEntry, Limits, Manifest, check_task_name, version_key
from streamflow.deploy.protocol import valid_version
from streamflow.deploy.signing import TrustedKeys
from streamflow.job import Job
from streamflow.runners.device import DeviceRunner
from streamflow.runners.swaps import TaskSwap

log = logging.getLogger("streamflow.deploy")

ACTIONS = ("update", "rollback")


class BundleSource(Protocol):
    """Where the updater gets bundles from and reports to: the device's HTTP client
    (``streamflow.deploy.device.client.DeployClient``) or a bundles directory
    (:class:`~streamflow.deploy.device.directory.DirectoryClient`).

    ``tasks`` is what the device runs (task → version); the updater keeps it current, so that the
    client's next request carries it.
    """

    tasks: dict[str, str]

    def fetch_manifest(self, directive: Mapping[str, Any]) -> tuple[bytes, bytes]:
        """``(manifest bytes, signature bytes)`` from the directive's ``manifest`` and ``signature`` paths."""

    def fetch_file(self, entry: FileEntry) -> bytes:
        """A file's bytes: shared ones from the static path, exclusive ones from the API (at most its size)."""

    def report(self, task: str, version: str, ok: bool, reason: str = "") -> object:
        """Tell the server how a version did on this device."""


class AppClient(BundleSource, Protocol):
    """A bundle source that also carries the app's own requests (the piggyback protocol)."""

    def request(self, path: str, **options: Any) -> tuple[Any, list[dict[str, str]]]:
        """An app request carrying ``tasks``; the response and the deploy directives on it."""


@dataclass(frozen=True)
class Outcome:
    """What a directive (or a check) did for one task.

    ``status``: ``installed`` (the new version runs), ``rolled_back`` (the server's rollback runs),
    ``local_rollback`` (the new version failed on its first events; N-1 runs again), ``refused``
    (nothing changed; ``reason`` says why, ``"<code>: <message>"``), ``unchanged`` (already running),
    ``pending`` (the swap waits for the runner's next event), ``resumed`` (loaded again after a restart).
    """

    task: str
    version: str
    status: str
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status not in ("refused", "local_rollback")


@dataclass
class Running:
    """A task version loaded in the runner: its verified manifest and the job its module defined."""

    manifest: Manifest
    job: Job

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.job.task_names())


@dataclass
class _Pending:
    swap: TaskSwap
    new: Running
    old: Running | None
    kind: str  # "update" | "rollback" | "resume"
    probation: _Probation | None = None


class _Probation:
    """A new version's first runs, judged at the runner's safe point (a runner hook: it runs on the runner's
    thread, before each event). It is armed by the swap itself (counting from the swap's safe point on),
    and at the first sign of failure it swaps N-1 back right there: no event reaches a failing version
    after it is judged, and none falls between the two versions."""

    def __init__(self, runner: DeviceRunner, new: Running, old: Running | None, firings: int):
        self.runner, self.new, self.old, self.firings = runner, new, old, firings
        self.baseline: dict[str, tuple[int, int]] | None = None  # set when the swap is applied
        self.failure: FailedOnFirstEvents | None = None
        self.rollback: TaskSwap | None = None  # set once the rollback is requested (after ``failure``)
        self.passed = False
        self.cancelled = False
        self.lock = threading.Lock()  # the hook (runner thread) against a cancel (an app request's thread)

    def arm(self) -> None:
        """The swap's ``on_applied``: count from here (runner thread, before the new version's first event)."""
        self.baseline = {name: _ok_and_errors(self.runner, name) for name in self.new.names}

    def __call__(self) -> bool:
        with self.lock:
            if self.cancelled:
                return False
            if self.baseline is None:  # the swap is not applied yet
                return True
            verdict = self.verdict(self.baseline)
            if verdict is None:
                return True
            if verdict is True:
                self.passed = True
                return False
            self.failure = FailedOnFirstEvents(verdict, bundle=self.new.manifest.label)
            self.rollback = self.runner.swap_tasks(add=self.old.job.tasks if self.old else (), remove=self.new.names)
            return False

    def cancel(self) -> bool:
        """Stop watching (the version is replaced, or never came in); False if the rollback was already requested."""
        with self.lock:
            self.cancelled = self.rollback is None
            return self.cancelled

    def verdict(self, baseline: dict[str, tuple[int, int]]) -> str | Literal[True] | None:
        """A failure (why), True (every task ran ``firings`` times without raising), or None (not yet known)."""
        stats = self.runner.summary.task_stats
        passed = True
        for name in self.new.names:
            task_stats = stats.get(name)
            if task_stats is not None and task_stats.quarantined:
                return f"task {name} was quarantined after {task_stats.consecutive_errors} consecutive failures"
            ok, errors = (now - before for now, before in zip(_ok_and_errors(self.runner, name), baseline[name],
                                                             strict=True))
            if errors >= self.firings and ok == 0:
                return f"task {name} raised on each of its first {errors} runs"
            passed = passed and ok >= self.firings
        return passed or None


def _ok_and_errors(runner: DeviceRunner, name: str) -> tuple[int, int]:
    """A task's successful runs and failures so far (a trigger task counts every run as fired, failures too;
    a stream task counts its rows)."""
    task_stats = runner.summary.task_stats.get(name)
    if task_stats is None:
        return 0, 0
    task = runner.tasks.get(name)
    stream = task is not None and task.input == "stream"
    return (task_stats.fired if stream else task_stats.fired - task_stats.errors), task_stats.errors


class Updater:
    """Applies deploy directives to a :class:`~streamflow.runners.device.DeviceRunner` (see the module docstring).

    Thread-safe: app requests may call :meth:`apply` from any thread while the runner runs.
    """

    def __init__(self, runner: DeviceRunner, client: BundleSource | None, trusted: TrustedKeys, store_dir: Path,
                 *, limits: Limits | None = None, probation_firings: int = 3, swap_timeout_s: float = 1.0):
        if probation_firings < 1:
            raise ValueError(f"probation_firings must be >= 1, got {probation_firings}")
        self.runner = runner
        self.client = client
        self.trusted = trusted
        self.store = BundleStore(Path(store_dir), trusted, limits)
        self.probation_firings = probation_firings
        self.swap_timeout_s = swap_timeout_s
        self._running: dict[str, Running] = {}
        self._previous: dict[str, Running] = {}  # N-1 in memory, for a local rollback without a reload
        self._pending: dict[str, _Pending] = {}
        self._probation: dict[str, _Probation] = {}
        self._reported_blocked: set[str] = set()
        self._lock = threading.RLock()

    # -- what the device runs --------------------------------------------------------------------
    def versions(self) -> dict[str, str]:
        """Deployed task → the version running (what the ``X-Streamflow-Tasks`` header carries)."""
        with self._lock:
            return {task: running.manifest.version for task, running in sorted(self._running.items())}

    def tasks_header(self) -> str:
        """The ``X-Streamflow-Tasks`` header value: ``ipv=2,sessions=1``."""
        return ",".join(f"{task}={version}" for task, version in self.versions().items())

    # -- directives --------------------------------------------------------------------------
    def request(self, path: str, **options: Any) -> tuple[Any, list[Outcome]]:
        """Make an app request through the client (an :class:`AppClient`) carrying this device's task
        versions, and apply the directives its response carries; ``(response, outcomes)``."""
        request = getattr(self.client, "request", None)  # an AppClient's; a bundles directory makes no requests
        if request is None:
            raise AttributeError(f"{type(self.client).__name__} makes no app requests (an AppClient does)")
        response, directives = request(path, tasks=self.versions(), **options)
        return response, self.apply(directives)

    def apply(self, directives: Iterable[Mapping[str, Any]] | None, *, source: BundleSource | None = None
              ) -> list[Outcome]:
        """Apply the directives of one server response (None or empty: only :meth:`check`).

        ``source`` fetches the bundles instead of the client, e.g. a
        :class:`~streamflow.deploy.device.directory.DirectoryClient` over the bundles an app ships with, to
        provision a device with its first versions (the server changes the versions of tasks a device
        runs; it does not add tasks). They are verified the same way; reports still go to the client.
        """
        with self._lock:
            outcomes = self._check()
            for directive in directives or ():
                outcome = self._apply_one(directive, source or self.client)
                log.info("deploy %s@%s: %s%s", outcome.task, outcome.version, outcome.status,
                         f" ({outcome.reason})" if outcome.reason else "")
                outcomes.append(outcome)
            self._publish()
            return outcomes

    def check(self) -> list[Outcome]:
        """Settle swaps the runner has applied since, and the local rollbacks its safe point made (reported,
        blocked, the store's state updated)."""
        with self._lock:
            outcomes = self._check()
            self._publish()
            return outcomes

    def resume(self) -> list[Outcome]:
        """After a restart: load each task's current version from the store (verified again), or its N-1 if
        the current one no longer verifies or loads. Call it before the runner's run (a checkpoint of
        the runner's job then matches)."""
        outcomes = []
        with self._lock:
            for task in self.store.tasks():
                if task in self._running:
                    continue
                state = self.store.state(task)
                for version in (state.current, state.previous):
                    if version is None:
                        continue
                    try:
                        new = self._load(task, version)
                        self._check_names(task, new)
                    except BundleError as exc:
                        outcomes.append(self._refuse(task, version, exc))
                        continue
                    previous = state.previous if version == state.current else None
                    self.store.set_state(task, version, previous)
                    outcomes.append(self._swap(task, _Pending(
                        self.runner.swap_tasks(add=new.job.tasks), new, None, "resume")))
                    break
            self._publish()
        return outcomes

    def _apply_one(self, directive: Mapping[str, Any], source: BundleSource | None) -> Outcome:
        try:
            task, version, action = _parse_directive(directive)
        except DirectiveInvalid as exc:
            task = str(directive.get("task", "?"))[:64] if isinstance(directive, Mapping) else "?"
            version = str(directive.get("version", "?"))[:32] if isinstance(directive, Mapping) else "?"
            return self._refuse(task, version, exc)
        if task in self._pending:
            return Outcome(task, version, "pending", "a swap of this task waits for the runner's next event")
        running = self._running.get(task)
        if running is not None and running.manifest.version == version:
            return Outcome(task, version, "unchanged")
        try:
            new = self._fetch_verified(task, version, action, directive, running, source)
            self._check_names(task, new)
        except BundleError as exc:
            return self._refuse(task, version, exc)
        except Exception as exc:  # the client's own failure (network, HTTP status): nothing changed
            return self._refuse(task, version, exc)
        kind = "rollback" if running is not None and version_key(version) < version_key(
            running.manifest.version) else "update"
        probation = self._probation.get(task)
        if probation is not None:  # the version on probation is being replaced anyway
            if not probation.cancel():
                return Outcome(task, version, "pending", f"{probation.new.manifest.label} is being rolled back locally")
            del self._probation[task]
        watch = _Probation(self.runner, new, running, self.probation_firings) if kind == "update" else None
        if watch is not None:  # watching before the swap can apply: the verdict comes at the first safe point
            self.runner.add_safe_point_hook(watch)
        swap = self.runner.swap_tasks(add=new.job.tasks, remove=running.names if running else (),
                                      on_applied=watch.arm if watch is not None else None)
        return self._swap(task, _Pending(swap, new, running, kind, watch))

    def _fetch_verified(self, task: str, version: str, action: str, directive: Mapping[str, Any],
                        running: Running | None, source: BundleSource | None) -> Running:
        """The directive's version, verified, installed and loaded (nothing swapped yet)."""
        state = self.store.state(task)
        kept = [state.previous] if state.previous else []
        local = action == "rollback" and version in kept and version in self.store.installed(task)
        if local:
            manifest = self.store.load(task, version)  # the kept N-1: verified again from disk, no download
        else:
            if source is None:
                raise DirectiveInvalid("no client to fetch the bundle with", bundle=f"{task}@{version}")
            manifest_bytes, signature = source.fetch_manifest(directive)
            fetch_file = source.fetch_file
            manifest = verify_manifest(manifest_bytes, signature, self.trusted)
            if (manifest.task, manifest.version) != (task, version):
                raise DirectiveInvalid(f"the directive names {task}@{version} but its manifest is {manifest.label}",
                                       bundle=manifest.label)
        self._refuse_blocked(manifest)
        check_version(manifest, running.manifest if running else None, rollback=action == "rollback", kept=kept,
                      highest=state.highest)
        if not local:
            self.store.install(manifest, signature, fetch_file)
            manifest = self.store.load(task, version)  # what runs is what is on disk, verified there
        return self._load(task, version, manifest)

    def _load(self, task: str, version: str, manifest: Manifest | None = None) -> Running:
        manifest = manifest or self.store.load(task, version)
        try:
            job = load_bundle_job(self.store.bundle_dir(task, version), manifest)
        except LoadFailed:
            self.store.block(manifest.digest, "load_failed")
            raise
        return Running(manifest, job)

    def _refuse_blocked(self, manifest: Manifest) -> None:
        why = self.store.blocked(manifest.digest)
        if why is not None:
            raise LocallyBlocked(f"manifest {manifest.digest[:16]} failed on this device before ({why})",
                                 bundle=manifest.label)

    def _check_names(self, task: str, new: Running) -> None:
        """The new job's task names must be free: not run by another deployed task nor by the app's own job."""
        mine = set(self._running[task].names) if task in self._running else set()
        owners = {name: other for other, running in self._running.items() if other != task
                  for name in running.names}
        clashes = [f"{name} (run by {owners.get(name, 'the app')})" for name in new.names
                   if name in self.runner.tasks and name not in mine]
        if clashes:
            self.store.block(new.manifest.digest, "load_failed")
            raise LoadFailed(f"task names already in use: {', '.join(clashes)}", bundle=new.manifest.label)

    # -- swaps -------------------------------------------------------------------------------
    def _swap(self, task: str, pending: _Pending) -> Outcome:
        self._pending[task] = pending
        if pending.swap.wait(self.swap_timeout_s):
            return self._settle(task)
        return Outcome(task, pending.new.manifest.version, "pending", "the swap waits for the runner's next event")

    def _settle(self, task: str) -> Outcome:
        pending = self._pending.pop(task)
        new, old = pending.new, pending.old
        if pending.swap.error is not None:  # refused by the runner: nothing changed there
            if pending.probation is not None:
                pending.probation.cancel()
            error = LoadFailed(f"the runner refused the tasks: {pending.swap.error}", bundle=new.manifest.label)
            self.store.block(new.manifest.digest, "load_failed")
            return self._refuse(task, new.manifest.version, error)
        self._running[task] = new
        version = new.manifest.version
        if pending.kind == "resume":
            return Outcome(task, version, "resumed")
        if pending.kind == "update":
            self.store.set_state(task, version, old.manifest.version if old else None)
            if old is not None:
                self._previous[task] = old
            if pending.probation is not None:  # (an update always has one)
                self._probation[task] = pending.probation
        else:  # the server's rollback
            self.store.set_state(task, version, None)
            self._previous.pop(task, None)
        self.store.prune(task)
        self._report(task, version, True, "")
        return Outcome(task, version, "installed" if pending.kind == "update" else "rolled_back")

    def _check(self) -> list[Outcome]:
        outcomes = [self._settle(task) for task in [t for t, p in self._pending.items() if p.swap.done()]]
        for task, probation in list(self._probation.items()):
            if probation.passed:
                del self._probation[task]
            elif probation.rollback is not None and probation.rollback.done():
                del self._probation[task]
                outcomes.append(self._rolled_back_locally(task, probation))
        return outcomes

    def _rolled_back_locally(self, task: str, probation: _Probation) -> Outcome:
        """Bookkeeping after the runner swapped a failing new version out at its safe point."""
        bad, old, failure, rollback = probation.new, probation.old, probation.failure, probation.rollback
        assert failure is not None and rollback is not None
        self.store.block(bad.manifest.digest, failure.reason)
        self._report(task, bad.manifest.version, False, failure.report())
        if rollback.error is not None:  # the runner refused to take N-1 back: the failing version runs on
            log.error("deploy %s: rolling %s back failed: %s", task, bad.manifest.label, rollback.error)
            return Outcome(task, bad.manifest.version, "refused",
                           f"{failure.report()}; the rollback was refused: {rollback.error}")
        self._previous.pop(task, None)
        if old is not None:
            self._running[task] = old
            self.store.set_state(task, old.manifest.version, None)
        else:  # a first install that failed: the task is gone
            self._running.pop(task, None)
            self.store.set_state(task, None, None)
        self.store.prune(task)
        return Outcome(task, bad.manifest.version, "local_rollback", failure.report())

    # -- reporting -----------------------------------------------------------------------------
    def _publish(self) -> None:
        """Let the client's next request carry the versions now running."""
        if self.client is not None:
            self.client.tasks = {task: running.manifest.version for task, running in sorted(self._running.items())}

    def _refuse(self, task: str, version: str, error: Exception) -> Outcome:
        reason = error.report() if isinstance(error, BundleError) else f"fetch_failed: {type(error).__name__}: {error}"
        log.warning("deploy %s@%s refused: %s", task, version, reason)
        if isinstance(error, LocallyBlocked):
            if reason in self._reported_blocked:  # the server may name it on every request: report once
                return Outcome(task, version, "refused", reason)
            self._reported_blocked.add(reason)
        self._report(task, version, False, reason)
        return Outcome(task, version, "refused", reason)

    def _report(self, task: str, version: str, ok: bool, reason: str) -> None:
        if self.client is None:
            return
        try:
            self.client.report(task, version, ok, reason)
        except Exception as exc:  # reporting is best effort: the device goes on
            log.warning("deploy %s@%s: report to the server failed: %s", task, version, exc)


def _parse_directive(directive: Any) -> tuple[str, str, str]:
    if not isinstance(directive, Mapping):
        raise DirectiveInvalid(f"a directive is a JSON object, got {type(directive).__name__}")
    try:
        task = check_task_name(directive.get("task"))
        version = valid_version(directive.get("version"))
    except ValueError as exc:
        raise DirectiveInvalid(f"directive {dict(directive)!r}: {exc}") from None
    action = directive.get("action", "update")
    if action not in ACTIONS:
        raise DirectiveInvalid(f"directive action {action!r} is not one of {ACTIONS}", bundle=f"{task}@{version}")
    return task, version, action
