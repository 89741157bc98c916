"""PNG plots of a run: accuracy/loss curves and the alpha heatmap."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: runs are headless

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402

from fedrun.runfiles import replaced  # noqa: E402


def plot_curves(metrics: pd.DataFrame, path: Path, title: str = "") -> Path:
    """Accuracy and loss per round, evaluated rounds only."""
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for column, label in (
        ("test_accuracy", "test"),
        ("val_accuracy", "validation"),
        ("client_accuracy", "clients' local models, own held-out data"),
    ):
        if column in metrics and metrics[column].notna().any():
            evaluated = metrics[metrics[column].notna()]
            acc_ax.plot(evaluated["round"], evaluated[column], marker=".", label=label)
    for column, label in (
        ("train_loss", "train (global model, cohort)"),
        ("test_loss", "test"),
        ("val_loss", "validation"),
    ):
        if column in metrics and metrics[column].notna().any():
            evaluated = metrics[metrics[column].notna()]
            loss_ax.plot(evaluated["round"], evaluated[column], marker=".", label=label)
    acc_ax.set(xlabel="round", ylabel="accuracy", title="accuracy")
    loss_ax.set(xlabel="round", ylabel="cross-entropy", title="loss", yscale="log")
    for ax in (acc_ax, loss_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a run that failed before its first evaluation has no curves
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    save(fig, path)
    return path


def plot_alpha_heatmap(alpha: pd.DataFrame, path: Path, title: str = "", top: int = 0) -> Path:
    """Rounds x clients heatmap of alpha (0 for clients not sampled).

    Args:
        alpha: One row per round: a ``round`` column and one ``client_<id>`` column per client shown.
        path: Where to write the PNG.
        title: Figure title.
        top: When > 0, outline the ``top`` largest alphas of each round.
    """
    values = alpha.drop(columns="round").to_numpy()
    rounds, clients = values.shape
    fig, ax = plt.subplots(figsize=(min(16, 4 + 0.12 * clients), min(12, 2.5 + 0.12 * rounds)))
    image = ax.imshow(
        values,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        origin="lower",
        extent=(-0.5, clients - 0.5, alpha["round"].iloc[0] - 0.5, alpha["round"].iloc[-1] + 0.5),
    )
    if top > 0:
        rows, cols = np.nonzero(_top_mask(values, top))
        ax.scatter(
            cols, alpha["round"].to_numpy()[rows], s=6, c="red", marker="s", label=f"top {top} alpha of the round"
        )
        ax.legend(loc="upper right", fontsize="small")
    fig.colorbar(image, ax=ax, label="alpha (aggregation weight)")
    ax.set(xlabel="client", ylabel="round", title=title or "aggregation weight per client and round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ids = [int(c.split("_", 1)[1]) for c in alpha.columns if c != "round"]  # a subset's columns are not 0..n-1
    ax.xaxis.set_major_formatter(
        FuncFormatter(lambda v, _: str(ids[int(round(v))]) if 0 <= round(v) < len(ids) else "")
    )
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    save(fig, path)
    return path


def save(fig, path: Path) -> None:
    """Write the figure to ``path`` (its format by the suffix) as a new file renamed over it (``fedrun.runfiles``:
    never through a link in a run dir), and close it."""
    with replaced(path, "wb") as handle:
        fig.savefig(handle, dpi=110, format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)


def _top_mask(values: np.ndarray, top: int) -> np.ndarray:
    mask = np.zeros_like(values, dtype=bool)
    k = min(top, values.shape[1])
    order = np.argsort(-values, axis=1, kind="stable")[:, :k]
    np.put_along_axis(mask, order, True, axis=1)
    return mask & (values > 0)
