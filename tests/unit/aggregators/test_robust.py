"""The robust aggregators (issue 36): the peers' own golden numbers, each with its convention named; hand-computed
cases where the peers have none; the breakdown points refused in one line before training; equivalences with the
mean; a run through the engine."""

import functools
import math

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from fedrun import compat
from fedrun.aggregators import (
    Bulyan,
    CenteredClip,
    FedAvg,
    FLTrust,
    GeoMed,
    Krum,
    Median,
    MultiKrum,
    NormBound,
    RoundView,
    TrimmedMean,
)
from fedrun.aggregators.robust import closest_mean, krum_scores, squared_distances
from fedrun.datasets import FederatedData
from fedrun.engine import run
from fedrun.errors import ConfigError
from fedrun.models import MLP
from fedrun.parts import Parts
from fedrun.privacy import Privacy
from fedrun.rounds import Schedule
from fedrun.seeding import torch_seed
from fedrun.servers import ServerAdam, ServerMomentum
from fedrun.state import Context

# ByzFL's unit tests (LPD-EPFL/byzfl, tests/unit_test_aggregators.py) all aggregate these three vectors.
BYZFL = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])


def view(n: int, sizes=None) -> RoundView:
    return RoundView(np.arange(n), np.array(sizes if sizes is not None else [1] * n))


def aggregate(aggregator, x, sizes=None):
    x = torch.as_tensor(x, dtype=torch.float64)
    return aggregator.aggregate(torch.zeros(x.shape[1], dtype=x.dtype), x, view(len(x), sizes))


# --- ByzFL's golden numbers ---------------------------------------------------------------------------------------


def test_byzfl_median_trimmed_mean_and_centered_clipping_give_the_middle_vector():
    assert_allclose(aggregate(Median(), BYZFL).update, [4.0, 5.0, 6.0])
    assert_allclose(aggregate(TrimmedMean(f=1), BYZFL).update, [4.0, 5.0, 6.0])  # TrMean(1): one cut per side
    # ByzFL's CenteredClipping(): tau 100, one iteration, its first call starting from zero: nothing is clipped.
    assert_allclose(aggregate(CenteredClip(tau=100.0, iterations=1, start="zero"), BYZFL).update, [4.0, 5.0, 6.0])


def test_byzfl_geometric_median_with_its_settings():
    # ByzFL's GeometricMedian(): nu 0.1, T = 3 steps from z = 0, uniform weights, no early stop.
    agg = GeoMed(nu=0.1, iterations=3, tolerance=0.0, start="zero", weighting="uniform")
    result = aggregate(agg, BYZFL)
    assert_allclose(result.update, [3.78788764, 4.78788764, 5.78788764], rtol=1e-5)
    assert result.diagnostics["robust/iterations"] == 3
    assert_allclose(result.alpha.sum(), 1.0)
    assert_allclose(result.alpha @ BYZFL.double().numpy(), result.update)  # alpha: the last step's weights


def test_byzfl_krum_under_both_neighbour_counts():
    # ByzFL's Krum(1) scores with n - f - 1 = 1 nearest other (its code sorts each row and keeps [1 : n - f]).
    # Squared distances: 27 between neighbours, 108 between the ends: every score is 27, the tie goes to the first.
    squared = squared_distances(BYZFL.double())
    assert_allclose(squared, [[0, 27, 108], [27, 0, 27], [108, 27, 0]])
    assert_allclose(krum_scores(squared, 1), [27, 27, 27])
    # fedrun counts n - f - 2 (Blanchard et al. 2017), so ByzFL's single neighbour is fedrun's f = 0: [1, 2, 3] too.
    assert_allclose(aggregate(Krum(f=0), BYZFL).update, [1.0, 2.0, 3.0])
    # With f = 0 the two counts differ: n - f - 1 = 2 neighbours score [135, 54, 135] and choose the middle.
    assert_allclose(krum_scores(squared, 2), [135, 54, 135])
    assert_allclose(aggregate(Krum(f=0, neighbours="n-f-1"), BYZFL).update, [4.0, 5.0, 6.0])
    # f = 1 with n = 3 is below Krum's breakdown point (n > 2f + 2): refused at bind, skipped if a round is that small.
    skipped = aggregate(Krum(f=1), BYZFL)
    assert_allclose(skipped.update, [0, 0, 0])
    assert skipped.diagnostics["robust/skipped"] == 1.0


