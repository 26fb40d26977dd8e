"""KV-cache quantization, simulated inside the attention call (keys after RoPE).

``install_kv_quant(model, cfg, context)`` registers a wrapper around the model's current attention
implementation (sdpa, eager, or another mask-taking one) in transformers' ``AttentionInterface`` and
selects it with ``model.set_attn_implementation``. The wrapper receives the post-RoPE keys and the
values on every path: one-pass scoring (with or without ``use_cache``) and each generation step, where
it sees the whole cached K/V. The cache itself keeps full precision; the wrapper quantizes what
attention reads, which is numerically what a quantized cache would return.

Consistency between one-pass scoring and incremental generation. Generation re-reads (and so
re-quantizes) old tokens at every step, so a token's quantized value must not depend on when it is
read. The design guarantees that for every scheme except dynamic ``tensor``/``head`` scales:

- ``token`` (FP8 per-token-per-head, KIVI values): each token's scale comes from its own head vector.
- ``channel`` (KIVI keys): one scale per channel and per group of ``group_tokens`` tokens, groups aligned
  to absolute positions (from ``position_ids``, so left padding does not shift them). A group is used
  quantized only by queries at or after its last token; before that it is full precision (KIVI's
  incomplete trailing group), so its scale always comes from the same, complete set of tokens.
- ``residual_length`` R: a query at position p reads keys/values at positions s with p - s < R in full
  precision. In one pass different queries need different versions of the same key, so the wrapper
  calls the base attention on concatenated copies [quantized | full precision] with a mask that
  admits each (query, key) pair in exactly one copy — the same softmax as generation computes.
- static (calibrated) ``tensor``/``head`` scales: fixed per layer.

Agreement is exact in exact arithmetic, not bit for bit: one-pass and incremental K/V differ by float
rounding (different matmul shapes), and a value near a rounding boundary can land on the neighbouring
grid point. On SmolLM2-135M with FP8 KV, greedy tokens agreed while logits differed by up to 0.3 in
float32; in float64 the difference fell to 2e-6, the unquantized model's own level.

Dynamic ``tensor``/``head`` scales are computed per call from the keys attention may read (keys that no
query may attend to, i.e. padding, are left out); during generation that means the whole cache is
re-quantized each step with a scale over all tokens so far, which one-pass scoring cannot reproduce
exactly. Limitation: on sliding-window layers a cache window can cut a ``channel`` key group; that
group's scale then differs between the two paths (token and static schemes are unaffected).
Static caches (``StaticCache``) are not supported: positions assume keys end at the last query.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

import torch
from torch import Tensor, nn

from harness.config import KVCacheQuantConfig, TensorQuantConfig
from harness.quant.format_table import FORMATS, SchemeError, get_format, validate_spec

__all__ = ["KVLayerState", "calibrate_kv_scales", "fake_quantize_kv", "full_precision_masks", "install_kv_quant",
           "kv_formats", "kv_layer_states", "kv_quant_mode", "remove_kv_quant", "validate_kv_cache"]

KEY_GRANULARITIES = ("tensor", "head", "token", "channel")
VALUE_GRANULARITIES = ("tensor", "head", "token")
STATIC_GRANULARITIES = ("tensor", "head")
WRAPPER_PREFIX = "harness_kvquant_"
_STATE_ATTR = "harness_kv_state"
_UNWRAPPABLE = ("flash", "flex", "paged", "sdpa_paged")
Mode = Literal["quantize", "observe", "off"]


def validate_kv_cache(cfg: KVCacheQuantConfig) -> None:
    """Refuse KV-cache schemes that make no sense, naming the value and the fix."""
    if cfg.keys is None and cfg.values is None:
        raise SchemeError("quant.kv_cache sets neither keys nor values; set one or remove kv_cache")
    if cfg.residual_length < 0:
        raise SchemeError(f"quant.kv_cache.residual_length={cfg.residual_length} must be >= 0")
    for role, spec, allowed in (("keys", cfg.keys, KEY_GRANULARITIES), ("values", cfg.values, VALUE_GRANULARITIES)):
        if spec is None:
            continue
        where = f"quant.kv_cache.{role}"
        validate_spec(spec, role)
        if not get_format(spec.format).scaled:
            raise SchemeError(f"{where}.format={spec.format!r}: the KV cache supports {kv_formats()} (formats "
                              "that round onto a given scale)")
        if spec.granularity not in allowed:
            hint = " (per-channel KIVI grouping is for keys; values are per token)" if role == "values" else ""
            raise SchemeError(f"{where}.granularity={spec.granularity!r}: use one of {list(allowed)}{hint}")
        if not spec.dynamic and spec.granularity not in STATIC_GRANULARITIES:
            raise SchemeError(f"{where}: a calibrated (dynamic: false) scale is per tensor or per head, not "
                              f"per {spec.granularity}; set granularity: tensor|head or dynamic: true")
        if not spec.dynamic and not spec.symmetric:
            raise SchemeError(f"{where}: calibrated {spec.format} scales are symmetric (amax/qmax); set symmetric: true")
    if cfg.keys is not None and cfg.keys.granularity == "channel" and cfg.group_tokens <= 0:
        raise SchemeError(f"quant.kv_cache.group_tokens={cfg.group_tokens} must be positive for per-channel keys")


def kv_formats() -> list[str]:
    """Registered formats the KV cache can use: those that round onto a given scale."""
    return sorted(name for name, fmt in FORMATS.items() if fmt.scaled)


def _apply_scale(x: Tensor, spec: TensorQuantConfig, scale: Tensor, zero: Tensor | None = None) -> Tensor:
    """Round ``x`` onto the grid of broadcastable ``scale`` (and integer ``zero``) and dequantize."""
    return get_format(spec.format).round(x, spec, scale, zero)


def _reduced_qparams(x: Tensor, spec: TensorQuantConfig, dims: tuple[int, ...]) -> tuple[Tensor, Tensor | None]:
    """Scale (and zero) over ``dims``; NaN elements of ``x`` are ignored (used to mask padding out)."""
    return get_format(spec.format).qparams(x, spec, dims, False)


def _grouped_channel(x: Tensor, spec: TensorQuantConfig, positions: Tensor, valid: Tensor,
                     group_tokens: int) -> Tensor:
    """KIVI keys: one scale per (batch, head, channel) and per group of tokens aligned to positions."""
    batch, heads, length, dim = x.shape
    xf = x.float()
    groups = torch.div(positions, group_tokens, rounding_mode="floor")
    groups = groups - groups[:, :1]
    index = groups[:, None, :, None].expand(batch, heads, length, dim)
    n_groups = int(groups.max()) + 1
    usable = torch.isfinite(xf) & valid[:, None, :, None]
    hi = torch.full((batch, heads, n_groups, dim), float("-inf"), device=x.device)
    lo = torch.full((batch, heads, n_groups, dim), float("inf"), device=x.device)
    hi = hi.scatter_reduce(2, index, torch.where(usable, xf, float("-inf")), "amax")
    lo = lo.scatter_reduce(2, index, torch.where(usable, xf, float("inf")), "amin")
    scale, zero = _reduced_qparams(torch.stack([lo, hi], dim=-2), spec, (-2,))  # [B, H, G, 1, D]
    scale = scale.squeeze(-2).gather(2, index)
    zero = None if zero is None else zero.squeeze(-2).gather(2, index)
    return _apply_scale(xf, spec, scale, zero).to(x.dtype)


def fake_quantize_kv(x: Tensor, spec: TensorQuantConfig, *, positions: Tensor | None = None,
                     valid: Tensor | None = None, group_tokens: int = 32,
                     static_scale: Tensor | None = None) -> Tensor:
    """Quantize then dequantize keys or values ``[batch, kv_heads, tokens, head_dim]`` as ``spec`` says.

    ``positions`` ``[batch, tokens]``: absolute positions (channel groups are aligned to them; default
    0..T-1). ``valid`` ``[batch, tokens]``: tokens that enter dynamic tensor/head/channel statistics
    (default all). ``static_scale``: calibrated scale, a scalar or one per kv head. Scales and rounding
    come from the format's entry (``harness.quant.format_table``) with ``include_zero=False``: INT grids use
    KIVI's min/max (no widening to 0); FP8 is ``fp8_cast(x / scale) * scale`` with ``scale = amax / fmt_max``.
    """
    batch, _, length, _ = x.shape
    if static_scale is not None:
        scale = static_scale.to(device=x.device, dtype=torch.float32)
        return _apply_scale(x.float(), spec, scale.reshape(1, -1, 1, 1) if scale.ndim else scale).to(x.dtype)
    if spec.granularity == "token":
        return get_format(spec.format).quantize(x, spec, "token", False)
    if valid is None:
        valid = torch.ones(batch, length, dtype=torch.bool, device=x.device)
    if spec.granularity == "channel":
        if positions is None:
            positions = torch.arange(length, device=x.device).expand(batch, length)
        return _grouped_channel(x, spec, positions, valid, group_tokens)
    dims = (2, 3) if spec.granularity == "head" else (1, 2, 3)
    masked = torch.where(valid[:, None, :, None], x.float(), float("nan"))
    scale, zero = _reduced_qparams(masked, spec, dims)
    return _apply_scale(x.float(), spec, scale, zero).to(x.dtype)


def full_precision_masks(positions: Tensor, query_len: int, cfg: KVCacheQuantConfig, *, start: int = 0,
                         stop: int | None = None) -> tuple[Tensor | None, Tensor | None]:
    """Which (query, key) pairs read the key / the value in full precision: ``[batch, queries, keys]``.

    Queries are the last ``query_len`` positions (only ``start:stop`` of them when given, so a long
    prefill builds these masks one chunk of queries at a time). A pair is full precision when the key
    is among the query's ``residual_length`` most recent tokens, and for per-channel keys also when
    the key's group is not complete at the query's position. None: every pair reads the quantized tensor.
    """
    query_pos = positions[:, positions.shape[1] - query_len:][:, start:stop]
    distance = query_pos[:, :, None] - positions[:, None, :]
    recent = distance < cfg.residual_length if cfg.residual_length > 0 else None
    key_fp = recent
    if cfg.keys is not None and cfg.keys.granularity == "channel":
        group_end = (torch.div(positions, cfg.group_tokens, rounding_mode="floor") + 1) * cfg.group_tokens - 1
        incomplete = group_end[:, None, :] > query_pos[:, :, None]
        key_fp = incomplete if recent is None else recent | incomplete
    return (key_fp if cfg.keys is not None else None), (recent if cfg.values is not None else None)


@dataclass
class KVLayerState:
    """What one attention layer's wrapper needs: the scheme, static scales, the observed maxima."""

    cfg: KVCacheQuantConfig
    name: str
    mode: Mode = "quantize"
    key_scale: Tensor | None = None  # calibrated: [] (tensor) or [kv_heads] (head)
    value_scale: Tensor | None = None
    observed: dict[str, Tensor] = field(default_factory=dict)  # role -> running amax per kv head

    def observe(self, key: Tensor, value: Tensor, valid: Tensor) -> None:
        for role, x in (("keys", key), ("values", value)):
            usable = torch.isfinite(x) & valid[:, None, :, None]
            amax = torch.where(usable, x.float().abs(), 0.0).amax(dim=(0, 2, 3)).detach()
            previous = self.observed.get(role)
            self.observed[role] = amax if previous is None else torch.maximum(previous, amax.to(previous.device))

    def quantize(self, role: str, x: Tensor, positions: Tensor, valid: Tensor) -> Tensor:
        spec = getattr(self.cfg, role)
        if spec is None:
            return x
        static = self.key_scale if role == "keys" else self.value_scale
        if not spec.dynamic and static is None:
            raise SchemeError(f"{self.name}: quant.kv_cache.{role} is static but was never calibrated")
        return fake_quantize_kv(x, spec, positions=positions, valid=valid, group_tokens=self.cfg.group_tokens,
                                static_scale=None if spec.dynamic else static)


