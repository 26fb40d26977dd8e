"""Screenshots of what a reviewer sees in MLflow: the run list in the Headline view, a run page, the per-item view.

Logs finished results directories to a fresh ``mlflow server`` (SQLite store in a temporary directory), opens
the pages in headless Chromium (the browser tests' DevTools client) and writes three PNGs:

    .venv/bin/python scripts/mlflow_screenshots.py results/example [more results dirs ...] \
        [--sweep NAME] [--page RESULTS_DIR] [--out docs/assets]

* ``mlflow_runs.png``: the experiment's run list in its saved Headline view (the view of ``--sweep`` when given);
* ``mlflow_run.png``: the page of the first results directory's run (of ``--page``'s, logged outside the sweep,
  when given), at 1280×900 with MLflow's assistant panel closed;
* ``screenshots/mlflow_items.png``: the "Artifact evaluation" view of ``flips.json``, up to 10 runs row by row.

Every results directory is logged as ``python -m harness.sync`` would (:func:`harness.results.tracking.log_results`),
with ``harness.sweep_id=<--sweep>`` when given. ``tests/test_tracking_views.py`` drives the same functions.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from harness.results import mlflow_views, tracking  # noqa: E402

TIMEOUT_S = 90.0
EXPERIMENT = "quant-harness"
RUN_LIST_SIZE = (1600, 720)
RUN_PAGE_SIZE = (1280, 900)  # the first-visit size
ITEMS_SIZE = (1600, 900)

# Every ag-grid row of the run list as {column id: cell text}; a row's cells sit in several containers.
TABLE_ROWS = """(() => {
  const rows = {};
  for (const cell of document.querySelectorAll('.ag-row .ag-cell')) {
    const id = cell.closest('.ag-row').getAttribute('row-id');
    (rows[id] = rows[id] || {})[cell.getAttribute('col-id')] = cell.innerText.trim();
  }
  return Object.values(rows);
})()"""
# The run list's column ids left to right as shown (ag-grid places header cells by position, not DOM order;
# columns scrolled out of view are not rendered: check with a wide enough page).
HEADER_IDS = ("[...document.querySelectorAll('.ag-header-cell')].map(e => [e.getBoundingClientRect().left,"
              " e.getAttribute('col-id')]).sort((a, b) => a[0] - b[0]).map(p => p[1])")


def wait_until(browser: Any, expression: str, what: str, timeout: float = TIMEOUT_S) -> Any:
    """The expression's value once truthy; an AssertionError with the page's text after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = browser.evaluate(expression)
        if value:
            return value
        time.sleep(0.5)
    text = browser.evaluate("document.body ? document.body.innerText.slice(0, 2000) : ''")
    raise AssertionError(f"{what}: not seen in {timeout:.0f} s; the page shows:\n{text}")


def set_size(browser: Any, size: tuple[int, int]) -> None:
    browser.call("Emulation.setDeviceMetricsOverride", {"width": size[0], "height": size[1], "deviceScaleFactor": 1,
                                                        "mobile": False})


def log_runs(uri: str, directories: Sequence[Path], sweep: str | None = None) -> tuple[str, list[str]]:
    """Log each results directory; returns the experiment id and the run ids (in the given order)."""
    from mlflow.tracking import MlflowClient

    tags = {tracking.SWEEP_TAG: sweep} if sweep else None
    run_ids = [tracking.log_results(d, uri=uri, experiment=EXPERIMENT, tags=tags) for d in directories]
    return MlflowClient(tracking_uri=uri).get_experiment_by_name(EXPERIMENT).experiment_id, run_ids


def view_key(sweep: str | None) -> str:
    return mlflow_views.sweep_view_key(sweep) if sweep else mlflow_views.HEADLINE_VIEW_KEY


def close_assistant(browser: Any, uri: str) -> None:
    """A first visit opens MLflow's assistant panel over a quarter of the page; closed once, as a reviewer does."""
    browser.open_page(f"{uri}/#/")
    browser.evaluate("localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true'),"
                     "localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false'), true")


def open_view(browser: Any, uri: str, experiment_id: str, key: str, n_runs: int, mode: str | None = None,
              size: tuple[int, int] = RUN_LIST_SIZE) -> None:
    """Open a saved view of the run list and wait for its runs."""
    browser.open_page(f"{uri}/{mlflow_views.view_path(experiment_id, key, mode)}")
    set_size(browser, size)
    wait_until(browser, f"document.body && document.body.innerText.includes('{n_runs} matching run')",
               f"{n_runs} runs in the view")


def run_list_rows(browser: Any, columns: Sequence[str], n_runs: int) -> dict[str, dict[str, str]]:
    """{run name: row} once every run's row shows ``columns``."""
    wanted = json.dumps(list(columns))
    rows = wait_until(browser, f"""(() => {{
        const runs = ({TABLE_ROWS}).filter(r => (r["attributes.`Run Name`"] || "").length > 0);
        const full = runs.filter(r => {wanted}.every(c => (r[c] || "").length > 0));
        return full.length === {n_runs} && full; }})()""", f"{n_runs} rows with {list(columns)}")
    return {row["attributes.`Run Name`"].splitlines()[-1]: row for row in rows}


