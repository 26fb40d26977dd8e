"""Gold-free outcomes of a prompt log: what changes for your users when the candidate replaces the reference.

For every item of a prompt-log slice (``slices=prompts``: the ``items`` table of a run, the reference's and the
candidate's greedy replies to the same conversation), with the run's tokenizer:

* **the reply**: identical or not, the first differing token (:func:`harness.results.longgen.first_difference`),
  the length ratio candidate ÷ reference (tokens), whether each side reached its token cap (the row's
  ``max_tokens``, or ``prompts.max_tokens``, lowered by ``eval.max_gen_toks``);
* **behaviour** per side: a refusal (the refusals slice's matcher), a loop at the end (the long-generation slice's
  detector), an empty reply;
* **format kept**, on the items where the reference's reply has the format: valid JSON (the structured slice's
  extractor), a fenced code block that parses (Python through :func:`ast.parse`, JSON through the strict parser;
  other languages: a closed fenced block), the reply in the language of the last user turn (langid, restricted
  to :data:`LANGUAGES`, on texts of at least :data:`MIN_LANGUAGE_CHARS` letters).

KL and top-1 agreement along the reference's own reply come from the divergence stage (every item's served text).

:func:`outcome_metrics` turns the per-item table into ``<slice>/po_*`` metrics: each per-side rate with its interval
(Wilson on the clustered effective size), each paired change (candidate − reference) with the clustered, stratified
score interval of :func:`harness.stats.paired_compare` (the statistic behind every Δ accuracy of the harness),
each "kept" share with its interval and, as a paired change on the eligible items, its loss; the identical-reply
share; and the length ratio with a paired cluster-bootstrap interval.
"""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Callable, Mapping

import numpy as np
import pandas as pd

from harness.results.longgen import first_difference

__all__ = ["LANGUAGES", "METRIC_DOCS", "OUTCOMES", "language_of", "outcome_frame", "outcome_metrics",
           "reply_checks"]

SIDES = ("ref", "quant")
# languages langid may answer (a closed set: short texts otherwise land on near neighbours, Spanish on Galician)
LANGUAGES = ("ar", "cs", "da", "de", "el", "en", "es", "fi", "fr", "he", "hi", "hu", "id", "it", "ja", "ko", "nl",
             "no", "pl", "pt", "ro", "ru", "sv", "th", "tr", "uk", "vi", "zh")
MIN_LANGUAGE_CHARS = 20  # letters; a shorter text (a number, a code block) has no language here
# outcome -> (per-side column stem, the eligible items: None = all, else the reference-side column that must hold)
OUTCOMES: dict[str, str] = {
    "refused": "a refusal (slices/refusals/utils.py)",
    "loop": "a reply ending in a loop (slices/long_generation/utils.py)",
    "empty": "an empty reply",
    "cap_hit": "a reply that reached its token cap",
}
KEPT: dict[str, str] = {
    "json": "valid JSON where the reference's reply is valid JSON",
    "code": "a fenced code block that parses where the reference's does",
    "language": "the reply in the last user turn's language where the reference's is",
}

_FENCE = re.compile(r"```([A-Za-z0-9_+.-]*)[ \t]*\n(.*?)```", re.DOTALL)
_LETTERS = re.compile(r"[^\W\d_]", re.UNICODE)
_identifier: Any = None


def _slice_module(name: str) -> Any:
    from harness.config import SLICES_DIR
    from harness.evaluation.slices import import_slice_module

    return import_slice_module(SLICES_DIR / name, "utils")


def language_of(text: str) -> str:
    """The language code of ``text`` (one of :data:`LANGUAGES`), or "" for a text with too few letters."""
    global _identifier
    if len(_LETTERS.findall(text)) < MIN_LANGUAGE_CHARS:
        return ""
    if _identifier is None:
        from langid.langid import LanguageIdentifier, model

        identifier = LanguageIdentifier.from_modelstring(model, norm_probs=True)
        identifier.set_languages(list(LANGUAGES))
        _identifier = identifier
    return str(_identifier.classify(_FENCE.sub(" ", text))[0])


