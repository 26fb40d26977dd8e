"""What needs both replies of a long generation: where they part, and how the candidate degrades.

For every item of a long-generation slice (the ``items`` table of a run: ``response_ref`` and
``response_quant`` from greedy decoding of the same prompt), with the run's tokenizer:

* ``first_diff``: the position (in generated tokens) of the first token where the two replies
  differ; the shorter length when one reply is a prefix of the other; ``None`` when identical;
* the **survival curve**: the fraction of items whose replies are still identical at token t;
* degeneration of each side (repeat rate, loop, early stop, words: ``slices/long_generation/utils.py``)
  and the ``length_ratio`` candidate ÷ reference.

KL and top-1 agreement of the candidate *along the reference's own continuation* come from the
divergence stage (the slice sets ``divergence_from_reference``, so its divergence texts are the
prompts followed by the reference's replies) and are reported there by position bucket.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pandas as pd


def first_difference(reference: Sequence[int], candidate: Sequence[int]) -> Optional[int]:
    """Index of the first differing token; the shorter length if one is a prefix; None if equal."""
    for index, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return index
    if len(reference) == len(candidate):
        return None
    return min(len(reference), len(candidate))


def survival(first_diffs: Sequence[Optional[int]], lengths: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """Fraction of items whose two replies are identical over their first ``t`` tokens, per ``t``.

    An item identical to its end counts as surviving up to its own length (``lengths``: the
    longer of the two replies), so the curve is not inflated by replies that simply stopped.
    """
    values = []
    for t in positions:
        alive = [(d is None and n >= t) or (d is not None and d >= t) for d, n in zip(first_diffs, lengths)]
        values.append(float(np.mean(alive)) if alive else float("nan"))
    return np.asarray(values)


def _scorer() -> Callable[[str], dict[str, float]]:
    from harness.config import SLICES_DIR
    from harness.evaluation.slices import import_slice_module

    return import_slice_module(SLICES_DIR / "long_generation", "utils").score


@dataclass
class LongGenReport:
    items: pd.DataFrame  # per item: first_diff, lengths, degeneration of both sides
    curve: pd.DataFrame  # position, survival
    summary: dict[str, float]

    def markdown(self) -> str:
        s = self.summary
        lines = [
            "## Long generation", "",
            f"- items: {s['n']}; identical replies: {s['identical_fraction']:.1%}; median first differing token: "
            f"{s['first_diff_median']:.0f}",
            f"- degenerate (repeat rate / loop / early stop), reference → candidate: "
            f"{s['repeat_rate_ref']:.3f} → {s['repeat_rate_quant']:.3f} / {s['loop_rate_ref']:.1%} → "
            f"{s['loop_rate_quant']:.1%} / {s['early_stop_ref']:.1%} → {s['early_stop_quant']:.1%}",
            f"- length ratio candidate ÷ reference (median): {s['length_ratio_median']:.2f}", "",
            "| token t | replies still identical |", "|---:|---:|",
            *(f"| {int(r.position)} | {r.survival:.1%} |" for r in self.curve.itertuples()), "",
        ]
        return "\n".join(lines)


def analyse(items: pd.DataFrame, tokenize: Callable[[str], list[int]], *,
            positions: Sequence[int] = (1, 8, 16, 32, 64, 128, 256, 512, 1024)) -> LongGenReport:
    """The long-generation comparison of one run's items (rows of one long-generation slice)."""
    if items.empty:
        raise ValueError("no long-generation items to analyse")
    score = _scorer()
    rows = []
    for row in items.itertuples():
        ref, quant = tokenize(str(row.response_ref)), tokenize(str(row.response_quant))
        s_ref, s_quant = score(str(row.response_ref)), score(str(row.response_quant))
        rows.append({
            "item_id": row.item_id, "sub_slice": row.sub_slice, "tokens_ref": len(ref), "tokens_quant": len(quant),
            "first_diff": first_difference(ref, quant),
            "length_ratio": len(quant) / len(ref) if ref else float("nan"),
            **{f"{k}_ref": v for k, v in s_ref.items() if k != "acc"},
            **{f"{k}_quant": v for k, v in s_quant.items() if k != "acc"},
        })
    table = pd.DataFrame(rows)
    longest = max(int(table[["tokens_ref", "tokens_quant"]].to_numpy().max()), 1)
    shown = [p for p in positions if p <= longest] or [longest]
    lengths = table[["tokens_ref", "tokens_quant"]].max(axis=1).tolist()
    first = [None if d is None or pd.isna(d) else int(d) for d in table["first_diff"]]
    curve = pd.DataFrame({"position": shown, "survival": survival(first, lengths, shown)})
    diffs = [d for d in first if d is not None]
    summary = {
        "n": float(len(table)),
        "identical_fraction": float(table["first_diff"].isna().mean()),
        "first_diff_median": float(np.median(diffs)) if diffs else float(longest),
        "length_ratio_median": float(np.nanmedian(table["length_ratio"])),
        **{f"{metric}_{side}": float(table[f"{column}_{side}"].mean())
           for metric, column in (("repeat_rate", "repeat_rate"), ("loop_rate", "loop"),
                                  ("early_stop", "early_stop")) for side in ("ref", "quant")},
    }
    return LongGenReport(table, curve, summary)


def plot_survival(curves: dict[str, pd.DataFrame], path: Path) -> Path:
    """Survival curves of one or more schemes against their reference (one line each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, curve in curves.items():
        ax.plot(curve["position"], curve["survival"], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("generated token t")
    ax.set_ylabel("replies identical to the reference up to t")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def for_run(items: pd.DataFrame, tokenizer: Any, slice_name: str = "long_generation") -> Optional[LongGenReport]:
    """The report for a run's items table when it holds the long-generation slice, else None."""
    rows = items[items["slice"] == slice_name]
    if rows.empty:
        return None
    return analyse(rows, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"])
