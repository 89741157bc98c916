"""Clients are data: an index array into the training tensors. Their work is functions over the cohort.

The passes over clients' data (their losses, accuracies, per-client signals) and the pieces of a local step that
the client programs share (``fedrun.programs``, where ``train_cohort`` runs a program over a cohort).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedrun.cohort import ClientLosses, LocalWork
from fedrun.lazy import deferrable, torch

_models = deferrable("fedrun.models")  # subclasses torch's classes: fedrun.lazy
_optimizers = deferrable("fedrun.optimizers")  # subclasses torch's classes: fedrun.lazy

# Inference chunks. On a CPU, small enough that the activations stay in cache: for the papers' CNN on 12,500
# MNIST images with 2 threads, 64 took 0.26 s against 0.27 (128), 0.39 (256) and 1.12 (1024). On a GPU,
# large enough to keep the launches few.
EVAL_BATCH = {"cpu": 64, "cuda": 1024}


def eval_chunk(model: torch.nn.Module, device: torch.device) -> int:
    """The batch size of inference: the model's own (``eval_batch``) when its outputs depend on their batch
    (``fedrun.models.BatchSoftmax``), else ``EVAL_BATCH`` for the device."""
    return getattr(model, "eval_batch", None) or EVAL_BATCH.get(device.type, EVAL_BATCH["cuda"])


# torch's types by name (``fedrun.lazy``: this module is imported before torch is)
Calibration = tuple["torch.Tensor", "torch.Tensor | None"]  # (inputs, index into them or None for all): calibrate
PerSample = Callable[["torch.nn.Module", "torch.Tensor", "torch.Tensor"], tuple["torch.Tensor", "torch.Tensor"]]


class _Reached(Exception):
    """Raised by a hook at the batch-norm layer being calibrated: the layers after it need not run."""

    def __init__(self, inputs: torch.Tensor):
        self.inputs = inputs


def _stop(module: torch.nn.Module, inputs: tuple) -> None:
    raise _Reached(inputs[0])


def calibrate(model: torch.nn.Module, x: torch.Tensor, index: torch.Tensor | None = None) -> None:
    """Set the statistics of every ``fedrun.models.BatchNorm`` of ``model`` to the per-channel mean and biased
    variance of its inputs over ``x[index]`` (all of ``x`` when ``index`` is None), under the loaded parameters.

    Layer by layer, in order: a layer's inputs are computed with the layers before it normalised by the statistics
    already set, so each layer's statistics are exactly those it sees in evaluation (one pass over the inputs per
    layer; ``torch.optim.swa_utils.update_bn`` takes one pass in training mode, which averages per-batch statistics
    of inputs normalised by the batches' own, and depends on the batch size). Sums in float64. Nothing to do for a
    model without batch norm.
    """
    with torch.no_grad():  # not inference_mode: the statistics may meet autograd later (a forward outside evaluation)
        norms = _models.batch_norms(model)
        if not norms:
            return
        count = len(x) if index is None else len(index)
        if not count:
            raise ValueError("batch-norm statistics of no inputs (a client without training samples)")
        training, chunk = model.training, EVAL_BATCH.get(x.device.type, EVAL_BATCH["cuda"])
        model.eval()
        for norm in norms:
            norm.statistics = None
        try:
            for norm in norms:
                total, square, handle = 0.0, 0.0, norm.register_forward_pre_hook(_stop)
                try:
                    for start in range(0, count, chunk):
                        try:
                            model(x[start : start + chunk] if index is None else x[index[start : start + chunk]])
                        except _Reached as reached:
                            h = reached.inputs.double()
                        dims = [0, *range(2, h.dim())]
                        total, square = total + h.sum(dims), square + (h * h).sum(dims)
                finally:
                    handle.remove()
                values = count * math.prod(h.shape[2:])  # per channel
                mean = total / values
                variance = (square / values - mean * mean).clamp_min(0.0)
                norm.statistics = (mean.to(norm.weight.dtype), variance.to(norm.weight.dtype))
        finally:
            model.train(training)


def per_sample_loss(
    model: torch.nn.Module,
    params: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    calibration: Calibration | None = None,
    per_sample: PerSample | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and correctness of every sample under the flat parameters ``params``; a batch-norm model
    normalised by the statistics of the ``calibration`` inputs (``calibrate``), which it then needs.
    ``per_sample``: how the loaded model's values are computed (default ``loaded_per_sample``; a backend's
    ``Trainer.per_sample`` may share the samples among its ranks)."""
    model.eval()  # batch norm by its statistics, not the evaluated batch's
    _models.load_flat(model, params)
    if calibration is not None:
        calibrate(model, *calibration)
    with torch.inference_mode():  # no autograd bookkeeping at all: cheaper than no_grad
        return (per_sample or loaded_per_sample)(model, x, y)


