"""One step of each server optimizer on hand-made updates."""

import math

import pytest
import torch
from numpy.testing import assert_allclose

from fedrun.errors import ConfigError
from fedrun.servers import ServerAdagrad, ServerAdam, ServerMomentum, ServerOptimizer, ServerYogi

W = torch.tensor([1.0, 1.0])
D1, D2 = torch.tensor([0.2, -0.4]), torch.tensor([0.1, 0.3])


def test_sgd_step():
    assert_allclose(ServerOptimizer(server_lr=2.0).step(W, D1).numpy(), [1.4, 0.2])


def test_sgd_step_at_server_lr_one_is_bit_for_bit_the_scaled_step():
    # server_lr = 1 skips the multiplication (no temporary as large as the model): 1.0 * delta is delta exactly,
    # signed zeros, infinities and NaNs included, so the step's bits are those of params + 1.0 * delta
    torch.manual_seed(0)
    w = torch.cat([torch.randn(1000), torch.tensor([0.0, -0.0, 1.0, float("inf"), 2.0])])
    d = torch.cat([torch.randn(1000) * 1e-3, torch.tensor([-0.0, -0.0, float("nan"), 1.0, -float("inf")])])
    stepped, scaled = ServerOptimizer().step(w, d), w + 1.0 * d
    assert torch.equal(stepped.view(torch.int32)[:1003], scaled.view(torch.int32)[:1003])  # bits, -0.0 included
    assert stepped[1002].isnan() and stepped[1003] == float("inf") and stepped[1004] == -float("inf")


def test_momentum_two_steps():
    server = ServerMomentum(server_lr=1.0, beta=0.5)
    w1 = server.step(W, D1)  # v = D1
    assert_allclose(w1.numpy(), [1.2, 0.6])
    w2 = server.step(w1, D2)  # v = 0.5 * [0.2, -0.4] + [0.1, 0.3] = [0.2, 0.1]
    assert_allclose(w2.numpy(), [1.4, 0.7], rtol=1e-6)


def test_adam_first_step_from_the_papers_v0():
    # Reddi et al. (2021) Algorithm 2: v_{-1} = tau^2 = 1e-4. m = 0.1 * D1 = [.02, -.04];
    # v = 0.99 * 1e-4 + 0.01 * D1^2 = [.000499, .001699]; sqrt v = [.0223383, .0412189];
    # w = 1 + 0.1 * m / (sqrt v + .01) = 1 + [.02 / .0323383, -.04 / .0512189] / 10 = [1.061846, 0.921904]
    server = ServerAdam(server_lr=0.1, beta1=0.9, beta2=0.99, eps=0.01)
    assert_allclose(server.step(W, D1).numpy(), [1.061846, 0.921904], rtol=1e-6)
    assert_allclose(server.v.numpy(), [0.000499, 0.001699], rtol=1e-5)


def test_adam_first_step_from_zero_is_nearly_sign_like():
    # v0 = zero (Flower's start): v = 0.01 * D1^2 = [.0004, .0016]; sqrt v = [.02, .04];
    # w = 1 + 0.1 * [.02 / .03, -.04 / .05] = [1.0666667, 0.92]
    server = ServerAdam(server_lr=0.1, beta1=0.9, beta2=0.99, eps=0.01, v0="zero")
    assert_allclose(server.step(W, D1).numpy(), [1 + 0.1 * 0.02 / 0.03, 1 - 0.1 * 0.04 / 0.05], rtol=1e-6)


def test_yogi_and_adagrad_second_moments():
    # Yogi from v = tau^2 = 1e-4: D1^2 = [.04, .16] > v, so sign(v - D1^2) = -1 and v = 1e-4 + 0.01 D1^2 = [.0005, .0017]
    yogi = ServerYogi(server_lr=0.1, beta1=0.9, beta2=0.99, eps=0.01)
    yogi.step(W, D1)
    assert_allclose(yogi.v.numpy(), [0.0005, 0.0017], rtol=1e-5)
    # second step: D2^2 = [.01, .09] > v again -> v += .01 * D2^2 = [.0006, .0026]
    yogi.step(W, D2)
    assert_allclose(yogi.v.numpy(), [0.0006, 0.0026], rtol=1e-5)
    # From v = 0 Yogi's first step equals Adam's: 0 - 0.01 * D1^2 * sign(0 - D1^2) = 0.01 * D1^2
    zero_yogi = ServerYogi(server_lr=0.1, beta1=0.9, beta2=0.99, eps=0.01, v0="zero")
    zero_adam = ServerAdam(server_lr=0.1, beta1=0.9, beta2=0.99, eps=0.01, v0="zero")
    assert_allclose(zero_yogi.step(W, D1).numpy(), zero_adam.step(W, D1).numpy(), rtol=1e-6)
    # Adagrad: v = 1e-4 + D1^2 = [.0401, .1601], sqrt v = [.200250, .400125]; m = 0.1 D1;
    # w = 1 + [.02 / .210250, -.04 / .410125] = [1.095125, 0.902469]
    adagrad = ServerAdagrad(server_lr=1.0, beta1=0.9, eps=0.01)
    assert_allclose(adagrad.step(W, D1).numpy(), [1.095125, 0.902469], rtol=1e-6)
    assert math.isclose(adagrad.v[1].item(), 0.1601, rel_tol=1e-6)
    # v0 = zero: v = D1^2, step = 0.1 D1 / (|D1| + .01)
    zero = ServerAdagrad(server_lr=1.0, beta1=0.9, eps=0.01, v0="zero")
    assert_allclose(zero.step(W, D1).numpy(), [1 + 0.02 / (0.2 + 0.01), 1 - 0.04 / (0.4 + 0.01)], rtol=1e-6)


@pytest.mark.parametrize(
    "make,key",
    [
        (lambda: ServerMomentum(beta=1.0), "beta"),
        (lambda: ServerAdam(eps=0), "eps"),
        (lambda: ServerYogi(beta2=1.5), "beta2"),
        (lambda: ServerOptimizer(server_lr=-1), "server_lr"),
        (lambda: ServerAdam(v0="ones"), "v0"),
    ],
)
def test_bad_values_name_the_key(make, key):
    with pytest.raises(ConfigError, match=key):
        make()
