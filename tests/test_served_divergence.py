"""Divergence on the served format (issue 24): the prompt as evaluated + the reference's own reply.

Checked against independent references: per-token KL on the reply and prompt positions against
scipy on float64 full softmaxes of the concatenated ids; the served prompt against the chat
template rendered here from the slice's own prompt definition; the prompt's token ids against
lm-eval's own encoders; the run's headline and side metrics against means of its token rows.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.special import log_softmax, rel_entr

from harness.evaluation import evaluate
from harness.job import identity
from harness.job import divergence_texts
from harness.config import to_config
from harness.models import loading as models
from harness.results import summary
from harness.divergence.scoring import PLAIN, PROMPT, REPLY, ServedText, compare_to_reference, encode_prompt, score_reference
from harness.evaluation.slices import resolve

VOCAB = 96


def _scipy_kl(reference, quantized, ids: list[int]) -> np.ndarray:
    """KL(ref || quant) per position 1..T-1 from float64 softmaxes of each model's own forward."""
    tensor = torch.tensor([ids])
    with torch.no_grad():
        logp = log_softmax(reference(tensor).logits[0, :-1].double().numpy(), axis=-1)
        logq = log_softmax(quantized(tensor).logits[0, :-1].double().numpy(), axis=-1)
    return rel_entr(np.exp(logp), np.exp(logq)).sum(-1)  # rel_entr = p log(p/q)


@pytest.mark.parametrize("store", ["hidden", "logprobs"])
def test_reply_and_prompt_positions_match_scipy(llama_pair, store):
    reference, quantized = llama_pair
    prompt, reply = tuple(range(3, 23)), (40, 41, 42, 43, 44, 45, 46)
    scored = score_reference(reference, None, [ServedText(prompt, reply)], max_tokens=64, store=store)
    rows = compare_to_reference(quantized, scored, "s")
    expected = _scipy_kl(reference, quantized, [*prompt, *reply])
    assert rows["kl"].to_numpy() == pytest.approx(expected, rel=2e-4, abs=1e-7) and expected.mean() > 1e-3
    # position p predicts token p: the reply's tokens are positions len(prompt) .. end
    assert rows.loc[rows["kind"] == REPLY, "position"].tolist() == list(range(len(prompt), len(prompt) + len(reply)))
    assert (rows.loc[rows["position"] < len(prompt), "kind"] == PROMPT).all()


def test_a_served_text_too_long_loses_the_start_of_its_prompt_not_its_reply(llama_pair):
    reference, quantized = llama_pair
    prompt, reply = tuple(range(3, 33)), tuple(range(50, 60))
    [text] = score_reference(reference, None, [ServedText(prompt, reply)], max_tokens=16, store="hidden")
    assert text.input_ids.tolist() == [*prompt, *reply][-16:] and text.prompt_tokens == 6
    rows = compare_to_reference(quantized, [text], "s")
    assert rows["kind"].tolist() == [PROMPT] * 5 + [REPLY] * 10
    assert rows["kl"].to_numpy() == pytest.approx(_scipy_kl(reference, quantized, [*prompt, *reply][-16:]),
                                                  rel=2e-4, abs=1e-7)


def test_plain_texts_keep_their_kind(llama_pair):
    reference, quantized = llama_pair

    def tokenizer(text, return_tensors="pt", truncation=True, max_length=64):
        return {"input_ids": torch.tensor([[1] + [ord(ch) % VOCAB for ch in text][: max_length - 1]])}

    rows = compare_to_reference(quantized, score_reference(reference, tokenizer, ["abc def"], max_tokens=64), "s")
    assert set(rows["kind"]) == {PLAIN} and len(rows) == 7


def test_served_reply_is_the_raw_generation_or_the_chosen_choice():
    generation = {"arguments": [("<prompt>", {"until": ["\n\n"]})], "resps": [["  42 apples"]],
                  "filtered_resps": ["42"]}
    assert evaluate._served(generation, "generate_until") == ("<prompt>", "  42 apples")
    choice = {"arguments": [("Q:", " a"), ("Q:", " b"), ("Q:", " c")],
              "filtered_resps": [(-3.0, False), (-1.0, True), (-2.0, False)]}
    assert evaluate._served(choice, "multiple_choice") == ("Q:", " b")
    assert evaluate._served({"arguments": [("whole text",)]}, "loglikelihood_rolling") == ("", "")


def test_spread_rows_covers_every_sub_slice_and_task_first():
    rows = pd.DataFrame({"task": ["mc"] * 6 + ["gen"] * 6, "sub_slice": ["en", "de", "fr"] * 4,
                         "item": range(12)})
    chosen = divergence_texts.spread_rows(rows, 6)
    assert sorted(chosen["sub_slice"]) == ["de", "de", "en", "en", "fr", "fr"]
    assert sorted(chosen["task"]) == ["gen"] * 3 + ["mc"] * 3
    assert set(map(tuple, chosen[["sub_slice", "task"]].values)) == {(s, t) for s in ("en", "de", "fr")
                                                                     for t in ("mc", "gen")}
    assert divergence_texts.spread_rows(rows, None) is rows


