"""The serving-engine registry (harness.engines): a new engine is one module that registers itself.

The toy engine here is that module's executable form: tests/fake_openai.py's server run in this process,
registered under a name and claiming the ``candidate.serve`` commands that start with ``fake-openai``. No
other file knows it, yet the served candidate, and a whole job, answer through it. The registry refuses an
unknown name in one line that lists the registered ones, and each built-in engine declares what it returns.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from harness import engines
from harness.evaluation.evaluate import check_settings
from harness.config import CandidateConfig
from harness.engines import registry
from harness.engines.base import Capabilities, InProcessEngine
from harness.engines.openai_endpoint import OpenAIEndpoint
from harness.engines.served import ServedCandidate
from harness.errors import UserError
from harness.evaluation import evaluate
from harness.config import to_config
from harness.job import pipeline as run_mod
from harness.models import loading as models
from tests.conftest import TINY_MATH

sys.path.insert(0, str(Path(__file__).parent))
from fake_openai import FakeServer  # noqa: E402

TOY_SERVE = "candidate.serve='fake-openai --port {port}'"


class FakeOpenAIEngine(OpenAIEndpoint):
    """A toy served engine: the fake OpenAI server, started in this process, answering with ``served_model``."""

    capabilities = Capabilities(generate=True, loglikelihood=True, prompt_logprobs=True, top_k=None,
                                starts_server=True)
    served_model: Any = None  # (model, tokenizer) the fake answers with; None: it lists a model and answers nothing

    def __init__(self, cfg: CandidateConfig, results_dir: Path) -> None:
        super().__init__(cfg, results_dir)
        self.fake: FakeServer | None = None  # started by start()

    @classmethod
    def serves(cls, cfg: CandidateConfig) -> bool:
        return (cfg.serve or "").split()[:1] == ["fake-openai"]

    @property
    def url(self) -> str:
        assert self.fake is not None, "not started"
        return self.fake.url

    def start(self) -> FakeOpenAIEngine:
        model, tokenizer = self.served_model or (None, None)
        self.fake = FakeServer(model, tokenizer, name="toy").__enter__()
        return super().start()

    def stop(self) -> None:
        if self.fake is not None and self.fake.thread.is_alive():
            self.fake.stop()


class DictEngine(InProcessEngine):
    """A toy in-process engine whose lm-eval model is a dict of its settings."""

    capabilities = Capabilities(generate=True, loglikelihood=False, prompt_logprobs=False, top_k=None,
                                starts_server=False)

    def lm(self) -> dict:
        return {"checkpoint": self.checkpoint, "max_length": self.max_length, "seed": self.seed}


@pytest.fixture
def toy_engines(monkeypatch):
    """The registry with the two toy engines added; as it was after the test."""
    monkeypatch.setattr(registry, "ENGINES", dict(registry.ENGINES))
    engines.register_engine("fake-openai", FakeOpenAIEngine)
    engines.register_engine("dict", DictEngine)
    monkeypatch.setattr(FakeOpenAIEngine, "served_model", None)


def test_an_unknown_engine_is_refused_in_one_line_naming_the_registered_ones(make_cfg):
    with pytest.raises(UserError, match=r"no serving engine is registered as 'tgi'; registered: llamacpp, "
                                        r"llamacpp-serve, openai, vllm, vllm-serve$") as err:
        engines.get_engine("tgi")
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=r"'openai' is a served engine.*in-process engines: vllm$"):
        engines.in_process_engine("openai")
    with pytest.raises(UserError, match=r"eval.backend='tgi': use one of \['hf', 'vllm'\]"):
        check_settings(to_config(make_cfg(*TINY_MATH, "eval.backend=tgi")))


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="'openai' is taken by OpenAIEndpoint"):
        engines.register_engine("openai", FakeOpenAIEngine)


def test_the_built_in_engines_declare_what_they_return():
    openai, serve, vllm = (engines.get_engine(name) for name in ("openai", "vllm-serve", "vllm"))
    assert (openai.served, serve.served, vllm.served) == (True, True, False)
    assert openai.capabilities == Capabilities(generate=True, loglikelihood=True, prompt_logprobs=True, top_k=None,
                                               starts_server=False)
    assert serve.capabilities == Capabilities(generate=True, loglikelihood=True, prompt_logprobs=True, top_k=20,
                                              starts_server=True)
    assert vllm.capabilities == Capabilities(generate=True, loglikelihood=True, prompt_logprobs=False, top_k=None,
                                             starts_server=False)
    assert serve.summary() == ("served, started by the harness; returns generation, log-likelihood, prompt "
                               "log-probs (top-20 at most by default)")
    assert vllm.summary() == "in this process; returns generation, log-likelihood"
    assert evaluate.backends() == ("hf", "vllm")
    # which served engine answers is the config's shape: a URL, or a command to start
    assert engines.served_engine(CandidateConfig(endpoint="http://127.0.0.1:8000"))[0] == "openai"
    assert engines.served_engine(CandidateConfig(serve="vllm serve d --port {port}"))[0] == "vllm-serve"


def test_a_registered_in_process_engine_is_an_eval_backend(toy_engines, make_cfg):
    assert evaluate.backends() == ("hf", "dict", "vllm")
    settings = evaluate.EvalSettings(backend="dict", max_length=512, seed=7)
    assert evaluate.make_lm(None, None, settings, checkpoint="exports/x") == {"checkpoint": "exports/x",
                                                                              "max_length": 512, "seed": 7}
    # the checks eval.backend=vllm has are every in-process engine's: it loads checkpoints from disk
    with pytest.raises(UserError, match="eval.backend=dict loads the reference from model.path"):
        check_settings(to_config(make_cfg(*TINY_MATH, "eval.backend=dict")))


def test_a_registered_served_engine_is_the_served_candidates_engine(toy_engines, tmp_path):
    cfg = CandidateConfig(serve="fake-openai --port {port}")
    candidate = ServedCandidate(cfg, tmp_path)
    assert candidate.engine_name == "fake-openai" and isinstance(candidate.engine, FakeOpenAIEngine)
    candidate.start()
    try:
        assert candidate.engine.healthy()
        assert candidate.params["candidate.served_model"] == "toy" and candidate.checkpoint_dir is None
    finally:
        candidate.stop()
    assert not candidate.engine.healthy()
    # a command that is not the toy's still goes to the built-in engine that starts servers
    assert engines.served_engine(CandidateConfig(serve="vllm serve d --port {port}"))[0] == "vllm-serve"


@pytest.mark.slow
def test_a_whole_job_answers_through_a_registered_engine(toy_engines, make_cfg, tmp_path, monkeypatch):
    """The toy engine serves the reference's own tiny model: every item answered as the reference answered it, the
    token divergence from its top-k log-probs, and its server stopped at the end."""
    small = [*TINY_MATH, "slices.math.n_items=8", "eval.max_gen_toks=12"]
    reference = to_config(make_cfg(*small, "quant=none"))
    loaded = models.load(reference.model, reference.paths.cache_dir)  # the same seeded tiny model the job loads
    monkeypatch.setattr(FakeOpenAIEngine, "served_model", (loaded.model, loaded.tokenizer))
    started: list[FakeOpenAIEngine] = []
    start = FakeOpenAIEngine.start
    monkeypatch.setattr(FakeOpenAIEngine, "start", lambda self: started.append(self) or start(self))
    result = run_mod.run(make_cfg(*small, "quant=external", TOY_SERVE))
    (engine,) = started
    assert engine.fake.completions > 0 and not engine.healthy()  # it answered, and was stopped
    assert result["candidate"]["candidate.served_model"] == "toy"
    assert result["candidate"]["candidate.endpoint_requests"] == engine.client.requests
    (results_dir,) = [d for d in (tmp_path / "results").iterdir() if (d / "summary.json").exists()]
    items = pd.read_parquet(results_dir / "items.parquet")
    assert (items["correct_ref"] == items["correct_quant"]).all()
    assert (items["response_ref"] == items["response_quant"]).all()
    tokens = pd.read_parquet(results_dir / "tokens.parquet")
    assert len(tokens) and (tokens["kl_bound"] == "topk_partition").all() and tokens["kl"].max() < 1e-4
