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


def test_only_aggregators_whose_alpha_follows_the_clients_log_its_series(compose_config):
    """alpha's per-client series go to MLflow only where alpha depends on what the clients measured (README,
    "Metrics in MLflow"): the loss-weighted family and the hybrid, FedStaleWeight, FedBuff with staleness scaling."""
    from hydra.utils import instantiate

    expected = {
        "fedavg": False,
        "fednova": False,
        "mvr": False,
        "fedbuff": False,
        "fedasync": False,
        "fedmax": True,
        "fedbetter": True,
        "fedmaxk": True,
        "fedbetterk": True,
        "fedsoftmax": True,
        "fedsoftbetter": True,
        "hybrid": True,
        "fedstaleweight": True,
    }
    for name, informative in expected.items():
        assert instantiate(compose_config(f"aggregator={name}").aggregator).alpha_informative is informative, name
    scaled = compose_config("aggregator=fedbuff", "aggregator.staleness_scaling=true").aggregator
    assert instantiate(scaled).alpha_informative


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
