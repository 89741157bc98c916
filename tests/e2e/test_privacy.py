"""Privacy through the real ``fedrun`` command (the accounting: tests/unit/test_privacy.py)."""

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