def code_parses(text: str) -> bool:
    """Whether ``text`` holds a closed fenced code block that parses (Python and JSON checked; others: closed)."""
    for match in _FENCE.finditer(text):
        language, body = match.group(1).lower(), match.group(2)
        if not body.strip():
            continue
        if language in ("python", "py", "python3", ""):
            try:
                ast.parse(body)
            except (SyntaxError, ValueError):
                if language:
                    continue
                return True  # an unnamed block need not be Python
            return True
        if language == "json":
            try:
                json.loads(body)
            except ValueError:
                continue
            return True
        return True
    return False


def reply_checks(reply: str) -> dict[str, int]:
    """One reply's gold-free checks: refused, loop, empty, json, code (0/1)."""
    refusals, longgen, structured = _slice_module("refusals"), _slice_module("long_generation"), \
        _slice_module("structured")
    return {"refused": int(bool(refusals.is_refusal(reply))), "loop": int(longgen.ends_in_loop(longgen.words(reply))),
            "empty": int(not reply.strip()), "json": int(structured.extract_json(reply) is not None),
            "code": int(code_parses(reply))}


def _last_user_turn(messages: Any) -> str:
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except ValueError:
            return messages
    for message in reversed(list(messages or [])):
        if message.get("role") == "user":
            return str(message.get("content", ""))
    return ""


def outcome_frame(items: pd.DataFrame, rows: Mapping[str, Mapping[str, Any]], tokenize: Callable[[str], list[int]],
                  *, cap_override: int | None = None) -> pd.DataFrame:
    """Per item of a prompt-log slice: the reply, behaviour and format outcomes of both sides (module docstring).

    ``rows`` maps an item id to its row (``messages_json``, ``max_tokens``); ``cap_override`` is
    ``eval.max_gen_toks``."""
    out = []
    for row in items.itertuples(index=False):
        source = rows.get(str(row.item_id), {})
        cap = int(source.get("max_tokens") or 0) or None
        if cap_override is not None:
            cap = min(cap, cap_override) if cap else cap_override
        replies = {"ref": str(row.response_ref), "quant": str(row.response_quant)}
        tokens = {side: tokenize(text) for side, text in replies.items()}
        record: dict[str, Any] = {"item_id": row.item_id, "slice": row.slice, "sub_slice": row.sub_slice,
                                  "cluster": str(row.cluster), "stratum": str(getattr(row, "stratum", "") or "")}
        first = first_difference(tokens["ref"], tokens["quant"])
        record["identical"] = int(replies["ref"] == replies["quant"])
        record["first_diff"] = math.nan if first is None else float(first)
        for side in SIDES:
            record[f"tokens_{side}"] = len(tokens[side])
            for key, value in reply_checks(replies[side]).items():
                record[f"{key}_{side}"] = value
            record[f"cap_hit_{side}"] = int(cap is not None and len(tokens[side]) >= cap)
        prompt_language = language_of(_last_user_turn(source.get("messages_json", "")))
        record["language_prompt"] = prompt_language
        for side in SIDES:
            language = language_of(replies[side])
            record[f"language_{side}"] = language
            record[f"in_language_{side}"] = int(bool(prompt_language) and language == prompt_language)
        out.append(record)
    return pd.DataFrame(out)


def _paired(frame: pd.DataFrame, ref: pd.Series, quant: pd.Series, ci_level: float, seed: int) -> tuple[float, ...]:
    from harness.stats.paired import paired_compare

    strata = frame["stratum"].astype(str).to_numpy() if frame["stratum"].astype(str).nunique() > 1 else None
    result = paired_compare(ref.to_numpy(dtype=float), quant.to_numpy(dtype=float),
                            clusters=frame["cluster"].astype(str).to_numpy(), strata=strata, ci_level=ci_level,
                            seed=seed)
    return float(result.delta), float(result.delta_ci[0]), float(result.delta_ci[1])


