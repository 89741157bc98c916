"""The seams for new features: the update pipeline (fedrun/pipeline.py: stages between local training and aggregation,
the clip stage) and per-client signals (fedrun/trainer.py), each equal on every backend."""

import functools
import math

import numpy as np
import pytest
import torch

from fedrun import compat
from fedrun.aggregators import MVR, FedAvg, FedBuff
from fedrun.async_engine import AsyncEngine
from fedrun.backends import Device
from fedrun.datasets import FederatedData
from fedrun.engine import Schedule, SyncEngine, run
from fedrun.errors import ConfigError
from fedrun.models import CNN
from fedrun.parts import Parts
from fedrun.pipeline import Clip, Pipeline


def test_clip_scales_each_update_to_the_bound_and_leaves_those_within_it_bit_for_bit():
    # Norms: ||(3, 4)|| = 5 (at the bound C = 5: kept), ||(6, 8)|| = 10 (scaled by 5/10 -> (3, 4)),
    # ||(0.3, 0.4)|| = 0.5 (kept). Clipped: 1 of 3; mean norm before clipping (5 + 10 + 0.5) / 3 = 5.1666...
    deltas = torch.tensor([[3.0, 4.0], [6.0, 8.0], [0.3, 0.4]], dtype=torch.float64)
    out, diagnostics = Clip(max_norm=5.0)(deltas, np.arange(3), 1)
    torch.testing.assert_close(
        out, torch.tensor([[3.0, 4.0], [3.0, 4.0], [0.3, 0.4]], dtype=torch.float64), rtol=0, atol=1e-15
    )
    assert torch.equal(out[0], deltas[0]) and torch.equal(out[2], deltas[2])
    assert diagnostics == {
        "clip/max_norm": 5.0,
        "clip/fraction_clipped": pytest.approx(1 / 3),
        "clip/norm_mean": pytest.approx(15.5 / 3),
    }
    assert torch.equal(deltas[1], torch.tensor([6.0, 8.0], dtype=torch.float64))  # its input is left as it was


def test_adaptive_clipping_moves_the_norm_geometrically_on_the_unclipped_fraction_as_andrew_et_al():
    # Andrew et al. 2021, Algorithm 1 (no noise): C <- C exp(-eta (b - gamma)), b = fraction with norm <= C.
    clip = Clip(max_norm=1.0, adaptive=True, target_quantile=0.5, clip_lr=0.2)
    first = torch.tensor([[0.5, 0.0], [2.0, 0.0], [3.0, 0.0], [4.0, 0.0]])  # norms 0.5, 2, 3, 4 under C = 1: b = 1/4
    _, diagnostics = clip(first[:2], np.arange(2), 1)  # a round's updates may pass in parts (the async engine)
    _, more = clip(first[2:], np.arange(2, 4), 1)
    assert (
        diagnostics["clip/max_norm"] == more["clip/max_norm"] == 1.0 == clip.max_norm
    )  # C moves at the round's end only
    clip.end_round()
    assert clip.max_norm == pytest.approx(math.exp(0.05))  # exp(-0.2 (0.25 - 0.5)) = exp(0.05) = 1.05127
    second = torch.tensor([[0.5, 0.0], [0.8, 0.0], [3.0, 0.0], [4.0, 0.0]])  # b = 2/4 = gamma: C stays
    out, diagnostics = clip(second, np.arange(4), 2)
    clip.end_round()
    assert clip.max_norm == pytest.approx(math.exp(0.05)) and diagnostics["clip/max_norm"] == pytest.approx(
        math.exp(0.05)
    )
    torch.testing.assert_close(out[2], torch.tensor([math.exp(0.05), 0.0]))  # clipped with the C of this round
    everything_fits = Clip(max_norm=10.0, adaptive=True)
    everything_fits(first, np.arange(4), 1)
    everything_fits.end_round()
    assert everything_fits.max_norm == pytest.approx(10.0 * math.exp(-0.1))  # b = 1: exp(-0.2 * 0.5)
    assert Clip(max_norm=2.0, adaptive=True).state_dict()["max_norm"] == 2.0


