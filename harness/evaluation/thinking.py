"""Reasoning models: the answer is what follows the end of thinking, and the trace is measured paired.

A thinking model writes a trace before its answer: ``<think>…</think>`` (Qwen3, DeepSeek-R1 and its distills;
R1's chat template opens the trace itself at the end of the prompt), or gpt-oss's harmony channels (``analysis``
then ``final``). :class:`ThinkingSpec` says which (``model.thinking``, ``model.think_start``, ``model.think_end``,
``model.enable_thinking``; ``eval.thinking_budget``) and is the same object on both sides.

**Scoring.** :func:`split_reply` cuts a raw reply into (trace, answer, state). The state is ``closed`` (the trace
ended and an answer followed), ``unclosed`` (the trace opened, in the reply or at the end of the prompt, and never
ended: the reply reached the token cap, or stopped, inside it) or ``none`` (no trace: the whole reply is the
answer). Every generation task's scorer sees only the answer (an unclosed trace has none, so it is scored wrong):
:func:`wrap_task` wraps the task's ``apply_filters``, the one place every engine's replies pass (HF, vLLM, a
served endpoint, lm-eval's request cache on resume), so the answer-extracting filters read the answer and the
logged ``resps`` keep the raw reply, trace included (the records' ``reply``). The task's stop strings would fire
inside a trace (``"\\n"``, ``"\\n\\n"``), so with thinking on they are taken from the request (the model runs to
its end-of-turn token or the cap) and applied to the answer only, where they cut it as they would have cut the
generation. A served candidate's ``reasoning_content`` (vLLM's reasoning parsers) is put back between the tags
(:func:`join_reasoning`) and read the same way.

**Measuring.** :func:`trace_frame` gives per item and side the state, trace tokens, whether the reply hit its
token cap, the share of repeated n-grams and whether it ends in a loop, and where the candidate's trace first
departs from the reference's; :func:`thinking_metrics` the paired statistics per slice (cap-hit and unclosed
rates per side with the paired difference from :func:`harness.stats.paired_compare`, the ratio of trace tokens
with a clustered log-scale interval, :func:`ratio_interval`); :func:`kl_split_metrics` the KL along the
reference's replies apart for trace and answer positions.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from harness.errors import UsageError

MODES = ("none", "tags", "harmony")
CLOSED, UNCLOSED, NONE = "closed", "unclosed", "none"
# gpt-oss (harmony): the analysis channel is the trace, the final channel the answer, which ends at one of these
HARMONY_START = "<|channel|>analysis<|message|>"
HARMONY_END = "<|channel|>final<|message|>"
HARMONY_ANSWER_END = ("<|return|>", "<|end|>", "<|call|>")
HARMONY_TRACE_END = "<|end|>"  # the analysis message's own end, before <|start|>assistant<|channel|>final
# stop strings kept on the request with thinking on: an end-of-turn marker such as <|im_end|> or <end_of_turn>
# (no whitespace inside angle brackets) cannot be part of a trace, everything else may be
_TURN_MARKER = re.compile(r"^<[^\s<>]+>$")
REPEAT_N = 4  # n of the repeated n-gram share
LOOP_MIN_REPEATS = 3  # a trace "loops" when its tail is one span repeated at least this many times ...
LOOP_MIN_TOKENS = 32  # ... covering at least this many tokens


@dataclass(frozen=True)
class ThinkingSpec:
    """How both sides think; the same for reference and candidate (:func:`check_matched`)."""

    mode: str = "none"  # none | tags | harmony
    start: str = "<think>"  # the trace's opening tag (tags)
    end: str = "</think>"  # the tag the answer follows (tags)
    enable_thinking: bool | None = None  # passed to the chat template; None: not passed
    budget: int = 0  # tokens added to each generation task's max_gen_toks for the trace

    @property
    def on(self) -> bool:
        return self.mode != "none"

    def markers(self) -> tuple[str, str, tuple[str, ...]]:
        """(trace start, trace end, strings that end the answer)."""
        if self.mode == "harmony":
            return HARMONY_START, HARMONY_END, HARMONY_ANSWER_END
        return self.start, self.end, ()

    def chat_template_args(self) -> dict[str, Any]:
        return {} if self.enable_thinking is None else {"enable_thinking": bool(self.enable_thinking)}

    def identity(self) -> dict[str, Any] | None:
        """What a cache key records (None when thinking is off and enable_thinking unset: keys stay as they were)."""
        if not self.on and self.enable_thinking is None:
            return None
        start, end, _ = self.markers()
        return {"mode": self.mode, "start": start, "end": end, "enable_thinking": self.enable_thinking,
                "budget": self.budget}

    def describe(self) -> str:
        if not self.on:
            return "thinking off"
        start, end, _ = self.markers()
        return (f"thinking {self.mode} ({start}…{end}), enable_thinking={self.enable_thinking}, "
                f"budget +{self.budget} tokens")


OFF = ThinkingSpec()


def spec_of(cfg: Any) -> ThinkingSpec:
    """The run config's thinking settings (``model.thinking`` and siblings, ``eval.thinking_budget``)."""
    model, ev = cfg.model, cfg.eval
    return ThinkingSpec(mode=str(getattr(model, "thinking", "none") or "none"),
                        start=str(getattr(model, "think_start", "<think>")),
                        end=str(getattr(model, "think_end", "</think>")),
                        enable_thinking=getattr(model, "enable_thinking", None),
                        budget=int(getattr(ev, "thinking_budget", 0) or 0))


