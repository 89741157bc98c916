"""Privacy accounting: epsilon against published values, the events a run's sampling gives, the ledger's state."""

import functools
import math

import dp_accounting
import numpy as np
import pytest
import torch
from conftest import TINY_CLIENTS as CLIENTS
from conftest import TINY_DATA as DATA
from dp_accounting import pld, rdp
from numpy.testing import assert_allclose

from fedrun.aggregators import FedAvg
from fedrun.backends import Device
from fedrun.engine import run
from fedrun.errors import ConfigError
from fedrun.models import Logistic
from fedrun.parts import Parts
from fedrun.privacy import (
    Accountant,
    LocalAccountant,
    Privacy,
    calibrate,
    local_event,
    make_accountant,
    round_event,
    update_noise_multiplier,
    without_replacement,
)
from fedrun.rounds import Schedule
from fedrun.state import Context


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
    # Every client every round: no amplification.
    full = Accountant(1.5, 1e-5, "fixed", num_clients=50, cohort=50)
    assert full.relation == "zero_out"  # N is public (the denominator depends on it): zero-out, not add-or-remove
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


# --- the mechanism: DP-FedAvg with central noise (fedrun.privacy.Privacy) ---


def private(**kwargs) -> Privacy:
    settings = {"mechanism": "central", "noise_multiplier": 1.0, "clip_norm": 1.0}
    settings.update(kwargs)
    return Privacy(**settings)


def one_round(privacy: Privacy, deltas, params, round_, clients=None):
    """One round of a bound mechanism's parts (``Privacy.attach`` with a uniform FedAvg, as an engine runs them,
    ``run_parts``): the update, alpha and the round's numbers of the stages and the aggregation together.
    ``clients``: the cohort's ids (local noise streams and ledger; by default 0, 1, ...)."""
    from fedrun.aggregators import Aggregation

    clients = np.arange(len(deltas)) if clients is None else np.asarray(clients)
    [(update, alpha, staged, aggregated)], _, _ = run_parts(privacy, [(round_, clients, deltas)], params)
    return Aggregation(update, alpha, {**staged, **aggregated})


def train(privacy=None, backend="loop", rounds=4, sampling="fixed", q=0.5, seed=0, rows=None):
    torch.manual_seed(0)
    schedule = Schedule(rounds=rounds, local_steps=2, batch_size=4, clients_per_round=q, sampling=sampling)
    if privacy is not None:
        privacy.bind(Context(schedule, np.ones(len(CLIENTS)), seed))
    return run(
        Logistic((4,), 3).double(),
        DATA,
        CLIENTS,
        Parts(FedAvg(weighting="uniform"), privacy=privacy),
        functools.partial(torch.optim.SGD, lr=0.5),
        schedule,
        Device("cpu", "contiguous", backend, workers=2),
        seed,
        on_round=lambda row, per_client: rows.append(row) if rows is not None else None,
    )


def test_no_noise_and_a_bound_no_update_reaches_equal_the_non_private_run_exactly():
    plain = train()
    mine = train(private(noise_multiplier=0.0, clip_norm=1e6))
    torch.testing.assert_close(mine.params, plain.params, rtol=0, atol=0)


def test_clipping_and_the_fixed_denominator_by_hand():
    privacy = private(noise_multiplier=0.0, clip_norm=2.0)
    privacy.bind(Context(Schedule(rounds=3, clients_per_round=0.5), np.ones(8), 0))  # fixed sampling: m = 4 of 8, D = 4
    deltas = torch.tensor([[3.0, 4.0], [0.6, 0.8], [0.0, 0.0]], dtype=torch.float64)  # norms 5, 1, 0
    update, alpha, numbers = one_round(privacy, deltas, torch.zeros(2, dtype=torch.float64), 1)
    # clip: [3, 4] * 2 / 5 = [1.2, 1.6]; the others within C, unchanged. Sum [1.8, 2.4] over D = 4 (not the 3 here).
    torch.testing.assert_close(update, torch.tensor([0.45, 0.6], dtype=torch.float64), rtol=0, atol=1e-15)
    assert_allclose(alpha, [0.25, 0.25, 0.25])
    assert numbers["clipped_fraction"] == pytest.approx(1 / 3) and numbers["update_norm_mean"] == pytest.approx(2.0)
    assert numbers["noise_std"] == 0.0 and numbers["clip_norm"] == 2.0


def test_a_run_whose_noise_swamps_its_update_is_warned_in_one_line_before_round_one(capsys):
    # d = 10,000 parameters: the noise on the averaged update has norm z C sqrt(d) / D = 100 z C / D centrally,
    # z C sqrt(d / D) locally. z = 1, Poisson q = 0.05 of N = 100: D = 5, central ratio 20, local ratio 44.7; of N =
    # 1,000: D = 50, central ratio 2 (no line), local 14.1.
    layout = (("w", 0, 10_000),)
    for mechanism, clients, ratio in (("central", 100, "20"), ("local", 100, "44.7"), ("local", 1000, "14.1")):
        privacy = private(mechanism=mechanism, noise_multiplier=1.0)
        schedule = Schedule(rounds=3, clients_per_round=0.05, sampling="poisson")
        context = Context(schedule, np.ones(clients), 0, layout=layout)
        privacy.bind(context)
        privacy.bind(context)  # a run binds twice: one line
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("fedrun: warning: the privacy noise swamps the update")
        assert f"is {ratio} times the clip norm" in lines[0] and "schedule.clients_per_round" in lines[0]
    private(noise_multiplier=1.0).bind(Context(schedule, np.ones(1000), 0, layout=layout))
    assert capsys.readouterr().err == ""


