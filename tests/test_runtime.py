"""The torch thread count a job chooses from the CPUs it was given (harness.infra.runtime)."""
from __future__ import annotations

import pytest
import torch

from harness.infra import runtime
from harness.cli import UsageError
from harness.config import RuntimeConfig


def test_the_configured_number_wins_over_everything():
    assert runtime.choose_threads(3, env={"OMP_NUM_THREADS": "1", "SLURM_CPUS_PER_TASK": "2"},
                                  affinity={0}) == (3, "runtime.threads")


def test_omp_num_threads_is_an_explicit_choice_of_the_environment():
    assert runtime.choose_threads(None, env={"OMP_NUM_THREADS": "2"}, affinity=range(16)) == (2, "OMP_NUM_THREADS")
    assert runtime.choose_threads(None, env={"OMP_NUM_THREADS": "4,2"}, affinity=range(16)) == (4, "OMP_NUM_THREADS")


def test_auto_uses_the_cpus_of_the_affinity_mask_not_the_machine():
    assert runtime.choose_threads(None, env={}, affinity={2, 5, 7}) == (3, "CPU affinity")


def test_slurm_cpus_per_task_caps_the_affinity():
    assert runtime.choose_threads(None, env={"SLURM_CPUS_PER_TASK": "4"}, affinity=range(64)) == (
        4, "SLURM_CPUS_PER_TASK")
    # A Slurm value above the mask cannot add CPUs the process may not run on.
    assert runtime.choose_threads(None, env={"SLURM_CPUS_PER_TASK": "8"}, affinity={0, 1}) == (2, "CPU affinity")


def test_unusable_environment_values_are_ignored():
    assert runtime.choose_threads(None, env={"OMP_NUM_THREADS": "", "SLURM_CPUS_PER_TASK": "many"},
                                  affinity={0, 1}) == (2, "CPU affinity")
    assert runtime.choose_threads(None, env={"OMP_NUM_THREADS": "0"}, affinity={0, 1, 2}) == (3, "CPU affinity")


def test_a_non_positive_setting_is_a_usage_error_naming_the_key():
    with pytest.raises(UsageError, match=r"runtime.threads=0.*null"):
        runtime.choose_threads(0, env={}, affinity={0})


def test_apply_sets_torch_and_reports_it():
    before = torch.get_num_threads()
    try:
        assert runtime.apply_threads(RuntimeConfig(threads=1)) == {"threads": 1, "threads_from": "runtime.threads"}
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
