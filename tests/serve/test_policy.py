"""MDInference's policy against a hand-computed example: known profiles, a fixed seed → known budget,
candidates, probabilities and pick; the EWMA update by hand."""

import math
import random

import pytest

from streamflow.serve.policy import MDInference, ModelInfo, Profile

MODELS = [ModelInfo("a", 0.70), ModelInfo("b", 0.80), ModelInfo("c", 0.90)]
# mean + std: a 10 + 2 = 12, b 30 + 5 = 35, c 60 + 10 = 70
PROFILES = {"a": Profile(10.0, 4.0), "b": Profile(30.0, 25.0), "c": Profile(60.0, 100.0)}


def test_budget_candidates_and_probabilities_by_hand():
    policy = MDInference(temperature=0.1, explore=0)
    # SLA 100, upload 20 → network 2 × 20 = 40 → budget 60: a (12) and b (35) fit, c (70) does not
    choice = policy.choose(MODELS, PROFILES, sla_ms=100, upload_ms=20, rng=random.Random(0))
    assert choice.network_ms == 40.0
    assert choice.budget_ms == 60.0
    assert choice.candidates == ("a", "b")
    # weights e^(0.7/0.1) : e^(0.8/0.1) = 1 : e  →  p(a) = 1/(1+e) = 0.268941..., p(b) = e/(1+e)
    assert choice.probabilities == pytest.approx((1 / (1 + math.e), math.e / (1 + math.e)), abs=1e-12)
    assert choice.probabilities[0] == pytest.approx(0.268941, abs=1e-6)
    # random.Random(0).random() = 0.844421... ≥ p(a) → b
    assert random.Random(0).random() == pytest.approx(0.8444218515250481)
    assert (choice.model, choice.reason) == ("b", "sampled")


def test_a_draw_below_the_first_probability_picks_the_less_accurate_candidate():
    # random.Random(3).random() = 0.237964... < p(a) = 0.268941 → a: exploration of the less accurate model
    assert random.Random(3).random() == pytest.approx(0.23796462709189137)
    choice = MDInference(temperature=0.1, explore=0).choose(MODELS, PROFILES, sla_ms=100, upload_ms=20,
                                                            rng=random.Random(3))
    assert choice.model == "a"


def test_sampling_frequencies_follow_the_probabilities():
    policy, rng = MDInference(temperature=0.1, explore=0), random.Random(7)
    picks = [policy.choose(MODELS, PROFILES, 100, 20, rng).model for _ in range(20_000)]
    assert picks.count("c") == 0
    assert picks.count("a") / len(picks) == pytest.approx(1 / (1 + math.e), abs=0.01)


def test_no_model_fits_takes_the_fastest():
    # SLA 50, upload 20 → budget 10 < 12 (a's mean + std): nothing fits → the fastest, a
    choice = MDInference(explore=0).choose(MODELS, PROFILES, sla_ms=50, upload_ms=20, rng=random.Random(0))
    assert (choice.model, choice.budget_ms, choice.candidates, choice.reason) == ("a", 10.0, (), "none_fits")


def test_a_generous_budget_and_zero_temperature_take_the_most_accurate():
    choice = MDInference(temperature=0, explore=0).choose(MODELS, PROFILES, sla_ms=250, upload_ms=5,
                                                          rng=random.Random(0))
    assert choice.candidates == ("a", "b", "c")
    assert choice.probabilities == (0.0, 0.0, 1.0)
    assert choice.model == "c"


def test_unknown_upload_time_assumes_half_the_sla_is_network():
    choice = MDInference(explore=0).choose(MODELS, PROFILES, sla_ms=100, upload_ms=None, rng=random.Random(0))
    assert (choice.network_ms, choice.budget_ms, choice.candidates) == (50.0, 50.0, ("a", "b"))


def test_the_static_baseline_ignores_the_budget():
    choice = MDInference().static("c", sla_ms=100, upload_ms=40)
    assert (choice.model, choice.budget_ms, choice.reason) == ("c", 20.0, "static")


def test_ewma_update_by_hand():
    # alpha 0.5, profile a (mean 10, var 4), observed 14: δ = 4, mean = 10 + 2 = 12,
    # var = (1 − 0.5)·(4 + 4·2) = 6
    updated = PROFILES["a"].updated(14.0, alpha=0.5)
    assert updated == Profile(12.0, 6.0, 1)
    # alpha 0.2 twice, observed 20 then 20: mean 12 → 13.6 → 14.88 (hand: 12 + 0.2·8; 13.6 + 0.2·6.4)
    again = updated.updated(20.0, 0.2).updated(20.0, 0.2)
    assert again.mean_ms == pytest.approx(14.88)
    # var: (0.8)(6 + 8·1.6) = 15.04; then (0.8)(15.04 + 6.4·1.28) = 18.5856
    assert again.var_ms2 == pytest.approx(18.5856)
    assert again.n == 3


