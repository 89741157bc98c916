"""Personalised FL: each client is served, and judged, by a model of its own (``personalization=<option>``).

Every method is a client state (``fedrun.parts.ClientState``, the round's seam for what a client starts from,
how it trains, what it sends and keeps): the engine does not know which one runs. What each keeps per client
lives in a ``PersonalStore`` (only for clients that have trained; spilled to disk beyond a memory budget;
checkpointed and restored exactly). The options:

- ``none`` (``ClientState``): the global model serves every client (FedAvg's per-client evaluation).
- ``local``: each client trains its own model alone and sends nothing (FedPer with every parameter personal).
- ``finetune``: the global model fine-tuned for ``epochs`` on each client's training data, when it is judged.
- ``fedper`` (Arivazhagan et al. 2019): the parameters matching ``personal`` (the last layer by default) stay on
  the client; only the rest is sent and averaged.
- ``fedrep`` (Collins et al. 2021, Algorithm 1): FedPer's split, trained in two phases each round: the head for
  ``head_epochs`` with the body frozen, then the body for the round's local work with the new head frozen.
- ``fedbn`` (Li et al. 2021, ICLR): FedPer's split with the batch-norm layers as the personal part.
- ``ditto`` (Li et al. 2021, Algorithm 1): the global model trains as FedAvg's; each selected client also trains a
  personal model v_k on F_k(v) + (lambda / 2) ||v - w^t||^2 from its last v_k (v_k^0 = w^0).

How a run judges its clients is ``fedrun.personal.judge`` (per-client accuracies, their mean, weighted mean, 10th
percentile and minimum) and ``fedrun.metrics.summarise`` (the round selected on validation, the best round on test).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from fedrun.cohort import CohortUpdate
from fedrun.errors import ConfigError, check
from fedrun.lazy import torch
from fedrun.metrics import FAIRNESS
from fedrun.parts import ClientState
from fedrun.programs import Frozen, Mixed, Program, Pulled
from fedrun.state import Context
from fedrun.store import PersonalStore

# ------------------------------------------------------------------------------------------------------- methods


class Personalization(ClientState):
    """What every personal method shares: a store of per-client tensors and the run's context.

    Args:
        memory_mb: Megabytes of personal state kept in memory; beyond it the least recently used clients' state is
            spilled to ``personal/`` in the run dir (read back when they train or are judged).
    """

    keeps = True
    personal = True  # capability: each client is served by a model of its own (judged per client)

    def __init__(self, memory_mb: float = 1024.0):
        check(memory_mb > 0, "memory_mb", memory_mb, "a number of megabytes > 0")
        self.memory_mb, self.store = memory_mb, PersonalStore(memory_mb)
        self.context: Context | None = None

    def bind(self, context: Context) -> None:
        self.context = context
        directory = None if context.workdir is None else Path(context.workdir) / "personal"
        self.store = PersonalStore(self.memory_mb, directory)

    def state_dict(self) -> dict:
        return {"store": self.store.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.store.load_state_dict(state.get("store", {}))


class Partial(Personalization):
    """FedPer's split: the parameters whose names match ``personal`` are the client's own; the rest is shared.

    A client's model is the global model with its own personal parameters in place (those of the global model, as
    initialised, until it has trained). Its upload has the personal coordinates zeroed: the server never sees
    them, and the global model's copy of them stays as initialised.

    Args:
        personal: fnmatch patterns over the model's parameter names (``fc2.*``); null: the model's last layer (the
            parameters of the module that holds the last one). An empty list makes every parameter shared
            (FedAvg, exactly); a pattern that matches nothing is refused.
        memory_mb: See ``Personalization``.
    """

    def __init__(self, personal: list[str] | None = None, memory_mb: float = 1024.0):
        super().__init__(memory_mb)
        check(
            personal is None
            or (
                isinstance(personal, Sequence)
                and not isinstance(personal, str)
                and all(isinstance(p, str) for p in personal)
            ),
            "personal",
            personal,
            "null (the model's last layer) or a list of parameter-name patterns",
        )
        self.patterns = None if personal is None else list(personal)  # (``personal`` is the capability flag)
        self.names: list[str] = []
        self.mask: torch.Tensor | None = None  # True at the personal coordinates of the flat model

    def bind(self, context: Context) -> None:
        super().bind(context)
        if not context.layout:  # bound before the model exists (the CLI's check): nothing to match yet
            return
        names = [name for name, _, _ in context.layout]
        if self.patterns is None:
            module = names[-1].rsplit(".", 1)[0] if "." in names[-1] else ""
            self.names = [n for n in names if (n.rsplit(".", 1)[0] if "." in n else "") == module]
        else:
            for pattern in self.patterns:
                check(
                    any(fnmatch.fnmatchcase(n, pattern) for n in names),
                    "personal",
                    pattern,
                    f"a pattern matching a parameter of the model ({', '.join(names)})",
                )
            self.names = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in self.patterns)]
        self.mask = torch.zeros(context.layout[-1][2], dtype=torch.bool)
        for name, start, end in context.layout:
            if name in self.names:
                self.mask[start:end] = True

    def _base(self, params: torch.Tensor) -> torch.Tensor:
        """The model a client without personal state starts from: the global one."""
        return params

    def _own(self, params: torch.Tensor, clients) -> torch.Tensor:
        """One model per client: the base model with each client's personal coordinates in place, if it has any."""
        rows = self._base(params).unsqueeze(0).repeat(len(clients), 1)
        mask = self.mask.to(params.device)
        for row, client in enumerate(clients):
            if (value := self.store.get(int(client))) is not None:
                rows[row, mask] = value.to(params)
        return rows

    def starts(self, params: torch.Tensor, cohort: np.ndarray) -> torch.Tensor:
        if not self.names or not any(int(c) in self.store for c in cohort):
            return self._base(params)  # one start for the cohort (FedAvg's path when nothing is personal)
        return self._own(params, cohort)

    def keep(self, cohort: np.ndarray, starts: torch.Tensor, deltas: torch.Tensor) -> None:
        if not self.names:
            return
        mask = self.mask.to(deltas.device)
        for row, client in enumerate(cohort):
            start = starts[row] if starts.dim() == 2 else starts
            self.store.put(int(client), (start[mask] + deltas[row, mask]).cpu())

    def upload(self, deltas: torch.Tensor) -> torch.Tensor:
        if not self.names:
            return deltas
        sent = deltas.clone()
        sent[:, self.mask.to(deltas.device)] = 0
        return sent

    def models(self, params: torch.Tensor, clients: np.ndarray, fit) -> torch.Tensor:
        return self._own(params, clients) if self.names else params

    def shared(self, d: int) -> int:
        """The coordinates outside the personal part: FedPer's body down and up, none for ``Local``."""
        return d - int(self.mask.sum()) if self.names else d


