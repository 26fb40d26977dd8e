"""Long-context slice: RULER-style synthetic retrieval at growing context lengths and depths.

Three task types, each its own lm-eval task (``dataset_kwargs.task_type`` in the YAML):

- ``niah``: one needle ("One of the special magic numbers for cobalt-heron is: 4821937.")
  hidden in a haystack; the question asks for its value.
- ``multikey``: eight needles whose keys differ only in their adjective ("cobalt-heron",
  "amber-heron", ...); the question asks for one of them, and another key's value is wrong.
- ``vartrack``: a chain of variable assignments (``VAR ABCDE = 48213``, ``VAR FGHIJ = VAR
  ABCDE``, ...), optionally with a decoy chain; the question asks for every variable that
  holds the chain's value.

Sub-slice = context-length bucket x needle depth ("len=2k/depth=50%"): the prompt is filled
to the bucket's length minus a reserve for chat markup and the answer, measured with the
model's tokenizer when the harness passes one (``tokenizer`` metadata), else estimated from
a word count. Buckets longer than the model's window (``max_length``) are dropped. Depth is
where the needle (or the chain's first assignment) sits, as a fraction of the haystack.
Cluster = the haystack document: the items of one document share their filler text.

Deterministic: ``random.Random`` with string seeds gives the same items on every machine;
with a tokenizer, the fill level depends on that tokenizer, as it should.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import random
import string
from pathlib import Path
from typing import Any, Callable, NamedTuple

log = logging.getLogger(__name__)

SIZES: dict[str, dict[int, int]] = {  # items per context-length bucket (tokens)
    # 48 items in 16 haystacks, 10 per 1k depth. Prefill is the slice's cost: 1k/2k buckets (75k prompt
    # tokens per model pass) took ~7 min per pass on 2 CPU cores, the 512/1k ones take 35k tokens.
    "quick": {512: 18, 1024: 30},
    "full": {1024: 9, 2048: 9, 4096: 6, 8192: 3},
}
TASK_TYPES = ("niah", "multikey", "vartrack")
DEPTHS = (0.1, 0.5, 0.9)
ITEMS_PER_HAYSTACK = 3  # consecutive items of a bucket share one haystack document (one cluster)
RESERVE_TOKENS = 96  # left free in each bucket for chat markup and the generated answer
MULTIKEY_NEEDLES = 8  # confusable keys; SmolLM2-135M: 3/3 right at 1k, 1/3 at 2k (4 needles: 6/9 over 1k-8k)
VARTRACK_HOPS = 2  # assignments after the first: VAR A = value, VAR B = VAR A, VAR C = VAR B
# 0 or 1 chain of other variables holding another value. RULER's default is none; with one,
# SmolLM2-135M named the decoy chain instead (0/6 at 1k tokens, against 1-2/6 without).
VARTRACK_DECOY_CHAINS = 0
TOKENS_PER_WORD = 1.2  # estimate of tokens per word when no tokenizer is given (SmolLM2 on this filler: 1.17-1.25)

NEEDLE_INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
                      "them. I will quiz you about the numbers afterwards.")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NEEDLE_QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
NEEDLE_PREFIX = "The special magic number for {key} mentioned in the provided text is"
VARTRACK_INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VARTRACK_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
# Ends with "VAR" so that the answer starts with a variable name rather than a new line.
VARTRACK_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {count} variables "
                   "are assigned the value {value}, they are: VAR")


def _sibling(name: str):
    """Import a module next to this file (lm-eval loads this file without a package or sys.path entry)."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"harness_long_context_{name}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


filler = _sibling("filler")


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:  # e.g. a GGUF directory, which needs gguf_file=
        log.warning("long_context: cannot load a tokenizer from %s (%s); prompt lengths are estimated "
                    "from word counts instead", path, str(exc).splitlines()[0])
        return None


def token_counter(tokenizer: str | Any | None) -> Callable[[str], int]:
    """Token count of a text: exact with a tokenizer (object or directory), else a word-count estimate."""
    tok = _load_tokenizer(tokenizer) if isinstance(tokenizer, str) and tokenizer else tokenizer
    if tok is None:
        return estimate_tokens
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


def estimate_tokens(text: str) -> int:
    """Words x TOKENS_PER_WORD, with digits counted one token each (as SmolLM2/Llama-2 style BPEs split them)."""
    words = text.split()
    digits = sum(ch.isdigit() for ch in text)
    plain = sum(1 for w in words if not any(ch.isdigit() for ch in w))
    return round(plain * TOKENS_PER_WORD) + digits + (len(words) - plain)


def bucket_label(bucket: int) -> str:
    return f"{bucket // 1024}k" if bucket % 1024 == 0 else str(bucket)


