"""harness.divergence.scoring against an independent reference: scipy on float64 full softmaxes.

A one-layer random Llama (transformers) is the reference, a copy with perturbed weights the
"quantized" model. The exact per-token KL in both directions, the NLLs, the probabilities of
the actual next token and the top-1 tokens are recomputed here with scipy from the models'
logits; the compact top-k + tail reference is checked against the lumped KL computed the same
way, against the log-sum inequality (lumped <= exact), and against the exact value when only
one token is left in the tail.
"""
from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.special import log_softmax, rel_entr

from harness.divergence.scoring import OutputHead, compare_to_reference, score_reference

VOCAB = 96


class CharTokenizer:
    """Characters to ids modulo the vocabulary; the call signature divergence.tokenize uses."""

    def __call__(self, text: str, return_tensors: str = "pt", truncation: bool = True, max_length: int = 512):
        ids = [1] + [ord(ch) % VOCAB for ch in text]
        return {"input_ids": torch.tensor([ids[:max_length] if truncation else ids])}


TEXTS = ["The quick brown fox jumps over the lazy dog.", "12 + 30 = 42; 7 * 6 = 42.", "a" * 5 + "bcdefg" * 4]


def _log_probs64(model: torch.nn.Module, text: str) -> tuple[np.ndarray, np.ndarray]:
    ids = CharTokenizer()(text)["input_ids"]
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0, :-1].double().numpy()
    return log_softmax(logits, axis=-1), ids[0, 1:].numpy()


def test_exact_kl_matches_scipy_full_softmax(llama_pair):
    reference, quantized = llama_pair
    refs = score_reference(reference, CharTokenizer(), TEXTS, max_tokens=512, topk=0)
    rows = compare_to_reference(quantized, refs, "s")
    offset = 0
    for text in TEXTS:
        logp, targets = _log_probs64(reference, text)
        logq, _ = _log_probs64(quantized, text)
        n = targets.size
        part = rows.iloc[offset:offset + n]
        offset += n
        p, q = np.exp(logp), np.exp(logq)
        np.testing.assert_allclose(part["kl"], rel_entr(p, q).sum(-1), rtol=2e-4, atol=1e-7)
        np.testing.assert_allclose(part["kl_reverse"], rel_entr(q, p).sum(-1), rtol=2e-4, atol=1e-7)
        chosen = np.arange(n), targets
        np.testing.assert_allclose(part["nll_ref"], -logp[chosen], rtol=1e-5)
        np.testing.assert_allclose(part["nll_quant"], -logq[chosen], rtol=1e-5)
        np.testing.assert_allclose(part["p_quant"], q[chosen], rtol=1e-5)
        assert (part["top1_ref"].to_numpy() == logp.argmax(-1)).all()
        assert (part["top1_quant"].to_numpy() == logq.argmax(-1)).all()
        assert part["position"].tolist() == list(range(1, n + 1))
    assert offset == len(rows) and rows["kl"].mean() > 1e-3  # the perturbation is visible


def _lumped_kl(logp: np.ndarray, logq: np.ndarray, k: int) -> np.ndarray:
    """KL on the partition {top-k tokens of the reference, everything else} (numpy, float64)."""
    top = np.argsort(-logp, axis=-1, kind="stable")[:, :k]
    p_k = np.take_along_axis(np.exp(logp), top, -1)
    q_k = np.take_along_axis(np.exp(logq), top, -1)
    p_tail = np.clip(1 - p_k.sum(-1), 1e-30, None)
    q_tail = np.clip(1 - q_k.sum(-1), 1e-30, None)
    return rel_entr(p_k, q_k).sum(-1) + rel_entr(p_tail, q_tail)


@pytest.mark.parametrize("k", [4, 16, 64])
def test_topk_tail_kl_is_the_lumped_kl_and_a_lower_bound(llama_pair, k):
    reference, quantized = llama_pair
    compact = compare_to_reference(quantized, score_reference(reference, CharTokenizer(), TEXTS, max_tokens=512,
                                                              topk=k), "s")
    exact = compare_to_reference(quantized, score_reference(reference, CharTokenizer(), TEXTS, max_tokens=512), "s")
    expected = np.concatenate([_lumped_kl(_log_probs64(reference, t)[0], _log_probs64(quantized, t)[0], k)
                               for t in TEXTS])
    np.testing.assert_allclose(compact["kl"], expected, rtol=2e-3, atol=2e-6)
    assert (compact["kl"].to_numpy() <= exact["kl"].to_numpy() + 1e-6).all()  # log-sum inequality
    # NLL, probabilities and top-1 do not depend on how the reference distribution is stored
    for column in ("nll_ref", "nll_quant", "p_ref", "p_quant", "top1_ref", "top1_quant"):
        np.testing.assert_array_equal(compact[column], exact[column])


