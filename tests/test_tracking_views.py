"""The Headline view, the run page's headline and the per-item view, checked in a real MLflow UI (headless Chromium).

An ``mlflow server`` gets three runs of one sweep logged by :func:`harness.results.tracking.log_results` from
hand-written results (tests/test_tracking_headline.py's layout). Its link must open the sweep's saved view with
the verdict columns first, then Δ per slice, with each run's values in the cells; a run page at 1280×900 must show
the description's headline and the ``verdict`` tag without a click; the per-item link must open MLflow's
"Artifact evaluation" view on the flips. It drives ``scripts/mlflow_screenshots.py``, whose screenshots go to
the test artifacts dir.

Without Chromium the test skips, unless HARNESS_REQUIRE_SYSTEM_TESTS=1 (then it fails).
"""
from __future__ import annotations

import importlib.util
import json

import pytest

from harness.config import REPO_DIR
from harness.results import mlflow_views
from tests.test_html_report import artifact_dir, browser  # noqa: F401  (browser: a fixture)
from tests.test_tracking_headline import STATS, headline_dir
from tests.test_tracking_server import free_port, mlflow_server

pytestmark = pytest.mark.slow

spec = importlib.util.spec_from_file_location("mlflow_screenshots", REPO_DIR / "scripts" / "mlflow_screenshots.py")
shots = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shots)

SWEEP = "multirun/2026-12-06/07-30-00"
# scheme: the statistics of its two slices (math, code); outcome in its run name
PASSING = {name: (*values[:8], "non-inferior within 2.0 pt", values[9]) for name, values in STATS.items()}
SCHEMES = {"int8": (PASSING, "PASS 2/2"), "int4_g128": (STATS, "FAIL 1/2"),
           "int4": ({**STATS, "code": (*STATS["code"][:8], "inconclusive", 0.05)}, "FAIL 1/2")}


def test_reviewer_sees_verdicts_side_by_side_the_headline_first_and_every_flip(browser, tmp_path,  # noqa: F811
                                                                               mlflow_template):
    with mlflow_server(tmp_path / "server", free_port(), template=mlflow_template) as uri:
        directories = [headline_dir(tmp_path / scheme, scheme, stats) for scheme, (stats, _) in SCHEMES.items()]
        experiment_id, run_ids = shots.log_runs(uri, directories, SWEEP)
        shots.close_assistant(browser, uri)

        # The sweep's Headline view: verdict columns first, then Δ per slice, then flips.
        shots.open_view(browser, uri, experiment_id, mlflow_views.sweep_view_key(SWEEP), len(SCHEMES),
                        size=(3000, 800))  # wide enough that no column of the view is virtualised away
        headers = shots.wait_until(browser, f"(() => {{ const h = {shots.HEADER_IDS};"
                                            " return h.includes('tags.`verdict`') && h; })()", "the verdict column")
        state = mlflow_views.view_state(["math", "code"], SWEEP)
        shown = [h for h in headers if h in state["selectedColumns"]]
        assert shown == state["selectedColumns"], headers  # every column of the view, in its order
        assert headers.index("tags.`verdict`") < headers.index("metrics.`acc_delta_pt/overall`")
        assert f"Headline · sweep {SWEEP}" in browser.evaluate("document.body.innerText")  # the Views menu's choice
        rows = shots.run_list_rows(browser, ["tags.`verdict`", "tags.`verdict.math`",
                                             "metrics.`acc_delta_pt/math`"], len(SCHEMES))
        assert set(rows) == {f"{scheme} · tiny_random · {outcome}" for scheme, (_, outcome) in SCHEMES.items()}
        for scheme, (stats, outcome) in SCHEMES.items():
            row = rows[f"{scheme} · tiny_random · {outcome}"]
            assert row["tags.`verdict`"] == outcome.split()[0].lower()
            assert float(row["metrics.`acc_delta_pt/math`"]) == round(100 * stats["math"][3], 1)
        assert not [p for p in browser.problems() if p.startswith("exception")]
        shots.screenshot(browser, artifact_dir() / "mlflow_headline_view.png")

        # A run page at the size: the headline and the verdict tag without a click.
        shots.open_run(browser, uri, experiment_id, run_ids[1])
        facts = shots.wait_until(browser, f"(() => {{ const f = {shots.HEADLINE_FACTS}; "
                                          "return f.tag && f.lineBox && f; })()", "the headline and the verdict tag")
        assert facts["worst"] == "FAIL"
        assert facts["line"].startswith("FAIL on 1 of 2 slices · overall Δ −10.0 [−25.0, +2.8] pt")
        assert facts["lineBox"]["shown"], facts  # inside the viewport and above the "Show more" cut
        assert facts["paragraph"]["shown"], facts  # all four lines: outcome, both groups, the links
        assert facts["tag"]["shown"], facts
        assert {"fail", "pass"} <= set(facts["groups"])  # one line per outcome group, shown as bold words
        groups = browser.evaluate("""(() => { const p = [...document.querySelectorAll('strong')]
            .find(e => e.innerText.trim() === 'FAIL').closest('p'); return p.innerText.split('\\n'); })()""")
        assert groups[1].startswith("fail (1): math") and groups[2].startswith("pass (1): code")

        # The per-item link: MLflow's Artifact evaluation view of the flips, one row per item.
        shots.open_view(browser, uri, experiment_id, mlflow_views.sweep_view_key(SWEEP), len(SCHEMES),
                        mode="ARTIFACT", size=shots.ITEMS_SIZE)
        shots.per_item_ready(browser)
        text = browser.evaluate("document.body.innerText")
        assert "flips.json" in text and "✗ right→wrong | quant: quant answer" in text
    facts_path = artifact_dir() / "mlflow_headline_facts.json"
    facts_path.write_text(json.dumps(facts, indent=1))