def test_byzfl_multikrum_is_fedruns_f0_with_two_kept():
    # ByzFL's MultiKrum(1): n - f - 1 = 1 neighbour, the n - f = 2 best averaged; fedrun's f = 0 counts that neighbour.
    result = aggregate(MultiKrum(f=0, m=2), BYZFL)
    assert_allclose(result.update, [2.5, 3.5, 4.5])
    assert_allclose(result.alpha, [0.5, 0.5, 0.0])  # 1 / m on the m selected
    assert result.diagnostics["robust/discarded"] == 1.0


# --- Flower's golden numbers (framework/py/flwr/server{,app}/strategy/*_test.py) ---------------------------------


def flower(*values):
    return torch.tensor([[v] * 4 for v in values])  # each of Flower's test models is one value in four coordinates


def test_flower_krum():
    # Flower's Krum(num_malicious=1) over 0.2, 0.7, 1.0 counts max(1, n - f - 2) = 1 neighbour: scores 1.0, 0.36,
    # 0.36; the tie goes to the first, 0.7. n = 3 is below the breakdown point for f = 1, so fedrun gives the same
    # neighbour count with f = 0 (n - f - 2 = 1).
    assert_allclose(aggregate(Krum(f=0), flower(0.2, 0.7, 1.0)).update, [0.7] * 4, rtol=1e-6)


def test_flower_multikrum():
    # Flower's MultiKrum(num_malicious=1, to_keep=2) over 0.2, 0.5, 1.0: one neighbour (fedrun's f = 0), the two
    # best (0.2 and 0.5, scores 0.36 each) averaged: 0.35 (Flower weighs them by samples: equal here).
    for weighting in ("uniform", "samples"):
        result = aggregate(MultiKrum(f=0, m=2, weighting=weighting), flower(0.2, 0.5, 1.0), sizes=[5, 5, 5])
        assert_allclose(result.update, [0.35] * 4, rtol=1e-6)


def test_flower_bulyan_with_no_byzantine_client_is_the_mean():
    # Flower's Bulyan(num_malicious=0) over six models: theta = n, beta = n, so the mean of all six.
    result = aggregate(Bulyan(f=0), flower(0.2, 0.5, 0.7, 12.0, 0.1, 0.1))
    assert_allclose(result.update, [(0.2 + 0.5 + 0.7 + 12.0 + 0.1 + 0.1) / 6] * 4)


def test_flower_bulyans_closest_values_step():
    # aggregate_n_closest_weights (serverapp/strategy/bulyan_test.py and server/strategy/aggregate_test.py), one
    # layer or the layers flattened into one vector.
    update, _ = closest_mean(torch.tensor([1.0]), torch.tensor([[1.0], [2.0], [0.5]]), 2)
    assert_allclose(update, [0.75])
    rows = torch.tensor([[1.1, 2.1, 0.2, 1.2], [0.9, 1.9, -0.1, 0.8], [5.0, 5.0, 10.0, 10.0]], dtype=torch.float64)
    update, share = closest_mean(torch.tensor([1.0, 2.0, 0.0, 1.0], dtype=torch.float64), rows, 2)
    assert_allclose(update, [1.0, 2.0, 0.05, 1.0])
    assert_allclose(share, [0.5, 0.5, 0.0])  # the far model never counts
    update, _ = closest_mean(torch.tensor([0.0]), torch.tensor([[1.0], [-0.5], [10.0]]), 1)
    assert_allclose(update, [-0.5])
    reference = torch.tensor([1, 2, 1, 2, 3, 4], dtype=torch.float64)
    rows = torch.tensor(
        [
            [1, 2, 1, 2, 3, 4],
            [1.1, 2.1, 1.1, 2.1, 3.1, 4.1],
            [1.2, 2.2, 1.2, 2.2, 3.2, 4.2],
            [1.3, 2.3, 0.9, 2.5, 3.4, 3.8],
        ],
        dtype=torch.float64,
    )
    update, _ = closest_mean(reference, rows, 2)
    assert_allclose(update, [1.05, 2.05, 0.95, 2.05, 3.05, 4.05])


