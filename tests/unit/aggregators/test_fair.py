"""q-FedAvg (fedrun/aggregators/fair.py) by hand on 3 clients, and at q = 0 FedAvg with uniform weights exactly."""

import numpy as np
import pytest
import torch

from fedrun.aggregators import QFFL, FedAvg, RoundView
from fedrun.cohort import ClientLosses
from fedrun.errors import ConfigError

DELTAS = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-1.0, -1.0]], dtype=torch.float64)
LOSSES = np.array([0.5, 1.0, 2.0])


def view(lr: float = 0.1) -> RoundView:
    return RoundView(np.arange(3), np.array([10, 20, 30]), losses=ClientLosses(LOSSES, LOSSES), lr=lr)


def test_q_fedavg_by_hand_on_three_clients():
    # q = 2, L = 1/lr = 10. In the paper's terms Delta w_k = L (w - w_bar_k) = -10 Delta_k, so ||Delta w_k||^2 =
    # 100 * (1, 4, 2); h_k = 2 F_k ||Delta w_k||^2 + 10 F_k^2 = (100 + 2.5, 800 + 10, 800 + 40) = (102.5, 810, 840);
    # the step -sum F_k^2 Delta w_k / sum h_k = 10 * (0.25 * D1 + 1 * D2 + 4 * D3) / 1752.5.
    update, alpha, diagnostics = QFFL(q=2.0).aggregate(torch.zeros(2), DELTAS, view())
    expected = 10 * (0.25 * DELTAS[0] + 1.0 * DELTAS[1] + 4.0 * DELTAS[2]) / 1752.5
    np.testing.assert_allclose(update.numpy(), expected.numpy(), rtol=1e-8)  # the losses' 1e-10 guard moves it < 1e-9
    np.testing.assert_allclose(alpha, np.array([0.25, 1.0, 4.0]) * 10 / 1752.5, rtol=1e-8)
    assert diagnostics["step_sum"] == pytest.approx(52.5 / 1752.5, rel=1e-8)
    fixed = QFFL(q=2.0, lipschitz=10.0).aggregate(torch.zeros(2), DELTAS, view(lr=0.5))[0]
    assert torch.equal(fixed, update)  # lipschitz fixes L whatever the learning rate


def test_q_fedavg_at_q_zero_is_fedavg_with_uniform_weights_bit_for_bit():
    update, alpha, _ = QFFL(q=0.0).aggregate(torch.zeros(2), DELTAS, view())
    fedavg, fedavg_alpha, _ = FedAvg(weighting="uniform").aggregate(torch.zeros(2), DELTAS, view())
    assert torch.equal(update, fedavg) and np.array_equal(alpha, fedavg_alpha)


def test_a_larger_q_weighs_the_worse_clients_more():
    shares = [(a := QFFL(q=q).alpha(DELTAS, view())) / a.sum() for q in (0.0, 1.0, 3.0)]
    assert shares[0][2] < shares[1][2] < shares[2][2]  # the client of loss 2.0 gets more of the weight


def test_q_fedavg_counts_a_negative_reported_loss_as_zero():
    """Only a liar reports a loss below 0: counted as 0 (F^q of a negative loss is NaN for q = 0.5, negative for
    q = 1), the rule stays a step of non-negative weights."""

    def reported(first: float) -> RoundView:
        losses = np.array([first, 1.0, 2.0])
        return RoundView(np.arange(3), np.array([10, 20, 30]), losses=ClientLosses(losses, losses), lr=0.1)

    for q in (0.5, 1.0, 2.0):
        alpha = QFFL(q=q).alpha(DELTAS, reported(-9.5))
        assert np.all(np.isfinite(alpha)) and np.all(alpha >= 0)
        np.testing.assert_array_equal(alpha, QFFL(q=q).alpha(DELTAS, reported(0.0)))


@pytest.mark.parametrize("kwargs", [{"q": -1.0}, {"q": True}, {"lipschitz": 0.0}])
def test_bad_settings_are_refused_in_one_line(kwargs):
    with pytest.raises(ConfigError):
        QFFL(**kwargs)


