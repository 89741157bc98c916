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
  dp-accounting's RDP code defines it (``_compute_rdp_sample_wor_gaussian``: alpha / (2 sigma^2) at m = N, no
  doubling of its own). That bound is loose: for some m and z it is above the plain Gaussian mechanism without
  amplification, which holds too; the smaller of the two is reported (and calibrated). dp-accounting's PLD
  accountant has no event for a sample without replacement: ``accountant=pld`` is refused there, with a noise
  multiplier or a target epsilon alike, before any calibration.
- The replace-one Gaussian mechanism (the fallback above, and local DP) is written once, ``replace_one_gaussian``:
  the sensitivity 2C is counted exactly once for each accountant. dp-accounting's RDP reads a GaussianDpEvent's
  noise multiplier over the sensitivity whatever the relation, so the event is Gaussian(z / 2); its PLD accountant
  builds a replace-one Gaussian's loss from the two shifted distributions, which doubles the per-client bound
  itself, so the event is Gaussian(z) (``tests/unit/test_privacy.py`` pins both against the exact Gaussian mechanism).
- full participation (``fixed`` with every client each round): no amplification, ``Gaussian(z)``, zero-out.

With ``mechanism: local`` each client clips and noises its own update before sending it (local DP): the server sees
every noised update and who sent it, so there is no amplification by sampling, and a client's guarantee is the
composition of one Gaussian mechanism per round it took part in. Its neighbours are any two datasets of that client
(replace-one: the clipped update moves by up to 2C, the noise is z C, so the event is ``Gaussian(z / 2)`` for RDP;
``local_event``). The ledger counts each client's rounds and the logged epsilon is the worst client's.

