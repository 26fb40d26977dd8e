"""The divergence pass at the machine's speed? Tokens/s per thread of teacher-forced scoring (issue 35).

Measures, on one torch thread and in one process (so the ratios are taken under the same load):

- ``prefill``: the model's own prefill (``model(ids, logits_to_keep=1)``), the machine's speed;
- ``reference``: :func:`score_reference` (store ``hidden``) over the same texts;
- ``compare``: :func:`compare_to_reference`, the divergence stage's pass (the quantized model's
  forward, both output heads and the per-token statistics);
- ``stats``: the per-token statistics alone from given hidden states (both heads + KL / reverse
  KL / NLL / top-1), by the two-log-softmax computation (``two_pass``), by the fused one
  (:func:`harness.divergence.scoring.token_statistics`: on a CPU in blocks of rows that stay in cache), by
  the fused one with all of a chunk's rows as one block (``one_block``, checked bit for bit equal) and by the
  fused one under ``torch.compile`` (``compiled``).

It checks that the fused statistics equal the two-log-softmax ones to float tolerance on these
texts (max |Δ| per column, top-1 agreement) and writes everything, with the machine, its load
(``uptime``) and the date, to ``benchmarks/results/divergence.json``.

    nice python benchmarks/bench_divergence.py [models=[smollm2_135m,tiny_random]] [tokens=2048] [text_tokens=512]

``job="overrides"`` instead runs ``python -m harness`` with those overrides (from ``code=DIR``: another
checkout, to measure before / after on one machine in one hour) into ``work=DIR`` with an empty cache, and
reports from its ``summary.json`` the prefill tokens per model against the unique prompt tokens (the
served texts' prompts, read from ``tokens.parquet``), the stage times and the divergence stage's
tokens/s per thread against the evaluate stage's, and checks every reply and score against
``expect=results/example/items.parquet`` on the slices it ran:

    nice python benchmarks/bench_divergence.py "job=slices=[math]" work=/tmp/after out=/tmp/after.json

``read=DIR`` reports the same on a run already finished (e.g. ``make run`` from a fresh clone, timed
from outside).

The "quantized" model is the model with every linear weight perturbed by 1 % of its standard
deviation (a speed benchmark: the weights' values do not change the work).
"""
from __future__ import annotations

import copy
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import cli  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROSE = ("The river had changed its course twice in living memory, and each time the village followed it, "
         "moving houses stone by stone to the new bank. Old maps in the town hall show three churches where "
         "today there is one; the records of 1873 list forty-one families, their trades, and the fields they "
         "rented from the abbey. ")


@dataclass
class Options:
    models: list[str] = field(default_factory=lambda: ["smollm2_135m", "tiny_random"],
                              metadata={"help": "packaged model configs to measure"})
    tokens: int = field(default=2048, metadata={"help": "tokens scored per measurement (split into texts)"})
    text_tokens: int = field(default=512, metadata={"help": "tokens per text"})
    compile: bool = field(default=True, metadata={"help": "also measure the fused statistics under torch.compile"})
    out: str = field(default=str(RESULTS / "divergence.json"), metadata={"help": "JSON written here"})
    job: str = field(default="", metadata={"help": "run a job with these overrides (space-separated) instead"})
    read: str = field(default="", metadata={"help": "instead, report on this finished run's results directory"})
    code: str = field(default=str(Path(__file__).resolve().parents[1]), metadata={"help": "checkout to run it from"})
    work: str = field(default="/tmp/bench_divergence", metadata={"help": "the job's results and cache (emptied)"})
    expect: str = field(default=str(Path(__file__).resolve().parents[1] / "results" / "example" / "items.parquet"),
                        metadata={"help": "items.parquet whose replies and scores the job must reproduce"})


def _imports() -> dict[str, Any]:
    """The harness modules this benchmark drives (the package layout moved once; both are accepted)."""
    try:
        from harness.divergence import scoring
        from harness.models import loading
    except ImportError:  # the flat layout before the restructure
        import harness.divergence as scoring  # type: ignore[no-redef]
        import harness.models as loading  # type: ignore[no-redef]
    from harness.config import load_model_config
    return {"scoring": scoring, "loading": loading, "load_model_config": load_model_config}


def _timed(work: Callable[[], Any], repeats: int = 2) -> tuple[float, Any]:
    """Best wall time of ``repeats`` runs (after one warm-up run) and the last result."""
    result = work()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = work()
        best = min(best, time.perf_counter() - start)
    return best, result


