"""The synchronous round loop. No Hydra here: it takes plain objects and reports each round to a callback."""

import math
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from fedrun.aggregators import MVR, Aggregator, FedAvg
from fedrun.backends import Device, as_device, passes
from fedrun.checkpoint import Checkpoint
from fedrun.clients import FStarEstimate, client_accuracy, evaluate
from fedrun.cohort import Lazy, RoundView
from fedrun.datasets import FederatedData
from fedrun.errors import ConfigError, DivergenceError
from fedrun.heterogeneity import EqualWork
from fedrun.models import flat_parameters
from fedrun.optimizers import base_lr
from fedrun.partitions import client_sizes
from fedrun.pipeline import Pipeline, upload_message_mb
from fedrun.privacy import Privacy
from fedrun.rounds import RunResult, Schedule, record
from fedrun.sampling import LOSS_BYTES, Sampler, Uniform
from fedrun.seeding import numpy_rng
from fedrun.servers import ServerOptimizer
from fedrun.state import Context


def run(
    model: nn.Module,
    data: FederatedData,
    clients: list[np.ndarray],
    aggregator: Aggregator,
    optimizer: Callable[..., torch.optim.Optimizer],
    schedule: Schedule,
    device: Device | torch.device,
    seed: int,
    server: ServerOptimizer | None = None,
    on_round: Callable[[dict, dict], None] = lambda metrics, per_client: None,
    client_tests: list[np.ndarray] | None = None,
    heterogeneity: EqualWork | None = None,
    checkpoint: Checkpoint | None = None,
    pipeline: Pipeline | None = None,
    privacy: Privacy | None = None,
    sampler: Sampler | None = None,
) -> RunResult:
    """Run synchronous federated training.

    Args:
        model: The global model's architecture, already initialised from the ``init`` stream.
        data: The dataset's tensors.
        clients: One training-index array per client.
        aggregator: Chooses alpha and combines the updates.
        optimizer: ``optimizer(params, lr=...)`` builds a local optimizer; its own ``lr`` is the base rate.
        schedule: Rounds, local work, sampling, evaluation.
        device: Where and how to train (a ``torch.device`` means the plain loop in the contiguous layout).
        seed: Run seed (client sampling and mini-batch streams).
        server: Applies the combined update (default: w + Delta).
        on_round: Called after each round with the metrics row and per-client series over all clients
            (``alpha``, ``local_steps``; 0 for clients not in the cohort).
        client_tests: Each client's own held-out samples (indices into train), or None. When given, the
            mean accuracy of the cohort's local models on them is logged as ``client_accuracy``.
        heterogeneity: How much local work each cohort client does (default: the schedule's).
        checkpoint: Where and when to checkpoint, and whether to resume from its file (see fedrun.checkpoint).
        pipeline: The stages each round's updates pass between training and aggregation (default: none).
        privacy: DP-FedAvg's clipping, noise and accounting in place of the aggregator (default: none; bound to the
            run's sampling by ``Privacy.bind``).
        sampler: Who trains each round (default: ``Uniform``, the schedule's sampling); bound here.

    Returns:
        The final model and the metrics rows.
    """
    device = as_device(device)
    has_val = data.x_val is not None and len(data.y_val) > 0
    x, y, x_test, y_test, x_val, y_val = device.prepare(
        model,
        data.x_train,
        data.y_train,
        data.x_test,
        data.y_test,
        *((data.x_val, data.y_val) if has_val else (None, None)),
    )
    model.eval()
    held_out = data.held_out(x, y, x_test, y_test)  # what client_tests index
    server = server or ServerOptimizer()
    heterogeneity = heterogeneity or EqualWork()
    pipeline = pipeline or Pipeline()
    privacy = privacy or Privacy()
    sizes = client_sizes(clients)  # a population's shared array: nothing per client
    first_lr = base_lr(optimizer)
    params = flat_parameters(model)
    initial = params  # w_0, where the F* estimate starts
    rng = numpy_rng(seed, "sampling")  # the sampler's draws (checkpointed as "sampler")
    sampler = sampler or Uniform()
    context = Context(schedule, sizes, seed, getattr(aggregator, "weighting", "samples"))
    sampler.bind(context)
    pipeline.bind(context)
    m = schedule.cohort_size(len(clients))
    accuracy_source = "val_accuracy" if has_val else "test_accuracy"
    previous = None  # the previous global model, for aggregators that need it (MVR)
    message_mb = params.numel() * params.element_size() / 1e6
    upload_mb = upload_message_mb(pipeline, params)  # a compressed update's message, else the dense one
    latest_accuracy = math.nan  # what accuracy-triggered aggregators (hybrid) see
    result = RunResult(params)
    first = 1
    saved = checkpoint.restored() if checkpoint else None
    if saved is not None:  # everything the loop carries between rounds, as it was after round saved["round"]
        first = saved["round"] + 1
        params, previous, latest_accuracy, rng = (
            saved["params"],
            saved["previous"],
            saved["latest_accuracy"],
            saved["sampler"],
        )
        aggregator.load_state_dict(saved["aggregator"])
        server.load_state_dict(saved["server"])
        pipeline.load_state_dict(saved["pipeline"])
        sampler.load_state_dict(saved.get("selection", {}))  # a checkpoint from before samplers has none
        privacy.load_state_dict(saved.get("privacy", {}))  # refused if private and the checkpoint has no ledger
        result = RunResult(params, rows=saved["rows"])
    trainer = device.trainer(model, x, y, optimizer, m * passes(int(sizes.mean()), schedule.work))
    fstar = FStarEstimate(trainer, initial, clients, optimizer, schedule.batch_size, seed)
    fstar.cache.update(saved["fstar"] if saved is not None else {})

    def measure(w: torch.Tensor) -> dict:
        columns = dict(zip(("test_accuracy", "test_loss"), evaluate(model, w, x_test, y_test)))
        if has_val:
            columns.update(zip(("val_accuracy", "val_loss"), evaluate(model, w, x_val, y_val)))
        return columns

    try:
        bar = tqdm(
            range(first, schedule.rounds + 1),
            desc="rounds",
            unit="round",
            dynamic_ncols=True,
            initial=first - 1,
            total=schedule.rounds,
        )
        for t in bar:
            if privacy.exceeds():  # the run ends here, FINISHED, its epsilon within max_epsilon (tag stopped_by)
                break
            start = time.perf_counter()
            clock = time.perf_counter()
            selection = sampler.draw(
                rng, lambda ids, w=params: trainer.losses(w, [clients[i] for i in ids], schedule.batch_size)
            )
            selection_s = time.perf_counter() - clock
            selected = np.zeros(len(clients), dtype=np.int64)  # who was picked (before stragglers drop out)
            selected[selection.cohort] = selection.counts
            plan = heterogeneity.plan(
                t, selection.cohort, sizes[selection.cohort], schedule.work, seed, counts=selection.counts
            )
            works = [work for work in plan if work is not None]
            selection = selection.keep(np.array([work is not None for work in plan], dtype=bool))  # stragglers drop out
            cohort = selection.cohort
            parts = [clients[i] for i in cohort]
            lr = schedule.lr(first_lr, t)
            clock = time.perf_counter()
            trained = trainer(params, parts, cohort, lr, works, seed, t)
            train_s = time.perf_counter() - clock
            deltas = trained.deltas  # as trained: each client's local model (client_accuracy) is params + these
            clock = time.perf_counter()
            sent, stage_diagnostics = pipeline(deltas, cohort, t) if pipeline else (deltas, {})
            pipeline.end_round()
            pipeline_s = time.perf_counter() - clock
            # What the aggregator may read; the lazy signals cost nothing unless read. Bound to this round.
            report = RoundView(
                cohort,
                sizes[cohort],
                round=t,
                accuracy=latest_accuracy,
                accuracy_source=accuracy_source,
                fstar=fstar,
                local_losses=trained.local_losses,
                steps=trained.steps,
                coefficient_norms=trained.coefficient_norms,
                # F_i(w_t), what the loss-weighted aggregators weigh by: a pass over the cohort's data at w_t (or
                # what Power-of-Choice already measured to choose the cohort).
                losses=selection.losses
                if selection.losses is not None
                else Lazy(lambda w=params, parts=parts: trainer.losses(w, parts, schedule.batch_size)),
                # From the previous global model on the same mini-batches (same round and client keys); MVR.
                measure=lambda signal, w=params, parts=parts: trainer.per_client(signal, w, parts),
                previous_deltas=Lazy(
                    lambda w=previous, parts=parts, cohort=cohort, works=works, lr=lr: (
                        None if w is None else trainer(w, parts, cohort, lr, works, seed, t).deltas
                    )
                ),
            )
            previous = params
            # The papers' client accuracy: each local model on its own held-out split, before aggregation.
            local_accuracy = (
                client_accuracy(model, params, deltas, *held_out, [client_tests[i] for i in cohort])
                if client_tests
                else None
            )
            clock = time.perf_counter()
            if privacy:  # DP-FedAvg: clipped, noised, a fixed denominator (an empty round is noise alone)
                update, alpha, diagnostics = privacy.aggregate(sent, params, t, cohort)
            elif len(cohort) and selection.weights is not None:  # importance sampling's unbiased FedAvg
                update, alpha, diagnostics = aggregator.combine(selection.weights, sent, report)
            elif len(cohort):
                update, alpha, diagnostics = aggregator.aggregate(params, sent, report)
            else:  # nobody sampled (poisson): a zero update, and the server steps on it as Opacus steps on an
                # empty Poisson batch (a server optimizer with momentum still moves; plain SGD does not)
                update, alpha, diagnostics = torch.zeros_like(params), np.zeros(0), {}
            sampler.observe(cohort, sent)
            params = server.step(params, update)
            diverged = not torch.isfinite(params).all()
            signals_s = sum(report.wall_s.values())  # lazy signals read while aggregating have their own columns
            timings = {"aggregate_wall_s": time.perf_counter() - clock - signals_s + pipeline_s}

            # Every row has every column (NaN when not evaluated) so metrics.csv can be appended to.
            models = 2 if report.read("previous_deltas") else 1  # the previous model goes down, its update up
            evaluated = not diverged and schedule.evaluates(t)
            train_loss = math.nan
            if len(cohort) and (report.read("losses") or evaluated):
                if not np.all(np.isfinite(report.losses.mean)):
                    raise DivergenceError(f"non-finite training loss of the global model at round {t} (lr={lr:g})")
                train_loss = float(np.average(report.losses.mean, weights=sizes[cohort]))
            timings["loss_wall_s"] = report.wall_s.get("losses", 0.0)
            timings["train_wall_s"] = train_s + report.wall_s.get("previous_deltas", 0.0)
            timings["selection_wall_s"] = selection_s  # Power-of-Choice's loss pass over its candidates
            unkept = max(selection.probed - int(np.count_nonzero(selected)), 0)  # candidates probed, not kept
            row = {
                "round": t,
                "train_loss": train_loss,
                "lr": lr,
                "upload_mb": len(cohort) * (upload_mb + (models - 1) * message_mb)
                + selection.probed * LOSS_BYTES / 1e6,
                "download_mb": (models * len(cohort) + unkept) * message_mb,
                "local_steps_mean": float(trained.steps.mean()) if len(cohort) else 0.0,
                "cohort_size": len(cohort),
            }
            row.update(
                dict.fromkeys(
                    ["test_accuracy", "test_loss"] + (["val_accuracy", "val_loss"] if has_val else []), math.nan
                )
            )
            if local_accuracy is not None:
                # A client without held-out samples (a LEAF user with no test sample) counts in no mean.
                has = [len(client_tests[i]) > 0 for i in cohort]
                row["client_accuracy"] = float(local_accuracy[has].mean()) if any(has) else math.nan
            row.update(diagnostics)
            row.update(selection.spread or {})
            row.update(stage_diagnostics)
            row.update(timings)
            alpha_all, steps_all = np.zeros(len(clients)), np.zeros(len(clients), dtype=int)
            alpha_all[cohort], steps_all[cohort] = alpha, trained.steps
            last = record(
                row,
                params,
                diverged,
                lr,
                schedule,
                measure,
                result,
                on_round,
                {"alpha": alpha_all, "local_steps": steps_all, "selected": selected},
                bar,
                start,
            )
            if schedule.evaluates(t):
                latest_accuracy = row[accuracy_source]
            if checkpoint:
                checkpoint.after_round(
                    t,
                    row["round_wall_s"],
                    last,
                    lambda: {
                        "round": t,
                        "engine": "sync",
                        "finished": last,
                        "params": params,
                        "previous": previous,
                        "latest_accuracy": latest_accuracy,
                        "sampler": rng,
                        "selection": sampler.state_dict(),
                        "aggregator": aggregator.state_dict(),
                        "server": server.state_dict(),
                        "pipeline": pipeline.state_dict(),
                        "privacy": privacy.state_dict(),
                        "fstar": fstar.cache,
                        "rows": result.rows,
                    },
                )
            if last:
                break
        bar.close()
        result.summary.update(sampler.summary())
    finally:
        trainer.close()
    return result


