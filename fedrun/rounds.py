"""What both engines share: the schedule (rounds, local work, learning rate, evaluation, early stop), a run's
result, and the recorder that finishes each aggregation's metrics row. The synchronous engine (``fedrun.engine``)
and the asynchronous one (``fedrun.async_engine``) import it; neither imports the other."""

from __future__ import annotations

import math
import time
import typing
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from fedrun.cohort import LocalWork
from fedrun.errors import DivergenceError, check
from fedrun.lazy import torch
from fedrun.pipeline import upload_message_mb

if typing.TYPE_CHECKING:  # malicious_table imports it: a refusal on the way to a run (fedrun.compat imports this
    import pandas as pd  # module) needs no pandas

STOP_ON = {
    "test": ("test_accuracy",),
    "client": ("client_accuracy",),
    "both": ("test_accuracy", "client_accuracy"),
}  # the row columns
SAMPLINGS = ("fixed", "poisson")


@dataclass
class Schedule:
    """How long and how much each client trains.

    Args:
        rounds: Communication rounds, >= 1.
        local_epochs: Local epochs per round (used when ``local_steps`` is null).
        local_steps: Fixed number of local mini-batch steps per round, or null.
        batch_size: Local mini-batch size.
        clients_per_round: Fraction C in (0, 1] of the clients sampled each round (at least one with ``fixed``).
        cohort: Clients a round as a count (``fixed`` sampling), in place of ``clients_per_round``; null: use C.
            Cross-device papers give the count (10 a round in Reddi et al. 2021), whatever the population.
        sampling: How a round's cohort is drawn: ``fixed`` (round(C * N) clients without replacement, McMahan et
            al.'s FedAvg) or ``poisson`` (each client joins with probability C on its own, so the cohort's size
            varies and may be empty: the sampling that privacy amplification by subsampling assumes).
        lr_decay: Per-round multiplicative decay of the local learning rate (1 = none).
        eval_every: Evaluate every this many rounds (and always at the last round).
        stop_at_accuracy: Stop early once the accuracy ``stop_on`` names reaches this, or null.
        stop_on: ``test`` (the global model's test accuracy), ``client`` (the clients' local models on their own
            held-out data, ``client_accuracy``: the loss-weighted papers' measure) or ``both``.
        tail: The final rounds a run is judged on (``fedrun.metrics.tail``: the mean and swing of each accuracy over
            the evaluated rounds among them; ``fedrun-report``'s default accuracy). Evaluate every round within it
            (``eval_every``: 1) or a period-2 oscillation is invisible.
    """

    rounds: int = 50
    local_epochs: int = 2
    local_steps: int | None = None
    batch_size: int = 10
    clients_per_round: float = 1.0
    sampling: str = "fixed"
    cohort: int | None = None
    lr_decay: float = 1.0
    eval_every: int = 1
    stop_at_accuracy: float | None = None
    stop_on: str = "test"
    tail: int = 10

    def __post_init__(self):
        check(isinstance(self.rounds, int) and self.rounds >= 1, "rounds", self.rounds, "an integer >= 1")
        check(
            isinstance(self.local_epochs, int) and self.local_epochs >= 1,
            "local_epochs",
            self.local_epochs,
            "an integer >= 1",
        )
        check(
            self.local_steps is None or (isinstance(self.local_steps, int) and self.local_steps >= 1),
            "local_steps",
            self.local_steps,
            "null or an integer >= 1",
        )
        check(
            isinstance(self.batch_size, int) and self.batch_size >= 1, "batch_size", self.batch_size, "an integer >= 1"
        )
        check(0 < self.clients_per_round <= 1, "clients_per_round", self.clients_per_round, "a fraction in (0, 1]")
        check(
            self.sampling in SAMPLINGS,
            "sampling",
            self.sampling,
            "fixed (clients_per_round of the clients, drawn without replacement) or poisson (each client with "
            "probability clients_per_round)",
        )
        check(
            self.cohort is None
            or (isinstance(self.cohort, int) and not isinstance(self.cohort, bool) and self.cohort >= 1),
            "cohort",
            self.cohort,
            "null (clients_per_round decides) or an integer >= 1",
        )
        check(
            self.cohort is None or self.sampling == "fixed",
            "sampling",
            self.sampling,
            "fixed with schedule.cohort (poisson draws each client with probability clients_per_round)",
        )
        check(0 < self.lr_decay <= 1, "lr_decay", self.lr_decay, "a factor in (0, 1]")
        check(
            isinstance(self.eval_every, int) and self.eval_every >= 1, "eval_every", self.eval_every, "an integer >= 1"
        )
        check(
            self.stop_at_accuracy is None or 0 < self.stop_at_accuracy <= 1,
            "stop_at_accuracy",
            self.stop_at_accuracy,
            "null or a fraction in (0, 1]",
        )
        check(
            self.stop_on in STOP_ON,
            "stop_on",
            self.stop_on,
            "test, client (client_accuracy, with dataset.client_test_fraction > 0) or both",
        )
        check(
            isinstance(self.tail, int) and not isinstance(self.tail, bool) and self.tail >= 1,
            "tail",
            self.tail,
            "an integer >= 1 (the final rounds a run is judged on)",
        )

    @property
    def work(self) -> LocalWork:
        return LocalWork(self.batch_size, self.local_epochs, self.local_steps)

    def lr(self, base_lr: float, round_: int) -> float:
        """The local learning rate in round ``round_`` (1-based): base_lr * lr_decay^(round - 1). An asynchronous
        client that pulled server version v trains in round v + 1. The one place the decay is applied."""
        return base_lr * self.lr_decay ** (round_ - 1)

    def evaluates(self, t: int) -> bool:
        """Whether round (or aggregation) ``t`` is evaluated: every ``eval_every``, and always the last."""
        return t % self.eval_every == 0 or t == self.rounds

    @property
    def tail_evaluations(self) -> int:
        """How many evaluated rounds the tail of a full run holds (``evaluates`` among the last ``tail`` rounds)."""
        return sum(self.evaluates(t) for t in range(max(1, self.rounds - self.tail + 1), self.rounds + 1))

    def thin_tail(self) -> str | None:
        """The one-line warning when the tail holds fewer than 3 evaluated rounds of a run that has 3 or more (a
        stride ``eval_every`` wider than a third of ``tail``): the tail is then (nearly) the final round; None
        otherwise."""
        evaluated = sum(self.evaluates(t) for t in range(1, self.rounds + 1))
        if self.tail_evaluations >= 3 or evaluated < 3:
            return None
        return (
            f"fedrun: warning: schedule.tail={self.tail} holds {self.tail_evaluations} evaluated round(s) at "
            f"schedule.eval_every={self.eval_every}: the run is judged on (nearly) its final round alone; "
            f"schedule.tail={3 * self.eval_every} or more judges it on 3 evaluations"
        )

    def reached(self, row: dict) -> bool:
        """Whether the round's accuracies that ``stop_on`` names (NaN when not evaluated) meet ``stop_at_accuracy``."""
        return self.stop_at_accuracy is not None and all(
            row.get(name, math.nan) >= self.stop_at_accuracy for name in STOP_ON[self.stop_on]
        )

    def cohort_size(self, num_clients: int) -> int:
        """Clients a round with ``fixed`` sampling (the expected size, rounded, with ``poisson``)."""
        if self.cohort is not None:
            return self.cohort  # at most the population: checked when the sampler is bound
        return max(1, int(round(self.clients_per_round * num_clients)))

    def draw(self, sampler: np.random.Generator, num_clients: int, available: np.ndarray | None = None) -> np.ndarray:
        """A round's cohort, sorted client ids (see ``sampling``); with ``poisson`` it may be empty. ``available``: the
        clients that can be drawn (a bool mask; None: all): ``fixed`` draws its count among them (all of them when
        fewer), ``poisson`` flips every client's coin as always and keeps the available ones."""
        if self.sampling == "poisson":
            drawn = sampler.random(num_clients) < self.clients_per_round
            return np.flatnonzero(drawn if available is None else drawn & available)
        if available is None:
            return np.sort(sampler.choice(num_clients, size=self.cohort_size(num_clients), replace=False))
        ids = np.flatnonzero(available)
        take = min(self.cohort_size(num_clients), len(ids))
        return np.sort(ids[sampler.choice(len(ids), size=take, replace=False)])


