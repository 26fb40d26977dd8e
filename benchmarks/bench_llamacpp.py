"""SmolLM2-135M as GGUF on llama.cpp: paired quality, serving speed, and the served KL bound against llama.cpp's own KL.

1. Exports (``python -m harness.export format=gguf``): the reference's own weights as F32, and each ``types``
   (default Q8_0, Q4_K_M) by llama.cpp's quantizer.
2. One job per type: ``quant=external candidate.serve='<llama_cpp.server --model X.gguf ...>'`` on ``slices``
   (default math and structured, ``served_texts`` served texts each), the reference in this process; its summary
   gives the paired table (Δ accuracy with its interval, flips, KL lower bound, top-1 agreement).
3. Serving speed (:func:`harness.engines.perf.measure_pair`): each type's GGUF against the F32 GGUF on the same
   server command, at concurrency 1 and 8, on the first job's generation prompts.
4. KL three ways on the same texts (served texts of the first job: prompt as evaluated + the reference's reply,
   ``kl_texts`` per slice, those that start with BOS): the harness's top-k partition bound from the served
   Q8_0's echo (what the job reports), the exact KL of the torch reference against llama.cpp's full Q8_0
   logits, and llama.cpp F32 vs llama.cpp Q8_0 on full logits (the quantity ``llama-perplexity
   --kl-divergence`` reports; the pip package does not build that binary, so ``llama_cpp.Llama(logits_all=True)``
   computes both sides), plus torch reference vs llama.cpp F32 (the engine floor).

    python benchmarks/bench_llamacpp.py [work=/tmp/bench_llamacpp] [types=[Q8_0,Q4_K_M]] \\
        [slices=[math,structured]] [served_texts=8] [threads=1] [perf=true] [kl_texts=4]

Writes ``benchmarks/results/llamacpp.json``; docs/benchmarks/llamacpp.md reports it.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness import cli

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LLAMACPP_PYTHON = REPO / ".venv-llamacpp" / "bin" / "python"


@dataclass
class Options:
    work: str = field(default="/tmp/bench_llamacpp", metadata={"help": "exports, results, logs"})
    types: list[str] = field(default_factory=lambda: ["Q8_0", "Q4_K_M"], metadata={"help": "GGUF types served"})
    slices: list[str] = field(default_factory=lambda: ["math", "structured"], metadata={"help": "slices of the jobs"})
    served_texts: int = field(default=8, metadata={"help": "served texts per slice for the token divergence (0: all; "
                                                          "llama.cpp's echo costs ~85 ms per token at 49k vocab)"})
    n_ctx: int = field(default=8192, metadata={"help": "llama.cpp context (the model's max_length)"})
    threads: int = field(default=2, metadata={"help": "llama.cpp threads"})
    perf: bool = field(default=True, metadata={"help": "measure serving speed"})
    perf_prompts: int = field(default=8, metadata={"help": "generation prompts timed per level"})
    kl_texts: int = field(default=4, metadata={"help": "served texts per slice for the three-way KL (0: skip)"})
    kl_max_tokens: int = field(default=1024, metadata={"help": "longest text for the three-way KL"})
    out: str = field(default=str(RESULTS / "llamacpp.json"), metadata={"help": "JSON written here"})


def serve_command(gguf: str | Path, options: Options) -> str:
    return (f"{LLAMACPP_PYTHON} -m llama_cpp.server --model {gguf} --host 127.0.0.1 --port {{port}} "
            f"--n_ctx {options.n_ctx} --n_threads {options.threads} --n_threads_batch {options.threads} "
            "--verbose false")


def export(work: Path, kind: str) -> tuple[Path, float, str]:
    path = work / "exports" / f"smollm2_{kind.lower()}.gguf"
    if path.exists():
        return path, 0.0, "(existing)"
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "harness.export", "format=gguf", "model=smollm2_135m",
                           f"gguf_type={kind}", f"out={path}"], cwd=REPO, capture_output=True, text=True, check=True)
    return path, time.perf_counter() - start, done.stdout.strip()


def job(work: Path, kind: str, gguf: Path, options: Options) -> dict:
    results = work / "results" / kind
    found = sorted(results.glob("*/summary.json"))
    if not found:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "harness", "model=smollm2_135m", "quant=external",
                        f"candidate.serve='{serve_command(gguf, options)}'", f"paths.results_dir={results}",
                        f"tracking.uri=sqlite:///{work / 'mlflow.db'}", *overrides(options)], cwd=REPO, check=True)
        print(f"[bench] {kind} job {time.perf_counter() - start:.0f} s", flush=True)
        found = sorted(results.glob("*/summary.json"))
    summary = json.loads(found[-1].read_text())
    summary["_dir"] = str(found[-1].parent)
    return summary


def overrides(options: Options) -> list[str]:
    """The jobs' slice overrides: the slices, each with its number of served texts."""
    out = [f"slices=[{','.join(options.slices)}]"]
    if options.served_texts:
        out += [f"slices.{name}.served_texts={options.served_texts}" for name in options.slices]
    return out


