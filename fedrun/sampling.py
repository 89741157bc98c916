"""Client selection: who trains each round of the synchronous engine (the ``sampler`` config group).

A sampler draws a round's cohort from the run's ``sampling`` stream (one numpy generator, checkpointed with the
run), so the same seed gives the same cohorts across a kill and resume, and on every backend for ``uniform`` and
``importance`` by ``size``. Power-of-Choice and ``update_norm`` choose from measured losses and norms, which
backends give equal up to floating-point noise: a near-tie may then go the other way. Its own state (each
client's total selections; the importance sampler's last-known update norms) is explicit and checkpointed.

- ``uniform`` (the default): the schedule's sampling, unchanged: ``fixed`` draws round(C N) clients without
  replacement (McMahan et al. 2017), ``poisson`` lets each client join with probability C on its own.
- ``power_of_choice``: Cho, Wang and Joshi 2022 ("Towards understanding biased client selection in federated
  learning", AISTATS; arXiv 2010.01243, Algorithm 1, pow-d): draw a candidate set A of d clients without
  replacement with probability proportional to p_k (the client's share of the data), send them the global model,
  each computes its loss F_k(w_t) over its local data, and the m = round(C N) candidates with the largest losses
  train (ties go to the smaller client id). The candidates' loss pass is timed (``selection_wall_s``) and counted
  in the round's communication: one model down to each candidate not kept, one float32 up from every candidate.
  The paper averages the m updates with equal weights (p_k already drew them); ``aggregator.weighting=uniform``
  does that, while FedAvg's default ``samples`` weighs them by size again (as Flower's PowerOfChoice does). The two
  coincide when clients hold equal amounts of data. With d = m the candidates are the cohort and no loss is
  measured: the cohort is drawn in proportion to the clients' data, which is the uniform sampler's draw (the same
  generator call) when sizes are equal or ``candidates_by=uniform``.
  The cohort is the candidates with the largest losses, so cohort averages (``train_loss``, ``client_accuracy``)
  are higher-loss averages than under uniform selection: compare runs on the test set.
- ``importance``: m clients drawn with replacement from probabilities p_k that follow a signal, with the
  inverse-probability correction that makes FedAvg's update unbiased (Horvitz and Thompson 1952; for client
  sampling, Chen, Horvath and Richtarik 2022, "Optimal client sampling for federated learning", TMLR, whose optimal
  probabilities are proportional to ||q_k Delta_k||). Each draw of client k contributes q_k / (m p_k) Delta_k, where
  q_k is FedAvg's weight of k over the whole population (n_k / n, or 1 / N with ``aggregator.weighting=uniform``:
  the issue's 1 / (N p_k)); a client drawn twice trains once and counts twice. Then
  E[sum of alpha_k Delta_k] = sum_k q_k Delta_k, full participation's update, for any p > 0. The alpha do not sum to
  1 in a round, only in expectation. Clients that drop out after the draw would bias it: ``heterogeneity`` with
  ``mode: drop`` is refused. Partial stragglers keep it unbiased: ``Stragglers`` picks the straggling share of
  the m draws, not of the distinct clients, so whether a client straggles does not depend on how often it (or
  anyone) was drawn. With top-k's error feedback the residual a client keeps is re-sent under the next
  round's weight, so the estimate is unbiased for each round's compressed updates, not for the residuals. Server
  optimizers step on an unbiased update; an adaptive one (Adam) is not linear in it. ``signal``:
  - ``update_norm``: p_k proportional to q_k ||Delta_k|| with each client's last-known update norm (what the
    server received from it the last time it trained; clients not yet seen get the mean of those seen, and all
    clients 1 before any was). Chen et al. use this round's norms, which needs every client to train each round
    (their method saves communication, not computation); the last-known norm is what a server has without that.
  - ``size``: p_k = q_k, so every draw counts 1 / m (Li et al. 2020, "On the convergence of FedAvg on non-IID
    data", sampling scheme I; Cho et al.'s unbiased baseline).
  ``uniform_mix`` lambda mixes in the uniform distribution, p = (1 - lambda) p_signal + lambda / N (defensive
  importance sampling, Hesterberg 1995): every p_k >= lambda / N, so no weight exceeds q_k N / (m lambda).

Every sampler reports, per round, who was picked (``selected``: each client's number of draws, a per-client series
beside ``alpha``) and the spread of the distribution it drew from (``selection_p_min``, ``selection_p_max`` and
``selection_p_cv``, the coefficient of variation, all over the population; for Power-of-Choice the candidates'
distribution), and per run how evenly the clients were picked (``selection_cv`` of each client's total selections
and ``clients_never_selected``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedrun.cohort import ClientLosses
from fedrun.errors import ConfigError, check
from fedrun.lazy import torch
from fedrun.rounds import Schedule
from fedrun.state import Context, Stateful

LOSS_BYTES = 4  # a candidate's loss, sent up as one float32


@dataclass
class Selection:
    """One round's draw.

    Attributes:
        cohort: The clients that train, sorted, each once.
        counts: How many times each cohort client was drawn (1 unless drawn with replacement).
        weights: The unbiased estimator's alpha of each cohort client (``importance``), or None: the aggregator's.
        probed: Candidates whose loss at the global model was measured (``power_of_choice``).
        candidates: Those candidates' ids, sorted (None when none was measured).
        losses: The cohort's F_k(w_t) when the draw measured them (the loss-weighted aggregators read them), or None.
        spread: ``selection_p_min``, ``selection_p_max``, ``selection_p_cv`` of the distribution drawn from.
    """

    cohort: np.ndarray
    counts: np.ndarray
    weights: np.ndarray | None = None
    probed: int = 0
    losses: ClientLosses | None = None
    spread: dict | None = None
    candidates: np.ndarray | None = None

    def keep(self, mask: np.ndarray) -> Selection:
        """The selection restricted to the cohort clients ``mask`` keeps (stragglers drop out after the draw)."""
        return Selection(
            self.cohort[mask],
            self.counts[mask],
            None if self.weights is None else self.weights[mask],
            self.probed,
            None if self.losses is None else ClientLosses(self.losses.mean[mask], self.losses.authors[mask]),
            self.spread,
            self.candidates,
        )


def spread(p: np.ndarray) -> dict:
    """The min, max and coefficient of variation (std / mean) of a distribution over the population."""
    return {
        "selection_p_min": float(p.min()),
        "selection_p_max": float(p.max()),
        "selection_p_cv": float(p.std() / p.mean()),
    }


def uniform_spread(num_clients: int) -> dict:
    """``spread`` of the uniform distribution, without building it (a population may be large)."""
    return {"selection_p_min": 1 / num_clients, "selection_p_max": 1 / num_clients, "selection_p_cv": 0.0}


class Sampler(Stateful):
    """Base of the ``sampler`` group: ``bind`` to the run, then ``draw`` each round and ``observe`` what was sent.

    State: ``selected``, each client's total number of draws so far (the run's summary reads it).
    """

    name = "uniform"
    STATE = ("selected",)  # the schedule, sizes and weighting are the run's, given again by ``bind``
    # Capabilities (fedrun.compat): the schedule's draw, every client alike, with no weights of its own.
    gives_weights = False
    draws_uniformly = True
    alpha_informative = False  # whether the weights it gives (``Selection``) follow what the clients sent

    def __init__(self):
        self.selected = np.zeros(0, dtype=np.int64)
        self.schedule: Schedule | None = None
        self.sizes = np.zeros(0)
        self.weighting = "samples"

    def bind(self, context: Context) -> None:
        """Attach the run's schedule, the clients' sample counts and the aggregator's weighting (``samples`` or
        ``uniform``: what q_k is); checks the settings that depend on them (ConfigError)."""
        schedule, sizes = context.schedule, np.asarray(context.sizes)
        self.schedule, self.sizes, self.weighting = schedule, sizes, context.weighting
        self.selected = np.zeros(len(sizes), dtype=np.int64)
        if schedule.cohort is not None and schedule.cohort > len(sizes):
            raise ConfigError("schedule.cohort", schedule.cohort, f"at most the {len(sizes)} clients")

    @property
    def draws_available(self) -> bool:
        """Capability (fedrun.compat): whether it can draw among the clients online only: it draws as the schedule
        does (no ``_draw`` of its own), or has a ``_draw_available`` of its own. A sampler of one's own with its own
        ``_draw`` is not handed availability it would ignore."""
        return type(self)._draw is Sampler._draw or type(self)._draw_available is not Sampler._draw_available

    @property
    def cohort_size(self) -> int:
        return self.schedule.cohort_size(len(self.sizes))

    def draw(
        self, rng: np.random.Generator, probe: Callable[[np.ndarray], ClientLosses], available: np.ndarray | None = None
    ) -> Selection:
        """The round's selection; ``probe(ids)`` measures those clients' losses at the round's global model.
        ``available``: the clients online now (``fedrun.devices``; None: all), for a sampler that ``draws_available``."""
        selection = self._draw(rng, probe) if available is None else self._draw_available(rng, probe, available)
        np.add.at(self.selected, selection.cohort, selection.counts)
        return selection

    def _draw(self, rng: np.random.Generator, probe) -> Selection:
        cohort = self.schedule.draw(rng, len(self.sizes))
        return Selection(cohort, np.ones(len(cohort), dtype=np.int64), spread=uniform_spread(len(self.sizes)))

    def _draw_available(self, rng: np.random.Generator, probe, available: np.ndarray) -> Selection:
        """The schedule's draw among the clients online (``draws_available``; a sampler with its own draw has none:
        ``fedrun.compat`` refuses devices with availability for it)."""
        cohort = self.schedule.draw(rng, len(self.sizes), available)
        return Selection(cohort, np.ones(len(cohort), dtype=np.int64), spread=uniform_spread(len(self.sizes)))

    def observe(self, cohort: np.ndarray, sent: torch.Tensor) -> None:
        """What the cohort sent this round (after the pipeline), for samplers that learn from it."""

    def summary(self) -> dict:
        """How evenly the run picked its clients: ``selection_cv`` of the total selections, and the clients never
        selected."""
        counts = self.selected.astype(np.float64)
        mean = counts.mean() if len(counts) else 0.0
        return {
            "selection_cv": float(counts.std() / mean) if mean > 0 else float("nan"),
            "clients_never_selected": int((counts == 0).sum()),
        }


class Uniform(Sampler):
    """The ``uniform`` option: the schedule's ``sampling`` (fixed or poisson), as before samplers existed."""


