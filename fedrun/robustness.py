"""``fedrun-report --robustness``: the matrix of ``sweep=robustness`` (docs/results/robustness.md).

Every finished run is one seed of a cell (rule, split, attack, f, told): the rule is the run's ``defence`` choice
(its ``aggregator`` where it has none), the split its ``partition``, f the number of attackers it drew (the tag
``attack_malicious_count``; 0 for ``attack=none``), told the f the rule was told (``declared_f``, set where the sweep
misstates it; f itself otherwise: the truth). The f = 0 cell is the run without attack and stands in every attack's
column. Per cell (``cells``):

- accuracy: each run judged on its tail (``tail_test_accuracy``, the mean over its last ``schedule.tail`` rounds:
  a run that oscillates between rounds is not judged by the parity of its last one; a run the attack drove to a
  non-finite model, FAILED with a ``DivergenceError``, ends with no model and scores 0), the mean over the seeds with
  its 95% Student-t interval cut to [0, 1] (``fedrun.metrics.bounded_ci``), each seed's value when there are fewer
  than five, ``split`` when the seeds span over half the range; the final round's mean beside it, labelled;
- the attackers' share of the aggregation weight (``attack/weight_share_mean``; only for rules whose alpha is a
  convex combination, NaN for the others) and ``attack/deviation_mean``, how far the attack moved each round's
  aggregate from the one the rule gives on the honest updates alone, relative to it (every rule);
- the cost (``total_wall_s``, ``upload_mb_total``) and how many runs were tagged ``unstable``.

Attacks that are the same here are one attack (``same_as``): an attack that differs from another only by a channel
the rule may not read (``VARIANTS``: the loss lie on top of the sign flip) and whose per-seed accuracies equal that
attack's is reported as that attack. The worst case of a rule at a split and f (``worst``) is the lowest mean over
the k distinct attacks, every attack within ``TIE`` of it seed by seed named with it; its interval is the minimum
over the attacks of Bonferroni-simultaneous 95% intervals (each at 1 - 0.05 / k), which covers the smallest true
mean whenever all k intervals cover theirs, so it carries the multiplicity a minimum over k attacks brings
(the point, a minimum of k noisy means, is biased low, and the page says so).
"""

import math
from pathlib import Path

import numpy as np
import pandas as pd

from fedrun.metrics import Interval, bounded_ci, by_seed, markdown_table

ACCURACY, FINAL = "metrics.tail_test_accuracy", "metrics.final_test_accuracy"
SHARE, DEVIATION = "metrics.attack/weight_share_mean", "metrics.attack/deviation_mean"
WALL, UPLOAD = "metrics.total_wall_s", "metrics.upload_mb_total"
CELL = ["rule", "split", "attack", "f", "told"]
TIE = 1e-6  # attacks whose accuracies differ by at most this on every seed are tied
# An attack that is another plus a lie on a channel some rules never read: where their results are equal, the rule
# did not read it, and the variant is reported as the attack it adds to.
VARIANTS = {"loss_lie_flip": "sign_flip", "loss_lie_flip_strong": "sign_flip_strong"}
CONFIDENCE = 0.95


