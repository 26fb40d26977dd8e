"""Reasoning models (harness.evaluation.thinking): the answer after the trace, truncation counted, the trace measured.

Scripted replies, each outcome checked against a count made by hand: a scripted lm-eval model answering the math
slice through lm-eval (closed, unclosed, looping traces; the gold number placed where only a trace-reading scorer
would find it), a scripted OpenAI-compatible server returning ``reasoning_content`` (tests/fake_openai.py,
``script=``), and a tiny model whose chat template opens the trace. No real thinking model runs here.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from harness.stats.paired import ratio_of_means
from harness.config import compose
from harness.errors import UsageError
from harness.evaluation import evaluate, thinking
from harness.evaluation.slices import resolve
from harness.evaluation.thinking import CLOSED, NONE, UNCLOSED, ThinkingSpec

TAGS = ThinkingSpec(mode="tags", budget=100)
HARMONY = ThinkingSpec(mode="harmony", budget=100)


# --------------------------------------------------------------------------- splitting a reply
@pytest.mark.parametrize("reply, prompt, spec, trace, answer, state", [
    ("<think>2+2 is 4</think>\n\n4", "", TAGS, "2+2 is 4", "4", CLOSED),
    ("<think>2+2 is 4, so the answer is 4", "", TAGS, "2+2 is 4, so the answer is 4", "", UNCLOSED),
    ("4", "", TAGS, "", "4", NONE),
    # DeepSeek-R1's template opens the trace at the end of the prompt: the reply starts inside it
    ("so 4</think>4", "<|User|>2+2?<|Assistant|><think>\n", TAGS, "so 4", "4", CLOSED),
    ("so 4 and so on", "<|User|>2+2?<|Assistant|><think>\n", TAGS, "so 4 and so on", "", UNCLOSED),
    # a prompt whose earlier turn closed its trace leaves nothing open
    ("4", "<think>a</think>b<|user|>again", TAGS, "", "4", NONE),
    # the first end tag ends the trace (as vLLM's reasoning parsers read it)
    ("<think>a</think>b</think>c", "", TAGS, "a", "b</think>c", CLOSED),
    ("<|channel|>analysis<|message|>2+2=4<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>", "",
     HARMONY, "2+2=4", "4", CLOSED),
    ("<|channel|>analysis<|message|>2+2=4 and", "", HARMONY, "2+2=4 and", "", UNCLOSED),
    ("<think>a</think>4", "", thinking.OFF, "", "<think>a</think>4", NONE),
])
def test_split_reply_reads_the_answer_after_the_trace(reply, prompt, spec, trace, answer, state):
    parts = thinking.split_reply(reply, spec, prompt)
    assert (parts.trace, parts.answer, parts.state) == (trace, answer, state)


def test_reasoning_content_is_read_as_the_model_wrote_it():
    from harness.engines.openai_endpoint import EndpointError, with_reasoning

    tags = ("<think>", "</think>")
    closed = with_reasoning({"reasoning_content": "2+2=4", "finish_reason": "stop"}, "4", tags, "item")
    unclosed = with_reasoning({"reasoning_content": "2+2 is", "finish_reason": "length"}, "", tags, "item")
    assert thinking.split_reply(closed, TAGS).answer == "4"
    assert thinking.split_reply(unclosed, TAGS).state == UNCLOSED
    assert with_reasoning({"text": "4"}, "4", tags, "item") == "4"  # no reasoning: unchanged
    with pytest.raises(EndpointError, match="model.thinking=none"):
        with_reasoning({"reasoning": "2+2=4"}, "4", None, "item")


# --------------------------------------------------------------------------- the trace's measures
def test_repetition_loop_and_departure_against_hand_counts():
    assert thinking.repeated_share([1, 2, 3, 4, 1, 2, 3, 4], n=4) == pytest.approx(1 / 5)  # (1,2,3,4) again, of 5
    assert math.isnan(thinking.repeated_share([1, 2, 3], n=4))
    looping = list(range(20)) + [7, 8, 9, 10] * 10  # ends in a 4-token span repeated 10 times (40 tokens)
    assert thinking.loop_period(looping) == 4
    assert thinking.loop_period(list(range(100))) == 0
    assert thinking.loop_period([5, 6] * 10) == 0  # 20 tokens: under LOOP_MIN_TOKENS
    assert thinking.first_departure([1, 2, 3], [1, 2, 4]) == 2
    assert thinking.first_departure([1, 2, 3], [1, 2, 3]) is None
    assert thinking.first_departure([1, 2], [1, 2, 3]) == 2


def test_token_ratio_interval_agrees_with_the_delta_method():
    """The paired cluster bootstrap of Σcand/Σref against an independent delta-method interval of the ratio."""
    rng = np.random.default_rng(3)
    clusters = np.repeat(np.arange(200), 3)
    ref = rng.gamma(4.0, 100.0, size=600) + np.repeat(rng.normal(0, 50, 200), 3).clip(-200)
    cand = ref * 1.3 + rng.normal(0, 60, size=600)
    ratio, low, high = ratio_of_means(ref, cand, clusters, n_resamples=4000, seed=1)
    assert ratio == pytest.approx(cand.sum() / ref.sum())
    # delta method: linearise R = Σc/Σr; cluster totals of (c - R r) / mean(r), CR1 variance of their mean
    frame = pd.DataFrame({"g": clusters, "z": (cand - ratio * ref) / ref.mean()})
    totals = frame.groupby("g")["z"].sum().to_numpy()
    g = totals.size
    se = math.sqrt(g / (g - 1) * np.sum(totals ** 2)) / ref.size
    assert low == pytest.approx(ratio - 1.96 * se, abs=0.35 * se)
    assert high == pytest.approx(ratio + 1.96 * se, abs=0.35 * se)


def test_metrics_of_scripted_traces_against_hand_counts():
    """Six items in six clusters; the hand count is in the comments."""
    tokenize = lambda text: [ord(c) for c in text]  # noqa: E731 - one token per character, for counting by hand
    loop = "<think>" + "abcd" * 10
    ref_replies = ["<think>xx</think>1", "<think>xxxx</think>2", "<think>xx</think>3",
                   "<think>xxxx</think>4", "<think>xx</think>5", "<think>xx</think>6"]  # traces: 2+4+2+4+2+2 = 16
    cand_replies = ["<think>xxx</think>1", "<think>xxxxxxx", loop, "<think>xxxx</think>4", "5", "<think>xx</think>6"]
    # candidate traces: 3, 7 (unclosed), 40 (unclosed, loop), 4, 0 (no trace), 2 = 56 -> ratio 56 / 16 = 3.5
    base = pd.DataFrame({"item_id": [f"t/{i}" for i in range(6)], "slice": "math", "task": "t",
                         "cluster": [str(i) for i in range(6)], "output_type": "generate_until", "prompt": ""})
    reference = base.assign(reply=ref_replies, max_gen_toks=40)
    candidate = base.assign(reply=cand_replies, max_gen_toks=40)
    frame = thinking.trace_frame(reference, candidate, TAGS, tokenize)
    assert frame["state_quant"].tolist() == [CLOSED, UNCLOSED, UNCLOSED, CLOSED, NONE, CLOSED]
    assert frame["trace_tokens_quant"].tolist() == [3, 7, 40, 4, 0, 2]
    # cap 40 tokens: only the looping reply (47 characters) reaches it
    assert frame["cap_hit_quant"].tolist() == [0, 0, 1, 0, 0, 0]
    metrics = thinking.thinking_metrics(frame, n_resamples=1000)
    assert metrics["math/think_unclosed_ref"] == 0
    assert metrics["math/think_unclosed_quant"] == pytest.approx(2 / 6)
    assert metrics["math/think_unclosed_delta"] == pytest.approx(2 / 6)
    assert metrics["math/think_cap_hit_quant"] == pytest.approx(1 / 6)
    assert metrics["math/think_loop_quant"] == pytest.approx(1 / 6)
    assert metrics["math/think_closed_quant"] == pytest.approx(3 / 6)
    assert metrics["math/think_tokens_ratio"] == pytest.approx(3.5)
    assert metrics["math/think_tokens_ratio_ci_low"] <= 3.5 <= metrics["math/think_tokens_ratio_ci_high"]
    assert metrics["math/think_unclosed_delta_ci_low"] < 2 / 6 < metrics["math/think_unclosed_delta_ci_high"]
    # identical traces: items 3 and 5 (xxxx = xxxx, xx = xx); first departures: item 0 at 2 (xx | xxx), item 1 at 4
    # (xxxx | xxxxxxx), item 2 at 0 (xx | abcd...), item 4 at 0 (xx | no trace)
    assert metrics["math/think_identical_rate"] == pytest.approx(2 / 6)
    assert metrics["math/think_first_departure_mean"] == pytest.approx((2 + 4 + 0 + 0) / 4)


# --------------------------------------------------------------------------- matched sides, refused in one line
def test_mismatched_or_unreadable_thinking_is_refused_in_one_line():
    with pytest.raises(UsageError, match="thinking differs.*budget"):
        thinking.check_matched(TAGS, ThinkingSpec(mode="tags", budget=200))
    thinking.check_matched(TAGS, ThinkingSpec(mode="tags", budget=100))
    cfg = compose(["model=tiny_random", "model.enable_thinking=true"])
    with pytest.raises(UsageError, match="model.thinking=none"):
        thinking.check_config(cfg)
    with pytest.raises(UsageError, match="model.thinking='chain'"):
        thinking.check_config(compose(["model=tiny_random", "model.thinking=chain"]))
    with pytest.raises(UsageError, match="thinking_budget=-1"):
        thinking.check_config(compose(["model=tiny_random", "model.thinking=tags", "eval.thinking_budget=-1"]))
    thinking.check_config(compose(["model=qwen3_0_6b"]))  # the preset is consistent


class _Template:
    """A tokenizer stand-in whose chat template reads enable_thinking (or not)."""

    def __init__(self, reads: bool):
        self.chat_template, self.reads = "x", reads

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, enable_thinking=True):
        closed = "<think>\n\n</think>\n\n" if self.reads and not enable_thinking else ""
        return f"<|user|>{messages[0]['content']}<|assistant|>{closed}"


def test_a_template_that_ignores_enable_thinking_is_refused():
    spec = ThinkingSpec(mode="tags", enable_thinking=True)
    thinking.check_template(_Template(reads=True), spec)
    with pytest.raises(UsageError, match="ignores enable_thinking"):
        thinking.check_template(_Template(reads=False), spec)


# --------------------------------------------------------------------------- through lm-eval: the math slice
def _scripted_lm(script):
    from lm_eval.api.model import LM

    class Scripted(LM):
        """Replies from ``script(doc, index)``, cut at the stop strings it is sent (as a model stops at them)."""

        def __init__(self):
            super().__init__()
            self.sent: list[dict] = []

        def generate_until(self, requests, disable_tqdm=False):
            out = []
            for request in requests:
                context, kwargs = request.args
                self.sent.append(dict(kwargs))
                reply = script(request.doc)
                for stop in kwargs.get("until") or []:
                    reply = reply.split(stop)[0]
                out.append(reply)
            return out

        def loglikelihood(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

    return Scripted()


def _math_slice(n_items: int = 8):
    cfg = compose(["model=tiny_random", "slices=[math]", f"slices.math.n_items={n_items}"])
    return resolve(cfg.slices)[0]


def test_math_slice_scores_the_answer_counts_truncation_and_keeps_the_trace():
    """Eight items, scripted by position (hand count): 0-1 closed and right, with "\\n\\n" inside the trace; 2-3
    closed, gold number only in the trace, wrong answer; 4-5 unclosed, trace ending in the gold number; 6 looping
    unclosed; 7 no trace, right. A trace-reading scorer would call 2-6 right; the answer after it: 0, 1, 7."""
    slice_ = _math_slice()
    order: list[str] = []

    def script(doc):
        if doc["id"] not in order:
            order.append(doc["id"])
        i, gold = order.index(doc["id"]), doc["answer"]
        return [f"<think>First step.\n\nSo it is {gold}.</think>\n\n{gold}",
                f"<think>Hmm.\n\nYes {gold}</think>{gold}\n\nand more text",
                f"<think>It is {gold}.</think>\n\n-1",
                f"<think>{gold}</think>-7",
                f"<think>Working... the answer is {gold}",
                f"<think>wait, {gold}",
                "<think>" + "wait, let me check. " * 30,
                f"{gold}"][i]

    settings = evaluate.EvalSettings(seed=1234, thinking=TAGS)
    lm = _scripted_lm(script)
    records, _ = evaluate.evaluate_slice(lm, slice_, settings)
    records = records.set_index(records["item_id"].map(lambda item: order.index(item.split("/", 1)[1])))
    records = records.sort_index()
    assert records["correct"].tolist() == [1, 1, 0, 0, 0, 0, 0, 1]
    # the trace's "\n\n" is not a stop: the request keeps only the end-of-turn marker, and the budget is added
    assert all(sent["until"] == ["<|im_end|>"] and sent["max_gen_toks"] == 24 + 100 for sent in lm.sent)
    # the raw reply, trace included, is kept; its answer cut at the task's stop strings
    assert records["reply"][1].startswith("<think>Hmm.\n\nYes") and records["reply"][1].endswith("</think>" + records["target"][1])
    assert records["response"][0] == records["target"][0]
    assert records["max_gen_toks"].tolist() == [124] * 8
    # the same replies without thinking: a scorer reading the trace calls 2-6 right (cut at the first "\n\n")
    plain, _ = evaluate.evaluate_slice(_scripted_lm(script), slice_, evaluate.EvalSettings(seed=1234))
    assert plain["correct"].sum() != records["correct"].sum()


def test_the_budget_is_capped_by_max_gen_toks():
    lm = _scripted_lm(lambda doc: "<think>a</think>1")
    evaluate.evaluate_slice(lm, _math_slice(2), evaluate.EvalSettings(seed=1234, thinking=TAGS, max_gen_toks=50))
    assert {sent["max_gen_toks"] for sent in lm.sent} == {50}


# --------------------------------------------------------------------------- a tiny model whose template thinks
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n"
            "{% endif %}{% endif %}")


@pytest.mark.slow
def test_tiny_model_with_a_thinking_template_passes_enable_thinking(tmp_path):
    """A tiny random Llama on SmolLM2's tokenizer, given a template that opens a trace unless enable_thinking is
    false: the rendered prompts follow the setting on the wrapper both sides use, and its replies (random tokens,
    never closing the trace) are unclosed, scored wrong and hit the cap."""
    from harness.models import loading

    from harness.config import to_config

    cfg = to_config(compose(["model=tiny_random"]))
    loaded = loading.load(cfg.model, cfg.paths.cache_dir)
    model, tokenizer = loaded.model, loaded.tokenizer
    tokenizer.chat_template = TEMPLATE
    spec = ThinkingSpec(mode="tags", enable_thinking=True, budget=4)
    settings = evaluate.EvalSettings(seed=1234, chat_template=True, thinking=spec, batch_size=4, max_length=512)
    lm = evaluate.make_lm(model, tokenizer, settings)
    on = lm.apply_chat_template([{"role": "user", "content": "2+2?"}])
    assert on.endswith("<think>\n") and thinking.opened_by(on, spec)
    off = evaluate.make_lm(model, tokenizer, evaluate.EvalSettings(
        chat_template=True, thinking=ThinkingSpec(mode="tags", enable_thinking=False))).apply_chat_template(
        [{"role": "user", "content": "2+2?"}])
    assert off.endswith("</think>\n\n") and not thinking.opened_by(off, spec)
    records, _ = evaluate.evaluate_slice(lm, _math_slice(4), settings)
    frame = thinking.trace_frame(records, records, spec,
                                 lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
    assert (frame["state_ref"] == UNCLOSED).all() and (records["correct"] == 0).all()
    assert records["max_gen_toks"].tolist() == [28] * 4


# --------------------------------------------------------------------------- a scripted server with a reasoning parser
@pytest.mark.slow
def test_served_candidate_reasoning_content_is_scored_and_measured_as_in_process():
    """A scripted OpenAI-compatible server answers the math slice as a thinking model behind vLLM's reasoning parser
    would: item 0 the trace in reasoning_content and the right answer in the text; 1 the trace split off but never
    ended (finish_reason length, no text); 2 a looping trace in the text, unclosed; 3 closed tags in the text, the
    gold number only in the trace. Hand count: right 1 of 4; unclosed 2 (items 1, 2); loop 1 (item 2)."""
    from fake_openai import FakeServer

    from harness.config import to_config
    from harness.engines.openai_endpoint import endpoint_lm
    from harness.engines.openai_http import Client, EndpointSpec
    from harness.models import loading

    cfg = to_config(compose(["model=tiny_random"]))
    loaded = loading.load(cfg.model, cfg.paths.cache_dir)
    slice_ = _math_slice(4)
    gold: dict[str, str] = {}  # question -> answer, read off the items by a scripted lm-eval model first
    evaluate.evaluate_slice(_scripted_lm(lambda doc: gold.setdefault(doc["question"], doc["answer"])), slice_,
                            evaluate.EvalSettings(seed=1234))
    order = list(gold)

    def script(prompt: str) -> dict:
        i = next(i for i, question in enumerate(order) if question in prompt)
        return [{"text": gold[order[0]], "reasoning_content": "thinking about it", "finish_reason": "stop"},
                {"text": "", "reasoning_content": f"it is {gold[order[1]]} and", "finish_reason": "length"},
                {"text": "<think>" + "again and again " * 20, "finish_reason": "length"},
                {"text": f"<think>maybe {gold[order[3]]}</think>-3", "finish_reason": "stop"}][i]

    settings = evaluate.EvalSettings(seed=1234, thinking=TAGS, batch_size=4, max_length=512)
    twin = evaluate.make_lm(loaded.model, loaded.tokenizer, settings)
    with FakeServer(tokenizer=loaded.tokenizer, script=script) as server:
        lm = endpoint_lm(Client(EndpointSpec(url=server.url)), twin)
        records, _ = evaluate.evaluate_slice(lm, slice_, settings)
    index = records["prompt"].map(lambda p: next(i for i, question in enumerate(order) if question in p))
    records = records.assign(i=index).sort_values("i").reset_index(drop=True)
    assert records["correct"].tolist() == [1, 0, 0, 0]
    frame = thinking.trace_frame(records, records, TAGS,
                                 lambda text: loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert frame.set_index("item_id").loc[records["item_id"], "state_ref"].tolist() == [CLOSED, UNCLOSED, UNCLOSED,
                                                                                        CLOSED]
    assert records["reply"][0] == f"<think>thinking about it</think>{gold[order[0]]}"
    metrics = thinking.thinking_metrics(frame)
    assert metrics["math/think_unclosed_ref"] == pytest.approx(2 / 4)
    assert metrics["math/think_loop_ref"] == pytest.approx(1 / 4)


@pytest.mark.slow
def test_chat_calibration_of_a_thinking_model_carries_traces():
    """GPTQ/AWQ/SmoothQuant chat-format calibration renders each assistant reply as trace + answer, through the
    template with enable_thinking, so the calibration set holds the tags (the token hash, hence the cache key,
    changes with it)."""
    from harness.config import to_config
    from harness.models import loading
    from harness.quant.calibration import chat_window

    cfg = to_config(compose(["model=tiny_random"]))
    import torch

    tokenizer = loading.load(cfg.model, cfg.paths.cache_dir).tokenizer

    ids = torch.tensor(tokenizer("The quick brown fox jumps over the lazy dog. " * 80,
                                 add_special_tokens=False)["input_ids"])
    plain = tokenizer.decode(chat_window(tokenizer, ids, 0, 200))
    thinking_window = tokenizer.decode(chat_window(tokenizer, ids, 0, 200, ("<think>", "</think>"),
                                                   {"enable_thinking": True}))
    assert "<think>" not in plain and "<think>\n" in thinking_window and "</think>" in thinking_window