class PowerOfChoice(Sampler):
    """The ``power_of_choice`` option (Cho et al. 2022, pow-d; see the module docstring).

    Args:
        candidates: d, the candidate set's size, m <= d <= N; null: 2 m (capped at N).
        candidates_by: ``samples`` (probability proportional to p_k, the paper's) or ``uniform``.
    """

    name = "power_of_choice"
    draws_uniformly = False  # the candidates with the largest losses

    def __init__(self, candidates: int | None = None, candidates_by: str = "samples"):
        super().__init__()
        check(
            candidates is None
            or (isinstance(candidates, int) and not isinstance(candidates, bool) and candidates >= 1),
            "candidates",
            candidates,
            "null (2 m) or an integer d >= 1",
        )
        check(candidates_by in ("samples", "uniform"), "candidates_by", candidates_by, "samples or uniform")
        self.candidates, self.candidates_by = candidates, candidates_by

    def bind(self, context: Context) -> None:
        super().bind(context)
        schedule, sizes = context.schedule, context.sizes
        if schedule.sampling != "fixed":
            raise ConfigError("schedule.sampling", schedule.sampling, "fixed with sampler=power_of_choice")
        m, n = self.cohort_size, len(sizes)
        if self.candidates is not None and not m <= self.candidates <= n:
            raise ConfigError(
                "sampler.candidates", self.candidates, f"an integer from m = {m} (clients a round) to N = {n}"
            )

    @property
    def d(self) -> int:
        return self.candidates if self.candidates is not None else min(2 * self.cohort_size, len(self.sizes))

    def probabilities(self) -> np.ndarray | None:
        """The candidates' draw probabilities, or None when they are uniform (equal sizes draw as uniform does)."""
        if self.candidates_by == "uniform" or np.all(self.sizes == self.sizes[0]):
            return None
        return self.sizes / self.sizes.sum()

    def _draw(self, rng: np.random.Generator, probe) -> Selection:
        n, m, d = len(self.sizes), self.cohort_size, self.d
        p = self.probabilities()
        candidates = np.sort(rng.choice(n, size=d, replace=False, p=p))
        shape = uniform_spread(n) if p is None else spread(p)
        if d == m:  # the candidates are the cohort: nothing to choose, nothing to measure
            return Selection(candidates, np.ones(m, dtype=np.int64), spread=shape)
        losses = probe(candidates)
        # Largest loss first; among equal losses the smaller id (candidates are sorted, and lexsort is stable).
        kept = np.sort(np.lexsort((candidates, -losses.mean))[:m])
        return Selection(
            candidates[kept],
            np.ones(m, dtype=np.int64),
            probed=d,
            losses=ClientLosses(losses.mean[kept], losses.authors[kept]),
            spread=shape,
            candidates=candidates,
        )


