"""KV-cache quantization on tiny llama / Gemma 3 models, against independent references.

References: post-RoPE keys rebuilt from forward hooks on ``k_proj`` plus the model's rotary embedding
(a route that does not go through the wrapper); FP8 grids from torch's float8 cast after clamping;
INT grids and KIVI token groups written out below with explicit loops; attention with a recent
full-precision window recomputed query by query.
"""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AttentionInterface, Gemma3ForCausalLM, Gemma3TextConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from harness.config import KVCacheQuantConfig, TensorQuantConfig, compose
from harness.quant import apply
from harness.quant.kv import (install_kv_quant, kv_layer_states, kv_quant_mode, remove_kv_quant,
                              validate_kv_cache)
from harness.quant.format_table import SchemeError
from tiny_models import tiny_llama

VOCAB = 96
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FP8 = dict(format="fp8_e4m3", dynamic=True)


def spec(**kwargs) -> TensorQuantConfig:
    return TensorQuantConfig(**kwargs)


FP8_TOKEN = KVCacheQuantConfig(keys=spec(granularity="token", **FP8), values=spec(granularity="token", **FP8))
KIVI4 = KVCacheQuantConfig(keys=spec(format="int", bits=4, symmetric=False, granularity="channel"),
                           values=spec(format="int", bits=4, symmetric=False, granularity="token"),
                           group_tokens=4, residual_length=3)
KIVI8_NO_WINDOW = KVCacheQuantConfig(keys=spec(format="int", bits=8, symmetric=True, granularity="channel"),
                                     values=spec(format="int", bits=8, symmetric=True, granularity="token"),
                                     group_tokens=4)
FP8_STATIC = KVCacheQuantConfig(keys=spec(format="fp8_e4m3", granularity="tensor", dynamic=False),
                                values=spec(format="fp8_e4m3", granularity="head", dynamic=False))


# ------------------------------------------------------------------------------------ fixtures
llama = partial(tiny_llama, vocab_size=VOCAB, std=0.15, attn="sdpa", max_position_embeddings=256)


def tiny_gemma3() -> Gemma3ForCausalLM:
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                              max_position_embeddings=256)
    torch.manual_seed(1)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.15)
    return model


