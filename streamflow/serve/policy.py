"""MDInference's model choice (Ogden & Guo, IC2E'20) as pure code: no Kafka, no clock, no model.

Two rules choose the model (``MDInference(rule=...)``): the paper's (``"paper"``, the default of this class)
and the expected-accuracy rule (``"expected"``, the serving worker's default; see below).

The paper's rule, for a request with a latency SLA and the device's measured upload time:

1. network estimate = 2 × upload time (the reply is assumed to take as long as the upload);
2. model budget = SLA − network estimate;
3. candidates = the models whose profiled latency ``mean + std`` fits the budget;
4. one candidate is drawn with probability ``softmax(accuracy / temperature)`` (the most accurate is
   favoured; the others are still tried now and then, which keeps their profiles fresh);
5. exploration beyond the candidates: with probability ``explore`` one of the models that do not fit is
   run instead, so that a model whose profile looks too slow (one stall while it ran is enough) is measured
   again rather than shut out for good;
6. if no model fits, the fastest (lowest ``mean + std``) is used — the device's own model covers the SLA;
7. the answering model's profile is updated with the measured inference time by an EWMA of mean and
   variance (weight ``alpha`` on the new sample), the sample clipped at ``mean + clip_sigmas · std``: on a
   shared machine one inference now and then takes ten times its usual time, which is the machine, not
   the model.

The expected-accuracy rule (``rule="expected"``) keeps steps 1, 2, 5 and 7 and replaces the hard fit test and
the "fastest when none fits" fallback by what MDInference is after — the most accurate answer the device gets
by its deadline — written out. The device always holds its own model's answer (accuracy ``a_local``), so a
cloud model ``m`` that arrives in time with probability ``P_m`` is worth, in expected accuracy,

    ``E_m = P_m · a_m + (1 − P_m) · a_local``,  ``P_m = Φ((budget − mean_m) / sqrt(std_m² + σ_net²))``,

where ``mean_m, std_m`` is the model's EWMA profile and ``σ_net`` the spread of the network estimate (twice
the spread of the device's measured upload time, which the request carries; without one,
``unknown_network_cv`` × the estimate). One model is drawn with probability ``softmax(E / temperature)``.
Why: the paper's rule assumes the model's time is what decides whether the answer is in time. When the
models differ by a few ms (the zoo's PP-LCNet sizes: 2-7 ms) and the network by tens (its jitter), a small
budget says little about which model arrives: the paper's rule then picks a small model that is much less
accurate and saves ~2 ms, and with nothing fitting it picks the fastest, which is no better than the
device's own answer (measured by ``bench.serve``: at SLA 100 ms with jittery links MDInference answered less
accurately than always running the largest model). ``E`` never prefers a model no more accurate than the
device's, and it prefers a faster model exactly when the time it saves moves enough probability mass under
the deadline to pay for its lost accuracy. ``on_time`` of the choice tells the worker whether running any
model is worth it (:meth:`MDInference.worth_running`: ``P ≥ min_on_time``), instead of the budget's sign:
the budget is an estimate, and a reply estimated a few ms late still arrives in time often.

Example:
    >>> import random
    >>> models = [ModelInfo("small", 0.70), ModelInfo("large", 0.90)]
    >>> profiles = {"small": Profile(10.0, 4.0), "large": Profile(60.0, 100.0)}
    >>> choice = MDInference(temperature=0.05, explore=0).choose(models, profiles, sla_ms=100, upload_ms=15,
    ...                                                          rng=random.Random(0))
    >>> choice.budget_ms, choice.candidates, choice.model
    (70.0, ('small', 'large'), 'large')
    >>> Profile(10.0, 4.0).updated(14.0, alpha=0.5)
    Profile(mean_ms=12.0, var_ms2=6.0, n=1)
    >>> Profile(10.0, 4.0).updated(300.0, alpha=0.5, clip_sigmas=3)   # counts as 10 + 3·2 = 16
    Profile(mean_ms=13.0, var_ms2=11.0, n=1)
    >>> expected = MDInference(rule="expected", temperature=0, explore=0)
    >>> c = expected.choose(models, profiles, sla_ms=100, upload_ms=45, rng=random.Random(0), upload_std_ms=0,
    ...                     local_accuracy=0.6)   # budget 10: small in time half the time, large never
    >>> c.model, round(c.on_time, 3)
    ('small', 0.5)
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

#: Which model-choice rule a request asks for: MDInference, or the static "always the largest model".
PolicyName = Literal["mdinference", "largest"]
POLICIES: tuple[str, ...] = ("mdinference", "largest")
#: How MDInference picks among the models: the paper's fit test, or the expected accuracy (module docstring).
RuleName = Literal["paper", "expected"]
RULES: tuple[str, ...] = ("paper", "expected")


def normal_cdf(x: float) -> float:
    """Φ(x), the standard normal distribution function."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def on_time_probability(budget_ms: float, profile: Profile, network_std_ms: float) -> float:
    """P(model time ≤ budget) with the model's time ~ N(mean, std²) and the network estimate's error ~ N(0, σ²).

    >>> on_time_probability(10.0, Profile(10.0, 9.0), 4.0)    # budget = mean: one half
    0.5
    >>> round(on_time_probability(15.0, Profile(10.0, 9.0), 4.0), 4)   # one σ = sqrt(9 + 16) = 5 above: Φ(1)
    0.8413
    """
    spread = math.sqrt(max(profile.var_ms2, 0.0) + network_std_ms**2)
    if spread == 0.0:
        return 1.0 if profile.mean_ms <= budget_ms else 0.0
    return normal_cdf((budget_ms - profile.mean_ms) / spread)


