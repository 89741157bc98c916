"""The attacks of fedrun/attacks.py on three or four clients, with numbers computed by hand.

The common example: four cohort clients, the last malicious; the honest updates are [1, 2], [3, 4], [5, 6], so
their mean is [3, 4] and their coordinate-wise standard deviation (n - 1) is [2, 2].
"""

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch

from fedrun.aggregators import FedAvg, TrimmedMean
from fedrun.aggregators.base import Aggregation
from fedrun.attacks import (
    ALIE,
    IPM,
    Attack,
    CountLie,
    Gaussian,
    LabelFlip,
    LossLie,
    MinMax,
    MinSum,
    RandomLabels,
    Scale,
    SignFlip,
    alie_z_max,
    line_search,
)
from fedrun.cohort import ClientLosses, RoundView
from fedrun.errors import ConfigError
from fedrun.seeding import torch_generator
from fedrun.state import Context

COHORT = np.array([0, 1, 2, 3])
MASK = np.array([False, False, False, True])
DELTAS = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], dtype=torch.float64)
HONEST = DELTAS[:3]


def bound(attack, clients=4, seed=0, sizes=None):
    """``attack`` bound to a run of ``clients`` clients of 10 samples (or ``sizes``)."""
    attack.bind(Context(None, np.full(clients, 10) if sizes is None else sizes, seed))
    return attack


def sent(attack, deltas=DELTAS, mask=MASK, cohort=COHORT, round_=1, **kwargs):
    out = bound(attack).updates(round_, cohort, deltas, mask, **kwargs)
    assert torch.equal(out[~torch.as_tensor(mask)], deltas[~torch.as_tensor(mask)])  # honest rows bit for bit
    return out


# -- who is malicious ----------------------------------------------------------------------------------------------


def test_the_fixed_set_is_the_seeds_whatever_the_order_of_calls():
    a, b = bound(Attack(fraction=0.3), 100, seed=7), bound(Attack(fraction=0.3), 100, seed=7)
    assert len(a.malicious_ids()) == 30 and np.array_equal(a.malicious_ids(), b.malicious_ids())
    assert np.all(np.diff(a.malicious_ids()) > 0)  # sorted, distinct
    everyone = np.arange(100)
    late_first = [a.malicious(t, everyone) for t in (9, 2, 5)]
    early_first = [b.malicious(t, everyone) for t in (2, 5, 9)]
    assert all(np.array_equal(x, early_first[0]) for x in late_first + early_first)  # fixed: the same every round
    assert np.array_equal(np.flatnonzero(late_first[0]), a.malicious_ids())
    assert not np.array_equal(bound(Attack(fraction=0.3), 100, seed=8).malicious_ids(), a.malicious_ids())
    a.load_state_dict(a.state_dict())  # a resumed run: nothing saved, the same set
    assert a.state_dict() == {} and np.array_equal(a.malicious_ids(), b.malicious_ids())


def test_a_redrawn_set_is_the_rounds_and_differs_across_rounds():
    a, b = bound(Attack(fraction=0.2, who="redrawn"), 50, seed=3), bound(Attack(fraction=0.2, who="redrawn"), 50, 3)
    everyone = np.arange(50)
    in_order = [a.malicious(t, everyone) for t in (1, 2, 3)]
    backwards = [b.malicious(t, everyone) for t in (3, 2, 1)][::-1]
    assert all(np.array_equal(x, y) and x.sum() == 10 for x, y in zip(in_order, backwards))
    assert not np.array_equal(in_order[0], in_order[1]) and not np.array_equal(in_order[1], in_order[2])
    with pytest.raises(ValueError, match="redrawn"):
        a.malicious_ids()


