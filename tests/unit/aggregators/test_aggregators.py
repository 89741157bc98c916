"""Golden numbers for the aggregators, computed by hand."""

import math

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from fedrun.aggregators import (
    MVR,
    FedAvg,
    FedBetter,
    FedBetterK,
    FedMax,
    FedMaxK,
    FedNova,
    FedSoftBetter,
    FedSoftMax,
    Hybrid,
    RoundView,
)
from fedrun.clients import ClientLosses
from fedrun.errors import ConfigError
from fedrun.servers import ServerOptimizer


def report(sizes, losses, round_=1, local=None, authors=None, accuracy=math.nan, fstar=None):
    losses = np.array(losses, float)
    return RoundView(
        clients=np.arange(len(sizes)),
        sizes=np.array(sizes),
        losses=ClientLosses(losses, np.array(authors if authors is not None else losses / 10, float)),
        round=round_,
        local_losses=None if local is None else ClientLosses(np.array(local, float), np.array(local, float) / 10),
        accuracy=accuracy,
        fstar=fstar,
    )


def test_fedavg_weights_by_samples_and_uniform():
    r = report([1, 1, 2], [5.0, 0.0, 1.0])
    assert_allclose(FedAvg().weights(r), [0.25, 0.25, 0.5])
    assert_allclose(FedAvg(weighting="uniform").weights(r), [1 / 3, 1 / 3, 1 / 3])


def test_fedavg_update_is_weighted_mean_of_deltas_times_server_lr():
    w = torch.tensor([1.0, -1.0])
    deltas = torch.tensor([[4.0, 0.0], [0.0, 4.0], [2.0, 2.0]])
    update, alpha, _ = FedAvg().aggregate(w, deltas, report([1, 1, 2], [0, 0, 0]))
    # 0.25*[4,0] + 0.25*[0,4] + 0.5*[2,2] = [2, 2]
    assert_allclose(update.numpy(), [2.0, 2.0])
    assert_allclose(ServerOptimizer().step(w, update).numpy(), [3.0, 1.0])
    assert_allclose(ServerOptimizer(server_lr=0.5).step(w, update).numpy(), [2.0, 0.0])


def test_fedsoftmax_weights_by_hand():
    # p = [.25, .25, .5], exp(L/T) = [1, 2, 1] -> [.25, .5, .5] / 1.25 = [.2, .4, .4]
    r = report([1, 1, 2], [0.0, np.log(2.0), 0.0])
    assert_allclose(FedSoftMax(temperature=1.0).weights(r), [0.2, 0.4, 0.4])
    # uniform p, L = [1, 2, 3], T = 1: softmax
    r = report([5, 7, 9], [1.0, 2.0, 3.0])
    assert_allclose(FedSoftMax(weighting="uniform").weights(r), [0.09003057, 0.24472847, 0.66524096], rtol=1e-7)
    # T = 2 halves the logits: exp([.5, 1, 1.5]) normalised
    e = np.exp([0.5, 1.0, 1.5])
    assert_allclose(FedSoftMax(temperature=2.0, weighting="uniform").weights(r), e / e.sum())


def test_fedsoftmax_update_and_alpha_distance_by_hand():
    w = torch.zeros(2)
    deltas = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    agg = FedSoftMax()
    new, alpha, diagnostics = agg.aggregate(w, deltas, report([1, 1, 2], [0.0, np.log(2.0), 0.0]))
    assert_allclose(alpha, [0.2, 0.4, 0.4])
    assert_allclose(new.numpy(), [0.6, 0.8], rtol=1e-6)
    # |.2-.25| + |.4-.25| + |.4-.5| = .05 + .15 + .1
    assert diagnostics["alpha_distance"] == pytest.approx(0.3)
    assert diagnostics["temperature"] == 1.0


