"""harness.evaluation.generation against HF generate: the same replies, fewer rows decoded."""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from lm_eval.models.utils import postprocess_generated_text

from harness.evaluation import evaluate
from harness.job import identity
from harness.evaluation.evaluate import check_settings
from harness.config import to_config
from harness.models import loading as models
from harness.evaluation.generation import (PREFILL_PADDING, PREFILL_TOKENS, greedy_generate, joins_caches,
                                           prefill_groups)
from harness.evaluation.slices import resolve

TINY = ["model=tiny_random", "slices=[math]", "slices.math.n_items=18", "slices.math.divergence_texts=4",
        "slices.math.tasks=[harness_math_gen,harness_math_mc]", "quant=none"]


@pytest.fixture
def tiny(make_cfg):
    cfg = to_config(make_cfg(*TINY))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    return cfg, loaded


def _batch(tokenizer, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of the given lengths (ids from the tokenizer's ordinary range)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(10, 200, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def _hf(model, ids, mask, new_tokens, pad, eos):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=pad, eos_token_id=sorted(eos) or None)


@pytest.mark.slow
def test_greedy_generate_is_hf_generate_without_stops(tiny):
    _, loaded = tiny
    model, tok = loaded.model, loaded.tokenizer
    ids, mask = _batch(tok, [5, 12, 9, 3])
    expected = _hf(model, ids, mask, 16, tok.pad_token_id, set())
    got = greedy_generate(model, ids, mask, max_new_tokens=16, pad_token_id=tok.pad_token_id, eos_token_ids=set())
    assert torch.equal(got, expected)


@pytest.mark.slow
def test_rows_that_stop_early_give_the_same_replies_and_leave_the_batch(tiny):
    _, loaded = tiny
    model, tok = loaded.model, loaded.tokenizer
    ids, mask = _batch(tok, [7, 11, 4, 9, 6], seed=1)
    width, new = ids.shape[1], 24
    free = _hf(model, ids, mask, new, tok.pad_token_id, set())
    # An end-of-sequence token that row 0 emits at its 4th step, and a stop string that row 2's reply
    # contains early on: both rows end early; the others run to max_new_tokens.
    eos = {int(free[0, width + 3])}
    reply2 = tok.decode(free[2, width:width + 6], skip_special_tokens=False)
    stop = [reply2[-3:]] if reply2[-3:].strip() else [reply2[-4:]]
    rows_per_step: list[int] = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: rows_per_step.append(kwargs["input_ids"].shape[0]),
                                           with_kwargs=True)
    try:
        got = greedy_generate(model, ids, mask, max_new_tokens=new, pad_token_id=tok.pad_token_id, stop=stop,
                              decode=lambda t: tok.decode(t, skip_special_tokens=False), eos_token_ids=eos)
    finally:
        hook.remove()
    expected = _hf(model, ids, mask, new, tok.pad_token_id, eos)
    assert got.shape[0] == expected.shape[0]
    for row in range(ids.shape[0]):
        ours = postprocess_generated_text(tok.decode(got[row, width:], skip_special_tokens=True), stop, None)
        theirs = postprocess_generated_text(tok.decode(expected[row, width:], skip_special_tokens=True), stop, None)
        assert ours == theirs, row
    assert rows_per_step[0] == 5 and min(rows_per_step) < 5  # finished rows were dropped
    assert sum(rows_per_step) < 5 * len(rows_per_step)


@pytest.mark.slow
def test_the_harness_generator_gives_lm_evals_records(tiny, make_cfg):
    """The whole slice through HFLM with HF generate and through HarnessHFLM: the same per-item records."""
    cfg, loaded = tiny
    slice_ = resolve(cfg.slices)[0]
    out = {}
    for generator in ("hf", "harness"):
        settings = identity.eval_settings(to_config(make_cfg(*TINY, f"eval.generator={generator}")), None)
        lm = evaluate.make_lm(loaded.model, loaded.tokenizer, settings)
        assert (type(lm).__name__ == "HarnessHFLM") == (generator == "harness")
        out[generator], _ = evaluate.evaluate_slice(lm, slice_, settings)
    pd.testing.assert_frame_equal(out["hf"], out["harness"])


def test_an_unknown_generator_is_refused_before_work(make_cfg):
    from harness.cli import UsageError

    with pytest.raises(UsageError, match="eval.generator='fast'.*harness"):
        check_settings(to_config(make_cfg(*TINY, "eval.generator=fast")))


@pytest.mark.slow
def test_shared_context_scoring_matches_full_sequences(tiny, make_cfg):
    """Multiple-choice requests scored with the context run once equal lm-eval's full-sequence scores."""
    from lm_eval.models.huggingface import HFLM

    from harness.evaluation.generation import shared_context_logprobs

    _, loaded = tiny
    model, tok = loaded.model, loaded.tokenizer
    settings = identity.eval_settings(to_config(make_cfg(*TINY)), None)
    lm = evaluate.make_lm(model, tok, settings)
    gen = torch.Generator().manual_seed(3)
    requests = []
    for item in range(3):
        context = torch.randint(10, 200, (9 + 4 * item,), generator=gen).tolist()
        for choice in range(4):
            cont = torch.randint(10, 200, (1 + choice,), generator=gen).tolist()
            requests.append(((f"c{item}", f"x{choice}"), context, cont))
    requests.append((("solo", "y"), [5, 6, 7], [8, 9]))  # a context of its own: lm-eval's path
    expected = HFLM._loglikelihood_tokens(lm, requests)
    got = lm._loglikelihood_tokens(requests)
    assert [g for _, g in got] == [g for _, g in expected]
    assert torch.allclose(torch.tensor([v for v, _ in got]), torch.tensor([v for v, _ in expected]), rtol=1e-5, atol=1e-4)
    direct = shared_context_logprobs(model, requests[0][1], [r[2] for r in requests[:4]], pad_token_id=0, device="cpu")
    assert [round(v, 4) for v, _ in direct] == [round(v, 4) for v, _ in got[:4]]
    with pytest.raises(ValueError, match="context of >= 2 tokens"):
        shared_context_logprobs(model, [5], [[1]], pad_token_id=0, device="cpu")


@pytest.mark.slow
def test_the_tail_stop_check_ends_each_reply_where_decoding_all_of_it_does(shared_model_cache, tmp_path):
    """The stop check decodes a reply's tail each step; it must end a reply at the step where
    decoding the whole reply first shows a stop string (the definition), never earlier or later.
    Replies: SmolLM2-tokenizer ids from code, prose, several scripts and emoji (characters split
    over byte tokens) and random ids; stops: strings cut from the decoded text at random places
    and lengths, whitespace runs, and the slices' own stop strings."""
    import random

    from harness.infra.cache import Cache
    from harness.config import load_model_config
    from harness.evaluation.generation import _stop_check

    (tmp_path / "models").symlink_to(shared_model_cache)
    tok = models.load_tokenizer(load_model_config("smollm2_135m"), Cache(tmp_path))

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=False)

    texts = ["def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n    return a + b\n\n\nclass Q:\n\tpass\n" * 6,
             "The answer is 42.\n\nQuestion: what is 6 x 7?\nAnswer: 42\n\n" * 8,
             "Привет, мир! 東京は日本の首都です。 مرحبا بالعالم 🚀🎉 naïve café — ünïcödé\n" * 6,
             '{"name": "x", "items": [1, 2, {"k": "v"}]}\n```\n' * 10]
    rng = random.Random(0)
    replies = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
    replies += [[rng.randrange(len(tok)) for _ in range(300)] for _ in range(4)]
    fixed = ["\n\n", "```", "<|im_end|>", "\nQuestion:", "    ", "\n\n\n", "🎉", "首都", "}\n"]
    cases = 0
    for reply in replies:
        full = decode(reply)
        cut = []
        for _ in range(12):
            start = rng.randrange(len(full))
            piece = full[start:start + rng.choice([1, 2, 3, 5, 8, 13, 40])]
            if piece and "\ufffd" not in piece:
                cut.append(piece)
        for stop in [[s] for s in fixed + cut] + [fixed[:3], cut[:4]]:
            definition = next((n for n in range(1, len(reply) + 1) if any(s in decode(reply[:n]) for s in stop)), None)
            stopped = _stop_check(stop, decode)
            tail = next((n for n in range(1, len(reply) + 1) if stopped(reply[:n])), None)
            assert tail == definition, (stop, definition, tail)
            cases += definition is not None
    assert cases > 60  # most stops are met somewhere in their reply, at many different steps


