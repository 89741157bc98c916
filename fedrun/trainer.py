"""The per-client primitive, written down: what every training backend does for the round loop.

A backend (``device.backend``: ``loop``, ``processes``, ``vmap``) is a ``Trainer``. Besides training the cohort
and the loss pass, it runs *per-client signals*: a signal is one plain function ``signal(model, params, x, y)
-> float`` of the global model's flat parameters and one client's data, and every backend runs it unchanged
(the loop here, the worker processes on their own model copies, vmap as the loop). An aggregator that needs a new
number per client (each client's gradient norm at the global model, say) writes that function and reads
``report.per_client(signal)``: no engine or backend changes (tests/unit/test_pipeline.py shows one).

Every engine trains through it: the round loop, the asynchronous engine (the clients of one instant together,
each from the model it pulled) and the F* estimate (its clients together, epoch by epoch).

A signal sent to worker processes travels by reference: define it at the top level of a module. On a model with
batch norm (``model.norm=batch``), loading ``params`` (``fedrun.models.load_flat``) clears the statistics, so a
signal that evaluates the model calls ``fedrun.clients.calibrate(model, x)`` first (the client's own statistics,
as every client-side evaluation here) or runs it in training mode (the batch's own).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fedrun.clients import client_signal, loaded_per_sample
from fedrun.cohort import ClientLosses, CohortUpdate
from fedrun.lazy import torch

# torch's types by name (``fedrun.lazy``: this module is imported before torch is)
Signal = Callable[["torch.nn.Module", "torch.Tensor", "torch.Tensor", "torch.Tensor"], float]


class Trainer:
    """The protocol of the training backends (``LoopTrainer``, ``ProcessTrainer``, ``VmapTrainer``). A backend of
    your own is a subclass, chosen with ``device.backend=<its import path>`` (``fedrun.backends.BACKENDS``); a run
    made with it resumes when the resume command names it again, ``FEDRUN_TRUST=<its import path> fedrun
    resume=<dir>`` (a run dir alone never makes fedrun import a module: ``fedrun.cli.resume``)."""

    @classmethod
    def for_device(cls, model, x, y, make_optimizer, device) -> Trainer:
        """The trainer for a run on ``device`` (a ``fedrun.backends.Device``: its ``workers``, ``chunk``, cores)
        of ``model`` (a workspace module) on the training tensors ``x``, ``y``. A subclass whose constructor
        takes more than these overrides it."""
        return cls(model, x, y, make_optimizer)

    def __call__(
        self, global_params, parts, client_ids, lr, work, seed, round_, stream="batches", program=None
    ) -> CohortUpdate:
        """Train each cohort client from ``global_params`` on its ``parts`` entry with its (round, client) stream;
        ``work`` is one ``LocalWork`` or one per client; ``program`` the client program to run
        (``fedrun.programs.Program``: its rows of own states go with the clients; None: plain local SGD). ``global_params`` may hold one row per client and
        ``round_`` one entry per client (the asynchronous engine's clients started from different versions and
        are at different jobs; the F* estimate's clients at different points). The updates come back in cohort
        order, each from its client's start."""
        raise NotImplementedError

    def losses(self, params, parts, batch_size) -> ClientLosses:
        """F_i(params) of each client, one pass over its data (``params`` may hold one row per client)."""
        raise NotImplementedError

    def per_client(self, signal: Signal, params: torch.Tensor, parts: list[np.ndarray]) -> np.ndarray:
        """``signal(model, params, x_i, y_i)`` of each client, in cohort order (float64). This default runs them
        one after another in this process."""
        return client_signal(signal, self.model, params, self.x, self.y, parts)

    def per_sample(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The server's evaluation: cross-entropy and correctness of every sample of ``x``, ``y`` under the
        parameters loaded in ``model`` (``fedrun.clients.loaded_per_sample``). This default computes them here; a
        backend whose processes all hold the model may share the samples among them."""
        return loaded_per_sample(model, x, y)

    def by_clients(self, compute: Callable[[int, int], object], costs: list[int]) -> list:
        """The results of ``compute(lo, hi)`` over contiguous blocks [lo, hi) of a call's clients, in client order
        (``costs``: each client's share of the work), for per-client evaluations whose values do not depend on the
        other clients of the block. This default computes one block of all of them here; a backend whose processes
        all hold the model may deal the blocks to them."""
        return [compute(0, len(costs))] if costs else []

    def close(self) -> None:
        """Release what the backend holds (worker processes)."""
