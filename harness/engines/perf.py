"""Serving speed measured on the engine: a candidate's server against the reference's own weights on the same engine.

Against any OpenAI-compatible server (streaming ``/v1/completions``), on a slice's own prompts (as the model
saw them, from a run's ``items.parquet``), at each concurrency level of ``perf.concurrency`` (a closed
loop: that many requests always in flight, each prompt sent ``perf.rounds`` times), per request:

- time to first token (TTFT): from sending the request to the first streamed chunk holding text;
- inter-token latency (ITL): the gaps between successive streamed chunks (a chunk is one token on vLLM);
  time per output token (TPOT) per request: ``(e2e − TTFT) / (output tokens − 1)``;
- end-to-end latency (e2e): from sending to the last byte;
- output tokens: the server's own count (``usage`` of the stream's last chunk), else the chunks counted;

and per level: output tokens/s and requests/s over the level's wall clock. Each figure has an interval
from a bootstrap over prompts (a prompt's repeats resampled together), and the candidate's speed-up over
the reference (output tokens/s, candidate / reference) a paired one: the same resampled prompts on both
sides. Throughput intervals are the wall-clock figure scaled by the bootstrap distribution of the
steady-state estimate ``concurrency × Σ tokens / Σ e2e`` (Little's law) relative to its value on all
requests. With ``perf.ignore_eos`` (default) both sides generate exactly ``perf.max_tokens`` tokens per
request (vLLM's ``ignore_eos``), so the same work is timed.

Beside the client's timings, what the engine itself reports: vLLM's Prometheus ``/metrics`` scraped before
and after each level (means of its TTFT, inter-token, e2e, queue, prefill and decode histograms, tokens
counted, KV-cache use), and from its log the weight memory and KV-cache capacity. Beside those, the capacity
ledger's prediction for the run that was measured (:mod:`harness.sizing.measured`, which reads the ledger): the
scheme's and the BF16 reference's weight memory and batch-1 decode floor on the device, with measured ÷ predicted.

:func:`measure_pair` starts each server with :class:`~harness.engines.vllm_serve.ServedProcess`;
:func:`measure_endpoint` measures a running one. :func:`flat_metrics` and :func:`headline` give a result's
``perf/...`` metrics and one line for summaries and MLflow; :func:`perf_markdown` its table.
"""
from __future__ import annotations

import json
import logging
import math
import queue
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from harness.config import PerfConfig
from harness.engines.openai_http import Client, EndpointError, EndpointSpec, _v1

log = logging.getLogger(__name__)

__all__ = ["LevelResult", "RequestTiming", "device_name", "engine_metrics_delta", "flat_metrics",
           "headline", "measure_endpoint", "measure_pair", "measured_weight_gb", "parse_prometheus", "perf_markdown",
           "predicted_markdown", "prompts_from_run", "run_level", "server_log_facts",
           "speedup", "stream_one", "summarize"]

# vLLM's Prometheus histograms read as means over a level (name without the vllm: prefix -> label here)
ENGINE_HISTOGRAMS = {"time_to_first_token_seconds": "ttft_s", "inter_token_latency_seconds": "itl_s",
                     "e2e_request_latency_seconds": "e2e_s", "request_queue_time_seconds": "queue_s",
                     "request_prefill_time_seconds": "prefill_s", "request_decode_time_seconds": "decode_s",
                     # older vLLM names of the inter-token histogram
                     "time_per_output_token_seconds": "itl_s"}
ENGINE_COUNTERS = {"generation_tokens_total": "generation_tokens", "prompt_tokens_total": "prompt_tokens",
                   "num_preemptions_total": "preemptions", "request_success_total": "requests"}
ENGINE_GAUGES = {"kv_cache_usage_perc": "kv_cache_usage", "gpu_cache_usage_perc": "kv_cache_usage"}


