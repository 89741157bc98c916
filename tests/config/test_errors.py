"""Every bad value stops the run before training with one line that names its key (table-driven)."""

import pytest

from fedrun.checkpoint import Checkpoint
from fedrun.cli.build import setup
from fedrun.cli.entry import check_run_keys
from fedrun.errors import ConfigError

# (overrides, the key the one-line message must name)
BAD = [
    (["seed=-1"], "seed"),
    (["seed=abc"], "seed"),
    (["dataset.test_fraction=1.5"], "dataset.test_fraction"),
    (["dataset.val_fraction=-0.1"], "dataset.val_fraction"),
    (["dataset.client_test_fraction=1"], "dataset.client_test_fraction"),
    (["dataset.client_val_fraction=0.1"], "dataset.client_val_fraction"),  # without a client test split
    (["dataset.client_test_fraction=0.2", "dataset.client_val_fraction=1"], "dataset.client_val_fraction"),
    (["personalization=fedper"], "dataset.client_test_fraction"),  # a personal model nobody judges
    (["client=feddyn", "client.alpha=0"], "client.alpha"),
    (["client=moon", "client.tau=0"], "client.tau"),
    (
        ["personalization=fedper", "dataset.client_test_fraction=0.2", "personalization.personal=[head*]"],
        "personalization.personal",
    ),  # fmt: skip
    (["personalization=fedper", "personalization.personal=x"], "personalization.personal"),
    (["personalization=fedrep", "personalization.head_epochs=-1"], "personalization.head_epochs"),
    (["personalization=ditto", "personalization.lam=-1"], "personalization.lam"),
    (["personalization=ditto", "personalization.memory_mb=0"], "personalization.memory_mb"),
    (["personalization=finetune", "personalization.epochs=-1"], "personalization.epochs"),
    (["personalization=apfl", "personalization.alpha=2"], "personalization.alpha"),
    (["personalization=apfl", "personalization.alpha_lr=-1"], "personalization.alpha_lr"),
    (["personalization=fedbn", "dataset.client_test_fraction=0.2"], "personalization"),  # a model without batch norm
    (["model=cnn", "model.norm=group"], "model.norm"),
    (["model=cnn", "model.norm=batch", "engine=async", "aggregator=fedbuff"], "model.norm"),
    (["device.inner=processes"], "device.inner"),
    (["partition=pathological", "partition.num_clients=6"], "partition.num_clients"),  # class 6 finds no client
    (["personalization=ditto", "aggregator=fedbuff", "dataset.client_test_fraction=0.2"], "engine"),
    (["partition.num_clients=0"], "partition.num_clients"),
    (["partition.num_clients=100000"], "partition.num_clients"),
    (["partition=shards", "partition.num_clients=100000"], "partition.num_clients"),
    (["partition=shards", "partition.shards_per_client=0"], "partition.shards_per_client"),
    (["partition=dirichlet", "partition.alpha=0"], "partition.alpha"),
    (["partition.samples_per_client=100000"], "partition.samples_per_client"),
    (["partition.unbalanced=-1"], "partition.unbalanced"),
    (["model=cnn", "model.padding=-1"], "model.padding"),
    (["model=mlp", "model.hidden=[0]"], "model.hidden"),
    (["aggregator=fedsoftmax", "aggregator.temperature=-1"], "aggregator.temperature"),
    (["aggregator=fedsoftmax", "aggregator.anneal=cosine"], "aggregator.anneal"),
    (["aggregator=fedsoftmax", "aggregator.fstar=best"], "aggregator.fstar"),
    (["aggregator=fedsoftmax", "+aggregator.temprature=2"], "aggregator.temprature"),
    (["aggregator=mvr", "aggregator.beta=2"], "aggregator.beta"),
    (["aggregator=fedstaleweight", "aggregator.form=eq9"], "aggregator.form"),
    (["aggregator=fedasync", "aggregator.mixing=0"], "aggregator.mixing"),
    (["optimizer.lr=-0.1"], "optimizer.lr"),
    (["optimizer.lr=abc"], "optimizer.lr"),
    (["optimizer.momentum=-1"], "optimizer.momentum"),
    (["+optimizer.foo=1"], "optimizer.foo"),
    (["optimizer=prox", "optimizer.mu=-1"], "optimizer.mu"),
    (["optimizer=storm", "optimizer.beta=2"], "optimizer.beta"),
    (["server=adam", "server.v0=one"], "server.v0"),
    (["server=momentum", "server.beta=1.5"], "server.beta"),
    (["schedule.rounds=0"], "schedule.rounds"),
    (["schedule.batch_size=0"], "schedule.batch_size"),
    (["schedule.clients_per_round=0"], "schedule.clients_per_round"),
    (["schedule.eval_every=0"], "schedule.eval_every"),
    (["schedule.stop_at_accuracy=2"], "schedule.stop_at_accuracy"),
    (["heterogeneity=random_steps", "heterogeneity.low=0"], "heterogeneity.low"),
    (["heterogeneity=stragglers", "heterogeneity.mode=sleep"], "heterogeneity.mode"),
    (["device.kind=tpu"], "device.kind"),
    (["device.backend=threads"], "device.backend"),
    (["device.chunk=0"], "device.chunk"),
    (["aggregator=fedbuff", "engine.concurrency=0"], "engine.concurrency"),
    (["aggregator=fedbuff", "engine.max_time=-1"], "engine.max_time"),
    (["tracking.max_alpha_series=-1"], "tracking.max_alpha_series"),
    (["tracking.experiment="], "tracking.experiment"),
    (["metrics.r_targets=[0.6,1.5]"], "metrics.r_targets"),
    (["checkpoint.every=0"], "checkpoint.every"),
    (["pipeline=clip", "pipeline.stages.0.max_norm=0"], "pipeline.stages.0.max_norm"),
    (["pipeline=clip", "pipeline.stages.0.clip_lr=-1"], "pipeline.stages.0.clip_lr"),
    (["privacy=central", "privacy.clip_norm=0"], "privacy.clip_norm"),
    (["privacy=central", "privacy.delta=2.0"], "privacy.delta"),
    (["privacy=central", "privacy.mechanism=shuffle"], "privacy.mechanism"),
    (["attack=sign_flip", "attack.fraction=1.5"], "attack.fraction"),
    (["attack=sign_flip", "attack.fraction=null", "attack.count=500"], "attack.count"),
    (["attack=loss_lie", "attack.who=sometimes"], "attack.who"),
    (["method=hierarchical_term", "aggregator.loss_on=local"], "aggregator.loss_on"),
    (["method=hierarchical_term", "attack=loss_lie"], "aggregator.tau"),  # the lie would not reach the tilted risk
    (["compression=topk", "compression.k=0"], "compression.k"),
    (["compression=qsgd", "compression.levels=0"], "compression.levels"),
    (["sampler=power_of_choice", "sampler.candidates=1"], "sampler.candidates"),
    (["sampler=importance", "sampler.uniform_mix=-0.5"], "sampler.uniform_mix"),
    (["schedule.sampling=shuffle"], "schedule.sampling"),
    (["schedule.cohort=0"], "schedule.cohort"),
    (["schedule.rounds=${nothing}"], "schedule.rounds"),  # an interpolation to nothing
    (["+loss_signal.extra=${bogus}"], "loss_signal.extra"),
    (["seed=???"], "seed"),  # a missing value
    (["optimizer.lr=???"], "optimizer.lr"),
    # inf and nan, refused for every key before any constructor sees them (each of these trained or was accepted)
    (["attack=scale", "attack.scale=inf"], "attack.scale"),
    (["attack=sign_flip", "attack.scale=inf"], "attack.scale"),
    (["attack=gaussian", "attack.sigma=inf"], "attack.sigma"),
    (["attack=loss_lie", "attack.offset=nan"], "attack.offset"),
    (["attack=alie", "attack.z=nan"], "attack.z"),
    (["privacy=central", "privacy.noise_multiplier=inf"], "privacy.noise_multiplier"),
    (["privacy=central", "privacy.clip_norm=inf"], "privacy.clip_norm"),
    (["personalization=ditto", "personalization.lam=inf"], "personalization.lam"),
    (["aggregator=centered_clip", "aggregator.tau=inf"], "aggregator.tau"),
    (["metrics.r_targets=[0.5,nan]"], "metrics.r_targets.1"),
    (["model.norm=batch", "device.backend=vmap"], "device.backend"),  # the trainer refused it in round 1
    (["devices=trace", "devices.profiles=no_such_profiles.csv"], "devices.profiles"),  # before the data is read
    (["devices=generated", "devices.up=1", "devices.down=1", "devices.availability=diurnal"], "devices.availability"),
    (
        ["devices=generated", "devices.up=1", "devices.down=1", "devices.availability=lognormal", "devices.beta=1"],
        "devices.beta",
    ),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_value_names_its_key_in_one_line(compose_config, tmp_path, overrides, key):
    cfg = compose_config(*overrides, "dataset=digits")
    with pytest.raises(ConfigError) as info:
        Checkpoint(tmp_path, cfg.checkpoint.every)
        check_run_keys(cfg)
        setup(cfg)
    line = f"fedrun: error: {info.value}"
    assert info.value.key == key, line
    assert line.startswith(f"fedrun: error: {key}=") and "\n" not in line and " is invalid: allowed is " in line


def test_the_table_covers_every_group():
    from fedrun.tracking import CONFIG_GROUPS

    groups = {key.split(".")[0] for _, key in BAD}
    presets = {"method", "experiment", "defence"}  # they set other groups' keys; their bad values are those groups'
    assert set(CONFIG_GROUPS) - presets | {"seed", "tracking", "metrics", "checkpoint"} <= groups
    assert len(BAD) >= 30