def test_count_and_fraction():
    assert len(bound(Attack(count=3), 10).malicious_ids()) == 3
    assert len(bound(Attack(fraction=0.29), 100).malicious_ids()) == 29  # 0.29 * 100 = 28.999999999999996
    assert len(bound(Attack(fraction=0.25), 10).malicious_ids()) == 2  # floor
    assert len(bound(Attack(), 10).malicious_ids()) == 0  # attack=none
    with pytest.raises(ConfigError, match=r"^count=10 is invalid: allowed is an integer from 0 to 9"):
        bound(Attack(count=10), 10)
    with pytest.raises(ConfigError, match=r"^fraction=1.0 is invalid"):
        Attack(fraction=1.0)
    with pytest.raises(ConfigError, match=r"^count=2 is invalid: allowed is null when fraction is set"):
        Attack(fraction=0.1, count=2)
    with pytest.raises(ConfigError, match=r"^who='sometimes' is invalid: allowed is fixed or redrawn"):
        Attack(who="sometimes")


def test_a_population_of_a_million_holds_only_the_malicious_ids():
    sizes = np.broadcast_to(np.int64(20), (1_000_000,))  # partition=population's shared sizes
    attack = bound(SignFlip(fraction=0.001), sizes=sizes)
    assert attack.malicious_ids().shape == (1000,) and attack.malicious_ids().dtype == np.int64
    for name, value in vars(attack).items():  # nothing N-sized of its own (the context's sizes are shared)
        assert not isinstance(value, np.ndarray) or value.size <= 1000 or value is sizes, name
    cohort = np.array([attack.malicious_ids()[0], 5, attack.malicious_ids()[-1]])
    assert attack.malicious(1, cohort).tolist() == [True, cohort[1] in attack.malicious_ids(), True]


def test_run_tags_list_at_most_50_ids():
    attack = bound(Attack(count=60), 100)
    tags = attack.run_tags()
    assert tags["attack_malicious_count"] == "60" and tags["attack_who"] == "fixed"
    shown, more = tags["attack_malicious_ids"].split(",... ")
    assert shown.split(",") == [str(i) for i in attack.malicious_ids()[:50]] and more == "(10 more in malicious.csv)"
    assert attack.summary() == {"attack_malicious": 60.0}


# -- nobody malicious: the inputs themselves ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "attack",
    [Attack(), SignFlip(fraction=0), Scale(fraction=0), Gaussian(fraction=0), ALIE(fraction=0), IPM(fraction=0)]
    + [MinMax(fraction=0), MinSum(fraction=0), LossLie(fraction=0, offset=1.0), CountLie(fraction=0)]
    + [LabelFlip(fraction=0), RandomLabels(fraction=0), LossLie(fraction=0, factor=2.0, update=SignFlip())],
    ids=lambda a: type(a).__name__,
)
def test_fraction_zero_returns_the_inputs_themselves(attack):
    bound(attack)
    mask = attack.malicious(1, COHORT)
    assert not mask.any()
    x, y = torch.zeros(5, 2), torch.arange(5)
    assert attack.training_data(x, y)[0] is x and attack.training_data(x, y)[1] is y
    parts = [np.arange(3)]
    assert attack.data(1, COHORT[:1], parts, mask[:1]) is parts
    assert attack.updates(1, COHORT, DELTAS, mask) is DELTAS
    losses = ClientLosses(np.ones(4), np.ones(4))
    assert attack.losses(1, COHORT, losses, mask) is losses
    sizes = np.full(4, 10)
    assert attack.sizes(COHORT, sizes, mask) is sizes


# -- updates -------------------------------------------------------------------------------------------------------


def test_sign_flip_and_scale():
    assert sent(SignFlip(count=1))[3].tolist() == [-7.0, -8.0]
    assert sent(SignFlip(count=1, scale=2.0))[3].tolist() == [-14.0, -16.0]
    assert sent(Scale(count=1, scale=3.0))[3].tolist() == [21.0, 24.0]
    assert sent(Scale(count=1))[3].tolist() == [28.0, 32.0]  # null: the cohort size, 4
    two = np.array([True, False, False, True])
    assert sent(SignFlip(count=1), mask=two)[[0, 3]].tolist() == [[-1.0, -2.0], [-7.0, -8.0]]


def test_the_input_is_not_edited():
    before = DELTAS.clone()
    sent(SignFlip(count=1))
    assert torch.equal(DELTAS, before)