@dataclass
class RequestTiming:
    """One streamed request, times in seconds from sending it."""

    prompt: int  # index of the prompt
    ttft: float = math.nan
    e2e: float = math.nan
    output_tokens: int = 0
    prompt_tokens: int | None = None
    itl: list[float] = field(default_factory=list)  # gaps between successive text chunks
    chunks: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


def stream_one(base: str, model: str, prompt: str, index: int, *, max_tokens: int, ignore_eos: bool,
               timeout_s: float, headers: dict[str, str]) -> RequestTiming:
    """One streaming ``/v1/completions`` request, timed as the module says (``base``: the server's /v1 URL)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM (and llama.cpp's server) extension: generate max_tokens tokens
    timing = RequestTiming(prompt=index)
    request = urllib.request.Request(base + "/completions", data=json.dumps(body).encode(), headers=headers,
                                     method="POST")
    start = time.perf_counter()
    last = None
    usage = None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            for raw in response:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - start
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                text = "".join(str(choice.get("text") or "") for choice in chunk.get("choices") or [])
                if not text:
                    continue
                timing.chunks += 1
                if last is None:
                    timing.ttft = now
                else:
                    timing.itl.append(now - last)
                last = now
        timing.e2e = time.perf_counter() - start
    except urllib.error.HTTPError as exc:
        timing.error = f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:200]}"
    except (OSError, ValueError) as exc:
        timing.error = f"{exc.__class__.__name__}: {exc}"
    if usage:
        timing.output_tokens = int(usage.get("completion_tokens") or timing.chunks)
        timing.prompt_tokens = usage.get("prompt_tokens")
    else:
        timing.output_tokens = timing.chunks
    return timing


def run_level(base: str, model: str, prompts: Sequence[str], concurrency: int, rounds: int, *, max_tokens: int,
              ignore_eos: bool, timeout_s: float, headers: dict[str, str]) -> tuple[list[RequestTiming], float]:
    """Every prompt ``rounds`` times with ``concurrency`` requests always in flight; the timings and the wall clock."""
    work: queue.Queue = queue.Queue()
    for _ in range(rounds):
        for index in range(len(prompts)):
            work.put(index)
    done: list[RequestTiming] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                index = work.get_nowait()
            except queue.Empty:
                return
            timing = stream_one(base, model, prompts[index], index, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                timeout_s=timeout_s, headers=headers)
            with lock:
                done.append(timing)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return done, time.perf_counter() - start


def _quantile(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else math.nan


def _by_prompt(timings: Sequence[RequestTiming]) -> dict[int, list[RequestTiming]]:
    groups: dict[int, list[RequestTiming]] = {}
    for timing in timings:
        groups.setdefault(timing.prompt, []).append(timing)
    return groups


def _steady(timings: Iterable[RequestTiming], concurrency: int) -> float:
    """Little's law: ``concurrency × Σ output tokens / Σ e2e`` (tokens/s with that many always in flight)."""
    timings = list(timings)
    seconds = sum(t.e2e for t in timings)
    return concurrency * sum(t.output_tokens for t in timings) / seconds if seconds > 0 else math.nan


def _resamples(prompts: Sequence[int], n_resamples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, len(prompts), size=(n_resamples, len(prompts)))


def _interval(replicates: np.ndarray, ci_level: float) -> tuple[float, float]:
    replicates = replicates[np.isfinite(replicates)]
    if not len(replicates):
        return math.nan, math.nan
    tail = (1 - ci_level) / 2
    return float(np.quantile(replicates, tail)), float(np.quantile(replicates, 1 - tail))


@dataclass
class LevelResult:
    """One side at one concurrency level: its summary (:func:`summarize`) and its requests."""

    concurrency: int
    wall_s: float
    summary: dict[str, float]
    timings: list[RequestTiming]
    engine: dict[str, float] = field(default_factory=dict)  # the engine's own /metrics over the level


