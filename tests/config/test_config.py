"""Every option of every group composes and instantiates; groups are found by glob, so new files are tested."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from conftest import composed
from hydra.utils import instantiate
from omegaconf import OmegaConf

import fedrun.conf
from fedrun.cli.build import build, setup
from fedrun.errors import ConfigError
from fedrun.tracking import CONFIG_GROUPS

CONF = Path(fedrun.conf.__file__).parent
OPTIONS = sorted(
    (d.name, f.stem) for d in CONF.iterdir() if d.is_dir() and not d.name.startswith("_") for f in d.glob("*.yaml")
)
# The groups that build an object from their node alone (a model needs the data's shape; presets are not objects).
OBJECT_GROUPS = tuple(g for g in CONFIG_GROUPS if g not in ("model", "method", "defence", "experiment"))
GLOBAL_GROUPS = ("experiment", "sweep", "method", "defence")  # presets that set keys across groups
# Small shapes that each model option accepts: images for the CNN, anything for the others.
MODEL_INPUT = {"cnn": (1, 8, 8), "fedavg_cnn": (1, 28, 28), "char_lstm": (12,)}
MODEL_DTYPE = {"char_lstm": torch.int64}  # symbol indices


def test_groups_are_found():
    groups = {g for g, _ in OPTIONS}
    assert set(CONFIG_GROUPS) <= groups and {"sweep", "pipeline"} <= groups


# Options with a value the user must give (``???``), and one that composes (the constructor does not read the file).
PROFILES = Path(__file__).parents[1] / "data" / "devices" / "profiles.csv"  # 100 clients' speeds and bandwidths
GIVEN = {
    ("devices", "trace"): [f"devices.profiles={PROFILES}"],
    ("devices", "generated"): ["devices.up=1", "devices.down=5"],
}


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_instantiates(compose_config, group, option):
    cfg = compose_config(f"{group}={option}", *GIVEN.get((group, option), []))
    if group in GLOBAL_GROUPS:
        for name in OBJECT_GROUPS:
            assert instantiate(cfg[name]) is not None or name == "device"
        return
    node = cfg[group]
    if group == "model":
        model = instantiate(node, input_shape=MODEL_INPUT.get(option, (1, 8, 8)), num_classes=10)
        inputs = torch.zeros(2, *MODEL_INPUT.get(option, (1, 8, 8)), dtype=MODEL_DTYPE.get(option, torch.float32))
        assert model(inputs).shape == (2, 10)
    elif group == "optimizer":
        optimizer = instantiate(node)([torch.zeros(1, requires_grad=True)])
        assert isinstance(optimizer, torch.optim.Optimizer)
    elif group == "device" and option == "cuda" and not torch.cuda.is_available():
        with pytest.raises(Exception, match="no CUDA"):
            instantiate(node)
    else:
        assert instantiate(node) is not None


@pytest.mark.parametrize(
    "overrides",
    [
        ["partition=iid"],
        ["partition=shards"],
        ["partition=dirichlet", "partition.min_size=5"],
        ["partition=label_split"],
        ["dataset=synthetic", "partition=natural", "model=mlp"],
        ["dataset=synthetic", "partition=natural", "model=logistic"],
        ["dataset.val_fraction=0.1", "model=logistic"],
    ],
)
def test_working_combinations_build(compose_config, overrides):
    parts = setup(compose_config(*overrides))
    clients = parts["clients"]
    assert len(clients) >= 1 and all(len(c) > 0 for c in clients)
    assert parts["model"](parts["data"].x_train[:2]).shape == (2, parts["data"].num_classes)


@pytest.mark.parametrize(
    "overrides,key,allowed",
    [
        (["aggregator=fedsoftmax", "aggregator.temperature=0"], "aggregator.temperature=0", "> 0"),
        (["aggregator=fedsoftmax", "aggregator.temperature=-2"], "aggregator.temperature=-2", "> 0"),
        (["schedule.clients_per_round=1.5"], "schedule.clients_per_round=1.5", "(0, 1]"),
        (["schedule.clients_per_round=0"], "schedule.clients_per_round=0", "(0, 1]"),
        (["schedule.rounds=0"], "schedule.rounds=0", ">= 1"),
        (["partition=dirichlet", "partition.alpha=0"], "partition.alpha=0", "> 0"),
        (["partition.num_clients=5000"], "partition.num_clients=5000", "at most"),
        (["partition=shards", "partition.shard_size=500"], "partition.shard_size=500", "at most"),
        (["device.kind=tpu"], "device.kind='tpu'", "cpu, cuda or auto"),
        (["dataset=synthetic", "partition=natural", "model=cnn"], "model=", "mlp or logistic"),
        (["dataset=synthetic", "partition=iid", "model=mlp"], "partition=", "natural"),
        (["partition=natural"], "partition=", "does not come split"),
        (["optimizer.lr=-1"], "optimizer.lr=-1", "learning rate"),  # the key, never a dump of the group
        (["seed=-1"], "seed=-1", ">= 0"),
        (["aggregator=fedbuff", "engine=sync"], "engine='sync'", "async for FedBuff"),
        (["aggregator=fedbuff", "heterogeneity=stragglers"], "heterogeneity='Stragglers'", "none with engine=async"),
        (["schedule.sampling=shuffle"], "schedule.sampling='shuffle'", "fixed (clients_per_round"),
        (["aggregator=fedbuff", "schedule.sampling=poisson"], "schedule.sampling='poisson'", "fixed with engine=async"),
        (["metrics.r_targets=[0.6,1.5]"], "metrics.r_targets", "(0, 1]"),
        (
            [
                "aggregator=hybrid",
                "aggregator.phases=[{aggregator:{_target_:fedrun.aggregators.FedNova},until_round:2},"
                "{aggregator:{_target_:fedrun.aggregators.FedAvg}}]",
            ],
            "aggregator.phases[0].aggregator='FedNova'",
            "only chooses weights",
        ),
        (["partition=shards", "partition.shard_source=balanced"], "partition.shard_source='balanced'", "dataset"),
        (["server=adam", "server.v0=one"], "server.v0='one'", "paper"),
        (["optimizer=storm", "optimizer.init=half"], "optimizer.init='half'", "minibatch or full"),
        (
            ["schedule.stop_at_accuracy=0.9", "schedule.stop_on=client"],
            "schedule.stop_on='client'",
            "client_test_fraction is 0",
        ),
        (["pipeline=clip", "pipeline.stages.0.max_norm=-1"], "pipeline.stages.0.max_norm=-1", "a number > 0"),
        (["pipeline=clip", "pipeline.stages.0.target_quantile=2"], "pipeline.stages.0.target_quantile=2", "[0, 1]"),
        (["aggregator=mvr", "pipeline=clip"], "pipeline=['Clip']", "none with aggregator=mvr"),
        (["sampler=importance", "aggregator=fedsoftmax"], "aggregator='FedSoftMax'", "fedavg with sampler=importance"),
        (["sampler=power_of_choice", "aggregator=fedbuff"], "sampler='power_of_choice'", "uniform with engine=async"),
        (["sampler=power_of_choice", "privacy=central"], "sampler='power_of_choice'", "uniform with privacy=central"),
        (["sampler=power_of_choice", "sampler.candidates=50"], "sampler.candidates=50", "to N = 20"),
        (["sampler=importance", "sampler.signal=loss"], "sampler.signal='loss'", "update_norm or size"),
    ],
)
def test_bad_values_fail_before_training_with_one_line(compose_config, overrides, key, allowed):
    with pytest.raises(ConfigError) as info:
        setup(compose_config(*overrides))
    message = str(info.value)
    assert key in message and allowed in message and "\n" not in message


def test_cuda_without_cuda_is_refused(compose_config):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="device.kind='cuda'.*no CUDA"):
        setup(compose_config("device=cuda"))


# What an aggregator's node and the engine it builds depend on: the aggregator's YAML (async ones switch the engine),
# the root keys it interpolates (checked below: loss_signal's) and whatever a preset sets of these groups, in its
# body or as a defaults override (privacy: setup refuses every aggregator but FedAvg under it).
AGGREGATOR_WORLD = ("aggregator", "engine", "loss_signal", "privacy", "method")


def touches_the_aggregator(experiment: str) -> bool:
    """Whether the preset sets anything of ``AGGREGATOR_WORLD``, read from its YAML (body keys and defaults)."""
    raw = OmegaConf.load(CONF / "experiment" / f"{experiment}.yaml")
    overridden = {
        str(next(iter(d))).split("@")[0].removeprefix("override ").strip("/")
        for d in raw.get("defaults", [])
        if not isinstance(d, str)
    }
    return bool((set(raw.keys()) | overridden) & set(AGGREGATOR_WORLD))


def test_aggregators_interpolate_loss_signal_alone():
    """``AGGREGATOR_WORLD`` holds every root key an aggregator's YAML reads."""
    for path in (CONF / "aggregator").glob("*.yaml"):
        for root in re.findall(r"\$\{([a-z_]+)\.", path.read_text()):
            assert root in AGGREGATOR_WORLD, (path.name, root)


