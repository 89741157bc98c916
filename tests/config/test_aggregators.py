"""The aggregator options as composed from conf/aggregator: which log alpha's per-client series, and the
loss-weighted family's trim and max_weight (the golden numbers: tests/unit/aggregators/test_aggregators.py)."""


def test_only_aggregators_whose_alpha_follows_the_clients_log_its_series(compose_config):
    """alpha's per-client series go to MLflow only where alpha depends on what the clients measured (docs/reference/metrics.md): the loss-weighted family and the hybrid, FedStaleWeight, FedBuff with staleness scaling."""
    from hydra.utils import instantiate

    expected = {
        "fedavg": False,
        "fednova": False,
        "mvr": False,
        "fedbuff": False,
        "fedasync": False,
        "fedmax": True,
        "fedbetter": True,
        "fedmaxk": True,
        "fedbetterk": True,
        "fedsoftmax": True,
        "fedsoftbetter": True,
        "hybrid": True,
        "fedstaleweight": True,
    }
    for name, informative in expected.items():
        assert instantiate(compose_config(f"aggregator={name}").aggregator).alpha_informative is informative, name
    scaled = compose_config("aggregator=fedbuff", "aggregator.staleness_scaling=true").aggregator
    assert instantiate(scaled).alpha_informative


def test_every_loss_weighted_yaml_and_the_hybrids_phase_take_trim_and_max_weight(compose_config):
    from hydra.utils import instantiate

    for name in ("fedmax", "fedmaxk", "fedsoftmax", "fedbetter", "fedbetterk", "fedsoftbetter"):
        default = compose_config(f"aggregator={name}").aggregator
        assert (default.trim, default.max_weight) == (0, None), name
        agg = instantiate(
            compose_config(f"aggregator={name}", "aggregator.trim=1", "aggregator.max_weight=0.5").aggregator
        )
        assert (agg.trim, agg.max_weight) == (1, 0.5), name
    overrides = (
        "aggregator=hybrid",
        "aggregator.phases.0.aggregator.trim=2",
        "aggregator.phases.0.aggregator.max_weight=0.3",
    )
    phase = instantiate(compose_config(*overrides).aggregator).phases[0][0]
    assert (phase.trim, phase.max_weight) == (2, 0.3)
