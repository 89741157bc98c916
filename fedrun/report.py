"""``fedrun-report``: compare the runs of an MLflow experiment in a table with confidence intervals.

Runs are grouped by every config key that varies across them except ``seed`` (or by ``--group-by``).
For each group: the number of runs, mean +/- 95% Student-t interval of each R-index over the runs that
reached it ("reached k/n"), the censored median of each R-index (runs that never reached the target count
as infinitely late; "> N" when fewer than half reached it within their N rounds), final and best test
accuracy, smoothness, and any other metric named with ``--metrics`` (its last logged value, e.g.
``accuracy/slow weight_share/slow`` of an asynchronous run). Writes ``report.md``, ``report.csv`` and
``accuracy.png`` (mean test accuracy per round with its interval band per group), and a band plot for each
further metric named with ``--plot`` (``accuracy_slow.png`` for ``accuracy/slow``). ``--versus KEY`` also plots
final test accuracy against a numeric config key (a privacy-utility curve against ``privacy.target_epsilon``).
"""

import argparse
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from fedrun.metrics import (
    FAIRNESS,
    R_INDEX,
    TAIL,
    Interval,
    bounded_ci,
    bounds,
    by_seed,
    fairness,
    markdown_table,
    mean_ci,
    natural,
    tail,
)
from fedrun.tracking import (
    CONFIG_GROUPS,
    DEFAULT_URI,
    HEADLINE_PLAIN,
    SECTION,
    experiment_names,
    find_experiment,
    metric_history,
    open_client,
    per_client_table,
    plain_name,
    resolve_uri,
    search_runs,
    stored_names,
)

IGNORED_PARAMS = ("seed", "tracking.", "hydra.")
META_GROUPS = ("experiment", "method", "defence")  # config groups whose options choose options of other groups
SWEEP_TAG = "tags.fedrun.role"  # "sweep" on a sweep's parent run, "trial" on a study's trial: not runs of their own
TRIAL_TAG = "tags.fedrun.trial"  # a study's seed run: its trial (``--group-by trial``)
# The run judged on its tail first (the mean over its final schedule.tail rounds, and how far it swung there); the
# final round alone after it, labelled as such.
SUMMARY = (
    "tail_test_accuracy",
    "tail_test_accuracy_swing",
    "final_test_accuracy",
    "best_test_accuracy",
    "smoothness",
    "lag1_autocorr",
)


# OWASP's rule against CSV injection (https://owasp.org/www-community/attacks/CSV_Injection): a spreadsheet runs a cell
# that begins with = + - @ (or a tab or carriage return) as a formula; such a cell gets a leading single quote, so
# that it is shown as the text it is. A number stays a number: -0.5 or 1e-3 is not escaped (nor is a number column).
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
PLAIN_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def csv_cell(value):
    """``value``, with a leading ``'`` when it is text a spreadsheet would run as a formula (``FORMULA_START``)."""
    if isinstance(value, str) and value.startswith(FORMULA_START) and not PLAIN_NUMBER.fullmatch(value):
        return "'" + value
    return value


