"""A pairwise judge: an LLM behind any OpenAI-compatible chat endpoint reads both sides' replies to the same prompt.

Off unless ``judge.endpoint`` (a running server) or ``judge.serve`` (a command the harness starts on a free
loopback port, with ``{port}`` in it, as ``candidate.serve``) is set. For every item of ``judge.slices`` (default
the prompt log), the judge sees the conversation as the user saw it and the two replies as "Response A" and
"Response B", labels that do not say which side wrote which, and is asked twice: with the reference's reply first,
then with the candidate's first (:data:`SYSTEM`, :func:`judge_messages`). It answers one word, A, B or tie
(:func:`parse_verdict`: anything else is unparsable, counted, never guessed). Identical replies are a tie and the
judge is not asked. The verdicts become win / tie / loss per item and their statistics in
:mod:`harness.evaluation.judge_stats`; the gate reads ``gate.judge_loss_max`` (:func:`harness.decision.criteria.judge_criteria`).

Requests: ``/v1/chat/completions``, greedy, ``judge.max_tokens``; ``judge.concurrency`` in flight, at most
``judge.max_requests_per_s`` started per second; HTTP 429 and 503 are retried after the server's Retry-After (else
a doubling back-off), a few times. The API key is read from the variable ``judge.api_key_env`` names, into the
Authorization header only; URLs are logged without credentials and any message is scrubbed of the key.

The stage that starts the judge and writes its files, and the command over a finished run's replies, are in
:mod:`harness.evaluation.judge`.
"""
from __future__ import annotations

import os
import re
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

import pandas as pd

from harness.config import JudgeConfig
from harness.engines.openai_http import Client, EndpointError, EndpointSpec, healthy, redact_url, retry_after
from harness.errors import UserError

__all__ = ["JudgeClient", "JudgeConfigError", "Pair", "SYSTEM", "check_config", "enabled", "judge_messages",
           "judge_pairs", "pairs_from_items", "parse_verdict"]

SYSTEM = ("You compare two assistant replies to the same conversation. Decide which reply serves the user better: "
          "correct, helpful, doing what was asked in the form that was asked, in the user's language. A longer reply "
          "is not better for being longer. Answer with exactly one word: A if Response A is better, B if Response B "
          "is better, tie if neither is clearly better.")
QUESTION = "Which response is better? Answer with one word: A, B or tie."
ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
RETRIED = (429, 503)  # rate limited or overloaded: wait and ask again
RETRIES = 5
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_VERDICT = re.compile(r"^(?:response\s+)?(a|b|tie)$", re.IGNORECASE)


class JudgeConfigError(UserError, ValueError):
    """A judge.* setting that cannot work; one line naming it and the fix."""


def enabled(cfg: JudgeConfig) -> bool:
    return bool(cfg.endpoint or cfg.serve)


