"""The synchronous round loop. No Hydra here: it takes plain objects and reports each round to a callback.

A round reads top to bottom as select, each client's start and data, train, stages, aggregate, server step,
record; each step is a part of ``fedrun.parts.Parts`` (``fedrun.parts`` says what each may do).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from fedrun.backends import Device, as_device, passes
from fedrun.checkpoint import Checkpoint, snapshot
from fedrun.clients import (
    FStarEstimate,
    client_accuracy,
    client_rows,
    evaluate_splits,
    judged_accuracy,
    pooled_judging,
)
from fedrun.cohort import ClientLosses, ClientReport, Lazy, LocalWork, RoundView
from fedrun.datasets import FederatedData
from fedrun.errors import DivergenceError
from fedrun.lazy import deferrable, torch
from fedrun.metrics import fairness
from fedrun.partitions import LazyClients, client_sizes
from fedrun.parts import Parts, layout
from fedrun.personal import STATISTICS, columns, statistics
from fedrun.rounds import (
    AttackEffect,
    Bits,
    RunResult,
    Schedule,
    Timer,
    malicious_table,
    progress,
    record,
)
from fedrun.sampling import LOSS_BYTES
from fedrun.seeding import numpy_rng
from fedrun.state import Context

_models = deferrable("fedrun.models")  # subclasses torch's classes: fedrun.lazy
_optimizers = deferrable("fedrun.optimizers")  # subclasses torch's classes: fedrun.lazy


@dataclass
class Loop:
    """What the synchronous loop carries between rounds besides its parts (checkpointed as ``loop``)."""

    params: torch.Tensor  # the global model w_t
    rng: np.random.Generator  # the sampler's draws
    previous: torch.Tensor | None = None  # w_{t-1}, for aggregators that read it (MVR)
    latest_accuracy: float = math.nan  # what accuracy-triggered aggregators (hybrid) see
    fstar: dict = field(default_factory=dict)  # the F* estimate's cache

    @classmethod
    def started(cls, parts: Parts, checkpoint: Checkpoint | None, initial: torch.Tensor, seed: int) -> tuple:
        """(loop, result, first round): as they were after the checkpoint's round, or new."""
        if (saved := parts.restore(checkpoint, initial)) is None:
            return cls(initial, numpy_rng(seed, "sampling")), RunResult(initial), 1
        loop = cls(**saved["loop"])
        return loop, RunResult(loop.params, rows=saved["rows"]), saved["round"] + 1