def test_flower_fedtrimmedavg_beta_is_fedruns_fraction_per_side():
    # FedTrimmedAvg(beta=0.25) over four clients cuts floor(0.25 * 4) = 1 from each side: 0.5 everywhere.
    x = [[0.5, 0.5, 0.5, 0.5], [1.0, 0.2, 0.5, 1.0], [0.2, 0.5, 1.0, 0.2], [0.5, 1.0, 0.2, 0.5]]
    result = aggregate(TrimmedMean(fraction=0.25), x, sizes=[1, 5, 2, 9])
    assert_allclose(result.update, [0.5] * 4)
    # By hand: kept per coordinate (ties in cohort order) {0, 3}, {0, 2}, {0, 1}, {0, 3}: client 0 in all four
    # coordinates of the 2 * 4 kept values, client 3 in two, clients 1 and 2 in one each.
    assert_allclose(result.alpha, [4 / 8, 1 / 8, 1 / 8, 2 / 8])
    assert result.diagnostics["robust/f"] == 1.0


def test_flower_fedmedian():
    x = [[1.0, 0.2, 0.5, 1.0], [0.2, 0.5, 1.0, 0.2], [0.5, 1.0, 0.2, 0.5]]
    assert_allclose(aggregate(Median(), x).update, [0.5] * 4)


# --- By hand, where the peers have no test ------------------------------------------------------------------------


def test_median_of_an_even_cohort_is_the_mean_of_the_middle_two():
    # Coordinate 0: 1, 2, 3, 10 -> (2 + 3) / 2 from clients 1 and 3; coordinate 1: 0, 1, 2, 5 -> 1.5 from 2 and 3.
    result = aggregate(Median(), [[1.0, 0.0], [2.0, 5.0], [10.0, 1.0], [3.0, 2.0]])
    assert_allclose(result.update, [2.5, 1.5])
    assert_allclose(result.alpha, [0.0, 0.25, 0.25, 0.5])
    assert result.diagnostics["robust/discarded"] == 1.0


LINE = [[0.0], [1.0], [2.5], [100.0], [3.0]]  # four honest clients on a line and one far away


def test_krum_and_multikrum_leave_out_the_far_client_and_the_neighbour_count_matters():
    # n = 5, f = 1: n - f - 2 = 2 neighbours. Squared distances to the two nearest others:
    # 0: 1 + 6.25, 1: 1 + 2.25, 2.5: 0.25 + 2.25, 100: huge, 3: 0.25 + 4 -> Krum takes 2.5.
    result = aggregate(Krum(f=1), LINE)
    assert_allclose(result.update, [2.5])
    assert_allclose(result.alpha, [0, 0, 1, 0, 0])
    assert result.diagnostics["robust/score_min"] == pytest.approx(2.5)
    # n - f - 1 = 3 neighbours: 0: 1 + 6.25 + 9, 1: 1 + 2.25 + 4, 2.5: 0.25 + 2.25 + 6.25, 3: 0.25 + 4 + 9 -> 1.
    assert_allclose(aggregate(Krum(f=1, neighbours="n-f-1"), LINE).update, [1.0])
    # Multi-Krum keeps the n - f = 4 best: all but the far client; uniform, then by sample count.
    result = aggregate(MultiKrum(f=1), LINE)
    assert_allclose(result.update, [(0 + 1 + 2.5 + 3) / 4])
    assert_allclose(result.alpha, [0.25, 0.25, 0.25, 0, 0.25])
    result = aggregate(MultiKrum(f=1, weighting="samples"), LINE, sizes=[1, 2, 1, 1, 4])
    assert_allclose(result.alpha, [1 / 8, 2 / 8, 1 / 8, 0, 4 / 8])
    assert_allclose(result.update, [(0 + 2 * 1 + 2.5 + 4 * 3) / 8])


def test_bulyan_by_hand():
    # n = 7, f = 1: theta = 5 chosen by Krum over those left, beta = 3. Neighbours max(1, n' - 3) among n' left:
    # 7 left (4): scores 0:30, 1:10, 2:10, 3:10, 4:15, 5:30 -> 1 (first of the tie);
    # 6 left (3): 0:29, 2:9, 3:6, 4:6, 5:14 -> 3; 5 left (2): 0:20, 2:8, 4:5, 5:10 -> 4;
    # 4 left (1): 0:4, 2:4, 5:9 -> 0; 3 left (1): 2:9, 5:9 -> 2. Chosen 0, 1, 2, 3, 4: median 2, the three closest
    # 1, 2, 3 averaged.
    result = aggregate(Bulyan(f=1), [[0.0], [1.0], [2.0], [3.0], [4.0], [5.0], [100.0]])
    assert_allclose(result.update, [2.0])
    assert_allclose(result.alpha, [0, 1 / 3, 1 / 3, 1 / 3, 0, 0, 0])
    assert result.diagnostics["robust/discarded"] == 4.0


