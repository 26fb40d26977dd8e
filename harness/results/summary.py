"""Join the two models' per-item records and token rows into the run's comparison.

Items are paired on their stable id; statistics are computed overall, per slice and per
sub-slice (harness.stats), token divergence per slice and per position bucket
(harness.divergence.token_stats). The result is plain data: DataFrames and a JSON-able dict.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from harness import stats
from harness.config import CompareConfig
from harness.divergence import token_stats
from harness.results.longgen import first_difference


@dataclass
class Comparison:
    items: pd.DataFrame  # one row per item: both models side by side
    item_stats: pd.DataFrame  # one row per (level, slice, sub_slice)
    token_stats: pd.DataFrame  # one row per (slice, position bucket) incl. "all"
    generation: pd.DataFrame  # generation divergence per slice

    def metrics(self) -> dict[str, float]:
        """Flat metric names for MLflow: ``<slice>/<metric>`` and ``overall/<metric>``."""
        out: dict[str, float] = {}
        keys = ["acc_ref", "acc_quant", "delta", "delta_ci_low", "delta_ci_high", "flips_right_to_wrong",
                "flips_wrong_to_right", "flip_rate", "delta_p", "delta_p_adj", "n", "n_clusters"]
        for row in self.item_stats[self.item_stats["level"].isin(["overall", "slice"])].to_dict("records"):
            prefix = "overall" if row["level"] == "overall" else row["slice"]
            for key in keys:
                if key in row and row[key] is not None and _is_number(row[key]):
                    out[f"{prefix}/{key.replace('delta', 'acc_delta') if key.startswith('delta') else key}"] = float(row[key])
        for row in self.token_stats[self.token_stats["bucket"] == "all"].to_dict("records"):
            bound = isinstance(row.get("kl_bound"), str)  # a lower bound is never logged under KL's own name
            for key, value in row.items():
                if key not in ("slice", "bucket") and _is_number(value):
                    name = key.replace("kl", "kl_lower_bound", 1) if bound and key.startswith("kl") else key
                    out[f"{row['slice']}/{name}"] = float(value)
        for row in self.generation.to_dict("records"):
            for key in ("identical_rate", "first_diff_mean"):
                if _is_number(row.get(key)):
                    out[f"{row['slice']}/gen_{key}"] = float(row[key])
        return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and math.isfinite(float(value))


def pair_items(ref: pd.DataFrame, quant: pd.DataFrame) -> pd.DataFrame:
    """Inner-join on item id; refuses item sets that differ (they must be the same items)."""
    missing = set(ref["item_id"]) ^ set(quant["item_id"])
    if missing:
        raise ValueError(f"reference and quantized runs scored different items ({len(missing)} differ, e.g. "
                         f"{sorted(missing)[:3]}); the reference cache key must include the item set")
    keys = ["item_id", "slice", "task", "sub_slice", "cluster", "output_type", "target"]
    if "stratum" not in ref and "stratum" in quant:  # a reference cached before records carried strata
        ref = ref.merge(quant[["item_id", "stratum"]], on="item_id")
    if "stratum" in ref:
        keys.append("stratum")
    merged = ref.merge(quant[["item_id", "correct", "response"]], on="item_id", suffixes=("_ref", "_quant"))
    return merged[keys + ["correct_ref", "correct_quant", "response_ref", "response_quant"]]


def design_strata(items: pd.DataFrame) -> pd.Series | None:
    """Each item's stratum for the statistics: its slice and its declared stratum (a slice is a stratum of
    the run: the slices are chosen, not drawn); None for records without strata (those of older runs),
    which keeps their numbers exactly as they were. Within one slice the prefix changes nothing."""
    if "stratum" not in items:
        return None
    declared = items["stratum"].astype(object).where(items["stratum"].notna(), "").astype(str)
    return items["slice"].astype(str) + "\x1f" + declared


def generation_divergence(items: pd.DataFrame, tokenize) -> pd.DataFrame:
    """Share of identical greedy outputs and where they first differ, for generative items."""
    rows = []
    generative = items[items["output_type"] == "generate_until"]
    for slice_name, group in generative.groupby("slice"):
        firsts = [None if a == b else first_difference(tokenize(a), tokenize(b))
                  for a, b in zip(group["response_ref"], group["response_quant"])]
        differing = [f for f in firsts if f is not None]
        rows.append({"slice": slice_name, "n_generative": len(group),
                     "identical_rate": float(np.mean([f is None for f in firsts])),
                     "first_diff_mean": float(np.mean(differing)) if differing else float("nan"),
                     "first_diff_median": float(np.median(differing)) if differing else float("nan")})
    return pd.DataFrame(rows, columns=["slice", "n_generative", "identical_rate", "first_diff_mean", "first_diff_median"])


def paired_statistics(items: pd.DataFrame, cfg: CompareConfig) -> pd.DataFrame:
    """Paired statistics overall, per slice and per sub-slice, corrected across all rows; stratified by
    the items' declared strata (and, overall, by slice) where the records carry them."""
    frame = items.assign(overall="overall")
    strata = design_strata(items)
    if strata is not None:
        frame = frame.assign(design_stratum=strata)
    levels = [("overall", ["overall"]), ("slice", ["slice"]), ("sub_slice", ["slice", "sub_slice"])]
    parts = []
    for level, by in levels:
        result = stats.compare_frame(frame, by=by, cluster_col="cluster", n_resamples=cfg.n_resamples,
                                     stratum_col=None if strata is None else "design_stratum",
                                     seed=cfg.seed, margin=cfg.margin, correction="none",
                                     ci_level=cfg.ci_level, min_clusters=cfg.min_clusters)
        result.insert(0, "level", level)
        parts.append(result)
    table = pd.concat(parts, ignore_index=True)
    for column in ("slice", "sub_slice"):
        if column not in table:
            table[column] = None
    table["delta_p_adj"] = stats.adjust_pvalues(table["delta_p"].to_numpy(dtype=float), cfg.correction)
    return table


