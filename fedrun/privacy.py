"""Privacy accounting: the (epsilon, delta) that a run's private rounds guarantee, computed by Google's dp-accounting.

Each private round is one event of user-level DP-FedAvg (McMahan et al. 2018; Andrew et al. 2021): every update of
the round's cohort is clipped to l2 norm C, Gaussian noise of std z * C is added to their sum, and the sum is
divided by a fixed denominator (post-processing). Which event that is depends on how the cohort was drawn, and the
ledger records what ran (``schedule.sampling``):

- ``poisson``: each client joins with probability q on its own. Add-or-remove-one neighbours; the sum moves by at
  most C when one client's data is added or removed, so the event is ``PoissonSampled(q, Gaussian(z))``;
  amplified by sampling.
- ``fixed`` with m < N clients a round: a sample of m drawn without replacement. dp-accounting has that event for
  replace-one neighbours only (Wang, Balle and Kasiviswanathan 2019, Theorem 27; RDP only), where replacing one
  client's data moves the sum by up to ||v_j - v_j'|| <= 2C: the noise is z * C = (z / 2) * 2C, so the event is
  ``SampledWithoutReplacement(N, m, Gaussian(z / 2))``, its noise multiplier relative to that sensitivity as
  dp-accounting's RDP code defines it. (Its PLD accountant instead takes the per-client bound and doubles it
  itself; ``tests/test_privacy.py`` checks the two conventions against each other.) The epsilon is then for
  replace-one neighbours, which the run's tags say.
- full participation (``fixed`` with every client each round): no amplification, ``Gaussian(z)``, add-or-remove.

The ledger is plain data (``state_dict``): the events' parameters and how many rounds each ran, so a resumed run
replays it into a fresh accountant and reports the same epsilon as an uninterrupted one. Epsilon is always computed
from the whole ledger (one self-composed event per entry), never accumulated round by round, so it does not depend
on where a run was stopped.
"""

import math

import dp_accounting
from dp_accounting import pld, rdp

from fedrun.errors import ConfigError, check
from fedrun.state import Stateful

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "fixed")
ADD_OR_REMOVE, REPLACE_ONE = "add_or_remove_one", "replace_one"


def round_event(noise_multiplier: float, sampling: str, num_clients: int, cohort: int | None, rate: float | None):
    """The dp-accounting event of one private round (see the module docstring).

    Args:
        noise_multiplier: z, the noise std over the clip norm C.
        sampling: ``poisson`` (each client joins with probability ``rate``) or ``fixed`` (``cohort`` clients drawn
            without replacement; every client when ``cohort`` equals ``num_clients``).
        num_clients: N, the clients the cohort is drawn from.
        cohort: m, clients a round (``fixed``).
        rate: q, each client's probability of joining (``poisson``).
    """
    gaussian = dp_accounting.GaussianDpEvent
    if sampling == "poisson":
        return dp_accounting.PoissonSampledDpEvent(rate, gaussian(noise_multiplier))
    if cohort >= num_clients:
        return gaussian(noise_multiplier)
    return without_replacement(noise_multiplier, num_clients, cohort)


def without_replacement(noise_multiplier: float, num_clients: int, cohort: int):
    """m of N clients drawn without replacement, for replace-one neighbours: the clipped sum's sensitivity is 2C,
    so the noise multiplier relative to it is z / 2 (dp-accounting's RDP reads it that way)."""
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2)
    return dp_accounting.SampledWithoutReplacementDpEvent(num_clients, cohort, gaussian)


def neighbours(sampling: str, num_clients: int, cohort: int | None) -> str:
    """The neighbouring relation the epsilon holds for: replace-one for a fixed-size sample of some clients,
    add-or-remove-one otherwise."""
    return REPLACE_ONE if sampling == "fixed" and cohort < num_clients else ADD_OR_REMOVE


def make_accountant(kind: str, relation: str):
    """A fresh dp-accounting accountant: ``rdp`` (Renyi DP, Mironov 2017, at dp-accounting's default orders) or
    ``pld`` (privacy loss distributions, tighter and slower)."""
    neighbouring = dp_accounting.NeighboringRelation
    relation_enum = neighbouring.REPLACE_ONE if relation == REPLACE_ONE else neighbouring.ADD_OR_REMOVE_ONE
    if kind == "rdp":
        return rdp.RdpAccountant(neighboring_relation=relation_enum)
    return pld.PLDAccountant(neighboring_relation=relation_enum)


