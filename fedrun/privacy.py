"""Privacy accounting: the (epsilon, delta) that a run's private rounds guarantee, computed by Google's dp-accounting.

Each private round is one event of user-level DP-FedAvg (McMahan et al. 2018): every update of the round's cohort is
clipped to l2 norm C, Gaussian noise of std z * C is added to their sum, and the sum is divided by a fixed
denominator D (post-processing). D is q N or m: it depends on the number of clients N, which is therefore public,
and neighbouring datasets have the same N. Which event a round is depends on how its cohort was drawn, and the
ledger records what ran (``schedule.sampling``):

- ``poisson``: each client joins with probability q on its own. Neighbours differ in one client's data, replaced by
  a client that contributes nothing (zero-out; dp-accounting's ``REPLACE_SPECIAL``, Kairouz et al. 2021): the sum
  moves by at most C, so the event is ``PoissonSampled(q, Gaussian(z))``, amplified by sampling. (Add-or-remove-one
  would change N and with it D, which the noised update reveals: it is not claimed.)
- ``fixed`` with m < N clients a round: a sample of m drawn without replacement. dp-accounting has that event for
  replace-one neighbours only (Wang, Balle and Kasiviswanathan 2019, Theorem 27; RDP only), where replacing one
  client's data moves the sum by up to ||v_j - v_j'|| <= 2C: the noise is z * C = (z / 2) * 2C, so the event is
  ``SampledWithoutReplacement(N, m, Gaussian(z / 2))``, its noise multiplier relative to that sensitivity as
  dp-accounting's RDP code defines it. (Its PLD accountant instead takes the per-client bound and doubles it
  itself; ``tests/test_privacy.py`` checks the two conventions against each other.) That bound is loose: for some
  m and z it is above the plain Gaussian(z / 2) without amplification, which holds too; the smaller of the two is
  reported (and calibrated).
- full participation (``fixed`` with every client each round): no amplification, ``Gaussian(z)``, zero-out.

The ledger is plain data (``state_dict``): the event's parameters and how many rounds ran, so a resumed run
replays it into a fresh accountant and reports the same epsilon as an uninterrupted one. Epsilon is always computed
from the whole ledger (one self-composed event), never accumulated round by round, so it does not depend on where
a run was stopped.
"""

import contextlib
import logging
import math

import dp_accounting
import numpy as np
import torch
from dp_accounting import pld, rdp
from dp_accounting.mechanism_calibration import NoBracketIntervalFoundError

