"""harness.results.report: the run's terminal table and report.md show the cluster count beside n,
and print missing numbers as an en dash (harness.results.formatting)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from harness.results import formatting
from harness.results import report
from harness.results import summary
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
    item_stats = summary.paired_statistics(items, CompareConfig(n_resamples=200))
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
    sub_header = next(line for line in text.splitlines() if "sub-slice" in line)
    cells = [cell.strip() for cell in sub_header.strip("|").split("|")]
    assert cells[cells.index("n") + 1] == "clusters"
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


# ------------------------------------------------------------------------------- KL by position
EDGES = [0, 128, 1024]  # labels "[0, 128)", "[128, 1024)", "[1024, inf)": string order would put 1024 before 128


def _token_rows() -> pd.DataFrame:
    """Per-token rows of two slices with KL = position / 1e5 on 'long' and a constant 0.02 on 'short'."""
    rng = np.random.default_rng(0)
    frames = []
    for name, positions in (("long", np.arange(1, 1500)), ("short", np.arange(1, 200))):
        n = len(positions)
        top1 = rng.integers(0, 50, n)
        kl = positions / 1e5 if name == "long" else np.full(n, 0.02)
        frames.append(pd.DataFrame({
            "slice": name, "text": 0, "position": positions, "nll_ref": rng.uniform(0.5, 3, n),
            "nll_quant": rng.uniform(0.5, 3, n), "kl": kl, "kl_reverse": kl,
            "top1_ref": top1, "top1_quant": np.where(positions % 4 == 0, top1 + 1, top1),
            "p_ref": rng.uniform(0.05, 0.9, n), "p_quant": rng.uniform(0.05, 0.9, n)}))
    return pd.concat(frames, ignore_index=True)


def _position_comparison() -> summary.Comparison:
    base = _comparison()
    return summary.Comparison(items=base.items, item_stats=base.item_stats,
                              token_stats=summary.summarize_tokens(_token_rows(), EDGES), generation=base.generation)


def test_kl_by_position_lists_buckets_per_slice_in_position_order_with_hand_checked_values():
    table = report.kl_by_position(_position_comparison())
    assert table[["slice", "positions"]].values.tolist() == [
        ["long", "[0, 128)"], ["long", "[128, 1024)"], ["long", "[1024, inf)"],
        ["short", "[0, 128)"], ["short", "[128, 1024)"]]
    long = table[table["slice"] == "long"].set_index("positions")
    # KL = position / 1e5 on positions 1..127, 128..1023, 1024..1499: means (1+127)/2, (128+1023)/2, (1024+1499)/2
    assert long["tokens"].tolist() == ["127", "896", "476"]
    expected = [64e-5, 575.5e-5, 1261.5e-5]
    assert [float(cell.split(" ± ")[0]) for cell in long["KL mean ± SE"]] == pytest.approx(expected, abs=5e-5)
    # SE of a uniform run of integers: sd(1..n)/sqrt(n) with sd = sqrt(n(n+1)/12) for n consecutive values
    n = 896
    se = math.sqrt(n * (n + 1) / 12) / math.sqrt(n) / 1e5
    assert float(long.loc["[128, 1024)", "KL mean ± SE"].split(" ± ")[1]) == pytest.approx(se, abs=5e-5)
    # top-1 differs exactly where position % 4 == 0: 31 of 127 positions in 1..127
    assert float(long.loc["[0, 128)", "top-1 agree %"].split(" ± ")[0]) == pytest.approx(100 * (1 - 31 / 127), abs=0.05)


def test_report_md_has_the_kl_by_position_section():
    result = {"run_name": "r", "scheme": "kv4", "method": "rtn", "model": "m", "run_key": "k", "timings": {}}
    text = report.markdown(_position_comparison(), result)
    section = text.split("## KL by position", 1)[1].split("Timings:", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| long ") or line.startswith("| short ")]
    assert len(rows) == 5 and "[1024, inf)" in rows[2]
    without = report.markdown(_comparison(), result)  # only "all" rows: the section says so
    assert "(no per-position token statistics in this run)" in without.split("## KL by position", 1)[1]


def test_plot_kl_by_position_writes_a_png_with_one_line_per_slice(tmp_path):
    import matplotlib.image as mpimg

    path = report.plot_kl_by_position(_position_comparison(), tmp_path / "kl.png")
    assert path == tmp_path / "kl.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = mpimg.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.05  # not a blank canvas
    assert report.plot_kl_by_position(_comparison(), tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_plot_kl_by_position_lines_follow_the_data(tmp_path, monkeypatch):
    """The plotted points are the per-bucket means in position order (captured from errorbar)."""
    import matplotlib.axes

    calls = []
    original = matplotlib.axes.Axes.errorbar
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar",
                        lambda self, x, y, **kw: calls.append((kw["label"], list(x), list(y))) or original(self, x, y, **kw))
    report.plot_kl_by_position(_position_comparison(), tmp_path / "kl.png")
    assert [c[0] for c in calls] == ["long", "short"]
    assert calls[0][1] == [0, 1, 2] and calls[1][1] == [0, 1]
    assert calls[0][2] == pytest.approx([64e-5, 575.5e-5, 1261.5e-5], rel=1e-9)
    assert calls[1][2] == pytest.approx([0.02, 0.02])


def test_bucket_labels_that_are_not_position_buckets_are_refused():
    assert report.bucket_start("[128, 512)") == 128.0
    with pytest.raises(ValueError, match="not of the form"):
        report.bucket_start("early")


@pytest.mark.slow
def test_a_tiny_random_run_reports_kl_by_position_and_plots_it(make_cfg, tmp_path):
    """End to end: the run's report.md lists every per-position row of its token_stats.parquet, and
    plot_kl_by_position draws them from a Comparison rebuilt off the written parquet."""
    from harness.job import pipeline as run_mod
    from tests.conftest import TINY_MATH

    run_mod.run(make_cfg(*TINY_MATH, "quant=int4_g128", "tracking.enabled=false", "runtime.threads=1"))
    directory = next((tmp_path / "results").glob("*"))
    token_rows = pd.read_parquet(directory / "token_stats.parquet")
    per_position = token_rows[(token_rows["bucket"].astype(str) != "all") & (token_rows["slice"] != "overall")]
    assert len(per_position) >= 1
    section = (directory / "report.md").read_text().split("## KL by position", 1)[1].split("Timings:", 1)[0]
    for row in per_position.to_dict("records"):
        cells = next(c for c in ([x.strip() for x in line.strip("|").split("|")] for line in section.splitlines()
                                 if line.startswith("|")) if c[:2] == [row["slice"], str(row["bucket"])])
        assert cells[2] == str(int(row["n_tokens"])) and cells[3].startswith(f"{row['kl_mean']:.4f} ± ")
    comparison = summary.Comparison(items=pd.DataFrame(), item_stats=pd.DataFrame(), token_stats=token_rows,
                                    generation=pd.DataFrame())
    assert report.plot_kl_by_position(comparison, tmp_path / "kl.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_that_simulates_activation_quantization_says_so_and_one_that_does_not_stays_quiet(make_cfg):
    from harness.config import to_config
    from harness.job.pipeline import simulated_activations
    from harness.results.report import simulation_lines

    base = ["model=tiny_random", "slices=[math]", "tracking.enabled=false"]
    fp8 = simulated_activations(to_config(make_cfg(*base, "quant=fp8")))
    assert fp8 == {"simulated_activations": "fp8_e4m3, per token, dynamic scales"}
    (line,) = simulation_lines({"model": "tiny_random", "scheme": "fp8", **fp8})
    assert "python -m harness.parity model=tiny_random quant=fp8" in line
    for weight_only in ("int4_g128", "fp8_w8a16", "none"):
        assert simulated_activations(to_config(make_cfg(*base, f"quant={weight_only}"))) == {}
    # an export or a server is judged as it is: nothing simulated
    external = to_config(make_cfg(*base, "quant=fp8", "candidate.path=/some/export"))
    assert simulated_activations(external) == {}
    assert simulation_lines({"model": "m", "scheme": "int4"}) == []