# ------------------------------------------------------------------------------- attention wrapper
def _base_attention(base_name: str, module: nn.Module) -> Callable[..., tuple[Tensor, Tensor | None]]:
    from transformers import AttentionInterface

    if base_name == "eager":  # each model family defines its own eager function next to its attention
        return getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    return AttentionInterface._global_mapping[base_name]


def _allowed_pairs(mask: Tensor | None, module: nn.Module, batch: int, q_len: int, k_len: int,
                   device: torch.device, *, start: int = 0, stop: int | None = None) -> Tensor:
    """Boolean ``[batch, queries, keys]``: which pairs the base attention lets through (queries
    ``start:stop`` of the ``q_len`` when given)."""
    stop = q_len if stop is None else stop
    if mask is None:
        if not getattr(module, "is_causal", True):
            return torch.ones(batch, stop - start, k_len, dtype=torch.bool, device=device)
        query_pos = torch.arange(k_len - q_len + start, k_len - q_len + stop, device=device)
        return (torch.arange(k_len, device=device)[None, :] <= query_pos[:, None]).expand(batch, stop - start, k_len)
    if mask.shape[-1] != k_len or mask.shape[-2] != q_len:
        raise SchemeError(f"attention mask {tuple(mask.shape)} does not match {q_len} queries x {k_len} keys; "
                          "KV-cache quantization supports dynamic caches only (not StaticCache)")
    rows = mask[..., start:stop, :]
    allowed = rows if rows.dtype == torch.bool else rows > torch.finfo(rows.dtype).min / 2
    return allowed.any(dim=1).expand(batch, stop - start, k_len) if allowed.ndim == 4 else allowed


