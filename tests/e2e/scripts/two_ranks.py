"""Run by tests/e2e/test_distributed.py under ``torchrun --nproc_per_node=2``: the distributed trainer's pieces
against the loop's on the same inputs, on gloo. Each rank writes what it found to rank<r>.json in its working
directory."""

import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from fedrun.backends import LoopTrainer
from fedrun.clients import per_sample_loss
from fedrun.cohort import LocalWork
from fedrun.distributed import DistributedTrainer
from fedrun.errors import ConfigError
from fedrun.models import flat_parameters

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
x, y = torch.randn(300, 5), torch.randint(0, 3, (300,))
optimizer = lambda params, lr: torch.optim.SGD(params, lr=lr)  # noqa: E731
loop, ranks = LoopTrainer(model, x, y, optimizer), DistributedTrainer(LoopTrainer(model, x, y, optimizer))
w, work, found = flat_parameters(model), LocalWork(16, local_epochs=1), {"rank": rank}
# a cohort of one (rank 1 has no client), none, and three of unequal sizes
for parts in ([np.arange(10)], [], [np.arange(10), np.arange(10, 40), np.arange(40, 45)]):
    ids = np.arange(len(parts))
    mine = ranks(w, parts, ids, 0.1, work, 0, 1)
    plain = loop(w, parts, ids, 0.1, work, 0, 1)
    found[f"train_{len(parts)}"] = (
        torch.equal(mine.deltas, plain.deltas) and mine.steps.tolist() == plain.steps.tolist()
    )
    losses, plain_losses = ranks.losses(w, parts, 16), loop.losses(w, parts, 16)
    found[f"losses_{len(parts)}"] = np.array_equal(losses.mean, plain_losses.mean)
shared, plain = per_sample_loss(model, w, x, y, per_sample=ranks.per_sample), per_sample_loss(model, w, x, y)
found["per_sample"] = all(torch.equal(a, b) for a, b in zip(shared, plain))
found["by_clients"] = ranks.by_clients(lambda lo, hi: list(range(lo, hi)), [1, 1, 1])
found["by_no_clients"] = ranks.by_clients(lambda lo, hi: 1, [])


def fails_on_rank_1(lo, hi):
    if rank == 1:
        raise ConfigError("device.inner", "x", "loop or vmap")  # three arguments: it does not unpickle
    return [lo]


try:
    ranks.by_clients(fails_on_rank_1, [1, 1])
except Exception as exc:
    found["error"] = f"{type(exc).__name__}: {exc}"
Path(f"rank{rank}.json").write_text(json.dumps(found))
dist.barrier()  # neither leaves while the other is still in a collective
dist.destroy_process_group()