class FedPer(Partial):
    """FedPer (Arivazhagan et al. 2019, arXiv:1912.00818, Section 3): base layers federated, personalisation
    layers trained on the client only, both in the same local epochs. See ``Partial`` for the arguments."""


class FedBN(Partial):
    """FedBN (Li et al. 2021, "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization", ICLR,
    Algorithm 1): every batch-norm layer stays on its client, the server aggregating every other layer (its line
    "w_l <- aggregate over clients, for every layer l that is not batch norm"). Each client keeps the affine
    parameters of its ``fedrun.models.BatchNorm`` layers (as FedPer keeps its head) and normalises by the statistics
    of its own data (as every client does here: ``BatchNorm``). The paper averages uniformly over its clients; here
    the run's aggregator weighs them (FedAvg's sample counts by default). Needs a model with batch norm
    (``model.norm=batch``).

    Args:
        memory_mb: See ``Personalization``.
    """

    def __init__(self, memory_mb: float = 1024.0):
        super().__init__(None, memory_mb)

    def bind(self, context: Context) -> None:
        if context.layout:
            check(
                bool(context.batch_norm),
                "personalization",
                "fedbn",
                "a model with batch norm (model.norm=batch with model=cnn or fedavg_cnn)",
            )
            self.patterns = list(context.batch_norm)
        super().bind(context)


class Local(Partial):
    """Each client trains its own model alone from the initial one and sends nothing: the baseline with no
    federation (every parameter personal; the global model stays as initialised).

    Args:
        memory_mb: See ``Personalization``.
    """

    def __init__(self, memory_mb: float = 1024.0):
        super().__init__(["*"], memory_mb)

    def _base(self, params: torch.Tensor) -> torch.Tensor:
        return self.context.initial.to(params)  # w^0, whatever the global model became