def _query_chunk(k_len: int) -> int:
    """Queries per chunk of a multi-query pass: ~2M (query, key) pairs per batch row, at least 64."""
    return max(64, 2 ** 21 // max(k_len, 1))


def _valid_keys(mask: Tensor | None, module: nn.Module, batch: int, q_len: int, k_len: int,
                device: torch.device) -> Tensor:
    """``[batch, keys]``: keys some query may read (padding stays out of statistics), chunk by chunk."""
    valid = torch.zeros(batch, k_len, dtype=torch.bool, device=device)
    for start in range(0, q_len, _query_chunk(k_len)):
        stop = min(start + _query_chunk(k_len), q_len)
        valid |= _allowed_pairs(mask, module, batch, q_len, k_len, device, start=start, stop=stop).any(dim=1)
    return valid


def _key_positions(position_ids: Tensor | None, batch: int, k_len: int, device: torch.device) -> Tensor:
    """Absolute positions ``[batch, keys]``: keys are contiguous and end at the last query."""
    steps = torch.arange(k_len, device=device)
    if position_ids is None:
        return steps.expand(batch, k_len)
    last = position_ids[:, -1:].to(device=device, dtype=torch.long)
    return (last - (k_len - 1) + steps[None, :]).expand(batch, k_len)


def _attend_mixed(base: Callable, module: nn.Module, query: Tensor,
                  copies: Callable[[int, int], list[tuple[Tensor, Tensor, Tensor]]],
                  mask: Tensor | None, float_mask: bool, kwargs: dict[str, Any], k_len: int) -> Tensor:
    """Attention over concatenated (keys, values, pair selection) copies; each pair is admitted once.

    ``copies(start, stop)`` gives the copies with their selections for queries ``start:stop`` only,
    so the ``[batch, queries, keys]`` masks of a long prefill never exist whole: temporary memory is
    bounded by the chunk (~2M pairs per batch row), not by queries × keys.
    """
    q_len = query.shape[2]
    chunk = _query_chunk(k_len)
    outputs = []
    for start in range(0, q_len, chunk):
        stop = min(start + chunk, q_len)
        keys, values, masks = [], [], []
        for key, value, sel in copies(start, stop):
            columns = sel.any(dim=(0, 1)).nonzero()
            if columns.numel() == 0:
                continue
            lo, hi = int(columns[0]), int(columns[-1]) + 1
            sel = sel[:, None, :, lo:hi]
            keys.append(key[:, :, lo:hi])
            values.append(value[:, :, lo:hi])
            if float_mask:
                base_mask = mask[..., start:stop, lo:hi] if mask is not None else torch.zeros((), dtype=query.dtype,
                                                                                             device=query.device)
                masks.append(torch.where(sel, base_mask, torch.finfo(query.dtype).min))
            else:
                masks.append(sel if mask is None else sel & mask[..., start:stop, lo:hi])
        out, _ = base(module, query[:, :, start:stop], torch.cat(keys, 2), torch.cat(values, 2),
                      torch.cat(masks, -1), **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1)


def _make_wrapper(base_name: str, float_mask: bool) -> Callable[..., tuple[Tensor, Tensor | None]]:
    def kv_quant_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | None, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        base = _base_attention(base_name, module)
        state: KVLayerState | None = getattr(module, _STATE_ATTR, None)
        if state is None or state.mode == "off":
            return base(module, query, key, value, attention_mask, **kwargs)
        batch, _, k_len, _ = key.shape
        q_len = query.shape[2]
        valid = _valid_keys(attention_mask, module, batch, q_len, k_len, key.device)
        if state.mode == "observe":
            state.observe(key, value, valid)
            return base(module, query, key, value, attention_mask, **kwargs)
        positions = _key_positions(kwargs.get("position_ids"), batch, k_len, key.device)
        key_q = state.quantize("keys", key, positions, valid)
        value_q = state.quantize("values", value, positions, valid)
        cfg = state.cfg
        has_key_fp = cfg.keys is not None and (cfg.residual_length > 0 or cfg.keys.granularity == "channel")
        has_value_fp = cfg.values is not None and cfg.residual_length > 0
        if not has_key_fp and not has_value_fp:
            return base(module, query, key_q, value_q, attention_mask, **kwargs)
        if q_len == 1:  # one query: each key has one version, no copies needed
            key_fp, value_fp = full_precision_masks(positions, q_len, cfg)
            if key_fp is not None:
                key_q = torch.where(key_fp[:, None, 0, :, None], key, key_q)
            if value_fp is not None:
                value_q = torch.where(value_fp[:, None, 0, :, None], value, value_q)
            return base(module, query, key_q, value_q, attention_mask, **kwargs)

        def copies(start: int, stop: int) -> list[tuple[Tensor, Tensor, Tensor]]:
            allowed = _allowed_pairs(attention_mask, module, batch, q_len, k_len, key.device, start=start, stop=stop)
            key_fp, value_fp = full_precision_masks(positions, q_len, cfg, start=start, stop=stop)
            out = []
            for key_full in ((False, True) if key_fp is not None else (False,)):
                for value_full in ((False, True) if value_fp is not None else (False,)):
                    select = allowed if attention_mask is None else torch.ones_like(allowed)
                    if key_fp is not None:
                        select = select & (key_fp == key_full)
                    if value_fp is not None:
                        select = select & (value_fp == value_full)
                    out.append((key if key_full else key_q, value if value_full else value_q, select))
            return out

        return _attend_mixed(base, module, query, copies, attention_mask, float_mask, kwargs, k_len), None

    kv_quant_attention.__name__ = f"{WRAPPER_PREFIX}{base_name}"
    return kv_quant_attention


# -------------------------------------------------------------------------------------- install
def _attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "k_proj") and hasattr(m, "v_proj") and hasattr(m, "layer_idx")}