What the epsilon covers (``COVERS``, also the run's tag ``privacy_epsilon_covers``): the released global models
(with ``local``, each noised update) for one client's data, all its rounds, against an observer who does not know
who was drawn in each round nor the noise. A simulation shows both: each round's cohort is written to the run dir
and to MLflow (``selected.csv``, ``alpha.csv``, ``cohort_size``, ``upload_mb``) although amplification by sampling
assumes it secret, and the noise is a function of the logged seed (two runs with one seed share their noise).
Neighbours differ in one client, so with ``partition=population``, where a training sample belongs to hundreds of
synthetic clients, the epsilon is per synthetic client, not per sample. It is the epsilon a deployment with this
sampling and noise would give, not a guarantee of what this run dir or its MLflow run discloses.

The ledger is plain data (``state_dict``): the event's parameters and how many rounds ran, so a resumed run
replays it into a fresh accountant and reports the same epsilon as an uninterrupted one. Epsilon is always computed
from the whole ledger (one self-composed event), never accumulated round by round, so it does not depend on where
a run was stopped.

The mechanism in the round. ``Privacy`` (the ``privacy`` group) is the configuration, the accountant and the ledger:
``bind`` calibrates and sets the accounting, ``exceeds`` stops a run before its epsilon would pass ``max_epsilon``,
``state_dict`` is the ledger. What it does to the updates are parts of the round, which ``Privacy.attach`` places
once, when the run is built, among the run's stages and around its aggregator; the engine then runs them as any
other stage and aggregator:

- ``central``: a ``CentralClip`` stage after the others (the server clips what the clients sent) and the run's FedAvg
  wrapped in ``CentralNoise`` (the fixed denominator, the noise, the ledger's step, adaptive clipping's noised
  count).
- ``local``: a ``LocalNoise`` stage before compression (each client clips and noises, then compresses its noised
  update: post-processing), so that the upload is counted as the message the client sends (``Stage.sent_bits``).

A new mechanism is one class, one YAML file and its tests: the class (a ``Privacy`` subclass with its own
``MECHANISMS``) says in ``attach`` which stage or aggregation it adds where and in ``bind_ledger`` how it is
accounted, with its parts beside it here; the YAML file ``conf/privacy/<name>.yaml`` names it as ``_target_``;
the accountant and the ledger stay this module's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from dataclasses import dataclass

import numpy as np

from fedrun.aggregators import Aggregation, Aggregator
from fedrun.compression import dense_bits
from fedrun.errors import ConfigError, check
from fedrun.lazy import torch
from fedrun.pipeline import Stage, check_clip_rule, clip_rows, geometric_clip_step, number
from fedrun.seeding import torch_generator
from fedrun.state import Stateful


class _Accounting:
    """``dp_accounting``, imported when a privacy run first needs it: the library imports scipy's signal and stats
    (0.7 s), which every run and every refused config would otherwise pay (``scripts/bench_cli_start.py``)."""

    def __getattr__(self, name: str):
        import dp_accounting
        import dp_accounting.mechanism_calibration  # noqa: F401  (its NoBracketIntervalFoundError)
        import dp_accounting.pld  # noqa: F401
        import dp_accounting.rdp  # noqa: F401

        return getattr(dp_accounting, name)


dp_accounting = _Accounting()

ACCOUNTANTS = ("rdp", "pld")
COVERS = (
    "epsilon covers the released models (local: each noised update) for one client's data over all its rounds, "
    "if each round's cohort and the noise stay secret. This run does not keep them secret: its dir and MLflow run "
    "log each round's cohort (selected.csv, alpha.csv, cohort_size, upload_mb), which amplification by sampling "
    "assumes hidden, and the noise follows the logged seed (runs with one seed share their noise). Neighbours "
    "differ in one client: with partition=population a training sample belongs to many synthetic clients, and "
    "epsilon is per synthetic client, not per sample."
)
SAMPLINGS = ("poisson", "fixed")
ZERO_OUT, REPLACE_ONE = "zero_out", "replace_one"  # the neighbouring relations (N public in both)


# The ratio of the noise's expected norm on the averaged update to the clip norm above which a run is warned: the
# MNIST preset that learns (experiment=dp_mnist: z = 0.83 for epsilon 8, 34,826 parameters, 50 clients a round)
# is at 3.1; the digits data's 20 clients with z = 0.8 and q = 0.1 (2 a round, 21,386 parameters) at 58, and with
# q = 0.3 at 19.5, where accuracy stayed at chance (issue 40).
SWAMPED = 10.0


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
    """m of N clients drawn without replacement, for replace-one neighbours (RDP only: dp-accounting's PLD has no
    such event): the clipped sum's sensitivity is 2C, so the noise multiplier relative to it is z / 2."""
    return dp_accounting.SampledWithoutReplacementDpEvent(num_clients, cohort, replace_one_gaussian(noise_multiplier))


def replace_one_gaussian(noise_multiplier: float, kind: str = "rdp"):
    """The Gaussian mechanism of noise z C on a sum whose replace-one sensitivity is 2C (one client's clipped update
    replaced by another), as each accountant reads it: ``Gaussian(z / 2)`` for RDP, which takes the noise over the
    sensitivity; ``Gaussian(z)`` for PLD, whose replace-one Gaussian already shifts by twice the per-client bound.
    The factor 2 is counted once, here, for either."""
    return dp_accounting.GaussianDpEvent(noise_multiplier / 2 if kind == "rdp" else noise_multiplier)


def check_accountant(kind: str, relation: str) -> None:
    """Refuse PLD for a fixed-size sample of some clients (replace-one): dp-accounting's PLD has no event for it."""
    if kind == "pld" and relation == REPLACE_ONE:
        raise ConfigError(
            "accountant",
            kind,
            "rdp with schedule.sampling=fixed and fewer clients than all (dp-accounting's PLD has no event for "
            "a fixed-size sample), or schedule.sampling=poisson",
        )


def neighbours(sampling: str, num_clients: int, cohort: int | None) -> str:
    """The neighbouring relation the epsilon holds for: replace-one for a fixed-size sample of some clients,
    zero-out otherwise."""
    return REPLACE_ONE if sampling == "fixed" and cohort < num_clients else ZERO_OUT


def bounds(
    noise_multiplier: float,
    sampling: str,
    num_clients: int,
    cohort: int | None,
    rate: float | None,
    kind: str = "rdp",
) -> list:
    """The events whose epsilon is a valid bound for one round (the smallest is reported): the round's event, and
    for a fixed-size sample also the replace-one Gaussian without amplification (``replace_one_gaussian``: its
    sensitivity 2C counted once for ``kind``)."""
    events = [round_event(noise_multiplier, sampling, num_clients, cohort, rate)]
    if neighbours(sampling, num_clients, cohort) == REPLACE_ONE:
        events.append(replace_one_gaussian(noise_multiplier, kind))
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
        return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation_enum)
    return dp_accounting.pld.PLDAccountant(neighboring_relation=relation_enum)


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
        check(number(noise_multiplier) and noise_multiplier >= 0, "noise_multiplier", noise_multiplier, "a number >= 0")
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
        check_accountant(kind, self.relation)
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
        smallest over ``events``; cached (a PLD takes about a second)."""
        rounds = self.rounds if rounds is None else rounds
        if rounds == 0:
            return 0.0
        if self.event["noise_multiplier"] == 0:
            return math.inf
        if rounds not in self._cache:
            values = []
            for event in self.events():
                accountant = make_accountant(self.kind, self.relation)
                with quiet_absl():
                    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
                    values.append(float(accountant.get_epsilon(self.delta)))
            self._cache[rounds] = min(values)
        return self._cache[rounds]

    def events(self) -> list:
        """The events whose epsilon bounds one round (``bounds``)."""
        return bounds(**self.event, kind=self.kind)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "delta": self.delta, "event": dict(self.event), "rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        self.check_same_config(state)
        self.rounds = int(state["rounds"])

    def check_same_config(self, state: dict) -> None:
        """A saved ledger made for other events (another config) is refused."""
        mine = {"kind": self.kind, "delta": self.delta, "event": self.event}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise ConfigError("privacy", theirs, f"the ledger of this run's config ({mine})")


def local_event(noise_multiplier: float, kind: str):
    """One round of one client under local DP (replace-one, sensitivity 2C, noise z C): ``replace_one_gaussian``."""
    return replace_one_gaussian(noise_multiplier, kind)


class LocalAccountant(Accountant):
    """Local DP's ledger: how many rounds each client has sent a noised update in. Each client's epsilon is that
    many self-composed ``local_event``; the worst client's is reported (``Accountant.epsilon`` of the most rounds
    any client ran).

    Args:
        noise_multiplier: z.
        delta: The delta of the reported (epsilon, delta), for each client.
        num_clients: N.
        kind: ``rdp`` or ``pld``.
    """

    relation = REPLACE_ONE

    def __init__(self, noise_multiplier: float, delta: float, num_clients: int, kind: str = "rdp"):
        check(kind in ACCOUNTANTS, "accountant", kind, "rdp or pld")
        self.kind, self.delta = kind, float(delta)
        self.event = {"noise_multiplier": float(noise_multiplier), "num_clients": int(num_clients)}
        self.counts = np.zeros(num_clients, dtype=np.int64)
        self._cache: dict[int, float] = {}

    @property
    def rounds(self) -> int:
        """The most rounds any one client has taken part in."""
        return int(self.counts.max(initial=0))

    def step(self, clients) -> None:
        """Record a round in which ``clients`` (indices) sent noised updates."""
        np.add.at(self.counts, np.asarray(clients, dtype=np.int64), 1)

    def events(self) -> list:
        return [local_event(self.event["noise_multiplier"], self.kind)]

    def state_dict(self) -> dict:
        return {"kind": self.kind, "delta": self.delta, "event": dict(self.event), "counts": self.counts.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.check_same_config(state)
        self.counts = np.asarray(state["counts"], dtype=np.int64)


def calibrate_events(events, relation: str, kind: str, target_epsilon: float, delta: float, rounds: int) -> float:
    """The smallest z (to dp-accounting's tolerance, rounded up) for which some event of ``events(z)`` (a list of
    valid bounds for one round) composed ``rounds`` times gives at most ``target_epsilon`` at ``delta``
    (``dp_accounting.calibrate_dp_mechanism`` for each bound)."""
    check(number(target_epsilon) and target_epsilon > 0, "target_epsilon", target_epsilon, "a number > 0")
    found = []
    for k in range(len(events(1.0))):

        def event(z: float, k=k):
            return dp_accounting.SelfComposedDpEvent(events(z)[k], rounds)

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
        except (ValueError, dp_accounting.mechanism_calibration.NoBracketIntervalFoundError):
            continue
    if not found:
        raise ConfigError(
            "target_epsilon",
            target_epsilon,
            f"an epsilon some noise multiplier in [0.001, 1000] gives in {rounds} rounds",
        )
    return float(min(found))


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
    reported epsilon is their smallest, so the smallest z that brings any of them to the target). What the
    accountant cannot account is refused first (``check_accountant``), as it is with a noise multiplier given."""
    check_accountant(kind, neighbours(sampling, num_clients, cohort))
    return calibrate_events(
        lambda z: bounds(z, sampling, num_clients, cohort, rate, kind),
        neighbours(sampling, num_clients, cohort),
        kind,
        target_epsilon,
        delta,
        rounds,
    )