class Importance(Sampler):
    """The ``importance`` option: unbiased importance sampling of clients (see the module docstring).

    Args:
        signal: ``update_norm`` (p proportional to q_k times the last-known update norm) or ``size`` (p = q).
        uniform_mix: lambda in [0, 1], the share of the uniform distribution mixed in.
    """

    name = "importance"
    gives_weights = True  # q_k / (m p_k), FedAvg's alpha
    draws_uniformly = False
    STATE = ("selected", "norms")

    def __init__(self, signal: str = "update_norm", uniform_mix: float = 0.1):
        super().__init__()
        check(signal in ("update_norm", "size"), "signal", signal, "update_norm or size")
        check(
            isinstance(uniform_mix, (int, float)) and not isinstance(uniform_mix, bool) and 0 <= uniform_mix <= 1,
            "uniform_mix",
            uniform_mix,
            "a fraction in [0, 1]",
        )
        check(
            signal != "update_norm" or uniform_mix > 0,
            "uniform_mix",
            uniform_mix,
            "> 0 with signal=update_norm (a client whose last update was zero would never be drawn again, and the "
            "estimate would lose its unbiasedness)",
        )
        self.signal, self.uniform_mix = signal, float(uniform_mix)
        self.alpha_informative = signal == "update_norm"  # q_k / (m p_k) with p following the update norms
        self.norms = np.zeros(0)

    def bind(self, context: Context) -> None:
        super().bind(context)
        schedule, sizes = context.schedule, context.sizes
        if schedule.sampling != "fixed":
            raise ConfigError("schedule.sampling", schedule.sampling, "fixed with sampler=importance")
        self.norms = np.full(len(sizes), np.nan)  # the last norm each client sent; NaN: never trained

    def population_weights(self) -> np.ndarray:
        """q_k: FedAvg's weight of each client over the whole population."""
        q = self.sizes.astype(np.float64) if self.weighting == "samples" else np.ones(len(self.sizes))
        return q / q.sum()

    def probabilities(self) -> np.ndarray:
        """p_k, the distribution each of the m draws comes from."""
        q = self.population_weights()
        if self.signal == "size":
            score = q
        else:
            seen = ~np.isnan(self.norms)
            fill = self.norms[seen].mean() if seen.any() else 1.0
            score = q * np.where(seen, self.norms, fill)
            if score.sum() <= 0:  # every known update was zero: nothing to prefer
                score = q
        n = len(q)
        return (1 - self.uniform_mix) * score / score.sum() + self.uniform_mix / n

    def _draw(self, rng: np.random.Generator, probe) -> Selection:
        m = self.cohort_size
        p = self.probabilities()
        cohort, counts = np.unique(rng.choice(len(p), size=m, replace=True, p=p), return_counts=True)
        weights = counts * self.population_weights()[cohort] / (m * p[cohort])
        return Selection(cohort, counts, weights=weights, spread=spread(p))

    def observe(self, cohort: np.ndarray, sent: torch.Tensor) -> None:
        if len(cohort):
            self.norms[cohort] = torch.linalg.vector_norm(sent.double(), dim=1).cpu().numpy()
