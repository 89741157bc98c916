"""privacy=central and privacy=local composed: what cannot be accounted is refused in one line, the weighting they
choose, a cohort too small for the noise (the accounting itself: tests/unit/test_privacy.py)."""

import pytest

from fedrun.errors import ConfigError


def test_what_cannot_be_accounted_is_refused_in_one_line(compose_config):
    from fedrun.cli.build import setup

    cases = [
        (["aggregator=fedsoftmax"], "aggregator='FedSoftMax'", "would change the sensitivity"),
        (
            ["aggregator.weighting=uniform", "pipeline=clip", "pipeline.stages.0.adaptive=true"],
            "pipeline.stages.0='Clip'",
            "acts on each update alone",
        ),
        (
            [
                "aggregator.weighting=uniform",
                "dataset.client_test_fraction=0.2",
                "schedule.stop_at_accuracy=0.9",
                "schedule.stop_on=client",
            ],
            "schedule.stop_on='client'",
            "un-noised client data",
        ),
        (["aggregator.weighting=uniform", "privacy.delta=0.3"], "privacy.delta=0.3", "below 1 / N"),
        (["aggregator.weighting=samples"], "aggregator.weighting='samples'", "uniform with privacy=central"),
        (["aggregator.weighting=uniform", "heterogeneity=stragglers"], "heterogeneity='Stragglers'", "drop out"),
        (["aggregator=fedbuff"], "engine='async'", "asynchronous privacy is not accounted"),
        (
            ["aggregator.weighting=uniform", "schedule.clients_per_round=0.5", "privacy.accountant=pld"],
            "privacy.accountant='pld'",
            "no event for a fixed-size sample",
        ),
        (["aggregator.weighting=uniform", "privacy.noise_multiplier=null"], "privacy.noise_multiplier", "one of"),
    ]
    for overrides, key, allowed in cases:
        with pytest.raises(ConfigError) as error:
            setup(compose_config("privacy=central", "partition.num_clients=4", *overrides))
        assert key in str(error.value) and allowed in str(error.value), str(error.value)


def test_local_noise_is_refused_where_central_is(compose_config):
    from fedrun.cli.build import setup

    for overrides, key, allowed in [
        (["aggregator.weighting=samples"], "aggregator.weighting='samples'", "uniform with privacy=local"),
        (["aggregator=fedmax"], "aggregator='FedMax'", "fedavg with privacy=local"),
        (["aggregator.weighting=uniform", "+privacy.adaptive=true"], "privacy.adaptive=True", "mechanism=local"),
    ]:
        with pytest.raises(ConfigError) as error:
            setup(compose_config("privacy=local", "partition.num_clients=4", *overrides))
        assert key in str(error.value) and allowed in str(error.value), str(error.value)


def test_privacy_options_choose_uniform_weighting_and_refuse_only_an_explicit_samples(compose_config):
    from fedrun.cli.build import setup

    for mechanism in ("central", "local"):
        cfg = compose_config(f"privacy={mechanism}", "partition.num_clients=4")
        assert cfg.aggregator.weighting == "uniform" and cfg.privacy.mechanism == mechanism
        assert setup(cfg)["aggregator"].weighting == "uniform"
        with pytest.raises(ConfigError, match=rf"^aggregator\.weighting='samples' is invalid: .*privacy={mechanism}"):
            setup(compose_config(f"privacy={mechanism}", "partition.num_clients=4", "aggregator.weighting=samples"))
    assert compose_config("privacy=none").aggregator.weighting == "samples"  # FedAvg's default is untouched
    assert compose_config("privacy=central", "aggregator=fedsoftmax").aggregator._target_.endswith("FedSoftMax")


def test_an_expected_cohort_below_one_client_is_refused_under_central_noise(compose_config):
    from fedrun.cli.build import setup

    poisson = ("partition.num_clients=50", "schedule.sampling=poisson", "aggregator.weighting=uniform")
    # q N = 0.01 * 50 = 0.5 clients: each weight 1 / D = 2 would double the noise and a lone client's update
    with pytest.raises(
        ConfigError, match=r"^schedule\.clients_per_round=0\.01 is invalid: allowed is a rate of at least 1 / N = 0\.02"
    ):
        setup(compose_config("privacy=central", *poisson, "schedule.clients_per_round=0.01"))
    assert (
        setup(compose_config("privacy=central", *poisson, "schedule.clients_per_round=0.02"))["privacy"].denominator
        == 1
    )
    # local noise has no denominator: an empty round takes no step
    setup(compose_config("privacy=local", *poisson, "schedule.clients_per_round=0.01"))


@pytest.mark.parametrize("key", ["clip_norm", "noise_multiplier", "target_epsilon", "clip_lr"])
def test_true_is_not_a_number_for_privacy(compose_config, key):
    from fedrun.cli.build import setup

    overrides = ["privacy=central", "aggregator.weighting=uniform", f"privacy.{key}=true"]
    if key == "target_epsilon":
        overrides.append("privacy.noise_multiplier=null")
    with pytest.raises(ConfigError, match=rf"^privacy\.{key}=True is invalid: allowed is "):
        setup(compose_config(*overrides))