def test_topk_error_shrinks_and_vanishes_with_one_tail_token(llama_pair):
    reference, quantized = llama_pair
    exact = compare_to_reference(quantized, score_reference(reference, CharTokenizer(), TEXTS, max_tokens=512), "s")
    errors = []
    for k in (2, 8, 32, VOCAB - 1):
        refs = score_reference(reference, CharTokenizer(), TEXTS, max_tokens=512, topk=k)
        compact = compare_to_reference(quantized, refs, "s")
        errors.append(1 - compact["kl"].mean() / exact["kl"].mean())
    assert all(e >= -1e-5 for e in errors)
    assert errors[0] > errors[-2]
    assert abs(errors[-1]) < 1e-3  # one tail token: the partition is the full distribution


def test_hidden_state_store_is_exact_and_small(llama_pair):
    """store=hidden recomputes the reference distribution from the final hidden state and a frozen
    copy of the output head: identical to the full-logprob store, at hidden_size floats per token,
    and immune to a scheme that later modifies the live model's head."""
    reference, quantized = llama_pair
    full = compare_to_reference(quantized, score_reference(reference, CharTokenizer(), TEXTS, max_tokens=512,
                                                           store="logprobs"), "s")
    live = copy.deepcopy(reference)
    refs = score_reference(live, CharTokenizer(), TEXTS, max_tokens=512, store="hidden")
    with torch.no_grad():
        live.lm_head.weight.mul_(0.5)  # must not leak into the stored reference
    hidden = compare_to_reference(quantized, refs, "s")
    # the logprobs store holds log-probs rounded to float32 (|log p| up to ~10 here: steps of ~1e-6), the hidden
    # store recomputes the logits themselves: they agree to that rounding
    for column in ("kl", "kl_reverse", "nll_ref", "nll_quant", "top1_ref", "p_ref"):
        np.testing.assert_allclose(hidden[column], full[column], rtol=1e-5, atol=1e-6)
    assert refs[0].hidden.shape[-1] == 64 and refs[0].logp is None
    same = compare_to_reference(reference, score_reference(reference, CharTokenizer(), TEXTS, max_tokens=512,
                                                           store="hidden"), "s")
    assert (same["kl"] == 0).all() and (same["kl_reverse"] == 0).all()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 30.0])
@torch.no_grad()
def test_a_head_into_a_reused_buffer_gives_the_heads_own_values(bias, softcap):
    """OutputHead.logits(out=buffer) writes a plain float32 head's logits into the buffer's first rows: bit for
    bit the head's own forward (+ soft-cap), chunk after chunk through one buffer; a head it cannot run that way
    (bf16, another vocabulary) leaves the buffer alone and computes as before."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, VOCAB, bias=bias)
    head = OutputHead(linear, softcap)
    buffer = torch.full((512, VOCAB), float("nan"))
    for rows in (512, 37, 300):
        hidden = torch.randn(rows, 64) * 4
        expected = linear(hidden)
        if softcap:
            expected = torch.tanh(expected / softcap) * softcap
        got = head.logits(hidden, out=buffer)
        assert got.data_ptr() == buffer.data_ptr() and got.shape == (rows, VOCAB)
        assert torch.equal(got, expected)
        assert torch.equal(got, head.logits(hidden))
    other = torch.zeros(512, VOCAB + 1)
    assert torch.equal(head.logits(hidden, out=other), expected) and not other.any()
    half = OutputHead(copy.deepcopy(linear).bfloat16(), softcap)
    untouched = buffer.clone()
    assert torch.equal(half.logits(hidden, out=buffer), half.logits(hidden)) and torch.equal(buffer, untouched)


def test_comparing_through_reused_buffers_equals_fresh_logits(llama_pair, monkeypatch):
    """The divergence stage's reused logit buffers change no value: every column equals a comparison that
    allocates each chunk's logits afresh, on texts of several chunks (CHUNK rows each) and of one."""
    from harness.divergence import scoring

    reference, quantized = llama_pair
    texts = [*TEXTS, "The river had changed its course twice in living memory. " * 20]
    assert len(CharTokenizer()(texts[-1], max_length=4096)["input_ids"][0]) > 2 * scoring.CHUNK
    reused = compare_to_reference(quantized, score_reference(reference, CharTokenizer(), texts, max_tokens=4096,
                                                             store="hidden"), "s")
    monkeypatch.setattr(scoring, "_logit_buffers", lambda head, device: (None, None))
    fresh = compare_to_reference(quantized, score_reference(reference, CharTokenizer(), texts, max_tokens=4096,
                                                            store="hidden"), "s")
    pd.testing.assert_frame_equal(reused, fresh, check_exact=True)


