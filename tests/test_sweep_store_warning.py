"""A Slurm sweep with an SQLite tracking store warns at start, naming the fix."""
from __future__ import annotations

import logging

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import open_dict

from harness.job import pipeline as run_mod
from harness.job import sweep
from harness.config import CONF_DIR, register_configs
from harness.config import to_config


@pytest.fixture
def hydra_job():
    """Make this process look like one job of a multirun with the given launcher, as Hydra sets it up."""
    register_configs()

    def _set(launcher: str, mode: RunMode = RunMode.MULTIRUN, *overrides: str):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[f"hydra/launcher={launcher}", *overrides], return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.mode = mode
            cfg.hydra.runtime.choices["hydra/launcher"] = launcher  # what Hydra records when it launches
        HydraConfig.instance().set_config(cfg)
        return cfg
    yield _set
    HydraConfig.instance().cfg = None


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["slurm", "slurm_70b"])
def test_slurm_sweep_with_sqlite_store_warns_at_start(hydra_job, make_cfg, caplog, launcher, tmp_path):
    hydra_job(launcher)
    assert sweep.hydra_launcher() == launcher
    with caplog.at_level(logging.WARNING, logger="harness"):
        run_mod.preflight(to_config(make_cfg("model=tiny_random", "slices=[math]")))
    [line] = [r.getMessage() for r in caplog.records if "SHARED TRACKING STORE" in r.getMessage()]
    assert f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}" in line and f"hydra/launcher={launcher}" in line
    assert "tracking.uri=http://<host>:5000" in line and "README: Sweeps on a cluster" in line


@pytest.mark.slow
def test_no_warning_with_a_server_or_another_launcher_or_a_single_run(hydra_job):
    hydra_job("slurm")
    assert sweep.shared_store_warning("http://mlflow:5000", sweep.hydra_launcher()) is None
    assert sweep.shared_store_warning("sqlite:///x/mlflow.db", sweep.hydra_launcher()) is not None
    hydra_job("local")
    assert sweep.shared_store_warning("sqlite:///x/mlflow.db", sweep.hydra_launcher()) is None
    hydra_job("slurm", RunMode.RUN)  # python -m harness hydra/launcher=slurm without -m runs here, no sweep
    assert sweep.hydra_launcher() is None
    HydraConfig.instance().cfg = None
    assert sweep.hydra_launcher() is None  # not under Hydra at all (the Python API)
