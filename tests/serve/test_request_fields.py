"""What a request tells the cloud's expected-accuracy rule: the spread of the device's measured upload time and
its own model's accuracy, carried by the signed request, checked on arrival, absent from an older device's."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from connectors.tunnel.envelope import encode
from streamflow.serve.messages import MessageError, Request, decode_request, encode_request
from streamflow.serve.network import UploadTime

KEY = b"k" * 32
KEYS = {"phone-1": KEY}
IMAGE = np.zeros((4, 4, 3), np.uint8)


def request(**fields) -> Request:
    return Request("phone-1", 7, 150.0, 12.5, 1_700_000_000_000, "mdinference", IMAGE, 120.0, **fields)


def test_the_spread_and_the_local_accuracy_travel_with_the_request():
    back = decode_request(encode_request(request(upload_std_ms=3.25, local_accuracy=0.589), KEY), KEYS)
    assert (back.upload_std_ms, back.local_accuracy) == (3.25, 0.589)
    back = decode_request(encode_request(request(), KEY), KEYS)
    assert (back.upload_std_ms, back.local_accuracy) == (None, None)


def test_a_request_without_the_columns_still_parses():
    row = pa.table({"sla_ms": [150.0], "window_ms": [120.0], "upload_ms": [12.5], "sent_ms": [1],
                    "policy": ["mdinference"], "height": pa.array([4], pa.int32()), "width": pa.array([4], pa.int32()),
                    "format": ["raw"], "image": pa.array([IMAGE.tobytes()], pa.binary())})
    back = decode_request(encode("phone-1", "serve.request", 7, row, KEY), KEYS)
    assert (back.upload_ms, back.upload_std_ms, back.local_accuracy) == (12.5, None, None)


@pytest.mark.parametrize(("fields", "message"), [
    ({"upload_std_ms": -1.0}, "upload_std_ms"), ({"upload_std_ms": math.inf}, "upload_std_ms"),
    ({"local_accuracy": 1.5}, "local_accuracy"), ({"local_accuracy": math.nan}, "local_accuracy"),
])
def test_bad_values_are_refused_naming_the_field(fields, message):
    with pytest.raises(MessageError, match=message) as caught:
        decode_request(encode_request(request(**fields), KEY), KEYS)
    assert caught.value.reason == "bad_fields"


def test_upload_time_spread_by_hand():
    upload = UploadTime(alpha=0.5, min_samples=3)
    upload.replied(round_trip_ms=40.0, inference_ms=0.0)   # one way 20: mean 20, var 0
    upload.replied(round_trip_ms=60.0, inference_ms=0.0)   # 30: δ 10, mean 25, var 0.5·(0 + 0.5·100) = 25
    assert upload.std is None  # two samples: not yet
    upload.replied(round_trip_ms=40.0, inference_ms=0.0)   # 20: δ −5, mean 22.5, var 0.5·(25 + 0.5·25) = 18.75
    assert upload.value == 22.5
    assert upload.std == pytest.approx(math.sqrt(18.75))