@dataclass
class RunResult:
    """What a run produced.

    Attributes:
        params: The final flat global model.
        rows: One metrics row per round (aggregation).
        summary: Run-level metrics the engine measured (e.g. fairness).
        tables: Named tables to keep as CSV artifacts.
    """

    params: torch.Tensor
    rows: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)


def record(
    row: dict,
    params: torch.Tensor,
    diverged: bool,
    lr: float,
    schedule: Schedule,
    measure: Callable[[torch.Tensor], dict],
    result: RunResult,
    on_round: Callable[[dict, dict], None],
    per_client: dict,
    bar,
    started: float,
) -> bool:
    """Finish and report one aggregation's row, the same way for both engines.

    Evaluates the new global model when the schedule says so (``measure(params)`` gives the columns, which
    ``row`` already holds as NaN: every row has every column so metrics.csv can be appended to), times the
    round, keeps the row and hands it to ``on_round`` before refusing a non-finite model (so the diverging
    aggregation is on record). Returns whether the run ends here (the last aggregation, or the target
    accuracy reached).
    """
    t = row["round"]
    clock = time.perf_counter()
    if not diverged and schedule.evaluates(t):
        row.update(measure(params))
        bar.set_postfix(acc=f"{row['test_accuracy']:.4f}", loss=f"{row['test_loss']:.4f}")
    row["eval_wall_s"] = time.perf_counter() - clock
    row["round_wall_s"] = time.perf_counter() - started
    result.rows.append(row)
    on_round(row, per_client)
    if diverged:
        raise DivergenceError(f"non-finite global model after aggregation at round {t} (lr={lr:g})")
    result.params = params
    return t == schedule.rounds or schedule.reached(row)