from fedrun.errors import ConfigError, check
from fedrun.pipeline import clip_rows
from fedrun.seeding import torch_generator
from fedrun.state import Stateful

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "fixed")
ZERO_OUT, REPLACE_ONE = "zero_out", "replace_one"  # the neighbouring relations (N public in both)


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
    zero-out otherwise."""
    return REPLACE_ONE if sampling == "fixed" and cohort < num_clients else ZERO_OUT


def bounds(noise_multiplier: float, sampling: str, num_clients: int, cohort: int | None, rate: float | None) -> list:
    """The events whose epsilon is a valid bound for one round (the smallest is reported): the round's event, and
    for a fixed-size sample also the Gaussian(z / 2) without amplification (replace-one)."""
    events = [round_event(noise_multiplier, sampling, num_clients, cohort, rate)]
    if neighbours(sampling, num_clients, cohort) == REPLACE_ONE:
        events.append(dp_accounting.GaussianDpEvent(noise_multiplier / 2))
    return events


@contextlib.contextmanager
def quiet_absl():
    """dp-accounting warns through absl for every RDP order it drops as non-convergent (dozens a call at large q);
    the orders left give a valid bound, so those warnings are kept out of a run's output."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def make_accountant(kind: str, relation: str):
    """A fresh dp-accounting accountant: ``rdp`` (Renyi DP, Mironov 2017, at dp-accounting's default orders) or
    ``pld`` (privacy loss distributions, tighter and slower)."""
    neighbouring = dp_accounting.NeighboringRelation
    relation_enum = neighbouring.REPLACE_ONE if relation == REPLACE_ONE else neighbouring.REPLACE_SPECIAL
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
        self._cache: dict[int, float] = {}  # epsilon by rounds (a function of the event and delta only)

    def step(self, rounds: int = 1) -> None:
        """Record ``rounds`` more private rounds."""
        self.rounds += rounds

    def epsilon(self, rounds: int | None = None) -> float:
        """Epsilon at ``delta`` after the ledger's rounds (or ``rounds``); inf for z = 0, 0 before any round. The
        smallest over ``bounds``; cached (a PLD takes about a second)."""
        rounds = self.rounds if rounds is None else rounds
        if rounds == 0:
            return 0.0
        if self.event["noise_multiplier"] == 0:
            return math.inf
        if rounds not in self._cache:
            values = []
            for event in bounds(**self.event):
                accountant = make_accountant(self.kind, self.relation)
                with quiet_absl():
                    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
                    values.append(float(accountant.get_epsilon(self.delta)))
            self._cache[rounds] = min(values)
        return self._cache[rounds]

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
    most ``target_epsilon`` at ``delta`` (``dp_accounting.calibrate_dp_mechanism`` for each of ``bounds``; the
    reported epsilon is their smallest, so the smallest z that brings any of them to the target)."""
    check(target_epsilon > 0, "target_epsilon", target_epsilon, "a number > 0")
    relation = neighbours(sampling, num_clients, cohort)
    found = []
    for k in range(len(bounds(1.0, sampling, num_clients, cohort, rate))):

        def event(z: float, k=k):
            return dp_accounting.SelfComposedDpEvent(bounds(z, sampling, num_clients, cohort, rate)[k], rounds)

        try:
            with quiet_absl():
                found.append(
                    dp_accounting.calibrate_dp_mechanism(
                        lambda: make_accountant(kind, relation),
                        event,
                        target_epsilon,
                        delta,
                        bracket_interval=dp_accounting.ExplicitBracketInterval(1e-3, 1e3),
                        tol=1e-6,
                    )
                )
        except (ValueError, NoBracketIntervalFoundError):
            continue
    if not found:
        raise ConfigError(
            "target_epsilon",
            target_epsilon,
            f"an epsilon some noise multiplier in [0.001, 1000] gives in {rounds} rounds",
        )
    return float(min(found))


class Privacy(Stateful):
    """The ``privacy`` group: none, or user-level DP-FedAvg with central noise (McMahan et al. 2018, "Learning
    differentially private recurrent language models", Algorithm 1 with the fixed denominator of its
    estimator f~_f; as Flower's server-side fixed clipping and pfl's central Gaussian mechanism).

    Each round, every cohort update Delta_i is clipped to l2 norm C (Delta_i * min(1, C / ||Delta_i||)), Gaussian
    noise N(0, (z C)^2 I) is added to their sum, and the sum is divided by a fixed denominator D: the expected
    cohort size q N with Poisson sampling, m with a fixed one. Every client weighs 1 / D whatever its data, so the
    sum's sensitivity is C (add-or-remove; 2C replace-one, see ``round_event``) and the update
    Delta = (sum_i clip(Delta_i) + noise) / D is the mechanism's output; the server optimizer then steps on it
    (post-processing). A round that samples nobody still adds the noise. The noise comes from its own stream
    (seed, round): the same on every backend and device.

    The epsilon logged each round (``epsilon``, at ``delta``) is what the rounds run so far guarantee for the
    released global models, by dp-accounting (``Accountant``). fedrun's other per-round numbers computed on
    clients' data (``train_loss``, ``client_accuracy``, alpha, the clip statistics) are measurements of the
    simulation, outside that guarantee.

    Args:
        mechanism: ``none`` or ``central``.
        noise_multiplier: z (give it or ``target_epsilon``).
        clip_norm: C > 0.
        delta: delta of the reported epsilon.
        accountant: ``rdp`` or ``pld``.
        target_epsilon: Calibrate z so that the run's ``schedule.rounds`` rounds give this epsilon.
        max_epsilon: Stop the run, FINISHED, before the round that would take epsilon above this.
    """

    def __init__(
        self,
        mechanism: str = "none",
        noise_multiplier: float | None = None,
        clip_norm: float = 1.0,
        delta: float = 1e-5,
        accountant: str = "rdp",
        target_epsilon: float | None = None,
        max_epsilon: float | None = None,
    ):
        check(mechanism in ("none", "central"), "mechanism", mechanism, "none or central")
        self.mechanism = mechanism
        if mechanism == "none":
            return
        check(
            (noise_multiplier is None) != (target_epsilon is None),
            "noise_multiplier",
            noise_multiplier,
            "a number >= 0, or null with target_epsilon set (one of the two)",
        )
        check(noise_multiplier is None or noise_multiplier >= 0, "noise_multiplier", noise_multiplier, "a number >= 0")
        check(isinstance(clip_norm, (int, float)) and clip_norm > 0, "clip_norm", clip_norm, "a number > 0")
        check(isinstance(delta, float) and 0 < delta < 1, "delta", delta, "a number in (0, 1)")
        check(accountant in ACCOUNTANTS, "accountant", accountant, "rdp or pld")
        check(target_epsilon is None or target_epsilon > 0, "target_epsilon", target_epsilon, "null or a number > 0")
        check(max_epsilon is None or max_epsilon > 0, "max_epsilon", max_epsilon, "null or a number > 0")
        self.noise_multiplier = None if noise_multiplier is None else float(noise_multiplier)
        self.clip_norm, self.delta, self.kind = float(clip_norm), float(delta), accountant
        self.target_epsilon, self.max_epsilon = target_epsilon, max_epsilon
        self.ledger: Accountant | None = None
        self.denominator, self.seed, self.stopped = None, 0, ""

    def __bool__(self) -> bool:
        return self.mechanism != "none"

    def check(self, aggregator, engine, heterogeneity, pipeline=None, schedule=None) -> None:
        """Refuse, before training, what this mechanism's accounting does not cover."""
        from fedrun.aggregators import FedAvg
        from fedrun.engine import SyncEngine
        from fedrun.heterogeneity import EqualWork

        if not self:
            return
        if not isinstance(engine, SyncEngine):
            raise ConfigError("engine", "async", "sync with privacy=central (asynchronous privacy is not accounted)")
        if type(aggregator) is not FedAvg:
            raise ConfigError(
                "aggregator",
                type(aggregator).__name__,
                "fedavg with privacy=central (weights that follow the clients' losses, steps or data would change "
                "the sensitivity the noise is calibrated to)",
            )
        if aggregator.weighting != "uniform":
            raise ConfigError(
                "aggregator.weighting",
                aggregator.weighting,
                "uniform with privacy=central (DP-FedAvg weighs every client 1 / D; sample counts are private)",
            )
        if heterogeneity is not None and type(heterogeneity) is not EqualWork:
            raise ConfigError(
                "heterogeneity",
                type(heterogeneity).__name__,
                "none with privacy=central (stragglers that drop out change the sampling that is accounted; the "
                "other options are not checked against the accounting yet)",
            )
        for i, stage in enumerate(getattr(pipeline, "stages", [])):
            if stage.crosses_clients():
                raise ConfigError(
                    f"pipeline.stages.{i}",
                    type(stage).__name__,
                    "a stage that acts on each update alone with privacy=central (one that adapts to the round's "
                    "clients, as adaptive clipping without its noised count, carries them into later rounds "
                    "unaccounted)",
                )
        if schedule is not None and schedule.stop_at_accuracy is not None and schedule.stop_on != "test":
            raise ConfigError(
                "schedule.stop_on",
                schedule.stop_on,
                "test with privacy=central and stop_at_accuracy (the clients' held-out accuracy is un-noised client "
                "data: stopping on it would release it)",
            )

    def bind(self, schedule, num_clients: int, seed: int) -> None:
        """Set the accounting for this run's sampling and rounds (and calibrate z for ``target_epsilon``)."""
        if not self:
            return
        poisson = schedule.sampling == "poisson"
        cohort = None if poisson else schedule.cohort_size(num_clients)
        rate = schedule.clients_per_round if poisson else None
        if self.noise_multiplier is None:
            self.noise_multiplier = calibrate(
                self.target_epsilon,
                self.delta,
                schedule.rounds,
                schedule.sampling,
                num_clients,
                cohort,
                rate,
                self.kind,
            )
        try:
            self.ledger = Accountant(
                self.noise_multiplier, self.delta, schedule.sampling, num_clients, cohort, rate, self.kind
            )
        except ConfigError as exc:
            raise exc.within("privacy") from None
        if self.delta >= 1 / num_clients:
            raise ConfigError(
                "privacy.delta",
                self.delta,
                f"a delta below 1 / N = {1 / num_clients:.3g} (a delta of 1 / N allows releasing one client's data "
                "outright)",
            )
        self.denominator = rate * num_clients if poisson else float(cohort)
        self.seed = seed
        if self.max_epsilon is not None and self.ledger.epsilon(1) > self.max_epsilon:
            raise ConfigError(
                "privacy.max_epsilon",
                self.max_epsilon,
                f"at least {self.ledger.epsilon(1):.4g}, the epsilon of one round with z = {self.noise_multiplier:g}",
            )

    def exceeds(self) -> bool:
        """Whether the next round would take epsilon above ``max_epsilon`` (then the run stops before it)."""
        if not self or self.max_epsilon is None:
            return False
        after = self.ledger.epsilon(self.ledger.rounds + 1)
        if after > self.max_epsilon:
            self.stopped = (
                f"max_epsilon {self.max_epsilon:g}: round {self.ledger.rounds + 1} would bring epsilon to {after:.4g}"
            )
            return True
        return False

    def aggregate(self, deltas: torch.Tensor, params: torch.Tensor, round_: int):
        """The round's noised update (an ``Aggregation``: the update, alpha = 1 / D each, the round's numbers)."""
        from fedrun.aggregators import Aggregation

        # A client's non-finite update (its local training diverged) is sent as zero: one client's data must not be
        # able to stop the run, which a non-finite sum would.
        finite = torch.isfinite(deltas).all(dim=1)
        deltas = torch.where(finite[:, None], deltas, torch.zeros_like(deltas))
        clipped, norms, over = clip_rows(deltas, self.clip_norm)
        alpha = np.full(len(deltas), 1.0 / self.denominator)
        total = torch.as_tensor(alpha, dtype=deltas.dtype, device=deltas.device) @ clipped
        std = self.noise_multiplier * self.clip_norm
        noise = torch.randn(
            params.numel(), generator=torch_generator(self.seed, "privacy", round_), dtype=torch.float64
        )
        update = (total if len(deltas) else torch.zeros_like(params)) + (std * noise / self.denominator).to(
            dtype=params.dtype, device=params.device
        )
        self.ledger.step()
        return Aggregation(
            update,
            alpha,
            {
                "epsilon": self.ledger.epsilon(),
                "clip_norm": self.clip_norm,
                "clipped_fraction": float(over.double().mean()) if len(deltas) else math.nan,
                "update_norm_mean": float(norms.double().mean()) if len(deltas) else math.nan,
                "noise_std": std,
                "nonfinite_updates": float((~finite).sum()),
            },
        )

    def run_tags(self) -> dict[str, str]:
        if not self:
            return {}
        tags = {
            "privacy_noise_multiplier": f"{self.noise_multiplier:.6g}",
            "privacy_neighbours": self.ledger.relation if self.ledger else "",
            "privacy_accountant": self.kind,
        }
        if self.stopped:
            tags["stopped_by"] = self.stopped
        return tags

    def state_dict(self) -> dict:
        return {"ledger": self.ledger.state_dict()} if self and self.ledger else {}

    def load_state_dict(self, state: dict) -> None:
        if not self:
            return
        if state.get("ledger") is None:  # the rounds already run must be counted
            raise ConfigError("privacy", self.mechanism, "a run whose checkpoint holds its privacy ledger")
        self.ledger.load_state_dict(state["ledger"])
