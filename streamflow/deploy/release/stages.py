"""Staged release: simulation test → beta → gray steps, failure-rate guardrail, rollback, blocked digests.

A release takes one published version of a task to the fleet:

1. **simulation** (when the manager has a simulator and the plan asks for it): the new version replays
   recorded events in the cloud on the device runtime next to the stable version; it must not raise,
   and the diff of their rows is stored with the release. A failed simulation refuses the release.
2. **beta**: only the plan's allow-list of devices (skipped when the list is empty).
3. **gray**: sticky hash cohorts, step by step (default 1 % → 5 % → 20 % → 50 % → 100 %), then
   **complete**: a uniform release becomes the task's stable version; a targeted one stays as a layer
   (see :mod:`streamflow.deploy.release.policy`).

A stage advances by command (:meth:`ReleaseManager.advance`) or on the plan's schedule
(:meth:`ReleaseManager.tick`): after ``step_interval_s`` in the stage, once the stage's newest cohort
has ``min_samples`` reporting devices within the guardrail (fewer when the cohort cannot hold that many:
all of a smaller beta; half the devices a gray band should hold, by the devices seen running the task).

**Samples and the guardrail.** Only a device the release was offered to (told to update to it; the
offers are stored) is a sample: it counts as a success once it reports success or is seen running the
version (its ``X-Streamflow-Tasks``), as a failure once it reports a failure (at load or at run time,
over HTTP or over the tunnel); failure wins. Reports and observations come from authenticated devices
only (the server checks each request's signature, the tunnel each batch's), so a process without a
device's key cannot add a sample, and one device is one sample however often it reports. Each device
belongs to one cohort: ``beta`` or the gray band its cohort point fell in (``0-1%``, ``1-5%``, ...).
When a cohort — or the release as a whole — has at least ``min_samples`` devices and its failure rate
is above ``max_failure_rate`` (or, for the beta cohort, whose size is known, once its failed devices
alone make more than that rate), the release is rolled back at once: its layer is dropped from the
policy, so every device on it is told ``rollback`` to the stable version (its N−1), and the bundle's
digest is blocked (never released again). A device whose failure was reported is not offered the release again.

Example (virtual clock; ``bundle`` is the manifest as :func:`publish` would have verified it):
    >>> import tempfile
    >>> from streamflow.deploy.release.state import ReleaseStore
    >>> now = [0.0]
    >>> manager = ReleaseManager(ReleaseStore(tempfile.mkdtemp()), clock=lambda: now[0])
    >>> for v, prev in (("1", None), ("2", "1")):
    ...     _ = manager.add_bundle(PublishedBundle("ipv", v, f"digest{v}", "key", prev), b"{}", b"sig", [])
    >>> release = manager.start("ipv", "2", ReleasePlan(steps=(0.5, 1.0), min_samples=2, max_failure_rate=0.2))
    >>> release.stage, release.fraction, manager.policy.tasks["ipv"].stable
    ('gray', 0.5, '1')
    >>> [d for d in "abcdef" if manager.decide_header(d, "ipv=1")]  # offered the release (cohort point < 0.5)
    ['a', 'b', 'c']
    >>> for device in ("d", "e", "a", "b"):  # d and e were never offered it: not counted
    ...     manager.report(device, "ipv", "2", ok=False, reason="ImportError: no module x")
    >>> release.status, release.reason, sorted(release.failed)
    ('rolled_back', 'guardrail: cohort 0-50% failure rate 100.0% (2 of 2 devices) above 20.0%', ['a', 'b'])
    >>> manager.decide_header("a", "ipv=2")
    '[{"action":"rollback","manifest":"/deploy/bundles/ipv/1/manifest.json","signature":"/deploy/bundles/ipv/1/manifest.sig","task":"ipv","version":"1"}]'
    >>> "digest2" in manager.blocked
    True
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from streamflow.deploy.manifest import check_task_name, version_key
from streamflow.deploy.protocol import parse_pairs, valid_version
from streamflow.deploy.release.policy import (
    Layer,
    Policy,
    Target,
    TaskPolicy,
    cohort_point,
)
from streamflow.deploy.release.state import ReleaseStore, StoredBundle

log = logging.getLogger("streamflow.deploy.release.stages")

DEFAULT_STEPS = (0.01, 0.05, 0.20, 0.50, 1.0)


class ReleaseError(ValueError):
    """A release command that cannot be carried out; the message says why."""


@dataclass(frozen=True)
class PublishedBundle:
    """What the release state needs of a verified manifest."""

    task: str
    version: str
    digest: str
    key_id: str
    previous: str | None = None


class Simulator(Protocol):
    """Replays recorded events through the stable and the new version (:mod:`.simulation`)."""

    def __call__(self, old: StoredBundle | None, new: StoredBundle, fetch: Callable[[str], bytes]
                 ) -> Mapping[str, Any]:
        """A JSON-able report with at least ``ok`` (bool) and ``summary`` (str); raising refuses the release.

        ``fetch`` gives a stored file's bytes by sha256.
        """


@dataclass(frozen=True)
class ReleasePlan:
    """How a release goes: gray steps (fractions ending at 1.0), beta allow-list, target, schedule, guardrail.

    ``step_interval_s`` None: stages advance only by command.

    Example:
        >>> ReleasePlan(steps=(0.1, 0.05, 1.0))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        streamflow.deploy.release.stages.ReleaseError: gray steps must rise strictly within (0, 1] and end at ...
    """

    steps: tuple[float, ...] = DEFAULT_STEPS
    beta: tuple[str, ...] = ()
    target: Target = Target()
    step_interval_s: float | None = 600.0
    max_failure_rate: float = 0.05
    min_samples: int = 20
    simulate: bool = True

    def __post_init__(self) -> None:
        steps = tuple(float(s) for s in self.steps)
        if not steps or steps[-1] != 1.0 or any(not 0 < s <= 1 for s in steps) or any(
                a >= b for a, b in zip(steps, steps[1:], strict=False)):
            raise ReleaseError(f"gray steps must rise strictly within (0, 1] and end at 1.0, got {self.steps}")
        object.__setattr__(self, "steps", steps)
        if not 0 <= self.max_failure_rate < 1:
            raise ReleaseError(f"max_failure_rate must be in [0, 1), got {self.max_failure_rate}")
        if self.min_samples < 1:
            raise ReleaseError(f"min_samples must be at least 1, got {self.min_samples}")
        if self.step_interval_s is not None and self.step_interval_s < 0:
            raise ReleaseError(f"step_interval_s must be >= 0 or None, got {self.step_interval_s}")

    def to_json(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "beta": list(self.beta), "target": self.target.to_json(),
                "step_interval_s": self.step_interval_s, "max_failure_rate": self.max_failure_rate,
                "min_samples": self.min_samples, "simulate": self.simulate}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReleasePlan:
        known = {k: data[k] for k in ("step_interval_s", "max_failure_rate", "min_samples", "simulate") if k in data}
        return cls(steps=tuple(data.get("steps", DEFAULT_STEPS)), beta=tuple(data.get("beta", ())),
                   target=Target.from_json(data.get("target") or {}), **known)


@dataclass
class CohortStats:
    """Devices of one cohort that succeeded and failed on a release."""

    ok: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)

    @property
    def samples(self) -> int:
        return len(self.ok) + len(self.failed)

    @property
    def failure_rate(self) -> float:
        return len(self.failed) / self.samples if self.samples else 0.0


@dataclass
class Release:
    """One release's state (mutable; the manager owns it)."""

    release_id: str
    seq: int
    task: str
    version: str
    digest: str
    plan: ReleasePlan
    status: str = "active"  # active | complete | rolled_back | refused
    stage: str = "simulation"  # simulation | beta | gray | complete
    step: int = -1
    fraction: float = 0.0
    started_at: float = 0.0
    stage_at: float = 0.0
    ended_at: float | None = None
    reason: str = ""
    simulation: dict[str, Any] | None = None
    failed: set[str] = field(default_factory=set)
    ok: set[str] = field(default_factory=set)  # every cohort's successes (never a failed device)
    cohorts: dict[str, CohortStats] = field(default_factory=dict)
    exposed: set[str] = field(default_factory=set)  # the devices offered it (told to update to it): the only samples

    @property
    def beta(self) -> frozenset[str]:
        return frozenset(self.plan.beta)

    def cohort_of(self, device: str) -> str:
        """``beta`` or the gray band the device's cohort point falls in."""
        if device in self.plan.beta:
            return "beta"
        point = cohort_point(self.release_id, device)
        low = 0.0
        for step in self.plan.steps:
            if point < step:
                return f"{low * 100:g}-{step * 100:g}%"
            low = step
        return f"{low * 100:g}-100%"

    def stats(self, cohort: str) -> CohortStats:
        stats = self.cohorts.get(cohort)
        if stats is None:
            stats = self.cohorts[cohort] = CohortStats()
        return stats

    def total(self) -> CohortStats:
        """The whole release as one cohort (the live sets: read, do not change)."""
        return CohortStats(self.ok, self.failed)

    def current_cohort(self) -> str:
        """The cohort the stage added last (the one whose samples gate the next step)."""
        if self.stage == "beta":
            return "beta"
        low = self.plan.steps[self.step - 1] if self.step > 0 else 0.0
        return f"{low * 100:g}-{self.plan.steps[self.step] * 100:g}%"

    def layer(self) -> Layer:
        fraction = self.fraction if self.stage in ("gray", "complete") else 0.0
        return Layer(self.release_id, self.task, self.version, fraction, self.beta, self.plan.target, self.failed)

    def row(self) -> dict[str, Any]:
        return {"release_id": self.release_id, "seq": self.seq, "task": self.task, "version": self.version,
                "digest": self.digest, "plan": self.plan.to_json(), "status": self.status, "stage": self.stage,
                "step": self.step, "fraction": self.fraction, "started_at": self.started_at,
                "stage_at": self.stage_at, "ended_at": self.ended_at, "reason": self.reason,
                "simulation": self.simulation}

    def to_json(self) -> dict[str, Any]:
        total = self.total()
        cohorts = {name: {"samples": c.samples, "failed": len(c.failed), "failure_rate": c.failure_rate}
                   for name, c in sorted(self.cohorts.items(), key=lambda kv: _cohort_order(kv[0]))}
        return {**self.row(), "samples": total.samples, "failed": len(total.failed),
                "failure_rate": total.failure_rate, "cohorts": cohorts, "exposed": len(self.exposed)}


