"""``streamflow bundle keygen|build``: signing keys and signed task bundles from git tags.

    streamflow bundle keygen [--out KEY]
    streamflow bundle build REPO --tag v3 --key KEY --out DIR [--task NAME] [--job job.py]
                                 [--shared GLOB ...] [--exclusive GLOB ...]
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from streamflow.prerequisites import require_extra

bundle_app = typer.Typer(help="signed task bundles: signing keys, build a bundle from a git tag",
                         no_args_is_help=True)

DEFAULT_KEY = Path(".streamflow") / "bundle-signing.key"


@bundle_app.command("keygen", help="make an Ed25519 signing key (KEY, mode 0600) and its public key (KEY.pub)")
def keygen(out: Annotated[Path, typer.Option(help="where to write the private key")] = DEFAULT_KEY) -> int:
    require_extra("deploy", what="bundle keygen")
    from streamflow.deploy.signing import generate_key, public_key_path

    kid = generate_key(out)
    print(f"signing key {out} (keep it secret), public key {public_key_path(out)} (give it to devices), "
          f"key id {kid}")
    return 0


@bundle_app.command("build", help="build and sign the bundle of a git tag into OUT/<task>/<version>/")
def build(
    repo: Annotated[Path, typer.Argument(help="git repository of the task (a tag per version)")],
    tag: Annotated[str, typer.Option(help="the version's tag: v3, 3, 1.2.0 or <task>/v3")],
    key: Annotated[Path, typer.Option(help="Ed25519 signing key (streamflow bundle keygen)")],
    out: Annotated[Path, typer.Option(help="bundles directory (the release server serves it)")],
    task: Annotated[str | None, typer.Option(help="task name (default: streamflow-bundle.toml's, or the "
                                                  "tag's <task>/ prefix)")] = None,
    job: Annotated[str | None, typer.Option(help="the job module in the repository (default: job.py)")] = None,
    shared: Annotated[list[str] | None, typer.Option(help="pattern of files served to every device from the "
                      "cacheable static path; if given, the others are exclusive (repeatable)")] = None,
    exclusive: Annotated[list[str] | None, typer.Option(help="pattern of files fetched per device through the "
                         "API (repeatable; wins over --shared)")] = None,
) -> int:
    require_extra("deploy", what="bundle build")
    from streamflow.deploy.bundle import read_signed
    from streamflow.deploy.manifest import Manifest
    from streamflow.deploy.release.build import build_bundle

    built = build_bundle(repo, tag, signing_key=key, out=out, shared=shared, exclusive=exclusive, task=task,
                         job=job)
    manifest = Manifest.from_bytes(read_signed(built)[0])
    shared_n = sum(1 for f in manifest.files if f.scope == "shared")
    print(f"built {manifest.label} (previous {manifest.previous or 'none'}) in {built}: {len(manifest.files)} "
          f"files, {manifest.total_bytes} bytes ({shared_n} shared, {len(manifest.files) - shared_n} exclusive), "
          f"signed by key {manifest.key_id}, manifest sha256 {manifest.digest}")
    return 0