def test_the_projection_onto_the_simplex_by_hand_and_at_a_vertex():
    from fedrun.aggregators.fair import project_simplex

    # (0.5, 0.2, 0.6): theta = (0.6 + 0.5 + 0.2 - 1) / 3 = 0.1, all above it: (0.4, 0.1, 0.5).
    np.testing.assert_allclose(project_simplex(np.array([0.5, 0.2, 0.6])), [0.4, 0.1, 0.5], atol=1e-15)
    # (2, 0, 0.5): rho = 1 (0.5 - (2.5 - 1)/2 < 0), theta = 1: the vertex (1, 0, 0).
    np.testing.assert_array_equal(project_simplex(np.array([2.0, 0.0, 0.5])), [1.0, 0.0, 0.0])
    # (0.8, 0.6, -1): theta = 0.2: (0.6, 0.4, 0).
    np.testing.assert_allclose(project_simplex(np.array([0.8, 0.6, -1.0])), [0.6, 0.4, 0.0], atol=1e-15)


def afl(lambda_lr: float, clients: int = 4):
    from types import SimpleNamespace

    from fedrun.aggregators import AFL

    rule = AFL(lambda_lr=lambda_lr)
    rule.bind(SimpleNamespace(sizes=np.ones(clients)))
    return rule


def test_afl_by_hand_on_three_of_four_clients():
    rule = afl(lambda_lr=0.1)
    update, alpha, _ = rule.aggregate(torch.zeros(2), DELTAS, view())
    np.testing.assert_array_equal(alpha, np.full(3, 1 / 3))  # lambda^1 uniform: its step weighs the cohort equally
    # lambda + 0.1 * (4/3) * (0.5, 1, 2, 0) = (0.25 + 0.0667, 0.25 + 0.1333, 0.25 + 0.2667, 0.25): theta = 0.1167,
    # so lambda^2 = (0.2, 0.2667, 0.4, 0.1333).
    np.testing.assert_allclose(rule.lam, [0.2, 0.8 / 3, 0.4, 0.4 / 3], atol=1e-12)
    _, alpha, diagnostics = rule.aggregate(torch.zeros(2), DELTAS, view())
    np.testing.assert_allclose(alpha, np.array([0.2, 0.8 / 3, 0.4]) / (0.6 + 0.8 / 3), rtol=1e-12)
    assert diagnostics["lambda_max"] == pytest.approx(rule.lam.max())


def test_afl_with_lambda_lr_zero_is_fedavg_with_uniform_weights_bit_for_bit():
    rule = afl(lambda_lr=0.0, clients=7)
    fedavg, fedavg_alpha, _ = FedAvg(weighting="uniform").aggregate(torch.zeros(2), DELTAS, view())
    for _ in range(3):
        update, alpha, _ = rule.aggregate(torch.zeros(2), DELTAS, view())
        assert torch.equal(update, fedavg) and np.array_equal(alpha, fedavg_alpha)
    assert np.array_equal(rule.state_dict()["lam"], np.full(7, 1 / 7))


def test_term_by_hand_and_at_t_zero_fedavg_bit_for_bit():
    from fedrun.aggregators import TERM

    # p = (10, 20, 30) / 60, F = (0.5, 1, 2), t = 2: alpha proportional to p_k exp(2 F_k) = (e, 2 e^2, 3 e^4) / 6.
    _, alpha, diagnostics = TERM(t=2.0).aggregate(torch.zeros(2), DELTAS, view())
    expected = np.array([np.e, 2 * np.e**2, 3 * np.e**4])
    np.testing.assert_allclose(alpha, expected / expected.sum(), rtol=1e-14)
    assert diagnostics["tilt"] == 2.0
    _, negative, _ = TERM(t=-2.0).aggregate(torch.zeros(2), DELTAS, view())
    assert negative[0] > negative[1] > negative[2]  # t < 0: away from the worst clients
    for weighting in ("samples", "uniform"):
        term = TERM(t=0.0, weighting=weighting).aggregate(torch.zeros(2), DELTAS, view())
        fedavg = FedAvg(weighting=weighting).aggregate(torch.zeros(2), DELTAS, view())
        assert torch.equal(term[0], fedavg[0]) and np.array_equal(term[1], fedavg[1])


