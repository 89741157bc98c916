"""Buffered asynchronous FL on a deterministic virtual clock: a heap of (arrival time, client) events.

No threads and no sleeping. Every client repeatedly pulls the newest global model (remembering its
version), trains, and its update arrives after a compute time drawn from its own random stream. With
``concurrency`` k (FedBuff's), only k clients train at once: they are drawn from the population at the
start, and as updates arrive, as many idle clients (any client not training, the arrived ones included)
are drawn to replace them, from the engine's own random stream; only the training clients hold state. When
the buffer holds b updates the server aggregates and the version increases. A client restarts at its
arrival time with the newest model then available (the new one if its arrival triggered aggregation).
Ties in arrival time are broken by client id, so the same config and seed give the same event order.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from fedrun.aggregators.buffered import BufferReport
from fedrun.backends import as_device, passes
from fedrun.checkpoint import Checkpoint, snapshot
from fedrun.clients import per_sample_loss
from fedrun.datasets import FederatedData
from fedrun.errors import ConfigError, check
from fedrun.lazy import deferrable, torch
from fedrun.partitions import LazyClients, client_sizes
from fedrun.parts import Parts, layout
from fedrun.rounds import (
    AttackEffect,
    Bits,
    RunResult,
    malicious_table,
    record,
)
from fedrun.seeding import numpy_rng
from fedrun.state import Context, Stateful

_models = deferrable("fedrun.models")  # subclasses torch's classes: fedrun.lazy
_optimizers = deferrable("fedrun.optimizers")  # subclasses torch's classes: fedrun.lazy

FAIRNESS_PIECE = 8192  # samples per piece of the end-of-run per-client accuracy pass
DISTRIBUTIONS = {
    "constant": ("value",),
    "uniform": ("low", "high"),
    "normal": ("mean", "std", "min"),
    "lognormal": ("mean", "sigma"),
}


class SpeedGroup:
    """Clients sharing a compute-time distribution and availability.

    Args:
        name: Group name, used in metric names (``weight_share/<name>``).
        clients: How many clients (numbered in group order), or null for all remaining ones.
        distribution: ``constant`` (value), ``uniform`` (low, high), ``normal`` (mean, std, clipped
            at min) or ``lognormal`` (mean, sigma of the underlying normal).
        offline: Virtual-time intervals [start, end) in which the group's clients neither start work
            nor deliver it: work starts, and updates arrive, at the interval's end.
        **params: The distribution's parameters.
    """

    def __init__(self, name: str, clients: int | None, distribution: str, offline: list | None = None, **params):
        check(distribution in DISTRIBUTIONS, f"speeds.{name}.distribution", distribution, ", ".join(DISTRIBUTIONS))
        wanted = set(DISTRIBUTIONS[distribution])
        check(set(params) == wanted, f"speeds.{name}", sorted(params), f"exactly {sorted(wanted)} for {distribution}")
        check(
            clients is None or (isinstance(clients, int) and clients >= 1),
            f"speeds.{name}.clients",
            clients,
            "null or an integer >= 1",
        )
        low = {
            "constant": params.get("value"),
            "uniform": params.get("low"),
            "normal": params.get("min"),
            "lognormal": 0.0,
        }[distribution]
        check(
            low is not None and low >= 0 and (distribution != "uniform" or params["high"] >= params["low"]),
            f"speeds.{name}",
            params,
            "non-negative compute times",
        )
        self.offline = sorted((float(a), float(b)) for a, b in (offline or []))
        for a, b in self.offline:
            check(b > a >= 0, f"speeds.{name}.offline", offline, "intervals [start, end) with 0 <= start < end")
        self.name, self.clients, self.distribution, self.params = name, clients, distribution, params

    def draw(self, rng: np.random.Generator) -> float:
        p = self.params
        if self.distribution == "constant":
            return float(p["value"])
        if self.distribution == "uniform":
            return float(rng.uniform(p["low"], p["high"]))
        if self.distribution == "normal":
            return float(max(p["min"], rng.normal(p["mean"], p["std"])))
        return float(rng.lognormal(p["mean"], p["sigma"]))

    def online_at(self, t: float) -> float:
        """The first time >= t at which the group is online."""
        for start, end in self.offline:
            if start <= t < end:
                t = end
        return t


class AsyncEngine:
    """Runs an ``AsyncAggregator`` on the virtual clock.

    Args:
        speeds: Speed groups (see ``SpeedGroup``), assigned to clients in order.
        max_time: Stop once virtual time passes this budget, or null.
        concurrency: At most this many clients training at once (FedBuff's concurrency), or null for
            every client always training.
    """

    asynchronous = True  # a capability the parts check (privacy refuses it: not accounted)

    def __init__(self, speeds: list, max_time: float | None = None, concurrency: int | None = None):
        check(len(speeds) >= 1, "speeds", speeds, "a non-empty list of speed groups")
        self.groups = [SpeedGroup(**dict(g)) for g in speeds]
        check(
            sum(g.clients is None for g in self.groups) <= 1,
            "speeds",
            [g.name for g in self.groups],
            "at most one group with clients: null",
        )
        check(max_time is None or max_time > 0, "max_time", max_time, "null or a number > 0")
        check(
            concurrency is None or (isinstance(concurrency, int) and concurrency >= 1),
            "concurrency",
            concurrency,
            "null or an integer >= 1",
        )
        self.max_time, self.concurrency = max_time, concurrency

    def assign(self, num_clients: int) -> np.ndarray:
        """Each client's speed group index."""
        fixed = sum(g.clients for g in self.groups if g.clients is not None)
        if fixed > num_clients or (fixed != num_clients and all(g.clients is not None for g in self.groups)):
            raise ConfigError(
                "engine.speeds",
                [g.clients for g in self.groups],
                f"group sizes that add up to the {num_clients} clients",
            )
        sizes = [g.clients if g.clients is not None else num_clients - fixed for g in self.groups]
        return np.repeat(np.arange(len(self.groups)), sizes)

    def __call__(
        self,
        model: torch.nn.Module,
        data: FederatedData,
        clients: list[np.ndarray],
        parts: Parts,
        optimizer: Callable[..., torch.optim.Optimizer],
        schedule,
        device,
        seed: int,
        on_round: Callable[[dict, dict], None] = lambda metrics, per_client: None,
        client_tests: list[np.ndarray] | None = None,
        checkpoint: Checkpoint | None = None,
        client_vals: list[np.ndarray] | None = None,  # per-client judging is the synchronous engine's: not read here
    ):
        """Simulate until ``schedule.rounds`` aggregations (server versions) or ``max_time``.

        Same arguments as ``fedrun.engine.run``; each metrics row is one aggregation. Compute heterogeneity comes
        from the speed groups here (the parts' heterogeneity is the equal-work default, ``fedrun.compat``); who
        trains next is who finished (the sampler is uniform). Each arriving update passes the stages alone, as its
        client would send it; an aggregation's row logs the mean of its buffered updates' stage diagnostics.
        """
        group_of = self.assign(len(clients))
        device = as_device(device)
        x, y, x_test, y_test = device.prepare(model, data.x_train, data.y_train, data.x_test, data.y_test)
        model.eval()
        if isinstance(clients, LazyClients) and self.concurrency is None:
            raise ConfigError(
                "engine.concurrency", None, "the clients training at once with partition=population (not all of them)"
            )
        # A population's clients are drawn when they train: the groups' label sets are alike, and none is computed.
        label_sets = {} if isinstance(clients, LazyClients) else self._label_sets(data, clients, group_of)
        sizes = client_sizes(clients)
        weighting = getattr(parts.aggregator, "weighting", "samples")
        workdir = checkpoint.path.parent if checkpoint is not None else None  # where a client program's states spill
        shape = dict(layout=layout(model), initial=_models.flat_parameters(model), workdir=workdir)
        parts.bind(Context(schedule, sizes, seed, weighting, asynchronous=True, **shape), engine=self)
        # The clients that arrive at one instant train together (each from the model it pulled), on the device's
        # backend. Drawn speeds make them arrive one at a time, so ``auto`` keeps the loop; with equal speeds a
        # whole wave arrives together, and ``device.backend=processes`` (CPU) or ``vmap`` (GPU) trains it at once.
        tx, ty = parts.attack.training_data(x, y)  # a data attack's poisoned copy of the labels, appended once
        trainer = device.trainer(model, tx, ty, optimizer, passes(int(sizes.mean()), schedule.work), together=1)
        first_lr, w = _optimizers.base_lr(optimizer), _models.flat_parameters(model)
        bits = Bits.of(parts.stages, w, parts.client_state)
        clock = self._clock(parts, sizes, schedule, bits)
        loop, result = self._start_all(w, seed, group_of, clock), RunResult(w)
        if (saved := parts.restore(checkpoint, w)) is not None:  # the simulation after the instant of saved["round"]
            loop = AsyncLoop.of(saved["loop"], seed)
            result = RunResult(loop.params, rows=saved["rows"])
        evaluate = lambda p: self._evaluate(model, p, x_test, y_test, label_sets, trainer.per_sample)  # noqa: E731
        try:
            bar = tqdm(total=schedule.rounds, desc="aggregations", unit="agg", dynamic_ncols=True, initial=loop.version)
            start, done = time.perf_counter(), False
            while loop.events and not done:
                now = loop.events[0][0]
                if self.max_time is not None and now > self.max_time:
                    break
                arrived = loop.arrivals(now)  # in client-id order (the heap's tie-break)
                trained = self._train(trainer, arrived, loop, clients, schedule, first_lr, parts, seed)
                for c in arrived:
                    loop.jobs[c] += 1
                    from_version, w_pulled = loop.pulled[c]
                    one, t = np.array([c]), loop.version + 1  # the aggregation this update joins
                    sent = parts.attack.updates(t, one, trained[c][None], parts.attack.malicious(t, one))
                    sent, stage_diagnostics = parts.stages(sent, one, t)
                    parts.aggregator.observe(c, loop.version - from_version)
                    loop.buffer.append((c, sent[0], loop.version - from_version, w_pulled, stage_diagnostics))
                    if len(loop.buffer) < parts.aggregator.buffer_size:
                        continue
                    lr = schedule.lr(first_lr, loop.version + 1)
                    row, alpha = self._aggregate(loop, parts, sizes, now, lr, bits, label_sets)
                    diverged = not _models.all_finite(loop.params)
                    done = record(
                        row, loop.params, diverged, lr, schedule, evaluate, result, on_round, alpha, bar, start
                    )
                    start = time.perf_counter()
                    bar.update()
                    if done:
                        break
                # Restart with the newest model at this instant, this instant's aggregations included: the arrived
                # clients themselves, or as many clients drawn among those not training.
                for c in self._next(arrived, loop.pulled, len(clients), loop.rng):
                    loop.pulled[c] = (loop.version, loop.params)
                    self._start(loop.events, c, now, loop.speed_rng, group_of, clock)
                if checkpoint and result.rows and result.rows[-1]["round"] > checkpoint.saved_round:  # aggregated now
                    state = lambda: snapshot("async", loop.version, done, parts, loop.state(), result.rows)  # noqa: E731
                    checkpoint.after_round(loop.version, result.rows[-1]["round_wall_s"], done, state)
            bar.close()
        finally:
            trainer.close()
        held_x, held_y = data.held_out(x, y, x_test, y_test) if client_tests else (x, y)
        result.summary, result.tables = self._fairness(
            model, result.params, held_x, held_y, clients, client_tests, group_of, loop.applied
        )
        if parts.attack:
            result.tables["malicious.csv"] = malicious_table(parts.attack, [int(r["round"]) for r in result.rows])
        return result

    def _start_all(self, w: torch.Tensor, seed: int, group_of: np.ndarray, clock=None) -> AsyncLoop:
        """The simulation at time 0: the first clients training from w_0, their arrivals on the heap."""
        loop = AsyncLoop(w, numpy_rng(seed, "concurrency"), _Streams(seed, "speed"), len(group_of))
        for c in self._first(len(group_of), loop.rng):
            loop.pulled[c] = (0, w)
            self._start(loop.events, c, 0.0, loop.speed_rng, group_of, clock)
        return loop

    @staticmethod
    def _clock(parts: Parts, sizes, schedule, bits: Bits):
        """With devices (``fedrun.devices``), when a job of client c started at ``now`` arrives: when c is next online,
        plus its download, its passes and its upload; None without (the speed groups draw the jobs' times)."""
        if not parts.devices.clocked:
            return None
        devices, down, up = parts.devices, bits.dense_mb, bits.upload_mb
        return lambda c, now: devices.arrival(c, now, passes(int(sizes[c]), schedule.work), down, up)

    def _aggregate(self, loop: AsyncLoop, parts: Parts, sizes, now: float, lr: float, bits: Bits, label_sets):
        """Aggregate the full buffer and step the server: the aggregation's row (before evaluation) and the
        per-client series (alpha over all clients)."""
        buffer, loop.buffer = loop.buffer, []
        ids = np.array([b[0] for b in buffer])
        staleness = np.array([b[2] for b in buffer], dtype=np.float64)
        lying = parts.attack.malicious(loop.version + 1, ids)  # the attackers of this aggregation (count_lie's)
        report = BufferReport(
            ids, parts.attack.sizes(ids, sizes[ids], lying), staleness, loop.version, [b[3] for b in buffer]
        )
        deltas = torch.stack([b[1] for b in buffer])
        effect = AttackEffect(parts.attack, parts.aggregation, lying)
        before = loop.params
        update, alpha, diagnostics = parts.aggregation.aggregate(before, deltas, report)
        parts.stages.end_round()  # the buffer's updates all passed: an adaptive stage adapts once per aggregation
        loop.params, loop.version = parts.server.step(loop.params, update), loop.version + 1
        alpha_all = np.bincount(ids, weights=alpha, minlength=len(loop.jobs))
        loop.applied += alpha_all
        row = {
            "round": loop.version,
            "virtual_time": now,
            "staleness_mean": staleness.mean(),
            "staleness_max": staleness.max(),
            "lr": lr,
            "upload_mb": len(ids) * bits.upload_mb,
            "download_mb": len(ids) * bits.dense_mb,
        }
        row.update(dict.fromkeys(["test_accuracy", "test_loss"] + [f"accuracy/{g}" for g in label_sets], math.nan))
        row.update(diagnostics, **effect.columns(update, alpha, before, deltas, report))
        row.update({k: float(np.mean([b[4][k] for b in buffer])) for k in buffer[0][4]})
        return row, {"alpha": alpha_all}

    @staticmethod
    def _train(trainer, arrived, loop: AsyncLoop, clients, schedule, first_lr, parts: Parts, seed) -> dict:
        """The update of each client arriving at this instant, trained together: each from the model it pulled,
        with its own (job, client) stream and the learning rate of the aggregation it will join. The k-th
        arrival (0-based) joins aggregation ``version + 1 + (buffered + k) // b``, one aggregation each time the
        buffer of b fills. Clients with equal rates train in one call; an attacker of that aggregation trains on
        what a data attack gives it."""
        version, buffered, pulled, jobs = loop.version, len(loop.buffer), loop.pulled, loop.jobs
        joins = [version + 1 + (buffered + k) // parts.aggregator.buffer_size for k in range(len(arrived))]
        rates = [schedule.lr(first_lr, t) for t in joins]
        trained = {}
        for lr in dict.fromkeys(rates):
            ids = np.array([c for c, rate in zip(arrived, rates) if rate == lr])
            rounds = [t for t, rate in zip(joins, rates) if rate == lr]
            data = [
                parts.attack.data(t, np.array([c]), [clients[c]], parts.attack.malicious(t, np.array([c])))[0]
                for c, t in zip(ids, rounds)
            ]
            starts = torch.stack([pulled[int(c)][1] for c in ids])
            call = parts.client.call(ids, starts)  # the client program (MOON), each client's own state with it
            run = {} if call is None else {"program": call}  # a backend of one's own written for plain SGD: as before
            update = trainer(starts, data, ids, lr, schedule.work, seed, jobs[ids] + 1, **run)
            parts.client.keep(ids, None if call is None else call.owns, update.kept)
            trained.update(zip(ids.tolist(), update.deltas))
        return trained

    def _first(self, num_clients: int, sampler: np.random.Generator) -> list[int]:
        """The clients training at the start: all, or ``concurrency`` drawn by ``sampler``."""
        if self.concurrency is None or self.concurrency >= num_clients:
            return list(range(num_clients))
        return sorted(int(c) for c in sampler.choice(num_clients, size=self.concurrency, replace=False))

    def _next(self, arrived: list[int], pulled: dict, num_clients: int, sampler: np.random.Generator) -> list[int]:
        """Who starts training now that ``arrived`` delivered (``pulled`` loses them and gains the result)."""
        for c in arrived:
            del pulled[c]
        if self.concurrency is None or self.concurrency >= num_clients:
            return arrived
        # The draw over the idle clients in id order, without listing them (a population has a million): numpy's
        # choice(idle, k) is idle[choice(len(idle), k)], and the p-th idle client is p plus the training clients
        # at or below it, found among the sorted training ids shifted by their rank.
        training = np.sort(np.fromiter(pulled, dtype=np.int64, count=len(pulled)))
        positions = sampler.choice(num_clients - len(training), size=len(arrived), replace=False)
        shifted = training - np.arange(len(training))
        return sorted(int(p + np.searchsorted(shifted, p, side="right")) for p in positions)

    def _start(self, events: list, c: int, now: float, speed_rng, group_of, clock=None) -> None:
        if clock is not None:  # the devices time the job (the groups only name the clients for the metrics)
            heapq.heappush(events, (clock(c, now), c))
            return
        group = self.groups[group_of[c]]
        begin = group.online_at(now)
        heapq.heappush(events, (group.online_at(begin + group.draw(speed_rng[c])), c))

    def _label_sets(self, data, clients, group_of) -> dict[str, np.ndarray]:
        """Each speed group's training labels, when the groups' label sets differ."""
        labels = data.y_train.numpy()
        sets = {
            g.name: np.unique(labels[np.concatenate([clients[c] for c in np.flatnonzero(group_of == i)])])
            for i, g in enumerate(self.groups)
        }
        distinct = len({tuple(s) for s in sets.values()}) > 1
        return sets if distinct else {}

    @staticmethod
    def _evaluate(model, w, x_test, y_test, label_sets, per_sample=None) -> dict:
        loss, correct = per_sample_loss(model, w, x_test, y_test, per_sample=per_sample)
        row = {"test_accuracy": correct.float().mean().item(), "test_loss": loss.mean().item()}
        for name, labels in label_sets.items():
            mask = torch.isin(y_test, torch.as_tensor(labels, device=y_test.device))
            row[f"accuracy/{name}"] = correct[mask].float().mean().item()
        return row

    def _fairness(self, model, w, x, y, clients, client_tests, group_of, applied):
        """Weight shares per client and group, and the spread of per-client accuracy of the final model (over the
        clients whose updates were applied, for a population: the others were never drawn)."""
        import pandas as pd  # once a run ends: the engine's module is imported to check a config (fedrun.lazy)

        total = applied.sum() or 1.0
        members = np.flatnonzero(applied > 0) if isinstance(clients, LazyClients) else np.arange(len(clients))
        held_out = [client_tests[c] for c in members] if client_tests else [clients[c] for c in members]
        # One pass over the distinct samples (clients may share some), then each client's mean.
        samples, position = np.unique(np.concatenate(held_out), return_inverse=True)
        correct = np.concatenate(
            [
                per_sample_loss(model, w, x[index], y[index])[1].cpu().numpy()  # in pieces: no copy of all the data
                for index in torch.as_tensor(samples, device=x.device).split(FAIRNESS_PIECE)
            ]
        )[position]
        counts = np.array([len(p) for p in held_out])
        hits = np.bincount(np.repeat(np.arange(len(held_out)), counts), weights=correct, minlength=len(held_out))
        with np.errstate(invalid="ignore"):
            accuracy = hits / counts  # NaN for a client without samples
        table = pd.DataFrame(
            {
                "client": members,
                "group": [self.groups[g].name for g in group_of[members]],
                "weight_share": applied[members] / total,
                "accuracy": accuracy,
            }
        )
        summary = {
            f"weight_share/{g.name}": float(applied[group_of == i].sum() / total) for i, g in enumerate(self.groups)
        }
        summary.update(
            # Clients without held-out samples (NaN) count in none of these.
            client_accuracy_std=float(np.nanstd(accuracy)),
            client_accuracy_min=float(np.nanmin(accuracy)),
            client_accuracy_max=float(np.nanmax(accuracy)),
        )
        return summary, {"fairness.csv": table}


@dataclass
class AsyncLoop:
    """What the asynchronous simulation carries between instants besides its parts (checkpointed as ``loop``)."""

    params: torch.Tensor  # the newest global model
    rng: np.random.Generator  # who trains next, when concurrency limits it
    speed_rng: _Streams  # each client's compute times
    num_clients: int = 0
    version: int = 0
    jobs: np.ndarray = None  # each client's jobs so far (the key of its mini-batch stream)
    buffer: list = field(default_factory=list)  # (client, update, staleness, model it pulled, stage diagnostics)
    pulled: dict = field(default_factory=dict)  # each training client's (model version, model) it started from
    events: list = field(default_factory=list)  # the heap of (arrival time, client)
    applied: np.ndarray = None  # the total alpha each client received

    def __post_init__(self):
        self.jobs = np.zeros(self.num_clients, dtype=int) if self.jobs is None else self.jobs
        self.applied = np.zeros(self.num_clients) if self.applied is None else self.applied

    def arrivals(self, now: float) -> list[int]:
        """Every client arriving at ``now``, taken off the heap in client-id order."""
        arrived = []
        while self.events and self.events[0][0] == now:
            arrived.append(heapq.heappop(self.events)[1])
        return arrived

    def state(self) -> dict:
        return {**{k: v for k, v in vars(self).items() if k != "num_clients"}, "speed_rng": self.speed_rng.state_dict()}

    @classmethod
    def of(cls, state: dict, seed: int) -> AsyncLoop:
        speed_rng = _Streams(seed, "speed")
        speed_rng.load_state_dict(state["speed_rng"])
        return cls(**{**state, "speed_rng": speed_rng, "num_clients": len(state["jobs"])})


class _Streams(Stateful):
    """Each client's random stream under ``seed`` and ``name``, made on first use (a list-like of generators)."""

    STATE = ("made",)  # the streams made so far; seed and name come from the run

    def __init__(self, seed: int, name: str):
        self.seed, self.name, self.made = seed, name, {}

    def state_dict(self) -> dict:
        return {"made": self.made}

    def load_state_dict(self, state: dict) -> None:
        self.made = dict(state["made"])

    def __getitem__(self, client: int) -> np.random.Generator:
        if client not in self.made:
            self.made[client] = numpy_rng(self.seed, self.name, client)
        return self.made[client]
