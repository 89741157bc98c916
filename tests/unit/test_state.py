"""Explicit state (fedrun/state.py): what a checkpoint holds is plain data that torch.load(weights_only=True) reads."""

import io
import math
from collections import deque

import numpy as np
import pytest
import torch

from fedrun.aggregators import FedAvg, FedSoftBetter, Hybrid
from fedrun.aggregators.base import Aggregator
from fedrun.pipeline import Clip
from fedrun.state import Stateful, decode, encode


def through_a_file(value):
    """encode, save, load with weights_only=True, decode: the checkpoint's path."""
    buffer = io.BytesIO()
    torch.save(encode(value), buffer)
    buffer.seek(0)
    return decode(torch.load(buffer, weights_only=True))


def test_every_kind_of_state_comes_back_equal_with_its_type_and_dtype():
    generator = np.random.default_rng(7)
    generator.random(3)  # advanced: its state, not its seed, must come back
    window = deque([1, 2], maxlen=4)
    state = {
        "round": 3,
        "lr": 0.1,
        "name": "x",
        "none": None,
        "tensor": torch.arange(3.0),
        "counts": np.array([1, 2], dtype=np.int64),
        "mean": np.float32(0.25),
        "rows": [{"acc": np.float64(0.5)}],
        "pair": (1, torch.ones(2)),
        "rng": generator,
        "history": {4: window},
        "big": 2**100,
    }
    back = through_a_file(state)
    assert (
        back["round"] == 3
        and back["lr"] == 0.1
        and back["name"] == "x"
        and back["none"] is None
        and back["big"] == 2**100
    )
    assert torch.equal(back["tensor"], state["tensor"])
    assert back["counts"].dtype == np.int64 and back["counts"].tolist() == [1, 2]
    assert type(back["mean"]) is np.float32 and back["mean"] == np.float32(0.25)
    assert type(back["rows"][0]["acc"]) is np.float64 and back["rows"][0]["acc"] == 0.5
    assert isinstance(back["pair"], tuple) and torch.equal(back["pair"][1], torch.ones(2))
    assert back["history"][4] == window and back["history"][4].maxlen == 4
    assert back["rng"].random(5).tolist() == generator.random(5).tolist()  # the same draws from here on


def test_an_object_in_the_state_is_refused_when_saved_naming_where_it_is():
    with pytest.raises(
        TypeError, match=r"state\['aggregator'\]\['inner'\] is a .*Aggregator, which a checkpoint cannot hold"
    ):
        encode({"aggregator": {"inner": Aggregator()}})


def test_a_hybrids_state_holds_its_phases_states_and_restores_them_into_a_fresh_hybrid():
    def hybrid():
        return Hybrid([{"aggregator": FedSoftBetter(temperature=0.2), "until_round": 2}, {"aggregator": Aggregator()}])

    first = hybrid()
    first.current, first.switched["hybrid_phase_1_from_round"] = 1, "3"
    first.phases[0][0].temperature = 0.5  # a setting: the config gives it again, the checkpoint does not hold it
    again = hybrid()
    again.load_state_dict(through_a_file(first.state_dict()))
    assert again.current == 1 and again.run_tags() == {"hybrid_phase_1_from_round": "3"}
    assert again.phases[0][0].temperature == 0.2 and again.phases[0][0] is not first.phases[0][0]


def test_a_hybrid_restores_the_state_of_a_phase_that_has_some_a_hybrid_within_it():
    def nested():
        inner = Hybrid([{"aggregator": FedAvg(), "until_round": 1}, {"aggregator": FedSoftBetter()}])
        return Hybrid([{"aggregator": inner, "until_round": 5}, {"aggregator": FedAvg()}])

    first = nested()
    first.phases[0][0].current, first.phases[0][0].switched["hybrid_phase_1_from_round"] = 1, "2"
    again = nested()
    again.load_state_dict(through_a_file(first.state_dict()))
    assert again.current == 0 and again.phases[0][0].current == 1
    assert again.phases[0][0].run_tags() == {"hybrid_phase_1_from_round": "2"}


