"""A team's prompt log (production traffic, no gold answers) read as the items of a slice.

Formats, detected from the file's content first and its extension second:

* ``chat-jsonl``: JSON Lines (or a ``.json`` file holding one JSON array of objects) whose rows carry
  OpenAI chat ``messages``; the system prompt and earlier turns are kept. A message's content is a
  string or a list of ``{"type": "text", "text": ...}`` parts (joined with newlines); any other part
  (an image, audio) is refused, since the slice evaluates text.
* ``text``: JSON Lines, CSV or Parquet rows with a text column, named by ``field`` or else the first
  of ``prompt``, ``text``, ``input``; the text becomes one user message. In CSV and Parquet a
  ``messages`` column may hold the chat as a JSON string.
* ``openai-batch``: an OpenAI Batch API input file (``custom_id``, ``url``, ``body``): the id is
  ``custom_id``; ``/v1/chat/completions`` lines give ``body.messages``, ``/v1/completions`` lines give
  ``body.prompt`` as text; ``body.max_tokens`` or ``body.max_completion_tokens`` caps the reply.
* ``datasets``: a directory written by ``Dataset.save_to_disk``; of a ``DatasetDict`` the ``test``
  split is read if present, else the first (:attr:`PromptLog.split` says which). Its rows are read
  like JSON rows.

Optional top-level fields of a row: ``id`` (default ``row-<line>``, six digits; numbers become
strings), ``group`` (a conversation or a user: the cluster of the statistics), ``stratum`` (a product
surface), ``max_tokens`` and ``reference_reply`` (the production reply).

Every row is validated before anything expensive runs; a bad log raises one :class:`PromptLogError`
naming the first bad row, its problem and the fix, and how many more rows are bad. Rows whose
messages repeat an earlier row's exactly are dropped (the first is kept) and counted. ``sample=N``
draws a seeded sample (numpy ``default_rng(seed)``), allocated over the strata in proportion to
their size when any row has a stratum; rows keep their order in the log.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np

from harness.errors import UserError

Format = Literal["chat-jsonl", "text", "openai-batch", "datasets"]

ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_FIELDS = ("prompt", "text", "input")
ROLE_LABELS = {"system": "System", "developer": "Developer", "user": "User", "assistant": "Assistant",
               "tool": "Tool"}
BATCH_URLS = ("/v1/chat/completions", "/v1/completions")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
CSV_SUFFIXES = (".csv", ".tsv")
PARQUET_MAGIC = b"PAR1"


TASK = "harness_prompts"  # the lm-eval task of a prompt-log slice (slices/prompts/)


class PromptLogError(UserError, ValueError):
    """A prompt log that cannot be read as slice items; the message names the row, the problem and the fix."""


class _RowProblem(Exception):
    """One row's problem and its fix, collected so that all bad rows are counted before raising."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix


@dataclass(frozen=True)
class PromptRow:
    id: str
    messages: tuple[dict, ...]  # {"role": str, "content": str} each; the last is the user's
    group: str | None = None  # a conversation or a user: the cluster of the statistics
    stratum: str | None = None  # a product surface or use case
    max_tokens: int | None = None
    reference_reply: str | None = None  # the production reply, when logged
    line: int = 0  # 1-based row number in the source


@dataclass
class PromptLog:
    rows: list[PromptRow]
    source: str
    format: Format
    total_rows: int  # rows read
    duplicates: int  # rows dropped as exact duplicates of an earlier row's messages
    sampled_from: int | None  # rows before sampling; None when not sampled
    split: str | None = None  # the split read from a datasets DatasetDict

    def summary(self) -> dict[str, Any]:
        """Counts for ``summary.json``: rows kept, duplicates, sampling, strata and clusters."""
        strata: dict[str, int] = {}
        for row in self.rows:
            label = row.stratum or "all"
            strata[label] = strata.get(label, 0) + 1
        return {
            "format": self.format,
            "split": self.split,
            "rows": len(self.rows),
            "total_rows": self.total_rows,
            "duplicates": self.duplicates,
            "sampled_from": self.sampled_from,
            "strata": dict(sorted(strata.items())),
            "groups": len({row.group for row in self.rows if row.group is not None}),
            "clusters": len({row.group or row.id for row in self.rows}),
        }


