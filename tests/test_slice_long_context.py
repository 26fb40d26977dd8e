"""The long-context slice: deterministic items, bucket x depth coverage, token-exact lengths,
non-compressible filler, the scorer, and an lm-eval run on the tiny random model."""
from __future__ import annotations

import os
import re
import zlib

import pytest

from harness.config import SLICES_DIR, compose, load_model_config
from harness.evaluation.slices import import_slice_module, resolve

generate = import_slice_module(SLICES_DIR / "long_context", "generate")
utils = import_slice_module(SLICES_DIR / "long_context", "utils")
filler = generate.filler

CACHE_DIR = os.path.expanduser(os.environ.get("HARNESS_CACHE_DIR", "~/.cache/quant-harness"))


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from harness.infra.cache import Cache
    from harness.models.loading import load_tokenizer

    return load_tokenizer(load_model_config("smollm2_135m"), Cache(CACHE_DIR))


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_tokenizer, tmp_path_factory) -> str:
    """A directory the generator can load the tokenizer from, as the harness passes it."""
    if os.path.exists(os.path.join(str(smollm2_tokenizer.name_or_path), "tokenizer.json")):
        return str(smollm2_tokenizer.name_or_path)
    directory = tmp_path_factory.mktemp("smollm2_tokenizer")
    smollm2_tokenizer.save_pretrained(directory)
    return str(directory)


def test_same_seed_same_items_other_seed_other_items() -> None:
    first = generate.items(size="quick", seed=7)
    again = generate.items(size="quick", seed=7)
    other = generate.items(size="quick", seed=8)
    assert first == again
    assert [i["id"] for i in first] != [i["id"] for i in other]
    assert all(a["prompt"] != b["prompt"] for a, b in zip(first, other))
    assert len({i["id"] for i in first}) == len(first)