def test_term_across_clients_is_fedsoftmax_at_one_over_t_where_their_definitions_meet():
    # Equal to floating point, not bit for bit: FedSoftMax divides the loss by T = 1/t, TERM multiplies it by t.
    # They meet with fstar=zero, loss_on=global, loss_scale=mean (paper 000's rule may subtract F_i*, read the last
    # local epoch's loss or the authors' scale) and both weigh by p_k.
    from fedrun.aggregators import TERM, FedSoftBetter, FedSoftMax

    for t in (0.3, 1.0, 4.0):
        term = TERM(t=t).aggregate(torch.zeros(2), DELTAS, view())[1]
        softmax = FedSoftMax(temperature=1 / t).aggregate(torch.zeros(2), DELTAS, view())[1]
        np.testing.assert_allclose(term, softmax, rtol=1e-14)
        mirror = FedSoftBetter(temperature=1 / t).aggregate(torch.zeros(2), DELTAS, view())[1]
        np.testing.assert_allclose(TERM(t=-t).aggregate(torch.zeros(2), DELTAS, view())[1], mirror, rtol=1e-14)
        # with trim too: t < 0 rewards the smallest losses, so trim drops those (it dropped the largest, which the
        # rule already weighs least: a liar reporting a tiny loss kept the weight the defence was to take away)
        for sign, rule in ((1, FedSoftMax), (-1, FedSoftBetter)):
            trimmed = TERM(t=sign * t, trim=1).aggregate(torch.zeros(2), DELTAS, view())[1]
            same = rule(temperature=1 / t, trim=1).aggregate(torch.zeros(2), DELTAS, view())[1]
            np.testing.assert_allclose(trimmed, same, rtol=1e-14)
            assert trimmed[2 if sign > 0 else 0] == 0.0


def bias_only(probabilities):
    """A two-class model whose logits are log(probabilities) whatever the input: each sample's loss is
    -log(probabilities[label]), known by hand."""
    model = torch.nn.Linear(3, 2).double()
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.log(torch.tensor(probabilities, dtype=torch.float64)))
    from fedrun.models import flat_parameters

    return model, flat_parameters(model)


def test_the_tilted_risk_by_hand_and_its_limits_the_mean_and_the_largest_loss():
    from fedrun.clients import TiltedRisk, tilted

    model, w = bias_only([0.25, 0.75])  # losses: log 4 for label 0, log(4/3) for label 1
    x, y = torch.zeros(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 1])
    losses = np.log([4.0, 4 / 3, 4 / 3, 4 / 3])
    # tau = 1: log((4 + 3 * 4/3) / 4) = log 2; tau = -1: -log((1/4 + 3 * 3/4) / 4) = -log(5/8)
    assert TiltedRisk(1.0)(model, w, x, y) == pytest.approx(np.log(2.0), rel=1e-14)
    assert TiltedRisk(-1.0)(model, w, x, y) == pytest.approx(-np.log(5 / 8), rel=1e-14)
    assert TiltedRisk(1e4)(model, w, x, y) == pytest.approx(np.log(4.0) - np.log(4) / 1e4, rel=1e-12)  # finite
    assert TiltedRisk(-1e4)(model, w, x, y) == pytest.approx(np.log(4 / 3) + np.log(4 / 3) / 1e4, rel=1e-12)
    # tau -> 0: the mean, to the last bits however small tau is (the plain form lost them all by tau = 1e-15); the
    # cumulant expansion: the mean + tau/2 the variance + tau^2/6 the third central moment + O(tau^3)
    for tau in (1e-6, 1e-9, 1e-15, 1e-18, -1e-15):
        expected = losses.mean() + tau / 2 * losses.var() + tau**2 / 6 * ((losses - losses.mean()) ** 3).mean()
        assert tilted(torch.tensor(losses), tau) == pytest.approx(expected, rel=1e-14, abs=0)
    rng = np.random.default_rng(0)
    many = torch.tensor(rng.exponential(0.4, 1000))
    assert tilted(many, 1e-15) == pytest.approx(float(many.mean()), rel=1e-14)
    assert tilted(many, 0.3) == pytest.approx(float(torch.logsumexp(0.3 * many, 0) - np.log(1000)) / 0.3, rel=1e-13)
    assert TiltedRisk(2.0) == TiltedRisk(2.0) and hash(TiltedRisk(2.0)) == hash(TiltedRisk(2.0))  # a view's cache key