def test_the_noise_has_the_calibrated_law_and_follows_the_seed():
    def noise(seed, round_=1, poisson=True):
        privacy = private(noise_multiplier=1.3, clip_norm=0.5)
        sampling = "poisson" if poisson else "fixed"
        privacy.bind(Context(Schedule(rounds=5, clients_per_round=0.1, sampling=sampling), np.ones(200), seed))
        empty = torch.zeros(0, 400_000, dtype=torch.float64)  # nobody sampled: the update is the noise alone
        return one_round(privacy, empty, torch.zeros(400_000, dtype=torch.float64), round_).update

    draw = noise(0)
    sigma = 1.3 * 0.5 / (0.1 * 200)  # z C / D, D = q N = 20
    assert abs(float(draw.mean())) < 0.01 * sigma  # its standard error is sigma / sqrt(4e5) = 0.0016 sigma
    assert float(draw.var()) == pytest.approx(sigma**2, rel=0.02)  # standard error about 0.2%
    assert torch.equal(noise(0), draw) and not torch.equal(noise(1), draw) and not torch.equal(noise(0, 2), draw)


def test_each_round_logs_the_epsilon_dp_accounting_gives_for_the_rounds_so_far():
    rows = []
    train(private(noise_multiplier=1.2), rounds=4, sampling="poisson", q=0.5, rows=rows)
    ledger = Accountant(1.2, 1e-5, "poisson", num_clients=6, rate=0.5)
    assert [r["epsilon"] for r in rows] == [ledger.epsilon(t) for t in (1, 2, 3, 4)]
    assert all(r["noise_std"] == 1.2 for r in rows)


def test_max_epsilon_stops_before_the_round_that_would_exceed_it_and_target_epsilon_calibrates():
    ledger = Accountant(1.2, 1e-5, "poisson", num_clients=6, rate=0.5)
    limit = (ledger.epsilon(3) + ledger.epsilon(4)) / 2  # rounds 1-3 fit, round 4 would not
    rows, privacy = [], private(noise_multiplier=1.2, max_epsilon=limit)
    train(privacy, rounds=8, sampling="poisson", q=0.5, rows=rows)
    assert len(rows) == 3 and rows[-1]["epsilon"] <= limit
    assert privacy.run_tags()["stopped_by"].startswith(f"max_epsilon {limit:g}: round 4 would bring epsilon to")
    calibrated = private(noise_multiplier=None, target_epsilon=4.0)
    rows = []
    train(calibrated, rounds=5, sampling="poisson", q=0.5, rows=rows)
    assert rows[-1]["epsilon"] <= 4.0 and rows[-1]["epsilon"] == pytest.approx(4.0, rel=1e-3)
    with pytest.raises(ConfigError, match="privacy.max_epsilon"):
        private(max_epsilon=0.01).bind(
            Context(Schedule(rounds=5, clients_per_round=0.5, sampling="poisson"), np.ones(6), 0)
        )


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(private, id="central"),
        pytest.param(lambda: private(adaptive=True, clip_count_noise=1.0), id="adaptive", marks=pytest.mark.slow),
        pytest.param(lambda: local(), id="local", marks=pytest.mark.slow),
    ],
)
def test_private_runs_are_equal_on_every_backend(make):
    loop = train(make(), "loop", sampling="poisson")
    for backend in ("processes", "vmap"):  # vmap runs on the CPU too (slower there, the same numbers)
        other = train(make(), backend, sampling="poisson")
        torch.testing.assert_close(other.params, loop.params, rtol=1e-10, atol=1e-10)


def test_a_fixed_sample_reports_the_smaller_of_its_two_valid_bounds():
    def epsilon(event, rounds):
        accountant = make_accountant("rdp", "replace_one")
        accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
        return accountant.get_epsilon(1e-5)

    # Theorem 27's bound for m = 90 of 100 lies above no amplification at all (Gaussian(z / 2), replace-one): the
    # latter is reported. For m = 40 of 1,000 the amplified bound is the smaller one.
    for n, m, z, better in ((100, 90, 1.0, "plain"), (1000, 40, 1.5, "sampled")):
        ledger = Accountant(z, 1e-5, "fixed", num_clients=n, cohort=m)
        ledger.step(100)
        sampled = epsilon(without_replacement(z, n, m), 100)
        plain = epsilon(dp_accounting.GaussianDpEvent(z / 2), 100)
        assert ledger.epsilon() == min(sampled, plain) and (plain < sampled) == (better == "plain")


@pytest.mark.slow  # each epsilon of a sample without replacement takes about a second: calibration takes dozens
def test_calibration_of_a_fixed_sample_follows_the_smaller_bound():
    z = calibrate(300.0, 1e-5, 100, "fixed", 100, cohort=90)
    at_z = Accountant(z, 1e-5, "fixed", num_clients=100, cohort=90)
    at_z.step(100)
    assert at_z.epsilon() <= 300.0 and at_z.epsilon() == pytest.approx(300.0, rel=1e-3)


def test_the_sensitivity_of_the_released_sum_is_c_for_zero_out_and_2c_for_replace_one():
    c, d = 0.5, 3  # fixed sample of m = 4: D = 4
    privacy = private(noise_multiplier=0.0, clip_norm=c)
    privacy.bind(Context(Schedule(rounds=2, clients_per_round=0.5), np.ones(8), 0))
    base = torch.tensor([[0.1, 0.2, -0.1], [0.3, 0.0, 0.2], [-0.2, 0.1, 0.4], [0.0, 0.3, 0.1]], dtype=torch.float64)
    released = one_round(privacy, base, torch.zeros(d, dtype=torch.float64), 1).update
    huge, zero = base.clone(), base.clone()
    huge[2], zero[2] = torch.tensor([-300.0, 400.0, 0.0]), 0.0  # one client's data replaced / zeroed out
    moved_huge = one_round(privacy, huge, torch.zeros(d, dtype=torch.float64), 1).update - released
    moved_zero = one_round(privacy, zero, torch.zeros(d, dtype=torch.float64), 1).update - released
    assert float(moved_huge.norm()) <= 2 * c / 4 + 1e-12 and float(moved_zero.norm()) <= c / 4 + 1e-12
    assert float(moved_huge.norm()) > c / 4  # and the replace-one bound is needed: it moves further than C / D