class Probe:
    """A base attention (sdpa inside) that records the query, keys and values it is handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        self.calls.append((module.layer_idx, query.clone(), key.clone(), value.clone()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def layer(self, idx: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [(q, k, v) for i, q, k, v in self.calls if i == idx]


def with_probe(model) -> Probe:
    probe = Probe()
    AttentionInterface.register("kvtest_probe", probe)
    AttentionMaskInterface.register("kvtest_probe", sdpa_mask)
    model.set_attn_implementation("kvtest_probe")
    return probe


class Projections:
    """Forward hooks on k_proj / v_proj: the pre-RoPE keys and the values, per layer and call."""

    def __init__(self, model) -> None:
        self.model = model
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}
        self.handles = []
        for idx, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            self.handles.append(attn.k_proj.register_forward_hook(self._hook(self.keys, idx, attn.head_dim)))
            self.handles.append(attn.v_proj.register_forward_hook(self._hook(self.values, idx, attn.head_dim)))

    @staticmethod
    def _hook(store, idx, head_dim):
        def hook(_module, _inputs, output):
            b, s, _ = output.shape
            store.setdefault(idx, []).append(output.detach().view(b, s, -1, head_dim).transpose(1, 2).clone())
        return hook

    def post_rope_keys(self, idx: int, call: int = -1) -> torch.Tensor:
        pre = self.keys[idx][call]
        position_ids = torch.arange(pre.shape[2])[None]
        cos, sin = self.model.model.rotary_emb(pre, position_ids)
        return apply_rotary_pos_emb(pre, pre, cos, sin)[1]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# --------------------------------------------------------------------- independent references
def fp8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def fp8_token_ref(x: torch.Tensor) -> torch.Tensor:
    return fp8_ref(x, x.abs().amax(-1, keepdim=True) / 448)


def int_sym_ref(x: torch.Tensor, bits: int, amax: torch.Tensor) -> torch.Tensor:
    qmax = 2 ** (bits - 1) - 1
    scale = amax / qmax
    return torch.clamp(torch.round(x / scale), -qmax, qmax) * scale


def int_asym_ref(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Min/max grid over ``dim``: scale (max-min)/(2^b-1), integer zero point, codes 0..2^b-1."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / (2 ** bits - 1)
    zero = torch.round(-lo / scale)
    return (torch.clamp(torch.round(x / scale) + zero, 0, 2 ** bits - 1) - zero) * scale


def kivi_keys_ref(keys: torch.Tensor, bits: int, group: int, symmetric: bool) -> torch.Tensor:
    """Per-channel over complete groups of ``group`` tokens from position 0; the tail stays as is."""
    out = keys.clone()
    for start in range(0, keys.shape[2] - group + 1, group):
        block = keys[:, :, start:start + group]
        out[:, :, start:start + group] = (int_asym_ref(block, bits, 2) if not symmetric
                                          else int_sym_ref(block, bits, block.abs().amax(2, keepdim=True)))
    return out


def attention_reference(q, k, v, k_quant, v_quant, scaling, residual, group):
    """Causal attention, query by query: key j is read in full precision when i - j < residual or its
    group is incomplete at i; value j when i - j < residual."""
    batch, heads, length, _ = q.shape
    rep = heads // k.shape[1]
    out = torch.zeros_like(q)
    for i in range(length):
        for h in range(heads):
            kv = h // rep
            keys, values = [], []
            for j in range(i + 1):
                group_complete = (j // group + 1) * group - 1 <= i
                recent = i - j < residual
                keys.append(k[:, kv, j] if recent or not group_complete else k_quant[:, kv, j])
                values.append(v[:, kv, j] if recent else v_quant[:, kv, j])
            scores = torch.einsum("bd,bjd->bj", q[:, h, i], torch.stack(keys, 1)) * scaling
            out[:, h, i] = torch.einsum("bj,bjd->bd", scores.softmax(-1), torch.stack(values, 1))
    return out


def greedy(model, ids, mask, new_tokens=12):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)


def generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """position_ids as generate() makes them for a left-padded batch."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def calibration_context(batches):
    return SimpleNamespace(calibration_batches=lambda: batches)


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_disabled_wrapper_reproduces_unwrapped_model_exactly(attn):
    model = llama(attn=attn)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: lost if the wrapper's mask function were not registered
    reference = model(ids).logits
    reference_padded = model(ids, attention_mask=mask).logits
    reference_gen = greedy(model, ids, mask)
    install_kv_quant(model, KIVI4)
    assert model.config._attn_implementation == f"harness_kvquant_{attn}"
    with kv_quant_mode(model, "off"):
        assert torch.equal(model(ids).logits, reference)
        assert torch.equal(model(ids, attention_mask=mask).logits, reference_padded)
        generated = greedy(model, ids, mask)
        assert torch.equal(generated.sequences, reference_gen.sequences)
        assert all(torch.equal(a, b) for a, b in zip(generated.logits, reference_gen.logits))
    assert not torch.allclose(model(ids).logits, reference, atol=1e-3)
    remove_kv_quant(model)
    assert model.config._attn_implementation == attn and not kv_layer_states(model)
    assert torch.equal(model(ids).logits, reference)