def labelled(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs with the cell columns ``rule``, ``split``, ``attack``, ``f``, ``told`` and ``clients``."""
    runs = runs.copy()
    rule = runs["tags.defence"] if "tags.defence" in runs else pd.Series(None, index=runs.index, dtype=object)
    runs["rule"] = rule.where(rule.notna() & (rule != "None"), runs["tags.aggregator"])
    runs["split"] = runs["tags.partition"]
    runs["attack"] = runs["tags.attack"].fillna("none") if "tags.attack" in runs else "none"
    count = runs.get("tags.attack_malicious_count", pd.Series(0, index=runs.index))
    runs["f"] = pd.to_numeric(count, errors="coerce").fillna(0).astype(int).where(runs["attack"] != "none", 0)
    told = pd.to_numeric(runs.get("params.declared_f", pd.Series(np.nan, index=runs.index)), errors="coerce")
    runs["told"] = told.where(told.notna() & (runs["f"] > 0), runs["f"]).astype(int)
    runs["clients"] = pd.to_numeric(runs.get("params.partition.num_clients"), errors="coerce")
    runs["diverged"] = diverged(runs)
    for column in (ACCURACY, FINAL):  # a run driven to a non-finite model ends with none: it scores 0
        runs[column] = pd.to_numeric(runs.get(column, pd.Series(np.nan, index=runs.index)), errors="coerce")
        runs.loc[runs["diverged"], column] = 0.0
    return runs


def _column(group: pd.DataFrame, name: str) -> np.ndarray:
    return pd.to_numeric(group.get(name, pd.Series(np.nan, index=group.index)), errors="coerce").to_numpy(float)


def _seeds(group: pd.DataFrame) -> list[str]:
    return [str(s) for s in group["params.seed"]] if "params.seed" in group else [str(i) for i in range(len(group))]


def cells(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per cell (module docstring): its runs and seeds, accuracy (tail), the final round's, weight share,
    deviation, cost, unstable runs, and ``same_as``."""
    rows = []
    for (rule, split, attack, f, told), group in labelled(runs).groupby(CELL):
        group = by_seed(group)
        accuracy, final = bounded_ci(_column(group, ACCURACY)), bounded_ci(_column(group, FINAL))
        share = bounded_ci(_column(group, SHARE)) if attack != "none" else Interval(0.0, np.nan, np.nan, ())
        deviation = bounded_ci(_column(group, DEVIATION), (0.0, math.inf)) if attack != "none" else None
        unstable = group.get("tags.unstable", pd.Series(None, index=group.index))
        rows.append(
            {
                "rule": rule,
                "split": split,
                "attack": attack,
                "f": int(f),
                "told": int(told),
                "clients": group["clients"].max(),
                "runs": len(group),
                "seeds": " ".join(_seeds(group)),
                **_interval("accuracy", accuracy),
                "final_accuracy_mean": final.mean,
                **_interval("weight_share", share),
                **_interval("deviation", deviation or Interval(np.nan, np.nan, np.nan, ())),
                "unstable_runs": int(unstable.notna().sum()),
                "diverged_runs": int(group["diverged"].sum()),
                "wall_s_mean": float(np.nanmean(_column(group, WALL))) if len(group) else np.nan,
                "upload_mb_mean": float(np.nanmean(_column(group, UPLOAD))) if len(group) else np.nan,
            }
        )
    table = pd.DataFrame(rows)
    if len(table):
        table["same_as"] = [_same_as(table, row) for _, row in table.iterrows()]
    return table


def _interval(name: str, interval: Interval) -> dict:
    return {f"{name}_mean": interval.mean, **interval.columns(name)}


def tied(a, b) -> bool:
    """Whether two cells' runs have the same seeds and accuracies within ``TIE`` of each other seed by seed."""
    if a["seeds"] != b["seeds"] or not a["seeds"]:
        return False
    x, y = Interval.from_row(a, "accuracy").values, Interval.from_row(b, "accuracy").values
    return len(x) == len(y) and all(abs(u - v) <= TIE or (math.isnan(u) and math.isnan(v)) for u, v in zip(x, y))


def _same_as(table: pd.DataFrame, row) -> str:
    """The attack a variant is reported as (``VARIANTS``) when its cell is tied with that attack's, else ""."""
    base = VARIANTS.get(row["attack"])
    if base is None:
        return ""
    match = table[(table["rule"] == row["rule"]) & (table["split"] == row["split"]) & (table["attack"] == base)]
    match = match[(match["f"] == row["f"]) & (match["told"] == row["told"])]
    return base if len(match) and tied(row, match.iloc[0]) else ""


def simultaneous(row, k: int) -> tuple[float, float]:
    """The cell's accuracy interval at the Bonferroni level 1 - (1 - CONFIDENCE) / k, cut to [0, 1]; the whole range
    where it has none (a single run): it then bounds nothing."""
    interval = bounded_ci(Interval.from_row(row, "accuracy").values, (0.0, 1.0), 1 - (1 - CONFIDENCE) / k)
    return (0.0, 1.0) if math.isnan(interval.lo) else (interval.lo, interval.hi)


def diverged(runs: pd.DataFrame) -> pd.Series:
    """Which runs failed because the model became non-finite (the tag ``failure_reason``, a ``DivergenceError``):
    the matrix keeps them (the attack won), scored 0 (``labelled``); other failed runs are left out."""
    if "status" not in runs:
        return pd.Series(False, index=runs.index)
    reason = runs.get("tags.failure_reason", pd.Series(None, index=runs.index)).astype(str)
    return (runs["status"] == "FAILED") & reason.str.startswith("DivergenceError")


def worst(table: pd.DataFrame) -> pd.DataFrame:
    """Per (rule, split, f, told): the lowest mean accuracy over the distinct attacks (those not ``same_as``
    another), every attack tied with it named (``tied``), and its interval: the minimum over the k attacks of
    their simultaneous intervals (``simultaneous``). f = 0: the run without attack, its own interval."""
    rows = []
    for (rule, split, f, told), group in table.groupby(["rule", "split", "f", "told"]):
        distinct = group[group["same_as"] == ""] if "same_as" in group else group
        k = len(distinct)
        low = distinct.loc[distinct["accuracy_mean"].idxmin()]
        names = sorted({other["attack"] for _, other in distinct.iterrows() if tied(low, other)}, key=_order_key)
        if f == 0 or k == 1:
            lo, hi = low["accuracy_lo"], low["accuracy_hi"]
        else:
            bounds = [simultaneous(other, k) for _, other in distinct.iterrows()]
            lo, hi = min(b[0] for b in bounds), min(b[1] for b in bounds)
        rows.append(
            {
                "rule": rule,
                "split": split,
                "f": int(f),
                "told": int(told),
                "attack": " = ".join(names),
                "accuracy_mean": low["accuracy_mean"],
                "accuracy_lo": lo,
                "accuracy_hi": hi,
                "accuracy_split": bool(low["accuracy_split"]),
                "accuracy_values": low["accuracy_values"],
                "runs": int(low["runs"]),
                "diverged_runs": int(low["diverged_runs"]),
                "attacks": k,
            }
        )
    return pd.DataFrame(rows)


KNOWN = [
    "fedavg", "fedsoftmax", "fedmax", "fedsoftmax_trim", "fedsoftmax_cap", "median", "trimmed_mean", "krum",
    "geomed", "centered_clip", "fltrust", "median_bucketing", "centered_clip_bucketing", "trimmed_mean_nnm",
    "krum_nnm", "none", "label_flip", "sign_flip", "sign_flip_strong", "alie", "alie_adaptive", "ipm", "ipm_strong",
    "ipm_adaptive", "loss_lie_flip",
]  # fmt: skip


def _order_key(value, first=("fedavg", "none")) -> tuple:
    return (value not in first, KNOWN.index(value) if value in KNOWN else len(KNOWN), str(value))


def _order(values, first=("fedavg", "none")) -> list:
    """Table order: the baseline first (fedavg, none), then as the sweep lists them where known, then by name."""
    return sorted(dict.fromkeys(values), key=lambda v: _order_key(v, first))


def _columns(table: pd.DataFrame) -> list[tuple[int, int]]:
    """The (f, told) columns: by f, the rule told the truth before a misspecified f."""
    pairs = {(int(f), int(t)) for f, t in zip(table["f"], table["told"])}
    return sorted(pairs, key=lambda p: (p[0], p[0] != p[1], p[1]))


def _f_label(f: int, told: int, clients: float) -> str:
    share = "" if np.isnan(clients) or not clients else f" ({100 * f / clients:.0f}%)"
    return f"f={f}{share}" + ("" if told == f else f", told {told}")


def markdown(table: pd.DataFrame, worst_table: pd.DataFrame, experiment: str, runs: pd.DataFrame) -> str:
    """The report: the worst case per rule, then every cell's accuracy, weight share and deviation, the unstable
    runs, then the cost."""
    clients = float(table["clients"].max()) if len(table) else np.nan
    columns = _columns(table)
    attacks = [a for a in _order(table["attack"].unique()) if a != "none"]
    rules, splits = _order(table["rule"].unique()), _order(table["split"].unique(), first=("iid",))
    commits = sorted(set(runs.get("tags.git_commit", pd.Series(dtype=object)).dropna().astype(str)))
    seeds = sorted(set(runs["params.seed"].astype(str)), key=lambda v: (len(v), v)) if "params.seed" in runs else []
    tails = sorted(set(pd.to_numeric(runs.get("params.schedule.tail", pd.Series(dtype=float))).dropna().astype(int)))
    window = f"its last {', '.join(map(str, tails))} rounds" if tails else "its last rounds"
    lost = int(diverged(runs).sum())
    text = [
        f"# {experiment}: clients that lie\n",
        f"{len(runs)} runs ({lost} of them FAILED as diverged, kept and scored 0); seeds {', '.join(seeds) or '-'}; commit {', '.join(commits) or 'unknown'}. "
        f"Each cell: tail test accuracy (each run's mean over {window}), mean over the seeds with its 95% Student-t "
        "interval, cut to [0, 1] where it reaches past (then printed as [low, high]); with fewer than five seeds "
        "each seed's value follows in parentheses; `split` marks a cell whose seeds span over half the range "
        "(they disagree in kind: do not read its mean alone). f = 0 is the run without attack, the same in every "
        "attack's column; 'told' is the f the rule was told where it is not the true one.\n",
        "## Worst case over attacks\n",
        "Per rule, split and f: the lowest mean accuracy over the k distinct attacks (the `attacks` column of "
        "robustness_worst.csv), with every attack tied with it seed by seed (`a = b`); an attack that only adds a "
        "lie on a channel the rule does not read is counted as the attack it adds to. The interval is simultaneous "
        "over the k attacks (Bonferroni, each at 1 - 0.05 / k): it covers the smallest true mean; the point, the "
        "lowest of k noisy means, is biased low.\n",
    ]
    key = worst_table.set_index(["rule", "split", "f", "told"])
    header = ["rule"] + [f"{s} {_f_label(f, t, clients)}" for s in splits for f, t in columns]
    rows = []
    for rule in rules:
        row = [rule]
        for split in splits:
            for f, told in columns:
                if (rule, split, f, told) not in key.index:
                    row.append("-")
                    continue
                w = key.loc[(rule, split, f, told)]
                cell = Interval.from_row(w, "accuracy").cell(brackets=f > 0)  # simultaneous: never a plain ± half-width
                if w["diverged_runs"]:
                    cell += f" ({int(w['diverged_runs'])}/{int(w['runs'])} diverged)"
                row.append(cell + ("" if f == 0 else f" ({w['attack']})"))
        rows.append(row)
    text.append(markdown_table(header, rows))
    by_cell = table.set_index(CELL)
    for title, name in (
        ("Tail test accuracy", "accuracy"),
        (
            "The attackers' share of the aggregation weight (mean over rounds; n/a where the rule's alpha is not a "
            "convex combination: FLTrust, centered clipping, norm bounding)",
            "weight_share",
        ),
        (
            "Deviation: ||aggregate - the rule's aggregate of the honest updates alone|| / the latter's norm (mean "
            "over rounds)",
            "deviation",
        ),
    ):
        for split in splits:
            text.append(f"## {title}: {split}\n")
            header = ["rule", "attack"] + [_f_label(f, t, clients) for f, t in columns]
            rows = []
            for rule in rules:
                for attack in attacks:
                    row = [rule, attack]
                    for f, told in columns:
                        cell = (rule, split, "none" if f == 0 else attack, f, told)
                        if cell not in by_cell.index:
                            row.append("-")
                            continue
                        found = by_cell.loc[cell]
                        shown = Interval.from_row(found, name).cell(".3g" if name == "deviation" else 3)
                        if name != "accuracy" and f == 0:
                            shown = "-"
                        elif name == "weight_share" and f > 0 and np.isnan(found["weight_share_mean"]):
                            shown = "n/a"
                        elif found.get("same_as"):
                            shown += f" (= {found['same_as']})"
                        if name == "accuracy" and found["diverged_runs"]:
                            shown += f" ({int(found['diverged_runs'])}/{int(found['runs'])} diverged)"
                        row.append(shown)
                    rows.append(row)
            text.append(markdown_table(header, rows))
    unstable = table[table["unstable_runs"] > 0]
    text.append("## Runs tagged unstable\n")
    if len(unstable):
        text.append(
            "Runs whose test accuracy swung more than `metrics.unstable_swing` over their tail (their final round "
            "alone would misdescribe them), per rule and split: unstable runs / runs.\n"
        )
        rows = []
        for rule in rules:
            mine = table[table["rule"] == rule]
            rows.append(
                [rule]
                + [
                    f"{int(m['unstable_runs'].sum())}/{int(m['runs'].sum())}"
                    for split in splits
                    for m in [mine[mine["split"] == split]]
                ]
            )
        text.append(markdown_table(["rule"] + splits, rows))
    else:
        text.append("None.\n")
    text.append("## Cost\n")
    text.append("Per run: the rounds' wall-clock seconds and the megabytes uploaded, mean over the rule's cells.\n")
    rows = []
    for rule in rules:
        mine = table[table["rule"] == rule]
        rows.append(
            [
                rule,
                f"{mine['wall_s_mean'].mean():.2f}",
                f"{mine['wall_s_mean'].max():.2f}",
                f"{mine['upload_mb_mean'].mean():.1f}",
            ]
        )
    text.append(markdown_table(["rule", "seconds (mean)", "seconds (slowest cell)", "MB uploaded"], rows))
    short = table[table["runs"] < table["runs"].max()]
    if len(short):
        text.append(f"\n{len(short)} cells have fewer runs than the others (unfinished or failed jobs).\n")
    return "\n".join(text)


def heatmaps(table: pd.DataFrame, worst_table: pd.DataFrame, out: Path, experiment: str) -> list[Path]:
    """``robustness_worst.png`` (per rule: (f, told) x split, the worst case over attacks) and
    ``robustness_<split>.png`` (per rule: attack x (f, told)), on one colour scale, each square annotated with its
    mean tail accuracy; a ``split`` cell is hatched and annotated with its seeds' range instead (its mean is no
    reading of it)."""
    from matplotlib.patches import Rectangle

    from fedrun.plots import plt

    rules, splits = _order(table["rule"].unique()), _order(table["split"].unique(), first=("iid",))
    columns = _columns(table)
    attacks = [a for a in _order(table["attack"].unique()) if a != "none"]
    clients = float(table["clients"].max()) if len(table) else np.nan
    cols = min(5, len(rules))
    rows_n = -(-len(rules) // cols)
    paths = []

    def panel_grid(name, cell_rows, cell_cols, value, row_labels, col_labels, title, width=2.3):
        fig, axes = plt.subplots(
            rows_n, cols, figsize=(width * cols + 1, 0.42 * len(cell_rows) * rows_n + 1.2 * rows_n), squeeze=False,
            layout="constrained",
        )  # fmt: skip
        image = None
        for index, ax in enumerate(axes.flat):
            if index >= len(rules):
                ax.axis("off")
                continue
            rule = rules[index]
            found = [[value(rule, r, c) for c in cell_cols] for r in cell_rows]
            grid = np.array([[np.nan if v is None else v.mean for v in line] for line in found], dtype=float)
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                interval = found[i][j]
                if interval is None or np.isnan(v):
                    continue
                if interval.split:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="lightgrey", hatch="///", lw=0))
                    low, high = np.nanmin(interval.values), np.nanmax(interval.values)
                    ax.text(j, i, f"split\n{low:.2f}-{high:.2f}", ha="center", va="center", fontsize=6.5)
                    continue
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v < 0.6 else "black")
            ax.set_xticks(range(len(cell_cols)), col_labels, fontsize=7)
            ax.set_yticks(range(len(cell_rows)), row_labels if index % cols == 0 else [""] * len(cell_rows), fontsize=7)
            ax.set_title(rule, fontsize=9)
        fig.colorbar(image, ax=axes, shrink=0.8, label="tail accuracy (seed mean)")
        fig.suptitle(title, fontsize=10)
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    low = worst_table.set_index(["rule", "split", "f", "told"])
    panel_grid(
        "robustness_worst.png",
        columns,
        splits,
        lambda rule, ft, split: (
            Interval.from_row(low.loc[(rule, split, *ft)], "accuracy") if (rule, split, *ft) in low.index else None
        ),
        [_f_label(f, t, clients) for f, t in columns],
        splits,
        f"{experiment}: worst case over attacks (rows: attackers; columns: split)",
    )
    by_cell = table.set_index(CELL)

    def cell(rule, attack, ft, split):
        key = (rule, split, "none" if ft[0] == 0 else attack, *ft)
        return Interval.from_row(by_cell.loc[key], "accuracy") if key in by_cell.index else None

    for split in splits:
        panel_grid(
            f"robustness_{split}.png",
            attacks,
            columns,
            lambda rule, attack, ft, split=split: cell(rule, attack, ft, split),
            attacks,
            [f"{f}" if f == t else f"{f}/{t}" for f, t in columns],
            f"{experiment}, {split}: tail test accuracy (rows: attack; columns: attackers f, or f/told)",
            width=2.6,
        )
    return paths


def report(runs: pd.DataFrame, out: Path, experiment: str) -> tuple[str, dict[str, pd.DataFrame], list[Path]]:
    """The report's text (``robustness.md``), its tables (``robustness.csv``: every cell; ``robustness_worst.csv``)
    and the heatmaps it wrote to ``out``."""
    table = cells(runs)
    worst_table = worst(table)
    text = markdown(table, worst_table, experiment, runs)
    tables = {"robustness.csv": table, "robustness_worst.csv": worst_table}
    return text, tables, heatmaps(table, worst_table, Path(out), experiment)