def test_items_independent_of_string_hash_seed() -> None:
    """Python's str hash is salted per process; items must not depend on it (no hash())."""
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, sys.argv[1]); import generate; "
            "print(generate.items(size='quick', seed=3)[4]['prompt'][-300:])")
    outputs = {subprocess.run([sys.executable, "-c", code, str(SLICES_DIR / "long_context")], capture_output=True,
                              text=True, env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
               for seed in ("1", "2")}
    assert len(outputs) == 1


@pytest.mark.slow
@pytest.mark.parametrize("size,max_length,buckets", [
    ("quick", 8192, {512, 1024}),
    ("full", 8192, {1024, 2048, 4096, 8192}),
    ("full", 4096, {1024, 2048, 4096}),
    ("full", 2048, {1024, 2048}),
])
def test_buckets_depths_and_task_types_all_covered(size: str, max_length: int, buckets: set[int]) -> None:
    items = generate.items(size=size, seed=1, max_length=max_length)
    assert {i["bucket"] for i in items} == buckets
    for bucket in buckets:
        in_bucket = [i for i in items if i["bucket"] == bucket]
        assert {i["depth"] for i in in_bucket} == {0.1, 0.5, 0.9}
        assert {i["task_type"] for i in in_bucket} == {"niah", "multikey", "vartrack"}
    label = {512: "512", 1024: "1k", 2048: "2k", 4096: "4k", 8192: "8k"}
    expected = {f"len={label[b]}/depth={d}%" for b in buckets for d in (10, 50, 90)}
    assert {i["sub_slice"] for i in items} == expected


def test_items_of_a_haystack_share_their_filler() -> None:
    items = generate.items(size="full", seed=1, max_length=2048)
    by_cluster: dict[str, list[dict]] = {}
    for item in items:
        by_cluster.setdefault(item["cluster"], []).append(item)
    assert len(by_cluster) > 1
    for members in by_cluster.values():
        assert 1 <= len(members) <= generate.ITEMS_PER_HAYSTACK
        openings = {m["prompt"].split("\n\n")[1].split(". ")[0] for m in members}
        assert len(openings) == 1  # the same document (needles go after its first sentence)


def test_window_shorter_than_every_bucket_is_refused() -> None:
    with pytest.raises(ValueError, match="max_length=256"):
        generate.items(size="quick", max_length=256)
    with pytest.raises(ValueError, match="size='huge'"):
        generate.items(size="huge")


def test_n_items_spreads_over_buckets_and_covers_task_types() -> None:
    items = generate.items(size="full", seed=1, n_items=3, max_length=8192)
    assert len(items) == 3
    assert {i["task_type"] for i in items} == {"niah", "multikey", "vartrack"}
    assert len({i["bucket"] for i in items}) == 3


def test_needles_sit_at_their_depth_and_answers_are_in_the_text() -> None:
    for item in generate.items(size="quick", seed=5, max_length=8192):
        prompt = item["prompt"]
        for answer in item["answers"] + item["distractors"]:
            assert re.search(rf"\b{answer}\b", prompt), (item["id"], answer)
        context = prompt.split("\n\n")[1]
        first = item["answers"][0]
        needle_at = re.search(rf"(is: {first}\.|VAR {first} = \d+\.)", context).start()
        tolerance = 0.05 if item["task_type"] == "niah" else 0.15  # other inserts shift it a little
        tolerance += 1 / context.count(". ")  # needles go between sentences: ~5% of a 512-token haystack
        assert abs(needle_at / len(context) - item["depth"]) < tolerance, item["id"]


def test_vartrack_chain_and_optional_decoy_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    probe = generate.make_probe("vartrack", 0.5, random.Random("x"))
    statements = [text for _, text in probe.inserts]
    value = re.search(r"value (\d+)", probe.question).group(1)
    first, *rest = probe.answers
    assert statements[0] == f"VAR {first} = {value}."
    assert statements[1:] == [f"VAR {b} = VAR {a}." for a, b in zip(probe.answers, rest)]
    assert probe.distractors == []
    monkeypatch.setattr(generate, "VARTRACK_DECOY_CHAINS", 1)
    probe = generate.make_probe("vartrack", 0.5, random.Random("x"))
    assert len(probe.distractors) == len(probe.answers)
    assert len(probe.inserts) == 2 * len(probe.answers)
    assert not set(probe.distractors) & set(probe.answers)


def test_filler_is_varied_not_a_repeated_sentence() -> None:
    import random

    text = " ".join(filler.sentences(random.Random("t"), 400))
    sentences = re.split(r"(?<=\.) ", text)
    assert len(set(sentences)) / len(sentences) > 0.98
    repeated = " ".join(["The grass is green. The sky is blue. The sun is yellow."] * 200)
    ratio = len(zlib.compress(text.encode(), 9)) / len(text.encode())
    assert ratio > 0.18  # generated filler ~0.21, English prose ~0.35, a repeated haystack ~0.01
    assert len(zlib.compress(repeated.encode(), 9)) / len(repeated.encode()) < 0.02
    assert not set(filler.KEY_ADJECTIVES + filler.KEY_NOUNS) & set(re.findall(r"[a-z]+", text.lower()))


@pytest.mark.slow
def test_token_lengths_fill_the_bucket_with_the_models_tokenizer(smollm2_tokenizer, tokenizer_dir) -> None:
    items = generate.items(size="full", seed=2, n_items=3, tokenizer=tokenizer_dir, max_length=4096)
    assert {i["bucket"] for i in items} == {1024, 2048, 4096}
    for item in items:
        measured = len(smollm2_tokenizer(item["prompt"] + " " + item["gen_prefix"], add_special_tokens=False)["input_ids"])
        assert measured == item["n_tokens"]
        budget = item["bucket"] - generate.RESERVE_TOKENS
        assert budget - 40 <= measured <= budget, item["id"]
        chat = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": item["prompt"]}],
                                                      add_generation_prompt=True, tokenize=False)
        templated = len(smollm2_tokenizer(chat + item["gen_prefix"], add_special_tokens=False)["input_ids"])
        assert templated + 32 <= item["bucket"]  # chat markup and the longest answer still fit


def test_word_count_estimate_is_within_fifteen_percent(smollm2_tokenizer) -> None:
    for item in generate.items(size="quick", seed=4):
        text = item["prompt"] + " " + item["gen_prefix"]
        exact = len(smollm2_tokenizer(text, add_special_tokens=False)["input_ids"])
        assert abs(generate.estimate_tokens(text) - exact) / exact < 0.15


def test_divergence_texts_are_long_gold_texts_per_bucket() -> None:
    texts = generate.divergence_texts(size="full", seed=1, max_length=8192, divergence_max_tokens=4096)
    assert len(texts) == 3
    lengths = [generate.estimate_tokens(t) for t in texts]
    assert lengths == sorted(lengths) and lengths[-1] > 3000
    assert all(re.search(r"mentioned in the provided text is \d{7}\.$", t) for t in texts)


@pytest.mark.parametrize("response,answers,distractors,expected", [
    (" 4821937.", ["4821937"], [], True),
    ("4,821,937", ["4821937"], [], True),
    ("4 821 937 is the number", ["4821937"], [], True),
    ("48219370", ["4821937"], [], False),  # a longer number is not the answer
    ("14821937", ["4821937"], [], False),
    ("4821937 and 5571852", ["4821937"], ["5571852"], False),  # listing every value earns nothing
    ("", ["4821937"], [], False),
    (" LTCUP, ivjvi, MKRCI", ["LTCUP", "IVJVI", "MKRCI"], ["FGRMR"], True),
    (" LTCUP, IVJVI", ["LTCUP", "IVJVI", "MKRCI"], ["FGRMR"], False),
    (" LTCUPS IVJVI MKRCI", ["LTCUP", "IVJVI", "MKRCI"], [], False),  # whole words only
    (" LTCUP IVJVI MKRCI FGRMR", ["LTCUP", "IVJVI", "MKRCI"], ["FGRMR"], False),
])
def test_scorer(response: str, answers: list[str], distractors: list[str], expected: bool) -> None:
    doc = {"answers": answers, "distractors": distractors}
    assert utils.process_results(doc, [response]) == {"acc": int(expected)}