def run(
    model: torch.nn.Module,
    data: FederatedData,
    clients: list[np.ndarray],
    parts: Parts,
    optimizer: Callable[..., torch.optim.Optimizer],
    schedule: Schedule,
    device: Device | torch.device,
    seed: int,
    on_round: Callable[[dict, dict], None] = lambda metrics, per_client: None,
    client_tests: list[np.ndarray] | None = None,
    checkpoint: Checkpoint | None = None,
    client_vals: list[np.ndarray] | None = None,
) -> RunResult:
    """Run synchronous federated training.

    Args:
        model: The global model's architecture, already initialised from the ``init`` stream.
        data: The dataset's tensors.
        clients: One training-index array per client.
        parts: The round's parts (``fedrun.parts.Parts``: sampler, client state, heterogeneity, stages, aggregator,
            server optimizer, privacy); bound here.
        optimizer: ``optimizer(params, lr=...)`` builds a local optimizer; its own ``lr`` is the base rate.
        schedule: Rounds, local work, sampling, evaluation.
        device: Where and how to train (a ``torch.device`` means the plain loop in the contiguous layout).
        seed: Run seed (client sampling and mini-batch streams).
        on_round: Called after each round with its row and per-client series (``alpha``, ``local_steps``, ...).
        client_tests: Each client's own held-out samples (indices into train), or None: the cohort's local models
            on them (``client_accuracy``), every client's model (``ClientState.models``) each evaluated round.
        checkpoint: Where and when to checkpoint, and whether to resume from its file (see fedrun.checkpoint).
        client_vals: Each client's own validation samples, or None: as ``client_tests`` (``personal/val_``).

    Returns: The final model and the metrics rows."""
    device, sizes = as_device(device), client_sizes(clients)  # a population's sizes: one shared array
    tensors, weighting = Tensors.on(device, model, data, clients), getattr(parts.aggregator, "weighting", "samples")
    first_lr, initial = _optimizers.base_lr(optimizer), _models.flat_parameters(model)  # w_0, F* starts there
    workdir = checkpoint.path.parent if checkpoint is not None else None
    shape = dict(layout=layout(model), batch_norm=_models.batch_norm_names(model))  # the flat model's layers, by name
    parts.bind(Context(schedule, sizes, seed, weighting, initial=initial, workdir=workdir, **shape))
    loop, result, first = Loop.started(parts, checkpoint, initial, seed)
    m = schedule.cohort_size(len(clients))
    x, y = parts.attack.training_data(*parts.client_state.training_data(tensors.x, tensors.y))
    trainer = device.trainer(model, x, y, optimizer, m * passes(int(sizes.mean()), schedule.work))
    fstar = FStarEstimate(trainer, initial, clients, optimizer, schedule.batch_size, seed)
    fstar.cache = loop.fstar  # one dict: the checkpoint's loop holds the estimates
    bits = Bits.of(parts.stages, initial, parts.client_state, parts.client)
    tensors.root = None if data.root is None else (data.root, schedule.work)  # FLTrust's root set, its local work
    judge = Judge(model, parts.client_state, trainer, tensors, clients, client_tests, client_vals, schedule, seed)
    bar = progress(first, schedule.rounds, "rounds", "round")
    measure = partial(tensors.measure, per_sample=trainer.per_sample)  # the trainer's ranks may share it
    try:
        for t in range(first, schedule.rounds + 1):
            if parts.exhausted():  # the run ends here, FINISHED (privacy's max_epsilon: the tag stopped_by)
                break
            started, timer = time.perf_counter(), Timer()
            probe = Probe(trainer, loop.params, clients, schedule.batch_size, parts.attack, t)
            with timer("selection_wall_s"):  # Power-of-Choice's loss pass over its candidates (they may lie)
                selection = parts.sampler.draw(loop.rng, probe, parts.devices.available())
            selection, works, selected = who_trains(parts, selection, t, sizes, schedule, seed, len(clients), bits)
            cohort, lr, lying = selection.cohort, schedule.lr(first_lr, t), parts.attack.malicious(t, selection.cohort)
            own = parts.client_state.data(cohort, [clients[i] for i in cohort])
            trained_on = parts.attack.data(t, cohort, own, lying)  # a data-poisoning attack's clients train on theirs
            starts = parts.client_state.starts(loop.params, cohort)
            with timer("train_wall_s"):
                trained = parts.train(trainer, starts, trained_on, cohort, lr, works, seed, t)
            parts.client_state.keep(cohort, starts, trained.deltas)
            view = round_view(trainer, loop, selection, trained, trained_on, works, lr, t, fstar, tensors, sizes, probe)
            with timer("pipeline_wall_s"):  # the attackers replace what they send, then every update takes the stages
                sent = parts.attack.updates(t, cohort, parts.client_state.upload(trained.deltas), lying, view)
                sent, stage_diagnostics = parts.stages(sent, cohort, t)
                parts.stages.end_round()
            local = client_accuracy_column(model, trainer, starts, trained.deltas, tensors, client_tests, cohort, own)
            effect = AttackEffect(parts.attack, parts.aggregation, lying)  # the rule in its state now, on the honest
            with timer("aggregate_wall_s"):
                update, alpha, diagnostics = parts.aggregation.aggregate(loop.params, sent, view)
                parts.sampler.observe(cohort, sent)
                loop.previous, loop.params = loop.params, parts.step(loop.params, update, sent, cohort)
            diverged = not _models.all_finite(loop.params)
            row = metrics(t, lr, selection, selected, trained, view, timer, bits, tensors, diverged, schedule)
            row.update(local, **diagnostics, **parts.devices.columns())
            row.update(selection.spread or {}, **stage_diagnostics, **timings(timer, view))
            row.update(effect.columns(update, alpha, loop.previous, sent, view))
            per_client = {"alpha": spread_over(alpha, cohort, len(clients)), "selected": selected}
            per_client["local_steps"] = spread_over(trained.steps, cohort, len(clients)).astype(int)
            row.update(judge(loop.params, lr, t, per_client, measured=not diverged and schedule.evaluates(t)))
            last = record(row, loop.params, diverged, lr, schedule, measure, result, on_round, per_client, bar, started)
            loop.latest_accuracy = row[tensors.accuracy_source] if schedule.evaluates(t) else loop.latest_accuracy
            if checkpoint:
                checkpoint.after_round(
                    t, row["round_wall_s"], last, lambda: snapshot("sync", t, last, parts, vars(loop), result.rows)
                )
            bar.update()
            if last:
                break
        finish(result, parts)
    finally:
        bar.close()  # before the caller's one-line error, so that the line is the last one printed
        trainer.close()
    return result


