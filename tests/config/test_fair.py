"""The fair aggregators (q-FFL, AFL, TERM: fedrun/aggregators/fair.py) compose with the rest of a round: a server
optimizer, a sampler that reads reported losses, a compressed upload and an attack that lies about its loss, each
backend giving the loop's numbers (their arithmetic by hand: tests/unit/aggregators/test_fair.py)."""

import numpy as np
import pytest
import torch

from fedrun.cli.build import run_engine, setup

EVERYTHING = [
    "dataset=digits",
    "schedule.rounds=2",
    "partition.num_clients=8",
    "schedule.clients_per_round=0.5",
    "server=adam",
    "sampler=power_of_choice",
    "compression=topk",
    "attack=loss_lie",
    "attack.fraction=0.25",
    "device=cpu",
    "device.threads=1",
]


def trained(cfg):
    """(final parameters, rows) of the run ``cfg`` builds, as ``fedrun``'s train() runs its engine."""
    built, before = setup(cfg), torch.get_num_threads()
    built["device"].use_cores(1)  # device.threads=1, as the CLI sets it: the workers' count, so the same sums
    try:
        result = run_engine(built, cfg.seed)
    finally:
        torch.set_num_threads(before)
    return result.params, result.rows


@pytest.mark.parametrize("aggregator", [["aggregator=qffl", "aggregator.q=1"], ["aggregator=afl"], ["aggregator=term"]])
def test_each_fair_rule_runs_a_whole_round_of_parts_on_every_backend_with_the_loops_numbers(compose_config, aggregator):
    def run(backend: str, *more: str):
        workers = ["device.workers=2"] if backend == "processes" else []
        params, rows = trained(compose_config(*aggregator, *EVERYTHING, f"device.backend={backend}", *workers, *more))
        assert torch.isfinite(params).all() and len(rows) == 2
        return params, [(r["test_accuracy"], r["test_loss"]) for r in rows]

    loop, processes = run("loop"), run("processes")
    assert torch.equal(processes[0], loop[0]) and processes[1] == loop[1]  # the same arithmetic, bit for bit
    # vmap sums in its own order: equal to floating-point noise, without top-k, whose choice between two coordinates
    # within that noise of each other may go either way (a discontinuity of the compressor, not of vmap), and in one
    # memory layout: vmap's is contiguous, and the loop's channels_last convolutions (device.memory_format=auto) sum in
    # another order, whose noise a max-pool's ties (digits' pixels are integers) can turn into another gradient route:
    # 1.4e-3 apart after one round on an AVX-512 machine, 3e-8 in one layout
    dense = ["compression=none", "device.memory_format=contiguous"]
    dense_loop, dense_vmap = run("loop", *dense), run("vmap", *dense)
    torch.testing.assert_close(dense_vmap[0], dense_loop[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dense_vmap[1], dense_loop[1], rtol=1e-5)
