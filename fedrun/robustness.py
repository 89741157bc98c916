"""``fedrun-report --robustness``: the matrix of ``sweep=robustness`` (docs/results/robustness.md).

Every finished run is one seed of a cell (rule, split, attack, f): the rule is the run's ``defence`` choice (its
``aggregator`` where it has none), the split its ``partition``, f the number of attackers it drew (the tag
``attack_malicious_count``; 0 for ``attack=none``). The f = 0 cell is the run without attack and stands in every
attack's column. Per cell: final test accuracy as mean and 95% Student-t interval over the seeds, the attackers'
mean share of the aggregation weight (``attack/weight_share_mean``, per run the mean over its rounds), and the
cost (``total_wall_s``, the rounds' wall-clock seconds, and ``upload_mb_total``). The worst case of a rule at a
split and f is the attack with the lowest mean accuracy, reported with that attack's interval: ByzFL's headline
(its ``benchmark`` takes the minimum over attacks of the mean over seeds); a minimum over attacks seed by seed
would be biased low by the noise alone.
"""

from pathlib import Path

import numpy as np
import pandas as pd

from fedrun.metrics import markdown_table, mean_ci

ACCURACY, SHARE = "metrics.final_test_accuracy", "metrics.attack/weight_share_mean"
WALL, UPLOAD = "metrics.total_wall_s", "metrics.upload_mb_total"
CELL = ["rule", "split", "attack", "f"]


