"""Token-level divergence summaries of a quantized model against its reference.

The numbers follow llama.cpp's ``llama-perplexity --kl-divergence`` report, computed from
per-token arrays over the scored tokens (both models scored on the same tokens):

``nll_ref``/``nll_quant``  negative log-likelihood of the actual next token (nats)
``kl``/``kl_reverse``      KL(ref || quant) and optionally KL(quant || ref) per token
``top1_ref``/``top1_quant`` argmax token ids
``p_ref``/``p_quant``      probability each model gives the actual next token

Standard errors are those of a mean of per-token values, ``sd(ddof=1) / sqrt(n)``; tokens
are treated as independent (they are not quite: neighbouring tokens correlate, so these
SEs are optimistic, as llama.cpp's are). The PPL ratio's SE is paired: it is the SE of the
mean of d = nll_quant - nll_ref, i.e. it uses var(ref) + var(quant) - 2 cov(ref, quant),
carried through exp() by the delta method. Percentiles are numpy's "linear" quantiles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike


# Columns of the other token kinds beside a slice's headline (``kl_mean`` etc.), ``{kind}`` = plain / prompt, or a
# thinking reply's trace / answer (harness.evaluation.thinking.kl_split_metrics)
SIDE_COLUMNS = {"n_tokens": "n_tokens_{kind}", "kl_mean": "kl_{kind}_mean", "kl_se": "kl_{kind}_se",
                "kl_p99": "kl_{kind}_p99", "top1_agree": "top1_agree_{kind}", "ln_ppl_ratio": "ln_ppl_ratio_{kind}",
                "ppl_ratio": "ppl_ratio_{kind}"}

__all__ = ["PERCENTILES", "TOKEN_COLUMNS", "position_buckets", "summarize_by", "summarize_divergence"]

PERCENTILES: tuple[float, ...] = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
TOKEN_COLUMNS: tuple[str, ...] = ("nll_ref", "nll_quant", "kl", "top1_ref", "top1_quant", "p_ref", "p_quant")


def _percentile_key(q: float) -> str:
    """99.9 -> 'p99_9', 50.0 -> 'p50', 0.1 -> 'p0_1'."""
    return "p" + f"{q:g}".replace(".", "_")


def _mean_se(values: np.ndarray) -> float:
    """SE of the mean; NaN for a single token (no spread to estimate)."""
    if values.size < 2:
        return math.nan
    return float(np.std(values, ddof=1) / math.sqrt(values.size))


def _spread(values: np.ndarray, name: str) -> dict[str, float]:
    """max, min and the PERCENTILES of ``values``, keyed ``{name}_max`` etc."""
    out = {f"{name}_max": float(values.max()), f"{name}_min": float(values.min())}
    for q, value in zip(PERCENTILES, np.percentile(values, PERCENTILES)):
        out[f"{name}_{_percentile_key(q)}"] = float(value)
    return out


def _as_tokens(values: ArrayLike, name: str, n: int | None, *, probability: bool = False) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one value per scored token), got shape {array.shape}")
    if n is not None and array.size != n:
        raise ValueError(f"{name} has {array.size} tokens but nll_ref has {n}: pass arrays over the same tokens")
    if array.dtype.kind == "f" or probability:
        array = array.astype(float)
        bad = ~np.isfinite(array)
        if probability:
            bad |= (array < 0) | (array > 1)
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            expected = "a probability in [0, 1]" if probability else "finite"
            raise ValueError(f"{name}[{first}] = {float(array[first])!r} is not {expected}; check the scoring step")
    return array


def summarize_divergence(
    nll_ref: ArrayLike,
    nll_quant: ArrayLike,
    kl: ArrayLike,
    top1_ref: ArrayLike,
    top1_quant: ArrayLike,
    p_ref: ArrayLike,
    p_quant: ArrayLike,
    kl_reverse: ArrayLike | None = None,
) -> dict[str, float]:
    """Flat llama.cpp-style summary: PPLs and their paired ratio, KL, top-1 agreement, Δp.

    Keys: n_tokens; ppl_ref, ppl_ref_se, ppl_quant, ppl_quant_se; ln_ppl_ratio,
    ln_ppl_ratio_se, ppl_ratio, ppl_ratio_se; kl_mean, kl_se, kl_max, kl_min,
    kl_p99_9 … kl_p0_1; kl_reverse_mean, kl_reverse_se (only with ``kl_reverse``);
    top1_agree, top1_agree_se (binomial sqrt(p(1-p)/n)); dp_mean, dp_se, dp_rms, dp_max,
    dp_min, dp_p99_9 … dp_p0_1 where dp = p_quant - p_ref.
    """
    nll_r = _as_tokens(nll_ref, "nll_ref", None).astype(float)
    n = nll_r.size
    if n == 0:
        raise ValueError("no scored tokens: the arrays are empty")
    nll_q = _as_tokens(nll_quant, "nll_quant", n).astype(float)
    kl_forward = _as_tokens(kl, "kl", n).astype(float)
    top1_r = _as_tokens(top1_ref, "top1_ref", n)
    top1_q = _as_tokens(top1_quant, "top1_quant", n)
    prob_r = _as_tokens(p_ref, "p_ref", n, probability=True)
    prob_q = _as_tokens(p_quant, "p_quant", n, probability=True)

    out: dict[str, float] = {"n_tokens": n}
    for name, nll in (("ref", nll_r), ("quant", nll_q)):
        ppl = math.exp(nll.mean())
        out[f"ppl_{name}"] = ppl
        out[f"ppl_{name}_se"] = ppl * _mean_se(nll)  # d exp(m)/dm = exp(m)
    log_ratio_per_token = nll_q - nll_r
    out["ln_ppl_ratio"] = float(log_ratio_per_token.mean())
    out["ln_ppl_ratio_se"] = _mean_se(log_ratio_per_token)
    out["ppl_ratio"] = math.exp(out["ln_ppl_ratio"])
    out["ppl_ratio_se"] = out["ppl_ratio"] * out["ln_ppl_ratio_se"]

    out["kl_mean"] = float(kl_forward.mean())
    out["kl_se"] = _mean_se(kl_forward)
    out.update(_spread(kl_forward, "kl"))
    if kl_reverse is not None:
        kl_back = _as_tokens(kl_reverse, "kl_reverse", n).astype(float)
        out["kl_reverse_mean"] = float(kl_back.mean())
        out["kl_reverse_se"] = _mean_se(kl_back)

    agree = float(np.mean(top1_r == top1_q))
    out["top1_agree"] = agree
    out["top1_agree_se"] = math.sqrt(agree * (1 - agree) / n)

    dp = prob_q - prob_r
    out["dp_mean"] = float(dp.mean())
    out["dp_se"] = _mean_se(dp)
    out["dp_rms"] = float(np.sqrt(np.mean(dp**2)))
    out.update(_spread(dp, "dp"))
    return out


def position_buckets(positions: ArrayLike, edges: Sequence[float]) -> pd.Categorical:
    """Ordered labels ``"[e_i, e_i+1)"`` for token positions; the last bucket ``"[e_k, inf)"`` is open.

    ``edges`` must increase strictly and start at or below the smallest position, e.g.
    ``[0, 512, 1024, 2048, 4096]`` for KL by context position. The result is an ordered
    categorical so groupby sorts buckets by position, not alphabetically.
    """
    bounds = np.asarray(edges, dtype=float)
    if bounds.ndim != 1 or bounds.size == 0 or np.any(np.diff(bounds) <= 0):
        raise ValueError(f"edges={list(edges)!r} must be non-empty and strictly increasing, e.g. [0, 512, 1024]")
    where = np.asarray(positions, dtype=float)
    if not np.all(np.isfinite(where)):
        raise ValueError("positions contain NaN or inf; pass token indices")
    if where.size and where.min() < bounds[0]:
        raise ValueError(f"position {where.min():g} lies below the first edge {bounds[0]:g}; start edges at 0")
    text = [f"{edge:g}" for edge in bounds] + ["inf"]
    labels = [f"[{low}, {high})" for low, high in zip(text[:-1], text[1:])]
    codes = np.searchsorted(bounds, where, side="right") - 1
    return pd.Categorical.from_codes(codes, categories=labels, ordered=True)


def summarize_by(df: pd.DataFrame, by: str | list[str]) -> pd.DataFrame:
    """``summarize_divergence`` per group of a per-token frame (columns ``TOKEN_COLUMNS``,
    plus ``kl_reverse`` when present); one row per non-empty group, the ``by`` columns first."""
    by = [by] if isinstance(by, str) else list(by)
    missing = [col for col in [*by, *TOKEN_COLUMNS] if col not in df.columns]
    if missing:
        raise ValueError(f"columns {missing} not in the per-token frame (has {list(df.columns)})")
    if df.empty:
        raise ValueError("the per-token frame has no rows: nothing to summarize")
    has_reverse = "kl_reverse" in df.columns
    rows = []
    for key, group in df.groupby(by, sort=True, observed=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        summary = summarize_divergence(
            *(group[col].to_numpy() for col in TOKEN_COLUMNS),
            kl_reverse=group["kl_reverse"].to_numpy() if has_reverse else None,
        )
        rows.append({**dict(zip(by, key)), **summary})
    return pd.DataFrame(rows)
