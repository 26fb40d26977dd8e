"""Tests for harness.divergence.token_stats against hand computations and independent formulas."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from harness.divergence.token_stats import PERCENTILES, position_buckets, summarize_by, summarize_divergence


def _tokens(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Correlated per-token arrays shaped like a real scoring run."""
    rng = np.random.default_rng(seed)
    nll_ref = rng.gamma(1.5, 1.5, n)
    nll_quant = np.maximum(nll_ref + rng.normal(0.03, 0.2, n), 0.0)
    top1_ref = rng.integers(0, 50, n)
    return {
        "nll_ref": nll_ref,
        "nll_quant": nll_quant,
        "kl": rng.exponential(0.02, n),
        "top1_ref": top1_ref,
        "top1_quant": np.where(rng.random(n) < 0.1, rng.integers(0, 50, n), top1_ref),
        "p_ref": np.exp(-nll_ref),
        "p_quant": np.exp(-nll_quant),
    }


def test_ppl_and_se_by_hand() -> None:
    nll_ref = [0.5, 1.0, 1.5, 2.0]  # mean 1.25, squared deviations .5625 .0625 .0625 .5625
    nll_quant = [1.0, 1.0, 2.0, 2.0]  # mean 1.5, d = [.5, 0, .5, 0]: mean .25, var (4 x .0625)/3
    out = summarize_divergence(nll_ref, nll_quant, [0.0] * 4, [1, 2, 3, 4], [1, 2, 3, 4], [0.5] * 4, [0.5] * 4)
    assert out["n_tokens"] == 4
    assert out["ppl_ref"] == pytest.approx(math.exp(1.25))
    assert out["ppl_ref_se"] == pytest.approx(math.exp(1.25) * math.sqrt(1.25 / 3) / 2)
    assert out["ppl_quant"] == pytest.approx(math.exp(1.5))
    assert out["ppl_quant_se"] == pytest.approx(math.exp(1.5) * math.sqrt(1.0 / 3) / 2)
    assert out["ln_ppl_ratio"] == pytest.approx(0.25)
    assert out["ln_ppl_ratio_se"] == pytest.approx(math.sqrt(0.25 / 3) / 2)
    assert out["ppl_ratio"] == pytest.approx(math.exp(1.5) / math.exp(1.25))
    assert out["ppl_ratio_se"] == pytest.approx(math.exp(0.25) * math.sqrt(0.25 / 3) / 2)


def test_ppl_ratio_se_from_covariance_of_nlls() -> None:
    tokens = _tokens(2000, seed=1)
    out = summarize_divergence(**tokens)
    cov = np.cov(tokens["nll_ref"], tokens["nll_quant"])  # ddof=1
    n = tokens["nll_ref"].size
    var_log_ratio = (cov[0, 0] + cov[1, 1] - 2 * cov[0, 1]) / n
    ratio = out["ppl_quant"] / out["ppl_ref"]
    assert out["ppl_ratio"] == pytest.approx(ratio, rel=1e-12)
    assert out["ln_ppl_ratio_se"] == pytest.approx(math.sqrt(var_log_ratio), rel=1e-9)
    assert out["ppl_ratio_se"] == pytest.approx(ratio * math.sqrt(var_log_ratio), rel=1e-9)
    # the paired SE is far smaller than treating the two PPLs as independent
    unpaired = ratio * math.sqrt((cov[0, 0] + cov[1, 1]) / n)
    assert out["ppl_ratio_se"] < 0.5 * unpaired


def test_ppl_ratio_se_close_to_bootstrap() -> None:
    tokens = _tokens(3000, seed=2)
    out = summarize_divergence(**tokens)
    rng = np.random.default_rng(0)
    d = tokens["nll_quant"] - tokens["nll_ref"]
    idx = rng.integers(0, d.size, size=(2000, d.size))
    boot = np.exp(d[idx].mean(axis=1))
    assert out["ppl_ratio_se"] == pytest.approx(np.std(boot), rel=0.08)


def test_percentiles_by_hand_and_against_pandas() -> None:
    kl = np.arange(11.0)[::-1]  # 10 .. 0, unsorted on purpose
    p = np.full(11, 0.5)
    out = summarize_divergence(np.ones(11), np.ones(11), kl, np.zeros(11), np.zeros(11), p, p)
    expected = {"kl_p50": 5.0, "kl_p10": 1.0, "kl_p99": 9.9, "kl_p99_9": 9.99, "kl_p0_1": 0.01, "kl_p1": 0.1}
    for key, value in expected.items():
        assert out[key] == pytest.approx(value), key
    assert (out["kl_max"], out["kl_min"]) == (10.0, 0.0)

    tokens = _tokens(997, seed=3)
    out = summarize_divergence(**tokens)
    dp = pd.Series(tokens["p_quant"] - tokens["p_ref"])
    kl_series = pd.Series(tokens["kl"])
    for q in PERCENTILES:
        suffix = f"{q:g}".replace(".", "_")
        assert out[f"kl_p{suffix}"] == pytest.approx(kl_series.quantile(q / 100), rel=1e-12)
        assert out[f"dp_p{suffix}"] == pytest.approx(dp.quantile(q / 100), rel=1e-12, abs=1e-15)
    assert out["dp_max"] == dp.max() and out["dp_min"] == dp.min()