def check_config(cfg: JudgeConfig, slices: Iterable[str], judge_loss_max: Optional[float] = None) -> None:
    """Refuse a judge config that cannot work, before any model is loaded (nothing to check when the judge is off)."""
    limit_set = judge_loss_max is not None
    if limit_set and not 0 <= float(judge_loss_max) < 1:
        raise JudgeConfigError(f"gate.judge_loss_max={judge_loss_max!r} must be a fraction in [0, 1) (0.05: the "
                               "candidate may lose at most 5 points more often than it wins)")
    if not enabled(cfg):
        if limit_set:
            raise JudgeConfigError("gate.judge_loss_max is set but no judge is: set judge.endpoint=URL or "
                                   "judge.serve='<command with {port}>', or drop gate.judge_loss_max")
        return
    if cfg.endpoint and cfg.serve:
        raise JudgeConfigError("judge.endpoint and judge.serve are both set: keep one (a running server, or a "
                               "command the harness starts)")
    if cfg.endpoint:
        parts = urllib.parse.urlsplit(str(cfg.endpoint))
        if parts.username or parts.password:
            raise JudgeConfigError(f"judge.endpoint={redact_url(str(cfg.endpoint))} holds credentials in the URL, "
                                   "which would be logged: remove them and put the key in an environment variable "
                                   "named by judge.api_key_env")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise JudgeConfigError(f"judge.endpoint={cfg.endpoint!r} is not an http(s) URL: give the server's base "
                                   "URL, e.g. http://127.0.0.1:8000")
    if cfg.serve:
        if "{port}" not in str(cfg.serve):
            raise JudgeConfigError(f"judge.serve={cfg.serve!r} has no {{port}}: the harness picks a free loopback "
                                   "port and puts it there, e.g. 'vllm serve <dir> --host 127.0.0.1 --port {port}'")
        if "--api-key" in str(cfg.serve):
            raise JudgeConfigError("judge.serve holds --api-key, which would be logged: start the server with the "
                                   "key from its environment (e.g. VLLM_API_KEY) and name it in judge.api_key_env")
    if cfg.api_key_env is not None:
        if not _ENV_NAME.match(str(cfg.api_key_env)):
            raise JudgeConfigError("judge.api_key_env must be the NAME of an environment variable (letters, digits, "
                                   "_), not the key itself: export JUDGE_API_KEY=... and set "
                                   "judge.api_key_env=JUDGE_API_KEY")
        if not os.environ.get(str(cfg.api_key_env)):
            raise JudgeConfigError(f"judge.api_key_env={cfg.api_key_env}: that environment variable is not set; "
                                   "export it with the judge server's API key")
    names = list(slices)
    judged = list(cfg.slices or [])
    if not judged:
        raise JudgeConfigError("judge.slices is empty: name the slices whose replies are judged, e.g. "
                               "judge.slices=[prompts]")
    unknown = [name for name in judged if name not in names]
    if unknown:
        raise JudgeConfigError(f"judge.slices names {unknown}, not slices of this run ({names}): judge only the "
                               "run's slices, e.g. judge.slices=[prompts]")
    for key, value, low in (("max_tokens", cfg.max_tokens, 1), ("concurrency", cfg.concurrency, 1)):
        if isinstance(value, bool) or int(value) != value or value < low:
            raise JudgeConfigError(f"judge.{key}={value!r} must be a whole number of at least {low}")
    if cfg.max_requests_per_s is not None and not float(cfg.max_requests_per_s) > 0:
        raise JudgeConfigError(f"judge.max_requests_per_s={cfg.max_requests_per_s!r} must be positive (or null: "
                               "no limit)")
    if not float(cfg.timeout_s) > 0 or not float(cfg.serve_startup_s) > 0:
        raise JudgeConfigError("judge.timeout_s and judge.serve_startup_s must be positive seconds")


# ---------------------------------------------------------------------------------------------------- the prompt
def render_conversation(messages: Iterable[Mapping[str, Any]]) -> str:
    """A conversation as plain turns ("User: ..."), the way it reads to someone shown it."""
    return "\n\n".join(f"{ROLE_NAMES.get(str(m.get('role')), str(m.get('role')).title())}: {m.get('content', '')}"
                       for m in messages)


def judge_messages(conversation: str, first: str, second: str) -> list[dict[str, str]]:
    """The chat messages that ask the judge about one ordering: ``first`` shown as Response A, ``second`` as B."""
    body = (f"[Conversation]\n{conversation}\n[End of conversation]\n\n"
            f"[Response A]\n{first}\n[End of Response A]\n\n"
            f"[Response B]\n{second}\n[End of Response B]\n\n{QUESTION}")
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": body}]


def parse_verdict(text: Optional[str]) -> str:
    """``A``, ``B`` or ``tie`` from the judge's reply, else ``unparsable``. A closed ``<think>`` block is dropped; the
    rest must be one word (``Response A`` also accepted), case and surrounding punctuation or markup ignored."""
    if text is None:
        return "unparsable"
    kept = _THINK.sub(" ", str(text)).strip().strip("*_`'\"“”‘’.,;:!()[]{}<> \t\n").strip()
    match = _VERDICT.match(kept)
    if not match:
        return "unparsable"
    word = match.group(1).lower()
    return "tie" if word == "tie" else word.upper()