def test_geometric_median_of_points_on_a_line_is_their_median_and_the_tolerance_stops_early():
    # On a line the geometric median is the median, 1; smoothed Weiszfeld from the mean gets there.
    result = aggregate(GeoMed(nu=1e-12, iterations=200, tolerance=0.0, weighting="uniform"), [[0.0], [1.0], [10.0]])
    assert_allclose(result.update, [1.0], atol=1e-6)
    assert result.alpha[1] > 0.99  # nearly all weight on the median point
    early = aggregate(GeoMed(iterations=200, tolerance=1e-3, weighting="uniform"), [[0.0], [1.0], [10.0]])
    assert early.diagnostics["robust/iterations"] < 200
    # Sample-count weights (RFA's): a client with most of the samples pulls the median onto itself.
    heavy = aggregate(GeoMed(nu=1e-12, iterations=200, tolerance=0.0), [[0.0], [1.0], [10.0]], sizes=[1, 1, 5])
    assert_allclose(heavy.update, [10.0], atol=1e-6)


def test_centered_clipping_by_hand_then_from_the_previous_aggregate():
    x = [[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]]
    agg = CenteredClip(tau=1.0, iterations=1)  # start=previous: zero in round 1
    # From v = 0: norms 0, 5, 1; only the second (5 > tau) is scaled, by 1/5. v = ([0,0] + [3,4]/5 + [0,1]) / 3.
    first = aggregate(agg, x)
    assert_allclose(first.update, [0.2, 0.6])
    assert_allclose(first.alpha, [1 / 3, 1 / 15, 1 / 3])
    assert first.diagnostics["robust/start_weight"] == pytest.approx(4 / 15)
    assert first.diagnostics["robust/clipped"] == 1.0
    assert_allclose(agg.state_dict()["previous"], [0.2, 0.6])
    # Round 2 starts from [0.2, 0.6]: x_i - v = [-0.2, -0.6], [2.8, 3.4] (norm sqrt(19.4), clipped), [-0.2, 0.4].
    second = aggregate(agg, x)
    c = 1 / math.sqrt(19.4)
    assert_allclose(second.update, [0.2 + (-0.4 + 2.8 * c) / 3, 0.6 + (-0.2 + 3.4 * c) / 3])
    gamma = second.diagnostics["robust/start_weight"]
    assert_allclose(second.update, gamma * np.array([0.2, 0.6]) + second.alpha @ np.array(x))
    # A fresh aggregator given the saved state continues the same way (the checkpoint's explicit state).
    resumed = CenteredClip(tau=1.0, iterations=1)
    resumed.load_state_dict({"previous": torch.tensor([0.2, 0.6], dtype=torch.float64)})
    assert_allclose(aggregate(resumed, x).update, second.update)


def test_norm_bound_by_hand():
    # Norms 5 and 1, bound 1: the first scaled by 1/5; p = [1/4, 3/4] by samples.
    result = aggregate(NormBound(bound=1.0), [[3.0, 4.0], [0.0, 1.0]], sizes=[1, 3])
    assert_allclose(result.alpha, [0.25 / 5, 0.75])
    assert_allclose(result.update, [0.15, 0.2 + 0.75])
    assert result.diagnostics["robust/clipped"] == 1.0
    assert result.diagnostics["robust/norm_median"] == pytest.approx(3.0)


# --- Equivalences -------------------------------------------------------------------------------------------------

RANDOM = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))


def test_trimmed_mean_without_trimming_multikrum_of_all_and_an_unreached_norm_bound_are_the_mean():
    mean = RANDOM.mean(0)
    sizes = [3, 1, 4, 1, 5, 9]
    r = view(6, sizes)
    for agg in (TrimmedMean(f=0), MultiKrum(f=0, m=6), MultiKrum(f=1, m=6), NormBound(bound=1e9, weighting="uniform")):
        result = agg.aggregate(torch.zeros(50), RANDOM, r)
        assert result.update.dtype == RANDOM.dtype
        assert_allclose(result.update, mean, rtol=1e-5, atol=1e-7)
        assert_allclose(result.alpha, [1 / 6] * 6)
    fedavg = FedAvg(weighting="samples").aggregate(torch.zeros(50), RANDOM, r)
    for agg in (NormBound(bound=1e9), MultiKrum(f=0, m=6, weighting="samples")):
        result = agg.aggregate(torch.zeros(50), RANDOM, r)
        assert_allclose(result.update, fedavg.update, rtol=1e-5, atol=1e-7)
        assert_allclose(result.alpha, fedavg.alpha)