class SyncEngine:
    """The ``engine=sync`` option: runs ``run`` (a class, so unknown config keys fail when it is built)."""

    asynchronous = False  # a capability the parts check (privacy accounts synchronous rounds only)

    def check(self, aggregator, heterogeneity, pipeline=None, schedule=None, sampler=None) -> None:
        """Refuse, before training, an aggregator this engine cannot run."""
        if not isinstance(aggregator, Aggregator):
            raise ConfigError("engine", "sync", f"async for {type(aggregator).__name__}, an asynchronous aggregator")
        if sampler is not None and sampler.name == "importance" and type(aggregator) is not FedAvg:
            raise ConfigError(
                "aggregator",
                type(aggregator).__name__,
                "fedavg with sampler=importance (its weights q_k / (m p_k) make FedAvg's update unbiased; other "
                "aggregators choose their own alpha)",
            )
        if sampler is not None and sampler.name == "importance" and getattr(heterogeneity, "mode", None) == "drop":
            raise ConfigError(
                "heterogeneity.mode",
                "drop",
                "partial with sampler=importance (clients dropping out after the draw would bias its estimate)",
            )
        if pipeline and isinstance(aggregator, MVR):  # MVR reads a second update per client, which no stage would see
            raise ConfigError(
                "pipeline",
                [type(s).__name__ for s in pipeline.stages],
                "none with aggregator=mvr (its second update per "
                "client, from the previous model, would bypass the stages)",
            )

    def __call__(self, **kwargs) -> RunResult:
        self.check(
            kwargs["aggregator"], kwargs.get("heterogeneity"), kwargs.get("pipeline"), None, kwargs.get("sampler")
        )
        return run(**kwargs)