def test_the_poisson_denominator_is_the_expected_cohort_size():
    privacy = private(noise_multiplier=0.0, clip_norm=10.0)
    privacy.bind(Context(Schedule(rounds=2, clients_per_round=0.25, sampling="poisson"), np.ones(8), 0))  # D = q N = 2
    deltas = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 0.0]], dtype=torch.float64)  # 3 drawn this round, not 2
    update = one_round(privacy, deltas, torch.zeros(2, dtype=torch.float64), 1).update
    torch.testing.assert_close(update, torch.tensor([4.5, 3.0], dtype=torch.float64), rtol=0, atol=1e-15)


def test_a_non_finite_client_update_is_sent_as_zero():
    privacy = private(noise_multiplier=0.0, clip_norm=10.0)
    privacy.bind(Context(Schedule(rounds=2, clients_per_round=0.25), np.ones(8), 0))  # fixed, m = D = 2
    deltas = torch.tensor([[1.0, 2.0], [math.nan, 1.0]], dtype=torch.float64)
    update, _, numbers = one_round(privacy, deltas, torch.zeros(2, dtype=torch.float64), 1)
    torch.testing.assert_close(update, torch.tensor([0.5, 1.0], dtype=torch.float64))
    assert numbers["nonfinite_updates"] == 1.0


def test_a_fixed_sample_run_and_an_empty_poisson_round_through_the_engine():
    rows = []
    train(private(noise_multiplier=1.5), rounds=3, sampling="fixed", q=0.5, rows=rows)  # m = 3 of 6
    ledger = Accountant(1.5, 1e-5, "fixed", num_clients=6, cohort=3)
    assert ledger.relation == "replace_one" and [r["epsilon"] for r in rows] == [ledger.epsilon(t) for t in (1, 2, 3)]
    rows = []
    # q N = 1.02 (central noise refuses an expected cohort below one client)
    result = train(private(noise_multiplier=1.0, clip_norm=0.1), rounds=10, sampling="poisson", q=0.17, rows=rows)
    empty = [i for i, r in enumerate(rows) if r["cohort_size"] == 0]
    assert empty and result  # about 33% of rounds draw nobody of 6 at q = 0.17
    poisson = Accountant(1.0, 1e-5, "poisson", num_clients=6, rate=0.17)
    assert [r["epsilon"] for r in rows] == [poisson.epsilon(t) for t in range(1, 11)]  # empty rounds count too
    for i in empty:  # the released model moved by the noise alone
        assert rows[i]["test_loss"] != (rows[i - 1]["test_loss"] if i else None)


# --- adaptive clipping (Andrew et al. 2021) ---


def adaptive(clip_norm=1.0, count_noise=0.0, noise_multiplier=0.0, clients=8, cohort=1.0, **kwargs) -> Privacy:
    """A central mechanism with adaptive clipping bound to a fixed sample (D = m exactly; every client by default,
    whose Gaussian epsilon takes milliseconds where a sample without replacement takes a second)."""
    privacy = private(
        noise_multiplier=noise_multiplier, clip_norm=clip_norm, adaptive=True, clip_count_noise=count_noise, **kwargs
    )
    privacy.bind(Context(Schedule(rounds=10, clients_per_round=cohort), np.ones(clients), 0))
    return privacy


def rows_of_norms(norms) -> torch.Tensor:
    """One update per norm, along distinct axes."""
    return torch.diag(torch.tensor(norms, dtype=torch.float64))


def test_adaptive_clipping_moves_c_by_e_to_the_plus_or_minus_0_1_by_hand():
    # eta = 0.2, gamma = 0.5, no count noise, m = D = 4: all clipped gives b~ = (0 - 4/2) / 4 + 1/2 = 0, so
    # C <- C exp(-0.2 (0 - 0.5)) = C e^0.1; none clipped gives b~ = (4 - 2) / 4 + 1/2 = 1, so C <- C e^-0.1.
    privacy = adaptive(clip_norm=2.0, clients=4, cohort=1.0)
    zero = torch.zeros(4, dtype=torch.float64)
    numbers = one_round(privacy, rows_of_norms([3.0, 4.0, 5.0, 6.0]), zero, 1).diagnostics
    assert numbers["clip_norm"] == 2.0 and numbers["unclipped_fraction_noised"] == 0.0  # the C this round used
    assert privacy.clip_norm == pytest.approx(2.0 * math.exp(0.1), rel=1e-15)
    privacy = adaptive(clip_norm=2.0, clients=4, cohort=1.0)
    numbers = one_round(privacy, rows_of_norms([0.5, 1.0, 1.5, 2.0]), zero, 1).diagnostics  # 2.0 = C is unclipped
    assert numbers["unclipped_fraction_noised"] == 1.0
    assert privacy.clip_norm == pytest.approx(2.0 * math.exp(-0.1), rel=1e-15)


@pytest.mark.parametrize("start", [0.1, 10.0])
def test_adaptive_clipping_converges_to_the_median_of_fixed_norms(start):
    norms = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]  # median 5
    privacy = adaptive(clip_norm=start, clients=9, cohort=1.0)
    zero = torch.zeros(9, dtype=torch.float64)
    for t in range(1, 201):  # ln(50) / 0.1 = 39 rounds at least to get there from either start
        one_round(privacy, rows_of_norms(norms), zero, t)
    assert abs(privacy.clip_norm - 5.0) < 0.5


