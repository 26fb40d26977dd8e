"""Long-generation slice: prompts, the per-reply degeneration checks, and the paired reply comparison."""
from __future__ import annotations

import pandas as pd
import pytest

from harness.results import longgen
from harness.config import SLICES_DIR
from harness.evaluation.slices import import_slice_module

DIR = SLICES_DIR / "long_generation"
generate = import_slice_module(DIR, "generate")
utils = import_slice_module(DIR, "utils")

FLUENT = ("The refrigerator keeps food cold by moving heat from the inside to the outside. A liquid called the "
          "refrigerant flows through pipes at the back. When it evaporates inside the fridge it absorbs heat, and "
          "a compressor squeezes the vapour so that it becomes hot. The hot gas then releases that heat into the "
          "kitchen through the coils behind the fridge, where it condenses back into a liquid. An expansion valve "
          "lowers its pressure again, it cools down sharply, and the cycle starts over while the thermostat "
          "decides when the compressor should run.")


def test_sizes_kinds_and_determinism():
    for size, count in generate.SIZES.items():
        items = generate.items(size=size)
        assert len(items) == count == len({i["id"] for i in items})
        assert {i["sub_slice"] for i in items} == set(generate.KINDS)
    assert generate.items(n_items=9) == generate.items()[:9]
    with pytest.raises(ValueError, match="exceeds"):
        generate.items(n_items=60)


def test_repeat_rate_counts_repeated_four_grams():
    # 6 four-grams: "a b c d", "b c d a", "c d a b", "d a b c", "a b c d" (repeat), "b c d a" (repeat)
    assert utils.repeat_rate("a b c d a b c d a".split()) == pytest.approx(2 / 6)
    assert utils.repeat_rate("one two three".split()) == 0.0


def test_loop_detector_and_the_pass_criterion():
    looped = FLUENT + " and then the and then the and then the and then the"
    assert utils.ends_in_loop(utils.words(looped))
    assert not utils.ends_in_loop(utils.words(FLUENT))
    assert utils.score(FLUENT) == {"acc": 1, "repeat_rate": pytest.approx(utils.repeat_rate(utils.words(FLUENT))),
                                   "loop": 0, "early_stop": 0, "n_words": float(len(utils.words(FLUENT)))}
    assert utils.score(looped)["acc"] == 0 and utils.score(looped)["loop"] == 1
    short = utils.score("Refrigerators move heat outside.")
    assert short["acc"] == 0 and short["early_stop"] == 1
    circling = " ".join(["The fridge is cold because the fridge is cold."] * 8)
    assert utils.score(circling)["repeat_rate"] > utils.MAX_REPEAT_RATE and utils.score(circling)["acc"] == 0


def test_first_difference_and_survival_by_hand():
    assert longgen.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert longgen.first_difference([1, 2, 3], [1, 2]) == 2
    assert longgen.first_difference([1, 2], [1, 2]) is None
    assert longgen.first_difference([5], [6]) == 0
    # items: differs at 2; identical, 4 long; differs at 0
    curve = longgen.survival([2, None, 0], [5, 4, 3], [1, 2, 3, 4, 5])
    assert curve.tolist() == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3, 0.0])


def test_analyse_a_constructed_run():
    vocab: dict[str, int] = {}

    def tokenize(text: str) -> list[int]:
        return [vocab.setdefault(w, len(vocab)) for w in text.split()]

    items = pd.DataFrame([
        {"item_id": "a", "slice": "long_generation", "sub_slice": "explain", "response_ref": FLUENT,
         "response_quant": FLUENT},
        {"item_id": "b", "slice": "long_generation", "sub_slice": "story", "response_ref": FLUENT,
         "response_quant": " ".join(FLUENT.split()[:10]) + " and the and the and the and the and the"},
    ])
    report = longgen.analyse(items, tokenize)
    assert report.items["first_diff"].tolist()[1] == 10
    assert pd.isna(report.items["first_diff"].tolist()[0])
    assert report.summary["identical_fraction"] == 0.5
    assert report.summary["loop_rate_quant"] == 0.5 and report.summary["loop_rate_ref"] == 0.0
    assert "## Long generation" in report.markdown()
    at_16 = report.curve.set_index("position").loc[16, "survival"]
    assert at_16 == 0.5  # item b parted at token 10
