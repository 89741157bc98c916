"""Fast paths equal the plain computation they replace."""

import functools
import math

import numpy as np
import pytest
import torch
from torch import nn

from fedrun.aggregators import FedAvg, FedSoftMax
from fedrun.backends import LoopTrainer
from fedrun.cohort import Lazy, RoundView
from fedrun.datasets import FederatedData
from fedrun.engine import Schedule, run
from fedrun.errors import ConfigError
from fedrun.models import CNN, MLP, flat_parameters
from fedrun.optimizers import ProxSGD
from fedrun.parts import Parts


def test_cnn_relu_after_pooling_equals_the_papers_order_exactly():
    torch.manual_seed(0)
    model = CNN((1, 28, 28), 10)
    conv1, _, _, conv2, _, _, flatten, linear = model
    papers = nn.Sequential(conv1, nn.ReLU(), nn.MaxPool2d(2), conv2, nn.ReLU(), nn.MaxPool2d(2), flatten, linear)
    x, y = torch.randn(16, 1, 28, 28) - 1.0, torch.randint(0, 10, (16,))  # shifted: many all-negative pooling windows
    grads = []
    for net in (model, papers):
        net.zero_grad()
        out = net(x)
        nn.functional.cross_entropy(out, y).backward()
        grads.append((out.detach(), [p.grad.clone() for p in net.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    for mine, theirs in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_round_view_signals_are_computed_once_on_first_read():
    calls = []

    def compute():
        calls.append(1)
        return "losses"

    view = RoundView(np.arange(2), np.ones(2), round=3, losses=Lazy(compute), steps=np.array([4, 5]))
    assert not view.read("losses") and calls == []
    assert view.losses == "losses" and view.losses == "losses" and len(calls) == 1 and view.read("losses")
    assert list(view.steps) == [4, 5] and view.previous_deltas is None and view.round == 3
    with pytest.raises(AttributeError, match="no signal 'gradients'"):
        view.gradients  # noqa: B018 (reading it is the test)


torch.manual_seed(0)
X, Y = torch.randn(40, 1, 2, 3), torch.randint(0, 3, (40,))
PARTS = [np.arange(0, 12), np.arange(12, 40)]
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def engine_rows(aggregator, eval_every):
    torch.manual_seed(0)
    model = MLP((1, 2, 3), 3, hidden=(4,))
    rows = []
    result = run(
        model,
        FederatedData(X, Y, X[:8], Y[:8], num_classes=3),
        PARTS,
        Parts(aggregator),
        SGD,
        Schedule(rounds=4, local_steps=2, batch_size=5, eval_every=eval_every),
        torch.device("cpu"),
        0,
        on_round=lambda row, per_client: rows.append(row),
    )
    return result.params, rows


def test_losses_nobody_reads_are_skipped_and_train_loss_keeps_its_meaning():
    every, every_rows = engine_rows(FedAvg(), eval_every=1)
    skipping, skipping_rows = engine_rows(FedAvg(), eval_every=2)
    torch.testing.assert_close(skipping, every, rtol=0, atol=0)  # training is untouched
    for t, (a, b) in enumerate(zip(every_rows, skipping_rows), start=1):
        if t % 2 == 0:  # evaluated: the same F(w_t) over the cohort, measured at the round's start model
            assert b["train_loss"] == a["train_loss"] and b["loss_wall_s"] > 0
        else:  # FedAvg reads no losses and the round is not evaluated: no loss pass
            assert math.isnan(b["train_loss"]) and b["loss_wall_s"] == 0
    # An aggregator that reads the losses gets them every round, so train_loss is there every round.
    _, softmax_rows = engine_rows(FedSoftMax(), eval_every=2)
    assert all(not math.isnan(r["train_loss"]) for r in softmax_rows)
    assert softmax_rows[1]["train_loss"] != every_rows[1]["train_loss"]  # a different model by round 2


def test_blocks_split_the_cohort_into_contiguous_parts_of_equal_work():
    from fedrun.backends import _blocks

    # costs 1, 1, 2 | 2, 1, 1 for two workers: total 8, the first block ends where the running sum reaches 4
    assert _blocks([1, 1, 2, 2, 1, 1], 2) == [(0, 3), (3, 6)]
    assert _blocks([5], 3) == [(0, 1), (1, 1), (1, 1)]  # fewer clients than workers: empty blocks
    assert _blocks([], 2) == [(0, 0), (0, 0)]


def images(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def cohort_update(device, make_optimizer, dtype=torch.float32, work_override=None, **kwargs):
    from fedrun.clients import LocalWork

    torch.manual_seed(0)
    model = CNN((3, 8, 8), 4).to(dtype)
    x, y = images()
    x = x.to(dtype)
    x, y = device.prepare(model, x, y)
    from fedrun.models import flat_parameters

    parts = [np.arange(0, 10), np.arange(10, 35), np.arange(35, 60)]
    trainer = device.trainer(model, x, y, make_optimizer, passes_per_round=10**9)
    try:
        return trainer(
            flat_parameters(model),
            parts,
            np.array([3, 7, 9]),
            0.05,
            work_override or LocalWork(4, local_epochs=2),
            0,
            1,
            **kwargs,
        )
    finally:
        trainer.close()


def test_worker_processes_equal_the_loop_in_float64():
    from fedrun.backends import Device
    from fedrun.optimizers import ProxSGD

    for make in (
        functools.partial(torch.optim.SGD, lr=0.05, momentum=0.5),
        functools.partial(ProxSGD, lr=0.05, mu=0.1, momentum=0.5),
    ):
        loop = cohort_update(Device("cpu", "contiguous", "loop"), make, torch.float64)
        forked = cohort_update(Device("cpu", "contiguous", "processes", workers=2), make, torch.float64)
        torch.testing.assert_close(forked.deltas, loop.deltas, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(forked.local_losses.mean, loop.local_losses.mean, rtol=1e-10)
        assert list(forked.steps) == list(loop.steps) == [6, 14, 14]


def test_worker_processes_write_the_updates_into_shared_rows_equal_to_the_loops_bit_for_bit():
    # The workers write each client's update into its row of one buffer in shared memory (no copy back): the same
    # float32 bits as the loop's, in cohort order, and the buffer is the update the parent reads.
    from fedrun.backends import Device

    make = functools.partial(torch.optim.SGD, lr=0.05)
    loop = cohort_update(Device("cpu", "contiguous", "loop"), make)
    forked = cohort_update(Device("cpu", "contiguous", "processes", workers=2), make)
    assert forked.deltas.is_shared() and not loop.deltas.is_shared()
    assert torch.equal(forked.deltas, loop.deltas) and forked.deltas.shape == (3, loop.deltas.shape[1])
    np.testing.assert_array_equal(forked.local_losses.mean, loop.local_losses.mean)


def test_the_loop_and_worker_processes_reuse_their_update_buffers_and_never_one_a_caller_still_holds():
    # Round after round, the workers write into the same shared rows and start from the same broadcast buffer when
    # nothing holds them; an update the caller keeps is never written over. Every round equals the loop's bits.
    from fedrun.backends import Device
    from fedrun.clients import LocalWork

    torch.manual_seed(0)
    model, (x, y) = CNN((3, 8, 8), 4), images()
    parts, work = [np.arange(0, 10), np.arange(10, 35), np.arange(35, 60)], LocalWork(4, local_epochs=1)
    trainers = [
        Device("cpu", "contiguous", b, workers=2).trainer(model, x, y, SGD, 10**9) for b in ("loop", "processes")
    ]
    try:
        w, kept, addresses, looped = flat_parameters(model), [], [], []
        for round_ in range(1, 6):
            loop, forked = (trainer(w, parts, np.arange(3), 0.1, work, 0, round_) for trainer in trainers)
            assert torch.equal(forked.deltas, loop.deltas)
            addresses.append(forked.deltas.data_ptr())
            looped.append(loop.deltas.data_ptr())
            if round_ == 2:  # held past the round: its rows must stay as they are
                kept = [forked.deltas, forked.deltas.clone()]
            w = w + forked.deltas.mean(0)  # this round's update is still held while the next is asked for, as the
            # engine's is: the two buffers alternate, but for round 2's, kept, in place of which round 4 gets a third
        assert torch.equal(kept[0], kept[1])
        assert addresses[0] == addresses[2] == addresses[4] and len(set(addresses)) == 3
        assert len(trainers[1].broadcast.buffers) == 1  # the model sent: one buffer, reused
        assert looped[0] == looped[2] == looped[4] != looped[1] == looped[3]  # the loop's rows: two, in turn
    finally:
        for trainer in trainers:
            trainer.close()


def test_a_process_whose_worker_trainer_was_never_closed_still_exits(tmp_path):
    # Its workers ignore SIGTERM (the parent decides when they stop), and multiprocessing joins daemonic children at
    # exit after terminating them: a trainer left open (its caller's cleanup raised) hung the process at exit.
    import subprocess
    import sys

    script = tmp_path / "open.py"
    script.write_text(
        "import weakref\n"
        "class Kept:\n    pass\n"
        "kept = Kept()\n"
        "weakref.finalize(kept, print, 'kept')\n"  # a finalizer made before multiprocessing is imported
        "import functools, torch\n"
        "from fedrun.backends import Device\n"
        "from fedrun.models import CNN\n"
        "x, y = torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)\n"
        "make = functools.partial(torch.optim.SGD, lr=0.1)\n"
        "trainer = Device('cpu', backend='processes', workers=2).trainer(CNN((1, 8, 8), 3), x, y, make, 10**6)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_all_finite_agrees_with_torchs_check_where_the_sum_overflows_too():
    from fedrun.models import all_finite

    big = torch.full((4,), 3e38)  # every entry finite, the sum inf: the entries decide
    for tensor in (torch.zeros(5), big, torch.tensor([1.0, float("inf")]), torch.tensor([float("nan"), 1.0]),
                   torch.tensor([float("inf"), -float("inf")]), torch.zeros(0)):  # fmt: skip
        assert all_finite(tensor) == bool(torch.isfinite(tensor).all())


def test_shared_buffers_are_made_in_shared_memory_as_shaped_with_or_without_torchs_maker(monkeypatch):
    from fedrun.backends import shared_empty

    for params in (torch.zeros(7, dtype=torch.float64), torch.zeros(4, 7, dtype=torch.float64)):  # one start, or each
        made = shared_empty((3, params.shape[-1]), params)
        assert made.is_shared() and made.shape == (3, 7) and made.dtype == torch.float64
    owner = next(c for c in torch.UntypedStorage.__mro__ if "_new_shared" in vars(c))
    monkeypatch.setattr(owner, "_new_shared", None)  # a torch without it: made by copying, the same tensor
    copied = shared_empty((3, 7), torch.zeros(7))
    assert copied.is_shared() and copied.shape == (3, 7) and copied.dtype == torch.float32


def test_worker_processes_train_apfls_personal_models_and_alphas_as_the_loop_does():
    from fedrun.backends import Device
    from fedrun.programs import Mixed, Program

    torch.manual_seed(1)
    personal = [flat_parameters(CNN((3, 8, 8), 4).double()) for _ in range(3)]
    rows = torch.stack([torch.cat([v, v.new_tensor([a])]) for a, v in zip((0.2, 0.5, 0.9), personal)])
    program = Program(Mixed(alpha_lr=0.05), rows)
    make = functools.partial(torch.optim.SGD, lr=0.05)
    loop = cohort_update(Device("cpu", "contiguous", "loop"), make, torch.float64, program=program)
    forked = cohort_update(Device("cpu", "contiguous", "processes", workers=2), make, torch.float64, program=program)
    vmapped = cohort_update(Device("cpu", "contiguous", "vmap"), make, torch.float64, program=program)
    chunked = cohort_update(Device("cpu", "contiguous", "vmap", chunk=2), make, torch.float64, program=program)
    assert program.program.batched  # vmap steps (v, alpha) for the whole cohort, carried through the steps

    class Before(Mixed):  # a step vmap's batch_before (Mixed's) does not stand for: the loop runs it
        def before(self, local, chosen):
            super().before(local, chosen)

    class Kept(Mixed):
        def kept(self, local, delta, steps):
            return super().kept(local, delta, steps)

    assert not Before().batched and not Kept().batched
    for other in (forked, vmapped, chunked):
        torch.testing.assert_close(other.deltas, loop.deltas, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(other.kept, loop.kept, rtol=1e-10, atol=1e-12)  # each client's (v_i, alpha_i)
        np.testing.assert_allclose(other.local_losses.mean, loop.local_losses.mean, rtol=1e-10)
    assert (loop.kept[:, :-1] - rows[:, :-1]).abs().sum() > 0 and not np.allclose(loop.kept[:, -1], [0.2, 0.5, 0.9])


def test_workers_started_by_forkserver_equal_the_loop_in_float64():
    # The start method used where a GPU is visible (fork breaks autograd there): tensors through shared memory.
    from fedrun.backends import Device, ProcessTrainer
    from fedrun.clients import LocalWork
    from fedrun.models import flat_parameters

    make = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.5)
    loop = cohort_update(Device("cpu", "contiguous", "loop"), make, torch.float64)
    torch.manual_seed(0)
    model = CNN((3, 8, 8), 4).double()
    x, y = images()
    trainer = ProcessTrainer(model, x.double(), y, make, workers=2, start_method="forkserver")
    try:
        served = trainer(
            flat_parameters(model),
            [np.arange(0, 10), np.arange(10, 35), np.arange(35, 60)],
            np.array([3, 7, 9]),
            0.05,
            LocalWork(4, local_epochs=2),
            0,
            1,
        )
    finally:
        trainer.close()
    torch.testing.assert_close(served.deltas, loop.deltas, rtol=1e-10, atol=1e-12)
    assert served.deltas.is_shared()  # written by the forkserver's workers into the parent's shared rows
    assert list(served.steps) == list(loop.steps) == [6, 14, 14]


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_worker_processes_outlive_every_stop_signal_sent_to_them_twice(start_method):
    """A signal to a whole job (SLURM's SIGUSR2 before its time limit, its SIGTERM, a closed terminal's SIGHUP) reaches
    the workers too: they leave the stop to the parent, whose clean stop needs them. Before, SIGUSR2 killed a worker
    (its default action), and a forked worker ran the parent's handler, whose second signal killed it."""
    import os
    import signal

    from fedrun.backends import ProcessTrainer
    from fedrun.checkpoint import StopSignals
    from fedrun.clients import LocalWork
    from fedrun.models import flat_parameters

    make = functools.partial(torch.optim.SGD, lr=0.05)
    torch.manual_seed(0)
    model = CNN((3, 8, 8), 4).double()
    x, y = images()
    trainer = ProcessTrainer(model, x.double(), y, make, workers=2, start_method=start_method)
    args = (flat_parameters(model), [np.arange(0, 10), np.arange(10, 35)], np.array([3, 7]), 0.05, LocalWork(4), 0, 1)
    try:
        before = trainer(*args).deltas.clone()  # the workers are up, their handlers set
        for process in trainer.processes:
            for signum in StopSignals.SIGNALS * 2:
                os.kill(process.pid, signum)
        after = trainer(*args).deltas
        assert all(process.is_alive() for process in trainer.processes)
    finally:
        trainer.close()
    assert signal.SIGUSR2 in StopSignals.SIGNALS
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_worker_processes_loss_pass_equals_the_loop_in_float64():
    from fedrun.backends import Device
    from fedrun.models import flat_parameters

    losses = {}
    for backend in ("loop", "processes"):
        torch.manual_seed(0)
        model = CNN((3, 8, 8), 4).double()
        x, y = images()
        device = Device("cpu", "contiguous", backend, workers=2)
        (x,) = device.prepare(model, x.double())
        trainer = device.trainer(model, x, y, SGD, passes_per_round=10**9)
        try:
            losses[backend] = trainer.losses(
                flat_parameters(model), [np.arange(0, 10), np.arange(10, 35), np.arange(35, 60)], 4
            )
        finally:
            trainer.close()
    np.testing.assert_allclose(losses["processes"].mean, losses["loop"].mean, rtol=1e-12)
    np.testing.assert_allclose(losses["processes"].authors, losses["loop"].authors, rtol=1e-12)


def test_channels_last_equals_contiguous_up_to_float_noise():
    from fedrun.backends import Device

    make = functools.partial(torch.optim.SGD, lr=0.05)
    contiguous = cohort_update(Device("cpu", "contiguous", "loop"), make)
    channels_last = cohort_update(Device("cpu", "channels_last", "loop"), make)
    torch.testing.assert_close(channels_last.deltas, contiguous.deltas, rtol=1e-4, atol=1e-6)


def whole_runs(devices: dict, make_model, data, parts, optimizer, schedule) -> dict:
    """{name: (final params, metrics rows)} of the same FedSoftMax run (same seed and initial model) on each device."""
    outcome = {}
    for name, device in devices.items():
        torch.manual_seed(0)
        rows = []
        result = run(
            make_model(),
            data,
            parts,
            Parts(FedSoftMax()),
            optimizer,
            schedule,
            device,
            0,
            on_round=lambda row, per_client: rows.append(row),
        )
        outcome[name] = (result.params, rows)
    return outcome


def test_a_whole_run_with_worker_processes_and_channels_last_matches_the_plain_run():
    from fedrun.backends import Device

    x, y = images(80)
    data = FederatedData(x, y, x[:20], y[:20], num_classes=4)
    parts = [np.arange(k * 20, (k + 1) * 20) for k in range(4)]
    outcome = whole_runs(
        {"plain": torch.device("cpu"), "fast": Device("cpu", "channels_last", "processes", workers=2)},
        lambda: CNN((3, 8, 8), 4),
        data,
        parts,
        SGD,
        Schedule(rounds=3, local_epochs=1, batch_size=5),
    )
    torch.testing.assert_close(outcome["fast"][0], outcome["plain"][0], rtol=1e-4, atol=1e-5)
    for fast, plain in zip(outcome["fast"][1], outcome["plain"][1]):
        assert fast["test_accuracy"] == plain["test_accuracy"]
        assert fast["train_loss"] == pytest.approx(plain["train_loss"], rel=1e-5)


VMAP_SOLVERS = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.05),
    "momentum": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=0.01),
    "dampening": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.5, dampening=0.3),
    "prox": functools.partial(ProxSGD, lr=0.05, mu=0.1, momentum=0.5, weight_decay=0.01),
}


@pytest.mark.parametrize("solver", list(VMAP_SOLVERS))
def test_vmap_cohort_equals_the_loop_in_float64_with_unequal_clients(solver):
    from fedrun.backends import Device

    # Clients of 10, 25 and 25 samples in batches of 4 for two epochs: 3 + 7 + 7 batches per epoch, the last
    # of each epoch short (2, 1 and 1 samples), so padding, masks and finished clients are all exercised.
    make = VMAP_SOLVERS[solver]
    loop = cohort_update(Device("cpu", "contiguous", "loop"), make, torch.float64)
    for chunk in (None, 2):
        together = cohort_update(Device("cpu", "contiguous", "vmap", chunk=chunk), make, torch.float64)
        torch.testing.assert_close(together.deltas, loop.deltas, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(together.local_losses.mean, loop.local_losses.mean, rtol=1e-10)
        np.testing.assert_allclose(together.local_losses.authors, loop.local_losses.authors, rtol=1e-10)
        np.testing.assert_allclose(together.coefficient_norms, loop.coefficient_norms, rtol=1e-12)
        assert list(together.steps) == list(loop.steps) == [6, 14, 14]
    assert loop.deltas.abs().max() > 1e-3  # the clients moved: the comparison is not between zeros


PROGRAMS = ["scaffold", "feddyn", "ditto", "fedrep", "moon", "tilted", "untilted", "normalized", "opaque"]


def program_call(name, device="cpu"):
    """The program ``name`` as a trainer call carries it, its states (not zero) and broadcast on ``device``."""
    from fedrun.programs import FedDyn, Frozen, LocalSGD, Moon, Program, Pulled, Scaffold, Tilted

    torch.manual_seed(3)
    d = sum(p.numel() for p in CNN((3, 8, 8), 4).parameters())
    owns = 0.01 * torch.randn(3, d, dtype=torch.float64)  # each client's c_i (SCAFFOLD) or g_k (FedDyn), not zero
    shared = 0.01 * torch.randn(d, dtype=torch.float64)
    if name == "opaque":

        class Opaque(
            Scaffold
        ):  # the same correction through ``corrected``: vmap cannot see inside it, the loop runs it
            def corrected(self, local) -> None:
                super().corrected(local)

        program = Opaque()
    elif name == "normalized":  # a gradient that reduces over the parameter: mapped per client, not over the cohort

        class Normalized(LocalSGD):
            def gradient(self, grad, param, start, own, shared):
                return grad / (grad.norm() + 1e-12)

        program, owns, shared = Normalized(), None, None
    elif name == "scaffold":  # with c, the server's variate
        program = Scaffold()
    elif name == "ditto":  # the personal model pulled to the round's global model (here a perturbed one)
        program, owns, shared = Pulled(lam=0.5), None, 10 * shared
    elif name == "moon":  # the contrastive term between the local, global and previous models' representations
        program, owns, shared = Moon(mu=1.0, tau=0.5), owns * 10, None  # owns: each client's previous local model
    elif name in ("tilted", "untilted"):  # sample-level TERM inside each client; tau = 0 is plain SGD's mean
        program, owns, shared = Tilted(tau=2.0 if name == "tilted" else 0.0), None, None
    elif name == "fedrep":  # the body frozen, the head trained (FedRep's first phase)
        names = tuple(n for n, _ in CNN((3, 8, 8), 4).named_parameters())[:-2]
        program, owns, shared = Frozen(names), None, None
    else:
        program, shared = FedDyn(alpha=0.1), None
    return Program(program, *(None if t is None else t.to(device) for t in (owns, shared)))


@pytest.mark.parametrize("name", PROGRAMS)
def test_vmap_maps_scaffolds_and_feddyns_steps_over_the_cohort_as_the_loop_takes_them(name):
    # SCAFFOLD's and FedDyn's programs change the gradient only (``LocalSGD.gradient``), Ditto's adds a pull and
    # FedRep's freezes layers: vmap steps them for the whole cohort at once; a program that overrides more (here
    # ``corrected``) runs on the loop there.
    from fedrun.backends import Device

    program = program_call(name)
    assert program.program.batched == (name != "opaque")
    for make in VMAP_SOLVERS.values():
        loop = cohort_update(Device("cpu", "contiguous", "loop"), make, torch.float64, program=program)
        for chunk in (None, 2):
            together = cohort_update(
                Device("cpu", "contiguous", "vmap", chunk=chunk), make, torch.float64, program=program
            )
            torch.testing.assert_close(together.deltas, loop.deltas, rtol=1e-10, atol=1e-12)
            if loop.kept is not None:
                torch.testing.assert_close(together.kept, loop.kept, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(together.local_losses.mean, loop.local_losses.mean, rtol=1e-10)
            np.testing.assert_allclose(together.coefficient_norms, loop.coefficient_norms, rtol=1e-12)
        plain = cohort_update(Device("cpu", "contiguous", "loop"), make, torch.float64)
        if name == "untilted":  # tilt 0 is the mean: plain SGD's numbers
            torch.testing.assert_close(loop.deltas, plain.deltas, rtol=1e-12, atol=1e-14)
            continue
        assert (loop.deltas - plain.deltas).abs().max() > 1e-6  # the program moved the clients: not plain SGD's
    if name == "fedrep":
        assert (loop.deltas[:, :-1028] == 0).all() and (loop.deltas[:, -1028:] != 0).any()  # the head alone moved


def test_vmap_nesterov_and_per_client_work_equal_the_loop():
    from fedrun.backends import Device
    from fedrun.cohort import LocalWork

    make = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.5, nesterov=True)
    works = [
        LocalWork(4, local_steps=5),
        LocalWork(4, local_epochs=1),
        LocalWork(3, local_epochs=2),
    ]  # stragglers do less
    loop = cohort_update(Device("cpu", "contiguous", "loop"), make, torch.float64, work_override=works)
    together = cohort_update(Device("cpu", "contiguous", "vmap"), make, torch.float64, work_override=works)
    torch.testing.assert_close(together.deltas, loop.deltas, rtol=1e-10, atol=1e-12)
    assert list(together.steps) == list(loop.steps) == [5, 7, 18]


def test_vmap_refuses_solvers_and_models_without_a_closed_form_in_one_line():
    from fedrun.backends import Device
    from fedrun.errors import ConfigError
    from fedrun.optimizers import STORM

    with pytest.raises(
        ConfigError, match=r"device.backend='vmap' is invalid: allowed is loop or processes for this optimizer"
    ):
        cohort_update(Device("cpu", "contiguous", "vmap"), functools.partial(STORM, lr=0.05), torch.float64)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 3), nn.Dropout(0.5))
    from fedrun.vmap import VmapTrainer

    with pytest.raises(ConfigError, match="models with batch norm, buffers or dropout"):
        VmapTrainer(model, X.flatten(1), Y, SGD)
    from fedrun.models import BatchSoftmax

    with pytest.raises(ConfigError, match="model.head=batch_softmax"):  # padding would enter the batch's softmax
        VmapTrainer(nn.Sequential(nn.Flatten(), nn.Linear(6, 3), BatchSoftmax()), X.flatten(1), Y, SGD)


def test_auto_backend_picks_vmap_on_cuda_only_when_it_can():
    from fedrun.backends import Device

    device = Device("cpu")
    assert device.chosen_backend(10**9, vmap_ok=True) != "vmap"  # never on a CPU
    device.torch = torch.device("cuda")  # the rule only (this machine may have no GPU)
    assert device.chosen_backend(10, vmap_ok=True) == "vmap"
    assert device.chosen_backend(10, vmap_ok=False) == "loop"
    # The asynchronous engine's calls mostly hold one client: auto keeps the loop (an explicit backend is kept).
    assert device.chosen_backend(10**9, vmap_ok=True, together=1) == "loop"
    device.torch, device.workers = torch.device("cpu"), 2
    assert device.chosen_backend(10**9, together=1) == "loop" and device.chosen_backend(10**9, together=2) != "loop"
    assert Device("cpu", backend="processes").chosen_backend(10, together=1) == "processes"


def test_auto_counts_a_recurrent_models_pass_once_per_step_of_its_sequences():
    # LEAF's Shakespeare round (10 roles of 100 sequences of 80, batch 4): 1,000 sample-passes, 500 a worker, under
    # the rule's 1,000 as plain passes; each is 80 steps of the LSTM's cells, and the worker processes are faster.
    from fedrun.backends import Device, pass_cost
    from fedrun.models import CNN, CharLSTM

    lstm, cnn, symbols = CharLSTM((80,), 80), CNN((1, 28, 28), 10), torch.zeros(5, 80, dtype=torch.long)
    assert pass_cost(lstm, symbols) == 80 and pass_cost(cnn, torch.zeros(5, 1, 28, 28)) == 1
    device = Device("cpu", workers=2)
    assert device.chosen_backend(1_000 * pass_cost(lstm, symbols)) == "processes"
    assert device.chosen_backend(1_000 * pass_cost(cnn, torch.zeros(5, 1, 28, 28))) == "loop"


def test_a_whole_run_with_vmap_matches_the_loop_in_float64():
    from fedrun.backends import Device
    from fedrun.optimizers import ProxSGD

    x, y = images(80)
    data = FederatedData(x.double(), y, x[:20].double(), y[:20], num_classes=4)
    parts = [np.arange(0, 15), np.arange(15, 40), np.arange(40, 52), np.arange(52, 80)]
    outcome = whole_runs(
        {backend: Device("cpu", "contiguous", backend) for backend in ("loop", "vmap")},
        lambda: CNN((3, 8, 8), 4).double(),
        data,
        parts,
        functools.partial(ProxSGD, lr=0.05, mu=0.1, momentum=0.5),
        Schedule(rounds=3, local_epochs=2, batch_size=4, clients_per_round=0.75),
    )
    torch.testing.assert_close(outcome["vmap"][0], outcome["loop"][0], rtol=1e-10, atol=1e-12)
    for together, loop in zip(outcome["vmap"][1], outcome["loop"][1]):
        assert together["test_accuracy"] == loop["test_accuracy"]
        assert together["train_loss"] == pytest.approx(loop["train_loss"], rel=1e-10)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")


@needs_cuda
@pytest.mark.parametrize("solver", list(VMAP_SOLVERS))
def test_on_cuda_vmap_and_the_loop_equal_the_cpu_loop_in_float64(solver):
    from fedrun.backends import Device

    make = VMAP_SOLVERS[solver]
    cpu = cohort_update(Device("cpu", "contiguous", "loop"), make, torch.float64)
    for backend in ("loop", "vmap"):
        for chunk in (None, 2):
            cuda = cohort_update(Device("cuda", "contiguous", backend, chunk=chunk), make, torch.float64)
            assert cuda.deltas.device.type == "cuda"
            torch.testing.assert_close(cuda.deltas.cpu(), cpu.deltas, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(cuda.local_losses.mean, cpu.local_losses.mean, rtol=1e-10)
            np.testing.assert_allclose(cuda.local_losses.authors, cpu.local_losses.authors, rtol=1e-10)
            assert list(cuda.steps) == list(cpu.steps) == [6, 14, 14]


@needs_cuda
@pytest.mark.parametrize("name", PROGRAMS)
def test_on_cuda_every_program_on_vmap_and_the_loop_equals_the_cpu_loop_in_float64(name):
    # The client programs (SCAFFOLD, FedDyn, MOON, Ditto's pull, FedRep's freeze, TERM inside a client, and two of the
    # tests' own) with their per-client states and broadcast on the GPU, as the engine places them.
    from fedrun.backends import Device

    make = VMAP_SOLVERS["prox"]
    cpu = cohort_update(Device("cpu", "contiguous", "loop"), make, torch.float64, program=program_call(name))
    for backend in ("loop", "vmap"):
        for chunk in (None, 2):
            device = Device("cuda", "contiguous", backend, chunk=chunk)
            cuda = cohort_update(device, make, torch.float64, program=program_call(name, "cuda"))
            assert cuda.deltas.device.type == "cuda"
            torch.testing.assert_close(cuda.deltas.cpu(), cpu.deltas, rtol=1e-10, atol=1e-12)
            if cpu.kept is not None:
                torch.testing.assert_close(cuda.kept.cpu(), cpu.kept, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(cuda.local_losses.mean, cpu.local_losses.mean, rtol=1e-10)
            np.testing.assert_allclose(cuda.coefficient_norms, cpu.coefficient_norms, rtol=1e-12)


@needs_cuda
def test_on_cuda_a_whole_run_with_vmap_and_channels_last_matches_the_cpu_run():
    from fedrun.backends import Device

    x, y = images(80)
    data = FederatedData(x.double(), y, x[:20].double(), y[:20], num_classes=4)
    parts = [np.arange(0, 15), np.arange(15, 40), np.arange(40, 52), np.arange(52, 80)]
    devices = {
        "cpu": Device("cpu", "contiguous", "loop"),
        "cuda-loop": Device("cuda", "contiguous", "loop"),
        "cuda-vmap": Device("cuda", "channels_last", "vmap"),
    }
    outcome = whole_runs(
        devices,
        lambda: CNN((3, 8, 8), 4).double(),
        data,
        parts,
        functools.partial(ProxSGD, lr=0.05, mu=0.1, momentum=0.5),
        Schedule(rounds=3, local_epochs=2, batch_size=4, clients_per_round=0.75),
    )
    for name in ("cuda-loop", "cuda-vmap"):
        torch.testing.assert_close(outcome[name][0].cpu(), outcome["cpu"][0], rtol=1e-10, atol=1e-12)
        for cuda, cpu in zip(outcome[name][1], outcome["cpu"][1]):
            assert cuda["test_accuracy"] == cpu["test_accuracy"]
            assert cuda["train_loss"] == pytest.approx(cpu["train_loss"], rel=1e-10)


def test_the_plain_sgd_step_equals_torchs_sgd_bit_for_bit():
    from fedrun.clients import _loss_closure, plain_sgd_step

    x, y = images()
    trained = []
    for fast in (False, True):
        torch.manual_seed(0)
        model = CNN((3, 8, 8), 4).double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        step = plain_sgd_step(optimizer) if fast else optimizer.step
        assert step is not None
        for k in range(5):
            step(_loss_closure(model, optimizer, x.double(), y, torch.arange(4 * k, 4 * k + 4)))
        trained.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(trained[0], trained[1])
    for other in (dict(momentum=0.9), dict(weight_decay=0.1), dict(maximize=True)):
        assert plain_sgd_step(torch.optim.SGD(CNN((3, 8, 8), 4).parameters(), lr=0.05, **other)) is None
    assert plain_sgd_step(ProxSGD(CNN((3, 8, 8), 4).parameters(), lr=0.05, mu=0.1)) is None


def test_forked_workers_with_a_large_model_after_multithreaded_work_do_not_hang():
    # Regression: a worker that copied a 470,000-weight layer before limiting itself to one thread ran a
    # parallel copy in a forked child of a process whose OpenMP pool was busy, and hung for good.
    import signal

    from fedrun.backends import ProcessTrainer, worker_start_method
    from fedrun.clients import LocalWork
    from fedrun.models import flat_parameters

    if worker_start_method() != "fork":  # on the H200 machine, after the CUDA tests: autograd refuses forked children
        pytest.skip("where a GPU is visible the workers start from a forkserver (fedrun.backends.worker_start_method)")
    torch.manual_seed(0)
    model = MLP((1, 28, 28), 10)  # 784 x 600 + 600 x 600 weights: copies of them are split over threads
    x, y = torch.randn(60, 1, 28, 28), torch.randint(0, 10, (60,))
    torch.randn(1000, 1000) @ torch.randn(1000, 1000)  # the parent's thread pool has been used
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the worker processes hung"))
    signal.alarm(120)
    try:
        trainer = ProcessTrainer(
            model, x, y, functools.partial(torch.optim.SGD, lr=0.05), workers=2, start_method="fork"
        )
        try:
            update = trainer(
                flat_parameters(model),
                [np.arange(0, 30), np.arange(30, 60)],
                np.array([0, 1]),
                0.05,
                LocalWork(10, local_epochs=1),
                0,
                1,
            )
        finally:
            trainer.close()
    finally:
        signal.alarm(0)
    assert list(update.steps) == [3, 3] and update.deltas.abs().max() > 0


class NotATrainer:
    """Not a Trainer: refused as a backend."""


class CountedLoop(LoopTrainer):
    """A backend of a user's own: the loop, counting its calls."""

    calls = 0

    def __call__(self, *args, **kwargs):
        CountedLoop.calls += 1
        return super().__call__(*args, **kwargs)


def test_a_backend_of_ones_own_is_chosen_by_its_import_path_and_anything_else_is_refused():
    from fedrun.backends import Device
    from fedrun.errors import ConfigError

    CountedLoop.calls = 0
    mine = Device("cpu", "contiguous", f"{__name__}.CountedLoop")
    assert isinstance(mine.trainer(nn.Linear(1, 1), X, Y, SGD, 10), CountedLoop)
    ours = cohort_update(Device("cpu", "contiguous", "loop"), SGD, torch.float64)
    theirs = cohort_update(mine, SGD, torch.float64)
    torch.testing.assert_close(theirs.deltas, ours.deltas, rtol=0, atol=0)
    assert CountedLoop.calls == 1
    for wrong in ("threads", "fedrun.backends.Nothing", f"{__name__}.NotATrainer", "no.such.module.Trainer"):
        with pytest.raises(ConfigError, match="the import path of a fedrun.trainer.Trainer class"):
            Device("cpu", backend=wrong)


MARKER_MODULE = "from pathlib import Path\nPath({marker!r}).write_text('imported')\n"


def test_a_backend_that_names_a_module_of_someone_else_is_not_imported_to_check_it(tmp_path, monkeypatch):
    from fedrun.backends import Device

    marker = tmp_path / "marker"
    (tmp_path / "planted.py").write_text(MARKER_MODULE.format(marker=str(marker)))
    package = tmp_path / "plantedpkg" / "sub"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text(MARKER_MODULE.format(marker=str(marker)))  # a parent's code, too
    (package / "__init__.py").write_text("")
    (package / "trainers.py").write_text(MARKER_MODULE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("planted.Trainer", "plantedpkg.sub.trainers.Trainer"):
        device = Device("cpu", backend=name)  # found without running its module
        assert device.backend == name and not marker.exists()
    for missing in ("plantedpkg.nothing.Trainer", "planted.sub.Trainer", "nowhere_at_all.Trainer"):
        with pytest.raises(ConfigError, match="the import path of a fedrun.trainer.Trainer class"):
            Device("cpu", backend=missing)
    assert not marker.exists()
    with pytest.raises(ConfigError, match="device.backend='planted.Trainer'"):  # imported when the user asks for it
        Device("cpu", backend="planted.Trainer").load_backend()
    assert marker.exists()
