"""Task deployment: signed, versioned task bundles, a release server with staged release and rollback, and the
device side that installs and hot-swaps them.

- :mod:`~streamflow.deploy.manifest`: the manifest (canonical JSON), file-name and version rules.
- :mod:`~streamflow.deploy.signing`: Ed25519 signing keys, the keys a device trusts.
- :mod:`~streamflow.deploy.build`: a bundle from a git tag (``streamflow bundle build``).
- :mod:`~streamflow.deploy.bundle`: verify, install, load (the order of trust).
- :mod:`~streamflow.deploy.store`: a device's installed versions and content-addressed file cache.
- :mod:`~streamflow.deploy.updater`: the device side: directives in, tasks hot-swapped in the runner.
- :mod:`~streamflow.deploy.policy`: the release server's per-request decision (targets, sticky cohorts).
- :mod:`~streamflow.deploy.release`: staged release (simulation, beta, gray steps), guardrail, rollback.
- :mod:`~streamflow.deploy.state`: the release server's SQLite state and file store.
- :mod:`~streamflow.deploy.server`: the release server (aiohttp); :mod:`~streamflow.deploy.client`: the
  device's HTTP client of it.
"""
