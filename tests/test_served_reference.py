"""The staged production comparison (harness.job.served_reference): the reference and the candidate both served.

Against independent references: the same items through an in-process reference and a served candidate (the
comparison the harness already trusts) give the same answers on both sides; the two-sided top-k KL bound is checked
against the in-process one it must not exceed; the KL conversion of a server's top-k into a stored reference
against a loop over the cells written here; the HTTP client's rate pacing and 429 handling against a scripted
server's clock (no engine here produces a 429). The real two-vLLM-server run is in tests/test_endpoint_vllm.py's
tier (slow, needs .venv-engine).
"""
from __future__ import annotations

import copy
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from harness import cli
from harness.config import to_config
from harness.divergence import topk_bound
from harness.engines.openai_http import Client, EndpointError, EndpointSpec
from harness.job import pipeline as run_mod
from harness.job.served_reference import as_reference_text, check_same_requests
from harness.models import loading as models
from tests.conftest import TINY_MATH

sys.path.insert(0, str(Path(__file__).parent))
from fake_openai import FakeServer  # noqa: E402

SMALL = [*TINY_MATH, "slices.math.n_items=8", "eval.max_gen_toks=12"]


def _perturbed(model: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(scale * parameter.abs().mean() * torch.randn(parameter.shape, generator=generator))
    return other


def _results(root: Path) -> Path:
    (found,) = [d for d in (root / "results").iterdir() if (d / "summary.json").exists()]
    return found


@pytest.mark.slow
def test_both_sides_served_pair_as_an_in_process_reference_would(make_cfg, tmp_path):
    base = to_config(make_cfg(*SMALL, "quant=none"))
    loaded = models.load(base.model, base.paths.cache_dir)
    candidate_model = _perturbed(loaded.model)
    with FakeServer(loaded.model, loaded.tokenizer, name="deployed") as ref_server, \
            FakeServer(candidate_model, loaded.tokenizer, name="candidate") as cand_server:
        staged = run_mod.run(make_cfg(*SMALL, "quant=external", f"candidate.endpoint={cand_server.url}",
                                      f"reference.endpoint={ref_server.url}", "paths.results_dir=" +
                                      str(tmp_path / "staged" / "results")))
        in_process = run_mod.run(make_cfg(*SMALL, "quant=external", f"candidate.endpoint={cand_server.url}",
                                          "paths.results_dir=" + str(tmp_path / "inproc" / "results")))
    staged_dir, inproc_dir = _results(tmp_path / "staged"), _results(tmp_path / "inproc")
    a = pd.read_parquet(staged_dir / "items.parquet").set_index("item_id").sort_index()
    b = pd.read_parquet(inproc_dir / "items.parquet").set_index("item_id").sort_index()
    assert list(a.index) == list(b.index) and len(a) == 16
    # the reference served gives the in-process reference's answers (same model, another implementation), and the
    # candidate's answers are the same candidate's
    assert (a["response_ref"] == b["response_ref"]).all() and (a["correct_ref"] == b["correct_ref"]).all()
    assert (a["response_quant"] == b["response_quant"]).all()
    params = staged["candidate"]
    assert params["reference.served"] is True and params["reference.served_model"] == "deployed"
    assert params["reference.endpoint_requests"] > 0
    assert "both sides served" in params["candidate.divergence"] and "LOWER BOUND" in params["candidate.divergence"]
    # the two-sided bound merges more tokens into the rest than the one-sided bound: never above it, per token
    ta = pd.read_parquet(staged_dir / "tokens.parquet").sort_values(["slice", "text", "position"])
    tb = pd.read_parquet(inproc_dir / "tokens.parquet").sort_values(["slice", "text", "position"])
    assert len(ta) == len(tb) > 0
    assert (ta["kl"].to_numpy() <= tb["kl"].to_numpy() + 1e-9).all()
    assert ta["kl"].mean() > 0  # the perturbed candidate differs, and the bound sees it
    # NLL and top-1 are exact on both sides: equal to the in-process reference's up to float rounding
    assert np.allclose(ta["nll_ref"].to_numpy(), tb["nll_ref"].to_numpy(), atol=1e-3)
    assert np.allclose(ta["nll_quant"].to_numpy(), tb["nll_quant"].to_numpy(), atol=1e-6)
    assert "both sides served" in (staged_dir / "report.md").read_text()
    assert in_process["candidate"].get("reference.served") is None
    assert staged["reference"].startswith("the served reference (at http://127.0.0.1:")  # not model='s weights
    assert in_process["reference"].startswith("the reference (random weights")


@pytest.mark.parametrize("overrides, message", [
    (["quant=int8", "reference.endpoint=http://127.0.0.1:9"], "pairs it with a served candidate"),
    (["quant=external", "candidate.endpoint=http://127.0.0.1:9", "reference.endpoint=http://u:sk-secret@127.0.0.1:8"],
     "reference.endpoint has credentials"),
    (["quant=external", "candidate.endpoint=http://127.0.0.1:9", "reference.serve='vllm serve d --port 8000'"],
     r"reference.serve=.*has no \{port\}"),
    (["quant=external", "candidate.endpoint=http://127.0.0.1:9", "reference.endpoint=http://127.0.0.1:8",
      "reference.serve='x --port {port}'"], "not both"),
])
def test_a_served_reference_that_cannot_pair_or_would_log_a_secret_fails_before_work(make_cfg, overrides, message):
    with pytest.raises(cli.UsageError, match=message) as err:
        run_mod.run(make_cfg(*TINY_MATH, *overrides))
    assert "sk-secret" not in str(err.value)


def test_a_servers_top_k_becomes_a_stored_reference_whose_bound_matches_a_loop_over_the_cells():
    rng = np.random.default_rng(0)
    vocab, n, k = 40, 6, 5
    p = np.exp(rng.normal(0, 2, (n, vocab)))
    p /= p.sum(-1, keepdims=True)
    q = np.exp(rng.normal(0, 2, (n, vocab)))
    q /= q.sum(-1, keepdims=True)
    ids = torch.arange(n + 1)  # the text's tokens: position i predicts token i+1
    targets = ids[1:].numpy()

    def served(dist):
        top = np.argsort(-dist, -1)[:, :k]
        return topk_bound.ServedLogprobs(np.log(dist[np.arange(n), targets]), top,
                                         np.log(np.take_along_axis(dist, top, -1)), k)

    ref = as_reference_text(ids, served(p), prompt_tokens=2)
    assert ref.top1.tolist() == np.argmax(p, -1).tolist()
    assert np.allclose(ref.target_logp.numpy(), np.log(p[np.arange(n), targets]))
    rows = topk_bound.served_rows(ref, served(q), "s", 0)
    for row in range(n):  # the partition: tokens both named, each a cell; the rest one cell
        cells = sorted(set(np.argsort(-p[row])[:k]) & set(np.argsort(-q[row])[:k]))
        forward = sum(p[row, c] * np.log(p[row, c] / q[row, c]) for c in cells)
        p_rest, q_rest = 1 - p[row, cells].sum(), 1 - q[row, cells].sum()
        forward += p_rest * np.log(p_rest / q_rest)
        assert rows["kl"].iloc[row] == pytest.approx(forward, rel=1e-9, abs=1e-12)
    assert rows["kind"].tolist() == ["prompt"] + ["reply"] * (n - 1)


def test_requests_that_differ_between_the_two_servers_are_refused_naming_the_item():
    ref = pd.DataFrame({"item_id": ["a", "b"], "prompt": ["p1", "p2"], "max_gen_toks": [32, 32]})
    assert check_same_requests(ref, ref.copy()) == 2
    cand = ref.assign(max_gen_toks=[32, 64])
    with pytest.raises(cli.UsageError, match="item b was asked differently.*max_gen_toks differs in 1 of 2"):
        check_same_requests(ref, cand)


class _Scripted:
    """A /v1/completions stub that answers 429 (with Retry-After) to its first ``limited`` requests and records
    when each request arrived: the client's pacing and waiting are read off its clock."""

    def __init__(self, limited: int = 0, retry_after: str = "0.2"):
        self.limited, self.retry_after, self.arrivals = limited, retry_after, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.arrivals.append(time.monotonic())
                if len(outer.arrivals) <= outer.limited:
                    body, code = b'{"error": {"message": "slow down"}}', 429
                else:
                    body, code = json.dumps({"choices": [{"index": 0, "text": "ok"}]}).encode(), 200
                self.send_response(code)
                if code == 429:
                    self.send_header("Retry-After", outer.retry_after)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_the_client_paces_requests_to_the_rate_limit_across_threads():
    server = _Scripted()
    try:
        client = Client(EndpointSpec(url=server.url, model="m", max_requests_per_s=20.0))
        threads = [threading.Thread(target=lambda: client.complete(prompt="x")) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        arrivals = sorted(server.arrivals)
        assert len(arrivals) == 8
        # 20 per second: starts 50 ms apart, so 8 requests span at least 7 x 50 ms (less the scheduler's jitter on
        # the two ends); unpaced, eight threads arrive within a few ms
        assert arrivals[-1] - arrivals[0] > 0.33
    finally:
        server.close()


def test_a_429_is_waited_out_for_its_retry_after_and_too_many_end_the_run_in_one_line():
    server = _Scripted(limited=2, retry_after="0.3")
    try:
        client = Client(EndpointSpec(url=server.url, model="m", role="reference"))
        assert client.complete(prompt="x")[0]["text"] == "ok"
        assert client.rate_limited == 2 and len(server.arrivals) == 3
        assert min(np.diff(server.arrivals)) >= 0.3  # Retry-After honoured
    finally:
        server.close()
    server = _Scripted(limited=10, retry_after="0")
    try:
        client = Client(EndpointSpec(url=server.url, model="m", role="reference", retries_429=2))
        with pytest.raises(EndpointError, match=r"reference endpoint .*HTTP 429.*lower reference\.endpoint_max_req"):
            client.complete(prompt="x")
        assert len(server.arrivals) == 3
    finally:
        server.close()


@pytest.mark.slow
def test_a_served_reference_that_dies_mid_slice_ends_in_one_line_and_the_same_command_resumes(make_cfg, tmp_path):
    base = to_config(make_cfg(*SMALL, "quant=none"))
    loaded = models.load(base.model, base.paths.cache_dir)
    from harness.engines.vllm_serve import free_port

    port = free_port()  # the same URL both times: a served reference's URL is part of the run's key
    with FakeServer(loaded.model, loaded.tokenizer, name="candidate") as cand_server:
        overrides = [*SMALL, "quant=external", f"candidate.endpoint={cand_server.url}",
                     f"reference.endpoint=http://127.0.0.1:{port}"]
        with FakeServer(loaded.model, loaded.tokenizer, name="deployed", die_after=5, port=port):
            with pytest.raises(Exception, match=r"^reference endpoint http://127.0.0.1:\d+/v1: .*the same command "
                                                r"resumes") as err:
                run_mod.run(make_cfg(*overrides))
        assert "\n" not in str(err.value)
        with FakeServer(loaded.model, loaded.tokenizer, name="deployed", port=port) as again:
            result = run_mod.run(make_cfg(*overrides))
        assert result["metrics"]["math/n"] == 16
        with FakeServer(loaded.model, loaded.tokenizer, name="deployed", port=port) as fresh:
            run_mod.run(make_cfg(*overrides, "force=true"))  # the whole run asked again, for the count
        # the answers given before the failure were not asked again
        assert 0 < again.completions < fresh.completions
