"""benchmarks/bench_kv_length.py on the tiny random model: texts, buckets, the written JSON/Markdown/PNG.

The SmolLM2 numbers in benchmarks/results/kv_length.* come from the same code at 4k-8k tokens;
this keeps the script from rotting and checks its bookkeeping against values computed here.
"""
from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pandas as pd
import pytest

from harness.config import REPO_DIR


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kv_length", REPO_DIR / "benchmarks" / "bench_kv_length.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class WordTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = False):
        return {"input_ids": list(range(len(text.split())))}


def test_long_texts_are_deterministic_distinct_and_long_enough(bench):
    first = bench.long_texts(WordTokenizer(), 2, 900)
    assert first == bench.long_texts(WordTokenizer(), 2, 900)
    assert first[0] != first[1]
    assert all(len(text.split()) >= 900 for text in first)


def test_summarize_buckets_tokens_by_position(bench):
    positions = np.arange(1, 5000)
    n = len(positions)
    tokens = pd.DataFrame({"slice": "kv4", "text": 0, "position": positions, "nll_ref": np.ones(n),
                           "nll_quant": np.ones(n), "kl": positions * 1e-6, "top1_ref": np.zeros(n, int),
                           "top1_quant": (positions >= 4096).astype(int), "p_ref": np.full(n, 0.5),
                           "p_quant": np.full(n, 0.5)})
    table = bench.summarize(tokens).set_index("bucket")
    assert table.loc["all", "n_tokens"] == n
    assert table.loc["[2048, 4096)", "n_tokens"] == 2048 and table.loc["[4096, inf)", "n_tokens"] == 5000 - 4096
    assert table.loc["[512, 1024)", "kl_mean"] == pytest.approx((512 + 1023) / 2 * 1e-6)
    assert table.loc["[4096, inf)", "top1_agree"] == 0.0 and table.loc["[2048, 4096)", "top1_agree"] == 1.0


@pytest.mark.slow
def test_the_script_runs_on_the_tiny_model_and_writes_its_results(bench, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_kv_length.py", "--model", "tiny_random", "--texts", "1",
                                      "--max-tokens", "160", "--cache-dir", str(cache_dir), "--out", str(tmp_path)])
    bench.main()
    result = json.loads((tmp_path / "kv_length.json").read_text())
    assert result["schemes"] == ["kv8", "kv4", "int4_g128"] and result["tokens_per_text"] == [160]
    rows = pd.DataFrame(result["rows"])
    for scheme in result["schemes"]:
        mine = rows[rows["scheme"] == scheme].set_index("bucket")
        assert mine.loc["all", "n_tokens"] == 159  # 160 tokens predict 159 next tokens
        assert mine.loc["[0, 128)", "n_tokens"] + mine.loc["[128, 512)", "n_tokens"] == 159
        assert mine.loc["all", "kl_mean"] > 0  # every scheme changes something on a random model
    assert (tmp_path / "kv_length.png").read_bytes()[:4] == b"\x89PNG"
    text = (tmp_path / "kv_length.md").read_text()
    assert "| kv4 KL |" in text and "| int4_g128 top-1 |" in text
