"""sampler=importance composed: stragglers that drop out are refused (the samplers: tests/unit/test_sampling.py)."""

import pytest

from fedrun.errors import ConfigError


def test_importance_sampling_refuses_stragglers_that_drop_out(compose_config):
    from fedrun.cli.build import setup

    with pytest.raises(ConfigError, match="heterogeneity.mode='drop'.*partial with sampler=importance"):
        setup(compose_config("sampler=importance", "heterogeneity=stragglers", "heterogeneity.mode=drop"))