@pytest.mark.parametrize("cfg, key_ref, value_ref", [
    (FP8_TOKEN, fp8_token_ref, fp8_token_ref),
    (KVCacheQuantConfig(keys=spec(format="int", bits=8, granularity="head"),
                        values=spec(format="int", bits=4, symmetric=False, granularity="token")),
     lambda k: int_sym_ref(k, 8, k.abs().amax((2, 3), keepdim=True)), lambda v: int_asym_ref(v, 4, -1)),
], ids=["fp8_token", "int8_head_int4_token"])
@pytest.mark.parametrize("use_cache", [False, True])
@torch.no_grad()
def test_one_pass_attention_reads_quantized_post_rope_kv(cfg, key_ref, value_ref, use_cache):
    model = llama()
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    reference = model(ids).logits
    probe = with_probe(model)
    install_kv_quant(model, cfg)
    projections = Projections(model)
    logits = model(ids, use_cache=use_cache).logits
    assert (logits - reference).abs().max() > 1e-3
    for idx in range(2):
        (_, key, value), = probe.layer(idx)
        torch.testing.assert_close(key, key_ref(projections.post_rope_keys(idx)), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(value, value_ref(projections.values[idx][-1]), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_keys_are_quantized_after_rope_not_before():
    model = llama()
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    probe = with_probe(model)
    install_kv_quant(model, KVCacheQuantConfig(keys=spec(granularity="token", **FP8)))
    projections = Projections(model)
    model(ids)
    (_, key, value), = probe.layer(0)
    post = projections.post_rope_keys(0)
    pre = projections.keys[0][-1]
    cos, sin = model.model.rotary_emb(pre, torch.arange(pre.shape[2])[None])
    rope_of_quantized = apply_rotary_pos_emb(pre, fp8_token_ref(pre), cos, sin)[1]

    def on_token_grid(x):
        scale = x.abs().amax(-1, keepdim=True) / 448
        return torch.isclose(fp8_ref(x, scale), x, rtol=1e-6, atol=0)

    torch.testing.assert_close(key, fp8_token_ref(post), rtol=1e-5, atol=1e-6)
    assert bool(on_token_grid(key).all())
    assert on_token_grid(rope_of_quantized).float().mean() < 0.7  # rotating a quantized key leaves the grid
    assert (key - rope_of_quantized).abs().max() > 1e-3
    torch.testing.assert_close(value, projections.values[0][-1])  # values not configured: untouched


@pytest.mark.parametrize("cfg", [FP8_TOKEN, KIVI4, KIVI8_NO_WINDOW, FP8_STATIC],
                         ids=["fp8_token", "kivi4_window3", "kivi8_channel", "fp8_static"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_generation_quantizes_and_matches_one_pass_scoring(cfg, padded, device):
    model = llama().to(device)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
    unquantized = greedy(model, ids, mask)
    calibration = [torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(4))]
    install_kv_quant(model, cfg, calibration_context(calibration))
    out = greedy(model, ids, mask)
    full_mask = torch.cat([mask, torch.ones_like(mask[:, :1]).expand(2, 12)], 1)
    one_pass = model(out.sequences, attention_mask=full_mask, position_ids=generate_positions(full_mask)).logits
    incremental = torch.stack(out.logits, 1)
    torch.testing.assert_close(incremental, one_pass[:, 6:-1], rtol=0, atol=2e-4)
    assert torch.equal(one_pass[:, 6:-1].argmax(-1), out.sequences[:, 7:])
    assert (incremental - torch.stack(unquantized.logits, 1)).abs().max() > 1e-2  # quantization took effect


@pytest.mark.parametrize("cfg", [
    KIVI4,
    KVCacheQuantConfig(keys=spec(format="int", bits=8, granularity="head"),
                       values=spec(format="fp8_e4m3", granularity="tensor")),
], ids=["kivi4", "dynamic_head_and_tensor"])
@torch.no_grad()
def test_left_padding_does_not_change_a_sequences_quantization(cfg):
    """Groups follow real positions (position_ids) and padding stays out of dynamic statistics, so a
    left-padded sequence is quantized exactly as it is alone (lm-eval batching changes nothing)."""
    model = llama()
    gen = torch.Generator().manual_seed(13)
    seq, other = torch.randint(0, VOCAB, (1, 7), generator=gen), torch.randint(0, VOCAB, (1, 10), generator=gen)
    batch = torch.cat([torch.cat([torch.randint(0, VOCAB, (1, 3), generator=gen), seq], 1), other])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    install_kv_quant(model, cfg)
    alone = torch.stack(greedy(model, seq, torch.ones_like(seq)).logits, 1)[0]
    padded = torch.stack(greedy(model, batch, mask).logits, 1)[0]
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-4)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_one_pass_recent_window_and_incomplete_group_stay_full_precision(attn):
    model = llama(attn=attn)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(5))
    inputs = {}
    model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda _m, args: inputs.update(o=args[0]))
    projections = Projections(model)
    model(ids)
    k_pre, v = projections.keys[0][-1], projections.values[0][-1]
    install_kv_quant(model, KIVI4)
    model(ids)
    projections.remove()
    attn_module = model.model.layers[0].self_attn
    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    q_pre = attn_module.q_proj(hidden).view(2, 13, -1, 16).transpose(1, 2)
    cos, sin = model.model.rotary_emb(k_pre, torch.arange(13)[None])
    q, k = apply_rotary_pos_emb(q_pre, k_pre, cos, sin)
    k_quant, v_quant = kivi_keys_ref(k, 4, 4, symmetric=False), int_asym_ref(v, 4, -1)
    expected = attention_reference(q, k, v, k_quant, v_quant, attn_module.scaling, residual=3, group=4)
    torch.testing.assert_close(inputs["o"], expected.transpose(1, 2).reshape(2, 13, -1), rtol=1e-4, atol=1e-5)
    without_window = attention_reference(q, k, v, k_quant, v_quant, attn_module.scaling, residual=0, group=1)
    assert (inputs["o"] - without_window.transpose(1, 2).reshape(2, 13, -1)).abs().max() > 1e-3