def test_the_update_noise_multiplier_leaves_the_count_its_share_of_z():
    # z = 1, sigma_b = 1: z_Delta = (1 - 1 / 4)^(-1/2) = 1 / sqrt(0.75) = 1.1547005...
    assert update_noise_multiplier(1.0, 1.0) == pytest.approx(1.1547005383792515, rel=1e-15)
    z, sigma_b = 0.8, 1.3
    z_delta = update_noise_multiplier(z, sigma_b)
    assert z_delta**-2 + (2 * sigma_b) ** -2 == pytest.approx(z**-2, rel=1e-12)  # one Gaussian of multiplier z
    assert update_noise_multiplier(0.0, 1.0) == 0.0


def test_adaptive_noise_uses_the_round_s_clip_norm_and_the_count_noise_has_its_law():
    # every client every round (a Gaussian event: each round's epsilon is quick), D = m = 10
    privacy = adaptive(clip_norm=1.0, count_noise=2.0, noise_multiplier=1.0, clients=10, cohort=1.0)
    z_delta = update_noise_multiplier(1.0, 2.0)
    zero = torch.zeros(10, dtype=torch.float64)
    fractions = []
    for t in range(1, 2001):
        used = privacy.clip_norm
        numbers = one_round(privacy, rows_of_norms([used * 2] * 5 + [used / 2] * 5), zero, t).diagnostics
        assert numbers["clip_norm"] == used and numbers["noise_std"] == pytest.approx(z_delta * used, rel=1e-15)
        fractions.append(numbers["unclipped_fraction_noised"])
    # 5 of 10 unclipped: b~ = (5 - 5 + N(0, 4)) / 10 + 1/2, mean 0.5 and std 0.2
    assert np.mean(fractions) == pytest.approx(0.5, abs=3 * 0.2 / math.sqrt(2000))
    assert np.std(fractions) == pytest.approx(0.2, rel=0.05)
    assert privacy.run_tags()["privacy_update_noise_multiplier"] == f"{z_delta:.6g}"
    # and the noise actually added: all-zero updates release the noise alone, std z_Delta C / D with this round's C
    d, used = 200_000, privacy.clip_norm
    update = one_round(privacy, torch.zeros(10, d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64), 2001)
    assert float(update.update.std()) == pytest.approx(z_delta * used / 10, rel=0.01) and privacy.clip_norm != used


def test_binding_again_starts_from_the_config_not_from_the_last_bind():
    privacy = private(noise_multiplier=None, target_epsilon=4.0, adaptive=True)
    privacy.bind(
        Context(Schedule(rounds=5, clients_per_round=1.0), np.ones(200), 0)
    )  # every client: sigma_b = 200 / 20 = 10
    first = (privacy.noise_multiplier, privacy.count_noise)
    privacy.bind(
        Context(Schedule(rounds=50, clients_per_round=0.1, sampling="poisson"), np.ones(200), 0)
    )  # 20 a round: sigma_b = 1
    assert privacy.count_noise == 1.0 and first[1] == 10.0 and privacy.noise_multiplier != first[0]


def test_adaptive_clipping_is_refused_where_its_count_would_eat_the_whole_budget_or_with_local_noise():
    with pytest.raises(ConfigError, match=r"clip_count_noise=0.4.*above z / 2 = 0.5"):
        adaptive(count_noise=0.4, noise_multiplier=1.0)
    with pytest.raises(ConfigError, match="adaptive=True.*false with mechanism=local"):
        Privacy(mechanism="local", noise_multiplier=1.0, adaptive=True)
    default = adaptive(count_noise=None, noise_multiplier=0.05, clients=200, cohort=0.1)  # m = 20: sigma_b = 1
    assert default.count_noise == 1.0


def test_an_adaptive_run_is_deterministic_and_its_state_carries_the_clip_norm():
    rows, again = [], []
    train(adaptive(clip_norm=0.05, count_noise=1.0, noise_multiplier=0.5, clients=6), q=1.0, rows=rows)
    train(adaptive(clip_norm=0.05, count_noise=1.0, noise_multiplier=0.5, clients=6), q=1.0, rows=again)
    assert [r["clip_norm"] for r in rows] == [r["clip_norm"] for r in again]
    assert len({r["clip_norm"] for r in rows}) == len(rows)  # it moves every round
    privacy = adaptive(clip_norm=0.05, count_noise=1.0, noise_multiplier=0.5, clients=6)
    train(privacy, rounds=2, q=1.0)
    state = privacy.state_dict()
    fresh = adaptive(clip_norm=0.05, count_noise=1.0, noise_multiplier=0.5, clients=6)
    fresh.load_state_dict(state)
    assert fresh.clip_norm == privacy.clip_norm != 0.05 and fresh.ledger.rounds == 2


# --- local DP ---


def local(**kwargs) -> Privacy:
    settings = {"mechanism": "local", "noise_multiplier": 1.0, "clip_norm": 1.0}
    settings.update(kwargs)
    return Privacy(**settings)


def test_local_epsilon_is_the_worst_client_s_gaussian_composed_over_its_rounds():
    ledger = LocalAccountant(2.0, 1e-5, num_clients=5)
    ledger.step([0, 1])
    ledger.step([1, 2])
    ledger.step([1])  # client 1 in 3 rounds, the most
    reference = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    reference.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.0), 3))  # z / 2 = 1
    assert ledger.rounds == 3 and ledger.epsilon() == reference.get_epsilon(1e-5)
    # RDP's z / 2 against PLD, which doubles the sensitivity itself for replace-one: the same mechanism, PLD tighter
    tight = LocalAccountant(2.0, 1e-5, num_clients=5, kind="pld")
    tight.counts[:] = ledger.counts
    assert local_event(2.0, "pld") == dp_accounting.GaussianDpEvent(2.0)
    assert tight.epsilon() <= ledger.epsilon() <= 1.1 * tight.epsilon()