def update_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """z_Delta of adaptive clipping (Andrew et al. 2021, Theorem 1): the update's noise multiplier that, released
    together with the unclipped count noised with std sigma_b (sensitivity 1/2 once centred), makes one Gaussian
    mechanism of multiplier z: z^-2 = z_Delta^-2 + (2 sigma_b)^-2, so z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2).
    Needs 2 sigma_b > z; z = 0 gives 0."""
    if noise_multiplier == 0:
        return 0.0
    return (noise_multiplier**-2 - (2 * count_noise) ** -2) ** -0.5


def clip_finite(deltas: torch.Tensor, bound: float) -> tuple[torch.Tensor, Clipped]:
    """Each update clipped to l2 norm ``bound`` (``clip_rows``), a non-finite one (its local training diverged) first
    sent as zero: one client's data must not be able to stop the run, which a non-finite sum would. Returns the
    clipped rows and the round's clip statistics."""
    finite = torch.isfinite(deltas).all(dim=1)
    deltas = torch.where(finite[:, None], deltas, torch.zeros_like(deltas))
    clipped, norms, over = clip_rows(deltas, bound)
    return clipped, Clipped(bound, norms, over, finite)


@dataclass(frozen=True)
class Clipped:
    """One round's clipping: the bound C it used, each update's norm before clipping, which were over C, and which
    were finite. What the mechanism logs and adaptive clipping counts."""

    bound: float
    norms: torch.Tensor
    over: torch.Tensor
    finite: torch.Tensor

    def diagnostics(self, epsilon: float, noise_std: float) -> dict[str, float]:
        """The round's numbers, named and ordered as the mechanism has always logged them."""
        some = len(self.norms) > 0  # an empty round (Poisson) has no clip statistics
        return {
            "epsilon": epsilon,
            "clip_norm": self.bound,
            "clipped_fraction": float(self.over.double().mean()) if some else math.nan,
            "update_norm_mean": float(self.norms.double().mean()) if some else math.nan,
            "noise_std": noise_std,
            "nonfinite_updates": float((~self.finite).sum()),
        }