def summarize(timings: Sequence[RequestTiming], wall_s: float, concurrency: int, *, n_resamples: int = 2000,
              seed: int = 0, ci_level: float = 0.95) -> dict[str, float]:
    """Percentiles of TTFT, TPOT, ITL and e2e, output tokens/s and requests/s, each with its bootstrap interval."""
    good = [t for t in timings if not t.error]
    out: dict[str, float] = {"requests": len(good), "errors": len(timings) - len(good),
                             "output_tokens": sum(t.output_tokens for t in good), "wall_s": wall_s}
    if not good:
        return out
    out["output_tok_s"] = out["output_tokens"] / wall_s
    out["requests_s"] = len(good) / wall_s
    groups = _by_prompt(good)
    keys = sorted(groups)
    draws = _resamples(keys, n_resamples, seed)
    per = {"ttft": lambda ts: np.array([t.ttft for t in ts]), "tpot": lambda ts: np.array([t.tpot for t in ts]),
           "e2e": lambda ts: np.array([t.e2e for t in ts]),
           "itl": lambda ts: np.array([gap for t in ts for gap in t.itl])}
    for name, values_of in per.items():
        values = values_of(good)
        values = values[np.isfinite(values)]
        out[f"{name}_mean"] = float(values.mean()) if len(values) else math.nan
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = _quantile(values, q / 100)
        replicates = {q: [] for q in (50, 90, 99)}
        for draw in draws:
            sample = values_of([t for k in draw for t in groups[keys[k]]])
            sample = sample[np.isfinite(sample)]
            for q in replicates:
                replicates[q].append(_quantile(sample, q / 100))
        for q, found in replicates.items():
            out[f"{name}_p{q}_ci_low"], out[f"{name}_p{q}_ci_high"] = _interval(np.array(found), ci_level)
    steady = _steady(good, concurrency)
    ratios = np.array([_steady([t for k in draw for t in groups[keys[k]]], concurrency) for draw in draws]) / steady
    low, high = _interval(ratios, ci_level)
    for name in ("output_tok_s", "requests_s"):
        out[f"{name}_ci_low"], out[f"{name}_ci_high"] = out[name] * low, out[name] * high
    return out


def speedup(candidate: LevelResult, reference: LevelResult, *, n_resamples: int = 2000, seed: int = 0,
            ci_level: float = 0.95) -> dict[str, float]:
    """Output tokens/s of the candidate over the reference's, with a paired bootstrap interval over the prompts
    both answered (the same resampled prompts on both sides); e2e p50 and TTFT p50 ratios (reference / candidate,
    so above 1 is faster too)."""
    cand = _by_prompt([t for t in candidate.timings if not t.error])
    ref = _by_prompt([t for t in reference.timings if not t.error])
    keys = sorted(set(cand) & set(ref))
    point = candidate.summary.get("output_tok_s", math.nan) / reference.summary.get("output_tok_s", math.nan)
    out = {"speedup": point, "speedup_ci_low": math.nan, "speedup_ci_high": math.nan,
           "e2e_p50_speedup": reference.summary.get("e2e_p50", math.nan) / candidate.summary.get("e2e_p50", math.nan),
           "ttft_p50_speedup": reference.summary.get("ttft_p50", math.nan) / candidate.summary.get("ttft_p50", math.nan)}
    if not keys:
        return out
    c = candidate.concurrency
    steady = _steady([t for k in keys for t in cand[k]], c) / _steady([t for k in keys for t in ref[k]], c)
    replicates = []
    for draw in _resamples(keys, n_resamples, seed):
        chosen = [keys[k] for k in draw]
        replicates.append(_steady([t for k in chosen for t in cand[k]], c)
                          / _steady([t for k in chosen for t in ref[k]], c))
    low, high = _interval(np.array(replicates) / steady, ci_level)
    out["speedup_ci_low"], out["speedup_ci_high"] = point * low, point * high
    return out


