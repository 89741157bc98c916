"""Hydra's own errors as fedrun's one line: a bad override (an unknown key, group or option, a value of the wrong
type, ``+`` on a key that exists, ``~`` on one that does not, broken override grammar) is
``fedrun: error: <key>=<value> is invalid: allowed is <what>`` and exit 2, where Hydra prints several lines and
exits 1.

Hydra reports these inside ``hydra.main``: ``hydra/_internal/utils.py`` runs composition (``Hydra.run``,
``Hydra.multirun``, ``show_cfg``, ``app_help``) through ``run_and_report``, which prints any exception and exits 1.
``one_line_errors`` wraps the decorated main so that, while it runs, each of those calls first goes through
``_one_line``: a composition error raised outside a job becomes the line, anything else reaches Hydra's reporter
as before (``--help``, ``--cfg``, sweeps, and a genuine bug inside a job keep Hydra's output and traceback).
``HYDRA_FULL_ERROR=1`` keeps Hydra's full report.
"""

import difflib
import functools
import math
import os
import re
import sys
import typing
from importlib import resources
from pathlib import Path

import yaml
from hydra._internal import utils as hydra_utils
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue, OmegaConfBaseException

from fedrun.errors import ConfigError, JobFailed
from fedrun.runfiles import RunFileError
from fedrun.sweepdir import linked_files

GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def one_line_errors(hydra_main):
    """Decorate the ``hydra.main`` function: its composition errors print as one line and exit 2."""

    @functools.wraps(hydra_main)
    def main(*args, **kwargs):
        try:  # before Hydra writes .hydra/ into a resumed dir
            refuse_linked_resume(_command_line_overrides(), os.getcwd())
        except ConfigError as exc:
            print(f"fedrun: error: {exc}", file=sys.stderr)
            sys.exit(2)
        reporter = hydra_utils.run_and_report
        hydra_utils.run_and_report = lambda func: reporter(lambda: _one_line(func))
        try:
            return hydra_main(*args, **kwargs)
        finally:
            hydra_utils.run_and_report = reporter

    return main


def refuse_linked_resume(overrides: list[str], cwd: str) -> None:
    """Before Hydra starts: ``resume=<dir>`` of a dir that holds links, symbolic or hard, is a ConfigError. Hydra
    writes ``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml`` and the job's log into the dir it runs in (a
    resumed run's or sweep's own) before any of fedrun's code runs, and it writes through links: a crafted dir (or
    one copied with ``cp -al``) would have it overwrite a file elsewhere."""
    try:  # as Hydra reads them: resume=, +resume=, ++resume=, a quoted path
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:
        return  # Hydra refuses the command before it writes anything
    given = next((o.value() for o in reversed(parsed) if o.key_or_group == "resume"), None)
    given = given if isinstance(given, str) else None
    directory = Path(cwd, given) if given else None
    if directory is None or not directory.is_dir():
        return  # nothing to write through (a missing dir is refused once the job opens)
    if links := linked_files(directory):
        shown = ", ".join(str(link.relative_to(directory)) for link in links[:3])
        raise ConfigError(
            "resume",
            given,
            f"a dir without links, symbolic or hard ({directory} has {shown}{', ...' if len(links) > 3 else ''}; "
            "Hydra writes .hydra/ and the job's log into it before fedrun starts: copy the dir with cp -a, not -al)",
        )


def _one_line(func):
    """``func()``; a composition error outside a job is printed as fedrun's one line, exit 2."""
    try:
        return func()
    except (ConfigCompositionException, OverrideParseException) as exc:
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or _inside_a_job(exc):
            raise
        print(f"fedrun: error: {explain(exc, _command_line_overrides())}", file=sys.stderr)
        sys.exit(2)
    except RunFileError as exc:  # the sweeper's own file (a study's journal) became a link while it ran
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"fedrun: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except JobFailed:  # each failed job printed its line as it failed; Hydra re-raises the first at the end
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print("fedrun: some jobs of this sweep failed (each said why above); the others ran", file=sys.stderr)
        sys.exit(1)


def _inside_a_job(exc: BaseException) -> bool:
    """Whether the exception came from a job's own code (Hydra's ``run_job``): its traceback is then kept."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "run_job" and frame.f_globals.get("__name__") == "hydra.core.utils":
            return True
        tb = tb.tb_next
    return False


def _command_line_overrides() -> list[str]:
    """The overrides on the command line, as Hydra's own argument parser reads them."""
    args, _ = hydra_utils.get_args_parser().parse_known_args(sys.argv[1:])
    return list(args.overrides or [])


