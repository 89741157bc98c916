"""Fair aggregation: the objectives that weigh clients by their loss to even out their accuracies, beside the
loss-weighted family of papers 000 and 001.

- ``QFFL``: q-FedAvg (Li, Sanjabi, Beirami and Smith 2020, "Fair Resource Allocation in Federated Learning", ICLR,
  Algorithm 2), which minimises sum_k p_k F_k^(q+1) / (q + 1).
- ``AFL``: agnostic FL (Mohri, Sivek and Suresh 2019), the worst mixture of the clients' losses.
- ``TERM``: tilted ERM across clients (Li, Beirami, Sanjabi and Smith 2021), FedSoftMax's form at T = 1/t.
"""

from __future__ import annotations

import math

import numpy as np

from fedrun.aggregators.base import Aggregation, Aggregator
from fedrun.aggregators.loss_weighted import LossWeighted, exponential_weights
from fedrun.clients import TiltedRisk
from fedrun.cohort import RoundView
from fedrun.errors import check
from fedrun.lazy import torch
from fedrun.pipeline import number

EPSILON = 1e-10  # added to every loss before its power, as the authors' code (fair_flearn, qffedavg.py) does


class QFFL(Aggregator):
    """q-FedAvg (Li et al. 2020, Algorithm 2). Each selected client k reports F_k(w^t), its loss at the round's model
    before training (``report.losses``: what clients report, so a loss lie applies, as to FedSoftMax), and its local
    solution w_bar_k; with Delta w_k = L (w^t - w_bar_k) (line 7),

        Delta_k = F_k^q Delta w_k,   h_k = q F_k^(q-1) ||Delta w_k||^2 + L F_k^q   (lines 8-9),
        w^(t+1) = w^t - sum_k Delta_k / sum_k h_k                                      (line 11).

    In fedrun's convention (Delta_i = w_bar_i - w^t, the server steps w + Delta) that is the update sum_k alpha_k
    Delta_k with alpha_k = F_k^q / sum_j (q F_j^(q-1) L ||Delta_j||^2 + F_j^q): alpha does not sum to 1 (it is a
    step size as much as a weighting; ``attack/weight_share`` is NaN), and the server's SGD at lr 1 takes the
    paper's step. L, the Lipschitz estimate, is 1/lr of the round's local learning rate, as the paper sets it (its
    Section 4.2 and the authors' code); ``lipschitz`` fixes it instead. The losses get 1e-10 before their power, as
    in the authors' code (a zero loss with q < 1 would divide by zero); a reported loss below 0, which only a liar
    sends, counts as 0. With q = 0, alpha_k = 1/|S_t|: FedAvg with
    uniform weights, exactly (a test); the paper's p_k are the sampling's (it samples clients by p_k and averages
    uniformly).

    Args:
        q: q >= 0, the fairness parameter (0: FedAvg; the paper tunes q in {0.001, ..., 15} per dataset).
        lipschitz: L > 0, or null: 1 / the round's local learning rate.
    """

    weights_follow_clients = True  # alpha follows the clients' losses (privacy refuses it)
    alpha_informative = True
    alpha_is_share = False

    def __init__(self, q: float = 1.0, lipschitz: float | None = None):
        super().__init__("uniform")
        check(number(q) and q >= 0, "q", q, "a number >= 0")
        check(
            lipschitz is None or (isinstance(lipschitz, (int, float)) and lipschitz > 0),
            "lipschitz",
            lipschitz,
            "null (1 / the local learning rate) or a number > 0",
        )
        self.q, self.lipschitz = float(q), lipschitz

    def aggregate(self, global_params: torch.Tensor, deltas: torch.Tensor, report: RoundView) -> Aggregation:
        if not len(deltas):
            return self.empty(global_params)
        return self.combine(self.alpha(deltas, report), deltas, report)

    def alpha(self, deltas: torch.Tensor, report: RoundView) -> np.ndarray:
        """alpha_k = F_k^q / sum_j (q F_j^(q-1) L ||Delta_j||^2 + F_j^q) over the cohort."""
        # A loss is >= 0; a reported one below (only a liar's: attack=loss_lie with a negative offset) counts as 0,
        # where F^q is defined for every q (a negative loss made alpha NaN at q = 0.5 and negative at q = 1).
        losses = np.maximum(np.asarray(report.losses.mean, dtype=np.float64), 0.0) + EPSILON
        lipschitz = self.lipschitz if self.lipschitz is not None else 1.0 / report.lr
        squared = (deltas.double() ** 2).sum(1).cpu().numpy()
        powered = np.float_power(losses, self.q)
        h = self.q * np.float_power(losses, self.q - 1) * lipschitz * squared + powered  # h_k / L
        return powered / h.sum()

    def diagnose(self, report: RoundView, alpha: np.ndarray) -> dict[str, float]:
        return {"step_sum": float(alpha.sum())}  # sum_k alpha_k: 1 at q = 0, below it as q or the updates grow