def _interval(metrics: dict, stem: str) -> list[Any]:
    return [metrics.get(stem), metrics.get(f"{stem}_ci_low"), metrics.get(f"{stem}_ci_high")]


def paired_rows(kind: str, summary: dict) -> list[dict]:
    metrics = summary["metrics"]
    rows = []
    for name in ["overall", *summary["slices"]]:
        rows.append({"type": kind, "slice": name, "n": metrics.get(f"{name}/n"),
                     "acc_ref": metrics.get(f"{name}/acc_ref"), "acc_quant": metrics.get(f"{name}/acc_quant"),
                     "acc_delta": _interval(metrics, f"{name}/acc_delta"),
                     "flips_right_to_wrong": metrics.get(f"{name}/flips_right_to_wrong"),
                     "flips_wrong_to_right": metrics.get(f"{name}/flips_wrong_to_right"),
                     "kl_lower_bound_mean": metrics.get(f"{name}/kl_lower_bound_mean", metrics.get(f"{name}/kl_mean")),
                     "top1_agree": metrics.get(f"{name}/top1_agree"),
                     "gen_identical_rate": metrics.get(f"{name}/gen_identical_rate")})
    return rows


# ------------------------------------------------------------------------------ the three-way KL
def kl_texts(summary: dict, tokenizer: Any, per_slice: int, max_tokens: int) -> list[tuple[str, list[int]]]:
    """Served texts of the job (prompt + the reference's reply), ``per_slice`` per slice, starting with BOS."""
    import pandas as pd

    from harness.divergence.scoring import served_text
    from harness.job.divergence_texts import spread_rows

    items = pd.read_parquet(Path(summary["_dir"]) / "items.parquet")
    out = []
    for name, rows in items[items["prompt"].astype(str) != ""].groupby("slice", sort=False):
        taken = 0
        for row in spread_rows(rows, None).itertuples():
            text = served_text(tokenizer, str(row.prompt), str(row.response_ref))
            ids = [*text.prompt_ids, *text.reply_ids]
            if ids[0] == tokenizer.bos_token_id and len(ids) <= max_tokens and text.reply_ids:
                out.append((str(name), ids))
                taken += 1
            if taken == per_slice:
                break
    return out


def full_logprobs(gguf: Path, texts: list[list[int]], directory: Path, threads: int) -> list[np.ndarray]:
    from harness.checkpoint.export_gguf import run_worker

    directory.mkdir(parents=True, exist_ok=True)
    run_worker({"op": "logits", "model": str(gguf), "texts": texts, "out": str(directory), "threads": threads})
    return [np.load(directory / f"text{i}.npy", mmap_mode="r") for i in range(len(texts))]


def _kl(logp: np.ndarray, logq: np.ndarray) -> np.ndarray:
    logp, logq = np.asarray(logp, dtype=np.float64), np.asarray(logq, dtype=np.float64)
    return (np.exp(logp) * (logp - logq)).sum(-1)


def three_way_kl(summary: dict, ggufs: dict[str, Path], options: Options, work: Path) -> dict:
    import pandas as pd
    import torch

    from harness.cli import compose_run
    from harness.config import CandidateConfig
    from harness.divergence.scoring import ServedText, score_reference
    from harness.divergence.topk_bound import served_rows
    from harness.engines.llamacpp import LlamaCppServe
    from harness.models.loading import load

    cfg = compose_run(["model=smollm2_135m"])
    loaded = load(cfg.model, cfg.paths.cache_dir)
    chosen = kl_texts(summary, loaded.tokenizer, options.kl_texts, options.kl_max_tokens)
    ids = [t for _, t in chosen]
    refs = score_reference(loaded.model, loaded.tokenizer, [ServedText(tuple(t), ()) for t in ids],
                           max_tokens=options.kl_max_tokens)
    engine = LlamaCppServe(CandidateConfig(serve=serve_command(ggufs["Q8_0"], options)), work / "kl_serve")
    with engine:
        served = engine.prompt_logprobs(ids, 20, loaded.tokenizer)
    f32 = full_logprobs(ggufs["F32"], ids, work / "logits_f32", options.threads)
    q8 = full_logprobs(ggufs["Q8_0"], ids, work / "logits_q8_0", options.threads)
    frames = []
    for index, ((slice_name, text), ref, answer) in enumerate(zip(chosen, refs, served)):
        rows = served_rows(ref, answer, slice_name, index)
        keep = rows["nll_quant"].notna().to_numpy()
        ref_logp = torch.log_softmax(ref.logp.double(), -1).numpy()  # [T-1, V]: position p+1 predicted at row p
        exact_ref_q8 = _kl(ref_logp, q8[index][:-1])
        f32_q8 = _kl(f32[index][:-1], q8[index][:-1])
        floor = _kl(ref_logp, f32[index][:-1])
        frames.append(pd.DataFrame({"slice": slice_name, "text": index, "bound": rows["kl"].to_numpy(),
                                    "exact_ref_vs_q8": exact_ref_q8, "llamacpp_f32_vs_q8": f32_q8,
                                    "floor_ref_vs_f32": floor})[keep])
    table = pd.concat(frames, ignore_index=True)
    by_slice = table.groupby("slice")[["bound", "exact_ref_vs_q8", "llamacpp_f32_vs_q8", "floor_ref_vs_f32"]].mean()
    overall = table[["bound", "exact_ref_vs_q8", "llamacpp_f32_vs_q8", "floor_ref_vs_f32"]].mean()
    n = len(table)
    se = table[["bound", "exact_ref_vs_q8", "llamacpp_f32_vs_q8"]].std(ddof=1) / np.sqrt(max(1, n))
    return {"texts": len(ids), "positions": n, "overall": overall.to_dict(), "se_positions": se.to_dict(),
            "by_slice": by_slice.reset_index().to_dict(orient="records"),
            "bound_over_exact": float(overall["bound"] / overall["exact_ref_vs_q8"]),
            "bound_never_above_exact": bool((table["bound"] <= table["exact_ref_vs_q8"] + 1e-9).all()),
            "bound_above_exact_share": float((table["bound"] > table["exact_ref_vs_q8"]).mean()),
            "bound_above_exact_max": float((table["bound"] - table["exact_ref_vs_q8"]).max()),
            "bound_above_exact_sum_share": float((table["bound"] - table["exact_ref_vs_q8"]).clip(lower=0).sum()
                                                 / table["exact_ref_vs_q8"].sum())}