def content_hash(text: str) -> str:
    """The first 16 hex digits of the text's SHA-256: how a prompt is logged to MLflow without its text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def render_plain(messages: Any) -> str:
    """The chat as plain text for a model without a chat template, ending with the assistant's cue.

    ``System: ...\\n\\nUser: ...\\n\\nAssistant: ...\\n\\nUser: ...\\n\\nAssistant:``
    """
    turns = [f"{ROLE_LABELS.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
    return "\n\n".join([*turns, "Assistant:"])


def items(path: str | Path, *, field: str | None = None, sample: int | None = None,
          seed: int = 0) -> list[dict[str, Any]]:
    """The slice's items, one plain-JSON dict per row, every key present with one type in every dict.

    An absent ``max_tokens`` is ``0`` (use the task's own limit) and an absent ``reference_reply`` is
    ``""``, so that ``datasets`` infers one column type whatever the log holds.
    """
    log = load(path, field=field, sample=sample, seed=seed)
    out = []
    for row in log.rows:
        messages = [dict(message) for message in row.messages]
        out.append({
            "item_id": row.id,
            "messages": messages,
            "prompt": render_plain(messages),
            "sub_slice": row.stratum or "all",
            "stratum": row.stratum or "all",
            "cluster": row.group or row.id,
            "max_tokens": row.max_tokens or 0,
            "reference_reply": row.reference_reply or "",
        })
    return out


def load(path: str | Path, *, field: str | None = None, sample: int | None = None, seed: int = 0) -> PromptLog:
    """Read, validate, de-duplicate and (with ``sample``) sample the prompt log at ``path``."""
    path = Path(path)
    if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int) or sample < 1):
        raise PromptLogError(f"prompts.sample={sample!r} is not a positive integer; "
                             "set it to the number of rows to draw, or leave it unset to keep every row")
    split = None
    if not path.exists():
        raise PromptLogError(f"{path}: no such file or directory; prompts.path must point to a file or a datasets "
                             "directory (JSON Lines, JSON, CSV, Parquet, or Dataset.save_to_disk output)")
    if path.is_dir():
        records, split = _read_datasets_dir(path)
        container = "datasets"
    else:
        records, container = _read_file(path)
    batch = container != "datasets" and _first_is_batch(records)
    rows: list[PromptRow] = []
    problems: list[tuple[int, str, str]] = []
    saw_messages = False
    for line, record in records:
        try:
            row, chat = _parse_row(record, line, field, batch)
        except _RowProblem as bad:
            problems.append((line, bad.problem, bad.fix))
            continue
        saw_messages = saw_messages or chat
        rows.append(row)
    if not rows and not problems:
        raise PromptLogError(f"{path}: the file holds no rows; write one prompt per row "
                             "(a JSON object with messages or prompt, or a CSV/Parquet text column)")
    kept, duplicates = _deduplicate(rows, problems)
    if problems:
        line, problem, fix = min(problems)
        more = f" (and {len(problems) - 1} more bad rows)" if len(problems) > 1 else ""
        raise PromptLogError(f"{path} row {line}: {problem}; {fix}{more}")
    if container == "datasets":
        fmt: Format = "datasets"
    elif batch:
        fmt = "openai-batch"
    else:
        fmt = "chat-jsonl" if saw_messages else "text"
    sampled_from = None
    if sample is not None:
        sampled_from = len(kept)
        kept = _sample(kept, sample, seed)
    return PromptLog(rows=kept, source=str(path), format=fmt, total_rows=len(records), duplicates=duplicates,
                     sampled_from=sampled_from, split=split)


# ---- reading --------------------------------------------------------------------------------------

Record = tuple[int, Any]  # (1-based row number, the row as read: a dict, or _BadJson)


@dataclass(frozen=True)
class _BadJson:
    error: str


def _read_file(path: Path) -> tuple[list[Record], str]:
    """The file's rows and its container ("json", "csv", "parquet"), told from content, then extension."""
    suffix = path.suffix.lower()
    with path.open("rb") as handle:
        head = handle.read(4)
    if head == PARQUET_MAGIC:
        return _read_parquet(path), "parquet"
    if suffix == ".parquet":
        raise PromptLogError(f"{path}: not a Parquet file (no PAR1 header); write it with pandas.to_parquet "
                             "or pyarrow, or give the file the extension of its real format")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise PromptLogError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                             "save the log as UTF-8 JSON Lines, CSV or Parquet") from None
    stripped = text.lstrip()
    if not stripped:
        raise PromptLogError(f"{path}: the file is empty; write one prompt per row "
                             "(a JSON object with messages or prompt, or a CSV/Parquet text column)")
    if stripped[0] == "[":
        array = _json_array(stripped)
        if array is not None:
            return [(index + 1, value) for index, value in enumerate(array)], "json"
    if stripped[0] in "{[" or suffix in JSON_SUFFIXES:
        return list(_json_lines(text)), "json"
    if suffix in CSV_SUFFIXES:
        return _read_csv(text, "\t" if suffix == ".tsv" else ","), "csv"
    raise PromptLogError(f"{path}: unknown extension {suffix or '(none)'!r} and the content is neither "
                         "JSON Lines nor a JSON array nor Parquet; use .jsonl, .json, .csv or .parquet")