@pytest.mark.parametrize("experiment", sorted(f.stem for f in (CONF / "experiment").glob("*.yaml")))
def test_presets_combine_with_every_aggregator(experiment):
    """A preset that sets anything of ``AGGREGATOR_WORLD`` is composed with every aggregator, each instantiated and
    its engine built (or refused where it must be). Any other preset leaves an aggregator's node and engine as the
    default config has them, which is checked on a synchronous and an asynchronous aggregator (and each aggregator on
    the default config is test_every_option_composes_and_instantiates'): the full product, 16 x 26 compositions, took
    90 s of the fast tier for the 11 presets of 16 that touch none of it."""
    aggregators = sorted(f.stem for f in (CONF / "aggregator").glob("*.yaml"))
    touching = touches_the_aggregator(experiment)
    for aggregator in aggregators if touching else ["fedavg", "fedbuff"]:
        cfg = composed(f"experiment={experiment}", f"aggregator={aggregator}")
        assert cfg.tracking.experiment == experiment, aggregator
        if not touching:
            plain = composed(f"aggregator={aggregator}")
            for group in AGGREGATOR_WORLD:
                assert cfg.get(group) == plain.get(group), (aggregator, group)
        if experiment == "dp_mnist" and aggregator != "fedavg":  # privacy takes uniform FedAvg alone
            with pytest.raises(ConfigError, match="aggregator"):
                setup(cfg)
            continue
        assert instantiate(cfg.aggregator) is not None and instantiate(cfg.partition) is not None, aggregator
        sync_aggregator_on_async_preset = "speeds" in cfg.engine and cfg.engine._target_.endswith("SyncEngine")
        if sync_aggregator_on_async_preset:  # an asynchronous preset: synchronous aggregators refused at build
            with pytest.raises(ConfigError, match="^engine="):
                build("engine", cfg.engine)
        else:
            assert callable(build("engine", cfg.engine)), aggregator


