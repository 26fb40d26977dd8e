"""Prompt logs: every format read, every bad row refused by name, duplicates dropped, seeded stratified samples."""
from __future__ import annotations

import csv
import hashlib
import json
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from harness.errors import UserError
from harness.evaluation import prompt_log
from harness.evaluation.prompt_log import PromptLogError, PromptRow, content_hash, items, load, render_plain


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _refusal(path: Path, **kwargs) -> str:
    with pytest.raises(PromptLogError) as caught:
        load(path, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


# ---- formats ------------------------------------------------------------------------------------

def test_chat_jsonl_keeps_system_prompt_and_earlier_turns(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}]
    path = _jsonl(tmp_path / "log.jsonl", [
        {"id": 7, "messages": chat, "group": "conv-1", "stratum": "support", "max_tokens": 64,
         "reference_reply": "4"},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Part one."},
                                                   {"type": "text", "text": "Part two."}]}]},
    ])
    log = load(path)
    assert log.format == "chat-jsonl"
    assert (log.total_rows, log.duplicates, log.sampled_from) == (2, 0, None)
    first, second = log.rows
    assert first == PromptRow(id="7", messages=tuple(chat), group="conv-1", stratum="support", max_tokens=64,
                              reference_reply="4", line=1)
    assert second.id == "row-000002" and second.group is None and second.max_tokens is None
    assert second.messages == ({"role": "user", "content": "Part one.\nPart two."},)


def test_json_array_file(tmp_path):
    path = tmp_path / "log.json"
    path.write_text(json.dumps([{"messages": _user("a")}, {"prompt": "b"}]), encoding="utf-8")
    log = load(path)
    assert [row.messages[-1]["content"] for row in log.rows] == ["a", "b"]
    assert [row.line for row in log.rows] == [1, 2]


def test_text_csv_takes_prompt_then_text_then_input(tmp_path):
    path = tmp_path / "log.csv"
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "text", "stratum", "max_tokens", "group"])
        writer.writerow(["a", "Summarise this, please.", "search", "128", "u1"])
        writer.writerow(["b", "Line one\nline two", "", "", ""])
    log = load(path)
    assert log.format == "text"
    assert [row.id for row in log.rows] == ["a", "b"]
    assert log.rows[0].messages == ({"role": "user", "content": "Summarise this, please."},)
    assert (log.rows[0].stratum, log.rows[0].max_tokens, log.rows[0].group) == ("search", 128, "u1")
    assert (log.rows[1].stratum, log.rows[1].max_tokens, log.rows[1].group) == (None, None, None)
    assert log.rows[1].messages[0]["content"] == "Line one\nline two"


def test_parquet_with_named_field(tmp_path):
    pd = pytest.importorskip("pandas")
    path = tmp_path / "log.parquet"
    pd.DataFrame({"id": [1, 2], "question": ["q one", "q two"], "prompt": ["ignored", "ignored"],
                  "max_tokens": [32.0, float("nan")]}).to_parquet(path)
    log = load(path, field="question")
    assert [row.id for row in log.rows] == ["1", "2"]
    assert [row.messages[0]["content"] for row in log.rows] == ["q one", "q two"]
    assert [row.max_tokens for row in log.rows] == [32, None]


def test_parquet_detected_by_content_not_extension(tmp_path):
    pd = pytest.importorskip("pandas")
    path = tmp_path / "log.bin"
    pd.DataFrame({"prompt": ["x"]}).to_parquet(path)
    assert load(path).rows[0].messages[0]["content"] == "x"