def test_stages_run_in_order_and_an_empty_pipeline_passes_updates_unchanged():
    deltas = torch.tensor([[6.0, 8.0]])
    assert Pipeline()(deltas, np.arange(1), 1) == (deltas, {}) and not Pipeline()
    out, diagnostics = Pipeline([Clip(5.0), Clip(1.0)])(
        deltas, np.arange(1), 1
    )  # 10 -> 5 -> 1; the second stage sees norm 5
    torch.testing.assert_close(out, torch.tensor([[0.6, 0.8]]))
    assert diagnostics["clip/norm_mean"] == pytest.approx(5.0)
    with pytest.raises(ConfigError, match=r"stages\[0\]"):
        Pipeline([FedAvg()])
    with pytest.raises(ConfigError, match="max_norm"):
        Clip(0)


def images(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=generator, dtype=torch.float64), torch.randint(
        0, 4, (n,), generator=generator
    )


def whole_run(device, pipeline, rounds=3, aggregator=None):
    x, y = images(80)
    data = FederatedData(x, y, x[:20], y[:20], num_classes=4)
    parts = [np.arange(0, 15), np.arange(15, 40), np.arange(40, 52), np.arange(52, 80)]
    torch.manual_seed(0)
    rows = []
    result = run(
        CNN((3, 8, 8), 4).double(),
        data,
        parts,
        Parts(aggregator or FedAvg(), pipeline=pipeline),
        functools.partial(torch.optim.SGD, lr=0.5),
        Schedule(rounds=rounds, local_epochs=2, batch_size=4),
        device,
        0,
        on_round=lambda row, per_client: rows.append(row),
    )
    return result.params, rows


def test_a_clip_stage_gives_equal_runs_on_the_loop_worker_process_and_vmap_backends_in_float64():
    outcome = {
        backend: whole_run(Device("cpu", "contiguous", backend, workers=2), Pipeline([Clip(0.05)]))
        for backend in ("loop", "processes", "vmap")
    }
    loop_params, loop_rows = outcome["loop"]
    assert all(row["clip/fraction_clipped"] > 0 for row in loop_rows)  # the bound is active
    for backend in ("processes", "vmap"):
        params, rows = outcome[backend]
        torch.testing.assert_close(params, loop_params, rtol=1e-10, atol=1e-12)
        for row, loop_row in zip(rows, loop_rows):
            assert row["clip/fraction_clipped"] == loop_row["clip/fraction_clipped"]
            assert row["clip/norm_mean"] == pytest.approx(loop_row["clip/norm_mean"], rel=1e-10)
    # Clipping changes the run (else this test would prove nothing), and a bound no update reaches changes nothing.
    unclipped, plain_rows = whole_run(torch.device("cpu"), Pipeline())
    assert not torch.allclose(unclipped, loop_params)
    loose, loose_rows = whole_run(torch.device("cpu"), Pipeline([Clip(1e9)]))
    assert torch.equal(loose, unclipped) and all(r["clip/fraction_clipped"] == 0 for r in loose_rows)
    assert [r["test_accuracy"] for r in loose_rows] == [r["test_accuracy"] for r in plain_rows]


@pytest.mark.parametrize("key", ["max_norm", "target_quantile", "clip_lr"])
def test_true_is_not_a_number_for_a_clip_stage(key):
    # Python's bool is an int: true would have been a quantile or a rate of 1
    with pytest.raises(ConfigError, match=rf"^{key}=True is invalid: allowed is a number"):
        Clip(**{key: True})


def test_the_sync_engine_refuses_stages_with_mvr_whose_second_update_would_bypass_them():
    with pytest.raises(ConfigError, match="pipeline=.*none with aggregator=mvr"):
        compat.check({"engine": SyncEngine(), "aggregator": MVR(), "pipeline": Pipeline([Clip(1.0)])})
    compat.check({"engine": SyncEngine(), "aggregator": MVR(), "pipeline": Pipeline()})


