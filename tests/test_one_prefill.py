"""One prefill per prompt per model (issue 35).

The divergence stage's per-token numbers taken from the forwards that answered the items (the
prefill of each prompt, the reference's decode steps, the quantized model's teacher-forced pass
of the reference's reply from the prompt's KV cache) equal the two-pass computation (every text
run again, unbatched, from its first token) to float tolerance; a copy of those states shifted by
one position, or computed with another item's KV cache in front, does not. The fused per-token
statistics are checked against float64 softmaxes computed here.
"""
from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.special import log_softmax, rel_entr

from harness.divergence import scoring
from harness.divergence.scoring import (ServedText, compare_to_reference, final_hidden, score_reference,
                                        token_statistics)
from harness.divergence.capture import CapturedPrompt, HiddenCapture
from harness.evaluation.generation import PADDING, greedy_generate
from harness.job.reference import teacher_force_held
from tests.conftest import perturbed_llama_pair

VOCAB = 96
PAD = 0
# different lengths (left padding in a batch), two batches (two KV caches), one prompt in both batches
PROMPTS = [(5, 17, 33, 8, 9, 60, 2), (11, 12), (70, 3, 3, 3, 41, 22, 19, 50, 7, 1, 88), (4, 44, 64)]
BATCHES = [PROMPTS[:2], PROMPTS[2:]]
STEPS = 7
COLUMNS = ["kl", "kl_reverse", "nll_ref", "nll_quant", "p_ref", "p_quant"]


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    return perturbed_llama_pair(VOCAB, num_hidden_layers=2)


