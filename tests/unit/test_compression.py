"""Compressed updates (fedrun.compression): each compressor by hand, unbiasedness, the bits of a message, and runs
through the engine."""

import functools
import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TINY_CLIENTS as CLIENTS
from conftest import TINY_DATA as DATA

from fedrun.aggregators import FedAvg
from fedrun.backends import Device
from fedrun.compression import QSGD, Sign, TopK, message_bits
from fedrun.engine import run
from fedrun.errors import ConfigError
from fedrun.models import Logistic
from fedrun.parts import Parts
from fedrun.pipeline import Clip, Pipeline
from fedrun.rounds import Schedule
from fedrun.state import decode, encode


def rows(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_topk_with_error_feedback_by_hand_over_two_rounds():
    topk = TopK(k=0.25)  # 1 of 4 coordinates
    sent, _ = topk(rows([4.0, -3.0, 2.0, 1.0]), np.array([7]), 1)
    assert sent.tolist() == [[4.0, 0.0, 0.0, 0.0]]  # what is left, e = (0, -3, 2, 1), waits for round 2
    sent, _ = topk(rows([1.0, 1.0, 1.0, 1.0]), np.array([7]), 2)
    assert sent.tolist() == [[0.0, 0.0, 3.0, 0.0]]  # 1 + e = (1, -2, 3, 2): the 3 goes
    assert topk.residuals[7].tolist() == [1.0, -2.0, 0.0, 2.0]
    plain = TopK(k=0.25, error_feedback=False)
    plain(rows([4.0, -3.0, 2.0, 1.0]), np.array([7]), 1)
    sent, _ = plain(rows([1.0, 1.0, 1.0, 3.0]), np.array([7]), 2)
    assert sent.tolist() == [[0.0, 0.0, 0.0, 3.0]] and plain.residuals == {}


def test_error_feedback_is_per_client_and_checkpointed():
    topk = TopK(k=0.5)
    topk(rows([1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]), np.array([0, 1]), 1)
    assert topk.residuals[0].tolist() == [1.0, 2.0, 0.0, 0.0] and topk.residuals[1].tolist() == [0.0, 0.0, 2.0, 1.0]
    restored = TopK(k=0.5)
    restored.load_state_dict(decode(encode(topk.state_dict())))
    one, _ = topk(rows([0.0, 0.0, 0.0, 0.0]), np.array([1]), 2)
    two, _ = restored(rows([0.0, 0.0, 0.0, 0.0]), np.array([1]), 2)
    assert one.tolist() == two.tolist() == [[0.0, 0.0, 2.0, 1.0]]


def test_sign_by_hand():
    # ||v||_1 / d = (1 + 2 + 3 + 4) / 4 = 2.5
    sent, _ = Sign(error_feedback=False)(rows([1.0, -2.0, 3.0, -4.0]), np.array([0]), 1)
    assert sent.tolist() == [[2.5, -2.5, 2.5, -2.5]]


def test_sign_sends_a_zero_as_plus_so_one_bit_a_coordinate_is_the_whole_message():
    # The vector: ||v||_1 / d = (0.35 + 0 + 0.35 + 0 + 0.35) / 5 = 0.21. Two symbols, zero as +: the decoded
    # vector is 0.21 * (+, +, -, +, +), and the message is the scale (32 bits) and 5 bits: 37 bits.
    v = rows([0.35, 0.0, -0.35, 0.0, 0.35])
    sign = Sign(error_feedback=True)
    sent, diagnostics = sign(v, np.array([3]), 1)
    torch.testing.assert_close(sent, rows([0.21, 0.21, -0.21, 0.21, 0.21]), rtol=0, atol=1e-15)
    assert set(sent[0].abs().tolist()) == {sent[0].abs().max().item()}  # one magnitude: no third symbol
    assert sign.message_bits(5) == 37 and diagnostics["sign/bits_per_coordinate"] == 37 / 5
    # The residual the client keeps: v - sent = (0.14, -0.21, -0.14, -0.21, 0.14); ||e||^2 = ||v||^2 - ||v||_1^2 / d
    torch.testing.assert_close(sign.residuals[3], rows(0.14, -0.21, -0.14, -0.21, 0.14), rtol=0, atol=1e-15)
    assert sign.residuals[3].square().sum().item() == pytest.approx(3 * 0.35**2 - 1.05**2 / 5, rel=1e-12)
    # -0.0 is a zero too: sent as +
    assert Sign(error_feedback=False)(rows([-0.0, 2.0]), np.array([0]), 1)[0].tolist() == [[1.0, 1.0]]


def test_qsgd_is_unbiased_and_lands_on_its_levels():
    qsgd, n = QSGD(levels=2), 1000
    v = torch.tensor([0.3, -0.4, 0.0, 1.2], dtype=torch.float64)  # ||v|| = sqrt(0.09 + 0.16 + 1.44) = 1.3
    # the four clients of a round draw from their own streams: n / 4 rounds give n draws of v
    draws = torch.cat([qsgd(v.expand(4, 4), np.arange(4), t)[0] for t in range(1, n // 4 + 1)])
    levels = draws / 1.3 * 2  # signed levels l in {-2, ..., 2}
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-12)
    # each coordinate is a two-point variable l / s or (l + 1) / s times ||v||: standard deviation at most
    # ||v|| / s / 2 = 0.325; the mean of n draws lies within 4 standard errors of v_j
    assert torch.all((draws.mean(dim=0) - v).abs() < 4 * 0.325 / math.sqrt(n))
    assert draws[:, 2].abs().max() == 0  # a zero stays zero
    assert not torch.equal(draws[0], draws[1])  # each client (and round) draws anew ...
    again = QSGD(levels=2)(v[None], np.array([0]), 1)[0][0]
    assert torch.equal(again, draws[0])  # ... and the same (seed, round, client) draws the same


def test_the_bits_of_each_message_by_hand():
    # dense float32: 32 d
    assert message_bits([], 100) == 3200.0
    # top-k of d = 100 at k = 0.1: 10 values of 32 bits and 10 indices of ceil(log2 100) = 7 bits: 390
    assert TopK(k=0.1).message_bits(100) == 390
    assert TopK(k=1.0).message_bits(100) == 3200.0  # keeping everything: the dense message, no indices
    # QSGD, s = 4, d = 3: the norm (32 bits) and 3 signed levels of 2 s + 1 = 9 values: 32 + 3 log2 9 = 41.5097750
    assert QSGD(levels=4).message_bits(3) == pytest.approx(41.50977500432694, rel=1e-15)
    # sign, d = 10: the scale and a bit a coordinate: 42
    assert Sign().message_bits(10) == 42
    # the last compressor's message is what travels
    assert message_bits([Clip(1.0), TopK(k=0.1), Clip(1.0)], 100) == 390


@pytest.mark.parametrize(
    "make,key",
    [
        (lambda: TopK(k=0), "k"),
        (lambda: TopK(k=True), "k=True is invalid: allowed is a fraction in"),  # a bool is not a number (k = 1)
        (lambda: QSGD(levels=0), "levels"),
    ],
)
def test_bad_settings_are_refused(make, key):
    with pytest.raises(ConfigError, match=key):
        make()


def train(stages=(), backend="loop", rows=None, rounds=4):
    torch.manual_seed(0)
    return run(
        Logistic((4,), 3).double(),
        DATA,
        CLIENTS,
        Parts(FedAvg(), pipeline=Pipeline(list(stages))),
        functools.partial(torch.optim.SGD, lr=0.5),
        Schedule(rounds=rounds, local_steps=2, batch_size=4, clients_per_round=0.5),
        Device("cpu", "contiguous", backend, workers=2),
        0,
        on_round=lambda row, per_client: rows.append(row) if rows is not None else None,
    )


def test_topk_of_everything_and_qsgd_with_a_huge_number_of_levels_equal_fedavg():
    plain = train()
    torch.testing.assert_close(train([TopK(k=1.0)]).params, plain.params, rtol=0, atol=0)
    torch.testing.assert_close(train([QSGD(levels=2**40)]).params, plain.params, rtol=0, atol=1e-9)


def test_upload_mb_counts_the_compressed_message():
    dense, compressed = [], []
    train(rows=dense)
    train([TopK(k=0.25)], rows=compressed)
    d = 4 * 3 + 3  # logistic regression: 15 parameters; float64 here, 8 bytes each
    assert [r["upload_mb"] for r in dense] == [3 * d * 8 / 1e6] * 4
    kept = math.ceil(0.25 * d)  # 4 values of 32 bits and 4 indices of ceil(log2 15) = 4 bits
    assert [r["upload_mb"] for r in compressed] == [3 * kept * (32 + 4) / 8 / 1e6] * 4
    assert [r["download_mb"] for r in compressed] == [r["download_mb"] for r in dense]


def test_compressed_runs_are_equal_on_every_backend():
    for make in (lambda: TopK(k=0.3), lambda: QSGD(levels=3), Sign):  # fresh stages: error feedback keeps state
        loop, other = train([make()]), train([make()], "processes")
        torch.testing.assert_close(other.params, loop.params, rtol=1e-10, atol=1e-10)


def test_the_megabytes_uploaded_until_a_target_are_the_r_index_s_communication_twin():
    from fedrun.metrics import summarise

    rows = pd.DataFrame(
        {
            "round": [1, 2, 3, 4],
            "round_wall_s": [1.0] * 4,
            "test_accuracy": [0.5, 0.7, 0.95, 0.96],
            "upload_mb": [2.0, 1.0, 0.5, 0.5],
        }
    )
    values, tags = summarise(rows, [0.6, 0.9, 0.99])
    # R60 = 2 after 2 + 1 = 3 MB; R90 = 3 after 3.5 MB; 4 MB in all; R99 not reached: no R99_mb
    assert (values["R60_mb"], values["R90_mb"], values["upload_mb_total"]) == (3.0, 3.5, 4.0)
    assert "R99_mb" not in values and tags["R99"] == "not_reached"
