"""The example's numbers in the README and the docs, generated from ``results/example``.

Every number a newcomer reads about the default job comes from the example through the code that
prints it: the result table is :func:`harness.results.report.side_by_side` (what the job's console and
report.md show) with the gate's outcome beside it, the sample gate output is what
``python -m harness.gate results/example`` prints (:func:`harness.decision.gate_output.render`), and
the sentences around them are written from the same numbers. Each lives in a marked block::

    <!-- example:table -->
    ...generated...
    <!-- /example:table -->

    .venv/bin/python scripts/example_docs.py          # rewrite every block, forest.png and flips.png
    .venv/bin/python scripts/example_docs.py --check  # exit 1 naming each block that differs

``scripts/regenerate_example.py`` runs it after a fresh default job; ``tests/test_example.py`` runs the
check, so a statistics change cannot land with stale docs.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

EXAMPLE = REPO / "results" / "example"
FOREST = REPO / "docs" / "assets" / "forest.png"
FLIPS = REPO / "docs" / "assets" / "flips.png"
PAGES = [REPO / "README.md", REPO / "docs" / "index.md", REPO / "docs" / "getting-started" / "reading-results.md",
         REPO / "docs" / "guides" / "deciding-to-ship.md", REPO / "results" / "README.md"]
BLOCK = re.compile(r"(<!-- example:(?P<name>[a-z-]+) -->\n)(?P<body>.*?)(<!-- /example:(?P=name) -->)", re.S)


def comparison(directory: Path = EXAMPLE):
    """The run's comparison as its job left it on disk (items, per-slice statistics, tokens, generation)."""
    from harness.results.summary import Comparison

    return Comparison(items=pd.read_parquet(directory / "items.parquet"),
                      item_stats=pd.read_parquet(directory / "item_stats.parquet"),
                      token_stats=pd.read_parquet(directory / "token_stats.parquet"),
                      generation=pd.read_parquet(directory / "generation.parquet"))


def decision(directory: Path = EXAMPLE):
    """The gate's decision on the run at its default settings, as ``python -m harness.gate`` takes it."""
    from harness.config import GateConfig
    from harness.decision import gate

    return gate.decide([directory], GateConfig())


def _accuracy_criteria(decided) -> dict[str, object]:
    (run,) = decided.runs
    return {c.slice: c for c in run.criteria if c.criterion == "accuracy_noninferiority"}


def table_block() -> str:
    """The job's own result table (slices and overall) with the gate's outcome per slice."""
    from harness.results.report import side_by_side

    decided = decision()
    outcomes = {name: c.outcome for name, c in _accuracy_criteria(decided).items()}
    outcomes["overall"] = f"{decided.outcome} (run)"
    table = side_by_side(comparison())
    table["gate"] = table["slice"].map(outcomes).fillna("–")
    columns = ["slice", "n", "clusters", "acc ref %", "acc quant %", "Δacc pt [95% CI]", "flips r→w / w→r",
               "verdict", "gate", "KL mean ± SE"]
    align = ["left", "right", "right", "right", "right", "left", "left", "left", "left", "right"]
    return table[columns].to_markdown(index=False, disable_numparse=True, colalign=align) + "\n"


def gate_block() -> str:
    """What the gate prints on the example, as a terminal shows it."""
    from harness.decision.gate_output import render

    where = EXAMPLE.relative_to(REPO)
    text = render(decision(), where / "gate.json", where / "gate.xml")
    return f"```text\n$ python -m harness.gate {where}\n{text}\n```\n"


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def gate_line() -> str:
    """One paragraph: which slices the gate fails, which it leaves open, and what would settle them."""
    criteria = _accuracy_criteria(decision())
    by = {o: [s for s, c in criteria.items() if c.outcome == o] for o in ("fail", "inconclusive", "pass")}
    parts = []
    if by["fail"]:
        parts.append(f"the gate fails {_names(by['fail'])}")
    if by["pass"]:
        parts.append(f"passes {_names(by['pass'])}")
    for name in by["inconclusive"]:
        x = criteria[name].numbers
        settle = (f"about {x['n_fail']} items would settle it as a fail, and no number of items would pass it"
                  if x.get("n_fail") else f"about {x['n_needed']} items would settle it" if x.get("n_needed")
                  else "more items of the same kind would not settle it")
        parts.append(f"{name} is inconclusive ({x['n']} items in {x['n_clusters']} clusters; {settle})")
    return "On this example " + "; ".join(parts) + ".\n"