@torch.no_grad()
def test_generation_step_reads_recent_tokens_in_full_precision():
    model = llama()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(6))
    probe = with_probe(model)
    install_kv_quant(model, KIVI4)
    out = greedy(model, ids, torch.ones_like(ids), new_tokens=8)
    _, key, value = [c for c in probe.layer(0) if c[0].shape[2] == 1][-1]
    length = key.shape[2]  # 14 tokens: groups 0-3, 4-7, 8-11 complete, 12-13 incomplete
    cached_k = out.past_key_values.layers[0].keys[:, :, :length]
    cached_v = out.past_key_values.layers[0].values[:, :, :length]
    recent = slice(length - 3, length)
    torch.testing.assert_close(key[:, :, recent], cached_k[:, :, recent], rtol=0, atol=0)
    torch.testing.assert_close(value[:, :, recent], cached_v[:, :, recent], rtol=0, atol=0)
    torch.testing.assert_close(key[:, :, :11], kivi_keys_ref(cached_k, 4, 4, False)[:, :, :11], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(value[:, :, :11], int_asym_ref(cached_v, 4, -1)[:, :, :11], rtol=1e-5, atol=1e-6)
    assert (key[:, :, :11] - cached_k[:, :, :11]).abs().max() > 1e-3


@torch.no_grad()
def test_static_scales_are_calibrated_and_used():
    model = llama()
    batches = [torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(s)) for s in (7, 8)]
    projections = Projections(model)
    for batch in batches:
        model(batch, use_cache=False)
    key_amax = [max(float(projections.post_rope_keys(i, c).abs().max()) for c in range(2)) for i in range(2)]
    value_amax = [torch.stack([projections.values[i][c].abs().amax((0, 2, 3)) for c in range(2)]).amax(0)
                  for i in range(2)]
    projections.remove()
    probe = with_probe(model)
    install_kv_quant(model, FP8_STATIC, calibration_context(batches))
    states = list(kv_layer_states(model).values())
    for i, state in enumerate(states):
        torch.testing.assert_close(state.key_scale, torch.tensor(key_amax[i] / 448), rtol=1e-6, atol=0)
        torch.testing.assert_close(state.value_scale, value_amax[i] / 448, rtol=1e-6, atol=0)
    probe.calls.clear()
    projections = Projections(model)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(9))
    model(ids)
    (_, key, value), = probe.layer(0)
    post = projections.post_rope_keys(0)
    torch.testing.assert_close(key, fp8_ref(post, states[0].key_scale), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(value, fp8_ref(projections.values[0][-1], states[0].value_scale.view(1, -1, 1, 1)),
                               rtol=1e-5, atol=1e-6)
    assert not torch.allclose(key, fp8_ref(post, post.abs().max() / 448), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_gemma3_sliding_window_layers_quantize_consistently():
    model = tiny_gemma3()
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    reference = model(ids, attention_mask=mask).logits
    unquantized = greedy(model, ids, mask, new_tokens=10)
    probe = with_probe(model)
    cfg = KVCacheQuantConfig(keys=spec(granularity="token", **FP8),
                             values=spec(format="int", bits=4, symmetric=False, granularity="token"),
                             residual_length=2)
    install_kv_quant(model, cfg)
    with kv_quant_mode(model, "off"):
        assert torch.equal(model(ids, attention_mask=mask).logits, reference)
    out = greedy(model, ids, mask, new_tokens=10)
    full_mask = torch.cat([mask, torch.ones(2, 10, dtype=mask.dtype)], 1)
    one_pass = model(out.sequences, attention_mask=full_mask, position_ids=generate_positions(full_mask)).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), one_pass[:, 5:-1], rtol=0, atol=2e-4)
    assert torch.equal(one_pass[:, 5:-1].argmax(-1), out.sequences[:, 6:])
    assert (torch.stack(out.logits, 1) - torch.stack(unquantized.logits, 1)).abs().max() > 1e-2
    sliding_steps = [k.shape[2] for q, k, _ in probe.layer(0) if q.shape[2] == 1]
    assert max(sliding_steps) == 4  # the sliding layer's cache really dropped old tokens


