"""KL along a thinking model's replies, apart for the trace and the answer (thinking.kl_split_metrics).

Hand-built served texts whose trace and answer positions are known by construction (one token per character, so
the positions are counted by hand), a real tokenizer's boundary checked against tokenizing the trace on its own,
and the report section that shows it.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from harness.evaluation import thinking
from harness.evaluation.thinking import ThinkingSpec

TAGS = ThinkingSpec(mode="tags")


class _Text:
    """A served reference text (ReferenceText's prompt_and_reply), one token per character."""

    def __init__(self, prompt: str, reply: str):
        self.prompt_ids, self.reply_ids = [ord(c) for c in prompt], [ord(c) for c in reply]

    def prompt_and_reply(self):
        return self.prompt_ids, self.reply_ids


def _decode(ids):
    return "".join(chr(i) for i in ids)


def _rows(slice_name: str, index: int, text: _Text, kl, agree) -> pd.DataFrame:
    """The divergence stage's rows of one text: position p (1..T-1) predicts token p; reply from the prompt's end."""
    n = len(text.prompt_ids) + len(text.reply_ids)
    positions = np.arange(1, n)
    return pd.DataFrame({"slice": slice_name, "text": index, "position": positions,
                         "kind": np.where(positions >= len(text.prompt_ids), "reply", "prompt"),
                         "kl": kl(positions), "kl_reverse": 0.0, "nll_ref": 1.0, "nll_quant": 1.0 + kl(positions),
                         "top1_ref": 7, "top1_quant": np.where(agree(positions), 7, 8), "p_ref": 0.5, "p_quant": 0.5})


def test_answer_token_counts_the_trace_by_hand():
    # "<think>ab</think>" is 17 characters: the answer "c" starts at reply token 17
    assert thinking.answer_token([ord(c) for c in "<think>ab</think>c"], _decode, TAGS) == 17
    assert thinking.answer_token([ord(c) for c in "<think>ab and on"], _decode, TAGS) == 16  # unclosed: all trace
    assert thinking.answer_token([ord(c) for c in "just 4"], _decode, TAGS) == 0  # no trace: all answer
    # the prompt opened the trace (DeepSeek-R1's template): "so 4</think>" is 12 characters of trace
    assert thinking.answer_token([ord(c) for c in "so 4</think>4"], _decode, TAGS, "<|Assistant|><think>\n") == 12


def test_kl_split_against_hand_means():
    """Math slice: text 0 = prompt "Q?" (2 tokens) + "<think>ab</think>c" (17 trace tokens, 1 answer); text 1 =
    prompt "Q?" + "<think>abc" (unclosed: 10 trace tokens); a plain text 2 (no prompt/reply split) is left out.
    KL at position p is p / 100; top-1 disagrees at positions 5 and 19. Code slice: text 0 = "R" + "42" (no
    trace: 2 answer tokens)."""
    texts = {"math": [_Text("Q?", "<think>ab</think>c"), _Text("Q?", "<think>abc"), None],
             "code": [_Text("R", "42")]}
    kl = lambda p: p / 100.0  # noqa: E731
    agree = lambda p: (p != 5) & (p != 19)  # noqa: E731
    plain = pd.DataFrame({"slice": "math", "text": 2, "position": [1, 2], "kind": "plain", "kl": 9.0,
                          "kl_reverse": 0.0, "nll_ref": 1.0, "nll_quant": 1.0, "top1_ref": 7, "top1_quant": 7,
                          "p_ref": 0.5, "p_quant": 0.5})
    tokens = pd.concat([_rows("math", 0, texts["math"][0], kl, agree), _rows("math", 1, texts["math"][1], kl, agree),
                        plain, _rows("code", 0, texts["code"][0], kl, agree)], ignore_index=True)
    metrics = thinking.kl_split_metrics(tokens, texts, TAGS, _decode)
    # math trace positions: text 0 at 2..18 (17), text 1 at 2..11 (10); the answer: text 0 at 19
    trace = [p / 100 for p in range(2, 19)] + [p / 100 for p in range(2, 12)]
    assert metrics["math/n_tokens_trace"] == 27
    assert metrics["math/kl_trace_mean"] == pytest.approx(sum(trace) / 27)
    assert metrics["math/top1_agree_trace"] == pytest.approx(25 / 27)  # position 5 disagrees, in both texts
    assert metrics["math/n_tokens_answer"] == 1
    assert metrics["math/kl_answer_mean"] == pytest.approx(0.19)
    assert metrics["math/top1_agree_answer"] == 0.0  # position 19 disagrees
    # code: positions 1 and 2 predict "4" and "2", both answer
    assert metrics["code/kl_answer_mean"] == pytest.approx(0.015) and "code/kl_trace_mean" not in metrics
    assert metrics["overall/n_tokens_answer"] == 3
    assert metrics["overall/kl_answer_mean"] == pytest.approx((0.19 + 0.01 + 0.02) / 3)
    assert metrics["overall/kl_trace_mean"] == pytest.approx(metrics["math/kl_trace_mean"])
    # thinking off: nothing (a non-thinking run's keys are unchanged)
    assert thinking.kl_split_metrics(tokens, texts, thinking.OFF, _decode) == {}


@pytest.mark.slow
def test_a_real_tokenizers_boundary_is_the_trace_tokenized_alone():
    """SmolLM2's tokenizer (the tiny model's): the answer starts after as many tokens as the trace with its tags
    has when tokenized on its own, where the boundary falls between tokens."""
    from harness.config import compose, to_config
    from harness.models import loading

    cfg = to_config(compose(["model=tiny_random"]))
    tokenizer = loading.load(cfg.model, cfg.paths.cache_dir).tokenizer
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for trace, answer in [("<think>\nok so 4</think>", "\n\n4"), ("<think>Let me add 12 and 30.</think>", " 42"),
                          ("<think>\n\n</think>", "\n\nThe answer is 7.")]:
        ids = encode(trace + answer)
        assert ids[:len(encode(trace))] == encode(trace)  # the boundary falls between tokens here
        assert thinking.answer_token(ids, tokenizer.decode, TAGS) == len(encode(trace))


def test_report_section_shows_the_intervals_and_the_split():
    metrics = {"math/think_n": 40.0, "math/think_unclosed_ref": 0.1, "math/think_unclosed_quant": 0.25,
               "math/think_unclosed_delta": 0.15, "math/think_unclosed_delta_ci_low": 0.05,
               "math/think_unclosed_delta_ci_high": 0.26, "math/think_tokens_ref_mean": 100.0,
               "math/think_tokens_quant_mean": 120.0, "math/think_tokens_ratio": 1.2,
               "math/think_tokens_ratio_ci_low": 1.1, "math/think_tokens_ratio_ci_high": 1.3,
               "math/kl_trace_mean": 0.031, "math/top1_agree_trace": 0.9, "math/n_tokens_trace": 900.0}
    text = thinking.markdown(metrics, "math")
    assert "| trace never closed | 10.0 | 25.0 | +15.0 [+5.0, +26.0] |" in text
    assert "change +20.0 [+10.0, +30.0] %" in text
    assert "| trace | 900 | 0.031 | 90.0 |" in text
    assert thinking.markdown(metrics, "code") == ""  # no trace metrics: no section
