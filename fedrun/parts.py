"""The parts of a round, held together, with one lifecycle.

A round reads: select (``sampler``), each client's start and data (``client_state``), how much each trains
(``heterogeneity``), train (``client``: the program each client runs, ``fedrun.programs``), what the attackers send and report instead (``attack``), the stages (``pipeline``: clip, noise, compress), aggregate (``aggregator``: FedAvg, a
loss-weighted rule, or a privacy mechanism wrapping FedAvg), the server step (``server``), what clients keep
(``client_state``), record. ``privacy`` is the accountant the private parts report to (its ledger, its stop).

Every part has the same three calls: ``bind(context)`` once before round 1 (``fedrun.state.Context``; a setting
that cannot run with the run's schedule, clients or seed fails there, before training), its per-round call, and
``state_dict()`` / ``load_state_dict()`` (explicit state). The engines hold one ``Parts``; a checkpoint stores
``{part name: its state}`` (``Parts.state_dict``) beside the loop's own variables, written by
``fedrun.checkpoint.snapshot`` for both engines; ``fedrun.upgrade.migrate`` reads older checkpoints into that form.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from fedrun import compat
from fedrun.attacks import Attack
from fedrun.cohort import CohortUpdate
from fedrun.devices import Unmodelled
from fedrun.errors import ConfigError
from fedrun.heterogeneity import EqualWork
from fedrun.lazy import torch
from fedrun.pipeline import Pipeline
from fedrun.privacy import Privacy
from fedrun.programs import LocalSGD
from fedrun.runfiles import BadFile
from fedrun.sampling import Uniform
from fedrun.servers import ServerOptimizer
from fedrun.state import Context, Stateful
from fedrun.upgrade import migrate


class ClientState(Stateful):
    """The client-state seam: where a client's round starts, what it trains on, and what it keeps afterwards.

    The default is FedAvg's: every client starts from the global model, trains on its own samples and keeps
    nothing. A subclass (``client_state=<option>``) may keep per-client tensors, e.g. FedPer's own last layer or
    Ditto's personal model, and hand them back as each client's start; or give a client a view of its data
    (``training_data`` adds rows to the training tensors once, ``data`` maps a client's samples into them: a copy
    with flipped labels for a label-flipping client). It works on every backend: starts are one row per client
    (``fedrun.trainer.Trainer`` takes them), data are index arrays into the tensors the backend holds.

    State is kept only for the clients that have some (a population of a million holds nothing until its clients
    train); ``state_dict`` is ``{client id: its state}`` and the checkpoint restores it exactly.
    """

    keeps = False  # capability: whether it holds anything per client between rounds
    personal = False  # capability: whether each client is served (and judged) by a model of its own

    def training_data(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The training tensors the backend holds (called once, before the backend is made): ``x``, ``y`` or
        those with rows appended that ``data`` may index."""
        return x, y

    def data(self, cohort: np.ndarray, parts: list[np.ndarray]) -> list[np.ndarray]:
        """The sample indices each cohort client trains on this round (default: its own)."""
        return parts

    def starts(self, params: torch.Tensor, cohort: np.ndarray) -> torch.Tensor:
        """Each cohort client's starting model: ``params`` itself (every client from the global model) or one
        row per cohort client."""
        return params

    def train(self, trainer, starts, data, cohort, lr, works, seed, t) -> CohortUpdate:
        """The cohort's local training from ``starts`` (``trainer``: the run's ``fedrun.trainer.Trainer``; the other
        arguments are its own). Default: one call, the round's local work (FedRep trains in two phases; Ditto
        trains a personal model beside)."""
        return trainer(starts, data, cohort, lr, works, seed, t)

    def keep(self, cohort: np.ndarray, starts: torch.Tensor, deltas: torch.Tensor) -> None:
        """After training: each cohort client's local model is its start plus its row of ``deltas``."""

    def upload(self, deltas: torch.Tensor) -> torch.Tensor:
        """What the cohort sends of its updates (default: all of it; FedPer's clients keep their head)."""
        return deltas

    def shared(self, d: int) -> int:
        """How many of the flat model's ``d`` coordinates a client exchanges with the server, down and up (the
        ``download_mb`` and ``upload_mb`` columns count them): all of them by default."""
        return d

    def models(self, params: torch.Tensor, clients: np.ndarray, fit) -> torch.Tensor:
        """The model each of ``clients`` is served and judged by: ``params`` (the global model, for all) or one row
        per client. ``fit(starts, clients, epochs, stream)`` trains them on their own training data with the round's
        learning rate and gives the updates (fine-tuning)."""
        return params

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@dataclass
class Parts:
    """What one run's rounds are made of (see the module docstring); the defaults are plain FedAvg's."""

    aggregator: Any
    sampler: Any = None
    heterogeneity: Any = None
    client_state: Any = None
    client: Any = None
    pipeline: Any = None
    server: Any = None
    privacy: Any = None
    attack: Any = None
    devices: Any = None

    NAMES = (
        "sampler", "heterogeneity", "client_state", "client", "attack", "pipeline", "aggregator", "server", "privacy",
        "devices",
    )  # fmt: skip

    def __post_init__(self):
        for name, default in DEFAULTS.items():  # None: the default part (plain objects passed through as None)
            if getattr(self, name) is None:
                setattr(self, name, default())
        # The stages an update passes: the run's pipeline, with a private mechanism's own stage in its place (central
        # DP clips last; local DP noises before compression), and the aggregation the mechanism wraps around
        # FedAvg. The pipeline's own stages keep their state in ``pipeline``; the mechanism's in ``privacy``.
        self.aggregation, stages = self.privacy.attach(self.aggregator, list(self.pipeline.stages))
        self.stages = Pipeline(stages)
        self.attack.against(self.aggregation, self.stages)  # an attack that knows the defence tunes itself to it

    def bind(self, context: Context, engine=None) -> None:
        """Check the parts against each other and the engine (``fedrun.compat``: the same table the CLI checks
        before it reads the dataset), then bind every part to the run in round order (each part's errors name their
        keys). ``engine``: the engine object, or None for one that is synchronous."""
        engine = engine if engine is not None else SimpleNamespace(asynchronous=context.asynchronous, concurrency=None)
        compat.check(
            {**{name: getattr(self, name) for name in self.NAMES}, "engine": engine, "schedule": context.schedule}
        )
        running = {"pipeline": self.stages, "aggregator": self.aggregation}  # with the mechanism's stage and wrapper
        for name in self.NAMES:
            part = running.get(name, getattr(self, name))
            if hasattr(part, "bind"):
                try:
                    part.bind(context)
                except ConfigError as exc:  # a part's own key (count) gets its group (attack.count); a full one stays
                    raise exc if "." in exc.key else exc.within(GROUPS.get(name, name)) from None

    def train(self, trainer, starts, data, cohort, lr, works, seed, t) -> CohortUpdate:
        """The cohort's local work: the client program (``client``) run as the client state says (its starts;
        plain SGD through ``ClientState.train``: FedRep's phases, Ditto's personal model)."""
        return self.client.train(self.client_state, trainer, starts, data, cohort, lr, works, seed, t)

    def step(self, params: torch.Tensor, update: torch.Tensor, sent: torch.Tensor, cohort: np.ndarray) -> torch.Tensor:
        """The server's step from the round's aggregate: the client program's server half adjusts it (FedDyn's h),
        then the server optimizer steps along it.

        Under central DP the updates ``sent`` are clipped but not noised (``CentralNoise`` noises their sum), so the
        server half reads the round's release instead, as one row: D times the noised aggregate, the noised sum of
        the clipped updates. What it adds to the model is then post-processing of what epsilon covers; FedDyn's h
        summed from the un-noised updates was not (every past round's updates, un-noised, in every later model)."""
        if self.privacy.mechanism == "central":
            sent = (update * self.privacy.denominator).unsqueeze(0)
        return self.server.step(params, self.client.adjust(update, sent, cohort))

    def exhausted(self) -> bool:
        """Whether the run must end before the next round (privacy: it would pass ``max_epsilon``)."""
        return self.privacy.exceeds()

    def state_dict(self) -> dict:
        return {name: _state(getattr(self, name)) for name in self.NAMES}

    def load_state_dict(self, state: dict) -> None:
        # A part a checkpoint predates (the sampler, privacy, client state) starts from {}: privacy refuses that
        # when the run is private (the rounds run must be counted).
        for name in self.NAMES:
            part = getattr(self, name)
            if hasattr(part, "load_state_dict"):
                part.load_state_dict(state.get(name, {}))

    def restore(self, checkpoint, initial: torch.Tensor) -> dict | None:
        """The saved state when ``checkpoint`` resumes (in today's format, its parts loaded into these), else None.
        A checkpoint is data (``weights_only`` let nothing run); one that is not this run's (a global model of
        another shape than ``initial``, parts' state that does not load) is a ``BadFile``: one line, before round 1."""
        saved = checkpoint.restored() if checkpoint is not None else None
        if saved is None:
            return None
        try:
            saved = migrate(saved)
            params = saved["loop"]["params"]
            if not isinstance(params, torch.Tensor) or params.shape != initial.shape:
                raise ValueError(
                    f"a global model of {getattr(params, 'shape', type(params).__name__)}, not {tuple(initial.shape)}"
                )
            self.load_state_dict(saved["parts"])
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as error:
            raise BadFile(checkpoint.path, f"a checkpoint of this run ({type(error).__name__}: {error})") from None
        return saved


GROUPS = {"client_state": "personalization"}  # a part's config group, where its name differs

DEFAULTS = {
    "sampler": Uniform,
    "heterogeneity": EqualWork,
    "client_state": ClientState,
    "client": LocalSGD,
    "pipeline": Pipeline,
    "server": ServerOptimizer,
    "privacy": Privacy,
    "attack": Attack,
    "devices": Unmodelled,
}


def _state(part) -> dict:
    return part.state_dict() if hasattr(part, "state_dict") else {}


def layout(model: torch.nn.Module) -> tuple:
    """The flat model's parameters as ``(name, start, end)``, in ``fedrun.models.flat_parameters``' order."""
    spans, start = [], 0
    for name, parameter in model.named_parameters():
        spans.append((name, start, start + parameter.numel()))
        start += parameter.numel()
    return tuple(spans)
