"""The data that engine, client training and aggregators share: how much a client trains, what a cohort's
training produced, per-client losses, and the round view the server aggregates from.

Nothing here trains or aggregates, so aggregators import this module, not the client-training one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedrun.lazy import torch


@dataclass(frozen=True)
class LocalWork:
    """How much a client trains in one round: ``local_epochs`` passes, or exactly ``local_steps`` mini-batches, in
    mini-batches of ``batch_size``. What it trains and towards what is its program's (``fedrun.programs``)."""

    batch_size: int
    local_epochs: int = 1
    local_steps: int | None = None


@dataclass
class ClientLosses:
    """Per-client losses in two scales.

    Attributes:
        mean: The mean loss over the client's samples.
        authors: The scale of the loss-weighted papers' code: the sum of per-batch mean losses divided
            by the client's sample count (about mean / 57 for 200 samples in batches of 64).
    """

    mean: np.ndarray
    authors: np.ndarray

    @staticmethod
    def concat(parts: list[ClientLosses]) -> ClientLosses:
        """The losses of consecutive groups of clients, joined in order (none for no group: an empty cohort)."""
        if not parts:
            return ClientLosses(np.zeros(0), np.zeros(0))
        return ClientLosses(np.concatenate([p.mean for p in parts]), np.concatenate([p.authors for p in parts]))


@dataclass
class CohortUpdate:
    """What local training of a cohort produced.

    Attributes:
        deltas: Delta_i = w_i - w, one row per cohort client.
        local_losses: Each client's running training loss over its last local epoch.
        steps: Local mini-batch steps each client took.
        coefficient_norms: FedNova's ||a_i||_1 of each client's solver and steps.
        kept: With a client program that keeps a state (``fedrun.programs``): each client's state after its local
            work, one row per client (as wide as its own state); else None.
    """

    deltas: torch.Tensor
    local_losses: ClientLosses
    steps: np.ndarray
    coefficient_norms: np.ndarray
    kept: torch.Tensor | None = None

    @staticmethod
    def of(done: list, params: torch.Tensor, out: torch.Tensor) -> CohortUpdate:
        """The cohort's update from each client's ``fedrun.programs.Finished`` record, in cohort order; ``out``: the
        cohort's rows, which a client's delta is already in when its program wrote it there (``Local.out``) and is
        copied into otherwise (a program of the user's that returns a vector of its own)."""
        if not done:
            return CohortUpdate.concat([], params)
        for row, finished in zip(out, done):
            if finished.delta.data_ptr() != row.data_ptr():
                row.copy_(finished.delta)
        return CohortUpdate(
            deltas=out,
            local_losses=ClientLosses(np.array([f.loss_mean for f in done]), np.array([f.loss_authors for f in done])),
            steps=np.array([f.steps for f in done], dtype=int),
            coefficient_norms=np.array([f.norm for f in done], dtype=float),
            kept=torch.stack([f.kept for f in done]) if done[0].kept is not None else None,
        )

    @staticmethod
    def concat(parts: list[CohortUpdate], params: torch.Tensor, deltas: torch.Tensor | None = None) -> CohortUpdate:
        """The updates of consecutive groups of clients, joined in order; none for no group (an empty cohort,
        ``params`` giving the width and dtype of the empty rows). ``deltas``: the cohort's rows, when the groups
        wrote them there (the worker processes' shared rows) instead of carrying their own."""
        if not parts:
            empty = np.zeros(0)
            return CohortUpdate(
                params.new_empty(0, params.shape[-1]), ClientLosses(empty, empty), empty.astype(int), empty
            )
        return CohortUpdate(
            deltas=torch.cat([p.deltas for p in parts]) if deltas is None else deltas,
            local_losses=ClientLosses.concat([p.local_losses for p in parts]),
            steps=np.concatenate([p.steps for p in parts]),
            coefficient_norms=np.concatenate([p.coefficient_norms for p in parts]),
            kept=None if parts[0].kept is None else torch.cat([p.kept for p in parts]),
        )


