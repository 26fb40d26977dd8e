"""A long multi-query pass with KV quantization builds its [batch, queries, keys] masks one chunk of
queries at a time (bounded temporary memory), and the chunking changes nothing beyond the float
summation order of the attention kernel."""
from __future__ import annotations

import pytest
import torch

from harness.config import KVCacheQuantConfig, TensorQuantConfig
from harness.quant import kv
from harness.quant.kv import install_kv_quant
from tiny_models import tiny_llama

KIVI4 = KVCacheQuantConfig(keys=TensorQuantConfig(format="int", bits=4, symmetric=False, granularity="channel"),
                           values=TensorQuantConfig(format="int", bits=4, symmetric=False, granularity="token"),
                           group_tokens=32, residual_length=32)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("padded", [False, True])
@torch.no_grad()
def test_long_prefill_masks_are_built_per_query_chunk_with_identical_results(monkeypatch, attn, padded):
    length = 2304  # 2^21 / 2304 = 910 queries per chunk: three chunks
    ids = torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :100] = 0
    model = tiny_llama(vocab_size=97, hidden_size=32, layers=1, heads=2, kv_heads=1, attn=attn,
                       max_position_embeddings=4096)
    install_kv_quant(model, KIVI4)
    spans: list[int] = []
    original = kv.full_precision_masks

    def recording(positions, query_len, cfg, *, start=0, stop=None):
        spans.append((query_len if stop is None else stop) - start)
        return original(positions, query_len, cfg, start=start, stop=stop)

    monkeypatch.setattr(kv, "full_precision_masks", recording)
    chunked = model(ids, attention_mask=mask).logits
    assert spans and max(spans) <= kv._query_chunk(length) < length  # never the whole queries x keys
    monkeypatch.setattr(kv, "_query_chunk", lambda k_len: 10**9)  # one chunk: the unchunked computation
    whole = model(ids, attention_mask=mask).logits
    # the same pairs attend; only the attention kernel's summation order over chunks differs
    # (padding positions attend to nothing and their outputs are not compared)
    real = mask.bool()
    torch.testing.assert_close(chunked[real], whole[real], rtol=0, atol=1e-5)