def _bf16_step(values: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """``values`` (bf16) with a random ``fraction`` of entries moved one bf16 step up or down."""
    generator = torch.Generator().manual_seed(seed)
    pick = torch.rand(values.shape, generator=generator) < fraction
    up = torch.rand(values.shape, generator=generator) < 0.5
    towards = torch.where(up, torch.full_like(values, float("inf")), torch.full_like(values, float("-inf")))
    return torch.where(pick, torch.nextafter(values, towards), values)


def test_tolerance_accepts_one_rounding_step_that_allclose_1e3_rejected():
    """Two bf16 GEMMs that accumulate in a different order differ by one bf16 step on a few logits
    (seen at 8B shapes: 0.01 % of logits, max |Δ log p| 0.031). The dtype-derived tolerance accepts
    that; the former atol = rtol = 1e-3 check rejected it."""
    from harness.divergence.scoring import _agreement
    torch.manual_seed(0)
    logits = (6 * torch.randn(63, 4096)).to(torch.bfloat16)
    other = _bf16_step(logits, 1e-4)
    top = logits[0].argmax()  # one step on a leading logit moves log p of the whole row
    other[0, top] = torch.nextafter(logits[0, top], torch.tensor(float("inf"), dtype=torch.bfloat16))
    assert not torch.equal(other, logits)
    assert not torch.allclose(torch.log_softmax(other.float(), -1), torch.log_softmax(logits.float(), -1),
                              atol=1e-3, rtol=1e-3)
    _agreement("logits", other, logits, torch.bfloat16)  # does not raise
    with pytest.raises(RuntimeError, match="differs from the model's own forward"):
        _agreement("logits", (logits.float() * 1.1).to(torch.bfloat16), logits, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_check_passes_in_the_models_dtype(llama_pair, dtype):
    reference = copy.deepcopy(llama_pair[0]).to(dtype)
    refs = score_reference(reference, CharTokenizer(), TEXTS, max_tokens=512, store="hidden")
    assert refs[0].head is not None and next(refs[0].head.parameters()).dtype == dtype
    assert next(refs[0].head.parameters()).device.type == "cpu"  # moved back after the check
    same = compare_to_reference(reference, refs, "s")
    assert (same["kl"] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wrong", ["softcap", "logit_scale", "other_weight"])
def test_head_check_catches_a_wrong_head(llama_pair, dtype, wrong, monkeypatch):
    """A head the harness would recompute wrongly fails the check, in fp32 and in bf16."""
    from harness.divergence import scoring as divergence
    reference = copy.deepcopy(llama_pair[0]).to(dtype)
    if wrong == "softcap":  # OutputHead applies a soft-cap this model's forward does not
        reference.config.final_logit_softcapping = 4.0
    elif wrong == "logit_scale":  # the model scales its logits after the head (Granite, Cohere do)
        original = reference.forward

        def scaled(*args, **kwargs):
            out = original(*args, **kwargs)
            out.logits = out.logits * 1.25
            return out
        monkeypatch.setattr(reference, "forward", scaled)
    else:  # the frozen copy is not the head the model uses
        of = divergence.OutputHead.of

        def perturbed(model, *, frozen_copy=False):
            head = of(model, frozen_copy=frozen_copy)
            if frozen_copy:
                with torch.no_grad():
                    weight = head.lm_head.weight
                    weight.add_(0.1 * weight.float().std() * torch.randn(weight.shape).to(weight.dtype))
            return head
        monkeypatch.setattr(divergence.OutputHead, "of", staticmethod(perturbed))
    with pytest.raises(RuntimeError, match="reference_store=logprobs"):
        score_reference(reference, CharTokenizer(), TEXTS, max_tokens=512, store="hidden")


@pytest.mark.slow
def test_every_slice_of_a_run_shares_one_frozen_head(make_cfg):
    """The frozen reference head is held (and moved to the device) once per run, not once per slice."""
    from harness.models import loading as models
    from harness.infra.cache import Cache
    from harness.job.identity import ReferenceSpec
    from harness.config import to_config
    from harness.job.reference import compute_reference, share_heads
    from harness.evaluation.slices import resolve

    cfg = to_config(make_cfg("model=tiny_random", "slices=[math,structured]", "slices.math.n_items=4",
                             "slices.structured.n_items=4", "slices.math.divergence_texts=2",
                             "slices.structured.divergence_texts=2"))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    cache = Cache(cfg.paths.cache_dir)
    references = {s.name: compute_reference(loaded, s, ReferenceSpec.of(cfg), cache) for s in resolve(cfg.slices)}
    before = {id(t.head) for r in references.values() for t in r.texts}
    assert len(before) == 2  # one copy per slice as computed
    shared = share_heads(references)
    heads = {id(t.head) for r in shared.values() for t in r.texts}
    assert len(heads) == 1 and None not in {t.head for r in shared.values() for t in r.texts}
    assert [len(r.texts) for r in shared.values()] == [len(r.texts) for r in references.values()]
