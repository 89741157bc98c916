"""fedrun-import (fedrun/importer.py): a bad metrics file is refused in one line before the store is created."""

import pytest

from fedrun.errors import ConfigError

# fedrun-import: each crafted dir is refused in one line before the store is touched (the database is not even
# created), so no half-imported run is left RUNNING.
CONFIG = "schedule: {rounds: 2}\ntracking: {experiment: imported}\n"


BAD_DIRS = {
    "formula": ('round,test_accuracy\n1,=HYPERLINK("http://x")\n', "metrics.csv line 2 test_accuracy", "a number"),
    "word": ("round,test_accuracy\n1,high\n", "metrics.csv line 2 test_accuracy='high'", "a number"),
    "round abc": ("round,test_accuracy\nabc,0.5\n", "metrics.csv line 2 round='abc'", "a round"),
    "round of 20 digits": ("round,test_accuracy\n" + "9" * 20 + ",0.5\n", "metrics.csv line 2 round", "a round"),
    "a path as a name": ("round,../../x\n1,0.5\n", "metrics.csv column='../../x'", "a name MLflow accepts"),
    "a long name": (f"round,{'a' * 1000}\n1,0.5\n", "metrics.csv column='aaaa", "at most 250"),
    "no round": ("test_accuracy\n0.5\n", "metrics.csv=", "a round column"),
    "a short row": ("round,test_accuracy\n1\n", "metrics.csv line 2", "2 cells"),
}


@pytest.mark.parametrize("case", list(BAD_DIRS))
def test_fedrun_import_refuses_a_bad_metrics_file_before_it_creates_anything(tmp_path, case):
    metrics, key, allowed = BAD_DIRS[case]
    refused_before_the_store(tmp_path, {"metrics.csv": metrics}, key, allowed)


def refused_before_the_store(tmp_path, files: dict, key: str, allowed: str) -> None:
    """A run dir of ``files`` (and a config) is refused by fedrun-import naming ``key``, and no store is created."""
    from fedrun.importer import import_run

    run = tmp_path / "run"
    run.mkdir()
    for name, text in {"config.yaml": CONFIG, **files}.items():
        (run / name).write_text(text)
    with pytest.raises(ConfigError) as refused:
        import_run(run, f"sqlite:///{tmp_path / 'store.db'}", None)
    assert str(refused.value).startswith(key) and allowed in str(refused.value)
    assert not (tmp_path / "store.db").exists()


@pytest.mark.parametrize(
    "alpha,summary,key,allowed",
    [
        ("round,client_0\n1,=cmd()\n", "", "alpha.csv line 2 client_0", "a number"),
        ("round,client_0\n1,inf\n", "", "alpha.csv line 2 client_0='inf'", "a finite number"),
        ("round,client_0\n1,1e999\n", "", "alpha.csv line 2 client_0", "a finite number"),
        # a run that logged alpha.csv only as an artifact: its cells are checked all the same
        ("round,client_0\n1,nan\n", ",value\nalpha_series,artifacts\n", "alpha.csv line 2 client_0", "a finite number"),
    ],
)
def test_fedrun_import_refuses_an_alpha_file_that_is_no_weights(tmp_path, alpha, summary, key, allowed):
    files = {"metrics.csv": "round,test_accuracy\n1,0.5\n", "alpha.csv": alpha}
    refused_before_the_store(tmp_path, files | ({"summary.csv": summary} if summary else {}), key, allowed)