class Timer(dict):
    """Seconds spent in named steps of a round: ``with timer("train_wall_s"): ...`` adds to ``timer[name]``."""

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self[name] = self.get(name, 0.0) + time.perf_counter() - start


@dataclass(frozen=True)
class Bits:
    """Megabytes of one model sent down (dense) and of one client's update sent up (through the stages: a
    compressed message, or a dense one again after noise), over the coordinates a client exchanges with the server
    (``ClientState.shared``: FedPer's clients neither receive nor send their head); ``extra_down`` and
    ``extra_up``: the dense model-sized messages a client program exchanges besides (SCAFFOLD's variates)."""

    dense_mb: float
    upload_mb: float
    extra_down: int = 0
    extra_up: int = 0

    @classmethod
    def of(cls, pipeline, params: torch.Tensor, client_state=None, program=None) -> Bits:
        d = params.numel() if client_state is None else client_state.shared(params.numel())
        down, up = (1, 1) if program is None else program.exchanged()
        return cls(
            d * params.element_size() / 1e6, upload_message_mb(pipeline, d, params.element_size()), down - 1, up - 1
        )


def progress(first: int, rounds: int, desc: str, unit: str) -> tqdm:
    """The progress bar over rounds ``first`` to ``rounds`` (resumed runs start where they were), moved by the loop
    with ``update()`` once a round is done: iterating over the bar would count a round only when the next one
    begins, so a run that ends (or stops early) would show its last round as undone."""
    import torch.distributed as dist

    follower = dist.is_available() and dist.is_initialized() and dist.get_rank() > 0  # rank 0 alone shows it
    return tqdm(desc=desc, unit=unit, dynamic_ncols=True, initial=first - 1, total=rounds, disable=follower)


def malicious_table(attack, rounds: list[int]) -> pd.DataFrame:
    """The malicious clients: the fixed set, or each round's (``attack.who=redrawn``) with its round."""
    import pandas as pd

    if attack.who == "fixed":
        return pd.DataFrame({"client": attack.malicious_ids()})
    drawn = [(r, int(c)) for r in rounds for c in attack.malicious_ids(r)]
    return pd.DataFrame(drawn, columns=["round", "client"])


SHARE_TOLERANCE = 1e-6  # how far from 1 a round's alpha may sum and still be a share of the weight