def _current_base(model: nn.Module) -> str:
    current = getattr(model.config, "_attn_implementation", None) or "eager"
    return current[len(WRAPPER_PREFIX):] if current.startswith(WRAPPER_PREFIX) else current


def _register_wrapper(base_name: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
        eager_mask,
    )

    if base_name.startswith(_UNWRAPPABLE) or (base_name != "eager" and base_name not in
                                              AttentionInterface._global_mapping):
        raise SchemeError(f"KV-cache quantization wraps sdpa, eager or a registered mask-taking attention; the "
                          f"model uses {base_name!r}. Load it with attn_implementation='sdpa' (or 'eager')")
    if base_name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        raise SchemeError(f"attention {base_name!r} has no mask function in AttentionMaskInterface; without one "
                          "transformers would drop the padding mask. Register it or use sdpa/eager")
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[base_name]
    name = f"{WRAPPER_PREFIX}{base_name}"
    AttentionInterface.register(name, _make_wrapper(base_name, float_mask=mask_fn is eager_mask))
    AttentionMaskInterface.register(name, mask_fn)  # else transformers builds no mask: padding would be lost
    return name


def install_kv_quant(model: nn.Module, cfg: KVCacheQuantConfig, context: Any = None) -> None:
    """Quantize ``model``'s KV cache as ``cfg`` says, from now on (calibrating static scales first).

    ``context`` must provide ``calibration_batches()`` (token id batches) when a spec is static.
    Installing again replaces the previous scheme. Undo with :func:`remove_kv_quant`.
    """
    validate_kv_cache(cfg)
    modules = _attention_modules(model)
    if not modules or not hasattr(model, "set_attn_implementation"):
        raise SchemeError(f"{type(model).__name__} has no attention layers with k_proj/v_proj that use "
                          "transformers' AttentionInterface; KV-cache quantization cannot be installed")
    static = [role for role in ("keys", "values") if getattr(cfg, role) is not None and not getattr(cfg, role).dynamic]
    if static and (context is None or not hasattr(context, "calibration_batches")):
        raise SchemeError(f"quant.kv_cache.{static[0]} has dynamic: false: calibrated scales need calibration "
                          "data (a context with calibration_batches()); set dynamic: true or pass one")
    base_name = _current_base(model)
    model.set_attn_implementation(_register_wrapper(base_name))
    for name, module in modules.items():
        setattr(module, _STATE_ATTR, KVLayerState(cfg=cfg, name=name))
    if static:
        calibrate_kv_scales(model, context.calibration_batches())


