"""The aggregation interface: weights alpha over the cohort, then a server step.

With Delta_i = w_i - w (local model minus the global model it started from), the server step is
    w <- w + server_lr * sum_i alpha_i * Delta_i,    sum_i alpha_i = 1 over the cohort.
Aggregators differ in how they choose alpha; ``weights`` is the only method most of them write.
"""

from dataclasses import dataclass

import numpy as np
import torch

from fedrun.errors import check


@dataclass
class CohortReport:
    """What the server knows about the cohort of one round.

    Attributes:
        clients: Client ids of the cohort.
        sizes: Number of training samples of each cohort client.
        losses: F_i(w_t): each client's mean training loss of the current global model.
        round: The round, 1-based.
    """

    clients: np.ndarray
    sizes: np.ndarray
    losses: np.ndarray
    round: int


class Aggregator:
    """Base of the ``aggregator`` group.

    Args:
        weighting: How p_i, the FedAvg weight, is set: ``samples`` (proportional to the client's sample
            count) or ``uniform``; renormalised over the cohort.
        server_lr: The server learning rate of the step above.
    """

    def __init__(self, weighting: str = "samples", server_lr: float = 1.0):
        check(weighting in ("samples", "uniform"), "weighting", weighting, "samples or uniform")
        check(server_lr > 0, "server_lr", server_lr, "a number > 0")
        self.weighting, self.server_lr = weighting, server_lr

    def base_weights(self, report: CohortReport) -> np.ndarray:
        """p_i over the cohort, summing to 1."""
        p = report.sizes.astype(np.float64) if self.weighting == "samples" else np.ones(len(report.sizes))
        return p / p.sum()

    def weights(self, report: CohortReport) -> np.ndarray:
        """alpha_i over the cohort, summing to 1."""
        raise NotImplementedError

    def aggregate(
        self, global_params: torch.Tensor, deltas: torch.Tensor, report: CohortReport
    ) -> tuple[torch.Tensor, np.ndarray]:
        """One server step.

        Args:
            global_params: Flat global model w.
            deltas: Cohort updates Delta_i, one row per client, in cohort order.
            report: The cohort's sizes and losses.

        Returns:
            The new flat global model and alpha over the cohort (a diagnostic for tracking).
        """
        alpha = self.weights(report)
        step = torch.as_tensor(alpha, dtype=deltas.dtype, device=deltas.device) @ deltas
        return global_params + self.server_lr * step, alpha