def labelled(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs with the cell columns ``rule``, ``split``, ``attack``, ``f`` and ``clients`` (the population)."""
    runs = runs.copy()
    rule = runs["tags.defence"] if "tags.defence" in runs else pd.Series(None, index=runs.index, dtype=object)
    runs["rule"] = rule.where(rule.notna() & (rule != "None"), runs["tags.aggregator"])
    runs["split"] = runs["tags.partition"]
    runs["attack"] = runs["tags.attack"].fillna("none") if "tags.attack" in runs else "none"
    count = runs.get("tags.attack_malicious_count", pd.Series(0, index=runs.index))
    runs["f"] = pd.to_numeric(count, errors="coerce").fillna(0).astype(int).where(runs["attack"] != "none", 0)
    runs["clients"] = pd.to_numeric(runs.get("params.partition.num_clients"), errors="coerce")
    return runs


def _stats(values: pd.Series) -> tuple[float, float]:
    values = pd.to_numeric(values, errors="coerce").dropna()
    return mean_ci(values.to_numpy()) if len(values) else (np.nan, np.nan)


def cells(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: runs, accuracy and weight share (mean, ci95), mean seconds and megabytes."""
    rows = []
    for (rule, split, attack, f), group in labelled(runs).groupby(CELL):
        accuracy, share = _stats(group[ACCURACY]), _stats(group.get(SHARE, pd.Series(dtype=float)))
        rows.append(
            {
                "rule": rule,
                "split": split,
                "attack": attack,
                "f": int(f),
                "clients": group["clients"].max(),
                "runs": len(group),
                "seeds": " ".join(sorted(group["params.seed"].astype(str))) if "params.seed" in group else "",
                "accuracy_mean": accuracy[0],
                "accuracy_ci95": accuracy[1],
                "weight_share_mean": share[0] if attack != "none" else 0.0,
                "weight_share_ci95": share[1] if attack != "none" else np.nan,
                "wall_s_mean": _stats(group.get(WALL, pd.Series(dtype=float)))[0],
                "upload_mb_mean": _stats(group.get(UPLOAD, pd.Series(dtype=float)))[0],
            }
        )
    return pd.DataFrame(rows)


def worst(table: pd.DataFrame) -> pd.DataFrame:
    """Per (rule, split, f): the attack of lowest mean accuracy with its interval (f = 0: the run without attack)."""
    rows = []
    for (rule, split, f), group in table.groupby(["rule", "split", "f"]):
        low = group.loc[group["accuracy_mean"].idxmin()]
        rows.append(
            {
                "rule": rule,
                "split": split,
                "f": int(f),
                "attack": low["attack"],
                "accuracy_mean": low["accuracy_mean"],
                "accuracy_ci95": low["accuracy_ci95"],
                "runs": int(low["runs"]),
                "attacks": len(group),
            }
        )
    return pd.DataFrame(rows)


def _order(values, first=("fedavg", "none")) -> list:
    """Table order: the baseline first (fedavg, none), then as the sweep lists them where known, then by name."""
    known = [
        "fedavg", "fedsoftmax", "fedmax", "fedsoftmax_trim", "fedsoftmax_cap", "median", "trimmed_mean", "krum",
        "geomed", "centered_clip", "none", "label_flip", "sign_flip", "alie", "ipm", "loss_lie_flip",
    ]  # fmt: skip
    values = list(dict.fromkeys(values))
    return sorted(values, key=lambda v: (v not in first, known.index(v) if v in known else len(known), str(v)))


def _f_label(f: int, clients: float) -> str:
    return f"f={f}" if np.isnan(clients) or not clients else f"f={f} ({100 * f / clients:.0f}%)"


def _acc(mean: float, half: float) -> str:
    if np.isnan(mean):
        return "-"
    return f"{mean:.3f}" if np.isnan(half) else f"{mean:.3f} ± {half:.3f}"


def markdown(table: pd.DataFrame, worst_table: pd.DataFrame, experiment: str, runs: pd.DataFrame) -> str:
    """The report: the worst case per rule, then every cell's accuracy and weight share, then the cost."""
    clients = float(table["clients"].max()) if len(table) else np.nan
    fs = sorted(table["f"].unique())
    attacks = [a for a in _order(table["attack"].unique()) if a != "none"]
    rules, splits = _order(table["rule"].unique()), _order(table["split"].unique(), first=("iid",))
    commits = sorted(set(runs.get("tags.git_commit", pd.Series(dtype=object)).dropna().astype(str)))
    seeds = sorted(set(runs["params.seed"].astype(str))) if "params.seed" in runs else []
    text = [
        f"# {experiment}: clients that lie\n",
        f"{len(runs)} finished runs; seeds {', '.join(seeds) or '-'}; commit {', '.join(commits) or 'unknown'}. "
        "Each cell: final test accuracy, mean ± 95% Student-t interval over the seeds. f = 0 is the run without "
        "attack, the same in every attack's column.\n",
        "## Worst case over attacks\n",
        "The attack of lowest mean accuracy (named) with its interval, per rule, split and f (ByzFL's headline).\n",
    ]
    key = worst_table.set_index(["rule", "split", "f"])
    header = ["rule"] + [f"{s} {_f_label(f, clients)}" for s in splits for f in fs]
    rows = []
    for rule in rules:
        row = [rule]
        for split in splits:
            for f in fs:
                if (rule, split, f) not in key.index:
                    row.append("-")
                    continue
                w = key.loc[(rule, split, f)]
                row.append(_acc(w["accuracy_mean"], w["accuracy_ci95"]) + ("" if f == 0 else f" ({w['attack']})"))
        rows.append(row)
    text.append(markdown_table(header, rows))
    by_cell = table.set_index(CELL)
    for title, column, half in (
        ("Final test accuracy", "accuracy_mean", "accuracy_ci95"),
        ("The attackers' share of the aggregation weight (mean over rounds)", "weight_share_mean", "weight_share_ci95"),
    ):
        for split in splits:
            text.append(f"## {title}: {split}\n")
            header = ["rule", "attack"] + [_f_label(f, clients) for f in fs]
            rows = []
            for rule in rules:
                for attack in attacks:
                    row = [rule, attack]
                    for f in fs:
                        cell = (rule, split, "none" if f == 0 else attack, f)
                        row.append(
                            _acc(by_cell.loc[cell, column], by_cell.loc[cell, half]) if cell in by_cell.index else "-"
                        )
                    rows.append(row)
            text.append(markdown_table(header, rows))
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
    """``robustness_worst.png`` (per rule: f x split, the worst case over attacks) and ``robustness_<split>.png``
    (per rule: attack x f), on one colour scale, each square annotated with its mean accuracy."""
    from fedrun.plots import plt

    rules, splits = _order(table["rule"].unique()), _order(table["split"].unique(), first=("iid",))
    fs = sorted(table["f"].unique())
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
            grid = np.array([[value(rule, r, c) for c in cell_cols] for r in cell_rows], dtype=float)
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                if not np.isnan(v):
                    ax.text(
                        j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v < 0.6 else "black"
                    )
            ax.set_xticks(range(len(cell_cols)), col_labels, fontsize=7)
            ax.set_yticks(range(len(cell_rows)), row_labels if index % cols == 0 else [""] * len(cell_rows), fontsize=7)
            ax.set_title(rule, fontsize=9)
        fig.colorbar(image, ax=axes, shrink=0.8, label="final test accuracy (mean over seeds)")
        fig.suptitle(title, fontsize=10)
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    low = worst_table.set_index(["rule", "split", "f"])["accuracy_mean"]
    panel_grid(
        "robustness_worst.png",
        fs,
        splits,
        lambda rule, f, split: low.get((rule, split, f), np.nan),
        [_f_label(f, clients) for f in fs],
        splits,
        f"{experiment}: worst case over attacks (rows: attackers; columns: split)",
    )
    mean = table.set_index(CELL)["accuracy_mean"]
    for split in splits:
        panel_grid(
            f"robustness_{split}.png",
            attacks,
            fs,
            lambda rule, attack, f, split=split: mean.get((rule, split, "none" if f == 0 else attack, f), np.nan),
            attacks,
            [str(f) for f in fs],
            f"{experiment}, {split}: final test accuracy (rows: attack; columns: attackers f)",
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
