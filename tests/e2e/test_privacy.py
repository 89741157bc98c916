"""Privacy through the real ``fedrun`` command (the accounting: tests/unit/test_privacy.py)."""

import os

import pandas as pd
import pytest

from fedrun.errors import ConfigError
from fedrun.privacy import (
    calibrate,
)


def test_pld_with_a_fixed_sample_is_refused_before_calibrating_as_with_a_noise_multiplier(compose_config, fedrun):
    from fedrun.cli.build import setup

    base = ("privacy=central", "partition.num_clients=4", "schedule.clients_per_round=0.5", "privacy.accountant=pld")
    base += ("aggregator.weighting=uniform",)  # what privacy=central sets; typed so that 968a63f reaches the accountant
    for extra in ((), ("privacy.noise_multiplier=null", "privacy.target_epsilon=4")):
        with pytest.raises(ConfigError, match=r"^privacy\.accountant='pld' is invalid: allowed is rdp with "):
            setup(compose_config(*base, *extra))
    with pytest.raises(ConfigError, match="accountant='pld'"):
        calibrate(4.0, 1e-5, 10, "fixed", 4, cohort=2, kind="pld")
    done = fedrun(*base, "privacy.noise_multiplier=null", "privacy.target_epsilon=4", check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "fedrun: error: privacy.accountant='pld' is invalid: allowed is rdp with schedule.sampling=fixed and fewer "
        "clients than all (dp-accounting's PLD has no event for a fixed-size sample), or schedule.sampling=poisson"
    )


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FEDRUN_DATA"), reason="experiment=dp_mnist uses MNIST")
def test_the_readmes_private_run_learns_and_one_whose_noise_swamps_it_is_warned(fedrun):
    # The README's and the how-to's private run, 20 rounds instead of 200 (its noise calibrated to epsilon 8 over 20)
    done = fedrun("experiment=dp_mnist", "schedule.rounds=20", "hydra.run.dir=dp", experiment="dp")
    assert "noise swamps" not in done.stderr
    metrics = pd.read_csv(fedrun.cwd / "dp" / "metrics.csv")
    assert metrics["test_accuracy"].dropna().iloc[-1] > 0.5  # chance is 0.1
    assert metrics["epsilon"].iloc[-1] == pytest.approx(8.0, rel=0.01)
    # the digits data's 20 clients, 2 a round: warned once, before round 1, and run all the same
    swamped = fedrun(
        "privacy=central",
        "schedule.sampling=poisson",
        "schedule.clients_per_round=0.1",
        "privacy.noise_multiplier=0.8",
        "schedule.rounds=1",
        experiment="swamped",
    )
    warnings = [line for line in swamped.stderr.splitlines() if line.startswith("fedrun: warning: the privacy noise")]
    assert len(warnings) == 1 and "58.5 times the clip norm" in warnings[0], swamped.stderr[-2000:]