def buckets_for(size: str, max_length: int | None) -> dict[int, int]:
    """The size's buckets that fit the model's window (``max_length``)."""
    if size not in SIZES:
        raise ValueError(f"long_context size={size!r} is not one of {sorted(SIZES)}")
    plan = SIZES[size]
    if not max_length:
        return dict(plan)
    fitting = {bucket: count for bucket, count in plan.items() if bucket <= max_length}
    if not fitting:
        raise ValueError(f"long_context: model max_length={max_length} is shorter than the smallest bucket "
                         f"({min(plan)} tokens); use a model with a longer window or drop slice long_context")
    return fitting


def item_plan(size: str, n_items: int | None, max_length: int | None) -> list[tuple[int, int, int]]:
    """(bucket, index within bucket, grid cell) for every item. ``n_items`` is spread round-robin
    over the buckets with the grid cell running on globally, so three items cover all task types."""
    plan = buckets_for(size, max_length)
    if n_items is None:
        return [(bucket, j, j) for bucket, count in plan.items() for j in range(count)]
    buckets = list(plan)
    return sorted((buckets[i % len(buckets)], i // len(buckets), i) for i in range(n_items))


def grid_cell(cell: int) -> tuple[str, float]:
    """Task type and depth of a grid cell: a Latin square, so any three consecutive cells cover
    all depths and all task types, and nine cover every combination."""
    depth = DEPTHS[cell % len(DEPTHS)]
    task_type = TASK_TYPES[(cell + cell // len(DEPTHS)) % len(TASK_TYPES)]
    return task_type, depth


class Probe(NamedTuple):
    """What gets hidden in a haystack and asked about (a NamedTuple: lm-eval executes this file
    before registering it as a module, which dataclasses cannot handle)."""

    instruction: str
    inserts: list[tuple[float, str]]  # (depth in [0, 1], sentence)
    question: str
    gen_prefix: str
    answers: list[str]
    distractors: list[str]


def _variable(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in taken and name != "VAR":
            taken.add(name)
            return name


def make_probe(task_type: str, depth: float, rng: random.Random) -> Probe:
    if task_type == "niah":
        key = filler.needle_keys(rng, 1)[0]
        value = str(rng.randint(1_000_000, 9_999_999))
        return Probe(NEEDLE_INSTRUCTION, [(depth, NEEDLE.format(key=key, value=value))],
                     NEEDLE_QUESTION.format(key=key), NEEDLE_PREFIX.format(key=key), [value], [])
    if task_type == "multikey":
        keys = filler.needle_keys(rng, MULTIKEY_NEEDLES, confusable=True)
        values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), MULTIKEY_NEEDLES)]
        others = [rng.uniform(0.02, 0.98) for _ in keys[1:]]
        inserts = [(d, NEEDLE.format(key=k, value=v)) for d, k, v in zip([depth, *others], keys, values)]
        return Probe(NEEDLE_INSTRUCTION, inserts, NEEDLE_QUESTION.format(key=keys[0]),
                     NEEDLE_PREFIX.format(key=keys[0]), [values[0]], values[1:])
    if task_type == "vartrack":
        taken: set[str] = set()
        value, decoy = (str(v) for v in rng.sample(range(10_000, 100_000), 2))
        chain = [_variable(rng, taken) for _ in range(VARTRACK_HOPS + 1)]
        decoys = [_variable(rng, taken) for _ in range(VARTRACK_HOPS + 1)]
        decoy_start = rng.uniform(0.02, 0.5)
        span = (1.0 - depth) * 0.9
        chains = [(chain, depth, value)] + [(decoys, decoy_start, decoy)] * VARTRACK_DECOY_CHAINS
        inserts = []
        for names, start, val in chains:
            for hop, name in enumerate(names):
                statement = f"VAR {name} = {val}." if hop == 0 else f"VAR {name} = VAR {names[hop - 1]}."
                position = start + (span if names is chain else 0.45) * hop / len(names)
                inserts.append((position, statement))
        return Probe(VARTRACK_INSTRUCTION, inserts, VARTRACK_QUESTION.format(value=value),
                     VARTRACK_PREFIX.format(count=len(chain), value=value), chain,
                     decoys if VARTRACK_DECOY_CHAINS else [])
    raise ValueError(f"unknown long_context task_type {task_type!r}; one of {TASK_TYPES}")


def _compose(probe: Probe, haystack: list[str]) -> str:
    placed = list(haystack)
    for depth, sentence in sorted(probe.inserts, key=lambda p: p[0], reverse=True):
        placed.insert(round(depth * len(haystack)), sentence)
    return f"{probe.instruction}\n\n{' '.join(placed)}\n\n{probe.question}"


def fill(probe: Probe, pool: list[str], budget: int, count: Callable[[str], int]) -> tuple[str, int]:
    """The prompt with as many filler sentences from ``pool`` as fit in ``budget`` tokens
    (prompt plus generation prefix), and its token count."""
    fixed = count(_compose(probe, []) + " " + probe.gen_prefix)
    lengths = [count(" " + s) for s in pool]
    total, k = fixed, 0
    while k < len(pool) and total + lengths[k] <= budget:
        total += lengths[k]
        k += 1
    if k == len(pool):
        raise ValueError(f"filler pool of {len(pool)} sentences is too short for a {budget}-token budget")
    while k > 0:
        prompt = _compose(probe, pool[:k])
        n_tokens = count(prompt + " " + probe.gen_prefix)
        if n_tokens <= budget:
            return prompt, n_tokens
        k -= max(1, (n_tokens - budget) // 20)
    raise ValueError(f"budget of {budget} tokens leaves no room for filler; raise the bucket size")


def _haystack_pool(seed: int, bucket: int, doc: str) -> list[str]:
    rng = random.Random(f"long_context/{seed}/haystack/{bucket}/{doc}")
    return filler.sentences(rng, max(40, bucket // 10))  # filler sentences run ~20 tokens: ~2x headroom


def build_item(seed: int, bucket: int, j: int, count: Callable[[str], int], *, cell: int | None = None,
               doc: str | None = None, task_type: str | None = None, depth: float | None = None) -> dict[str, Any]:
    """The j-th item of a bucket, in grid ``cell`` (default j), or of a given task type and depth."""
    cell_type, cell_depth = grid_cell(j if cell is None else cell)
    task_type, depth = task_type or cell_type, cell_depth if depth is None else depth
    doc = doc if doc is not None else str(j // ITEMS_PER_HAYSTACK)
    probe = make_probe(task_type, depth, random.Random(f"long_context/{seed}/probe/{bucket}/{doc}/{j}/{task_type}"))
    prompt, n_tokens = fill(probe, _haystack_pool(seed, bucket, doc), bucket - RESERVE_TOKENS, count)
    answer = ", ".join(probe.answers)
    return {
        "id": f"lc-{seed}-{bucket_label(bucket)}-{task_type}-{doc}-{j:04d}",
        "sub_slice": f"len={bucket_label(bucket)}/depth={round(depth * 100)}%",
        # stratum: the (length, depth) cell the slice enumerates; cluster: the haystack document its items share
        "stratum": f"len={bucket_label(bucket)}/depth={round(depth * 100)}%",
        "cluster": f"haystack-{bucket_label(bucket)}-{doc}",
        "task_type": task_type,
        "bucket": bucket,
        "depth": depth,
        "prompt": prompt,
        "gen_prefix": probe.gen_prefix,
        "answers": probe.answers,
        "distractors": probe.distractors,
        "answer": answer,
        "n_tokens": n_tokens,
        "gold_text": f"{prompt}\n{probe.gen_prefix} {answer}.",
    }


@functools.lru_cache(maxsize=8)
def _items_cached(size: str, seed: int, n_items: int | None, tokenizer: str | None,
                  max_length: int | None) -> tuple[dict, ...]:
    count = token_counter(tokenizer)
    plan = item_plan(size, n_items, max_length)
    return tuple(build_item(seed, bucket, j, count, cell=cell) for bucket, j, cell in plan)


def items(size: str = "quick", seed: int = 1234, n_items: int | None = None, tokenizer: str | None = None,
          max_length: int | None = None, task_type: str | None = None, **_: Any) -> list[dict]:
    """The slice's items (all task types, or only ``task_type``), each with id, sub_slice, cluster, gold_text."""
    if task_type is not None and task_type not in TASK_TYPES:
        raise ValueError(f"long_context task_type={task_type!r} is not one of {TASK_TYPES}")
    everything = _items_cached(size, int(seed), n_items, tokenizer or None, max_length)
    return [dict(item) for item in everything if task_type is None or item["task_type"] == task_type]


def divergence_texts(size: str = "quick", seed: int = 1234, tokenizer: str | None = None,
                     max_length: int | None = None, divergence_max_tokens: int = 4096, **_: Any) -> list[str]:
    """One long gold text per bucket up to ``divergence_max_tokens``: a needle at 50% depth, its
    question and answer, so KL by token position spans the whole window of each bucket."""
    count = token_counter(tokenizer)
    limit = min(int(divergence_max_tokens), max_length or int(divergence_max_tokens))
    plan = [b for b in buckets_for(size, max_length) if b <= limit] or [min(buckets_for(size, max_length))]
    return [build_item(seed, bucket, 0, count, doc="gold", task_type="niah", depth=0.5)["gold_text"]
            for bucket in plan]


def dataset(**metadata: Any):
    """lm-eval ``custom_dataset`` hook: the items of one task type as a DatasetDict with a test split."""
    from datasets import Dataset, DatasetDict

    selected = items(**metadata)
    if not selected:
        raise ValueError(f"long_context: n_items={metadata.get('n_items')} leaves task type "
                         f"{metadata.get('task_type')!r} without items; use n_items >= {len(TASK_TYPES)}")
    return DatasetDict({"test": Dataset.from_list(selected)})