def test_fedsoftmax_limits():
    r = report([3, 1, 4, 2], [0.3, 2.0, 0.1, 1.2])
    assert_allclose(FedSoftMax(temperature=1e12).weights(r), FedAvg().weights(r), rtol=1e-9)
    assert_allclose(FedSoftMax(temperature=1e-6).weights(r), FedMax().weights(r), atol=1e-12)
    assert_allclose(FedSoftBetter(temperature=1e-6).weights(r), FedBetter().weights(r), atol=1e-12)


def test_fedsoftmax_is_stable_for_huge_losses():
    alpha = FedSoftMax(temperature=1.0).weights(report([1, 1], [1000.0, 0.0]))
    assert np.all(np.isfinite(alpha))
    assert_allclose(alpha, [1.0, 0.0], atol=1e-12)


def test_fedmax_and_fedbetter_pick_the_extremes_and_split_ties():
    r = report([1, 2, 3, 4], [0.5, 2.0, 0.1, 2.0])
    assert_allclose(FedMax().weights(r), [0, 0.5, 0, 0.5])
    assert_allclose(FedBetter().weights(r), [0, 0, 1, 0])
    r = report([1, 2, 3, 4], [0.5, 2.0, 0.1, 0.1])
    assert_allclose(FedBetter().weights(r), [0, 0, 0.5, 0.5])


def test_fedbetter_mirrors_fedmax():
    losses = [0.7, 0.2, 1.9, 1.1]
    r, mirrored = report([1, 1, 1, 1], losses), report([1, 1, 1, 1], [-v for v in losses])
    assert_allclose(FedBetter().weights(r), FedMax().weights(mirrored))
    assert_allclose(FedBetterK(k=2).weights(r), FedMaxK(k=2).weights(mirrored))
    assert_allclose(FedSoftBetter(temperature=0.5).weights(r), FedSoftMax(temperature=0.5).weights(mirrored))


def test_fedmaxk_counts_and_fractions():
    r = report([1, 1, 1, 1], [0.7, 0.2, 1.9, 1.1])
    assert_allclose(FedMaxK(k=2).weights(r), [0, 0, 0.5, 0.5])
    assert_allclose(FedMaxK(k=0.75).weights(r), [1 / 3, 0, 1 / 3, 1 / 3])  # round(0.75 * 4) = 3
    assert_allclose(FedBetterK(k=1).weights(r), [0, 1, 0, 0])
    # k equal to (or above) the cohort is uniform, whatever the sample counts
    r = report([5, 1, 1, 3], [0.7, 0.2, 1.9, 1.1])
    assert_allclose(FedMaxK(k=4).weights(r), [0.25] * 4)
    assert_allclose(FedMaxK(k=10).weights(r), [0.25] * 4)
    assert_allclose(FedMaxK(k=1.0).weights(r), [0.25] * 4)  # the float 1.0 is the whole cohort
    # k = 0.1 of 4 rounds to 0: at least one client
    assert_allclose(FedMaxK(k=0.1).weights(r), [0, 0, 1, 0])


def test_authors_loss_scale_and_mapping_of_their_inverse_temperature():
    # The authors weigh by exp(T_paper * l_i) with l_i = sum of batch mean losses / n.
    # 200 samples in batches of 64 (64, 64, 64, 8) with batch means [2.0, 1.0, 1.5, 0.5]: l = 5.0 / 200 = 0.025
    from fedrun.clients import _authors_scale

    losses = torch.cat([torch.full((64,), 2.0), torch.full((64,), 1.0), torch.full((64,), 1.5), torch.full((8,), 0.5)])
    assert _authors_scale(losses, 64) == pytest.approx(0.025)
    l_i = np.array([0.025, 0.01, 0.04])
    t_paper = 50.0
    expected = np.exp(t_paper * l_i) / np.exp(t_paper * l_i).sum()
    r = report([200, 200, 200], [9.0, 9.0, 9.0], authors=l_i)
    agg = FedSoftMax(temperature=1 / t_paper, loss_scale="authors")
    assert_allclose(agg.weights(r), expected)


