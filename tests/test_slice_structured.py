"""The structured-output slice: deterministic items, strict JSON extraction, schema and value checks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from harness.config import SLICES_DIR
from harness.evaluation.slices import import_slice_module

STRUCTURED_DIR = SLICES_DIR / "structured"
generate = import_slice_module(STRUCTURED_DIR, "generate")
utils = import_slice_module(STRUCTURED_DIR, "utils")


def _item(variant: str, n: int = 14) -> dict:
    return next(i for i in generate.items(size="full", n_items=n) if i["sub_slice"] == variant)


def test_items_are_deterministic_and_seeded():
    assert generate.items(size="quick", seed=5) == generate.items(size="quick", seed=5)
    assert generate.items(size="quick", seed=5) != generate.items(size="quick", seed=6)
    assert generate.items(n_items=10, seed=5) == generate.items(n_items=30, seed=5)[:10]


def test_sizes_cover_their_variants_evenly():
    for size, count in generate.SIZES.items():
        items = generate.items(size=size)
        assert len(items) == count == len({i["id"] for i in items})
        per_variant = {v: sum(i["sub_slice"] == v for i in items) for v in generate.VARIANTS}
        variants = generate.SIZE_VARIANTS[size]
        assert {per_variant[v] for v in variants} == {count // len(variants)}, per_variant
        assert all(per_variant[v] == 0 for v in generate.VARIANTS if v not in variants)
    assert generate.SIZE_VARIANTS["full"] == generate.VARIANTS
    assert min(generate.SIZES["quick"] // len(generate.SIZE_VARIANTS["quick"]), 10) == 10  # >= 10 per sub-slice


def test_variants_override_and_reject_unknown():
    items = generate.items(size="quick", variants=["nested", "number"], n_items=4)
    assert [i["sub_slice"] for i in items] == ["nested", "number", "nested", "number"]
    with pytest.raises(ValueError, match=r"variants \['tables'\] are unknown"):
        generate.items(variants=["tables"])


def test_expected_answers_validate_against_their_schemas():
    for item in generate.items(size="full"):
        schema, expected = json.loads(item["schema"]), json.loads(item["expected"])
        Draft202012Validator.check_schema(schema)
        assert not list(Draft202012Validator(schema).iter_errors(expected)), item["id"]
        assert utils.score(item, item["expected"]) == {"acc": 1, "parsed": 1, "schema_valid": 1}
        assert item["gold_text"].endswith(item["expected"])


def test_prompt_states_text_schema_and_constraints():
    flat = _item("flat")
    expected = json.loads(flat["expected"])
    assert expected["name"] in flat["prompt"] and str(expected["age"]) in flat["prompt"]
    assert 'Format: {"name": string, "age": integer, "city": string}' in flat["prompt"]
    assert flat["schema"] not in flat["prompt"]
    shown = next(i for i in generate.items(n_items=14, show_schema=True) if i["sub_slice"] == "flat")
    assert shown["schema"] in shown["prompt"]
    assert '"priority": "low" | "medium" | "high"' in _item("enum")["prompt"]
    assert "exactly this order" in _item("key_order")["prompt"]
    assert "JSON object only" in _item("json_only")["prompt"]


# --- scorer -------------------------------------------------------------------------------------

FLAT = {"schema": json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                             "member": {"type": "boolean"}},
                              "required": ["name", "age", "member"], "additionalProperties": False}),
        "expected": json.dumps({"name": "Maria", "age": 34, "member": True})}


@pytest.mark.parametrize("response, acc", [
    ('{"name": "Maria", "age": 34, "member": true}', 1),
    ('```json\n{"name": "Maria", "age": 34, "member": true}\n```', 1),
    ('Here is the JSON:\n{"name": "maria ", "age": 34, "member": true}\nHope this helps!', 1),  # prose, case
    ('{"name": "Maria", "age": 34.0, "member": true}', 1),  # 34.0 is an integer in JSON Schema
    ('{"member": true, "age": 34, "name": "Maria"}', 1),  # key order is free unless the item asks
    ('{"name": "Maria", "age": "34", "member": true}', 0),  # wrong type
    ('{"name": "Maria", "age": 34, "member": "yes"}', 0),
    ('{"name": "Maria", "age": 34, "member": 1}', 0),  # 1 is not a boolean
    ('{"name": "Maria", "age": 34, "member": true, "city": "Lyon"}', 0),  # extra key
    ('{"name": "Maria", "age": 34}', 0),  # missing key
    ('{"name": "Maria", "age": 35, "member": true}', 0),  # wrong value
    ('{"name": "Maria", "age": 34, "member": true,}', 0),  # trailing comma
    ("{'name': 'Maria', 'age': 34, 'member': true}", 0),  # single quotes
    ('{"name": "Maria", "name": "Maria", "age": 34, "member": true}', 0),  # duplicate key
    ('{"name": "Maria", "age": NaN, "member": true}', 0),
    ('[{"name": "Maria", "age": 34, "member": true}]', 0),  # an array, not the object
    ("I cannot answer that.", 0),
    ("", 0),
])
def test_score_lenient_item(response: str, acc: int):
    assert utils.score(FLAT, response)["acc"] == acc


def test_score_reports_where_an_answer_failed():
    assert utils.score(FLAT, "no json") == {"acc": 0, "parsed": 0, "schema_valid": 0}
    assert utils.score(FLAT, '{"name": "Maria"}') == {"acc": 0, "parsed": 1, "schema_valid": 0}
    assert utils.score(FLAT, '{"name": "Ana", "age": 3, "member": false}') == {"acc": 0, "parsed": 1,
                                                                              "schema_valid": 1}


def test_json_only_items_reject_prose_and_fences():
    doc = {**FLAT, "json_only": True}
    answer = '{"name": "Maria", "age": 34, "member": true}'
    assert utils.score(doc, f"  {answer}\n")["acc"] == 1
    assert utils.score(doc, f"```json\n{answer}\n```")["acc"] == 0
    assert utils.score(doc, f"Sure: {answer}")["acc"] == 0
    assert utils.score(doc, f"{answer}\nThis object lists Maria's details.")["acc"] == 0


def test_key_order_items_check_top_level_order():
    doc = {**FLAT, "check_key_order": True}
    assert utils.score(doc, '{"name": "Maria", "age": 34, "member": true}')["acc"] == 1
    assert utils.score(doc, '{"age": 34, "name": "Maria", "member": true}')["acc"] == 0


def test_nested_array_enum_and_numbers():
    array = _item("array")
    expected = json.loads(array["expected"])
    assert utils.score(array, json.dumps({**expected, "cities": expected["cities"][::-1]}))["acc"] == 0  # order
    assert utils.score(array, json.dumps({**expected, "cities": ", ".join(expected["cities"])}))["schema_valid"] == 0
    enum = _item("enum")
    wrong_enum = {**json.loads(enum["expected"]), "priority": "urgent"}
    assert utils.score(enum, json.dumps(wrong_enum))["schema_valid"] == 0
    number = _item("number")
    value = json.loads(number["expected"])
    assert value["price_usd"] >= 1000  # written with a thousands separator in the text
    assert utils.score(number, json.dumps({**value, "price_usd": f"${value['price_usd']:,.2f}"}))["acc"] == 0
    assert utils.score(number, json.dumps({**value, "price_usd": round(value["price_usd"])}))["acc"] == (
        value["price_usd"] == round(value["price_usd"]))
    assert utils.score(number, json.dumps({**value, "price_usd": float(value["price_usd"])}))["acc"] == 1
    nested = _item("nested")
    flattened = {k: v for part in json.loads(nested["expected"]).values() for k, v in part.items()}
    assert utils.score(nested, json.dumps(flattened))["acc"] == 0


def test_values_match_normalisation():
    assert utils.values_match("  New   York ", "new york")
    assert utils.values_match(2.50, 2.5) and utils.values_match(3, 3.0)
    assert not utils.values_match(True, 1) and not utils.values_match(1, True)
    assert not utils.values_match("3", 3)


def test_unknown_size_names_the_choices():
    with pytest.raises(ValueError, match="quick"):
        generate.items(size="huge")


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # the tiny model decodes faster on one thread
def test_end_to_end_on_tiny_random_model(tmp_path: Path):
    from harness.models import loading as models
    from harness.config import compose
    from harness.evaluation.evaluate import EvalSettings, evaluate_slice, make_lm
    from harness.config import to_config
    from harness.evaluation.slices import resolve

    cfg = to_config(compose(["model=tiny_random", "slices=[structured]", "slices.structured.n_items=3",
                             f"paths.results_dir={tmp_path}/results"]))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    settings = EvalSettings(batch_size=3, max_length=cfg.model.max_length, chat_template=False)
    records, aggregates = evaluate_slice(make_lm(loaded.model, loaded.tokenizer, settings),
                                         resolve(cfg.slices)[0], settings)
    assert list(records["sub_slice"]) == list(generate.SIZE_VARIANTS["quick"][:3])
    assert (records["correct"] == 0).all()  # random weights do not write valid JSON
    assert set(aggregates) == {"harness_structured_json"}