def test_openai_batch_file(tmp_path):
    path = _jsonl(tmp_path / "batch.jsonl", [
        {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-x", "messages": [{"role": "developer", "content": "Terse."},
                                                 {"role": "user", "content": "Hi"}], "max_tokens": 50}},
        {"custom_id": "req-2", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-x", "messages": _user("Bye"), "max_completion_tokens": 20}},
        {"custom_id": "req-3", "method": "POST", "url": "/v1/completions",
         "body": {"model": "gpt-x", "prompt": "Once upon a time"}},
    ])
    log = load(path)
    assert log.format == "openai-batch"
    assert [row.id for row in log.rows] == ["req-1", "req-2", "req-3"]
    assert [row.max_tokens for row in log.rows] == [50, 20, None]
    assert log.rows[0].messages[0] == {"role": "developer", "content": "Terse."}
    assert log.rows[2].messages == ({"role": "user", "content": "Once upon a time"},)


def test_datasets_directory_prefers_test_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    plain = tmp_path / "plain"
    datasets.Dataset.from_list([{"messages": _user("one"), "stratum": "s"},
                                {"messages": _user("two"), "stratum": "t"}]).save_to_disk(str(plain))
    log = load(plain)
    assert (log.format, log.split) == ("datasets", None)
    assert [row.messages[0]["content"] for row in log.rows] == ["one", "two"]
    assert [row.stratum for row in log.rows] == ["s", "t"]

    splits = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "train row"}]),
                          "test": datasets.Dataset.from_list([{"text": "test row"}])}).save_to_disk(str(splits))
    log = load(splits)
    assert (log.format, log.split) == ("datasets", "test")
    assert log.rows[0].messages[0]["content"] == "test row"


# ---- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("row", "expected"), [
    ({"prompt": ""}, ["row 2", "empty text"]),
    (["not", "an", "object"], ["row 2", "list, not an object"]),
    ({"question": "x", "lang": "en"}, ["row 2", "fields found: lang, question", "prompts.field=<column>"]),
    ({"messages": []}, ["row 2", "empty list"]),
    ({"messages": "hi"}, ["row 2", "messages is a string that is not JSON"]),
    ({"messages": ["hi"]}, ["row 2", "messages[1] is a str, not an object"]),
    ({"messages": [{"role": "bot", "content": "x"}]}, ["row 2", "unknown role 'bot'", "system"]),
    ({"messages": [{"role": "user", "content": 5}]}, ["row 2", "content is a int"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     ["row 2", "part 1 is 'image_url', not text"]),
    ({"messages": [{"role": "user", "content": "  "}]}, ["row 2", "empty content"]),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     ["row 2", "last message is from 'assistant'", "reference_reply"]),
    ({"prompt": "x", "max_tokens": 0}, ["row 2", "max_tokens is 0, not a positive integer"]),
    ({"prompt": "x", "max_tokens": "many"}, ["row 2", "max_tokens is 'many'"]),
    ({"prompt": "x", "max_tokens": True}, ["row 2", "max_tokens is True"]),
    ({"prompt": "x", "id": [1]}, ["row 2", "id is [1]"]),
])
def test_a_bad_row_is_named_with_its_problem(tmp_path, row, expected):
    path = _jsonl(tmp_path / "log.jsonl", [{"prompt": "fine"}, row])
    message = _refusal(path)
    assert message.startswith(f"{path} row 2: ")
    for text in expected:
        assert text in message
    assert "more bad rows" not in message


def test_invalid_json_and_count_of_further_bad_rows(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{"prompt": "x",}\n{"prompt": ""}\n{"nothing": 1}\n{"prompt": "y"}\n',
                    encoding="utf-8")
    message = _refusal(path)
    assert message.startswith(f"{path} row 3: not valid JSON")
    assert message.endswith("(and 2 more bad rows)")


def test_named_field_missing(tmp_path):
    path = _jsonl(tmp_path / "log.jsonl", [{"prompt": "x"}])
    message = _refusal(path, field="question")
    assert "row 1: no field 'question' (fields found: prompt)" in message


def test_same_id_with_other_messages_is_refused(tmp_path):
    path = _jsonl(tmp_path / "log.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"},
                                           {"id": "a", "prompt": "z"}])
    message = _refusal(path)
    assert "row 3: id 'a' is also used by row 1 for different messages" in message
    assert "own id" in message