def test_distances_come_from_differences_and_are_squared_once():
    assert_allclose(squared_distances(torch.tensor([[0.0, 0.0], [3.0, 4.0]], dtype=torch.float64)), [[0, 25], [25, 0]])
    # Two updates 1e-3 apart, far from the origin: ||x||^2 + ||y||^2 - 2 x.y would lose the difference.
    far = torch.full((2, 1000), 1e4, dtype=torch.float64)
    far[1, 0] += 1e-3
    assert squared_distances(far)[0, 1].item() == pytest.approx(1e-6, rel=1e-6)


def test_a_round_of_nobody_and_a_round_too_small_for_f():
    for agg in (Median(), Krum(f=1), Bulyan(f=1), GeoMed(), CenteredClip(), NormBound()):
        empty = agg.aggregate(torch.ones(3), torch.zeros(0, 3), view(0))
        assert torch.equal(empty.update, torch.zeros(3)) and len(empty.alpha) == 0 and empty.diagnostics == {}
    state = CenteredClip()
    state.aggregate(torch.ones(3), torch.zeros(0, 3), view(0))
    assert state.previous is None  # an empty round leaves the state alone
    small = aggregate(Bulyan(f=1), RANDOM[:6].double())  # 6 < 4f + 3
    assert torch.equal(small.update, torch.zeros(50, dtype=torch.float64))
    assert_allclose(small.alpha, np.zeros(6))
    assert small.diagnostics["robust/skipped"] == 1.0 and small.diagnostics["robust/discarded"] == 6.0
    # f from a fraction follows each round's size: floor(0.2 * 6) = 1, floor(0.2 * 4) = 0.
    assert aggregate(TrimmedMean(fraction=0.2), RANDOM[:6]).diagnostics["robust/f"] == 1.0
    assert aggregate(TrimmedMean(fraction=0.2), RANDOM[:4]).diagnostics["robust/f"] == 0.0


# --- Refusals -----------------------------------------------------------------------------------------------------


def bind(agg, cohort=None, clients=10, **schedule):
    agg.bind(Context(Schedule(cohort=cohort, **schedule), np.full(clients, 5)))


@pytest.mark.parametrize(
    "make,cohort,message",
    [
        (lambda: Krum(f=2), 6, r"^aggregator\.f=2 is invalid: allowed is f with n > 2f \+ 2 for Krum .*f at most 1$"),
        (lambda: MultiKrum(f=2), 5, r"^aggregator\.f=2 .*n > 2f \+ 2"),
        (lambda: Bulyan(f=1), 6, r"^aggregator\.f=1 .*n >= 4f \+ 3 for Bulyan \(El Mhamdi et al\. 2018\)"),
        (lambda: TrimmedMean(f=2), 4, r"^aggregator\.f=2 .*n > 2f .*4 clients a round allows f at most 1$"),
        (lambda: Median(f=2), 4, r"^aggregator\.f=2 .*n > 2f"),
        (lambda: GeoMed(f=3), 5, r"^aggregator\.f=3 .*n > 2f"),
        (lambda: Krum(fraction=0.4), 5, r"^aggregator\.fraction=0\.4 .*floor\(fraction \* n\) with n > 2f \+ 2"),
        (lambda: Krum(f=0), 2, r"^aggregator\.f=0 .*no f at all \(too few clients\)$"),
        (lambda: MultiKrum(f=1, m=7), 6, r"^aggregator\.m=7 is invalid: allowed is an integer from 1 to the 6 clients"),
    ],
)
def test_an_f_beyond_the_breakdown_point_is_refused_in_one_line(make, cohort, message):
    with pytest.raises(ConfigError, match=message) as error:
        bind(make(), cohort)
    assert "\n" not in str(error.value)


def test_the_breakdown_points_accept_their_smallest_cohort():
    bind(Krum(f=2), 7)
    bind(MultiKrum(f=1), 5)
    bind(Bulyan(f=1), 7)
    bind(Bulyan(f=2), 11)
    bind(TrimmedMean(f=2), 5)
    bind(Median(f=2), 5)
    bind(MultiKrum(f=1, m=6), 6)


