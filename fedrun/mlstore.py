"""Where an MLflow tracking store lives, read without importing MLflow or torch (``fedrun-ui`` and the resume checks
read it before either): the file of a SQLite store, the folder of a file store, and the tag fedrun marks its
experiments with."""

from pathlib import Path

SQLITE = "sqlite:///"
# The experiment tag that makes MLflow's UI open an experiment on its runs (model training), not in GenAI mode.
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"


def local_store(uri: str, cwd: Path) -> Path | None:
    """The file of a SQLite store (``sqlite:///path``) or the folder of a file store (``file:path``, ``file://path``
    or a plain path) that ``uri`` names, joined to ``cwd`` where relative (not resolved); None for a tracking
    server's or a database server's URI."""
    if uri.startswith(SQLITE):
        return Path(cwd, uri[len(SQLITE) :])
    if uri.startswith("file:") or "://" not in uri:
        return Path(cwd, uri.removeprefix("file://").removeprefix("file:"))
    return None
