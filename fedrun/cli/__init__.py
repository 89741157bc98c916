"""The ``fedrun`` command: compose the config, validate and build every object, open tracking, run the engine.

This package is the only one that touches Hydra or OmegaConf; everything below it takes plain objects.
``main`` reads top to bottom; each step lives in a module of its own: ``job`` (a job, from its config to what it
found), ``resume`` (which config, dir and checkpoint a job runs with), ``build`` (every object, validated),
``runinfo`` (name, description, tags), ``sweeps`` (a sweep's MLflow parent run, cores per job, a resumed sweep's
jobs), ``entry`` (what runs before Hydra and Hydra's errors as one line).

This module imports Hydra, OmegaConf and ``entry`` only: ``--help``, ``--cfg``, ``--info``, every composition
error and every value a part's constructor refuses (``build.build_parts``, torch imported on first use:
``fedrun.lazy``) answer before torch, MLflow or a dataset is imported (``scripts/bench_cli_start.py`` measures it,
``tests/e2e/test_cli_start.py`` keeps it); a job imports ``fedrun.cli.job``.
"""

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fedrun.cli.entry import check_known_keys, check_run_keys, fail, one_line_errors
from fedrun.errors import ConfigError
from hydra_plugins.fedrun_grid_sweeper.grid_sweeper import FedrunGridSweeper
from hydra_plugins.fedrun_optuna_sweeper.optuna_sweeper import FedrunOptunaSweeper

__all__ = ["main"]

# ``${fedrun.either:a,b}``: a unless it is null or empty, else b (the run dir of ``resume=<dir>`` is that dir).
OmegaConf.register_new_resolver("fedrun.either", lambda value, default: value if value else default, replace=True)
# Hydra finds plugins by listing the hydra_plugins namespace, which an editable install (pip install -e .) hides
# from it (setuptools' editable finder lists no modules): the sweepers are registered here, however fedrun was installed.
Plugins.instance().register(FedrunOptunaSweeper)
Plugins.instance().register(FedrunGridSweeper)


@one_line_errors  # Hydra's composition errors (an unknown key, option or group, a bad override) as one line, exit 2
@hydra.main(config_path="pkg://fedrun.conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """Run one job; returns the final test accuracy (Hydra sweepers can use it). Its dir is locked while it runs
    (``fedrun.checkpoint.lock``) and released when it ends: a sweep's process runs its jobs one after another."""
    hydra_cfg = HydraConfig.get()
    # a new run's own keys and parts, before torch and MLflow (a resumed run's: once its config is read)
    parts = None
    if not cfg.get("resume"):
        try:
            check_known_keys(cfg, hydra_cfg)
            check_run_keys(cfg)
            from fedrun import lazy

            lazy.defer("torch")  # every part's module and constructor runs without it
            try:
                from fedrun.cli.build import build_parts

                parts = build_parts(cfg)
            except Exception as exc:
                # A single run's refusal exits at once; anything else lets this process go on (a sweep's next job,
                # a caller's except), where code that is not fedrun's may import torch's submodules.
                if hydra_cfg.mode == RunMode.MULTIRUN or not isinstance(exc, ConfigError):
                    lazy.load("torch")
                raise
            lazy.load("torch")  # here, on the main thread, before any code that is not fedrun's (fedrun.lazy)
        except ConfigError as exc:
            fail(hydra_cfg, f"fedrun: error: {exc}", 2)
    from fedrun import distributed
    from fedrun.checkpoint import held, unlock
    from fedrun.cli.job import run_job

    before = held()
    try:
        return run_job(cfg, hydra_cfg, parts)
    finally:
        for directory in held() - before:
            unlock(directory)
        distributed.close()  # a distributed run's group (also one resumed from a command line that does not say so)
