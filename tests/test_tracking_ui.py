"""The runs table a reviewer opens, checked in a real MLflow UI in headless Chromium.

An ``mlflow server`` (SQLite store, temp dir) gets three logged results, two of sweep A and
one of sweep B. The harness's link (:func:`harness.results.tracking.experiment_url`) must open the
classic runs table (not the GenAI overview); each run's Dataset cell must name its slices
with the digests of their items; Duration must be the job's, not the logging's. With the
headline columns chosen (scheme, model, slices, overall Δacc, flips, KL: saved in the page's
own settings, as the Columns menu would), the cells must hold the logged values; one
*Group by* -> ``harness.sweep_id`` must show the two sweeps as groups. The screenshot goes to
the test's tmp dir, the test artifacts dir and ``benchmarks/results/mlflow_runs.png``.
A second test opens a run's own page: its description must render the terminal table and
the gate's outcome, and the experiment page its one-paragraph description.

Without Chromium the test skips, unless HARNESS_REQUIRE_SYSTEM_TESTS=1 (then it fails).
"""
from __future__ import annotations

import io
import json
import shutil
import time
from pathlib import Path
from typing import Any

import mlflow
import pytest
from PIL import Image

from harness.results import tracking
from harness.config import REPO_DIR
from tests.test_html_report import DevTools, artifact_dir, browser  # noqa: F401  (browser: a fixture)
from tests.test_tracking import reference_digest, write_result_dir
from tests.test_tracking_server import free_port, mlflow_server

pytestmark = pytest.mark.slow

SLICES = {"math": 24, "code": 12}
# scheme: (sweep, job seconds, overall Δacc, right→wrong flips, wrong→right flips, mean KL)
RUNS = {"int8": ("A", 725.5, -0.006, 2, 1, 0.0031),
        "int4_g128": ("A", 1374.0, -0.047, 11, 3, 0.0412),
        "int4": ("B", 612.0, -0.125, 24, 4, 0.187)}
HEADLINE = {"tags.`scheme`": "scheme", "tags.`model`": "model", "tags.`slices`": "slices",
            "metrics.`detail/overall/acc_delta`": "detail/overall/acc_delta",
            "metrics.`detail/overall/flips_right_to_wrong`": "detail/overall/flips_right_to_wrong",
            "metrics.`detail/overall/flips_wrong_to_right`": "detail/overall/flips_wrong_to_right",
            "metrics.`detail/overall/kl_mean`": "detail/overall/kl_mean"}
# Column order and widths, as the page saves them after a drag (widths apply to ordered columns only).
COLUMN_ORDER = ["attributes.`Run Name`", "runDateAndNestInfo", "duration", "attributes.`Dataset`", *HEADLINE]
COLUMN_WIDTHS = {"attributes.`Run Name`": 150, "runDateAndNestInfo": 110, "duration": 80, "attributes.`Dataset`": 420,
                 **{c: (200 if c.startswith("metrics") else 100) for c in HEADLINE}}
TIMEOUT_S = 90.0

# Every ag-grid row of the runs table as {column id: cell text}; a row's cells sit in several
# containers (pinned and scrolling), joined by the row's id.
TABLE_ROWS = """(() => {
  const rows = {};
  for (const cell of document.querySelectorAll('.ag-row .ag-cell')) {
    const id = cell.closest('.ag-row').getAttribute('row-id');
    (rows[id] = rows[id] || {})[cell.getAttribute('col-id')] = cell.innerText.trim();
  }
  return Object.values(rows);
})()"""
HEADERS = "[...document.querySelectorAll('.ag-header-cell')].map(e => [e.getAttribute('col-id'), e.innerText.trim()])"


def wait_until(browser: DevTools, expression: str, what: str) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        value = browser.evaluate(expression)
        if value:
            return value
        time.sleep(0.5)
    text = browser.evaluate("document.body.innerText.slice(0, 2000)")
    raise AssertionError(f"{what}: not seen in {TIMEOUT_S:.0f} s; the page shows:\n{text}")


