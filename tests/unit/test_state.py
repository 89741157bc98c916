"""Explicit state (fedrun/state.py): what a checkpoint holds is plain data that torch.load(weights_only=True) reads."""

import inspect
import io
import math
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate

import fedrun.conf
from fedrun.aggregators import FedAvg, FedSoftBetter, Hybrid
from fedrun.aggregators.base import Aggregator
from fedrun.aggregators.buffered import AsyncAggregator
from fedrun.pipeline import Clip, Pipeline
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


# Every part a config group builds, nested parts included (a pipeline's stages, a hybrid's phases).
STATEFUL_GROUPS = ("aggregator", "server", "pipeline", "compression", "sampler")
CONF = Path(fedrun.conf.__file__).parent
PART_OPTIONS = [(group, f.stem) for group in STATEFUL_GROUPS for f in sorted((CONF / group).glob("*.yaml"))]
# Constructor settings that a run moves, so that they are state as well: adaptive clipping's C.
SETTINGS_A_RUN_MOVES = {"max_norm"}


def parts_of(part):
    """The part and the parts it holds, depth first."""
    yield part
    for stage in getattr(part, "stages", ()):
        yield from parts_of(stage)
    for aggregator, _, _ in getattr(part, "phases", ()):
        yield from parts_of(aggregator)
    if hasattr(part, "rule"):  # a robust rule over the asynchronous buffer
        yield from parts_of(part.rule)


def old_checkpoint_state(part):
    """What a checkpoint written before explicit state holds for ``part``: every attribute, settings included (and an
    aggregator's last ``diagnostics``), with the nested parts' states where their holder nested them."""
    if isinstance(part, Pipeline):
        return {"stages": [old_checkpoint_state(stage) for stage in part.stages]}
    state = dict(vars(part))
    if isinstance(part, Hybrid):
        state["phases"] = [old_checkpoint_state(aggregator) for aggregator, _, _ in part.phases]
    if hasattr(part, "rule"):
        state["rule"] = old_checkpoint_state(part.rule)
    if isinstance(part, (Aggregator, AsyncAggregator)):
        state["diagnostics"] = {"alpha_distance": 0.5}
    return state


def built(compose_config, group, option):
    node = compose_config(f"{group}={option}")[group]
    return instantiate(node) if "_target_" in node else None


@pytest.mark.parametrize("group,option", PART_OPTIONS, ids=[f"{g}={o}" for g, o in PART_OPTIONS])
def test_every_part_of_the_config_loads_an_old_attribute_dict_and_gives_back_exactly_its_declared_state(
    compose_config, group, option
):
    part = built(compose_config, group, option)
    if part is None:  # compression=none: no stage
        return
    for inner in parts_of(part):
        for name in type(inner).STATE:  # a distinct value in each state attribute, to see it come back
            setattr(inner, name, f"{type(inner).__name__}.{name}")
    fresh = built(compose_config, group, option)
    fresh.load_state_dict(old_checkpoint_state(part))
    assert fresh.state_dict() == part.state_dict()
    for inner, again in zip(parts_of(part), parts_of(fresh), strict=True):
        assert isinstance(type(inner).STATE, tuple), type(inner).__name__
        own = {k: v for k, v in inner.state_dict().items() if k not in ("phases", "stages", "rule")}
        assert own == {name: f"{type(inner).__name__}.{name}" for name in inner.STATE}
        assert not hasattr(again, "diagnostics")
        settings = set(inspect.signature(type(inner).__init__).parameters) - {"self", "kwargs"}
        assert set(own) & settings <= SETTINGS_A_RUN_MOVES, type(inner).__name__


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