class HasAccuracy(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def accuracy(self) -> float: ...


@dataclass(frozen=True)
class ModelInfo:
    """A model the cloud can run: its name and its accuracy on the labelled eval set (0..1)."""

    name: str
    accuracy: float


@dataclass(frozen=True)
class Profile:
    """A model's latency profile: EWMA mean and variance of its inference time (ms, ms²), ``n`` updates."""

    mean_ms: float
    var_ms2: float
    n: int = 0

    @property
    def std_ms(self) -> float:
        return math.sqrt(max(self.var_ms2, 0.0))

    @property
    def bound_ms(self) -> float:
        """What the policy compares with the budget: ``mean + std``."""
        return self.mean_ms + self.std_ms

    def updated(self, observed_ms: float, alpha: float, clip_sigmas: float | None = None) -> Profile:
        """The profile after one more measurement (exponentially weighted mean and variance).

        ``mean += α·δ`` and ``var = (1 − α)·(var + α·δ²)`` with ``δ = observed − mean``: the standard
        incremental EWMA pair, so a constant input drives the variance to 0. With ``clip_sigmas``, a sample
        above ``mean + clip_sigmas · std`` counts as that bound (when the profile has a spread).
        """
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if clip_sigmas is not None and self.var_ms2 > 0:
            observed_ms = min(observed_ms, self.mean_ms + clip_sigmas * self.std_ms)
        delta = observed_ms - self.mean_ms
        increment = alpha * delta
        return Profile(self.mean_ms + increment, (1.0 - alpha) * (self.var_ms2 + delta * increment), self.n + 1)

    def to_dict(self) -> dict[str, float]:
        return {"mean_ms": self.mean_ms, "var_ms2": self.var_ms2, "n": self.n}

    @classmethod
    def from_dict(cls, value: Mapping[str, float]) -> Profile:
        return cls(float(value["mean_ms"]), float(value["var_ms2"]), int(value.get("n", 0)))


@dataclass(frozen=True)
class Choice:
    """Which model answers a request, and why.

    ``reason``: ``"sampled"`` (drawn among the candidates), ``"explored"`` (a model that does not fit, to
    measure it again), ``"none_fits"`` (no candidate: the fastest), ``"static"`` (a static policy, no budget
    consulted), ``"expected"`` (drawn by expected accuracy; ``candidates`` are then every model, in the
    order given, and ``on_time`` the picked model's probability of arriving in time).
    """

    model: str
    budget_ms: float
    network_ms: float
    candidates: tuple[str, ...]
    probabilities: tuple[float, ...]
    reason: Literal["sampled", "explored", "none_fits", "static", "expected"]
    on_time: float = math.nan


@dataclass(frozen=True)
class MDInference:
    """The policy's knobs: ``temperature`` of the accuracy softmax (in accuracy units, 0..1; 0 = always the
    most accurate candidate), ``alpha`` of the profile EWMA and its outlier clip ``clip_sigmas`` (None: no
    clip), ``explore`` (the probability of running a model that does not fit), and the share of the SLA
    assumed to be network time when a request carries no upload time yet (a device's first request).
    ``rule`` picks the model-choice rule (:data:`RULES`; module docstring); the expected-accuracy rule also
    uses ``unknown_network_cv`` (the network estimate's spread as a share of it, when a request carries no
    measured spread) and ``min_on_time`` (below this chance of arriving in time the worker runs no model).

    The default temperature suits the zoo, whose best models are within half a point of each other: a model
    0.3 points less accurate than the best gets ``e^-1.5`` ≈ 0.22 of its weight, one a point less ``e^-5``
    (at 0.02, and on this machine at 0.005 with the rotated models, MDInference spread its answers over the
    near-best models and answered less accurately than always running the largest model at generous SLAs,
    measured by ``bench.serve``)."""

    temperature: float = 0.002
    alpha: float = 0.2
    explore: float = 0.02
    clip_sigmas: float | None = 3.0
    unknown_network_share: float = 0.5
    rule: RuleName = "paper"
    unknown_network_cv: float = 0.5
    min_on_time: float = 0.02

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if not 0.0 <= self.explore < 1.0:
            raise ValueError(f"explore must be in [0, 1), got {self.explore}")
        if self.clip_sigmas is not None and self.clip_sigmas <= 0:
            raise ValueError(f"clip_sigmas must be positive or None, got {self.clip_sigmas}")
        if not 0.0 <= self.unknown_network_share <= 1.0:
            raise ValueError(f"unknown_network_share must be in [0, 1], got {self.unknown_network_share}")
        if self.rule not in RULES:
            raise ValueError(f"rule is one of {RULES}, got {self.rule!r}")
        if self.unknown_network_cv < 0:
            raise ValueError(f"unknown_network_cv must be >= 0, got {self.unknown_network_cv}")
        if not 0.0 <= self.min_on_time < 1.0:
            raise ValueError(f"min_on_time must be in [0, 1), got {self.min_on_time}")

    def network_estimate_ms(self, sla_ms: float, upload_ms: float | None) -> float:
        if upload_ms is None:
            return self.unknown_network_share * sla_ms
        return 2.0 * max(upload_ms, 0.0)

    def network_std_ms(self, network_ms: float, upload_std_ms: float | None) -> float:
        """The spread of the network estimate: twice the upload time's measured spread (the estimate is twice
        the upload time), else ``unknown_network_cv`` × the estimate."""
        if upload_std_ms is None or not math.isfinite(upload_std_ms):
            return self.unknown_network_cv * network_ms
        return 2.0 * max(upload_std_ms, 0.0)

    def probabilities(self, accuracies: Sequence[float]) -> list[float]:
        """``softmax(accuracy / temperature)``; temperature 0 puts all weight on the most accurate (ties share)."""
        if not accuracies:
            return []
        best = max(accuracies)
        if self.temperature == 0:
            weights = [1.0 if a == best else 0.0 for a in accuracies]
        else:
            weights = [math.exp((a - best) / self.temperature) for a in accuracies]
        total = sum(weights)
        return [w / total for w in weights]

    def choose(self, models: Sequence[HasAccuracy], profiles: Mapping[str, Profile], sla_ms: float,
               upload_ms: float | None, rng: random.Random, *, upload_std_ms: float | None = None,
               local_accuracy: float | None = None) -> Choice:
        """The model for one request; ``profiles`` must hold every model of ``models``. ``upload_std_ms`` (the
        measured spread of the upload time) and ``local_accuracy`` (of the device's own model; None: 0, no
        fallback) are used by the expected-accuracy rule only."""
        if not models:
            raise ValueError("no models to choose from")
        network = self.network_estimate_ms(sla_ms, upload_ms)
        budget = sla_ms - network
        fitting = [m for m in models if profiles[m.name].bound_ms <= budget]
        outside = [m for m in models if m not in fitting]
        candidates = tuple(m.name for m in fitting)
        probabilities = self.probabilities([m.accuracy for m in fitting])
        if self.explore and outside and rng.random() < self.explore:
            explored = rng.choice(outside).name
            on_time = (on_time_probability(budget, profiles[explored], self.network_std_ms(network, upload_std_ms))
                       if self.rule == "expected" else math.nan)
            return Choice(explored, budget, network, candidates, tuple(probabilities), "explored", on_time)
        if self.rule == "expected":
            return self._by_expected_accuracy(models, profiles, budget, network, upload_std_ms, local_accuracy, rng)
        if not fitting:
            fastest = min(models, key=lambda m: profiles[m.name].bound_ms)
            return Choice(fastest.name, budget, network, (), (), "none_fits")
        draw, cumulative, picked = rng.random(), 0.0, fitting[-1]
        for model, p in zip(fitting, probabilities, strict=True):
            cumulative += p
            if draw < cumulative:
                picked = model
                break
        return Choice(picked.name, budget, network, candidates, tuple(probabilities), "sampled")

    def expected_accuracies(self, models: Sequence[HasAccuracy], profiles: Mapping[str, Profile], budget_ms: float,
                            network_std_ms: float, local_accuracy: float | None) -> list[tuple[float, float]]:
        """``(P_m, E_m)`` per model: its chance of arriving within ``budget_ms`` and its expected accuracy with
        the device's answer (``local_accuracy``) standing in when it does not."""
        fallback = 0.0 if local_accuracy is None else local_accuracy
        out = []
        for m in models:
            p = on_time_probability(budget_ms, profiles[m.name], network_std_ms)
            out.append((p, p * m.accuracy + (1.0 - p) * fallback))
        return out

    def _by_expected_accuracy(self, models: Sequence[HasAccuracy], profiles: Mapping[str, Profile], budget: float,
                              network: float, upload_std_ms: float | None, local_accuracy: float | None,
                              rng: random.Random) -> Choice:
        values = self.expected_accuracies(models, profiles, budget, self.network_std_ms(network, upload_std_ms),
                                          local_accuracy)
        probabilities = self.probabilities([e for _, e in values])
        draw, cumulative, picked = rng.random(), 0.0, len(models) - 1
        for i, p in enumerate(probabilities):
            cumulative += p
            if draw < cumulative:
                picked = i
                break
        return Choice(models[picked].name, budget, network, tuple(m.name for m in models), tuple(probabilities),
                      "expected", values[picked][0])

    def worth_running(self, choice: Choice) -> bool:
        """Whether the worker should run the chosen model at all, or answer at once that no time is left (the
        device's own model then answers): the paper's rule while the budget is positive, the expected-accuracy
        rule while its chance of arriving in time is at least ``min_on_time``, the static policy always (it
        consults no budget)."""
        if choice.reason == "static":
            return True
        if self.rule == "expected" and not math.isnan(choice.on_time):
            return choice.on_time >= self.min_on_time
        return choice.budget_ms > 0

    def update(self, profile: Profile, observed_ms: float) -> Profile:
        """``profile`` after the answering model took ``observed_ms`` (EWMA with this policy's alpha and clip)."""
        return profile.updated(observed_ms, self.alpha, self.clip_sigmas)

    def static(self, model: str, sla_ms: float, upload_ms: float | None) -> Choice:
        """A static baseline: always ``model`` (e.g. the largest), whatever the budget."""
        network = self.network_estimate_ms(sla_ms, upload_ms)
        return Choice(model, sla_ms - network, network, (model,), (1.0,), "static")


__all__ = ["POLICIES", "RULES", "Choice", "MDInference", "ModelInfo", "PolicyName", "Profile", "RuleName",
           "normal_cdf", "on_time_probability"]