def click(browser: DevTools, element: str) -> None:
    """A real mouse click (pressed, released) on the centre of the element ``element`` finds."""
    x, y = browser.evaluate(f"(() => {{ const e = {element}; e.scrollIntoView({{block: 'center'}});"
                            " const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
    for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
        browser.call("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1})


def rows_by_run(browser: DevTools, columns: list[str]) -> dict[str, dict[str, str]]:
    """{run name: row} once every run's row shows ``columns`` (a run row's name starts with its colour)."""
    wanted = json.dumps(columns)
    rows = wait_until(browser, f"""(() => {{
        const runs = ({TABLE_ROWS}).filter(r => (r["attributes.`Run Name`"] || "").startsWith("#"));
        const full = runs.filter(r => {wanted}.every(c => (r[c] || "").length > 0));
        return full.length === {len(RUNS)} && full; }})()""", f"rows of {len(RUNS)} runs with {columns}")
    return {row["attributes.`Run Name`"].splitlines()[-1]: row for row in rows}


def log_three_runs(root: Path, uri: str) -> str:
    now = time.time()
    for scheme, (sweep, seconds, delta, worse, better, kl) in RUNS.items():
        metrics = {"overall/acc_delta": delta, "overall/flips_right_to_wrong": worse,
                   "overall/flips_wrong_to_right": better, "overall/kl_mean": kl}
        directory = write_result_dir(root, scheme, slices=SLICES, metrics=metrics,
                                     started_at=now - 3600 - seconds, ended_at=now - 3600)
        tracking.log_results(directory, uri=uri, experiment="quant-harness", tags={tracking.SWEEP_TAG: sweep})
    return mlflow.tracking.MlflowClient(tracking_uri=uri).get_experiment_by_name("quant-harness").experiment_id


def test_reviewer_sees_the_classic_runs_table_with_datasets_headlines_and_sweeps(browser, tmp_path,  # noqa: F811
                                                                               mlflow_template):
    digests = {name: reference_digest([(f"{name}_task/{name}-{i:03d}", str(i)) for i in range(n)])
               for name, n in SLICES.items()}
    with mlflow_server(tmp_path / "server", free_port(), template=mlflow_template) as uri:
        experiment_id = log_three_runs(tmp_path / "results", uri)
        browser.open_page(tracking.experiment_url(uri, experiment_id))
        wait_until(browser, f"document.body.innerText.includes('{len(RUNS)} matching runs')", "the three runs")

        # The classic runs table of the "Model training" view, not the GenAI overview.
        assert "/runs?" in browser.evaluate("location.hash")
        headings = wait_until(browser, "(() => { const h = [...document.querySelectorAll('h2')]"
                                       ".map(e => e.innerText.trim()); return h.length > 0 && h; })()",
                              "the page's headings")  # under load they render after the run count
        assert headings == ["Runs"]
        nav = browser.evaluate("[...document.querySelectorAll('nav a, aside a')].map(e => e.innerText.trim())")
        assert {"Runs", "Models"} <= set(nav) and "Overview" not in nav and "Sessions" not in nav
        # Default columns: every run names its slices with their items' digests; Duration is the job's.
        runs = rows_by_run(browser, ["attributes.`Dataset`", "duration"])
        assert set(runs) == {f"tiny/{scheme}" for scheme in RUNS}
        for scheme, (_, seconds, *_) in RUNS.items():
            row = runs[f"tiny/{scheme}"]
            for name, digest in digests.items():
                assert f"{name} ({digest})" in row["attributes.`Dataset`"], (scheme, row)
            assert row["duration"] == f"{seconds / 60:.1f}min", (scheme, row)

        # The headline columns, saved in the page's own settings as its Columns menu saves them.
        key = browser.evaluate("Object.keys(localStorage).find(k => k.includes('ExperimentPage'))")
        assert key, "the runs page saved no settings to change"
        browser.evaluate(f"""(() => {{
            const key = {json.dumps(key)}, state = JSON.parse(localStorage.getItem(key));
            state.selectedColumns = ["attributes.`Dataset`", ...{json.dumps(list(HEADLINE))}];
            state.columnOrder = {json.dumps(COLUMN_ORDER)};
            state.columnWidths = {json.dumps(COLUMN_WIDTHS)};
            localStorage.setItem(key, JSON.stringify(state));
            localStorage.setItem("mlflow.assistant.panelOpen_v1", "false");
            return true; }})()""")
        browser.call("Emulation.setDeviceMetricsOverride", {"width": 2200, "height": 560, "deviceScaleFactor": 1,
                                                            "mobile": False})
        browser.call("Page.reload")
        wait_until(browser, f"document.querySelectorAll('.ag-header-cell[col-id=\"{list(HEADLINE)[-1]}\"]').length",
                   "the headline columns")
        headers = dict(browser.evaluate(HEADERS))
        assert {column: headers.get(column) for column in HEADLINE} == HEADLINE
        runs = rows_by_run(browser, list(HEADLINE))
        for scheme, (_, _, delta, worse, better, kl) in RUNS.items():
            row = runs[f"tiny/{scheme}"]
            assert (row["tags.`scheme`"], row["tags.`model`"], row["tags.`slices`"]) == (scheme, "tiny_random",
                                                                                         "math,code")
            shown = [float(row[f"metrics.`detail/overall/{m}`"]) for m in ("acc_delta", "flips_right_to_wrong",
                                                                    "flips_wrong_to_right", "kl_mean")]
            assert shown == pytest.approx([delta, worse, better, kl], rel=1e-3), (scheme, row)

        # One sweep, one group: Group by -> harness.sweep_id.
        click(browser, "[...document.querySelectorAll('button')].find(e => e.innerText.trim() === 'Group by')")
        wait_until(browser, "[...document.querySelectorAll('[role=menuitemcheckbox]')]"
                            ".some(e => e.innerText.trim() === 'harness.sweep_id')", "the Group by menu")
        click(browser, "[...document.querySelectorAll('[role=menuitemcheckbox]')]"
                       ".find(e => e.innerText.trim() === 'harness.sweep_id')")
        for kind in ("keyDown", "keyUp"):  # close the menu before the screenshot
            browser.call("Input.dispatchKeyEvent", {"type": kind, "key": "Escape", "code": "Escape",
                                                    "windowsVirtualKeyCode": 27})
        groups = wait_until(browser, "(() => { const g = [...document.querySelectorAll('.ag-row')]"
                                     ".map(e => e.innerText.match(/Group: (\\w+)\\s+(\\d+)/)).filter(Boolean)"
                                     ".map(m => [m[1], Number(m[2])]); return g.length >= 2 && g; })()",
                            "the sweep groups")
        assert dict(groups) == {"A": 2, "B": 1}
        assert "Group by: harness.sweep_id" in browser.evaluate("document.body.innerText")
        assert not [p for p in browser.problems() if p.startswith("exception")]
        shot = browser.screenshot()

    path = tmp_path / "mlflow_runs.png"
    path.write_bytes(shot)
    for copy in (artifact_dir() / "mlflow_runs.png", REPO_DIR / "benchmarks" / "results" / "mlflow_runs.png"):
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
    print(f"screenshot of the MLflow runs table: {path}")
    with Image.open(io.BytesIO(shot)) as image:
        assert image.format == "PNG" and image.size[0] >= 2000
        colours = image.convert("RGB").resize((200, 200)).getcolors(maxcolors=200 * 200)
        assert colours is not None and len(colours) > 50  # not blank: text, chips, table


def test_reviewer_lands_on_a_run_page_whose_description_is_the_headline(browser, tmp_path,  # noqa: F811
                                                                       mlflow_template):
    """The run page: its description renders the terminal table and the gate (bold outcome, one row per
    slice and criterion). The experiment page: its one-paragraph description. Screenshot of the run page
    in the test artifacts dir."""
    from tests.test_tracking import GATE, HEADLINE, write_report

    with mlflow_server(tmp_path / "server", free_port(), template=mlflow_template) as uri:
        directory = write_result_dir(tmp_path / "results", "int4_g128", slices=SLICES)
        write_report(directory, GATE)
        run_id = tracking.log_results(directory, uri=uri, experiment="quant-harness")
        experiment_id = mlflow.tracking.MlflowClient(tracking_uri=uri).get_experiment_by_name(
            "quant-harness").experiment_id
        browser.open_page(f"{uri}/#/experiments/{experiment_id}/runs/{run_id}")
        browser.call("Emulation.setDeviceMetricsOverride", {"width": 1600, "height": 1400, "deviceScaleFactor": 1,
                                                            "mobile": False})
        wait_until(browser, "document.body.innerText.includes('Gate: fail')", "the gate in the run's description")
        # the description is rendered Markdown: the terminal table as a table, the gate in bold, its rows
        tables = wait_until(browser, """(() => { const t = [...document.querySelectorAll('table')].map(t =>
            [...t.querySelectorAll('tr')].map(r => [...r.querySelectorAll('th,td')].map(c => c.innerText.trim())));
            return t.length >= 2 && t; })()""", "the description's tables")
        headline = next(t for t in tables if t and "Δacc [95% CI]" in t[0])
        assert headline[0] == list(HEADLINE.columns)
        assert [row[0] for row in headline[1:]] == list(HEADLINE["slice"])
        assert headline[2][HEADLINE.columns.get_loc("Δacc [95% CI]")] == "-0.125 [-0.292, +0.042]"
        gate = next(t for t in tables if t and t[0] == ["slice", "criterion", "outcome", "why"])
        assert [row[:3] for row in gate[1:]] == [["math", "accuracy_noninferiority", "fail"],
                                                 ["code", "kl_mean", "pass"]]
        strong = browser.evaluate("[...document.querySelectorAll('strong')].map(e => e.innerText.trim())")
        assert "Gate: fail" in strong
        assert not [p for p in browser.problems() if p.startswith("exception")]
        shot = browser.screenshot()
        # the experiment's page carries its paragraph above the runs table (Markdown: code spans lose their ticks)
        browser.open_page(tracking.experiment_url(uri, experiment_id))
        wait_until(browser, "document.body && document.body.innerText.includes('1 matching run')",
                   "the run in the runs table")
        assert tracking.EXPERIMENT_DESCRIPTION.replace("`", "") in browser.evaluate("document.body.innerText")
    (artifact_dir() / "mlflow_run_description.png").write_bytes(shot)
