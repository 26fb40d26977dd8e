"""lm-eval's environment report (torch's collect_env: pip, nvidia-smi, lscpu as subprocesses) is not
run by the harness's evaluations, and lm-eval is left as installed outside them."""
from __future__ import annotations

from importlib.metadata import version

import pytest
import torch.utils.collect_env
import transformers
from lm_eval import evaluator

from harness.evaluation import evaluate
from harness.job import identity
from harness.config import to_config
from harness.models import loading as models
from harness.evaluation.slices import resolve
from tests.conftest import TINY_MATH


def _count_collect_env(monkeypatch) -> list[int]:
    """Calls of torch's collect_env from now on (a stand-in that answers at once)."""
    calls: list[int] = []
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: (calls.append(1), "an env")[1])
    return calls


def test_inside_the_call_lm_eval_records_versions_only_and_is_put_back_after(monkeypatch):
    calls = _count_collect_env(monkeypatch)
    installed = evaluator.add_env_info
    storage: dict = {}
    with evaluate.versions_only_env_info():
        evaluator.add_env_info(storage)
    assert calls == []
    assert storage["lm_eval_version"] == version("lm_eval")
    assert storage["transformers_version"] == transformers.__version__
    assert storage["pretty_env_info"].startswith("not collected")
    assert evaluator.add_env_info is installed
    with pytest.raises(KeyError), evaluate.versions_only_env_info():
        raise KeyError("a failed evaluation")
    assert evaluator.add_env_info is installed  # put back on an error too
    evaluator.add_env_info(storage)  # outside: lm-eval's own report, torch's collect_env included
    assert calls == [1] and storage["pretty_env_info"] == "an env"


@pytest.mark.slow
def test_an_evaluation_of_a_slice_does_not_collect_the_environment(make_cfg, monkeypatch):
    calls = _count_collect_env(monkeypatch)
    cfg = to_config(make_cfg(*TINY_MATH, "quant=none"))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    settings = identity.eval_settings(cfg, None)
    records, aggregates = evaluate.evaluate_slice(evaluate.make_lm(loaded.model, loaded.tokenizer, settings),
                                                  resolve(cfg.slices)[0], settings)
    assert len(records) == 36 and set(aggregates) == {"harness_math_gen", "harness_math_mc"}
    assert calls == []