def test_bad_batch_lines(tmp_path):
    good = {"custom_id": "r1", "url": "/v1/chat/completions", "body": {"messages": _user("x")}}
    path = _jsonl(tmp_path / "batch.jsonl", [good, {"custom_id": "r2", "url": "/v1/embeddings",
                                                    "body": {"input": "x"}}])
    assert "row 2: url '/v1/embeddings' is not a text-generation endpoint" in _refusal(path)
    path = _jsonl(tmp_path / "batch.jsonl", [good, {"prompt": "plain"}])
    assert "row 2: not a Batch API request" in _refusal(path)


def test_file_level_refusals(tmp_path):
    missing = tmp_path / "nope.jsonl"
    message = _refusal(missing)
    assert str(missing) in message and "prompts.path must point to a file or a datasets directory" in message

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    assert "is empty" in _refusal(empty)

    no_rows = tmp_path / "header.csv"
    no_rows.write_text("prompt\n", encoding="utf-8")
    assert "holds no rows" in _refusal(no_rows)

    odd = tmp_path / "log.txt"
    odd.write_text("hello world\n", encoding="utf-8")
    assert "unknown extension '.txt'" in _refusal(odd)

    fake = tmp_path / "log.parquet"
    fake.write_text("prompt\nx\n", encoding="utf-8")
    assert "not a Parquet file" in _refusal(fake)

    directory = tmp_path / "dir"
    directory.mkdir()
    assert "not one written by Dataset.save_to_disk" in _refusal(directory)

    path = _jsonl(tmp_path / "log.jsonl", [{"prompt": "x"}])
    assert "prompts.sample=0" in _refusal(path, sample=0)


def test_refusal_is_a_user_error(tmp_path):
    with pytest.raises(UserError):
        load(tmp_path / "missing.jsonl")
    assert issubclass(PromptLogError, ValueError)


# ---- duplicates ---------------------------------------------------------------------------------

def test_exact_duplicates_dropped_keeping_the_first(tmp_path):
    path = _jsonl(tmp_path / "log.jsonl", [
        {"id": "a", "messages": _user("same")}, {"id": "b", "prompt": "other"},
        {"id": "c", "messages": _user("same")}, {"id": "a", "messages": _user("same")},
        {"id": "d", "messages": [{"role": "system", "content": "S"}, *_user("same")]},
    ])
    log = load(path)
    assert [row.id for row in log.rows] == ["a", "b", "d"]
    assert (log.total_rows, log.duplicates) == (5, 2)
    assert log.summary()["duplicates"] == 2 and log.summary()["rows"] == 3


# ---- sampling -----------------------------------------------------------------------------------

def _reference_allocation(sizes: dict[str, int], total: int) -> dict[str, int]:
    """Hamilton's method in exact arithmetic, written independently of the module."""
    population = sum(sizes.values())
    quotas = {name: Fraction(total * size, population) for name, size in sizes.items()}
    counts = {name: int(quota) for name, quota in quotas.items()}
    left = total - sum(counts.values())
    for name in sorted(sizes, key=lambda n: (quotas[n] - counts[n], sizes[n]), reverse=True)[:left]:
        counts[name] += 1
    return counts


def _stratified_log(tmp_path: Path, sizes: dict[str, int]) -> Path:
    rows, number = [], 0
    for stratum, size in sizes.items():
        for _ in range(size):
            number += 1
            rows.append({"id": f"q{number}", "prompt": f"question {number}", "stratum": stratum})
    rows.sort(key=lambda row: hashlib.sha256(row["id"].encode()).hexdigest())  # interleave the strata
    return _jsonl(tmp_path / "log.jsonl", rows)