def test_loss_on_local_and_fstar_estimate():
    r = report([1, 1], [1.0, 1.0], local=[0.2, 0.9])
    assert_allclose(FedMax(loss_on="local").weights(r), [0, 1])
    # F* = [0.9, 0.1]: gaps [0.1, 0.9] -> FedMax picks client 1; a fake estimator records what it was asked
    asked = []

    def fstar(clients, epochs):
        asked.append((list(clients), epochs))
        return ClientLosses(np.array([0.9, 0.1]), np.array([0.09, 0.01]))

    r = report([1, 1], [1.0, 1.0], fstar=fstar)
    assert_allclose(FedMax(fstar="estimate", fstar_epochs=3).weights(r), [0, 1])
    assert asked == [([0, 1], 3)]
    # gaps [0.1, 0.9] with T = 1, uniform p: softmax
    e = np.exp([0.1, 0.9])
    assert_allclose(FedSoftMax(fstar="estimate", weighting="uniform").weights(r), e / e.sum())


def test_temperature_schedules():
    linear = FedSoftMax(temperature=10.0, temperature_final=1.0, anneal="linear", anneal_rounds=10)
    assert [linear.temperature_at(t) for t in (1, 10, 20)] == [10.0, 1.0, 1.0]
    assert linear.temperature_at(4) == pytest.approx(7.0)
    exponential = FedSoftMax(temperature=8.0, temperature_final=1.0, anneal="exponential", anneal_rounds=4)
    assert [exponential.temperature_at(t) for t in (1, 2, 3, 4, 5)] == pytest.approx([8.0, 4.0, 2.0, 1.0, 1.0])
    r = report([1, 1], [0.0, 1.0], round_=4)
    e = np.exp([0.0, 1.0 / 7.0])
    assert_allclose(linear.weights(r), e / e.sum())


def test_hybrid_switches_at_the_right_round():
    hybrid = Hybrid([{"aggregator": FedMax(), "until_round": 2}, {"aggregator": FedAvg()}])
    r = lambda t: report([1, 3], [2.0, 1.0], round_=t)  # noqa: E731
    assert_allclose(hybrid.weights(r(1)), [1, 0])
    assert_allclose(hybrid.weights(r(2)), [1, 0])
    assert_allclose(hybrid.weights(r(3)), [0.25, 0.75])
    assert hybrid.run_tags() == {"hybrid_phase_1_from_round": "3"}


def test_hybrid_switches_at_the_right_accuracy_and_never_back():
    hybrid = Hybrid([{"aggregator": FedSoftBetter(), "until_accuracy": 0.8}, {"aggregator": FedAvg()}])
    r = lambda t, acc: report([1, 3], [2.0, 1.0], round_=t, accuracy=acc)  # noqa: E731
    assert not np.allclose(hybrid.weights(r(1, math.nan)), [0.25, 0.75])
    assert not np.allclose(hybrid.weights(r(2, 0.79)), [0.25, 0.75])
    assert_allclose(hybrid.weights(r(3, 0.81)), [0.25, 0.75])
    assert_allclose(hybrid.weights(r(4, 0.5)), [0.25, 0.75])
    assert hybrid.run_tags() == {"hybrid_phase_1_from_round": "3", "hybrid_switch_on": "test_accuracy"}