def loaded_per_sample(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and correctness of every sample under the parameters loaded in ``model``, in chunks of
    ``eval_chunk`` from the first sample (a slice that starts at a multiple of it gives the same values)."""
    chunk = eval_chunk(model, x.device)
    # The model in chunks, the loss and the argmax once over all the logits (samples x classes, never larger than
    # the inputs): a row's values do not depend on the rows beside it, and 10,000 MNIST images with 2 threads took
    # 0.37 s against 0.45 s with the two per chunk (their small kernels' start-up, 157 times).
    logits = torch.cat([model(x[start : start + chunk]) for start in range(0, len(y), chunk)])
    return torch.nn.functional.cross_entropy(logits, y, reduction="none"), logits.argmax(1) == y


def evaluate(
    model: torch.nn.Module,
    params: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    calibration: Calibration | None = None,
) -> tuple[float, float]:
    """(accuracy, mean loss) of ``params`` on a split (``calibration``: see ``per_sample_loss``)."""
    return evaluate_splits(model, params, [(x, y)], calibration)[0]


def evaluate_splits(
    model: torch.nn.Module,
    params: torch.Tensor,
    splits: list[tuple],
    calibration: Calibration | None = None,
    per_sample: PerSample | None = None,
) -> list[tuple[float, float]]:
    """(accuracy, mean loss) of ``params`` on each (x, y) of ``splits``, the parameters loaded, and a batch-norm
    model calibrated, once for all of them (``per_sample``: see ``per_sample_loss``)."""
    model.eval()
    _models.load_flat(model, params)
    if calibration is not None:
        calibrate(model, *calibration)
    measured = []
    with torch.inference_mode():
        for x, y in splits:
            loss, correct = (per_sample or loaded_per_sample)(model, x, y)
            measured.append((correct.float().mean().item(), loss.mean().item()))
    return measured


def _authors_scale(losses: torch.Tensor, batch_size: int) -> float:
    """Sum over consecutive batches of the batch mean loss, divided by the sample count.

    Full batches contribute their sum / batch_size, the last partial batch its sum / its size.
    """
    full = len(losses) - len(losses) % batch_size
    total = losses[:full].sum() / batch_size
    if full < len(losses):
        total = total + losses[full:].mean()
    return float(total) / len(losses)


def pooled_losses(model: torch.nn.Module, params: torch.Tensor) -> bool:
    """Whether ``cohort_losses`` pools the cohort's samples into one pass (inference chunks that cross clients)."""
    return params.dim() == 1 and not (hasattr(model, "eval_batch") or _models.batch_norms(model))


def cohort_losses(
    model: torch.nn.Module,
    params: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    parts: list[np.ndarray],
    batch_size: int,
    per_sample: PerSample | None = None,
) -> ClientLosses:
    """F_i(w): each cohort client's training loss under ``params``, in one pass over their data (one pass per
    client when the model's outputs depend on their batch, ``BatchSoftmax``: two clients never share one; or on
    the client's own data, ``BatchNorm``: each client normalises by its own statistics, the only ones it has).
    ``params`` may hold one row per client (each client's loss under its own model). ``per_sample``: the pass's
    (see ``per_sample_loss``; a ``pooled_losses`` pass only)."""
    if not parts:
        return ClientLosses.concat([])
    if params.dim() == 2:
        return ClientLosses.concat(
            [cohort_losses(model, params[i], x, y, [part], batch_size) for i, part in enumerate(parts)]
        )
    if hasattr(model, "eval_batch") or _models.batch_norms(model):
        model.eval()
        _models.load_flat(model, params)  # once for all clients
        pieces = []
        for index in (torch.as_tensor(p, device=x.device) for p in parts):
            calibrate(model, x, index)
            with torch.inference_mode():
                pieces.append(loaded_per_sample(model, x[index], y[index])[0])
        loss = torch.cat(pieces)
    else:
        index = torch.as_tensor(np.concatenate(parts), device=x.device)
        loss, _ = per_sample_loss(model, params, x[index], y[index], per_sample=per_sample)
    per_client = loss.double().cpu().split([len(p) for p in parts])
    return ClientLosses(
        mean=np.array([float(c.mean()) for c in per_client]),
        authors=np.array([_authors_scale(c, batch_size) for c in per_client]),
    )


@dataclass(frozen=True)
class TiltedRisk:
    """A client's tilted risk at ``params`` (Li, Beirami, Sanjabi and Smith 2021, "Tilted Empirical Risk
    Minimization", ICLR: R~(tau) = (1/tau) log((1/n) sum_j exp(tau l_j)) over its n samples' losses l_j, the
    inner objective of hierarchical TERM), a per-client signal (``fedrun.trainer``). Equal for equal ``tau``, so a
    copy of the aggregator that reads it (``fedrun.rounds.HonestReference``) finds the round's values in the view's
    cache. A batch-norm model is normalised by the client's own statistics, as in ``cohort_losses``."""

    tau: float

    def __call__(self, model: torch.nn.Module, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
        calibration = (x, None) if _models.batch_norms(model) else None
        return tilted(per_sample_loss(model, params, x, y, calibration)[0], self.tau)


def tilted(losses: torch.Tensor, tau: float) -> float:
    """(1/tau) log mean_j exp(tau l_j) of per-sample losses (in their dtype, the model's), reduced in float64
    around their mean m: m + log1p(mean(expm1(d))) / tau with d = tau (l - m) while every |d| < 1 (exact to the
    last bits however small tau is: the plain form's log n / tau cancellation lost all of them at tau = 1e-15),
    else m + (logsumexp(d) - log n) / tau (finite for any tau and loss). tau -> 0 gives the mean, tau -> +inf the
    largest loss, tau -> -inf the smallest."""
    losses = losses.double()
    if not len(losses):  # a client without samples has no risk, as its mean loss is NaN (``cohort_losses``)
        return math.nan
    mean = losses.mean()
    d = tau * (losses - mean)
    if float(d.abs().max()) < 1:
        return float(mean + torch.log1p(torch.expm1(d).mean()) / tau)
    return float(mean + (torch.logsumexp(d, 0) - math.log(len(losses))) / tau)


def client_signal(
    signal, model: torch.nn.Module, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, parts: list[np.ndarray]
) -> np.ndarray:
    """``signal(model, params, x_i, y_i)`` of each client in ``parts`` (a per-client signal, ``fedrun.trainer``),
    with ``model`` as the workspace the signal may load ``params`` into."""
    values = []
    for part in parts:
        index = torch.as_tensor(part, device=x.device)
        values.append(float(signal(model, params, x[index], y[index])))
    return np.array(values, dtype=np.float64)


def client_accuracy(
    model: torch.nn.Module,
    global_params: torch.Tensor,
    deltas: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    tests: list[np.ndarray],
    own: tuple[torch.Tensor, list[np.ndarray]] | None = None,
) -> np.ndarray:
    """Each local model's (w + Delta_i) accuracy on its client's own held-out samples; ``global_params`` may hold
    one start per client (a client state's). ``own``: (training inputs, each client's training indices), whose
    statistics a batch-norm model is normalised by on its client."""
    accuracy = []
    for row, (delta, test) in enumerate(zip(deltas, tests)):
        index = torch.as_tensor(test, device=x.device)
        model_ = per_client_start(global_params, row) + delta
        accuracy.append(evaluate(model, model_, x[index], y[index], _own_calibration(own, row))[0])
    return np.array(accuracy)


def _own_calibration(own: tuple[torch.Tensor, list[np.ndarray]] | None, row: int) -> Calibration | None:
    """Client ``row``'s calibration: its own training inputs (see ``client_accuracy``)."""
    if own is None:
        return None
    inputs, parts = own
    return inputs, torch.as_tensor(parts[row], device=inputs.device)


def pooled_judging(model: torch.nn.Module, models: torch.Tensor, own) -> bool:
    """Whether ``judged_accuracy`` judges one model in one pass over every client's split (inference chunks that
    cross clients) rather than client by client."""
    return models.dim() == 1 and not (own is not None and _models.batch_norms(model))


def judged_accuracy(
    model: torch.nn.Module,
    models: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    split_sets: list[list[np.ndarray]],
    own: tuple[torch.Tensor, list[np.ndarray]] | None = None,
    per_sample: PerSample | None = None,
) -> list[np.ndarray]:
    """Each client's accuracy on each of its own held-out splits (``split_sets``: a list of per-client splits, e.g.
    the test splits and the validation splits) under its model: ``models`` is one flat model for all (one pass over
    every split) or one row per client (one pass per client over its splits). NaN for a client with no sample in a
    split. ``own``: as in ``client_accuracy`` (a batch-norm model is judged client by client, each normalised by
    its own statistics, computed once for all its splits). ``per_sample``: the pass of one model over every split
    (see ``per_sample_loss``). Returns one array per split set."""
    clients = len(split_sets[0]) if split_sets else 0
    per_client = [[splits[i] for splits in split_sets] for i in range(clients)]  # client by client
    norm = own is not None and bool(_models.batch_norms(model))
    if pooled_judging(model, models, own):  # split set by split set (a batch-dependent head sees the same batches)
        by_set = []
        for splits in split_sets:
            index = torch.as_tensor(np.concatenate([np.zeros(0, np.int64), *splits]), device=x.device)
            correct = per_sample_loss(model, models, x[index], y[index], per_sample=per_sample)[1].double().cpu()
            by_set.append(correct.split([len(split) for split in splits]))
        pieces = [piece for client in zip(*by_set) for piece in client]  # client by client
    else:
        pieces = []
        for row, splits in enumerate(per_client):
            index = torch.as_tensor(np.concatenate(splits), device=x.device)
            calibration = _own_calibration(own, row) if norm else None
            correct = per_sample_loss(model, per_client_start(models, row), x[index], y[index], calibration)[1]
            pieces += correct.double().cpu().split([len(split) for split in splits])
    accuracy = np.array([float(p.mean()) if len(p) else np.nan for p in pieces]).reshape(clients, len(split_sets))
    return list(accuracy.T)


def _batches(n: int, batch_size: int, epochs: int, steps: int | None, generator: torch.Generator):
    """Mini-batch index tensors: ``epochs`` reshuffled passes, or exactly ``steps`` batches across passes."""
    done = 0
    while steps is not None or done < epochs:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            yield order[start : start + batch_size]
            if steps is not None:
                steps -= 1
                if steps == 0:
                    return
        done += 1


def _loss_closure(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    chosen: torch.Tensor,
    pull: tuple[float, list[torch.Tensor]] | None = None,
):
    """The closure solvers step with: the mean loss over the ``chosen`` samples, gradients freshly computed.
    ``pull``: (lambda, anchor per parameter) adds (lambda / 2) ||w - anchor||^2 (Ditto's personal objective); the
    loss returned, and recorded as the local loss, is the data term alone."""

    clear = cleared(optimizer)

    def closure():
        clear()
        loss = torch.nn.functional.cross_entropy(model(x[chosen]), y[chosen])
        if pull is None:
            loss.backward()
            return loss
        strength, anchors = pull
        penalty = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchors) if p.requires_grad)
        (loss + 0.5 * strength * penalty).backward()
        return loss.detach()

    return closure


