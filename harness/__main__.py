"""``python -m harness model=... quant=... slices=...`` — see README.md.

Hydra composes and validates the config; errors a user can fix (an unknown config-group option,
a model that cannot be loaded, a scheme that cannot apply, an unusable slice or tracking store —
:func:`harness.cli.user_errors`) print one ``error: ...`` line naming the fix and exit with
status 2, without Hydra's "Error executing job" traceback. A disk that fills up during the job
prints one line too (where, how much, how to resume) and exits with 75; Ctrl-C prints one line (what
is kept, how to resume) and exits with 130. Real bugs keep their traceback.
The console shows the job's progress and the harness's messages; libraries' messages go to
``results/<run>/job.log`` (:func:`harness.infra.joblog.job_console`; ``hydra.verbose=true`` shows them too).
"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from harness import cli
from harness.config import CONF_DIR, register_configs
from harness.infra import joblog

register_configs()

EXIT_INTERRUPTED = 130  # a shell's status for a process ended by SIGINT


def interrupted_message(cfg: DictConfig) -> str:
    """What Ctrl-C keeps and how to go on: finished work is cached, so the same command resumes."""
    return (f"the references and answers finished so far are kept (cache: {cfg.paths.cache_dir}; request "
            f"checkpoints: {cfg.paths.results_dir}); run the same command again to resume from them")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    from harness.config import name_what_ran
    from harness.job import disk
    from harness.job.pipeline import run

    name_what_ran(cfg, list(HydraConfig.get().overrides.task))  # an overridden scheme's name says so
    try:
        with joblog.job_console(verbose=bool(HydraConfig.get().verbose)):
            result = run(cfg)
    except cli.user_errors() as exc:
        sys.exit(cli.fail(str(exc)))  # SystemExit passes Hydra's job wrapper: no traceback around it
    except KeyboardInterrupt:  # Ctrl-C: one line; a server the job started is stopped by its own exit handler
        print(f"\ninterrupted: {interrupted_message(cfg)}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:  # a full disk mid-job: one line, a status of its own, a rerun resumes
        if not disk.is_disk_full(exc):
            raise
        paths = {"paths.results_dir": cfg.paths.results_dir, "paths.cache_dir": cfg.paths.cache_dir}
        print(f"\nerror: {disk.disk_full_message(exc, paths)}", file=sys.stderr)  # below a progress bar
        sys.exit(disk.EXIT_DISK_FULL)
    return result.get("metrics", {}).get("overall/kl_mean")


if __name__ == "__main__":
    try:  # your config directories and model=hf:<id> (harness.infra.presets), checked before Hydra composes
        sys.argv[1:] = cli.prepare_main_args(sys.argv[1:])
    except cli.UsageError as exc:
        sys.exit(cli.fail(str(exc)))
    main()