def check_config(cfg: Any) -> None:
    """Refuse, in one line and before any work, a thinking setup that would score traces or compare unlike sides."""
    spec = spec_of(cfg)
    if spec.mode not in MODES:
        raise UsageError(f"model.thinking={spec.mode!r}: use one of {list(MODES)}")
    if spec.mode == "tags" and (not spec.start.strip() or not spec.end.strip() or spec.start == spec.end):
        raise UsageError(f"model.think_start={spec.start!r}, model.think_end={spec.end!r}: give two different, "
                         "non-empty tags (e.g. <think> and </think>)")
    if spec.budget < 0:
        raise UsageError(f"eval.thinking_budget={spec.budget}: give a number of tokens >= 0")
    if spec.enable_thinking and not spec.on:
        raise UsageError("model.enable_thinking=true but model.thinking=none: the trace would be scored as the "
                         "answer; set model.thinking=tags (or harmony), or model.enable_thinking=false")
    if spec.enable_thinking is not None and not cfg.model.chat_template:
        raise UsageError(f"model.enable_thinking={spec.enable_thinking} reaches the model through its chat template, "
                         "and model.chat_template=false; set model.chat_template=true or model.enable_thinking=null")


def check_matched(reference: ThinkingSpec, candidate: ThinkingSpec) -> None:
    """Refuse two sides that do not think alike (mode, tags, enable_thinking, budget), in one line."""
    for name in ("mode", "start", "end", "enable_thinking", "budget"):
        ours, theirs = getattr(reference, name), getattr(candidate, name)
        if ours != theirs:
            raise UsageError(f"thinking differs between the sides: reference {name}={ours!r}, candidate "
                             f"{name}={theirs!r}; both must think alike (same enable_thinking and budget) to be paired")


def check_template(tokenizer: Any, spec: ThinkingSpec) -> None:
    """Refuse an ``enable_thinking`` the model's chat template never reads (it renders both values alike)."""
    if spec.enable_thinking is None or not getattr(tokenizer, "chat_template", None):
        return
    messages = [{"role": "user", "content": "2+2?"}]
    rendered = {value: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                     enable_thinking=value) for value in (True, False)}
    if rendered[True] == rendered[False]:
        raise UsageError(f"model.enable_thinking={spec.enable_thinking}: this model's chat template ignores "
                         "enable_thinking (it renders both values alike); set model.enable_thinking=null")


# --------------------------------------------------------------------------- a reply's parts
@dataclass(frozen=True)
class Split:
    trace: str  # the thinking text, tags left out ("" without a trace)
    answer: str  # what the scorer reads ("" for an unclosed trace)
    state: str  # closed | unclosed | none
    answer_at: int  # where the answer begins in the reply (len(reply) for an unclosed trace)


def opened_by(prompt: str, spec: ThinkingSpec) -> bool:
    """Whether the prompt itself leaves a trace open (DeepSeek-R1's template ends with ``<think>\\n``)."""
    if not spec.on or not prompt:
        return False
    start, end, _ = spec.markers()
    at = prompt.rfind(start)
    return at >= 0 and prompt.find(end, at + len(start)) < 0


