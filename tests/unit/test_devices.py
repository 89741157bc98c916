"""Clients as devices (fedrun/devices.py): a round's virtual time by hand, the profiles file's refusals, FedScale's
capacities read without running code, and devices=none leaving a run as it was."""

import functools
import math
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TINY_CLIENTS as CLIENTS
from conftest import TINY_DATA as DATA

from fedrun.aggregators import FedAvg
from fedrun.backends import Device
from fedrun.compression import TopK
from fedrun.devices import Traced, Unmodelled, fedscale_profiles, read_fedscale, read_profiles
from fedrun.engine import run
from fedrun.errors import ConfigError
from fedrun.models import Logistic
from fedrun.parts import Parts
from fedrun.pipeline import Pipeline
from fedrun.rounds import Schedule


def profiles_file(tmp_path, rows, name="profiles.csv"):
    path = tmp_path / name
    table = pd.DataFrame(rows, columns=["client", "speed", "up", "down"])
    table.to_parquet(path) if name.endswith(".parquet") else table.to_csv(path, index=False)
    return str(path)


def three(tmp_path, **server):
    # client 0: 0.01 s a pass, up 1 MB/s, down 2 MB/s; client 1: 0.002 s, 0.5, 4; client 2: 0.02 s, 10, 10
    path = profiles_file(tmp_path, [(2, 0.02, 10, 10), (0, 0.01, 1, 2), (1, 0.002, 0.5, 4)])  # any row order
    devices = Traced(path, **server)
    devices.bind(SimpleNamespace(sizes=np.array([30, 50, 20])))
    return devices


# 1.5 MB down, 0.25 MB up; passes 30, 100, 40:
# 0: 1.5/2 + 30 * 0.01 + 0.25/1 = 0.75 + 0.3 + 0.25 = 1.3
# 1: 1.5/4 + 100 * 0.002 + 0.25/0.5 = 0.375 + 0.2 + 0.5 = 1.075
# 2: 1.5/10 + 40 * 0.02 + 0.25/10 = 0.15 + 0.8 + 0.025 = 0.975
ROUND = (np.array([0, 1, 2]), [30, 100, 40], 1.5, 0.25)


def test_a_three_client_rounds_time_by_hand(tmp_path):
    devices = three(tmp_path)
    np.testing.assert_allclose(devices.times(*ROUND), [1.3, 1.075, 0.975], rtol=1e-12)
    assert devices.round(*ROUND).all()  # no deadline: every client reports, the round waits for the slowest
    assert devices.columns() == pytest.approx({"round_virtual_s": 1.3, "virtual_time": 1.3})
    assert devices.round(np.array([2, 1]), [40, 100], 1.5, 0.25).all()  # client 0 not drawn: client 1's 1.075
    assert devices.columns() == pytest.approx({"round_virtual_s": 1.075, "virtual_time": 2.375})
    assert not len(devices.round(np.array([], dtype=int), [], 1.5, 0.25))  # a round that drew nobody: no time
    assert devices.columns() == {"round_virtual_s": 0.0, "virtual_time": 2.375}
    resumed = Traced(devices.path)  # the clock is the checkpoint's
    resumed.load_state_dict(devices.state_dict())
    resumed.bind(SimpleNamespace(sizes=np.array([30, 50, 20])))
    resumed.round(np.array([1]), [100], 1.5, 0.25)
    assert resumed.columns()["virtual_time"] == pytest.approx(3.45)
    with pytest.raises(ValueError, match="devices clock"):
        resumed.load_state_dict({"clock": -1.0})


def test_power_of_choices_probe_comes_first_and_its_cohort_does_not_download_again_by_hand(tmp_path):
    devices = three(tmp_path)
    # every client a candidate (30, 50 and 20 samples): the model down, one forward pass (a third of a training
    # pass), a float32 loss up:
    # 0: 1.5/2 + 30 * 0.01 / 3 + 4e-6/1 = 0.850004; 1: 1.5/4 + 50 * 0.002 / 3 + 4e-6/0.5 = 0.408341...;
    # 2: 1.5/10 + 20 * 0.02 / 3 + 4e-6/10 = 0.283333...: the probe lasts 0.850004
    probe = (np.array([0, 1, 2]), np.array([30, 50, 20]), 1.5, 4e-6)
    assert devices.probing(probe) == pytest.approx(0.850004, rel=1e-12)
    # then clients 1 and 2 train, holding the model already: 100 * 0.002 + 0.25/0.5 = 0.7, 40 * 0.02 + 0.25/10 = 0.825
    assert devices.round(np.array([1, 2]), [100, 40], 0.0, 0.25, probe).all()  # nothing more to download
    assert devices.columns() == pytest.approx(
        {"round_virtual_s": 0.850004 + 0.825, "virtual_time": 0.850004 + 0.825, "probe_virtual_s": 0.850004}
    )