def test_a_hybrid_returns_its_phase_s_diagnostics_with_the_phase_and_keeps_none_on_itself():
    hybrid = Hybrid([{"aggregator": FedSoftMax(temperature=0.5), "until_round": 1}, {"aggregator": FedAvg()}])
    deltas, w = torch.eye(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    # Round 1, FedSoftMax with p = [.25, .75], F = [0, ln 3], T = 0.5: alpha = p * exp(F / T) / Z = [.25, 6.75] / 7,
    # |alpha - p|_1 = (.25 - .25 / 7) + (6.75 / 7 - .75) = 2 (.25 - .25 / 7).
    first = hybrid.aggregate(w, deltas, report([1, 3], [0.0, math.log(3.0)], round_=1))
    assert_allclose(first.alpha, [0.25 / 7, 6.75 / 7])
    assert first.diagnostics == pytest.approx(
        {"alpha_distance": 2 * (0.25 - 0.25 / 7), "temperature": 0.5, "hybrid_phase": 0.0}
    )
    second = hybrid.aggregate(w, deltas, report([1, 3], [0.0, math.log(3.0)], round_=2))
    assert second.diagnostics == {"alpha_distance": 0.0, "hybrid_phase": 1.0}  # FedAvg: no temperature
    assert_allclose(second.update.numpy(), [0.25, 0.75])
    assert not hasattr(hybrid, "diagnostics") and "diagnostics" not in hybrid.state_dict()


@pytest.mark.parametrize(
    "make,key",
    [
        (lambda: FedSoftMax(temperature=0), "temperature"),
        (lambda: FedSoftMax(temperature=-1), "temperature"),
        (lambda: FedSoftMax(weighting="size"), "weighting"),
        (lambda: ServerOptimizer(server_lr=0), "server_lr"),
        (lambda: FedMaxK(k=0), "k"),
        (lambda: FedMaxK(k=1.5), "k"),
        (lambda: FedMax(fstar="min"), "fstar"),
        (lambda: FedMax(loss_on="server"), "loss_on"),
        (lambda: FedMax(loss_scale="sum"), "loss_scale"),
        (lambda: FedSoftMax(anneal="linear"), "temperature_final"),
        (lambda: Hybrid([{"aggregator": FedMax()}, {"aggregator": FedAvg()}]), "phases"),
        (
            lambda: Hybrid([{"aggregator": FedNova(), "until_round": 2}, {"aggregator": FedAvg()}]),
            r"phases\[0\].aggregator='FedNova'",
        ),
        (
            lambda: Hybrid([{"aggregator": FedAvg(), "until_round": 2}, {"aggregator": MVR()}]),
            r"phases\[1\].aggregator='MVR'",
        ),
    ],
)
def test_bad_values_name_the_key(make, key):
    with pytest.raises(ConfigError, match=key):
        make()


def test_fedavg_takes_the_samplers_unbiased_weights_when_the_round_has_some_and_measures_them_against_p():
    deltas = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    view = RoundView(np.arange(2), np.array([10, 30]), sampled_weights=np.array([0.5, 1.5]))
    update, alpha, diagnostics = FedAvg().aggregate(torch.zeros(2), deltas, view)
    # alpha = q_k / (m p_k) as given; p = (0.25, 0.75), so |0.5 - 0.25| + |1.5 - 0.75| = 1.0.
    assert_allclose(alpha, [0.5, 1.5])
    assert_allclose(update.numpy(), [0.5, 1.5])
    assert diagnostics == {"alpha_distance": pytest.approx(1.0)}
    update, alpha, diagnostics = FedAvg().aggregate(torch.zeros(2), deltas, RoundView(np.arange(2), np.array([10, 30])))
    assert_allclose(alpha, [0.25, 0.75])
    assert_allclose(update.numpy(), [0.25, 0.75])
    assert diagnostics == {"alpha_distance": 0.0}


@pytest.mark.parametrize(
    "aggregator",
    [
        FedAvg(),
        FedSoftMax(),
        FedNova(),
        MVR(),
        Hybrid([{"aggregator": FedAvg(), "until_round": 1}, {"aggregator": FedSoftMax()}]),
    ],
    ids=lambda a: type(a).__name__,
)
def test_a_round_that_drew_nobody_aggregates_to_a_zero_update_with_no_alpha_and_leaves_the_state_alone(aggregator):
    params = torch.tensor([1.0, -2.0, 3.0])
    before = {k: v for k, v in aggregator.state_dict().items() if k != "phases"}
    nobody = RoundView(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), round=5)
    update, alpha, diagnostics = aggregator.aggregate(params, torch.zeros(0, 3), nobody)
    assert update.tolist() == [0.0, 0.0, 0.0] and alpha.shape == (0,) and diagnostics == {}
    assert {k: v for k, v in aggregator.state_dict().items() if k != "phases"} == before  # a hybrid does not switch


