"""The comparison's HTML page, checked in a real headless Chromium (Debian's package).

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
NUL-separated JSON on file descriptors 3 and 4), so no websocket library is needed. The
page must load without console errors, exceptions or failed loads; its tables must hold
the report's rows; every image must be a PNG data URI that the browser decodes to a
non-empty bitmap; the full-page screenshot must not be blank. The screenshot is kept in
``results/test-artifacts/`` ($HARNESS_TEST_ARTIFACTS overrides). A second test feeds the
same checks a broken page, so a checker that sees nothing fails.

Without Chromium the tests skip, unless HARNESS_REQUIRE_SYSTEM_TESTS=1 (then they fail).
"""
from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from PIL import Image

from harness.compare import CompareOptions, analyse, write_report
from harness.config import REPO_DIR
from tests.test_compare import synthetic_runs

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe"]
TIMEOUT_S = 60.0


def chromium_binary() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.environ.get("HARNESS_REQUIRE_SYSTEM_TESTS") == "1":
        pytest.fail("chromium is not installed but HARNESS_REQUIRE_SYSTEM_TESTS=1; run scripts/system_deps.sh as root")
    pytest.skip("chromium not installed (scripts/system_deps.sh installs it); HARNESS_REQUIRE_SYSTEM_TESTS=1 fails")