def test_poisson_sampling_is_checked_at_its_expected_cohort():
    bind(Krum(f=1), clients=10, clients_per_round=0.5, sampling="poisson")  # 5 expected > 2f + 2
    with pytest.raises(ConfigError, match=r"5 clients a round expected \(poisson sampling\)"):
        bind(Krum(f=2), clients=10, clients_per_round=0.5, sampling="poisson")


@pytest.mark.parametrize(
    "make,key",
    [
        (lambda: Krum(f=-1), "f"),
        (lambda: Krum(f=1.5), "f"),
        (lambda: Krum(fraction=0.5), "fraction"),
        (lambda: Krum(f=1, fraction=0.1), "fraction"),
        (lambda: Krum(neighbours="n-f"), "neighbours"),
        (lambda: MultiKrum(m=0), "m"),
        (lambda: GeoMed(nu=0.0), "nu"),
        (lambda: GeoMed(iterations=0), "iterations"),
        (lambda: GeoMed(start="median"), "start"),
        (lambda: CenteredClip(tau=0.0), "tau"),
        (lambda: CenteredClip(start="mean"), "start"),
        (lambda: NormBound(bound=-1.0), "bound"),
        (lambda: Median(weighting="loss"), "weighting"),
    ],
)
def test_bad_settings_name_their_key(make, key):
    with pytest.raises(ConfigError, match=f"^{key}="):
        make()


ALL = (Median, TrimmedMean, Krum, MultiKrum, Bulyan, GeoMed, CenteredClip, NormBound)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_privacy_refuses_every_robust_aggregator_by_its_declared_capability(cls):
    agg = cls(weighting="uniform")
    assert agg.weights_follow_clients and not agg.follows_sampler and isinstance(cls.STATE, tuple)
    with pytest.raises(ConfigError, match=f"^aggregator='{cls.__name__}' is invalid: allowed is fedavg with privacy"):
        compat.check({"privacy": Privacy(mechanism="central", noise_multiplier=1.0), "aggregator": agg})


# --- Through the engine -------------------------------------------------------------------------------------------

g = torch.Generator().manual_seed(1)
X = torch.randn(400, 4, generator=g, dtype=torch.float64)
Y = (X @ torch.randn(4, 3, generator=g, dtype=torch.float64)).argmax(1)
DATA = FederatedData(X[:320], Y[:320], X[320:], Y[320:], num_classes=3)
CLIENTS = [np.arange(40 * c, 40 * (c + 1)) for c in range(8)]  # eight honest clients: Bulyan's f = 1 needs 7
SGD = functools.partial(torch.optim.SGD, lr=0.3)


def train(parts, rounds=6, rows=None, **schedule):
    torch.manual_seed(torch_seed(0, "init"))
    model = MLP((4,), 3, hidden=(8,)).double()
    rows = [] if rows is None else rows
    run(
        model,
        DATA,
        CLIENTS,
        parts,
        SGD,
        Schedule(rounds=rounds, local_steps=3, batch_size=10, **schedule),
        torch.device("cpu"),
        0,
        on_round=lambda row, per_client: rows.append(row),
    )
    return rows


@pytest.mark.parametrize(
    "agg",
    [Median(f=1), TrimmedMean(f=1), Krum(f=1), MultiKrum(f=1), Bulyan(f=1), GeoMed(f=1), CenteredClip(), NormBound()],
    ids=lambda a: type(a).__name__,
)
def test_an_attacker_free_run_is_finite_and_improves(agg):
    rows = train(Parts(agg))
    accuracy = [row["test_accuracy"] for row in rows]
    assert all(math.isfinite(a) for a in accuracy) and all(row["robust/skipped"] == 0 for row in rows)
    assert accuracy[-1] > accuracy[0] and accuracy[-1] > 0.6  # three classes: chance is 1/3


@pytest.mark.parametrize("server", [ServerMomentum(server_lr=1.0, beta=0.5), ServerAdam(server_lr=0.05)])
def test_robust_aggregators_compose_with_the_server_optimizers(server):
    rows = train(Parts(TrimmedMean(f=1), server=server), rounds=3)
    assert all(math.isfinite(row["test_accuracy"]) for row in rows)


def test_the_breakdown_point_is_refused_before_round_one():
    rows = []
    with pytest.raises(ConfigError, match=r"^aggregator\.f=4 .*8 clients a round allows f at most 1"):
        train(Parts(Bulyan(f=4)), rows=rows)
    assert rows == []  # no round ran