def cleared(optimizer: torch.optim.Optimizer):
    """``optimizer.zero_grad(set_to_none=True)`` as a function. For a solver that keeps torch's own ``zero_grad``:
    every gradient of its parameter groups set to None, which is all that method does with ``set_to_none``, without
    its profiler and compiler wrappers (3% of a 10-sample CNN step on a CPU: scripts/bench.py's cross-device
    workload); a solver's own ``zero_grad`` is called as it is."""
    if type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad:
        return lambda: optimizer.zero_grad(set_to_none=True)
    groups = optimizer.param_groups

    def clear():
        for group in groups:
            for p in group["params"]:
                p.grad = None

    return clear


def _anchors(model: torch.nn.Module, anchor: torch.Tensor) -> list[torch.Tensor]:
    """A flat anchor as one tensor per parameter of ``model``, in ``flat_parameters`` order."""
    return list(_models.flat_views(anchor, model.named_parameters()).values())


def plain_sgd_step(optimizer: torch.optim.Optimizer):
    """For ``torch.optim.SGD`` with nothing but a learning rate, its step (w <- w - lr * grad, as torch's
    ``param.add_(grad, alpha=-lr)``) without ``Optimizer.step``'s per-call wrappers, which cost ~4% of a
    10-sample CNN step on a CPU; None for any other solver or setting."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return None
    group = optimizer.param_groups[0]
    if (
        group["momentum"]
        or group["weight_decay"]
        or group["maximize"]
        or group.get("differentiable")
        or not isinstance(group["lr"], float)
    ):
        return None
    params, lr = group["params"], group["lr"]

    def step(closure):
        with torch.enable_grad():
            loss = closure()
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
        return loss

    return step


def solver_coefficient_norm(optimizer: torch.optim.Optimizer, steps: int, lr: float) -> float:
    """||a||_1 of a local solver: its own ``coefficient_norm`` if it has one, else from its momentum and mu."""
    if hasattr(optimizer, "coefficient_norm"):
        return optimizer.coefficient_norm(steps)
    group = optimizer.param_groups[0]
    return _optimizers.coefficient_norm(
        steps,
        lr,
        group.get("momentum", 0.0),
        group.get("mu", 0.0),
        group.get("dampening", 0.0),
        group.get("nesterov", False),
    )


def per_client_start(params: torch.Tensor, row: int) -> torch.Tensor:
    """Client ``row``'s starting model: ``params`` itself (one model for the cohort) or its row (one each)."""
    return params[row] if params.dim() == 2 else params