def split_reply(reply: str, spec: ThinkingSpec, prompt: str = "") -> Split:
    """(trace, answer, state) of a raw reply; the answer is what follows the first end tag."""
    if not spec.on:
        return Split("", reply, NONE, 0)
    start, end, answer_ends = spec.markers()
    begin = reply.find(start)
    close = reply.find(end, 0 if begin < 0 else begin + len(start))
    if close < 0 and begin < 0 and not opened_by(prompt, spec):
        return Split("", reply, NONE, 0)
    trace_from = 0 if begin < 0 else begin + len(start)
    if close < 0:
        return Split(_trace_text(reply[trace_from:], spec), "", UNCLOSED, len(reply))
    answer_at = close + len(end)
    answer = reply[answer_at:]
    for marker in answer_ends:
        answer = answer.split(marker)[0]
    return Split(_trace_text(reply[trace_from:close], spec), answer.lstrip(), CLOSED, answer_at)


def _trace_text(trace: str, spec: ThinkingSpec) -> str:
    if spec.mode == "harmony":
        trace = trace.split(HARMONY_TRACE_END)[0]
    return trace.strip()


def cut_at_stops(text: str, stops: Iterable[str]) -> str:
    """The text before its first stop string (as lm-eval cuts a reply)."""
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text


def join_reasoning(reasoning: str | None, content: str | None, spec: ThinkingSpec, finished: bool = True) -> str:
    """A served reply whose server split off the trace (``reasoning_content``) as the model wrote it.

    A reply whose trace never ended comes back as reasoning alone (vLLM's parsers put all of an unterminated
    trace there): it is joined without the end tag, so it reads as unclosed. ``finished`` False (the server
    says it stopped at the token cap) with no answer text is such a reply."""
    if not reasoning:
        return content or ""
    start, end, _ = spec.markers() if spec.on else ("<think>", "</think>", ())
    if not content and not finished:
        return f"{start}{reasoning}"
    return f"{start}{reasoning}{end}{content or ''}"


def request_stops(until: Any) -> tuple[list[str], list[str]]:
    """(stops kept on a thinking request: end-of-turn markers, stops applied to the answer only: all of them)."""
    stops = [until] if isinstance(until, str) else list(until or [])
    return [s for s in stops if s and _TURN_MARKER.match(s)], [s for s in stops if s]


def wrap_task(task: Any, spec: ThinkingSpec, cap: int | None = None, default_max_gen_toks: int = 256) -> None:
    """Make one lm-eval generation task think: its budget, its stop strings after the trace, its scorer on the answer.

    ``max_gen_toks`` becomes the task's own plus ``spec.budget`` (at most ``cap``); the request keeps only
    end-of-turn stop strings (:func:`request_stops`), the others cut the answer; ``apply_filters`` runs the
    task's filters (the answer extractors) on each reply's answer, then puts back the raw reply, trace included
    and its answer cut at the stop strings, which lm-eval logs as the sample's ``resps``."""
    if not spec.on or getattr(task, "_harness_thinking", None) is not None:
        return
    generation = dict(task.get_config("generation_kwargs") or {})
    kept, answer_stops = request_stops(generation.get("until"))
    total = int(generation.get("max_gen_toks", default_max_gen_toks)) + spec.budget
    generation["max_gen_toks"] = total if cap is None else min(total, cap)
    generation["until"] = kept
    task.set_config(key="generation_kwargs", value=generation)
    task._harness_thinking = spec
    original = task.apply_filters

    def apply_filters(*args: Any, **kwargs: Any) -> Any:
        raw: list[tuple[Any, list]] = []
        for instance in getattr(task, "_instances", None) or []:
            prompt = str(instance.args[0]) if instance.args else ""
            trimmed, answers = [], []
            for reply in instance.resps:
                parts = split_reply(str(reply), spec, prompt)
                answer = cut_at_stops(parts.answer, answer_stops)
                answers.append(answer)
                head = str(reply)[:parts.answer_at]
                trimmed.append(head + cut_at_stops(str(reply)[parts.answer_at:], answer_stops))
            raw.append((instance, trimmed))
            instance.resps = answers
        try:
            return original(*args, **kwargs)
        finally:
            for instance, trimmed in raw:
                instance.resps = trimmed

    task.apply_filters = apply_filters


