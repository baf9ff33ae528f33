"""The serving messages: a request (device → cloud) and a reply (cloud → device), each one signed envelope.

Both ride in the tunnel's envelope (:mod:`connectors.tunnel.envelope`: HMAC-SHA256 with the device's key
from :mod:`connectors.tunnel.keys`), one row each, so serving has no signing scheme of its own: the cloud
verifies a request with the requesting device's key and signs its reply with the same key; the device
verifies the reply with its own. The envelope's table name says which message it is (``serve.request`` /
``serve.reply``) and its sequence number is the request id.

A request carries the SLA, the time the device will still wait for the reply when the request leaves
(``window_ms``: the SLA less what encoding took and the device's guard before its deadline), the device's
latest measured upload time and its spread, the accuracy of the device's own model (both optional: the
cloud's expected-accuracy rule uses them), the device clock at sending, the policy asked for, and the image (``H×W×3``
uint8), as JPEG (what a phone uploads; ~23 KB for a noisy 256 px page at quality 90 against 192 KB raw; the
broker keeps every byte until the worker deletes it) or raw.
A reply names the model that answered, its budget, the network estimate, the inference time and the
predicted class.

Anything that does not verify or parse raises :class:`MessageError` with a ``reason``
(the envelope's reasons, or ``wrong_kind`` / ``bad_fields``) and a message naming the record.

Example:
    >>> import numpy as np
    >>> key = b"k" * 32
    >>> req = Request("phone-1", 7, sla_ms=150.0, upload_ms=12.5, sent_ms=1_700_000_000_000,
    ...               policy="mdinference", image=np.zeros((4, 4, 3), np.uint8), window_ms=120.0)
    >>> back = decode_request(encode_request(req, key), {"phone-1": key})
    >>> back.request_id, back.sla_ms, back.window_ms, back.upload_ms, back.image.shape
    (7, 150.0, 120.0, 12.5, (4, 4, 3))
    >>> decode_reply(encode_request(req, key), {"phone-1": key})
    Traceback (most recent call last):
    ...
    streamflow.serve.messages.MessageError: wrong_kind: phone-1 request 7: a serve.request where a serve.reply belongs
"""

from __future__ import annotations

import io
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from connectors.tunnel.envelope import Batch, EnvelopeError, Keys, decode, encode

REQUEST_TOPIC = "serve.requests"
REPLY_TOPIC = "serve.replies"
REQUEST_KIND = "serve.request"
REPLY_KIND = "serve.reply"
#: Reply partitions: a device reads only the one its id hashes to (:func:`reply_partition`).
REPLY_PARTITIONS = 4
MAX_IMAGE_SIDE = 4096
IMAGE_FORMATS = ("jpeg", "raw")
REPLY_STATUSES = ("ok", "expired", "error")
#: A request's short text fields (``format``, ``policy``) are at most this long.
MAX_TEXT_FIELD = 64
#: A message error's detail (logged, and a dead letter's header) is cut to this many characters.
MAX_DETAIL = 1000
_REPR_CHARS = 80



class MessageError(ValueError):
    """A message that must not be used: ``reason`` says why, ``device`` who it claims to be from."""

    def __init__(self, reason: str, detail: str, device: str | None = None):
        if len(detail) > MAX_DETAIL:
            detail = detail[:MAX_DETAIL] + f"... ({len(detail)} characters)"
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.device = device


@dataclass(frozen=True)
class Request:
    device: str
    request_id: int
    sla_ms: float
    upload_ms: float | None
    sent_ms: int
    policy: str
    image: np.ndarray = field(repr=False)
    window_ms: float | None = None  # None: the whole SLA
    upload_std_ms: float | None = None  # the spread of the measured upload time; None: not measured yet
    local_accuracy: float | None = None  # of the device's own model (its zoo's figure); None: not said

    @property
    def wait_ms(self) -> float:
        """How long the device waits for the reply from when the request left: the budget's starting point."""
        return self.sla_ms if self.window_ms is None else self.window_ms


@dataclass(frozen=True)
class Reply:
    device: str
    request_id: int
    status: str
    model: str = ""
    label: int = -1
    budget_ms: float = math.nan
    network_ms: float = math.nan
    inference_ms: float = math.nan
    candidates: tuple[str, ...] = ()
    detail: str = ""


