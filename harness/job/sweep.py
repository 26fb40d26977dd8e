"""The sweep a job belongs to: the id that groups a sweep's runs in MLflow.

Every job of ``python -m harness -m ...`` is tagged ``harness.sweep_id`` in MLflow, so the
morning review filters one night's runs with ``tags.`harness.sweep_id` = '<id>'`` (or
``python -m harness.compare sweep=<id>``). The id is, in order:

1. ``tracking.tags.sweep_id=<name>`` (or an explicit ``harness.sweep_id`` tag) when given:
   name a sweep, or keep the id of an interrupted sweep when starting it again;
2. in a multirun, Hydra's sweep directory (``multirun/<date>/<time>`` by default, the same
   for every job of the sweep whatever the launcher: basic, submitit local or Slurm);
3. nothing for a single run.

The id is a tracking tag only: it is not part of the run key, so a config finished in an
earlier sweep is reused (not recomputed) by a later one, which logs it under its own id.
"""
from __future__ import annotations

from typing import Mapping

from harness.results.tracking import SWEEP_TAG

SWEEP_ID_KEY = "sweep_id"  # tracking.tags.sweep_id: the user's name for the sweep ("" = derive it)


def hydra_sweep_dir() -> str | None:
    """Hydra's sweep directory when this process runs a job of a multirun, else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return str(hydra_cfg.sweep.dir)


def sweep_id(tags: Mapping[str, str]) -> str | None:
    """The sweep id for a job whose tracking tags are ``tags`` (see the module docstring)."""
    explicit = str(tags.get(SWEEP_ID_KEY) or tags.get(SWEEP_TAG) or "").strip()
    return explicit or hydra_sweep_dir()


def tags_with_sweep_id(tags: Mapping[str, str]) -> dict[str, str]:
    """The tags to log: the user's ``sweep_id`` key replaced by the ``harness.sweep_id`` tag."""
    identifier = sweep_id(tags)
    out = {key: str(value) for key, value in tags.items() if key != SWEEP_ID_KEY}
    if identifier:
        out[SWEEP_TAG] = identifier
    return out


SLURM_LAUNCHERS = ("slurm", "slurm_70b")  # conf/hydra/launcher/*.yaml that submit to Slurm


def hydra_launcher() -> str | None:
    """The ``hydra/launcher`` option of this multirun job (``slurm``, ``local``, ...), else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return hydra_cfg.runtime.choices.get("hydra/launcher")


def shared_store_warning(uri: str, launcher: str | None) -> str | None:
    """Why an SQLite tracking store is unsafe for a Slurm sweep, or None when it is not one.

    Jobs of a Slurm sweep run on many nodes; SQLite over NFS/Lustre has no reliable locking
    across nodes, so concurrent writes from them can corrupt the database or fail with
    "database is locked". A tracking server serialises the writes.
    """
    if launcher not in SLURM_LAUNCHERS or not uri.startswith("sqlite:"):
        return None
    return (f"tracking.uri={uri} is an SQLite file, which jobs of a Slurm sweep (hydra/launcher={launcher}) write "
            "from many nodes at once over a shared filesystem: it can lock up or corrupt. Run an MLflow tracking "
            "server and pass tracking.uri=http://<host>:5000 (README: Sweeps on a cluster)")