@pytest.mark.parametrize(("sizes", "total", "expected"), [
    ({"a": 13, "b": 5, "c": 2}, 6, {"a": 4, "b": 1, "c": 1}),
    ({"a": 50, "b": 30, "c": 20}, 10, {"a": 5, "b": 3, "c": 2}),
    ({"a": 37, "b": 41, "c": 22}, 17, None),
])
def test_stratified_sample_is_proportional(tmp_path, sizes, total, expected):
    expected = expected or _reference_allocation(sizes, total)
    assert expected == _reference_allocation(sizes, total)
    log = load(_stratified_log(tmp_path, sizes), sample=total, seed=3)
    assert log.sampled_from == sum(sizes.values())
    assert Counter(row.stratum for row in log.rows) == Counter(expected)
    assert log.summary()["strata"] == expected


def test_every_stratum_gets_a_row_when_the_sample_covers_them(tmp_path):
    sizes = {"big": 18, "x": 1, "y": 1}
    log = load(_stratified_log(tmp_path, sizes), sample=3)
    assert Counter(row.stratum for row in log.rows) == {"big": 1, "x": 1, "y": 1}
    assert prompt_log.allocate(sizes, 2) == {"big": 2, "x": 0, "y": 0}


def test_sample_is_seeded_and_keeps_log_order(tmp_path):
    path = _stratified_log(tmp_path, {"a": 30, "b": 20})
    ids = [row.id for row in load(path).rows]
    first = [row.id for row in load(path, sample=10, seed=1).rows]
    assert first == [row.id for row in load(path, sample=10, seed=1).rows]
    assert first != [row.id for row in load(path, sample=10, seed=2).rows]
    assert first == [i for i in ids if i in set(first)]


def test_unstratified_sample_and_oversized_sample(tmp_path):
    path = _jsonl(tmp_path / "log.jsonl", [{"prompt": f"p{i}"} for i in range(40)])
    log = load(path, sample=7, seed=0)
    assert len(log.rows) == 7 and log.sampled_from == 40
    assert [row.line for row in log.rows] == sorted(row.line for row in log.rows)
    everything = load(path, sample=100)
    assert len(everything.rows) == 40 and everything.sampled_from == 40


# ---- items and helpers --------------------------------------------------------------------------

def test_items_are_uniform_plain_dicts(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = _jsonl(tmp_path / "log.jsonl", [
        {"id": "a", "messages": [{"role": "system", "content": "S"}, *_user("Q1")], "group": "g",
         "stratum": "chat", "max_tokens": 10, "reference_reply": "R"},
        {"prompt": "Q2"},
    ])
    out = items(path)
    keys = {"item_id", "messages", "prompt", "sub_slice", "stratum", "cluster", "max_tokens", "reference_reply"}
    assert all(set(item) == keys for item in out)
    for key in keys:
        assert len({type(item[key]) for item in out}) == 1, key
    first, second = out
    assert first["prompt"] == "System: S\n\nUser: Q1\n\nAssistant:"
    assert (first["cluster"], first["stratum"], first["max_tokens"], first["reference_reply"]) == ("g", "chat", 10, "R")
    assert (second["item_id"], second["cluster"], second["sub_slice"]) == ("row-000002", "row-000002", "all")
    assert (second["max_tokens"], second["reference_reply"]) == (0, "")
    assert json.loads(json.dumps(out)) == out
    assert datasets.Dataset.from_list(out).num_rows == 2


def test_render_plain_multi_turn():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
    assert render_plain(messages) == "System: S\n\nUser: U1\n\nAssistant: A1\n\nUser: U2\n\nAssistant:"


def test_content_hash():
    assert content_hash("hello") == hashlib.sha256(b"hello").hexdigest()[:16]
    assert len(content_hash("")) == 16


def test_summary_counts(tmp_path):
    path = _jsonl(tmp_path / "log.jsonl", [
        {"prompt": "a", "group": "u1", "stratum": "s"}, {"prompt": "b", "group": "u1", "stratum": "t"},
        {"prompt": "c"},
    ])
    summary = load(path).summary()
    assert summary == {"format": "text", "split": None, "rows": 3, "total_rows": 3, "duplicates": 0,
                       "sampled_from": None, "strata": {"all": 1, "s": 1, "t": 1}, "groups": 1, "clusters": 2}
