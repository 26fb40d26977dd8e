"""The one tiny random Llama (transformers) of the tests: every test that needs a small Llama builds it here.

A test file states what its model differs in as arguments (a file calling it often binds them once with
functools.partial); the same arguments give the same weights on every call. Mixture-of-experts models are
in moe_models.py.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(vocab_size: int = 64, hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               seed: int | None = 0, tie: bool = False, *, intermediate_size: int | None = None,
               std: float | None = None, norm_range: tuple[float, float] | None = None, attn: str | None = None,
               **overrides: Any) -> LlamaForCausalLM:
    """A random ``LlamaForCausalLM`` in eval mode, built after ``torch.manual_seed(seed)`` (``seed=None``: the
    global generator as it is, for shapes-only models).

    ``intermediate_size`` defaults to twice ``hidden_size``; ``overrides`` are further ``LlamaConfig`` fields
    (``max_position_embeddings``, token ids). ``std``: every matrix redrawn from N(0, std²) (a larger scale than
    transformers' initialisation, so that quantization errors are not vanishingly small); ``norm_range``: every
    norm weight redrawn uniformly from the range, so that folds into norms are exercised. Both are drawn in one
    pass over the parameters in their order. ``attn``: the attention implementation ("sdpa", "eager").
    """
    if seed is not None:
        torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size if intermediate_size is None else intermediate_size,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         tie_word_embeddings=tie, **overrides)
    model = LlamaForCausalLM(config).eval()
    if std is not None or norm_range is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 2:
                    if std is not None:
                        param.normal_(0.0, std)
                elif norm_range is not None and "norm" in name:
                    param.uniform_(*norm_range)
    if attn is not None:
        model.set_attn_implementation(attn)
    return model
