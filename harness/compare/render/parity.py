"""The parity table as text: :func:`parity_markdown` (both floors beside the disagreement, intervals beside their
estimates), its legend and the two-line headline (:func:`headline`), for ``python -m harness.parity`` and
``harness.compare parity=true`` alike."""
from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["LEGEND", "headline", "parity_markdown"]


LEGEND = ("disagree: share of items answered differently (reply text, chosen answer); engine floor: the reference "
          "against its served self; scheme floor: the simulation against itself with its input embeddings moved "
          "in the last bit. excess: agreement of simulation with served minus agreement of the floor's pair, on the "
          "same items, over the larger floor; EXCEEDS FLOOR when the excess over every floor lies below 0. "
          "Δ and its verdict: served − simulation against the equivalence margin. KL: each run's own divergence "
          "from the reference (served runs: a lower bound on the server's top-k log-probs, where the server "
          "returns them).")


def _num(value, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and np.isnan(value)) else format(value, spec)


def parity_markdown(table: pd.DataFrame) -> str:
    """:func:`parity_table`'s rows as Markdown, both floors beside the disagreement, intervals beside estimates."""
    from harness.results.formatting import pct, points

    def interval(estimate: float, low: float, high: float) -> str:
        return "–" if estimate is None or np.isnan(estimate) else points(estimate, low, high)

    rows = []
    for row in table.to_dict("records"):
        binding = {"engine": "engine", "scheme": "scheme"}.get(row.get("binding_floor"), "")
        rows.append({
            "slice": row["slice"], "n": row["n"], "acc sim %": pct(row["acc_sim"]),
            "acc served %": pct(row["acc_served"]),
            "Δ served − sim pt [CI]": interval(row["delta"], row["delta_ci_low"], row["delta_ci_high"]),
            "verdict": row.get("verdict", ""),
            "flips sim→served r→w / w→r": f"{row['sim_right_served_wrong']} / {row['sim_wrong_served_right']}",
            "disagree sim/served %": pct(row["disagree_sim_served"]),
            "engine floor %": pct(row["disagree_floor"]),
            "scheme floor %": pct(row.get("disagree_own_floor", float("nan"))),
            "excess over larger floor pt [CI]": interval(row["excess"], row["excess_ci_low"], row["excess_ci_high"])
            + (f" ({binding})" if binding else ""),
            "flag": {True: "EXCEEDS FLOOR", False: "not shown beyond floor"}.get(row["exceeds_floor"], "no floor run"),
            "KL sim": _num(row["kl_sim"], ".4f"),
            "KL served": ("≥ " if row.get("kl_served_on") == "top-k lower bound" else "") + _num(row["kl_served"], ".4f"),
            "KL floor": _num(row["kl_floor"], ".4f")})
    return pd.DataFrame(rows).to_markdown(index=False)


def headline(table: pd.DataFrame) -> list[str]:
    """Parity's headline, quality first: one line for Δ accuracy and its verdict with KL, one for reply identity
    against the larger floor (the overall row)."""
    from harness.results.formatting import points

    row = table.set_index("slice").loc["overall"]
    kl = ""
    if not np.isnan(row["kl_sim"]) and not np.isnan(row["kl_served"]):
        bound = "≥ " if row["kl_served_on"] == "top-k lower bound" else ""
        kl = f"; KL simulated {row['kl_sim']:.4f} vs served {bound}{row['kl_served']:.4f}: {row['kl_check']}"
    quality = (f"quality: Δ accuracy served − simulated {points(row['delta'], row['delta_ci_low'], row['delta_ci_high'])}"
               f" pt, {row['verdict']}{kl}")
    n = int(row["n"])
    floors = [f"engine floor {round(row['disagree_floor'] * n)}/{n}" if not np.isnan(row["disagree_floor"]) else "",
              f"scheme's own floor {round(row['disagree_own_floor'] * n)}/{n}"
              if not np.isnan(row["disagree_own_floor"]) else ""]
    floors = ", ".join(f for f in floors if f) or "no floor run"
    flag = {True: "EXCEEDS the larger floor", False: "not shown beyond the larger floor"}.get(row["exceeds_floor"],
                                                                                             "no flag without a floor")
    identity = (f"reply identity: {round(row['disagree_sim_served'] * n)}/{n} items answered differently; {floors}: "
                f"{flag}")
    return [quality, identity]