@dataclass
class Tensors:
    """The run's data on its device, and how the global model is measured on it."""

    model: torch.nn.Module
    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    x_val: torch.Tensor | None
    y_val: torch.Tensor | None
    held_out: tuple  # what client_tests index: (x, y)
    calibration: tuple | None = None  # a batch-norm model's statistics on the server: every client's training inputs
    root: tuple | None = None  # the server's root set (FLTrust) and the local work it trains with

    @classmethod
    def on(cls, device: Device, model: torch.nn.Module, data: FederatedData, clients=None) -> Tensors:
        has_val = data.x_val is not None and len(data.y_val) > 0
        val = (data.x_val, data.y_val) if has_val else (None, None)
        x, y, x_test, y_test, x_val, y_val = device.prepare(
            model, data.x_train, data.y_train, data.x_test, data.y_test, *val
        )
        model.eval()
        calibration = server_calibration(model, x, clients)
        held_out = data.held_out(x, y, x_test, y_test)
        return cls(model, x, y, x_test, y_test, x_val, y_val, held_out, calibration)

    @property
    def has_val(self) -> bool:
        return self.x_val is not None

    @property
    def accuracy_source(self) -> str:
        return "val_accuracy" if self.has_val else "test_accuracy"

    @property
    def columns(self) -> list[str]:
        return ["test_accuracy", "test_loss"] + (["val_accuracy", "val_loss"] if self.has_val else [])

    def measure(self, w: torch.Tensor, per_sample=None) -> dict:
        """The global model's test (and validation) columns; ``per_sample``: the trainer's (``Trainer.per_sample``)."""
        splits = [(self.x_test, self.y_test)] + ([(self.x_val, self.y_val)] if self.has_val else [])
        measured = evaluate_splits(self.model, w, splits, self.calibration, per_sample)  # one calibration for both
        return dict(zip(self.columns, (value for pair in measured for value in pair)))


def server_calibration(model: torch.nn.Module, x: torch.Tensor, clients) -> tuple | None:
    """What a batch-norm model's statistics are computed from on the server (``fedrun.clients.calibrate``): every
    client's training samples pooled, their held-out ones left out (a population's clients are drawn from the whole
    training split); None for a model without batch norm."""
    if not _models.batch_norms(model):
        return None
    pooled = None if clients is None or isinstance(clients, LazyClients) else np.concatenate(list(clients))
    return x, None if pooled is None else torch.as_tensor(np.unique(pooled), device=x.device)


def who_trains(parts: Parts, selection, t: int, sizes, schedule: Schedule, seed: int, num_clients: int, bits=None):
    """The round's selection after its stragglers dropped out and, with devices, after the clients too late to
    report did (``fedrun.devices``: each client's time from its work and the messages of ``bits``), each client's
    work, and who was picked (before they dropped out: ``selected``, the draws of each client)."""
    selected = np.zeros(num_clients, dtype=np.int64)
    selected[selection.cohort] = selection.counts
    cohort = selection.cohort
    plan = parts.heterogeneity.plan(t, cohort, sizes[cohort], schedule.work, seed, counts=selection.counts)
    works = [work for work in plan if work is not None]
    selection = selection.keep(np.array([work is not None for work in plan], dtype=bool))
    if parts.devices.clocked:  # the messages every cohort client exchanges: the model (and a program's extra ones)
        down, up = (1 + bits.extra_down) * bits.dense_mb, bits.upload_mb + bits.extra_up * bits.dense_mb
        work_passes = [passes(int(sizes[c]), work) for c, work in zip(selection.cohort, works)]
        probe, probed = None, selection.candidates  # Power-of-Choice's: each downloads the model, sends its loss
        if probed is not None:  # first; the cohort, which holds the model then, downloads a program's extra messages
            probe, down = (probed, sizes[probed], bits.dense_mb, LOSS_BYTES / 1e6), bits.extra_down * bits.dense_mb
        reported = parts.devices.round(selection.cohort, work_passes, down, up, probe)
        selection, works = selection.keep(reported), [work for work, kept in zip(works, reported) if kept]
    return selection, works, selected


