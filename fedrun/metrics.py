"""Measurements over whole runs: pure functions of accuracy curves and metrics rows."""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

if typing.TYPE_CHECKING:  # imported by run_summary: a refusal on the way to a run imports this module, not pandas
    import pandas as pd


def r_name(target: float) -> str:
    """The metric name of an R-index target: 0.6 -> ``R60``, 0.925 -> ``R92.5``."""
    return f"R{round(100 * target, 4):g}"


def r_index(rounds: Sequence[int], accuracy: Sequence[float], target: float) -> int | None:
    """The first round (1-based) at which ``accuracy`` reached ``target``, or None if it never did.

    Rounds that were not evaluated carry NaN and are skipped.
    """
    for t, a in zip(rounds, accuracy):
        if not math.isnan(a) and a >= target:
            return int(t)
    return None


def _changes(accuracy: Sequence[float]) -> np.ndarray:
    a = np.asarray([v for v in accuracy if not math.isnan(v)], dtype=np.float64)
    return np.diff(a)


def smoothness(accuracy: Sequence[float]) -> float:
    """std(d) / mean(|d|) of the round-to-round changes d_t = a_{t+1} - a_t of an accuracy curve.

    The papers' "normalised standard deviation of the variations over one round": 0 when every round
    changes accuracy by the same amount, 1 for changes of equal size and alternating sign, larger when a
    few big jumps or drops dominate (an unstable curve). NaN with fewer than two changes or when the
    curve never moves. Unevaluated (NaN) points are skipped.
    """
    d = _changes(accuracy)
    if len(d) < 2 or not np.any(d):
        return math.nan
    return float(np.std(d) / np.mean(np.abs(d)))