def test_kl_top1_and_dp_by_hand() -> None:
    kl = [0.1, 0.3, 0.2, 0.0, 0.4]
    top1_ref = [5, 6, 7, 8, 9]
    top1_quant = [5, 0, 7, 8, 1]  # 3 of 5 agree
    p_ref = [0.5, 0.4, 0.9, 0.1, 0.2]
    p_quant = [0.4, 0.4, 0.7, 0.2, 0.2]  # dp = -.1 0 -.2 .1 0
    out = summarize_divergence([1.0] * 5, [1.0] * 5, kl, top1_ref, top1_quant, p_ref, p_quant,
                               kl_reverse=[0.2, 0.2, 0.2, 0.2, 0.7])
    assert out["kl_mean"] == pytest.approx(0.2)
    assert out["kl_se"] == pytest.approx(math.sqrt(0.1 / 4) / math.sqrt(5))  # deviations^2 sum .1
    assert out["kl_reverse_mean"] == pytest.approx(0.3)
    assert out["kl_reverse_se"] == pytest.approx(math.sqrt(0.2 / 4) / math.sqrt(5))
    assert out["top1_agree"] == pytest.approx(0.6)
    assert out["top1_agree_se"] == pytest.approx(math.sqrt(0.6 * 0.4 / 5))
    assert out["dp_mean"] == pytest.approx(-0.04)
    assert out["dp_rms"] == pytest.approx(math.sqrt(0.06 / 5))
    assert out["dp_se"] == pytest.approx(math.sqrt((0.0036 + 0.0016 + 0.0256 + 0.0196 + 0.0016) / 4 / 5))
    assert out["ln_ppl_ratio"] == 0.0 and out["ppl_ratio"] == 1.0


def test_kl_reverse_keys_only_when_given() -> None:
    out = summarize_divergence(**_tokens(50))
    assert not any(key.startswith("kl_reverse") for key in out)
    assert len([key for key in out if key.startswith("kl_p")]) == len(PERCENTILES)


def test_single_token_has_nan_se() -> None:
    out = summarize_divergence([1.0], [2.0], [0.3], [4], [4], [0.4], [0.1])
    assert out["ppl_ratio"] == pytest.approx(math.e)
    assert math.isnan(out["ppl_ratio_se"]) and math.isnan(out["kl_se"])
    assert out["top1_agree"] == 1.0 and out["top1_agree_se"] == 0.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kl": np.zeros(3)}, "kl has 3 tokens but nll_ref has 4"),
        ({"p_quant": np.array([0.1, 1.2, 0.3, 0.4])}, r"p_quant\[1\] = 1.2"),
        ({"nll_ref": np.array([1.0, np.nan, 1.0, 1.0])}, r"nll_ref\[1\] = nan"),
        ({"top1_ref": np.zeros((2, 2))}, "1-D"),
    ],
)
def test_bad_inputs_raise(change: dict, message: str) -> None:
    tokens = {key: value[:4] for key, value in _tokens(4).items()} | change
    with pytest.raises(ValueError, match=message):
        summarize_divergence(**tokens)


def test_position_buckets() -> None:
    labels = position_buckets([0, 511, 512, 1023, 1024, 5000], [0, 512, 1024])
    assert list(labels) == ["[0, 512)", "[0, 512)", "[512, 1024)", "[512, 1024)", "[1024, inf)", "[1024, inf)"]
    assert labels.ordered and list(labels.categories) == ["[0, 512)", "[512, 1024)", "[1024, inf)"]
    with pytest.raises(ValueError, match="below the first edge"):
        position_buckets([3, 10], [5, 20])
    with pytest.raises(ValueError, match="strictly increasing"):
        position_buckets([3], [0, 10, 10])


def test_summarize_by_groups_in_position_order() -> None:
    tokens = _tokens(600, seed=4)
    frame = pd.DataFrame(tokens)
    frame["position"] = np.tile(np.arange(200), 3) * 10
    frame["bucket"] = position_buckets(frame["position"], [0, 100, 1000])
    frame["language"] = np.repeat(["en", "ja", "sw"], 200)
    out = summarize_by(frame, ["bucket"])
    assert list(out["bucket"]) == ["[0, 100)", "[100, 1000)", "[1000, inf)"]  # not alphabetical
    first = frame[frame["position"] < 100]
    assert out.loc[0, "n_tokens"] == len(first) == 30
    assert out.loc[0, "kl_mean"] == pytest.approx(first["kl"].mean())
    assert out.loc[0, "top1_agree"] == pytest.approx(np.mean(first["top1_ref"] == first["top1_quant"]))

    two_keys = summarize_by(frame.assign(kl_reverse=frame["kl"] * 2), ["language", "bucket"])
    assert len(two_keys) == 9
    assert two_keys["kl_reverse_mean"].to_numpy() == pytest.approx(2 * two_keys["kl_mean"].to_numpy())
    with pytest.raises(ValueError, match="p_ref"):
        summarize_by(frame.drop(columns="p_ref"), "bucket")