def _json_array(text: str) -> list | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) else None


def _json_lines(text: str) -> Iterator[Record]:
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            yield number, json.loads(raw)
        except json.JSONDecodeError as exc:
            yield number, _BadJson(f"{exc.msg} at column {exc.colno}")


def _read_csv(text: str, delimiter: str) -> list[Record]:
    reader = csv.DictReader(io.StringIO(text), delimiter=delimiter)
    out = []
    for number, row in enumerate(reader, start=1):
        out.append((number, {key: value for key, value in row.items() if key is not None}))
    return out


def _read_parquet(path: Path) -> list[Record]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise PromptLogError(f"{path}: cannot be read as Parquet ({exc}); rewrite it with pandas.to_parquet "
                             "or pyarrow") from None
    return [(index + 1, value) for index, value in enumerate(table.to_pylist())]


def _read_datasets_dir(path: Path) -> tuple[list[Record], str | None]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise PromptLogError(f"{path}: a directory, but not one written by Dataset.save_to_disk; prompts.path "
                             "must point to a file or a datasets directory") from None
    split = None
    if isinstance(loaded, datasets.DatasetDict):
        if not loaded:
            raise PromptLogError(f"{path}: the DatasetDict holds no splits; save a split with the prompts")
        split = "test" if "test" in loaded else next(iter(loaded))
        loaded = loaded[split]
    return [(index + 1, value) for index, value in enumerate(loaded.to_list())], split


def _first_is_batch(records: list[Record]) -> bool:
    """Whether the file is a Batch API input file, told by its first object row."""
    for _, record in records:
        if isinstance(record, dict):
            return "custom_id" in record and isinstance(record.get("body"), dict)
    return False


# ---- rows -----------------------------------------------------------------------------------------

def _parse_row(record: Any, line: int, field: str | None, batch: bool) -> tuple[PromptRow, bool]:
    """The row and whether it held chat messages; raises :class:`_RowProblem`."""
    if isinstance(record, _BadJson):
        raise _RowProblem(f"not valid JSON ({record.error})",
                          "write one JSON object per line (JSON Lines), or a JSON array of objects")
    if not isinstance(record, dict):
        raise _RowProblem(f"a JSON {type(record).__name__}, not an object",
                          "write each row as an object with messages or prompt")
    max_tokens: Any = record.get("max_tokens")
    if batch:
        messages, chat, max_tokens, row_id = _batch_request(record)
    else:
        messages, chat = _prompt(record, field)
        row_id = record.get("id")
    return PromptRow(
        id=_label(row_id, "id") or f"row-{line:06d}",
        messages=messages,
        group=_label(record.get("group"), "group"),
        stratum=_label(record.get("stratum"), "stratum"),
        max_tokens=_max_tokens(max_tokens),
        reference_reply=_reference(record.get("reference_reply")),
        line=line,
    ), chat


def _batch_request(record: dict) -> tuple[tuple[dict, ...], bool, Any, Any]:
    body = record.get("body")
    if not isinstance(body, dict) or "custom_id" not in record:
        raise _RowProblem("not a Batch API request (custom_id and body are needed, as on the file's first line)",
                          "keep every line of a Batch API file in the same form")
    url = record.get("url", "/v1/chat/completions")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if url == "/v1/chat/completions":
        return _messages(body.get("messages"), "body.messages"), True, max_tokens, record["custom_id"]
    if url == "/v1/completions":
        return _text_prompt(body.get("prompt"), "body.prompt"), False, max_tokens, record["custom_id"]
    raise _RowProblem(f"url {url!r} is not a text-generation endpoint", f"use one of {', '.join(BATCH_URLS)}")