def lag1_autocorr(accuracy: Sequence[float]) -> float:
    """Lag-one autocorrelation of the changes d_t = a_{t+1} - a_t: sum (d_t - m)(d_{t+1} - m) / sum (d_t - m)^2.

    In [-1, 1]: negative when rises and drops alternate (oscillation), positive when changes persist.
    NaN with fewer than three changes or constant changes.
    """
    d = _changes(accuracy)
    if len(d) < 3:
        return math.nan
    centred = d - d.mean()
    denominator = float(np.sum(centred**2))
    return float(np.sum(centred[:-1] * centred[1:]) / denominator) if denominator > 0 else math.nan


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Mean and half-width of its Student-t confidence interval (n - 1 degrees of freedom).

    The half-width is NaN for a single value.
    """
    from scipy.stats import t

    x = np.asarray(values, dtype=np.float64)
    if len(x) == 0:
        return math.nan, math.nan
    if len(x) == 1:
        return float(x[0]), math.nan
    half = t.ppf(0.5 + confidence / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return float(x.mean()), float(half)


TAIL = 10  # schedule.tail's default: the final rounds a run is judged on (docs/explanation/verdicts.md)
UNSTABLE_SWING = 0.1  # metrics.unstable_swing's default: a tail swing above it tags the run ``unstable``
# The accuracies judged on their tail: (row column, summary name). The personal ones are every client's own model.
TAILED = (
    ("test_accuracy", "test_accuracy"),
    ("val_accuracy", "val_accuracy"),
    ("client_accuracy", "client_accuracy"),
    *((f"personal/accuracy_{s}", f"personal_accuracy_{s}") for s in ("mean", "weighted", "p10", "min")),
)


FAIRNESS = ("mean", "min", "max", "worst10", "best10", "p10", "p90", "variance", "jain", "left_behind")
LEFT_BEHIND = 0.8  # a client is left behind below this fraction of the clients' mean accuracy
DECILE = 0.1  # worst10 and best10: the mean over this share of the clients (rounded up, at least one)


def fairness(accuracy: np.ndarray, counts: np.ndarray) -> dict:
    """How evenly per-client test accuracies (clients without a held-out sample left out) are spread, the measures of
    the fair-FL papers: their mean, worst and best; ``worst10`` and ``best10``, the mean accuracy of the worst and
    the best tenth of the clients (q-FFL's Table 1 columns "Worst 10%" and "Best 10%", the average over the worst
    and best 10% of devices; a tenth of n rounded up, so that 5 clients still have a worst client); the 10th and 90th
    percentiles (those tenths' boundaries); the variance (q-FFL's, the population variance); Jain's index
    (sum a)^2 / (n sum a^2) (1 when every client is equal, 1/n when one client holds all of it; Li et al. 2020 use
    it too) and ``left_behind``, the share of clients below ``LEFT_BEHIND`` (80%) of the mean accuracy: a count of
    the clients the federation leaves behind that, like Jain's index, does not depend on the task's scale of
    accuracy (a fixed threshold would say nothing of a 10-class and a 62-class task alike)."""
    accuracy = np.asarray(accuracy)[np.asarray(counts) > 0]
    if not len(accuracy):
        return dict.fromkeys(FAIRNESS, math.nan)
    mean, squares = float(accuracy.mean()), float((accuracy**2).sum())
    ordered, tenth = np.sort(accuracy), math.ceil(DECILE * len(accuracy))  # the sums above in the clients' order
    return {
        "mean": mean,
        "min": float(ordered[0]),
        "max": float(ordered[-1]),
        "worst10": float(ordered[:tenth].mean()),
        "best10": float(ordered[-tenth:].mean()),
        "p10": float(np.percentile(accuracy, 10)),
        "p90": float(np.percentile(accuracy, 90)),
        "variance": float(accuracy.var()),
        "jain": float(accuracy.sum() ** 2 / (len(accuracy) * squares)) if squares > 0 else math.nan,
        "left_behind": float((accuracy < LEFT_BEHIND * mean).mean()),
    }


# The fairness measures judged on their tail too (summary ``tail_fairness_<s>``), but never tagged unstable: a swing
# of a variance or of Jain's index is no accuracy's.
FAIR_TAILED = tuple((f"fairness/{s}", f"fairness_{s}") for s in FAIRNESS)


def tail(rounds: Sequence[int], values: Sequence[float], window: int) -> tuple[float, float, int]:
    """A curve judged on its tail: the mean and the swing (max - min) of its evaluated values (NaN: not evaluated,
    skipped) over the final ``window`` rounds, those after ``last round - window``, and how many values that is.
    (NaN, NaN, 0) when none of them was evaluated. A period-2 oscillation between 0.05 and 0.91 has a tail mean near
    0.48 and a swing of 0.86, where its last round alone says 0.05 or 0.91 by the parity of the round count."""
    rounds, values = np.asarray(rounds, dtype=np.int64), np.asarray(values, dtype=np.float64)
    if not len(rounds):
        return math.nan, math.nan, 0
    kept = values[(rounds > rounds.max() - window) & ~np.isnan(values)]
    if not len(kept):
        return math.nan, math.nan, 0
    return float(kept.mean()), float(kept.max() - kept.min()), len(kept)


def tail_summary(metrics: pd.DataFrame, window: int, threshold: float) -> tuple[dict, dict]:
    """``tail_<name>`` and ``tail_<name>_swing`` of each accuracy in ``TAILED`` the rows have (``tail``), and the
    tag ``unstable`` naming those whose swing exceeds ``threshold`` (absent when none does). Returns (metrics, tags)."""
    values, unstable = {}, []
    groups = [(c, c) for c in metrics.columns if str(c).startswith("accuracy/")]  # the async engine's speed groups
    for column, name in (*TAILED, *FAIR_TAILED, *groups):
        if column not in metrics:
            continue
        mean, swing, count = tail(metrics["round"], metrics[column], window)
        if not count:
            continue
        values[f"tail_{name}"], values[f"tail_{name}_swing"] = mean, swing
        if swing > threshold and (column, name) not in FAIR_TAILED:
            unstable.append(column)
    return values, ({"unstable": ",".join(unstable)} if unstable else {})


def unstable_line(values: dict, tags: dict, window: int) -> str | None:
    """The line a run ends with when its tail swings (tag ``unstable``): what ranged how far, and the tail mean the
    reports use; None for a stable run."""
    if not tags.get("unstable"):
        return None
    parts = []
    for column in tags["unstable"].split(","):
        name = dict(TAILED).get(column, column)
        if f"tail_{name}" in values:
            parts.append(
                f"{column} swung by {values[f'tail_{name}_swing']:.3f} (tail mean {values[f'tail_{name}']:.4f})"
            )
    return (
        f"fedrun: unstable over its last {window} rounds: {'; '.join(parts)}. Its final round alone misdescribes it; "
        "fedrun-report uses the tail mean (docs/explanation/verdicts.md)"
    )


R_INDEX = re.compile(
    r"^(?P<client>client_)?R(?P<target>\d+(\.\d+)?)(?P<time>_time|_mb)?$"
)  # R60, client_R60, R60_time, R60_mb
# Quantities that cannot be negative though nothing bounds them above: megabytes, seconds, an epsilon, a relative
# deviation, the smoothness std(d) / mean(|d|).
NON_NEGATIVE = re.compile(r"(_mb|_mb_total|_s|_wall_s)$|epsilon|^attack/deviation|^smoothness$")


def bounds(name: str, rounds: float = math.inf) -> tuple[float, float] | None:
    """The range a metric's values lie in, by its name: [0, 1] for an accuracy, a share or a fraction (and an
    accuracy's tail swing) and for the fairness measures of the clients' accuracies but their variance, [0, 1/4],
    [-1, 1] for a lag-one autocorrelation, [0, 2] for the L1 distance between two weight vectors; [1, ``rounds``]
    for an R-index in rounds (a round number of a run of at most ``rounds`` rounds), [0, inf) for one in time or
    megabytes and for the other quantities that cannot be negative (``NON_NEGATIVE``); None for any other."""
    plain = name.removeprefix("metrics.")
    if (r := R_INDEX.match(plain)) is not None:
        return (0.0, math.inf) if r["time"] else (1.0, rounds)
    if "accuracy" in plain or "share" in plain or plain.endswith("_fraction"):
        return (0.0, 1.0)
    if plain.startswith(("fairness/", "tail_fairness_")):  # accuracies' statistics; a variance of [0, 1] values
        return (0.0, 0.25) if "variance" in plain else (0.0, 1.0)  # is at most 1/4 (half at 0, half at 1)
    if plain == "lag1_autocorr":
        return (-1.0, 1.0)
    if plain.startswith("alpha_distance"):
        return (0.0, 2.0)
    if NON_NEGATIVE.search(plain):
        return (0.0, math.inf)
    return None


SHOWN_SEEDS = 5  # below this many runs a cell shows each run's value beside the mean
SPLIT = 0.5  # seeds whose range exceeds this share of the quantity's range disagree in kind: the cell is ``split``


@dataclass(frozen=True)
class Interval:
    """A mean over runs and its 95% interval [lo, hi] within the quantity's range (``bounded_ci``), the runs'
    values (in the order given) and whether they disagree in kind (``split``)."""

    mean: float
    lo: float
    hi: float
    values: tuple[float, ...]
    split: bool = False

    @property
    def cut(self) -> bool:
        """Whether the range cut the Student-t interval (it is then not mean ± a half-width)."""
        return not math.isclose(self.mean - self.lo, self.hi - self.mean, rel_tol=1e-9, abs_tol=1e-12)

    def cell(self, digits: int | str = 3, brackets: bool = False) -> str:
        """``0.874 ± 0.016``; ``0.281 [0.000, 1.000]`` where the range cut the interval; the runs' values after it
        when there are fewer than ``SHOWN_SEEDS``; ``split`` first when they disagree in kind (and their range when
        they are not all shown). ``digits``: decimals, or a format spec (``".3g"``); ``brackets``: ``[low, high]``
        even when uncut (an interval that is not the plain t interval of the mean printed beside it)."""
        if math.isnan(self.mean):
            return "-"
        f = f"{{:.{digits}f}}" if isinstance(digits, int) else f"{{:{digits}}}"
        if math.isnan(self.lo):
            text = f.format(self.mean)
        elif self.cut or brackets:
            text = f"{f.format(self.mean)} [{f.format(self.lo)}, {f.format(self.hi)}]"
        else:
            text = f"{f.format(self.mean)} ± {f.format(self.hi - self.mean)}"
        values = [v for v in self.values if not math.isnan(v)]
        if 1 < len(values) < SHOWN_SEEDS:
            text += " (" + ", ".join(f.format(v) for v in values) + ")"
        elif self.split:
            text += f" ({f.format(min(values))}–{f.format(max(values))})"
        return ("split " if self.split else "") + text

    def columns(self, name: str) -> dict:
        """The interval as a table row's columns ``<name>_lo``, ``_hi``, ``_split`` and ``_values`` (each run's value,
        exact: ties are judged on them); the mean is the table's own column."""
        return {
            f"{name}_lo": self.lo,
            f"{name}_hi": self.hi,
            f"{name}_split": self.split,
            f"{name}_values": " ".join(repr(float(v)) for v in self.values),
        }

    @classmethod
    def from_row(cls, row, name: str, mean: str | None = None) -> Interval:
        """The interval a table row holds for ``name`` (``columns``), its mean in ``<name>_mean`` (or ``mean``)."""
        text = row.get(f"{name}_values")
        values = tuple(float(v) for v in text.split()) if isinstance(text, str) else ()
        centre = row[mean or f"{name}_mean"]
        return cls(centre, row[f"{name}_lo"], row[f"{name}_hi"], values, bool(row[f"{name}_split"]))