def test_local_noise_is_each_client_s_own_and_the_server_averages_what_arrives():
    privacy = local(noise_multiplier=0.0, clip_norm=1.0)
    privacy.bind(Context(Schedule(rounds=2, clients_per_round=0.5), np.ones(8), 0))
    deltas = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]], dtype=torch.float64)  # norms 5, 0.5, 0
    # clipped: (0.6, 0.8), (0.3, 0.4), (0, 0); the mean over the 3 that arrived: (0.3, 0.4)
    update = one_round(privacy, deltas, torch.zeros(2, dtype=torch.float64), 1, np.array([2, 5, 7])).update
    torch.testing.assert_close(update, torch.tensor([0.3, 0.4], dtype=torch.float64), rtol=0, atol=1e-15)
    assert privacy.ledger.counts.tolist() == [0, 0, 1, 0, 0, 1, 0, 1]
    noisy = local(noise_multiplier=2.0, clip_norm=0.5)
    noisy.bind(Context(Schedule(rounds=2, clients_per_round=0.5), np.ones(8), 3))
    d = 200_000
    one = one_round(noisy, torch.zeros(1, d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64), 1, [4]).update
    assert float(one.mean()) == pytest.approx(0.0, abs=0.01 * 1.0) and float(one.var()) == pytest.approx(1.0, rel=0.02)
    two = one_round(
        noisy, torch.zeros(2, d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64), 1, [4, 6]
    ).update
    # client 4's noise is its own, whoever else is in the round: (n4 + n6) / 2 has variance 1 / 2
    assert float(two.var()) == pytest.approx(0.5, rel=0.02)
    assert torch.corrcoef(torch.stack([one, two]))[0, 1] == pytest.approx(math.sqrt(0.5), abs=0.01)


def test_a_local_run_without_noise_equals_the_non_private_run_and_logs_the_worst_client_s_epsilon():
    plain = train()
    mine = train(local(noise_multiplier=0.0, clip_norm=1e6))
    torch.testing.assert_close(mine.params, plain.params, rtol=0, atol=0)
    rows, privacy = [], local(noise_multiplier=1.5)
    train(privacy, rounds=4, sampling="poisson", q=0.5, rows=rows)
    worst = LocalAccountant(1.5, 1e-5, 6)
    assert rows[-1]["epsilon"] == worst.epsilon(privacy.ledger.rounds) and privacy.ledger.counts.sum() == sum(
        r["cohort_size"] for r in rows
    )


def test_local_calibration_covers_a_client_drawn_every_round_and_max_epsilon_stops_before_any_could_pass_it():
    privacy = local(noise_multiplier=None, target_epsilon=3.0)
    privacy.bind(Context(Schedule(rounds=20, clients_per_round=0.5, sampling="poisson"), np.ones(6), 0))
    assert privacy.ledger.epsilon(20) == pytest.approx(3.0, rel=1e-3) and privacy.ledger.epsilon(20) <= 3.0
    ledger = LocalAccountant(1.5, 1e-5, 6)
    limit = (ledger.epsilon(2) + ledger.epsilon(3)) / 2
    rows, capped = [], local(noise_multiplier=1.5, max_epsilon=limit)
    train(capped, rounds=12, q=0.5, rows=rows)
    assert capped.ledger.rounds == 2 and rows[-1]["epsilon"] <= limit
    assert capped.stopped.startswith(f"max_epsilon {limit:g}: a client's round 3 would bring epsilon to")


def test_epsilon_deployment_is_a_larger_deployment_s_with_the_same_noise_on_the_average():
    privacy = private(
        noise_multiplier=1.0, deployment_clients=10_000_000, deployment_cohort=1000, deployment_delta=1e-8
    )
    rows = []
    train(privacy, rounds=3, sampling="poisson", q=0.5, rows=rows)  # D = 3: z_dep = 1 * 1000 / 3
    deployment = Accountant(1000 / 3, 1e-8, "poisson", num_clients=10_000_000, rate=1e-4)
    assert [r["epsilon_deployment"] for r in rows] == [deployment.epsilon(t) for t in (1, 2, 3)]
    assert all(r["epsilon_deployment"] < r["epsilon"] for r in rows)
    assert "not this run's epsilon" in privacy.run_tags()["privacy_deployment"]
    with pytest.raises(ConfigError, match="deployment_cohort"):
        local(deployment_clients=100, deployment_cohort=10)
    with pytest.raises(ConfigError, match=r"deployment_delta=1e-05 is invalid: allowed is a delta below 1 / "):
        private(deployment_clients=10_000_000, deployment_cohort=1000, deployment_delta=1e-5)
    state = privacy.state_dict()
    del state["deployment"]  # a checkpoint saved before the deployment was asked for
    with pytest.raises(ConfigError, match="holds its deployment"):
        privacy.load_state_dict(state)