@pytest.mark.parametrize("experiment", sorted(f.stem for f in (CONF / "experiment").glob("*.yaml")))
def test_presets_combine_with_every_partition(compose_config, experiment):
    # Apart from the aggregator test above: which partition composes does not depend on the aggregator (that test
    # composed these three for each of its experiment x aggregator cases, 3/4 of its time).
    for partition in ("iid", "shards", "dirichlet"):
        instantiate(compose_config(f"experiment={experiment}", f"partition={partition}").partition)


def test_softmax_mnist_is_the_papers_protocol(compose_config):
    cfg = compose_config("experiment=softmax_mnist")
    assert (cfg.partition.num_clients, cfg.partition.samples_per_client, cfg.partition.shards_per_client) == (
        50,
        200,
        2,
    )
    assert (cfg.schedule.local_epochs, cfg.schedule.batch_size, cfg.schedule.clients_per_round) == (2, 64, 1.0)
    assert cfg.model._target_.endswith("CNN") and cfg.dataset._target_.endswith("MNIST")
    assert instantiate(cfg.partition).shard_source == "dataset"  # McMahan's shards of the whole training set


def test_the_authors_presets_are_their_code(compose_config):
    from fedrun.models import BatchSoftmax

    cfg = compose_config("experiment=softmax_mnist_authors", "aggregator=fedavg")
    split = instantiate(cfg.partition)  # their label pairs, drawn independently by each client (datasplitting.py:52-75)
    assert (split.draw, split.num_clients, split.samples_per_client) == ("independent", 50, 200)
    assert [labels for _, labels in split.groups] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    triples = instantiate(compose_config("experiment=softmax_mnist_authors", "partition=label_triples").partition)
    assert [labels for _, labels in triples.groups] == [[0, 1, 2], [2, 3, 4], [3, 4, 5], [5, 6, 7], [7, 8, 9]]
    assert (cfg.dataset.scale, cfg.dataset.client_test_fraction, cfg.optimizer.lr, cfg.schedule.local_epochs) == (
        "raw",
        0.15,
        1e-4,
        1,
    )
    assert cfg.model.head == "logits"  # 4e1a5a1's ConvNet returns self.lin(x)
    hybrid = compose_config("experiment=hybrid_fmnist_authors")
    assert (hybrid.model.head, hybrid.model.eval_batch, hybrid.dataset.scale) == ("batch_softmax", 1000, "raw")
    shards = instantiate(hybrid.partition)  # their shards of 30, all dealt at random (10622fb datasplitting.py:7-23)
    assert (shards.deal, shards.shard_size, shards.num_clients, shards.shard_source) == ("random", 30, 100, "dataset")
    model = instantiate(hybrid.model, input_shape=(1, 28, 28), num_classes=10)
    assert isinstance(model[-1], BatchSoftmax) and model.eval_batch == 1000


