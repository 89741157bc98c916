"""The ``device`` group: where the cohort trains, in which memory layout, and by which backend.

A backend is the training seam of the round loop: ``trainer(global_params, parts, client_ids, lr, work,
seed, round_)`` returns the cohort's ``CohortUpdate``. ``loop`` trains the clients one after another in
this process (intra-op threads parallelise each step); ``processes`` splits the cohort over worker
processes that run one thread each, so small per-client steps keep every core busy; ``vmap``
(``fedrun.vmap``) trains the cohort together, one batched step for all clients, which is what a GPU needs.
A client's training depends only on the global model, its data and its (round, client) random stream, so
all three give the same updates up to floating-point noise (the thread count and batching change the
order of some sums).
"""

from __future__ import annotations

import copy
import functools
import importlib
import math
import multiprocessing
import multiprocessing.util
import os
import platform
import signal
import sys

import numpy as np

from fedrun import lazy
from fedrun.checkpoint import StopSignals
from fedrun.clients import client_rows, client_signal, cohort_losses
from fedrun.cohort import ClientLosses, CohortUpdate, LocalWork
from fedrun.errors import check
from fedrun.lazy import torch
from fedrun.programs import train_cohort
from fedrun.trainer import Trainer

# The backends by name: ``device.backend`` is one of these names, ``auto``, or the import path of any other
# ``fedrun.trainer.Trainer`` class (``device.backend=mypackage.trainers.RayTrainer``), as a ``_target_`` names a
# class: a new backend is one class, no edit here. A class is built with ``cls.for_device(model, x, y,
# make_optimizer, device)``.
BACKENDS = {
    "loop": "fedrun.backends.LoopTrainer",
    "processes": "fedrun.backends.ProcessTrainer",
    "vmap": "fedrun.vmap.VmapTrainer",
    "distributed": "fedrun.distributed.DistributedTrainer",
}

# The ``auto`` backend uses worker processes when a round has at least this many sample-passes per worker:
# below it, sending the model and updates costs more than the second core saves (scripts/bench.py). A recurrent
# model's pass counts once per step of its sequence (``pass_cost``).
MIN_PASSES_PER_WORKER = 1000