def test_prompts_prefilled_in_groups_decode_as_one_batch_with_the_same_replies():
    """prefill_rows: groups of prompts prefilled apart (each padded to its own longest), then decoded as one batch.
    Each row's reply is the one HF generate gives that prompt alone (no padding at all); every decode step carries
    every unfinished row; the captured states are those of one prefill of the whole batch."""
    from harness.divergence.capture import HiddenCapture
    from tests.conftest import perturbed_llama_pair

    _, model = perturbed_llama_pair(96, num_hidden_layers=2)
    lengths, pad, new = [13, 13, 12, 9, 9, 9, 2], 0, 12  # groups of 3 rows within the padding bound, then 1
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 96, (n,), generator=gen).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    alone = [model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=new, do_sample=False, pad_token_id=pad, eos_token_id=None)[0, len(p):]
             for p in prompts]
    eos = {int(alone[1][4])}  # row 1 (and any row emitting it) finishes early
    rows_per_forward: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _args, kwargs: rows_per_forward.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    grouped, whole = HiddenCapture(), HiddenCapture()
    teacher = {tuple(p): tuple(alone[(i + 1) % len(prompts)][:5].tolist()) for i, p in enumerate(prompts)}
    try:
        got = greedy_generate(model, ids, mask, max_new_tokens=new, pad_token_id=pad, eos_token_ids=eos,
                              capture=grouped, teacher=teacher.get, prefill_rows=3)
    finally:
        hook.remove()
    greedy_generate(model, ids, mask, max_new_tokens=new, pad_token_id=pad, eos_token_ids=eos, capture=whole,
                    teacher=teacher.get)
    for row, reply in enumerate(alone):
        tokens = reply.tolist()
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        assert got[row, width:width + end].tolist() == tokens[:end], row
        assert (got[row, width + end:] == pad).all(), row
    # three prefills (3 + 3 + 1 rows) and three teacher-forcing passes, then decode steps of all unfinished rows
    assert prefill_groups(lengths, 3) == [(0, 3), (3, 6), (6, 7)]
    unfinished = sum(int(reply[0]) not in eos for reply in alone)  # rows still decoding after their first token
    assert rows_per_forward[:6] == [3, 3, 3, 3, 1, 1] and rows_per_forward[6] == unfinished > 3
    assert min(rows_per_forward[6:]) < len(prompts)  # finished rows still leave the batch
    for prompt in prompts:
        reply = teacher[tuple(prompt)]
        a, b = grouped.states(prompt, reply), whole.states(prompt, reply)
        assert a is not None and b is not None and torch.allclose(a, b, rtol=1e-4, atol=1e-5)