def attack_columns(attack, lying: np.ndarray, alpha: np.ndarray, is_share: bool = True) -> dict:
    """``attack/weight_share``: the attackers' share of the round's aggregation weight (their alpha; 0 when none
    was drawn), and ``attack/cohort_share``: their share of the cohort; only when the run has an attack.

    The weight share is a share only where alpha is a convex combination of the updates: ``is_share`` (the
    aggregator's ``alpha_is_share``: not FLTrust, NormBound, centered clipping, FedNova, MVR, whose alpha are
    coefficients that need not sum to 1) and this round's alpha non-negative and summing to 1 (an importance
    sampler's unbiased weights, FedBuff's staleness scaling and a robust rule's skipped round, all zeros, do not). It is NaN otherwise; ``attack/deviation`` is the
    measure every rule has."""
    if not attack:
        return {}
    alpha = np.asarray(alpha, dtype=np.float64)
    convex = is_share and bool(np.all(alpha >= 0)) and abs(float(alpha.sum()) - 1.0) <= SHARE_TOLERANCE
    share = (float(alpha[lying].sum()) if convex else math.nan) if len(alpha) else 0.0
    return {"attack/weight_share": share, "attack/cohort_share": float(lying.mean()) if len(lying) else 0.0}


class HonestReference:
    """What the round's rule, in its state before this round, makes of the honest clients' updates alone: the
    reference of ``attack/deviation``. Taken before the round's aggregation (``take``: the aggregation's
    ``reference`` copy, so its state is what the real one started from and is never touched, as an adaptive attack's
    probes leave it), aggregated after it (``update``) through the view of the honest clients (``RoundView.subset``),
    so that every signal the real aggregation read is read from its cache and timed where it was. None when no
    attacker is in the cohort (the deviation is 0) or no honest client is (it is undefined)."""

    def __init__(self, copied, honest: np.ndarray):
        self.copied, self.honest = copied, honest

    @classmethod
    def take(cls, aggregation, lying: np.ndarray) -> HonestReference | None:
        honest = ~np.asarray(lying, dtype=bool)
        if honest.all() or not honest.any():
            return None
        return cls(aggregation.reference(honest), honest)

    def update(self, params: torch.Tensor, sent: torch.Tensor, view) -> torch.Tensor:
        rows = torch.as_tensor(self.honest, device=sent.device)
        return self.copied.aggregate(params, sent[rows], view.subset(self.honest)).update


class AttackEffect:
    """What a round's attack achieved, for either engine: made before the round's aggregation (the honest reference
    taken from the rule's state then), ``columns`` after it (``attack_columns`` and ``deviation_column``); no
    columns in a run without an attack."""

    def __init__(self, attack, aggregation, lying: np.ndarray):
        self.attack, self.aggregation, self.lying = attack, aggregation, lying
        self.honest = HonestReference.take(aggregation, lying) if attack else None

    def columns(self, update: torch.Tensor, alpha: np.ndarray, params: torch.Tensor, sent: torch.Tensor, view) -> dict:
        """The round's columns: ``params`` the model the round started from, ``sent`` and ``view`` what it
        aggregated."""
        if not self.attack:
            return {}
        reference = None if self.honest is None else self.honest.update(params, sent, view)
        shares = attack_columns(self.attack, self.lying, alpha, self.aggregation.alpha_is_share)
        return {**shares, **deviation_column(update, reference, self.lying)}


def deviation_column(update: torch.Tensor, reference: torch.Tensor | None, lying: np.ndarray) -> dict:
    """``attack/deviation``: ||U - U_h|| / ||U_h||, how far the attack moved the round's aggregate U from the
    aggregate U_h the same rule gives on the honest updates alone (``HonestReference``), relative to the latter: 0
    when no attacker was in the cohort; NaN when every client was one or U_h is zero (a rule that skips a round of
    the honest clients under its f, or an FLTrust round that trusts none of them)."""
    if reference is None:
        return {"attack/deviation": 0.0 if not np.any(lying) else math.nan}
    norm = float(torch.linalg.vector_norm(reference.double()))
    if norm == 0.0:
        return {"attack/deviation": math.nan}
    return {"attack/deviation": float(torch.linalg.vector_norm(update.double() - reference.double())) / norm}