def test_help_opens_with_what_fedrun_is_and_its_commonest_commands():
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([str(Path(sys.executable).parent / "fedrun"), "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert lines[0].startswith("fedrun: simulated federated-learning experiments")
    commands = [line.split()[0] for line in lines[lines.index("Commonest commands:") + 1 :] if line.startswith("  ")]
    assert commands[:7] == ["fedrun", "fedrun", "fedrun", "fedrun", "fedrun", "fedrun-report", "fedrun-ui"]
    for page in [p for line in lines for p in __import__("re").findall(r"\((docs/[^)]+\.md)\)", line)]:
        assert (Path(__file__).parents[2] / page).exists(), page  # every page the help points to exists
    assert any(line.startswith("aggregator: ") and "fedsoftmax" in line for line in lines)  # then the groups


def test_every_group_of_the_config_tree_is_a_run_tag_and_a_report_key():
    from fedrun.tracking import CONFIG_GROUPS

    tree = {d.name for d in CONF.iterdir() if d.is_dir() and not d.name.startswith("_")} - {"hydra", "sweep"}
    assert set(CONFIG_GROUPS) == tree and CONFIG_GROUPS[:3] == (
        "engine",
        "dataset",
        "partition",
    )  # conf/config.yaml's order


OPTIONS_LINE = "none, qsgd, sign, topk"
SCHEDULE_KEYS = (
    "_target_, rounds, local_epochs, local_steps, batch_size, clients_per_round, cohort, sampling, lr_decay, "
    "eval_every, stop_at_accuracy, stop_on, tail"
)
# Hydra's options of hydra/launcher: its own, the plugins' (ray and ray_aws only with the [ray] extra) and conf/'s
RAY = ", ray, ray_aws" if importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") else ""
LAUNCHERS = f"basic, joblib{RAY}, ray_cluster, slurm, slurm_cpu, submitit_local, submitit_local_requeue, submitit_slurm"
# What a new user types wrong, and the one line fedrun says for it (Hydra printed several lines and exited 1).
HYDRA_ERRORS = [
    (
        ["compression.k=0.1"],  # a key of another option of the group
        "compression.k=0.1 is invalid: allowed is a key of compression with compression=none (it has none); "
        "k is a key of compression=topk",
    ),
    (["compression=bogus"], f"compression='bogus' is invalid: allowed is an option of compression: {OPTIONS_LINE}"),
    (
        ["optimizer.lr=0.1", "optimizer.bogus=1"],
        "optimizer.bogus=1 is invalid: allowed is a key of optimizer with optimizer=sgd "
        "(_target_, _partial_, lr, momentum, weight_decay)",
    ),
    (
        ["bogus/x=y"],
        "bogus/x='y' is invalid: allowed is a config group: aggregator, attack, client, compression, dataset, defence, device, "
        "devices, engine, experiment, heterogeneity, method, model, optimizer, partition, personalization, pipeline, privacy, sampler, schedule, "
        "server, sweep (or hydra/<group>)",
    ),
    (
        ["a=["],
        "a='[' is invalid: allowed is an override in Hydra's grammar, key=value (no viable alternative at input "
        "'['; https://hydra.cc/docs/advanced/override_grammar/basic/)",
    ),
    (
        ["+schedule.rounds=3"],
        "+schedule.rounds=3 is invalid: allowed is schedule.rounds=<value> without + (schedule.rounds exists; "
        "++schedule.rounds=<value> sets it either way)",
    ),
    (
        ["~schedule.bogus"],
        "schedule.bogus='~schedule.bogus' is invalid: allowed is ~ on a key the config has: a key of schedule "
        f"with schedule=default ({SCHEDULE_KEYS})",
    ),
    (["hydra.job.chdir=maybe"], "hydra.job.chdir='maybe' is invalid: allowed is true or false"),
    (
        ["hydra/launcher=bogus"],
        f"hydra/launcher='bogus' is invalid: allowed is an option of hydra/launcher: {LAUNCHERS}",
    ),
    (
        ["hydra.launcher.n_jobs=2"],
        "hydra.launcher.n_jobs=2 is invalid: allowed is a key of hydra.launcher with hydra/launcher=basic "
        "(_target_); other hydra/launcher options have other keys",
    ),
    (
        ["compression=topk", "compression.k=0.1,0.2"],
        "compression.k='0.1,0.2' is invalid: allowed is one value in a single run (fedrun -m sweeps over a,b; "
        "key=[a,b] is a list)",
    ),
]


@pytest.mark.parametrize("overrides,line", HYDRA_ERRORS, ids=[" ".join(o) for o, _ in HYDRA_ERRORS])
def test_a_hydra_composition_error_is_one_line_naming_the_key_the_value_and_what_is_allowed(overrides, line):
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException

    from fedrun.cli.entry import explain

    with pytest.raises(HydraException) as info:
        with initialize_config_module(config_module="fedrun.conf", version_base="1.3"):
            compose(config_name="config", overrides=overrides)
    assert str(explain(info.value, overrides)) == line