class Lazy:
    """A signal computed on first read (``RoundView`` caches the value and the time it took)."""

    def __init__(self, compute: Callable[[], object]):
        self.compute = compute


class Told:
    """A reported signal that is a function of the honest one, ``tell(honest value)``: the view reads the honest value
    through its own signal (computed, cached and timed once, ``true_<name>``) and tells it on first read."""

    def __init__(self, tell: Callable[[object], object]):
        self.tell = tell


@dataclass
class ClientReport:
    """What a cohort's clients tell the server about their round, one entry per client. A round has two: the honest
    one (what they computed: the record the round's own measurements read, ``train_loss``) and the reported one
    (what they say: an attack's clients may lie, ``fedrun.attacks.Attack.report``), which the aggregator reads.

    Attributes:
        sizes: Each client's sample count n_k.
        losses: F_i(w_t) under the round's global model: a ``ClientLosses``, a ``Lazy`` (a pass over their data,
            made when first read) or, in a reported record, a ``Told`` of the honest losses.
        local_losses: Each client's running training loss over its last local epoch.
        steps: Local steps each client took.
        coefficient_norms: FedNova's ||a_i||_1 of each client's local solver.
    """

    sizes: np.ndarray
    losses: object = None
    local_losses: ClientLosses | None = None
    steps: np.ndarray | None = None
    coefficient_norms: np.ndarray | None = None


