"""Serving speed (harness.engines.perf): the figures against hand-computed values, then against a scripted
OpenAI-compatible server whose delays are known (first token after D0 seconds, each further token after D1), with
a Prometheus /metrics that counts what it served, as vLLM's does."""
from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pandas as pd
import pytest

from harness.config import PerfConfig
from harness.engines import perf
from harness.engines.perf import LevelResult, RequestTiming


def _timing(prompt: int, ttft: float, gap: float, tokens: int) -> RequestTiming:
    return RequestTiming(prompt=prompt, ttft=ttft, e2e=ttft + gap * (tokens - 1), output_tokens=tokens,
                         itl=[gap] * (tokens - 1), chunks=tokens)


def test_summary_figures_equal_a_hand_computation():
    timings = [_timing(k, ttft=0.1 * (k + 1), gap=0.01, tokens=11) for k in range(4)]  # e2e 0.2, 0.3, 0.4, 0.5
    summary = perf.summarize(timings, wall_s=2.0, concurrency=1, n_resamples=200)
    assert summary["requests"] == 4 and summary["output_tokens"] == 44
    assert summary["output_tok_s"] == pytest.approx(44 / 2.0) and summary["requests_s"] == pytest.approx(2.0)
    assert summary["ttft_p50"] == pytest.approx(0.25)  # the median of 0.1 .. 0.4
    assert summary["e2e_p90"] == pytest.approx(0.47)  # numpy's linear interpolation: 0.4 + 0.7 * 0.1
    assert summary["tpot_p50"] == pytest.approx(0.01) and summary["itl_p99"] == pytest.approx(0.01)
    assert summary["ttft_p50_ci_low"] <= 0.25 <= summary["ttft_p50_ci_high"]
    assert summary["output_tok_s_ci_low"] <= summary["output_tok_s"] <= summary["output_tok_s_ci_high"]
    errored = perf.summarize([RequestTiming(prompt=0, error="HTTP 500")], wall_s=1.0, concurrency=1)
    assert errored["errors"] == 1 and "output_tok_s" not in errored


def test_speedup_is_the_paired_ratio_of_throughputs():
    ref = [_timing(k, 0.1, 0.02 * (1 + k / 10), 9) for k in range(6)]
    cand = [_timing(k, 0.05, 0.01 * (1 + k / 10), 9) for k in range(6)]
    ref_level = LevelResult(1, 3.0, perf.summarize(ref, 3.0, 1, n_resamples=300), ref)
    cand_level = LevelResult(1, 1.5, perf.summarize(cand, 1.5, 1, n_resamples=300), cand)
    found = perf.speedup(cand_level, ref_level, n_resamples=300)
    assert found["speedup"] == pytest.approx(2.0)  # 54 tokens in 1.5 s against 54 in 3.0 s
    assert found["speedup_ci_low"] <= 2.0 <= found["speedup_ci_high"]
    assert found["ttft_p50_speedup"] == pytest.approx(2.0)
    result = {"levels": [{"concurrency": 1, **found}]}
    assert "SLOWER" not in perf.headline(result)
    slow = perf.speedup(ref_level, cand_level, n_resamples=300)
    assert perf.headline({"levels": [{"concurrency": 1, **slow}]}, "fp8").startswith("SLOWER than the reference: fp8")


def test_prometheus_deltas_and_server_log_facts():
    before = perf.parse_prometheus('# HELP x\nvllm:time_to_first_token_seconds_sum{model_name="m"} 1.5\n'
                                   'vllm:time_to_first_token_seconds_count{model_name="m"} 3\n'
                                   'vllm:time_to_first_token_seconds_bucket{le="0.1"} 1\n'
                                   'vllm:generation_tokens_total{model_name="m"} 30\n')
    after = perf.parse_prometheus('vllm:time_to_first_token_seconds_sum{model_name="m"} 2.5\n'
                                  'vllm:time_to_first_token_seconds_count{model_name="m"} 7\n'
                                  'vllm:generation_tokens_total{model_name="m"} 70\n'
                                  'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n')
    delta = perf.engine_metrics_delta(before, after)
    assert delta["ttft_s_mean"] == pytest.approx(1.0 / 4) and delta["generation_tokens"] == 40
    assert delta["kv_cache_usage"] == 0.25
    assert perf.engine_metrics_delta(None, after) == {}
    log = ("INFO 12-06 [gpu_model_runner.py] Model loading took 0.5 GiB memory and 1.2 seconds\n"
           "INFO [kv_cache_utils.py] KV cache size: 43,680 tokens\n"
           "INFO [kv_cache_utils.py] Maximum concurrency for 4,096 tokens per request: 10.66x\n")
    assert perf.server_log_facts(log) == {"weights_gib": 0.5, "kv_cache_tokens": 43680, "max_concurrency": 10.66}
    cpu = ("(Worker pid=7618) INFO 12-06 08:06:19 [weight_utils.py:1108] Filesystem type for checkpoints: EXT4. "
           "Checkpoint size: 0.21 GiB. Available RAM: 19.88 GiB.\n"
           "(Worker pid=7618) INFO 12-06 08:06:22 [cpu_worker.py:260] Explicitly set (1.0/23.54) GiB for KV cache on "
           "node 0.\n(EngineCore pid=7554) INFO 12-06 08:06:22 [kv_cache_utils.py:2327] CPU KV cache size: 23,296 "
           "tokens, Maximum concurrency for 4,096 tokens per request: 5.69x\n")  # vLLM 0.32's CPU build
    assert perf.server_log_facts(cpu) == {"checkpoint_gib": 0.21, "kv_cache_gib": 1.0, "kv_cache_tokens": 23296,
                                          "max_concurrency": 5.69}


