"""Task deployment: signed, versioned task bundles, a release server with staged release and rollback, and the
device side that installs and hot-swaps them.

Two rooms over a shared floor; the device room and the floor import nothing of the release room
(``tests/test_layout.py``), so a device install never carries the server.

- The floor, what both sides speak: :mod:`~streamflow.deploy.manifest` (canonical JSON, file-name and version
  rules), :mod:`~streamflow.deploy.signing` (Ed25519 keys, the keys a device trusts), :mod:`~streamflow.deploy.layout`
  and :mod:`~streamflow.deploy.bundle` (a bundle on disk: verify, install, load, in the order of trust),
  :mod:`~streamflow.deploy.errors`, :mod:`~streamflow.deploy.device_auth` (a device's signed requests) and
  :mod:`~streamflow.deploy.protocol` (the piggyback headers, directives, report rows).
- :mod:`streamflow.deploy.device`: the installed versions and file cache (``store``), directives in and tasks
  hot-swapped in the runner (``updater``), the HTTP client of the release server (``client``), side-loading from a
  directory (``directory``).
- :mod:`streamflow.deploy.release`: the release server (``server``, aiohttp, and its ``status_page``), the
  per-request decision (``policy``), staged release and rollback (``stages``) over its state (``state``), the
  simulation stage (``simulation``), reports off the tunnel (``tunnel_reports``), the admin client (``admin``),
  bundles built from git tags (``build``) and the CLI (``commands``, ``bundle_commands``).
"""
