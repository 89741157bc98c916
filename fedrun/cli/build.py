"""Compose -> validate -> build: every object of a run from its config, checked against each other before any
training starts (a bad value is one ConfigError naming its key)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing

import hydra
import numpy as np
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fedrun import compat, lazy
from fedrun.cli.entry import check_run_keys
from fedrun.errors import ConfigError
from fedrun.lazy import deferrable, torch
from fedrun.partitions import LazyClients, Natural, Population, client_sizes, hold_out
from fedrun.parts import Parts, layout
from fedrun.seeding import numpy_rng, torch_seed
from fedrun.state import Context, check_encodable

_models = deferrable("fedrun.models")  # subclasses torch's classes: fedrun.lazy
_optimizers = deferrable("fedrun.optimizers")  # subclasses torch's classes: fedrun.lazy


def build(group: str, node: DictConfig, **runtime):
    """``instantiate(node, **runtime)``, turning constructor errors into one-line ConfigErrors for ``group``. A class
    that is not fedrun's may import torch's submodules, which a deferred torch cannot take (``fedrun.lazy``): torch
    is imported before it."""
    if any(not str(target).startswith("fedrun.") for target in _targets(node)):
        lazy.load("torch")
    try:
        return instantiate(node, **runtime)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, ConfigError):
            raise cause.within(group) from None
        raise _explain(group, node, cause or exc) from None


def _targets(value) -> list:
    """Every ``_target_`` in ``value`` (a config node, resolved as ``instantiate`` resolves it, or what
    ``OmegaConf.to_container`` made of one); ``[None]`` when the node does not resolve (its targets are unknown)."""
    if OmegaConf.is_config(value):
        try:
            value = OmegaConf.to_container(value, resolve=True)
        except Exception:  # instantiate will say what; its targets may be anyone's
            return [None]
    if isinstance(value, dict):
        own = [value["_target_"]] if "_target_" in value else []
        return own + [t for v in value.values() for t in _targets(v)]
    return [t for v in value for t in _targets(v)] if isinstance(value, list) else []


def _explain(group: str, node: DictConfig, cause: BaseException) -> ConfigError:
    """A ConfigError naming the one key the constructor's error is about: an unknown key, a value of the wrong
    type, or the value its message quotes (torch's "Invalid learning rate: -0.1")."""
    target = node.get("_target_")
    constructor = None
    arguments = {k: v for k, v in OmegaConf.to_container(node).items() if not k.startswith("_")}
    try:
        constructor = hydra.utils.get_object(target).__init__
        hints = _hints(constructor, arguments)
    except Exception:  # a target without usable annotations: fall back to the constructor's own message
        hints = {}
    unknown = re.search(r"unexpected keyword argument '(\w+)'", str(cause))
    if unknown and unknown.group(1) in arguments:
        known = (
            [
                name
                for name in inspect.signature(constructor).parameters
                if name not in ("self", "params", "args", "kwargs")
            ]
            if constructor
            else []
        )
        return ConfigError(
            f"{group}.{unknown.group(1)}",
            arguments[unknown.group(1)],
            f"a key of {group} ({', '.join(known)})" if known else f"a key of {target}",
        )
    for key, value in arguments.items():
        types = typing.get_args(hints.get(key)) or (hints.get(key),)
        if (int in types or float in types) and isinstance(value, (str, bool)):
            return ConfigError(f"{group}.{key}", value, "a number" if float in types else "an integer")
    quoted = [
        key
        for key, value in arguments.items()
        if isinstance(value, (int, float)) and re.search(rf"(?<![\w.-]){re.escape(str(value))}(?![\w.])", str(cause))
    ]
    if len(quoted) == 1:
        return ConfigError(f"{group}.{quoted[0]}", arguments[quoted[0]], f"a value {target} accepts ({cause})")
    return ConfigError(group, arguments, f"valid arguments for {target} ({cause})")


def _hints(constructor, keys) -> dict:
    """The annotations of ``constructor``'s parameters among ``keys``, evaluated as ``typing.get_type_hints`` does
    (they are strings: ``from __future__ import annotations``). Only those: another parameter's may name torch,
    which a part's refusal answers before (``fedrun.lazy``)."""
    parameters = inspect.signature(constructor).parameters
    wanted = {k: parameters[k].annotation for k in keys if k in parameters}
    wanted = {k: a for k, a in wanted.items() if a is not inspect.Parameter.empty}
    namespace = getattr(inspect.unwrap(constructor), "__globals__", None)
    return typing.get_type_hints(types.SimpleNamespace(__annotations__=wanted), globalns=namespace)


def build_parts(cfg: DictConfig) -> dict:
    """Every part of the run (all but the model, its solver and the data), each checked by its constructor and all
    against each other (``fedrun.compat``), with the state each keeps checked against what a checkpoint holds. This
    imports neither torch nor MLflow (``fedrun.lazy``): the CLI calls it before either, so that a refused value
    answers at once (``tests/config/test_lazy_torch.py`` builds every option of every group)."""
    # Privacy is built and checked with the engine first: its options set aggregator.weighting=uniform, a key
    # asynchronous aggregators lack, so its refusal of the asynchronous engine must come before they are built.
    privacy = build("privacy", cfg.privacy)
    early = {"privacy": privacy, "engine": build("engine", cfg.engine)} if privacy else {"privacy": privacy}
    compat.check(early)
    groups = (
        "dataset",
        "partition",
        "aggregator",
        "server",
        "schedule",
        "heterogeneity",
        "devices",
        "device",
        "engine",
    )
    objects = {group: early[group] if group in early else build(group, cfg[group]) for group in groups}
    # Each stage on its own, so that an error names its key (pipeline.stages.0.max_norm), then the pipeline around them.
    stages = [build(f"pipeline.stages.{i}", stage) for i, stage in enumerate(cfg.pipeline.get("stages", []))]
    if "_target_" in cfg.compression:  # the last stage (compression=none: no stage)
        stages.append(build("compression", cfg.compression))
    objects["pipeline"] = build("pipeline", cfg.pipeline, stages=stages)
    objects["sampler"] = build("sampler", cfg.sampler)
    objects["attack"] = build("attack", cfg.attack)
    objects["client_state"] = build("personalization", cfg.personalization)
    objects["client"] = build("client", cfg.client)
    objects["privacy"] = privacy
    compat.check(objects)  # every combination that cannot run, before the dataset is read
    # A state a checkpoint cannot hold fails now, not at round 10.
    for group in ("aggregator", "server", "pipeline", "sampler", "attack", "client_state", "client"):
        key = "personalization" if group == "client_state" else group
        try:
            check_encodable(objects[group].state_dict(), key)
        except TypeError as exc:
            raise ConfigError(
                key, type(objects[group]).__name__, f"a part whose state_dict() a checkpoint can hold ({exc})"
            ) from None
    return objects


def setup(cfg: DictConfig, checked: typing.Callable[[], None] | None = None, objects: dict | None = None) -> dict:
    """Build every object of the run and check them against each other, before any training; ``checked`` is called
    once every part is built and checked, before the dataset is read (the CLI checks the tracking store there: a
    config error does not wait for MLflow, an unreachable store does not wait for the data). ``objects``: what
    ``build_parts(cfg)`` returned, when the caller built them already."""
    seed = cfg.seed
    objects = build_parts(cfg) if objects is None else objects
    try:
        objects["device"].check_machine()
    except ConfigError as exc:
        raise exc.within("device") from None
    _optimizers.eager_optimizer_methods()  # before the first solver is built: torch's compiler stays unimported
    optimizer = build("optimizer", cfg.optimizer)
    try:  # torch optimizers check their arguments when built: do it now, not in round 1
        optimizer([torch.zeros(1, requires_grad=True)])
    except ConfigError as exc:
        raise exc.within("optimizer") from None
    except (ValueError, TypeError) as exc:
        raise _explain("optimizer", cfg.optimizer, exc) from None
    check_run_keys(cfg)
    if checked is not None:
        checked()

    data = objects["dataset"].load(seed)
    data.root = root_set(objects, len(data.y_train), seed)
    labels, natural, rng = data.y_train.numpy(), data.natural_split, numpy_rng(seed, "partition")
    try:
        if data.root is None:
            clients = objects["partition"](labels, rng, natural=natural)
        elif isinstance(objects["partition"], Natural):  # each user's own samples, less the root set
            clients = objects["partition"](labels, rng, natural=[np.setdiff1d(user, data.root) for user in natural])
        else:  # the partition of the samples left, as indices into train
            kept = np.setdiff1d(np.arange(len(labels)), data.root)
            clients = [kept[c] for c in objects["partition"](labels[kept], rng, natural=natural)]
    except ConfigError as exc:
        raise exc.within("partition") from None
    client_tests = None
    if getattr(objects["dataset"], "client_tests", False):  # LEAF: each user's own test samples (partition=natural)
        client_tests, data.client_tests_in = objects["dataset"].natural_test_split, "test"
    elif objects["dataset"].client_test_fraction > 0:
        if isinstance(clients, LazyClients):
            raise ConfigError(
                "dataset.client_test_fraction",
                objects["dataset"].client_test_fraction,
                "0 with partition=population (its clients are drawn when they train; nothing is held out)",
            )
        try:
            clients, client_tests = hold_out(
                clients, objects["dataset"].client_test_fraction, numpy_rng(seed, "client_test")
            )
        except ConfigError as exc:
            raise exc.within("dataset") from None
    client_vals = held_out_validation(objects["dataset"], clients, client_tests, seed)
    if objects["client_state"].personal and client_tests is None and not isinstance(clients, LazyClients):
        raise ConfigError(  # a population's personal state runs at scale unjudged; a listed client is judged
            "dataset.client_test_fraction",
            objects["dataset"].client_test_fraction,
            f"> 0 with personalization={type(objects['client_state']).__name__.lower()} (every client's own model "
            "is judged on its own held-out samples; PFLlib holds out 0.25)",
        )
    # Settings that depend on the population (candidates <= N) fail now; its errors name their full keys.
    context = Context(
        objects["schedule"],
        client_sizes(clients),
        seed,
        getattr(objects["aggregator"], "weighting", "samples"),
        objects["engine"].asynchronous,
    )
    torch.manual_seed(torch_seed(seed, "init"))  # the initial model depends on the seed only
    model = build("model", cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    if objects["device"].backend == "vmap":  # what the trainer would refuse in round 1, refused before tracking
        from fedrun.vmap import vmap_supported

        if (why := vmap_supported(optimizer, model)) is not None:
            raise ConfigError("device.backend", "vmap", why)
    if _models.batch_norms(model) and objects["engine"].asynchronous:
        raise ConfigError(
            "model.norm", "batch", "none with engine=async (its evaluations are not calibrated for batch norm yet)"
        )
    context = dataclasses.replace(
        context,
        layout=layout(model),
        initial=_models.flat_parameters(model),
        batch_norm=_models.batch_norm_names(model),
    )  # personal layers by name
    parts_of(objects).bind(context, engine=objects["engine"])  # every part's settings against the run, before tracking
    return dict(
        objects,
        optimizer=optimizer,
        data=data,
        clients=clients,
        client_tests=client_tests,
        client_vals=client_vals,
        model=model,
    )


def held_out_validation(dataset, clients, client_tests, seed: int) -> list[np.ndarray] | None:
    """Each client's own validation split (``dataset.client_val_fraction`` of its training samples left, from the
    seed's ``client_val`` stream), taken out of ``clients`` in place; None when there is none."""
    fraction = getattr(dataset, "client_val_fraction", 0.0)
    if not fraction:
        return None
    if client_tests is None:
        raise ConfigError(
            "dataset.client_val_fraction",
            fraction,
            "0 unless each client has its own test split (client_test_fraction > 0)",
        )
    try:
        clients[:], client_vals = hold_out(clients, fraction, numpy_rng(seed, "client_val"), key="client_val_fraction")
    except ConfigError as exc:
        raise exc.within("dataset") from None
    return client_vals


def root_set(objects: dict, n: int, seed: int) -> np.ndarray | None:
    """The server's root set when the aggregator asks for one (FLTrust's ``root_size``): that many training
    indices drawn without replacement from the seed's ``root`` stream, sorted; None without one."""
    size = getattr(objects["aggregator"], "root_size", 0)
    if not size:
        return None
    if size >= n:
        raise ConfigError("aggregator.root_size", size, f"fewer than the {n} training samples")
    if isinstance(objects["partition"], Population):
        raise ConfigError("aggregator", "fltrust", "a partition other than population (its clients are drawn lazily)")
    return np.sort(numpy_rng(seed, "root").choice(n, size=size, replace=False))


def run_engine(built: dict, seed: int, **hooks):
    """The run's engine called on what ``setup`` built (``hooks``: ``on_round``, ``checkpoint``); its RunResult."""
    return built["engine"](
        model=built["model"],
        data=built["data"],
        clients=built["clients"],
        parts=parts_of(built),
        optimizer=built["optimizer"],
        schedule=built["schedule"],
        device=built["device"],
        seed=seed,
        client_tests=built["client_tests"],
        client_vals=built["client_vals"],
        **hooks,
    )


def parts_of(built: dict) -> Parts:
    """The parts of a round from the built objects (privacy puts its own stage and aggregation in place)."""
    return Parts(**{name: built[name] for name in Parts.NAMES if name in built})