# --- issue 34: counts and guarantees ---


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of a Gaussian mechanism whose sensitivity is mu noise standard deviations
    (Balle and Wang 2018, "Improving the Gaussian mechanism", Theorem 8):
    delta(eps) = Phi(mu / 2 - eps / mu) - e^eps Phi(-mu / 2 - eps / mu), solved for eps by bisection."""
    from scipy.stats import norm

    low, high = 0.0, 200.0
    for _ in range(200):
        eps = (low + high) / 2
        if norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu) > delta:
            low = eps
        else:
            high = eps
    return high


@pytest.mark.parametrize("z,rounds", [(2.0, 10), (4.0, 30)])
def test_the_replace_one_sensitivity_is_counted_once_by_each_accountant(z, rounds):
    from fedrun.privacy import bounds, replace_one_gaussian

    # Replacing one client's clipped update moves the sum by up to 2C; the noise is z C. T rounds compose to one
    # Gaussian mechanism with mu = 2 sqrt(T) / z, whose exact epsilon is closed-form. PLD is exact up to its
    # (pessimistic) discretisation; RDP is a valid bound above it, and below the classic conversion of the
    # closed-form RDP, T * alpha (2 / z)^2 / 2 + log(1 / delta) / (alpha - 1) (Mironov 2017, Proposition 3).
    exact = exact_gaussian_epsilon(2 * math.sqrt(rounds) / z, 1e-5)
    orders = [1 + x / 10 for x in range(1, 100)] + list(range(12, 256))
    classic = min(rounds * 2 * a / z**2 + math.log(1e5) / (a - 1) for a in orders)
    pld_local, rdp_local = LocalAccountant(z, 1e-5, 3, "pld"), LocalAccountant(z, 1e-5, 3, "rdp")
    for _ in range(rounds):
        pld_local.step([1])
        rdp_local.step([1])
    assert exact <= pld_local.epsilon() <= exact * 1.01
    assert exact < rdp_local.epsilon() < classic
    # The fixed sample's fallback bound (no amplification) is that same mechanism, for either accountant: counted
    # twice (Gaussian(z / 4) under RDP) it would lie above the classic conversion, not at all (Gaussian(z)) below
    # the exact epsilon.
    for kind, low, high in (("rdp", exact, classic), ("pld", exact, exact * 1.01)):
        fallback = bounds(z, "fixed", 10, 3, None, kind)[1]
        assert fallback == replace_one_gaussian(z, kind)
        accountant = make_accountant(kind, "replace_one")
        accountant.compose(dp_accounting.SelfComposedDpEvent(fallback, rounds))
        assert low <= accountant.get_epsilon(1e-5) <= high, kind


def test_a_small_fixed_sample_s_epsilon_is_dp_accounting_s_for_the_event_built_by_hand():
    # m = 3 of N = 10 clients a round without replacement, z = 2, 10 rounds, replace-one: Wang, Balle and
    # Kasiviswanathan's Theorem 27 with the noise over the sensitivity 2C, sigma = z / 2 = 1, built here by hand.
    # It is below the un-amplified bound (Gaussian(1), 19.0536; the exact Gaussian gives 17.8566), so it is reported.
    relation = dp_accounting.NeighboringRelation.REPLACE_ONE
    by_hand = rdp.RdpAccountant(neighboring_relation=relation)
    by_hand.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(10, 3, dp_accounting.GaussianDpEvent(1.0)), 10
        )
    )
    ledger = Accountant(2.0, 1e-5, "fixed", num_clients=10, cohort=3)
    ledger.step(10)
    assert ledger.epsilon() == by_hand.get_epsilon(1e-5) == pytest.approx(11.139936972897104, rel=1e-9)
    assert ledger.epsilon() < exact_gaussian_epsilon(2 * math.sqrt(10) / 2.0, 1e-5) == pytest.approx(17.8566, rel=1e-5)


def test_the_run_says_what_its_epsilon_covers():
    privacy = private()
    privacy.bind(Context(Schedule(rounds=2, clients_per_round=0.5), np.ones(6), 0))
    covers = privacy.run_tags()["privacy_epsilon_covers"]
    for said in ("selected.csv", "alpha.csv", "cohort_size", "upload_mb", "seed", "partition=population"):
        assert said in covers, said
    assert "privacy_epsilon_covers" not in Privacy().run_tags()


# --- issue 35: the mechanism as parts of the round (a clip stage, a noise stage, a noised FedAvg) ---


def legacy_aggregate(privacy: Privacy, deltas, params, round_, clients=()):
    """The round of ``Privacy.aggregate`` as it was at a152b8f, before the mechanism became parts of the round
    (kept verbatim but for its noise streams and adaptive step written out): the reference the parts must equal
    bit for bit. It reads the bound mechanism's settings and steps its ledger as ``aggregate`` did."""
    from fedrun.aggregators import Aggregation
    from fedrun.pipeline import clip_rows, geometric_clip_step
    from fedrun.seeding import torch_generator

    def noise(n, *keys, stream="privacy"):
        return torch.randn(n, generator=torch_generator(privacy.seed, stream, *keys), dtype=torch.float64)

    finite = torch.isfinite(deltas).all(dim=1)
    deltas = torch.where(finite[:, None], deltas, torch.zeros_like(deltas))
    bound = privacy.clip_norm
    clipped, norms, over = clip_rows(deltas, bound)
    std = privacy.update_noise * bound
    diagnostics = {}
    if privacy.mechanism == "local":
        if len(deltas):
            clipped = clipped + torch.stack([std * noise(params.numel(), round_, int(i)) for i in clients]).to(clipped)
        alpha = np.full(len(deltas), 1.0 / max(len(deltas), 1))
        update = torch.as_tensor(alpha, dtype=deltas.dtype, device=deltas.device) @ clipped
        update = update if len(deltas) else torch.zeros_like(params)
        privacy.ledger.step(clients)
    else:
        alpha = np.full(len(deltas), 1.0 / privacy.denominator)
        total = torch.as_tensor(alpha, dtype=deltas.dtype, device=deltas.device) @ clipped
        total = total if len(deltas) else torch.zeros_like(params)
        update = total + (std * noise(params.numel(), round_) / privacy.denominator).to(params)
        privacy.ledger.step()
        if privacy.adaptive:
            centred = float((~over).double().sum()) - len(over) / 2
            noised = centred + privacy.count_noise * float(noise(1, round_, stream="privacy_count")[0])
            unclipped = noised / privacy.denominator + 0.5
            privacy.clip_norm = geometric_clip_step(
                privacy.clip_norm, unclipped, privacy.target_quantile, privacy.clip_lr
            )
            diagnostics["unclipped_fraction_noised"] = unclipped
        if privacy.deployment is not None:
            privacy.deployment.step()
            diagnostics["epsilon_deployment"] = privacy.deployment.epsilon()
    return Aggregation(
        update,
        alpha,
        {
            "epsilon": privacy.ledger.epsilon(),
            "clip_norm": bound,
            "clipped_fraction": float(over.double().mean()) if len(deltas) else math.nan,
            "update_norm_mean": float(norms.double().mean()) if len(deltas) else math.nan,
            "noise_std": std,
            "nonfinite_updates": float((~finite).sum()),
            **diagnostics,
        },
    )


