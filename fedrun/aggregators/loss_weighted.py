"""The loss-weighted family (papers 000 and 001): weights from each client's loss of the global model."""

import numpy as np

from fedrun.aggregators.base import Aggregator, CohortReport
from fedrun.errors import check


class FedAvg(Aggregator):
    """FedAvg (McMahan et al. 2017): alpha_i = p_i."""

    def weights(self, report: CohortReport) -> np.ndarray:
        return self.base_weights(report)


class FedSoftMax(Aggregator):
    """FedSoftMax (FedSoftWorse): alpha_i proportional to p_i * exp(L_i / T), L_i = F_i(w_t) - F_i*.

    F_i* = 0 here. T -> infinity gives FedAvg; T -> 0 puts all weight on the worst-fitted client (FedMax).

    Args:
        temperature: T > 0.
        weighting, server_lr: See ``Aggregator``.
    """

    def __init__(self, temperature: float = 1.0, weighting: str = "samples", server_lr: float = 1.0):
        super().__init__(weighting, server_lr)
        check(temperature > 0, "temperature", temperature, "a number > 0")
        self.temperature = temperature

    def weights(self, report: CohortReport) -> np.ndarray:
        # log-sum-exp form: subtracting the max keeps exp() finite for any loss and temperature.
        logits = np.log(self.base_weights(report)) + np.asarray(report.losses, dtype=np.float64) / self.temperature
        w = np.exp(logits - logits.max())
        return w / w.sum()
