"""The README's served-format tables (issue 24) from finished runs and bench_served_kl's JSON.

    python benchmarks/served_kl_tables.py benchmarks/results/served_kl_all.json <results folder>

Prints three Markdown tables: each run over all slices (accuracy, Δ with its interval, flips,
served / plain / prompt KL, served top-1), each slice's accuracy · served KL · plain KL, and the
rank correlations (pooled and within slices) that bench_served_kl.py computed. Formatting only:
every number is read from the runs' summary.json or the benchmark's JSON.
"""
import json, sys, glob
from pathlib import Path
bench = json.load(open(sys.argv[1]))
root = Path(sys.argv[2])
runs = {}
for d in sorted(root.glob("*/summary.json")):
    s = json.load(open(d)); c = json.load(open(d.parent / "config.json"))
    q = c["quant"]; fmt = q["calibration"].get("format", "auto")
    if fmt == "auto": fmt = "chat"
    label = q["name"] if q["method"] == "rtn" else f"{q['name']} · {fmt}"
    runs[label] = s["metrics"]
m0 = next(iter(runs.values()))
print(f"| scheme · calibration | acc (ref {m0['overall/acc_ref']:.3f}) | Δacc [95% CI] | flips r→w / w→r | served KL | plain KL | prompt KL | top-1 (served) |")
print("|---|---:|---|---|---:|---:|---:|---:|")
order = sorted(runs, key=lambda k: -runs[k]["overall/acc_quant"])
for k in order:
    m = runs[k]
    print(f"| {k} | {m['overall/acc_quant']:.3f} | {m['overall/acc_delta']*100:+.1f} [{m['overall/acc_delta_ci_low']*100:+.1f}, {m['overall/acc_delta_ci_high']*100:+.1f}] pt | "
          f"{m['overall/flips_right_to_wrong']:.0f} / {m['overall/flips_wrong_to_right']:.0f} | {m['overall/kl_mean']:.3f} | {m['overall/kl_plain_mean']:.3f} | {m['overall/kl_prompt_mean']:.3f} | {m['overall/top1_agree']:.3f} |")
print()
slices = ["math", "long_context", "multilingual", "code", "structured"]
print("| scheme · calibration | " + " | ".join(f"{s} (ref {m0[f'{s}/acc_ref']:.2f})" for s in slices) + " |")
print("|---|" + "---:|" * len(slices))
for k in order:
    m = runs[k]
    print(f"| {k} | " + " | ".join(f"{m[f'{s}/acc_quant']:.3f} · {m[f'{s}/kl_mean']:.2f} · {m[f'{s}/kl_plain_mean']:.2f}" for s in slices) + " |")
print()
print("| measure | pooled over (run, slice) | within slices (mean) | " + " | ".join(slices) + " |")
print("|---|---|---|" + "---:|" * len(slices))
for name, c in bench["rank_correlation"].items():
    print(f"| {name} | {c['spearman']:+.2f} [{c['ci_low']:+.2f}, {c['ci_high']:+.2f}] | {c['within_slice']:+.2f} [{c['within_ci_low']:+.2f}, {c['within_ci_high']:+.2f}] | "
          + " | ".join(f"{c['per_slice'].get(s, float('nan')):+.2f}" for s in slices) + " |")