def test_a_deadline_the_first_reports_and_a_failed_round_by_hand(tmp_path):
    # Times 1.3, 1.075, 0.975 (above). A deadline of 1.2 s drops client 0; the round lasts until the deadline.
    late = three(tmp_path, deadline=1.2)
    assert late.round(*ROUND).tolist() == [False, True, True]
    assert late.columns() == pytest.approx(
        {"round_virtual_s": 1.2, "virtual_time": 1.2, "devices_dropped": 1, "round_failed": 0.0}
    )
    # Over-selection: 3 drawn, the first 2 reports kept (clients 2 then 1): the round ends at the second, 1.075 s.
    first = three(tmp_path, reports=2)
    assert first.round(*ROUND).tolist() == [False, True, True]
    assert first.columns()["round_virtual_s"] == pytest.approx(1.075) and first.columns()["devices_dropped"] == 1
    # A deadline every client meets: no one dropped, the round waits for the slowest (1.3), not for the deadline.
    met = three(tmp_path, deadline=5.0)
    assert met.round(*ROUND).all() and met.columns()["round_virtual_s"] == pytest.approx(1.3)
    # Too few in time: 1 report by 1.0 s (client 2's 0.975) against min_reports 2: the round fails at the deadline.
    failed = three(tmp_path, deadline=1.0, min_reports=2)
    assert not failed.round(*ROUND).any()
    assert failed.columns() == pytest.approx(
        {"round_virtual_s": 1.0, "virtual_time": 1.0, "devices_dropped": 3, "round_failed": 1.0}
    )
    # Reports and a deadline together: 2 wanted, only client 2 in time by 1.0: it reports, the round ends at 1.0.
    both = three(tmp_path, deadline=1.0, reports=2)
    assert both.round(*ROUND).tolist() == [False, False, True] and both.columns()["round_virtual_s"] == 1.0
    # Equal times keep the cohort's order: with two of the same profile, the first drawn reports.
    tie = three(tmp_path, reports=1)
    assert tie.round(np.array([1, 1]), [100, 100], 1.5, 0.25).tolist() == [True, False]
    for bad, match in (
        (dict(deadline=0), r"deadline=0 is invalid: allowed is null or virtual seconds > 0"),
        (dict(reports=0), r"reports=0 is invalid"),
        (dict(reports=2, min_reports=3), r"min_reports=3 is invalid: allowed is at most reports=2"),
    ):
        with pytest.raises(ConfigError, match=match):
            three(tmp_path, **bad)


@pytest.mark.parametrize(
    "rows, match",
    [
        ([(0, 0.01, 1, 2), (1, 0.0, 1, 2)], r"row 3 speed=0\.0 is invalid: allowed is a finite number > 0"),
        ([(0, 0.01, 1, 2), (1, 0.01, float("inf"), 2)], r"row 3 up=inf is invalid"),
        ([(0, 0.01, 1, 2), (0, 0.01, 1, 2)], r"client=\[0\] is invalid: allowed is each id once"),
        ([(0, 0.01, 1, 2), (2, 0.01, 1, 2)], r"a row for each of the run's 2 clients, ids 0 to 1"),
        ([(0, 0.01, 1, 2)], r"a row for each of the run's 2 clients"),
        ([(0.5, 0.01, 1, 2), (1, 0.01, 1, 2)], r"integer client ids"),
        ([(-1, 0.01, 1, 2), (0, 0.01, 1, 2)], r"row 2 client=-1 is invalid: allowed is an integer client id >= 0"),
    ],
)
def test_a_bad_profiles_file_is_refused_in_one_line(tmp_path, rows, match):
    with pytest.raises(ConfigError, match=match):
        read_profiles(Path(profiles_file(tmp_path, rows)), 2)