def project_simplex(v: np.ndarray) -> np.ndarray:
    """The Euclidean projection of ``v`` onto the probability simplex (Duchi, Shalev-Shwartz, Singer and Chandra
    2008, "Efficient Projections onto the l1-Ball", Figure 1): sort, find the largest rho with
    u_rho - (sum_{j<=rho} u_j - 1) / rho > 0, subtract theta = (sum_{j<=rho} u_j - 1) / rho and clip at 0."""
    u = np.sort(v)[::-1]
    cumulative = np.cumsum(u) - 1.0
    rho = np.nonzero(u - cumulative / np.arange(1, len(u) + 1) > 0)[0][-1]
    return np.maximum(v - cumulative[rho] / (rho + 1), 0.0)


class AFL(Aggregator):
    """Agnostic FL (Mohri, Sivek and Suresh 2019, "Agnostic Federated Learning", ICML; Stochastic-AFL, Algorithm 1):
    min over w, max over lambda in the simplex of sum_k lambda_k F_k(w), one client a domain. Each round the model
    steps along the cohort's updates weighted by lambda^t renormalised over the cohort (a convex combination; the
    unbiased (N/m) lambda_k form differs by a server step size), and lambda takes a projected ascent step on the
    cohort's reported losses, the unbiased estimate of its gradient under uniform sampling of m of the N clients:
    lambda <- Proj(lambda + lambda_lr (N/m) F_k 1[k in S]) (the projection onto the simplex of Duchi et al. 2008).
    lambda starts uniform; a loss lie moves it (the losses are what clients report). lambda is the run's state (N
    numbers, 8 MB for a million clients), checkpointed exactly.

    Args:
        lambda_lr: gamma_lambda >= 0, the ascent step (0: lambda stays uniform, FedAvg with uniform weights).
    """

    STATE = ("lam",)
    weights_follow_clients = True
    alpha_informative = True

    def __init__(self, lambda_lr: float = 0.01):
        super().__init__("uniform")
        check(
            number(lambda_lr) and lambda_lr >= 0,
            "lambda_lr",
            lambda_lr,
            "a number >= 0",
        )
        self.lambda_lr, self.lam, self.clients = float(lambda_lr), None, 0

    def bind(self, context) -> None:
        self.clients = len(context.sizes)
        if self.lam is None:
            self.lam = np.full(self.clients, 1.0 / self.clients)

    def weights(self, report: RoundView) -> np.ndarray:
        lam = self.lam[report.clients]
        scaled = lam / lam.max() if lam.max() > 0 else np.ones(len(lam))  # equal lambdas give 1/m exactly
        alpha = scaled / scaled.sum()
        if self.lambda_lr:  # (a zero step leaves lambda on the simplex, where the projection is the identity)
            gradient = np.zeros(self.clients)
            np.add.at(gradient, report.clients, np.asarray(report.losses.mean, dtype=np.float64))
            self.lam = project_simplex(self.lam + self.lambda_lr * self.clients / len(report.clients) * gradient)
        return alpha

    def diagnose(self, report: RoundView, alpha: np.ndarray) -> dict[str, float]:
        return {"lambda_max": float(self.lam.max())}  # 1/N while uniform; towards 1 as one client dominates


