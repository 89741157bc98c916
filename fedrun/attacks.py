"""Clients that lie: the ``attack`` config group (``attack=none``: every client honest).

An attack is one part of the round (``fedrun.parts``), standing where the attackers replace what they send and
report: after local training, before the update pipeline. Its lifecycle is every part's (``bind`` once, its hooks
each round, ``state_dict``), and it holds no state: who is malicious is recomputed from the run's seed, so it is the
same set for a seed on every backend and after a kill and resume (``STATE = ()``).

Who is malicious. ``fraction`` (of the population, in [0, 1): K = floor(fraction * N) clients) or ``count`` (exactly
K; give one of them, neither is no attacker). ``who``: ``fixed``, a set of K drawn once in ``bind`` from
``numpy_rng(seed, "attack")`` (as Blades and the Ditto code: a client is malicious for the whole run), or
``redrawn``, a new set of K each round from ``numpy_rng(seed, "attack", round)`` (as FedML). The set is a sorted id
array of K entries, membership by binary search: a population of a million (``partition=population``) holds nothing
per client. ``knowledge``: ``omniscient`` (the attackers see the round's honest updates, as Blades and ByzFL
assume) or ``own`` (they see only what they trained themselves this round, pooled among the round's attackers:
Baruch et al.'s non-omniscient collusion). Attacks on a client's own update alone (sign flip, scale, Gaussian) are
the same under both.

The interface the engine calls (every attack has every hook; the base ones return their input unchanged, the very
same object):

- ``bind(context)``: checks ``fraction``/``count`` against ``context.num_clients`` and draws the fixed set;
  ``against(aggregator, stages=None)``: the run's aggregator (and pipeline), for an attack that knows the defence
  (``adaptive``); call it at bind time.
- ``malicious(round_, cohort) -> bool array`` over the cohort (or any id array: Power-of-Choice's candidates);
  ``malicious_ids(round_=None)``: the sorted set (the fixed one, or that round's when ``redrawn``).
- Data (``changes_data``): ``training_data(x, y) -> (x, y)`` once, before the backend is made: the tensors, or those
  with a poisoned copy appended (``label_flip``, ``random_labels``); ``data(round_, cohort, parts, mask) -> parts``:
  the attackers' sample indices moved into that copy (offset by the ``len(y)`` that ``training_data`` received).
  The engine calls it after ``ClientState.data``, so a copy indexes whatever rows a client state added too.
- Updates (``changes_updates``): ``updates(round_, cohort, deltas, mask, view=None) -> deltas``: a new tensor whose
  attackers' rows are replaced and whose honest rows are the input's bit for bit (the input itself when ``mask``
  selects nobody). ``view``: the round's ``RoundView``, read only by an adaptive attack's aggregator (without it, a
  view with the cohort's sizes alone, enough for FedAvg and the robust rules).
- Reported scalars (only fedrun's aggregators read them): ``losses(round_, cohort, losses, mask) -> ClientLosses``
  (``lies_about_losses``: ``loss_lie``) and ``sizes(cohort, sizes, mask) -> sizes`` (``lies_about_sizes``:
  ``count_lie``). Either may also poison the update through an inner update attack (``update``).
- ``summary()`` (numbers for the run's summary) and ``run_tags()`` (the count and at most ``TAGGED_IDS`` ids; the full
  set is ``malicious_ids()``, which the engine writes as the artifact ``malicious.csv``).

``mask`` is ``malicious(round_, cohort)``; a hook uses the mask it is given, not its own set, so an inner attack
(``loss_lie``'s ``update``) poisons the outer attack's clients.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import replace
from statistics import NormalDist

import numpy as np

from fedrun.cohort import ClientLosses, ClientReport, RoundView, Told
from fedrun.errors import check
from fedrun.lazy import torch
from fedrun.pipeline import number
from fedrun.seeding import numpy_rng, torch_generator
from fedrun.state import Context, Stateful

TAGGED_IDS = 50  # malicious ids a run tag lists; the rest are in malicious.csv


def _integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class Attack(Stateful):
    """Base of the ``attack`` group, and ``attack=none`` itself: no client is malicious (see the module docstring).

    Args:
        fraction: The malicious share of the population, in [0, 1): K = floor(fraction * N) clients.
        count: Exactly this many malicious clients (instead of ``fraction``).
        who: ``fixed`` (one set drawn from the run's seed) or ``redrawn`` (a new set each round).
        knowledge: ``omniscient`` (the round's honest updates) or ``own`` (the attackers' own updates).
    """

    STATE = ()  # the set is recomputed from (seed, N) and, when redrawn, the round

    # Capabilities (fedrun.compat).
    changes_data = False
    changes_updates = False
    lies_about_losses = False
    lies_about_sizes = False
    # Whether an attacker's update depends on its own update alone (the asynchronous engine's arrivals see no other).
    per_client = True

    def __init__(
        self, fraction: float | None = None, count: int | None = None, who: str = "fixed", knowledge: str = "omniscient"
    ):
        check(fraction is None or (number(fraction) and 0 <= fraction < 1), "fraction", fraction, "a number in [0, 1)")
        check(count is None or (_integer(count) and count >= 0), "count", count, "an integer >= 0")
        check(
            fraction is None or count is None,
            "count",
            count,
            f"null when fraction is set (fraction={fraction}: give one of them, e.g. fraction=null count={count})",
        )
        check(who in ("fixed", "redrawn"), "who", who, "fixed or redrawn")
        check(knowledge in ("omniscient", "own"), "knowledge", knowledge, "omniscient or own")
        self.fraction, self.count, self.who, self.knowledge = fraction, count, who, knowledge
        self.num_clients, self.num_malicious, self.seed = 0, 0, 0
        self.ids = np.zeros(0, dtype=np.int64)  # the fixed set (sorted); empty when redrawn
        self._round_ids: tuple[int, np.ndarray] | None = None  # a redrawn set, for the last round asked (a cache)
        self._sizes: np.ndarray | None = None  # the context's array (shared, not copied): an adaptive view's sizes
        self.aggregator, self.stages = None, None

    def __bool__(self) -> bool:
        """Whether the run has an attack: any option but ``none`` (with nobody malicious, it still logs its columns)."""
        return self.changes_data or self.changes_updates or self.lies_about_losses or self.lies_about_sizes

    # -- who is malicious ------------------------------------------------------------------------------------------

    def bind(self, context: Context) -> None:
        """Check the count against the population and draw the fixed set (from the run's seed only)."""
        n = context.num_clients
        if self.count is not None:
            check(
                self.count < max(n, 1), "count", self.count, f"an integer from 0 to {n - 1} (the run has {n} clients)"
            )
            k = int(self.count)
        else:
            # floor, with room for the float product (0.29 * 100 is 28.999999999999996): K <= fraction * N.
            k = int(math.floor((self.fraction or 0.0) * n + 1e-9))
        self.num_clients, self.num_malicious, self.seed = n, k, int(context.seed)
        self._sizes, self._round_ids = context.sizes, None
        self.ids = self._draw(numpy_rng(self.seed, "attack")) if self.who == "fixed" else np.zeros(0, dtype=np.int64)

    def _draw(self, rng: np.random.Generator) -> np.ndarray:
        # K of N without replacement (numpy may use an N-long scratch range while drawing; nothing N-long is kept).
        if not self.num_malicious:
            return np.zeros(0, dtype=np.int64)
        return np.sort(rng.choice(self.num_clients, size=self.num_malicious, replace=False)).astype(np.int64)

    def malicious_ids(self, round_: int | None = None) -> np.ndarray:
        """The sorted malicious ids: the fixed set, or round ``round_``'s when ``who=redrawn`` (which needs it)."""
        if self.who == "fixed":
            return self.ids
        if round_ is None:
            raise ValueError("attack.who=redrawn: the malicious set is a round's; pass round_")
        if self._round_ids is None or self._round_ids[0] != round_:
            self._round_ids = (round_, self._draw(numpy_rng(self.seed, "attack", round_)))
        return self._round_ids[1]

    def malicious(self, round_: int, cohort: np.ndarray) -> np.ndarray:
        """Whether each client of ``cohort`` (any id array) is malicious in round ``round_``."""
        cohort = np.asarray(cohort, dtype=np.int64)
        ids = self.malicious_ids(round_)
        if not len(ids):
            return np.zeros(len(cohort), dtype=bool)
        at = np.minimum(np.searchsorted(ids, cohort), len(ids) - 1)
        return ids[at] == cohort

    # -- the hooks (unchanged input by default) --------------------------------------------------------------------

    def training_data(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The training tensors the backend holds (called once, after ``bind``): ``x``, ``y`` themselves here."""
        return x, y

    def data(self, round_: int, cohort: np.ndarray, parts: list[np.ndarray], mask: np.ndarray) -> list[np.ndarray]:
        """The sample indices each cohort client trains on: ``parts`` itself here."""
        return parts

    def updates(
        self, round_: int, cohort: np.ndarray, deltas: torch.Tensor, mask: np.ndarray, view: RoundView | None = None
    ) -> torch.Tensor:
        """What each cohort client sends: ``deltas`` itself here."""
        return deltas

    def losses(self, round_: int, cohort: np.ndarray, losses: ClientLosses, mask: np.ndarray) -> ClientLosses:
        """The losses each client of ``cohort`` reports (the cohort's, or Power-of-Choice's candidates'): ``losses``
        itself here."""
        return losses

    def sizes(self, cohort: np.ndarray, sizes: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The sample counts n_k each cohort client reports: ``sizes`` itself here."""
        return sizes

    def report(
        self, round_: int, cohort: np.ndarray, honest: ClientReport, mask: np.ndarray, drawn: ClientLosses | None = None
    ) -> ClientReport:
        """What the cohort tells the server, from what it computed (``honest``): the losses and sample counts as
        ``losses`` and ``sizes`` say (the losses told from the honest ones when the aggregator reads them). A cohort
        that reported its losses to be drawn (Power-of-Choice's candidates, ``drawn``) reported them once: the
        aggregator weighs those, not a second report. Without an attack the reported values are the honest ones."""
        told = drawn if drawn is not None else Told(lambda losses: self.losses(round_, cohort, losses, mask))
        local = self.losses(round_, cohort, honest.local_losses, mask)
        return replace(honest, losses=told, local_losses=local, sizes=self.sizes(cohort, honest.sizes, mask))

    def against(self, aggregator, stages=None) -> None:
        """The run's aggregator (and pipeline, as ByzFL's pre-aggregators) that an adaptive attack searches against.
        They are copied before each probe, so their state is never touched."""
        self.aggregator, self.stages = aggregator, stages

    # -- what a run records ----------------------------------------------------------------------------------------

    def summary(self) -> dict[str, float]:
        """``attack_malicious``: K, the malicious clients (of the population; each round's when redrawn)."""
        return {"attack_malicious": float(self.num_malicious)}

    def run_tags(self) -> dict[str, str]:
        """The malicious count and, for a fixed set, its first ``TAGGED_IDS`` ids (all of them: malicious.csv)."""
        tags = {"attack_malicious_count": str(self.num_malicious), "attack_who": self.who}
        if self.who == "fixed":
            shown = ",".join(str(int(i)) for i in self.ids[:TAGGED_IDS])
            more = len(self.ids) - TAGGED_IDS
            tags["attack_malicious_ids"] = shown + (f",... ({more} more in malicious.csv)" if more > 0 else "")
        else:
            tags["attack_malicious_ids"] = "redrawn each round from (seed, round)"
        return tags


def _mask_on(mask: np.ndarray, deltas: torch.Tensor) -> torch.Tensor:
    if len(mask) != len(deltas):  # the engine's call, not a setting: not a ConfigError
        raise ValueError(f"the attack's mask has {len(mask)} entries for {len(deltas)} updates")
    return torch.as_tensor(np.asarray(mask, dtype=bool), device=deltas.device)


# -- data ----------------------------------------------------------------------------------------------------------


class DataAttack(Attack):
    """An attack on what the attackers train on: a poisoned copy of the training labels, appended once
    (``training_data``), and the attackers' indices moved into it each round (``data``). The copy doubles the
    training tensors the backend holds when any client can be malicious; with none, nothing is appended.

    Args:
        num_classes: C; null: ``y.max() + 1`` of the training labels (set it when the training split lacks the last
            class).
        **common: ``fraction``, ``count``, ``who``, ``knowledge`` (``Attack``).
    """

    changes_data = True

    def __init__(self, num_classes: int | None = None, **common):
        super().__init__(**common)
        check(
            num_classes is None or (_integer(num_classes) and num_classes >= 2),
            "num_classes",
            num_classes,
            "null or an integer >= 2",
        )
        self.num_classes = num_classes
        self.offset: int | None = None  # len(y) before the copy: where the attackers' rows start

    def poisoned_labels(self, y: torch.Tensor, classes: int) -> torch.Tensor:
        raise NotImplementedError

    def training_data(self, x, y):
        if not self.num_malicious:
            return x, y
        classes = self.num_classes if self.num_classes is not None else int(y.max()) + 1
        self.offset = len(y)
        return torch.cat([x, x]), torch.cat([y, self.poisoned_labels(y, classes).to(y.device, y.dtype)])

    def data(self, round_, cohort, parts, mask):
        if not np.any(mask):
            return parts
        if self.offset is None:
            raise RuntimeError(f"{type(self).__name__}.data before training_data: the poisoned copy does not exist")
        return [part + self.offset if bad else part for part, bad in zip(parts, mask, strict=True)]


class LabelFlip(DataAttack):
    """``label_flip``: the attackers train on labels y -> C - 1 - y (every class moved, none kept), the flip of
    Allen-Zhu et al. 2021 ("Byzantine-resilient non-convex stochastic gradient descent", ICLR) and Karimireddy, He
    and Jaggi 2022 ("Byzantine-robust learning on heterogeneous datasets via bucketing", ICLR), as Blades'
    ``LabelFlipAdversary``. Its loss is honestly high, so a loss-weighted aggregator weighs it up without a lie."""

    def poisoned_labels(self, y, classes):
        return classes - 1 - y


class RandomLabels(DataAttack):
    """``random_labels``: the attackers train on labels drawn uniformly from the C classes, once for the run from the
    stream (seed, ``attack.labels``) (the label noise of Zhang et al. 2017, "Understanding deep learning requires
    rethinking generalization", ICLR, as a poisoning attack): a client's wrong labels are the same every round."""

    def poisoned_labels(self, y, classes):
        return torch.randint(0, classes, y.shape, generator=torch_generator(self.seed, "attack.labels"))


# -- updates -------------------------------------------------------------------------------------------------------


class UpdateAttack(Attack):
    """An attack on what the attackers send: ``poison`` gives their rows (one for each, or one row they all send),
    ``updates`` puts them in a copy of ``deltas``. Statistics are computed in float64 and cast back."""

    changes_updates = True
    per_client = False  # the statistics of the round's updates (ALIE, IPM, min-max); the per-client ones say True

    def poison(self, round_, cohort, deltas: torch.Tensor, mask: torch.Tensor, view) -> torch.Tensor:
        raise NotImplementedError

    def updates(self, round_, cohort, deltas, mask, view=None):
        if not np.any(mask):
            return deltas
        where = _mask_on(mask, deltas)
        sent = deltas.clone()
        rows = self.poison(round_, np.asarray(cohort), deltas, where, view)
        sent[where] = rows.to(deltas.dtype).expand(int(where.sum()), deltas.shape[1])
        return sent

    def reference(self, deltas: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The updates the attackers know, float64: the honest ones (``omniscient``; their own when the cohort has no
        honest client) or their own (``own``)."""
        honest = deltas[~mask]
        return (honest if self.knowledge == "omniscient" and len(honest) else deltas[mask]).double()


class SignFlip(UpdateAttack):
    """``sign_flip``: each attacker sends -kappa Delta_i, its own update reversed and scaled (the sign-flipping attack
    of Li et al. 2019, "RSA: Byzantine-robust stochastic aggregation methods...", AAAI; Allen-Zhu et al. 2021, ICLR).

    Args:
        scale: kappa > 0 (1: the update reversed).
    """

    def __init__(self, scale: float = 1.0, **common):
        super().__init__(**common)
        check(number(scale) and scale > 0, "scale", scale, "a number > 0")
        self.scale = float(scale)

    per_client = True

    def poison(self, round_, cohort, deltas, mask, view):
        return -self.scale * deltas[mask]


class Scale(UpdateAttack):
    """``scale``: each attacker sends kappa Delta_i, its own update boosted: the model replacement of Bagdasaryan et
    al. 2020 ("How to backdoor federated learning", AISTATS), which scales by the cohort size over the server rate so
    that the attacker's update survives averaging.

    Args:
        scale: kappa > 0; null: the round's cohort size (what averaging divides by).
    """

    def __init__(self, scale: float | None = None, **common):
        super().__init__(**common)
        check(scale is None or (number(scale) and scale > 0), "scale", scale, "null or a number > 0")
        self.scale = scale

    @property
    def per_client(self) -> bool:  # scale=null boosts by the cohort's size: the round's, not an arrival's
        return self.scale is not None

    def poison(self, round_, cohort, deltas, mask, view):
        return (float(len(cohort)) if self.scale is None else float(self.scale)) * deltas[mask]


class Gaussian(UpdateAttack):
    """``gaussian``: each attacker sends noise N(0, sigma^2 I), drawn from the stream (seed, ``attack.gaussian``,
    round, client), so it is the same on every backend (the Gaussian Byzantine workers of Blanchard et al. 2017,
    "Machine learning with adversaries: Byzantine tolerant gradient descent", NeurIPS).

    Args:
        sigma: The noise's standard deviation, > 0.
    """

    per_client = True

    def __init__(self, sigma: float = 1.0, **common):
        super().__init__(**common)
        check(number(sigma) and sigma > 0, "sigma", sigma, "a number > 0")
        self.sigma = float(sigma)

    def poison(self, round_, cohort, deltas, mask, view):
        ids = cohort[mask.cpu().numpy()]
        d = deltas.shape[1]
        noise = [torch.randn(d, generator=torch_generator(self.seed, "attack.gaussian", round_, int(c))) for c in ids]
        return self.sigma * torch.stack(noise).to(deltas.device)


def line_search(objective: Callable[[float], float], start: float, step: float, ratio: float, evals: int) -> float:
    """The x >= ``start`` that maximises ``objective`` within ``evals`` evaluations, by ByzFL's search (its
    ``Optimal_InnerProductManipulation`` and ``Optimal_ALittleIsEnough``; Allouah et al. 2023, "Fixing by mixing",
    AISTATS): expand (x + step, doubling the step while the objective grows), then contract (x + step, the step
    times ``ratio`` after each probe, keeping the best)."""
    best, value = start, objective(start)
    left = evals - 1
    while left > 0:  # expansion
        probe = best + step
        found, left = objective(probe), left - 1
        if found > value:
            best, value, step = probe, found, step * 2
        else:
            step *= ratio
            break
    while left > 0:  # contraction
        probe = best + step
        found, left = objective(probe), left - 1
        if found > value:
            best, value = probe, found
        step *= ratio
    return best


class Adaptive(UpdateAttack):
    """An update attack with one scale tau that can know the defence: with ``adaptive``, tau maximises
    ||aggregate(sent) - mean(reference)|| under the run's aggregator (``against``), by ByzFL's ``line_search``; the
    aggregator (and pipeline) are copied for each probe, so their state is untouched.

    Args:
        adaptive: Search tau against the aggregator each round.
        evals: Probes of the search (ByzFL: 20).
        start: The first tau probed (ByzFL: 0).
        step: The first step (ByzFL: 10).
        ratio: The contraction, in (0.5, 1) (ByzFL: 0.8).
    """

    def __init__(
        self,
        adaptive: bool = False,
        evals: int = 20,
        start: float = 0.0,
        step: float = 10.0,
        ratio: float = 0.8,
        **common,
    ):
        super().__init__(**common)
        check(isinstance(adaptive, bool), "adaptive", adaptive, "true or false")
        check(_integer(evals) and evals >= 1, "evals", evals, "an integer >= 1")
        check(number(start) and start >= 0, "start", start, "a number >= 0")
        check(number(step) and step > 0, "step", step, "a number > 0")
        check(number(ratio) and 0.5 < ratio < 1, "ratio", ratio, "a number in (0.5, 1)")
        self.adaptive, self.evals, self.start, self.step, self.ratio = adaptive, evals, start, step, ratio

    def sent(self, reference: torch.Tensor, tau: float) -> torch.Tensor:
        """What every attacker sends for the scale ``tau`` (one row, float64)."""
        raise NotImplementedError

    def tau(self, cohort, deltas, mask) -> float:
        """The scale without the search."""
        raise NotImplementedError

    def poison(self, round_, cohort, deltas, mask, view):
        reference = self.reference(deltas, mask)
        if not self.adaptive:
            return self.sent(reference, self.tau(cohort, deltas, mask))
        if self.aggregator is None:
            raise RuntimeError(f"{type(self).__name__}: attack.adaptive=true needs the run's aggregator (against)")
        view = view if view is not None else RoundView(cohort, self._sizes[cohort], round=round_)
        target, params = reference.mean(0), deltas.new_zeros(deltas.shape[1])

        def distance(tau: float) -> float:
            sent = deltas.clone()
            sent[mask] = self.sent(reference, tau).to(deltas.dtype).expand(int(mask.sum()), -1)
            if self.stages is not None:
                sent = copy.deepcopy(self.stages)(sent, cohort, round_)[0]
            update = copy.deepcopy(self.aggregator).aggregate(params, sent, view).update
            return float(torch.linalg.vector_norm(update.double() - target))

        return self.sent(reference, line_search(distance, self.start, self.step, self.ratio, self.evals))


Z_RULES = ("baruch", "blades")


def alie_z_max(n: int, f: int, rule: str = "baruch") -> float:
    """Baruch et al. 2019's z_max for f attackers among n workers. Both rules start from the honest workers the
    attackers need on their side for a majority, s = floor(n / 2 + 1) - f (line 1 of the paper's Algorithm 1).
    ``baruch``: z_max = max z with Phi(z) < (n - s) / n (line 2 of Algorithm 1: the largest z for which s of the n
    workers are expected farther from the mean than mu + z sigma). ``blades``: z_max = Phi^-1((n - f - s) / (n - f)),
    the same count among the n - f honest workers only (Blades' ``alieclient.py`` and ByzShield compute this; it is
    smaller, and 0 for n = 20, f = 2). Phi is the standard normal CDF; the probability is clipped to
    [1e-6, 1 - 1e-6] where the attackers need no honest worker (s <= 0) or no honest worker is left to lean on."""
    s = math.floor(n / 2 + 1) - f
    if rule == "baruch":
        p = (n - s) / n if n > 0 else 1.0
    else:
        p = (n - f - s) / (n - f) if n > f else 1.0
    return NormalDist().inv_cdf(min(max(p, 1e-6), 1 - 1e-6))


class ALIE(Adaptive):
    """``alie``: "A little is enough" (Baruch, Baruch and Goldberg 2019, "A little is enough: circumventing defenses
    for distributed learning", NeurIPS): every attacker sends mu - z sigma, the coordinate-wise mean of the reference
    updates (``knowledge``: the honest ones, or the attackers' own pooled, the paper's setting) minus z of their
    coordinate-wise standard deviations (n - 1 in the denominator, as ByzFL and Blades; 0 for a single update):
    close enough to the mean in every coordinate that median- and distance-based rules keep it. The sign is a
    convention (some implementations add). z = ``alie_z_max(n, f, z_rule)`` with n the cohort and f its attackers this
    round, or the fixed ``z``; with ``adaptive``, the z >= 0 found by ByzFL's search against the aggregator.

    Args:
        z: A fixed z; null: z_max.
        z_rule: How z_max is computed (``alie_z_max``): ``baruch`` (the paper's Algorithm 1) or ``blades``.
        **adaptive: ``Adaptive``'s search keys and the common ones.
    """

    def __init__(self, z: float | None = None, z_rule: str = "baruch", **adaptive):
        super().__init__(**adaptive)
        check(z is None or number(z), "z", z, "null or a number")
        check(z_rule in Z_RULES, "z_rule", z_rule, " or ".join(Z_RULES))
        self.z, self.z_rule = z, z_rule

    def sent(self, reference, tau):
        std = reference.std(0) if len(reference) > 1 else torch.zeros_like(reference[0])
        return (reference.mean(0) - tau * std)[None]

    def tau(self, cohort, deltas, mask):
        return float(self.z) if self.z is not None else alie_z_max(len(cohort), int(mask.sum()), self.z_rule)


class IPM(Adaptive):
    """``ipm``: inner product manipulation (Xie, Koyejo and Gupta 2020, "Fall of empires: breaking Byzantine-tolerant
    SGD by inner product manipulation", UAI 2019, PMLR 115): every attacker sends -epsilon times the mean of the
    reference updates, so that the aggregate's inner product with the true gradient turns negative; with
    ``adaptive``, epsilon is ByzFL's search against the aggregator.

    Args:
        epsilon: epsilon > 0 (ByzFL's default: 2; Blades': 1).
        **adaptive: ``Adaptive``'s search keys and the common ones.
    """

    def __init__(self, epsilon: float = 2.0, **adaptive):
        super().__init__(**adaptive)
        check(number(epsilon) and epsilon > 0, "epsilon", epsilon, "a number > 0")
        self.epsilon = float(epsilon)

    def sent(self, reference, tau):
        return (-tau * reference.mean(0))[None]

    def tau(self, cohort, deltas, mask):
        return self.epsilon


DIRECTIONS = ("std", "unit_vec", "sign")


class MinMax(UpdateAttack):
    """``minmax``: the AGR-agnostic Min-Max attack of Shejwalkar and Houmansadr 2021 ("Manipulating the Byzantine:
    optimizing model poisoning attacks and defenses for federated learning", NDSS, Section IV): every attacker sends
    m = mu - gamma p, mu the mean of the reference updates and p a direction (``std``: their coordinate-wise standard
    deviation; ``unit_vec``: mu / ||mu||; ``sign``: sign(mu)), with the largest gamma such that m's largest distance
    to a reference update is within the largest distance between two of them:
    max_i ||m - x_i|| <= max_{i,j} ||x_i - x_j||. gamma is found by the paper's search: gamma starts at
    ``gamma_init`` and moves up or down by a step that halves each time (up while the condition holds), until the
    last success and the probe differ by at most ``tolerance``; m uses that success (gamma = 0, the mean, holds
    always), so the condition holds exactly, whatever the search's resolution.

    Distances are computed from explicit differences in float64 (``torch.cdist`` without its matrix-product form,
    as ``fedrun.aggregators.robust``): ||x||^2 + ||y||^2 - 2 x.y would lose nearby updates' distances to cancellation.

    Args:
        direction: p: std, unit_vec or sign (the paper's three; Blades uses std).
        gamma_init: The first gamma (the paper's code: 10); the search reaches at most twice it.
        tolerance: The search's resolution (the paper's code: 1e-5).
    """

    def __init__(self, direction: str = "std", gamma_init: float = 10.0, tolerance: float = 1e-5, **common):
        super().__init__(**common)
        check(direction in DIRECTIONS, "direction", direction, " or ".join(DIRECTIONS))
        check(number(gamma_init) and gamma_init > 0, "gamma_init", gamma_init, "a number > 0")
        check(number(tolerance) and tolerance > 0, "tolerance", tolerance, "a number > 0")
        self.direction, self.gamma_init, self.tolerance = direction, float(gamma_init), float(tolerance)

    @staticmethod
    def pairwise(reference: torch.Tensor) -> torch.Tensor:
        """||x_i - x_j||^2 over the reference updates."""
        distances = torch.cdist(reference, reference, compute_mode="donot_use_mm_for_euclid_dist")
        return distances * distances

    def bound(self, reference: torch.Tensor) -> float:
        """The largest squared distance between two reference updates."""
        return float(self.pairwise(reference).max())

    def score(self, m: torch.Tensor, reference: torch.Tensor) -> float:
        """m's largest squared distance to a reference update."""
        return float(((reference - m) ** 2).sum(1).max())

    def perturbation(self, reference: torch.Tensor) -> torch.Tensor:
        mean = reference.mean(0)
        if self.direction == "std":
            return reference.std(0) if len(reference) > 1 else torch.zeros_like(mean)
        if self.direction == "sign":
            return torch.sign(mean)
        norm = torch.linalg.vector_norm(mean)
        return mean / norm if norm > 0 else torch.zeros_like(mean)

    def gamma(self, reference: torch.Tensor) -> float:
        """The paper's search for the largest gamma that keeps m within the bound."""
        mean, p, limit = reference.mean(0), self.perturbation(reference), self.bound(reference)
        gamma, step, good = self.gamma_init, self.gamma_init, 0.0
        while abs(good - gamma) > self.tolerance:
            if self.score(mean - gamma * p, reference) <= limit:
                good, gamma = gamma, gamma + step / 2
            else:
                gamma -= step / 2
            step /= 2
        return good

    def poison(self, round_, cohort, deltas, mask, view):
        reference = self.reference(deltas, mask)
        return (reference.mean(0) - self.gamma(reference) * self.perturbation(reference))[None]


class MinSum(MinMax):
    """``minsum``: the AGR-agnostic Min-Sum attack of Shejwalkar and Houmansadr 2021 (NDSS, Section IV): as
    ``minmax``, with the sum of squared distances: sum_i ||m - x_i||^2 <= max_i sum_j ||x_i - x_j||^2 (m is no
    farther from the reference updates, in total, than the farthest of them is from the others)."""

    def bound(self, reference):
        return float(self.pairwise(reference).sum(1).max())

    def score(self, m, reference):
        return float(((reference - m) ** 2).sum())


# -- reported scalars ----------------------------------------------------------------------------------------------


class Reporting(Attack):
    """An attack on a reported scalar, with the update honest (``update=null``) or poisoned by an inner update attack
    (``update``: an ``UpdateAttack``, e.g. ``{_target_: fedrun.attacks.SignFlip}``), which poisons this attack's
    clients (the mask it is given): its own ``fraction``/``count``/``who`` are not used.

    Args:
        update: The inner update attack, or null.
        **common: ``fraction``, ``count``, ``who``, ``knowledge`` (``Attack``).
    """

    def __init__(self, update: UpdateAttack | None = None, **common):
        super().__init__(**common)
        check(
            update is None or isinstance(update, UpdateAttack),
            "update",
            type(update).__name__,
            "null or an update attack (fedrun.attacks.SignFlip, ALIE, ...)",
        )
        self.update = update

    @property
    def changes_updates(self) -> bool:
        return self.update is not None

    @property
    def per_client(self) -> bool:
        return self.update is None or self.update.per_client

    def bind(self, context):
        super().bind(context)
        if self.update is not None:
            self.update.bind(context)  # its seed (Gaussian's stream) and sizes; its own set is not used

    def against(self, aggregator, stages=None):
        super().against(aggregator, stages)
        if self.update is not None:
            self.update.against(aggregator, stages)

    def updates(self, round_, cohort, deltas, mask, view=None):
        return deltas if self.update is None else self.update.updates(round_, cohort, deltas, mask, view)


class LossLie(Reporting):
    """``loss_lie``: the attackers report a loss of l + ``offset`` or ``factor`` * l, where l is their own loss
    (``relative_to: own``) or the largest honest loss of the same call (``honest_max``: an omniscient liar, e.g.
    l_max + T ln(9 (n - 1)) takes 90% of FedSoftMax's weight). Both scales of ``ClientLosses`` are changed alike, so
    ``offset`` is in the units of whichever scale the aggregator reads (``loss_signal.loss_scale``). Only fedrun's
    loss-weighted aggregators and Power-of-Choice read a reported loss; the update is honest unless ``update`` is set.

    Args:
        offset: Added to l (give this or ``factor``).
        factor: Multiplies l, >= 0.
        relative_to: own or honest_max (needs knowledge=omniscient).
        **reporting: ``update`` and the common keys.
    """

    lies_about_losses = True

    def __init__(self, offset: float | None = None, factor: float | None = None, relative_to: str = "own", **reporting):
        super().__init__(**reporting)
        check(offset is None or number(offset), "offset", offset, "null or a number")
        check(factor is None or (number(factor) and factor >= 0), "factor", factor, "null or a number >= 0")
        if offset is None:
            check(factor is not None, "factor", factor, "a number >= 0 when offset is null (give one of them)")
        else:
            check(factor is None, "factor", factor, f"null when offset is set (offset={offset}: give one of them)")
        check(relative_to in ("own", "honest_max"), "relative_to", relative_to, "own or honest_max")
        check(
            relative_to == "own" or self.knowledge == "omniscient",
            "relative_to",
            relative_to,
            "own with knowledge=own (an attacker that sees no honest loss cannot top it)",
        )
        self.offset, self.factor, self.relative_to = offset, factor, relative_to

    def lie(self, values: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """One scale's reported losses."""
        values = np.asarray(values, dtype=np.float64)
        base = values[mask]
        if self.relative_to == "honest_max":
            honest = values[~mask]
            base = np.full(int(mask.sum()), honest.max() if len(honest) else base.max())
        told = values.copy()
        told[mask] = base + self.offset if self.offset is not None else self.factor * base
        return told

    def losses(self, round_, cohort, losses, mask):
        mask = np.asarray(mask, dtype=bool)
        if not mask.any():
            return losses
        return ClientLosses(self.lie(losses.mean, mask), self.lie(losses.authors, mask))


class CountLie(Reporting):
    """``count_lie``: the attackers report n_k times ``factor`` samples (rounded), so that FedAvg's p_k, which trusts
    the reported counts (McMahan et al. 2017), weighs them up; the update is honest unless ``update`` is set.

    Args:
        factor: > 0 (e.g. 10: ten times the data).
        **reporting: ``update`` and the common keys.
    """

    lies_about_sizes = True

    def __init__(self, factor: float = 10.0, **reporting):
        super().__init__(**reporting)
        check(number(factor) and factor > 0, "factor", factor, "a number > 0")
        self.factor = float(factor)

    def sizes(self, cohort, sizes, mask):
        mask = np.asarray(mask, dtype=bool)
        if not mask.any():
            return sizes
        told = np.array(sizes, copy=True)
        told[mask] = np.rint(told[mask] * self.factor).astype(told.dtype)
        return told