def test_a_profiles_file_that_is_not_one_is_refused_in_one_line(tmp_path):
    (tmp_path / "cols.csv").write_text("client,speed\n0,1\n")
    with pytest.raises(ConfigError, match=r"columns client, speed, up, down \(missing: up, down\)"):
        read_profiles(tmp_path / "cols.csv", 1)
    (tmp_path / "text.csv").write_text("client,speed,up,down\n0,fast,1,1\n")
    with pytest.raises(ConfigError, match=r"row 2 speed='fast' is invalid"):
        read_profiles(tmp_path / "text.csv", 1)
    with pytest.raises(ConfigError, match="none there"):
        read_profiles(tmp_path / "missing.csv", 1)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="a CSV or Parquet file pandas reads"):
        read_profiles(tmp_path / "bad.parquet", 1)
    parquet = Path(profiles_file(tmp_path, [(1, 0.2, 3, 4), (0, 0.1, 1, 2), (2, 9, 9, 9)], "p.parquet"))
    speed, up, down = read_profiles(parquet, 2)  # ids in order; the extra client 2 unused
    assert speed.tolist() == [0.1, 0.2] and up.tolist() == [1, 3] and down.tolist() == [2, 4]


def test_fedscale_capacities_are_read_without_running_code_and_converted(tmp_path):
    good = tmp_path / "capacity"
    good.write_bytes(
        pickle.dumps({7: {"computation": 50.0, "communication": 8000}, 3: {"computation": 10, "communication": 800.0}})
    )
    table = fedscale_profiles(read_fedscale(good))
    # FedScale's completion time: 3 x ms-per-sample inference / 1000 per training sample; kbps / 8000 = MB/s
    assert table["client"].tolist() == [0, 1] and table["fedscale_id"].tolist() == ["3", "7"]
    assert table["speed"].tolist() == pytest.approx([0.03, 0.15]) and table["up"].tolist() == pytest.approx([0.1, 1.0])
    assert (table["up"] == table["down"]).all()

    class Payload:
        def __reduce__(self):
            return (print, ("a trace ran code",))

    evil = tmp_path / "evil"
    evil.write_bytes(pickle.dumps({0: Payload()}))
    with pytest.raises(ConfigError, match=r"a trace names builtins\.print: only dicts, lists"):
        read_fedscale(evil)
    odd = tmp_path / "odd"
    odd.write_bytes(pickle.dumps({0: {"computation": "fast", "communication": 1}}))
    with pytest.raises(ConfigError, match=r"client 0=.* allowed is \{computation: ms, communication: kbps\}"):
        read_fedscale(odd)
    (tmp_path / "cut").write_bytes(pickle.dumps({0: 1})[:5])
    with pytest.raises(ConfigError, match="a pickle of plain dicts and numbers"):
        read_fedscale(tmp_path / "cut")


def untimed(row: dict) -> dict:
    """A row without its wall-clock columns (they differ between any two runs) nor the cohort (an array)."""
    return {k: v for k, v in row.items() if not k.endswith("_wall_s") and k != "cohort"}


def train(devices=None, rows=None, stages=(), backend="loop", sampler=None):
    torch.manual_seed(0)
    return run(
        Logistic((4,), 3).double(),
        DATA,
        CLIENTS,
        Parts(FedAvg(), pipeline=Pipeline(list(stages)), devices=devices, sampler=sampler),
        functools.partial(torch.optim.SGD, lr=0.5),
        Schedule(rounds=3, local_steps=2, batch_size=4, clients_per_round=0.5),
        Device("cpu", "contiguous", backend, workers=2),
        0,
        on_round=lambda row, per_client: (
            rows.append({**row, "cohort": np.flatnonzero(per_client["selected"])}) if rows is not None else None
        ),
    )