def remove_kv_quant(model: nn.Module) -> None:
    """Restore the attention implementation that was wrapped and drop the per-layer states."""
    for module in _attention_modules(model).values():
        if hasattr(module, _STATE_ATTR):
            delattr(module, _STATE_ATTR)
    model.set_attn_implementation(_current_base(model))


def kv_layer_states(model: nn.Module) -> dict[str, KVLayerState]:
    """The installed per-layer states, by module name (empty when nothing is installed)."""
    return {name: getattr(m, _STATE_ATTR) for name, m in _attention_modules(model).items()
            if hasattr(m, _STATE_ATTR)}


@contextmanager
def kv_quant_mode(model: nn.Module, mode: Mode) -> Iterator[None]:
    """Temporarily run the wrappers as ``quantize``, ``observe`` (record maxima, no change) or ``off``."""
    states = kv_layer_states(model)
    previous = {name: s.mode for name, s in states.items()}
    for state in states.values():
        state.mode = mode
    try:
        yield
    finally:
        for name, state in states.items():
            state.mode = previous[name]


@torch.no_grad()
def calibrate_kv_scales(model: nn.Module, batches: list[Tensor]) -> None:
    """Static scales amax / fmt_max of the post-RoPE keys and the values, per layer (tensor) or kv head.

    One forward pass over the calibration batches with the KV cache unquantized (weights as they are:
    apply() quantizes weights first), as llm-compressor's KV-cache observers do for vLLM.
    """
    states = kv_layer_states(model)
    if not batches:
        raise SchemeError("calibration produced no batches; raise quant.calibration.num_samples")
    device = next(model.parameters()).device
    for state in states.values():
        state.observed.clear()
    with kv_quant_mode(model, "observe"):
        for batch in batches:
            model(input_ids=batch.to(device), use_cache=False, logits_to_keep=1)
    for state in states.values():
        for role in ("keys", "values"):
            spec = getattr(state.cfg, role)
            if spec is None or spec.dynamic:
                continue
            amax = state.observed[role]
            amax = amax.amax() if spec.granularity == "tensor" else amax
            scale = torch.where(amax > 0, amax / get_format(spec.format).max(spec), torch.ones_like(amax))
            setattr(state, "key_scale" if role == "keys" else "value_scale", scale)