def client_rows(value, lo: int, hi: int):
    """Clients [lo, hi) of a per-client argument (a starting model or round with one row/entry per client), or the
    argument itself when the whole cohort shares it."""
    per_client = value.dim() == 2 if isinstance(value, torch.Tensor) else np.ndim(value) > 0
    return value[lo:hi] if per_client else value


def per_client_round(round_, row: int) -> int:
    """Client ``row``'s round (the key of its mini-batch stream): ``round_`` itself or its entry (one each)."""
    return int(round_) if np.ndim(round_) == 0 else int(round_[row])


def apfl_step(
    model: torch.nn.Module,
    w: torch.Tensor,
    v: torch.Tensor,
    alpha: float,
    x: torch.Tensor,
    y: torch.Tensor,
    lr: float,
    alpha_lr: float,
) -> tuple[torch.Tensor, float]:
    """One local step of APFL's personal model (Deng et al. 2020, "Adaptive Personalized Federated Learning",
    arXiv:2003.13461, Algorithm 1), on the mini-batch (x, y) that also steps w:

        v_bar = alpha v + (1 - alpha) w,  g = grad f(v_bar),
        v' = v - lr * alpha * g                          (the gradient of f(v_bar) in v),
        alpha' = clip(alpha - alpha_lr * <v - w, g>, 0, 1)  (its gradient in alpha; only when alpha_lr > 0).

    alpha stays in [0, 1], where v_bar is a mixture (the paper's alpha is a mixing weight; PFLlib clips as well).
    PFLlib's clientapfl.py differs: it steps v on f(v) itself, approximates g by alpha grad f(v) + (1 - alpha)
    grad f(w) and adds 0.02 alpha to alpha's gradient; FL-bench mixes the two models' logits instead. Returns
    (v', alpha')."""
    mixed = (alpha * v + (1 - alpha) * w).requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(
        torch.func.functional_call(model, _models.flat_views(mixed, model.named_parameters()), (x,)), y
    )
    (g,) = torch.autograd.grad(loss, mixed)
    stepped = v - (lr * alpha) * g  # both from the step's (w, v, alpha)
    if alpha_lr:
        alpha = min(1.0, max(0.0, alpha - alpha_lr * float(torch.dot(v - w, g))))
    return stepped, alpha


