"""Real-time serving as a stream operator: each row's image answered by the cloud or the device, within an SLA.

The operator hands every row of a firing to a serving client at once (the requests overlap) and waits for
their answers; the client (:class:`streamflow.serve.client.ServeClient`) races the cloud worker against the
device's fastest model and answers each request exactly once by its deadline.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from operators.base import FieldSpec, Group, Operator, field_reader


class ServingClient(Protocol):
    def submit(self, image: Any, sla_ms: float, policy: str = ...) -> Any: ...


class Serve(Operator):
    """Add a served prediction to every row: ``row[into]`` and ``answered_by``, ``model``, ``latency_ms``,
    ``met_sla`` (and ``budget_ms`` of the cloud's model choice, NaN for a device answer).

    ``client`` is a started :class:`~streamflow.serve.client.ServeClient`; ``image`` names (or computes) the
    row's ``H×W×3`` uint8 image; ``sla_ms`` is a number or a field; ``policy`` is ``"mdinference"``,
    ``"largest"`` (always the most accurate cloud model) or ``"local"`` (never the cloud). Copies of the
    operator (a runner's per-task copies) share the one client.

    Example (a broker, ``streamflow serve`` and the zoo must be up)::

        >>> from operators import Serve, run_pipeline                                  # doctest: +SKIP
        >>> from streamflow.serve.client import ServeClient                            # doctest: +SKIP
        >>> with ServeClient("phone-1") as client:                                     # doctest: +SKIP
        ...     rows = run_pipeline([Serve(client, image="page", sla_ms=150)], [{"page": page}])
        >>> rows[0]["answered_by"], rows[0]["model"], rows[0]["label"]                 # doctest: +SKIP
        ('cloud', 'pplcnet_160', 2)
    """

    def __init__(self, client: ServingClient, image: FieldSpec = "image", sla_ms: float | FieldSpec = 150.0,
                 policy: str = "mdinference", into: str = "label"):
        self.client = client
        self.image = image
        self.sla_ms = sla_ms
        self.policy = policy
        self.into = into
        self._image = field_reader(image)
        self._sla: Callable[[Any], float] = (field_reader(sla_ms) if isinstance(sla_ms, str) or callable(sla_ms)
                                             else _constant(float(sla_ms)))

    def apply(self, groups: list[Group]) -> list[Group]:
        rows = [row for _, items in groups for row in items]
        for row in rows:
            if not isinstance(row, Mapping):
                raise TypeError(f"Serve works on rows (dicts); put it after an Aggregate or a Map, got {row!r}")
        futures = iter([self.client.submit(self._image(row), float(self._sla(row)), self.policy) for row in rows])
        out = []
        for key, items in groups:
            served = []
            for row in items:
                answer = next(futures).result()
                served.append({**row, self.into: answer.label, "answered_by": answer.answered_by,
                               "model": answer.model, "latency_ms": answer.latency_ms, "met_sla": answer.met_sla,
                               "budget_ms": answer.budget_ms})
            out.append((key, served))
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> Serve:
        twin = copy.copy(self)  # the client (threads, Kafka connections) is shared, not copied
        memo[id(self)] = twin
        return twin


__all__ = ["Serve"]


def _constant(value: float) -> Callable[[Any], float]:
    """The SLA of every row when ``sla_ms`` is a number."""
    return lambda _row: value
