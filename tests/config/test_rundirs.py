"""Run dirs from elsewhere are data, never code, at the config level: a resumed config that names code outside
fedrun's options is refused before anything is built. The crafted dirs are built here (tests/e2e/test_rundirs.py
resumes one through the real command)."""

import pickle
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import fedrun.cli.resume as resume
from fedrun.cli.build import setup
from fedrun.errors import ConfigError

# Read at use (not imported by name), so that each test fails for its own reason on a fedrun without them.
TRUST_VARIABLE = "FEDRUN_TRUST"


class Payload:
    """A pickle that creates ``marker`` when it is loaded (any loader that unpickles runs it)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


# The loaders the review found running a run dir's pickle, each with the keyword that names the file.
LOADERS = {
    "torch.load": {"f": None, "weights_only": False},
    "numpy.load": {"file": None, "allow_pickle": True},
    "joblib.load": {"filename": None},
    "pandas.read_pickle": {"filepath_or_buffer": None},
}


def crafted_run(directory: Path, compose_config, loader: str) -> Path:
    """A run dir whose ``dataset`` group (the first one built) loads the dir's own pickle with ``loader``."""
    directory.mkdir()
    (directory / "payload.pkl").write_bytes(pickle.dumps(Payload(directory.parent / "marker")))
    config = OmegaConf.to_container(compose_config("schedule.rounds=3", "tracking.enabled=false"), resolve=True)
    arguments = {k: str(directory / "payload.pkl") if v is None else v for k, v in LOADERS[loader].items()}
    config["dataset"] = {"_target_": loader, **arguments}
    OmegaConf.save(OmegaConf.create(config), directory / "config.yaml")
    return directory


@pytest.mark.parametrize("loader", list(LOADERS))
def test_a_resumed_config_that_loads_the_dir_s_pickle_is_refused_before_anything_is_built(
    tmp_path, compose_config, loader
):
    run = crafted_run(tmp_path / "run", compose_config, loader)
    outcome = None
    try:
        setup(resume.saved_config(run, str(run)))  # what ``fedrun resume=`` builds
    except Exception as exc:
        outcome = exc
    assert not (tmp_path / "marker").exists()  # the payload never ran
    assert isinstance(outcome, ConfigError)
    assert f"names '{loader}' at dataset._target_, and nothing was built" in str(outcome)


def test_a_run_started_with_ones_own_class_resumes_when_the_command_names_it_again(
    tmp_path, compose_config, monkeypatch
):
    run = tmp_path / "run"
    run.mkdir()
    saved = compose_config("device.backend=mypackage.trainers.MyTrainer", "model._target_=mypackage.nets.Net")
    OmegaConf.save(saved, run / "config.yaml", resolve=True)
    with pytest.raises(ConfigError) as refused:
        resume.saved_config(run, str(run))
    assert f"{TRUST_VARIABLE}=mypackage.nets.Net,mypackage.trainers.MyTrainer fedrun resume={run}" in str(refused.value)
    monkeypatch.setenv(TRUST_VARIABLE, "mypackage.trainers.MyTrainer")  # one of the two: still refused
    with pytest.raises(ConfigError, match="names 'mypackage.nets.Net' at model._target_"):
        resume.saved_config(run, str(run))
    monkeypatch.setenv(TRUST_VARIABLE, "mypackage.nets.Net, mypackage.trainers.MyTrainer")
    assert resume.saved_config(run, str(run)).device.backend == "mypackage.trainers.MyTrainer"


def test_a_saved_config_with_interpolations_or_a_dir_with_symbolic_links_is_refused(tmp_path, compose_config):
    run = tmp_path / "run"
    run.mkdir()
    config = OmegaConf.to_container(compose_config(), resolve=True)
    config["dataset"] = "${oc.decode:'{_target_: torch.load, f: x}'}"  # a node that only resolving builds
    OmegaConf.save(OmegaConf.create(config), run / "config.yaml")
    with pytest.raises(ConfigError, match=r"a config.yaml saved by fedrun \(resolved; dataset is"):
        resume.saved_config(run, str(run))
    OmegaConf.save(compose_config(), run / "config.yaml", resolve=True)
    (run / "metrics.csv").symlink_to(tmp_path / "yours.txt")  # a resume rewrites metrics.csv
    with pytest.raises(ConfigError, match="a run dir without links, symbolic or hard"):
        resume.saved_config(run, str(run))


def test_a_resumed_sweep_s_job_dir_is_checked_too(tmp_path, compose_config):
    job = tmp_path / "sweep" / "0"
    job.mkdir(parents=True)
    cfg = compose_config(f"resume={tmp_path / 'sweep'}")
    config = OmegaConf.to_container(cfg, resolve=True)
    config["dataset"] = {"_target_": "torch.load", "f": "payload.pkl"}
    OmegaConf.save(OmegaConf.create(config), job / "config.yaml")
    with pytest.raises(ConfigError, match="names 'torch.load' at dataset._target_"):
        resume.sweep_job(cfg, job)
    # a class the sweep's own command line names is the user's
    mine = compose_config(f"resume={tmp_path / 'sweep'}", "device.backend=mypackage.Trainer")
    OmegaConf.save(mine, job / "config.yaml", resolve=True)
    assert resume.sweep_job(mine, job) is None


MARKER_MODULE = "from pathlib import Path\nPath({marker!r}).write_text('imported')\n"


def test_resume_of_a_dir_naming_a_planted_backend_never_imports_it(tmp_path, compose_config, monkeypatch):
    marker = tmp_path / "marker"
    (tmp_path / "planted_backend.py").write_text(MARKER_MODULE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(compose_config("device.backend=planted_backend.Trainer"), run / "config.yaml", resolve=True)
    with pytest.raises(ConfigError, match="names 'planted_backend.Trainer' at device.backend"):
        setup(resume.saved_config(run, str(run)))
    assert not marker.exists()