# ---------------------------------------------------------------- what the engine reports

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfINFNa]+)')


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition: each sample's name (labels dropped, values of one name summed) -> value."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line.strip())
        if not match:
            continue
        name, labels, value = match.groups()
        if name.endswith("_bucket"):
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + number
    return out


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    """The server's ``/metrics`` (base URL without /v1), parsed; None where it has none."""
    try:
        with urllib.request.urlopen(url.rstrip("/").removesuffix("/v1") + "/metrics", timeout=timeout_s) as response:
            return parse_prometheus(response.read().decode(errors="replace"))
    except (OSError, ValueError):
        return None


def engine_metrics_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """What the engine counted between two scrapes: its histograms' means, its counters' increments, its gauges."""
    if not before or not after:
        return {}
    out: dict[str, float] = {}
    for prefix in ("vllm:", ""):
        for name, label in ENGINE_HISTOGRAMS.items():
            total, count = f"{prefix}{name}_sum", f"{prefix}{name}_count"
            if total in after and count in after and label + "_mean" not in out:
                n = after[count] - before.get(count, 0.0)
                if n > 0:
                    out[label + "_mean"] = (after[total] - before.get(total, 0.0)) / n
                    out[label + "_count"] = n
        for name, label in ENGINE_COUNTERS.items():
            if f"{prefix}{name}" in after and label not in out:
                out[label] = after[f"{prefix}{name}"] - before.get(f"{prefix}{name}", 0.0)
        for name, label in ENGINE_GAUGES.items():
            if f"{prefix}{name}" in after and label not in out:
                out[label] = after[f"{prefix}{name}"]
    return out


_LOG_FACTS = {
    "weights_gib": re.compile(r"Model loading took ([0-9.]+) ?GiB"),  # vLLM on a GPU
    "checkpoint_gib": re.compile(r"Checkpoint size: ([0-9.]+) ?GiB"),
    "kv_cache_gib": re.compile(r"set \(([0-9.]+)/[0-9.]+\) GiB for KV cache"),  # vLLM's CPU build
    "kv_cache_tokens": re.compile(r"KV cache size: ([0-9,]+) tokens"),
    "max_concurrency": re.compile(r"Maximum concurrency for [0-9,]+ tokens per request: ([0-9.]+)x"),
}


def server_log_facts(text: str) -> dict[str, float]:
    """From a vLLM server's log: its weight memory or checkpoint size (GiB), KV-cache memory (GiB, CPU build) and
    capacity (tokens), and the concurrency that capacity holds at full length."""
    out = {}
    for name, pattern in _LOG_FACTS.items():
        found = pattern.findall(text)
        if found:
            out[name] = float(found[-1].replace(",", ""))
    return out


# ---------------------------------------------------------------- measuring one server, and a pair

def prompts_from_run(run_dir: str | Path, n: int) -> list[str]:
    """``n`` generation prompts of a finished run (as the model saw them), spread evenly over its items by id."""
    import pandas as pd

    items = pd.read_parquet(Path(run_dir) / "items.parquet")
    if "prompt" not in items:
        raise EndpointError(f"{run_dir}/items.parquet has no prompt column (a run from before prompts were kept): "
                            "rerun it with force=true")
    generated = items[(items.get("output_type", "generate_until") == "generate_until")
                      & items["prompt"].astype(str).str.len().gt(0)].sort_values("item_id")
    if generated.empty:
        raise EndpointError(f"{run_dir} has no generation items with a prompt: give a slice with generation tasks")
    picks = np.unique(np.linspace(0, len(generated) - 1, min(n, len(generated))).round().astype(int))
    return generated["prompt"].astype(str).iloc[picks].tolist()