def within(lo: float, hi: float, bound: tuple[float, float] | None) -> tuple[float, float]:
    """[lo, hi] intersected with ``bound``, the range the quantity lies in (None: unbounded)."""
    return (lo, hi) if bound is None else (max(lo, bound[0]), min(hi, bound[1]))


def bounded_ci(
    values: Sequence[float], bound: tuple[float, float] | None = (0.0, 1.0), confidence: float = 0.95
) -> Interval:
    """The mean of ``values`` (NaN dropped) and its Student-t interval (``mean_ci``) intersected with ``bound``, the
    range the quantity lies in (None: unbounded). The true mean lies in that range, so the intersection covers it
    whenever the t interval does: the cut keeps the t interval's coverage and never reports a value the quantity
    cannot take (docs/explanation/verdicts.md says why this and not a logit or bootstrap interval). ``split``: the
    values span more than ``SPLIT`` of the range (with a bound), seeds that disagree in kind (a model that
    oscillates, a run that failed)."""
    x = np.asarray([v for v in values if not math.isnan(v)], dtype=np.float64)
    mean, half = mean_ci(x, confidence)
    lo, hi = (math.nan, math.nan) if math.isnan(half) else within(mean - half, mean + half, bound)
    split = bound is not None and len(x) > 1 and float(x.max() - x.min()) > SPLIT * (bound[1] - bound[0])
    return Interval(mean, lo, hi, tuple(float(v) for v in values), split)