class FStarEstimate:
    """F_i*: each client's smallest loss (over epoch ends) in ``epochs`` of local training from the
    initial model, computed on first request and cached. The clients asked for together are trained together,
    epoch by epoch, by the run's trainer (every backend: the loop, worker processes, vmap), each epoch from
    where the client's previous one ended.

    Args:
        trainer: The run's ``fedrun.trainer.Trainer``.
        initial_params: The initial global model w_0.
        clients: Every client's sample indices.
        make_optimizer: Local optimizer factory (its base ``lr``).
        batch_size: Mini-batch size.
        seed: Run seed (the ``fstar`` mini-batch stream, keyed by (epoch, client)).
    """

    def __init__(self, trainer, initial_params, clients, make_optimizer, batch_size: int, seed: int):
        self.trainer, self.w0, self.clients = trainer, initial_params.clone(), clients
        self.make_optimizer, self.batch_size, self.seed = make_optimizer, batch_size, seed
        self.cache: dict[tuple[int, int], tuple[float, float]] = {}

    def __call__(self, client_ids: np.ndarray, epochs: int) -> ClientLosses:
        missing = list(dict.fromkeys(int(c) for c in client_ids if (int(c), epochs) not in self.cache))
        if missing:
            self._estimate(np.array(missing), epochs)
        values = np.array([self.cache[int(c), epochs] for c in client_ids])
        return ClientLosses(values[:, 0], values[:, 1])

    def _estimate(self, ids: np.ndarray, epochs: int) -> None:
        parts = [self.clients[c] for c in ids]
        w, best_mean, best_authors = self.w0, np.full(len(ids), np.inf), np.full(len(ids), np.inf)
        work, lr = LocalWork(self.batch_size, local_epochs=1), _optimizers.base_lr(self.make_optimizer)
        for epoch in range(1, epochs + 1):
            w = w + self.trainer(w, parts, ids, lr, work, self.seed, epoch, "fstar").deltas  # one row per client
            losses = self.trainer.losses(w, parts, self.batch_size)
            best_mean, best_authors = np.minimum(best_mean, losses.mean), np.minimum(best_authors, losses.authors)
        for client, mean, authors in zip(ids, best_mean, best_authors):
            self.cache[int(client), epochs] = (float(mean), float(authors))