def measure_endpoint(url: str, prompts: Sequence[str], settings: PerfConfig, *, model: str | None = None,
                     api_key_env: str | None = None, label: str = "") -> list[LevelResult]:
    """Every concurrency level of ``settings`` against the running server at ``url`` (after ``settings.warmup``
    requests), with the engine's /metrics over each level where it has them."""
    client = Client(EndpointSpec(url=url, model=model, api_key_env=api_key_env, timeout_s=settings.timeout_s))
    client.connect()
    headers = client._headers()
    base = _v1(url)
    common = dict(max_tokens=settings.max_tokens, ignore_eos=settings.ignore_eos, timeout_s=settings.timeout_s,
                  headers=headers)
    for index in range(settings.warmup):
        stream_one(base, client.model, prompts[index % len(prompts)], index, **common)
    levels = []
    for concurrency in settings.concurrency:
        before = scrape(url)
        timings, wall = run_level(base, client.model, prompts, concurrency, settings.rounds, **common)
        after = scrape(url)
        failed = [t.error for t in timings if t.error]
        if len(failed) == len(timings):
            raise EndpointError(f"{label or url}: every request at concurrency {concurrency} failed: {failed[0]}")
        summary = summarize(timings, wall, concurrency, n_resamples=settings.n_resamples, seed=settings.seed,
                            ci_level=settings.ci_level)
        levels.append(LevelResult(concurrency, wall, summary, timings, engine_metrics_delta(before, after)))
        log.info("%s c=%d: %.2f output tok/s, TTFT p50 %.3f s, e2e p50 %.2f s (%d requests)", label or url,
                 concurrency, summary.get("output_tok_s", math.nan), summary.get("ttft_p50", math.nan),
                 summary.get("e2e_p50", math.nan), summary["requests"])
    return levels


def measure_pair(command: str, candidate_dir: str | Path, reference_dir: str | Path, prompts: Sequence[str],
                 settings: PerfConfig, out: Path) -> dict[str, Any]:
    """The candidate and the reference, each served by ``command`` (``{model}``, ``{port}``) in turn, measured on the
    same prompts with the same settings; the result :func:`flat_metrics` / :func:`perf_markdown` read."""
    from harness.engines.vllm_serve import ServedProcess

    sides: dict[str, Any] = {}
    for side, directory in (("reference", reference_dir), ("candidate", candidate_dir)):
        logfile = out / f"perf_serve_{side}.log"
        server = ServedProcess(command.replace("{model}", str(directory)), logfile,
                               startup_timeout_s=settings.startup_s)
        with server:
            levels = measure_endpoint(server.url, prompts, settings, label=side)
        sides[side] = {"directory": str(directory), "levels": levels,
                       "log": server_log_facts(logfile.read_text(errors="replace"))}
    result = assemble(sides, settings, command=command, prompts=prompts)
    result["device"] = device_name()
    return result


def device_name() -> str:
    """The accelerator the servers ran on (``nvidia-smi``'s first GPU name), else ``cpu``: what the ledger's decode
    floor is computed for when measured and predicted stand side by side (:func:`harness.sizing.measured.predicted_vs_measured`)."""
    import subprocess

    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    names = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return names[0] if done.returncode == 0 and names else "cpu"


def assemble(sides: dict[str, Any], settings: PerfConfig, *, command: str = "", prompts: Sequence[str] = ()) -> dict:
    """Both sides' levels with the speed-up at each level, as one JSON-ready result."""
    result: dict[str, Any] = {"settings": asdict(settings), "command": command,
                              "prompt_chars": [len(p) for p in prompts], "levels": []}
    for index, concurrency in enumerate(settings.concurrency):
        cand, ref = sides["candidate"]["levels"][index], sides["reference"]["levels"][index]
        result["levels"].append({"concurrency": concurrency, "candidate": cand.summary, "reference": ref.summary,
                                 "candidate_engine": cand.engine, "reference_engine": ref.engine,
                                 **speedup(cand, ref, n_resamples=settings.n_resamples, seed=settings.seed,
                                           ci_level=settings.ci_level)})
    result["log"] = {side: sides[side].get("log", {}) for side in ("candidate", "reference")}
    result["directories"] = {side: sides[side].get("directory", "") for side in ("candidate", "reference")}
    result["requests"] = {side: [[asdict(t) for t in level.timings] for level in sides[side]["levels"]]
                          for side in ("candidate", "reference")}
    return result