def test_gaussian_is_the_streams_noise_for_each_round_and_client():
    out = sent(Gaussian(count=1, sigma=0.5), round_=4)
    expected = 0.5 * torch.randn(2, generator=torch_generator(0, "attack.gaussian", 4, 3))
    assert torch.equal(out[3], expected.double())
    assert torch.equal(sent(Gaussian(count=1, sigma=0.5), round_=4), out)  # reproducible
    assert not torch.equal(sent(Gaussian(count=1, sigma=0.5), round_=5)[3], out[3])


def test_ipm_sends_minus_epsilon_times_the_honest_mean():
    assert sent(IPM(count=1, epsilon=2.0))[3].tolist() == [-6.0, -8.0]
    # knowledge=own: the attackers' own updates, here rows 2 and 3 (mean [6, 7]).
    two = np.array([False, False, True, True])
    assert sent(IPM(count=1, epsilon=0.5, knowledge="own"), mask=two)[[2, 3]].tolist() == [[-3.0, -3.5]] * 2


def test_alie_z_max_by_hand():
    # Both rules: s = floor(n / 2 + 1) - f. The paper's Algorithm 1 (rule="baruch"): z_max = Phi^-1((n - s) / n).
    # n = 50, f = 12: s = 26 - 12 = 14, (50 - 14) / 50 = 0.72, between Phi(0.58) = 0.7190 and Phi(0.59) = 0.7224:
    # z = 0.583.
    assert alie_z_max(50, 12) == pytest.approx(0.583, abs=1e-3)
    assert NormalDist().cdf(alie_z_max(50, 12)) == pytest.approx(0.72, rel=1e-12)
    # n = 20, f = 2 (sweep=robustness): s = 9, 11 / 20 = 0.55: z = 0.1257 (Phi(0.12) = 0.5478, Phi(0.13) = 0.5517).
    assert alie_z_max(20, 2) == pytest.approx(0.1257, abs=1e-4)
    assert alie_z_max(4, 1) == 0.0  # s = 2, (4 - 2) / 4 = 1/2
    # Blades' form (rule="blades"): Phi^-1((n - f - s) / (n - f)), the count among the honest workers only.
    # n = 50, f = 12: (38 - 14) / 38 = 12 / 19 = 0.6316, between Phi(0.33) = 0.6293 and Phi(0.34) = 0.6331: z = 0.336.
    assert alie_z_max(50, 12, "blades") == pytest.approx(0.336, abs=1e-3)
    assert NormalDist().cdf(alie_z_max(50, 12, "blades")) == pytest.approx(12 / 19, rel=1e-12)
    # n = 4, f = 1: s = 2, (3 - 2) / 3 = 1 / 3: z = -Phi^-1(2 / 3) = -0.4307 (Phi(0.43) = 0.6664).
    assert alie_z_max(4, 1, "blades") == pytest.approx(-0.4307, abs=1e-4)
    assert alie_z_max(20, 2, "blades") == 0.0  # s = 9, (18 - 9) / 18 = 1/2: the honest mean itself
    assert alie_z_max(3, 1, "blades") == 0.0  # s = 1, (2 - 1) / 2 = 1/2


def test_alie_sends_mean_minus_z_std():
    assert sent(ALIE(count=1, z=1.0))[3].tolist() == [1.0, 2.0]  # [3, 4] - 1 * [2, 2]
    z = alie_z_max(4, 1, "blades")
    assert z < 0 and sent(ALIE(count=1, z_rule="blades"))[3].tolist() == pytest.approx(
        [3 - 2 * z, 4 - 2 * z], rel=1e-15
    )
    assert sent(ALIE(count=1))[3].tolist() == [3.0, 4.0]  # the paper's rule: z_max(4, 1) = 0, the mean itself


def test_minmax_keeps_within_the_largest_honest_distance():
    # m = [3, 4] - gamma [2, 2]; its farthest honest update is [5, 6]: 8 (1 + gamma)^2 <= 32 (the distance between
    # [1, 2] and [5, 6], squared), so gamma = 1 and m = [1, 2].
    out = sent(MinMax(count=1))
    assert out[3].tolist() == pytest.approx([1.0, 2.0], abs=1e-4)
    assert float(((HONEST - out[3]) ** 2).sum(1).max()) <= 32.0