class Accountant(Stateful):
    """The ledger of a run's private rounds and the epsilon it gives at ``delta``.

    Args:
        noise_multiplier: z.
        delta: The delta of the reported (epsilon, delta).
        sampling, num_clients, cohort, rate: How each round's cohort is drawn (``round_event``).
        kind: ``rdp`` or ``pld`` (``pld`` has no event for a fixed-size sample of some clients: refused).
    """

    def __init__(
        self,
        noise_multiplier: float,
        delta: float,
        sampling: str,
        num_clients: int,
        cohort: int | None = None,
        rate: float | None = None,
        kind: str = "rdp",
    ):
        check(kind in ACCOUNTANTS, "accountant", kind, "rdp or pld")
        check(sampling in SAMPLINGS, "sampling", sampling, "poisson or fixed")
        check(
            isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0,
            "noise_multiplier",
            noise_multiplier,
            "a number >= 0",
        )
        check(isinstance(delta, float) and 0 < delta < 1, "delta", delta, "a number in (0, 1)")
        if sampling == "poisson":
            check(rate is not None and 0 < rate <= 1, "rate", rate, "a probability in (0, 1] with sampling=poisson")
        else:
            check(
                isinstance(cohort, int) and 1 <= cohort <= num_clients,
                "cohort",
                cohort,
                f"an integer in [1, {num_clients}] with sampling=fixed",
            )
        self.relation = neighbours(sampling, num_clients, cohort)
        if kind == "pld" and self.relation == REPLACE_ONE:
            raise ConfigError(
                "accountant",
                kind,
                "rdp with schedule.sampling=fixed and fewer clients than all (dp-accounting's PLD has no event for "
                "a fixed-size sample), or schedule.sampling=poisson",
            )
        self.kind, self.delta = kind, float(delta)
        self.event = {
            "noise_multiplier": float(noise_multiplier),
            "sampling": sampling,
            "num_clients": int(num_clients),
            "cohort": None if cohort is None else int(cohort),
            "rate": None if rate is None else float(rate),
        }
        self.rounds = 0  # the ledger: this many rounds of ``event``

    def step(self, rounds: int = 1) -> None:
        """Record ``rounds`` more private rounds."""
        self.rounds += rounds

    def epsilon(self, rounds: int | None = None) -> float:
        """Epsilon at ``delta`` after the ledger's rounds (or ``rounds``); inf for z = 0, 0 before any round."""
        rounds = self.rounds if rounds is None else rounds
        if rounds == 0:
            return 0.0
        if self.event["noise_multiplier"] == 0:
            return math.inf
        accountant = make_accountant(self.kind, self.relation)
        accountant.compose(dp_accounting.SelfComposedDpEvent(round_event(**self.event), rounds))
        return float(accountant.get_epsilon(self.delta))

    def state_dict(self) -> dict:
        return {"kind": self.kind, "delta": self.delta, "event": dict(self.event), "rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        """Take a saved ledger back; one made for other events (another config) is refused."""
        mine = {"kind": self.kind, "delta": self.delta, "event": self.event}
        theirs = {k: state[k] for k in mine}
        if theirs != mine:
            raise ConfigError("privacy", theirs, f"the ledger of this run's config ({mine})")
        self.rounds = int(state["rounds"])


def calibrate(
    target_epsilon: float,
    delta: float,
    rounds: int,
    sampling: str,
    num_clients: int,
    cohort: int | None = None,
    rate: float | None = None,
    kind: str = "rdp",
) -> float:
    """The smallest noise multiplier z (to dp-accounting's tolerance, rounded up) whose ``rounds`` rounds give at
    most ``target_epsilon`` at ``delta`` (``dp_accounting.calibrate_dp_mechanism``)."""
    check(target_epsilon > 0, "target_epsilon", target_epsilon, "a number > 0")
    relation = neighbours(sampling, num_clients, cohort)

    def event(z: float):
        return dp_accounting.SelfComposedDpEvent(round_event(z, sampling, num_clients, cohort, rate), rounds)

    return float(
        dp_accounting.calibrate_dp_mechanism(
            lambda: make_accountant(kind, relation),
            event,
            target_epsilon,
            delta,
            bracket_interval=dp_accounting.ExplicitBracketInterval(1e-3, 1e3),
            tol=1e-6,
        )
    )