class CentralClip(Stage):
    """Central DP's clipping, the mechanism's stage: each update clipped to this round's C (``clip_finite``). It keeps
    the round's statistics (``last``) for ``CentralNoise``, which logs them and counts them for adaptive clipping.

    C is the mechanism's (``Privacy.clip_norm``, saved in its state with ``adaptive``); this stage keeps nothing
    between rounds. It does not cross clients (``crosses_clients``): C moves only through the noised and accounted
    count of ``CentralNoise``.

    Args:
        mechanism: The bound ``Privacy`` whose C this stage clips to.
    """

    name = "privacy"
    STATE = ()

    def __init__(self, mechanism: Privacy):
        self.mechanism = mechanism
        self.last: tuple[int, Clipped] | None = None  # (round, its statistics): the round the aggregation reads

    def __call__(self, deltas, clients, round_):
        clipped, stats = clip_finite(deltas, self.mechanism.clip_norm)
        self.last = (round_, stats)
        return clipped, {}  # logged by the aggregation, with the noise they come with

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class CentralNoise(Aggregator):
    """User-level DP-FedAvg's aggregation (McMahan et al. 2018, Algorithm 1): the clipped updates summed with weight
    1 / D each, D fixed (``Privacy.denominator``), plus N(0, (z_Delta C)^2 I) / D from the stream (seed, round): an
    empty round releases the noise alone. Then the ledger's step, adaptive clipping's noised count (Andrew et al.
    2021), and ``epsilon_deployment``. Its updates must have passed its ``CentralClip`` this round.

    It wraps the run's FedAvg with uniform weighting (every client alike, as the sensitivity needs; the weights are
    1 / D, not FedAvg's 1 / m): that aggregator's state and tags are this one's, so a checkpoint's ``aggregator``
    entry is what it was.

    Args:
        aggregator: The run's FedAvg, ``weighting: uniform``.
        mechanism: The bound ``Privacy`` (z, C, D, the ledger and the noise streams).
        clip: The stage that clipped this round's updates.
    """

    def __init__(self, aggregator: Aggregator, mechanism: Privacy, clip: CentralClip):
        check_uniform(aggregator, mechanism.mechanism)
        super().__init__("uniform")
        self.inner, self.mechanism, self.clip = aggregator, mechanism, clip
        self.alpha_informative = aggregator.alpha_informative
        self.alpha_is_share = aggregator.alpha_is_share

    def weights(self, report) -> np.ndarray:
        return np.full(len(report.clients), 1.0 / self.mechanism.denominator)

    def aggregate(self, global_params, deltas, report) -> Aggregation:
        mechanism = self.mechanism
        if getattr(report, "sampled_weights", None) is not None:
            raise ConfigError(
                "sampler", "importance", f"uniform with privacy={mechanism.mechanism} (weights of its own change D)"
            )
        if self.clip.last is None or self.clip.last[0] != report.round or len(self.clip.last[1].norms) != len(deltas):
            raise RuntimeError(
                f"round {report.round}: CentralNoise aggregates updates that its CentralClip did not clip this round "
                "(give the engine the stages Privacy.attach returned)"
            )
        stats = self.clip.last[1]
        alpha = np.full(len(deltas), 1.0 / mechanism.denominator)
        total = torch.as_tensor(alpha, dtype=deltas.dtype, device=deltas.device) @ deltas
        total = total if len(deltas) else torch.zeros_like(global_params)  # nobody sampled: the noise alone
        std = mechanism.update_noise * stats.bound
        noise = std * mechanism.noise(global_params.numel(), report.round) / mechanism.denominator
        update = total + noise.to(global_params)
        mechanism.ledger.step()
        more = {}
        if mechanism.adaptive:
            more["unclipped_fraction_noised"] = self._adapt(stats.over, report.round)
        if mechanism.deployment is not None:
            mechanism.deployment.step()
            more["epsilon_deployment"] = mechanism.deployment.epsilon()
        return Aggregation(update, alpha, {**stats.diagnostics(mechanism.ledger.epsilon(), std), **more})

    def combine(self, alpha, deltas, report) -> Aggregation:
        raise ConfigError(
            "sampler", "importance", f"uniform with privacy={self.mechanism.mechanism} (weights of its own change D)"
        )

    def _adapt(self, over: torch.Tensor, round_: int) -> float:
        """Adaptive clipping's step (Andrew et al. 2021, Algorithm 1): the noised centred count of unclipped
        updates gives b~, and C <- C exp(-eta (b~ - gamma)) for the next round. Returns b~."""
        mechanism = self.mechanism
        # sum_i (b_i - 1/2): sensitivity 1/2 (zero-out; 1 replace-one, as the update's C doubles to 2C: z holds)
        centred = float((~over).double().sum()) - len(over) / 2
        noised = centred + mechanism.count_noise * float(mechanism.noise(1, round_, stream="privacy_count")[0])
        unclipped = noised / mechanism.denominator + 0.5
        mechanism.clip_norm = geometric_clip_step(
            mechanism.clip_norm, unclipped, mechanism.target_quantile, mechanism.clip_lr
        )
        return unclipped

    def reference(self, keep: np.ndarray) -> CentralNoise:
        """A copy whose clip statistics are those of the clients ``keep`` selects (it checks that its updates were
        clipped this round, one statistic each)."""
        copied = super().reference(keep)
        if copied.clip.last is not None:
            round_, stats = copied.clip.last
            rows = torch.as_tensor(np.asarray(keep, dtype=bool), device=stats.norms.device)
            copied.clip.last = (round_, Clipped(stats.bound, stats.norms[rows], stats.over[rows], stats.finite[rows]))
        return copied

    def bind(self, context) -> None:
        self.inner.bind(context)  # the mechanism is a part of the run, bound on its own

    def run_tags(self) -> dict[str, str]:
        return self.inner.run_tags()

    def state_dict(self) -> dict:
        return self.inner.state_dict()  # C and the ledger are the mechanism's (``Privacy.state_dict``)

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


