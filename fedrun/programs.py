"""The ``client`` group: what one client computes in a round, as a program every backend runs without knowing it.

A program has three calls over flat tensors (fedjax's ``for_each_client``: ``client_init``, ``client_step``,
``client_final``): ``start(client, start, own, shared)`` gives a client's local state from the model it starts
from, its own state kept from earlier rounds and what the server broadcasts besides the model; ``step(local,
batch)`` takes one mini-batch step; ``finish(local)`` gives its ``Finished`` record (the update it uploads, the
state it keeps, its report: losses, steps, FedNova's norm). ``train_cohort`` runs one program over a cohort, and is
what every backend calls (the loop here, the worker processes and the distributed ranks on their blocks of clients;
vmap maps a program's step over the cohort where the program writes it as a function, ``LocalSGD.batched``, and
hands any other program to the loop).

The options:

- ``sgd`` (``LocalSGD``): local training with the run's local solver (``optimizer=``), FedAvg's client. It also
  runs what a personalisation method asks of a client's work (``LocalWork``: FedRep's frozen phases, Ditto's pull,
  APFL's mixture).
- ``scaffold`` (``Scaffold``): SCAFFOLD's control variates (Karimireddy et al. 2020, Algorithm 1, option II).
- ``feddyn`` (``FedDyn``): FedDyn's dynamic regulariser (Acar et al. 2021, Algorithm 1).
- ``moon`` (``Moon``): MOON's model-contrastive term (Li, He and Song 2021, Algorithm 1).

Per-client state (SCAFFOLD's c_i, FedDyn's gradient term, MOON's previous local model) is one flat tensor per
client, held only for the clients that have trained, in a ``fedrun.personal.PersonalStore`` (a memory budget,
spilled to ``client/`` in the run dir beyond it, restored exactly by a checkpoint): a population of a million holds
the state of the clients that trained, never a table of all of them. What the server keeps (SCAFFOLD's c, FedDyn's
h) is the program's own state, checkpointed with it. A program travels to worker processes without that state
(``__getstate__``): the clients get what ``start`` is given, nothing more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedrun.clients import (
    _anchors,
    _batches,
    _loss_closure,
    apfl_step,
    cleared,
    per_client_round,
    per_client_start,
    plain_sgd_step,
    solver_coefficient_norm,
)
from fedrun.cohort import CohortUpdate
from fedrun.errors import check
from fedrun.lazy import deferrable, torch
from fedrun.pipeline import number
from fedrun.seeding import torch_generator
from fedrun.state import Context
from fedrun.store import PersonalStore

_models = deferrable("fedrun.models")  # subclasses torch's classes: fedrun.lazy


@dataclass
class Client:
    """One client's call: its workspace, data and work (``index``: its samples in ``x``, ``y``)."""

    model: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor
    index: torch.Tensor
    job: object  # fedrun.cohort.LocalWork
    lr: float
    make_optimizer: object
    id: int
    round: int
    seed: int
    stream: str


@dataclass
class Local:
    """A client's state during its local work (``start``'s result, stepped by ``step``)."""

    client: Client
    start: torch.Tensor
    own: torch.Tensor | None
    shared: torch.Tensor | None
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    plain: object  # plain_sgd_step's fast step, or None
    pull: tuple | None
    losses: list
    sizes: list
    personal: tuple | None = None  # APFL's (v0, v, alpha): a model trained beside
    out: torch.Tensor | None = None  # the row of the cohort's updates this client's delta is written into
    norm: float | None = None  # ||a||_1 of its steps (FedNova's: the update is -lr sum_j a_j g_j), once they are done


@dataclass
class Finished:
    """What a client's program gives back: its upload, the state it keeps, its report."""

    delta: torch.Tensor
    kept: torch.Tensor | None
    steps: int
    norm: float
    loss_mean: float
    loss_authors: float


