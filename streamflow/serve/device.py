"""The device's model process (see :mod:`streamflow.serve.child` for why it is a process of its own).

Per request ``(request_id, image, encode)`` it sends back the encoded image first (``("encoded", id,
bytes)``, when ``encode``: the request can leave for the cloud at once), then the local model's answer
(``("label", id, (class index, inference ms))``), or ``("error", id, reason)`` for an image it cannot take.
The local model runs on our engine (:meth:`streamflow.serve.zoo.Zoo.predictor`), warmed up before
``ready``.

Example (needs the zoo)::

    >>> import numpy as np, queue
    >>> from streamflow.serve.child import Child
    >>> from streamflow.serve.zoo import Zoo
    >>> zoo, results = Zoo.load(), queue.SimpleQueue()                                     # doctest: +SKIP
    >>> device = Child("streamflow.serve.device", lambda *m: results.put(m)).start(
    ...     {"zoo": str(zoo.path), "model": zoo.fastest().name})                          # doctest: +SKIP
    >>> device.send((1, np.zeros((64, 64, 3), np.uint8), True))                           # doctest: +SKIP
    >>> results.get()[0], results.get()[0]                                                 # doctest: +SKIP
    ('encoded', 'label')
    >>> device.close()                                                                     # doctest: +SKIP
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from streamflow.serve.child import ChildSide


def serve(side: ChildSide) -> None:
    from streamflow.serve.messages import encode_image
    from streamflow.serve.zoo import Zoo

    hello = side.hello
    image_format, quality = hello.get("image_format", "jpeg"), int(hello.get("quality", 90))
    try:
        zoo = Zoo.load(Path(hello["zoo"]))
        predict = zoo.predictor(hello["model"])
        zoo.warm_up([hello["model"]])
    except Exception as exc:  # the parent raises it from start()
        side.send("failed", 0, f"the device model {hello.get('model')!r} could not start: {exc}")
        return
    side.send("ready", 0, None)
    while (message := side.recv()) is not None:
        request_id, image, encode = message
        try:
            if encode:
                side.send("encoded", request_id, encode_image(image, image_format, quality))
            start = time.perf_counter()
            label = predict(image)
        except ValueError as exc:
            side.send("error", request_id, str(exc))
            continue
        side.send("label", request_id, (label, (time.perf_counter() - start) * 1000.0))


if __name__ == "__main__":
    serve(ChildSide(int(sys.argv[1])))