# ---------------------------------------------------------------- reading a result

FLAT_KEYS = ("output_tok_s", "requests_s", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "itl_p50", "itl_p90",
             "itl_p99", "e2e_p50", "e2e_p90", "e2e_p99")


def flat_metrics(result: dict) -> dict[str, float]:
    """``perf/c<N>/<side>/<figure>`` and ``perf/c<N>/speedup[_ci_low|_ci_high]`` for summary.json and MLflow
    (seconds, tokens/s, requests/s; speed-up as a ratio); ``perf/log/<side>/<fact>`` from each server's log (GiB,
    tokens); ``perf/predicted/<side>/<figure>`` where the ledger stands beside the measurement (GB, ms, ratios)."""
    out: dict[str, float] = {}
    for level in result["levels"]:
        prefix = f"perf/c{level['concurrency']}"
        for side in ("candidate", "reference"):
            for key in FLAT_KEYS:
                value = level[side].get(key)
                if value is not None and math.isfinite(value):
                    out[f"{prefix}/{side}/{key}"] = float(value)
        for key in ("speedup", "speedup_ci_low", "speedup_ci_high"):
            if math.isfinite(level.get(key, math.nan)):
                out[f"{prefix}/{key}"] = float(level[key])
    for side, facts in (result.get("log") or {}).items():  # the server's own log: weight memory, KV cache
        for key, value in (facts or {}).items():
            out[f"perf/log/{side}/{key}"] = float(value)
    for row in result.get("predicted") or []:  # the ledger's prediction beside the measurement
        for key in ("predicted_weight_gb", "measured_weight_gb", "weight_ratio", "predicted_floor_ms",
                    "measured_tpot_ms", "decode_ratio"):
            value = row.get(key)
            if value is not None and math.isfinite(value):
                out[f"perf/predicted/{row['side']}/{key}"] = float(value)
    return out


def headline(result: dict, name: str = "the candidate") -> str:
    """One line: the speed-up at each level with its interval; a candidate slower than the reference says so first."""
    parts, slower = [], []
    for level in result["levels"]:
        point, low, high = level["speedup"], level["speedup_ci_low"], level["speedup_ci_high"]
        parts.append(f"{point:.2f}× [{low:.2f}, {high:.2f}] at {level['concurrency']} in flight")
        if high < 1:
            slower.append(level["concurrency"])
    speed = "; ".join(parts)
    if slower:
        return (f"SLOWER than the reference: {name} generates fewer output tokens/s than the reference's own weights "
                f"on the same engine at concurrency {', '.join(map(str, slower))} (speed-up {speed})")
    faster = all(level["speedup_ci_low"] > 1 for level in result["levels"])
    verdict = "faster than the reference" if faster else "not shown faster than the reference"
    return f"{name} is {verdict} on this engine: output tokens/s speed-up {speed}"


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None or not math.isfinite(value) else format(value, spec)