@pytest.mark.slow
def test_lm_eval_run_on_tiny_model() -> None:
    """The slice's tasks load in lm-eval and yield one record per item with its sub-slice and cluster."""
    from harness.evaluation import evaluate
    from harness.models import loading as models
    from harness.job.identity import eval_settings, tokenizer_dir as model_tokenizer_dir
    from harness.config import to_config

    cfg = to_config(compose(["model=tiny_random", "model.max_length=1024", "slices=[long_context]",
                             "slices.long_context.size=full", "slices.long_context.n_items=3", "eval.batch_size=4"]))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    settings = eval_settings(cfg, model_tokenizer_dir(loaded))
    (slice_,) = resolve(cfg.slices)
    records, aggregates = evaluate.evaluate_slice(evaluate.make_lm(loaded.model, loaded.tokenizer, settings),
                                                  slice_, settings)
    assert len(records) == 3
    assert set(records["task"]) == {"harness_lc_niah", "harness_lc_multikey", "harness_lc_vartrack"}
    assert set(records["sub_slice"]) == {"len=1k/depth=10%", "len=1k/depth=50%", "len=1k/depth=90%"}
    assert set(records["cluster"]) == {"haystack-1k-0"}
    assert set(records["correct"]) <= {0.0, 1.0}
    assert set(aggregates) == set(records["task"])
    texts = slice_.divergence_texts(**slice_.metadata(cfg.eval.seed, settings.tokenizer_path, cfg.model.max_length))
    assert len(texts) == 1 and texts[0].endswith(".")


@pytest.mark.slow
def test_some_sub_slice_discriminates_on_smollm2() -> None:
    """Issue 5: at least one sub-slice of the quick slice where the reference model scores between
    20% and 80%. An existence claim needs one witness: every item of the 512-token sub-slices
    (18 of 48 items, 7.3k of 34.8k prompt tokens; the whole slice took 165 s on one thread). Each
    sub-slice evaluated is evaluated whole, so its accuracy is the one a job reports. Measured on
    the whole slice, idle, 2026-12-02: 512 at 10/50/90% depth 50/67/83%, 1k 80/60/90%."""
    from harness.evaluation import evaluate
    from harness.models import loading as models
    from harness.job.identity import eval_settings, tokenizer_dir as model_tokenizer_dir
    from harness.config import to_config

    cfg = to_config(compose(["model=smollm2_135m", "slices=[long_context]", "eval.batch_size=1"]))
    loaded = models.load(cfg.model, cfg.paths.cache_dir)
    settings = eval_settings(cfg, model_tokenizer_dir(loaded))
    (slice_,) = resolve(cfg.slices)
    metadata = slice_.metadata(settings.seed, settings.tokenizer_path, settings.max_length)
    witness = {f"harness_lc_{kind}": [index for index, item in enumerate(generate.items(**metadata, task_type=kind))
                                      if item["bucket"] == 512]
               for kind in generate.TASK_TYPES}  # a task's documents in the order its dataset lists them
    lm = evaluate.make_lm(loaded.model, loaded.tokenizer, settings)
    records, _ = evaluate.evaluate_slice(lm, slice_, settings, samples=witness)
    assert set(records["sub_slice"]) == {f"len=512/depth={depth}%" for depth in (10, 50, 90)}
    in_bucket = sum(item["bucket"] == 512 for item in generate.items(**metadata))
    assert len(records) == sum(map(len, witness.values())) == in_bucket
    accuracy = records.groupby("sub_slice")["correct"].mean()
    assert accuracy.between(0.2, 0.8).any(), accuracy.to_dict()


def test_quick_size_has_enough_items_per_sub_slice_for_a_verdict() -> None:
    """Issue 12: >= 48 items at quick, and 1k sub-slices of >= 10 items."""
    items = generate.items(size="quick", seed=1)
    assert len(items) >= 48
    per_sub_slice = {}
    for item in items:
        per_sub_slice[item["sub_slice"]] = per_sub_slice.get(item["sub_slice"], 0) + 1
    assert all(per_sub_slice[f"len=1k/depth={d}%"] >= 10 for d in (10, 50, 90)), per_sub_slice
    assert len({item["cluster"] for item in items}) == len(items) // generate.ITEMS_PER_HAYSTACK