# ---------------------------------------------------------------------------------------------------- the client
class JudgeClient:
    """``/v1/models`` and ``/v1/chat/completions`` of the judge's server, through the engines' HTTP client
    (:class:`harness.engines.openai_http.Client`: rate limit, Retry-After, one-line errors naming ``judge.*``)."""

    def __init__(self, url: str, cfg: JudgeConfig, server: Any = None,
                 sleep: Callable[[float], None] = time.sleep):
        spec = EndpointSpec(url=url, model=cfg.model, api_key_env=cfg.api_key_env, timeout_s=float(cfg.timeout_s),
                            concurrency=int(cfg.concurrency), max_requests_per_s=cfg.max_requests_per_s,
                            role="judge", settings="judge.", retries_429=RETRIES, retried=RETRIED, resumes=False)
        self.http = Client(spec, server=server, sleep=sleep)
        self.cfg, self.base = cfg, self.http.base
        self.model: Optional[str] = cfg.model

    @property
    def requests(self) -> int:
        return self.http.requests

    @property
    def retries(self) -> int:
        return self.http.rate_limited

    def call(self, path: str, body: Optional[dict] = None) -> dict:
        """One request, retried on 429 / 503 after the server's Retry-After (else 1, 2, 4 ... s)."""
        return self.http.call(path, body)

    def connect(self) -> str:
        """The judge model's id, from ``/v1/models`` (judge.model, checked; else the server's only model)."""
        self.http.connect()
        self.model = self.http.model
        return str(self.model)

    def chat(self, messages: list[dict[str, str]]) -> Optional[str]:
        """The judge's reply text to one chat (greedy), or None when the answer holds no message."""
        answer = self.call("/chat/completions", {"model": self.model, "messages": messages, "temperature": 0,
                                                 "max_tokens": int(self.cfg.max_tokens)})
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            return None
        return content if isinstance(content, str) else None


# ---------------------------------------------------------------------------------------------------- judging
@dataclass(frozen=True)
class Pair:
    """One item to judge: where it belongs (for the statistics) and what the judge reads."""

    item_id: str
    slice: str
    sub_slice: str
    cluster: str
    stratum: str
    conversation: str  # as the user saw it (render_conversation)
    reply_ref: str
    reply_quant: str


def pairs_from_items(items: pd.DataFrame, slices: Iterable[str],
                     conversations: Mapping[str, str]) -> list[Pair]:
    """The items of ``slices`` as :class:`Pair`; an item's conversation from ``conversations`` (item id -> text),
    else its rendered prompt (the ``prompt`` column: a task slice's prompt as the model saw it)."""
    wanted = set(slices)
    out = []
    for row in items[items["slice"].isin(wanted)].to_dict("records"):
        item_id = str(row["item_id"])
        conversation = conversations.get(item_id)
        if conversation is None:
            conversation = f"User: {row.get('prompt') or ''}"
        out.append(Pair(item_id, str(row["slice"]), str(row.get("sub_slice") or ""), str(row.get("cluster") or item_id),
                        str(row.get("stratum") or ""), conversation, str(row["response_ref"]),
                        str(row["response_quant"])))
    return out


def judge_pairs(pairs: list[Pair], client: JudgeClient, concurrency: int = 1) -> pd.DataFrame:
    """Both orderings of every pair whose replies differ, asked ``concurrency`` at a time; one row per pair with
    its two verdicts (empty for identical replies, not asked). No text of the prompt, the replies or the judge."""
    asks: list[tuple[int, str, list[dict[str, str]]]] = []
    for index, pair in enumerate(pairs):
        if pair.reply_ref == pair.reply_quant:
            continue
        asks.append((index, "ref_first", judge_messages(pair.conversation, pair.reply_ref, pair.reply_quant)))
        asks.append((index, "quant_first", judge_messages(pair.conversation, pair.reply_quant, pair.reply_ref)))
    verdicts: dict[tuple[int, str], str] = {}

    def ask(job: tuple[int, str, list[dict[str, str]]]) -> None:
        index, order, messages = job
        verdicts[(index, order)] = parse_verdict(client.chat(messages))

    pool = ThreadPoolExecutor(max_workers=max(1, int(concurrency)))
    try:
        for future in [pool.submit(ask, job) for job in asks]:
            future.result()  # re-raises the first failure
    except BaseException:  # a failure or Ctrl-C: requests in flight end, queued ones are dropped
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    rows = []
    for index, pair in enumerate(pairs):
        identical = int(pair.reply_ref == pair.reply_quant)
        rows.append({"item_id": pair.item_id, "slice": pair.slice, "sub_slice": pair.sub_slice,
                     "cluster": pair.cluster, "stratum": pair.stratum, "identical": identical,
                     "verdict_ref_first": verdicts.get((index, "ref_first"), ""),
                     "verdict_quant_first": verdicts.get((index, "quant_first"), "")})
    return pd.DataFrame(rows, columns=["item_id", "slice", "sub_slice", "cluster", "stratum", "identical",
                                       "verdict_ref_first", "verdict_quant_first"])

