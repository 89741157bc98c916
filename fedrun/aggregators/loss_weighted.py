"""The loss-weighted family (papers 000 and 001): weights from how badly the global model fits each client.

L_i = F_i(w_t) - F_i* for each cohort client. The "worse" aggregators (FedMax, FedMax(k), FedSoftMax)
favour large L_i; their "better" mirrors (FedBetter, FedBetter(k), FedSoftBetter) favour small L_i.

Every rule trusts the L_i its clients report, so one client that lies about its loss takes the weight: FedMax
gives it all of it, FedSoftMax (p uniform) 90% once it reports T ln(9 (n - 1)) above the others
(tests/unit/aggregators/test_aggregators.py derives it). Two defences act on every rule of the family (issue 36):

- ``trim`` f: the f clients with the most extreme reported L_i in the direction the rule favours (the largest
  for the "worse" rules, the smallest for the "better" ones, where a liar reports a tiny loss) are dropped
  before the rule weighs the rest. FedMax with ``trim`` f is the Ditto code's ``k_loss`` defence.
- ``max_weight`` c: no client's alpha exceeds c; the excess goes to the others in proportion to their alpha.
"""

import math

import numpy as np

from fedrun.aggregators.base import Aggregator
from fedrun.cohort import RoundView
from fedrun.errors import ConfigError, check
from fedrun.state import Context


class FedAvg(Aggregator):
    """FedAvg (McMahan et al. 2017): alpha_i = p_i, or the sampler's unbiased weights when it gives some (importance
    sampling's q_k / (m p_k), ``RoundView.sampled_weights``)."""

    follows_sampler = True

    def weights(self, report: RoundView) -> np.ndarray:
        return report.sampled_weights if report.sampled_weights is not None else self.base_weights(report)


