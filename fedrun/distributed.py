"""``device.backend=distributed``: one run over ``torch.distributed`` ranks (``torchrun``, ``srun``).

Every rank runs the whole round loop on the same seeds. Only local training, the loss pass, per-client signals, the
server's evaluation and the per-client evaluations (``Trainer.by_clients``) are split. Each training call's clients
are dealt to the ranks in contiguous blocks of about equal work (in cohort order, as the ``processes`` backend deals
them to its workers); each rank trains its block with an inner backend (``loop`` or ``vmap``, ``device.inner``), and
every rank gathers every block in rank order: the updates by one ``all_gather`` of tensors (on CUDA they stay on the
GPUs), the per-client scalars pickled. So every rank holds the cohort's updates and scalars in client order, and the
stages, the aggregator, the attack and the server step run on identical inputs on every rank: the global model stays
identical everywhere without a broadcast. A client's training depends only on the model it starts from, its data and
its (round, client) stream; the passes that pool samples (the server's evaluation, the loss pass over a cohort) are
split at the loop's own inference chunks, so each sample's value is the loop's. A run therefore gives the same
numbers on any number of ranks as the ``loop`` backend with the same ``device.threads``.

``init`` joins the process group from the environment ``torchrun`` and SLURM set (gloo on a CPU, NCCL on CUDA);
``rank()`` tells the command line which process writes (rank 0 alone: MLflow, the run dir, checkpoints).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import numpy as np
import torch.distributed as dist

from fedrun.backends import LoopTrainer, _blocks, passes
from fedrun.checkpoint import exchanged
from fedrun.clients import client_rows, cohort_losses, eval_chunk, loaded_per_sample, pooled_losses
from fedrun.cohort import ClientLosses, CohortUpdate
from fedrun.errors import ConfigError
from fedrun.lazy import torch
from fedrun.trainer import Trainer

INNER = ("loop", "vmap")

# How long a rank waits for the others at a gather before the run fails (a rank that died is seen at once on its
# closed connection; this bounds a rank that hangs).
TIMEOUT = timedelta(minutes=30)


def chosen(device) -> bool:
    """Whether a run's ``device`` config (a node or a dict) asks for this backend."""
    return device.get("backend") == "distributed"


def launched() -> bool:
    """Whether this process was started as one rank of several (``torchrun`` or ``srun`` set its environment)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ or "SLURM_PROCID" in os.environ


def several() -> bool:
    """Whether this process is one of several ranks a launcher started (world size above 1), read from the
    environment before the group is joined: a ``resume=`` under torchrun is spread over its ranks whatever the
    command line says of the device (the saved config does)."""
    return launched() and int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1))) > 1


def rank() -> int:
    """This process's rank: 0 when it is not one of several (it writes everything), from the environment before the
    group is joined (the command line decides who writes before it builds anything)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def init(cuda: bool) -> None:
    """Join the process group once (gloo on a CPU, NCCL on CUDA, each rank on GPU ``LOCAL_RANK``). Under SLURM
    without torchrun, RANK, WORLD_SIZE and LOCAL_RANK come from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID;
    MASTER_ADDR and MASTER_PORT must be set (the documented recipe does)."""
    if dist.is_initialized():
        return
    if not launched():
        raise ConfigError(
            "device.backend",
            "distributed",
            "a process started by torchrun or srun (torchrun --nproc_per_node=2 -m fedrun device.backend=distributed)",
        )
    place()
    dist.init_process_group(backend(cuda), timeout=TIMEOUT)


def place() -> None:
    """Name this rank from SLURM's variables when torchrun did not (RANK, WORLD_SIZE, LOCAL_RANK from
    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), and make GPU ``LOCAL_RANK`` mod the GPUs seen the current CUDA
    device, before anything is placed on one (``torch.device("cuda")`` means the current device). The command line
    calls it as soon as it knows the run is distributed."""
    for name, slurm in (("RANK", "SLURM_PROCID"), ("WORLD_SIZE", "SLURM_NTASKS"), ("LOCAL_RANK", "SLURM_LOCALID")):
        if name not in os.environ and slurm in os.environ:
            os.environ[name] = os.environ[slurm]
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())