def test_minsum_keeps_within_the_largest_honest_sum():
    # sum_i ||m - x_i||^2 = 16 + 24 gamma^2 <= 40 (the sum of [1, 2] or [5, 6] to the others): gamma = 1 again.
    out = sent(MinSum(count=1))
    assert out[3].tolist() == pytest.approx([1.0, 2.0], abs=1e-4)
    assert float(((HONEST - out[3]) ** 2).sum()) <= 40.0


def test_minmax_and_minsum_differ_where_their_bounds_do():
    # Honest [0, 0], [2, 0], [0, 2]; p = mu / ||mu|| with mu = [2/3, 2/3]; m = (a, a), a = 2/3 - gamma / sqrt(2).
    # Min-Max: 2a^2 - 4a + 4 <= 8 (its farthest, [2, 0], within 8 = ||[2, 0] - [0, 2]||^2): a = 1 - sqrt(3).
    # Min-Sum: 6a^2 - 8a + 8 <= 12 (the largest sum of a row to the others): a = (2 - sqrt(10)) / 3.
    honest = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    gamma_max = MinMax(direction="unit_vec").gamma(honest)
    gamma_sum = MinSum(direction="unit_vec").gamma(honest)
    assert gamma_max == pytest.approx((2 / 3 - (1 - math.sqrt(3))) * math.sqrt(2), abs=1e-4)
    assert gamma_sum == pytest.approx((2 / 3 - (2 - math.sqrt(10)) / 3) * math.sqrt(2), abs=1e-4)
    deltas = torch.cat([honest, torch.zeros(1, 2, dtype=torch.float64)])
    m = sent(MinMax(count=1, direction="unit_vec"), deltas=deltas)[3]
    assert float(((honest - m) ** 2).sum(1).max()) <= 8.0
    m = sent(MinSum(count=1, direction="unit_vec"), deltas=deltas)[3]
    assert float(((honest - m) ** 2).sum()) <= 12.0