class LocalSGD:
    """Plain local training (FedAvg's client), and the base of every program: ``start`` loads the start into the
    workspace and builds the local solver, ``step`` takes a solver step on the mini-batch's loss (``objective``,
    then ``corrected``), ``finish`` reads the update. A new local objective overrides ``objective`` (a term added
    to the mini-batch loss) or ``corrected`` (the gradients before the solver's step), ``finish`` (the state it
    keeps), and on the server's side ``initial``, ``shared``, ``server_keep`` and ``adjust``.

    Args:
        memory_mb: Megabytes of per-client state kept in memory (programs that keep some); beyond it the least
            recently used clients' state is spilled to ``client/`` in the run dir.
    """

    keeps = False  # capability: it keeps a state per client between rounds
    serves = False  # capability: it has a server half (a state the server updates from each round's cohort)
    name = "sgd"

    def __init__(self, memory_mb: float = 1024.0):
        check(
            isinstance(memory_mb, (int, float)) and memory_mb > 0, "memory_mb", memory_mb, "a number of megabytes > 0"
        )
        self.memory_mb = memory_mb
        self.context: Context | None = None
        self.store = PersonalStore(memory_mb)
        self.server: torch.Tensor | None = None  # the server's own state (SCAFFOLD's c, FedDyn's h)

    @property
    def plain(self) -> bool:
        """Whether this is plain local SGD (what a personalisation method may train with)."""
        return type(self) is LocalSGD

    @property
    def batched(self) -> bool:
        """Whether the vmap backend steps this program for the whole cohort at once: local SGD whose changes are
        ``gradient`` (a function of one client's gradient, value, start, own state and broadcast of a parameter:
        SCAFFOLD, FedDyn; ``torch.func.vmap`` maps it over the clients), ``pull`` (Ditto's) and ``frozen`` (FedRep's
        phases), and an ``objective`` or ``closure`` that ``batch_loss`` also writes as a function (MOON's term,
        sample-level TERM's tilt). A program that changes anything else (its start, step, an objective without
        ``batch_loss``, ``corrected`` itself) runs on the loop there, with the loop's numbers; ``kept`` is called per
        client with the loop's arguments. A ``before`` that ``batch_before`` also writes (APFL's personal step) is
        mapped too, its state carried through the steps and kept by ``batch_kept`` instead of ``kept``; a subclass
        that overrides ``start``, ``before``, ``kept`` or ``batch_kept`` of the class that wrote ``batch_before``
        runs on the loop."""
        steps_as_sgd = ("start", "step", "before", "closure", "objective", "corrected", "finish")
        if type(self).batch_loss is not LocalSGD.batch_loss:  # its objective has a functional form: vmap maps that
            steps_as_sgd = tuple(n for n in steps_as_sgd if n not in ("closure", "objective"))
        if self.carries:  # its ``before`` (and the start of what it carries) has a functional form: vmap maps that,
            # as long as the class that wrote ``batch_before`` also wrote the start, step and state it stands for
            owner = next(c for c in type(self).__mro__ if "batch_before" in vars(c))
            if any(getattr(type(self), n) is not getattr(owner, n) for n in ("start", "before", "kept", "batch_kept")):
                return False
            steps_as_sgd = tuple(n for n in steps_as_sgd if n not in ("start", "before"))
        return all(getattr(type(self), name) is getattr(LocalSGD, name) for name in steps_as_sgd)

    def __getstate__(self) -> dict:  # to a worker process: the program without the server's state
        return {**self.__dict__, "store": None, "server": None, "context": None}

    # -------------------------------------------------------------------------------------------- the client's side

    def start(self, client: Client, start: torch.Tensor, own: torch.Tensor | None, shared) -> Local:
        model = client.model
        own, shared = (None if t is None else t.to(start) for t in (own, shared))
        _models.load_flat(model, start)
        if frozen := self.frozen():  # FedRep's phases: the frozen part keeps its start (``finish`` thaws it)
            for name, parameter in model.named_parameters():
                parameter.requires_grad_(name not in frozen)
        # fresh state: clients keep no solver across rounds (a frozen parameter is no solver's: it gets no step)
        optimizer = client.make_optimizer([p for p in model.parameters() if p.requires_grad], lr=client.lr)
        pull = self.pull(model, shared)
        if hasattr(optimizer, "start_round"):  # solvers whose step follows the round (STORM's eta_t)
            optimizer.start_round(client.round, _loss_closure(model, optimizer, client.x, client.y, client.index, pull))
        generator = torch_generator(client.seed, client.stream, client.round, client.id)
        return Local(client, start, own, shared, optimizer, generator, plain_sgd_step(optimizer), pull, [], [])

    def frozen(self) -> tuple[str, ...]:
        """Names of the parameters that keep their start (no solver steps them); default: none."""
        return ()

    def pull(self, model: torch.nn.Module, shared: torch.Tensor | None) -> tuple | None:
        """(lambda, anchor per parameter): (lambda / 2) ||w - anchor||^2 added to each mini-batch's loss, or None."""
        return None

    def before(self, local: Local, chosen: torch.Tensor) -> None:
        """What the client computes on the mini-batch ``chosen`` before its model steps (APFL's personal step)."""

    def step(self, local: Local, batch: torch.Tensor) -> Local:
        client = local.client
        chosen = client.index[batch.to(client.x.device)]
        self.before(local, chosen)
        closure = self.closure(local, chosen)
        local.losses.append((local.plain(closure) if local.plain else local.optimizer.step(closure)).detach())
        local.sizes.append(len(batch))
        return local

    def closure(self, local: Local, chosen: torch.Tensor):
        """The solver's closure for the mini-batch ``chosen``: the loss (with ``pull``'s and ``objective``'s terms)
        with fresh gradients, ``corrected``; it returns the data term, which is what the client reports."""
        client = local.client
        data = _loss_closure(client.model, local.optimizer, client.x, client.y, chosen, local.pull)
        if type(self).objective is LocalSGD.objective and not self.corrects:
            return data
        clear = cleared(local.optimizer)

        def closure():
            extra = self.objective(local, chosen)
            if extra is None:
                loss = data()
            else:  # the data term's gradients and the term's, together
                clear()
                loss = torch.nn.functional.cross_entropy(client.model(client.x[chosen]), client.y[chosen])
                (loss + extra(local)).backward()
                loss = loss.detach()
            self.corrected(local)
            return loss

        return closure

    def objective(self, local: Local, chosen: torch.Tensor):
        """A term added to the mini-batch loss, as a function of ``local`` run inside the closure after the model's
        forward, or None (the data term alone)."""
        return None

    def batch_loss(self, model: torch.nn.Module, params: dict, x, y, mask, count, start: dict, own: dict | None):
        """The mini-batch loss as a function, for the vmap backend (``torch.func`` maps it over the cohort and takes
        its gradient in ``params``): one client's ``params``, ``start`` and ``own`` state as {name: tensor}, its
        batch ``x``, ``y`` padded to the cohort's widest (``mask``: 1 for a real sample, 0 for padding; ``count``:
        the real ones). Returns (the loss the solver steps on, the data term the client reports). A program whose
        ``objective`` or ``closure`` changes the loss writes the same loss here (``Moon``, ``Tilted``), or runs on
        the loop under vmap. Default: the mean cross-entropy, both."""
        data = masked_mean(
            torch.nn.functional.cross_entropy(torch.func.functional_call(model, params, (x,)), y, reduction="none"),
            mask,
            count,
        )
        return data, data

    @property
    def carries(self) -> bool:
        """Whether ``before`` has a functional form (``batch_before``) that vmap maps over the cohort."""
        return type(self).batch_before is not LocalSGD.batch_before

    def batch_before(self, model: torch.nn.Module, params: dict, carried: torch.Tensor, x, y, mask, count, lr: float):
        """``before`` as a function, for the vmap backend: one client's carried state after the mini-batch, from its
        ``params`` before they step ({name: tensor}), its batch padded as in ``batch_loss`` and the round's ``lr``.
        The carried state starts as the client's own state (its row) and ends in ``batch_kept``. A program that
        writes it declares that its ``start`` only sets up that state (``Mixed``). Default: none is carried."""
        return carried

    def batch_kept(self, own: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
        """The state a client keeps, for the vmap backend, from its own state and its carried state after its last
        step (a program that writes ``batch_before`` writes this as its ``kept``)."""
        return carried

    @property
    def corrects(self) -> bool:
        """Whether the program changes the gradients before the solver steps (``corrected`` or ``gradient``)."""
        return type(self).corrected is not LocalSGD.corrected or type(self).gradient is not LocalSGD.gradient

    def corrected(self, local: Local) -> None:
        """Change the gradients before the solver steps: by default each parameter's to ``gradient``'s."""
        if type(self).gradient is LocalSGD.gradient:
            return
        with torch.no_grad():
            for p, start, own, shared in with_gradients(local.client.model, local.start, local.own, local.shared):
                p.grad.copy_(self.gradient(p.grad, p, start, own, shared))

    def gradient(self, grad, param, start, own, shared):
        """The gradient the local solver steps with, from the mini-batch's ``grad`` at ``param`` and the same
        parameter's part of the client's start, own state and the server's broadcast (each a model's tensor, or
        [clients, *shape] when vmap maps it over the cohort; None where the program has no such state); default:
        ``grad``. SCAFFOLD's and FedDyn's corrections are this."""
        return grad

    def finish(self, local: Local) -> Finished:
        client, job = local.client, local.client.job
        if self.frozen():
            for parameter in client.model.parameters():
                parameter.requires_grad_(True)
        delta = _models.flat_delta(client.model, local.start, local.out)  # into its row of the cohort's updates
        steps = len(local.losses)
        mean = authors = math.nan
        if steps:
            last = -(-len(client.index) // job.batch_size)  # batches in one epoch
            epoch_losses = torch.stack(local.losses[-last:]).double().cpu().numpy()
            mean = float(np.average(epoch_losses, weights=local.sizes[-last:]))
            authors = float(epoch_losses.sum() / len(client.index))
        local.norm = solver_coefficient_norm(local.optimizer, steps, client.lr)
        return Finished(delta, self.kept(local, delta, steps), steps, local.norm, mean, authors)

    def kept(self, local: Local, delta: torch.Tensor, steps: int) -> torch.Tensor | None:
        """The state the client keeps after this round (None: it keeps nothing)."""
        return None

    # -------------------------------------------------------------------------------------------- the server's side

    def bind(self, context: Context) -> None:
        self.context = context
        directory = None if context.workdir is None else Path(context.workdir) / "client"
        self.store = PersonalStore(self.memory_mb, directory)

    def initial(self, d: int) -> torch.Tensor | None:
        """A client's own state before it first trains (None: the program keeps none)."""
        return None

    def owns(self, cohort: np.ndarray, like: torch.Tensor) -> torch.Tensor | None:
        """The cohort's own states, one row per client (None when the program keeps none)."""
        if not self.keeps:
            return None
        d = like.shape[-1]
        rows = [self.store.get(int(c)) for c in cohort]
        initial = self.initial(d)
        return torch.stack([(initial if r is None else r).to(like) for r in rows]) if len(cohort) else None

    def shared(self) -> torch.Tensor | None:
        """What the server sends every client besides the model (SCAFFOLD's c), or None."""
        return None

    def train(self, client_state, trainer, starts, data, cohort, lr, works, seed, t) -> CohortUpdate:
        """The cohort's round of local work: plain SGD as the client state trains it (``ClientState.train``:
        FedRep's phases, Ditto's personal model); any other program through the trainer, its states kept."""
        if self.plain:
            return client_state.train(trainer, starts, data, cohort, lr, works, seed, t)
        call = self.call(cohort, starts)
        trained = trainer(starts, data, cohort, lr, works, seed, t, program=call)
        check(
            trained.kept is not None or not len(cohort) or not self.keeps,
            "device.backend",
            type(trainer).__name__,
            "a backend that runs client programs (passes program= to fedrun.programs.train_cohort)",
        )
        self.keep(cohort, call.owns, trained.kept)
        return trained

    def call(self, cohort: np.ndarray, like: torch.Tensor) -> Program | None:
        """What a trainer call carries for ``cohort``: the program, their own states and the broadcast (None for
        plain local SGD: the trainers' own default)."""
        return None if self.plain else Program(self, self.owns(cohort, like), self.shared())

    def keep(self, cohort: np.ndarray, owns: torch.Tensor | None, kept: torch.Tensor | None) -> None:
        """After the cohort's clients ran: the server's state from their states before (``owns``) and after
        (``kept``), and each client's new state in the store."""
        if not self.keeps or not len(cohort):
            return
        self.server_keep(cohort, owns, kept)
        for row, client in enumerate(cohort):
            self.store.put(int(client), kept[row].cpu())

    def server_keep(self, cohort: np.ndarray, before: torch.Tensor, after: torch.Tensor) -> None:
        """The server's state after the cohort's clients changed theirs from ``before`` to ``after``."""

    def adjust(self, update: torch.Tensor, sent: torch.Tensor, cohort: np.ndarray) -> torch.Tensor:
        """The server's update after aggregation (FedDyn's h), from the aggregated ``update`` and what the cohort
        ``sent``; default: the aggregate."""
        return update

    def exchanged(self) -> tuple[int, int]:
        """Models a client downloads and updates it uploads each round, counting the control variates."""
        return 1, 1

    def state_dict(self) -> dict:
        if not self.keeps:
            return {}
        return {"store": self.store.state_dict(), "server": self.server}

    def load_state_dict(self, state: dict) -> None:
        if self.keeps:
            self.store.load_state_dict(state.get("store", {}))
            self.server = state.get("server")


@dataclass
class Program:
    """A program as a trainer call carries it: the program and the cohort's own states and broadcast."""

    program: LocalSGD
    owns: torch.Tensor | None = None
    shared: torch.Tensor | None = None

    def rows(self, lo: int, hi: int) -> Program:
        """The call for clients [lo, hi) of the cohort (a worker's or a rank's block)."""
        return Program(self.program, None if self.owns is None else self.owns[lo:hi], self.shared)


PLAIN = Program(LocalSGD())


class Frozen(LocalSGD):
    """Local SGD with the parameters ``names`` kept at their start (FedRep's phases: the head with the body frozen,
    then the body with the new head frozen)."""

    def __init__(self, names: tuple[str, ...] = ()):
        super().__init__()
        self.names = tuple(names)

    def frozen(self) -> tuple[str, ...]:
        return self.names


class Pulled(LocalSGD):
    """Local SGD on F_k(v) + (lam / 2) ||v - anchor||^2, the anchor being the call's broadcast (``shared``): Ditto's
    personal objective (the anchor is the round's global model w^t). The loss a client reports is F_k alone."""

    def __init__(self, lam: float = 0.0):
        super().__init__()
        self.lam = float(lam)

    def pull(self, model: torch.nn.Module, shared: torch.Tensor | None) -> tuple | None:
        return (self.lam, _anchors(model, shared)) if self.lam else None


class Mixed(LocalSGD):
    """Local SGD of w beside APFL's personal model v and mixing weight alpha (``fedrun.clients.apfl_step``), on the
    same mini-batches: each step moves (v, alpha) from the step's (w, v, alpha), then w. A client's own state is the
    row (v, alpha) and it keeps (v', alpha'), v' written as v + (v' - v) like every model update here.

    Args:
        alpha_lr: Step size of alpha's gradient step (0: alpha stays fixed).
    """

    def __init__(self, alpha_lr: float = 0.0):
        super().__init__()
        self.alpha_lr = float(alpha_lr)

    def start(self, client, start, own, shared) -> Local:
        local = super().start(client, start, own, shared)
        v0 = local.own[:-1]
        local.personal = (v0, v0, float(local.own[-1]))
        return local

    def before(self, local: Local, chosen: torch.Tensor) -> None:  # from the step's (w, v, alpha), before w moves
        client, (v0, v, alpha) = local.client, local.personal
        w = _models.flat_parameters(client.model)
        v, alpha = apfl_step(client.model, w, v, alpha, client.x[chosen], client.y[chosen], client.lr, self.alpha_lr)
        local.personal = (v0, v, alpha)

    def kept(self, local: Local, delta: torch.Tensor, steps: int) -> torch.Tensor:
        v0, v, alpha = local.personal
        moved = v0 + (v - v0)
        return torch.cat([moved, moved.new_tensor([alpha])])

    def batch_before(self, model, params, carried, x, y, mask, count, lr):  # ``apfl_step`` as a function of tensors
        v, alpha = carried[:-1], carried[-1]
        w = torch.cat([p.reshape(-1) for p in params.values()])

        def loss(flat):
            logits = torch.func.functional_call(model, _models.flat_views(flat, params.items()), (x,))
            return masked_mean(torch.nn.functional.cross_entropy(logits, y, reduction="none"), mask, count)

        g = torch.func.grad(loss)(alpha * v + (1 - alpha) * w)
        stepped = v - (lr * alpha) * g  # both from the step's (w, v, alpha)
        if self.alpha_lr:
            alpha = torch.clamp(alpha - self.alpha_lr * torch.dot(v - w, g), 0.0, 1.0)
        return torch.cat([stepped, alpha.reshape(1)])

    def batch_kept(self, own, carried):
        v0, v = own[:-1], carried[:-1]
        return torch.cat([v0 + (v - v0), carried[-1:]])


class Scaffold(LocalSGD):
    """SCAFFOLD (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
    Algorithm 1). Each local step corrects the gradient by the variates, y <- y - eta_l (g_i(y) - c_i + c) (line 10);
    after K steps the client's variate is option II's, c_i+ = c_i - c + (x - y_i) / (K eta_l) (line 12); the server
    keeps c <- c + (1/N) sum_{i in S} (c_i+ - c_i) (line 17, |S|/N times the cohort's mean) and steps the model
    along the run's aggregate of the y_i - x (line 16: with ``aggregator=fedavg aggregator.weighting=uniform`` and
    ``server.lr`` eta_g, the paper's x <- x + eta_g mean(Delta y)). Every c_i starts at 0, c at 0 (line 1).

    Option II reuses the local steps' own displacement (no extra pass over the client's data); option I, the
    gradient of the client's data at x, costs a pass and is not offered. The correction goes into the run's local
    solver: with plain SGD it is the paper's step. Each client downloads c beside x and uploads c_i+ - c_i beside
    its update (``exchanged``).
    """

    keeps, serves, name = True, True, "scaffold"

    def initial(self, d: int) -> torch.Tensor:
        return torch.zeros(d)

    def shared(self) -> torch.Tensor | None:
        return torch.zeros(self.context.layout[-1][2]) if self.server is None else self.server

    def gradient(self, grad, param, start, own, shared):
        return grad + (shared - own)  # g_i(y) - c_i + c (line 10)

    def kept(self, local: Local, delta: torch.Tensor, steps: int) -> torch.Tensor:
        if not steps:
            return local.own.clone()
        # (x - y_i) = -delta = lr sum_j a_j (g_j - c_i + c): divided by lr ||a||_1, the a-weighted mean of the
        # corrected gradients, c_i+ their mean gradient. With plain SGD ||a||_1 = K, the paper's K eta_l (line 12);
        # with momentum K alone made c_i+ about 1 / (1 - momentum) times too large (and the run diverge).
        return local.own - local.shared - delta / (local.norm * local.client.lr)

    def server_keep(self, cohort, before, after) -> None:
        total = len(self.context.sizes)  # N: every client of the run
        self.server = self.shared() + (after - before).sum(0).cpu() / total

    def exchanged(self) -> tuple[int, int]:
        return 2, 2


class FedDyn(LocalSGD):
    """FedDyn (Acar et al. 2021, "Federated Learning Based on Dynamic Regularization", Algorithm 1). Client k
    minimises L_k(theta) - <grad L_k(theta_k^{t-1}), theta> + (alpha / 2) ||theta - theta^{t-1}||^2 from the
    server's theta^{t-1} (line 6); its linear term starts at 0 and becomes grad L_k(theta_k^{t-1}) - alpha
    (theta_k^t - theta^{t-1}) (line 7, the first-order condition of its problem). The server keeps
    h^t = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1}) over the m clients of the run (line 9) and
    sets theta^t = (1/|P_t|) sum theta_k^t - (1/alpha) h^t (line 10): here the run's aggregate of the updates less
    h^t / alpha (``adjust``; the paper's with ``aggregator.weighting=uniform`` and server SGD at lr 1).

    The regulariser enters as its gradient, -g_k + alpha (theta - theta^{t-1}), added to the data term's (the local
    loss a client reports is the data term, as FedProx's). In its first round (g_k = 0) a client solves FedProx's
    problem with mu = alpha.

    Args:
        alpha: alpha > 0 (the paper's 0.01-0.1, its code's example 0.01; FL-bench 0.1, PFLlib's shared alpha 1.0).
    """

    keeps, serves, name = True, True, "feddyn"

    def __init__(self, alpha: float = 0.01, memory_mb: float = 1024.0):
        super().__init__(memory_mb)
        check(isinstance(alpha, (int, float)) and alpha > 0, "alpha", alpha, "a number > 0")
        self.alpha = float(alpha)

    def initial(self, d: int) -> torch.Tensor:
        return torch.zeros(d)

    def gradient(self, grad, param, start, own, shared):
        return torch.add(grad, param - start, alpha=self.alpha) - own  # grad L_k - g_k + alpha (theta - theta^{t-1})

    def kept(self, local: Local, delta: torch.Tensor, steps: int) -> torch.Tensor:
        return local.own - self.alpha * delta

    def adjust(self, update: torch.Tensor, sent: torch.Tensor, cohort: np.ndarray) -> torch.Tensor:
        h = torch.zeros_like(update) if self.server is None else self.server.to(update)
        if len(cohort):
            h = h - self.alpha * sent.sum(0) / len(self.context.sizes)
        self.server = h.cpu()
        return update - h / self.alpha


class Moon(LocalSGD):
    """MOON (Li, He and Song 2021, "Model-Contrastive Federated Learning", Algorithm 1). Each mini-batch's loss is
    the data term plus mu times the model-contrastive loss (eq. 3),

        l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) ),

    with z, z_glob and z_prev the representations of the inputs under the local model being trained, the round's
    global model and the client's previous local model (its model at the end of its last round; the initial global
    model before, as PFLlib's: FL-bench takes the round's global model, the authors' code an empty pool in round 0
    and then each party's own network, docs/explanation/client-programs.md), and sim the cosine similarity. The
    representation is the input of the model's last layer (the module holding its last parameter): for ``mlp`` the
    last hidden layer's 200 (or ``hidden[-1]``) units, for ``cnn`` the flattened features before ``fc``, for
    ``fedavg_cnn`` the 512 units of its first dense layer, for ``leaf_cnn`` its 2048-unit dense layer, for
    ``char_lstm`` the last step's LSTM output. The paper adds a projection head before it; fedrun's models have none, as PFLlib's and FL-bench's MOON use the base's output.
    A model whose last layer reads its raw inputs (``logistic``) has no representation to contrast: refused.

    Args:
        mu: Weight of the contrastive term (the paper's tuned values: 5 on CIFAR-10, 1 on CIFAR-100 and
            Tiny-ImageNet; it has no MNIST-like data); 0 is FedAvg.
        tau: Temperature (the paper's 0.5).
    """

    keeps, name = True, "moon"

    def __init__(self, mu: float = 1.0, tau: float = 0.5, memory_mb: float = 1024.0):
        super().__init__(memory_mb)
        check(isinstance(mu, (int, float)) and mu >= 0, "mu", mu, "a number >= 0")
        check(isinstance(tau, (int, float)) and tau > 0, "tau", tau, "a number > 0")
        self.mu, self.tau = float(mu), float(tau)

    def bind(self, context: Context) -> None:
        super().bind(context)
        if context.layout:
            names = [name for name, _, _ in context.layout]
            check(
                len({n.rsplit(".", 1)[0] for n in names}) > 1,
                "client",
                "moon",
                "a model with a layer before its last (logistic has none: its representation would be its inputs)",
            )

    def initial(self, d: int) -> torch.Tensor:
        return self.context.initial

    def objective(self, local: Local, chosen: torch.Tensor):
        if not self.mu:
            return None
        model, x = local.client.model, local.client.x[chosen]
        with torch.no_grad():
            z_glob = representation(model, local.start, x)
            z_prev = representation(model, local.own, x)
        last = last_layer(model)
        seen = {}
        handle = last.register_forward_pre_hook(lambda module, inputs: seen.__setitem__("z", inputs[0].flatten(1)))

        def term(local: Local):
            handle.remove()
            z = seen["z"]
            positive = torch.cosine_similarity(z, z_glob, dim=-1) / self.tau
            negative = torch.cosine_similarity(z, z_prev, dim=-1) / self.tau
            logits = torch.stack([positive, negative], dim=1)
            return self.mu * torch.nn.functional.cross_entropy(
                logits, torch.zeros(len(z), dtype=torch.long, device=z.device)
            )

        return term

    def batch_loss(self, model, params, x, y, mask, count, start, own):
        logits, z = forward_with_representation(model, params, x)
        data = masked_mean(torch.nn.functional.cross_entropy(logits, y, reduction="none"), mask, count)
        if not self.mu:
            return data, data
        z_glob, z_prev = forward_with_representation(model, start, x)[1], forward_with_representation(model, own, x)[1]
        positive = torch.cosine_similarity(z, z_glob, dim=-1) / self.tau
        negative = torch.cosine_similarity(z, z_prev, dim=-1) / self.tau
        logits = torch.stack([positive, negative], dim=1)
        contrastive = torch.nn.functional.cross_entropy(
            logits, torch.zeros(len(z), dtype=torch.long, device=z.device), reduction="none"
        )
        return data + self.mu * masked_mean(contrastive, mask, count), data

    def kept(self, local: Local, delta: torch.Tensor, steps: int) -> torch.Tensor:
        return local.start + delta  # the client's local model: next round's z_prev


class Tilted(LocalSGD):
    """Sample-level tilted ERM inside the client (Li, Beirami, Sanjabi and Smith 2021, "Tilted Empirical Risk
    Minimization", ICLR, eq. 2): each mini-batch's loss is (1/tau) log mean_j exp(tau l_j) over its samples'
    losses l_j, whose gradient weighs sample j by softmax(tau l)_j (tau > 0: the hardest samples more; tau < 0:
    outliers less; tau = 0: the mean, plain local SGD exactly). The loss a client reports is the plain mean (what
    every other program reports). With ``aggregator=term`` across clients both tilts run; with its ``tau`` too, the
    tilt across clients reads each client's tilted risk: hierarchical TERM (``method=hierarchical_term``). The tilt
    is normalised within each mini-batch, so its strength follows the batch size (batch size 1: plain SGD); the
    authors keep a running normaliser.

    Args:
        tau: The sample-level tilt, any real number; null is 0 (``method=hierarchical_term`` sets it to
            ``aggregator.tau``, whose null is the mean loss).
    """

    name = "tilted"

    def __init__(self, tau: float | None = 1.0, memory_mb: float = 1024.0):
        super().__init__(memory_mb)
        check(
            tau is None or (number(tau) and math.isfinite(tau)),
            "tau",
            tau,
            "null (0) or a finite number",
        )
        self.tau = 0.0 if tau is None else float(tau)

    def closure(self, local: Local, chosen: torch.Tensor):
        if self.tau == 0:
            return super().closure(local, chosen)
        client, clear = local.client, cleared(local.optimizer)

        def closure():
            clear()
            losses = torch.nn.functional.cross_entropy(
                client.model(client.x[chosen]), client.y[chosen], reduction="none"
            )
            ((torch.logsumexp(self.tau * losses, 0) - math.log(len(losses))) / self.tau).backward()
            return losses.mean().detach()

        return closure

    def batch_loss(self, model, params, x, y, mask, count, start, own):
        losses = torch.nn.functional.cross_entropy(torch.func.functional_call(model, params, (x,)), y, reduction="none")
        mean = masked_mean(losses, mask, count)
        if self.tau == 0:
            return mean, mean
        # padding's exp(tau l) counts 0: log(mask) is -inf there (a client whose batch is all padding has finished;
        # its step is discarded)
        tilted = (torch.logsumexp(self.tau * losses + torch.log(mask), 0) - torch.log(count)) / self.tau
        return tilted, mean


def with_gradients(model: torch.nn.Module, *flats: torch.Tensor | None):
    """Each parameter of ``model`` that has a gradient, with its slice of each flat vector (in ``flat_parameters``'
    order) viewed in its shape (None for a flat that is None)."""
    slices = [_anchors(model, f) if f is not None else [None] * len(list(model.parameters())) for f in flats]
    for p, *views in zip(model.parameters(), *slices):
        if p.grad is not None:
            yield (p, *views)


def last_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The module that holds the model's last parameter (MOON reads its input as the representation)."""
    name = [n for n, _ in model.named_parameters()][-1]
    return model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model


def representation(model: torch.nn.Module, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The input of ``model``'s last layer for ``x`` under the flat parameters ``flat`` (flattened per sample), by a
    functional call: the workspace's own parameters are untouched."""
    views = {name: view for (name, _), view in zip(model.named_parameters(), _anchors(model, flat))}
    return forward_with_representation(model, views, x)[1]


def forward_with_representation(
    model: torch.nn.Module, params: dict, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ``model`` for ``x`` under ``params`` ({name: tensor}, a functional call) and the input of its
    last layer (MOON's representation, flattened per sample)."""
    seen = {}
    handle = last_layer(model).register_forward_pre_hook(lambda module, inputs: seen.__setitem__("z", inputs[0]))
    try:
        logits = torch.func.functional_call(model, params, (x,))
    finally:
        handle.remove()
    return logits, seen["z"].flatten(1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, count) -> torch.Tensor:
    """The mean of a padded batch's per-sample ``values`` over its real samples (``mask`` 1, ``count`` of them)."""
    return (values * mask).sum() / count


def train_cohort(
    model: torch.nn.Module,
    global_params: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    parts: list[np.ndarray],
    client_ids: np.ndarray,
    make_optimizer,
    lr: float,
    work,
    seed: int,
    round_,
    stream: str = "batches",
    program: Program | None = None,
    out: torch.Tensor | None = None,
) -> CohortUpdate:
    """Run the client program on each cohort client from its start (``global_params``: the global model, or one
    row per client), on its samples (``parts``), with its work (one ``LocalWork`` or one each) and its (round,
    client) mini-batch stream under ``seed``; ``round_`` may hold one round per client (an asynchronous client's
    job count). ``model`` is a workspace whose parameters are overwritten. ``program``: the program and the cohort's
    own states (default: plain local SGD). ``out``: one row per client that the updates are written into (the
    worker processes' rows of a shared buffer: nothing to copy back); default a new tensor. Returns the updates
    and reports in cohort order."""
    call, works = program or PLAIN, work if isinstance(work, list) else [work] * len(parts)
    if out is None:  # written row by row as clients finish: no per-client vector, no stacking after
        out = global_params.new_empty(len(parts), global_params.shape[-1])
    done = []
    model.train()
    for row, run in enumerate(
        cohort_calls(model, x, y, parts, client_ids, works, lr, make_optimizer, round_, seed, stream)
    ):
        own = None if call.owns is None else call.owns[row]
        local = call.program.start(run, per_client_start(global_params, row), own, call.shared)
        local.out = out[row]
        job = run.job
        for batch in _batches(len(run.index), job.batch_size, job.local_epochs, job.local_steps, local.generator):
            local = call.program.step(local, batch)
        done.append(call.program.finish(local))
    model.eval()
    return CohortUpdate.of(done, global_params, out)


def cohort_calls(
    model: torch.nn.Module, x, y, parts, client_ids, works, lr, make_optimizer, round_, seed: int, stream: str
) -> list[Client]:
    """Each cohort client's call, in cohort order: the workspace, its samples (``parts``) in ``x``, ``y``, its work,
    id and round (``round_``: one, or one per client) and its mini-batch stream; what every backend hands a program."""
    return [
        Client(
            model,
            x,
            y,
            torch.as_tensor(part, device=x.device),
            job,
            lr,
            make_optimizer,
            int(client),
            per_client_round(round_, row),
            seed,
            stream,
        )
        for row, (part, client, job) in enumerate(zip(parts, client_ids, works))
    ]