def reply_partition(device: str, partitions: int = REPLY_PARTITIONS) -> int:
    """The reply partition of ``device``: the cloud writes there, the device reads only there."""
    return zlib.crc32(device.encode()) % partitions


def encode_image(image: np.ndarray, image_format: str = "jpeg", quality: int = 90) -> bytes:
    """An ``H×W×3`` uint8 image as a request carries it: JPEG (``quality``) or raw bytes."""
    image = np.ascontiguousarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"an image is H×W×3 uint8, got {image.dtype} {image.shape}")
    if image_format == "raw":
        return image.tobytes()
    if image_format != "jpeg":
        raise ValueError(f"image_format is one of {IMAGE_FORMATS}, got {image_format!r}")
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def encode_request(request: Request, key: bytes, image_format: str = "jpeg", quality: int = 90,
                   encoded: bytes | None = None) -> bytes:
    """The signed request; the image as JPEG (``quality``) or raw bytes, or ``encoded`` already (by
    :func:`encode_image` in ``image_format``; ``request.image`` then only gives the shape)."""
    data = encoded if encoded is not None else encode_image(request.image, image_format, quality)
    height, width = request.image.shape[:2]
    row = pa.table({
        "sla_ms": pa.array([float(request.sla_ms)], pa.float64()),
        "window_ms": pa.array([request.window_ms], pa.float64()),
        "upload_ms": pa.array([request.upload_ms], pa.float64()),
        "upload_std_ms": pa.array([request.upload_std_ms], pa.float64()),
        "local_accuracy": pa.array([request.local_accuracy], pa.float64()),
        "sent_ms": pa.array([int(request.sent_ms)], pa.int64()),
        "policy": pa.array([request.policy], pa.string()),
        "height": pa.array([height], pa.int32()),
        "width": pa.array([width], pa.int32()),
        "format": pa.array([image_format], pa.string()),
        "image": pa.array([data], pa.binary()),
    })
    return encode(request.device, REQUEST_KIND, request.request_id, row, key)


def decode_request(value: bytes | None, keys: Keys) -> Request:
    batch = _open(value, keys, REQUEST_KIND)
    where = f"{batch.device} request {batch.first_seq}"
    fields = _one_row(batch.rows, where, {"sla_ms", "window_ms", "upload_ms", "sent_ms", "policy", "height",
                                          "width", "format", "image"})
    # added later: a request without them (an older device) still parses
    optional = {name: batch.rows.column(name)[0].as_py() for name in ("upload_std_ms", "local_accuracy")
                if name in batch.rows.column_names}
    try:
        for name in ("format", "policy"):
            if not isinstance(fields[name], str) or len(fields[name]) > MAX_TEXT_FIELD:
                raise ValueError(f"{name} must be a string of at most {MAX_TEXT_FIELD} characters, got "
                                 f"{short(fields[name])}")
        height, width, data = int(fields["height"]), int(fields["width"]), fields["image"]
        sla, upload, window = float(fields["sla_ms"]), fields["upload_ms"], fields["window_ms"]
        if not (0 < height <= MAX_IMAGE_SIDE and 0 < width <= MAX_IMAGE_SIDE):
            raise ValueError(f"image side {height}×{width} outside 1..{MAX_IMAGE_SIDE}")
        image = _image(fields["format"], data, height, width)
        if not (math.isfinite(sla) and sla > 0):
            raise ValueError(f"sla_ms must be a positive number, got {sla}")
        if upload is not None and not (math.isfinite(upload) and upload >= 0):
            raise ValueError(f"upload_ms must be a non-negative number, got {upload}")
        if window is not None and not (math.isfinite(window) and 0 < window <= sla):
            raise ValueError(f"window_ms must be in (0, sla_ms], got {window}")
        upload_std, local_accuracy = optional.get("upload_std_ms"), optional.get("local_accuracy")
        if upload_std is not None and not (math.isfinite(upload_std) and upload_std >= 0):
            raise ValueError(f"upload_std_ms must be a non-negative number, got {upload_std}")
        if local_accuracy is not None and not (math.isfinite(local_accuracy) and 0 <= local_accuracy <= 1):
            raise ValueError(f"local_accuracy must be in [0, 1], got {local_accuracy}")
        if not isinstance(fields["policy"], str) or not isinstance(fields["sent_ms"], int):
            raise ValueError("policy must be a string and sent_ms an integer")
    except (TypeError, ValueError) as exc:
        raise MessageError("bad_fields", f"{where}: {exc}", batch.device) from exc
    return Request(batch.device, batch.first_seq, sla, None if upload is None else float(upload),
                   fields["sent_ms"], fields["policy"], image, None if window is None else float(window),
                   None if upload_std is None else float(upload_std),
                   None if local_accuracy is None else float(local_accuracy))