def test_the_largest_gamma_is_found_to_the_tolerance():
    attack = MinMax()
    for direction in ("std", "sign", "unit_vec"):
        attack.direction = direction
        honest = torch.randn(6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        gamma, p, mean = attack.gamma(honest), attack.perturbation(honest), honest.mean(0)
        assert attack.score(mean - gamma * p, honest) <= attack.bound(honest)
        assert attack.score(mean - (gamma + 3e-5) * p, honest) > attack.bound(honest)  # within 2 tolerances


class Counting:
    """A test aggregator with state: FedAvg over uniform weights that counts its aggregations."""

    def __init__(self):
        self.calls = 0

    def aggregate(self, params, deltas, view):
        self.calls += 1
        return Aggregation(deltas.mean(0), np.full(len(deltas), 1 / len(deltas)), {})


def test_line_search_is_byzfls():
    # Rising without end: the expansion doubles its step on each of the 19 probes after the start.
    assert line_search(lambda x: x, 0.0, 10.0, 0.8, 20) == 10 * (2**19 - 1)
    # A peak at 13: 0, then 10 (better: the step doubles to 20), 30 (worse: the step becomes 16 and the contraction
    # starts), 10 + 16, 10 + 12.8, 10 + 10.24, 10 + 8.192, 10 + 6.5536 (all worse than 10's -3), 10 + 5.24288 (-2.24:
    # better), then 15.24288 + 4.194..., each worse: the search only probes above its best.
    assert line_search(lambda x: -abs(x - 13), 0.0, 10.0, 0.8, 20) == pytest.approx(10 + 16 * 0.8**5, rel=1e-12)


def test_adaptive_ipm_and_alie_search_against_the_aggregator_without_touching_it():
    # Against a mean, the distance to the honest mean grows with the scale: the search's last expansion.
    aggregator = Counting()
    attack = IPM(count=1, adaptive=True)
    attack.against(aggregator)
    assert sent(attack)[3].tolist() == [-3.0 * 10 * (2**19 - 1), -4.0 * 10 * (2**19 - 1)]
    assert aggregator.calls == 0  # probed copies only
    alie = ALIE(count=1, adaptive=True)
    alie.against(FedAvg(weighting="uniform"))  # a real aggregator on the view built from the context's sizes
    assert sent(alie)[3].tolist() == [3.0 - 2 * 10 * (2**19 - 1), 4.0 - 2 * 10 * (2**19 - 1)]
    with pytest.raises(RuntimeError, match="against"):
        sent(IPM(count=1, adaptive=True))


def test_adaptive_alie_knows_the_trimmed_mean():
    # The attacker sends [3, 4] - tau [2, 2]; per coordinate the trimmed mean (f = 1 of 4) averages the middle two
    # values: 3 - tau (and 4 - tau) while tau <= 1, then 2 (and 3) once the attacker is the smallest. The distance to
    # the honest mean, sqrt(2) min(tau, 1), first reaches its plateau at the first probe, tau = 10, which no later
    # probe beats: the attacker sends [3 - 20, 4 - 20].
    attack = ALIE(count=1, adaptive=True)
    attack.against(TrimmedMean(f=1))
    out = sent(attack)
    assert out[3].tolist() == [-17.0, -16.0]
    assert TrimmedMean(f=1).aggregate(torch.zeros(2), out, RoundView(COHORT, np.full(4, 10))).update.tolist() == [
        2.0,
        3.0,
    ]


# -- data ----------------------------------------------------------------------------------------------------------


def test_label_flip_appends_flipped_labels_and_moves_the_attackers_there():
    attack = bound(LabelFlip(count=1), 4)
    x, y = torch.arange(8.0).reshape(4, 2), torch.tensor([0, 1, 2, 2])
    x2, y2 = attack.training_data(x, y)
    assert torch.equal(x2, torch.cat([x, x])) and y2.tolist() == [0, 1, 2, 2, 2, 1, 0, 0]  # C = 3: 2 - y
    assert bound(LabelFlip(count=1, num_classes=10), 4).training_data(x, y)[1][4:].tolist() == [9, 8, 7, 7]
    parts = [np.array([0, 1]), np.array([2, 3])]
    moved = attack.data(1, np.array([5, 6]), parts, np.array([False, True]))
    assert moved[0] is parts[0] and moved[1].tolist() == [6, 7]  # offset by len(y) = 4


def test_random_labels_are_the_seeds():
    y = torch.zeros(1000, dtype=torch.int64)
    labels = bound(RandomLabels(count=1, num_classes=10), 4, seed=2).training_data(torch.zeros(1000, 1), y)[1][1000:]
    again = bound(RandomLabels(count=1, num_classes=10), 4, seed=2).training_data(torch.zeros(1000, 1), y)[1][1000:]
    assert torch.equal(labels, again) and set(labels.tolist()) == set(range(10))
    expected = torch.randint(0, 10, (1000,), generator=torch_generator(2, "attack.labels"))
    assert torch.equal(labels, expected)


# -- reported scalars ----------------------------------------------------------------------------------------------


def test_loss_lie_reports_offset_or_factor_in_both_scales():
    losses = ClientLosses(np.array([0.5, 1.0, 2.0, 0.25]), np.array([0.01, 0.02, 0.04, 0.005]))
    told = bound(LossLie(count=1, offset=3.0)).losses(1, COHORT, losses, MASK)
    assert told.mean.tolist() == [0.5, 1.0, 2.0, 3.25] and told.authors.tolist() == [0.01, 0.02, 0.04, 3.005]
    told = bound(LossLie(count=1, factor=4.0)).losses(1, COHORT, losses, MASK)
    assert told.mean.tolist() == [0.5, 1.0, 2.0, 1.0] and told.authors.tolist() == [0.01, 0.02, 0.04, 0.02]
    told = bound(LossLie(count=1, offset=1.0, relative_to="honest_max")).losses(1, COHORT, losses, MASK)
    assert told.mean.tolist() == [0.5, 1.0, 2.0, 3.0] and told.authors.tolist() == [0.01, 0.02, 0.04, 1.04]
    assert losses.mean[3] == 0.25  # not edited
    with pytest.raises(ConfigError, match=r"^relative_to='honest_max' is invalid"):
        LossLie(offset=1.0, relative_to="honest_max", knowledge="own")
    with pytest.raises(ConfigError, match=r"^factor=2.0 is invalid: allowed is null when offset is set"):
        LossLie(offset=1.0, factor=2.0)


def test_loss_lie_with_an_inner_update_attack():
    honest_update = bound(LossLie(count=1, offset=1.0))
    assert not honest_update.changes_updates and honest_update.updates(1, COHORT, DELTAS, MASK) is DELTAS
    poisoned = LossLie(count=1, offset=1.0, update=SignFlip(scale=2.0))
    assert poisoned.changes_updates and poisoned.lies_about_losses
    assert sent(poisoned)[3].tolist() == [-14.0, -16.0]  # the outer mask, the inner attack's rows


def test_count_lie_inflates_the_attackers_counts():
    attack = bound(CountLie(count=1, factor=2.5))
    sizes = np.array([10, 20, 30, 41])
    assert attack.sizes(COHORT, sizes, MASK).tolist() == [10, 20, 30, 102]  # 41 * 2.5 = 102.5, rounded to even
    assert sizes.tolist() == [10, 20, 30, 41] and attack.lies_about_sizes and not attack.changes_updates


def test_capabilities():
    none = Attack()
    assert not (none.changes_data or none.changes_updates or none.lies_about_losses or none.lies_about_sizes)
    assert LabelFlip().changes_data and not LabelFlip().changes_updates
    assert SignFlip().changes_updates and not SignFlip().lies_about_losses
    assert LossLie(offset=1.0).lies_about_losses and not LossLie(offset=1.0).lies_about_sizes


# --- What an attack achieved: attack/deviation and the weight share (fedrun.rounds) ----------------------------------


def _deviation(rule, sent, lying, **signals):
    from fedrun.cohort import RoundView
    from fedrun.rounds import HonestReference, deviation_column

    view = RoundView(np.arange(len(sent)), np.ones(len(sent)), **signals)
    params = torch.zeros(sent.shape[1], dtype=torch.float64)
    honest = HonestReference.take(rule, lying)  # as the engine: taken before the round's aggregation, used after
    update, alpha, _ = rule.aggregate(params, sent, view)
    reference = None if honest is None else honest.update(params, sent, view)
    return deviation_column(update, reference, lying)["attack/deviation"], alpha


def test_the_deviation_by_hand_on_three_clients():
    from fedrun.aggregators import FedAvg, FLTrust, Median

    lying = np.array([False, False, True])
    flipped = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-4.0, -4.0]], dtype=torch.float64)
    # FedAvg: the mean [-1, -1] against the honest mean [0.5, 0.5]: ||[-1.5, -1.5]|| / ||[0.5, 0.5]|| = 3
    deviation, alpha = _deviation(FedAvg(), flipped, lying)
    assert deviation == pytest.approx(3.0) and alpha[2] == pytest.approx(1 / 3)
    # Median told f = 0: per coordinate the middle of (1, 0, -4) and (0, 1, -4), [0, 0]; of the honest two their
    # mean [0.5, 0.5]: deviation 1
    assert _deviation(Median(f=0), flipped, lying)[0] == pytest.approx(1.0)
    # Median told f = 1: the two honest clients alone are refused by n > 2f (a skipped round, zero): undefined
    assert math.isnan(_deviation(Median(f=1), flipped, lying)[0])
    # FLTrust with g_0 = [1, 1]: the flipped update gets no trust, so the honest aggregate is the round's: 0. An
    # attacker sending [3, 0] gets trust cos 45 = 0.7071 and is rescaled to [1.4142, 0]: the update
    # (0.7071 [1.4142, 0] + 0.7071 [0, 1.4142] + 0.7071 [1.4142, 0]) / 2.1213 = [0.9428, 0.4714] against the
    # honest [0.7071, 0.7071]: ||[0.2357, -0.2357]|| / 1 = 1/3.
    g0 = torch.tensor([1.0, 1.0], dtype=torch.float64)
    assert _deviation(FLTrust(), flipped, lying, server_update=g0)[0] == pytest.approx(0.0, abs=1e-12)
    sneaky = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 0.0]], dtype=torch.float64)
    assert _deviation(FLTrust(), sneaky, lying, server_update=g0)[0] == pytest.approx(1 / 3)
    # no attacker in the cohort: 0; only attackers: undefined
    assert _deviation(FedAvg(), flipped, np.zeros(3, dtype=bool))[0] == 0.0
    assert math.isnan(_deviation(FedAvg(), flipped, np.ones(3, dtype=bool))[0])