EQUIVALENT = {
    "central_fixed": ({"noise_multiplier": 1.3, "clip_norm": 0.7}, "fixed", 0.5),
    "central_poisson": ({"noise_multiplier": 0.9, "clip_norm": 0.7}, "poisson", 0.3),
    "central_adaptive_deployment": (
        {
            "noise_multiplier": 1.1,
            "clip_norm": 0.4,
            "adaptive": True,
            "clip_count_noise": 1.0,
            "deployment_clients": 100_000,
            "deployment_cohort": 100,
            "deployment_delta": 1e-6,
        },
        "poisson",
        0.3,
    ),
    "local": ({"mechanism": "local", "noise_multiplier": 1.7, "clip_norm": 0.6}, "poisson", 0.3),
}


def equivalence_rounds(sampling, q, clients=10, d=7, rounds=6):
    """Each round's cohort and updates: norms about 0.3 to 3 around C, one non-finite update in round 2, nobody in
    round 4 (the Poisson draw that samples no one), float64 as the tiny federation trains."""
    g = torch.Generator().manual_seed(11)
    for t in range(1, rounds + 1):
        m = 0 if t == 4 and sampling == "poisson" else round(q * clients) + (t % 2 if sampling == "poisson" else 0)
        cohort = np.sort(torch.randperm(clients, generator=g)[:m].numpy())
        deltas = torch.randn(m, d, generator=g, dtype=torch.float64) * torch.rand(m, 1, generator=g) * 1.5
        if t == 2:
            deltas[0, 3] = math.nan
        yield t, cohort, deltas


def bound_twin(settings, sampling, q, clients=10, rounds=6):
    privacy = Privacy(**{"mechanism": "central", **settings})
    privacy.bind(Context(Schedule(rounds=rounds, clients_per_round=q, sampling=sampling), np.ones(clients), 5))
    return privacy


def same_numbers(mine: dict, theirs: dict) -> bool:
    """Equal dicts, NaN equal to NaN (an empty round's clip statistics)."""
    return mine.keys() == theirs.keys() and all(
        mine[k] == theirs[k] or (math.isnan(mine[k]) and math.isnan(theirs[k])) for k in mine
    )


def run_parts(privacy: Privacy, rounds, params, stages=()):
    """The rounds as an engine runs the mechanism's parts: ``attach`` once, then each round the stages, the
    aggregation on the round's view. Returns each round's (update, alpha, diagnostics of the stages and the
    aggregation) and the parts."""
    from fedrun.aggregators import RoundView
    from fedrun.pipeline import Pipeline

    aggregator, attached = privacy.attach(FedAvg(weighting="uniform"), list(stages))
    pipeline = Pipeline(attached)
    out = []
    for t, cohort, deltas in rounds:
        sent, staged = pipeline(deltas, cohort, t)
        pipeline.end_round()
        done = aggregator.aggregate(params, sent, RoundView(cohort, np.ones(len(cohort)), round=t))
        out.append((done.update, done.alpha, staged, done.diagnostics))
    return out, aggregator, attached


@pytest.mark.parametrize("case", sorted(EQUIVALENT))
def test_the_parts_give_today_s_update_alpha_and_numbers_bit_for_bit(case):
    settings, sampling, q = EQUIVALENT[case]
    mine, reference = bound_twin(settings, sampling, q), bound_twin(settings, sampling, q)
    params = torch.zeros(7, dtype=torch.float64)
    rounds = list(equivalence_rounds(sampling, q))
    got, _, _ = run_parts(mine, rounds, params)
    for (t, cohort, deltas), (update, alpha, staged, aggregated) in zip(rounds, got, strict=True):
        expected = legacy_aggregate(reference, deltas, params, t, cohort)
        assert torch.equal(update, expected.update) and np.array_equal(alpha, expected.alpha), t
        if mine.mechanism == "central":  # the clip stage logs nothing itself: the aggregation logs the round
            assert staged == {} and same_numbers(aggregated, expected.diagnostics), (aggregated, expected)
        else:  # local: the noise stage logs the mechanism's numbers; FedAvg's own (alpha_distance) are FedAvg's
            assert same_numbers(staged, expected.diagnostics), (staged, expected.diagnostics)
            assert not aggregated.keys() & expected.diagnostics.keys()
    assert mine.state_dict() == reference.state_dict()  # the ledger (and adaptive C, the deployment's) alike
    assert mine.clip_norm == reference.clip_norm