def perf_markdown(result: dict) -> str:
    """Per concurrency level and side: client-side figures with intervals, the engine's own, the speed-up."""
    rows = ["| in flight | side | output tok/s [CI] | requests/s | TTFT p50 / p90 / p99 s | TPOT p50 s | "
            "ITL p50 / p90 / p99 s | e2e p50 / p90 / p99 s | engine: TTFT, ITL, e2e mean s | speed-up [CI] |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for level in result["levels"]:
        for side in ("reference", "candidate"):
            s, e = level[side], level[f"{side}_engine"]
            up = (f"{level['speedup']:.2f} [{_fmt(level['speedup_ci_low'], '.2f')}, "
                  f"{_fmt(level['speedup_ci_high'], '.2f')}]") if side == "candidate" else ""
            engine = ", ".join(_fmt(e.get(k), ".3f") for k in ("ttft_s_mean", "itl_s_mean", "e2e_s_mean")) if e else "–"
            rows.append(
                f"| {level['concurrency']} | {side} | {_fmt(s.get('output_tok_s'), '.2f')} "
                f"[{_fmt(s.get('output_tok_s_ci_low'), '.2f')}, {_fmt(s.get('output_tok_s_ci_high'), '.2f')}] | "
                f"{_fmt(s.get('requests_s'), '.3f')} | "
                + " / ".join(_fmt(s.get(f"ttft_p{q}"), ".3f") for q in (50, 90, 99)) + " | "
                + f"{_fmt(s.get('tpot_p50'), '.4f')} | "
                + " / ".join(_fmt(s.get(f"itl_p{q}"), ".4f") for q in (50, 90, 99)) + " | "
                + " / ".join(_fmt(s.get(f"e2e_p{q}"), ".2f") for q in (50, 90, 99)) + f" | {engine} | {up} |")
    facts = []
    for side in ("reference", "candidate"):
        found = result.get("log", {}).get(side) or {}
        if found:
            facts.append(f"- {side}'s server log: " + ", ".join(f"{k} {v:g}" for k, v in found.items()))
    settings = result["settings"]
    lines = ["\n".join(rows), "",
             f"{settings['rounds']} rounds of {len(result.get('prompt_chars', []))} prompts per level, "
             f"{settings['max_tokens']} output tokens per request"
             + (" (ignore_eos)" if settings["ignore_eos"] else "") + f", {settings['warmup']} warm-up request(s); "
             f"intervals {settings['ci_level']:.0%}, bootstrap over prompts.", *facts]
    if result.get("predicted"):
        lines += ["", predicted_markdown(result["predicted"])]
    return "\n".join(lines)


# ---------------------------------------------------------------- the ledger's prediction beside the measurement

GIB = 2**30


def measured_weight_gb(facts: dict[str, float]) -> tuple[float, str]:
    """(GB of 1e9 bytes, what it is) from :func:`server_log_facts`: the weight memory after loading (vLLM on a GPU),
    else the checkpoint's size on disk (vLLM's CPU build logs only that); (nan, "") where the log says neither."""
    if "weights_gib" in facts:
        return facts["weights_gib"] * GIB / 1e9, "weights loaded"
    if "checkpoint_gib" in facts:
        return facts["checkpoint_gib"] * GIB / 1e9, "checkpoint size"
    return math.nan, ""


def predicted_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`harness.sizing.measured.predicted_vs_measured` as a table and what each ratio means."""
    if not rows:
        return ""
    lines = ["| side | ledger weights GB | engine weights GB | measured ÷ predicted | ledger decode floor ms/token | "
             "measured TPOT p50 ms | measured ÷ floor |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        what = f" ({row['measured_weight_from']})" if row["measured_weight_from"] else ""
        gpu = f" ({row['gpu']})" if row["gpu"] else ""
        lines.append(f"| {row['side']} | {_fmt(row['predicted_weight_gb'], '.3f')} | "
                     f"{_fmt(row['measured_weight_gb'], '.3f')}{what} | {_fmt(row['weight_ratio'], '.2f')} | "
                     f"{_fmt(row['predicted_floor_ms'], '.4f')}{gpu} | {_fmt(row['measured_tpot_ms'], '.2f')} "
                     f"({row['tpot_concurrency']} in flight) | {_fmt(row['decode_ratio'], '.1f')} |")
    first = rows[0]
    note = ("The ledger predicts the scheme's weights and the BF16 reference's (GB = 1e9 bytes; the engine's GiB "
            "converted); the decode floor is the bytes one batch-1 decode step reads ÷ the device's peak bandwidth, so "
            "measured ÷ floor is at least 1 and says how far the engine is from reading its weights at full bandwidth.")
    if not first["gpu"]:
        note += (f" Device {first['device']!r} has no bandwidth in the ledger (it predicts for GPUs): no floor; the "
                 "comparison takes one as perf_device=NAME:memory_GB:bandwidth_TBps.")
    return "\n".join(["Predicted (the capacity ledger) beside measured (the engine):", "", *lines, "", note])
