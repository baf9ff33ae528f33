"""IPV features encoded and learned on the device, with models as stream operators.

Two tasks fire on every item-page exit, each on top of the IPV feature of ``jobs/ipv.py``:

- ``ipv_encoded``: a small model (8 features -> 32 float32) turns the visit into a 128-byte
  encoding, the compact form the Walle paper ships instead of the ~1.3 KB raw page-level sequence.
  A deployment ships trained encoder weights as a model file (``engine.save_model``) and passes its
  path in ``STREAMFLOW_IPV_ENCODER``; without one the encoder is a fixed, seeded random projection.
- ``purchase_model``: an MLP trained on the device, one Adam step per 64 visits, to predict whether
  a visit ends in a purchase from what else happened on the page; each step logs its loss.

Run it:  streamflow run jobs/ipv_encoder.py --events jobs/data/taobao_user_behavior_10k.csv
"""

import math
import os
from pathlib import Path

import numpy as np

from engine import GraphBuilder, load_model
from operators import Infer, Map, Train
from streamflow import Job, Task, load_job

IPV = load_job(Path(__file__).with_name("ipv.py")).tasks[0]
N_FEATURES = 8


def ipv_features(row: dict) -> list[float]:
    """The IPV row as numbers (without ``n_buy``, the purchase model's label)."""
    day = 2 * math.pi * (row["enter_ts"] % 86_400) / 86_400
    return [math.log1p(row["dwell_s"]), math.log1p(row["n_reload"]), row["n_fav"], row["n_cart"],
            math.sin(day), math.cos(day), float(row["dwell_s"] == 0), (int(row["category_id"]) % 97) / 97]


def encoder():
    if os.environ.get("STREAMFLOW_IPV_ENCODER"):
        return load_model(os.environ["STREAMFLOW_IPV_ENCODER"])
    rng = np.random.default_rng(0)
    b = GraphBuilder("ipv_encoder")
    x = b.input("ipv", (None, N_FEATURES))
    b.output(b.sigmoid(b.linear(x, rng.standard_normal((N_FEATURES, 32), dtype=np.float32) / math.sqrt(N_FEATURES),
                                np.zeros(32, np.float32))))
    return b.build()


def purchase_mlp():
    rng = np.random.default_rng(1)
    b = GraphBuilder("purchase")
    h = b.relu(b.linear(b.input("ipv", (None, N_FEATURES)),
                        rng.standard_normal((N_FEATURES, 16), dtype=np.float32) * 0.3, np.zeros(16, np.float32)))
    b.output(b.linear(h, rng.standard_normal((16, 2), dtype=np.float32) * 0.3, np.zeros(2, np.float32)))
    return b.build()


ipv_encoded = Task(
    name="ipv_encoded",
    trigger=IPV.trigger,
    input="page",
    pipeline=[*IPV.pipeline,
              # reproducible: the same encoding bytes on every run and on both runners
              Infer(encoder(), features=ipv_features, into="encoding", as_bytes=True, reproducible=True),
              Map(lambda row: {"item_id": row["item_id"], "category_id": row["category_id"],
                               "encoding": row["encoding"]})],
)

purchase_model = Task(
    name="purchase_model",
    trigger=IPV.trigger,
    input="page",
    pipeline=[*IPV.pipeline,
              Train(purchase_mlp(), features=ipv_features, label=lambda row: int(row["n_buy"] > 0),
                    batch_size=64, lr=0.01)],
    tunnel=False,  # with --tunnel kafka the 128-byte encodings go to the cloud; the training log stays here
)

job = Job("ipv_encoder", [ipv_encoded, purchase_model],
          description="IPV features encoded to 128 bytes and a purchase model trained on the device")
