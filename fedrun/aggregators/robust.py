"""Robust aggregators (issue 36): rules that bound what a few dishonest clients can do to the round's update.

Each rule returns an update Delta for the server optimizer (``server.step``), so it composes with every server
optimizer, and the alpha it reports is each client's influence on that update: its coefficient in the update,
averaged over the coordinates for the coordinate-wise rules (``Median``, ``TrimmedMean``, ``Bulyan``). Alpha sums to
1 except where a rule says otherwise (``CenteredClip`` keeps some weight on its starting point, ``NormBound`` scales
clipped updates down).

The Byzantine count f is a setting of the rules that have a breakdown point: ``f`` (a count) or ``fraction`` (f =
floor(fraction * n) for a round of n clients). ``bind`` checks it against the run's cohort size before training:

    median, geomed     n > 2f (f < n / 2)
    trimmed_mean       n > 2f (f removed from each side)
    krum, multikrum    n > 2f + 2 (Blanchard et al. 2017)
    bulyan             n >= 4f + 3 (El Mhamdi et al. 2018)

With Poisson sampling the cohort varies: ``bind`` checks the expected size, and so does nothing more. A round whose
cohort is too small for its f at aggregation time (a small Poisson draw, stragglers that dropped out) is skipped:
the update is zero, alpha is zero and ``robust/skipped`` is 1. A rule never aggregates outside its breakdown point
(lowering f for that round would hand a round to the attackers exactly when they are most of it).

The pairwise distances of Krum and Bulyan are computed from explicit differences (``torch.cdist`` with
``donot_use_mm_for_euclid_dist``), never as ||x||^2 + ||y||^2 - 2 x.y, which loses the distance between two nearby
updates to cancellation; they are squared once. All rules compute in float64 and hand the update back in the
updates' dtype (float32 on Apple's MPS, which has no float64).

Every rule logs ``robust/f`` (the round's f), ``robust/discarded`` (clients with alpha = 0: no influence at all) and
``robust/skipped``, plus its own columns (NaN in a skipped round).
"""

from __future__ import annotations

import math

import numpy as np

from fedrun.aggregators.base import Aggregation, Aggregator
from fedrun.cohort import RoundView
from fedrun.errors import ConfigError, check
from fedrun.lazy import torch
from fedrun.seeding import numpy_rng
from fedrun.state import Context


def squared_distances(x: torch.Tensor) -> torch.Tensor:
    """||x_i - x_j||^2 for every pair of rows, from their differences (no cancellation), squared once."""
    distances = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist")
    return distances * distances


def precise(deltas: torch.Tensor) -> torch.Tensor:
    """The updates in float64 (float32 on Apple's MPS, which has no float64)."""
    return deltas.to(torch.float32 if deltas.device.type == "mps" else torch.float64)


def krum_scores(squared: torch.Tensor, neighbours: int) -> torch.Tensor:
    """Each client's Krum score: the sum of its squared distances to its ``neighbours`` nearest other clients.

    Args:
        squared: Squared pairwise distances (``squared_distances``) of the clients scored.
        neighbours: How many nearest others count (0: every score is 0).
    """
    n = len(squared)
    others = squared.masked_fill(torch.eye(n, dtype=torch.bool, device=squared.device), math.inf)
    return others.sort(dim=1).values[:, :neighbours].sum(dim=1)


def influence(rows: torch.Tensor, n: int) -> np.ndarray:
    """How often each of n clients appears in ``rows`` (client indices, one per kept value), as a share of them."""
    counts = torch.bincount(rows.reshape(-1), minlength=n).double()
    return (counts / rows.numel()).cpu().numpy()