def test_mvrs_momentum_waits_through_a_round_that_drew_nobody():
    mvr = MVR(beta=0.5)
    one = RoundView(np.arange(1), np.array([10]), previous_deltas=None)
    assert mvr.aggregate(torch.zeros(2), torch.tensor([[2.0, 4.0]]), one).update.tolist() == [2.0, 4.0]
    nobody = RoundView(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), previous_deltas=None)
    mvr.aggregate(torch.zeros(2), torch.zeros(0, 2), nobody)
    again = RoundView(np.arange(1), np.array([10]), previous_deltas=torch.tensor([[1.0, 1.0]]))
    # m = 0.5 (0, 2) + 0.5 ((2, 4) + ((0, 2) - (1, 1))) = (0, 1) + (0.5, 2.5) = (0.5, 3.5)
    assert mvr.aggregate(torch.zeros(2), torch.tensor([[0.0, 2.0]]), again).update.tolist() == [0.5, 3.5]


# The defences of the loss-weighted family against a client that lies about its loss (issue 36): trim and max_weight.
LOSS_WEIGHTED = (FedMax, FedMaxK, FedSoftMax, FedBetter, FedBetterK, FedSoftBetter)


@pytest.mark.parametrize("make", LOSS_WEIGHTED, ids=lambda c: c.__name__)
def test_without_trim_or_cap_every_loss_weighted_rule_is_what_it_was_bit_for_bit(make):
    r = report([3, 1, 4, 2, 5], [0.3, 2.0, 0.1, 1.2, 0.7], round_=3)
    for agg in (make(), make(trim=0, max_weight=None), make(max_weight=1.0)):
        before = agg.weigh(agg.sign * agg.gaps(r), agg.base_weights(r), r.round)  # the rule alone, as before
        assert np.array_equal(agg.weights(r), before)
        assert "trimmed" not in agg.combine(agg.weights(r), torch.eye(5), r).diagnostics


def test_trim_drops_the_highest_losses_and_reweighs_the_rest_by_hand():
    # p = [.25, .25, .5], L = [0, ln 2, 5]; trim 1 drops client 2, p over the kept = [.5, .5], exp(L) = [1, 2]:
    # alpha = [.5, 1] / 1.5 = [1/3, 2/3], and 0 for the dropped.
    r = report([1, 1, 2], [0.0, np.log(2.0), 5.0])
    agg = FedSoftMax(trim=1)
    aggregation = agg.aggregate(torch.zeros(3), torch.eye(3), r)
    assert_allclose(aggregation.alpha, [1 / 3, 2 / 3, 0.0])
    assert aggregation.diagnostics["trimmed"] == 1.0
    # |1/3 - 1/4| + |2/3 - 1/4| + |0 - 1/2| = 1/12 + 5/12 + 6/12
    assert aggregation.diagnostics["alpha_distance"] == pytest.approx(1.0)


def test_fedmax_with_trim_is_the_ditto_codes_k_loss():
    # Ditto (litian96/ditto, flearn/trainers_global/fedbase.py, k_loss_average): np.argsort(losses)[num_benign - 1],
    # num_benign = clients - f. Losses [.5, 2, .1, 1], f = 1: sorted ids [2, 0, 3, 1], place 2 -> client 3.
    r = report([1, 1, 1, 1], [0.5, 2.0, 0.1, 1.0])
    assert_allclose(FedMax(trim=1).weights(r), [0, 0, 0, 1])
    assert_allclose(FedMax(trim=2).weights(r), [1, 0, 0, 0])  # place 1 -> client 0
    # FedMax(k): k of the kept clients. f = 1 keeps {0, 2, 3}; the 2 largest are 3 and 0.
    assert_allclose(FedMaxK(k=2, trim=1).weights(r), [0.5, 0, 0, 0.5])
    # the fraction is of the 3 kept: round(1/3 * 3) = 1 client
    assert_allclose(FedMaxK(k=1 / 3, trim=1).weights(r), [0, 0, 0, 1])