def test_devices_add_their_clock_and_change_nothing_else(tmp_path):
    plain, none, traced = [], [], []
    first = train(rows=plain)
    assert torch.equal(train(Unmodelled(), rows=none).params, first.params)  # devices=none: the run as it was
    assert [untimed(r) for r in none] == [untimed(r) for r in plain]
    path = profiles_file(tmp_path, [(c, 0.01 * (c + 1), 1.0, 2.0) for c in range(6)])
    assert torch.equal(train(Traced(path), rows=traced).params, first.params)  # the same model, the same rows
    for before, after in zip(plain, traced):
        assert {k: v for k, v in untimed(after).items() if k not in ("round_virtual_s", "virtual_time")} == untimed(
            before
        )
    # 3 of 6 clients a round, 2 steps of 4 samples each: 8 passes; 15 float64 parameters = 120 bytes each way;
    # client c computes at 0.01 (c + 1) s a pass, uploads at 1 MB/s, downloads at 2: the slowest of the cohort.
    mb, clock = 15 * 8 / 1e6, 0.0
    for row in traced:
        assert len(row["cohort"]) == 3
        assert row["round_virtual_s"] == pytest.approx(
            max(mb / 2.0 + 8 * 0.01 * (c + 1) + mb / 1.0 for c in row["cohort"])
        )
        clock += row["round_virtual_s"]
        assert row["virtual_time"] == pytest.approx(clock)
    # A deadline between client 2's time and client 3's: the drawn clients 3-5 drop, the round lasts until it.
    late, deadline = [], mb / 2 + 8 * 0.035 + mb
    train(Traced(path, deadline=deadline), rows=late)
    for row in late:  # "cohort" here is who was drawn (per_client["selected"]), before the late ones dropped
        assert row["cohort_size"] == (row["cohort"] <= 2).sum() and row["devices_dropped"] == (row["cohort"] > 2).sum()
        assert row["round_virtual_s"] == pytest.approx(
            deadline if (row["cohort"] > 2).any() else max(mb / 2.0 + 8 * 0.01 * (c + 1) + mb for c in row["cohort"])
        )
    assert sum(r["devices_dropped"] for r in late) > 0 and not any(r["round_failed"] for r in late)
    compressed = []
    train(Traced(path), rows=compressed, stages=[TopK(k=0.25)])  # the compressed message is what goes up
    assert all(c["round_virtual_s"] < t["round_virtual_s"] for c, t in zip(compressed, traced))


def test_a_run_with_power_of_choice_times_its_probe_before_its_cohort(tmp_path):
    from fedrun.sampling import PowerOfChoice

    path = profiles_file(tmp_path, [(c, 0.01 * (c + 1), 1.0, 2.0) for c in range(6)])
    rows, plain = [], []
    probed = train(Traced(path), rows=rows, sampler=PowerOfChoice(candidates=6))
    assert torch.equal(probed.params, train(rows=plain, sampler=PowerOfChoice(candidates=6)).params)  # clock only
    # every client a candidate: the model down (15 float64 parameters, 120 bytes, at 2 MB/s), its samples forward
    # at a third of 0.01 (c + 1) s a pass, a 4-byte loss up at 1 MB/s; then the 3 kept train 8 passes and upload
    mb, sizes = 15 * 8 / 1e6, [len(part) for part in CLIENTS]
    probe = max(mb / 2.0 + sizes[c] * 0.01 * (c + 1) / 3 + 4e-6 / 1.0 for c in range(6))
    for row in rows:
        assert row["probe_virtual_s"] == pytest.approx(probe, rel=1e-12)
        trained = max(8 * 0.01 * (c + 1) + mb / 1.0 for c in row["cohort"])  # no second download
        assert row["round_virtual_s"] == pytest.approx(probe + trained, rel=1e-12)


def test_availability_windows_by_hand(tmp_path):
    from fedrun.devices import Windows

    path = tmp_path / "windows.csv"
    # client 0: [0, 10) and [20, 30); client 1: [5, 25); client 2: no window (always online); client 3: [40, 50)
    path.write_text("client,start,end\n0,0,10\n1,5,25\n0,20,30\n3,40,50\n")
    windows = Windows.read(path, None)
    assert windows.online(0, 4).tolist() == [True, False, True, False]
    assert windows.online(5, 4).tolist() == [True, True, True, False]  # a window's start is in it
    assert windows.online(10, 4).tolist() == [False, True, True, False]  # its end is not
    assert windows.online(45, 4).tolist() == [False, False, True, True]
    assert windows.next_opening(10) == 20 and windows.next_opening(45) == 45  # none opens after 40: no wait
    daily = Windows.read(path, 50.0)  # every 50 s: at 62 it is 12
    assert daily.online(62, 4).tolist() == [False, True, True, False]
    assert daily.next_opening(62) == 70 and daily.next_opening(95) == 100  # the next period's first window (0)
    for text, match in (
        ("client,start,end\n0,5,5\n", r"row 2=.* allowed is a client id >= 0 and 0 <= start < end"),
        ("client,start,end\n-1,0,5\n", r"row 2="),
        ("client,start\n0,0\n", r"columns client, start, end \(missing: end\)"),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError, match=match):
            Windows.read(path, None)
    path.write_text("client,start,end\n0,0,60\n")
    with pytest.raises(ConfigError, match=r"0 <= start < end <= its period"):
        Windows.read(path, 50.0)
    # each window its own period (FedScale's traces repeat per client): client 0 every 10 s, client 1 never
    path.write_text("client,start,end,period\n0,2,4,10\n1,30,40,\n")
    own = Windows.read(path, None)
    assert own.online(13, 2).tolist() == [True, False] and own.online(35, 2).tolist() == [False, True]
    assert own.next_opening(5) == 12 and own.next_opening(44) == 52  # client 1's window never opens again


