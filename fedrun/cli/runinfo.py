"""What a run is called and how it describes itself in MLflow: its name, its description, the git commit."""

import math
import re
import subprocess
from pathlib import Path

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from fedrun.datasets import SCALE_NAMES
from fedrun.tracking import CONFIG_GROUPS, flatten


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


FEATURE_GROUPS = (
    "method", "client", "personalization", "privacy", "compression", "attack", "sampler", "heterogeneity", "engine",
)  # fmt: skip
QUIET_CHOICES = ("none", "uniform", "sync", "sgd")  # the defaults: nothing to say


def run_name(choices: dict, overrides, seed: int, varying: frozenset[str] = frozenset()) -> str:
    """A short run name that says what the run is and what differs: the aggregator, partition and dataset
    chosen, each feature that ran (``FEATURE_GROUPS`` not at their defaults), each overridden value by its last key
    (paths, tracking, Hydra and device keys left out), and the seed; e.g. ``fedsoftmax shards mnist temperature=0.1
    seed=2``, ``fedavg iid digits central noise_multiplier=0.8 seed=0``. In a sweep the keys it ``varying`` and
    the seed come first (``temperature=0.1 seed=2 fedsoftmax shards mnist``): MLflow's runs table cuts names at
    about 15-20 characters, and what tells a sweep's jobs apart must be within them. The whole override string is
    the tag ``overrides``."""
    given = []  # (key, word) for each override of the command line that says something about the run
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.split(".")[0].split("/")[0] in ("tracking", "hydra", "device", "resume", "seed") or "/" in value:
            continue  # the seed is said last (or first in a sweep); paths and where it ran say nothing about the run
        given.append((key, f"{key.rsplit('.', 1)[-1]}={value}" if "." in key else value))
    chosen = {key for key, _ in given if "." not in key}
    words = [choices.get(group) for group in ("aggregator", "partition", "dataset") if choices.get(group)]
    # a feature that ran says so (``central``, ``topk``, ``sign_flip``): a run is not named as plain FedAvg
    words += [choices[group] for group in FEATURE_GROUPS if choices.get(group) not in (None, *QUIET_CHOICES)]
    words += [word for key, word in given if "." in key]
    if varying:
        lead = [word for key, word in given if key in varying] + [f"seed={seed}"]
        words = lead + [w for w in words if w not in lead] + [w for k, w in given if k in chosen and w not in words]
    else:
        words.append(f"seed={seed}")
    return " ".join(dict.fromkeys(words))[:250]


def swept_keys(sweep_dir: Path, sweeper_params) -> frozenset[str]:
    """The keys a sweep varies: each given more than one value on its command line (as Hydra wrote it in the sweep
    dir's ``multirun.yaml`` before any job started; read as plain YAML) or searched by its sweeper
    (``hydra.sweeper.params``). The seed counts as varying when swept."""
    keys = set(sweeper_params or {})
    try:
        saved = yaml.safe_load((Path(sweep_dir) / "multirun.yaml").read_text())
        task = saved["hydra"]["overrides"]["task"]
        parsed = OverridesParser.create().parse_overrides([str(t) for t in task])
    except Exception:  # no file (a launcher that writes none), or not Hydra's: the sweeper's params alone
        return frozenset(keys)
    keys.update(o.key_or_group for o in parsed if o.is_sweep_override())
    return frozenset(keys)


def description(cfg: DictConfig, choices: dict, overrides: str, output_dir: Path) -> str:
    """The run's description in the MLflow UI (markdown): each config group's choice and its values, the
    overrides, the seed and the output dir."""
    scale = f" ({SCALE_NAMES[cfg.dataset.scale]})" if "scale" in cfg.dataset else ""
    lines = [
        f"**{choices.get('aggregator', '')}** on **{choices.get('dataset', '')}**{scale}, partition **{choices.get('partition', '')}**, "
        f"seed {cfg.seed}",
        "",
    ]
    for group in CONFIG_GROUPS:
        node = cfg.get(group)
        if not isinstance(node, DictConfig):
            continue
        values = ", ".join(
            f"{k}={v}" for k, v in flatten(OmegaConf.to_container(node, resolve=True)).items() if not k.startswith("_")
        )
        lines.append(f"- {group}: `{choices.get(group, '')}` {values}")
    lines += ["", f"Overrides: `{overrides}`", "", f"Output: `{output_dir}`"]
    return "\n".join(lines)


def found(values: dict, tags: dict, planned: int, status: str, why: str | None = None) -> list[str]:
    """What a run found, in a line or two for its end (``values`` and ``tags``: its summary, ``run_summary``): the
    test accuracy at the last round and over the tail (its swing), the best and its round, the R-indices reached
    and not, the clients' personal or fairness headline where measured, the epsilon spent, and why it stopped when
    it stopped before its last round (a privacy budget, a stop at an accuracy, a signal, a divergence)."""
    parts = []
    if "final_test_accuracy" in values:
        accuracy = f"test accuracy {values['final_test_accuracy']:.4f} at round {values.get('rounds_run', '?')}"
        if "tail_test_accuracy" in values:
            accuracy += (
                f", {values['tail_test_accuracy']:.4f} over the tail (swing {values['tail_test_accuracy_swing']:.4f})"
            )
        parts.append(accuracy + f", best {values['best_test_accuracy']:.4f}")
    reached = [  # in rounds, and in virtual seconds where the run has a clock (devices, the asynchronous engine)
        f"{k} {int(v)}" + (f" ({values[k + '_time']:.4g} s)" if k + "_time" in values else "")
        for k, v in values.items()
        if re.fullmatch(r"R\d+", k)
    ]
    missed = [k for k, v in tags.items() if re.fullmatch(r"R\d+", k) and v == "not_reached"]
    if reached or missed:
        parts.append(", ".join(reached + [f"{k} not reached" for k in missed]))
    if "tail_personal_accuracy_mean" in values:
        parts.append(
            f"clients' own models {values['tail_personal_accuracy_mean']:.4f} on their test splits over the tail "
            f"(worst client {values.get('tail_personal_accuracy_min', math.nan):.4f})"
        )
    if "tail_fairness_worst10" in values:
        parts.append(f"the worst tenth of the clients {values['tail_fairness_worst10']:.4f}")
    if "final_epsilon" in values:
        parts.append(f"epsilon {values['final_epsilon']:.3g} spent")
    if values.get("rounds_failed"):  # devices with a deadline: rounds that aggregated nothing
        parts.append(f"{int(values['rounds_failed'])} rounds failed (fewer than devices.min_reports reports in time)")
    ran = int(values.get("rounds_run", 0))
    line = f"fedrun: {status.lower()} after {ran} of {planned} rounds" + (": " + "; ".join(parts) if parts else "")
    stop = tags.get("stopped_by") or why
    return [line] + ([f"fedrun: stopped before its last round: {stop}"] if stop and ran < planned else [])