def backend(cuda: bool) -> str:
    """NCCL on CUDA with a GPU per rank of this machine; gloo on a CPU, or with more ranks than GPUs (NCCL refuses
    two ranks on one GPU; pfl-research runs several processes per GPU): the updates then travel through the CPU."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return "nccl" if cuda and ranks_here <= torch.cuda.device_count() else "gloo"


def close() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class DistributedTrainer(Trainer):
    """Deal each call's clients over the ranks; each trains its block with ``inner``; every rank gathers all.

    Args:
        inner: The trainer of this rank's clients (a ``LoopTrainer`` or a ``fedrun.vmap.VmapTrainer``).
    """

    @classmethod
    def for_device(cls, model, x, y, make_optimizer, device) -> DistributedTrainer:
        init(device.torch.type == "cuda")
        inner = device.inner
        if inner == "vmap":
            from fedrun.vmap import VmapTrainer

            trainer = VmapTrainer.for_device(model, x, y, make_optimizer, device)
        else:
            trainer = LoopTrainer(model, x, y, make_optimizer)
        return cls(trainer)

    def __init__(self, inner: Trainer):
        if not dist.is_initialized():
            raise ConfigError("device.backend", "distributed", "a process that has joined its process group")
        self.inner, self.rank, self.world = inner, dist.get_rank(), dist.get_world_size()

    def __call__(
        self, global_params, parts, client_ids, lr, work, seed, round_, stream="batches", program=None
    ) -> CohortUpdate:
        works = work if isinstance(work, list) else [work] * len(parts)
        blocks = _blocks([passes(len(p), w) for p, w in zip(parts, works)], self.world)
        lo, hi = blocks[self.rank]
        sent, d = {}, global_params.shape[-1]

        def mine() -> CohortUpdate:  # the updates go by all_gather below; the rest (scalars) by pickling
            update = self.inner(
                client_rows(global_params, lo, hi),
                parts[lo:hi],
                client_ids[lo:hi],
                lr,
                works[lo:hi],
                seed,
                client_rows(round_, lo, hi),
                stream,
                None if program is None else program.rows(lo, hi),
            )
            sent["deltas"], sent["kept"] = update.deltas, update.kept
            for name, value in sent.items():  # checked here, where an error reaches every rank (not in all_gather)
                width = d if name == "deltas" or program is None or program.owns is None else program.owns.shape[-1]
                if value is not None and (value.shape != (hi - lo, width) or value.dtype != global_params.dtype):
                    raise RuntimeError(
                        f"the inner backend's {name} are {tuple(value.shape)} {value.dtype}, not "
                        f"{(hi - lo, width)} {global_params.dtype}"
                    )
            update.deltas, update.kept = None, update.kept is not None
            return update

        pieces = self._gathered(mine, lo < hi)
        rows = [end - start for start, end in blocks]
        deltas = self._stacked(sent.get("deltas"), rows, global_params)
        kept = None
        if any(piece.kept for piece in pieces):  # a program's states, as wide as its own states (or the model)
            like = global_params if program is None or program.owns is None else program.owns
            kept = self._stacked(sent.get("kept"), rows, like)
        for piece in pieces:
            piece.kept = None
        update = CohortUpdate.concat(pieces, global_params, deltas=deltas)
        update.kept = kept
        return update

    def _stacked(self, mine: torch.Tensor | None, rows: list[int], like: torch.Tensor) -> torch.Tensor:
        """Every rank's block of a (clients, d) tensor, in rank order, by one ``all_gather`` of the blocks padded
        to the largest (tensors, not pickles: on CUDA they stay on the GPU, NCCL moving them); ``like`` gives d,
        the dtype and the device."""
        most, d = max(rows), like.shape[-1]
        if most == 0:
            return like.new_empty(0, d)
        on = like.device if dist.get_backend() == "nccl" else torch.device("cpu")  # gloo: through the CPU
        padded = torch.zeros(most, d, dtype=like.dtype, device=on)
        if mine is not None:
            padded[: len(mine)] = mine
        out = [torch.empty_like(padded) for _ in range(self.world)]
        exchanged(dist.all_gather, out, padded)
        return torch.cat([block[:count] for block, count in zip(out, rows)]).to(like.device)

    def losses(self, params, parts, batch_size) -> ClientLosses:
        inner = self.inner
        if pooled_losses(inner.model, params):  # the loop's chunks cross clients: share its samples, not its clients
            return cohort_losses(inner.model, params, inner.x, inner.y, parts, batch_size, per_sample=self.per_sample)
        lo, hi = _blocks([len(p) for p in parts], self.world)[self.rank]
        mine = lambda: self.inner.losses(client_rows(params, lo, hi), parts[lo:hi], batch_size)  # noqa: E731
        return ClientLosses.concat(self._gathered(mine, lo < hi))

    def per_client(self, signal, params, parts) -> np.ndarray:
        lo, hi = _blocks([len(p) for p in parts], self.world)[self.rank]
        pieces = self._gathered(lambda: self.inner.per_client(signal, params, parts[lo:hi]), lo < hi)
        return np.concatenate([np.zeros(0), *pieces])

    def per_sample(self, model, x, y) -> tuple[torch.Tensor, torch.Tensor]:
        """The server's evaluation shared: each rank computes a contiguous run of whole inference chunks (the
        chunks the loop computes, so each sample's values are the loop's), and every rank gathers all of them in
        sample order; the mean over them is then the loop's."""
        chunk = eval_chunk(model, x.device)
        lo, hi = _blocks([1] * math.ceil(len(y) / chunk), self.world)[self.rank]
        lo, hi = lo * chunk, min(hi * chunk, len(y))
        mine = lambda: loaded_per_sample(model, x[lo:hi], y[lo:hi])  # noqa: E731
        pieces = self._gathered(mine, lo < hi)
        if not pieces:  # no samples
            return loaded_per_sample(model, x, y)
        return tuple(torch.cat(values).to(x.device) for values in zip(*pieces))

    def by_clients(self, compute, costs) -> list:
        """Each rank computes its block of clients (about equal ``costs``); every rank gathers every block."""
        lo, hi = _blocks(list(costs), self.world)[self.rank]
        return self._gathered(lambda: compute(lo, hi), lo < hi)

    def _gathered(self, compute, any_clients: bool) -> list:
        """Every rank's result of ``compute`` (tensors on the CPU), in rank order, the ranks without clients left
        out; an error on any rank is raised on every rank (none waits for a result that will not come)."""
        failure = None
        try:
            result = _to_cpu(compute()) if any_clients else None
        except Exception as exc:  # its line goes to the others (an exception may not unpickle), raised on every rank
            failure, result = exc, Failed(f"{type(exc).__name__}: {exc}")
        gathered = [None] * self.world
        exchanged(dist.all_gather_object, gathered, result)
        for rank_, value in enumerate(gathered):
            if isinstance(value, Failed):
                if rank_ == self.rank:
                    raise failure
                raise RuntimeError(f"rank {rank_} failed: {value.line}")
        return [value for value in gathered if value is not None]

    def close(self) -> None:
        self.inner.close()


class Failed:
    """What a rank sends the others when its part raised: the error's line (plain data, always unpickled)."""

    def __init__(self, line: str):
        self.line = line


def _to_cpu(value):
    """A result with its tensors on the CPU: a pickled CUDA tensor would unpickle on the sender's GPU index."""
    if isinstance(value, tuple):
        return tuple(_to_cpu(v) for v in value)
    return value.cpu() if isinstance(value, torch.Tensor) else value