@pytest.mark.parametrize("cfg, message", [
    (KVCacheQuantConfig(), "neither keys nor values"),
    (KVCacheQuantConfig(values=spec(format="int", bits=4, granularity="channel")), "values are per token"),
    (KVCacheQuantConfig(keys=spec(format="fp8_e4m3", granularity="token", dynamic=False)), "per tensor or per head"),
    (KVCacheQuantConfig(keys=spec(format="int", bits=8, symmetric=False, granularity="tensor", dynamic=False)),
     "symmetric"),
    (KVCacheQuantConfig(keys=spec(format="int", bits=4, granularity="group", group_size=16)), "granularity"),
    (KVCacheQuantConfig(keys=spec(format="nvfp4", granularity="group", group_size=16)), "supports"),
    (KVCacheQuantConfig(keys=spec(format="int", bits=4, granularity="channel"), group_tokens=0), "group_tokens"),
    (KVCacheQuantConfig(keys=spec(format="fp8_e4m3", symmetric=False, granularity="token")), "asymmetric"),
])
def test_nonsensical_kv_schemes_are_refused(cfg, message):
    with pytest.raises(SchemeError, match=message):
        validate_kv_cache(cfg)


def test_static_scheme_without_calibration_data_and_unwrappable_attention_are_refused():
    model = llama()
    with pytest.raises(SchemeError, match="calibration"):
        install_kv_quant(model, FP8_STATIC, None)
    model.config._attn_implementation_internal = "flex_attention"
    with pytest.raises(SchemeError, match="sdpa"):
        install_kv_quant(model, FP8_TOKEN)


@pytest.mark.slow
@pytest.mark.parametrize("overrides, keys_format, weights", [
    (["quant=kv8"], "fp8_e4m3", None),
    (["quant=kv4"], "int", None),
    (["quant=int4_g128_kv8"], "fp8_e4m3", 128),
    (["quant=int4_g128", "+quant/kv_cache=fp8"], "fp8_e4m3", 128),
    (["quant=int8", "+quant/kv_cache=fp8_dynamic"], "fp8_e4m3", None),
    (["quant=int4_g128", "+quant/kv_cache=int4"], "int", 128),
])
def test_presets_and_kv_cache_override_compose(overrides, keys_format, weights):
    scheme = OmegaConf.to_object(compose(overrides).quant)
    validate_kv_cache(scheme.kv_cache)
    assert scheme.kv_cache.keys.format == keys_format
    if weights is not None:
        assert scheme.weights.group_size == weights and scheme.weights.bits == 4


@torch.no_grad()
def test_apply_composes_weight_scheme_with_kv_cache():
    scheme = OmegaConf.to_object(compose(["quant=int4_g128_kv8", "quant.weights.group_size=32"]).quant)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(11))
    context = calibration_context([torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(12))])
    weight_only = llama()
    weight_only_scheme = OmegaConf.to_object(compose(["quant=int4_g128", "quant.weights.group_size=32"]).quant)
    apply(weight_only, weight_only_scheme, context)
    model = llama()
    original = model.model.layers[0].self_attn.q_proj.weight.clone()
    report = apply(model, scheme, context)
    assert report.layers and not torch.equal(model.model.layers[0].self_attn.q_proj.weight, original)
    assert all(s.key_scale is not None for s in kv_layer_states(model).values())
    quantized = model(ids).logits
    assert (quantized - weight_only(ids).logits).abs().max() > 1e-3
    with kv_quant_mode(model, "off"):
        assert torch.equal(model(ids).logits, weight_only(ids).logits)


@torch.no_grad()
def test_bfloat16_model_keeps_its_dtype_and_stays_finite():
    model = llama().to(torch.bfloat16)
    probe = with_probe(model)
    install_kv_quant(model, KIVI4)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(14))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    logits = model(ids, attention_mask=mask).logits
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())
    assert all(k.dtype == torch.bfloat16 and v.dtype == torch.bfloat16 for _, _, k, v in probe.calls)
    assert greedy(model, ids, mask, new_tokens=3).sequences.shape == (2, 16)
