"""The simulation stage of a release: the new version replayed in the cloud on recorded events, beside the old.

:class:`ReplaySimulator` installs both versions from the release server's file store exactly as a
device would (signature, every digest, then load: :mod:`streamflow.deploy.bundle`), runs each job on
the device runtime over the same recorded events (:func:`streamflow.testing.run_job`) and compares
their rows table by table (:func:`streamflow.testing.rows_diff`). The new version must not raise: a
load failure, an exception out of the run, or any ``task_errors`` row fails the simulation and the
release is refused. Differences in rows are reported (counts and examples), not failed: a new version
is usually meant to change its rows; with ``max_changed_fraction`` set, changing more rows than that
fails too.

Example (what a report looks like)::

    {"ok": true, "summary": "counter@2 on 10000 events: no task error; 1 of 1 tables differ (4210 rows only
     in the old version, 4210 only in the new)", "events": 10000, "tables": {...}, "diff": [...]}
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from streamflow.deploy.bundle import install_bundle, load_bundle_job, load_installed, verify_manifest
from streamflow.deploy.release.state import StoredBundle
from streamflow.deploy.signing import TrustedKeys
from streamflow.summary import TASK_ERRORS_TABLE
from streamflow.testing import rows_diff, run_job


class ReplaySimulator:
    """Replays ``events`` (a CSV or JSONL file) through the stable and the new version of a task."""

    def __init__(self, events: str | Path, work_dir: str | Path, trusted: TrustedKeys | None = None,
                 max_changed_fraction: float | None = None):
        self.events = Path(events)
        self.work_dir = Path(work_dir)
        self.trusted = trusted
        self.max_changed_fraction = max_changed_fraction

    def __call__(self, old: StoredBundle | None, new: StoredBundle, fetch: Callable[[str], bytes]
                 ) -> Mapping[str, Any]:
        if self.trusted is None:
            raise ValueError("the simulator needs the server's trusted keys to load bundles")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="simulation-", dir=self.work_dir))
        try:
            new_rows, new_label = self._run(new, fetch, tmp / "new")
            old_rows, _ = self._run(old, fetch, tmp / "old") if old is not None else ({}, None)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return compare(new_label, old_rows, new_rows, self.max_changed_fraction)

    def _run(self, stored: StoredBundle, fetch: Callable[[str], bytes], dest: Path) -> tuple[dict, str]:
        trusted = self.trusted
        assert trusted is not None  # (__call__ checked it)
        manifest = verify_manifest(stored.manifest, stored.signature, trusted)
        installed = install_bundle(manifest, lambda entry: fetch(entry.sha256), dest, signature=stored.signature)
        job = load_bundle_job(installed, load_installed(installed, trusted))
        return run_job(job, self.events), manifest.label


def compare(label: str, old: Mapping[str, list[dict[str, Any]]], new: Mapping[str, list[dict[str, Any]]],
            max_changed_fraction: float | None = None) -> dict[str, Any]:
    """The simulation report of two runs' rows (see the module docstring).

    Example:
        >>> report = compare("t@2", {"t": [{"n": 1}]}, {"t": [{"n": 1}], "task_errors": [{"task": "t",
        ...                  "error": "KeyError: 'x'"}]})
        >>> report["ok"], report["summary"]
        (False, "t@2 raised: 1 task error (first: t: KeyError: 'x')")
    """
    errors = list(new.get(TASK_ERRORS_TABLE, []))
    tables = {t: {"old": len(old.get(t, [])), "new": len(new.get(t, []))}
              for t in sorted(set(old) | set(new)) if t != TASK_ERRORS_TABLE}
    diff = rows_diff(dict(old), dict(new), limit=5, labels=("old", "new"), names=("the old version",
                                                                                   "the new version"))
    report: dict[str, Any] = {"tables": tables, "diff": diff, "task_errors": len(errors)}
    if errors:
        first = errors[0]
        report.update(ok=False, summary=f"{label} raised: {len(errors)} task error{'s' * (len(errors) != 1)} "
                                        f"(first: {first.get('task')}: {first.get('error')})")
        return report
    changed = sum(1 for line in diff if line.startswith("table "))
    total_old = sum(t["old"] for t in tables.values())
    only_old = sum(_count(line, "only on the old version") for line in diff)
    summary = f"{label}: no task error; {changed} of {len(tables)} tables differ"
    if changed:
        summary += f" ({only_old} of {total_old} old rows not reproduced)"
    ok = True
    if max_changed_fraction is not None and total_old and only_old / total_old > max_changed_fraction:
        ok = False
        summary += f", more than the allowed {max_changed_fraction:.0%}"
    report.update(ok=ok, summary=summary)
    return report


def _count(line: str, marker: str) -> int:
    """The row count before ``marker`` in a :func:`rows_diff` line (0 if absent)."""
    head, found, _ = line.partition(" rows " + marker)
    if not found:
        return 0
    return int(head.rsplit(" ", 1)[-1]) if head.rsplit(" ", 1)[-1].isdigit() else 0
