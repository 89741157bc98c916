"""The aggregation interface: weights alpha over the cohort, giving the update Delta = sum_i alpha_i Delta_i.

With Delta_i = w_i - w (local model minus the global model it started from) and alpha summing to 1 over
the cohort, the server optimizer (the ``server`` group) then steps, e.g. w <- w + server_lr * Delta.
Aggregators differ in how they choose alpha; ``weights`` is the only method most of them write.
"""

import numpy as np
import torch

from fedrun.cohort import RoundView
from fedrun.errors import check
from fedrun.state import Stateful


class Aggregator(Stateful):
    """Base of the ``aggregator`` group.

    After each ``aggregate`` call, ``diagnostics`` holds numbers to log for the round (at least
    ``alpha_distance``, the L1 distance between alpha and p); ``tags`` holds run-level facts.

    Args:
        weighting: How p_i, the FedAvg weight, is set: ``samples`` (proportional to the client's sample
            count) or ``uniform``; renormalised over the cohort.
    """

    def __init__(self, weighting: str = "samples"):
        check(weighting in ("samples", "uniform"), "weighting", weighting, "samples or uniform")
        self.weighting = weighting
        self.diagnostics: dict[str, float] = {}
        self.tags: dict[str, str] = {}

    def base_weights(self, report: RoundView) -> np.ndarray:
        """p_i over the cohort, summing to 1."""
        p = report.sizes.astype(np.float64) if self.weighting == "samples" else np.ones(len(report.sizes))
        return p / p.sum()

    def weights(self, report: RoundView) -> np.ndarray:
        """alpha_i over the cohort, summing to 1. May add entries to ``self.diagnostics``."""
        raise NotImplementedError

    def aggregate(
        self, global_params: torch.Tensor, deltas: torch.Tensor, report: RoundView
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Combine the cohort's updates.

        Args:
            global_params: Flat global model w.
            deltas: Cohort updates Delta_i, one row per client, in cohort order.
            report: What the server knows about the cohort.

        Returns:
            The update Delta = sum_i alpha_i Delta_i for the server optimizer, and alpha over the cohort
            (a diagnostic for tracking).
        """
        self.diagnostics = {}
        alpha = self.weights(report)
        self.diagnostics["alpha_distance"] = float(np.abs(alpha - self.base_weights(report)).sum())
        return torch.as_tensor(alpha, dtype=deltas.dtype, device=deltas.device) @ deltas, alpha