def round_view(trainer, loop: Loop, selection, trained, data, works, lr, t, fstar, tensors, sizes, probe) -> RoundView:
    """What the aggregator may read this round: what the clients computed (the honest report) and what they tell
    the server (the reported one, ``Attack.report``: the attackers' lies), and the round's lazy signals, which cost
    nothing unless read. ``probe``: the round's ``Probe`` (its attack, and the losses it measured)."""
    cohort, w, previous, seed, batch_size = selection.cohort, loop.params, loop.previous, fstar.seed, fstar.batch_size
    server, root = np.array([len(sizes)]), tensors.root  # the server trains on its root set under a key no client has
    # F_i(w_t), what the loss-weighted aggregators weigh by: a pass over the cohort's data at w_t (what
    # Power-of-Choice already measured to choose the cohort is not measured again).
    measured = probe.measured(cohort) if len(cohort) else None
    losses = measured if measured is not None else Lazy(lambda: trainer.losses(w, data, batch_size))
    honest = ClientReport(sizes[cohort], losses, trained.local_losses, trained.steps, trained.coefficient_norms)
    return RoundView.of(
        cohort,
        honest,
        probe.told(cohort, honest, selection.losses),
        round=t,
        accuracy=loop.latest_accuracy,
        accuracy_source=tensors.accuracy_source,
        fstar=fstar,
        sampled_weights=selection.weights,  # importance sampling's unbiased weights (FedAvg takes them)
        lr=lr,  # the round's local learning rate (q-FedAvg's Lipschitz estimate is its inverse)
        # From the previous global model on the same mini-batches (same round and client keys); MVR.
        measure=lambda signal: trainer.per_client(signal, w, data),
        previous_deltas=Lazy(
            lambda: None if previous is None else trainer(previous, data, cohort, lr, works, seed, t).deltas
        ),
        # FLTrust's g_0: the round's model trained on the server's root set with the clients' work.
        server_update=Lazy(
            lambda: None if root is None else trainer(w, [root[0]], server, lr, [root[1]], seed, t).deltas[0]
        ),
    )


class Probe:
    """Power-of-Choice's question to its candidates, ``probe(ids)``: their losses at the round's model, as they
    report them (an attacker may lie, ``Attack.losses``); the honest values are kept for the round's own record.
    ``told`` gives the cohort's reported record of its round (the round's attack and its liars)."""

    def __init__(self, trainer, params, clients, batch_size, attack, round_):
        self.trainer, self.params, self.clients, self.batch_size = trainer, params, clients, batch_size
        self.attack, self.round, self.honest = attack, round_, {}

    def __call__(self, ids: np.ndarray) -> ClientLosses:
        honest = self.trainer.losses(self.params, [self.clients[i] for i in ids], self.batch_size)
        self.honest.update(zip((int(i) for i in ids), zip(honest.mean, honest.authors)))
        return self.attack.losses(self.round, ids, honest, self.attack.malicious(self.round, ids))

    def measured(self, cohort: np.ndarray) -> ClientLosses | None:
        """The cohort's honest losses when the probe measured every one of them, else None."""
        if not all(int(c) in self.honest for c in cohort):
            return None
        values = np.array([self.honest[int(c)] for c in cohort], dtype=np.float64).reshape(len(cohort), 2)
        return ClientLosses(values[:, 0], values[:, 1])

    def told(self, cohort: np.ndarray, honest: ClientReport, drawn: ClientLosses | None) -> ClientReport:
        """What the cohort tells the server of its round (``Attack.report``; ``drawn``: the losses it reported to be
        drawn, Power-of-Choice's)."""
        return self.attack.report(self.round, cohort, honest, self.attack.malicious(self.round, cohort), drawn)