class FedRep(Partial):
    """FedRep (Collins et al. 2021, "Exploiting Shared Representations for Personalized Federated Learning",
    Algorithm 1 lines 5-9): each selected client first updates its head for ``head_epochs`` epochs with the body
    (the shared representation) fixed at the global one, then the body for the round's local work with the new
    head fixed; it sends the body's update only.

    Args:
        personal: The head's parameter-name patterns (see ``Partial``; default the last layer).
        head_epochs: Epochs of the head phase (PFLlib's ``plocal_epochs``, default 1).
        memory_mb: See ``Personalization``.
    """

    def __init__(self, personal: list[str] | None = None, head_epochs: int = 1, memory_mb: float = 1024.0):
        super().__init__(personal, memory_mb)
        check(isinstance(head_epochs, int) and head_epochs >= 0, "head_epochs", head_epochs, "an integer >= 0")
        self.head_epochs = head_epochs

    def train(self, trainer, starts, data, cohort, lr, works, seed, t) -> CohortUpdate:
        names = [name for name, _, _ in self.context.layout]
        head, body = tuple(self.names), tuple(n for n in names if n not in self.names)
        first = None
        if self.head_epochs:
            head_works = [replace(w, local_epochs=self.head_epochs, local_steps=None) for w in works]
            first = trainer(starts, data, cohort, lr, head_works, seed, t, "head", program=Program(Frozen(body)))
            starts = (starts if starts.dim() == 2 else starts.unsqueeze(0)) + first.deltas
        second = trainer(starts, data, cohort, lr, works, seed, t, program=Program(Frozen(head)))
        if first is None:
            return second
        second.deltas += first.deltas  # from the round's start: the head's update, then the body's
        second.steps = second.steps + first.steps
        return second


class Ditto(Personalization):
    """Ditto (Li et al. 2021, "Ditto: Fair and Robust Federated Learning Through Personalization", Algorithm 1):
    the global model is trained and aggregated as the run's aggregator says (lines 4-6); each selected client also
    updates its personal model, v_k <- v_k - eta (grad F_k(v_k) + lambda (v_k - w^t)) for the round's local work
    (line 7, from v_k^0 = w^0), with w^t the global model the round started from.

    Args:
        lam: lambda >= 0, the pull towards the global model (0: local training; large: v_k stays at w^t).
        personal_epochs: Local epochs of the personal update; null: the round's local work.
        memory_mb: See ``Personalization``.
    """

    def __init__(self, lam: float = 0.1, personal_epochs: int | None = None, memory_mb: float = 1024.0):
        super().__init__(memory_mb)
        check(isinstance(lam, (int, float)) and lam >= 0, "lam", lam, "a number >= 0")
        check(
            personal_epochs is None or (isinstance(personal_epochs, int) and personal_epochs >= 1),
            "personal_epochs",
            personal_epochs,
            "null (the round's local work) or an integer >= 1",
        )
        self.lam, self.personal_epochs = float(lam), personal_epochs

    def _own(self, clients, params: torch.Tensor) -> torch.Tensor:
        initial = self.context.initial.to(params)
        return torch.stack([_or(self.store.get(int(c)), initial).to(params) for c in clients])

    def train(self, trainer, starts, data, cohort, lr, works, seed, t) -> CohortUpdate:
        trained = trainer(starts, data, cohort, lr, works, seed, t)
        if len(cohort):
            w = starts if starts.dim() == 1 else starts[0]  # every client starts the global objective from w^t
            epochs = {} if self.personal_epochs is None else {"local_epochs": self.personal_epochs, "local_steps": None}
            jobs = [replace(job, **epochs) for job in works]
            own = self._own(cohort, w)
            personal = trainer(
                own, data, cohort, lr, jobs, seed, t, "personal", program=Program(Pulled(self.lam), None, w)
            )
            for row, client in enumerate(cohort):
                self.store.put(int(client), (own[row] + personal.deltas[row]).cpu())
        return trained

    def models(self, params: torch.Tensor, clients: np.ndarray, fit) -> torch.Tensor:
        return self._own(clients, params)


