"""Every override of every sweep of scripts/reproduce.py composes (the commands run end to end in
tests/e2e/test_reproduce.py)."""

import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
import reproduce  # noqa: E402


# Slow tier: these commands run for hours (the reproduction is the slow path this proves), and their 160-odd
# compositions took 32 s of the fast tier's worker time; scripts/reproduce.py's own code runs in the fast tier's
# --dry-run test (tests/e2e/test_reproduce.py).
@pytest.mark.slow
@pytest.mark.parametrize("paper", list(reproduce.PAPERS))
def test_every_point_of_every_reproduction_sweep_composes(paper, compose_config):
    points = 0
    for part in reproduce.PAPERS[paper].parts:
        args = [a.format(seeds="0,1,2,3,4", temperature="1.0") for a in part.args]
        seeds = {int(v) for a in args if a.startswith("seed=") for v in a.partition("=")[2].split(",")}
        assert seeds, part.name
        assert seeds <= set(
            range(100, 102) if part.tuning and paper.startswith("000") else range(5)
        )  # 000 tunes T on seeds of its own

        # The seed changes no key but itself: each point is composed with the part's first seed (5x fewer compositions).
        def values(key, value):
            if value.startswith("["):  # a list value is one value
                return [value]
            return [str(min(seeds))] if key == "seed" else value.split(",")

        # Hydra's multirun first composes the sweep's base, its overrides without the swept ones (a key of a swept
        # option alone fails there: fedrun -m aggregator=fedbuff,fedstaleweight engine.concurrency=10 did)
        compose_config(*[a for a in args if "," not in a.partition("=")[2] or a.partition("=")[2].startswith("[")])
        axes = [[f"{key}={v}" for v in values(key, value)] for key, _, value in (a.partition("=") for a in args)]
        for point in itertools.product(*axes):
            cfg = compose_config(*point)
            assert cfg.seed == min(seeds)
            points += len(seeds)  # the sweep points this composition stands for
    assert points >= 5