def outcome_metrics(frame: pd.DataFrame, *, ci_level: float = 0.95, n_resamples: int = 2000,
                    seed: int = 0) -> dict[str, float]:
    """``<slice>/po_*`` metrics of an :func:`outcome_frame` (one slice), flat for summary.json (module docstring)."""
    from harness.stats.intervals import clustered_rate
    from harness.stats.paired import cluster_codes, ratio_of_means

    out: dict[str, float] = {}
    if frame.empty:
        return out
    for name, part in frame.groupby("slice", sort=False):
        part = part.reset_index(drop=True)
        prefix = f"{name}/po_"
        codes = cluster_codes(part["cluster"].astype(str).to_numpy(), len(part))

        def rate(key: str, values: pd.Series, keep: np.ndarray | None = None) -> None:
            chosen = values.to_numpy(dtype=float) if keep is None else values.to_numpy(dtype=float)[keep]
            groups = codes if keep is None else cluster_codes(part["cluster"].astype(str).to_numpy()[keep], int(keep.sum()))
            value, low, high = clustered_rate(chosen, groups, ci_level)
            out[f"{prefix}{key}"] = value
            if math.isfinite(low):
                out[f"{prefix}{key}_ci_low"], out[f"{prefix}{key}_ci_high"] = low, high

        out[f"{prefix}n"] = float(len(part))
        rate("identical", part["identical"])
        firsts = part["first_diff"].dropna()
        if len(firsts):
            out[f"{prefix}first_diff_median"] = float(firsts.median())
        ratio, low, high = ratio_of_means(part["tokens_ref"].to_numpy(), part["tokens_quant"].to_numpy(),
                                          part["cluster"].astype(str).to_numpy(), n_resamples=n_resamples,
                                          ci_level=ci_level, seed=seed)
        if math.isfinite(ratio):
            out[f"{prefix}length_ratio"] = ratio
            if math.isfinite(low):
                out[f"{prefix}length_ratio_ci_low"], out[f"{prefix}length_ratio_ci_high"] = low, high
        for outcome in OUTCOMES:
            for side in SIDES:
                rate(f"{outcome}_{side}", part[f"{outcome}_{side}"])
            delta, low, high = _paired(part, part[f"{outcome}_ref"], part[f"{outcome}_quant"], ci_level, seed)
            out[f"{prefix}{outcome}_delta"] = delta
            if math.isfinite(low):
                out[f"{prefix}{outcome}_delta_ci_low"], out[f"{prefix}{outcome}_delta_ci_high"] = low, high
        for kept in KEPT:
            column = "in_language" if kept == "language" else kept
            eligible = part[f"{column}_ref"].to_numpy(dtype=int) == 1
            out[f"{prefix}{kept}_eligible"] = float(eligible.sum())
            if not eligible.any():
                continue
            rate(f"{kept}_kept", part[f"{column}_quant"], eligible)
            subset = part[eligible].reset_index(drop=True)
            delta, low, high = _paired(subset, subset[f"{column}_ref"], subset[f"{column}_quant"], ci_level, seed)
            out[f"{prefix}{kept}_lost_delta"] = delta
            if math.isfinite(low):
                out[f"{prefix}{kept}_lost_delta_ci_low"], out[f"{prefix}{kept}_lost_delta_ci_high"] = low, high
    return out