def _answer(model, capture: HiddenCapture | None, teacher=None, eos: set[int] = frozenset()) -> dict[tuple, list[int]]:
    """Greedy replies of every prompt, batch by batch (left-padded), as lm-eval's generation calls do."""
    replies = {}
    for batch in BATCHES:
        width = max(map(len, batch))
        ids = torch.tensor([[PAD] * (width - len(p)) + list(p) for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = greedy_generate(model, ids, mask, max_new_tokens=STEPS, pad_token_id=PAD, eos_token_ids=set(eos),
                              capture=capture, teacher=teacher)
        for row, prompt in enumerate(batch):
            reply = out[row, width:].tolist()
            replies[prompt] = reply[:next((i + 1 for i, t in enumerate(reply) if t in eos), len(reply))]
    return replies


@pytest.fixture(scope="module")
def answered(pair):
    """The items answered once by each model, capturing; the reference's replies are the served texts."""
    reference, quantized = pair
    first = _answer(reference, None)
    eos = {first[PROMPTS[0]][2]}  # the first prompt's row finishes early: rows leave the batch mid-decode
    ref_capture, quant_capture = HiddenCapture(), HiddenCapture()
    replies = _answer(reference, ref_capture, eos=eos)
    own = _answer(quantized, quant_capture, teacher=lambda prompt: replies.get(prompt), eos=eos)
    texts = [ServedText(p, tuple(replies[p])) for p in PROMPTS]
    return texts, ref_capture, quant_capture, replies, own


def _two_pass(pair, texts):
    reference, quantized = pair
    return compare_to_reference(quantized, score_reference(reference, None, texts, max_tokens=64, store="hidden"), "s")


def _one_prefill(pair, texts, ref_capture, quant_capture):
    reference, quantized = pair
    scored = score_reference(reference, None, texts, max_tokens=64, store="hidden", captured=ref_capture)
    return compare_to_reference(quantized, scored, "s", captured=quant_capture)


def _close(a, b) -> bool:
    return all(np.allclose(a[c].to_numpy(), b[c].to_numpy(), rtol=1e-4, atol=1e-6) for c in COLUMNS) and \
        (a["top1_ref"] == b["top1_ref"]).all() and (a["top1_quant"] == b["top1_quant"]).all()


def test_one_prefill_equals_the_two_pass_computation(pair, answered):
    texts, ref_capture, quant_capture, replies, own = answered
    assert any(own[p][:len(replies[p])] != replies[p] for p in PROMPTS)  # the teacher-forced path is used
    assert len({len(r) for r in replies.values()}) > 1  # a row left its batch early
    reference, quantized = pair
    tokens = {"reference": 0, "quantized": 0}
    hooks = [m.get_decoder().register_forward_pre_hook(lambda _m, args, kwargs, side=side: tokens.__setitem__(
        side, tokens[side] + int((kwargs.get("input_ids") if args == () else args[0]).numel())), with_kwargs=True)
        for m, side in ((reference, "reference"), (quantized, "quantized"))]
    try:
        one = _one_prefill(pair, texts, ref_capture, quant_capture)
    finally:
        for hook in hooks:
            hook.remove()
    two = _two_pass(pair, texts)
    assert len(one) == len(two) == sum(len(t.prompt_ids) + len(t.reply_ids) - 1 for t in texts)
    assert (one[["text", "position", "kind"]].to_numpy() == two[["text", "position", "kind"]].to_numpy()).all()
    assert _close(one, two) and two["kl"].mean() > 1e-3
    # nothing run again but the reference head's check (the model's forward and its decoder's, on the first
    # text); the quantized side runs nothing
    assert tokens == {"reference": 2 * (len(PROMPTS[0]) + len(texts[0].reply_ids)), "quantized": 0}


def test_a_shift_by_one_or_another_items_cache_is_caught(pair, answered):
    texts, ref_capture, quant_capture, _, _ = answered
    two = _two_pass(pair, texts)
    shifted = HiddenCapture()
    for prompt, row in quant_capture.prompts.items():
        states = torch.cat([row.prompt[:1], row.prompt[:-1]])  # every state one position late
        shifted.prompts[prompt] = CapturedPrompt(states, row.fed, row.steps, row.continuations)
    assert not _close(_one_prefill(pair, texts, ref_capture, shifted), two)
    _, quantized = pair
    carried = copy.copy(quant_capture)  # the third item's prompt states computed after the second item's tokens
    carried.prompts = dict(quant_capture.prompts)
    before, prompt = PROMPTS[1], PROMPTS[2]
    both = final_hidden(quantized, torch.tensor([*before, *prompt, 0]))[len(before):]
    carried.prompts[prompt] = CapturedPrompt(both, *[getattr(quant_capture.prompts[prompt], f)
                                                     for f in ("fed", "steps", "continuations")])
    assert not _close(_one_prefill(pair, texts, ref_capture, carried), two)


def test_a_prompt_not_answered_is_run_as_before(pair, answered):
    texts, ref_capture, quant_capture, _, _ = answered
    unknown = ServedText((9, 9, 9, 9), (1, 2, 3))
    assert ref_capture.states(unknown.prompt_ids, unknown.reply_ids) is None
    one = _one_prefill(pair, [*texts, unknown], ref_capture, quant_capture)
    assert _close(one, _two_pass(pair, [*texts, unknown]))


def _counting(model, into: list[int]):
    return model.get_decoder().register_forward_pre_hook(lambda _m, args, kwargs: into.append(
        int((kwargs.get("input_ids") if args == () else args[0]).numel())), with_kwargs=True)


def _held_and_compared(pair, answered, hold_bytes: int):
    """The quantized side answers holding prompt caches within ``hold_bytes`` (no teacher: the replies are not known
    yet), then teacher-forces the reference's replies from them; its answers, the capture, the texts and the token
    counts of the forwards run after answering."""
    texts, ref_capture, _, _, _ = answered
    reference, quantized = pair
    eos = {_answer(reference, None)[PROMPTS[0]][2]}  # as the fixture answered
    held = HiddenCapture(hold_bytes=hold_bytes)
    own = _answer(quantized, held, eos=eos)
    assert own == _answer(quantized, None, eos=eos)  # holding changes no answer
    counts = (len(held.held), held.held_size, held.not_held)
    scored = score_reference(reference, None, texts, max_tokens=64, store="hidden", captured=ref_capture)
    assert all(t.captured for t in scored)
    runs: list[int] = []
    hook = _counting(quantized, runs)
    try:
        teacher_force_held(quantized, held, scored)
        one = compare_to_reference(quantized, scored, "s", captured=held)
    finally:
        hook.remove()
    return own, held, counts, runs, one


def test_replies_known_later_are_teacher_forced_from_held_prompt_caches(pair, answered):
    """A slice answered before its reference exists: each batch's prompt KV cache is held, and the reference's
    replies are teacher-forced from it once read; no prompt is run again, the numbers equal the two-pass ones."""
    texts, _, _, replies, _ = answered
    own, held, (n_held, size, not_held), runs, one = _held_and_compared(pair, answered, 2**30)
    assert n_held == len(BATCHES) and size > 0 and not_held == 0
    assert not held.held and held.held_size == 0
    # only the replies its own decode did not give are run (right-padded within PADDING), no prompt token
    needed = [len(replies[p]) - 1 for p in PROMPTS if own[p][:len(replies[p])] != replies[p] and len(replies[p]) >= 2]
    assert needed and sum(needed) <= sum(runs) <= PADDING * sum(needed)
    assert _close(one, _two_pass(pair, texts))


def test_caches_beyond_the_budget_are_not_held_and_their_texts_run_again(pair, answered):
    texts = answered[0]
    _, held, (n_held, _, not_held), runs, one = _held_and_compared(pair, answered, 1)
    assert n_held == 0 and not_held == len(BATCHES)
    # the texts whose reply the model's own decode did not give are run whole; the others are not
    assert sum(runs) == sum(len(t.prompt_ids) + len(t.reply_ids) for t in texts
                            if held.states(t.prompt_ids, t.reply_ids) is None) > 0
    assert _close(one, _two_pass(pair, texts))



def test_a_held_batch_that_runs_out_of_cuda_memory_runs_its_texts_again(pair, answered, monkeypatch, caplog):
    """Out of CUDA memory while teacher-forcing one held batch: that batch is let go with a warning, its texts run
    again from their first token, the other batch is teacher-forced, and every number equals the two-pass one."""
    from harness.evaluation import generation

    texts = answered[0]
    real, calls = generation._teacher_force, []

    def first_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "_teacher_force", first_fails)
    with caplog.at_level("WARNING", logger="harness"):
        _, held, _, runs, one = _held_and_compared(pair, answered, 2**30)
    assert len(calls) == len(BATCHES) and "CUDA out of memory teacher-forcing" in caplog.text
    assert not held.held and held.held_size == 0
    again = [t for t in texts if held.states(t.prompt_ids, t.reply_ids) is None]
    first = {tuple(p) for p in BATCHES[0]}
    assert again and all(t.prompt_ids in first for t in again)  # only the first batch's texts run whole
    assert sum(runs) >= sum(len(t.prompt_ids) + len(t.reply_ids) for t in again)
    assert _close(one, _two_pass(pair, texts))

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_statistics_match_float64_softmaxes(dtype):
    generator = torch.Generator().manual_seed(3)
    logits_p = (6 * torch.randn(40, 500, generator=generator)).to(dtype).float()
    logits_q = (logits_p + 0.3 * torch.randn(40, 500, generator=generator)).to(dtype).float()
    logits_q[0] = logits_p[0]  # identical rows: exactly 0
    logits_q[1] = logits_p[1] + 1000.0  # a shift of every logit: the same distribution
    targets = torch.randint(0, 500, (40,), generator=generator)
    got = token_statistics(logits_q.clone(), logits_p.clone() - 7.0, targets)  # either side's shift is free
    logp, logq = log_softmax(logits_p.double().numpy(), -1), log_softmax(logits_q.double().numpy(), -1)
    kl, kl_reverse = rel_entr(np.exp(logp), np.exp(logq)).sum(-1), rel_entr(np.exp(logq), np.exp(logp)).sum(-1)
    np.testing.assert_allclose(got["kl"].numpy(), kl, rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(got["kl_reverse"].numpy(), kl_reverse, rtol=1e-4, atol=2e-6)
    np.testing.assert_allclose(got["logq_target"].numpy(), logq[np.arange(40), targets.numpy()], rtol=1e-6, atol=1e-5)
    assert (got["top1_quant"].numpy() == logq.argmax(-1)).all() and kl[2:].min() > 1e-5 and kl.mean() > 1e-3
    same = token_statistics(logits_p.clone(), logits_p.clone(), targets)  # identical logits: exactly 0
    assert (same["kl"] == 0).all() and (same["kl_reverse"] == 0).all()



@pytest.mark.parametrize("threads", [1, 2])
def test_statistics_in_blocks_of_rows_equal_one_block_bit_for_bit(monkeypatch, threads):
    """On a CPU the statistics run in blocks of rows (cache-sized); every value equals the one-block computation's
    exactly, whatever the block, the last block's size and the thread count."""
    generator = torch.Generator().manual_seed(5)
    logits_p = 5 * torch.randn(45, 3000, generator=generator)
    logits_q = logits_p + 0.4 * torch.randn(45, 3000, generator=generator)
    targets = torch.randint(0, 3000, (45,), generator=generator)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = scoring._token_statistics(logits_q, logits_p, targets, True)
        for rows in (1, 7, 16, 44):
            monkeypatch.setattr(scoring, "CPU_STATISTICS_FLOATS", rows * 3000)
            blocks = token_statistics(logits_q, logits_p, targets, reference_targets=True)
            assert blocks.keys() == whole.keys()
            assert all(torch.equal(blocks[key], whole[key]) for key in whole), rows
        log_q, top1 = scoring.target_statistics(logits_q.clone(), targets)  # the reference-side twin, unblocked
        assert torch.equal(log_q, blocks["logq_target"]) and torch.equal(top1, blocks["top1_quant"])
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_a_sequential_job_builds_its_tasks_once_and_runs_no_prompt_again(make_cfg, tmp_path, monkeypatch):
    """Under eval.sequential the candidate answers in rounds: lm-eval's tasks are loaded once per slice and
    model (not once per round), and the divergence stage takes the rounds' states (no text run again)."""
    from harness.evaluation import evaluate
    from harness.job.pipeline import run

    loads = []
    build = evaluate.task_manager

    def counting(slice_, settings):
        manager = build(slice_, settings)
        load = manager.load
        manager.load = lambda *args, **kwargs: loads.append(slice_.name) or load(*args, **kwargs)
        return manager

    monkeypatch.setattr(evaluate, "task_manager", counting)
    result = run(make_cfg("model=tiny_random", "slices=[math]", "slices.math.n_items=24", "eval.sequential=true",
                          "eval.sequential_round_items=6", "gate.min_items=100", "quant=int4_g128",
                          "tracking.enabled=false", "runtime.threads=1"))
    assert result["sequential"]["math"]["rounds_used"] >= 2  # gate.min_items=100 keeps the slice open
    assert loads == ["math", "math"]  # the reference's evaluation, then every round of the candidate's
    # the divergence stage runs exactly the texts whose reference states were not captured (a random model's
    # reply re-encodes to other tokens than it generated: those are run again on both sides)
    [entry] = (tmp_path / "cache" / "reference").glob("*/divergence.pt")
    texts = torch.load(entry, weights_only=False)
    again = sum(len(t.input_ids) for t in texts if not t.captured)
    assert any(t.captured for t in texts)
    assert result["throughput"].get("divergence", {}).get("prefill_tokens", 0) == again
    tokens = pd.read_parquet(next((tmp_path / "results").glob("*")) / "tokens.parquet")
    assert set(tokens["kind"]) == {"prompt", "reply"} and tokens["kl"].mean() > 0