def summary_block() -> str:
    """results/README.md's paragraph on the example: items, clusters, the overall Δ, flips, KL, verdicts."""
    import json

    result = json.loads((EXAMPLE / "summary.json").read_text())
    m = result["metrics"]
    stats = comparison().item_stats
    verdicts = stats[stats["level"] == "slice"].set_index("slice")["verdict"]
    groups: dict[str, list[str]] = {}
    for name, verdict in verdicts.items():
        groups.setdefault(str(verdict), []).append(str(name))
    verdict_text = "; ".join(f"{_names(names)}: \"{verdict}\"" for verdict, names in groups.items())
    return (f"{int(m['overall/n'])} items in {int(m['overall/n_clusters'])} clusters. Overall Δaccuracy "
            f"{100 * m['overall/acc_delta']:+.1f} pt [{100 * m['overall/acc_delta_ci_low']:+.1f}, "
            f"{100 * m['overall/acc_delta_ci_high']:+.1f}] (95 %), {int(m['overall/flips_right_to_wrong'])} "
            f"right→wrong and {int(m['overall/flips_wrong_to_right'])} wrong→right flips; mean KL on the served "
            f"reply {m['overall/kl_mean']:.3f} nats per token. Verdicts: {verdict_text}. {gate_line()}")


BLOCKS: dict[str, Callable[[], str]] = {"table": table_block, "gate-output": gate_block, "gate-line": gate_line,
                                        "summary": summary_block}


def rewrite(text: str, rendered: dict[str, str]) -> str:
    """``text`` with every marked block's body replaced by its rendering; an unknown block name is an error."""
    def body(match: re.Match) -> str:
        name = match["name"]
        if name not in rendered:
            raise KeyError(f"unknown example block {name!r}; known: {sorted(rendered)}")
        return match.group(1) + rendered[name] + match.group(4)

    return BLOCK.sub(body, text)


def plot_assets(forest_png: Path = FOREST, flips_png: Path = FLIPS) -> list[Path]:
    """docs/assets/forest.png (Δ per slice with its interval) and flips.png (items lost and gained per
    slice): the example as ``harness.compare`` draws it."""
    from harness.compare.analysis import analyse
    from harness.compare.options import CompareOptions
    from harness.compare.render.plots import flip_bars, forest
    from harness.compare.sources import load_results_dir

    report = analyse([load_results_dir(EXAMPLE)], CompareOptions())
    stats = report.item_stats[report.item_stats["level"].isin(["overall", "slice"])]
    forest(stats, report.labels, margin=report.options.margin,
           title="results/example: Δ accuracy per slice").savefig(forest_png, dpi=110)
    flip_bars(report.headline()).savefig(flips_png, dpi=110)
    return [forest_png, flips_png]


def main(argv: list[str]) -> int:
    check = "--check" in argv
    rendered = {name: render() for name, render in BLOCKS.items()}
    stale = []
    for page in PAGES:
        text = page.read_text()
        new = rewrite(text, rendered)
        if new != text:
            stale.append(page.relative_to(REPO))
            if not check:
                page.write_text(new)
    if check:
        for page in stale:
            print(f"{page}: its example blocks differ from results/example; run .venv/bin/python "
                  "scripts/example_docs.py", file=sys.stderr)
        return 1 if stale else 0
    drawn = ", ".join(str(p.relative_to(REPO)) for p in plot_assets())
    print(f"rewrote {len(stale)} page(s); drew {drawn}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