def coordinate_median(x: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """The coordinate-wise median of the rows of ``x`` (the mean of the two middle values for an even count, as
    numpy), and each row's share of the values it was taken from (ties go to the lower row)."""
    n = len(x)
    values, order = x.sort(dim=0, stable=True)
    middle = slice((n - 1) // 2, n // 2 + 1)  # one row for odd n, two for even n
    return values[middle].mean(dim=0), influence(order[middle], n)


def closest_mean(reference: torch.Tensor, x: torch.Tensor, beta: int) -> tuple[torch.Tensor, np.ndarray]:
    """Per coordinate, the mean of the ``beta`` values of the rows of ``x`` closest to ``reference`` (Bulyan's last
    step; ties go to the lower row), and each row's share of the values averaged."""
    order = (x - reference).abs().argsort(dim=0, stable=True)[:beta]
    return x.gather(0, order).mean(dim=0), influence(order, len(x))


class RobustAggregator(Aggregator):
    """Base of the robust rules: float64, the skip rule, the common diagnostics (module docstring).

    Subclasses write ``robust(x, f, report)``; those with a breakdown point derive from ``ByzantineRobust``.
    """

    STATE = ()
    # Their output follows the updates themselves, not a fixed-denominator sum of them: privacy refuses them.
    weights_follow_clients = True
    alpha_informative = True  # alpha says whom the rule kept
    COLUMNS: tuple[str, ...] = ()  # the rule's own diagnostics, NaN in a skipped round

    PRE = ("none", "bucketing")  # the pre-aggregations the rule takes (``nnm`` needs an f: ByzantineRobust's)

    def __init__(self, weighting: str = "uniform", pre: str = "none", bucket_size: int = 2):
        super().__init__(weighting)
        check(pre in self.PRE, "pre", pre, " or ".join(self.PRE) + f" for {type(self).__name__}")
        check(
            isinstance(bucket_size, int) and not isinstance(bucket_size, bool) and bucket_size >= 1,
            "bucket_size",
            bucket_size,
            "an integer >= 1",
        )
        self.pre, self.bucket_size, self.seed = pre, bucket_size, 0

    def bind(self, context: Context) -> None:
        self.seed = context.seed  # bucketing's stream

    def rows(self, n: int) -> int:
        """How many vectors the rule aggregates for n clients: ceil(n / bucket_size) after bucketing."""
        return -(-n // self.bucket_size) if self.pre == "bucketing" else n

    def mixing(self, x: torch.Tensor, f: int, round_: int) -> torch.Tensor | None:
        """The pre-aggregation as a matrix M (rows x clients) whose rows M x the rule aggregates, or None.

        ``nnm``: nearest-neighbour mixing (Allouah et al. 2023, "Fixing by mixing", Algorithm 1): row i is the mean
        of the n - f updates nearest x_i (itself included; ties to the lower cohort position).
        ``bucketing``: (Karimireddy, He and Jaggi 2022, ICLR, Algorithm 1): the cohort in a random order drawn from
        (seed, round), cut into buckets of ``bucket_size`` (the last may be smaller), each averaged.
        """
        n = len(x)
        if self.pre == "nnm":
            nearest = squared_distances(x).argsort(dim=1, stable=True)[:, : n - f]
            mix = torch.zeros(n, n, dtype=x.dtype, device=x.device)
            return mix.scatter_(1, nearest, 1.0 / (n - f))
        if self.pre == "bucketing":
            order = torch.as_tensor(numpy_rng(self.seed, "bucketing", round_).permutation(n), device=x.device)
            mix = torch.zeros(self.rows(n), n, dtype=x.dtype, device=x.device)
            for b, start in enumerate(range(0, n, self.bucket_size)):
                members = order[start : start + self.bucket_size]
                mix[b, members] = 1.0 / len(members)
            return mix
        return None

    def byzantine(self, n: int) -> int:
        """f for a round of n clients."""
        return 0

    def tolerates(self, n: int, f: int) -> bool:
        """Whether a round of n clients can be aggregated with f of them Byzantine."""
        return n >= 1

    def robust(self, x: torch.Tensor, f: int, report: RoundView) -> tuple[torch.Tensor, np.ndarray, dict]:
        """The update (float64), alpha and the rule's own diagnostics for the updates ``x`` (float64, one row per
        client) of a round the rule tolerates."""
        raise NotImplementedError

    def aggregate(self, global_params: torch.Tensor, deltas: torch.Tensor, report: RoundView) -> Aggregation:
        if not len(deltas):
            return self.empty(global_params)
        n = len(deltas)
        f = self.byzantine(n)
        skipped = not self.tolerates(self.rows(n), f)
        if skipped:  # a small round: skipped, never aggregated outside the breakdown point
            update, alpha, own = torch.zeros_like(global_params), np.zeros(n), dict.fromkeys(self.COLUMNS, math.nan)
        else:
            x = precise(deltas)
            mix = self.mixing(x, f, report.round)
            if mix is None:
                update, alpha, own = self.robust(x, f, report)
            else:  # the rule over the mixed rows; a client's alpha is its share of the rows' alphas
                shares = mix.cpu().numpy()
                sizes = shares @ np.asarray(report.sizes, dtype=np.float64)
                update, rows_alpha, own = self.robust(
                    mix @ x, f, RoundView(np.arange(len(mix)), sizes, round=report.round)
                )
                alpha = rows_alpha @ shares
            update = update.to(deltas.dtype)
        diagnostics = {
            "alpha_distance": float(np.abs(alpha - self.base_weights(report)).sum()),
            "robust/f": float(f),
            "robust/discarded": float(np.count_nonzero(alpha == 0)),
            "robust/skipped": float(skipped),
            **own,
        }
        return Aggregation(update, alpha, diagnostics)


class ByzantineRobust(RobustAggregator):
    """A robust rule that assumes at most f Byzantine clients a round and has a breakdown point.

    Args:
        f: The number of Byzantine clients a round (an integer >= 0); null with ``fraction``.
        fraction: f as a share of each round's cohort, f = floor(fraction * n), in [0, 0.5); null with ``f``.
            Both null: f = 0.
        weighting: p_i, where the rule averages with weights (see each rule); otherwise only ``alpha_distance``.
    """

    BREAKDOWN = "n > 2f"  # the condition, in words
    CITATION = ""

    PRE = ("none", "nnm", "bucketing")

    def __init__(
        self,
        f: int | None = None,
        fraction: float | None = None,
        weighting: str = "uniform",
        pre: str = "none",
        bucket_size: int = 2,
    ):
        super().__init__(weighting, pre, bucket_size)
        check(
            f is None or (isinstance(f, int) and not isinstance(f, bool) and f >= 0),
            "f",
            f,
            "null or an integer >= 0 (the Byzantine clients a round)",
        )
        check(
            fraction is None or (isinstance(fraction, (int, float)) and 0 <= fraction < 0.5),
            "fraction",
            fraction,
            "null or a fraction in [0, 0.5) of each round's clients",
        )
        check(f is None or fraction is None, "fraction", fraction, f"null when f is set (f={f}; set one of them)")
        self.f, self.fraction = f, fraction

    def byzantine(self, n: int) -> int:
        if self.fraction is not None:
            return math.floor(self.fraction * n)
        return self.f or 0

    def tolerates(self, n: int, f: int) -> bool:
        return n > 2 * f

    def bind(self, context: Context) -> None:
        """Refuse an f beyond the breakdown point for the run's cohort size (the expected size with Poisson
        sampling, whose smaller rounds are skipped)."""
        super().bind(context)
        schedule = context.schedule
        n = schedule.cohort_size(context.num_clients)
        if self.tolerates(self.rows(n), self.byzantine(n)):
            return
        key, value = ("fraction", self.fraction) if self.fraction is not None else ("f", self.f or 0)
        size = f"{n} clients a round" + (" expected (poisson sampling)" if schedule.sampling == "poisson" else "")
        size += f" in {self.rows(n)} buckets" if self.pre == "bucketing" else ""
        most = max((g for g in range(n) if self.tolerates(self.rows(n), g)), default=None)
        reach = f"f at most {most}" if most is not None else "no f at all (too few clients)"
        quantity = "floor(fraction * n)" if key == "fraction" else "f"
        raise ConfigError(
            f"aggregator.{key}",
            value,
            f"{quantity} with {self.BREAKDOWN} for {type(self).__name__} ({self.CITATION}): {size} allows {reach}",
        )


class Median(ByzantineRobust):
    """Coordinate-wise median (Yin et al. 2018; Flower's FedMedian, ByzFL's Median): per coordinate the middle value,
    the mean of the two middle values for an even cohort (numpy's convention). Unweighted; breakdown n > 2f (f only
    checks the cohort).

    alpha_i: the share of the coordinates' median values that client i gave (a value is half a client's for an even
    cohort; ties go to the lower cohort position).
    """

    CITATION = "Yin et al. 2018"

    def robust(self, x, f, report):
        update, alpha = coordinate_median(x)
        return update, alpha, {}


class TrimmedMean(ByzantineRobust):
    """Coordinate-wise trimmed mean (Yin et al. 2018): per coordinate, the f largest and the f smallest values are
    removed and the n - 2f others averaged, unweighted. f counts per side: ``fraction`` is Yin et al.'s beta, the
    share cut from each end (Flower's FedTrimmedAvg ``beta`` and scipy's ``trim_mean``, floor(beta * n) each side;
    ByzFL's TrMean(f) takes the count). f = 0 is the mean. Breakdown n > 2f.

    alpha_i: the share of the coordinates in which client i was kept, over n - 2f.
    """

    CITATION = "Yin et al. 2018"

    def robust(self, x, f, report):
        n = len(x)
        values, order = x.sort(dim=0, stable=True)
        return values[f : n - f].mean(dim=0), influence(order[f : n - f], n), {}


class Krum(ByzantineRobust):
    """Krum (Blanchard et al. 2017): the update of the client whose n - f - 2 nearest others are closest, by the sum
    of squared distances to them. Breakdown n > 2f + 2.

    The neighbour count follows the paper (n - f - 2); ByzFL (and other tools) count n - f - 1, which
    ``neighbours`` selects. Flower counts max(1, n - f - 2), which differs only below the breakdown point, where this
    rule skips the round. Ties go to the lower cohort position.

    alpha: 1 on the chosen client.

    Args:
        neighbours: ``n-f-2`` (Blanchard et al.) or ``n-f-1`` (ByzFL's count).
        f, fraction, weighting: See ``ByzantineRobust`` (weighting only for ``alpha_distance``).
    """

    BREAKDOWN = "n > 2f + 2"
    CITATION = "Blanchard et al. 2017"
    COLUMNS = ("robust/score_min",)
    NEIGHBOURS = {"n-f-2": 2, "n-f-1": 1}

    def __init__(self, neighbours: str = "n-f-2", **kwargs):
        super().__init__(**kwargs)
        check(neighbours in self.NEIGHBOURS, "neighbours", neighbours, "n-f-2 (Blanchard et al. 2017) or n-f-1")
        self.neighbours = neighbours

    def tolerates(self, n, f):
        return n > 2 * f + 2

    def ranking(self, x: torch.Tensor, f: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The clients from the best Krum score to the worst (ties by cohort position), and the scores."""
        scores = krum_scores(squared_distances(x), len(x) - f - self.NEIGHBOURS[self.neighbours])
        return scores.argsort(stable=True), scores

    def robust(self, x, f, report):
        order, scores = self.ranking(x, f)
        alpha = np.zeros(len(x))
        alpha[int(order[0])] = 1.0
        return x[order[0]], alpha, {"robust/score_min": float(scores[order[0]])}


class MultiKrum(Krum):
    """Multi-Krum (Blanchard et al. 2017, section 5; El Mhamdi et al. 2018): the average of the m clients with the best
    Krum scores (neighbours as ``Krum``). m = n (m = null with f = 0) is the plain average. Breakdown n > 2f + 2.

    alpha: p_i renormalised over the m selected (1 / m each with ``uniform``, Blanchard et al.'s average; Flower's
    MultiKrum weighs them by sample count, ``samples``).

    Args:
        m: How many clients to average (an integer >= 1, at most the cohort; a smaller round takes all of its
            clients if it has fewer), or null for n - f.
        neighbours, f, fraction: See ``Krum``.
        weighting: p_i over the selected clients: ``uniform`` or ``samples``.
    """

    def __init__(self, m: int | None = None, **kwargs):
        super().__init__(**kwargs)
        check(
            m is None or (isinstance(m, int) and not isinstance(m, bool) and m >= 1),
            "m",
            m,
            "null (n - f) or an integer >= 1",
        )
        self.m = m

    def bind(self, context: Context) -> None:
        super().bind(context)
        n = context.schedule.cohort_size(context.num_clients)
        if self.m is not None and self.m > self.rows(n):
            rows = f"{self.rows(n)} buckets of the {n} clients" if self.pre == "bucketing" else f"{n} clients"
            raise ConfigError("aggregator.m", self.m, f"an integer from 1 to the {rows} a round")

    def robust(self, x, f, report):
        n = len(x)
        order, scores = self.ranking(x, f)
        chosen = order[: min(self.m, n) if self.m is not None else n - f].cpu().numpy()
        p = self.base_weights(report)
        alpha = np.zeros(n)
        alpha[chosen] = p[chosen] / p[chosen].sum()
        update = torch.as_tensor(alpha, dtype=x.dtype, device=x.device) @ x
        return update, alpha, {"robust/score_min": float(scores[order[0]])}


class Bulyan(ByzantineRobust):
    """Bulyan (El Mhamdi et al. 2018) over Krum: theta = n - 2f clients chosen one at a time by Krum over those not yet
    chosen, then per coordinate the mean of the beta = theta - 2f chosen values closest to the chosen values' median.
    Breakdown n >= 4f + 3. Unweighted.

    Krum counts n' - f - 2 neighbours among the n' clients left, at least 1 (as Flower does): the last choices leave
    fewer clients than Krum's own breakdown point needs, and with no neighbour every score would tie. Ties go to the
    lower cohort position. f = 0 is the mean.

    alpha_i: the share of the coordinates' averaged values that client i gave (0 for the n - theta never chosen).
    """

    BREAKDOWN = "n >= 4f + 3"
    CITATION = "El Mhamdi et al. 2018"

    def tolerates(self, n, f):
        return n >= 4 * f + 3

    def robust(self, x, f, report):
        n = len(x)
        squared, left, chosen = squared_distances(x), list(range(n)), []
        for _ in range(n - 2 * f):
            among = squared[left][:, left]  # distances do not change as clients are chosen: computed once
            best = int(krum_scores(among, max(1, len(left) - f - 2)).argmin())  # the first of equal scores
            chosen.append(left.pop(best))
        chosen = sorted(chosen)  # ties in the coordinate-wise step go to the lower cohort position
        selected = x[chosen]
        median, _ = coordinate_median(selected)
        update, share = closest_mean(median, selected, len(chosen) - 2 * f)
        alpha = np.zeros(n)
        alpha[chosen] = share
        return update, alpha, {}


class GeoMed(ByzantineRobust):
    """Geometric median by the smoothed Weiszfeld algorithm (RFA, Pillutla et al. 2022, Algorithm 2):
    z <- sum_i beta_i x_i / sum_i beta_i with beta_i = p_i / max(nu, ||x_i - z||), from z = the weighted mean, for at
    most ``iterations`` steps, stopping once the objective sum_i p_i ||x_i - z|| improves by less than
    ``tolerance`` times itself. The defaults are the authors' code (krishnap25/RFA: nu 1e-5, 4 iterations, ftol 1e-6,
    sample-count weights); ByzFL's GeometricMedian is nu 0.1, 3 iterations, no tolerance, from z = 0, uniform.
    Breakdown n > 2f (f only checks the cohort).

    alpha: the last step's normalised weights beta_i / sum_j beta_j, the update's exact coefficients.

    Args:
        nu: The smoothing nu > 0 (the least distance a weight divides by).
        iterations: Weiszfeld steps at most, >= 1.
        tolerance: The relative objective improvement below which it stops (0: run every step).
        start: ``mean`` (the weighted mean, RFA) or ``zero`` (ByzFL).
        f, fraction: See ``ByzantineRobust``.
        weighting: p_i, the weights of the median (``samples``: RFA's).
    """

    COLUMNS = ("robust/iterations", "robust/objective")
    CITATION = "Pillutla et al. 2022"

    def __init__(
        self,
        nu: float = 1e-5,
        iterations: int = 4,
        tolerance: float = 1e-6,
        start: str = "mean",
        weighting: str = "samples",
        **kwargs,
    ):
        super().__init__(weighting=weighting, **kwargs)
        check(isinstance(nu, (int, float)) and nu > 0, "nu", nu, "a number > 0")
        check(isinstance(iterations, int) and iterations >= 1, "iterations", iterations, "an integer >= 1")
        check(isinstance(tolerance, (int, float)) and tolerance >= 0, "tolerance", tolerance, "a number >= 0")
        check(start in ("mean", "zero"), "start", start, "mean (RFA) or zero (ByzFL)")
        self.nu, self.iterations, self.tolerance, self.start = nu, iterations, tolerance, start

    def robust(self, x, f, report):
        p = torch.as_tensor(self.base_weights(report), dtype=x.dtype, device=x.device)
        z = p @ x if self.start == "mean" else torch.zeros_like(x[0])
        objective = float(p @ (x - z).norm(dim=1))
        steps = 0
        while steps < self.iterations:
            beta = p / (x - z).norm(dim=1).clamp(min=self.nu)
            weights = beta / beta.sum()
            z, steps = weights @ x, steps + 1
            previous, objective = objective, float(p @ (x - z).norm(dim=1))
            if abs(previous - objective) < self.tolerance * objective:
                break
        own = {"robust/iterations": float(steps), "robust/objective": objective}
        return z, weights.cpu().numpy(), own


class CenteredClip(RobustAggregator):
    """Centered clipping (Karimireddy et al. 2021): from a starting point v, ``iterations`` times
    v <- v + sum_i q_i (x_i - v) min(1, tau / ||x_i - v||), with q_i = 1 / n (the paper's) or the weighting's p_i.
    The paper starts from the previous round's aggregate (``previous``: zero in round 1 and after a restart with
    nothing saved; kept as state); ``zero`` is ByzFL's first call, ``median`` the round's coordinate-wise median.
    tau 10 and one iteration are the middle of the authors' grid (tau 0.1, 10, 1000; l = 1, 3, 5); ByzFL defaults to
    tau 100, Blades to tau 10 and 5 iterations.

    alpha: client i's coefficient in v = gamma v_0 + sum_i alpha_i x_i, carried through the iterations (sum alpha
    + gamma = 1; gamma, the weight left on the starting point, is ``robust/start_weight``). ``robust/clipped``: the
    clients clipped in the last iteration.

    Args:
        tau: The clipping radius > 0.
        iterations: Clipping iterations l >= 1.
        start: ``previous``, ``zero`` or ``median``.
        weighting: q_i: ``uniform`` (the paper's 1 / n) or ``samples``.
    """

    STATE = ("previous",)  # the last aggregate, the next round's start (``start=previous``)
    COLUMNS = ("robust/clipped", "robust/start_weight")
    alpha_is_share = False  # sum alpha = 1 - gamma: the rest stays on the starting point

    def __init__(
        self,
        tau: float = 10.0,
        iterations: int = 1,
        start: str = "previous",
        weighting: str = "uniform",
        pre: str = "none",
        bucket_size: int = 2,
    ):
        super().__init__(weighting, pre, bucket_size)
        check(isinstance(tau, (int, float)) and tau > 0, "tau", tau, "a number > 0")
        check(isinstance(iterations, int) and iterations >= 1, "iterations", iterations, "an integer >= 1")
        check(start in ("previous", "zero", "median"), "start", start, "previous (the paper's), zero or median")
        self.tau, self.iterations, self.start = tau, iterations, start
        self.previous: torch.Tensor | None = None

    def robust(self, x, f, report):
        q = torch.as_tensor(self.base_weights(report), dtype=x.dtype, device=x.device)
        if self.start == "median":
            v = coordinate_median(x)[0]
        elif self.start == "previous" and self.previous is not None:
            v = self.previous.to(x)
        else:
            v = torch.zeros_like(x[0])
        alpha, gamma = torch.zeros_like(q), 1.0
        for _ in range(self.iterations):
            distance = (x - v).norm(dim=1)
            # min(1, tau / ||x_i - v||), 1 where x_i = v (nothing to clip)
            scale = torch.where(distance > self.tau, self.tau / distance.clamp(min=self.tau), torch.ones_like(q))
            step = q * scale
            v = v + step @ (x - v)
            kept = 1.0 - float(step.sum())
            alpha, gamma = alpha * kept + step, gamma * kept
        if self.start == "previous":
            self.previous = v.clone()
        own = {"robust/clipped": float((distance > self.tau).sum()), "robust/start_weight": gamma}
        return v, alpha.cpu().numpy(), own


class NormBound(RobustAggregator):
    """Norm bounding (Sun et al. 2019, "Can you really backdoor federated learning?"): each update is clipped to norm
    at most ``bound`` (x_i min(1, bound / ||x_i||)), then the clipped updates are averaged with p_i (FedAvg's weights).
    A bound above every update's norm is FedAvg.

    alpha_i = p_i min(1, bound / ||x_i||), client i's coefficient in the update (below p_i when clipped; the sum is
    below 1 when any is). ``robust/clipped``: the clients clipped; ``robust/norm_median``: the median update norm,
    to choose the bound from.

    Args:
        bound: The norm bound M > 0.
        weighting: p_i: ``samples`` (Sun et al.'s, as FedAvg) or ``uniform``.
    """

    COLUMNS = ("robust/clipped", "robust/norm_median")
    alpha_is_share = False  # p_i scaled down where clipped: the sum is below 1

    def __init__(self, bound: float = 5.0, weighting: str = "samples"):
        super().__init__(weighting)
        check(isinstance(bound, (int, float)) and bound > 0, "bound", bound, "a number > 0")
        self.bound = bound

    def robust(self, x, f, report):
        norms = x.norm(dim=1)
        scale = torch.where(norms > self.bound, self.bound / norms.clamp(min=self.bound), torch.ones_like(norms))
        alpha = torch.as_tensor(self.base_weights(report), dtype=x.dtype, device=x.device) * scale
        own = {"robust/clipped": float((norms > self.bound).sum()), "robust/norm_median": float(norms.quantile(0.5))}
        return alpha @ x, alpha.cpu().numpy(), own


class FLTrust(RobustAggregator):
    """FLTrust (Cao, Fang, Liu and Gong 2021, "FLTrust: Byzantine-robust federated learning via trust
    bootstrapping", NDSS, Algorithm 1 and Eq. 1-4): the server trains the round's global model on its own root set
    (``root_size`` training samples drawn from the seed and held out of every client, ``FederatedData.root``) with
    the clients' local work, which gives g_0 (the view's ``server_update``). Each update gets the trust score
    TS_i = ReLU(cos(g_i, g_0)) (Eq. 1), is rescaled to g_0's norm, g_i ||g_0|| / ||g_i|| (Eq. 2), and the update is
    sum_i TS_i g_i ||g_0|| / ||g_i|| / sum_j TS_j (Eq. 3); a round where every score is 0 (every update points away
    from g_0) gives the zero update. The paper's root set is 100 samples for MNIST.

    alpha_i = TS_i ||g_0|| / (||g_i|| sum_j TS_j), client i's coefficient in the update (its sum is not 1 unless every
    norm equals ||g_0||). ``robust/trust_min`` and ``robust/trust_mean``: the scores' minimum and mean.

    Args:
        root_size: Samples in the server's root set (>= 1).
        weighting: Unused by the rule (its weights are the trust scores); kept for the common alpha_distance.
    """

    COLUMNS = ("robust/trust_min", "robust/trust_mean")
    alpha_is_share = False  # trust rescaled by ||g_0|| / ||g_i||: an attacker's alpha grows as its update shrinks

    def __init__(self, root_size: int = 100, weighting: str = "uniform"):
        super().__init__(weighting)
        check(
            isinstance(root_size, int) and not isinstance(root_size, bool) and root_size >= 1,
            "root_size",
            root_size,
            "an integer >= 1",
        )
        self.root_size = root_size

    def robust(self, x, f, report):
        g0 = report.server_update.to(x)
        norm0, norms = g0.norm(), x.norm(dim=1)
        cosine = (x @ g0) / (norms * norm0).clamp(min=torch.finfo(x.dtype).tiny)
        trust = cosine.clamp(min=0.0)  # ReLU: an update against g_0 is not trusted at all
        own = {"robust/trust_min": float(trust.min()), "robust/trust_mean": float(trust.mean())}
        if float(trust.sum()) == 0.0:
            return torch.zeros_like(g0), np.zeros(len(x)), own
        alpha = trust * norm0 / norms.clamp(min=torch.finfo(x.dtype).tiny) / trust.sum()
        return alpha @ x, alpha.cpu().numpy(), own