def pass_cost(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Sample-passes one sample-pass of ``model`` counts for as in ``auto``'s rule: a recurrent model (``nn.RNNBase``)
    runs its cells once per step of a sequence (the inputs' second dimension), one pass each; any other model 1.
    Without it ``auto`` kept LEAF's Shakespeare LSTM (10 roles of 100 sequences of 80, batch 4: 500 passes a
    worker) on the loop, at 1.34x the worker processes' round (``scripts/bench.py --workloads shakespeare``,
    2026-11-30: loop 3.717 s, processes 2.769 s, floor 2.447 s)."""
    recurrent = any(isinstance(module, torch.nn.RNNBase) for module in model.modules())
    return int(x.shape[1]) if recurrent and x.dim() >= 2 else 1


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# The CPU flags of the instruction sets that CPU kernels dispatch on (torch's own, MKL's and oneDNN's convolutions and
# matrix products): other kernels sum in another order. Every one of the 34 client-method runs of
# tests/e2e/test_client_methods.py differs in its last bits between an AVX-512 machine and an AVX10.1 + AMX one,
# and 12 by more than 1e-5.
KERNEL_FLAGS = ("avx", "amx", "fma", "f16c")


def cpu_kernels(cpuinfo: str | None = None) -> dict[str, str]:
    """The CPU as its kernels see it: the model's name, torch's CPU capability and the kernel-relevant flags
    (``KERNEL_FLAGS``) of ``cpuinfo`` (default: Linux's /proc/cpuinfo; elsewhere no flags are read). A run records
    where it starts and continues (``run.json``, ``fedrun.cli.job.settle_threads``): its numbers are those of its
    config, seed, thread count and these kernels."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as file:
                cpuinfo = file.read()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags = sorted({flag for flag in fields.get("flags", "").split() if flag.startswith(KERNEL_FLAGS)})
    return {
        "model": fields.get("model name") or platform.processor() or platform.machine(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "flags": " ".join(flags),
    }


def cpu_label(kernels: dict[str, str]) -> str:
    """``cpu_kernels`` in a few words: the model and torch's capability (and AMX, which oneDNN's kernels use)."""
    amx = ", AMX" if "amx_" in kernels.get("flags", "") else ""
    return f"{kernels.get('model') or 'an unnamed CPU'} ({kernels.get('capability')}{amx})"


def other_kernels(first: dict[str, str], now: dict[str, str]) -> str:
    """How the CPU ``now`` differs from ``first`` (both ``cpu_kernels``), in words; "" when it does not."""
    if first == now:
        return ""
    said = f"{cpu_label(first)}, now on {cpu_label(now)}"
    was, is_ = set(first.get("flags", "").split()), set(now.get("flags", "").split())
    if was != is_:
        there, here = (" ".join(sorted(flags)) or "none" for flags in (was - is_, is_ - was))
        said += f" (flags only there: {there}; only here: {here})"
    return said


class Device:
    """Where and how the cohort trains.

    Args:
        kind: ``cpu``, ``cuda`` (refused without CUDA) or ``auto`` (CUDA when available).
        memory_format: ``auto`` (channels_last for image models: 2-4x faster convolutions on CPU, equal up
            to floating-point noise), ``channels_last`` or ``contiguous``.
        backend: ``auto``, ``loop``, ``processes`` or ``vmap`` (see the module docstring). ``auto``: on CUDA,
            vmap when the solver and model allow it (``fedrun.vmap.vmap_supported``), else the loop; on a CPU
            with two or more cores, processes when each worker gets at least ``MIN_PASSES_PER_WORKER``
            sample-passes a round (a recurrent model's counted per step of its sequences: ``pass_cost``), else
            the loop (vmap is never chosen on a CPU: scripts/bench.py measures
            it slower there than the loop).
        workers: Worker processes for ``processes``; null = the usable cores.
        chunk: Clients that ``vmap`` trains together; null = the whole cohort (lower it when memory runs out).
        threads: torch intra-op threads of this job; null = the cores it may use (``use_cores``): all of them,
            or cores / jobs in a parallel sweep, so parallel jobs never oversubscribe the machine.
        inner: With ``backend=distributed`` (``fedrun.distributed``), how each rank trains its clients: ``loop``
            or ``vmap``.
    """

    def __init__(
        self,
        kind: str = "auto",
        memory_format: str = "auto",
        backend: str = "auto",
        workers: int | None = None,
        chunk: int | None = None,
        threads: int | None = None,
        inner: str = "loop",
    ):
        check(kind in ("cpu", "cuda", "auto"), "kind", kind, "cpu, cuda or auto")
        check(
            memory_format in ("auto", "channels_last", "contiguous"),
            "memory_format",
            memory_format,
            "auto, channels_last or contiguous",
        )
        check(
            isinstance(backend, str) and (backend == "auto" or backend in BACKENDS or findable(backend)),
            "backend",
            backend,
            "auto, loop, processes, vmap, distributed or the import path of a fedrun.trainer.Trainer class",
        )
        check(inner in ("loop", "vmap"), "inner", inner, "loop or vmap (how each rank of backend=distributed trains)")
        check(
            workers is None or (isinstance(workers, int) and workers >= 1),
            "workers",
            workers,
            "null or an integer >= 1",
        )
        check(chunk is None or (isinstance(chunk, int) and chunk >= 1), "chunk", chunk, "null or an integer >= 1")
        check(
            threads is None or (isinstance(threads, int) and threads >= 1),
            "threads",
            threads,
            "null or an integer >= 1",
        )
        check(
            backend != "processes" or "fork" in multiprocessing.get_all_start_methods(),
            "backend",
            backend,
            "loop or auto on a platform without fork",
        )
        self.kind, self.memory_format, self.backend, self.workers, self.chunk = (
            kind,
            memory_format,
            backend,
            workers,
            chunk,
        )
        self.inner = inner
        self.threads, self.cores = threads, None  # cores: what this job may use, once ``use_cores`` says
        if not lazy.deferred("torch"):  # the command asks the machine once every part is built (``setup``)
            self.check_machine()

    def check_machine(self) -> None:
        """The checks that ask the machine whether it has CUDA, which needs torch: the constructor checks the values
        alone while torch is deferred (the command builds a run's parts before it imports torch, ``fedrun.lazy``), and
        ``setup`` calls this next; otherwise the constructor calls it."""
        if self.kind == "cuda":
            check(torch.cuda.is_available(), "kind", self.kind, "cpu or auto: this machine has no CUDA device")
        check(
            not (self._cuda() and self.backend == "processes"),
            "backend",
            self.backend,
            "loop or auto on CUDA (worker processes are for CPUs)",
        )

    def _cuda(self) -> bool:
        """Whether the run trains on CUDA: ``kind=cuda``, or ``auto`` on a machine that has it."""
        return self.kind == "cuda" or (self.kind == "auto" and torch.cuda.is_available())

    @functools.cached_property
    def torch(self) -> torch.device:
        """The torch device (the machine was asked by ``check_machine``: the constructor or ``setup``)."""
        return torch.device("cuda" if self._cuda() else "cpu")

    def use_cores(self, cores: int) -> int:
        """Limit this job to ``cores`` cores: its intra-op threads (unless ``threads`` says) and its default
        worker processes. Returns the threads set."""
        self.cores = max(1, cores)
        torch.set_num_threads(self.threads or self.cores)
        return torch.get_num_threads()

    def layout(self, x: torch.Tensor) -> torch.memory_format:
        """The memory format for a model fed inputs like ``x``."""
        if self.memory_format == "contiguous" or x.dim() != 4:
            return torch.contiguous_format
        return torch.channels_last

    def prepare(self, model: torch.nn.Module, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Move the model and tensors to the device, in the layout (images only). Returns the tensors."""
        layout = self.layout(tensors[0])
        model.to(self.torch).to(memory_format=layout)
        return [
            None
            if t is None
            else t.to(self.torch).contiguous(memory_format=layout if t.dim() == 4 else torch.contiguous_format)
            for t in tensors
        ]

    def chosen_backend(self, passes_per_round: int, vmap_ok: bool = False, together: int | None = None) -> str:
        """The backend for a round of this many sample-passes (``vmap_ok``: the solver and model allow vmap;
        ``together``: how many clients a call usually trains, when known; one alone gains nothing from workers
        or vmap)."""
        if self.backend != "auto":
            return self.backend
        if together is not None and together < 2:
            return "loop"
        if self.torch.type == "cuda":
            return "vmap" if vmap_ok else "loop"
        workers = self.workers or self.cores or usable_cores()
        fits = self.torch.type == "cpu" and workers >= 2 and "fork" in multiprocessing.get_all_start_methods()
        return "processes" if fits and passes_per_round >= MIN_PASSES_PER_WORKER * workers else "loop"

    def trainer(self, model, x, y, make_optimizer, passes_per_round: int, together: int | None = None) -> Trainer:
        """A trainer for the run (close it when done): the chosen backend's class (``BACKENDS``, or the class
        ``backend`` names) built by its ``for_device`` (``together``: see ``chosen_backend``)."""
        from fedrun.vmap import vmap_supported  # torch.func, models and solvers: imported when a run chooses

        vmap_ok = self.torch.type == "cuda" and self.backend == "auto" and vmap_supported(make_optimizer, model) is None
        backend = self.chosen_backend(passes_per_round * pass_cost(model, x), vmap_ok, together)
        return self.load_backend(BACKENDS.get(backend, backend)).for_device(model, x, y, make_optimizer, self)

    def load_backend(self, path: str | None = None) -> type[Trainer] | None:
        """The ``Trainer`` class at ``path`` (default: ``backend`` when it is an import path), imported: its
        module's code runs, so the CLI calls this once the name is known to be the user's (from the command line,
        or a resumed run's named again: ``fedrun.cli.resume``). ConfigError when it names no Trainer class."""
        path = path or BACKENDS.get(self.backend, self.backend)
        if path == "auto":
            return None
        found = trainer_class(path)
        check(
            found is not None,
            "device.backend",
            path,
            "auto, loop, processes, vmap, distributed or the import path of a fedrun.trainer.Trainer class",
        )
        return found


def trainer_class(path: str):
    """The ``Trainer`` subclass at an import path (``package.module.Class``), or None when there is none. This
    imports the module (its top-level code runs): ``findable`` looks without importing."""
    module, _, name = str(path).rpartition(".")
    if not module:
        return None
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return found if isinstance(found, type) and issubclass(found, Trainer) else None


def findable(path: str) -> bool:
    """Whether ``path`` (``package.module.Class``) may name a ``Trainer`` class, found without running any code
    that is not fedrun's: a module of fedrun or one already imported is read; any other is only looked for, part
    by part, by the finders of ``sys.meta_path``, as the import system does before it loads a module
    (``importlib.util.find_spec`` would import the parent packages, running their ``__init__``). The class itself
    is checked when it is loaded (``Device.load_backend``)."""
    module, _, name = path.rpartition(".")
    if not module or not name.isidentifier() or not all(part.isidentifier() for part in module.split(".")):
        return False
    if module == "fedrun" or module.startswith("fedrun.") or module in sys.modules:
        lazy.load("torch")  # a trainer's module may import torch's submodules (fedrun.lazy)
        return trainer_class(path) is not None
    parts, locations = module.split("."), None
    for depth in range(1, len(parts) + 1):
        fullname = ".".join(parts[:depth])
        if fullname in sys.modules:  # an imported parent: its package path
            locations = getattr(sys.modules[fullname], "__path__", None)
        else:
            spec = next(
                (
                    found
                    for finder in sys.meta_path
                    if hasattr(finder, "find_spec") and (found := finder.find_spec(fullname, locations)) is not None
                ),
                None,
            )
            if spec is None:
                return False
            locations = spec.submodule_search_locations
        if depth < len(parts) and locations is None:  # a module, not a package: it has no submodules
            return False
    return True


def as_device(device) -> Device:
    """A ``Device`` for a ``torch.device`` (plain loop, contiguous layout, as before) or a ``Device``."""
    if isinstance(device, Device):
        return device
    return Device(kind=torch.device(device).type, memory_format="contiguous", backend="loop")


class LoopTrainer(Trainer):
    """Train the cohort's clients one after another in this process."""

    def __init__(self, model, x, y, make_optimizer):
        self.model, self.x, self.y, self.make_optimizer = model, x, y, make_optimizer
        self.updates = Buffers(keep=2, shared=False)  # the cohort's rows, kept from round to round (``Buffers``)

    def __call__(
        self, global_params, parts, client_ids, lr, work, seed, round_, stream="batches", program=None
    ) -> CohortUpdate:
        out = self.updates.take((len(parts), global_params.shape[-1]), global_params)
        return train_cohort(
            self.model,
            global_params,
            self.x,
            self.y,
            parts,
            client_ids,
            self.make_optimizer,
            lr,
            work,
            seed,
            round_,
            stream,
            program,
            out,
        )

    def losses(self, params, parts, batch_size) -> ClientLosses:
        """F_i(params) of each client (``cohort_losses``)."""
        return cohort_losses(self.model, params, self.x, self.y, parts, batch_size)

    def close(self) -> None:
        pass


# Shared buffers a worker keeps mapped: the parent's broadcast and its two of updates (``Buffers``).
KEEP_MAPPED = 3


def _worker(connection, inherited, model, x, y, make_optimizer, private: bool) -> None:
    for end in inherited:  # the parent's ends, copied by fork: closed, so a dead parent means EOF here
        end.close()
    torch.set_num_threads(
        1
    )  # first: one thread per worker (the workers are the parallelism), and OpenMP is safe after fork
    if (
        private
    ):  # its own workspace: a model pickled to a forkserver worker shares the parent's memory (fork copies on write)
        model = copy.deepcopy(model)
    for signum in StopSignals.SIGNALS:  # the parent decides when to stop: a clean stop needs its workers, and a
        # signal to the whole job (SLURM's SIGTERM or its SIGUSR2 before the time limit, a closed terminal's SIGHUP)
        # reaches them too. Ignored, not the parent's handler a fork copies (whose second signal kills this worker)
        # nor a forkserver's defaults (SIGUSR2's kills it)
        signal.signal(signum, signal.SIG_IGN)
    mapped = {}  # storage address -> a tensor on it, the last sent last
    while True:
        try:
            task = connection.recv()
        except EOFError:  # the parent is gone (killed): nothing left to do
            return
        if task is None:
            return
        (kind, args), task = task, None  # nothing of a task is kept past it but the parent's buffers (``mapped``)
        try:
            if kind == "train":
                params, parts, client_ids, works, lr, seed, round_, stream, program, out = args
                args = None
                _keep_mapped(mapped, params, out)
                update = train_cohort(
                    model, params, x, y, parts, client_ids, make_optimizer, lr, works, seed, round_, stream, program, out
                )  # fmt: skip
                update.deltas = out = None  # written into the server's shared rows (``out``): nothing to send back
                connection.send(update)
            elif kind == "signal":
                signal_fn, params, parts = args
                _keep_mapped(mapped, params)
                connection.send(client_signal(signal_fn, model, params, x, y, parts))
            else:
                params, parts, batch_size = args
                _keep_mapped(mapped, params)
                connection.send(cohort_losses(model, params, x, y, parts, batch_size))
        except BaseException as exc:  # report to the parent instead of dying silently
            connection.send(exc)


def _keep_mapped(mapped: dict, *tensors: torch.Tensor) -> None:
    """Keep the parent's buffers ``tensors`` lie on mapped in this worker, the last ``KEEP_MAPPED`` sent (``Buffers``):
    sent again, torch maps them to this mapping, whose pages are in."""
    for tensor in tensors:
        key = tensor.untyped_storage().data_ptr()
        mapped[key] = mapped.pop(key, tensor)
    while len(mapped) > KEEP_MAPPED:
        del mapped[next(iter(mapped))]


class ProcessTrainer(Trainer):
    """Split the cohort over worker processes, each training its clients on one thread.

    The dataset tensors are shared with the workers by fork (copy-on-write, never written), or through shared
    memory where ``worker_start_method`` says forkserver, so memory does not grow with the workers. Clients are
    dealt to workers in contiguous blocks of about equal work; each worker writes its clients' updates into their
    rows of one buffer in shared memory (``Buffers``), and the rest of their reports come back by pipe.
    """

    @classmethod
    def for_device(cls, model, x, y, make_optimizer, device) -> ProcessTrainer:
        return cls(model, x, y, make_optimizer, device.workers or device.cores or usable_cores())

    def __init__(self, model, x, y, make_optimizer, workers: int, start_method: str | None = None):
        start_method = start_method or worker_start_method()
        context = multiprocessing.get_context(start_method)
        if start_method != "fork":  # the tensors travel by pickling: into shared memory once, not copied per worker
            import torch.multiprocessing  # noqa: F401  (registers the shared-memory pickling of tensors)

            x, y = x.share_memory_(), y.share_memory_()
        self.connections, self.processes = [], []
        for _ in range(workers):
            parent, child = context.Pipe()
            inherited = (
                self.connections + [parent] if start_method == "fork" else []
            )  # only fork copies the parent's ends
            process = context.Process(
                target=_worker,
                args=(child, inherited, model, x, y, make_optimizer, start_method != "fork"),
                daemon=True,
            )
            process.start()
            child.close()
            self.connections.append(parent)
            self.processes.append(process)
        # Kept in shared memory from one call to the next, as the workers keep them mapped (``Buffers``): the
        # cohort's updates, and what the workers start from.
        self.updates, self.broadcast = Buffers(keep=2), Buffers()
        # At this process's exit, among multiprocessing's own finalizers, which run before it joins its daemonic
        # children (who ignore its SIGTERM): a trainer nobody closed (the caller's cleanup raised: a progress bar on a
        # closed pipe) must not hang the exit. (``weakref.finalize`` runs after that join where any finalizer was
        # made before multiprocessing was imported.)
        self._finalizer = multiprocessing.util.Finalize(
            self, _stop_workers, args=(self.connections, self.processes), exitpriority=10
        )

    def __call__(
        self, global_params, parts, client_ids, lr, work, seed, round_, stream="batches", program=None
    ) -> CohortUpdate:
        works = work if isinstance(work, list) else [work] * len(parts)
        blocks = _blocks([passes(len(p), w) for p, w in zip(parts, works)], len(self.connections))
        out = self.updates.take((len(parts), global_params.shape[-1]), global_params) if parts else None
        sent = self.sent(global_params)
        results = self._scatter(
            "train",
            blocks,
            lambda lo, hi: (
                client_rows(sent, lo, hi),
                parts[lo:hi],
                client_ids[lo:hi],
                works[lo:hi],
                lr,
                seed,
                client_rows(round_, lo, hi),
                stream,
                None if program is None else program.rows(lo, hi),
                out[lo:hi],
            ),
        )
        return CohortUpdate.concat(results, global_params, deltas=out)

    def losses(self, params, parts, batch_size) -> ClientLosses:
        """F_i(params) of each client, the clients split over the workers by sample count."""
        sent = self.sent(params)
        results = self._scatter(
            "losses",
            _blocks([len(p) for p in parts], len(self.connections)),
            lambda lo, hi: (client_rows(sent, lo, hi), parts[lo:hi], batch_size),
        )
        return ClientLosses.concat(results)

    def per_client(self, signal, params, parts) -> np.ndarray:
        """A per-client signal, the clients split over the workers by sample count (each on its model copy)."""
        blocks = _blocks([len(p) for p in parts], len(self.connections))
        sent = self.sent(params)
        return np.concatenate(self._scatter("signal", blocks, lambda lo, hi: (signal, sent, parts[lo:hi])))

    def sent(self, params: torch.Tensor) -> torch.Tensor:
        """``params`` as the workers get it: copied into the broadcast buffer, which they keep mapped (a tensor of
        the caller's would be moved into new shared memory at every send, and each worker fault its pages in)."""
        return self.broadcast.take(params.shape, params).copy_(params)

    def _scatter(self, kind: str, blocks, arguments) -> list:
        """Send each non-empty block its task, gather the results in block order, re-raise a worker's error."""
        sent = []
        for connection, (lo, hi) in zip(self.connections, blocks):
            if lo < hi:
                connection.send((kind, arguments(lo, hi)))
                sent.append(connection)
        results = [connection.recv() for connection in sent]
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    def close(self) -> None:
        self.updates, self.broadcast = Buffers(keep=2), Buffers()  # the shared memory let go
        self._finalizer()


def _stop_workers(connections, processes) -> None:
    """Tell each worker to stop, wait for it, kill one still alive after 5 s."""
    for connection in connections:
        try:
            connection.send(None)
        except (BrokenPipeError, OSError):
            pass
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()


def shared_empty(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` and ``like``'s dtype in shared memory, made there
    (``torch.Tensor.share_memory_`` would copy a tensor's pages in): the worker processes write the cohort's updates
    into their rows of one, and a view of it goes to a worker as a handle, so an update is written once and never
    copied or sent (a 6.6M-parameter FEMNIST CNN's updates were copied three times a client: stacked by the worker,
    into shared memory to be sent, joined by the parent)."""
    made_there = getattr(torch.UntypedStorage, "_new_shared", None)  # torch's, by its sharing strategy (fd or file)
    if made_there is None:  # a torch without it: the copying way, the same tensor
        return like.new_empty(shape).share_memory_()
    return like.new_empty(0).set_(made_there(math.prod(shape) * like.element_size()), 0, shape)


class Buffers:
    """Tensors given out again and again, so that each is faulted in once. In shared memory (``shared``) for the
    worker processes, which keep mapped what they were sent last (``KEEP_MAPPED``; torch maps a storage sent again to
    the mapping it has): writing a FEMNIST CNN's ten 26 MB updates into new shared memory every round and reading them
    here faulted in 66,000 pages a side a round, and moving the global model into new shared memory to send it kept
    the workers waiting: together 0.3 s of a 2.0 s round (one ``ProcessTrainer`` call, 2 workers). The loop's rows
    are made anew as often: the same 264 MB of new pages a round.

    ``take`` gives a view of a buffer of its ``keep`` when nothing but this object holds a part of it (torch's count
    of the storage's owners is the one it had when made), else of a new one: a caller may keep what it was given.
    ``keep=2`` for a round's updates, whose caller still holds the last round's while it asks for the next.
    """

    def __init__(self, keep: int = 1, shared: bool = True):
        self.keep, self.shared, self.buffers = keep, shared, []  # [(flat tensor, its owners when made)], last used last

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A tensor of ``shape`` and ``like``'s dtype and device (in shared memory if ``shared``), uninitialised."""
        numel = math.prod(shape)
        free = (
            entry
            for entry in self.buffers
            if entry[1] is not None and _owners(entry[0]) == entry[1]  # None: torch cannot count: never again
            and entry[0].dtype == like.dtype and len(entry[0]) >= numel
        )  # fmt: skip
        entry = next(free, None)
        if entry is None:
            tensor = shared_empty((numel,), like) if self.shared else like.new_empty(numel)
            entry = (tensor, _owners(tensor))
        others = [e for e in self.buffers if e is not entry]
        self.buffers = others[max(0, len(others) - self.keep + 1) :] + [entry]  # at most ``keep``, the last used last
        return entry[0][:numel].view(shape)


def _owners(tensor: torch.Tensor) -> int | None:
    """How many owners (tensors, views) ``tensor``'s storage has, or None for a torch that cannot say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(tensor.untyped_storage()._cdata)


def worker_start_method() -> str:
    """``fork`` (workers up at once, the dataset shared copy-on-write), or ``forkserver`` where an accelerator is
    visible: once autograd has run in a process that sees a GPU, autograd refuses to run in its forked children
    ("Unable to handle autograd's threading in combination with fork-based multiprocessing", seen on an H100
    machine in a sweep's second job and in the tests), so there the workers start from a clean server process
    and get the tensors through shared memory."""
    accelerator = torch.cuda.is_available() or (hasattr(torch.backends, "mps") and torch.backends.mps.is_available())
    return "forkserver" if accelerator else "fork"


def passes(samples: int, work: LocalWork) -> int:
    """Sample-passes (forward and backward) of a client's local work."""
    return work.local_steps * work.batch_size if work.local_steps is not None else work.local_epochs * samples


def _blocks(costs: list[int], workers: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) blocks of clients with about equal total cost, one per worker (some may be empty)."""
    cumulative, bounds, lo = np.cumsum(costs), [], 0
    for k in range(1, workers + 1):
        target = cumulative[-1] * k / workers if len(costs) else 0
        hi = len(costs) if k == workers else int(np.searchsorted(cumulative, target, side="left")) + 1
        hi = max(lo, min(hi, len(costs)))
        bounds.append((lo, hi))
        lo = hi
    return bounds
