"""The aggregation interface: weights alpha over the cohort, giving the update Delta = sum_i alpha_i Delta_i.

With Delta_i = w_i - w (local model minus the global model it started from) and alpha summing to 1 over
the cohort, the server optimizer (the ``server`` group) then steps, e.g. w <- w + server_lr * Delta.
Aggregators differ in how they choose alpha; ``weights`` is the only method most of them write.

``aggregate`` returns an ``Aggregation``: the update, alpha and the round's diagnostics, all three as return values
(an aggregator keeps no per-round results on itself; its attributes are its state, ``fedrun.state``).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import numpy as np

from fedrun.cohort import RoundView
from fedrun.errors import check
from fedrun.lazy import torch
from fedrun.state import Stateful


class Aggregation(NamedTuple):
    """What one aggregation gives the engine."""

    update: torch.Tensor  # Delta = sum_i alpha_i Delta_i (or the aggregator's own form), for the server optimizer
    alpha: np.ndarray  # the weight of each client of the cohort (or buffer), logged
    diagnostics: dict[str, float]  # numbers to log for this round


class Aggregator(Stateful):
    """Base of the ``aggregator`` group.

    ``aggregate`` returns the round's diagnostics with the weights: at least ``alpha_distance``, the L1 distance
    between alpha and p, and what ``diagnose`` adds; ``run_tags`` gives run-level facts (logged as tags at the end).

    Args:
        weighting: How p_i, the FedAvg weight, is set: ``samples`` (proportional to the client's sample
            count) or ``uniform``; renormalised over the cohort.
    """

    STATE = ()  # most aggregators carry nothing between rounds (MVR its momentum, a hybrid its phase)

    # Capabilities (fedrun.compat): a synchronous aggregator whose alpha is p_i, reading one update per client.
    asynchronous = False
    follows_sampler = False
    weights_follow_clients = False
    reads_second_update = False
    measures_losses = False  # alpha reads a loss measured on the clients' data, not the one they report

    # Whether alpha depends on what the clients measured (their losses), so that its per-client series say more than
    # p_i: only then does a run log them to MLflow (alpha.csv and the heatmap always have alpha).
    alpha_informative = False

    # Whether alpha is a convex combination (non-negative, summing to 1), so that a part of it is a share of the
    # round's weight (``attack/weight_share``, ``fedrun.rounds.attack_columns``); False where alpha are coefficients of
    # another form (FLTrust's rescaled trust, NormBound's clipped p_i, centered clipping's, FedNova's p beside a work
    # scaling).
    alpha_is_share = True

    def __init__(self, weighting: str = "samples"):
        check(weighting in ("samples", "uniform"), "weighting", weighting, "samples or uniform")
        self.weighting = weighting

    def base_weights(self, report: RoundView) -> np.ndarray:
        """p_i over the cohort, summing to 1."""
        p = report.sizes.astype(np.float64) if self.weighting == "samples" else np.ones(len(report.sizes))
        return p / p.sum()

    def weights(self, report: RoundView) -> np.ndarray:
        """alpha_i over the cohort, summing to 1."""
        raise NotImplementedError

    def diagnose(self, report: RoundView, alpha: np.ndarray) -> dict[str, float]:
        """Numbers to log for the round beyond ``alpha_distance`` (called after ``weights`` with its alpha)."""
        return {}

    def run_tags(self) -> dict[str, str]:
        """Run-level facts, logged as tags when the run closes (e.g. the round a hybrid switched)."""
        return {}

    def reference(self, keep: np.ndarray) -> Aggregator:
        """A copy of this aggregator in its state now, to aggregate the round's clients ``keep`` selects (a bool
        mask over the cohort) alone: ``attack/deviation``'s honest reference (``fedrun.rounds.HonestReference``).
        Its state is its own, so aggregating with it leaves this one's untouched."""
        return copy.deepcopy(self)

    def aggregate(self, global_params: torch.Tensor, deltas: torch.Tensor, report: RoundView) -> Aggregation:
        """Combine the cohort's updates.

        Args:
            global_params: Flat global model w.
            deltas: Cohort updates Delta_i, one row per client, in cohort order.
            report: What the server knows about the cohort.

        Returns:
            The update Delta = sum_i alpha_i Delta_i for the server optimizer, alpha over the cohort and the
            round's diagnostics (``empty`` for a cohort of no client).
        """
        if not len(deltas):
            return self.empty(global_params)
        return self.combine(self.weights(report), deltas, report)

    def empty(self, global_params: torch.Tensor) -> Aggregation:
        """The aggregation of a round that drew nobody (Poisson sampling can): a zero update, on which the server
        steps as Opacus steps on an empty Poisson batch (a server optimizer with momentum still moves; plain SGD
        does not), no alpha and no diagnostics. The aggregator's state does not change."""
        return Aggregation(torch.zeros_like(global_params), np.zeros(0), {})

    def combine(self, alpha: np.ndarray, deltas: torch.Tensor, report: RoundView) -> Aggregation:
        """The update sum_i alpha_i Delta_i for these ``alpha`` (this aggregator's, or a sampler's unbiased
        weights), with the round's diagnostics."""
        diagnostics = {"alpha_distance": float(np.abs(alpha - self.base_weights(report)).sum())}
        diagnostics.update(self.diagnose(report, alpha))
        return Aggregation(
            torch.as_tensor(alpha, dtype=deltas.dtype, device=deltas.device) @ deltas, alpha, diagnostics
        )