def test_exploration_runs_a_model_that_does_not_fit_with_the_asked_probability():
    # budget 60: a and b fit, c does not. random.Random(1): 0.134364... < 0.2 → explore → rng.choice([c]) = c
    assert random.Random(1).random() == pytest.approx(0.13436424411240122)
    choice = MDInference(temperature=0.1, explore=0.2).choose(MODELS, PROFILES, 100, 20, random.Random(1))
    assert (choice.model, choice.reason, choice.candidates) == ("c", "explored", ("a", "b"))
    policy, rng = MDInference(temperature=0.1, explore=0.05), random.Random(5)
    picks = [policy.choose(MODELS, PROFILES, 100, 20, rng) for _ in range(20_000)]
    assert sum(c.reason == "explored" for c in picks) / len(picks) == pytest.approx(0.05, abs=0.005)
    # with every model fitting there is nothing to explore
    assert all(policy.choose(MODELS, PROFILES, 250, 5, rng).reason == "sampled" for _ in range(200))


def test_a_stall_is_clipped_before_it_enters_the_profile():
    # mean 20, std 5: a 400 ms stall counts as 20 + 3·5 = 35 → mean 20 + 0.2·15 = 23
    clipped = MDInference(alpha=0.2).update(Profile(20.0, 25.0), 400.0)
    assert clipped.mean_ms == pytest.approx(23.0)
    assert Profile(20.0, 25.0).updated(400.0, alpha=0.2).mean_ms == pytest.approx(96.0)  # unclipped


def test_a_constant_latency_drives_the_variance_to_zero():
    profile = Profile(50.0, 400.0)
    for _ in range(200):
        profile = profile.updated(20.0, alpha=0.2)
    assert profile.mean_ms == pytest.approx(20.0) and profile.std_ms == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"alpha": 0}, {"alpha": 1.5}, {"unknown_network_share": 2},
                                 {"explore": 1.0}, {"clip_sigmas": 0}])
def test_bad_knobs_are_refused(bad):
    with pytest.raises(ValueError):
        MDInference(**bad)


# --- the expected-accuracy rule ------------------------------------------------------------------------------------
EXPECTED = MDInference(rule="expected", temperature=0, explore=0)


def test_expected_accuracy_by_hand():
    # SLA 100, upload 30 → network 60, budget 40; upload spread 5 → network spread σ = 10.
    # a: mean 10, var 4  → z = 30 / sqrt(4 + 100)   = 2.9417 → P = 0.99837 → E = 0.6 + P·0.1 = 0.69984
    # b: mean 30, var 25 → z = 10 / sqrt(25 + 100)  = 0.8944 → P = 0.81444 → E = 0.6 + P·0.2 = 0.76289
    # c: mean 60, var 100 → z = −20 / sqrt(200)    = −1.4142 → P = 0.07865 → E = 0.6 + P·0.3 = 0.62360
    choice = EXPECTED.choose(MODELS, PROFILES, sla_ms=100, upload_ms=30, rng=random.Random(0), upload_std_ms=5,
                             local_accuracy=0.6)
    values = EXPECTED.expected_accuracies(MODELS, PROFILES, 40.0, 10.0, 0.6)
    assert [p for p, _ in values] == pytest.approx([0.998368, 0.814453, 0.078650], abs=1e-6)
    assert [e for _, e in values] == pytest.approx([0.699837, 0.762891, 0.623595], abs=1e-6)
    assert (choice.model, choice.reason, choice.budget_ms, choice.network_ms) == ("b", "expected", 40.0, 60.0)
    assert choice.candidates == ("a", "b", "c") and choice.probabilities == (0.0, 1.0, 0.0)
    assert choice.on_time == pytest.approx(0.814453, abs=1e-6)


def test_expected_rule_never_prefers_a_model_no_better_than_the_device():
    # budget −10 (network 110): the paper's rule takes the fastest (a, 0.70); with the device at 0.70, a's E is
    # 0.70 whatever its P; upload spread 20 → σ = 40:
    # b: z = −40 / sqrt(25 + 1600) = −0.9923 → P = 0.16053 → E = 0.7 + P·0.1 = 0.71605
    # c: z = −70 / sqrt(100 + 1600) = −1.6977 → P = 0.04478 → E = 0.7 + P·0.2 = 0.70896
    paper = MDInference(explore=0).choose(MODELS, PROFILES, sla_ms=100, upload_ms=55, rng=random.Random(0))
    assert (paper.model, paper.reason) == ("a", "none_fits")
    choice = EXPECTED.choose(MODELS, PROFILES, sla_ms=100, upload_ms=55, rng=random.Random(0), upload_std_ms=20,
                             local_accuracy=0.70)
    assert choice.model == "b"
    assert choice.on_time == pytest.approx(0.160531, abs=1e-6)  # above min_on_time (0.02): worth running
    assert EXPECTED.worth_running(choice)
    assert not MDInference(rule="expected", min_on_time=0.2).worth_running(choice)
    assert not MDInference(explore=0).worth_running(paper)  # the paper's rule: no budget, no model


def test_expected_rule_without_a_measured_spread_uses_the_unknown_cv():
    policy = MDInference(rule="expected", unknown_network_cv=0.25)
    assert policy.network_std_ms(60.0, None) == 15.0
    assert policy.network_std_ms(60.0, 4.0) == 8.0  # measured: twice the upload time's spread
    with pytest.raises(ValueError, match="rule"):
        MDInference(rule="fastest")  # type: ignore[arg-type]


def test_the_static_policy_always_runs():
    assert MDInference(rule="expected").worth_running(MDInference().static("c", sla_ms=100, upload_ms=60))
