"""The Parquet format jars for Flink's ``FileSink`` (issue 29): fetched from PyPI archives, verified, and loading
in PyFlink 2.3.

The jars (:data:`streamflow.flink.connector_jars.PARQUET_SOURCES`): ``flink-sql-parquet`` 1.16.1 from the
``feathub==0.1.0`` wheel and Hadoop's shaded client 3.3.4 from the ``pyspark==3.5.9`` sdist (no PyPI archive
carries a Flink 2.x ``flink-sql-parquet``). The MiniCluster test writes Parquet through PyFlink's own
``FileSink.for_bulk_format(..., ParquetBulkWriters.for_row_type(...))`` at parallelism 2 with checkpoints, kills
the job's tasks once after some checkpoints have committed part files, and reads what is left with pyarrow: every
row exactly once in the committed part files (the failed attempt's in-progress files stay behind, hidden, as
readers expect). It is the jars' test; the runner's ``--sink parquet:DIR`` built on them is
tested in ``tests/flink/test_flink_parquet_sink.py``.
"""

from __future__ import annotations

import shutil
import tarfile
import time
from pathlib import Path

import pytest

pytest.importorskip("pyflink", reason="needs the flink extra: pip install 'streamflow[flink]'", exc_type=ImportError)
if shutil.which("java") is None:
    pytest.skip("the Flink runner needs a Java runtime", allow_module_level=True)

import pyarrow.dataset as pads  # noqa: E402

from streamflow.flink import connector_jars  # noqa: E402


@pytest.fixture(scope="module")
def parquet_jars() -> list[Path]:
    """The verified jars in the real cache: downloaded at most once (``make test`` has fetched them already)."""
    return connector_jars.fetch_parquet()


def copied(jars: list[Path], into: Path) -> Path:
    into.mkdir()
    for jar in jars:
        shutil.copy(jar, into / jar.name)
    return into


def test_fetch_parquet_is_a_no_op_when_the_verified_jars_are_cached(parquet_jars, tmp_path):
    cache = copied(parquet_jars, tmp_path / "jars")
    before = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    absent = {requirement: tmp_path / "absent" for requirement in connector_jars.PARQUET_SOURCES}
    assert [p.name for p in connector_jars.fetch_parquet(cache, archives=absent)] == \
        list(connector_jars.PARQUET_JARS)
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == before
    assert connector_jars.parquet_jar_urls(cache) == \
        [(cache / name).resolve().as_uri() for name in connector_jars.PARQUET_JARS]


