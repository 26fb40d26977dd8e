"""Tabulate finished jobs run both ways: the full evaluation and ``eval.sequential=true``, same model and scheme.

``python benchmarks/bench_sequential_jobs.py FULL_RESULTS_DIR SEQUENTIAL_RESULTS_DIR [...]``

For each scheme found in both directories, per slice: items the candidate answered (sequential)
of the items there are, the round it stopped at and why, the gate's outcome each way (from each
run's gate.json), and per job the candidate's evaluation time (the ``evaluate`` stage) and the
job's wall time (summary.json's started_at → ended_at). A verdict that differs is listed with
both reasons. Prints Markdown; nothing is recomputed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _runs(directory: Path) -> dict[str, dict]:
    """scheme -> {"summary": ..., "gate": {slice: (outcome, message)}} of the finished runs in ``directory``."""
    out = {}
    for summary_path in sorted(directory.glob("*/summary.json")):
        summary = json.loads(summary_path.read_text())
        gate_path = summary_path.parent / "gate.json"
        outcomes = {}
        if gate_path.exists():
            for run in json.loads(gate_path.read_text())["runs"]:
                for criterion in run["criteria"]:
                    if criterion["criterion"] == "accuracy_noninferiority":
                        outcomes[criterion["slice"]] = (criterion["outcome"], criterion["message"])
        out[summary["scheme"]] = {"summary": summary, "gate": outcomes}
    return out


def table(full_dir: Path, sequential_dir: Path) -> str:
    full, sequential = _runs(full_dir), _runs(sequential_dir)
    lines = ["| scheme | slice | items used | stop | gate, full | gate, sequential |", "|---|---|---:|---|---|---|"]
    jobs = ["| scheme | evaluate, full | evaluate, sequential | job wall, full | job wall, sequential | items used |",
            "|---|---:|---:|---:|---:|---:|"]
    disagreements = []
    for scheme in sorted(set(full) & set(sequential)):
        seq = sequential[scheme]["summary"].get("sequential") or {}
        used = total = 0
        for name, record in seq.items():
            used, total = used + record["items_used"], total + record["items_total"]
            before = full[scheme]["gate"].get(name, ("–", ""))
            after = sequential[scheme]["gate"].get(name, ("–", ""))
            lines.append(f"| {scheme} | {name} | {record['items_used']}/{record['items_total']} | round "
                         f"{record['rounds_used']}/{record['rounds_total']}: {record['reason']} | {before[0]} | "
                         f"{after[0]} |")
            if before[0] != after[0]:
                disagreements.append(f"- {scheme} · {name}: full {before[0]} ({before[1]}); sequential {after[0]} "
                                     f"({after[1]})")
        f_sum, s_sum = full[scheme]["summary"], sequential[scheme]["summary"]
        jobs.append(f"| {scheme} | {f_sum['timings'].get('evaluate', float('nan')):.0f} s | "
                    f"{s_sum['timings'].get('evaluate', float('nan')):.0f} s | "
                    f"{f_sum['ended_at'] - f_sum['started_at']:.0f} s | {s_sum['ended_at'] - s_sum['started_at']:.0f} s | "
                    f"{used}/{total} |")
    text = "\n".join(lines) + "\n\n" + "\n".join(jobs) + "\n"
    if disagreements:
        text += "\nVerdicts that differ:\n\n" + "\n".join(disagreements) + "\n"
    return text


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    print(table(Path(args[0]), Path(args[1])), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