def test_a_round_draws_among_the_clients_online_and_waits_when_none_is(tmp_path):
    from fedrun.rounds import Schedule

    rng = np.random.default_rng(0)
    available = np.array([False, True, True, False, True, False])
    fixed = Schedule(clients_per_round=0.5)  # 3 of 6
    for _ in range(20):
        cohort = fixed.draw(rng, 6, available)
        assert len(cohort) == 3 and available[cohort].all()
    assert len(fixed.draw(rng, 6, np.array([True, False, False, False, False, True]))) == 2  # fewer online: all
    # Poisson flips every client's coin as without availability (the same stream), then keeps the online ones.
    poisson = Schedule(sampling="poisson", clients_per_round=0.5)
    plain = poisson.draw(np.random.default_rng(1), 6)
    assert poisson.draw(np.random.default_rng(1), 6, available).tolist() == [c for c in plain if available[c]]
    # Nobody online at the round's start: it starts when the first window opens and counts the wait.
    (tmp_path / "w.csv").write_text("client,start,end\n0,3,4\n1,3,4\n2,10,20\n")
    devices = Traced(
        profiles_file(tmp_path, [(0, 0.01, 1, 1), (1, 0.01, 1, 1), (2, 0.01, 1, 1)]),
        availability=str(tmp_path / "w.csv"),
    )
    devices.bind(SimpleNamespace(sizes=np.array([10, 10, 10])))
    assert devices.available().tolist() == [True, True, False] and devices.clock == 3.0  # waited 3 s for 0 and 1
    kept = devices.round(np.array([0, 1]), [10, 10], 0.5, 0.5)  # 0.5 + 0.1 + 0.5 = 1.1 s each
    # both reports would arrive at 4.1, after their window closed at 4: lost, so the round failed; without a deadline
    # it lasted as long as its slowest drawn client
    assert not kept.any()
    assert devices.columns() == pytest.approx(
        {
            "round_virtual_s": 4.1,
            "virtual_time": 4.1,
            "devices_online": 2 / 3,
            "devices_lost": 2,
            "devices_dropped": 2,
            "round_failed": 1.0,
        }
    )
    assert devices.available().tolist() == [False, False, True] and devices.clock == 10.0  # client 2's window
    devices.round(np.array([2]), [10], 0.5, 0.5)
    assert devices.columns()["round_virtual_s"] == pytest.approx(5.9 + 1.1)  # 4.1 -> 10 waiting, then 1.1
    devices.clock = 25.0  # past every window: nobody is online again, no wait, an empty round
    assert not devices.available().any() and devices.clock == 25.0


def test_a_client_offline_when_its_report_would_arrive_is_lost_by_hand(tmp_path):
    # FedScale's rule (Aggregator.tictak_client_tasks): lost when not active at the virtual clock + its time.
    # Client 0 online in [0, 2), client 1 in [0, 10), client 2 always; times 1.1, 2.1 and 3.1 s from clock 0.5.
    (tmp_path / "w.csv").write_text("client,start,end\n0,0,2\n1,0,10\n")
    profiles = profiles_file(tmp_path, [(0, 0.01, 1, 1), (1, 0.11, 1, 1), (2, 0.21, 1, 1)])

    def round_(**server):
        devices = Traced(profiles, availability=str(tmp_path / "w.csv"), **server)
        devices.bind(SimpleNamespace(sizes=np.array([10, 10, 10])))
        devices.clock = 0.5
        devices.available()
        kept = devices.round(np.array([0, 1, 2]), [10, 10, 10], 0.5, 0.5)  # 1 s of messages + 10 passes x speed
        return kept.tolist(), devices.columns()

    # client 0 would arrive at 1.6, inside [0, 2): it reports; nobody is lost
    kept, columns = round_()
    assert kept == [True, True, True] and columns["devices_lost"] == 0 and columns["round_virtual_s"] == 3.1
    profiles = profiles_file(tmp_path, [(0, 0.2, 1, 1), (1, 0.11, 1, 1), (2, 0.21, 1, 1)])  # client 0: 3 s, at 3.5
    kept, columns = round_()
    assert kept == [False, True, True]  # its window closed at 2: lost
    assert columns["devices_lost"] == 1 and columns["devices_dropped"] == 1 and columns["round_failed"] == 0
    assert columns["round_virtual_s"] == pytest.approx(3.1)  # not waited for: the slowest report
    kept, columns = round_(deadline=5.0)
    assert kept == [False, True, True] and columns["round_virtual_s"] == 5.0  # with a deadline, waited for until it
    kept, columns = round_(reports=1)
    assert kept == [False, True, False] and columns["round_virtual_s"] == pytest.approx(2.1)  # the first report kept
    kept, columns = round_(reports=2, min_reports=2, deadline=2.5)  # client 2 too late, client 0 lost: 1 of 2
    assert kept == [False, False, False] and columns["round_failed"] == 1 and columns["round_virtual_s"] == 2.5
    # a round that fails from its losses alone, without a deadline: it lasts as long as its slowest client not lost
    # (client 2's 3.1 s; client 0's 3 s never arrive), not waiting for the lost one
    profiles = profiles_file(tmp_path, [(0, 0.5, 1, 1), (1, 0.11, 1, 1), (2, 0.21, 1, 1)])  # client 0: 6 s, at 6.5
    kept, columns = round_(min_reports=3)
    assert kept == [False, False, False] and columns["round_failed"] == 1 and columns["devices_lost"] == 1
    assert columns["round_virtual_s"] == pytest.approx(3.1)