def test_prefill_groups_cut_where_padding_or_tokens_would_grow():
    # long prompts alone; short ones together while the padding stays within PREFILL_PADDING
    assert prefill_groups([1000, 990, 600, 120, 118, 117, 116, 115, 60], 8) == \
        [(0, 1), (1, 2), (2, 3), (3, 8), (8, 9)]
    assert prefill_groups([5, 5, 5, 5, 5], 2) == [(0, 2), (2, 4), (4, 5)]  # at most `rows` rows
    assert prefill_groups([2000], 8) == [(0, 1)]  # one row past every bound still goes
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        lengths = sorted(torch.randint(1, 1500, (int(torch.randint(1, 70, (1,), generator=gen)),),
                                       generator=gen).tolist(), reverse=bool(torch.randint(0, 2, (1,), generator=gen)))
        rows = int(torch.randint(1, 12, (1,), generator=gen))
        groups = prefill_groups(lengths, rows)
        assert [a for a, _ in groups] == [0, *[b for _, b in groups[:-1]]] and groups[-1][1] == len(lengths)
        for a, b in groups:
            part = lengths[a:b]
            assert b - a <= rows
            assert b - a == 1 or (sum(part) <= PREFILL_TOKENS and len(part) * max(part) <= PREFILL_PADDING * sum(part))