def test_the_better_mirrors_trim_the_lowest_losses_where_their_liar_reports():
    # FedBetter rewards a small loss, so its liar reports one: trim drops the smallest L_i (the largest -L_i).
    r = report([1, 1, 1, 1], [0.5, 2.0, 0.1, 1.0])
    assert_allclose(FedBetter(trim=1).weights(r), [1, 0, 0, 0])  # 0.1 dropped: 0.5 is the best left
    assert_allclose(FedBetterK(k=2, trim=1).weights(r), [0.5, 0, 0, 0.5])  # {0.5, 1.0} of {0.5, 2.0, 1.0}
    # FedSoftBetter, uniform p, T = 1, trim 1 keeps [.5, 2, 1]: alpha proportional to exp(-L)
    e = np.exp([-0.5, -2.0, -1.0])
    assert_allclose(FedSoftBetter(trim=1, weighting="uniform").weights(r), np.insert(e / e.sum(), 2, 0.0))


def test_trim_ties_drop_the_lower_cohort_position_and_a_small_round_keeps_one_client():
    assert_allclose(FedMax(trim=1).weights(report([1, 1, 1], [2.0, 2.0, 1.0])), [0, 1, 0])
    # A Poisson round of 2 clients under trim 3 drops 1 (n - 1) and keeps the least extreme.
    agg = FedSoftMax(trim=3)
    aggregation = agg.aggregate(torch.zeros(2), torch.eye(2), report([1, 1], [3.0, 1.0]))
    assert_allclose(aggregation.alpha, [0, 1])
    assert aggregation.diagnostics["trimmed"] == 1.0


def test_max_weight_water_fills_by_hand():
    # Uniform p, T = 1 and L = ln(alpha) give alpha = [.6, .3, .06, .04]. Cap .35: client 0 -> .35, its .25 to the
    # others in proportion [.3, .06, .04] / .4: [.4875, .0975, .065]; client 1 is now above: -> .35, and the .3
    # left goes to [.06, .04] / .1: [.18, .12].
    losses = np.log([0.6, 0.3, 0.06, 0.04])
    agg = FedSoftMax(weighting="uniform", max_weight=0.35)
    assert_allclose(agg.weights(report([1, 1, 1, 1], losses)), [0.35, 0.35, 0.18, 0.12])
    # With trim: a fifth client reporting 10 is dropped first; the cap then acts on the four kept, the dropped at 0.
    agg = FedSoftMax(weighting="uniform", max_weight=0.35, trim=1)
    assert_allclose(agg.weights(report([1] * 5, [*losses, 10.0])), [0.35, 0.35, 0.18, 0.12, 0.0])


def test_max_weight_spreads_by_p_where_the_others_hold_no_weight():
    # FedMax on p = [.25, .25, .5] gives [0, 1, 0]; cap .4: client 1 -> .4, the .6 over clients 0 and 2 by p:
    # .6 [1/3, 2/3] = [.2, .4].
    assert_allclose(FedMax(max_weight=0.4).weights(report([1, 1, 2], [0.0, 3.0, 1.0])), [0.2, 0.4, 0.4])
    # FedMax(2) on four equal clients: [.5, .5] capped at .3 each, the .4 left split by p over the other two.
    assert_allclose(FedMaxK(k=2, max_weight=0.3).weights(report([1] * 4, [1.0, 4.0, 3.0, 0.0])), [0.2, 0.3, 0.3, 0.2])


