"""Computational heterogeneity: how much local work each cohort client does in a round (``heterogeneity`` group)."""

import math

import numpy as np

from fedrun.cohort import LocalWork
from fedrun.errors import check
from fedrun.seeding import numpy_rng


class EqualWork:
    """``heterogeneity=none``: every client does the schedule's work."""

    # Capabilities (fedrun.compat).
    equal_work = True
    drops_clients = False  # whether some cohort clients drop out of a round after the draw

    def plan(
        self,
        round_: int,
        cohort: np.ndarray,
        sizes: np.ndarray,
        work: LocalWork,
        seed: int,
        counts: np.ndarray | None = None,
    ) -> list[LocalWork | None]:
        """Each cohort client's work this round, or None for a client that drops out. ``counts``: how many of the
        round's draws each cohort client took (a sampler with replacement; None: one each)."""
        return [work] * len(cohort)


def full_steps(size: int, work: LocalWork) -> int:
    """The mini-batch steps of the schedule's work for a client of this size."""
    return work.local_steps if work.local_steps is not None else math.ceil(size / work.batch_size) * work.local_epochs


class RandomSteps(EqualWork):
    """Local steps drawn per client uniformly from [low, high], fixed per client or redrawn every round.

    Args:
        low, high: Inclusive bounds on the number of local mini-batch steps (>= 1).
        redraw: Draw again every round instead of once per client.
    """

    equal_work = False

    def __init__(self, low: int = 1, high: int = 50, redraw: bool = False):
        check(isinstance(low, int) and low >= 1, "low", low, "an integer >= 1")
        check(isinstance(high, int) and high >= low, "high", high, f"an integer >= low={low}")
        self.low, self.high, self.redraw = low, high, redraw

    def plan(self, round_, cohort, sizes, work, seed, counts=None):
        keys = [(round_, int(c)) if self.redraw else (int(c),) for c in cohort]
        return [
            LocalWork(work.batch_size, local_steps=int(numpy_rng(seed, "work", *k).integers(self.low, self.high + 1)))
            for k in keys
        ]


class Stragglers(EqualWork):
    """FedProx's protocol: each round a ``fraction`` of the cohort straggles. In ``partial`` mode a straggler
    does a uniformly random number of steps in [1, its full work]; in ``drop`` mode it drops out of the round.

    The fraction is of the round's draws: int(fraction * m) of the m draws straggle, chosen uniformly, and a client
    drawn more than once (``sampler=importance`` draws with replacement) does the work of its first draw. Which
    draws straggle does not depend on who was drawn, so a client's chance of straggling, int(fraction * m) / m, is
    the same whatever else the draw holds, and importance sampling's estimate stays unbiased: E[sum_k alpha_k
    Delta_k] = sum_k q_k E[Delta_k], each client's update averaged over the stragglers' law. Counting the fraction
    over the distinct clients instead made a client drawn twice (fewer distinct clients) straggle less often. With
    one draw per client (every sampler without replacement) the draws are the clients, as in FedProx.

    Args:
        fraction: Share of the cohort that straggles, in [0, 1) (at least one client always finishes).
        mode: ``partial`` or ``drop``.
    """

    equal_work = False

    @property
    def drops_clients(self) -> bool:
        return self.mode == "drop"

    def __init__(self, fraction: float = 0.5, mode: str = "partial"):
        check(0 <= fraction < 1, "fraction", fraction, "a number in [0, 1)")
        check(mode in ("partial", "drop"), "mode", mode, "partial or drop")
        self.fraction, self.mode = fraction, mode

    def plan(self, round_, cohort, sizes, work, seed, counts=None):
        rng = numpy_rng(seed, "stragglers", round_)
        counts = np.ones(len(cohort), dtype=np.int64) if counts is None else np.asarray(counts)
        draws = int(counts.sum())  # the cohort's clients in sorted order, each repeated as often as it was drawn
        first = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else counts  # each client's first draw
        straggling = rng.choice(draws, size=int(self.fraction * draws), replace=False)
        stragglers = set(np.flatnonzero(np.isin(first, straggling)).tolist())
        plan = []
        for i, size in enumerate(sizes):
            if i not in stragglers:
                plan.append(work)
            elif self.mode == "partial":
                plan.append(
                    LocalWork(work.batch_size, local_steps=int(rng.integers(1, full_steps(int(size), work) + 1)))
                )
            else:
                plan.append(None)
        return plan