def test_attach_places_the_parts_and_leaves_a_run_without_privacy_as_it_was():
    from fedrun.compression import TopK
    from fedrun.pipeline import Clip
    from fedrun.privacy import CentralClip, CentralNoise, LocalNoise

    fedavg, clip, topk = FedAvg(weighting="uniform"), Clip(2.0), TopK(0.1)
    aggregator, stages = Privacy().attach(fedavg, [clip, topk])
    assert aggregator is fedavg and stages == [clip, topk]
    aggregator, stages = private().attach(fedavg, [clip, topk])  # the server clips and noises what was sent
    assert isinstance(aggregator, CentralNoise) and aggregator.inner is fedavg
    assert stages[:2] == [clip, topk] and isinstance(stages[2], CentralClip) and aggregator.clip is stages[2]
    assert aggregator.state_dict() == fedavg.state_dict()  # a checkpoint's aggregator entry is FedAvg's, as before
    aggregator, stages = local().attach(fedavg, [clip, topk])  # each client noises, then compresses
    assert aggregator is fedavg and stages[0] is clip and isinstance(stages[1], LocalNoise) and stages[2] is topk
    _, stages = local().attach(fedavg, [clip])  # no compressor: last
    assert stages[0] is clip and isinstance(stages[1], LocalNoise)
    for mechanism in ("central", "local"):
        with pytest.raises(ConfigError, match=rf"^aggregator\.weighting='samples' is invalid: .*privacy={mechanism}"):
            Privacy(mechanism=mechanism, noise_multiplier=1.0).attach(FedAvg(), [])


def test_local_noise_comes_before_compression_so_the_upload_is_the_compressor_s_message():
    # By design this differs from before issue 35, where the server noised the compressed update: the compressed
    # message was counted (0.006 MB) although a client adding its own noise sends a dense update (0.4 MB). Now each
    # client noises, then compresses the noised update (post-processing: the guarantee is the same): the upload is
    # the compressor's message, and it is what the server receives.
    from fedrun.compression import TopK
    from fedrun.pipeline import Pipeline, upload_message_mb

    d, topk = 1000, TopK(0.01, error_feedback=False)
    privacy = local(noise_multiplier=1.0, clip_norm=1.0)
    privacy.bind(Context(Schedule(rounds=2, clients_per_round=0.5), np.ones(8), 0))
    _, stages = privacy.attach(FedAvg(weighting="uniform"), [topk])
    assert upload_message_mb(Pipeline(stages), d, 4) == topk.message_bits(d) / 8 / 1e6  # 10 * (32 + 10) bits
    assert topk.message_bits(d) == 10 * (32 + 10)
    sent, _ = Pipeline(stages)(torch.zeros(3, d, dtype=torch.float32), np.array([1, 4, 6]), 1)
    assert (sent != 0).sum(dim=1).tolist() == [10, 10, 10]  # what arrives is sparse: the noise went in before
    # The noise stage says its message is dense: after a compressor (a pipeline built by hand) it is sent dense.
    assert upload_message_mb(Pipeline([topk, stages[0]]), d, 4) == 32 * d / 8 / 1e6
    # Central noise is the server's: the clients send the compressor's message, as before.
    central = private()
    central.bind(Context(Schedule(rounds=2, clients_per_round=0.5), np.ones(8), 0))
    _, stages = central.attach(FedAvg(weighting="uniform"), [topk])
    assert upload_message_mb(Pipeline(stages), d, 4) == topk.message_bits(d) / 8 / 1e6


def test_central_noise_refuses_updates_its_clip_stage_did_not_clip_this_round():
    from fedrun.aggregators import RoundView

    privacy = private(noise_multiplier=0.0, clip_norm=1.0)
    privacy.bind(Context(Schedule(rounds=3, clients_per_round=0.5), np.ones(8), 0))
    aggregator, stages = privacy.attach(FedAvg(weighting="uniform"), [])
    deltas, params = torch.ones(4, 2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    view = RoundView(np.arange(4), np.ones(4), round=1)
    with pytest.raises(RuntimeError, match="did not clip this round"):
        aggregator.aggregate(params, deltas, view)
    sent, _ = stages[-1](deltas, np.arange(4), 1)
    update = aggregator.aggregate(params, sent, view).update  # each row clipped to norm 1, summed, over D = 4
    torch.testing.assert_close(update, torch.full((2,), 2**-0.5, dtype=torch.float64), rtol=0, atol=1e-15)
    with pytest.raises(RuntimeError, match="did not clip this round"):  # round 2's updates, round 1's statistics
        aggregator.aggregate(params, sent, RoundView(np.arange(4), np.ones(4), round=2))


def test_an_attack_on_a_private_run_measures_its_deviation_through_the_mechanisms_own_reference():
    """Central DP's aggregation checks that its clip stage clipped this round's updates, one statistic each: the
    honest reference's copy carries the honest clients' statistics (``CentralNoise.reference``), draws the round's
    noise from the same stream and leaves the real mechanism's ledger where one round put it."""
    from fedrun.attacks import SignFlip
    from fedrun.parts import Parts

    torch.manual_seed(0)
    rows, privacy = [], private()
    schedule = Schedule(rounds=3, local_steps=2, batch_size=4, clients_per_round=1.0)
    run(
        Logistic((4,), 3).double(),
        DATA,
        CLIENTS,
        Parts(FedAvg(weighting="uniform"), privacy=privacy, attack=SignFlip(count=2)),
        functools.partial(torch.optim.SGD, lr=0.5),
        schedule,
        Device("cpu", "contiguous", "loop"),
        0,
        on_round=lambda row, per_client: rows.append(row),
    )
    assert len(rows) == 3 and all(row["attack/deviation"] > 0 for row in rows)
    assert privacy.ledger.rounds == 3  # the references' ledger steps were their copies'