def _prompt(record: dict, field: str | None) -> tuple[tuple[dict, ...], bool]:
    if field == "messages" or (field is None and "messages" in record):
        messages = record.get("messages")
        if isinstance(messages, str):  # a CSV or Parquet column holding the chat as JSON
            try:
                messages = json.loads(messages)
            except json.JSONDecodeError as exc:
                raise _RowProblem(f"messages is a string that is not JSON ({exc.msg})",
                                  "store the chat as a JSON list of {role, content} objects") from None
        return _messages(messages, "messages"), True
    names = (field,) if field is not None else TEXT_FIELDS
    for name in names:
        if name in record:
            return _text_prompt(record[name], name), False
    found = ", ".join(sorted(map(str, record))) or "none"
    wanted = f"no field {field!r}" if field is not None else "no messages and no prompt, text or input field"
    raise _RowProblem(f"{wanted} (fields found: {found})",
                      "add messages, or name the text column with prompts.field=<column>")


def _text_prompt(text: Any, name: str) -> tuple[dict, ...]:
    if not isinstance(text, str):
        raise _RowProblem(f"{name} is a {type(text).__name__}, not a string", f"write the prompt text in {name}")
    if not text.strip():
        raise _RowProblem(f"{name} is empty text", "drop the row or write its prompt")
    return ({"role": "user", "content": text},)


def _messages(messages: Any, name: str) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if messages == [] else f"a {type(messages).__name__}"
        raise _RowProblem(f"{name} is {what}, not a non-empty list of messages",
                          'write [{"role": "user", "content": "..."}] with the user turn last')
    out = []
    for number, message in enumerate(messages, start=1):
        where = f"{name}[{number}]"
        if not isinstance(message, dict):
            raise _RowProblem(f"{where} is a {type(message).__name__}, not an object",
                              "write each message as {\"role\": ..., \"content\": ...}")
        role = message.get("role")
        if role not in ROLES:
            raise _RowProblem(f"{where} has unknown role {role!r}", f"use one of {', '.join(ROLES)}")
        out.append({"role": role, "content": _content(message.get("content"), where)})
    if out[-1]["role"] != "user":
        raise _RowProblem(f"the last message is from {out[-1]['role']!r}, not 'user'",
                          "end each row with the user turn the model should answer (log the reply as "
                          "reference_reply)")
    return tuple(out)


def _content(content: Any, where: str) -> str:
    if isinstance(content, list):
        texts = []
        for number, part in enumerate(content, start=1):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise _RowProblem(f"{where} content part {number} is {kind!r}, not text",
                                  "only text can be evaluated: drop the row or remove its non-text parts")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise _RowProblem(f"{where} content is a {type(content).__name__}, not a string or text parts",
                          'write the content as a string or [{"type": "text", "text": "..."}]')
    if not content.strip():
        raise _RowProblem(f"{where} has empty content", "drop the message or the row")
    return content


def _is_missing(value: Any) -> bool:
    return value is None or value == "" or (isinstance(value, float) and math.isnan(value))


def _label(value: Any, name: str) -> str | None:
    """An id, group or stratum as a string; numbers (as columnar formats store them) become strings."""
    if _is_missing(value):
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    raise _RowProblem(f"{name} is {value!r}, not a string or integer", f"write {name} as a string")


def _max_tokens(value: Any) -> int | None:
    if _is_missing(value):
        return None
    number = value
    if isinstance(value, str) and value.strip().isdigit():  # CSV cells are strings
        number = int(value)
    elif isinstance(value, float) and value.is_integer():  # a column with gaps is stored as floats
        number = int(value)
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise _RowProblem(f"max_tokens is {value!r}, not a positive integer",
                          "write the reply's token limit as a whole number, or leave it out")
    return number


def _reference(value: Any) -> str | None:
    if _is_missing(value):
        return None
    if not isinstance(value, str):
        raise _RowProblem(f"reference_reply is a {type(value).__name__}, not a string",
                          "log the production reply's text, or leave it out")
    return value


# ---- duplicates and sampling ----------------------------------------------------------------------

def _deduplicate(rows: list[PromptRow], problems: list[tuple[int, str, str]]) -> tuple[list[PromptRow], int]:
    """Rows with the messages of an earlier row dropped; an id reused for other messages is a problem."""
    seen_messages: set[str] = set()
    seen_ids: dict[str, tuple[str, int]] = {}
    kept, duplicates = [], 0
    for row in rows:
        key = json.dumps(row.messages, sort_keys=True, ensure_ascii=False)
        earlier = seen_ids.get(row.id)
        if earlier is not None and earlier[0] != key:
            problems.append((row.line, f"id {row.id!r} is also used by row {earlier[1]} for different messages",
                             "give each prompt its own id"))
            continue
        seen_ids.setdefault(row.id, (key, row.line))
        if key in seen_messages:
            duplicates += 1
            continue
        seen_messages.add(key)
        kept.append(row)
    return kept, duplicates