def explain(exc: BaseException, overrides: list[str]) -> ConfigError:
    """The ConfigError that says ``exc`` in one line: the override's key, its value and what is allowed."""
    message = str(exc)
    parsed = {}
    for text in overrides:
        try:
            parsed[text] = OverridesParser.create().parse_override(text)
        except HydraException as bad:  # the one the grammar refused: say which
            key = re.split(r"[=]", text, maxsplit=1)[0].lstrip("+~")
            value = text.split("=", 1)[1] if "=" in text else text
            reason = str(bad).splitlines()[0]
            return ConfigError(key, value, f"an override in Hydra's grammar, key=value ({reason}; {GRAMMAR})")

    def given(key: str):
        """The value the command line gave ``key`` (as Hydra parsed it), or the override as typed."""
        for text, override in parsed.items():
            if override.key_or_group == key:
                value = override.value()
                return value if isinstance(value, (str, int, float, bool, type(None))) else text.split("=", 1)[-1]
        return None

    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        if exc.options is not None and group:
            # an option of another group (device=trace for devices=trace): say which, after the near misses
            elsewhere = [g for g in _groups() if g != group and option in _options(g)] if "/" not in group else []
            hint = f"; {option} is an option of {' and '.join(elsewhere)}" if 0 < len(elsewhere) <= 2 else ""
            return ConfigError(
                group,
                option,
                f"an option of {group}: {', '.join(sorted(exc.options))}{did_you_mean(option, exc.options)}{hint}",
            )
        return ConfigError("config", exc.missing_cfg_file, f"a config of fedrun ({message.splitlines()[0]})")
    if found := re.match(r"Could not override '([^']+)'", message):
        key = found.group(1)
        allowed = _known_keys(key, [t for t in overrides if parsed[t].key_or_group != key])
        swept = [o.key_or_group for o in parsed.values() if o.is_sweep_override() and o.key_or_group in _groups()]
        if swept:  # Hydra composes a sweep's base without its swept groups (Hydra's defaults stand in for them)
            allowed += (
                f"; in a sweep over {', '.join(swept)}, Hydra first checks every other override against the "
                f"defaults, so a key that only the swept options have is set with ++ (++{key}={given(key)})"
            )
        return ConfigError(key, given(key), allowed)
    if found := re.match(r"Could not append to config\. An item is already at '([^']+)'", message):
        key = found.group(1)
        return ConfigError(
            f"+{key}", given(key), f"{key}=<value> without + ({key} exists; ++{key}=<value> sets it either way)"
        )
    if found := re.match(r"Could not delete from config\. '([^']+)' does not exist", message):
        key = found.group(1)
        others = [t for t in overrides if parsed[t].key_or_group != key]
        return ConfigError(key, f"~{key}", f"~ on a key the config has: {_known_keys(key, others)}")
    if found := re.search(r"Ambiguous value for argument '([^=']+)=", message):
        key = found.group(1).lstrip("+~")
        return ConfigError(
            key, given(key), "one value in a single run (fedrun -m sweeps over a,b; key=[a,b] is a list)"
        )
    if found := re.match(r"Error merging override (\S+?)=", message):
        key, cause = found.group(1).lstrip("+~"), exc.__cause__
        return ConfigError(key, given(key), _wanted_type(cause) if cause is not None else message.splitlines()[0])
    cause = f" ({exc.__cause__})" if isinstance(exc.__cause__, OmegaConfBaseException) else ""
    return ConfigError(
        "overrides", overrides, f"a config Hydra can compose: {message.splitlines()[0]}{cause}".replace("\n", " ")
    )


def _wanted_type(cause: BaseException) -> str:
    """What a typed node takes, from OmegaConf's ValidationError (``Value 'maybe' is not a valid bool``)."""
    text = str(cause).splitlines()[0]
    if found := re.search(r"is not a valid (\w+)", text) or re.search(r"could not be converted to (\w+)", text):
        kind = found.group(1).lower()
        return {"bool": "true or false", "integer": "an integer", "int": "an integer", "float": "a number"}.get(
            kind, f"a {kind}"
        )
    return text