class DevTools:
    """A minimal DevTools-protocol client over Chromium's debugging pipe (one page session)."""

    def __init__(self, binary: str, profile: Path) -> None:
        to_browser_read, self._write_fd = os.pipe()
        self._read_fd, from_browser_write = os.pipe()
        # The browser reads fd 3 and writes fd 4. bash maps our pipe ends there (dash cannot name
        # fds above 9); they are
        # first moved to fds >= 10 so the mapping cannot clobber one with the other.
        child_read = fcntl.fcntl(to_browser_read, fcntl.F_DUPFD, 10)
        child_write = fcntl.fcntl(from_browser_write, fcntl.F_DUPFD, 10)
        os.close(to_browser_read)
        os.close(from_browser_write)
        wiring = f'exec "$0" "$@" 3<&{child_read} 4>&{child_write} {child_read}<&- {child_write}>&-'
        self.stderr_path = profile / "chromium.stderr"
        with open(self.stderr_path, "wb") as stderr:
            command = [shutil.which("bash") or "/bin/bash", "-c", wiring, binary, *FLAGS,
                       f"--user-data-dir={profile}", "about:blank"]
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=stderr, pass_fds=(child_read, child_write))
        os.close(child_read)
        os.close(child_write)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.session: str | None = None

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.process.poll() is not None:
                raise TimeoutError(f"no DevTools message from Chromium (exit code {self.process.poll()}); "
                                   f"its stderr: {self.stderr_path}")
            ready, _, _ = select.select([self._read_fd], [], [], min(remaining, 1.0))
            if ready:
                chunk = os.read(self._read_fd, 1 << 20)
                if not chunk:
                    raise ConnectionError(f"Chromium closed the debugging pipe; stderr: {self.stderr_path}")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, params: dict | None = None, *, session: bool = True) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self._write_fd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method} failed: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str) -> dict:
        deadline = time.monotonic() + TIMEOUT_S
        for event in self.events:
            if event.get("method") == method:
                return event
        while True:
            event = self._receive(deadline)
            self.events.append(event)
            if event.get("method") == method:
                return event

    def open_page(self, url: str) -> None:
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": 1400, "height": 1000, "deviceScaleFactor": 1, "mobile": False})
        self.call("Page.navigate", {"url": url})
        self.wait_for("Page.loadEventFired")

    def problems(self) -> list[str]:
        """Console errors/asserts, uncaught exceptions and error-level log entries (e.g. failed loads)."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append("console." + params["type"] + ": " + " ".join(
                    str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                found.append("exception: " + params["exceptionDetails"].get("text", ""))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append("log: " + params["entry"].get("text", ""))
        return found

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"]["value"]

    def screenshot(self, max_height: int = 12000) -> bytes:
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], max_height), "scale": 1}
        shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip})
        return base64.b64decode(shot["data"])

    def close(self) -> None:
        try:
            self.call("Browser.close", session=False)
        except (RuntimeError, TimeoutError, ConnectionError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._write_fd)
        os.close(self._read_fd)


PAGE_FACTS = """
(async () => {
  const images = await Promise.all([...document.images].map(async (img) => {
    let decoded = true;
    try { await img.decode(); } catch (e) { decoded = false; }
    return {plot: img.dataset.plot || "", decoded, width: img.naturalWidth, height: img.naturalHeight,
            prefix: img.getAttribute("src").slice(0, 22)};
  }));
  const tables = [...document.querySelectorAll("table")].map((t) => ({
    css: t.className, rows: t.tBodies[0] ? t.tBodies[0].rows.length : 0,
    text: t.innerText, visible: t.getBoundingClientRect().height > 0}));
  return {images, tables, title: document.title};
})()
"""


@pytest.fixture
def browser(tmp_path):
    binary = chromium_binary()
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    tools = DevTools(binary, profile)
    yield tools
    tools.close()


def artifact_dir() -> Path:
    directory = Path(os.environ.get("HARNESS_TEST_ARTIFACTS", REPO_DIR / "results" / "test-artifacts"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@pytest.mark.slow
def test_comparison_page_renders_in_chromium(browser, tmp_path):
    report = analyse(synthetic_runs(), CompareOptions(n_resamples=300, margin=0.02))
    written = write_report(report, tmp_path / "report")
    pngs = {name: path for name, path in written.items() if path.suffix == ".png"}
    browser.open_page(written["html"].resolve().as_uri())
    facts = browser.evaluate(PAGE_FACTS)

    assert browser.problems() == []
    assert facts["title"] == f"Comparison: {report.name}"
    tables = {t["css"]: t for t in facts["tables"]}
    assert tables["matrix"]["rows"] == len(report.labels) and tables["matrix"]["visible"]
    assert tables["details"]["rows"] == len(report.headline())
    assert tables["subslices"]["rows"] == int((report.item_stats["level"] == "sub_slice").sum())
    assert "positions" in tables  # the long-context rows span several position buckets
    for css in ("details", "subslices"):  # the cluster count stands beside n
        assert "\tn\tclusters\t" in tables[css]["text"], css
    for label in report.labels:
        assert label in tables["matrix"]["text"]
    assert "worse" in tables["details"]["text"]  # int4 on math: 9 right->wrong vs 1
    images = {img["plot"]: img for img in facts["images"]}
    assert set(images) == set(pngs)
    for name, img in images.items():
        assert img["prefix"] == "data:image/png;base64," and img["decoded"], name
        with Image.open(pngs[name]) as png:
            assert (img["width"], img["height"]) == png.size and png.size[0] > 0 and png.size[1] > 0, name

    shot = browser.screenshot()
    path = artifact_dir() / "comparison_report.png"
    path.write_bytes(shot)
    print(f"screenshot of the comparison page: {path}")
    with Image.open(io.BytesIO(shot)) as image:
        assert image.format == "PNG" and image.size[0] >= 1000 and image.size[1] > 1000
        colours = image.convert("RGB").resize((200, 200)).getcolors(maxcolors=200 * 200)
        assert colours is not None and len(colours) > 50  # not blank: text, tables and plots


@pytest.mark.slow
def test_checks_catch_a_broken_page(browser, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><head><meta charset="utf-8"><link rel="icon" href="data:,">'
                    "<title>broken</title></head><body><table><tbody><tr><td>x</td></tr></tbody></table>"
                    '<img data-plot="bad" src="data:image/png;base64,AAAA">'
                    '<script>console.error("deliberate error"); undefinedFunction();</script></body></html>')
    browser.open_page(page.as_uri())
    facts = browser.evaluate(PAGE_FACTS)
    problems = browser.problems()
    assert any("deliberate error" in p for p in problems)
    assert any(p.startswith("exception") for p in problems)
    assert facts["images"] == [{"plot": "bad", "decoded": False, "width": 0, "height": 0,
                                "prefix": "data:image/png;base64,"}]