def allocate(sizes: dict[str, int], total: int) -> dict[str, int]:
    """Rows to draw per stratum: proportional to size, rounded by largest remainder, each stratum given
    at least one row when ``total`` covers them all (taken from the largest allocations).

    Ties in the remainder go to the larger stratum, then to the name that sorts first.
    """
    population = sum(sizes.values())
    total = min(total, population)
    quotas = {name: total * size / population for name, size in sizes.items()}
    counts = {name: math.floor(quota) for name, quota in quotas.items()}
    order = sorted(sizes, key=lambda name: (-(quotas[name] - counts[name]), -sizes[name], name))
    for name in order[:total - sum(counts.values())]:
        counts[name] += 1
    if total >= len(sizes):
        for name in sorted(sizes):
            if counts[name] == 0:
                donor = max(sorted(counts), key=lambda other: counts[other])
                counts[donor] -= 1
                counts[name] = 1
    return counts


def _sample(rows: list[PromptRow], size: int, seed: int) -> list[PromptRow]:
    if size >= len(rows):
        return list(rows)
    rng = np.random.default_rng(seed)
    if all(row.stratum is None for row in rows):
        chosen = rng.choice(len(rows), size=size, replace=False).tolist()
    else:
        members: dict[str, list[int]] = {}
        for index, row in enumerate(rows):
            members.setdefault(row.stratum or "all", []).append(index)
        counts = allocate({name: len(indices) for name, indices in members.items()}, size)
        chosen = []
        for name in sorted(members):
            picks = rng.choice(len(members[name]), size=counts[name], replace=False)
            chosen.extend(members[name][pick] for pick in picks.tolist())
    return [rows[index] for index in sorted(chosen)]


# --------------------------------------------------------------------------- the production reply as the reference's
def reuses_replies(slice_: Any) -> bool:
    """Whether the reference side of ``slice_`` takes each row's logged ``reference_reply`` instead of generating
    (``prompts.reference_replies=true`` on a prompt-log slice)."""
    config = getattr(slice_, "config", None)
    return bool(config is not None and TASK in config.tasks and (config.metadata or {}).get("reference_replies"))


@contextmanager
def logged_replies(lm: Any, tokenizer: Any, enabled: bool = True) -> Iterator[dict[str, int]]:
    """While open, ``lm`` answers a generation request whose item logged a ``reference_reply`` with that reply
    (no generation), and generates the others as before; yields the counts (``logged``, ``generated``).

    The logged reply is cut as the model's own would have been: at the request's stop strings, and at its token
    cap (``max_gen_toks``, counted with the reference's tokenizer), so both sides of a pair ran under the same
    limits and a cap hit means the same on both.
    """
    counts = {"logged": 0, "generated": 0}
    if not enabled:
        yield counts
        return
    own = lm.generate_until

    def generate_until(requests: list, *args: Any, **kwargs: Any) -> list[str]:
        replies: list[str | None] = [None] * len(requests)
        for index, request in enumerate(requests):
            doc = getattr(request, "doc", None)
            logged = doc.get("reference_reply") if isinstance(doc, dict) else None
            if logged:
                replies[index] = _as_generated(str(logged), request, tokenizer)
        todo = [i for i, reply in enumerate(replies) if reply is None]
        if todo:
            for index, reply in zip(todo, own([requests[i] for i in todo], *args, **kwargs)):
                replies[index] = reply
        counts["logged"] += len(requests) - len(todo)
        counts["generated"] += len(todo)
        return [str(reply) for reply in replies]

    lm.generate_until = generate_until  # the instance's own attribute, ahead of its class's method
    try:
        yield counts
    finally:
        del lm.generate_until


def _as_generated(reply: str, request: Any, tokenizer: Any) -> str:
    """A logged reply cut at the request's stop strings and its token cap."""
    arguments = getattr(request, "args", None) or ()
    kwargs = arguments[1] if len(arguments) > 1 and isinstance(arguments[1], dict) else {}
    until = kwargs.get("until") or []
    for stop in [until] if isinstance(until, str) else until:
        if stop and stop in reply:
            reply = reply[:reply.index(stop)]
    cap = kwargs.get("max_gen_toks")
    if cap:
        ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        if len(ids) > int(cap):
            reply = tokenizer.decode(ids[:int(cap)], skip_special_tokens=False)
    return reply