def perturbed(model: torch.nn.Module, scale: float = 0.01, seed: int = 0) -> torch.nn.Module:
    """A copy of ``model`` with every linear weight moved by ``scale`` of its standard deviation."""
    generator = torch.Generator().manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for module in other.modules():
            if isinstance(module, torch.nn.Linear):
                weight = module.weight
                noise = torch.randn(weight.shape, generator=generator).to(weight.dtype)
                weight.add_(scale * weight.float().std().to(weight.dtype) * noise)
    return other


def texts(tokenizer: Any, count: int, length: int) -> list[torch.Tensor]:
    """``count`` token sequences of ``length`` ids, each a different window of the same prose."""
    ids = tokenizer(PROSE * (2 + (count + 1) * length // 40), add_special_tokens=False)["input_ids"]
    if len(ids) < (count + 1) * length:
        raise RuntimeError("benchmark prose too short for the requested tokens")
    return [torch.tensor(ids[i * length // 3: i * length // 3 + length]) for i in range(count)]


def two_pass_statistics(head_q: Any, head_p: Any, hidden_q: torch.Tensor, hidden_p: torch.Tensor,
                        targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-token statistics as :func:`compare_to_reference` computed them before issue 35: a
    log-softmax per side, then exp / subtract / multiply / sum per direction, gather and argmax."""
    logq, logp = head_q.log_probs(hidden_q), head_p.log_probs(hidden_p)
    p, q = logp.exp(), logq.exp()
    return {"kl": (p * (logp - logq)).sum(-1), "kl_reverse": (q * (logq - logp)).sum(-1),
            "logq_target": logq.gather(-1, targets[:, None])[:, 0], "top1_quant": logq.argmax(-1)}


def fused_statistics(logits_q: torch.Tensor, logits_p: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Phase-1 prototype of the fused statistics (used when the harness has no ``token_statistics``).

    With m = max z and S = sum exp(z - m) per side, and d = (z_p - m_p) - (z_q - m_q):
    KL(p||q) = E_p[d] - log(S_p / S_q) and KL(q||p) = log(S_p / S_q) - E_q[d]; top-1 is the max's
    index, log q(target) = z_q[target] - m_q - log S_q. One exp per side, two dot products.
    """
    m_q, top1 = logits_q.max(-1)
    m_p = logits_p.amax(-1)
    shifted_q = logits_q - m_q[:, None]
    shifted_p = logits_p - m_p[:, None]
    d = shifted_p - shifted_q
    logq_target = shifted_q.gather(-1, targets[:, None])[:, 0]
    e_q, e_p = shifted_q.exp_(), shifted_p.exp_()
    s_q, s_p = e_q.sum(-1), e_p.sum(-1)
    c = s_p.log() - s_q.log()
    return {"kl": torch.linalg.vecdot(e_p, d) / s_p - c, "kl_reverse": c - torch.linalg.vecdot(e_q, d) / s_q,
            "logq_target": logq_target - s_q.log(), "top1_quant": top1}


def float64_statistics(logits_q: torch.Tensor, logits_p: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same statistics from the same float32 logits, computed in float64 (the yardstick of both)."""
    logq, logp = logits_q.double().log_softmax(-1), logits_p.double().log_softmax(-1)
    return {"kl": (logp.exp() * (logp - logq)).sum(-1), "kl_reverse": (logq.exp() * (logq - logp)).sum(-1),
            "logq_target": logq.gather(-1, targets[:, None])[:, 0], "top1_quant": logq.argmax(-1)}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "unavailable"


def one_thread_prefill(cache_dir: str, tokens: int = 2048, text_tokens: int = 512) -> dict[str, Any]:
    """The machine's speed as the project states it: SmolLM2's one-thread fp32 prefill, tokens/s (machines of this
    kind measure 205-315), with the load at the time; ``cache_dir`` holds (or receives) the dequantized model."""
    mods = _imports()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loaded = mods["loading"].load(mods["load_model_config"]("smollm2_135m"), cache_dir)
        sequences = texts(loaded.tokenizer, max(1, tokens // text_tokens), text_tokens)

        def prefill() -> None:
            with torch.no_grad():
                for ids in sequences:
                    loaded.model(ids[None], use_cache=False, logits_to_keep=1)

        seconds, _ = _timed(prefill)
    finally:
        torch.set_num_threads(threads)
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "one_thread_fp32_prefill_tok_s_smollm2": sum(len(s) for s in sequences) / seconds,
            "prefill_measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_during_prefill_measure": uptime()}


def measure(name: str, options: Options, mods: dict[str, Any]) -> dict[str, Any]:
    """Every rate of one model (see the module docstring)."""
    scoring, loading = mods["scoring"], mods["loading"]
    cfg = mods["load_model_config"](name)
    cache_dir = os.environ.get("HARNESS_CACHE_DIR", str(Path.home() / ".cache" / "quant-harness"))
    loaded = loading.load(cfg, cache_dir)
    reference, tokenizer = loaded.model, loaded.tokenizer
    quantized = perturbed(reference)
    count = max(1, options.tokens // options.text_tokens)
    sequences = texts(tokenizer, count, options.text_tokens)
    scored = sum(len(s) - 1 for s in sequences)
    out: dict[str, Any] = {"tokens": scored, "texts": count, "text_tokens": options.text_tokens,
                           "vocab": int(reference.config.vocab_size), "hidden": int(reference.config.hidden_size)}

    def prefill() -> None:
        with torch.no_grad():
            for ids in sequences:
                reference(ids[None], use_cache=False, logits_to_keep=1)

    seconds, _ = _timed(prefill)
    out["prefill_tok_s"] = scored / seconds

    # the reference and the comparison as the divergence stage runs them (texts as served token ids)
    served = [scoring.ServedText(tuple(s[:len(s) // 2].tolist()), tuple(s[len(s) // 2:].tolist())) for s in sequences]
    seconds, refs = _timed(lambda: scoring.score_reference(reference, tokenizer, served, max_tokens=options.text_tokens,
                                                           store="hidden"), repeats=1)
    out["reference_tok_s"] = scored / seconds
    seconds, frame = _timed(lambda: scoring.compare_to_reference(quantized, refs, "bench"), repeats=1)
    out["compare_tok_s"] = scored / seconds

    # the statistics alone, from given hidden states
    head_q, head_p = scoring.OutputHead.of(quantized), refs[0].head
    hidden = [(scoring.final_hidden(quantized, ids), ref.hidden, ids[1:]) for ids, ref in zip(sequences, refs)]
    chunk = scoring.CHUNK

    def statistics(compute: Callable) -> list[dict[str, torch.Tensor]]:
        rows = []
        with torch.no_grad():
            for hq, hp, targets in hidden:
                for a in range(0, len(hq), chunk):
                    rows.append(compute(hq[a:a + chunk], hp[a:a + chunk], targets[a:a + chunk]))
        return rows

    seconds, old = _timed(lambda: statistics(lambda hq, hp, t: two_pass_statistics(head_q, head_p, hq, hp, t)))
    out["stats_two_pass_tok_s"] = scored / seconds
    exact = statistics(lambda hq, hp, t: float64_statistics(head_q.logits(hq), head_p.logits(hp), t))
    out["two_pass_vs_float64"] = agreement(exact, old)
    fused = getattr(scoring, "token_statistics", fused_statistics)
    if fused is not None:
        run_fused = lambda hq, hp, t: fused(head_q.logits(hq), head_p.logits(hp), t)  # noqa: E731
        seconds, new = _timed(lambda: statistics(run_fused))
        out["stats_fused_tok_s"] = scored / seconds
        out["fused_vs_two_pass"] = agreement(old, new)
        out["fused_vs_float64"] = agreement(exact, new)
        one_block = getattr(scoring, "_token_statistics", None)  # the same, all rows of a chunk in one block
        if one_block is not None:
            seconds, whole = _timed(lambda: statistics(lambda hq, hp, t: one_block(head_q.logits(hq), head_p.logits(hp),
                                                                                   t, False)))
            out["stats_fused_one_block_tok_s"] = scored / seconds
            out["fused_blocks_equal_one_block"] = all(torch.equal(a[k], b[k]) for a, b in zip(new, whole) for k in a)
        if options.compile:
            compiled = torch.compile(fused, dynamic=True)
            start = time.perf_counter()
            statistics(lambda hq, hp, t: compiled(head_q.logits(hq), head_p.logits(hp), t))
            out["compile_s"] = time.perf_counter() - start  # the first call compiles
            seconds, new = _timed(lambda: statistics(lambda hq, hp, t: compiled(head_q.logits(hq), head_p.logits(hp),
                                                                                t)))
            out["stats_compiled_tok_s"] = scored / seconds
            out["compiled_vs_two_pass"] = agreement(old, new)
    out["kl_mean"] = float(frame["kl"].mean())
    return out


def agreement(old: list[dict[str, torch.Tensor]], new: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Max |Δ| of each statistic and the share of equal top-1 tokens between two computations."""
    def cat(rows: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
        return torch.cat([row[key] for row in rows])

    out = {f"max_abs_{key}": float((cat(new, key).double() - cat(old, key).double()).abs().max())
           for key in ("kl", "kl_reverse", "logq_target")}
    out["max_rel_kl"] = float(((cat(new, "kl") - cat(old, "kl")).abs() / cat(old, "kl").abs().clamp(min=1e-6)).max())
    out["top1_equal"] = float((cat(new, "top1_quant") == cat(old, "top1_quant")).double().mean())
    return out


def run_job(options: Options) -> dict[str, Any]:
    """One job from ``options.code`` with an empty cache; its prefill tokens, stage times and replies."""
    import shutil

    work = Path(options.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    command = [sys.executable, "-m", "harness", *options.job.split(), f"paths.results_dir={work / 'results'}",
               f"paths.cache_dir={work / 'cache'}", "tracking.enabled=false"]
    env = dict(os.environ, PYTHONPATH=options.code)
    start = time.perf_counter()
    subprocess.run(command, cwd=options.code, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    directory = next((work / "results").glob("*/summary.json")).parent
    return {"command": " ".join(command), "code": options.code, "wall_s": wall, **read_run(directory, options.expect)}


def read_run(directory: Path, expect: str) -> dict[str, Any]:
    """Prefill tokens per side against the unique prompt tokens, stage times, replies checked: one finished run."""
    import pandas as pd

    summary = json.loads((directory / "summary.json").read_text())
    tokens = pd.read_parquet(directory / "tokens.parquet")
    served = tokens[tokens["kind"] != "plain"]
    texts = served.groupby(["slice", "text"]).ngroups
    prompt_tokens = int((served["kind"] == "prompt").sum()) + texts  # a text's prompt: its prompt rows + its first token
    throughput = summary["throughput"]
    prefill = {"quantized": sum(throughput.get(s, {}).get("prefill_tokens", 0) for s in ("evaluate", "divergence")),
               "reference": sum(throughput.get(s, {}).get("prefill_tokens", 0) for s in ("reference", "reference_wait"))}
    # the evaluate and divergence stages run in this process, on its threads (the reference process has its own)
    threads = summary["runtime"]["threads"]
    per_thread = {stage: throughput[stage]["tokens_per_s"] / threads for stage in ("evaluate", "divergence")
                  if stage in throughput}
    # the divergence stage's work is the scored positions (both heads and the statistics at each), of which
    # only those not captured while answering the items are prefilled again
    if "divergence" in summary["timings"]:
        per_thread["divergence_scored_positions"] = len(tokens) / summary["timings"]["divergence"] / threads
    out = {"directory": str(directory), "timings": summary["timings"],
           "throughput": throughput, "runtime": summary["runtime"], "served_texts": texts,
           "unique_prompt_tokens": prompt_tokens, "prefill_tokens": prefill,
           "prefill_per_unique_prompt_token": {side: n / max(prompt_tokens, 1) for side, n in prefill.items()},
           "tokens_per_s_per_thread": per_thread, "kl_mean": summary["metrics"].get("overall/kl_mean")}
    items = pd.read_parquet(directory / "items.parquet")
    if Path(expect).exists():
        expected = pd.read_parquet(expect)
        expected = expected[expected["slice"].isin(set(items["slice"]))]
        columns = ["response_ref", "response_quant", "correct_ref", "correct_quant"]
        merged = expected.merge(items, on="item_id", how="outer", suffixes=("_expected", ""), indicator=True)
        out["items_expected"] = int(len(expected))
        out["items_missing_or_extra"] = int((merged["_merge"] != "both").sum())
        both = merged[merged["_merge"] == "both"]
        out["items_differing"] = {c: int((both[c].astype(str) != both[f"{c}_expected"].astype(str)).sum())
                                  for c in columns}
    return out


TOOL = cli.Tool(prog="python benchmarks/bench_divergence.py", options=Options,
                summary="Tokens/s per thread of the divergence pass against the machine's one-thread prefill.")


def main(argv: list[str] | None = None) -> int:
    options = cli.parse(TOOL, sys.argv[1:] if argv is None else argv).options
    if options.job or options.read:
        started, before = time.strftime("%Y-%m-%dT%H:%M:%S%z"), uptime()
        measured = read_run(Path(options.read), options.expect) if options.read else run_job(options)
        result = {"date": started, "uptime_before": before, **measured, "uptime_after": uptime()}
        if options.job:  # the machine's speed right after the job, on the job's own model cache
            result["machine"] = one_thread_prefill(str(Path(options.work) / "cache"))
        print(json.dumps(result, indent=1))
        Path(options.out).parent.mkdir(parents=True, exist_ok=True)
        Path(options.out).write_text(json.dumps(result, indent=1))
        return 0
    torch.set_num_threads(1)
    mods = _imports()
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": {"platform": platform.platform(),
              "cpus": os.cpu_count(), "torch": torch.__version__}, "threads": 1, "uptime_before": uptime(),
              "models": {}}
    for name in options.models:
        result["models"][name] = measure(name, options, mods)
        print(name, json.dumps(result["models"][name], indent=1), flush=True)
    result["uptime_after"] = uptime()
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(json.dumps(result, indent=1))
    print(f"written {options.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