class LossWeighted(Aggregator):
    """Base of the loss-weighted family: computes L_i; subclasses turn it into alpha in ``weigh``.

    Args:
        fstar: ``zero`` (F_i* = 0) or ``estimate`` (each client's smallest loss within ``fstar_epochs``
            of local training from the initial model, computed once per client and cached).
        fstar_epochs: Local epochs of the F_i* estimate.
        loss_on: ``global``: F_i of the global model before local training (the theory's F_i(w_t));
            ``local``: the client's running training loss over its last local epoch (the authors' code).
        loss_scale: ``mean`` (mean loss per sample) or ``authors`` (sum of per-batch mean losses divided
            by the sample count, as in the authors' code; see docs/explanation/aggregators.md for the temperature mapping).
        weighting: See ``Aggregator``.
        trim: f >= 0, the clients dropped before the weighing: the f with the largest signed score ``sign * L_i``
            (the largest L_i for FedMax, FedMax(k), FedSoftMax; the smallest for their "better" mirrors, the
            direction each rule rewards and so the one a liar reports). The rest are weighed as if they were the
            cohort (p_i renormalised over them, FedMax(k)'s fractional k taken of them); the dropped get alpha 0.
            Ties at the f-th place drop the lower cohort position. A round of n <= f clients (Poisson sampling;
            fixed cohorts are refused at ``bind``) drops n - 1 and keeps the least extreme one, so alpha still
            sums to 1. The Ditto code's ``k_loss`` (Li et al. 2021, ``flearn/trainers_global/fedbase.py``
            ``k_loss_average``) is FedMax with ``trim``: it sorts the losses measured at the global model and
            keeps the update at place ``num_benign - 1``, the largest loss once the f largest are gone.
        max_weight: null (no cap) or c in (0, 1]: each alpha_i is capped at c and the excess spread over the
            uncapped clients in proportion to their alpha, repeated until none exceeds c (water-filling). Where
            those clients hold no weight (FedMax, FedMax(k), a softmax that underflowed) it is spread in
            proportion to their p_i. Applied after ``trim``, over the kept clients. A cap below 1 / (clients
            kept) cannot hold: a fixed cohort is refused at ``bind``; a Poisson round that small is made uniform
            over its kept clients (the cap max(c, 1 / kept), the smallest that can hold).
    """

    sign = 1.0  # +1 favours the worst-fitted clients, -1 the best-fitted
    alpha_informative = True
    weights_follow_clients = True

    def __init__(
        self,
        fstar: str = "zero",
        fstar_epochs: int = 5,
        loss_on: str = "global",
        loss_scale: str = "mean",
        weighting: str = "samples",
        trim: int = 0,
        max_weight: float | None = None,
    ):
        super().__init__(weighting)
        check(fstar in ("zero", "estimate"), "fstar", fstar, "zero or estimate")
        check(isinstance(fstar_epochs, int) and fstar_epochs >= 1, "fstar_epochs", fstar_epochs, "an integer >= 1")
        check(loss_on in ("global", "local"), "loss_on", loss_on, "global or local")
        check(loss_scale in ("mean", "authors"), "loss_scale", loss_scale, "mean or authors")
        self.fstar, self.fstar_epochs, self.loss_on, self.loss_scale = fstar, fstar_epochs, loss_on, loss_scale
        check(
            isinstance(trim, int) and not isinstance(trim, bool) and trim >= 0,
            "trim",
            trim,
            "an integer >= 0 (the clients with the most extreme losses dropped each round)",
        )
        check(
            max_weight is None
            or (isinstance(max_weight, (int, float)) and not isinstance(max_weight, bool) and 0 < max_weight <= 1),
            "max_weight",
            max_weight,
            "null (no cap) or a number in (0, 1]",
        )
        self.trim, self.max_weight = trim, max_weight

    def bind(self, context: Context) -> None:
        """Refuse a ``trim`` that leaves no client, or a ``max_weight`` that cannot hold, in a round of the run's
        cohort size (the expected size with Poisson sampling, whose smaller rounds follow the rules above)."""
        m = context.schedule.cohort_size(context.num_clients)
        poisson = context.schedule.sampling == "poisson"
        size = f"the expected cohort of {m} clients (Poisson)" if poisson else f"the cohort of {m} clients"
        if self.trim >= m:
            raise ConfigError("aggregator.trim", self.trim, f"fewer than {size} (at least one must be weighed)")
        kept = m - self.trim
        if self.max_weight is not None and not poisson and self.max_weight * kept < 1:
            # kept clients capped at c hold at most c * kept of the weight: below 1 the cap cannot hold.
            raise ConfigError(
                "aggregator.max_weight",
                self.max_weight,
                f"null or at least 1 / {kept} = {1 / kept:.4g} ({kept} clients weighed a round: {size}, "
                f"trim={self.trim})",
            )

    def gaps(self, report: RoundView) -> np.ndarray:
        """L_i = F_i - F_i* over the cohort, in the configured loss and scale."""
        losses = report.losses if self.loss_on == "global" else report.local_losses
        loss = np.asarray(getattr(losses, self.loss_scale), dtype=np.float64)
        if self.fstar == "estimate":
            loss = loss - getattr(report.fstar(report.clients, self.fstar_epochs), self.loss_scale)
        return loss

    def weights(self, report: RoundView) -> np.ndarray:
        score, p = self.sign * self.gaps(report), self.base_weights(report)
        if not self.trim:  # the rule alone, as before the defences existed (bit for bit)
            alpha, kept = self.weigh(score, p, report.round), None
        else:
            kept = np.ones(len(score), dtype=bool)
            kept[np.argsort(-score, kind="stable")[: self.trimmed(len(score))]] = False  # ties: lower position goes
            alpha = np.zeros(len(score))
            alpha[kept] = self.weigh(score[kept], p[kept] / p[kept].sum(), report.round)
        if self.max_weight is not None:
            alpha = cap(alpha, p, self.max_weight, kept)
        return alpha

    def trimmed(self, cohort: int) -> int:
        """How many clients ``trim`` drops from a cohort of this size (always keeping one)."""
        return min(self.trim, max(cohort - 1, 0))

    def diagnose(self, report: RoundView, alpha: np.ndarray) -> dict[str, float]:
        return {"trimmed": float(self.trimmed(len(report.clients)))} if self.trim else {}

    def weigh(self, score: np.ndarray, p: np.ndarray, round_: int) -> np.ndarray:
        """alpha from signed scores (larger = more weight) and the FedAvg weights p."""
        raise NotImplementedError