def summarise(
    metrics: pd.DataFrame, r_targets: Sequence[float], window: int = TAIL, threshold: float = UNSTABLE_SWING
) -> tuple[dict, dict]:
    """Metrics and tags that summarise a run from its rows so far: rounds and time, megabytes uploaded
    (``upload_mb_total``), final and best test accuracy, each accuracy judged on its tail (``tail_summary``: the
    mean and swing over the final ``window`` rounds, the tag ``unstable`` past ``threshold``), the R-index of each target (and ``R90_mb``, the
    megabytes uploaded until it) (for the clients' local models too, and in virtual time for an
    asynchronous run; the tag ``R90=not_reached`` when a target was not reached), the curve's stability, and under
    an attack the attackers' mean weight and cohort share (``attack/weight_share_mean``, ``attack/cohort_share_mean``)
    and the mean relative deviation they caused (``attack/deviation_mean``),
    and with privacy the epsilon spent (``final_epsilon``). NaN values are left out."""
    values, tags = {"rounds_run": len(metrics), "total_wall_s": float(metrics["round_wall_s"].sum())}, {}
    uploaded = metrics["upload_mb"].cumsum() if "upload_mb" in metrics else None  # megabytes sent up so far
    if uploaded is not None and len(uploaded):
        values["upload_mb_total"] = float(uploaded.iloc[-1])
    accuracy = metrics["test_accuracy"].dropna()
    if len(accuracy):
        values["final_test_accuracy"], values["best_test_accuracy"] = float(accuracy.iloc[-1]), float(accuracy.max())
    if "epsilon" in metrics and metrics["epsilon"].notna().any():  # what the run spent, in the summary a reader opens
        values["final_epsilon"] = float(metrics["epsilon"].dropna().iloc[-1])
    for column, name in (("devices_dropped", "devices_dropped_total"), ("round_failed", "rounds_failed")):
        if column in metrics:  # devices with a deadline: clients too late to report, rounds with too few reports
            values[name] = float(metrics[column].sum())
    for column in ("attack/weight_share", "attack/cohort_share", "attack/deviation"):  # means over the rounds run
        if column in metrics and metrics[column].notna().any():
            values[column + "_mean"] = float(metrics[column].mean())
    tailed, tail_tags = tail_summary(metrics, window, threshold)
    values.update(tailed)
    tags.update(tail_tags)
    values["smoothness"] = smoothness(metrics["test_accuracy"])
    values["lag1_autocorr"] = lag1_autocorr(metrics["test_accuracy"])
    for column, prefix in (("test_accuracy", ""), ("client_accuracy", "client_")):
        if column not in metrics:
            continue
        for target in r_targets:
            reached = r_index(metrics["round"], metrics[column], target)
            if reached is None:
                tags[prefix + r_name(target)] = "not_reached"
                continue
            values[prefix + r_name(target)] = reached
            if uploaded is not None:  # the R-index's communication twin: megabytes uploaded until the target
                values[prefix + r_name(target) + "_mb"] = float(uploaded[metrics["round"] == reached].iloc[0])
            if "virtual_time" in metrics:  # asynchronous runs: the R-index in virtual time too
                values[prefix + r_name(target) + "_time"] = float(
                    metrics.loc[metrics["round"] == reached, "virtual_time"].iloc[0]
                )
    personal, personal_tags = personal_summary(metrics, r_targets)
    values.update(personal)
    tags.update(personal_tags)
    return {k: v for k, v in values.items() if not math.isnan(v)}, tags


