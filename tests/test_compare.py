"""harness.compare: run selection in MLflow, correction across all tests, outputs, logging.

Real runs of the tiny random model select and log through MLflow; synthetic runs with
known flip tables check the statistics against statsmodels and hand counts (the tiny
model answers too rarely to flip anything).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.multitest import multipletests

from harness import cli
from harness.job import pipeline as run_mod
from harness.compare import (CompareOptions, RunData, analyse, compare_runs, load_results_dir, main, parse_options,
                             write_report)
from harness.compare.render import plots
from harness.compare.render.tables import detail_table, sub_slice_table
from harness.compare.render.terminal import terminal_table
from harness.config import compose

# ------------------------------------------------------------------ synthetic runs -------------

SLICE_TABLES = {  # slice -> (both right, right->wrong, wrong->right, both wrong) for the "int4" run
    "math": (30, 9, 1, 20),
    "long_context": (25, 2, 2, 31),
}


def synthetic_run(scheme: str, bits: float, *, flips: dict[str, tuple[int, int]], kl_scale: float,
                  long_tokens: bool = True, seed: int = 0) -> RunData:
    """A run whose reference answers are fixed by SLICE_TABLES and whose flips are ``flips[slice]``
    = (right->wrong, wrong->right); three sub-slices per slice; per-token rows with KL ~ kl_scale."""
    rng = np.random.default_rng(seed)
    items = []
    for slice_name, (both_right, r2w, w2r, both_wrong) in SLICE_TABLES.items():
        ref = [1] * (both_right + r2w) + [0] * (w2r + both_wrong)
        want_r2w, want_w2r = flips[slice_name]
        quant = list(ref)
        for index in range(want_r2w):
            quant[index] = 0
        for index in range(want_w2r):
            quant[both_right + r2w + index] = 1
        for index, (r, q) in enumerate(zip(ref, quant)):
            items.append({"item_id": f"{slice_name}/{index:03d}", "slice": slice_name, "task": f"t_{slice_name}",
                          "sub_slice": f"level={index % 3}", "cluster": None, "output_type": "generate_until",
                          "target": "x", "correct_ref": float(r), "correct_quant": float(q),
                          "response_ref": "a", "response_quant": "a" if r == q else "b"})
    token_rows = []
    for slice_name in SLICE_TABLES:
        length = 3000 if (slice_name == "long_context" and long_tokens) else 100
        for text in range(2):
            positions = np.arange(1, length)
            kl = kl_scale * rng.gamma(2.0, 1.0, positions.size) * (1 + positions / 1000.0)
            p_ref = rng.uniform(0.05, 0.95, positions.size)
            token_rows.append(pd.DataFrame({
                "slice": slice_name, "text": text, "position": positions,
                "nll_ref": -np.log(p_ref), "nll_quant": -np.log(p_ref) + kl, "kl": kl, "kl_reverse": 0.9 * kl,
                "top1_ref": rng.integers(0, 50, positions.size), "top1_quant": rng.integers(0, 50, positions.size),
                "p_ref": p_ref, "p_quant": p_ref * np.exp(-kl)}))
    generation = pd.DataFrame([{"slice": s, "n_generative": sum(SLICE_TABLES[s]), "identical_rate": 0.5 + 0.1 * i,
                                "first_diff_mean": 3.0 + i, "first_diff_median": 2.0} for i, s in enumerate(SLICE_TABLES)])
    summary = {"run_key": f"key-{scheme}", "run_name": f"synthetic/{scheme}", "model": "synthetic", "scheme": scheme,
               "method": "rtn", "slices": list(SLICE_TABLES), "quant": {"bits_per_weight": bits}}
    return RunData(run_id=f"id-{scheme}", summary=summary, items=pd.DataFrame(items),
                   tokens=pd.concat(token_rows, ignore_index=True), generation=generation, source="synthetic")


def synthetic_runs(long_tokens: bool = True) -> list[RunData]:
    return [
        synthetic_run("int4", 4.125, flips={"math": (9, 1), "long_context": (2, 2)}, kl_scale=0.05,
                      long_tokens=long_tokens, seed=1),
        synthetic_run("int8", 8.0, flips={"math": (1, 0), "long_context": (0, 1)}, kl_scale=0.002,
                      long_tokens=long_tokens, seed=2),
        synthetic_run("nvfp4", 4.5, flips={"math": (6, 0), "long_context": (5, 0)}, kl_scale=0.03,
                      long_tokens=long_tokens, seed=3),
    ]


def _options(tmp_path: Path, **changes) -> CompareOptions:
    return CompareOptions(n_resamples=500, out=str(tmp_path / "out"), **changes)


# ------------------------------------------------------------------ statistics -----------------


@pytest.mark.slow
@pytest.mark.parametrize("correction, statsmodels_method", [("holm", "holm"), ("bh", "fdr_bh")])
def test_correction_spans_every_test_of_the_comparison(tmp_path, correction, statsmodels_method):
    report = analyse(synthetic_runs(), _options(tmp_path, correction=correction))
    stats = report.item_stats
    # 3 runs x (overall + 2 slices + 6 sub-slices) = 27 tests, all in one family.
    assert len(stats) == 27 and report.n_tests() == 27
    expected = multipletests(stats["delta_p"].to_numpy(), method=statsmodels_method)[1]
    np.testing.assert_allclose(stats["delta_p_adj"].to_numpy(), expected, rtol=1e-12)
    assert (stats["delta_p_adj"] >= stats["delta_p"] - 1e-15).all()
    assert (stats["significant"] == (stats["delta_p_adj"] < 0.05)).all()
    # The family is the comparison, not one run: the adjustment of int4's rows changes when the other runs join
    # (for Holm it can only get stricter; BH's FDR adjustment may go either way).
    alone = analyse(synthetic_runs()[:1], _options(tmp_path, correction=correction)).item_stats
    joint = stats[stats["label"] == "int4"].reset_index(drop=True)
    np.testing.assert_allclose(alone["delta_p_adj"].to_numpy(),
                               multipletests(alone["delta_p"].to_numpy(), method=statsmodels_method)[1], rtol=1e-12)
    assert not np.allclose(joint["delta_p_adj"].to_numpy(), alone["delta_p_adj"].to_numpy())
    if correction == "holm":
        assert (joint["delta_p_adj"].to_numpy() >= alone["delta_p_adj"].to_numpy() - 1e-15).all()


def test_rows_match_hand_counted_flip_tables(tmp_path):
    report = analyse(synthetic_runs(), _options(tmp_path))
    head = report.headline().set_index(["label", "slice"])
    row = head.loc[("int4", "math")]
    both_right, r2w, w2r, both_wrong = SLICE_TABLES["math"]
    n = both_right + r2w + w2r + both_wrong
    assert (row["flips_right_to_wrong"], row["flips_wrong_to_right"], row["n"]) == (r2w, w2r, n)
    assert row["delta"] == pytest.approx((w2r - r2w) / n)
    assert row["acc_ref"] == pytest.approx((both_right + r2w) / n)
    chi2 = mcnemar(np.array([[both_right, r2w], [w2r, both_wrong]]), exact=False, correction=False).statistic
    clusters = int(row["n_clusters"])  # the score test at Δ = 0 is McNemar's, clustered by the design effect
    expected_p = 2 * sps.t.sf(np.sqrt(chi2 / row["design_effect"]), clusters - 1)
    assert row["delta_p"] == pytest.approx(expected_p, rel=1e-9)
    overall = head.loc[("nvfp4", "overall")]
    assert (overall["flips_right_to_wrong"], overall["n"]) == (11, 120)
    # generation divergence and token divergence are carried into the same rows
    assert row["identical_rate"] == pytest.approx(0.5) and row["first_diff_mean"] == pytest.approx(3.0)
    tokens = synthetic_runs()[0].tokens
    assert row["kl_mean"] == pytest.approx(tokens.loc[tokens["slice"] == "math", "kl"].mean())
    assert head.loc[("int8", "math"), "kl_mean"] < head.loc[("int4", "math"), "kl_mean"]
    assert report.labels == ["int4", "int8", "nvfp4"]


def test_labels_are_unique_across_models_and_repeats(tmp_path):
    runs = synthetic_runs()
    runs[1].summary["scheme"] = "int4"  # a repeat of the same scheme
    runs[2].summary["model"] = "other"
    report = analyse(runs, _options(tmp_path))
    assert len(set(report.labels)) == 3
    assert report.labels[2] == "other/nvfp4"


@pytest.mark.slow
def test_kl_by_position_only_with_long_rows(tmp_path):
    long_report = analyse(synthetic_runs(long_tokens=True), _options(tmp_path))
    short_report = analyse(synthetic_runs(long_tokens=False), _options(tmp_path))
    assert plots.kl_by_position(long_report.token_stats, long_report.labels) is not None
    assert plots.kl_by_position(short_report.token_stats, short_report.labels) is None
    written = write_report(short_report, tmp_path / "short")
    assert "kl_by_position" not in written and "kl_cdf" in written


@pytest.mark.slow
def test_write_report_files_and_contents(tmp_path):
    report = analyse(synthetic_runs(), _options(tmp_path))
    written = write_report(report, tmp_path / "out")
    for name in ("forest", "forest_math", "forest_long_context", "flips", "kl_cdf", "kl_by_position",
                 "accuracy_vs_bits", "markdown", "html", "item_stats", "token_stats"):
        assert written[name].exists() and written[name].stat().st_size > 0, name
    for name, path in written.items():
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    text = written["markdown"].read_text()
    assert "## Schemes × slices" in text and "![forest](forest.png)" in text
    assert "across all 27 tests" in text
    page = written["html"].read_text()
    assert page.count("data:image/png;base64,") == sum(1 for p in written.values() if p.suffix == ".png")
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert pd.read_parquet(written["item_stats"]).shape == report.item_stats.shape


@pytest.mark.slow
def test_cluster_counts_stand_beside_n_in_every_table(tmp_path):
    runs = synthetic_runs()
    for run in runs:  # the 60 math items come from 15 sources of 4; long-context items are singletons
        math = run.items["slice"] == "math"
        run.items.loc[math, "cluster"] = [f"source{index // 4}" for index in range(int(math.sum()))]
    report = analyse(runs, _options(tmp_path))
    items = runs[0].items
    expected = {"math": 15, "long_context": 60, "overall": 75}
    detail = detail_table(report)
    assert list(detail.columns[2:4]) == ["n", "clusters"]
    assert {(row["slice"], row["clusters"]) for row in detail.to_dict("records")} == \
        {(name, str(count)) for name, count in expected.items()}
    sub = sub_slice_table(report)
    assert list(sub.columns[3:5]) == ["n", "clusters"]
    by_hand = items[items["slice"] == "math"].groupby("sub_slice")["cluster"].nunique()
    math_rows = sub[sub["slice"] == "math"]
    assert dict(zip(math_rows["sub-slice"], math_rows["clusters"].astype(int))) == by_hand.to_dict()
    assert (sub.loc[sub["slice"] == "long_context", "clusters"] == sub.loc[sub["slice"] == "long_context", "n"]
            .astype(str)).all()
    header = terminal_table(report).splitlines()[2].split()
    assert header[header.index("n") + 1] == "clusters"
    written = write_report(report, tmp_path / "clusters")
    text = written["markdown"].read_text()
    assert len(re.findall(r"\|\s*n\s*\|\s*clusters\s*\|", text)) == 2  # details and sub-slices
    assert written["html"].read_text().count("<th>n</th><th>clusters</th>") == 2


def test_parse_options():
    options = parse_options(["experiment=exp", "tags.scheme=int4", "tags.harness.kind=x", "sweep=abc",
                             "runs=[0e12aa,7f3b]", "tracking.uri=sqlite:///x.db", "margin=0.01", "correction=bh",
                             "log=false", "position_buckets=[0,512]"])
    assert options.experiment == "exp" and options.sweep == "abc"
    assert options.tags == {"scheme": "int4", "harness.kind": "x"}
    assert options.runs == ["0e12aa", "7f3b"]  # run ids stay strings (no YAML float parsing)
    assert options.tracking_uri == "sqlite:///x.db" and options.margin == 0.01 and options.correction == "bh"
    assert options.log is False and options.position_buckets == [0, 512]
    assert parse_options(["margin=null"]).margin is None
    assert parse_options(["compare.margin=0.03", "compare.correction=none"]).margin == 0.03
    # string values are the text typed: YAML would read these as 83, 100000.0 and True
    typed = parse_options(["sweep=0123", "runs=[1e5,0123]", "name=yes", "tags.team=a'b"])
    assert (typed.sweep, typed.runs, typed.name, typed.tags) == ("0123", ["1e5", "0123"], "yes", {"team": "a'b"})
    for bad, message in ((["colour=red"], "unknown option 'colour'"), (["correction=bonferroni"], "holm, bh"),
                         (["margin=2"], "margin=2.0"), (["sweep"], "not key=value"), (["n_resamples=x"], "^n_resamples")):
        with pytest.raises(cli.UsageError, match=message):
            parse_options(bad)


def test_command_line_errors_are_one_line_and_help_lists_options(capsys):
    assert main(["correction=bonferroni"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.strip() == "error: correction='bonferroni' is unknown; use holm, bh or none"
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: python -m harness.compare" in out and "margin=0.02" in out and "tracking.uri" in out


# ------------------------------------------------------------------ real runs in MLflow --------


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, shared_model_cache) -> dict:
    """Three finished runs of the tiny model in one MLflow store: sweep A = int4 + int8, sweep B = int4_g128."""
    root = tmp_path_factory.mktemp("compare")
    cache = root / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(shared_model_cache)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    run_ids = {}
    for scheme, sweep in (("int4", "A"), ("int8", "A"), ("int4_g128", "B")):
        cfg = run_mod.to_config(compose([
            f"paths.results_dir={root / 'results'}", f"paths.cache_dir={cache}", f"tracking.uri={uri}",
            "compare.n_resamples=1000", "model=tiny_random", "slices=[math]", "slices.math.n_items=6",
            "slices.math.divergence_texts=2", f"quant={scheme}"]))
        cfg.tracking.tags["harness.sweep_id"] = sweep
        result = run_mod.run(cfg)
        run_ids[scheme] = result["run_key"]
    return {"root": root, "uri": uri, "run_keys": run_ids}


def _client(uri: str):
    return mlflow.tracking.MlflowClient(tracking_uri=uri)


@pytest.mark.slow
def test_selects_runs_by_sweep_tag_and_id(tiny_runs, tmp_path):
    uri = tiny_runs["uri"]
    by_sweep = compare_runs(tracking_uri=uri, sweep="A", write=False, n_resamples=200)
    assert sorted(by_sweep.labels) == ["int4", "int8"]
    by_tag = compare_runs(tracking_uri=uri, tags={"scheme": "int4_g128"}, write=False, n_resamples=200)
    assert by_tag.labels == ["int4_g128"]
    both = compare_runs(tracking_uri=uri, sweep="A", tags={"scheme": "int8"}, write=False, n_resamples=200)
    assert both.labels == ["int8"]
    run_id = by_tag.runs["run_id"].iloc[0]
    explicit = compare_runs(tracking_uri=uri, runs=[run_id], write=False, n_resamples=200)
    assert explicit.runs["run_id"].tolist() == [run_id]
    everything = compare_runs(tracking_uri=uri, write=False, n_resamples=200)
    assert sorted(everything.labels) == ["int4", "int4_g128", "int8"]
    with pytest.raises(ValueError, match="no finished harness runs"):
        compare_runs(tracking_uri=uri, sweep="missing", write=False)
    with pytest.raises(ValueError, match="no MLflow experiment 'nope'"):
        compare_runs("nope", tracking_uri=uri, write=False)


@pytest.mark.slow
def test_rows_reproduce_each_runs_own_statistics(tiny_runs, tmp_path):
    report = compare_runs(tracking_uri=tiny_runs["uri"], sweep="A", write=False, n_resamples=1000,
                          correction="none")
    for directory in (tiny_runs["root"] / "results").iterdir():
        summary = json.loads((directory / "summary.json").read_text())
        if summary["scheme"] not in report.labels:
            continue
        own = pd.read_parquet(directory / "item_stats.parquet")
        ours = report.item_stats[report.item_stats["label"] == summary["scheme"]].reset_index(drop=True)
        for column in ("n", "delta", "delta_ci_low", "delta_ci_high", "delta_p", "flips_right_to_wrong", "mde"):
            np.testing.assert_allclose(ours[column].to_numpy(float), own[column].to_numpy(float), rtol=1e-12)
        assert list(ours["verdict"]) == list(own["verdict"])


@pytest.mark.slow
def test_command_writes_outputs_and_logs_a_comparison_run(tiny_runs, tmp_path, capsys):
    uri = tiny_runs["uri"]
    out = tmp_path / "cmp"
    code = main([f"tracking.uri={uri}", "sweep=A", f"out={out}", "name=sweepA", "margin=0.01",
                         "n_resamples=200"])
    assert code == 0
    assert "sweepA: 2 runs" in capsys.readouterr().out
    for name in ("comparison.md", "comparison.html", "forest.png", "forest_math.png", "flips.png", "kl_cdf.png",
                 "accuracy_vs_bits.png", "item_stats.parquet", "options.json"):
        assert (out / name).stat().st_size > 0, name
    assert not (out / "kl_by_position.png").exists()  # short texts: one position bucket
    client = _client(uri)
    experiment = client.get_experiment_by_name("quant-harness")
    logged = client.search_runs([experiment.experiment_id], "tags.`harness.kind` = 'comparison'")
    assert len(logged) == 1
    run = logged[0]
    assert run.data.tags["harness.sweep_id"] == "A" and run.data.metrics["n_runs"] == 2
    assert run.data.params["margin"] == "0.01"
    assert {"comparison.html", "comparison.md", "forest.png"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    # the comparison run is never itself selected as a run to compare
    again = compare_runs(tracking_uri=uri, sweep="A", write=False, n_resamples=200)
    assert sorted(again.labels) == ["int4", "int8"]
    # bits per weight come from each run's summary.json
    bits = again.runs.set_index("label")["bits_per_weight"]
    assert bits["int8"] > bits["int4"] > 4.0


@pytest.mark.slow
def test_results_directories_without_mlflow(tiny_runs, tmp_path):
    dirs = sorted((tiny_runs["root"] / "results").iterdir())
    report = compare_runs(dirs=dirs, write=True, out=str(tmp_path / "local"), n_resamples=200)
    assert sorted(report.labels) == ["int4", "int4_g128", "int8"]
    assert (tmp_path / "local" / "comparison.html").exists()
    with pytest.raises(FileNotFoundError, match="not a finished results directory"):
        load_results_dir(tmp_path)


# ------------------------------------------------------------------ package layering ------------


def _harness_imports(path: Path, module: str) -> set[str]:
    """The harness modules ``path`` imports anywhere (module level, in functions, under TYPE_CHECKING)."""
    import ast

    root = Path(run_mod.__file__).resolve().parents[2]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def is_module(name: str) -> bool:
        base = root.joinpath(*name.split("."))
        return base.with_suffix(".py").exists() or (base / "__init__.py").exists()

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base)
    return {name for name in found if name == "harness" or name.startswith("harness.")}


def compare_import_graph() -> dict[str, set[str]]:
    """``harness.compare.*`` module -> the harness modules it imports."""
    package_dir = Path(run_mod.__file__).resolve().parents[1] / "compare"
    graph = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[module] = _harness_imports(path, module)
    return graph


def test_compare_package_imports_one_way():
    graph = compare_import_graph()
    assert {"harness.compare.analysis", "harness.compare.sources", "harness.compare.__main__",
            "harness.compare.render.html_page", "harness.compare.render.plots"} <= set(graph)
    inside = {module: {t for t in targets if t in graph} for module, targets in graph.items()}
    # no module imports the package itself or its command line: nothing imports back up
    for module, targets in inside.items():
        assert not targets & {"harness.compare", "harness.compare.__main__", "harness.compare.render"}, module
    # renderers read the analysis' data types and each other's tables, nothing above them
    for module, targets in inside.items():
        if module.startswith("harness.compare.render."):
            assert all(t == "harness.compare.analysis" or t.startswith("harness.compare.render.")
                       for t in targets), (module, targets)
    # no cycle: a topological order exists
    remaining = {module: set(targets) for module, targets in inside.items()}
    while remaining:
        leaves = [module for module, targets in remaining.items() if not targets & set(remaining)]
        assert leaves, f"import cycle among {sorted(remaining)}"
        for leaf in leaves:
            del remaining[leaf]
    # the run's report shares the comparison's formatters without importing the comparison
    report_imports = _harness_imports(Path(run_mod.__file__).parents[1] / "results" / "report.py", "harness.results.report")
    assert "harness.results.formatting" in report_imports
    assert not any(name.startswith("harness.compare") for name in report_imports)
    assert all("harness.results.formatting" in graph[m] for m in ("harness.compare.render.tables",))


@pytest.mark.slow
def test_long_generation_survival_curves_are_compared_across_runs(tmp_path):
    """Runs that hold a long-generation survival table get one curve each in the comparison."""
    import json as _json

    import pandas as _pd

    from harness.compare import CompareOptions, analyse, load_results_dir
    from harness.compare.output import write_report

    runs = []
    for scheme, values in (("int4", [0.5, 0.25, 0.0]), ("int8", [1.0, 0.75, 0.5])):
        directory = tmp_path / scheme
        directory.mkdir()
        (directory / "summary.json").write_text(_json.dumps({"model": "m", "scheme": scheme, "slices": ["lg"],
                                                             "quant": {"bits_per_weight": 4.0}}))
        _pd.DataFrame({"item_id": ["a", "b"], "slice": "lg", "task": "t", "sub_slice": "s", "cluster": ["a", "b"],
                       "output_type": "generate_until", "target": "", "correct_ref": [1.0, 0.0],
                       "correct_quant": [1.0, 0.0], "response_ref": "x", "response_quant": "x"}
                      ).to_parquet(directory / "items.parquet")
        _pd.DataFrame({"position": [1, 8, 16], "survival": values}).to_parquet(
            directory / "long_generation_survival.parquet")
        runs.append(load_results_dir(directory))
    report = analyse(runs, CompareOptions(n_resamples=1000))
    assert sorted(report.survival["label"].unique()) == sorted(report.labels)
    assert report.survival.groupby("label")["survival"].max().max() == 1.0
    written = write_report(report, tmp_path / "out")
    assert (tmp_path / "out" / "long_generation_survival.png").stat().st_size > 1000
    assert "long_generation_survival" in written