def test_generated_speeds_follow_fedscales_lognormal_from_the_seed():
    from fedrun.devices import Generated

    def speeds(seed, n=20000):
        devices = Generated(up=1.0, down=5.0)
        devices.bind(SimpleNamespace(sizes=np.ones(n), seed=seed))
        return devices

    drawn = speeds(0)
    # 0.005 x LogNormal(1, 0.6): median 0.005 e = 0.01359, mean 0.005 e^(1 + 0.18) = 0.01627
    assert np.median(drawn.speed) == pytest.approx(0.005 * math.e, rel=0.02)
    assert drawn.speed.mean() == pytest.approx(0.005 * math.exp(1.18), rel=0.02)
    assert (drawn.up == 1.0).all() and (drawn.down == 5.0).all()
    assert np.array_equal(speeds(0).speed, drawn.speed) and not np.array_equal(speeds(1).speed, drawn.speed)
    assert np.array_equal(speeds(0, 10).speed, drawn.speed[:10])  # a client's speed does not depend on the population
    for bad, match in ((dict(up=0, down=1), "up=0 is invalid"), (dict(up=1, down=1, sigma=-1), "sigma=-1")):
        with pytest.raises(ConfigError, match=match):
            Generated(**bad)


def test_a_sampler_of_ones_own_is_not_handed_availability_it_would_ignore(tmp_path):
    from fedrun import compat
    from fedrun.sampling import Uniform

    class Mine(Uniform):  # a draw of its own (the extend-sampler guide's shape): it knows nothing of availability
        def _draw(self, rng, probe):
            return super()._draw(rng, probe)

    (tmp_path / "w.csv").write_text("client,start,end\n0,0,5\n")
    devices = Traced(profiles_file(tmp_path, [(0, 0.01, 1, 1)]), availability=str(tmp_path / "w.csv"))
    assert Uniform().draws_available and not Mine().draws_available
    with pytest.raises(ConfigError, match=r"devices.availability=.* allowed is null with sampler=uniform"):
        compat.check({"sampler": Mine(), "devices": devices})
    compat.check({"sampler": Uniform(), "devices": devices})


def test_fedscales_behaviour_traces_become_windows_repeating_over_each_clients_finish_time(tmp_path):
    from fedrun.devices import Windows, fedscale_windows, read_fedscale_behaviour

    trace = {
        7: {"active": [0, 50], "inactive": [20, 120], "finish_time": 100, "model": "Pixel 2"},  # 50-120 cut at 100
        3: {"active": [10], "inactive": [30], "finish_time": 60},
    }
    (tmp_path / "behave").write_bytes(pickle.dumps(trace))
    windows = fedscale_windows(read_fedscale_behaviour(tmp_path / "behave"), [3, 5, 7])  # client 5: no trace
    assert windows.values.tolist() == [[0, 10, 30, 60], [2, 0, 20, 100], [2, 50, 100, 100]]
    windows.to_csv(tmp_path / "w.csv", index=False)
    read = Windows.read(tmp_path / "w.csv", None)
    assert read.online(75, 3).tolist() == [True, True, True]  # 75 mod 60 = 15: in 10-30; 5 always; 75 in 50-100
    assert read.online(125, 3).tolist() == [False, True, False]  # 125 mod 60 = 5; 125 mod 100 = 25: in neither
    assert read.online(160, 3).tolist() == [False, True, True]  # 160 mod 60 = 40: out; 160 mod 100 = 60: in 50-100
    (tmp_path / "bad").write_bytes(pickle.dumps({1: {"active": [0, 5], "inactive": [3], "finish_time": 9}}))
    with pytest.raises(ConfigError, match=r"client 1=.* as many, finish_time"):
        read_fedscale_behaviour(tmp_path / "bad")