def metrics(t, lr, selection, selected, trained, view, timer, bits, tensors, diverged, schedule) -> dict:
    """The round's row before its stages', aggregator's and timing columns (every row has every column, NaN when
    not evaluated, so that metrics.csv can be appended to)."""
    cohort = selection.cohort
    # Read while aggregating, they have their own columns ("losses", as reported, is read through "true_losses").
    view.signals_s = sum(seconds for name, seconds in view.wall_s.items() if name != "losses")
    models = 2 if view.read("previous_deltas") else 1  # the previous model goes down, its update up
    train_loss = math.nan
    if len(cohort) and (view.read("true_losses") or (not diverged and schedule.evaluates(t))):
        if not np.all(np.isfinite(view.true_losses.mean)):
            raise DivergenceError(f"non-finite training loss of the global model at round {t} (lr={lr:g})")
        train_loss = float(np.average(view.true_losses.mean, weights=view.true_sizes))
    unkept = max(selection.probed - int(np.count_nonzero(selected)), 0)  # candidates probed, not kept
    row = {
        "round": t,
        "train_loss": train_loss,
        "lr": lr,
        "upload_mb": len(cohort) * (bits.upload_mb + (models - 1 + bits.extra_up) * bits.dense_mb)
        + selection.probed * LOSS_BYTES / 1e6,
        "download_mb": ((models + bits.extra_down) * len(cohort) + unkept) * bits.dense_mb,
        "local_steps_mean": float(trained.steps.mean()) if len(cohort) else 0.0,
        "cohort_size": len(cohort),
    }
    return row | dict.fromkeys(tensors.columns, math.nan)


JUDGED_TOGETHER = 256  # clients whose models are built and judged together (FedPer: 256 copies of the model)


class Judge:
    """Each evaluated round, every client's model (``ClientState.models``: the global model, a personal one, a
    fine-tuned one) on the client's own held-out test and validation samples: the ``personal/`` columns
    (``fedrun.personal.statistics``) and the per-client accuracies (``personal_accuracy.csv``). False (no
    columns) when the run holds nothing out per client."""

    def __init__(self, model, client_state, trainer, tensors, clients, tests, vals, schedule, seed):
        self.model, self.client_state, self.trainer, self.tensors = model, client_state, trainer, tensors
        self.clients, self.tests, self.vals, self.schedule, self.seed = clients, tests, vals, schedule, seed

    def __bool__(self) -> bool:
        return bool(self.tests)

    def __call__(self, params: torch.Tensor, lr: float, t: int, per_client: dict, measured: bool = True) -> dict:
        """The round's ``personal/`` columns (NaN unless ``measured``) and its seconds; adds ``personal_accuracy``
        to ``per_client`` when measured. None in a run that holds nothing out per client."""
        if not self:
            return {}
        if not measured:
            return dict.fromkeys(columns(), math.nan) | {"personal_eval_wall_s": 0.0}
        started, ids = time.perf_counter(), np.arange(len(self.clients))

        def fit(starts, clients, epochs, stream):
            work = LocalWork(self.schedule.batch_size, local_epochs=epochs)
            parts = [self.clients[i] for i in clients]
            return self.trainer(starts, parts, clients, lr, work, self.seed, t, stream).deltas

        row, x, y = {}, *self.tensors.held_out
        named = {name: splits for name, splits in (("accuracy", self.tests), ("val_accuracy", self.vals)) if splits}
        judged = {name: [] for name in named}
        for lo in range(0, len(ids), JUDGED_TOGETHER):  # a model per client: a chunk of them in memory at a time
            chunk = ids[lo : lo + JUDGED_TOGETHER]
            models = self.client_state.models(params, chunk, fit)
            own = (self.tensors.x, [self.clients[i] for i in chunk])  # each client's batch-norm statistics
            split_sets = [[splits[i] for i in chunk] for splits in named.values()]
            for name, accuracy in zip(named, self._judged(models, x, y, split_sets, own)):
                judged[name].append(accuracy)
        for name, splits in (("accuracy", self.tests), ("val_accuracy", self.vals)):
            if not splits:
                row.update({f"personal/{name}_{s}": math.nan for s in STATISTICS})
                continue
            accuracy = np.concatenate(judged[name])
            counts = np.array([len(split) for split in splits])
            row.update({f"personal/{name}_{s}": v for s, v in statistics(accuracy, counts).items()})
            if name == "accuracy":  # how evenly the model each client is served does across the clients
                per_client["personal_accuracy"] = accuracy
                row.update({f"fairness/{s}": v for s, v in fairness(accuracy, counts).items()})
        return row | {"personal_eval_wall_s": time.perf_counter() - started}

    def _judged(self, models, x, y, split_sets, own) -> list[np.ndarray]:
        """``judged_accuracy`` through the trainer: one model's pass over every client's splits shared as the
        server's evaluation is (``Trainer.per_sample``), or the clients judged one by one dealt in blocks
        (``Trainer.by_clients``); either way each client's accuracy is the plain computation's."""
        if pooled_judging(self.model, models, own):  # one pass, its chunks crossing clients
            return judged_accuracy(self.model, models, x, y, split_sets, own, self.trainer.per_sample)

        def block(lo: int, hi: int) -> list[np.ndarray]:
            mine = [splits[lo:hi] for splits in split_sets]
            return judged_accuracy(self.model, client_rows(models, lo, hi), x, y, mine, (own[0], own[1][lo:hi]))

        costs = [1 + sum(len(splits[i]) for splits in split_sets) for i in range(len(own[1]))]
        pieces = self.trainer.by_clients(block, costs)
        return [np.concatenate([piece[k] for piece in pieces]) for k in range(len(split_sets))]


