"""Privacy accounting: epsilon against published values, the events a run's sampling gives, the ledger's state."""

import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from fedrun.errors import ConfigError
from fedrun.privacy import Accountant, calibrate, make_accountant, round_event, without_replacement


def test_epsilon_matches_the_published_values():
    # DP-SGD's classic setting (Abadi et al. 2016): z = 1.5, q = 0.04, 2,250 steps, delta = 1e-5. Opacus's own test
    # pins RDP epsilon at 7.32911 (its orders); dp-accounting's default orders give 7.32933.
    poisson = Accountant(1.5, 1e-5, "poisson", num_clients=60_000, rate=0.04)
    poisson.step(2250)
    assert poisson.epsilon() == pytest.approx(7.32911, rel=1e-4)
    assert poisson.epsilon() == pytest.approx(7.32933, rel=1e-5)
    tighter = Accountant(1.5, 1e-5, "poisson", num_clients=60_000, rate=0.04, kind="pld")
    tighter.step(2250)
    assert tighter.epsilon() == pytest.approx(6.769, rel=1e-3)  # PLD: tighter than RDP's 7.33
    small = Accountant(1.0, 1e-5, "poisson", num_clients=10_000, rate=0.01)
    small.step(200)
    assert small.epsilon() == pytest.approx(1.34011, rel=1e-4)


def test_calibration_finds_the_noise_for_a_target_epsilon():
    z = calibrate(8.0, 1e-5, 2250, "poisson", 60_000, rate=0.04)
    assert z == pytest.approx(1.416, abs=1e-3)
    at_z = Accountant(z, 1e-5, "poisson", 60_000, rate=0.04)
    at_z.step(2250)
    assert at_z.epsilon() <= 8.0 and at_z.epsilon() == pytest.approx(8.0, rel=1e-3)  # the smallest z within 8


def test_the_event_follows_the_sampling_that_ran():
    assert round_event(1.2, "poisson", 100, None, 0.1) == dp_accounting.PoissonSampledDpEvent(
        0.1, dp_accounting.GaussianDpEvent(1.2)
    )
    # Every client every round: no amplification, add-or-remove neighbours.
    full = Accountant(1.5, 1e-5, "fixed", num_clients=50, cohort=50)
    assert full.relation == "add_or_remove_one"
    assert round_event(1.5, "fixed", 50, 50, None) == dp_accounting.GaussianDpEvent(1.5)
    full.step(100)
    gaussian = rdp.RdpAccountant()
    gaussian.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.5), 100))
    assert full.epsilon() == gaussian.get_epsilon(1e-5)
    # Some clients without replacement: replace-one neighbours, whose sensitivity of the clipped sum is 2C.
    some = Accountant(1.5, 1e-5, "fixed", num_clients=1000, cohort=40)
    assert some.relation == "replace_one"
    assert round_event(1.5, "fixed", 1000, 40, None) == dp_accounting.SampledWithoutReplacementDpEvent(
        1000, 40, dp_accounting.GaussianDpEvent(0.75)
    )
    with pytest.raises(ConfigError, match="PLD has no event for a fixed-size sample"):
        Accountant(1.5, 1e-5, "fixed", num_clients=1000, cohort=40, kind="pld")


@pytest.mark.parametrize("z,rounds", [(2.0, 30), (4.0, 50), (10.0, 200)])
def test_the_replace_one_noise_multiplier_is_z_over_2_as_the_pld_accountant_confirms(z, rounds):
    # With every client sampled (m = N), the without-replacement event is the plain Gaussian mechanism under
    # replace-one. dp-accounting's PLD takes the per-client bound C and doubles it for replace-one itself; its RDP
    # code takes the noise over the sensitivity 2C, hence z / 2. PLD is the tighter of two valid bounds, so RDP with
    # z / 2 must lie above it and close (within 10%); with z (the factor forgotten) it would lie far below it, which
    # no valid bound can.
    replace_one = dp_accounting.NeighboringRelation.REPLACE_ONE
    exact = pld.PLDAccountant(neighboring_relation=replace_one)
    exact.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), rounds))
    ours = make_accountant("rdp", "replace_one")
    ours.compose(dp_accounting.SelfComposedDpEvent(without_replacement(z, 1000, 1000), rounds))
    assert exact.get_epsilon(1e-5) <= ours.get_epsilon(1e-5) <= 1.1 * exact.get_epsilon(1e-5)


def test_the_ledger_is_plain_state_that_a_resumed_run_replays_to_the_same_epsilon():
    from fedrun.state import decode, encode

    first = Accountant(1.1, 1e-5, "poisson", num_clients=1000, rate=0.05)
    first.step(30)
    uninterrupted = Accountant(1.1, 1e-5, "poisson", num_clients=1000, rate=0.05)
    for _ in range(70):
        uninterrupted.step()
    resumed = Accountant(1.1, 1e-5, "poisson", num_clients=1000, rate=0.05)
    state = decode(encode(first.state_dict()))  # as a checkpoint holds it
    assert state == first.state_dict()
    resumed.load_state_dict(state)
    for _ in range(40):
        resumed.step()
    assert resumed.epsilon() == uninterrupted.epsilon() and resumed.rounds == 70
    other = Accountant(1.2, 1e-5, "poisson", num_clients=1000, rate=0.05)
    with pytest.raises(ConfigError, match="the ledger of this run's config"):
        other.load_state_dict(state)


def test_no_noise_is_no_privacy_and_no_round_is_no_loss():
    none = Accountant(0.0, 1e-5, "poisson", num_clients=10, rate=0.5)
    assert none.epsilon() == 0.0
    none.step()
    assert none.epsilon() == math.inf


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"kind": "moments"}, "accountant"),
        ({"sampling": "shuffle"}, "sampling"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"delta": 0.0}, "delta"),
        ({"rate": 0.0}, "rate"),
        ({"sampling": "fixed", "cohort": 11}, "cohort"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(kwargs, key):
    settings = {"noise_multiplier": 1.0, "delta": 1e-5, "sampling": "poisson", "num_clients": 10, "rate": 0.1}
    settings.update(kwargs)
    with pytest.raises(ConfigError, match=key):
        Accountant(**settings)