def csv_safe(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with every text cell and column name passed through ``csv_cell``, for ``to_csv``."""
    safe = table.rename(columns=csv_cell)
    for column in safe.columns:
        if not pd.api.types.is_numeric_dtype(safe[column]):  # text (object, string or category): numbers are safe
            safe[column] = safe[column].astype(object).map(csv_cell)
    return safe


def with_plain_names(runs: pd.DataFrame) -> pd.DataFrame:
    """One column per metric under its plain name (``metrics.test_accuracy``), whether the run logged it under its
    MLflow section (``0_main/test_accuracy``, ``5_summary/final_test_accuracy``: ``fedrun.tracking.mlflow_name``)
    or, stored before sections, without."""
    moved = [c for c in runs.columns if c.startswith("metrics.") and SECTION.match(c[len("metrics.") :])]
    # a run resumed across a rename (``fedrun.tracking.FORMER``) has both names: the current one, written last, wins
    moved.sort(key=lambda c: c[len("metrics.") :] in HEADLINE_PLAIN)
    runs = runs.copy()
    for column in moved:
        plain = "metrics." + plain_name(column[len("metrics.") :])
        runs[plain] = runs[column].combine_first(runs[plain]) if plain in runs else runs[column]
    return runs.drop(columns=moved)


def with_group_defaults(runs: pd.DataFrame) -> pd.DataFrame:
    """A run made before a config group existed (no ``pipeline`` tag, say) ran as that group's default option:
    its tag is filled in, so that it groups with the runs that name the default (``pipeline=none``)."""
    from fedrun.tracking import group_defaults

    fill = {f"tags.{g}": option for g, option in group_defaults().items() if f"tags.{g}" in runs}
    return runs.fillna(fill) if len(runs) else runs


def with_key_defaults(runs: pd.DataFrame) -> pd.DataFrame:
    """A run made before a key of its option existed (``aggregator.tau`` of ``term``) ran as that key's default,
    which a new key keeps (``tau: null``, the mean loss, TERM as it was): its empty param is filled with the default
    as MLflow logs it (``str``), so that it groups with the runs that log the default. Only for keys some run logged
    (a column of the frame) and for plain values in the option's own file (no interpolation, list or mapping)."""
    from fedrun.tracking import option_defaults

    runs = runs.copy()
    for group in CONFIG_GROUPS:
        tag = f"tags.{group}"
        if tag not in runs:
            continue
        for option in runs[tag].dropna().unique():
            rows = runs[tag] == option
            for key, value in option_defaults(group, str(option)).items():
                column = f"params.{group}.{key}"
                if column in runs:
                    runs.loc[rows & runs[column].isna(), column] = str(value)
    return runs


def without_switched_off_keys(runs: pd.DataFrame) -> pd.DataFrame:
    """The keys of a group whose option is ``none`` say nothing (``privacy=none`` with ``privacy.target_epsilon``
    left over from a preset): they are blanked, so the run does not group or plot by them."""
    runs = runs.copy()
    for group in CONFIG_GROUPS:
        tag = f"tags.{group}"
        if tag not in runs:
            continue
        off = runs[tag] == "none"
        for column in runs.columns:
            if column.startswith(f"params.{group}.") and not column.endswith("._target_"):
                runs.loc[off, column] = None
    return runs


def group_keys(runs: pd.DataFrame) -> list[str]:
    """The columns that vary across runs: group choices (tags) first, then params that vary within them.

    A param that only changes with a group choice (``aggregator.temperature`` exists for fedsoftmax
    runs, not for fedavg runs) is left out; it says nothing the choice does not. So is a group that only
    changes with a ``method`` or ``experiment`` choice, the groups that choose other groups (``method=storm_vr``
    sets ``aggregator=mvr`` and ``optimizer=storm``): those come first.
    """

    def varies(column: str, by: list[str]) -> bool:
        values = runs[column].fillna("-").astype(str)
        if not by:
            return values.nunique() > 1
        return values.groupby([runs[k].fillna("-").astype(str) for k in by]).nunique().max() > 1

    meta = [f"tags.{t}" for t in META_GROUPS if f"tags.{t}" in runs and varies(f"tags.{t}", [])]
    keys = meta + [
        f"tags.{t}" for t in CONFIG_GROUPS if t not in META_GROUPS and f"tags.{t}" in runs and varies(f"tags.{t}", meta)
    ]
    params = [
        c
        for c in runs.columns
        if c.startswith("params.")
        and not c.endswith("._target_")
        and not c[len("params.") :].startswith(IGNORED_PARAMS)
    ]
    return keys + sorted(c for c in params if varies(c, keys))  # sorted: the same table whatever order MLflow returns


def label(column: str) -> str:
    return column.split(".", 1)[1]


def groups(runs: pd.DataFrame, keys: list[str]):
    """(values of the keys, runs) per group, sorted (numbers as numbers); missing values group as "-"; one group without keys."""
    if not keys:
        yield (), runs
        return
    parts = [
        ((values if isinstance(values, tuple) else (values,)), group)
        for values, group in runs.fillna({k: "-" for k in keys}).groupby(keys)
    ]
    yield from sorted(parts, key=lambda part: tuple(natural(v) for v in part[0]))


def censored_median(values: np.ndarray) -> float:
    """The median R-index with runs that never reached the target (NaN) counted as infinitely late.

    This is the Kaplan-Meier median of survival analysis for runs censored after their last round: the
    smallest R by which at least half the runs had reached the target, i.e. the ceil(n/2)-th smallest
    value; infinite when fewer than half reached it.
    """
    ordered = np.sort(np.where(np.isnan(values), np.inf, values))
    return float(ordered[math.ceil(len(ordered) / 2) - 1]) if len(ordered) else math.nan


def metric_columns(runs: pd.DataFrame, extra: tuple[str, ...] = ()) -> tuple[pd.DataFrame, list[str], list[str]]:
    """The runs (with an empty column for an R-index no run reached), their R-index columns in order, and the
    summary and ``extra`` metric columns they have."""
    # A target no run reached exists only as a tag (R95=not_reached): give it an empty metric column.
    unreached = [f"metrics.{label(c)}" for c in runs.columns if c.startswith("tags.") and R_INDEX.match(label(c))]
    runs = runs.assign(**{c: math.nan for c in unreached if c not in runs})
    matches = {c: R_INDEX.match(label(c)) for c in runs.columns if c.startswith("metrics.")}
    r_columns = sorted(
        (c for c, m in matches.items() if m),
        # the suffix last: R60_mb before R60_time whatever order MLflow returned the columns in
        key=lambda c: (
            bool(matches[c]["client"]),
            bool(matches[c]["time"]),
            float(matches[c]["target"]),
            matches[c]["time"] or "",
        ),
    )
    return runs, r_columns, [f"metrics.{m}" for m in dict.fromkeys(SUMMARY + tuple(extra)) if f"metrics.{m}" in runs]


def interval_columns(name: str, values: np.ndarray, rounds: float = math.inf) -> dict:
    """A bounded metric's interval within its range (``fedrun.metrics.bounded_ci``; an R-index's is [1, ``rounds``],
    the most rounds a run of the group ran) as columns (``Interval.columns``: ``<name>_lo``, ``_hi``, ``_split``,
    ``_values``, each run's value in seed order, NaN for a run that did not reach an R-index's target); {} for an
    unbounded one."""
    bound = bounds(name, rounds)
    return {} if bound is None else bounded_ci(values, bound).columns(name)


def summarise(runs: pd.DataFrame, keys: list[str], extra: tuple[str, ...] = ()) -> pd.DataFrame:
    """One row per group: counts, and mean / CI half-width / reached counts of every R-index, summary metric
    and ``extra`` metric (each run's last logged value); a bounded metric (an accuracy, a share) also its interval
    cut to its range, its runs' values and whether they split (``interval_columns``)."""
    runs, r_columns, others = metric_columns(runs, extra)
    rows = []
    for values, group in groups(runs, keys):
        group = by_seed(group)
        row = {label(k): v for k, v in zip(keys, values)}
        row["runs"] = len(group)
        # Where a median is infinite, the table says "> N": N, the most rounds any run of the group ran (and no
        # R-index in rounds can exceed it).
        row["rounds_max"] = float(group["metrics.rounds_run"].max()) if "metrics.rounds_run" in group else math.nan
        rounds = math.inf if math.isnan(row["rounds_max"]) else row["rounds_max"]
        for column in r_columns + others:
            reached = group[column].dropna()
            row[f"{label(column)}_mean"], row[f"{label(column)}_ci95"] = mean_ci(reached.to_numpy())
            row.update(interval_columns(label(column), group[column].to_numpy(dtype=np.float64), rounds))
            if column in r_columns:
                row[f"{label(column)}_reached"] = len(reached)
                row[f"{label(column)}_median"] = censored_median(group[column].to_numpy(dtype=np.float64))
        rows.append(row)
    return pd.DataFrame(rows)


def paired(runs: pd.DataFrame, keys: list[str], key: str, baseline: str, extra: tuple[str, ...] = ()) -> pd.DataFrame:
    """Each other group against the baseline runs (``key`` == ``baseline``) of the same seed and the same values
    of the other keys the baseline has (``aggregator.temperature`` is no such key for a FedAvg baseline): per
    metric, the mean and 95% interval of the per-seed difference (group - baseline) over the pairs where both
    runs have a value (for an R-index: both reached the target), those pairs' count, and how many of them are
    lower and higher than the baseline (the rest are equal).

    Runs with the same seed share their data split and initial model, so the per-seed difference is free of
    the seed-to-seed spread that widens the intervals of ``summarise``: a paired t interval (Student t on the
    differences, n - 1 degrees of freedom). A seed is one pair: runs of one config and seed that were made more than
    once (the same job in two sweeps) are averaged first, so a repeat cannot pass for a second seed."""
    runs, r_columns, others = metric_columns(runs.fillna({k: "-" for k in keys}), extra)
    base = runs[runs[key].astype(str) == baseline]
    if base.empty:
        values = ", ".join(sorted(runs[key].astype(str).unique(), key=natural))
        raise ValueError(
            f"--paired {label(key)}={baseline}: no finished run has {label(key)} = {baseline!r} (there: {values})"
        )
    match = ["params.seed"] + [k for k in keys if k != key and (base[k] != "-").any()]
    metrics = r_columns + others
    # an R-index in rounds lies in [1, the most rounds any of these runs ran]: a difference of two, within +-(that - 1)
    rounds = float(runs["metrics.rounds_run"].max()) if "metrics.rounds_run" in runs else math.nan
    rounds = math.inf if math.isnan(rounds) else rounds

    def one_per_seed(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
        return frame.groupby(by, as_index=False, dropna=False)[metrics].mean()

    base = one_per_seed(base, match)
    rows = []
    for values, group in groups(runs[runs[key].astype(str) != baseline], keys):
        pairs = one_per_seed(group, match).merge(base, on=match, suffixes=("", "_base"))
        row = {label(k): v for k, v in zip(keys, values)}
        row["pairs"] = len(pairs)
        for column in r_columns + others:
            diff = (pairs[column] - pairs[f"{column}_base"]).dropna().to_numpy(dtype=np.float64)
            row[f"{label(column)}_diff"], row[f"{label(column)}_ci95"] = mean_ci(diff)
            if (bound := bounds(column, rounds)) is not None:  # a difference of two values in [a, b]: in [a - b, b - a]
                span = bound[1] - bound[0]
                interval = bounded_ci(diff, (-span, span))
                row[f"{label(column)}_lo"], row[f"{label(column)}_hi"] = interval.lo, interval.hi
            row[f"{label(column)}_pairs"] = len(diff)
            # How many pairs went each way: a mean can hide one seed far off and the others the other way.
            row[f"{label(column)}_lower"], row[f"{label(column)}_higher"] = int((diff < 0).sum()), int((diff > 0).sum())
        rows.append(row)
    return pd.DataFrame(rows)


def paired_markdown(table: pd.DataFrame, keys: list[str], key: str, baseline: str) -> str:
    """The paired differences as a Markdown table: "mean ± CI (pairs: lower-/equal=/higher+)" per metric."""
    names = [label(k) for k in keys]
    metrics = list(dict.fromkeys(c.rsplit("_", 1)[0] for c in table.columns if c.endswith("_diff")))
    rows = []
    for _, row in table.iterrows():
        cells = [str(row[n]) for n in names] + [str(int(row["pairs"]))]
        for m in metrics:
            digits = 1 if R_INDEX.match(m) else 4
            n, lower, higher = int(row[f"{m}_pairs"]), int(row[f"{m}_lower"]), int(row[f"{m}_higher"])
            cell = _cell(row[f"{m}_diff"], row[f"{m}_ci95"], digits)
            if f"{m}_lo" in row:  # bounded: cut to the differences' range, [low, high] where cut
                cell = Interval(row[f"{m}_diff"], row[f"{m}_lo"], row[f"{m}_hi"], ()).cell(digits)
            cells.append(f"{cell} ({n}: {lower}-/{n - lower - higher}=/{higher}+)")
        rows.append(cells)
    return (
        f"Paired by seed, against {label(key)} = {baseline}: mean difference (this group - baseline) ± 95% CI "
        "(pairs: how many lower/equal/higher than the baseline)\n\n"
        + markdown_table(names + ["pairs"] + [f"Δ {m}" for m in metrics], rows)
    )


def _cell(mean: float, half: float, digits: int) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f}" if math.isnan(half) else f"{mean:.{digits}f} ± {half:.{digits}f}"


def _median_cell(median: float, rounds_max: float, in_time: bool) -> str:
    if math.isnan(median):
        return "-"
    if math.isinf(median):  # fewer than half reached the target: censored at the end of the runs
        return "> end" if in_time or math.isnan(rounds_max) else f"> {int(rounds_max)}"
    return f"{median:.1f}" if in_time else f"{median:g}"


def markdown(table: pd.DataFrame, keys: list[str]) -> str:
    """A Markdown table: group keys, runs, then "mean ± CI" cells (R-indices with "reached k/n")."""
    names = [label(k) for k in keys]
    metrics = list(dict.fromkeys(c.rsplit("_", 1)[0] for c in table.columns if c.endswith("_mean")))
    header = names + ["runs"]
    for m in metrics:
        header += [f"{m} (reached)", f"{m} median"] if R_INDEX.match(m) else [m]
    rows = []
    for _, row in table.iterrows():
        runs = int(row["runs"])  # iterrows turns an all-numeric row (no group keys) into floats
        cells = [str(row[n]) for n in names] + [str(runs)]
        for m in metrics:
            is_r = f"{m}_reached" in row
            cell = _cell(row[f"{m}_mean"], row[f"{m}_ci95"], 1 if is_r else 4)
            if f"{m}_lo" in row:  # bounded: the interval within its range, the seeds when few, split when split
                cell = Interval.from_row(row, m).cell(1 if is_r else 4)
            cells.append(f"{cell} ({int(row[f'{m}_reached'])}/{runs})" if is_r else cell)
            if is_r:
                cells.append(
                    _median_cell(row[f"{m}_median"], row.get("rounds_max", math.nan), R_INDEX.match(m)["time"])
                )
        rows.append(cells)
    return markdown_table(header, rows)


def legend_name(keys: list[str], values: tuple) -> str:
    """A group's name in a plot legend: its keys that have a value ("-" and None are left out), each by the last
    part of its name where that is unique among the keys (``partition.shards_per_client`` as ``shards_per_client``)."""
    names = [label(k) for k in keys]
    last = [n.rsplit(".", 1)[-1] for n in names]
    short = [s if last.count(s) == 1 else n for n, s in zip(names, last)]
    return ", ".join(f"{n}={v}" for n, v in zip(short, values) if str(v) not in ("-", "None", "nan", "")) or "all runs"


def curves(client, runs: pd.DataFrame, keys: list[str], metric: str = "test_accuracy") -> dict[str, pd.DataFrame]:
    """Per group, a rounds x runs frame of ``metric``; runs that stopped early carry their last value forward."""
    out = {}
    for values, group in groups(runs, keys):
        name = legend_name(keys, values)
        series = {
            run_id: pd.Series({m.step: m.value for m in history(client, run_id, metric)}) for run_id in group["run_id"]
        }
        frame = pd.DataFrame(series).sort_index()
        out[name] = frame.ffill()
    return out


def client_tables(client, runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Each run's ``personal_accuracy.csv`` (a row per judged round, a column per client: its accuracy on its own
    test split under the model it is served), by run id; a run without client test splits logs none."""
    import os
    import tempfile

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per run's small file says nothing
    tables = {}
    for run_id in runs["run_id"]:
        with tempfile.TemporaryDirectory() as scratch:
            try:
                path = client.download_artifacts(run_id, "personal_accuracy.csv", scratch)
            except Exception:
                continue
            tables[run_id] = per_client_table(Path(path))
    return tables


def run_window(run: pd.Series) -> int:
    """The run's ``schedule.tail`` (``fedrun.metrics.TAIL`` for a run logged without one)."""
    window = pd.to_numeric(pd.Series([run.get("params.schedule.tail")]), errors="coerce")[0]
    return TAIL if pd.isna(window) else int(window)


def last_round(table: pd.DataFrame, run: pd.Series) -> int:
    """The run's last round (``rounds_run``), judged or not, or the table's last where the run logged none."""
    ran = pd.to_numeric(pd.Series([run.get("metrics.rounds_run")]), errors="coerce")[0]
    return max(int(table.index.max()), 0 if pd.isna(ran) else int(ran))


def tail_rows(table: pd.DataFrame, run: pd.Series) -> pd.DataFrame:
    """The rows of a per-client table in the run's tail, the rounds after its last round minus ``schedule.tail`` (the
    window ``fedrun.metrics.tail`` judges a curve on)."""
    return table[table.index > last_round(table, run) - run_window(run)]


def personal_accuracies(
    runs: pd.DataFrame, keys: list[str], tables: dict[str, pd.DataFrame], over: str = "selected"
) -> dict[str, np.ndarray]:
    """Per group, every client's accuracy on its own test split, pooled over the group's runs: at each run's round
    selected on validation (the last judged round without one), or with ``over="tail"`` its mean over the run's
    tail (what ``--fairness`` judges)."""
    out = {}
    for values, group in groups(runs, keys):
        pooled = []
        for _, run in group.iterrows():
            if (table := tables.get(run["run_id"])) is None:
                continue
            if over == "tail":
                pooled.append(tail_rows(table, run).mean(axis=0).to_numpy(dtype=float))
                continue
            chosen = run.get("metrics.personal/selected_round")
            row = table.loc[int(chosen)] if pd.notna(chosen) and int(chosen) in table.index else table.iloc[-1]
            pooled.append(row.to_numpy(dtype=float))
        if pooled:
            out[legend_name(keys, values)] = np.concatenate(pooled)
    return out


def with_fairness_tails(runs: pd.DataFrame, tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Runs without a ``tail_fairness_<s>`` (logged before that measure existed, e.g. ``worst10``) get it from their
    ``personal_accuracy.csv``: ``fedrun.metrics.fairness`` of each judged round (a client without a held-out sample,
    NaN there, left out), judged on the run's tail by ``fedrun.metrics.tail``, as the run itself judges it."""
    runs = runs.copy()
    for index, run in runs.iterrows():
        wanted = [s for s in FAIRNESS if pd.isna(run.get(f"metrics.tail_fairness_{s}"))]
        if not wanted or (table := tables.get(run["run_id"])) is None:
            continue
        rounds = [*table.index, last_round(table, run)]  # the tail ends at the run's last round, judged or not
        rows = [fairness(row, ~np.isnan(row)) for row in table.to_numpy(dtype=float)]
        for s in wanted:
            mean, swing, _ = tail(rounds, [r[s] for r in rows] + [math.nan], run_window(run))
            runs.loc[index, [f"metrics.tail_fairness_{s}", f"metrics.tail_fairness_{s}_swing"]] = mean, swing
    return runs


def plot_distribution(accuracies: dict[str, np.ndarray], path: Path, title: str) -> Path:
    """Each group's per-client accuracies: a box (quartiles, whiskers at 1.5 IQR) and every client as a point."""
    from fedrun.plots import plt

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(accuracies) + 2), 5), layout="constrained")
    names = list(accuracies)
    data = [accuracies[name][~np.isnan(accuracies[name])] for name in names]
    ax.boxplot(data, showfliers=False)
    jitter = np.random.default_rng(0)  # the points' horizontal spread only
    for i, values in enumerate(data):  # past the 10 colours of the cycle, the next ten groups take the next marker
        marker, color = MARKERS[i // 10 % len(MARKERS)], f"C{i % 10}"
        ax.plot(i + 1 + jitter.uniform(-0.15, 0.15, len(values)), values, marker, color=color, alpha=0.45, markersize=3)
    shown = [n.replace(", ", "\n") for n in names]  # a key a line: long group names side by side stay legible
    ax.set_xticks(range(1, len(names) + 1), [f"{n}\n(n={len(d)})" for n, d in zip(shown, data)], fontsize="small")
    ax.set(ylabel="client's accuracy on its own test split", title=title)
    ax.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


MARKERS = "osD^v<>P*X"  # a group's marker by its tenth (its colour repeats every 10 groups)
LINESTYLES = ("-", "--", ":")  # a curve's style past the colour cycle (``MARKERS`` for a point's)
AXIS = {
    "tail_fairness_mean": "the clients' mean accuracy (tail_fairness_mean)",
    "tail_fairness_worst10": "the worst tenth's mean accuracy (tail_fairness_worst10)",
}


def plot_frontier(
    table: pd.DataFrame,
    keys: list[str],
    path: Path,
    title: str,
    x: str = "tail_fairness_mean",
    y: str = "tail_fairness_worst10",
) -> Path:
    """Each group's clients' mean accuracy against their worst tenth's (``summarise``'s means, with their intervals
    within range both ways): the fair-FL trade-off, up is fairer, right is better on average; one panel per dataset
    when the table has several (their scales differ)."""
    from fedrun.plots import plt

    panel = next((k for k in keys if label(k) == "dataset" and table[label(k)].nunique() > 1), None)
    others = [k for k in keys if k != panel]
    panels = list(table.groupby(label(panel), sort=False)) if panel else [("", table)]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5.5), layout="constrained", squeeze=False)
    for ax, (name, part) in zip(axes[0], panels):
        for j, (_, row) in enumerate(part.iterrows()):
            mx, my = row[f"{x}_mean"], row[f"{y}_mean"]
            xerr = [[np.nan_to_num(mx - row[f"{x}_lo"])], [np.nan_to_num(row[f"{x}_hi"] - mx)]]
            yerr = [[np.nan_to_num(my - row[f"{y}_lo"])], [np.nan_to_num(row[f"{y}_hi"] - my)]]
            values = tuple(row[label(k)] for k in others)
            ax.errorbar(
                mx,
                my,
                xerr=xerr,
                yerr=yerr,
                fmt=MARKERS[j // 10 % len(MARKERS)],
                color=f"C{j % 10}",
                capsize=3,
                label=f"{legend_name(others, values)} (n={int(row['runs'])})",
            )
        ax.set(xlabel=AXIS.get(x, x), ylabel=AXIS.get(y, y), title=str(name))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def with_tails(client, runs: pd.DataFrame) -> pd.DataFrame:
    """Runs logged before the tail summary (no ``tail_test_accuracy``) get it, and its swing, from their test
    accuracy history over their ``schedule.tail`` (``fedrun.metrics.TAIL`` where the run has no such param), as
    ``fedrun.metrics.tail`` computes it for a new run."""
    column = "metrics.tail_test_accuracy"
    missing = runs.index if column not in runs else runs.index[runs[column].isna()]
    if not len(missing):
        return runs
    runs = runs.copy()
    for index in missing:
        points = history(client, runs.at[index, "run_id"], "test_accuracy")
        if not points:
            continue
        mean, swing, _ = tail([p.step for p in points], [p.value for p in points], run_window(runs.loc[index]))
        runs.loc[index, [column, column + "_swing"]] = mean, swing
    return runs


def history(client, run_id: str, metric: str) -> list:
    """A metric's series by its plain name, under its MLflow name (``0_main/test_accuracy``) or, for a run stored
    before, the name it had then (``fedrun.tracking.stored_names``); a run resumed across a rename has both, merged
    by step."""
    merged = {}  # a run resumed across a rename logged its rounds under both names: each step once, the newest name's
    for name in reversed(stored_names(metric)):
        merged.update({point.step: point for point in metric_history(client, run_id, name)})
    return [merged[step] for step in sorted(merged)]


def per_total(accuracy: dict[str, pd.DataFrame], totals: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """Each group's accuracy frame indexed by a running total of its runs at each evaluated round (their mean: the
    virtual seconds of ``virtual_time``, the megabytes of ``per_megabyte``) instead of the round; a group without
    the total has no line."""
    out = {}
    for name, frame in accuracy.items():
        total = totals.get(name, pd.DataFrame())
        if total.empty:
            out[name] = pd.DataFrame()
            continue
        out[name] = frame.set_axis(total.reindex(index=frame.index).mean(axis=1).to_numpy(), axis=0)
    return out


def per_megabyte(accuracy: dict[str, pd.DataFrame], uploads: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """``per_total`` of the megabytes uploaded until each round: every round's ``upload_mb`` summed, the rounds that
    were not evaluated included."""
    return per_total(accuracy, {name: frame.cumsum() for name, frame in uploads.items()})


def plot_bands(
    groups: dict[str, pd.DataFrame],
    path: Path,
    title: str,
    metric: str = "test accuracy",
    step: str = "round",
    log_x: bool = False,
) -> Path:
    """Mean ``metric`` per ``step`` (a round; an aggregation of the async engine; megabytes uploaded with
    ``log_x``, on a logarithmic axis) with its 95% Student-t band, one line per group."""
    from fedrun.plots import MaxNLocator, plt

    # Many or long group names go below the axes, one a line, and the figure grows to hold them.
    below = len(groups) > 4 or max(map(len, groups), default=0) > 40
    fig, ax = plt.subplots(figsize=(9, 5 + (0.22 * len(groups) if below else 0)), layout="constrained")
    # A mean of values in [0, 1] (an accuracy, a share) lies in [0, 1]: a wide band (few runs) is cut there.
    unit = all(
        np.nanmin(f.to_numpy()) >= 0 and np.nanmax(f.to_numpy()) <= 1 for f in groups.values() if f.notna().any().any()
    )
    nonnegative = all(np.nanmin(f.to_numpy()) >= 0 for f in groups.values() if f.notna().any().any())
    for j, (name, frame) in enumerate(groups.items()):
        if frame.empty:  # the group never logged this metric (a non-private run's clip_norm): no line
            continue
        stats = np.array([mean_ci(frame.loc[r].dropna().to_numpy()) for r in frame.index])
        low, high = stats[:, 0] - np.nan_to_num(stats[:, 1]), stats[:, 0] + np.nan_to_num(stats[:, 1])
        if unit:
            low, high = np.clip(low, 0, 1), np.clip(high, 0, 1)
        elif nonnegative:  # a norm, a count: a band below 0 is the interval's artefact
            low = np.maximum(low, 0)
        # past the 10 colours of the cycle, the next ten groups are dashed, then dotted: no two lines look alike
        color, style = f"C{j % 10}", LINESTYLES[j // 10 % len(LINESTYLES)]
        ax.plot(frame.index, stats[:, 0], color=color, linestyle=style, label=f"{name} (n={frame.shape[1]})")
        ax.fill_between(frame.index, low, high, color=color, alpha=0.2)
    ax.set(xlabel=step, ylabel=metric, title=title)
    if log_x:
        ax.set_xscale("log")
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if below:
        fig.legend(loc="outside lower center", fontsize="small")
    else:
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": a legend wider than the axes is not cut
    plt.close(fig)
    return path


def plot_versus(
    table: pd.DataFrame, keys: list[str], key: str, path: Path, title: str, metric: str = "tail_test_accuracy"
) -> Path:
    """``metric`` (each group's mean with its 95% Student-t interval, from ``summarise``) against the numeric
    config ``key``: one line per combination of the other keys. Groups where ``key`` has no number (a
    non-private baseline has no ``privacy.target_epsilon``) are horizontal lines with their interval as a band.
    The x axis is logarithmic when the values span a factor of 8 or more."""
    from fedrun.plots import plt

    name, others = label(key), [k for k in keys if k != key]
    x = pd.to_numeric(table[name], errors="coerce")
    mean = table[f"{metric}_mean"]
    # The interval within the accuracy's range (``interval_columns``): a t-interval of 3 runs can reach past it.
    below, above = (mean - table[f"{metric}_lo"]).fillna(0.0), (table[f"{metric}_hi"] - mean).fillna(0.0)
    fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
    numbered = table[x.notna()].assign(_x=x[x.notna()])
    lines = list(numbered.groupby([label(k) for k in others], sort=False)) if others else [((), numbered)]
    for values, line in lines:
        line = line.sort_values("_x")
        values = values if isinstance(values, tuple) else (values,)
        runs = int(line["runs"].min())
        ax.errorbar(
            line["_x"],
            mean[line.index],
            yerr=[below[line.index], above[line.index]],
            marker="o",
            capsize=3,
            label=f"{legend_name(others, values)} (n={runs})" if others else f"n={runs}",
        )
    for j, i in enumerate(table.index[x.isna()]):
        values, color = tuple(table.loc[i, label(k)] for k in keys), f"C{len(lines) + j}"  # after the lines' colours
        ax.axhline(
            mean[i], color=color, linestyle="--", label=f"{legend_name(keys, values)} (n={int(table.loc[i, 'runs'])})"
        )
        ax.axhspan(mean[i] - below[i], mean[i] + above[i], color=color, alpha=0.15)
    if x.notna().any() and x.min() > 0 and x.max() / x.min() >= 8:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(x.dropna().unique()), [f"{v:g}" for v in sorted(x.dropna().unique())])
    ax.set(xlabel=name, ylabel=metric.replace("_", " "), title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def step_name(runs: pd.DataFrame) -> str:
    """What the x axis counts: rounds, or the async engine's aggregations (its "rounds" are buffer flushes)."""
    engines = set(runs["tags.engine"].dropna()) if "tags.engine" in runs else set()
    if engines == {"async"}:
        return "aggregation"
    return "round (aggregation for async runs)" if "async" in engines else "round"


def build_parser() -> argparse.ArgumentParser:
    """The command's arguments (the docs' command reference prints its help)."""
    parser = argparse.ArgumentParser(
        prog="fedrun-report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Documentation: docs/how-to/report.md (how to), docs/reference/index.md (every command and option)",
    )
    parser.add_argument("--experiment", required=True, help="MLflow experiment name (tracking.experiment)")
    parser.add_argument("--tracking-uri", default=DEFAULT_URI, help="default: %(default)s (relative to here)")
    parser.add_argument(
        "--group-by",
        nargs="+",
        metavar="KEY",
        help="config keys or group names, or trial (a study's trials, each over its seeds) (default: every key that "
        "varies, except seed)",
    )
    parser.add_argument(
        "--filter", metavar="EXPR", help="MLflow search filter, e.g. \"params.`aggregator.temperature` = '1.0'\""
    )
    parser.add_argument(
        "--metrics",
        nargs="+",
        default=[],
        metavar="METRIC",
        help="further columns: each run's last value of these metrics, e.g. accuracy/slow weight_share/slow",
    )
    parser.add_argument(
        "--plot",
        nargs="+",
        default=[],
        metavar="METRIC",
        help="further band plots, one per metric logged each round, e.g. accuracy/slow (accuracy_slow.png)",
    )
    parser.add_argument(
        "--paired",
        metavar="KEY=BASELINE",
        help="also each group's per-seed difference from the runs with KEY = BASELINE (e.g. aggregator=fedavg), "
        "paired on the seed and the other keys; written to paired.md and paired.csv",
    )
    parser.add_argument(
        "--versus",
        metavar="KEY",
        help="also plot tail test accuracy against this numeric config key, one line per value of the other keys "
        "(e.g. privacy.target_epsilon: a privacy-utility curve; tail_test_accuracy_vs_<KEY>.png)",
    )
    parser.add_argument(
        "--per-mb",
        action="store_true",
        help="also plot test accuracy against the megabytes uploaded (accuracy_vs_upload_mb.png): compressed runs "
        "against dense ones on communication",
    )
    parser.add_argument(
        "--per-time",
        action="store_true",
        help="also plot test accuracy against the virtual seconds of devices (accuracy_vs_virtual_time.png): "
        "synchronous rounds against asynchronous aggregations on the same clock",
    )
    parser.add_argument(
        "--robustness",
        action="store_true",
        help="the matrix of sweep=robustness instead: accuracy per rule, split, attack and f with intervals, the worst "
        "case over attacks, the attackers' weight share, the cost, and heatmaps (robustness.md, .csv, *.png)",
    )
    parser.add_argument(
        "--personal",
        action="store_true",
        help="add the clients' own accuracies (personal/ metrics: dataset.client_test_fraction > 0): their tail means "
        "(mean, weighted, p10, worst client over each run's last schedule.tail rounds), at the round selected on validation (mean, weighted, p10, worst client, the round), PFLlib's best round on test "
        "(weighted, labelled best_on_test), and a band plot of the clients' mean accuracy per round",
    )
    parser.add_argument(
        "--fairness",
        action="store_true",
        help="add how evenly the clients fare under the model each is served (fairness/ measures: "
        "dataset.client_test_fraction > 0): the tail means of the clients' mean accuracy, worst and best tenth, 10th "
        "percentile, variance, Jain's index and share left behind, with intervals within their ranges; every "
        "client's tail accuracy per group (fairness_distribution.png) and the mean against the worst tenth "
        "(fairness_frontier.png)",
    )
    parser.add_argument("--out", type=Path, help="output folder (default: outputs/report/<experiment>/)")
    return parser


# What ``--fairness`` adds (q-FFL's Table 1 columns first: average, worst 10%, best 10%, variance).
FAIRNESS_METRICS = tuple(
    f"tail_fairness_{s}" for s in ("mean", "worst10", "best10", "variance", "p10", "jain", "left_behind")
)
# What ``--personal`` adds: the honest reading first (selected on validation), then PFLlib's rule beside it.
PERSONAL_METRICS = (
    *(f"personal/selected_accuracy_{s}" for s in ("mean", "weighted", "p10", "min")),
    "personal/selected_round",
    "personal/best_on_test_accuracy_weighted",
    "personal/best_on_test_round",
)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)

    uri = resolve_uri(args.tracking_uri, Path.cwd())
    client = open_client(uri)
    experiment_id = find_experiment(client, args.experiment)
    if experiment_id is None:
        names = ", ".join(experiment_names(client)) or "none"
        raise SystemExit(f"fedrun-report: error: no experiment {args.experiment!r} in {uri} (there: {names})")
    runs = search_runs(uri, experiment_id, args.filter or "")
    if SWEEP_TAG in runs:  # a sweep's parent run and a study's trials group jobs in the UI; they are not runs
        runs = runs[runs[SWEEP_TAG].isna()]
    runs = without_switched_off_keys(with_key_defaults(with_group_defaults(with_plain_names(runs))))
    args.metrics, args.plot = [plain_name(m) for m in args.metrics], [plain_name(m) for m in args.plot]
    if args.personal:  # a run without a validation split has no selected round: its final figures stand in
        column = f"metrics.{PERSONAL_METRICS[0]}"
        selected = column in runs and runs[column].notna().any()
        wanted = PERSONAL_METRICS if selected else tuple(m.replace("selected", "final") for m in PERSONAL_METRICS[:4])
        wanted += () if selected else PERSONAL_METRICS[5:]
        tails = tuple(f"tail_personal_accuracy_{s}" for s in ("mean", "weighted", "p10", "min"))
        wanted = tuple(m for m in tails if f"metrics.{m}" in runs and runs[f"metrics.{m}"].notna().any()) + wanted
        args.metrics += [m for m in wanted if m not in args.metrics]
        args.plot += [m for m in ("personal/accuracy_mean",) if m not in args.plot]
    finished = runs[runs["status"] == "FINISHED"] if len(runs) else runs
    if finished.empty:
        raise SystemExit(
            f"fedrun-report: error: no finished runs in {args.experiment!r}"
            + (f" matching {args.filter!r}" if args.filter else "")
        )
    finished = with_tails(client, finished)
    tables = client_tables(client, finished) if args.fairness or args.personal else {}
    if args.fairness:
        if not tables:
            raise SystemExit(
                f"fedrun-report: error: --fairness: no run of {args.experiment!r} judged its clients on their own "
                "test splits (dataset.client_test_fraction > 0)"
            )
        finished = with_fairness_tails(finished, tables)
        args.metrics += [m for m in FAIRNESS_METRICS if m not in args.metrics]
    out = args.out or Path("outputs") / "report" / args.experiment
    if args.robustness:
        from fedrun import robustness

        out.mkdir(parents=True, exist_ok=True)
        lost = runs[robustness.diverged(runs)] if len(runs) else runs  # the attack won: kept, scored 0
        text, tables, plots = robustness.report(pd.concat([finished, lost]), out, args.experiment)
        (out / "robustness.md").write_text(text)
        for name, table in tables.items():
            csv_safe(table).to_csv(out / name, index=False)
        print(text, end="")
        print("\nwrote " + ", ".join(str(p) for p in [out / "robustness.md", *(out / n for n in tables), *plots]))
        return
    if args.group_by:
        keys = []
        for key in args.group_by:
            column = TRIAL_TAG if key == "trial" else f"tags.{key}" if key in CONFIG_GROUPS else f"params.{key}"
            if column not in finished:
                raise SystemExit(
                    f"fedrun-report: error: --group-by {key!r} is neither a group ({', '.join(CONFIG_GROUPS)}) nor a logged config key"
                )
            keys.append(column)
    else:
        keys = group_keys(finished)

    logged = sorted(
        c[len("metrics.") :] for c in finished.columns if c.startswith("metrics.") and finished[c].notna().any()
    )
    for metric in args.metrics + args.plot:
        if metric not in logged:
            raise SystemExit(
                f"fedrun-report: error: metric {metric!r} was not logged by these runs (logged: {', '.join(logged)})"
            )
    out.mkdir(parents=True, exist_ok=True)
    if args.paired:
        name, sep, baseline = args.paired.partition("=")
        column = f"tags.{name}" if name in CONFIG_GROUPS else f"params.{name}"
        alone = (
            sep and column in finished and bool((finished[column].astype(str) == baseline).all())
        )  # nothing else ran (yet)
        if not sep or (column not in keys and not alone):
            raise SystemExit(
                f"fedrun-report: error: --paired {args.paired!r}: KEY=BASELINE with KEY one of the table's keys "
                f"({', '.join(label(k) for k in keys) or 'none'})"
            )
        try:
            pairs = pd.DataFrame() if alone else paired(finished, keys, column, baseline, tuple(args.metrics))
        except ValueError as error:
            raise SystemExit(f"fedrun-report: error: {error}") from None
    table = summarise(finished, keys, tuple(args.metrics))
    text = markdown(table, keys)
    (out / "report.md").write_text(
        f"# {args.experiment}\n\n{len(finished)} finished runs ({len(runs) - len(finished)} others left out).\n\n"
        + text
    )
    csv_safe(table).to_csv(out / "report.csv", index=False)
    step = step_name(finished)
    plots = [
        plot_bands(
            curves(client, finished, keys),
            out / "accuracy.png",
            f"{args.experiment}: mean test accuracy, 95% CI band",
            step=step,
        )
    ]
    for metric in dict.fromkeys(args.plot):
        plots.append(
            plot_bands(
                curves(client, finished, keys, metric),
                out / (re.sub(r"\W", "_", metric) + ".png"),
                f"{args.experiment}: mean {metric}, 95% CI band",
                metric,
                step,
            )
        )
    if args.personal and (accuracies := personal_accuracies(finished, keys, tables)):
        plots.append(
            plot_distribution(
                accuracies,
                out / "personal_accuracy_distribution.png",
                f"{args.experiment}: each client's accuracy at the round selected on validation",
            )
        )
    if args.fairness:
        plots.append(
            plot_distribution(
                personal_accuracies(finished, keys, tables, over="tail"),
                out / "fairness_distribution.png",
                f"{args.experiment}: each client's accuracy over its run's tail, under the model it is served",
            )
        )
        plots.append(
            plot_frontier(
                table,
                keys,
                out / "fairness_frontier.png",
                f"{args.experiment}: the clients' mean accuracy against their worst tenth's (tail means, 95% intervals)",
            )
        )
    against = (  # test accuracy against a running total of the runs instead of the round: (asked, metric, index, ...)
        (args.per_mb, "upload_mb", per_megabyte, "megabytes uploaded", "megabytes uploaded", True),
        (args.per_time, "virtual_time", per_total, "virtual time", "virtual seconds", False),
    )
    for asked, metric, index, what, step, log_x in against:
        if asked:
            plots.append(
                plot_bands(
                    index(curves(client, finished, keys), curves(client, finished, keys, metric)),
                    out / f"accuracy_vs_{metric}.png",
                    f"{args.experiment}: mean test accuracy against {what}, 95% CI band",
                    step=f"{step} (mean over the runs)",
                    log_x=log_x,
                )
            )
    if args.versus:
        versus = f"params.{args.versus}"
        if versus not in keys:
            raise SystemExit(
                f"fedrun-report: error: --versus {args.versus!r}: one of the table's config keys "
                f"({', '.join(label(k) for k in keys if k.startswith('params.')) or 'none'})"
            )
        plots.append(
            plot_versus(
                table,
                keys,
                versus,
                out / ("tail_test_accuracy_vs_" + re.sub(r"\W", "_", args.versus) + ".png"),
                f"{args.experiment}: tail test accuracy (mean over each run's last rounds), mean and 95% CI",
            )
        )
    written = [out / "report.md", out / "report.csv", *plots]
    if args.paired:
        pair_text = (
            f"Paired by seed, against {name} = {baseline}: every run is a baseline run, nothing to pair.\n"
            if alone
            else paired_markdown(pairs, keys, column, baseline)
        )
        (out / "paired.md").write_text(pair_text)
        csv_safe(pairs).to_csv(out / "paired.csv", index=False)
        text += "\n" + pair_text
        written += [out / "paired.md", out / "paired.csv"]
    print(text, end="")
    print("\nwrote " + ", ".join(str(p) for p in written))


if __name__ == "__main__":
    main()