def timings(timer: Timer, view: RoundView) -> dict:
    """The round's wall-clock columns: a lazy signal's time in its own column, not in the step that read it."""
    return {
        "aggregate_wall_s": timer["aggregate_wall_s"] - view.signals_s + timer["pipeline_wall_s"],
        "loss_wall_s": view.wall_s.get("true_losses", 0.0),
        "train_wall_s": timer["train_wall_s"]
        + view.wall_s.get("previous_deltas", 0.0)
        + view.wall_s.get("server_update", 0.0),
        "selection_wall_s": timer["selection_wall_s"],
    }


def client_accuracy_column(model, trainer, starts, deltas, tensors: Tensors, client_tests, cohort, own) -> dict:
    """``client_accuracy``, the papers' client accuracy: each local model (its start plus its update) on its own
    held-out split, averaged over the cohort clients that have held-out samples (a LEAF user with no test sample
    counts in no mean); {} when the run has no client tests. The clients are dealt in blocks by the trainer
    (``Trainer.by_clients``)."""
    if not client_tests:
        return {}
    tests = [client_tests[i] for i in cohort]

    def block(lo: int, hi: int) -> np.ndarray:  # own: each client's training samples, its batch-norm statistics
        rows = client_rows(starts, lo, hi)
        return client_accuracy(model, rows, deltas[lo:hi], *tensors.held_out, tests[lo:hi], (tensors.x, own[lo:hi]))

    accuracy = np.concatenate([np.zeros(0), *trainer.by_clients(block, [1 + len(test) for test in tests])])
    has = [len(client_tests[i]) > 0 for i in cohort]
    return {"client_accuracy": float(accuracy[has].mean()) if any(has) else math.nan}


def finish(result: RunResult, parts: Parts) -> None:
    """What a run reports once, at its end: how evenly clients were selected and who the attackers were."""
    result.summary.update(parts.sampler.summary())
    if parts.attack:  # a tag lists the first of them
        result.tables["malicious.csv"] = malicious_table(parts.attack, [int(r["round"]) for r in result.rows])


def spread_over(values: np.ndarray, cohort: np.ndarray, num_clients: int) -> np.ndarray:
    """A per-client series over all clients: the cohort's ``values``, 0 for the others."""
    out = np.zeros(num_clients)
    out[cohort] = values
    return out


class SyncEngine:
    """The ``engine=sync`` option: runs ``run`` (a class, so unknown config keys fail when it is built)."""

    asynchronous = False  # a capability the compatibility table reads (privacy accounts synchronous rounds only)

    def __call__(self, **kwargs) -> RunResult:
        return run(**kwargs)