def _known_keys(key: str, others: list[str], top: list[str] | None = None) -> str:
    """What may stand where ``key`` does: a config group (for ``group/option``), else the keys of the node it would
    sit in (with the option chosen for it), and the options of that group that have it. ``top``: the config's own
    top-level keys where the caller has them (a composed run's), so that nothing is composed again."""
    groups = _groups()
    if "/" in key:
        near = did_you_mean(key.partition("/")[0], groups)
        return f"a config group: {', '.join(groups)} (or hydra/<group>){near}"
    parent, _, leaf = key.rpartition(".")
    keys, choices = (top, {}) if top is not None and not parent else _node_keys(parent, others)
    group = parent.replace(".", "/")
    allowed = f"a key of {parent}" if parent else "a key of the config"
    if choices.get(group):
        allowed += f" with {group}={choices[group]}"
    if keys is not None:
        allowed += f" ({', '.join(keys) or 'it has none'})"
    if parent in groups:
        having = [
            f"{parent}={option}" for option, option_keys in sorted(_options(parent).items()) if leaf in option_keys
        ]
        if having:
            allowed += f"; {leaf} is a key of {' and '.join(having)}"
    elif group in choices:  # a group of Hydra's or a plugin's: its options are not files of fedrun's
        allowed += f"; other {group} options have other keys"
    if keys is None and parent in groups:  # the config did not compose (a second bad override): any option's keys
        keys = sorted(set().union(*_options(parent).values()))
    return allowed + did_you_mean(leaf, keys or [])


def did_you_mean(word: str, candidates) -> str:
    """``; did you mean x?`` for the candidates closest to a misspelt ``word`` (difflib's ratio of at least 0.6, at
    most three, closest first), else ``""``."""
    near = difflib.get_close_matches(word, [str(c) for c in candidates if str(c) != word], n=3)
    return f"; did you mean {' or '.join(near)}?" if near else ""


def _groups() -> list[str]:
    """fedrun's config groups: the folders of conf/ (fedrun.conf)."""
    conf = resources.files("fedrun.conf")
    return sorted(p.name for p in conf.iterdir() if p.is_dir() and p.name != "hydra" and not p.name.startswith("_"))


def check_known_keys(cfg, hydra_cfg) -> None:
    """Refuse a new run's top-level key that nothing reads: a key added with ``+`` that is neither a config group
    (fedrun's, or one a ``--config-dir`` added: Hydra's choices) nor a run-level key of conf/config.yaml, nor named
    by an interpolation (``+lr=0.1 optimizer.lr='${lr}'``). A typo there (``+agregator/x=fedavg``) used to run the
    defaults silently. Not for a config read back from a run dir, nor under a primary config of the user's own."""
    if hydra_cfg.job.config_name != "config":
        return
    choices = {str(group).split("/")[0] for group in hydra_cfg.runtime.choices}
    known = choices | set(_groups()) | set(_root_keys()) | _interpolated_roots(cfg)
    for key in cfg:
        if key not in known:
            top = [str(k) for k in cfg if k in known]  # the run's own keys, in the config's order
            raise ConfigError(str(key), _raw(cfg, str(key)), _known_keys(str(key), [], top))


def _interpolated_roots(cfg) -> set[str]:
    """The top-level keys the config's interpolations name (``${lr}``, ``${a.b}``)."""
    found = set()
    stack = [cfg]
    while stack:
        node = stack.pop()
        if node._is_none() or node._is_missing():
            continue
        items = node.items_ex(resolve=False) if OmegaConf.is_dict(node) else enumerate(node)
        for key, _ in items:
            child = node._get_node(key)
            if OmegaConf.is_config(child):
                stack.append(child)
            elif OmegaConf.is_interpolation(node, key):
                found.update(re.findall(r"\$\{(?:[a-z_.]+:)?([A-Za-z_]\w*)", str(child._value())))
    return found


def _root_keys() -> list[str]:
    """The run-level keys of conf/config.yaml (``seed``, ``resume``, ``metrics``, ...)."""
    content = yaml.safe_load(resources.files("fedrun.conf").joinpath("config.yaml").read_text()) or {}
    return [k for k in content if k not in ("defaults", "hydra")]


def _options(group: str) -> dict[str, set]:
    """Each option of a fedrun group and its top-level keys, read from conf/<group>/*.yaml."""
    options = {}
    for path in resources.files("fedrun.conf").joinpath(group).iterdir():
        if path.name.endswith(".yaml"):
            try:
                content = yaml.safe_load(path.read_text()) or {}
            except yaml.YAMLError:
                continue
            options[path.name[: -len(".yaml")]] = set(content) if isinstance(content, dict) else set()
    return options


