"""Aggregators that correct for unequal local work or client drift (paper 002's baselines and method)."""

from __future__ import annotations

import numpy as np

from fedrun.aggregators.base import Aggregation, Aggregator
from fedrun.cohort import RoundView
from fedrun.errors import check
from fedrun.lazy import torch


class FedNova(Aggregator):
    """FedNova (Wang et al. 2020): normalised averaging, Delta = tau_eff * sum_i p_i Delta_i / ||a_i||_1,
    tau_eff = sum_i p_i ||a_i||_1, with ||a_i||_1 the client's accumulated step coefficients (its local
    steps for plain SGD; the momentum and proximal forms follow the solver). Equals FedAvg when every
    client does the same work with the same solver. alpha (logged) is p.
    """

    weights_follow_clients = True  # each update is scaled by its client's local work
    alpha_is_share = False  # alpha is p, but each update is scaled by tau_eff / ||a_i||_1

    def weights(self, report: RoundView) -> np.ndarray:
        return self.base_weights(report)

    def aggregate(self, global_params, deltas, report):
        if not len(deltas):
            return self.empty(global_params)
        p = self.base_weights(report)
        norms = np.asarray(report.coefficient_norms, dtype=np.float64)
        check(bool(np.all(norms > 0)), "aggregator", "fednova", "clients that take at least one local step")
        tau_eff = float(p @ norms)
        scale = torch.as_tensor(p * tau_eff / norms, dtype=deltas.dtype, device=deltas.device)
        return Aggregation(scale @ deltas, p, {"alpha_distance": 0.0, "tau_eff": tau_eff})


class MVR(Aggregator):
    """Global momentum variance reduction (paper 002, Algorithm 2) in Delta form.

    m_1 = sum_i p_i Delta_i^1 and, from round 2,
    m_t = beta * sum_i p_i Delta_i^t + (1 - beta) m_{t-1} + (1 - beta) sum_i p_i (Delta_i^t - Delta_hat_i^{t-1}),
    where Delta_hat_i^{t-1} is the update client i would have made from the previous global model on the
    same mini-batches (reading ``previous_deltas`` makes the engine train the cohort from the previous model).
    The server optimizer then steps along m_t. Each client uploads two updates and downloads two models per
    round (Algorithm 2 line 2 broadcasts both models, also in round 1 where w_0 = w_1).

    Args:
        beta: Weight of the fresh average, in (0, 1].
        weighting: p_i (the paper averages uniformly).
    """

    STATE = ("momentum",)  # m_{t-1}
    reads_second_update = True  # Delta_hat_i, trained from the previous model: no pipeline stage sees it
    alpha_is_share = False  # the update carries the momentum and the correction besides sum p_i Delta_i

    def __init__(self, beta: float = 0.5, weighting: str = "uniform"):
        super().__init__(weighting)
        check(0 < beta <= 1, "beta", beta, "a number in (0, 1]")
        self.beta, self.momentum = beta, None

    def weights(self, report: RoundView) -> np.ndarray:
        return self.base_weights(report)

    def aggregate(self, global_params, deltas, report):
        if not len(deltas):
            return self.empty(global_params)  # the momentum waits for a round with clients
        p = self.base_weights(report)
        weights = torch.as_tensor(p, dtype=deltas.dtype, device=deltas.device)
        fresh = weights @ deltas
        if self.momentum is None or report.previous_deltas is None:
            self.momentum = fresh  # round 1: plain averaging
        else:
            correction = weights @ (deltas - report.previous_deltas)
            self.momentum = self.beta * fresh + (1 - self.beta) * (self.momentum + correction)
        return Aggregation(self.momentum, p, {"alpha_distance": 0.0})