def test_headline_is_the_served_reply_and_the_plain_text_kl_keeps_its_name():
    tokens = pd.DataFrame({
        "slice": ["a"] * 6 + ["b"] * 3, "text": [0, 0, 1, 1, 1, 1, 0, 0, 0], "position": [1, 2, 1, 2, 3, 4, 1, 2, 3],
        "kind": [PLAIN, PLAIN, PROMPT, PROMPT, REPLY, REPLY, PLAIN, PLAIN, PLAIN],
        "kl": [0.1, 0.3, 0.05, 0.07, 0.9, 1.1, 0.2, 0.4, 0.6]})
    tokens = tokens.assign(kl_reverse=tokens["kl"], nll_ref=1.0, nll_quant=1.0 + tokens["kl"], top1_ref=1,
                           top1_quant=[1, 1, 1, 2, 2, 1, 1, 1, 1], p_ref=0.5, p_quant=0.4)
    table = summary.summarize_tokens(tokens, [0, 2]).set_index(["slice", "bucket"])
    a, b, overall = table.loc[("a", "all")], table.loc[("b", "all")], table.loc[("overall", "all")]
    assert a["kl_mean"] == pytest.approx(1.0) and a["kl_on"] == "served reply" and a["n_tokens"] == 2
    assert a["kl_plain_mean"] == pytest.approx(0.2) and a["kl_prompt_mean"] == pytest.approx(0.06)
    assert a["top1_agree"] == pytest.approx(0.5) and a["top1_agree_prompt"] == pytest.approx(0.5)
    assert b["kl_mean"] == pytest.approx(0.4) and b["kl_plain_mean"] == pytest.approx(0.4) and b["kl_on"] == "plain text"
    assert overall["kl_mean"] == pytest.approx((0.9 + 1.1 + 0.2 + 0.4 + 0.6) / 5)
    assert overall["kl_plain_mean"] == pytest.approx((0.1 + 0.3 + 0.2 + 0.4 + 0.6) / 5)
    assert table.loc[("a", "[2, inf)"), "n_tokens"] == 2  # positions bucketed on the headline tokens only
    older = summary.summarize_tokens(tokens.drop(columns="kind"), [0, 2]).set_index(["slice", "bucket"])
    assert older.loc[("a", "all"), "kl_mean"] == pytest.approx(tokens.loc[tokens["slice"] == "a", "kl"].mean())


@pytest.mark.slow
def test_reference_key_marks_served_texts(make_cfg):
    [math] = resolve(to_config(make_cfg("slices=[math]")).slices)
    loaded = type("Loaded", (), {"identity": {"m": 1}})()
    def spec(*overrides: str) -> identity.ReferenceSpec:
        return identity.ReferenceSpec.of(to_config(make_cfg(*overrides)))

    base = identity.reference_key(loaded, math, spec("model=tiny_random"))
    chat = identity.reference_key(loaded, math, spec("model=tiny_random", "model.chat_template=true"))
    assert base != chat
    # served texts by default, for every model; with the gold texts also scored, a base model
    # (no chat template) is scored on them alone
    assert divergence_texts.served_format(math, spec("model=tiny_random"))
    plain = "eval.divergence_plain=true"
    assert divergence_texts.served_format(math, spec("model=smollm2_135m", plain))
    assert not divergence_texts.served_format(math, spec("model=tiny_random", plain))


@pytest.fixture(scope="module")
def tiny(shared_model_cache):
    from harness.config import compose

    cfg = to_config(compose(["model=tiny_random"]))
    return models.load(cfg.model, shared_model_cache.parent)


@pytest.mark.slow
def test_prompt_ids_are_lm_evals_own_encoding(tiny):
    lm = evaluate.make_lm(tiny.model, tiny.tokenizer, evaluate.EvalSettings())
    chat = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                              add_generation_prompt=True)
    for text in (chat, "Question: what is 2 + 3?\nAnswer:", f"{tiny.tokenizer.bos_token}already"):
        assert encode_prompt(tiny.tokenizer, text) == lm.tok_encode(text)
        assert encode_prompt(tiny.tokenizer, text) == lm.tok_batch_encode([text])[0][0].tolist()


@pytest.mark.slow
def test_chat_model_run_scores_the_prompt_lm_eval_sent_and_reports_both_kls(make_cfg, tmp_path, tiny):
    from harness.job import pipeline as run_mod

    cfg = make_cfg("model=tiny_random", "model.chat_template=true", "slices=[math]", "slices.math.n_items=6",
                   "slices.math.divergence_texts=3", "quant=int4_g128", "tracking.enabled=false",
                   "eval.divergence_plain=true")  # the gold texts too (off by default since issue 35)
    result = run_mod.run(cfg)
    [directory] = (tmp_path / "results").glob("*")
    tokens = pd.read_parquet(directory / "tokens.parquet")
    metrics = result["metrics"]
    assert metrics["math/kl_mean"] == pytest.approx(tokens.loc[tokens["kind"] == REPLY, "kl"].mean())
    assert metrics["math/kl_plain_mean"] == pytest.approx(tokens.loc[tokens["kind"] == PLAIN, "kl"].mean())
    assert metrics["math/kl_prompt_mean"] == pytest.approx(tokens.loc[tokens["kind"] == PROMPT, "kl"].mean())
    assert tokens.loc[tokens["kind"] == PLAIN, "text"].nunique() == 3
    assert tokens.loc[tokens["kind"] != PLAIN, "text"].nunique() == 6  # every item (served_texts unset)
    [entry] = (tmp_path / "cache" / "reference").glob("*/records.parquet")
    records = pd.read_parquet(entry)
    items = {item["id"]: item for item in resolve(to_config(cfg).slices)[0].items(
        **resolve(to_config(cfg).slices)[0].metadata(1234))}
    for row in records.itertuples():  # the slice's doc_to_text, rendered here through the chat template
        question = items[row.item_id.split("/", 1)[1]]["question"]
        assert row.prompt == tiny.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{question} Reply with the number only."}], tokenize=False,
            add_generation_prompt=True)
        assert row.reply == row.response
    assert json.loads((directory / "summary.json").read_text())["metrics"]["math/kl_mean"] == metrics["math/kl_mean"]
