"""Math slice items: exact answers, the grid of each size, determinism."""
from __future__ import annotations

import re

import pytest

from harness.config import SLICES_DIR
from harness.evaluation.slices import import_slice_module

generate = import_slice_module(SLICES_DIR / "math", "generate")
utils = import_slice_module(SLICES_DIR / "math", "utils")


def _value(expr: str) -> int:
    """Integer + - * with the usual precedence, by hand (not Python's eval, which the generator uses)."""
    tokens = expr.split()
    terms, signs, product = [], [1], int(tokens[0])
    for op, number in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            product *= int(number)
        else:
            terms.append(product)
            signs.append(1 if op == "+" else -1)
            product = int(number)
    terms.append(product)
    return sum(sign * term for sign, term in zip(signs, terms))


@pytest.mark.parametrize("size", ["quick", "full"])
def test_answers_are_the_value_of_the_question(size):
    for item in generate.items(size=size):
        question = item["question"]
        numbers = [int(n) for n in re.findall(r"\d+", question)]
        if "apples" in question or "coins" in question:
            expected = numbers[0] + numbers[1] - numbers[2]  # has a, receives b, loses c
        else:
            expected = _value(re.search(r"\d[\d +*-]*\d|\d", question).group(0))
        assert expected == int(item["answer"]), item
        assert item["choices"][item["label"]] == item["answer"]


def test_quick_keeps_the_easy_cells_full_covers_the_grid():
    quick = {item["sub_slice"] for item in generate.items(size="quick")}
    full = {item["sub_slice"] for item in generate.items(size="full")}
    assert quick == {"steps=1/digits=1", "steps=1/digits=2", "steps=2/digits=1"}
    assert full == {f"steps={s}/digits={d}" for s in (1, 2, 3) for d in (1, 2, 3)}
    counts = [sum(i["sub_slice"] == cell for i in generate.items(size="quick")) for cell in sorted(quick)]
    assert counts == [32, 32, 32]


def test_items_are_deterministic_and_reject_unknown_size():
    assert generate.items(size="quick", seed=7) == generate.items(size="quick", seed=7)
    assert generate.items(size="quick", seed=7) != generate.items(size="quick", seed=8)
    with pytest.raises(ValueError, match="size='huge' is unknown"):
        generate.items(size="huge")


def test_extract_answer_reads_the_number_after_the_last_equals_sign():
    assert utils.extract_answer("7 * 9 + 5 = 68") == utils.normalize_number("68")
    assert utils.extract_answer("The answer is 1,000.") == utils.normalize_number("1000")
    assert utils.extract_answer("no number") is None