class LocalNoise(Stage):
    """Local DP's stage: each client clips its update to C (``clip_finite``) and adds its own N(0, (z C)^2 I), drawn
    from its stream (seed, round, client) whoever else is in the round; the ledger counts a round for each of them.
    The server then averages what it receives (the run's FedAvg, uniform): post-processing.

    It comes before the compression stage (``Privacy.attach``): a client compresses its noised update (still
    post-processing), so what is uploaded is the compressor's message. The noise makes an update dense
    (``sent_bits``). It logs the mechanism's numbers under their own names (``epsilon``, ``clip_norm``, ...), as
    before, not under a stage prefix.

    Args:
        mechanism: The bound ``Privacy`` (z, C, the ledger and the noise streams).
    """

    name = "privacy"
    STATE = ()

    def __init__(self, mechanism: Privacy):
        self.mechanism = mechanism

    def __call__(self, deltas, clients, round_):
        mechanism = self.mechanism
        check(len(clients) == len(deltas), "clients", len(clients), f"one id per update ({len(deltas)})")
        clipped, stats = clip_finite(deltas, mechanism.clip_norm)
        std = mechanism.update_noise * stats.bound
        if len(deltas):
            d = deltas.shape[1]
            noise = torch.stack([std * mechanism.noise(d, round_, int(i)) for i in clients])
            clipped = clipped + noise.to(clipped)
        mechanism.ledger.step(clients)
        return clipped, stats.diagnostics(mechanism.ledger.epsilon(), std)

    def sent_bits(self, d: int, bits: float) -> float:
        # Noise on every coordinate: a dense message, at least one float32 a coordinate (the dense update as
        # stored when that came in: float64 parameters send float64 noise).
        return max(bits, dense_bits(d))

    def state_dict(self) -> dict:
        return {}  # the ledger is the mechanism's (``Privacy.state_dict``)

    def load_state_dict(self, state: dict) -> None:
        pass


def sets_message(stage: Stage, d: int = 1000) -> bool:
    """Whether ``stage`` sets its message's size whatever came before (a compressor: ``sent_bits`` ignores the bits
    it is given), the capability local noise is placed before."""
    return stage.sent_bits(d, 1.0) == stage.sent_bits(d, 2.0)


def check_uniform(aggregator, mechanism: str) -> None:
    """DP-FedAvg weighs every client alike (sample counts are private, and the sensitivity is per client)."""
    weighting = getattr(aggregator, "weighting", None)
    if weighting != "uniform":  # the privacy options choose uniform: this one was set after them
        raise ConfigError(
            "aggregator.weighting",
            weighting,
            f"uniform with privacy={mechanism}, which privacy={mechanism} sets by itself (DP-FedAvg weighs every "
            "client alike; sample counts are private)",
        )


