"""The gate's output: the table printed and logged, gate.json, and gate.xml (JUnit: one test case
per slice and criterion, inconclusive as skipped, the numbers in the message)."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd

from harness.decision.criteria import FAIL, INCONCLUSIVE, GateDecision, _fmt
from harness.infra.cache import atomic_write_json, atomic_write_text
from harness.results.formatting import pct, points


def junit_xml(decision: GateDecision) -> str:
    """JUnit XML: a testsuite per run, a testcase per slice and criterion; inconclusive is skipped."""
    root = ET.Element("testsuites", name="harness.gate")
    totals = {"tests": 0, "failures": 0, "skipped": 0}
    for run in decision.runs:
        suite = ET.SubElement(root, "testsuite", name=run.run_name)
        counts = {"tests": len(run.criteria), "failures": 0, "skipped": 0}
        for c in run.criteria:
            case = ET.SubElement(suite, "testcase", classname=f"{run.run_name}.{c.slice}", name=c.criterion)
            if c.outcome == FAIL:
                ET.SubElement(case, "failure", message=c.message, type="gate.fail").text = c.message
                counts["failures"] += 1
            elif c.outcome == INCONCLUSIVE:
                ET.SubElement(case, "skipped", message=c.message)
                counts["skipped"] += 1
            ET.SubElement(case, "system-out").text = json.dumps(c.numbers, sort_keys=True)
        for key, value in counts.items():
            suite.set(key, str(value))
            totals[key] += value
        suite.set("errors", "0")
    for key, value in totals.items():
        root.set(key, str(value))
    root.set("errors", "0")
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def run_labels(decision: GateDecision) -> list[str]:
    """Each run's label in the table: its run name, with its directory where two gated runs share a name
    (two runs of one config, e.g. results/example beside a fresh default job)."""
    names = [run.run_name for run in decision.runs]
    return [f"{run.run_name} ({run.directory})" if names.count(run.run_name) > 1 else run.run_name
            for run in decision.runs]


def table(decision: GateDecision) -> pd.DataFrame:
    rows = []
    for run, label in zip(decision.runs, run_labels(decision)):
        for c in run.criteria:
            x = c.numbers
            if c.criterion == "accuracy_noninferiority":
                if x.get("interval") == "sequence":  # a sequential run: items used of the slice's, the sequence's bounds
                    detail = (f"Δ {100 * x['delta']:+.1f} seq [{100 * x['delta_ci_low']:+.1f}, "
                              f"{100 * x['delta_ci_high']:+.1f}] m {100 * x['margin']:.1f}; "
                              f"{x['n']}/{x['items_total']} items")
                else:
                    detail = (f"Δ {100 * x['delta']:+.1f} [{100 * x['delta_ci_low']:+.1f}, {100 * x['delta_ci_high']:+.1f}] "
                              f"({100 * x['ci_level']:.4g} %) m {100 * x['margin']:.1f}")
                n_needed = x["n_needed"] if x["n_needed"] is not None else \
                    (f"fail at ~{x['n_fail']}" if x.get("n_fail") is not None else  # a pass is out of reach
                     "not by more items" if not x["settleable"] and c.outcome == INCONCLUSIVE
                     and x.get("interval") != "sequence" else "")
                rows.append({"run": label, "slice": c.slice, "criterion": "accuracy", "outcome": c.outcome,
                             "n": x["n"], "acc ref %": pct(x["acc_ref"]), "Δ pt [CI] · margin": detail,
                             "fail bound pt": points(x["fail_ci_high"]), "p_ni": _fmt(x["noninferiority_p"], ".3g"),
                             "MDE pt": pct(x["mde"]), "n_needed": n_needed, "why": "; ".join(c.reasons)})
            else:
                rows.append({"run": label, "slice": c.slice, "criterion": c.criterion, "outcome": c.outcome,
                             "n": "", "acc ref %": "", "Δ pt [CI] · margin": c.message.split(": ", 1)[-1],
                             "fail bound pt": "", "p_ni": "", "MDE pt": "", "n_needed": "", "why": "; ".join(c.reasons)})
    return pd.DataFrame(rows)


SHOWN = ["slice", "criterion", "outcome", "n", "acc ref %", "Δ pt [CI] · margin", "fail bound pt", "MDE pt", "n_needed"]


def render(decision: GateDecision, json_path: Path | str, xml_path: Path | str) -> str:
    """What ``python -m harness.gate`` prints: per run its name, then one row per gated slice and criterion
    (percent and points), then each row's reasons, the notes, and the outcome line with the exit code."""
    shown = table(decision)
    if shown.empty:
        lines = ["(no slices gated)"]
    else:
        lines = []
        for run_name, rows in shown.groupby("run", sort=False):
            lines += [f"run {run_name}", rows[SHOWN].to_string(index=False), ""]
            lines += [f"  {row['slice']} ({row['criterion']}): {row['why']}" for row in rows.to_dict("records")
                      if row["why"]]
            lines.append("")
    lines += [f"note: {note}\n" for note in decision.notes]
    lines.append(f"gate: {decision.outcome} (exit {decision.exit_code}); wrote {json_path} and {xml_path}")
    return "\n".join(lines)


def write(decision: GateDecision, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "gate.json", decision.to_dict())
    atomic_write_text(out / "gate.xml", junit_xml(decision))
    return out / "gate.json", out / "gate.xml"