def test_poisson_rounds_too_small_for_f_are_skipped_and_the_others_aggregated():
    # 8 clients at rate 0.6: 5 expected (> 2f + 2 for f = 1, so bind accepts), but a draw of 4 or fewer is skipped.
    rows = train(Parts(Krum(f=1)), rounds=10, clients_per_round=0.6, sampling="poisson")
    skipped = [row["robust/skipped"] == 1.0 for row in rows]
    assert skipped == [row["cohort_size"] <= 4 for row in rows]
    assert any(skipped) and not all(skipped)
    assert all(math.isfinite(row["test_accuracy"]) for row in rows)


# --- FLTrust ------------------------------------------------------------------------------------------------------


def test_fltrust_by_hand():
    # Cao et al. 2021, Eq. 1-3, with g_0 = [1, 0]: TS = ReLU(cos) = 1, 0, 0, 1/sqrt(2); each update rescaled to
    # ||g_0|| = 1: [1, 0] and [1, 1] / sqrt(2); update = (1 [1, 0] + 0.7071 [0.7071, 0.7071]) / 1.7071
    # = [1.5, 0.5] / 1.7071 = [0.87868, 0.29289]. alpha = TS ||g_0|| / (||g_i|| sum TS): 1 / 2 / 1.7071 = 0.29289 for
    # the first, 0.7071 / 1.4142 / 1.7071 = 0.29289 for the last, 0 for the orthogonal and the opposite one.
    x = torch.tensor([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    report = RoundView(np.arange(4), np.ones(4), server_update=torch.tensor([1.0, 0.0], dtype=torch.float64))
    out = FLTrust().aggregate(torch.zeros(2, dtype=torch.float64), x, report)
    assert_allclose(out.update, [1.5 / (1 + 0.5**0.5), 0.5 / (1 + 0.5**0.5)], rtol=1e-12)
    assert_allclose(out.alpha, [0.2928932188134524, 0, 0, 0.2928932188134524], rtol=1e-12)
    assert out.diagnostics["robust/discarded"] == 2 and out.diagnostics["robust/trust_min"] == 0.0
    assert out.diagnostics["robust/trust_mean"] == pytest.approx((1 + 0.5**0.5) / 4)


def test_fltrust_trusts_nobody_against_the_server():
    x = torch.tensor([[-1.0, 0.0], [0.0, -2.0]], dtype=torch.float64)
    report = RoundView(np.arange(2), np.ones(2), server_update=torch.tensor([1.0, 1.0], dtype=torch.float64))
    out = FLTrust().aggregate(torch.zeros(2, dtype=torch.float64), x, report)
    assert out.update.tolist() == [0.0, 0.0] and out.alpha.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("root_size", [0, -1, 1.5, True, "100"])
def test_fltrust_root_size_is_checked(root_size):
    with pytest.raises(ConfigError, match="root_size"):
        FLTrust(root_size=root_size)


def test_fltrust_through_the_engine_trains_the_server_on_its_root_set():
    from fedrun.attacks import SignFlip

    # The server holds samples 280-319; seven clients the rest. A client holding exactly the root set, trained full
    # batch, sends g_0 itself (up to the summation order): FLTrust trusts it fully and the update is its own.
    root = np.arange(280, 320)
    data = FederatedData(X[:320], Y[:320], X[320:], Y[320:], num_classes=3, root=root)
    torch.manual_seed(torch_seed(0, "init"))
    model = MLP((4,), 3, hidden=(8,)).double()
    rows, alphas = [], []
    run(
        model,
        data,
        [root],
        Parts(FLTrust()),
        SGD,
        Schedule(rounds=2, local_steps=3, batch_size=40),
        torch.device("cpu"),
        0,
        on_round=lambda row, per_client: (rows.append(row), alphas.append(per_client["alpha"])),
    )
    assert [a.tolist() for a in alphas] == [pytest.approx([1.0], rel=1e-9)] * 2
    assert all(row["robust/trust_min"] == pytest.approx(1.0, rel=1e-9) for row in rows)
    # Against two sign flippers of seven clients, the flipped updates point away from g_0: no weight, and it learns.
    clients = [np.arange(40 * c, 40 * (c + 1)) for c in range(7)]
    torch.manual_seed(torch_seed(0, "init"))
    model, rows, alphas, attack = MLP((4,), 3, hidden=(8,)).double(), [], [], SignFlip(count=2)
    run(
        model,
        data,
        clients,
        Parts(FLTrust(), attack=attack),
        SGD,
        Schedule(rounds=6, local_steps=3, batch_size=10),
        torch.device("cpu"),
        0,
        on_round=lambda row, per_client: (rows.append(row), alphas.append(per_client["alpha"])),
    )
    assert all(alpha[attack.malicious_ids()].sum() == 0.0 for alpha in alphas)
    # FLTrust's alpha is no convex combination: no weight share; the deviation is measured instead
    assert all(math.isnan(row["attack/weight_share"]) and row["attack/deviation"] >= 0 for row in rows)
    assert rows[-1]["test_accuracy"] > 0.6 and rows[-1]["train_wall_s"] > 0


# --- Pre-aggregation: nnm and bucketing ---------------------------------------------------------------------------


def test_nnm_by_hand_on_byzfls_vectors():
    # Allouah et al. 2023, Algorithm 1, f = 1: each row becomes the mean of its n - f = 2 nearest (itself included).
    # Distances: |x0 - x1| = |x1 - x2| = sqrt(27), |x0 - x2| = sqrt(108). Row 0: {0, 1}; row 1: {1, and 0 or 2 at the
    # same distance: the lower position, 0}; row 2: {2, 1}. Mixed: [2.5, 3.5, 4.5] twice and [5.5, 6.5, 7.5].
    mix = Median(f=1, pre="nnm").mixing(BYZFL.double(), 1, 1)
    assert_allclose(mix @ BYZFL.double(), [[2.5, 3.5, 4.5], [2.5, 3.5, 4.5], [5.5, 6.5, 7.5]])
    # The median of the mixed rows is [2.5, 3.5, 4.5], taken from mixed row 1 (the middle of the stable sort), which
    # is half client 0 and half client 1: alpha [0.5, 0.5, 0].
    out = aggregate(Median(f=1, pre="nnm"), BYZFL)
    assert_allclose(out.update, [2.5, 3.5, 4.5])
    assert_allclose(out.alpha, [0.5, 0.5, 0.0])
    assert_allclose(aggregate(TrimmedMean(f=0, pre="nnm"), BYZFL).update, [4.0, 5.0, 6.0])  # f = 0: every row the mean


def test_bucketing_averages_random_buckets():
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    clip = functools.partial(CenteredClip, tau=1e9, iterations=1, start="zero", pre="bucketing")  # the rows' mean
    out = aggregate(clip(bucket_size=2), x)
    # Buckets of 2, 2 and 1: the two-client buckets' members weigh 1/3 / 2 each, the lone client 1/3.
    assert_allclose(sorted(out.alpha), [1 / 6] * 4 + [1 / 3])
    assert_allclose(out.update, torch.as_tensor(out.alpha) @ x, rtol=1e-12)
    even = aggregate(clip(bucket_size=2), x[:4])  # equal buckets: the mean of the bucket means is the mean
    assert_allclose(even.update, x[:4].mean(0), rtol=1e-12)
    rule = clip(bucket_size=2)
    assert torch.equal(rule.mixing(x, 0, 3), rule.mixing(x, 0, 3))  # drawn from (seed, round)
    assert not torch.equal(rule.mixing(x, 0, 3), rule.mixing(x, 0, 4))


@pytest.mark.parametrize("rule", [Median, TrimmedMean, Krum, GeoMed], ids=lambda r: r.__name__)
def test_buckets_of_one_are_the_rule_alone(rule):
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    plain, bucketed = aggregate(rule(f=1), x), aggregate(rule(f=1, pre="bucketing", bucket_size=1), x)
    assert_allclose(bucketed.update, plain.update, rtol=1e-12, atol=1e-15)
    assert_allclose(bucketed.alpha, plain.alpha, rtol=1e-12, atol=1e-15)


def test_pre_aggregation_settings_are_checked():
    with pytest.raises(ConfigError, match="^pre='nnm' is invalid: allowed is none or bucketing for CenteredClip"):
        CenteredClip(pre="nnm")
    with pytest.raises(ConfigError, match="bucket_size"):
        Median(pre="bucketing", bucket_size=0)
    # Krum needs rows > 2f + 2: 12 clients in buckets of 2 are 6 rows, too few for f = 2.
    krum = Krum(f=2, pre="bucketing")
    with pytest.raises(
        ConfigError, match=r"^aggregator\.f=2 is invalid: .*12 clients a round in 6 buckets allows f at most 1"
    ):
        krum.bind(Context(Schedule(rounds=1), np.ones(12, dtype=int), 0, "uniform"))
