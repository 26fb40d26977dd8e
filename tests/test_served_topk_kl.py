"""A served candidate's KL from its server's top-k log-probs (harness.divergence.topk_bound).

The top-k partition KL against an independent float64 computation written here from its definition
(a loop over the cells), its lower-bound property over random distributions (hypothesis), its
equality with the exact KL when the server names the whole vocabulary, and the whole path over
HTTP: tests/fake_openai.py serving a perturbed copy of the tiny model, the rows checked against that
model's own distributions computed in the test.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.divergence import scoring
from harness.divergence.topk_bound import (
    KL_BOUND,
    NoPromptLogprobs,
    partition_kl,
    partition_kl_topk_reference,
    served_rows,
)
from harness.engines.openai_endpoint import TokenNames, teacher_forced
from harness.engines.openai_http import Client, EndpointSpec

sys.path.insert(0, str(Path(__file__).parent))
from fake_openai import FakeServer  # noqa: E402


def independent_partition_kl(p: np.ndarray, q: np.ndarray, cells: list[int]) -> tuple[float, float]:
    """KL(p‖q) and KL(q‖p) on {each cell} ∪ {the rest}, from the definition, float64 (0·log 0 = 0)."""
    def term(a: float, b: float) -> float:
        return 0.0 if a == 0 else a * (np.log(a) - np.log(b))

    rest = [i for i in range(len(p)) if i not in set(cells)]
    forward = sum(term(p[i], q[i]) for i in cells)
    reverse = sum(term(q[i], p[i]) for i in cells)
    if rest:
        p_rest, q_rest = float(np.sum(p[rest])), float(np.sum(q[rest]))
        forward += term(p_rest, q_rest)
        reverse += term(q_rest, p_rest)
    return forward, reverse


def exact_kl(p: np.ndarray, q: np.ndarray) -> tuple[float, float]:
    return float(np.sum(p * (np.log(p) - np.log(q)))), float(np.sum(q * (np.log(q) - np.log(p))))


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def _rows(p: np.ndarray, q: np.ndarray, cells: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """partition_kl over rows whose cell lists differ in length (-1 pads)."""
    width = max(len(c) for c in cells)
    ids = np.full((len(cells), width), -1)
    for row, c in enumerate(cells):
        ids[row, :len(c)] = c
    logq = np.log(np.take_along_axis(q, np.maximum(ids, 0), -1))
    forward, reverse = partition_kl(torch.from_numpy(np.log(p)), torch.from_numpy(ids), torch.from_numpy(logq))
    return forward.numpy(), reverse.numpy()


def test_the_partition_kl_equals_an_independent_float64_computation():
    rng = np.random.default_rng(7)
    vocab, n = 60, 12
    p = softmax(rng.normal(0, 3, (n, vocab)))
    q = softmax(rng.normal(0, 3, (n, vocab)))
    # the server's top-k of q (k varies by row), and arbitrary named sets (a server adds the actual token)
    cells = [list(np.argsort(-q[row])[:k]) for row, k in zip(range(n // 2), (1, 2, 5, 20, 30, 40))]
    cells += [list(rng.choice(vocab, size=k, replace=False)) for k in (1, 3, 7, 15, 30, 50)]
    forward, reverse = _rows(p, q, cells)
    for row in range(n):
        expected = independent_partition_kl(p[row], q[row], [int(i) for i in cells[row]])
        np.testing.assert_allclose([forward[row], reverse[row]], expected, rtol=1e-10, atol=1e-13)
        assert forward[row] > 0 and reverse[row] > 0  # distinct random distributions: something to find


def test_the_partition_kl_of_a_reference_stored_as_its_own_top_k_equals_the_independent_one():
    """Cells are the tokens both sides named (eval.reference_store=topk); the rest is lumped."""
    rng = np.random.default_rng(11)
    vocab = 40
    p, q = softmax(rng.normal(0, 3, (4, vocab))), softmax(rng.normal(0, 3, (4, vocab)))
    ref_ids = np.argsort(-p, axis=-1)[:, :12]
    served_ids = np.argsort(-q, axis=-1)[:, :8]
    forward, reverse = partition_kl_topk_reference(
        torch.from_numpy(ref_ids), torch.from_numpy(np.log(np.take_along_axis(p, ref_ids, -1))),
        torch.from_numpy(served_ids), torch.from_numpy(np.log(np.take_along_axis(q, served_ids, -1))))
    for row in range(4):
        both = [int(i) for i in served_ids[row] if i in set(ref_ids[row])]
        np.testing.assert_allclose([forward[row], reverse[row]], independent_partition_kl(p[row], q[row], both),
                                   rtol=1e-10, atol=1e-13)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.integers(2, 300), scale=st.floats(0.01, 12.0),
       k_share=st.floats(0.0, 1.0), arbitrary=st.booleans())
def test_the_partition_kl_never_exceeds_the_exact_kl(seed, vocab, scale, k_share, arbitrary):
    rng = np.random.default_rng(seed)
    p = softmax(rng.normal(0, scale, (3, vocab)))
    q = softmax(rng.normal(0, scale, (3, vocab)) + rng.normal(0, scale / 4, (3, vocab)))
    k = max(1, round(k_share * vocab))
    cells = [list(rng.choice(vocab, size=k, replace=False)) if arbitrary else list(np.argsort(-q[row])[:k])
             for row in range(3)]
    forward, reverse = _rows(p, q, cells)
    for row in range(3):
        exact_forward, exact_reverse = exact_kl(p[row], q[row])
        assert forward[row] <= exact_forward * (1 + 1e-9) + 1e-12
        assert reverse[row] <= exact_reverse * (1 + 1e-9) + 1e-12


def test_the_partition_kl_is_the_exact_kl_when_the_server_names_the_whole_vocabulary():
    rng = np.random.default_rng(3)
    vocab = 500
    p, q = softmax(rng.normal(0, 4, (5, vocab))), softmax(rng.normal(0, 4, (5, vocab)))
    cells = [list(rng.permutation(vocab)) for _ in range(5)]
    forward, reverse = _rows(p, q, cells)
    for row in range(5):
        np.testing.assert_allclose([forward[row], reverse[row]], exact_kl(p[row], q[row]), rtol=1e-10)


def test_a_top_k_lumping_more_mass_is_further_below_the_exact_kl():
    """Fewer cells (a smaller k) can only lose divergence: the bound grows with k toward the exact value."""
    rng = np.random.default_rng(5)
    p, q = softmax(rng.normal(0, 3, (1, 200))), softmax(rng.normal(0, 3, (1, 200)))
    order = list(np.argsort(-q[0]))
    bounds = [_rows(p, q, [order[:k]])[0][0] for k in (1, 5, 20, 50, 200)]
    assert all(a <= b + 1e-12 for a, b in zip(bounds, bounds[1:]))
    assert bounds[-1] == pytest.approx(exact_kl(p[0], q[0])[0], rel=1e-10)
    assert bounds[0] < bounds[-1]


def test_a_rest_below_the_resolution_of_the_servers_rounded_top_k_still_gives_a_finite_lower_bound():
    """The server's top-k holds all but 1e-12 of its mass, and its float32 log-probs sum past 1: its rest
    cell is unknowable, and the bound must not blow up past the exact KL (the reference puts half its
    mass there)."""
    vocab, k = 100, 4
    q = np.full(vocab, 1e-12 / (vocab - k))
    q[:k] = (1 - 1e-12) / k
    p = np.full(vocab, 0.5 / (vocab - k))
    p[:k] = 0.5 / k
    logq_served = np.log(q[:k]).astype(np.float32).astype(np.float64) + 1e-7  # rounded up, as a server may
    assert np.exp(logq_served).sum() > 1
    forward, reverse = partition_kl(torch.from_numpy(np.log(p))[None], torch.arange(k)[None],
                                    torch.from_numpy(logq_served)[None])
    exact_forward, _ = exact_kl(p, q)
    assert 0 < float(forward[0]) <= exact_forward and np.isfinite(float(reverse[0]))
    # the rest cell's term is what it is at the resolution of the sum (k float32 steps), not at 1e-12
    floor = k * 2.0 ** -23
    np.testing.assert_allclose(float(forward[0]), 0.5 * np.log(0.5 / floor) + sum(
        p[i] * (np.log(p[i]) - logq_served[i]) for i in range(k)), rtol=1e-9)


@pytest.mark.slow
def test_a_token_named_by_its_text_is_read_as_its_one_id(tiny_tokenizer):
    names = TokenNames(tiny_tokenizer)
    ids = tiny_tokenizer(" capital of France", add_special_tokens=False)["input_ids"]
    assert [names.id(tiny_tokenizer.decode([i])) for i in ids] == ids
    assert names.id("token_id:1234") == 1234
    assert names.id("no such token text \u2603\u2603") is None


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_models):
    return tiny_models[0].tokenizer


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, shared_model_cache):
    """A peaked copy of the tiny model (the reference: its random head's logits scaled up, as a trained
    model's are peaked) and a perturbed copy of that (the served candidate); a returned object holds
    the reference as ``.model`` and its tokenizer."""
    from harness.config import compose
    from harness.config import to_config
    from harness.models import loading as models

    root = tmp_path_factory.mktemp("served_kl")
    (root / "cache").mkdir()
    os.symlink(shared_model_cache, root / "cache" / "models")
    cfg = to_config(compose(["model=tiny_random", f"paths.cache_dir={root / 'cache'}",
                                      "tracking.enabled=false"]))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    reference = copy.deepcopy(loaded.model)
    with torch.no_grad():
        reference.get_output_embeddings().weight.mul_(5.0)
    loaded = dataclasses.replace(loaded, model=reference)
    served = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in served.named_parameters():
            if parameter.ndim == 2 and "embed" not in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * parameter.std() * 0.3)
    return loaded, served


TEXTS = ["The capital of France is Paris, and the capital of Japan is Tokyo.",
         "def square(x):\n    return x * x\n\nprint(square(12))", "12 + 7 * 3 = 33"]


@pytest.mark.slow
def test_served_rows_over_http_match_the_served_models_own_distributions(tiny_models):
    """Each row against the perturbed model's distributions computed here: exact NLL, its top-1, and the
    partition KL of its top-k plus the actual token (what the fake names), below the exact KL."""
    loaded, served_model = tiny_models
    tokenizer, k = loaded.tokenizer, 5
    references = scoring.score_reference(loaded.model, tokenizer, TEXTS, max_tokens=64, store="hidden")
    with FakeServer(served_model, tokenizer) as server:
        client = Client(EndpointSpec(url=server.url))
        client.connect()
        answers = teacher_forced(client, [r.input_ids.tolist() for r in references], k, tokenizer, batch_size=2)
    assert server.completions == 2  # three texts, two per request
    for index, (ref, answer) in enumerate(zip(references, answers)):
        rows = served_rows(ref, answer, "s", index)
        ids = ref.input_ids
        with torch.no_grad():
            logp = torch.log_softmax(loaded.model(ids[None]).logits[0, :-1].double(), -1).numpy()
            logq32 = torch.log_softmax(served_model(ids[None]).logits[0, :-1].float(), -1)
        logq = logq32.double().numpy()
        targets = ids[1:].numpy()
        assert (rows["kl_bound"] == KL_BOUND).all()
        np.testing.assert_allclose(rows["nll_quant"], -logq[np.arange(len(targets)), targets], atol=1e-5)
        assert (rows["top1_quant"].to_numpy() == logq32.argmax(-1).numpy()).all()
        for position in range(len(targets)):
            cells = {int(i) for i in logq32[position].topk(k).indices} | {int(targets[position])}
            expected = independent_partition_kl(np.exp(logp[position]), np.exp(logq[position]), sorted(cells))
            np.testing.assert_allclose(rows.loc[position, ["kl", "kl_reverse"]].to_numpy(float), expected,
                                       rtol=1e-3, atol=1e-5)
            assert rows.loc[position, "kl_cells"] == len(cells)
        exact = (np.exp(logp) * (logp - logq)).sum(-1)
        assert (rows["kl"].to_numpy() <= exact + 1e-5).all()
        assert rows["kl"].mean() > 0  # the perturbed copy differs: the bound sees it


@pytest.mark.slow
def test_a_server_without_prompt_log_probs_or_refusing_k_gives_no_divergence(tiny_models):
    loaded, _ = tiny_models
    ids = loaded.tokenizer(TEXTS[0])["input_ids"]
    with FakeServer(loaded.model, loaded.tokenizer, prompt_logprobs=False) as server:
        client = Client(EndpointSpec(url=server.url))
        client.connect()
        with pytest.raises(NoPromptLogprobs, match="no log-probs of prompt tokens"):
            teacher_forced(client, [ids], 20, loaded.tokenizer)
    with FakeServer(loaded.model, loaded.tokenizer, max_logprobs=5) as server:
        client = Client(EndpointSpec(url=server.url))
        client.connect()
        with pytest.raises(NoPromptLogprobs, match="refused logprobs=20.*greater than max allowed: 5"):
            teacher_forced(client, [ids], 20, loaded.tokenizer)
        assert len(teacher_forced(client, [ids], 5, loaded.tokenizer)) == 1  # within the cap it answers