def test_a_cap_below_one_over_the_round_makes_a_poisson_round_uniform():
    # A Poisson round of 2 clients cannot hold a cap of .2: it is raised to 1/2.
    assert_allclose(FedSoftMax(max_weight=0.2).weights(report([1, 3], [5.0, 0.0])), [0.5, 0.5])
    # Over the kept clients: trim 1 of 3 keeps 2.
    assert_allclose(FedMax(max_weight=0.2, trim=1).weights(report([1, 1, 1], [9.0, 2.0, 1.0])), [0, 0.5, 0.5])


def context(sizes=100, cohort=None, clients_per_round=1.0, sampling="fixed"):
    from fedrun.rounds import Schedule
    from fedrun.state import Context

    schedule = Schedule(cohort=cohort, clients_per_round=clients_per_round, sampling=sampling)
    return Context(schedule, np.ones(sizes, dtype=np.int64))


@pytest.mark.parametrize(
    "make,ctx,message",
    [
        (lambda: FedMax(trim=5), context(cohort=5), r"aggregator.trim=5 is invalid: allowed is fewer than the cohort"),
        (lambda: FedSoftMax(trim=10), context(clients_per_round=0.1, sampling="poisson"), r"expected cohort of 10"),
        (lambda: FedSoftMax(max_weight=0.1), context(cohort=5), r"aggregator.max_weight=0.1 .*1 / 5 = 0.2"),
        (lambda: FedSoftMax(max_weight=0.2, trim=1), context(cohort=5), r"1 / 4 = 0.25 \(4 clients weighed"),
        (
            lambda: Hybrid([{"aggregator": FedSoftBetter(trim=3), "until_round": 2}, {"aggregator": FedAvg()}]),
            context(cohort=3),
            r"aggregator.phases\[0\].aggregator.trim=3",
        ),
    ],
)
def test_bind_refuses_a_trim_that_leaves_nobody_and_a_cap_that_cannot_hold(make, ctx, message):
    with pytest.raises(ConfigError, match=message):
        make().bind(ctx)


def test_bind_accepts_what_can_run():
    FedMax(trim=4).bind(context(cohort=5))
    FedSoftMax(max_weight=0.25, trim=1).bind(context(cohort=5))
    FedSoftMax(max_weight=0.01).bind(context(clients_per_round=0.1, sampling="poisson"))  # small rounds: uniform
    Hybrid([{"aggregator": FedSoftBetter(trim=2), "until_round": 2}, {"aggregator": FedAvg()}]).bind(context(cohort=3))


@pytest.mark.parametrize(
    "make,key",
    [
        (lambda: FedMax(trim=-1), "trim"),
        (lambda: FedMax(trim=1.5), "trim"),
        (lambda: FedMax(trim=True), "trim"),
        (lambda: FedSoftMax(max_weight=0), "max_weight"),
        (lambda: FedSoftMax(max_weight=1.5), "max_weight"),
    ],
)
def test_bad_defence_values_name_the_key(make, key):
    with pytest.raises(ConfigError, match=f"^{key}="):
        make()


# The capture derivation (issue 36). FedSoftMax's alpha_i = p_i exp(L_i / T) / sum_j p_j exp(L_j / T) (paper 000,
# 000_e8a407b177dd9e6a.txt line 269; paper 001 line 239). Uniform p (weighting=uniform, or equal sample counts) and
# n clients: n - 1 honest ones with L_i <= l_max, one liar reporting L_a = l_max + D. Then
#   alpha_a = exp(L_a / T) / (exp(L_a / T) + sum_i exp(L_i / T))
#          >= exp(L_a / T) / (exp(L_a / T) + (n - 1) exp(l_max / T))      (each honest L_i <= l_max)
#           = 1 / (1 + (n - 1) exp(-D / T)),
# and alpha_a >= 0.9 iff (n - 1) exp(-D / T) <= 1/9 iff D >= T ln(9 (n - 1)). The inequality is an equality when every
# honest loss equals l_max, so the bound is tight: D = T ln(9 (n - 1)) - eps gives 1 / (1 + exp(eps / T) / 9) < 0.9.
# With samples weighting the (n - 1) becomes (1 - p_a) / p_a: D >= T ln(9 (1 - p_a) / p_a), a smaller lie for a
# client of many samples (and one that also inflates its count).
CAPTURE = [(n, t) for n in (2, 3, 10, 100) for t in (0.05, 1.0, 20.0)]