def test_the_async_engine_clips_each_arriving_update_and_logs_the_buffers_mean():
    x, y = images(60)
    data = FederatedData(x.float(), y, x[:20].float(), y[:20], num_classes=4)
    parts = [np.arange(k * 10, (k + 1) * 10) for k in range(6)]

    def go(pipeline):
        torch.manual_seed(0)
        rows = []
        engine = AsyncEngine(
            speeds=[{"name": "all", "clients": None, "distribution": "uniform", "low": 1.0, "high": 3.0}]
        )
        result = engine(
            model=CNN((3, 8, 8), 4),
            data=data,
            clients=parts,
            parts=Parts(FedBuff(buffer_size=2), pipeline=pipeline),
            optimizer=functools.partial(torch.optim.SGD, lr=0.5),
            schedule=Schedule(rounds=4, local_steps=2, batch_size=5),
            device=torch.device("cpu"),
            seed=0,
            on_round=lambda row, per_client: rows.append(row),
        )
        return result.params, rows

    plain, _ = go(None)
    clipped, rows = go(Pipeline([Clip(0.01)]))
    assert len(rows) == 4 and all(r["clip/fraction_clipped"] == 1.0 and r["clip/norm_mean"] > 0.01 for r in rows)
    assert not torch.allclose(plain, clipped)
    adaptive = Clip(0.01, adaptive=True, target_quantile=0.5, clip_lr=0.2)
    _, adaptive_rows = go(Pipeline([adaptive]))
    # Every update fits under none of these Cs (b = 0): C grows by exp(0.1) once per aggregation, not per update.
    logged = [r["clip/max_norm"] for r in adaptive_rows]
    assert logged == pytest.approx([0.01 * math.exp(0.1 * k) for k in range(4)], rel=1e-12)
    assert adaptive.max_norm == pytest.approx(0.01 * math.exp(0.4), rel=1e-12)
    loose, loose_rows = go(Pipeline([Clip(1e9)]))
    assert torch.equal(loose, plain) and all(r["clip/fraction_clipped"] == 0.0 for r in loose_rows)
    assert not any(math.isnan(r["clip/norm_mean"]) for r in loose_rows)


# The seam for a new per-client signal (fedrun/trainer.py): one function and one aggregator class, here in a test,
# with no engine or backend file touched, run by every backend.
def gradient_norm(model, params, x, y):
    """||grad F_i(w)||: the gradient norm of a client's mean loss at the global model."""
    from fedrun.models import load_flat

    load_flat(model, params)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())


class GradientNormWeighted(FedAvg):
    """alpha_i proportional to ||grad F_i(w)|| (a test-only aggregator)."""

    def weights(self, report):
        norms = report.per_client(gradient_norm)
        return norms / norms.sum()


def test_a_new_per_client_signal_is_one_function_and_runs_unchanged_on_the_loop_worker_process_and_vmap_backends():
    outcome = {
        backend: whole_run(Device("cpu", "contiguous", backend, workers=2), None, aggregator=GradientNormWeighted())
        for backend in ("loop", "processes", "vmap")
    }
    loop_params, loop_rows = outcome["loop"]
    assert all(row["alpha_distance"] > 1e-3 for row in loop_rows)  # the weights are not FedAvg's
    plain, _ = whole_run(torch.device("cpu"), None)
    assert not torch.allclose(plain, loop_params)
    for backend in ("processes", "vmap"):
        params, rows = outcome[backend]
        torch.testing.assert_close(params, loop_params, rtol=1e-10, atol=1e-12)
        for row, loop_row in zip(rows, loop_rows):
            assert row["alpha_distance"] == pytest.approx(loop_row["alpha_distance"], rel=1e-10, abs=1e-12)
    # The signal itself, by hand on one client: the same number the backend computed for it.
    x, y = images(80)
    torch.manual_seed(0)
    model = CNN((3, 8, 8), 4).double()
    from fedrun.models import flat_parameters

    w = flat_parameters(model)
    from fedrun.backends import LoopTrainer, ProcessTrainer

    by_hand = gradient_norm(model, w, x[:15], y[:15])
    loop = LoopTrainer(model, x, y, None).per_client(gradient_norm, w, [np.arange(0, 15), np.arange(15, 40)])
    workers = ProcessTrainer(model, x, y, None, workers=2)
    try:
        forked = workers.per_client(gradient_norm, w, [np.arange(0, 15), np.arange(15, 40)])
    finally:
        workers.close()
    assert loop[0] == pytest.approx(by_hand, rel=1e-12) and forked == pytest.approx(loop, rel=1e-10)
