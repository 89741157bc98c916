"""Golden numbers for the aggregators, computed by hand."""

import numpy as np
import pytest
import torch
from numpy.testing import assert_allclose

from fedrun.aggregators import CohortReport, FedAvg, FedSoftMax
from fedrun.errors import ConfigError


def report(sizes, losses):
    return CohortReport(clients=np.arange(len(sizes)), sizes=np.array(sizes), losses=np.array(losses, float), round=1)


def test_fedavg_weights_by_samples_and_uniform():
    r = report([1, 1, 2], [5.0, 0.0, 1.0])
    assert_allclose(FedAvg().weights(r), [0.25, 0.25, 0.5])
    assert_allclose(FedAvg(weighting="uniform").weights(r), [1 / 3, 1 / 3, 1 / 3])


def test_fedavg_update_is_weighted_mean_of_deltas_times_server_lr():
    w = torch.tensor([1.0, -1.0])
    deltas = torch.tensor([[4.0, 0.0], [0.0, 4.0], [2.0, 2.0]])
    new, alpha = FedAvg().aggregate(w, deltas, report([1, 1, 2], [0, 0, 0]))
    # 0.25*[4,0] + 0.25*[0,4] + 0.5*[2,2] = [2, 2]
    assert_allclose(new.numpy(), [3.0, 1.0])
    new, _ = FedAvg(server_lr=0.5).aggregate(w, deltas, report([1, 1, 2], [0, 0, 0]))
    assert_allclose(new.numpy(), [2.0, 0.0])


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


def test_fedsoftmax_update_by_hand():
    w = torch.zeros(2)
    deltas = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    new, alpha = FedSoftMax().aggregate(w, deltas, report([1, 1, 2], [0.0, np.log(2.0), 0.0]))
    assert_allclose(alpha, [0.2, 0.4, 0.4])
    assert_allclose(new.numpy(), [0.6, 0.8], rtol=1e-6)


def test_fedsoftmax_limits():
    r = report([3, 1, 4, 2], [0.3, 2.0, 0.1, 1.2])
    assert_allclose(FedSoftMax(temperature=1e12).weights(r), FedAvg().weights(r), rtol=1e-9)
    # T -> 0 puts all the weight on the worst-fitted client
    assert_allclose(FedSoftMax(temperature=1e-6).weights(r), [0, 1, 0, 0], atol=1e-12)


def test_fedsoftmax_is_stable_for_huge_losses():
    alpha = FedSoftMax(temperature=1.0).weights(report([1, 1], [1000.0, 0.0]))
    assert np.all(np.isfinite(alpha))
    assert_allclose(alpha, [1.0, 0.0], atol=1e-12)


@pytest.mark.parametrize("kwargs,key", [({"temperature": 0}, "temperature"), ({"temperature": -1}, "temperature"),
                                        ({"weighting": "size"}, "weighting"), ({"server_lr": 0}, "server_lr")])
def test_bad_values_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        FedSoftMax(**kwargs)
