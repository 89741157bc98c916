"""fedrun's grid sweeper: ``hydra/sweeper=grid``, Hydra's basic sweeper (the cartesian product of the swept
overrides, launched by the configured launcher) with jobs that are known to be equal run once.

``hydra.sweeper.collapse`` lists rules. A job whose overrides give every value of a rule's ``when`` becomes the job
with the rule's ``becomes`` overrides set and its ``drop`` keys removed; a job equal to one earlier in the product
is then left out. ``sweep=robustness`` uses it for the cells without attackers: an attack with ``attack.count=0`` is
the run without attack, exactly (``tests/config/test_attacks.py``), so every attack's f = 0 job is the one job
``attack=none`` instead of five equal runs. ``hydra.sweeper.exclude`` lists jobs that cannot run: a job whose
overrides give every value of a rule's ``when`` is left out, and the rule's ``why`` printed (``sweep=robustness``:
bucketing in pairs leaves 10 rows of 20 clients, and a rule told f = 6 needs more than 12: the run would be refused).
Exclusions apply to the product before the collapse rules (a ``when`` matches the overrides as swept). The sweep says
how many jobs it left out and why before it launches.
Hydra's basic sweeper has no such filter (hydra-core 1.3: ``BasicSweeper.split_arguments`` is a plain product).
"""

from dataclasses import dataclass, field
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore

TARGET = "hydra_plugins.fedrun_grid_sweeper.grid_sweeper.FedrunGridSweeper"


@dataclass
class FedrunGridSweeperConf:
    _target_: str = TARGET
    max_batch_size: Any = None
    params: Any = None
    collapse: Any = field(default_factory=list)  # [{when: {key: value}, becomes: {key: value}, drop: [key]}]
    exclude: Any = field(default_factory=list)  # [{when: {key: value}, why: text}]


ConfigStore.instance().store(group="hydra/sweeper", name="grid", node=FedrunGridSweeperConf, provider="fedrun")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _value(override: str) -> str:
    return override.split("=", 1)[1] if "=" in override else ""


def _plain(value) -> str:
    """A rule's value as an override writes it: 0 -> '0', true -> 'true', null -> 'null'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def collapsed(jobs: list[list[str]], rules: list[dict]) -> tuple[list[list[str]], int]:
    """``jobs`` (each a list of ``key=value`` overrides) with every rule applied and repeats left out, in order;
    and how many were left out."""
    kept, seen = [], set()
    for job in jobs:
        for rule in rules:
            values = {_key(o): _value(o) for o in job}
            if all(values.get(str(k)) == _plain(v) for k, v in (rule.get("when") or {}).items()):
                drop = {str(k) for k in rule.get("drop") or []}
                becomes = {str(k): _plain(v) for k, v in (rule.get("becomes") or {}).items()}
                job = [o for o in job if _key(o) not in drop and _key(o) not in becomes]
                job += [f"{k}={v}" for k, v in becomes.items()]
        signature = tuple(sorted(job))
        if signature not in seen:
            seen.add(signature)
            kept.append(job)
    return kept, len(jobs) - len(kept)


def _matches(job: list[str], when: dict) -> bool:
    values = {_key(o): _value(o) for o in job}
    return all(values.get(str(k)) == _plain(v) for k, v in (when or {}).items())


def excluded(jobs: list[list[str]], rules: list[dict]) -> tuple[list[list[str]], list[tuple[int, str]]]:
    """``jobs`` without those a rule's ``when`` matches, in order; and per rule that matched, (jobs, its ``why``)."""
    kept, counts = [], [0] * len(rules)
    for job in jobs:
        hit = next((i for i, rule in enumerate(rules) if _matches(job, rule["when"])), None)
        if hit is None:
            kept.append(job)
        else:
            counts[hit] += 1
    return kept, [(n, rules[i].get("why", "")) for i, n in enumerate(counts) if n]


def check_excludes(rules) -> list[dict]:
    """The exclude rules as plain dicts, or one line naming what is wrong."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(rules, resolve=True) if OmegaConf.is_config(rules) else rules
    if not isinstance(plain, list) or not all(
        isinstance(r, dict) and r.get("when") and not set(r) - {"when", "why"} for r in plain
    ):
        raise ValueError(f"hydra.sweeper.exclude={plain!r}: a list of {{when: {{key: value}}, why: text}}")
    return plain


def check_rules(rules) -> list[dict]:
    """The rules as plain dicts, or one line naming what is wrong."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(rules, resolve=True) if OmegaConf.is_config(rules) else rules
    if not isinstance(plain, list) or not all(isinstance(r, dict) for r in plain):
        raise ValueError(
            f"hydra.sweeper.collapse={plain!r}: a list of {{when: {{...}}, becomes: {{...}}, drop: [...]}}"
        )
    for rule in plain:
        unknown = set(rule) - {"when", "becomes", "drop"}
        if unknown or not rule.get("when"):
            raise ValueError(
                f"hydra.sweeper.collapse rule {rule!r}: needs `when` (key: value) and takes only when, becomes, drop"
            )
    return plain


class FedrunGridSweeper(BasicSweeper):
    """The basic sweeper with ``collapse`` rules (the module's docstring)."""

    def __init__(self, max_batch_size=None, params=None, collapse=(), exclude=()):
        # BasicSweeper.__init__'s own state, set here: Hydra's plugin scan may load basic_sweeper a second time, and
        # its ``super(BasicSweeper, self)`` then names another class than the one this derives from
        self.overrides, self.batch_index, self.max_batch_size = None, 0, max_batch_size
        self.params = dict(params or {})
        self.hydra_context = self.config = self.launcher = None
        self.collapse = check_rules(collapse or [])
        self.exclude = check_excludes(exclude or [])

    def split_arguments(self, overrides, max_batch_size):  # Hydra calls it on the instance: self.split_arguments
        jobs = [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]
        jobs, dropped = excluded(jobs, self.exclude)
        for count, why in dropped:
            print(f"fedrun: sweep: {count} jobs left out by hydra.sweeper.exclude: {why}")
        kept, left_out = collapsed(jobs, self.collapse)
        if left_out:
            print(
                f"fedrun: sweep: {len(jobs)} jobs, {left_out} equal to another by hydra.sweeper.collapse: {len(kept)} run"
            )
        if max_batch_size is None:
            return [kept]
        return [kept[i : i + max_batch_size] for i in range(0, len(kept), max_batch_size)]