def test_a_tampered_parquet_jar_in_the_cache_is_refused(parquet_jars, tmp_path):
    cache = copied(parquet_jars, tmp_path / "jars")
    jar = cache / "flink-sql-parquet.jar"
    data = bytearray(jar.read_bytes())
    data[len(data) // 2] ^= 0xFF
    jar.write_bytes(bytes(data))
    refused = r"flink-sql-parquet\.jar has sha256 [0-9a-f]{64}, expected 75755"
    with pytest.raises(connector_jars.JarError, match=refused):
        connector_jars.parquet_jar_urls(cache)


def test_an_sdist_that_does_not_match_its_pinned_hash_is_not_opened(parquet_jars, tmp_path):
    # The right member names, other bytes: what a compromised index or mirror could serve.
    requirement = "pyspark==3.5.9"
    sdist = tmp_path / "pyspark-3.5.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for member, _ in connector_jars.PARQUET_SOURCES[requirement][1].values():
            fake = tmp_path / "fake.jar"
            fake.write_bytes(b"PK not the real jar")
            archive.add(fake, arcname=member)
    cache = tmp_path / "jars"
    cache.mkdir()
    shutil.copy(parquet_jars[0], cache / parquet_jars[0].name)  # the feathub jar is there; pyspark's are not
    expected = connector_jars.PARQUET_SOURCES[requirement][0]
    with pytest.raises(connector_jars.JarError, match=f"expected {expected}; not using it"):
        connector_jars.fetch_parquet(cache, archives={requirement: sdist})
    assert sorted(p.name for p in cache.iterdir()) == ["flink-sql-parquet.jar"]  # nothing extracted


ROWS = 2000
FAIL_AT = 1400


def test_file_sink_writes_parquet_exactly_once_across_a_failure(parquet_jars, tmp_path):
    from pyflink.common import Configuration, Row, Types
    from pyflink.common.watermark_strategy import WatermarkStrategy
    from pyflink.datastream import RuntimeContext
    from pyflink.datastream.connectors.file_system import FileSink, OutputFileConfig
    from pyflink.datastream.connectors.number_seq import NumberSequenceSource
    from pyflink.datastream.formats.parquet import ParquetBulkWriters
    from pyflink.datastream.functions import MapFunction
    from pyflink.table.types import DataTypes

    from streamflow.flink.runner import flink_environment

    out = tmp_path / "parquet"
    marker = tmp_path / "failed-once"

    class Rows(MapFunction):
        """One row per number, a little slowly (so checkpoints commit part files before the failure); the first
        attempt dies at ``FAIL_AT``."""

        def __init__(self, marker: str):
            self.marker = marker

        def open(self, runtime_context: RuntimeContext) -> None:
            pass

        def map(self, n: int) -> Row:
            if n == FAIL_AT and not Path(self.marker).exists():
                Path(self.marker).touch()
                raise RuntimeError("killed once, after some checkpoints")
            time.sleep(0.002)
            return Row(f"u{n % 7}", n, n / 4, None if n % 5 == 0 else f"item-{n}")

    env = flink_environment(parallelism=2, checkpoint_dir=tmp_path / "checkpoints", checkpoint_interval_ms=300)
    env.add_jars(*connector_jars.parquet_jar_urls())
    names = ["user_id", "n", "x", "item_id"]
    row_type = DataTypes.ROW([DataTypes.FIELD("user_id", DataTypes.STRING()),
                              DataTypes.FIELD("n", DataTypes.BIGINT()),
                              DataTypes.FIELD("x", DataTypes.DOUBLE()),
                              DataTypes.FIELD("item_id", DataTypes.STRING())])
    type_info = Types.ROW_NAMED(names, [Types.STRING(), Types.LONG(), Types.DOUBLE(), Types.STRING()])
    hadoop = Configuration()
    hadoop.set_string("parquet.compression", "SNAPPY")
    sink = (FileSink.for_bulk_format(str(out), ParquetBulkWriters.for_row_type(row_type, hadoop_config=hadoop,
                                                                                utc_timestamp=True))
            .with_output_file_config(OutputFileConfig.builder().with_part_prefix("part")
                                     .with_part_suffix(".parquet").build())
            .build())
    (env.from_source(NumberSequenceSource(0, ROWS - 1), WatermarkStrategy.no_watermarks(), "numbers")
     .map(Rows(str(marker)), output_type=type_info)
     .sink_to(sink))
    env.execute("parquet jars: exactly once across a failure")

    assert marker.exists()  # the first attempt did die
    files = [p for p in sorted(out.rglob("*")) if p.is_file()]
    # In-progress files are hidden (".part-....inprogress.<uuid>"), and readers skip them: those the failed attempt
    # had open stay behind (Flink's FileSink does not delete them); every visible file is a committed part file.
    visible = [p for p in files if not p.name.startswith(".")]
    assert all(p.name.startswith(".part-") and ".inprogress." in p.name for p in files if p not in visible)
    assert len(visible) >= 2 and all(p.name.startswith("part-") and p.suffix == ".parquet" for p in visible)
    table = pads.dataset(out, format="parquet").to_table()
    assert table.schema.names == names
    rows = sorted(table.to_pylist(), key=lambda r: r["n"])
    assert rows == [{"user_id": f"u{n % 7}", "n": n, "x": n / 4, "item_id": None if n % 5 == 0 else f"item-{n}"}
                    for n in range(ROWS)]