def _node_keys(parent: str, others: list[str]) -> tuple[list[str] | None, dict]:
    """The keys of ``parent`` in the config composed from the other overrides (None where that fails too: a second
    bad override) and the option chosen for each group."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    try:
        GlobalHydra.instance().clear()  # the failed composition's; fedrun exits after this
        usable = [t for t in others if not OverridesParser.create().parse_override(t).is_sweep_override()]
        with initialize_config_module(config_module="fedrun.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=usable, return_hydra_config=True)
    except Exception:
        return None, {}
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if v is not None}
    node = OmegaConf.select(cfg, parent) if parent else cfg
    keys = [str(k) for k in node.keys() if parent or k != "hydra"] if OmegaConf.is_dict(node) else None
    return keys, choices


def check_resolves(cfg) -> None:
    """Refuse, before any work, a config value that interpolates to nothing (``${nothing}``) or is left ``???``."""
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as exc:
        raise ConfigError(exc.full_key or "config", "???", "a value (??? marks one the config must be given)") from None
    except InterpolationResolutionError as exc:
        key, reason = exc.full_key or "config", str(exc).splitlines()[0]
        raise ConfigError(key, _raw(cfg, key), f"an interpolation to a key the config has ({reason})") from None


# Keys whose doc says they take inf or nan (none today): every other number in a config is finite.
NON_FINITE_KEYS: frozenset[str] = frozenset()


def check_finite(cfg) -> None:
    """Refuse, before any work, an ``inf`` or ``nan`` anywhere in the config (Hydra reads both as floats): no group's
    number means anything at either (a scale, a noise, a temperature, a step), and one left to its constructor trains
    a non-finite model or is accepted. One pass over every key, so a group added later is covered without a check
    of its own; ``NON_FINITE_KEYS`` lists the exceptions, each documented where its key is."""

    def walk(node, key: str):
        if isinstance(node, dict):
            for name, value in node.items():
                yield from walk(value, f"{key}.{name}" if key else str(name))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from walk(value, f"{key}.{i}")
        else:
            yield key, node

    for key, value in walk(OmegaConf.to_container(cfg, resolve=True), ""):
        if isinstance(value, float) and not math.isfinite(value) and key not in NON_FINITE_KEYS:
            raise ConfigError(key, value, "a finite number (inf and nan are refused for every key)")


def _raw(cfg, key: str):
    """``key``'s value as written, before interpolation."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    try:
        return node._get_node(leaf)._value()
    except Exception:
        return key


def check_run_keys(cfg: DictConfig) -> None:
    """The root-level keys that no constructor checks; pure config, so a new run's are checked before torch or
    MLflow is imported (``fedrun.cli.main``), a resumed run's once its saved config is read."""
    check_resolves(cfg)  # an interpolation to nothing or a ??? left unset, named now rather than mid-run
    check_finite(cfg)  # inf and nan, in every group
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or cfg.seed < 0:
        raise ConfigError("seed", cfg.seed, "an integer >= 0")
    targets = cfg.metrics.r_targets
    if not OmegaConf.is_list(targets) or not all(isinstance(t, (int, float)) and 0 < t <= 1 for t in targets):
        raise ConfigError(
            "metrics.r_targets",
            OmegaConf.to_container(targets) if OmegaConf.is_config(targets) else targets,
            "a list of accuracies in (0, 1]",
        )
    swing = cfg.metrics.get("unstable_swing", 0.0)  # a run saved before the key has none
    if isinstance(swing, bool) or not isinstance(swing, (int, float)) or not 0 <= swing <= 1:
        raise ConfigError("metrics.unstable_swing", swing, "an accuracy range in [0, 1]")
    tracking = cfg.tracking
    if not isinstance(tracking.enabled, bool):
        raise ConfigError("tracking.enabled", tracking.enabled, "true or false")
    if not isinstance(tracking.uri, str) or not tracking.uri:
        raise ConfigError(
            "tracking.uri", tracking.uri, "an MLflow tracking URI (sqlite:///path.db, http://host:port, ...)"
        )
    if not isinstance(tracking.experiment, str) or not tracking.experiment:
        raise ConfigError("tracking.experiment", tracking.experiment, "a non-empty experiment name")
    if (
        not isinstance(tracking.max_alpha_series, int)
        or isinstance(tracking.max_alpha_series, bool)
        or tracking.max_alpha_series < 0
    ):
        raise ConfigError("tracking.max_alpha_series", tracking.max_alpha_series, "an integer >= 0")


def fail(hydra_cfg, line: str, code: int) -> typing.NoReturn:
    """Print the one-line reason; exit with ``code``, or in a sweep fail only this job (Hydra runs the rest and
    reports the failed jobs' overrides at the end)."""
    if hydra_cfg.mode == RunMode.MULTIRUN:
        line = line.replace(
            "fedrun: error: ", f"fedrun: error: job {hydra_cfg.job.num} ({hydra_cfg.job.override_dirname}): ", 1
        )
        print(line, file=sys.stderr)
        raise JobFailed(line)
    print(line, file=sys.stderr)
    sys.exit(code)