def test_hierarchical_term_tilts_each_clients_tilted_risk_by_hand_on_the_loop_and_worker_processes():
    # Two clients of two samples, p uniform. Client 0 has labels (0, 1): losses (log 4, log 4/3), tilted risk at
    # tau = 1 log((4 + 4/3) / 2) = log(8/3); client 1 has (1, 1): log(4/3) either way. At t = 1, alpha is
    # proportional to exp(R~) = (8/3, 4/3): (2/3, 1/3). Their mean losses would give sqrt(16/3) : 4/3 instead.
    from fedrun.aggregators import TERM
    from fedrun.backends import LoopTrainer, ProcessTrainer

    model, w = bias_only([0.25, 0.75])
    x, y = torch.zeros(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 1])
    parts = [np.array([0, 1]), np.array([2, 3])]
    mean = np.log([[4.0, 4 / 3], [4 / 3, 4 / 3]]).mean(axis=1)
    deltas = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    workers = ProcessTrainer(model, x, y, None, workers=2)
    try:
        for trainer in (LoopTrainer(model, x, y, None), workers):
            report = RoundView(
                np.arange(2),
                np.array([2, 2]),
                losses=ClientLosses(mean, mean),
                measure=lambda signal, trainer=trainer: trainer.per_client(signal, w, parts),
            )
            _, alpha, _ = TERM(t=1.0, tau=1.0, weighting="uniform").aggregate(torch.zeros(2), deltas, report)
            np.testing.assert_allclose(alpha, [2 / 3, 1 / 3], rtol=1e-14)
            _, plain, _ = TERM(t=1.0, weighting="uniform").aggregate(torch.zeros(2), deltas, report)
            np.testing.assert_allclose(plain, np.array([np.sqrt(16 / 3), 4 / 3]) / (np.sqrt(16 / 3) + 4 / 3))
            _, zero, _ = TERM(t=1.0, tau=0.0, weighting="uniform").aggregate(torch.zeros(2), deltas, report)
            assert np.array_equal(zero, plain)  # tau = 0: the mean loss, as null
    finally:
        workers.close()


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"tau": 1.0, "loss_on": "local"}, "loss_on"),
        ({"tau": 1.0, "loss_scale": "authors"}, "loss_scale"),
        ({"tau": 1.0, "fstar": "estimate"}, "fstar"),
        ({"tau": float("inf")}, "tau"),
        ({"tau": True}, "tau"),
    ],
)
def test_term_refuses_a_tilt_within_clients_it_cannot_measure_in_one_line(kwargs, key):
    from fedrun.aggregators import TERM

    with pytest.raises(ConfigError) as refused:
        TERM(t=1.0, **kwargs)
    assert refused.value.key == key and "\n" not in str(refused.value)


def test_a_copy_of_hierarchical_term_reads_the_tilted_risks_from_the_views_cache_and_t_zero_measures_none():
    """The honest reference of an attack's measures aggregates with a deep copy of the aggregator
    (``fedrun.rounds.HonestReference``): it must find the round's tilted risks in the view, not measure them again."""
    import copy

    from fedrun.aggregators import TERM

    calls = []
    report = RoundView(
        np.arange(3),
        np.array([10, 20, 30]),
        losses=ClientLosses(LOSSES, LOSSES),
        measure=lambda signal: calls.append(signal) or np.array(LOSSES),
    )
    term = TERM(t=2.0, tau=0.5)
    first = term.aggregate(torch.zeros(2), DELTAS, report)[1]
    again = copy.deepcopy(term).aggregate(torch.zeros(2), DELTAS, report)[1]
    assert len(calls) == 1 and np.array_equal(first, again)
    np.testing.assert_allclose(first, TERM(t=2.0).aggregate(torch.zeros(2), DELTAS, view())[1], rtol=1e-14)
    flat = TERM(t=0.0, tau=0.5).aggregate(torch.zeros(2), DELTAS, report)[1]
    assert len(calls) == 1 and np.array_equal(flat, np.array([10, 20, 30]) / 60)  # t = 0: p, nothing measured