class TERM(LossWeighted):
    """Tilted ERM across clients (Li, Beirami, Sanjabi and Smith 2021, "Tilted Empirical Risk Minimization", ICLR;
    hierarchical TERM's objective across groups, one client a group): (1/t) log sum_k p_k exp(t F_k(w)), whose
    gradient weighs client k by alpha_k = p_k exp(t F_k) / sum_j p_j exp(t F_j), F_k its reported loss at the
    round's model. t > 0 leans towards the worst clients (t -> infinity: FedMax), t < 0 away from them (robustness
    to outlying clients), t = 0 is FedAvg exactly. This is FedSoftMax's form with T = 1/t (FedSoftBetter's with
    T = -1/t for t < 0) when FedSoftMax measures what TERM does: ``fstar=zero``, ``loss_on=global`` and
    ``loss_scale=mean`` (the defaults here); paper 000's rule may subtract an F_i* estimate, read the last local
    epoch's loss or the authors' loss scale, where the two part.

    Hierarchical TERM (the paper's tilt across groups of tilted groups, one client a group) tilts each client's
    tilted risk instead of its mean loss: with ``tau`` set, F_k is R~_k(tau) = (1/tau) log((1/n_k) sum_j exp(tau
    l_kj)) over client k's training samples at the round's model (``fedrun.clients.TiltedRisk``, measured on the
    client's data by the run's backend), and with the sample-level tilt inside each client's objective at the same
    tau (the client program ``client=tilted``, ``fedrun.programs.Tilted``) the round is hierarchical TERM's; the
    preset ``method=hierarchical_term`` sets both. That is the authors' ``hierarchical/mixed_level1.py`` (samples
    tilted within each group, groups weighed by their size times exp(t R~)); their ``mixed_level2.py`` tilts within
    a group over its classes' mean losses instead.

    Args:
        t: The tilt across clients, any real number.
        tau: null (F_k the client's reported mean loss) or the tilt within each client, any real number (0: the
            mean loss, as null). With ``loss_on=global``, ``loss_scale=mean`` and ``fstar=zero`` only (the tilted
            risk is measured at the round's model, in the loss's own scale); a loss lie (``attack=loss_lie``) does
            not reach it, so the two are refused together.
        fstar, fstar_epochs, loss_on, loss_scale, weighting, trim, max_weight: See ``LossWeighted``.
    """

    def __init__(self, t: float = 1.0, tau: float | None = None, **kwargs):
        super().__init__(**kwargs)
        check(number(t) and math.isfinite(t), "t", t, "a finite number")
        self.t = float(t)
        check(
            tau is None or (number(tau) and math.isfinite(tau)),
            "tau",
            tau,
            "null or a finite number",
        )
        self.tau = None if tau is None or tau == 0 else float(tau)
        if self.tau is not None:
            for key, value, plain in (("loss_on", self.loss_on, "global"), ("loss_scale", self.loss_scale, "mean")):
                check(value == plain, key, value, f"{plain} with tau={tau} (the tilted risk at the round's model)")
            check(self.fstar == "zero", "fstar", self.fstar, f"zero with tau={tau} (F* is a mean loss's)")
        self._signal = None if self.tau is None else TiltedRisk(self.tau)

    @property
    def measures_losses(self) -> bool:
        """Whether its F_k is measured on the clients' data (the tilted risk), not the loss they report."""
        return self.tau is not None

    def gaps(self, report: RoundView) -> np.ndarray:
        if self._signal is None:
            return super().gaps(report)
        if self.t == 0 and not self.trim:  # alpha is p whatever the risks: no pass over the cohort's data for them
            return np.zeros(len(report.clients))
        return report.per_client(self._signal)

    @property
    def sign(self) -> float:
        """The direction the tilt rewards: the worst-fitted for t >= 0 (``trim`` drops the largest losses, as
        FedSoftMax's), the best-fitted for t < 0 (it drops the smallest, as FedSoftBetter's: what a liar reports)."""
        return -1.0 if self.t < 0 else 1.0

    def weigh(self, score, p, round_):
        if self.t == 0:  # exp(0) = 1: p itself (computed through the logits it would differ in the last bits)
            return p
        return exponential_weights(p, abs(self.t) * score)  # score = sign * F: t F, the same bits either sign

    def diagnose(self, report, alpha):
        return {**super().diagnose(report, alpha), "tilt": self.t}