def open_run(browser: Any, uri: str, experiment_id: str, run_id: str, size: tuple[int, int] = RUN_PAGE_SIZE) -> None:
    browser.open_page(f"{uri}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning")
    set_size(browser, size)
    wait_until(browser, "document.body && document.body.innerText.includes('overall Δ')", "the run's description")


# Where the description's first line and the verdict tag sit on the page, and whether they lie inside the
# viewport and above any "Show more" cut (the collapsed description's visible box).
HEADLINE_FACTS = """(() => {
  const visible = (el) => { if (!el) return null; const r = el.getBoundingClientRect();
    let box = el.parentElement; let clipTop = -Infinity, clipBottom = Infinity;
    while (box) { const s = getComputedStyle(box);
      if (s.overflow !== 'visible' || s.overflowY !== 'visible') { const b = box.getBoundingClientRect();
        clipTop = Math.max(clipTop, b.top); clipBottom = Math.min(clipBottom, b.bottom); }
      box = box.parentElement; }
    return {top: r.top, bottom: r.bottom, shown: r.height > 0 && r.top >= Math.max(0, clipTop) - 1
            && r.bottom <= Math.min(innerHeight, clipBottom) + 1}; };
  const strongs = [...document.querySelectorAll('strong')];
  const worst = strongs.find(e => /^(FAIL|PASS|INCONCLUSIVE)$/.test(e.innerText.trim()));
  const line = worst && worst.closest('p');
  const tag = [...document.querySelectorAll('body *')].find(e => e.children.length === 0 && /^verdict$/.test((e.innerText || '').trim()));
  return {worst: worst ? worst.innerText.trim() : null, line: line ? line.innerText : null,
          lineBox: visible(worst), paragraph: visible(line), groups: strongs.map(e => e.innerText.trim()),
          tag: visible(tag), showMore: document.body.innerText.includes('Show more')};
})()"""


def screenshot(browser: Any, path: Path) -> Path:
    import base64

    shot = browser.call("Page.captureScreenshot", {"format": "png"})  # the viewport: what a reviewer sees first
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


def per_item_ready(browser: Any) -> Any:
    return wait_until(browser, "document.body.innerText.includes('right→wrong')", "the per-item table's rows")


def take(uri: str, experiment_id: str, run_ids: Sequence[str], sweep: str | None, out: Path,
         browser: Any, log: Callable[[str], None] = print, page_run: str | None = None) -> dict[str, Path]:
    """The three screenshots; returns name -> path. ``page_run``: the run whose page is shown (default the first)."""
    written = {}
    key = view_key(sweep)
    close_assistant(browser, uri)
    open_view(browser, uri, experiment_id, key, len(run_ids))
    wait_until(browser, f"({HEADER_IDS}).includes('tags.`verdict`')", "the verdict column")
    time.sleep(1.0)
    written["runs"] = screenshot(browser, out / "mlflow_runs.png")
    log(f"run list in the Headline view: {written['runs']}")

    open_run(browser, uri, experiment_id, page_run or run_ids[0])
    time.sleep(1.0)
    written["run"] = screenshot(browser, out / "mlflow_run.png")
    log(f"run page: {written['run']}")

    open_view(browser, uri, experiment_id, key, len(run_ids), mode="ARTIFACT", size=ITEMS_SIZE)
    per_item_ready(browser)
    time.sleep(1.0)
    written["items"] = screenshot(browser, out / "screenshots" / "mlflow_items.png")
    log(f"per-item view: {written['items']}")
    return written


@contextlib.contextmanager
def chromium(profile: Path) -> Iterator[Any]:
    from tests.test_html_report import DevTools, chromium_binary

    profile.mkdir(parents=True, exist_ok=True)
    tools = DevTools(chromium_binary(), profile)
    try:
        yield tools
    finally:
        tools.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="finished results directories (results/<run>/)")
    parser.add_argument("--sweep", default=None, help="log them as one sweep (harness.sweep_id) and show its view")
    parser.add_argument("--page", type=Path, default=None,
                        help="a results directory logged outside the sweep whose run page is shown")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "assets", help="where the PNGs go")
    args = parser.parse_args(argv)
    from tests.test_tracking_server import free_port, mlflow_server

    with tempfile.TemporaryDirectory(prefix="mlflow-shots-") as tmp:
        root = Path(tmp)
        with mlflow_server(root / "server", free_port()) as uri, chromium(root / "chromium") as browser:
            page_run = log_runs(uri, [args.page])[1][0] if args.page else None
            experiment_id, run_ids = log_runs(uri, args.results, args.sweep)
            take(uri, experiment_id, run_ids, args.sweep, args.out, browser, page_run=page_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
