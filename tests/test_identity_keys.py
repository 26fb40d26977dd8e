"""A job's run key and its references' cache keys stay byte-identical when the code that builds them moves.

The expected keys below are pinned values, computed with the code as it was before the reference
stage took a :class:`ReferenceSpec` instead of the whole run config. Pinning is the requirement here,
not a shortcut: a changed key silently recomputes every cached reference and stops a sweep from
finding its finished runs. A change that means to change a key (a new setting that changes the
numbers) updates the pin of the configs it affects, and says so in the CHANGELOG.

The library versions in the reference key are pinned too (the installed ones change with the
environment, not with the code), and the slices are registry-style slices without files (an offline
slice's key hashes its generator's source, which other changes edit).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.config import SliceConfig, compose
from harness.evaluation.slices import Slice
from harness.job import identity
from harness.job import divergence_texts
from harness.config import to_config
from harness.job.identity import ReferenceSpec

BASE = ["model=tiny_random", "slices=[math]", "paths.results_dir=/nonexistent/results",
        "paths.cache_dir=/nonexistent/cache"]
SLICES = [Slice("pinned", SliceConfig(tasks=["task_a", "task_b"], size="quick"), None),
          Slice("from_reference", SliceConfig(tasks=["task_a"], size="quick", divergence_from_reference=True), None),
          Slice("long", SliceConfig(tasks=["task_a"], size="quick", metadata={"divergence_max_tokens": 4096}), None)]
MODEL = SimpleNamespace(identity={"source": "pinned", "weights": "0" * 16})  # all a key reads of a loaded model
VERSIONS = {"lm_eval": "0.4.x-pinned", "transformers": "4.x-pinned"}

# config overrides -> (run key with a model identity, run key without, reference key per slice,
#                      tokens scored per slice, whether each slice is scored on served texts)
PINNED = {
    "default": ([], "2ce3669f76c89e80", "7af6474770adea88",
                ["ef73c493bc1f37a18cdc7819", "4a0a27ab8c4639e5b20ecec1", "7fb8631d78219b8a3faa2c1e"],
                [1024, 1024, 2048], [True, True, True]),
    "vllm": (["eval.backend=vllm"], "d6be1d9d3e2cdf3b", "c81103d12e74ae88",
             ["ebfefedfe27c5f059ef147f1", "d3c67a586b1c15607a95d8b9", "238ad29487c43848a4b5a066"],
             [1024, 1024, 2048], [True, True, True]),
    "max_gen_toks": (["eval.max_gen_toks=8"], "1ac15c9354e0f96f", "a0ea694d1908bae6",
                     ["eab8fde72366b4356ad84bbd", "837254afbea77b46784bf927", "0e5e82a0c721f08a2e39c35c"],
                     [1024, 1024, 2048], [True, True, True]),
    "plain": (["eval.divergence_plain=true"], "a29448cb6f633515", "22ff2c08314b7e51",
              ["08212122bdda6ee90d5eb522", "8d1f4a1f7155592e02e50a97", "0dc57d42bcdbbccdff1c6cbf"],
              [1024, 1024, 2048], [False, True, False]),
    "chat_template": (["model.chat_template=true"], "f710f8d80a7af5fe", "8987d37b96c5452b",
                      ["8ff62f97156c29a95341f4f9", "fa35ad0bb0452a5863ff9960", "a2d445c8ee003f2eb3a4515b"],
                      [1024, 1024, 2048], [True, True, True]),
    "plain_chat_template": (["eval.divergence_plain=true", "model.chat_template=true"], "82606fefba278c9e",
                            "93a426f482ccc45d",
                            ["793babc07289a5de0156ee6d", "d19903cddf4f9ad987201fac", "4378a00475350d78065bfc8e"],
                            [1024, 1024, 2048], [True, True, True]),
    "no_chat_template": (["model.chat_template=false"], "2ce3669f76c89e80", "7af6474770adea88",
                         ["ef73c493bc1f37a18cdc7819", "4a0a27ab8c4639e5b20ecec1", "7fb8631d78219b8a3faa2c1e"],
                         [1024, 1024, 2048], [True, True, True]),
    "sequential": (["eval.sequential=true"], "80f27fd5f4f0ae71", "50514530a0641cb4",
                   ["ef73c493bc1f37a18cdc7819", "4a0a27ab8c4639e5b20ecec1", "7fb8631d78219b8a3faa2c1e"],
                   [1024, 1024, 2048], [True, True, True]),
    "topk_fast": (["eval.reference_store=topk", "eval.reference_topk=32", "eval.generator=hf", "eval.seed=7",
                   "eval.divergence_max_tokens=64", "model.max_length=512"], "b32e296694acdfe9", "952418b6e03b9bb2",
                  ["008cc8540cb38c322607668f", "9a26a87c415c234b975b497f", "56dcbfc308d2783ece1ff928"],
                  [64, 64, 512], [True, True, True]),
}


@pytest.mark.parametrize("name", list(PINNED))
def test_run_and_reference_keys_are_the_pinned_ones(name, monkeypatch):
    overrides, run, run_without_model, references, max_tokens, served = PINNED[name]
    monkeypatch.setattr(identity, "_version", VERSIONS.__getitem__)
    cfg = to_config(compose(BASE + overrides))
    spec = ReferenceSpec.of(cfg)
    assert identity.run_key(cfg, MODEL.identity) == run
    assert identity.run_key(cfg) == run_without_model
    assert [identity.reference_key(MODEL, s, spec) for s in SLICES] == references
    assert [divergence_texts.max_divergence_tokens(s, spec) for s in SLICES] == max_tokens
    assert [divergence_texts.served_format(s, spec) for s in SLICES] == served


def test_a_reference_spec_gives_the_jobs_evaluation_settings():
    cfg = to_config(compose(BASE + ["eval.max_gen_toks=8", "eval.backend=vllm", "model.chat_template=true"]))
    assert ReferenceSpec.of(cfg).eval_settings("/tokenizer") == identity.eval_settings(cfg, "/tokenizer")
    assert ReferenceSpec.of(cfg).eval_settings(None).batch_size == cfg.model.batch_size  # eval's falls back


def test_the_endpoint_divergence_topk_is_in_the_run_key_of_served_candidates_only():
    def key(*overrides: str) -> str:
        return identity.run_key(to_config(compose(BASE + list(overrides))))

    assert key("candidate.endpoint_divergence_topk=5") == key() == PINNED["default"][2]
    served = "candidate.endpoint=http://127.0.0.1:8000"
    assert key(served, "candidate.endpoint_divergence_topk=5") != key(served)
