"""Bundles: build from git tags, sign, verify, install; every bad input refused with its reason."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from deploy_helpers import counter_job, git, resign

from streamflow.deploy.bundle import (
    check_version,
    directory_fetcher,
    install_bundle,
    load_bundle_job,
    load_installed,
    read_signed,
    verify_manifest,
)
from streamflow.deploy.errors import (
    BundleError,
    BundleTooLarge,
    DigestMismatch,
    Downgrade,
    LoadFailed,
    ManifestInvalid,
    SignatureInvalid,
    UnknownKey,
    UnsafePath,
)
from streamflow.deploy.layout import FILES, MANIFEST, SIGNATURE
from streamflow.deploy.manifest import Limits, Manifest, canonical_json
from streamflow.deploy.release.build import GitError, build_bundle
from streamflow.deploy.signing import TrustedKeys, generate_key, key_id, load_signing_key, public_key_path


@pytest.fixture
def built(counter_repo, signing_key, tmp_path):
    out = tmp_path / "out"
    return {tag: build_bundle(counter_repo.path, tag, signing_key=signing_key, out=out) for tag in ("v1", "v2")}


def test_build_writes_a_signed_manifest_of_the_tagged_tree(built, trusted, signing_key):
    v1, v2 = built["v1"], built["v2"]
    assert v1.parts[-2:] == ("counter", "1") and v2.parts[-2:] == ("counter", "2")
    m1 = verify_manifest(*read_signed(v1), trusted)
    m2 = verify_manifest(*read_signed(v2), trusted)
    assert (m1.task, m1.version, m1.previous, m1.job) == ("counter", "1", None, "job.py")
    assert (m2.version, m2.previous) == ("2", "1")
    assert m1.key_id == key_id(load_signing_key(signing_key).public_key())
    scopes = {f.name: f.scope for f in m1.files}
    # dotfiles and the bundle config stay out; config/* is exclusive by the repository's config
    assert scopes == {"README.md": "shared", "config/device.json": "exclusive", "job.py": "shared",
                      "models/weights.bin": "shared"}
    # the shared model is the same file in both versions, the job module is not
    assert m1.entry("models/weights.bin") == m2.entry("models/weights.bin")
    assert m1.entry("job.py").sha256 != m2.entry("job.py").sha256
    assert (v2 / FILES / "job.py").read_text() == counter_job("2")
    raw = (v1 / MANIFEST).read_bytes()
    assert raw == canonical_json(json.loads(raw)) and len((v1 / SIGNATURE).read_bytes()) == 64


def test_build_reads_the_tag_not_the_working_copy_and_is_reproducible(counter_repo, signing_key, tmp_path):
    (counter_repo.path / "job.py").write_text("raise SystemExit('uncommitted')")
    (counter_repo.path / "untracked.py").write_text("x = 1")
    first = build_bundle(counter_repo.path, "v1", signing_key=signing_key, out=tmp_path / "a")
    again = build_bundle(counter_repo.path, "v1", signing_key=signing_key, out=tmp_path / "b")
    assert (first / FILES / "job.py").read_text() == counter_job("1")
    assert not (first / FILES / "untracked.py").exists()
    assert read_signed(first) == read_signed(again)  # same tag, same key: the same bytes
    assert build_bundle(counter_repo.path, "v1", signing_key=signing_key, out=tmp_path / "a") == first
    with pytest.raises(BundleError, match="versions are immutable"):
        build_bundle(counter_repo.path, "v1", signing_key=signing_key, out=tmp_path / "a", exclusive=["*.md"])


def test_build_options_override_the_config(counter_repo, signing_key, tmp_path, trusted):
    out = build_bundle(counter_repo.path, "v2", signing_key=signing_key, out=tmp_path / "o",
                       shared=["job.py", "models/*"], exclusive=[])
    scopes = {f.name: f.scope for f in verify_manifest(*read_signed(out), trusted).files}
    assert scopes == {"README.md": "exclusive", "config/device.json": "exclusive", "job.py": "shared",
                      "models/weights.bin": "shared"}


def test_build_refuses_bad_repositories_and_tags(make_repo, signing_key, tmp_path):
    repo = make_repo("links")
    repo.commit({"job.py": counter_job("1")}, tag="v1")
    os.symlink("/etc/passwd", repo.path / "models")
    repo.commit({}, tag="v2")
    with pytest.raises(GitError, match="no task name"):
        build_bundle(repo.path, "v1", signing_key=signing_key, out=tmp_path / "o")
    with pytest.raises(UnsafePath, match="'models' is a symlink"):
        build_bundle(repo.path, "v2", signing_key=signing_key, out=tmp_path / "o", task="links")
    with pytest.raises(GitError, match="has no tag 'v9'"):
        build_bundle(repo.path, "v9", signing_key=signing_key, out=tmp_path / "o", task="links")
    for tag in ("--upload-pack=evil", "v1..v2", "../v1", "v1@{0}"):
        with pytest.raises(GitError, match="not a plain tag name"):
            build_bundle(repo.path, tag, signing_key=signing_key, out=tmp_path / "o", task="links")
    git(repo.path, "tag", "release-candidate")
    with pytest.raises(GitError, match="does not name a version"):
        build_bundle(repo.path, "release-candidate", signing_key=signing_key, out=tmp_path / "o", task="links")
    with pytest.raises(ManifestInvalid, match="job module 'main.py' is not among the files"):
        build_bundle(repo.path, "v1", signing_key=signing_key, out=tmp_path / "o", task="links", job="main.py")
    with pytest.raises(GitError, match="not a directory"):
        build_bundle(tmp_path / "nowhere", "v1", signing_key=signing_key, out=tmp_path / "o")


def test_tags_per_task_in_one_repository(make_repo, signing_key, tmp_path, trusted):
    repo = make_repo("scenario")
    repo.commit({"job.py": counter_job("1")}, tag="alpha/v1")
    repo.commit({"job.py": counter_job("5")}, tag="beta/v5")
    repo.commit({"job.py": counter_job("2")}, tag="alpha/v2")
    m = verify_manifest(*read_signed(build_bundle(repo.path, "alpha/v2", signing_key=signing_key, out=tmp_path)),
                        trusted)
    assert (m.task, m.version, m.previous) == ("alpha", "2", "1")  # beta's v5 is another task's


def test_install_checks_every_file_and_loads_the_job(built, trusted, tmp_path):
    manifest_bytes, signature = read_signed(built["v2"])
    manifest = verify_manifest(manifest_bytes, signature, trusted)
    dest = install_bundle(manifest, directory_fetcher(built["v2"]), tmp_path / "device" / "counter" / "2",
                          signature=signature)
    assert load_installed(dest, trusted) == manifest
    job = load_bundle_job(dest, manifest)
    assert job.task_names() == ["counter"] and job.module.startswith("streamflow_bundle_counter_2_")
    # a second load of the same version is a module of its own
    assert load_bundle_job(dest, manifest).module != job.module


def _manifest_dict(built_dir):
    return json.loads((built_dir / MANIFEST).read_bytes())


@pytest.mark.parametrize("mutate, error, reason", [
    (lambda m: m.__setitem__("version", "3"), SignatureInvalid, "signature does not verify"),
    (lambda m: m["files"][0].__setitem__("size", 1), SignatureInvalid, "signature does not verify"),
    (lambda m: m.__setitem__("key_id", "0" * 16), UnknownKey, "does not trust"),
])
def test_a_manifest_changed_after_signing_is_refused(built, trusted, mutate, error, reason):
    value = _manifest_dict(built["v1"])
    mutate(value)
    with pytest.raises(error, match=reason) as refused:
        verify_manifest(canonical_json(value), (built["v1"] / SIGNATURE).read_bytes(), trusted)
    assert refused.value.reason in ("bad_signature", "unknown_key") and "counter@" in str(refused.value)


def test_wrong_signature_and_unknown_key(built, trusted, tmp_path):
    manifest_bytes, signature = read_signed(built["v1"])
    for bad in (signature[:-1] + bytes([signature[-1] ^ 1]), b"", signature * 2, "text"):
        with pytest.raises(SignatureInvalid):
            verify_manifest(manifest_bytes, bad, trusted)
    other = tmp_path / "other.key"
    generate_key(other)
    with pytest.raises(UnknownKey, match="counter@1: signed by key .* which this device does not trust"):
        verify_manifest(manifest_bytes, signature, TrustedKeys.from_files([public_key_path(other)]))
    # a manifest re-signed by an untrusted key that claims the trusted key's id
    forged, forged_sig = resign(_manifest_dict(built["v1"]), other)
    with pytest.raises(SignatureInvalid, match="does not verify"):
        verify_manifest(forged, forged_sig, trusted)


@pytest.mark.parametrize("data, match", [
    (b"not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "names no key_id"),
    (b'{"key_id": "a", "key_id": "b"}', "duplicate key"),
    (b'{"size": NaN}', "not valid JSON"),
    (b"[" * 100_000, "not valid JSON"),
    (b" " * (2 << 20), "at most"),
])
def test_a_manifest_that_is_not_json_is_refused(trusted, data, match):
    with pytest.raises(ManifestInvalid, match=match) as refused:
        verify_manifest(data, b"s" * 64, trusted)
    assert refused.value.reason == "bad_manifest"


@pytest.mark.parametrize("mutate, match", [
    (lambda m: m.__setitem__("format", 2), "format 2 is not 1"),
    (lambda m: m.__setitem__("extra", 1), "unknown \\['extra'\\]"),
    (lambda m: m.pop("job"), "missing \\['job'\\]"),
    (lambda m: m.__setitem__("version", "v3"), "version 'v3' must be"),
    (lambda m: m.__setitem__("task", "ipv; rm -rf"), "task name"),
    (lambda m: m.__setitem__("job", "README.md"), "must be one of the bundle's .py files"),
    (lambda m: m.__setitem__("previous", "7"), "is not lower than"),
    (lambda m: m["files"][0].__setitem__("sha256", "XYZ"), "sha256 must be 64 lowercase hex"),
    (lambda m: m["files"][0].__setitem__("size", -1), "size must be a non-negative integer"),
    (lambda m: m["files"][0].__setitem__("size", True), "size must be a non-negative integer"),
    (lambda m: m["files"][0].__setitem__("scope", "public"), "scope 'public'"),
    (lambda m: m.__setitem__("files", []), "non-empty list"),
])
def test_a_signed_manifest_with_a_bad_field_is_refused(built, trusted, signing_key, mutate, match):
    value = _manifest_dict(built["v1"])
    mutate(value)
    with pytest.raises(ManifestInvalid, match=match):
        verify_manifest(*resign(value, signing_key), trusted)


def test_a_manifest_not_in_canonical_form_is_refused(built, trusted, signing_key):
    value = _manifest_dict(built["v1"])
    data = json.dumps(value, indent=1).encode()  # same content, other bytes: signed, still refused
    from streamflow.deploy.signing import sign
    with pytest.raises(ManifestInvalid, match="not in canonical form"):
        verify_manifest(data, sign(load_signing_key(signing_key), data), trusted)


@pytest.mark.parametrize("name, why", [
    ("/etc/passwd", "is absolute"),
    ("../../outside.py", "'..' component"),
    ("models/../../x", "'..' component"),
    ("a\\..\\b", "backslash"),
    ("job\x00.py", "NUL or control character"),
    ("C:evil", "drive letter"),
    ("models//m.bin", "empty or '.' component"),
    ("./job.py", "empty or '.' component"),
    ("x" * 300, "longer than 255"),
    ("README.MD", "appears twice"),
    ("job.py/inner", "lies under 'job.py', which is a file"),
])
def test_a_file_name_escaping_the_bundle_is_refused(built, trusted, signing_key, name, why):
    value = _manifest_dict(built["v1"])
    value["files"].append({"name": name, "sha256": "0" * 64, "size": 0, "scope": "shared"})
    value["files"].sort(key=lambda f: f["name"])
    with pytest.raises(UnsafePath, match=why) as refused:
        verify_manifest(*resign(value, signing_key), trusted)
    assert refused.value.reason == "unsafe_path" and refused.value.bundle == "counter@1"


def test_a_tampered_or_truncated_file_is_refused_and_nothing_is_installed(built, trusted, tmp_path):
    manifest = verify_manifest(*read_signed(built["v1"]), trusted)
    fetch = directory_fetcher(built["v1"])
    dest = tmp_path / "device" / "counter" / "1"

    def tampered(entry):
        data = fetch(entry)
        return data.replace(b"Count()", b"Count() ") if entry.name == "job.py" else data

    with pytest.raises(DigestMismatch, match="'job.py' is .* bytes, the manifest says"):
        install_bundle(manifest, tampered, dest)
    same_size = lambda e: fetch(e).replace(b"Count()", b"Count(#") if e.name == "job.py" else fetch(e)  # noqa: E731
    with pytest.raises(DigestMismatch, match="sha256 of 'job.py' is [0-9a-f]+, the manifest says") as refused:
        install_bundle(manifest, same_size, dest)
    assert refused.value.reason == "tampered"
    assert not dest.parent.exists() or not list(dest.parent.iterdir())  # no half-installed bundle left


def test_an_installed_bundle_is_verified_again_before_loading(built, trusted, tmp_path):
    manifest_bytes, signature = read_signed(built["v1"])
    manifest = verify_manifest(manifest_bytes, signature, trusted)
    dest = install_bundle(manifest, directory_fetcher(built["v1"]), tmp_path / "d" / "1", signature=signature)
    job = dest / FILES / "job.py"
    job.write_text(job.read_text().replace("Count()", "Count(#"))
    with pytest.raises(DigestMismatch, match="sha256 of 'job.py'"):
        load_installed(dest, trusted)
    job.unlink()
    os.symlink(built["v1"] / FILES / "job.py", job)
    with pytest.raises(UnsafePath, match="symlink"):
        load_installed(dest, trusted)
    job.unlink()
    (dest / FILES / "job.py").write_bytes((built["v1"] / FILES / "job.py").read_bytes())
    (dest / FILES / "extra.py").write_text("import os")
    with pytest.raises(DigestMismatch, match="'extra.py' is not in the manifest"):
        load_installed(dest, trusted)
    (dest / FILES / "extra.py").unlink()
    os.mkfifo(dest / FILES / "README.md.fifo")
    with pytest.raises(DigestMismatch, match="not in the manifest"):
        load_installed(dest, trusted)
    (dest / FILES / "README.md.fifo").unlink()
    (dest / FILES / "README.md").unlink()
    os.mkfifo(dest / FILES / "README.md")  # a FIFO where a listed file should be: refused, never blocks
    with pytest.raises(UnsafePath, match="not a regular file"):
        load_installed(dest, trusted)


def test_an_oversized_bundle_is_refused_before_anything_is_fetched(built, trusted, tmp_path):
    manifest = verify_manifest(*read_signed(built["v1"]), trusted)
    fetched = []
    fetch = lambda entry: fetched.append(entry) or b""  # noqa: E731
    with pytest.raises(BundleTooLarge, match=r"counter@1: \d+ bytes, more than the limit of 1000") as refused:
        install_bundle(manifest, fetch, tmp_path / "d", max_bytes=1000)
    assert refused.value.reason == "too_large"
    with pytest.raises(BundleTooLarge, match="4 files, more than the limit of 2"):
        install_bundle(manifest, fetch, tmp_path / "d", limits=Limits(max_files=2))
    assert fetched == []


def test_a_fetch_returning_more_than_declared_is_refused(built, trusted, tmp_path):
    manifest = verify_manifest(*read_signed(built["v1"]), trusted)
    with pytest.raises(DigestMismatch, match="bytes, the manifest says"):
        install_bundle(manifest, lambda e: b"x" * (e.size + 10), tmp_path / "d")


def test_downgrades_only_as_rollbacks_to_the_kept_version(built, trusted):
    v1 = verify_manifest(*read_signed(built["v1"]), trusted)
    v2 = verify_manifest(*read_signed(built["v2"]), trusted)
    check_version(v2, v1)
    check_version(v2, None)
    with pytest.raises(Downgrade, match="counter@1: version 1 is older than the running 2 and the server did not"):
        check_version(v1, v2)
    with pytest.raises(Downgrade, match="not its kept N-1 \\(none\\)") as refused:
        check_version(v1, v2, rollback=True)  # v2's signed `previous` is 1, but this device never ran it
    assert refused.value.reason == "downgrade"
    check_version(v1, v2, rollback=True, kept=["1"])  # the device ran 1 before 2: its N-1
    with pytest.raises(Downgrade, match="already running"):
        check_version(v2, v2)
    v3 = Manifest("counter", "3", "job.py", v2.files, v2.key_id, previous="2")
    with pytest.raises(Downgrade, match="not its kept N-1 \\(2\\)"):
        check_version(v1, v3, rollback=True, kept=["2"])
    with pytest.raises(Downgrade, match="older than 3, the highest this device has accepted"):
        check_version(v2, None, highest="3")


def test_a_job_that_does_not_load_is_a_load_failure(make_repo, signing_key, trusted, tmp_path):
    repo = make_repo("broken")
    repo.commit({"job.py": "import no_such_module_anywhere\n"}, tag="v1")
    repo.commit({"job.py": "from streamflow import Job\njob = Job('empty')\n"}, tag="v2")
    repo.commit({"job.py": "from streamflow import Job, Task\njob = Job('j', [Task('x y', ['fav'], [])])\n"},
                tag="v3")
    for tag, match in [("v1", "ModuleNotFoundError"), ("v2", "has no tasks"), ("v3", "must be letters")]:
        out = build_bundle(repo.path, tag, signing_key=signing_key, out=tmp_path / "o", task="broken")
        manifest = load_installed(out, trusted)
        with pytest.raises(LoadFailed, match=match) as refused:
            load_bundle_job(out, manifest)
        assert refused.value.reason == "load_failed"


def test_cli_keygen_and_build(counter_repo, tmp_path, trusted):
    import sys
    key = tmp_path / "cli.key"
    run = lambda *args: subprocess.run([sys.executable, "-m", "streamflow.cli", "bundle", *args],  # noqa: E731
                                       capture_output=True, text=True, cwd=os.getcwd())
    made = run("keygen", "--out", str(key))
    assert made.returncode == 0, made.stderr
    assert "key id" in made.stdout and key.exists() and public_key_path(key).exists()
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    assert run("keygen", "--out", str(key)).returncode == 2  # never overwrites a key
    built = run("build", str(counter_repo.path), "--tag", "v2", "--key", str(key), "--out", str(tmp_path / "o"))
    assert built.returncode == 0, built.stderr
    assert str(tmp_path / "o" / "counter" / "2") in built.stdout
    device_keys = TrustedKeys.from_files([public_key_path(key)])
    assert verify_manifest(*read_signed(tmp_path / "o" / "counter" / "2"), device_keys).version == "2"
    bad = run("build", str(counter_repo.path), "--tag", "v7", "--key", str(key), "--out", str(tmp_path / "o"))
    assert bad.returncode == 2 and "has no tag 'v7'" in bad.stderr
