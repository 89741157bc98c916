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


def test_momentum_two_steps():
    server = ServerMomentum(server_lr=1.0, beta=0.5)
    w1 = server.step(W, D1)  # v = D1
    assert_allclose(w1.numpy(), [1.2, 0.6])
    w2 = server.step(w1, D2)  # v = 0.5 * [0.2, -0.4] + [0.1, 0.3] = [0.2, 0.1]
    assert_allclose(w2.numpy(), [1.4, 0.7], rtol=1e-6)


def test_adam_first_step():
    # m = 0.1 * D1 = [.02, -.04]; v = 0.01 * D1^2 = [.0004, .0016]; sqrt v = [.02, .04]
    server = ServerAdam(server_lr=0.1, beta1=0.9, beta2=0.99, eps=0.01)
    expected = 1.0 + 0.1 * torch.tensor([0.02 / 0.03, -0.04 / 0.05])
    assert_allclose(server.step(W, D1).numpy(), expected.numpy(), rtol=1e-6)


def test_yogi_and_adagrad_second_moments():
    # From v = 0: yogi v = 0 - 0.01 * D1^2 * sign(0 - D1^2) = 0.01 * D1^2 (as Adam's first step)
    yogi = ServerYogi(server_lr=0.1, beta1=0.9, beta2=0.99, eps=0.01)
    adam = ServerAdam(server_lr=0.1, beta1=0.9, beta2=0.99, eps=0.01)
    assert_allclose(yogi.step(W, D1).numpy(), adam.step(W, D1).numpy(), rtol=1e-6)
    # second step: v = [.0004, .0016]; D2^2 = [.01, .09]; sign(v - D2^2) = -1 -> v += .01 * D2^2
    yogi.step(W, D2)
    assert_allclose(yogi.v.numpy(), [0.0004 + 0.0001, 0.0016 + 0.0009], rtol=1e-5)
    # adagrad: v = D1^2; m = 0.1 D1; step = lr * 0.1 D1 / (|D1| + eps)
    adagrad = ServerAdagrad(server_lr=1.0, beta1=0.9, eps=0.01)
    expected = [1 + 0.02 / (0.2 + 0.01), 1 - 0.04 / (0.4 + 0.01)]
    assert_allclose(adagrad.step(W, D1).numpy(), expected, rtol=1e-6)
    assert math.isclose(adagrad.v[1].item(), 0.16, rel_tol=1e-6)


@pytest.mark.parametrize("make,key", [(lambda: ServerMomentum(beta=1.0), "beta"), (lambda: ServerAdam(eps=0), "eps"),
                                      (lambda: ServerYogi(beta2=1.5), "beta2"), (lambda: ServerOptimizer(server_lr=-1), "server_lr")])
def test_bad_values_name_the_key(make, key):
    with pytest.raises(ConfigError, match=key):
        make()