class APFL(Personalization):
    """APFL (Deng et al. 2020, "Adaptive Personalized Federated Learning", arXiv:2003.13461, Algorithm 1): each
    selected client trains its copy of the global model w as the run's solver says and, on the same mini-batches,
    its own model v through the mixture v_bar = alpha v + (1 - alpha) w, learning alpha too when ``alpha_lr`` > 0
    (``fedrun.programs.Mixed``, ``fedrun.clients.apfl_step``); w's update goes to the aggregator. A client is served v_bar = alpha_i v_i +
    (1 - alpha_i) w with w the current global model, v_i^0 = w^0 and alpha_i^0 = ``alpha``.

    Args:
        alpha: The initial (or, with ``alpha_lr`` 0, fixed) mixing weight in [0, 1]: 0 serves the global model, 1
            the personal one alone.
        alpha_lr: Step size of alpha's gradient step; null: the round's local learning rate (the paper's one eta);
            0: alpha stays fixed.
        memory_mb: See ``Personalization``.
    """

    def __init__(self, alpha: float = 0.5, alpha_lr: float | None = None, memory_mb: float = 1024.0):
        super().__init__(memory_mb)
        check(isinstance(alpha, (int, float)) and 0 <= alpha <= 1, "alpha", alpha, "a number in [0, 1]")
        check(
            alpha_lr is None or (isinstance(alpha_lr, (int, float)) and alpha_lr >= 0),
            "alpha_lr",
            alpha_lr,
            "null (the round's local learning rate) or a number >= 0",
        )
        self.alpha, self.alpha_lr = float(alpha), alpha_lr

    def _rows(self, clients, params: torch.Tensor) -> torch.Tensor:
        """Each client's row (v_i, alpha_i): w^0 and ``alpha`` until it trains."""
        initial = torch.cat([self.context.initial.to(params), params.new_tensor([self.alpha])])
        return torch.stack([_or(self.store.get(int(c)), initial).to(params) for c in clients])

    def _own(self, clients, params: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        """Each client's v_i (w^0 until it trains) and alpha_i."""
        rows = self._rows(clients, params)
        return rows[:, :-1], rows[:, -1].double().cpu().numpy()

    def train(self, trainer, starts, data, cohort, lr, works, seed, t) -> CohortUpdate:
        if not len(cohort):
            return trainer(starts, data, cohort, lr, works, seed, t)
        w = starts if starts.dim() == 1 else starts[0]
        step = lr if self.alpha_lr is None else self.alpha_lr
        trained = trainer(starts, data, cohort, lr, works, seed, t, program=Program(Mixed(step), self._rows(cohort, w)))
        if trained.kept is None:  # a backend of one's own that does not run client programs
            raise ConfigError("device.backend", type(trainer).__name__, "a backend that trains APFL's personal model")
        for row, client in enumerate(cohort):
            self.store.put(int(client), trained.kept[row].cpu())  # (v_i, alpha_i)
        return trained

    def models(self, params: torch.Tensor, clients: np.ndarray, fit) -> torch.Tensor:
        own, alphas = self._own(clients, params)
        alpha = torch.as_tensor(alphas, dtype=params.dtype, device=params.device).unsqueeze(1)
        return alpha * own + (1 - alpha) * params


class FineTune(ClientState):
    """The global model fine-tuned for ``epochs`` local epochs on each client's own training data, each time the
    clients are judged (nothing is kept between rounds; 0 epochs: the global model itself).

    Args:
        epochs: Local epochs of fine-tuning, >= 0.
    """

    personal = True

    def __init__(self, epochs: int = 1):
        check(isinstance(epochs, int) and epochs >= 0, "epochs", epochs, "an integer >= 0")
        self.epochs = epochs

    def models(self, params: torch.Tensor, clients: np.ndarray, fit) -> torch.Tensor:
        if not self.epochs:
            return params
        return params.unsqueeze(0) + fit(params, clients, self.epochs, "finetune")


def _or(value, default):
    return default if value is None else value


# ------------------------------------------------------------------------------------------------------- judging

STATISTICS = ("mean", "weighted", "p10", "min")


def statistics(accuracy: np.ndarray, counts: np.ndarray) -> dict:
    """Of per-client accuracies on held-out splits of ``counts`` samples (clients without one left out): the mean
    over clients, the mean weighted by held-out samples (= correct / total: PFLlib's and FL-bench's figure), the
    10th percentile (numpy's default, linear between order statistics: Hyndman and Fan's type 7) and the worst
    client."""
    has = counts > 0
    accuracy, counts = accuracy[has], counts[has]
    if not len(accuracy):
        return dict.fromkeys(STATISTICS, math.nan)
    return {
        "mean": float(accuracy.mean()),
        "weighted": float(np.average(accuracy, weights=counts)),
        "p10": float(np.percentile(accuracy, 10)),
        "min": float(accuracy.min()),
    }


def columns(prefix: str = "personal/") -> list[str]:
    """The metrics.csv columns of per-client judging: test accuracies, then validation ones, then the fairness of
    the test accuracies (``fairness/``)."""
    return (
        [f"{prefix}accuracy_{s}" for s in STATISTICS]
        + [f"{prefix}val_accuracy_{s}" for s in STATISTICS]
        + [f"fairness/{s}" for s in FAIRNESS]
    )