def test_the_reference_leaves_the_rules_state_as_it_was():
    from fedrun.aggregators import CenteredClip
    from fedrun.cohort import RoundView
    from fedrun.rounds import HonestReference

    rule = CenteredClip(tau=1.0)
    sent = torch.tensor([[1.0, 0.0], [0.0, 1.0], [9.0, 9.0]], dtype=torch.float64)
    params, view = torch.zeros(2, dtype=torch.float64), RoundView(np.arange(3), np.ones(3))
    rule.aggregate(params, sent, view)  # round 1: the state is its aggregate
    start = rule.previous.clone()
    reference = HonestReference.take(rule, np.array([False, False, True]))  # before round 2's aggregation
    rule.aggregate(params, sent, view)  # round 2 moves the state on
    after = rule.previous.clone()
    honest = reference.update(params, sent, view)
    assert torch.equal(rule.previous, after)  # the reference did not touch the rule
    fresh = CenteredClip(tau=1.0)  # the rule as it started round 2, on the honest two alone
    fresh.previous = start
    assert torch.equal(honest, fresh.aggregate(params, sent[:2], RoundView(np.arange(2), np.ones(2))).update)


def test_the_weight_share_is_a_share_only_where_alpha_is_a_convex_combination():
    from fedrun.rounds import attack_columns

    attack, lying = SignFlip(count=1), np.array([False, True])
    assert attack_columns(attack, lying, np.array([0.25, 0.75]))["attack/weight_share"] == 0.75
    assert math.isnan(attack_columns(attack, lying, np.array([0.25, 0.75]), is_share=False)["attack/weight_share"])
    # an importance sampler's unbiased weights (summing to 1.2): no share this round
    assert math.isnan(attack_columns(attack, lying, np.array([0.5, 0.7]))["attack/weight_share"])
    assert attack_columns(attack, lying, np.array([0.5, 0.7]))["attack/cohort_share"] == 0.5


def test_the_honest_view_reads_every_lazy_signal_through_the_rounds_cache():
    from fedrun.aggregators import FLTrust
    from fedrun.cohort import Lazy
    from fedrun.rounds import HonestReference

    calls = {"server_update": 0, "losses": 0}

    def counted(name, value):
        def compute():
            calls[name] += 1
            return value

        return Lazy(compute)

    sent = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 0.0]], dtype=torch.float64)
    losses = ClientLosses(np.array([1.0, 2.0, 3.0]), np.array([0.1, 0.2, 0.3]))
    view = RoundView(
        np.arange(3),
        np.ones(3),
        losses=counted("losses", losses),
        server_update=counted("server_update", torch.tensor([1.0, 1.0], dtype=torch.float64)),
    )
    params, lying = torch.zeros(2, dtype=torch.float64), np.array([False, False, True])
    reference = HonestReference.take(FLTrust(), lying)
    FLTrust().aggregate(params, sent, view)
    reference.update(params, sent, view)
    honest = view.subset(~lying)
    assert honest.losses.mean.tolist() == [1.0, 2.0] and honest.clients.tolist() == [0, 1]
    assert calls == {"server_update": 1, "losses": 1}  # FLTrust's g_0 trained once for both aggregations