def test_groups_caches_are_released_once_joined(monkeypatch):
    """Only the joined KV cache lives while decoding: the caches of the groups prefilled apart are freed."""
    import weakref

    from harness.evaluation import generation
    from tests.conftest import perturbed_llama_pair

    _, model = perturbed_llama_pair(96, num_hidden_layers=1)
    lengths = [9, 9, 8, 8, 3, 3]
    ids = torch.tensor([[0] * (9 - n) + list(range(1, n + 1)) for n in lengths])
    mask = (ids > 0).long()
    parts_keys: list = []
    merge = generation._merge

    def recording(parts):
        parts_keys.extend(weakref.ref(part[0].layers[0].keys) for part in parts[1:])
        return merge(parts)

    monkeypatch.setattr(generation, "_merge", recording)
    alive: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kwargs: alive.append(
        sum(ref() is not None for ref in parts_keys)) if kwargs["input_ids"].shape[1] == 1 else None, with_kwargs=True)
    try:
        greedy_generate(model, ids, mask, max_new_tokens=4, pad_token_id=0, eos_token_ids=set(), prefill_rows=2)
    finally:
        hook.remove()
    assert len(parts_keys) == 2 and alive and max(alive) == 0


def test_caches_that_cannot_be_joined_generate_batch_size_rows_at_a_time():
    """A sliding-window model's caches cannot be joined: lm-eval's decode_rows chunk generates prefill_rows
    (eval.batch_size) rows at a time, each group without the columns that pad all of its rows, and the result has
    the chunk's layout (its prompt width) with each group's own tokens."""
    from types import SimpleNamespace

    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                                             max_position_embeddings=64)).eval()
    assert not joins_caches(model)
    cls = evaluate._harness_hflm()
    lm = cls.__new__(cls)  # the generation methods only, around this model
    lm._model, lm.tokenizer, lm.backend = model, SimpleNamespace(pad_token_id=0), "causal"
    lm.prefill_rows, lm.hidden_capture, lm.teacher = 2, None, None
    lengths, width, new = [11, 10, 6, 5, 3, 2], 11, 6
    ids = torch.tensor([[0] * (width - n) + list(range(1, n + 1)) for n in lengths])
    mask = (ids > 0).long()
    shapes: list[tuple[int, int]] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kwargs: shapes.append(tuple(kwargs["input_ids"].shape))
                                           if kwargs["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    try:
        out = lm._model_generate(ids, width + new, [], attention_mask=mask, do_sample=False)
    finally:
        hook.remove()
    assert shapes == [(2, 11), (2, 6), (2, 3)]  # prefills of 2 rows, each as wide as its own longest prompt
    assert torch.equal(out[:, :width], ids)
    for a in range(0, 6, 2):
        first = width - lengths[a]
        alone = greedy_generate(model, ids[a:a + 2, first:], mask[a:a + 2, first:], max_new_tokens=new, pad_token_id=0,
                                eos_token_ids=set())
        assert torch.equal(out[a:a + 2, width:width + new], alone[:, lengths[a]:])