def test_an_old_checkpoint_of_pickled_objects_is_refused_then_converted_by_fedrun_upgrade_and_resumes_the_same_state(
    tmp_path,
):
    from fedrun.async_engine import _Streams
    from fedrun.checkpoint import FILE, Checkpoint
    from fedrun.errors import ConfigError
    from fedrun.upgrade import upgrade

    def hybrid():
        return Hybrid([{"aggregator": FedSoftBetter(temperature=0.2), "until_round": 2}, {"aggregator": Aggregator()}])

    old = hybrid()
    old.current, old.phases[0][0].temperature = 1, 0.5
    # As the hybrid was then: its switches in ``tags``, the last round's numbers in ``diagnostics`` (now returned).
    del old.switched
    old.tags, old.diagnostics = {"hybrid_phase_1_from_round": "3"}, {"hybrid_phase": 1.0}
    old.phases[0][0].tags, old.phases[0][0].diagnostics = {}, {"alpha_distance": 0.5}
    streams, sampler = _Streams(3, "speed"), np.random.default_rng(1)
    streams[2].random(4)
    # What fedrun wrote before explicit state: vars() of the objects, numpy generators and objects pickled whole.
    torch.save(
        {
            "round": 4,
            "finished": False,
            "sampler": sampler,
            "speed_rng": streams,
            "aggregator": vars(old),
            "rows": [{"round": 1, "staleness_mean": np.float64(1.5)}],
            "extra": {"mlflow_run_id": "abc"},
        },
        tmp_path / FILE,
    )
    (tmp_path / "config.yaml").write_text(
        "seed: 3\nschedule:\n  _target_: fedrun.engine.Schedule\n  rounds: 4\n"
    )  # no pipeline group
    from fedrun.cli.resume import saved_config

    with pytest.raises(ConfigError, match="python -m fedrun.upgrade"):
        Checkpoint(tmp_path, resume=True).restored()
    with pytest.raises(ConfigError, match="python -m fedrun.upgrade"):
        saved_config(tmp_path, str(tmp_path))
    assert upgrade(tmp_path) and not upgrade(tmp_path)  # converted once; then it is in today's format
    config = saved_config(tmp_path, str(tmp_path))
    assert (
        config.pipeline == {"_target_": "fedrun.pipeline.Pipeline", "stages": []}
        and config.schedule._target_ == "fedrun.rounds.Schedule"
    )
    assert config.seed == 3 and config.schedule.rounds == 4
    state = Checkpoint(tmp_path, resume=True).restored()
    again, again_streams = hybrid(), _Streams(3, "speed")
    again.load_state_dict(state["aggregator"])
    again_streams.load_state_dict(state["speed_rng"])
    assert again.current == 1 and again.phases[0][0].temperature == 0.2  # settings are the config's, not the file's
    assert again.run_tags() == {"hybrid_phase_1_from_round": "3"}
    assert not hasattr(again, "diagnostics") and not hasattr(again.phases[0][0], "diagnostics")
    assert again_streams[2].random(3).tolist() == streams[2].random(3).tolist()
    assert state["sampler"].random(3).tolist() == sampler.random(3).tolist()
    assert state["extra"] == {"mlflow_run_id": "abc"} and type(state["rows"][0]["staleness_mean"]) is np.float64


def test_keys_a_checkpoint_cannot_load_are_refused_when_saved_and_a_zero_d_array_stays_zero_d():
    with pytest.raises(TypeError, match=r"state has the key np.int64\(3\) \(int64\)"):
        encode({np.int64(3): 1.0})
    with pytest.raises(TypeError, match="__ndarray__"):
        encode({"__ndarray__": 1})  # a user's dict shaped like fedrun's markers would decode as something else
    assert encode({(1, "a"): 2}) == {(1, "a"): 2}
    back = through_a_file({"x": np.array(2.5)})
    assert back["x"].shape == () and back["x"] == 2.5


def test_a_generator_entry_naming_anything_but_a_numpy_bit_generator_is_refused():
    with pytest.raises(ValueError, match="not a numpy bit generator"):
        decode({"__numpy_generator__": {"bit_generator": "seed", "state": {}}})


def test_adaptive_clipping_moves_its_max_norm_so_that_it_is_state():
    clip = Clip(max_norm=1.0, adaptive=True)
    clip(torch.tensor([[3.0, 4.0]]), np.array([0]), 1)  # norm 5 > C: clipped, b = 0
    clip.end_round()
    assert clip.state_dict()["max_norm"] == pytest.approx(math.exp(0.2 * 0.5))  # C exp(-eta (0 - 0.5))


# Parts outside the config groups that still save every attribute, awaiting their own declaration.
UNDECLARED: set[str] = set()


def test_every_stateful_class_declares_its_state_or_nests_its_parts_states():
    import fedrun.async_engine  # noqa: F401  (the classes below are found as Stateful's subclasses)
    import fedrun.compression  # noqa: F401
    import fedrun.privacy  # noqa: F401
    import fedrun.sampling  # noqa: F401
    import fedrun.servers  # noqa: F401

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    undeclared = {
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in subclasses(Stateful)
        if cls.__module__.startswith("fedrun.")
        and cls.STATE is None
        and (cls.state_dict is Stateful.state_dict or cls.load_state_dict is Stateful.load_state_dict)
    }
    assert undeclared <= UNDECLARED