class FedMax(LossWeighted):
    """FedMax (FedWorse): all weight on the client with the largest L_i; exact ties split it evenly."""

    def weigh(self, score, p, round_):
        top = (score == score.max()).astype(np.float64)
        return top / top.sum()


class FedBetter(FedMax):
    """FedBetter: all weight on the client with the smallest L_i (ties split evenly)."""

    sign = -1.0


class FedMaxK(LossWeighted):
    """FedMax(k): uniform weight over the k clients with the largest L_i (Power-of-Choice applied at
    aggregation, Cho et al. 2022). Ties at the k-th place go to the lower cohort position.

    Args:
        k: A count (integer >= 1, capped at the cohort size) or a fraction of the cohort (a float,
            0 < k <= 1, rounded, at least one client): ``1`` is one client, ``1.0`` the whole cohort.
        fstar, fstar_epochs, loss_on, loss_scale, weighting: See ``LossWeighted``.
    """

    def __init__(self, k: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        valid = (isinstance(k, int) and k >= 1) or (isinstance(k, float) and 0 < k <= 1)
        check(valid, "k", k, "an integer count >= 1 or a fraction 0 < k <= 1")
        self.k = k

    def count(self, cohort: int) -> int:
        """How many clients get weight in a cohort of this size."""
        return min(cohort, self.k) if isinstance(self.k, int) else max(1, round(self.k * cohort))

    def weigh(self, score, p, round_):
        chosen = np.argsort(-score, kind="stable")[: self.count(len(score))]
        alpha = np.zeros(len(score))
        alpha[chosen] = 1.0 / len(chosen)
        return alpha


class FedBetterK(FedMaxK):
    """FedBetter(k): uniform weight over the k clients with the smallest L_i."""

    sign = -1.0


class FedSoftMax(LossWeighted):
    """FedSoftMax (FedSoftWorse): alpha_i proportional to p_i * exp(L_i / T).

    T -> infinity gives FedAvg; T -> 0 gives FedMax. The temperature can be annealed from
    ``temperature`` (T0) to ``temperature_final`` (T1) over ``anneal_rounds`` rounds, linearly or
    exponentially, and stays at T1 afterwards: the papers' "simulated annealing" mix.

    Args:
        temperature: T (T0 when annealing), > 0.
        temperature_final: T1, or null for a constant temperature.
        anneal: ``constant``, ``linear`` or ``exponential``.
        anneal_rounds: Rounds from T0 to T1 (>= 2 when annealing).
        fstar, fstar_epochs, loss_on, loss_scale, weighting: See ``LossWeighted``.
    """

    def __init__(
        self,
        temperature: float = 1.0,
        temperature_final: float | None = None,
        anneal: str = "constant",
        anneal_rounds: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check(temperature > 0, "temperature", temperature, "a number > 0")
        check(anneal in ("constant", "linear", "exponential"), "anneal", anneal, "constant, linear or exponential")
        if anneal != "constant":
            check(
                temperature_final is not None and temperature_final > 0,
                "temperature_final",
                temperature_final,
                f"a number > 0 with anneal={anneal}",
            )
            check(
                isinstance(anneal_rounds, int) and anneal_rounds >= 2,
                "anneal_rounds",
                anneal_rounds,
                f"an integer >= 2 with anneal={anneal}",
            )
        self.temperature, self.temperature_final = temperature, temperature_final
        self.anneal, self.anneal_rounds = anneal, anneal_rounds

    def temperature_at(self, round_: int) -> float:
        """T at a round (1-based)."""
        if self.anneal == "constant":
            return self.temperature
        progress = min(1.0, (round_ - 1) / (self.anneal_rounds - 1))
        t0, t1 = self.temperature, self.temperature_final
        return t0 + (t1 - t0) * progress if self.anneal == "linear" else t0 * (t1 / t0) ** progress

    def diagnose(self, report, alpha):
        return {**super().diagnose(report, alpha), "temperature": self.temperature_at(report.round)}

    def weigh(self, score, p, round_):
        # alpha_t^i = p_i exp(T^-1 (F_i(w_t) - F_i*)) re-normalised: paper 000 (000_e8a407b177dd9e6a.txt) line 269,
        # paper 001 (001_bd9b3d8952910fb9.txt) line 239.
        return exponential_weights(p, score / self.temperature_at(round_))


class FedSoftBetter(FedSoftMax):
    """FedSoftBetter: alpha_i proportional to p_i * exp(-L_i / T)."""

    sign = -1.0


def exponential_weights(p: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """p_i exp(x_i) renormalised (FedSoftMax's T^-1 L_i, TERM's t F_i), in log-sum-exp form: subtracting the largest
    logit keeps exp() finite for any loss and scale."""
    logits = np.log(p) + exponents
    w = np.exp(logits - logits.max())
    return w / w.sum()


def cap(alpha: np.ndarray, p: np.ndarray, max_weight: float, kept: np.ndarray | None = None) -> np.ndarray:
    """alpha with no entry above ``max_weight`` (``LossWeighted``'s ``max_weight``), by water-filling.

    Each pass caps the entries above the cap and gives the weight they lose to the uncapped clients, in proportion
    to their alpha (so their ratios are kept) or, where they hold none, in proportion to their p_i; until no entry
    exceeds the cap (at most one pass per client: each pass caps at least one more). Where the cap cannot hold
    (max_weight * kept clients < 1) it is raised to 1 / kept clients: uniform over them.

    Args:
        alpha: Weights over the cohort, summing to 1 over ``kept`` and 0 elsewhere.
        p: The FedAvg weights over the cohort (the fallback proportions).
        max_weight: The cap c in (0, 1].
        kept: Which clients may hold weight (a boolean mask; ``trim``'s dropped clients stay at 0); null: all.

    Returns:
        The capped weights, summing to 1.
    """
    alpha = np.array(alpha, dtype=np.float64)
    kept = np.ones(len(alpha), dtype=bool) if kept is None else kept
    c = max(max_weight, 1.0 / kept.sum())
    capped = np.zeros(len(alpha), dtype=bool)
    while (over := kept & ~capped & (alpha > c)).any():
        capped |= over
        alpha[capped] = c
        rest = kept & ~capped
        if not rest.any():
            break
        # c * capped < 1: each capped client held more than c before, and all of them at most 1.
        base = alpha[rest] if alpha[rest].sum() > 0 else p[rest]
        alpha[rest] = (1.0 - c * capped.sum()) * base / base.sum()
    return alpha


class Hybrid(Aggregator):
    """A sequence of aggregators, each used until its phase ends (e.g. FedSoftBetterAvg: ``fedsoftbetter``
    until round 20, then ``fedavg``). Phases never switch back.

    A phase ends after ``until_round`` (the last round it aggregates) or once ``until_accuracy`` has been
    reached by the latest evaluated accuracy: validation accuracy when the run has a validation split,
    else test accuracy, which the run then records in the tag ``hybrid_switch_on``.

    Args:
        phases: A list of ``{aggregator: <aggregator>, until_round: int | null, until_accuracy: float | null}``;
            the last phase needs no end.
        weighting: p_i, for the ``alpha_distance`` diagnostic (each phase's alpha is used as is).
    """

    alpha_informative = True  # a loss-weighted phase, or the switch itself
    weights_follow_clients = True  # its phases, and when it switches
    STATE = ("current", "switched")  # and each phase's own (``state_dict``)

    def __init__(self, phases: list, weighting: str = "samples"):
        super().__init__(weighting)
        check(len(phases) >= 1, "phases", phases, "a non-empty list of {aggregator, until_round | until_accuracy}")
        self.phases = []
        for i, phase in enumerate(phases):
            rounds, accuracy = phase.get("until_round"), phase.get("until_accuracy")
            check(
                isinstance(phase.get("aggregator"), Aggregator),
                f"phases[{i}].aggregator",
                phase.get("aggregator"),
                "an aggregator config",
            )
            # A phase contributes only its weights; one that aggregates otherwise (FedNova's normalisation,
            # MVR's momentum) would silently run as a weighted average.
            agg = phase["aggregator"]
            check(
                type(agg).aggregate is Aggregator.aggregate,
                f"phases[{i}].aggregator",
                type(agg).__name__,
                "an aggregator that only chooses weights (fedavg, the loss-weighted family, hybrid), not one with "
                "its own aggregation such as fednova or mvr",
            )
            check(
                rounds is None or (isinstance(rounds, int) and rounds >= 1),
                f"phases[{i}].until_round",
                rounds,
                "null or an integer >= 1",
            )
            check(
                accuracy is None or 0 < accuracy <= 1,
                f"phases[{i}].until_accuracy",
                accuracy,
                "null or a fraction in (0, 1]",
            )
            check(
                i == len(phases) - 1 or rounds is not None or accuracy is not None,
                f"phases[{i}]",
                dict(phase),
                "an until_round or until_accuracy (all but the last phase)",
            )
            self.phases.append((phase["aggregator"], rounds, accuracy))
        self.current = 0
        self.switched: dict[str, str] = {}  # when each phase began (and on what), the run's tags

    @property
    def measures_losses(self) -> bool:
        return any(agg.measures_losses for agg, _, _ in self.phases)

    def bind(self, context: Context) -> None:
        """Bind each phase (a loss-weighted phase checks its ``trim`` and ``max_weight``), its errors naming the
        phase's key."""
        for i, (agg, _, _) in enumerate(self.phases):
            try:
                agg.bind(context)
            except ConfigError as exc:
                key = exc.key.removeprefix("aggregator.")
                raise ConfigError(f"aggregator.phases[{i}].aggregator.{key}", exc.value, exc.allowed) from None

    def state_dict(self) -> dict:
        """Its phase and switches, with each phase's aggregator as that aggregator's state (the phases' ends are
        config)."""
        return {**super().state_dict(), "phases": [agg.state_dict() for agg, _, _ in self.phases]}

    def load_state_dict(self, state: dict) -> None:
        for (agg, _, _), phase in zip(self.phases, state["phases"], strict=True):
            agg.load_state_dict(phase)
        if "tags" in state and "switched" not in state:  # before diagnostics were returned its switches were its tags
            state = {**state, "switched": state["tags"]}
        super().load_state_dict(state)

    def _ended(self, report: RoundView) -> bool:
        _, rounds, accuracy = self.phases[self.current]
        if rounds is not None and report.round > rounds:
            return True
        return accuracy is not None and not math.isnan(report.accuracy) and report.accuracy >= accuracy

    def weights(self, report: RoundView) -> np.ndarray:
        while self.current < len(self.phases) - 1 and self._ended(report):
            self.current += 1
            self.switched[f"hybrid_phase_{self.current}_from_round"] = str(report.round)
            if self.phases[self.current - 1][2] is not None:
                self.switched["hybrid_switch_on"] = report.accuracy_source
        return self.phases[self.current][0].weights(report)

    def diagnose(self, report: RoundView, alpha: np.ndarray) -> dict[str, float]:
        return {**self.phases[self.current][0].diagnose(report, alpha), "hybrid_phase": float(self.current)}

    def run_tags(self) -> dict[str, str]:
        return dict(self.switched)