# ------------------------------------------------------------------------------ speed
def speed(summary: dict, ggufs: dict[str, Path], options: Options, work: Path) -> dict:
    from harness.config import PerfConfig
    from harness.engines import perf

    prompts = perf.prompts_from_run(summary["_dir"], options.perf_prompts)
    settings = PerfConfig(concurrency=[1, 8], n_prompts=options.perf_prompts, rounds=2, max_tokens=32,
                          ignore_eos=False, warmup=1)
    command = serve_command("{model}", options)
    out = {}
    for kind in options.types:
        result = perf.measure_pair(command, ggufs[kind], ggufs["F32"], prompts, settings, work / f"perf_{kind}")
        out[kind] = {"levels": [{key: level[key] for key in ("concurrency", "candidate", "reference", *[
            k for k in level if k.startswith("speedup")])} for level in result["levels"]],
            "markdown": perf.perf_markdown(result)}
    return out


# ------------------------------------------------------------------------------ main
def _body(parsed: cli.Parsed[Options]) -> int:
    options = parsed.options
    assert options is not None
    work = Path(options.work)
    (work / "exports").mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"date": datetime.date.today().isoformat(), "options": asdict(options),
                              "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
                              "load_before": os.getloadavg(), "exports": {}, "jobs": {}, "paired": []}
    ggufs = {}
    for kind in ["F32", *options.types]:
        ggufs[kind], seconds, printed = export(work, kind)
        record["exports"][kind] = {"path": str(ggufs[kind]), "seconds": round(seconds, 1), "printed": printed,
                                   "bytes": ggufs[kind].stat().st_size}
        print(f"[bench] export {kind}: {printed}", flush=True)
    summaries = {}
    for kind in options.types:
        summaries[kind] = job(work, kind, ggufs[kind], options)
        record["jobs"][kind] = {"dir": summaries[kind]["_dir"], "timings": summaries[kind].get("timings"),
                                "candidate": summaries[kind].get("candidate")}
        record["paired"] += paired_rows(kind, summaries[kind])
    first = summaries[options.types[0]]
    if options.kl_texts and "Q8_0" in ggufs:
        record["kl_three_way"] = three_way_kl(summaries.get("Q8_0", first), ggufs, options, work)
        print(f"[bench] KL: {json.dumps(record['kl_three_way']['overall'])}", flush=True)
    if options.perf:
        record["perf"] = speed(first, ggufs, options, work)
    previous = json.loads(Path(options.out).read_text()) if Path(options.out).exists() else {}
    for part in ("kl_three_way", "perf"):  # a part skipped this time keeps the last measurement, dated
        if part not in record and part in previous:
            record[part] = {**previous[part], "measured": previous.get("date"), "commit": previous.get("commit")}
    record["load_after"] = os.getloadavg()
    record["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                      text=True).stdout.strip()
    Path(options.out).write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {options.out}")
    return 0


TOOL = cli.Tool(prog="python benchmarks/bench_llamacpp.py", options=Options,
                summary="SmolLM2 GGUF candidates served by llama.cpp: paired quality, speed, and KL three ways.")

if __name__ == "__main__":
    raise SystemExit(cli.main(TOOL, _body))