def _image(image_format: str, data: bytes, height: int, width: int) -> np.ndarray:
    if image_format == "raw":
        if len(data) != height * width * 3:
            raise ValueError(f"image has {len(data)} bytes, {height}×{width}×3 needs {height * width * 3}")
        return np.frombuffer(data, np.uint8).reshape(height, width, 3)
    if image_format != "jpeg":
        raise ValueError(f"image format {short(image_format)} is not one of {IMAGE_FORMATS}")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=["JPEG"]) as opened:
            if opened.size != (width, height):  # checked before decoding: no bomb behind a small header
                raise ValueError(f"JPEG is {opened.size[0]}×{opened.size[1]}, the request says {width}×{height}")
            return np.asarray(opened.convert("RGB"))
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"image is not a readable JPEG: {exc}") from exc


def encode_reply(reply: Reply, key: bytes) -> bytes:
    row = pa.table({
        "status": pa.array([reply.status], pa.string()),
        "model": pa.array([reply.model], pa.string()),
        "label": pa.array([int(reply.label)], pa.int32()),
        "budget_ms": pa.array([float(reply.budget_ms)], pa.float64()),
        "network_ms": pa.array([float(reply.network_ms)], pa.float64()),
        "inference_ms": pa.array([float(reply.inference_ms)], pa.float64()),
        "candidates": pa.array([list(reply.candidates)], pa.list_(pa.string())),
        "detail": pa.array([reply.detail], pa.string()),
    })
    return encode(reply.device, REPLY_KIND, reply.request_id, row, key)


def decode_reply(value: bytes | None, keys: Keys) -> Reply:
    batch = _open(value, keys, REPLY_KIND)
    where = f"{batch.device} reply {batch.first_seq}"
    fields = _one_row(batch.rows, where, {"status", "model", "label", "budget_ms", "network_ms", "inference_ms",
                                          "candidates", "detail"})
    if fields["status"] not in REPLY_STATUSES:
        raise MessageError("bad_fields", f"{where}: status {short(fields['status'])} not one of {REPLY_STATUSES}",
                           batch.device)
    try:
        return Reply(batch.device, batch.first_seq, fields["status"], str(fields["model"]), int(fields["label"]),
                     float(fields["budget_ms"]), float(fields["network_ms"]), float(fields["inference_ms"]),
                     tuple(fields["candidates"] or ()), str(fields["detail"] or ""))
    except (TypeError, ValueError) as exc:
        raise MessageError("bad_fields", f"{where}: {exc}", batch.device) from exc


def short(value: Any) -> str:
    """``repr(value)`` cut to a few dozen characters (a field may be megabytes), saying how long it was."""
    text = repr(value[:_REPR_CHARS + 1] if isinstance(value, str | bytes) else value)
    if len(text) <= _REPR_CHARS:
        return text
    size = f" ({len(value)} long)" if isinstance(value, str | bytes) else ""
    return text[:_REPR_CHARS] + "..." + size


def _open(value: bytes | None, keys: Keys, kind: str) -> Batch:
    try:
        batch = decode(value, keys)
    except EnvelopeError as exc:
        raise MessageError(exc.reason, str(exc).split(": ", 1)[-1], exc.device) from exc
    if batch.table != kind:
        raise MessageError("wrong_kind", f"{batch.device} request {batch.first_seq}: a {batch.table} where a "
                           f"{kind} belongs", batch.device)
    return batch


def _one_row(rows: pa.Table, where: str, needed: set[str]) -> dict[str, Any]:
    missing = needed - set(rows.column_names)
    if rows.num_rows != 1 or missing:
        raise MessageError("bad_fields", f"{where}: needs one row with {sorted(needed)}, got {rows.num_rows} "
                           f"rows missing {sorted(missing)}")
    return {name: rows.column(name)[0].as_py() for name in needed}


__all__ = ["REPLY_PARTITIONS", "REPLY_TOPIC", "REQUEST_TOPIC", "MessageError", "Reply", "Request",
           "decode_reply", "decode_request", "encode_image", "encode_reply", "encode_request", "reply_partition"]