class RoundView:
    """What the server can know about one round's cohort. Every signal is computed on first read and cached,
    so a signal no aggregator reads costs nothing; adding one is one entry where the engine builds the view.

    Signals the engine provides (attributes of the view):

    - ``losses``: F_i(w_t), each client's ``ClientLosses`` under the round's global model (a pass over their data).
    - ``local_losses``: Each client's running training loss over its last local epoch.
    - ``steps``: Local steps each client took.
    - ``coefficient_norms``: FedNova's ||a_i||_1 of each client's local solver.
    - ``previous_deltas``: The updates each client makes from the previous global model on the same
      mini-batches (training the cohort a second time; None in round 1).
    - ``fstar``: ``fstar(client_ids, epochs)`` estimates F_i* (cached per client).

    Args:
        clients: Client ids of the cohort.
        sizes: Number of training samples of each cohort client.
        losses: See above (positional, like the other signals: a value, a ``Lazy`` or None).
        round: The round, 1-based.
        accuracy: The latest evaluated accuracy before this round (validation when the run has a validation
            split, else test); NaN before the first evaluation.
        accuracy_source: ``val_accuracy`` or ``test_accuracy``: which one ``accuracy`` is.
        sampled_weights: The sampler's unbiased weights of the cohort (importance sampling's q_k / (m p_k)), or
            None: an aggregator that follows the sampler (FedAvg) takes them as its alpha.
        measure: ``measure(signal)`` runs a per-client signal (``fedrun.trainer``) on the cohort at the round's
            global model with the run's backend; ``per_client`` calls it.
        **signals: Further signals by name.
    """

    def __init__(
        self,
        clients: np.ndarray,
        sizes: np.ndarray,
        losses=None,
        round: int = 1,
        local_losses=None,
        accuracy: float = math.nan,
        accuracy_source: str = "test_accuracy",
        fstar=None,
        steps=None,
        coefficient_norms=None,
        previous_deltas=None,
        measure=None,
        sampled_weights=None,
        **signals,
    ):
        self.clients, self.sizes, self.round = clients, sizes, round
        self.sampled_weights = sampled_weights
        self.accuracy, self.accuracy_source = accuracy, accuracy_source
        self._signals = dict(
            losses=losses,
            local_losses=local_losses,
            fstar=fstar,
            steps=steps,
            coefficient_norms=coefficient_norms,
            previous_deltas=previous_deltas,
            **signals,
        )
        self.wall_s: dict[str, float] = {}  # seconds each lazy signal took, once read
        self._measure, self._per_client = measure, {}

    @classmethod
    def of(cls, clients: np.ndarray, honest: ClientReport, reported: ClientReport, **others) -> RoundView:
        """The view of a round whose clients computed ``honest`` and told ``reported``: the aggregator reads the
        reported signals (``losses``, ``local_losses``, ``sizes``, ...), the round's measurements the honest ones
        (``true_losses``, ``true_sizes``); a ``Told`` reported signal is told from the honest one when read."""
        view = cls(
            clients,
            reported.sizes,
            local_losses=reported.local_losses,
            steps=reported.steps,
            coefficient_norms=reported.coefficient_norms,
            true_losses=honest.losses,
            **others,
        )
        told = reported.losses
        view._signals["losses"] = Lazy(lambda: told.tell(view.true_losses)) if isinstance(told, Told) else told
        view.true_sizes = honest.sizes
        return view

    def __getattr__(self, name: str):
        signals = self.__dict__.get("_signals", {})
        if name not in signals:
            raise AttributeError(f"RoundView has no signal {name!r} (known: {', '.join(signals)})")
        value = signals[name]
        if isinstance(value, Lazy):
            start = time.perf_counter()
            value = signals[name] = value.compute()
            self.wall_s[name] = time.perf_counter() - start
        return value

    def per_client(self, signal) -> np.ndarray:
        """``signal(model, params, x_i, y_i)`` of each cohort client at the round's global model (float64, cohort
        order), run by the run's backend on first read and cached; its time counts in ``aggregate_wall_s``."""
        if self._measure is None:
            raise AttributeError("RoundView.per_client: this view has no backend to run per-client signals")
        if signal not in self._per_client:
            self._per_client[signal] = self._measure(signal)
        return self._per_client[signal]

    def read(self, name: str) -> bool:
        """Whether the lazy signal ``name`` was computed (read) this round."""
        return name in self.wall_s

    # Signals with one entry per cohort client (the rest, ``fstar`` and ``server_update``, are the round's own).
    PER_CLIENT = frozenset(("losses", "true_losses", "local_losses", "steps", "coefficient_norms", "previous_deltas"))

    def subset(self, keep: np.ndarray) -> RoundView:
        """The view of the cohort clients ``keep`` selects (a bool mask over the cohort), in cohort order: their
        sizes and per-client signals, the round's own signals shared. A lazy signal stays lazy and is read through
        this view, so it is computed (and cached, and timed) once, in this view, for both. ``attack/deviation``'s reference
        aggregates the honest clients alone through it (``fedrun.rounds.HonestReference``)."""
        keep = np.asarray(keep, dtype=bool)
        signals = {}
        for name, value in self._signals.items():
            if name in self.PER_CLIENT and value is not None:
                signals[name] = Lazy(lambda name=name: _rows(getattr(self, name), keep))
            elif isinstance(value, Lazy):  # the round's own (FLTrust's server update): read through, cached here
                signals[name] = Lazy(lambda name=name: getattr(self, name))
            else:
                signals[name] = value
        view = RoundView(
            self.clients[keep],
            np.asarray(self.sizes)[keep],
            round=self.round,
            accuracy=self.accuracy,
            accuracy_source=self.accuracy_source,
            sampled_weights=None if self.sampled_weights is None else np.asarray(self.sampled_weights)[keep],
            measure=None if self._measure is None else lambda signal: self.per_client(signal)[keep],
            **signals,
        )
        if "true_sizes" in self.__dict__:  # the engine's honest sizes beside the reported ones
            view.true_sizes = np.asarray(self.true_sizes)[keep]
        return view


def _rows(value, keep: np.ndarray):
    """The rows ``keep`` selects of a per-client signal (``ClientLosses``, an array or a tensor; None stays None)."""
    if value is None:
        return None
    if isinstance(value, ClientLosses):
        return ClientLosses(np.asarray(value.mean)[keep], np.asarray(value.authors)[keep])
    if isinstance(value, torch.Tensor):
        return value[torch.as_tensor(keep, device=value.device)]
    return np.asarray(value)[keep]