def test_prompts_come_from_the_runs_generation_items(tmp_path):
    items = pd.DataFrame({"item_id": [f"t/{k:02d}" for k in range(10)] + ["mc/0"],
                          "output_type": ["generate_until"] * 10 + ["multiple_choice"],
                          "prompt": [f"prompt {k}" for k in range(10)] + ["a choice"]})
    items.to_parquet(tmp_path / "items.parquet", index=False)
    assert perf.prompts_from_run(tmp_path, 3) == ["prompt 0", "prompt 4", "prompt 9"]
    items.drop(columns="prompt").to_parquet(tmp_path / "items.parquet", index=False)
    with pytest.raises(perf.EndpointError, match="no prompt column"):
        perf.prompts_from_run(tmp_path, 3)


class _Scripted(BaseHTTPRequestHandler):
    """Streams ``tokens`` tokens: the first after ``d0`` seconds, each next after ``d1`` (set per server class)."""

    d0 = d1 = 0.0
    counts = {"requests": 0, "tokens": 0}

    def log_message(self, *args):
        pass

    def _json(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.endswith("/models"):
            return self._json({"data": [{"id": "scripted"}]})
        if self.path == "/metrics":
            c = type(self).counts
            text = (f"vllm:time_to_first_token_seconds_sum {c['requests'] * self.d0}\n"
                    f"vllm:time_to_first_token_seconds_count {c['requests']}\n"
                    f"vllm:generation_tokens_total {c['tokens']}\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
            return
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        tokens = int(body["max_tokens"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for k in range(tokens):
            time.sleep(self.d0 if k == 0 else self.d1)
            self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{k}'}]})}\n\n".encode())
            self.wfile.flush()
        # counted before the stream ends (the client may scrape /metrics the moment it reads [DONE])
        counts = type(self).counts
        counts["requests"] += 1
        counts["tokens"] += tokens
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": tokens}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True


def _server(d0: float, d1: float):
    handler = type("Handler", (_Scripted,), {"d0": d0, "d1": d1, "counts": {"requests": 0, "tokens": 0}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_measurement_against_a_scripted_server_with_known_delays():
    settings = PerfConfig(concurrency=[1, 4], n_prompts=4, rounds=2, max_tokens=5, warmup=1, n_resamples=200)
    prompts = ["a", "bb", "ccc", "dddd"]
    slow, slow_url = _server(0.08, 0.04)  # e2e 0.08 + 4 x 0.04 = 0.24 s
    fast, fast_url = _server(0.04, 0.02)  # 0.12 s: twice as fast
    try:
        ref = perf.measure_endpoint(slow_url, prompts, settings, label="reference")
        cand = perf.measure_endpoint(fast_url, prompts, settings, label="candidate")
    finally:
        slow.shutdown()
        fast.shutdown()
    one = ref[0].summary
    # a sleep never ends early; the slack above is the machine's (a shared 2-core machine)
    assert 0.08 <= one["ttft_p50"] < 0.08 + 0.06
    assert 0.04 <= one["itl_p50"] < 0.04 + 0.03 and 0.04 <= one["tpot_p50"] < 0.04 + 0.03
    assert 0.24 <= one["e2e_p50"] < 0.24 + 0.15
    assert one["requests"] == 8 and one["output_tokens"] == 40  # the server's own usage count
    assert 0.6 * 5 / 0.24 < one["output_tok_s"] <= 5 / 0.24  # one at a time: tokens per request / e2e
    four = ref[1].summary
    assert four["output_tok_s"] > 2.0 * one["output_tok_s"]  # 4 in flight on a server that serves them in parallel
    assert ref[0].engine["ttft_s_mean"] == pytest.approx(0.08) and ref[0].engine["generation_tokens"] == 40
    result = perf.assemble({"reference": {"levels": ref}, "candidate": {"levels": cand}}, settings, prompts=prompts)
    for level in result["levels"]:
        assert 1.4 < level["speedup"] < 2.6  # hand-computed: 0.24 / 0.12 = 2
        assert level["speedup_ci_low"] <= level["speedup"] <= level["speedup_ci_high"]
    flat = perf.flat_metrics(result)
    assert flat["perf/c1/speedup"] == result["levels"][0]["speedup"]
    assert flat["perf/c4/candidate/output_tok_s"] == result["levels"][1]["candidate"]["output_tok_s"]
    assert all(key.startswith("perf/c") and math.isfinite(value) for key, value in flat.items())
    assert "faster than the reference" in perf.headline(result) or "not shown faster" in perf.headline(result)
    table = perf.perf_markdown(result)
    assert table.count("| candidate |") == 2 and "0.080" in table  # the engine's own TTFT mean, from /metrics
