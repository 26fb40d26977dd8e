"""The documentation is tested like code: a stale reference, a broken link, a command that no longer
parses, a snippet that no longer runs or a README that grows a lab notebook again fails here.

* the generated references (configuration, presets, CLI, metrics, benchmark tables) equal what
  ``scripts/docs_reference.py`` renders from the code now, and nothing is left undocumented;
* ``mkdocs build --strict`` passes (nav, links and anchors validated), and a broken anchor fails it;
* every ``python -m harness …`` command in a ``bash`` block of the README and the docs composes its run
  config (what ``--cfg job`` prints; no work is done) and every tool command parses;
* the Python snippets of the docs run (on ``tiny_random`` and ``results/example``);
* the README: at most 200 lines, the test and run commands, no issue numbers, commit hashes or dated
  timings (its numbers about ``results/example`` are generated blocks, checked by tests/test_example.py).
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README = REPO / "README.md"


def _load_generator():
    spec = importlib.util.spec_from_file_location("docs_reference", REPO / "scripts" / "docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules["docs_reference"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


GEN = _load_generator()


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


# ----------------------------------------------------------------------------------------------------
# generated references


@pytest.mark.parametrize("page", sorted(GEN.PAGES))
def test_generated_reference_is_current(page):
    path = DOCS / page
    assert path.exists(), f"docs/{page} is missing; run .venv/bin/python scripts/docs_reference.py"
    want = GEN.PAGES[page]().rstrip("\n") + "\n"
    assert path.read_text() == want, f"docs/{page} differs from the code; run .venv/bin/python scripts/docs_reference.py"


# Fields whose one description is meant for both (none today): {"Class.field", ...} sets, each declared here.
SHARED_DESCRIPTIONS: list[set[str]] = []


def test_each_config_field_is_described_by_its_own_text():
    """A block comment above one field once described the fields after it too: position_buckets read as
    max_gen_toks, gate.chance as min_headroom, cluster_field as stratum_field."""
    by_text: dict[str, set[str]] = {}
    for cls, fields in GEN.config_fields().items():
        for f in fields:
            by_text.setdefault(f.meaning, set()).add(f"{cls}.{f.name}")
    shared = [names for text, names in by_text.items() if text and len(names) > 1 and names not in SHARED_DESCRIPTIONS]
    assert shared == []


def test_every_path_named_in_a_field_description_exists():
    from tests.test_message_paths import named_paths

    missing = [f"{cls}.{f.name}: {name}" for cls, fields in GEN.config_fields().items() for f in fields
               for name in named_paths(f.meaning) if not (REPO / name).exists()]
    assert missing == []
    named = [name for fields in GEN.config_fields().values() for f in fields for name in named_paths(f.meaning)]
    assert "docs/explanation/strata.md" in named  # the check reads the descriptions


def test_the_description_reader_keeps_a_block_comment_to_its_own_field(tmp_path):
    source = tmp_path / "planted.py"
    source.write_text("from dataclasses import dataclass\n\n\n@dataclass\nclass Planted:\n"
                      "    # the first field's text\n    first: int = 1\n    second: int = 2\n"
                      "    third: int = 3  # the third's own\n")
    spec = importlib.util.spec_from_file_location("planted", source)
    module = importlib.util.module_from_spec(spec)
    sys.modules["planted"] = module
    spec.loader.exec_module(module)
    meanings = {f.name: f.meaning for f in GEN.dataclass_fields(module, source)["Planted"]}
    assert meanings == {"first": "the first field's text", "second": "", "third": "the third's own"}


def test_every_config_field_preset_tool_and_metric_is_documented():
    assert GEN.problems() == []
    fields = GEN.config_fields()
    configuration = (DOCS / "reference" / "configuration.md").read_text()
    n_fields = sum(len(v) for v in fields.values())
    assert n_fields > 100  # the run config, not an empty parse
    for cls, prefixes in GEN.SECTIONS:
        for f in fields[cls]:
            assert f"`{prefixes[0]}{f.name}`" in configuration
    presets = (DOCS / "reference" / "presets.md").read_text()
    for path in GEN.preset_files():
        assert f"`{path.relative_to(REPO)}`" in presets or path.name == "config.yaml"
    cli = (DOCS / "reference" / "cli.md").read_text()
    for name in GEN.TOOLS:
        assert f"usage: python -m harness.{name}" in cli
    metrics = (DOCS / "reference" / "metrics.md").read_text()
    for norm in GEN.summary_keys():
        assert f"| `{norm}` |" in metrics and GEN.METRICS[norm][0]


def test_reference_facts_the_old_readme_got_wrong():
    """eval.reference_topk's default and eval.reference_store's row come from the code."""
    from harness.config import EvalConfig

    configuration = (DOCS / "reference" / "configuration.md").read_text()
    topk = next(line for line in configuration.splitlines() if line.startswith("| `eval.reference_topk`"))
    assert f"`{EvalConfig().reference_topk}`" in topk
    store = next(line for line in configuration.splitlines() if line.startswith("| `eval.reference_store`"))
    assert f"`{EvalConfig().reference_store}`" in store and "exact" in store


def test_metric_keys_are_normalised_to_their_variable_parts():
    slices = {"math", "code"}
    assert GEN.normalise_key("metrics/math/kl_p99_9", slices, set()) == "metrics/<slice>/kl_p<q>"
    assert GEN.normalise_key("metrics/overall/acc_delta", slices, set()) == "metrics/<slice>/acc_delta"
    assert GEN.normalise_key("metrics/code/kl_plain_p99", slices, set()) == "metrics/<slice>/kl_plain_p99"
    assert GEN.normalise_key("quant/ledger/H100/fp8/kv_tokens", slices, set()) == "quant/ledger/<gpu>/<kv>/kv_tokens"
    assert GEN.normalise_key("quant/decode_floor/70B/H200_ms", slices, set()) == "quant/decode_floor/<size>/<gpu>_ms"
    assert GEN.normalise_key("lm_eval_aggregates/reference/t1", slices, {"t1"}) == "lm_eval_aggregates/reference/<task>"


# ----------------------------------------------------------------------------------------------------
# the site


def _build(config_dir: Path, site: Path) -> subprocess.CompletedProcess:
    # not -q: a quiet build does not count warnings, and --strict fails on warnings only
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=config_dir, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.slow
def test_site_builds_strictly_and_a_broken_anchor_fails_it(tmp_path):
    pytest.importorskip("mkdocs")
    built = _build(REPO, tmp_path / "site")
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()
    # The same tree with one link to a missing anchor must fail: anchors are validated, not ignored.
    copy = tmp_path / "copy"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "getting-started" / "quickstart.md"
    page.write_text(page.read_text() + "\n[nowhere](../reference/configuration.md#no-such-section)\n")
    broken = _build(copy, tmp_path / "site2")
    assert broken.returncode != 0
    assert "no-such-section" in broken.stdout + broken.stderr


def test_every_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    for page in DOCS.rglob("*.md"):
        assert str(page.relative_to(DOCS)) in nav, f"{page} is not in mkdocs.yml's nav"


def test_images_the_pages_show_exist():
    for page in DOCS.rglob("*.md"):
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text()):
            assert (page.parent / target).resolve().exists(), f"{page}: image {target} is missing"


# ----------------------------------------------------------------------------------------------------
# commands

COMMAND = re.compile(r"^(?:\S+=\S+\s+)*(?:taskset -c \S+\s+|nice\s+)*(?:\.venv/bin/)?python3? -m (harness(?:\.\w+)?)(?=\s|$)(.*)$")
MAKE = re.compile(r"^make run(?:\s+ARGS=(\"[^\"]*\"|'[^']*'))?\s*$")


def shell_commands(text: str) -> list[str]:
    """Lines of the ```bash blocks, continuation lines joined, comments dropped."""
    out: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, module, argv) of every harness command in a bash block of the README or the docs."""
    found = []
    for path in doc_files():
        for line in shell_commands(path.read_text()):
            make = MAKE.match(line)
            if make:
                found.append((f"{path.name}: {line}", "harness", shlex.split(shlex.split(make.group(1) or "''")[0])))
                continue
            match = COMMAND.match(line)
            if match:
                found.append((f"{path.name}: {line}", match.group(1), shlex.split(match.group(2))))
    return found


def _sweep(overrides: list[str]) -> list[list[str]]:
    """Jobs that between them use every value of a multirun's comma lists: the first value of each list,
    then each other value alone (every preset a sweep names is composed, without the full product)."""
    lists = []
    for item in overrides:
        key, sep, value = item.partition("=")
        values = value.split(",") if sep and "," in value and not value.startswith(("[", "{")) else [value]
        lists.append((key, sep, values))
    first = [f"{k}{sep}{v[0]}" if sep else k for k, sep, v in lists]
    jobs = [first]
    for i, (key, sep, values) in enumerate(lists):
        for value in values[1:]:
            jobs.append([*first[:i], f"{key}={value}", *first[i + 1:]])
    return jobs


def test_documented_commands_are_found():
    commands = documented_commands()
    modules = {module for _, module, _ in commands}
    assert len(commands) >= 30
    assert {"harness", "harness.gate", "harness.compare", "harness.plan", "harness.ledger"} <= modules
    readme = [where for where, _, _ in commands if where.startswith("README.md")]
    assert any("make run" in where for where in readme) and len(readme) >= 4


def test_every_documented_command_composes_or_parses():
    from harness import cli

    failures = []
    composed: set[tuple[str, ...]] = set()

    def compose(job: list[str]) -> None:
        if tuple(job) not in composed:
            cli.compose_run(job)
            composed.add(tuple(job))

    for where, module, argv in documented_commands():
        try:
            if module == "harness":
                overrides = [a for a in argv if a not in ("-m", "--multirun", "--cfg", "job")]
                jobs = _sweep(overrides) if {"-m", "--multirun"} & set(argv) else [overrides]
                for job in jobs:
                    compose(job)
            else:
                name = module.split(".", 1)[1]
                tool = GEN.tool_of(name)
                for variant, face in GEN.TOOL_VARIANTS.get(name, []):  # e.g. harness.export format=gguf
                    if variant in argv:
                        tool = importlib.import_module(face).TOOL
                parsed = cli.parse(tool, [a for a in argv if a not in ("--help", "-h")])
                if tool.run_config:
                    jobs = _sweep(parsed.overrides) if parsed.flags else [parsed.overrides]
                    for job in jobs:
                        compose(job)
        except Exception as exc:  # collect them all: one run names every stale command
            failures.append(f"{where}\n    {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)


def test_a_stale_command_would_be_caught():
    from harness import cli

    with pytest.raises(cli.UsageError):
        cli.compose_run(["quant=int4_g129"])
    with pytest.raises(cli.UsageError):
        cli.parse(GEN.tool_of("gate"), ["results/", "no_such_option=1"])


# ----------------------------------------------------------------------------------------------------
# Python snippets


@pytest.mark.slow
def test_python_snippets_run():
    """Each page's ```python blocks run in order, in one fresh interpreter for all pages."""
    pages = {}
    for path in doc_files():
        blocks = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
        if blocks:
            pages[str(path.relative_to(REPO))] = "\n".join(blocks)
    assert pages, "no Python snippets found"
    program = "\n".join(
        f"print('== {name}', flush=True)\nexec(compile({code!r}, {name!r}, 'exec'), {{'__name__': '__main__'}})"
        for name, code in pages.items())
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in pages:
        assert f"== {name}" in done.stdout


# ----------------------------------------------------------------------------------------------------
# the README

ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\d+|(?<![\w/&])#\d{1,5}\b", re.I)
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b(?:morning|afternoon|evening|yesterday|today's)\b|\b\d+ min \d+ s\b", re.I)


def lint_readme(text: str) -> list[str]:
    problems = []
    lines = text.splitlines()
    if len(lines) > 200:
        problems.append(f"{len(lines)} lines (at most 200)")
    for number, line in enumerate(lines, 1):
        for name, pattern in (("issue number", ISSUE_NUMBER), ("commit hash", COMMIT_HASH), ("dated timing", DATED)):
            match = pattern.search(line)
            if match:
                problems.append(f"line {number}: {name} {match.group(0)!r}")
    return problems


def test_readme_is_short_and_no_lab_notebook():
    text = README.read_text()
    assert lint_readme(text) == []
    assert "make test" in text and "make run" in text
    assert re.search(r"tests are run with `make test`", text)
    assert "\n## Architecture\n" in text
    assert re.search(r"about \d+ minutes on a 2-core CPU machine", " ".join(text.split()))  # the default job's honest time


def test_readme_lint_catches_what_the_old_readme_had():
    old = ("Since the served-format divergence (issue 24) the divergence stage scores every item\n"
           "reply: `make run` on a fresh clone of c358eb4 took **9 min 22 s**\n"
           "On a fresh clone of 71aebfb (2026-12-02, new `.venv`) in the afternoon\n")
    found = lint_readme(old)
    assert any("issue number" in p for p in found)
    assert sum("commit hash" in p for p in found) == 2
    assert any("dated timing" in p for p in found)
    assert lint_readme("quant=int4_g128 · 374 items · sha256 · cuda:0 · 0.435 · #### answer") == []
