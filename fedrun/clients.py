"""Clients are data: an index array into the training tensors. Their work is functions over the cohort.

``train_cohort`` is the one place local training happens; it takes the whole cohort so it can be
parallelised or vectorised later without touching the round loop.
"""

from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.nn.functional import cross_entropy
from torch.nn.utils import parameters_to_vector

from fedrun.models import load_flat
from fedrun.seeding import torch_generator

EVAL_BATCH = 4096


@torch.no_grad()
def per_sample_loss(model: nn.Module, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy and correctness of every sample under the flat parameters ``params``."""
    load_flat(model, params)
    losses, correct = [], []
    for start in range(0, len(y), EVAL_BATCH):
        logits = model(x[start : start + EVAL_BATCH])
        target = y[start : start + EVAL_BATCH]
        losses.append(cross_entropy(logits, target, reduction="none"))
        correct.append(logits.argmax(1) == target)
    return torch.cat(losses), torch.cat(correct)


def evaluate(model: nn.Module, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean loss) of ``params`` on a split."""
    loss, correct = per_sample_loss(model, params, x, y)
    return correct.float().mean().item(), loss.mean().item()


def cohort_losses(model: nn.Module, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, parts: list[np.ndarray]) -> np.ndarray:
    """F_i(w): each cohort client's mean training loss under ``params``, in one pass over their data."""
    index = torch.as_tensor(np.concatenate(parts), device=x.device)
    loss, _ = per_sample_loss(model, params, x[index], y[index])
    owner = torch.repeat_interleave(torch.arange(len(parts), device=x.device), torch.as_tensor([len(p) for p in parts], device=x.device))
    sums = torch.zeros(len(parts), dtype=loss.dtype, device=x.device).index_add_(0, owner, loss)
    return (sums.cpu().double() / torch.as_tensor([len(p) for p in parts], dtype=torch.float64)).numpy()


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


def train_cohort(
    model: nn.Module,
    global_params: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    parts: list[np.ndarray],
    client_ids: np.ndarray,
    make_optimizer: Callable[..., torch.optim.Optimizer],
    lr: float,
    batch_size: int,
    epochs: int,
    steps: int | None,
    seed: int,
    round_: int,
) -> torch.Tensor:
    """Train each cohort client from the global model and return their updates.

    Args:
        model: A module whose parameters are overwritten (a workspace, not a client's model).
        global_params: Flat global model w the round started from.
        x, y: Training tensors on the training device.
        parts: Each cohort client's sample indices.
        client_ids: The cohort's client ids (they key each client's mini-batch stream).
        make_optimizer: ``make_optimizer(params, lr=...)`` gives a fresh local optimizer.
        lr: Local learning rate of this round.
        batch_size: Mini-batch size.
        epochs: Local epochs (used when ``steps`` is None).
        steps: Local mini-batch steps, or None.
        seed: Run seed; mini-batch order comes from its ``batches`` stream keyed by (round, client).
        round_: The round, 1-based.

    Returns:
        Delta_i = w_i - w, one row per cohort client.
    """
    deltas = torch.empty(len(parts), global_params.numel(), dtype=global_params.dtype, device=global_params.device)
    model.train()
    for row, (part, client) in enumerate(zip(parts, client_ids)):
        load_flat(model, global_params)
        optimizer = make_optimizer(model.parameters(), lr=lr)  # fresh state: clients keep nothing across rounds
        index = torch.as_tensor(part, device=x.device)
        generator = torch_generator(seed, "batches", round_, int(client))
        for batch in _batches(len(part), batch_size, epochs, steps, generator):
            chosen = index[batch.to(x.device)]
            optimizer.zero_grad(set_to_none=True)
            cross_entropy(model(x[chosen]), y[chosen]).backward()
            optimizer.step()
        deltas[row] = parameters_to_vector(model.parameters()).detach() - global_params
    model.eval()
    return deltas