def markdown(metrics: Mapping[str, float], slice_name: str) -> str:
    """The report's section: one line per outcome, reference → candidate, the paired change with its interval."""
    from harness.results.formatting import pct, points

    prefix = f"{slice_name}/po_"
    get = metrics.get
    if get(f"{prefix}n") is None:
        return ""
    lines = [f"## Your prompts: {slice_name} (no gold answers)", "",
             f"- prompts: {int(get(prefix + 'n'))}; identical replies: {pct(get(prefix + 'identical'))} %"
             + (f"; median first differing token: {get(prefix + 'first_diff_median'):.0f}"
                if get(prefix + "first_diff_median") is not None else "")
             + (f"; length candidate ÷ reference: {get(prefix + 'length_ratio'):.2f} "
                f"[{get(prefix + 'length_ratio_ci_low', math.nan):.2f}, {get(prefix + 'length_ratio_ci_high', math.nan):.2f}]"
                if get(prefix + "length_ratio") is not None else ""), "",
             "| outcome | reference % | candidate % | Δ pt [CI] |", "|---|---:|---:|---:|"]
    for outcome, meaning in OUTCOMES.items():
        if get(f"{prefix}{outcome}_delta") is None:
            continue
        lines.append(f"| {meaning} | {pct(get(f'{prefix}{outcome}_ref'))} | {pct(get(f'{prefix}{outcome}_quant'))} | "
                     f"{points(get(f'{prefix}{outcome}_delta'), get(f'{prefix}{outcome}_delta_ci_low', math.nan), get(f'{prefix}{outcome}_delta_ci_high', math.nan))} |")
    for kept, meaning in KEPT.items():
        eligible = int(get(f"{prefix}{kept}_eligible") or 0)
        if not eligible or get(f"{prefix}{kept}_kept") is None:
            continue
        lines.append(f"| {meaning} ({eligible} items) | 100.0 | {pct(get(f'{prefix}{kept}_kept'))} | "
                     f"{points(get(f'{prefix}{kept}_lost_delta'), get(f'{prefix}{kept}_lost_delta_ci_low', math.nan), get(f'{prefix}{kept}_lost_delta_ci_high', math.nan))} |")
    lines += ["", "Δ: candidate − reference on the same prompts, the clustered (by group) and stratified score interval; "
              "a kept share counts the items where the reference's reply has the format. KL and top-1 agreement "
              "along the reference's replies are in the slice's divergence row.", ""]
    return "\n".join(lines)


FRACTION = "fraction (tables: percent; Δ: points)"
# summary.json keys this module adds (scripts/docs_reference.py's METRICS format: key -> (unit, meaning))
METRIC_DOCS: dict[str, tuple[str, str]] = {
    "metrics/<slice>/po_n": ("items", "prompts of a prompt-log slice whose two replies are compared"),
    "metrics/<slice>/po_identical": (FRACTION, "share of prompts answered identically by both sides"),
    "metrics/<slice>/po_first_diff_median": ("tokens", "median position of the first differing reply token, over "
                                             "the prompts answered differently"),
    "metrics/<slice>/po_length_ratio": ("ratio", "reply tokens candidate ÷ reference, summed over the prompts "
                                        "(paired cluster bootstrap interval in _ci_low / _ci_high)"),
    "metrics/<slice>/po_<outcome>_<side>": (FRACTION, "share of replies with the outcome (refused, loop, empty, "
                                            "cap_hit); <side> ref or quant; interval in _ci_low / _ci_high (Wilson on "
                                            "the clustered effective size)"),
    "metrics/<slice>/po_<outcome>_delta": (FRACTION, "paired change of that share, candidate − reference, with the "
                                           "clustered, stratified score interval in _ci_low / _ci_high"),
    "metrics/<slice>/po_<format>_eligible": ("items", "prompts whose reference reply has the format (json, code, "
                                             "language)"),
    "metrics/<slice>/po_<format>_kept": (FRACTION, "share of those whose candidate reply keeps it (interval in "
                                         "_ci_low / _ci_high)"),
    "metrics/<slice>/po_<format>_lost_delta": (FRACTION, "the paired change on those items (kept − 1: a loss), "
                                               "with its score interval in _ci_low / _ci_high"),
    "metrics/<slice>/po_<rate>_ci_low": (FRACTION, "lower bound of that number's interval"),
    "metrics/<slice>/po_<rate>_ci_high": (FRACTION, "upper bound of that number's interval"),
}