def _cohort_order(name: str) -> float:
    return -1.0 if name == "beta" else float(name.split("-")[0])


class ReleaseManager:
    """The release state machine over a :class:`ReleaseStore`, and the policy snapshot it keeps current.

    ``clock`` gives the time (seconds; a virtual clock in the benchmark). Reports, offers and device
    observations are buffered and written by :meth:`flush` (called by :meth:`tick` every
    ``flush_every_s``); transitions are written at once. Only tasks that have a policy (a stable
    version or a release) are noted for a device, so made-up task names store nothing.
    """

    def __init__(self, store: ReleaseStore, *, clock: Callable[[], float] = time.time,
                 simulator: Simulator | None = None, coverage_every_s: float = 5.0, flush_every_s: float = 1.0):
        self.store = store
        self.clock = clock
        self.simulator = simulator
        self.coverage_every_s = coverage_every_s
        self.flush_every_s = flush_every_s
        self._lock = threading.RLock()
        self.releases: dict[str, Release] = {}
        self.active: dict[str, Release] = {}  # task → its release in progress
        self.bundles: dict[tuple[str, str], PublishedBundle] = {}
        self.stable: dict[str, str] = {}
        self.blocked: dict[str, tuple[str, str, str, float]] = {}
        self.seen: dict[str, dict[str, str]] = {}  # task → device → version it last reported
        self.counts: dict[str, Counter[str]] = {}  # task → version → devices
        self._reports: list[tuple[Any, ...]] = []
        self._reported: set[tuple[str, str, str, bool]] = set()  # reports of no release, each stored once
        self._offers: list[tuple[str, str]] = []
        self._dirty_devices: dict[tuple[str, str], tuple[str, float]] = {}
        self._last_flush = self._last_coverage = float("-inf")
        self.policy = Policy({})
        self._load()

    # -- loading ---------------------------------------------------------------------------------
    def _load(self) -> None:
        store = self.store
        for b in store.bundles():
            self.bundles[(b.task, b.version)] = PublishedBundle(b.task, b.version, b.digest, b.key_id, b.previous)
        self.stable = store.stable_versions()
        self.blocked = store.blocked()
        for row in store.releases():
            release = Release(**{**row, "plan": ReleasePlan.from_json(row["plan"])})
            self.releases[release.release_id] = release
            if release.status == "active":
                self.active[release.task] = release
            if release.status in ("active", "complete"):
                release.exposed.update(store.offers(release.release_id))
                for device, cohort, ok in store.reports(release.release_id):
                    self._count(release, device, cohort, bool(ok))
        for device, task, version in store.devices():
            self._see(device, task, version)
        self._rebuild()

    # -- publishing -------------------------------------------------------------------------------
    def add_bundle(self, bundle: PublishedBundle, manifest: bytes, signature: bytes,
                   files: Iterable[tuple[str, str, int, str]]) -> PublishedBundle:
        """Record a bundle whose signature and files the caller verified (:func:`streamflow.deploy.release.server`)."""
        check_task_name(bundle.task)
        valid_version(bundle.version)
        with self._lock:
            if bundle.digest in self.blocked:
                task, version, reason, _ = self.blocked[bundle.digest]
                raise ReleaseError(f"bundle {bundle.task}@{bundle.version} (digest {bundle.digest[:12]}) is blocked: "
                                   f"{reason}")
            known = self.bundles.get((bundle.task, bundle.version))
            if known is not None:
                if known.digest == bundle.digest:
                    return known
                raise ReleaseError(f"{bundle.task}@{bundle.version} is already published with another manifest "
                                   f"(digest {known.digest[:12]}); a version is published once")
            self.store.add_bundle(StoredBundle(bundle.task, bundle.version, bundle.digest, bundle.key_id,
                                               bundle.previous, manifest, signature, self.clock()), files)
            self.bundles[(bundle.task, bundle.version)] = bundle
        log.info("published %s@%s (digest %s)", bundle.task, bundle.version, bundle.digest[:12])
        return bundle

    def set_stable(self, task: str, version: str) -> None:
        """Make ``version`` (published) the task's stable version at once, without a staged release.

        For a task's first version; afterwards releases move the stable version.
        """
        with self._lock:
            bundle = self._bundle(task, version)
            if task in self.active:
                raise ReleaseError(f"task {task} has a release in progress ({self.active[task].release_id}); "
                                   "finish or roll it back first")
            if bundle.digest in self.blocked:
                raise ReleaseError(f"{task}@{version} is blocked: {self.blocked[bundle.digest][2]}")
            self.stable[task] = version
            self.store.set_stable(task, version)
            self._rebuild()

    def _bundle(self, task: str, version: str) -> PublishedBundle:
        bundle = self.bundles.get((task, version))
        if bundle is None:
            published = sorted(v for t, v in self.bundles if t == task)
            raise ReleaseError(f"{task}@{version} is not published (published versions of {task}: "
                               f"{', '.join(published) or 'none'})")
        return bundle

    # -- commands ---------------------------------------------------------------------------------
    def start(self, task: str, version: str, plan: ReleasePlan | None = None) -> Release:
        """Start releasing a published version (simulation first, when there is a simulator)."""
        plan = plan or ReleasePlan()
        with self._lock:
            bundle = self._bundle(task, version)
            if bundle.digest in self.blocked:
                raise ReleaseError(f"{task}@{version} (digest {bundle.digest[:12]}) is blocked: "
                                   f"{self.blocked[bundle.digest][2]}")
            if task in self.active:
                raise ReleaseError(f"task {task} already has a release in progress "
                                   f"({self.active[task].release_id}); finish or roll it back first")
            stable = self.stable.get(task)
            if stable is None and bundle.previous is not None and (task, bundle.previous) in self.bundles:
                stable = bundle.previous  # the version devices go back to if this one is rolled back
            if stable is None:
                raise ReleaseError(f"task {task} has no stable version to roll back to: publish "
                                   f"{task}@{bundle.previous or '<previous>'} (the manifest's previous) or set one "
                                   "with `streamflow release pin`")
            if version_key(version) <= version_key(stable):  # (published versions are versions)
                raise ReleaseError(f"{task}@{version} is not newer than the stable {task}@{stable}: a release "
                                   "moves forward; to go back, roll the newer one back")
            now = self.clock()
            seq = len(self.releases) + 1
            release = Release(f"{task}-{version}-{seq}", seq, task, version, bundle.digest, plan, started_at=now,
                              stage_at=now)
            self.releases[release.release_id] = release
            if task not in self.stable:
                self.stable[task] = stable
                self.store.set_stable(task, stable)
            self.store.save_release(release.row())
            self.store.add_event(release.release_id, now, "start", f"{task}@{version} over {task}@{stable}; "
                                 f"plan {plan.to_json()}")
        if plan.simulate and self.simulator is not None:
            self._simulate(self.simulator, release, stable)  # outside the lock: it runs jobs
        with self._lock:
            if release.status == "refused":
                return release
            self.active[task] = release
            if plan.beta:
                self._enter(release, "beta", -1, 0.0, "beta allow-list of " f"{len(plan.beta)} devices")
            else:
                self._enter(release, "gray", 0, plan.steps[0], f"gray {plan.steps[0]:.0%}")
        return release

    def _simulate(self, simulator: Simulator, release: Release, stable: str) -> None:
        old = self.store.bundle(release.task, stable)
        new = self.store.bundle(release.task, release.version)
        try:
            if old is None or new is None:  # (both were published: start checked them)
                raise LookupError(f"{release.task}@{stable} or @{release.version} is not in the store")
            report = dict(simulator(old, new, self._stored_file))
        except Exception as exc:  # noqa: BLE001 - any failure of the new version refuses the release
            report = {"ok": False, "summary": f"simulation raised {type(exc).__name__}: {exc}"}
        with self._lock:
            release.simulation = report
            now = self.clock()
            self.store.add_event(release.release_id, now, "simulation", report.get("summary", ""))
            if not report.get("ok"):
                release.status, release.stage, release.ended_at = "refused", "simulation", now
                release.reason = f"simulation: {report.get('summary', 'failed')}"
                self.store.add_event(release.release_id, now, "refused", release.reason)
            self.store.save_release(release.row())

    def _stored_file(self, sha256: str) -> bytes:
        path = self.store.file_path(sha256)
        if path is None:
            raise ReleaseError(f"file {sha256} is not in the server's file store")
        return path.read_bytes()

    def advance(self, task: str) -> Release:
        """Move the task's release to its next stage now."""
        with self._lock:
            release = self._active(task)
            self._advance(release, "by command")
            return release

    def rollback(self, task: str, reason: str = "by command", *, block: bool = False) -> Release:
        """Roll the task's release back (or, with none in progress, its latest completed one)."""
        with self._lock:
            release = self.active.get(task)
            if release is None:
                done = [r for r in self.releases.values() if r.task == task and r.status == "complete"]
                if not done:
                    raise ReleaseError(f"task {task} has no release in progress or completed to roll back")
                release = done[-1]
            self._rollback(release, reason, block=block)
            return release

    def _active(self, task: str) -> Release:
        release = self.active.get(task)
        if release is None:
            raise ReleaseError(f"task {task} has no release in progress")
        return release

    # -- transitions ---------------------------------------------------------------------------------
    def _enter(self, release: Release, stage: str, step: int, fraction: float, detail: str) -> None:
        now = self.clock()
        release.stage, release.step, release.fraction, release.stage_at = stage, step, fraction, now
        self.store.save_release(release.row())
        self.store.add_event(release.release_id, now, stage, detail)
        log.info("release %s: %s", release.release_id, detail)
        self._rebuild()

    def _advance(self, release: Release, why: str) -> None:
        steps = release.plan.steps
        if release.stage == "beta":
            self._enter(release, "gray", 0, steps[0], f"gray {steps[0]:.0%} ({why})")
        elif release.stage == "gray" and release.step + 1 < len(steps):
            step = release.step + 1
            self._enter(release, "gray", step, steps[step], f"gray {steps[step]:.0%} ({why})")
        elif release.stage == "gray":
            self._complete(release, why)

    def _complete(self, release: Release, why: str) -> None:
        now = self.clock()
        release.status, release.stage, release.ended_at, release.fraction = "complete", "complete", now, 1.0
        del self.active[release.task]
        if release.plan.target.uniform:
            self.stable[release.task] = release.version
            self.store.set_stable(release.task, release.version)
        self.store.save_release(release.row())
        self.store.add_event(release.release_id, now, "complete", f"{release.task}@{release.version} ({why})")
        self._rebuild()

    def _rollback(self, release: Release, reason: str, *, block: bool) -> None:
        now = self.clock()
        was_complete = release.status == "complete"
        release.status, release.ended_at, release.reason = "rolled_back", now, reason
        self.active.pop(release.task, None)
        if was_complete and self.stable.get(release.task) == release.version:
            before = self.releases_of(release.task, status="complete")
            earlier = [r.version for r in before if r.plan.target.uniform and r is not release]
            bundle = self.bundles.get((release.task, release.version))
            previous = earlier[-1] if earlier else (bundle.previous if bundle else None)
            if previous is None:
                raise ReleaseError(f"{release.task}@{release.version} has no earlier version to roll back to")
            self.stable[release.task] = previous
            self.store.set_stable(release.task, previous)
        if block:
            self.blocked[release.digest] = (release.task, release.version, reason, now)
            self.store.block(release.digest, release.task, release.version, reason, now)
        self.store.save_release(release.row())
        self.store.add_event(release.release_id, now, "rollback", reason + (" (digest blocked)" if block else ""))
        log.warning("release %s rolled back: %s", release.release_id, reason)
        self._rebuild()
        self.flush()  # the reports that led to it are stored with it

    def releases_of(self, task: str, status: str | None = None) -> list[Release]:
        return [r for r in self.releases.values() if r.task == task and (status is None or r.status == status)]

    def _rebuild(self) -> None:
        """A new policy snapshot from the current state (swapped in whole)."""
        tasks = set(self.stable) | set(self.active)
        policies = []
        for task in sorted(tasks):
            layers = []
            if task in self.active:
                layers.append(self.active[task].layer())
            done = [r for r in self.releases.values()
                    if r.task == task and r.status == "complete" and not r.plan.target.uniform]
            stable = self.stable.get(task)
            stable_key = version_key(stable) if stable is not None else ()
            layers += [r.layer() for r in sorted(done, key=lambda r: r.seq, reverse=True)
                       if version_key(r.version) > stable_key]
            policies.append(TaskPolicy(task, stable, tuple(layers)))
        self.policy = Policy.build(policies)

    # -- the request path -------------------------------------------------------------------------
    def decide_header(self, device: str, tasks_header: str, attrs_header: str | None = None,
                      user: str | None = None) -> str | None:
        """The ``X-Streamflow-Deploy`` value for one request, after noting what the device runs."""
        running = parse_pairs(tasks_header)
        self.observe(device, running)
        policy = self.policy
        out = policy.decide(device, running, parse_pairs(attrs_header) if attrs_header else None, user)
        if out:
            self._note_offers(device, running, out)
        return "[" + ",".join(out) + "]" if out else None

    def _note_offers(self, device: str, running: Mapping[str, str], out: Sequence[str]) -> None:
        """Remember the devices told to update to a release in progress: its only samples."""
        for task in running:
            release = self.active.get(task)
            if release is not None and device not in release.exposed and \
                    self.policy.tasks[task].fragment(release.version, "update") in out:
                release.exposed.add(device)
                self._offers.append((release.release_id, device))

    def observe(self, device: str, running: Mapping[str, str]) -> None:
        """Note the versions a device runs (of tasks with a policy): coverage, and a success sample for a release
        it runs and was offered."""
        now = None
        tasks = self.policy.tasks
        for task, version in running.items():
            if task not in tasks:
                continue
            seen = self.seen.get(task)
            if seen is None or seen.get(device) != version:
                if now is None:
                    now = self.clock()
                self._see(device, task, version)
                self._dirty_devices[(device, task)] = (version, now)
                release = self.active.get(task)
                if release is not None and release.version == version and device in release.exposed and \
                        device not in release.failed:
                    cohort = release.cohort_of(device)
                    with self._lock:
                        if self._count(release, device, cohort, True):
                            self._guard(release, cohort)

    def _see(self, device: str, task: str, version: str) -> None:
        seen = self.seen.setdefault(task, {})
        counts = self.counts.setdefault(task, Counter())
        before = seen.get(device)
        if before is not None:
            counts[before] -= 1
        seen[device] = version
        counts[version] += 1

    def report(self, device: str, task: str, version: str, *, ok: bool, reason: str = "", via: str = "http") -> None:
        """A device's report of ``task@version``: loaded and running (``ok``), or failed and why.

        ``device`` is authenticated by the caller. A report on a release counts only if the release was
        offered to the device, and is stored when it changes the device's standing (one device, one
        sample); a report on a version no release is about is stored once; one of a version that was
        never published is not stored.
        """
        with self._lock:
            if (task, version) not in self.bundles:
                return
            now = self.clock()
            release = self.active.get(task)
            if release is None or release.version != version:
                release = next((r for r in reversed(self.releases.values())
                                if r.task == task and r.version == version), None)
            if release is None:
                if (device, task, version, ok) not in self._reported:
                    self._reported.add((device, task, version, ok))
                    self._reports.append((now, device, task, version, None, None, int(ok), reason[:2000], via))
                return
            if device not in release.exposed:
                log.info("device %s reports on %s@%s, which it was not offered: not counted", device, task, version)
                return
            cohort = release.cohort_of(device)
            if not self._count(release, device, cohort, ok):
                return
            self._reports.append((now, device, task, version, release.release_id, cohort, int(ok), reason[:2000],
                                  via))
            if not ok:
                log.info("device %s reports %s@%s failed: %s", device, task, version, reason)
            if release.status == "active":  # a success may complete the samples a failure rate needs
                self._guard(release, cohort)

    def _count(self, release: Release, device: str, cohort: str, ok: bool) -> bool:
        """Count a device's outcome on a release; False if it changes nothing (already counted so, or failed)."""
        stats = release.stats(cohort)
        if device in release.failed or (ok and device in stats.ok):
            return False
        if ok:
            stats.ok.add(device)
            release.ok.add(device)
        else:
            release.failed.add(device)
            release.ok.discard(device)
            stats.ok.discard(device)
            stats.failed.add(device)
        return True

    def _guard(self, release: Release, cohort: str) -> None:
        """Roll ``release`` back if ``cohort`` or the whole release is over the guardrail (O(1))."""
        plan = release.plan
        if cohort == "beta" and len(release.stats("beta").failed) / len(plan.beta) > plan.max_failure_rate:
            # the beta cohort's size is known: this many failures put it over the guardrail, whatever the rest say
            failed = len(release.stats("beta").failed)
            self._rollback(release, f"guardrail: cohort beta: {failed} of its {len(plan.beta)} devices failed (at "
                                    f"least {failed / len(plan.beta):.1%}) above {plan.max_failure_rate:.1%}",
                           block=True)
            return
        for name, stats in ((f"cohort {cohort}", release.stats(cohort)), ("release", release.total())):
            if stats.samples >= plan.min_samples and stats.failure_rate > plan.max_failure_rate:
                self._rollback(release, f"guardrail: {name} failure rate {stats.failure_rate:.1%} ({len(stats.failed)}"
                                        f" of {stats.samples} devices) above {plan.max_failure_rate:.1%}", block=True)
                return

    # -- time ------------------------------------------------------------------------------------
    def tick(self) -> None:
        """Scheduled work: advance stages that are due, sample coverage, flush buffered rows."""
        now = self.clock()
        with self._lock:
            for release in list(self.active.values()):
                self._maybe_advance(release, now)
            if now - self._last_coverage >= self.coverage_every_s:
                self._last_coverage = now
                self._sample_coverage(now)
        if now - self._last_flush >= self.flush_every_s:
            self.flush()

    def _maybe_advance(self, release: Release, now: float) -> None:
        plan = release.plan
        if plan.step_interval_s is None or now - release.stage_at < plan.step_interval_s:
            return
        stats = release.stats(release.current_cohort())
        if release.stage == "beta":
            needed = min(plan.min_samples, len(plan.beta))
        else:  # a small fleet's band may hold fewer devices than min_samples: then half of those it should hold
            low = plan.steps[release.step - 1] if release.step > 0 else 0.0
            expected = (plan.steps[release.step] - low) * len(self.seen.get(release.task, ()))
            needed = min(plan.min_samples, int(expected / 2))  # 0 for a band too small to hold anyone
        if stats.samples >= needed and stats.failure_rate <= plan.max_failure_rate:
            self._advance(release, f"on schedule: {stats.samples} devices, {stats.failure_rate:.1%} failed")

    def _sample_coverage(self, now: float) -> None:
        rows = []
        for release in self.releases.values():
            if release.status == "active" or (release.ended_at is not None and now - release.ended_at <
                                              2 * self.coverage_every_s):
                total = release.total()
                counts = self.counts.get(release.task, Counter())
                rows.append((release.release_id, now, release.fraction, len(self.seen.get(release.task, ())),
                             counts[release.version], total.samples, len(total.failed)))
        self.store.add_coverage(rows)

    def flush(self) -> None:
        """Write buffered reports and device versions."""
        with self._lock:
            reports, self._reports = self._reports, []
            offers, self._offers = self._offers, []
            devices, self._dirty_devices = self._dirty_devices, {}
            self._last_flush = self.clock()
        self.store.add_offers(offers)
        self.store.add_reports(reports)
        self.store.save_devices([(d, t, v, at) for (d, t), (v, at) in devices.items()])

    # -- reading -----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Everything the status page and ``streamflow release status`` show, JSON-able."""
        with self._lock:
            tasks = {}
            for task in sorted(set(self.stable) | set(self.active) | {t for t, _ in self.bundles}):
                seen = self.seen.get(task, {})
                active = self.active.get(task)
                tasks[task] = {"stable": self.stable.get(task), "devices": len(seen),
                               "versions": dict(sorted(self.counts.get(task, Counter()).items())),
                               "active": active.release_id if active else None,
                               "published": sorted((v for t, v in self.bundles if t == task), key=version_key)}
            return {"now": self.clock(), "tasks": tasks,
                    "releases": [r.to_json() for r in sorted(self.releases.values(), key=lambda r: -r.seq)],
                    "blocked": [{"digest": d, "task": t, "version": v, "reason": why, "at": at}
                                for d, (t, v, why, at) in self.blocked.items()]}

    def coverage(self, release_id: str) -> list[tuple[float, float, int, int, int, int]]:
        self.flush()
        return self.store.coverage(release_id)
