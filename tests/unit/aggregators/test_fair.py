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
