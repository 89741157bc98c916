"""The ``vmap`` backend: the cohort's clients trained together, one batched step for all of them.

Each client's parameters are a slice of stacked tensors ([clients, *shape]); ``torch.func.vmap`` over
``torch.func.grad`` of ``functional_call`` gives every client's mini-batch gradient in one call, and the
local solver's update is applied to all slices at once. On a GPU this replaces hundreds of tiny kernels per
client step with one kernel over the cohort (pfl-research and FLUTE train cohorts this way).

Exactness. A client's mini-batches come from the same (round, client) stream as in ``train_cohort``, so
its trajectory is the loop's up to floating-point noise (tests: 1e-10 in float64). Clients of unequal
sizes or work are padded, not bucketed: a step's batch is [clients, batch_size]; a short batch (the last
of an epoch) is filled with the client's first sample at mask 0, and its loss is the masked sum over the
real count, so padding contributes exactly nothing; a client that has taken all its steps is inactive and
its parameters and momentum are left untouched (``torch.where``), not stepped with a zero gradient.

Solvers. The update is written here for the solvers that have a closed form: ``torch.optim.SGD`` (momentum,
dampening, Nesterov, weight decay) and FedProx's ``ProxSGD``, exactly in torch's order of operations.
Others (STORM) need the loop; asking for ``vmap`` with them is refused before training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from torch.func import functional_call, grad, grad_and_value, vmap

from fedrun.clients import _batches, client_rows, cohort_losses, per_client_round
from fedrun.cohort import ClientLosses, CohortUpdate, LocalWork
from fedrun.errors import ConfigError
from fedrun.lazy import torch
from fedrun.models import BatchSoftmax
from fedrun.optimizers import ProxSGD, base_lr, coefficient_norm
from fedrun.programs import Client, Local, LocalSGD, Program, cohort_calls, train_cohort
from fedrun.seeding import torch_generator
from fedrun.trainer import Trainer


@dataclass(frozen=True)
class SGDRule:
    """torch's SGD step, plus FedProx's pull mu (w - w_global) added to the gradient first (as ``ProxSGD``)."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    mu: float = 0.0

    @staticmethod
    def of(make_optimizer, lr: float) -> SGDRule | None:
        """The rule of the solver ``make_optimizer(params, lr=lr)`` builds, or None when it has no closed form here."""
        probe = make_optimizer([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        if type(probe) not in (torch.optim.SGD, ProxSGD):
            return None
        group = probe.param_groups[0]
        if group.get("maximize") or len(probe.param_groups) != 1:
            return None
        return SGDRule(
            group["lr"],
            group["momentum"],
            group["dampening"],
            group["nesterov"],
            group["weight_decay"],
            group.get("mu", 0.0),
        )

    def step(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        buffers: list[torch.Tensor | None],
        anchor: list[torch.Tensor],
        first: bool,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """New parameters and momentum buffers, in the order of operations of ProxSGD.step and torch's sgd."""
        new_params, new_buffers = [], []
        for p, g, buffer, a in zip(params, grads, buffers, anchor):
            if self.mu != 0:
                g = g + self.mu * (p - a)
            if self.weight_decay != 0:
                g = g + self.weight_decay * p
            if self.momentum != 0:
                buffer = g.clone() if first else buffer * self.momentum + (1 - self.dampening) * g
                g = g + self.momentum * buffer if self.nesterov else buffer
            new_params.append(p - self.lr * g)
            new_buffers.append(buffer)
        return new_params, new_buffers

    def coefficient_norm(self, steps: int) -> float:
        return coefficient_norm(steps, self.lr, self.momentum, self.mu, self.dampening, self.nesterov)


def vmap_supported(make_optimizer, model: torch.nn.Module) -> str | None:
    """Why the ``vmap`` backend cannot train with this solver and model, or None when it can."""
    if SGDRule.of(make_optimizer, base_lr(make_optimizer, default=0.1)) is None:
        return "loop or processes for this optimizer (vmap has the closed-form update of sgd and prox only)"
    if any(True for _ in model.buffers()) or any(
        isinstance(m, (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._BatchNorm))
        for m in model.modules()
    ):
        return (
            "loop or processes for models with batch norm, buffers or dropout (batch statistics would take in the "
            "padded samples; random masks are per call)"
        )
    if any(isinstance(m, torch.nn.RNNBase) for m in model.modules()):
        return "loop or processes for recurrent models (torch.func.vmap does not batch nn.LSTM's fused kernels)"
    if any(isinstance(m, BatchSoftmax) for m in model.modules()):
        return "loop or processes for model.head=batch_softmax (a padded sample would enter the softmax over the batch)"
    return None


class VmapTrainer(Trainer):
    """Train the cohort together with ``torch.func.vmap``, ``chunk`` clients at a time.

    Args:
        model: The workspace module (its parameters are read for shapes and layout, never trained).
        x, y: Training tensors on the device.
        make_optimizer: The local solver factory (SGD or ProxSGD).
        chunk: Clients trained together; null = the whole cohort (lower it if the device runs out of memory).
    """

    @classmethod
    def for_device(cls, model, x, y, make_optimizer, device) -> VmapTrainer:
        return cls(model, x, y, make_optimizer, device.chunk)

    def __init__(
        self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, make_optimizer, chunk: int | None = None
    ):
        why = vmap_supported(make_optimizer, model)
        if why is not None:
            raise ConfigError("device.backend", "vmap", why)
        self.model, self.x, self.y, self.make_optimizer, self.chunk = model, x, y, make_optimizer, chunk
        self.names = [name for name, _ in model.named_parameters()]
        self.shapes = [p.shape for p in model.parameters()]

        def loss(params, xb, yb, mask, count):
            per_sample = torch.nn.functional.cross_entropy(
                functional_call(self.model, params, (xb,)), yb, reduction="none"
            )
            return (per_sample * mask).sum() / count

        self._grad = vmap(grad_and_value(loss))

    def __call__(
        self, global_params, parts, client_ids, lr, work, seed, round_, stream="batches", program=None
    ) -> CohortUpdate:
        works = work if isinstance(work, list) else [work] * len(parts)
        if program is not None and not program.program.batched:
            # a program that changes more than vmap maps (an objective without its batch_loss, ``corrected`` itself):
            # the loop's, with the loop's numbers
            return train_cohort(
                self.model, global_params, self.x, self.y, parts, client_ids, self.make_optimizer, lr, works, seed,
                round_, stream, program,
            )  # fmt: skip
        rule = SGDRule.of(self.make_optimizer, lr)
        size = self.chunk or max(1, len(parts))
        pieces = [
            self._train(
                client_rows(global_params, lo, lo + size),
                parts[lo : lo + size],
                client_ids[lo : lo + size],
                works[lo : lo + size],
                rule,
                seed,
                client_rows(round_, lo, lo + size),
                stream,
                None if program is None else program.rows(lo, lo + size),
            )
            for lo in range(0, len(parts), size)
        ]
        return CohortUpdate.concat(pieces, global_params)

    def _train(
        self, global_params, parts, client_ids, works: list[LocalWork], rule: SGDRule, seed, round_, stream, program
    ) -> CohortUpdate:
        clients, device = len(parts), self.x.device
        batches = [
            list(
                _batches(
                    len(part),
                    job.batch_size,
                    job.local_epochs,
                    job.local_steps,
                    torch_generator(seed, stream, per_client_round(round_, i), int(client)),
                )
            )
            for i, (part, client, job) in enumerate(zip(parts, client_ids, works))
        ]
        steps = np.array([len(b) for b in batches])
        most, width = int(steps.max(initial=0)), max(job.batch_size for job in works)
        index, mask = _padded_index(parts, batches, steps, most, width, global_params.dtype)
        sizes = mask.sum(2)
        index, mask, counts = index.to(device), mask.to(device), sizes.clamp(min=1).to(device)
        active = torch.as_tensor(steps[:, None] > np.arange(most)[None, :], device=device)
        anchor = self._unflatten(global_params)  # FedProx's pull: to the model each client started from
        if global_params.dim() == 2:  # one start per client
            params = [a.clone() for a in anchor]
        else:
            params = [a.unsqueeze(0).repeat(clients, *([1] * a.dim())) for a in anchor]
        buffers: list[torch.Tensor | None] = [None] * len(params)
        losses = torch.empty(clients, most, dtype=global_params.dtype, device=device)
        gradient = None if program is None or not program.program.corrects else program.program.gradient
        broadcast = None if program is None or program.shared is None else program.shared.to(global_params)
        pull = None if program is None else program.program.pull(self.model, broadcast)  # (lambda, anchors)
        frozen = set() if program is None else set(program.program.frozen())
        moving = [name not in frozen for name in self.names]  # a frozen parameter keeps its start: no step at all
        per_client, owned = global_params.dim() == 2, program is not None and program.owns is not None
        owns = self._unflatten(program.owns.to(global_params)) if owned else [None] * len(params)
        if gradient is not None:  # mapped over the clients: each call sees one client's tensors, as on the loop
            shared = self._unflatten(broadcast) if broadcast is not None else [None] * len(params)
            gradient = vmap(gradient, in_dims=(0, 0, 0 if per_client else None, 0 if owned else None, None))
        step_grad = self._grad
        if program is not None and type(program.program).batch_loss is not LocalSGD.batch_loss:
            # the program's own loss (MOON's term, TERM's tilt), its gradient in the params mapped over the clients
            def loss(params, xb, yb, m, c, start, own):
                return program.program.batch_loss(self.model, params, xb, yb, m, c, start, own)

            batched = vmap(
                grad(loss, has_aux=True), in_dims=(0, 0, 0, 0, 0, 0 if per_client else None, 0 if owned else None)
            )
            starts, own_states = dict(zip(self.names, anchor)), (dict(zip(self.names, owns)) if owned else None)
            step_grad = lambda params, xb, yb, m, c: batched(params, xb, yb, m, c, starts, own_states)  # noqa: E731
        carries = program is not None and program.program.carries
        if carries:  # a state carried through the steps (APFL's (v, alpha)), from each client's own state
            carried = program.owns.to(global_params)
            before = vmap(
                lambda params, c, xb, yb, m, n: program.program.batch_before(
                    self.model, params, c, xb, yb, m, n, rule.lr
                )
            )
        for k in range(most):
            chosen = index[:, k]
            named = dict(zip(self.names, params))
            if carries:  # from the step's params, before they move
                new = before(named, carried, self.x[chosen], self.y[chosen], mask[:, k], counts[:, k])
                carried = _where(active[:, k], new, carried)
            grads, losses[:, k] = step_grad(named, self.x[chosen], self.y[chosen], mask[:, k], counts[:, k])
            grads = [grads[n] for n in self.names]
            if pull is not None:  # the gradient of (lambda / 2) ||w - anchor||^2, added to the data term's
                grads = [g + pull[0] * (p - a) for g, p, a in zip(grads, params, pull[1])]
            if gradient is not None:
                grads = [gradient(*args) for args in zip(grads, params, anchor, owns, shared)]
            new_params, new_buffers = rule.step(params, grads, buffers, anchor, first=k == 0)
            params = [_where(active[:, k], new, old) if m else old for new, old, m in zip(new_params, params, moving)]
            buffers = [new if old is None else _where(active[:, k], new, old) for new, old in zip(new_buffers, buffers)]
        losses = losses.detach().double().cpu().numpy()
        flat = torch.cat([p.reshape(clients, -1) for p in params], dim=1)
        local_mean, local_authors = np.full(clients, np.nan), np.full(clients, np.nan)
        sizes = sizes.numpy()
        for i, (part, job) in enumerate(zip(parts, works)):
            if steps[i]:
                last = slice(max(0, steps[i] - -(-len(part) // job.batch_size)), steps[i])  # the last epoch's batches
                epoch_losses = losses[i, last]
                local_mean[i] = np.average(epoch_losses, weights=sizes[i, last])
                local_authors[i] = epoch_losses.sum() / len(part)
        norms = np.array([rule.coefficient_norm(int(s)) for s in steps])
        deltas = flat - global_params
        kept = None
        if carries:
            kept = vmap(program.program.batch_kept)(program.owns.to(global_params), carried)
        elif program is not None and program.program.keeps:
            calls = cohort_calls(
                self.model, self.x, self.y, parts, client_ids, works, rule.lr, self.make_optimizer, round_, seed, stream
            )
            kept = _kept(program, calls, global_params, deltas, steps, norms)
        return CohortUpdate(deltas, ClientLosses(local_mean, local_authors), steps, norms, kept)

    def _unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view of a flat model, or [clients, *shape] of one model per row."""
        out, offset = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            out.append(flat[..., offset : offset + n].reshape(*flat.shape[:-1], *shape))
            offset += n
        return out

    def losses(self, params, parts, batch_size) -> ClientLosses:
        """F_i(params) of each client: one batched pass over the cohort's data (as the loop's)."""
        return cohort_losses(self.model, params, self.x, self.y, parts, batch_size)

    def close(self) -> None:
        pass


def _kept(
    program: Program,
    clients: list[Client],
    starts: torch.Tensor,
    deltas: torch.Tensor,
    steps: np.ndarray,
    norms: np.ndarray,
):
    """Each client's state after its local work, as the program's ``kept`` says it from the client's call (its
    data, work, learning rate and keys, as the loop's), its start, own state, broadcast and ||a||_1."""
    rows = []
    for i, (client, delta) in enumerate(zip(clients, deltas)):
        own = None if program.owns is None else program.owns[i].to(delta)
        start = starts if starts.dim() == 1 else starts[i]
        shared = None if program.shared is None else program.shared.to(delta)
        local = Local(client, start, own, shared, None, None, None, None, [], [], norm=float(norms[i]))
        rows.append(program.program.kept(local, delta, int(steps[i])))
    return torch.stack(rows)


def _padded_index(parts, batches, steps: np.ndarray, most: int, width: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """index[i, k, j]: the j-th sample of client i's k-th mini-batch, its first sample where padded; mask 1
    where real. Built in a few whole-cohort operations (a loop over every mini-batch cost ~5 ms a round)."""
    index = torch.zeros(len(parts), most, width, dtype=torch.long)
    mask = torch.zeros(len(parts), most, width, dtype=dtype)
    flat = [batch for client_batches in batches for batch in client_batches]
    if not flat:
        return index, mask
    local = torch.nn.utils.rnn.pad_sequence(
        flat, batch_first=True
    )  # [batches, longest], padded with 0: the client's first sample
    local = torch.nn.functional.pad(local, (0, width - local.shape[1]))
    lengths = torch.tensor([len(batch) for batch in flat])
    clients = torch.as_tensor(np.repeat(np.arange(len(parts)), steps))
    ks = torch.as_tensor(np.concatenate([np.arange(s) for s in steps]))
    starts = torch.as_tensor(np.concatenate([[0], np.cumsum([len(p) for p in parts])[:-1]]))
    samples = torch.as_tensor(np.concatenate(parts))
    index[clients, ks] = samples[starts[clients, None] + local]
    mask[clients, ks] = (torch.arange(width)[None, :] < lengths[:, None]).to(dtype)
    return index, mask


def _where(active: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` for active clients (dim 0), ``old`` for the rest."""
    return torch.where(active.view(-1, *([1] * (new.dim() - 1))), new, old)