def liar_round(n, temperature, rng, equal=False, below=0.0, sizes=None):
    """n - 1 honest losses in [0.5, 2.5] (all 2.5 when ``equal``) and a last client reporting
    l_max + T ln(9 (n - 1)) - ``below``."""
    honest = np.full(n - 1, 2.5) if equal else rng.uniform(0.5, 2.5, n - 1)
    liar = honest.max() + temperature * math.log(9 * (n - 1)) - below
    return report(sizes if sizes is not None else [7] * n, [*honest, liar])


@pytest.mark.parametrize("n,temperature", CAPTURE)
def test_a_loss_liar_captures_90_percent_of_fedsoftmax_and_the_bound_is_tight(n, temperature):
    rng = np.random.default_rng(n)
    agg = FedSoftMax(temperature=temperature, weighting="uniform")
    for _ in range(5):
        assert agg.weights(liar_round(n, temperature, rng))[-1] >= 0.9 - 1e-12  # = 0.9 for n = 2 (one honest)
    # Worst case (every honest loss at l_max): exactly 0.9, and any less lie gives less.
    assert agg.weights(liar_round(n, temperature, rng, equal=True))[-1] == pytest.approx(0.9, rel=1e-10)
    eps = 1e-3 * temperature
    short = agg.weights(liar_round(n, temperature, rng, equal=True, below=eps))[-1]
    assert short < 0.9
    assert short == pytest.approx(1 / (1 + math.exp(1e-3) / 9), rel=1e-10)
    # Equal sample counts under samples weighting are the same p: the same capture.
    assert FedSoftMax(temperature=temperature).weights(liar_round(n, temperature, rng, equal=True))[-1] == (
        pytest.approx(0.9, rel=1e-10)
    )


def test_with_samples_weighting_the_lie_needed_is_t_ln_9_1_minus_pa_over_pa():
    # Sizes [1, 1, 1, 7]: p_a = 0.7, so D = T ln(9 * 0.3 / 0.7) captures exactly 0.9 against equal honest losses,
    # far less than the uniform T ln(27).
    temperature = 0.5
    d = temperature * math.log(9 * 0.3 / 0.7)
    alpha = FedSoftMax(temperature=temperature).weights(report([1, 1, 1, 7], [1.0, 1.0, 1.0, 1.0 + d]))
    assert alpha[-1] == pytest.approx(0.9, rel=1e-10)


@pytest.mark.parametrize("n", [5, 10, 100])
def test_the_liar_gets_all_of_fedmax_none_with_trim_and_at_most_the_cap(n):
    rng = np.random.default_rng(n)
    r = liar_round(n, 1.0, rng)
    assert FedMax().weights(r)[-1] == 1.0
    for agg in (FedMax(trim=1), FedSoftMax(trim=1), FedMaxK(k=2, trim=1)):
        alpha = agg.weights(r)
        assert alpha[-1] == 0.0 and alpha.sum() == pytest.approx(1.0)
    for agg in (FedSoftMax(max_weight=0.2), FedMax(max_weight=0.2)):
        alpha = agg.weights(r)
        assert alpha[-1] == pytest.approx(0.2) and alpha.max() <= 0.2 + 1e-12 and alpha.sum() == pytest.approx(1.0)
