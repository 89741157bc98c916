"""Every stateful option of the config (aggregator, server, pipeline, compression, sampler) loads an old
checkpoint's attribute dict and gives back exactly its declared state (the state's encoding:
tests/unit/test_state.py)."""

import inspect
from pathlib import Path

import pytest
from hydra.utils import instantiate

import fedrun.conf
from fedrun.aggregators import Hybrid
from fedrun.aggregators.base import Aggregator
from fedrun.aggregators.buffered import AsyncAggregator
from fedrun.pipeline import Pipeline

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