class Privacy(Stateful):
    """The ``privacy`` group: none, user-level DP-FedAvg with central noise, or local DP.

    ``central`` (McMahan et al. 2018, "Learning differentially private recurrent language models", Algorithm 1 with
    the fixed denominator of its estimator f~_f; as Flower's server-side fixed clipping and pfl's central Gaussian
    mechanism): each round, every cohort update Delta_i is clipped to l2 norm C (Delta_i * min(1, C / ||Delta_i||)),
    Gaussian noise N(0, (z C)^2 I) is added to their sum, and the sum is divided by a fixed denominator D: the
    expected cohort size q N with Poisson sampling, m with a fixed one. Every client weighs 1 / D whatever its data,
    so the sum's sensitivity is C (zero-out; 2C replace-one, see ``round_event``) and the update
    Delta = (sum_i clip(Delta_i) + noise) / D is the mechanism's output; the server optimizer then steps on it
    (post-processing). A round that samples nobody still adds the noise.

    With ``adaptive`` (Andrew et al. 2021, "Differentially private learning with adaptive clipping", Algorithm 1
    with the centred count of its section 3): the round clips with its C, counts the updates whose norm was at
    most C (b_i = 1, the *unclipped* ones), releases the centred count sum_i (b_i - 1/2) + N(0, sigma_b^2) (its
    sensitivity is 1/2), estimates the unclipped fraction b~ = that / D + 1/2, and moves C <- C exp(-eta (b~ - gamma))
    for the next round. The update's noise is z_Delta C with the C this round clipped with, and
    z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) (``update_noise_multiplier``), so the two releases together are one
    Gaussian mechanism of multiplier z: the ledger accounts z, as for fixed clipping. sigma_b defaults to the
    expected cohort over 20 (Andrew et al.'s recommendation, section 3.1).

    ``local``: each client clips its update to C and adds N(0, (z C)^2 I) itself (its own noise stream), and the
    server averages the noised updates it received (uniform FedAvg over the round's cohort: post-processing). See
    ``LocalAccountant`` for the epsilon (the worst client's; no amplification by sampling).

    The clipping and noise are parts of the round (``attach``: ``CentralClip`` and ``CentralNoise``, ``LocalNoise``);
    this object holds what they share: z, C (moved by adaptive clipping), D, the ledger and the noise streams.

    The noise comes from its own streams (seed, round[, client]): the same on every backend and device. The epsilon
    logged each round (``epsilon``, at ``delta``) is what the rounds run so far guarantee for the global models
    (with ``local``, each noised update), by dp-accounting, if the cohorts and the noise stay secret; the run writes
    the cohorts down and the noise follows its logged seed (``COVERS``, the tag ``privacy_epsilon_covers``, says
    so on every private run). fedrun's other per-round numbers computed on clients' data (``train_loss``,
    ``client_accuracy``, the clip statistics) are measurements of the simulation, outside that guarantee.

    ``deployment_clients`` and ``deployment_cohort`` (central only) also log ``epsilon_deployment``: the epsilon of
    a larger, hypothetical deployment (pfl-research's benchmarks report this one) that adds the same noise to the
    averaged update: Poisson sampling of cohort / clients, z_dep = z * cohort / D. It is not this run's epsilon.

    Args:
        mechanism: ``none``, ``central`` or ``local``.
        noise_multiplier: z (give it or ``target_epsilon``).
        clip_norm: C > 0 (with ``adaptive``: its initial value).
        delta: delta of the reported epsilon.
        accountant: ``rdp`` or ``pld``.
        target_epsilon: Calibrate z so that the run's ``schedule.rounds`` rounds give this epsilon (``local``: for
            a client in every round, the bound whatever is drawn).
        max_epsilon: Stop the run, FINISHED, before the round that would take epsilon above this (``local``: that
            could take some client above it).
        adaptive: Adaptive clipping (``central``).
        target_quantile: gamma in [0, 1] (Andrew et al.: 0.5).
        clip_lr: eta > 0, the geometric step (Andrew et al.: 0.2).
        clip_count_noise: sigma_b > z / 2; null: the expected cohort / 20.
        deployment_clients, deployment_cohort, deployment_delta: The hypothetical deployment of
            ``epsilon_deployment`` and its delta (below 1 / deployment_clients).
    """

    MECHANISMS = ("none", "central", "local")  # a subclass for a new mechanism names its own

    def __init__(
        self,
        mechanism: str = "none",
        noise_multiplier: float | None = None,
        clip_norm: float = 1.0,
        delta: float = 1e-5,
        accountant: str = "rdp",
        target_epsilon: float | None = None,
        max_epsilon: float | None = None,
        adaptive: bool = False,
        target_quantile: float = 0.5,
        clip_lr: float = 0.2,
        clip_count_noise: float | None = None,
        deployment_clients: int | None = None,
        deployment_cohort: int | None = None,
        deployment_delta: float | None = None,
    ):
        check(mechanism in self.MECHANISMS, "mechanism", mechanism, ", ".join(self.MECHANISMS))
        self.mechanism = mechanism
        if mechanism == "none":
            return
        check(
            (noise_multiplier is None) != (target_epsilon is None),
            "noise_multiplier",
            noise_multiplier,
            "a number >= 0, or null with target_epsilon set (one of the two)",
        )
        # number(): Python's bool is an int, and clip_norm=true would clip to 1 without a word
        check(
            noise_multiplier is None or (number(noise_multiplier) and noise_multiplier >= 0),
            "noise_multiplier",
            noise_multiplier,
            "a number >= 0",
        )
        check(number(clip_norm) and clip_norm > 0, "clip_norm", clip_norm, "a number > 0")
        check(isinstance(delta, float) and 0 < delta < 1, "delta", delta, "a number in (0, 1)")
        check(accountant in ACCOUNTANTS, "accountant", accountant, "rdp or pld")
        check(
            target_epsilon is None or (number(target_epsilon) and target_epsilon > 0),
            "target_epsilon",
            target_epsilon,
            "null or a number > 0",
        )
        check(
            max_epsilon is None or (number(max_epsilon) and max_epsilon > 0),
            "max_epsilon",
            max_epsilon,
            "null or a number > 0",
        )
        check(isinstance(adaptive, bool), "adaptive", adaptive, "true or false")
        check(not adaptive or mechanism == "central", "adaptive", adaptive, "false with mechanism=local")
        check_clip_rule(target_quantile, clip_lr)
        check(
            clip_count_noise is None or (number(clip_count_noise) and clip_count_noise >= 0),
            "clip_count_noise",
            clip_count_noise,
            "null or a number >= 0",
        )
        deployment = (deployment_clients, deployment_cohort)
        check(
            deployment == (None, None)
            or (
                mechanism == "central"
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in deployment)
                and deployment_cohort <= deployment_clients
            ),
            "deployment_cohort",
            deployment_cohort,
            "null with deployment_clients null, or (mechanism=central) an integer in [1, deployment_clients]",
        )
        self.noise_multiplier = None if noise_multiplier is None else float(noise_multiplier)
        self.clip_norm, self.delta, self.kind = float(clip_norm), float(delta), accountant
        self.target_epsilon, self.max_epsilon = target_epsilon, max_epsilon
        self.adaptive, self.target_quantile, self.clip_lr = adaptive, float(target_quantile), float(clip_lr)
        self.count_noise = clip_count_noise
        self.deployment_clients, self.deployment_cohort = deployment
        self.deployment_delta = deployment_delta
        if self.deployment_clients is not None:
            check(
                deployment_delta is not None and 0 < deployment_delta < 1 / self.deployment_clients,
                "deployment_delta",
                deployment_delta,
                f"a delta below 1 / deployment_clients = {1 / self.deployment_clients:.3g} (the deployment's own "
                "delta: one below 1 / N for its N)",
            )
        self._given = (self.noise_multiplier, clip_count_noise)  # the config's; bind() computes from them anew
        self.ledger: Accountant | LocalAccountant | None = None
        self.deployment: Accountant | None = None
        self.update_noise = None  # z_Delta: z, or more with adaptive clipping (z^-2 = z_Delta^-2 + (2 sigma_b)^-2: the count takes part of the budget)
        self.denominator, self.seed, self.stopped = None, 0, ""
        self._warned: str | None = None  # the swamped-noise line, printed once (a run binds twice)

    def __bool__(self) -> bool:
        return self.mechanism != "none"

    def bind(self, context) -> None:
        """Set the accounting for this run's sampling and rounds (and calibrate z for ``target_epsilon``)."""
        if not self:
            return
        schedule, num_clients, seed = context.schedule, context.num_clients, context.seed
        self.noise_multiplier, self.count_noise = self._given
        poisson = schedule.sampling == "poisson"
        cohort = None if poisson else schedule.cohort_size(num_clients)
        rate = schedule.clients_per_round if poisson else None
        if self.delta >= 1 / num_clients:
            raise ConfigError(
                "privacy.delta",
                self.delta,
                f"a delta below 1 / N = {1 / num_clients:.3g} (a delta of 1 / N allows releasing one client's data "
                "outright)",
            )
        self.denominator = rate * num_clients if poisson else float(cohort)  # central's D: the expected cohort
        if self.mechanism == "central" and self.denominator < 1:
            # Below one expected client each weight 1 / D exceeds 1: the noise and a lone client's update are
            # multiplied, not averaged (q N = 0.02 took a test loss to 8e8). One client is the floor that keeps D an
            # average; a higher one would be a judgement on utility, which z and C already make the user's.
            raise ConfigError(
                "schedule.clients_per_round",
                rate,
                f"a rate of at least 1 / N = {1 / num_clients:.3g} with privacy=central and schedule.sampling=poisson "
                f"(an expected cohort q N = {self.denominator:.3g} below one client: the fixed denominator q N would "
                "multiply the noise instead of averaging it)",
            )
        try:
            self.bind_ledger(schedule, num_clients, cohort, rate)
        except ConfigError as exc:
            raise exc.within("privacy") from None
        self.seed = seed
        if self.max_epsilon is not None and self.ledger.epsilon(1) > self.max_epsilon:
            raise ConfigError(
                "privacy.max_epsilon",
                self.max_epsilon,
                f"at least {self.ledger.epsilon(1):.4g}, the epsilon of one round with z = {self.noise_multiplier:g}",
            )
        if context.layout and (line := self.swamped(context.layout[-1][2])) and line != self._warned:
            print(line, file=sys.stderr)  # a warning, not a refusal: that point of the trade-off may be the one wanted
            self._warned = line

    def swamped(self, dimension: int) -> str | None:
        """The one-line warning when the noise on the averaged update swamps it: its expected norm over the clip
        norm C, z sqrt(d) / D centrally (noise N(0, (z C)^2 I) on a sum divided by D) or z sqrt(d / D) locally (each
        client's own noise, averaged over D), above ``SWAMPED``; None otherwise. An average of clipped updates is
        at most C long, so the ratio bounds how much larger the noise is than the signal."""
        z, d, denominator = self.update_noise, dimension, self.denominator
        ratio = z * math.sqrt(d) / denominator if self.mechanism == "central" else z * math.sqrt(d / denominator)
        if not ratio > SWAMPED:
            return None
        return (
            f"fedrun: warning: the privacy noise swamps the update: its expected norm on the averaged update is "
            f"{ratio:.3g} times the clip norm (z = {z:.3g}, d = {d:,} parameters, D = {denominator:.3g} expected "
            "clients a round); more clients a round (schedule.clients_per_round, partition.num_clients) or less noise "
            "(privacy.noise_multiplier, a larger privacy.target_epsilon) lowers it"
        )

    def bind_ledger(self, schedule, num_clients: int, cohort: int | None, rate: float | None) -> None:
        """Calibrate z if asked and set the ledger (and ``update_noise``) for this mechanism; a new mechanism
        overrides it with its own accounting."""
        if self.mechanism == "local":
            self._bind_local(schedule.rounds, num_clients)
        else:
            self._bind_central(schedule, num_clients, cohort, rate)

    def _bind_local(self, rounds: int, num_clients: int) -> None:
        if self.noise_multiplier is None:  # a client may be drawn every round: calibrated for all of them
            self.noise_multiplier = calibrate_events(
                lambda z: [local_event(z, self.kind)], REPLACE_ONE, self.kind, self.target_epsilon, self.delta, rounds
            )
        self.ledger = LocalAccountant(self.noise_multiplier, self.delta, num_clients, self.kind)
        self.update_noise = self.noise_multiplier

    def _bind_central(self, schedule, num_clients: int, cohort: int | None, rate: float | None) -> None:
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
        self.ledger = Accountant(
            self.noise_multiplier, self.delta, schedule.sampling, num_clients, cohort, rate, self.kind
        )
        self.update_noise = self.noise_multiplier
        if self.adaptive:
            if self.count_noise is None:
                self.count_noise = self.denominator / 20
            if self.noise_multiplier > 0 and not 2 * self.count_noise > self.noise_multiplier:
                raise ConfigError(
                    "clip_count_noise",
                    self.count_noise,
                    f"above z / 2 = {self.noise_multiplier / 2:.4g} (the count takes part of the noise budget: "
                    "z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2), Andrew et al. 2021)",
                )
            self.update_noise = update_noise_multiplier(self.noise_multiplier, self.count_noise)
        if self.deployment_clients is not None:
            # The same noise on the averaged update: z_dep C / m_dep = z C / D.
            self.deployment = Accountant(
                self.noise_multiplier * self.deployment_cohort / self.denominator,
                float(self.deployment_delta),
                "poisson",
                self.deployment_clients,
                rate=self.deployment_cohort / self.deployment_clients,
                kind=self.kind,
            )

    def exceeds(self) -> bool:
        """Whether the next round would take epsilon above ``max_epsilon`` (then the run stops before it)."""
        if not self or self.max_epsilon is None:
            return False
        after = self.ledger.epsilon(self.ledger.rounds + 1)
        which = "round" if self.mechanism == "central" else "a client's round"  # local: the most any client ran
        if after > self.max_epsilon:
            self.stopped = (
                f"max_epsilon {self.max_epsilon:g}: {which} {self.ledger.rounds + 1} would bring epsilon to {after:.4g}"
            )
            return True
        return False

    def noise(self, n: int, round_: int, *keys: int, stream: str = "privacy") -> torch.Tensor:
        """n standard normal draws of ``stream`` under (seed, round, keys), in float64 on the CPU."""
        return torch.randn(n, generator=torch_generator(self.seed, stream, round_, *keys), dtype=torch.float64)

    def attach(self, aggregator: Aggregator, stages: list) -> tuple[Aggregator, list]:
        """The mechanism's parts in the round, called once when the run is built: the aggregator and the stages the
        engine runs instead of ``aggregator`` and ``stages`` (a new list; the parts read this object's z, C, D and
        ledger when they run, so binding may come before or after).

        - ``none``: both unchanged.
        - ``central``: ``stages`` then a ``CentralClip``, and the aggregator wrapped in ``CentralNoise``. The clip
          comes last: the server clips and noises what the clients sent (a compressor's message, as before).
        - ``local``: a ``LocalNoise`` stage before the first stage that sets the message's size (a compressor,
          ``sets_message``), or last; the aggregator unchanged (FedAvg, uniform: the server's plain average).

        Both need the aggregator's weighting uniform (refused otherwise)."""
        stages = list(stages)
        if not self:
            return aggregator, stages
        check_uniform(aggregator, self.mechanism)
        if self.mechanism == "central":
            clip = CentralClip(self)
            return CentralNoise(aggregator, self, clip), [*stages, clip]
        at = next((i for i, stage in enumerate(stages) if sets_message(stage)), len(stages))
        return aggregator, [*stages[:at], LocalNoise(self), *stages[at:]]

    def run_tags(self) -> dict[str, str]:
        if not self:
            return {}
        tags = {
            "privacy_epsilon_covers": COVERS,
            "privacy_noise_multiplier": f"{self.noise_multiplier:.6g}",
            "privacy_neighbours": self.ledger.relation if self.ledger else "",
            "privacy_accountant": self.kind,
        }
        if self.adaptive:
            tags["privacy_update_noise_multiplier"] = f"{self.update_noise:.6g}"
            tags["privacy_clip_count_noise"] = f"{self.count_noise:.6g}"
        if self.deployment is not None:
            tags["privacy_deployment"] = (
                f"epsilon_deployment: {self.deployment_cohort} of {self.deployment_clients} clients a round "
                f"(Poisson, zero-out), z = {self.deployment.event['noise_multiplier']:.6g}, delta = "
                f"{self.deployment_delta:g}; not this run's epsilon"
            )
        if self.stopped:
            tags["stopped_by"] = self.stopped
        return tags

    def state_dict(self) -> dict:
        if not self or not self.ledger:
            return {}
        state = {"ledger": self.ledger.state_dict()}
        if self.adaptive:
            state["clip_norm"] = self.clip_norm
        if self.deployment is not None:
            state["deployment"] = self.deployment.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if not self:
            return
        if state.get("ledger") is None:  # the rounds already run must be counted
            raise ConfigError("privacy", self.mechanism, "a run whose checkpoint holds its privacy ledger")
        self.ledger.load_state_dict(state["ledger"])
        for key, wanted in (("clip_norm", self.adaptive), ("deployment", self.deployment is not None)):
            if wanted and key not in state:
                raise ConfigError(
                    "privacy", self.mechanism, f"a run whose checkpoint holds its {key} (saved without it)"
                )
        if self.adaptive:
            self.clip_norm = float(state["clip_norm"])
        if self.deployment is not None:
            self.deployment.load_state_dict(state["deployment"])