def test_a_deadline_drops_the_same_clients_and_gives_the_same_numbers_on_worker_processes(tmp_path):
    path = profiles_file(tmp_path, [(c, 0.01 * (c + 1), 1.0, 2.0) for c in range(6)])
    deadline = 15 * 8 / 1e6 * 1.5 + 8 * 0.035  # clients 0-2 in time, 3-5 late (as above)
    loop, forked = [], []
    first = train(Traced(path, deadline=deadline), rows=loop)
    again = train(Traced(path, deadline=deadline), rows=forked, backend="processes")
    torch.testing.assert_close(again.params, first.params, rtol=1e-12, atol=1e-14)  # the loop's, to float noise
    for a, b in zip(loop, forked):
        assert a["cohort"].tolist() == b["cohort"].tolist() and a["devices_dropped"] == b["devices_dropped"]
        assert a["virtual_time"] == b["virtual_time"] and a["cohort_size"] == b["cohort_size"]
    assert sum(r["devices_dropped"] for r in loop) > 0


def slotted(mode="homogeneous", beta=0.1, slot=10.0, diurnal=False, n=6, seed=0):
    from fedrun.devices import Slotted

    windows = Slotted(mode, beta, slot, diurnal)
    windows.bind(seed, n)
    return windows


def test_generated_availability_rates_are_flgos_homogeneous_and_lognormal_from_the_seed():
    assert slotted(beta=0.2, n=10).rates.tolist() == [0.8] * 10  # FLGo's HOMO: 1 - beta
    # FLGo's LN: c_i ~ LogNormal(0, -ln(1 - beta)), p_i = c_i / max c: the largest rate is 1, the log-rates' spread
    # is sigma = -ln(0.9) = 0.10536
    rates = slotted("lognormal", beta=0.1, n=50000).rates
    assert rates.max() == 1.0 and (rates > 0).all()
    assert np.log(rates).std() == pytest.approx(-math.log(0.9), rel=0.02)
    assert np.array_equal(slotted("lognormal", n=50).rates, slotted("lognormal", n=50).rates)
    assert not np.array_equal(slotted("lognormal", n=50, seed=1).rates, slotted("lognormal", n=50).rates)


def test_generated_availability_is_a_fresh_coin_per_client_and_slot_at_the_rate_and_the_daily_wave():
    windows = slotted(beta=0.3, n=20000)
    at = [windows.online(10.0 * k + 3.0, 20000) for k in range(4)]
    assert [m.mean() for m in at] == pytest.approx([0.7] * 4, abs=0.015)  # p = 0.7 in every slot
    assert (at[0] & at[1]).mean() == pytest.approx(0.49, abs=0.015)  # independent from slot to slot
    assert np.array_equal(windows.online(0.0, 20000), windows.online(9.999, 20000))  # a whole slot, [0, 10)
    one = windows.online_at(np.zeros(5000, dtype=np.int64), 10.0 * np.arange(5000))  # client 0 over 5,000 slots
    assert one.mean() == pytest.approx(0.7, abs=0.02)
    assert np.array_equal(windows.online_at(np.arange(100), np.full(100, 25.0)), at[2][:100])
    # the wave f(k) = 0.4 sin(2 pi k / 24) + 0.5: 0.5 at slot 0, 0.9 at 6, 0.5 at 12, 0.1 at 18, 0.9 again at 30
    wave = slotted(diurnal=True).wave(np.array([0, 6, 12, 18, 30]))
    assert wave == pytest.approx([0.5, 0.9, 0.5, 0.1, 0.9])
    daily = slotted(beta=0.0, diurnal=True, n=20000)
    assert daily.online(6 * 10.0, 20000).mean() == pytest.approx(0.9, abs=0.015)
    assert daily.online(18 * 10.0, 20000).mean() == pytest.approx(0.1, abs=0.015)
    assert slotted(beta=0.0, n=100).online(123.0, 100).all()  # beta 0 without the wave: always online
    # the same (seed, client, slot), the same coin; another seed, others
    assert np.array_equal(slotted(beta=0.3, n=20000).online(13.0, 20000), at[1])
    assert not np.array_equal(slotted(beta=0.3, n=20000, seed=1).online(13.0, 20000), at[1])


