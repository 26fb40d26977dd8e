"""harness.report: the run's terminal table and report.md show the cluster count beside n,
and print missing numbers as an en dash (harness.formatting)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from harness import formatting, report, summary
from harness.config import CompareConfig


def _comparison() -> summary.Comparison:
    """24 math items from 6 sources of 4 (sub-slices a/b), 10 singleton code items; a few flips."""
    rows = []
    for index in range(24):
        rows.append({"item_id": f"m{index}", "slice": "math", "sub_slice": "a" if index < 12 else "b",
                     "cluster": f"src{index // 4}", "correct_ref": float(index % 3 != 0),
                     "correct_quant": float(index % 3 != 0 and index % 5 != 0)})
    for index in range(10):
        rows.append({"item_id": f"c{index}", "slice": "code", "sub_slice": "all", "cluster": None,
                     "correct_ref": float(index % 2), "correct_quant": float(index % 2 or index == 4)})
    items = pd.DataFrame(rows)
    item_stats = summary.compare_items(items, CompareConfig(n_resamples=200))
    token_stats = pd.DataFrame({"slice": ["math"], "bucket": ["all"], "kl_mean": [0.01], "kl_se": [0.002],
                                "top1_agree": [0.9], "ppl_ref": [3.0], "ppl_quant": [3.1]})
    return summary.Comparison(items=items, item_stats=item_stats, token_stats=token_stats,
                              generation=pd.DataFrame({"slice": ["math"], "identical_rate": [0.5]}))


def test_side_by_side_and_report_md_show_clusters_beside_n():
    comparison = _comparison()
    table = report.side_by_side(comparison).set_index("slice")
    assert list(table.columns[:2]) == ["n", "clusters"]
    # 6 sources in math, 10 singletons in code, 16 overall (counted by hand)
    assert table.loc["math", ["n", "clusters"]].tolist() == [24, "6"]
    assert table.loc["code", ["n", "clusters"]].tolist() == [10, "10"]
    assert table.loc["overall", ["n", "clusters"]].tolist() == [34, "16"]
    assert table.loc["code", "KL mean ± SE"] == "–" and table.loc["math", "KL mean ± SE"] == "0.0100 ± 0.0020"
    result = {"run_name": "r", "scheme": "int4", "method": "rtn", "model": "m", "run_key": "k", "timings": {}}
    text = report.markdown(comparison, result)
    sub_header = next(line for line in text.splitlines() if "sub_slice" in line)
    cells = [cell.strip() for cell in sub_header.strip("|").split("|")]
    assert cells[cells.index("n") + 1] == "n_clusters"
    sub_rows = [line for line in text.splitlines() if line.startswith("| math ") and "| a " in line]
    assert len(sub_rows) == 1 and [c.strip() for c in sub_rows[0].strip("|").split("|")][3] == "3"  # src0..src2


@pytest.mark.parametrize("missing", [None, math.nan, np.float32("nan"), pd.NA])
def test_missing_numbers_print_as_a_dash(missing):
    assert formatting.num(missing) == "–"
    assert formatting.pm(missing, 0.1) == "–"
    assert formatting.count(missing) == "–"
    assert formatting.delta_ci(missing, -0.1, 0.1) == "– [-0.100, +0.100]"


def test_present_numbers_use_the_given_format():
    assert formatting.num(0.5) == "0.500" and formatting.num(np.float64(0.01234), ".2g") == "0.012"
    assert formatting.pm(0.25, 0.01, ".2f") == "0.25 ± 0.01"
    assert formatting.delta_ci(0.0125, -0.004, 0.03) == "+0.013 [-0.004, +0.030]"
    assert formatting.flips(np.int64(9), 1.0) == "9 / 1"