PERSONAL_STATISTICS = ("mean", "weighted", "p10", "min")


def personal_summary(metrics: pd.DataFrame, r_targets: Sequence[float]) -> tuple[dict, dict]:
    """The per-client judging of a run (``personal/`` columns, ``fedrun.engine.Judge``) in three readings, each
    of the four statistics (mean, weighted, p10, min) of the clients' test accuracies:

    - ``personal/final_accuracy_<s>``: at the last evaluated round;
    - ``personal/selected_accuracy_<s>`` at ``personal/selected_round``, the first round of highest sample-weighted
      validation accuracy (``dataset.client_val_fraction``; the test split never chooses);
    - ``personal/best_on_test_accuracy_<s>`` at ``personal/best_on_test_round``, the first round of highest
      sample-weighted *test* accuracy: PFLlib's reported figure (its best round on the test split), optimistic by
      construction, kept to compare with it.

    And ``personal/R60``, ``personal/R90``: the first round the clients' mean accuracy reached each target (the tag
    ``personal/R90=not_reached`` when it never did). Returns (metrics, tags)."""
    if "personal/accuracy_weighted" not in metrics:
        return {}, {}
    judged = metrics[metrics["personal/accuracy_weighted"].notna()]
    if not len(judged):
        return {}, {}
    values, tags = {}, {}

    def at(reading: str, row) -> None:
        for s in PERSONAL_STATISTICS:
            values[f"personal/{reading}_accuracy_{s}"] = float(row[f"personal/accuracy_{s}"])

    at("final", judged.iloc[-1])
    best = judged.loc[judged["personal/accuracy_weighted"].idxmax()]  # idxmax: the first of equal maxima
    at("best_on_test", best)
    values["personal/best_on_test_round"] = int(best["round"])
    validation = judged["personal/val_accuracy_weighted"] if "personal/val_accuracy_weighted" in judged else None
    if validation is not None and validation.notna().any():
        chosen = judged.loc[validation.idxmax()]
        at("selected", chosen)
        values["personal/selected_round"] = int(chosen["round"])
        values["personal/selected_val_accuracy_weighted"] = float(chosen["personal/val_accuracy_weighted"])
    for target in r_targets:
        reached = r_index(metrics["round"], metrics["personal/accuracy_mean"], target)
        if reached is None:
            tags["personal/" + r_name(target)] = "not_reached"
        else:
            values["personal/" + r_name(target)] = reached
    return values, tags


def run_summary(
    rows: list[dict],
    r_targets: Sequence[float],
    measured: dict | None = None,
    window: int = TAIL,
    threshold: float = UNSTABLE_SWING,
) -> tuple[dict, dict]:
    """The run's summary, computed once when it closes (finished, failed or stopped): ``summarise`` of every row
    logged so far (those before a resume too), with the engine's own run-level metrics (``measured``, e.g. the
    asynchronous engine's fairness; NaN left out) added. Returns (metrics, tags)."""
    import pandas as pd

    values, tags = summarise(pd.DataFrame(rows), r_targets, window, threshold) if rows else ({}, {})
    values.update({k: v for k, v in (measured or {}).items() if not math.isnan(v)})
    return values, tags


def natural(value) -> tuple:
    """Sorts numbers as numbers ("3" before "10"), then any other value as text."""
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))


def by_seed(group: pd.DataFrame) -> pd.DataFrame:
    """A group of runs in seed order (numbers as numbers), the order a table cell lists their values in."""
    if "params.seed" not in group:
        return group
    return group.iloc[sorted(range(len(group)), key=lambda i: natural(group["params.seed"].iloc[i]))]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of text cells, for the reports."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows]) + "\n"