def test_generated_availability_finds_the_next_slot_a_client_or_anyone_is_online():
    windows = slotted(beta=0.8, n=3)  # p = 0.2: offline in most slots
    for client in range(3):
        for t in (0.0, 37.5, 1234.0):
            found = windows.next_online(client, t)
            if windows.online_at(np.array([client]), np.array([t]))[0]:
                assert found == t  # online now: at once
            else:  # the start of its first slot online, and offline in every slot between
                assert found > t and found % 10.0 == 0 and windows.online_at(np.array([client]), np.array([found]))[0]
                between = np.arange(t // 10 + 1, found // 10) * 10.0
                assert not windows.online_at(np.full(len(between), client), between).any()
    t = next(float(s) for s in np.arange(0, 1000, 10.0) if not windows.online(s, 3).any())  # a slot with nobody
    opens = windows.next_opening(t)
    assert opens > t and windows.online(opens, 3).any()
    assert not any(windows.online(s, 3).any() for s in np.arange(t + 10.0, opens, 10.0))


def test_a_slot_start_is_in_its_slot_whatever_the_slots_rounding():
    # 35 * 0.1 = 3.5000000000000004 is in slot 35, but about half the products k * 0.1 round down into slot k - 1:
    # the next time online must be in the slot found, or a run waits for nobody forever (the review's case)
    windows = slotted(beta=0.8, slot=0.1, n=3)
    assert all(windows._slot(windows.start(k)) == k for k in range(100000))
    for t in np.arange(300) * 0.1 + 0.05:
        assert windows.online(windows.next_opening(t), 3).any()
        for client in range(3):
            assert windows.online_at(np.array([client]), np.array([windows.next_online(client, t)]))[0]
    rare = slotted("lognormal", beta=0.9, n=1000)  # rates down to about 1e-6: found by the scan all the same
    client = int(np.argmin(rare.rates))
    found = rare.next_online(client, 0.0)
    assert found > 0 and rare.online_at(np.array([client]), np.array([found]))[0]


def test_a_run_with_generated_availability_draws_among_the_clients_online_at_each_round_start():
    from fedrun.devices import Generated

    rows = []
    devices = Generated(up=1.0, down=2.0, availability="homogeneous", beta=0.5, slot=0.05)
    train(devices, rows=rows)
    # an independent Slotted of the same seed (the run's: 0) says who was online when each round started
    windows, start = slotted(beta=0.5, slot=0.05), 0.0
    for row in rows:
        online = windows.online(start, 6)
        if not online.any():
            start = windows.next_opening(start)
            online = windows.online(start, 6)
        assert online[row["cohort"]].all() and row["devices_online"] == online.mean()
        start = row["virtual_time"]
    assert len(rows) == 3 and min(r["devices_online"] for r in rows) < 1


def test_generated_availability_is_refused_where_windows_are_and_bad_values_in_one_line():
    from fedrun import compat
    from fedrun.devices import Generated
    from fedrun.sampling import Uniform

    class Mine(Uniform):  # a draw of its own: it knows nothing of availability
        def _draw(self, rng, probe):
            return super()._draw(rng, probe)

    devices = Generated(up=1.0, down=1.0, availability="lognormal", diurnal=True)
    with pytest.raises(
        ConfigError, match="devices.availability='lognormal' is invalid: allowed is null with sampler=uniform"
    ):
        compat.check({"sampler": Mine(), "devices": devices})
    for bad, match in (
        (dict(availability="diurnal"), "availability='diurnal' is invalid: allowed is null, homogeneous or lognormal"),
        (dict(availability="lognormal", beta=1.0), "beta=1.0 is invalid: allowed is a number in"),
        (dict(availability="homogeneous", slot=0), "slot=0 is invalid"),
        (dict(availability="homogeneous", diurnal="yes"), "diurnal='yes' is invalid"),
        (dict(diurnal=True), "diurnal=True is invalid: allowed is false without devices.availability"),
    ):
        with pytest.raises(ConfigError, match=match):
            Generated(up=1.0, down=1.0, **bad)