def headline_tokens(tokens: pd.DataFrame) -> pd.DataFrame:
    """The tokens a slice's headline divergence is measured on: its served replies where it has
    them (a chat model: what it serves), else its plain gold texts (base models, older runs)."""
    if "kind" not in tokens or tokens.empty:
        return tokens
    served = tokens.groupby("slice", sort=False)["kind"].transform(lambda kinds: (kinds == "reply").any())
    return tokens[~served | (tokens["kind"] == "reply")]


def summarize_tokens(tokens: pd.DataFrame, edges: list[int]) -> pd.DataFrame:
    """Divergence per slice, overall and by token position bucket, on each slice's headline tokens.

    The slice and overall rows also carry the other kinds' KL, top-1 and PPL ratio under their own
    names (``kl_plain_mean`` for the plain gold texts, ``kl_prompt_mean`` for the prompt positions of
    the served texts: :data:`harness.divergence.token_stats.SIDE_COLUMNS`) and say what the headline is
    measured on (``kl_on``).
    Token rows with a ``kl_bound`` (a served candidate's KL on the server's top-k partition) make every
    row carry it: their KL is a lower bound, and :meth:`Comparison.metrics` names it ``kl_lower_bound_*``.
    """
    if tokens.empty:
        return pd.DataFrame(columns=["slice", "bucket"])
    head = headline_tokens(tokens)
    head = head.assign(bucket=token_stats.position_buckets(head["position"].to_numpy(), edges))
    everything = token_stats.summarize_by(head.assign(bucket="all"), ["slice", "bucket"])
    overall = token_stats.summarize_by(head.assign(slice="overall", bucket="all"), ["slice", "bucket"])
    by_position = token_stats.summarize_by(head, ["slice", "bucket"])
    if "kind" in tokens:
        on = head.groupby("slice", sort=False)["kind"].agg(lambda kinds: "served reply" if (kinds == "reply").any()
                                                           else "plain text")
        everything["kl_on"] = everything["slice"].map(on)
        overall["kl_on"] = " + ".join(sorted(set(on))) if len(on) else None
        for kind in ("plain", "prompt"):
            rows = tokens[tokens["kind"] == kind]
            if rows.empty:
                continue
            names = {key: value.format(kind=kind) for key, value in token_stats.SIDE_COLUMNS.items()}
            per_slice = token_stats.summarize_by(rows, "slice")[["slice", *names]].rename(columns=names)
            everything = everything.merge(per_slice, on="slice", how="left")
            whole = token_stats.summarize_by(rows.assign(slice="overall"), "slice")[["slice", *names]]
            overall = overall.merge(whole.rename(columns=names), on="slice", how="left")
    table = pd.concat([overall, everything, by_position], ignore_index=True)
    bounds = sorted(set(tokens["kl_bound"].dropna())) if "kl_bound" in tokens else []
    if bounds:  # a served candidate's KL on the server's top-k partition: a lower bound, labelled on every row
        table["kl_bound"] = " + ".join(bounds)
    return table


def build(ref_items: pd.DataFrame, quant_items: pd.DataFrame, tokens: pd.DataFrame, cfg: CompareConfig,
          edges: list[int], tokenize) -> Comparison:
    items = pair_items(ref_items, quant_items)
    return Comparison(items=items, item_stats=paired_statistics(items, cfg),
                      token_stats=summarize_tokens(tokens, edges),
                      generation=generation_divergence(items, tokenize))