def apply_to_lm(lm: Any, spec: ThinkingSpec) -> None:
    """Pass ``enable_thinking`` to an lm-eval model's chat template (HFLM's ``chat_template_args``, vLLM's
    ``enable_thinking``); a served candidate renders its prompts with the reference's wrapper, so it follows."""
    args = spec.chat_template_args()
    if not args:
        return
    if hasattr(lm, "chat_template_args"):
        lm.chat_template_args = {**(lm.chat_template_args or {}), **args}
    if hasattr(lm, "enable_thinking"):
        lm.enable_thinking = args["enable_thinking"]


# --------------------------------------------------------------------------- the trace, measured
def repeated_share(tokens: list[int], n: int = REPEAT_N) -> float:
    """Share of the trace's n-grams that occurred earlier in it (0: none repeat; NaN: fewer than n tokens)."""
    if len(tokens) < n:
        return math.nan
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        repeats += gram in seen
        seen.add(gram)
    return repeats / (len(tokens) - n + 1)


def loop_period(tokens: list[int], min_repeats: int = LOOP_MIN_REPEATS, min_tokens: int = LOOP_MIN_TOKENS) -> int:
    """The period of the loop the trace ends in (a span repeated ``min_repeats`` times back to back, covering
    ``min_tokens`` or more, at its end); 0 when it does not end in one."""
    n = len(tokens)
    for period in range(1, n // min_repeats + 1):
        span = tokens[n - period:]
        repeats, at = 1, n - period
        while at - period >= 0 and tokens[at - period:at] == span:
            repeats, at = repeats + 1, at - period
        if repeats >= min_repeats and repeats * period >= min_tokens:
            return period
    return 0


def first_departure(reference: list[int], candidate: list[int]) -> int | None:
    """Index of the first token where the candidate's trace departs from the reference's (None: identical)."""
    for i, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return i
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def ratio_interval(ref: np.ndarray, cand: np.ndarray, clusters: Any, ci_level: float = 0.95
                   ) -> tuple[float, float, float]:
    """(sum(cand) / sum(ref), its interval): the delta method on the log of the ratio of sums, over cluster
    totals, with the small-sample correction G / (G - 1) and Student's t on G - 1 degrees of freedom; NaN where
    undefined (no reference tokens, no candidate tokens, fewer than two clusters).

    The log scale keeps the interval inside (0, inf) and follows the ratio's right skew. Chosen over the paired
    cluster bootstrap's percentile interval because gate.thinking.trace_ratio reads it: at a true increase of
    exactly the limit, 96 items in 32 clusters passed 7.0 % of 200 simulated runs with the percentile interval
    (nominal 2.5 %), and at most 4.4 % with this one (benchmarks/bench_thinking_gate.py)."""
    from scipy.stats import t as student_t

    from harness.stats.paired import cluster_sums

    estimate, ref_sums, cand_sums = cluster_sums(ref, cand, clusters)
    if ref_sums is None or cand_sums is None or cand_sums.sum() <= 0:
        return estimate, math.nan, math.nan
    groups = len(ref_sums)
    share = cand_sums / cand_sums.sum() - ref_sums / ref_sums.sum()  # each cluster's term of d log(ratio)
    se = math.sqrt(groups / (groups - 1) * float(np.sum(share ** 2)))
    half = float(student_t.ppf(0.5 + ci_level / 2, groups - 1)) * se
    return estimate, estimate * math.exp(-half), estimate * math.exp(half)


SIDES = ("ref", "quant")


def trace_frame(reference: pd.DataFrame, candidate: pd.DataFrame, spec: ThinkingSpec,
                tokenize: Callable[[str], list[int]]) -> pd.DataFrame:
    """Per generation item, both sides: state, trace tokens, reply tokens, cap hit, repetition, loop, departure.

    ``reference`` and ``candidate`` are per-item records (``item_id``, ``slice``, ``cluster``, ``output_type``,
    ``prompt``, ``reply`` and, where known, ``max_gen_toks``: the token cap each reply ran under). A reply hit
    its cap when its tokens reach it. The frame is what ``thinking.parquet`` holds."""
    columns = ["item_id", "slice", "task", "cluster", "output_type", "prompt", "reply", "max_gen_toks"]
    ref = reference[[c for c in columns if c in reference]]
    ref = ref[ref["output_type"] == "generate_until"]
    cand = candidate[[c for c in ("item_id", "reply", "max_gen_toks") if c in candidate]]
    both = ref.merge(cand, on="item_id", suffixes=("_ref", "_quant"))
    rows = []
    for row in both.to_dict("records"):
        prompt = str(row.get("prompt") or "")
        out: dict[str, Any] = {k: row.get(k) for k in ("item_id", "slice", "task", "cluster")}
        traces = {}
        for side in SIDES:
            reply = str(row.get(f"reply_{side}") or "")
            parts = split_reply(reply, spec, prompt)
            trace_ids = tokenize(parts.trace) if parts.trace else []
            reply_tokens = len(tokenize(reply)) if reply else 0
            cap = row.get(f"max_gen_toks_{side}", row.get("max_gen_toks"))
            known = cap is not None and not (isinstance(cap, float) and math.isnan(cap))
            out.update({f"state_{side}": parts.state, f"trace_tokens_{side}": len(trace_ids),
                        f"reply_tokens_{side}": reply_tokens,
                        f"cap_hit_{side}": (float(reply_tokens >= int(cap)) if known else math.nan),
                        f"unclosed_{side}": float(parts.state == UNCLOSED),
                        f"closed_{side}": float(parts.state == CLOSED),
                        f"repeated_{side}": repeated_share(trace_ids),
                        f"loop_period_{side}": loop_period(trace_ids),
                        f"trace_{side}": parts.trace, f"answer_{side}": parts.answer})
            traces[side] = trace_ids
        departs = first_departure(traces["ref"], traces["quant"])
        out["first_departure"] = math.nan if departs is None else float(departs)
        out["trace_identical"] = float(departs is None)
        rows.append(out)
    return pd.DataFrame(rows)


def thinking_metrics(frame: pd.DataFrame, *, ci_level: float = 0.95, n_resamples: int = 2000,
                     seed: int = 0) -> dict[str, float]:
    """``<slice>/think_*`` metrics of a :func:`trace_frame` (and ``overall/think_*``), flat for summary.json.

    Per side (``_ref``, ``_quant``) with its interval: the cap-hit rate, the share of traces never closed, the
    share closed (terminated), the mean repeated-n-gram share and the share ending in a loop; paired (candidate
    minus reference, the clustered score interval of :func:`harness.stats.paired_compare`): the differences of
    the cap-hit, unclosed and loop rates; the ratio of thinking tokens (candidate over reference, summed over the
    items, :func:`ratio_interval`); the share of identical traces and the mean first departure (tokens)."""
    from harness.stats.intervals import clustered_rate
    from harness.stats.paired import cluster_codes, paired_compare

    out: dict[str, float] = {}
    if frame.empty:
        return out
    groups = [("overall", frame)] + ([(name, part) for name, part in frame.groupby("slice", sort=False)]
                                      if frame["slice"].nunique() > 1 else [(str(frame["slice"].iloc[0]), frame)])
    for name, part in groups:
        codes = cluster_codes(part["cluster"].astype(str).to_numpy(), len(part))
        prefix = f"{name}/think_"
        out[f"{prefix}n"] = float(len(part))
        out[f"{prefix}n_clusters"] = float(part["cluster"].astype(str).nunique())
        for what in ("cap_hit", "unclosed", "closed", "loop"):
            columns = {side: (part[f"loop_period_{side}"] > 0).astype(float) if what == "loop"
                       else part[f"{what}_{side}"].astype(float) for side in SIDES}
            known = columns["ref"].notna() & columns["quant"].notna()
            if not known.any():
                continue
            for side in SIDES:
                rate, low, high = clustered_rate(columns[side][known].to_numpy(), codes[known.to_numpy()], ci_level)
                out[f"{prefix}{what}_{side}"] = rate
                if math.isfinite(low):
                    out[f"{prefix}{what}_{side}_ci_low"], out[f"{prefix}{what}_{side}_ci_high"] = low, high
            if what == "closed":
                continue
            paired = paired_compare(columns["ref"][known].to_numpy(), columns["quant"][known].to_numpy(),
                                    clusters=part["cluster"][known].astype(str).to_numpy(), ci_level=ci_level,
                                    n_resamples=max(1000, n_resamples), seed=seed)
            out[f"{prefix}{what}_delta"] = float(paired.delta)
            if all(math.isfinite(v) for v in paired.delta_ci):
                out[f"{prefix}{what}_delta_ci_low"], out[f"{prefix}{what}_delta_ci_high"] = map(float, paired.delta_ci)
        for side in SIDES:
            out[f"{prefix}tokens_{side}_mean"] = float(part[f"trace_tokens_{side}"].mean())
            repeated = part[f"repeated_{side}"].astype(float)
            if repeated.notna().any():
                out[f"{prefix}repeated_{side}"] = float(repeated.mean())
        ratio, low, high = ratio_interval(part["trace_tokens_ref"].to_numpy(), part["trace_tokens_quant"].to_numpy(),
                                          part["cluster"].astype(str).to_numpy(), ci_level=ci_level)
        if math.isfinite(ratio):
            out[f"{prefix}tokens_ratio"] = ratio
            if math.isfinite(low):
                out[f"{prefix}tokens_ratio_ci_low"], out[f"{prefix}tokens_ratio_ci_high"] = low, high
        out[f"{prefix}identical_rate"] = float(part["trace_identical"].mean())
        departs = part["first_departure"].astype(float)
        if departs.notna().any():
            out[f"{prefix}first_departure_mean"] = float(departs.mean())
    return out


def run_metrics(reference: pd.DataFrame, candidate: pd.DataFrame, spec: ThinkingSpec,
                tokenize: Callable[[str], list[int]], **options: Any) -> tuple[dict[str, float], pd.DataFrame]:
    """(summary.json ``metrics`` entries, the ``thinking.parquet`` frame) of a run; nothing when thinking is off."""
    if not spec.on:
        return {}, pd.DataFrame()
    frame = trace_frame(reference, candidate, spec, tokenize)
    return thinking_metrics(frame, **options), frame


FRACTION_PT = "fraction (tables: points)"
# summary.json keys this module adds (scripts/docs_reference.py's METRICS format: key -> (unit, meaning))
METRIC_DOCS: dict[str, tuple[str, str]] = {
    "metrics/<slice>/think_n": ("items", "generation items whose traces are compared (model.thinking on)"),
    "metrics/<slice>/think_n_clusters": ("clusters", "clusters of those items (gate.thinking passes a slice of "
                                         "multi-item clusters only with gate.min_clusters_pass of them)"),
    "metrics/<slice>/think_cap_hit_<side>": ("fraction", "share of replies that reached their token cap "
                                             "(task max_gen_toks + eval.thinking_budget); <side> ref or quant"),
    "metrics/<slice>/think_unclosed_<side>": ("fraction", "share of replies whose trace never closed (scored wrong)"),
    "metrics/<slice>/think_closed_<side>": ("fraction", "share of replies whose trace closed and an answer followed"),
    "metrics/<slice>/think_loop_<side>": ("fraction", "share of traces ending in a loop (a span repeated ≥3 times "
                                          "back to back over ≥32 tokens)"),
    "metrics/<slice>/think_<rate>_<side>_ci_low": ("fraction", "lower bound of that rate's interval (Wilson on the "
                                                   "clustered effective size)"),
    "metrics/<slice>/think_<rate>_<side>_ci_high": ("fraction", "upper bound of that rate's interval"),
    "metrics/<slice>/think_<rate>_delta": (FRACTION_PT, "quant − ref of cap_hit, unclosed or loop, paired on the same items"),
    "metrics/<slice>/think_<rate>_delta_ci_low": (FRACTION_PT, "lower bound (clustered paired score interval)"),
    "metrics/<slice>/think_<rate>_delta_ci_high": (FRACTION_PT, "upper bound"),
    "metrics/<slice>/think_tokens_<side>_mean": ("tokens", "mean thinking tokens per item"),
    "metrics/<slice>/think_tokens_ratio": ("ratio", "thinking tokens of the candidate over the reference's, summed "
                                           "over the same items"),
    "metrics/<slice>/think_tokens_ratio_ci_low": ("ratio", "lower bound (clustered delta method on the log ratio, "
                                                  "Student's t on clusters - 1)"),
    "metrics/<slice>/think_tokens_ratio_ci_high": ("ratio", "upper bound"),
    "metrics/<slice>/think_repeated_<side>": ("fraction", "mean share of a trace's 4-grams that occurred earlier in it"),
    "metrics/<slice>/think_identical_rate": ("fraction", "share of items whose two traces are identical"),
    "metrics/<slice>/think_first_departure_mean": ("tokens", "mean token index where the candidate's trace first "
                                                   "departs from the reference's (items whose traces differ)"),
    "metrics/<slice>/n_tokens_trace": ("tokens", "trace positions scored along the reference's replies (through the "
                                       "end tag; an unclosed reply: all of it); model.thinking on"),
    "metrics/<slice>/kl_trace_mean": ("nats per token", "mean KL(ref || quant) on trace positions"),
    "metrics/<slice>/kl_trace_se": ("nats per token", "standard error of kl_trace_mean (tokens independent)"),
    "metrics/<slice>/kl_trace_p99": ("nats", "99th percentile of the KL on trace positions"),
    "metrics/<slice>/top1_agree_trace": ("fraction", "top-1 agreement on trace positions"),
    "metrics/<slice>/ln_ppl_ratio_trace": ("nats per token", "mean log PPL ratio (quant / ref) on trace positions"),
    "metrics/<slice>/ppl_ratio_trace": ("ratio", "PPL ratio (quant / ref) on trace positions"),
    "metrics/<slice>/n_tokens_answer": ("tokens", "answer positions scored along the reference's replies (after the "
                                        "end tag; a reply with no trace: all of it); model.thinking on"),
    "metrics/<slice>/kl_answer_mean": ("nats per token", "mean KL(ref || quant) on answer positions"),
    "metrics/<slice>/kl_answer_se": ("nats per token", "standard error of kl_answer_mean (tokens independent)"),
    "metrics/<slice>/kl_answer_p99": ("nats", "99th percentile of the KL on answer positions"),
    "metrics/<slice>/top1_agree_answer": ("fraction", "top-1 agreement on answer positions"),
    "metrics/<slice>/ln_ppl_ratio_answer": ("nats per token", "mean log PPL ratio (quant / ref) on answer positions"),
    "metrics/<slice>/ppl_ratio_answer": ("ratio", "PPL ratio (quant / ref) on answer positions"),
}


# --------------------------------------------------------------------------- KL along the trace and the answer
TRACE, ANSWER = "trace", "answer"  # the parts of a served reply whose KL is reported apart (kl_trace_mean, ...)


def answer_token(reply_ids: list[int], decode: Callable[[list[int]], str], spec: ThinkingSpec,
                 prompt: str = "") -> int:
    """How many of a reply's tokens are trace: the answer starts at this index (0: no trace, the whole reply is
    answer; ``len(reply_ids)``: a trace never closed, no answer). The end tag belongs to the trace; a token that
    holds both the tag's end and the answer's first characters is counted as trace."""
    parts = split_reply(decode(reply_ids), spec, prompt)
    if parts.state == NONE:
        return 0
    if parts.state == UNCLOSED:
        return len(reply_ids)
    low, high = 1, len(reply_ids)  # the fewest tokens whose text reaches the answer's first character
    while low < high:
        middle = (low + high) // 2
        if len(decode(reply_ids[:middle])) >= parts.answer_at:
            high = middle
        else:
            low = middle + 1
    return low


def reply_parts(tokens: pd.DataFrame, texts: dict[str, list[Any]], spec: ThinkingSpec,
                decode: Callable[[list[int]], str]) -> pd.DataFrame:
    """The served replies' token rows (``kind`` reply) labelled ``part`` trace or answer.

    ``tokens``: the divergence stage's rows (``slice``, ``text``, ``position``, ``kind``); ``texts``: each
    slice's reference texts in the order they were scored (``SliceReference.texts``: ``text`` indexes them). Row
    ``position`` p predicts token p of its text; a reply starts at the text's ``prompt_tokens``."""
    if tokens.empty or "kind" not in tokens or not spec.on:
        return tokens.iloc[0:0].assign(part=pd.Series(dtype=str))
    replies = tokens[tokens["kind"] == "reply"]
    starts: dict[tuple[str, int], int] = {}
    for (name, index) in replies[["slice", "text"]].drop_duplicates().itertuples(index=False):
        text = texts[name][int(index)]
        pair = text.prompt_and_reply()
        if pair is None:
            continue
        prompt_ids, reply_ids = pair
        starts[(name, int(index))] = len(prompt_ids) + answer_token(reply_ids, decode, spec, decode(prompt_ids))
    if not starts:
        return replies.iloc[0:0].assign(part=pd.Series(dtype=str))
    first = pd.Series([starts.get((s, int(t)), -1) for s, t in zip(replies["slice"], replies["text"])],
                      index=replies.index)
    known = first >= 0
    return replies[known].assign(part=np.where(replies["position"][known] < first[known], TRACE, ANSWER))


def kl_split_metrics(tokens: pd.DataFrame, texts: dict[str, list[Any]], spec: ThinkingSpec,
                     decode: Callable[[list[int]], str]) -> dict[str, float]:
    """``<slice>/kl_trace_mean``, ``kl_answer_mean``, ``top1_agree_trace``, ... (and ``overall/``): the divergence
    along the reference's own replies, apart for the trace's positions and the answer's (:func:`reply_parts`);
    the names of :data:`harness.divergence.token_stats.SIDE_COLUMNS` with kind trace / answer. Nothing when thinking is
    off or the run scored no served replies."""
    from harness.divergence import token_stats

    labelled = reply_parts(tokens, texts, spec, decode)
    out: dict[str, float] = {}
    if labelled.empty:
        return out
    for part in (TRACE, ANSWER):
        rows = labelled[labelled["part"] == part]
        if rows.empty:
            out[f"overall/n_tokens_{part}"] = 0.0
            continue
        for frame in (rows.assign(slice="overall"), rows):
            for row in token_stats.summarize_by(frame, "slice").to_dict("records"):
                for stat, name in token_stats.SIDE_COLUMNS.items():
                    value = row.get(stat)
                    if value is not None and math.isfinite(float(value)):
                        out[f"{row['slice']}/{name.format(kind=part)}"] = float(value)
    return out


def markdown(metrics: dict[str, Any], slice_name: str) -> str:
    """The report's "Thinking" section of one slice: per side and paired, the intervals ``gate.thinking`` reads
    (""  when the slice has no trace metrics)."""
    prefix = f"{slice_name}/think_"
    if f"{prefix}n" not in metrics:
        return ""

    def pct(key: str) -> str:
        value = metrics.get(key)
        return "–" if value is None else f"{100 * value:.1f}"

    def shown(stem: str, scale: float = 100.0, shift: float = 0.0) -> str:
        value, low, high = (metrics.get(stem), metrics.get(f"{stem}_ci_low"), metrics.get(f"{stem}_ci_high"))
        if value is None:
            return "–"
        tail = "" if low is None or high is None else \
            f" [{scale * (low - shift):+.1f}, {scale * (high - shift):+.1f}]"
        return f"{scale * (value - shift):+.1f}{tail}"

    lines = [f"### Thinking: {slice_name}", "",
             f"{int(metrics[f'{prefix}n'])} generation items; candidate − reference with its interval (the one "
             "gate.thinking reads).", "",
             "| | reference % | candidate % | Δ pt [CI] |", "|:--|--:|--:|:--|"]
    for rate, label in (("closed", "trace closed"), ("unclosed", "trace never closed"),
                        ("cap_hit", "reached the token cap"), ("loop", "ends in a loop")):
        if f"{prefix}{rate}_ref" in metrics:
            lines.append(f"| {label} | {pct(f'{prefix}{rate}_ref')} | {pct(f'{prefix}{rate}_quant')} | "
                         f"{shown(f'{prefix}{rate}_delta') if rate != 'closed' else '–'} |")
    ref_tokens, quant_tokens = metrics.get(f"{prefix}tokens_ref_mean"), metrics.get(f"{prefix}tokens_quant_mean")
    if ref_tokens is not None and quant_tokens is not None:
        lines += ["", f"Trace tokens per item: reference {ref_tokens:.1f}, candidate {quant_tokens:.1f}; change "
                  f"{shown(f'{prefix}tokens_ratio', shift=1.0)} % (clustered interval of the log ratio)."]
    split = [(part, metrics.get(f"{slice_name}/kl_{part}_mean"), metrics.get(f"{slice_name}/top1_agree_{part}"),
              metrics.get(f"{slice_name}/n_tokens_{part}")) for part in (TRACE, ANSWER)]
    if any(kl is not None for _, kl, _, _ in split):
        lines += ["", "| along the reference's replies | tokens | KL mean (nats) | top-1 agree % |",
                  "|:--|--:|--:|--:|"]
        lines += [f"| {part} | {int(n or 0)} | {'–' if kl is None else f'{kl:.4g}'} | "
                  f"{'–' if top1 is None else f'{100 * top1:.1f}'} |" for part, kl, top1, n in split]
    return "\n".join(lines) + "\n"
