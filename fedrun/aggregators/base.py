"""The aggregation interface: weights alpha over the cohort, giving the update Delta = sum_i alpha_i Delta_i.

With Delta_i = w_i - w (local model minus the global model it started from) and alpha summing to 1 over
the cohort, the server optimizer (the ``server`` group) then steps, e.g. w <- w + server_lr * Delta.
Aggregators differ in how they choose alpha; ``weights`` is the only method most of them write.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedrun.clients import ClientLosses
from fedrun.errors import check


@dataclass
class CohortReport:
    """What the server knows about the cohort of one round.

    Attributes:
        clients: Client ids of the cohort.
        sizes: Number of training samples of each cohort client.
        losses: F_i(w_t): each client's training loss of the current global model.
        round: The round, 1-based.
        local_losses: Each client's running training loss over its last local epoch.
        accuracy: The latest evaluated accuracy before this round (validation when the run has a
            validation split, else test); NaN before the first evaluation.
        accuracy_source: ``val_accuracy`` or ``test_accuracy``: which one ``accuracy`` is.
        fstar: ``fstar(client_ids, epochs)`` estimates F_i* (cached), or None.
        steps: Local steps each client took.
        coefficient_norms: FedNova's ||a_i||_1 of each client's local solver.
        previous_deltas: For aggregators that ask (``needs_previous_model``): the updates each client
            would have made from the previous global model on the same mini-batches; None in round 1.
    """

    clients: np.ndarray
    sizes: np.ndarray
    losses: ClientLosses
    round: int
    local_losses: ClientLosses | None = None
    accuracy: float = math.nan
    accuracy_source: str = "test_accuracy"
    fstar: Callable[[np.ndarray, int], ClientLosses] | None = None
    steps: np.ndarray | None = None
    coefficient_norms: np.ndarray | None = None
    previous_deltas: torch.Tensor | None = None


class Aggregator:
    """Base of the ``aggregator`` group.

    After each ``aggregate`` call, ``diagnostics`` holds numbers to log for the round (at least
    ``alpha_distance``, the L1 distance between alpha and p); ``tags`` holds run-level facts.

    Args:
        weighting: How p_i, the FedAvg weight, is set: ``samples`` (proportional to the client's sample
            count) or ``uniform``; renormalised over the cohort.
    """

    needs_previous_model = False  # True: clients also train from the previous global model (previous_deltas)

    def __init__(self, weighting: str = "samples"):
        check(weighting in ("samples", "uniform"), "weighting", weighting, "samples or uniform")
        self.weighting = weighting
        self.diagnostics: dict[str, float] = {}
        self.tags: dict[str, str] = {}

    def base_weights(self, report: CohortReport) -> np.ndarray:
        """p_i over the cohort, summing to 1."""
        p = report.sizes.astype(np.float64) if self.weighting == "samples" else np.ones(len(report.sizes))
        return p / p.sum()

    def weights(self, report: CohortReport) -> np.ndarray:
        """alpha_i over the cohort, summing to 1. May add entries to ``self.diagnostics``."""
        raise NotImplementedError

    def aggregate(
        self, global_params: torch.Tensor, deltas: torch.Tensor, report: CohortReport
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
