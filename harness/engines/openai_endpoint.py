"""The ``openai`` engine: any OpenAI-compatible ``/v1/completions`` server, reached at its URL.

``candidate.endpoint=<url>`` evaluates whatever that server serves (vLLM, SGLang, TensorRT-LLM,
llama.cpp's server, ...) as the candidate; ``candidate.serve="<command with {port}>"`` starts the
server first (the ``vllm-serve`` engine, :mod:`harness.engines.vllm_serve`: a free loopback port, wait for
health, stop at the end; :class:`Client` asks any such ``server`` how it ended when a request fails). The
items, the prompts and the per-item records are lm-eval's, exactly as for a simulated candidate:
:class:`EndpointLM` is an lm-eval ``LM`` whose prompts are built by the *reference's own* lm-eval
wrapper (its ``tok_encode``, ``tok_batch_encode`` and chat template, the "twin"), and only the
forward passes go over HTTP:

* log-likelihood items: the reference's token ids of context + continuation are sent as the prompt
  with ``echo=true, max_tokens=0, logprobs=k``; the continuation's prompt log-probs are summed, and
  it is greedy when each of its tokens is the top of the server's ``top_logprobs`` (as lm-eval's
  HFLM decides it from the full distribution);
* generation items: the prompt *text* exactly as lm-eval built it (chat template included) is sent,
  greedy, with the task's stop strings and ``max_gen_toks``; the reply is cut at the stop strings as
  HFLM cuts it;
* divergence texts (:func:`teacher_forced`): the reference's served text (prompt as evaluated + the
  reference's own reply) as token ids, ``echo=true, max_tokens=0, logprobs=k``: each position's log-prob
  of the actual token and the server's top-k, from which :mod:`harness.divergence.topk_bound` computes a
  lower bound of the KL.

Every request also echoes the prompt's tokens, and each item is refused unless the served prompt's
tokens equal the reference's (ids when the server returns them, ``return_tokens_as_token_ids``; else
each token's text against the reference tokenizer's): a server that serves another model, another
tokenizer or adds its own BOS is stopped at the first item, in one line.

A server that dies, hangs (no reply within ``timeout_s``) or refuses a request ends the run with one
line (plus its last log lines when the harness started it); every item answered before is already
in lm-eval's request cache (``CacheHook.add_partial`` after each answer), so the same command
resumes. The API key is read from the environment variable ``api_key_env`` names at each request
and is only ever put in the ``Authorization`` header: no attribute, message or log line holds it.
"""
from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness.config import CandidateConfig
from harness.divergence.topk_bound import NoPromptLogprobs, ServedLogprobs
from harness.engines.base import Capabilities, ServedEngine, ServedModel
from harness.engines.openai_http import Client, EndpointError, EndpointSpec, Server, healthy
from harness.engines.registry import register_engine

# Checked once per connection (chat template, accents, CJK, an emoji, digits, code): a server with another
# tokenizer echoes other tokens for it.
PROBE_TEXT = "Quelle est la capitale de la France ? Ünïcödé → 東京タワー 😀 12345 `def f(x): return x**2`"
TOKEN_ID = re.compile(r"^token_id:(\d+)$")  # vLLM's return_tokens_as_token_ids form


# --------------------------------------------------------------------------- the token check
def served_ids(choice: dict, tokenizer: Any, count: int) -> list[int | str]:
    """The first ``count`` echoed tokens: ids when the server names them, else their texts."""
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens")
    if not tokens:
        raise EndpointError("the server returned no prompt tokens for echo=true with logprobs: it cannot be checked "
                            "against the reference's tokens, nor scored (serve it with an engine that returns "
                            "prompt log-probs, e.g. vLLM)")
    out: list[int | str] = []
    for token in tokens[:count]:
        match = TOKEN_ID.match(str(token))
        out.append(int(match.group(1)) if match else str(token))
    return out


def check_tokens(served: list[int | str], reference: list[int], tokenizer: Any, what: str) -> None:
    """Refuse unless the server's tokens are the reference's (ids exactly; texts token by token)."""
    def same(theirs: int | str, ours: int) -> bool:
        if isinstance(theirs, int):
            return theirs == ours
        text = tokenizer.decode([ours], skip_special_tokens=False)
        return theirs == text or ("\ufffd" in text and ("\ufffd" in theirs or theirs.startswith("bytes:")))

    if len(served) == len(reference) and all(same(a, b) for a, b in zip(served, reference)):
        return
    first = next((i for i, (a, b) in enumerate(zip(served, reference)) if not same(a, b)),
                 min(len(served), len(reference)))
    theirs = served[first] if first < len(served) else "(end)"
    ours = reference[first] if first < len(reference) else "(end)"
    ours_text = tokenizer.decode([ours], skip_special_tokens=False) if isinstance(ours, int) else ours
    raise EndpointError(f"{what}: the server's prompt is {len(served)} tokens, the reference's {len(reference)}; "
                        f"first difference at token {first}: served {theirs!r} vs reference {ours!r} "
                        f"({ours_text!r}). The server runs another model or tokenizer (or adds its own BOS), so its "
                        "answers would not pair with the reference's: serve a quantization of this reference")


def _preview(text: str, width: int = 50) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


# --------------------------------------------------------------------------- teacher-forced log-probs
class TokenNames:
    """A server's name of a token, read as one id of the reference's vocabulary.

    ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``) is N; a token's text is the one id that
    decodes to it, and None (no cell of its own) where several ids or none do.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._by_text: dict[str, int | None] | None = None

    def render(self, token: int) -> str:
        """The text the server shows for ``token``."""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def by_text(self, name: str) -> int | None:
        """The one id :meth:`render` gives ``name`` for, else None (built once over the vocabulary)."""
        if self._by_text is None:
            by_text: dict[str, int | None] = {}
            for token in range(len(self.tokenizer)):
                text = self.render(token)
                by_text[text] = None if text in by_text else token
            self._by_text = by_text
        return self._by_text.get(name)

    def id(self, name: str) -> int | None:
        match = TOKEN_ID.match(name)
        if match:
            return int(match.group(1))
        return self.by_text(name)


def prompt_logprobs(choice: dict, n_tokens: int, k: int, names: TokenNames) -> ServedLogprobs:
    """Positions 1..n-1 of an echoed prompt's log-probs: each actual token's, and the top-k named."""
    logprobs = choice.get("logprobs") or {}
    values = (logprobs.get("token_logprobs") or [])[1:n_tokens]
    tops = (logprobs.get("top_logprobs") or [])[1:n_tokens]
    n = n_tokens - 1
    if len(values) < n or len(tops) < n or any(v is None for v in values) or any(not t for t in tops):
        raise NoPromptLogprobs(f"the server returned no log-probs of prompt tokens for echo=true, logprobs={k}")
    width = max([len(top) for top in tops] + [1])
    top_ids = np.full((n, width), -1, dtype=np.int64)
    top_values = np.full((n, width), np.nan)
    for row, top in enumerate(tops):
        column = 0
        for name, value in top.items():
            token = names.id(str(name))
            if token is None or value is None or token in top_ids[row, :column]:
                continue
            top_ids[row, column], top_values[row, column] = token, float(value)
            column += 1
    return ServedLogprobs(np.asarray(values, dtype=np.float64), top_ids, top_values, k)


def teacher_forced(client: Client, texts: list[list[int]], k: int, tokenizer: Any,
                   batch_size: int = 8) -> list[ServedLogprobs]:
    """The server's log-probs of each text (token ids), sent whole as a prompt, top-``k`` per position.

    ``echo=true, max_tokens=0, logprobs=k`` (vLLM returns the prompt's top-k this way, capped by its
    ``--max-logprobs``, 20 by default); the echoed tokens must be the ids sent. Raises
    :class:`NoPromptLogprobs` when the server returns none or refuses ``logprobs=k``, and
    :class:`EndpointError` when it fails otherwise.
    """
    names = TokenNames(tokenizer)
    out: list[ServedLogprobs] = []
    for start in range(0, len(texts), max(1, batch_size)):
        chunk = [list(ids) for ids in texts[start:start + max(1, batch_size)]]
        try:
            choices = client.complete(prompt=chunk, max_tokens=0, echo=True, logprobs=k, temperature=0,
                                      return_tokens_as_token_ids=True)
        except EndpointError as exc:
            if exc.http_status in (400, 422) and "logprob" in exc.detail.lower():
                raise NoPromptLogprobs(f"the server refused logprobs={k}: {exc.detail[:200]}; "
                                       "lower candidate.endpoint_divergence_topk or let the server return more "
                                       "(vLLM: --max-logprobs)") from None
            raise
        if len(choices) != len(chunk):
            raise EndpointError(f"the server answered {len(choices)} of {len(chunk)} prompts of one request")
        for ids, choice in zip(chunk, choices):
            what = f"divergence text {_preview(tokenizer.decode(ids[:40], skip_special_tokens=False))!r}"
            check_tokens(served_ids(choice, tokenizer, len(ids)), ids, tokenizer, what)
            out.append(prompt_logprobs(choice, len(ids), k, names))
    return out


# --------------------------------------------------------------------------- the lm-eval model
def endpoint_lm(client: Client, twin: Any) -> Any:
    """An lm-eval ``LM`` answering through ``client``'s server (connected here unless it is), with ``twin``'s
    prompts and tokens.

    ``twin`` is the reference's own lm-eval wrapper (``harness.evaluation.evaluate.make_lm`` on the
    reference): its tokenization, truncation and chat template make the prompts, so they are the
    reference's exactly; its model is never called. The server's tokenizer is probed once here.
    """
    served = client.served or client.connect()
    lm = _endpoint_lm_class()(client, twin, served)
    lm.probe()
    return lm


@functools.cache
def _endpoint_lm_class() -> type:
    """The lm-eval model class, built on first use (lm-eval is imported only when an endpoint is used)."""
    from lm_eval.api.model import TemplateLM

    class EndpointLM(TemplateLM):
        """The reference's prompts and tokens (its twin's), the server's answers (module docstring)."""

        def __init__(self, client: Client, twin: Any, served: dict) -> None:
            super().__init__()
            self.client, self.twin, self.tokenizer = client, twin, twin.tokenizer
            self.served = served  # the server's /v1/models entry (vLLM names the checkpoint: "root")
            limit = served.get("max_model_len")
            self.server_max_len = int(limit) if limit else None
            self.prompt_tokens = self.generated_tokens = 0
            self.seconds = 0.0

        # -- the reference's prompts and tokens
        @property
        def eot_token_id(self) -> int:
            return self.twin.eot_token_id

        @property
        def prefix_token_id(self) -> int:
            return self.twin.prefix_token_id

        @property
        def max_length(self) -> int:
            return self.twin.max_length

        @property
        def tokenizer_name(self) -> str:
            return self.twin.tokenizer_name

        def chat_template(self, chat_template: bool | str = False) -> str | None:
            return self.twin.chat_template(chat_template)

        def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
            return self.twin.apply_chat_template(chat_history, add_generation_prompt)

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            return self.twin.tok_encode(string, add_special_tokens=add_special_tokens, **kwargs)

        def _fits(self, n_tokens: int, what: str) -> None:
            if self.server_max_len is not None and n_tokens > self.server_max_len:
                raise EndpointError(f"{what}: {n_tokens} tokens, more than the server's max_model_len "
                                    f"{self.server_max_len}; serve it with a longer context (e.g. vLLM "
                                    f"--max-model-len {n_tokens}) or lower model.max_length")

        def _timed(self, **body: Any) -> list[dict]:
            start = time.perf_counter()
            try:
                return self.client.complete(**body)
            finally:
                self.seconds += time.perf_counter() - start

        def _prompt(self, context: str, left_truncate_len: int) -> tuple[list[int], str | list[int], bool]:
            return reference_prompt(self, context, left_truncate_len)

        def probe(self) -> None:
            """Refuse a server whose tokenizer differs, before any item: one chat-templated text, echoed."""
            probe_tokenizer(self)

        # -- the items
        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
            return score_loglikelihood(self, requests)

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            return [score_rolling(self, string) for (string,) in (request.args for request in requests)]

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            return generate_all(self, [request.args for request in requests])

    return EndpointLM


def score_loglikelihood(lm: Any, requests: list) -> list[tuple[float, bool]]:
    """Log-likelihood requests: prompt log-probs of the reference's token ids, ``batch_size`` prompts a request."""
    batch = max(1, lm.client.spec.batch_size)
    results: list[tuple[float, bool]] = []
    for start in range(0, len(requests), batch):
        chunk = requests[start:start + batch]
        prompts = [(list(ctx) + list(cont))[-(lm.max_length + 1):] for _, ctx, cont in chunk]
        for (key, _, _), prompt in zip(chunk, prompts):
            lm._fits(len(prompt), f"item {_preview(str(key[0]) if key else '')!r}")
        # token *texts* come back (no return_tokens_as_token_ids): echoed ids would only repeat the ids
        # sent, while their texts show which vocabulary the server scored them in
        choices = lm._timed(prompt=prompts, max_tokens=0, echo=True, logprobs=max(1, lm.client.spec.top_logprobs),
                            temperature=0)
        if len(choices) != len(prompts):
            raise EndpointError(f"the server answered {len(choices)} of {len(prompts)} prompts of one request")
        for (key, _, cont), prompt, choice in zip(chunk, prompts, choices):
            check_tokens(served_ids(choice, lm.tokenizer, len(prompt)), prompt, lm.tokenizer,
                         f"log-likelihood item {_preview(str(key[0]) if key else '')!r}")
            answer = _continuation_score(choice, len(cont))
            lm.prompt_tokens += len(prompt)
            results.append(answer)
            if key is not None:
                lm.cache_hook.add_partial("loglikelihood", key, answer)
    return results


def score_rolling(lm: Any, string: str) -> float:
    """A rolling log-likelihood request: the text's disjoint windows scored as log-likelihood requests."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
        token_list=lm.tok_encode(string), prefix_token=lm.prefix_token_id, max_seq_len=lm.max_length,
        context_len=1)]
    total = sum(score for score, _ in score_loglikelihood(lm, [(None, ctx, cont) for ctx, cont in windows]))
    lm.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
    return total


def reference_prompt(lm: Any, context: str, left_truncate_len: int) -> tuple[list[int], str | list[int], bool]:
    """(the reference's prompt ids as HFLM's generate_until makes them, what to send, add_special_tokens).

    The text is sent unless HFLM left-truncated it (then its ids are); ``add_special_tokens`` is
    HFLM's choice (False when the text already starts with BOS), passed on to servers that read it.
    """
    from lm_eval.models.utils import has_bos_prefix

    ids, _ = lm.twin.tok_batch_encode([context], left_truncate_len=left_truncate_len)
    reference = ids[0].tolist()
    bos = getattr(lm.tokenizer, "bos_token", None)
    add_special = False if has_bos_prefix(context, bos) else (
        lm.twin.add_bos_token if lm.twin.add_bos_token is not None else True)
    full = lm.tok_encode(context, add_special_tokens=add_special)
    return reference, (context if len(full) == len(reference) else reference), add_special


def probe_tokenizer(lm: Any) -> None:
    """Refuse a server whose tokenizer differs, before any item: one chat-templated text, echoed."""
    try:
        text = lm.apply_chat_template([{"role": "user", "content": PROBE_TEXT}])
    except Exception:  # noqa: BLE001 - a tokenizer without a chat template: the plain text
        text = PROBE_TEXT
    reference, prompt, add_special = reference_prompt(lm, text, lm.max_length)
    (choice,) = lm._timed(prompt=prompt, max_tokens=0, echo=True, logprobs=0, temperature=0,
                          add_special_tokens=add_special, return_tokens_as_token_ids=True)
    check_tokens(served_ids(choice, lm.tokenizer, len(reference)), reference, lm.tokenizer,
                 f"tokenizer probe {_preview(text)!r}")


def generate_all(lm: Any, items: list[tuple[str, dict]]) -> list[str]:
    """Generation items, ``lm.client.spec.concurrency`` requests in flight at once (only the HTTP requests run in
    threads; prompts are built and replies checked here). Replies are recorded in item order: when a request
    fails, the items before it are kept (the job resumes from them) and the error is raised."""
    workers = max(1, int(lm.client.spec.concurrency))
    if workers == 1 or len(items) < 2:
        return [generate_one(lm, *item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    prepared = [prepare_generation(lm, *item) for item in items]  # refuses a bad item before any request
    start = time.perf_counter()
    replies = []
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="endpoint") as pool:
            futures = [pool.submit(lm.client.complete, **request.body) for request in prepared]
            try:
                for (context, gen_kwargs), request, future in zip(items, prepared, futures):
                    (choice,) = future.result()
                    replies.append(record_generation(lm, context, gen_kwargs, *finish_generation(lm, request, choice)))
            finally:
                for future in futures:
                    future.cancel()  # requests not yet sent are not sent after a failure
    finally:
        lm.seconds += time.perf_counter() - start  # the wall time, once: the requests overlap
    return replies


def generate_one(lm: Any, context: str, gen_kwargs: dict) -> str:
    """One generation request: the prompt text as lm-eval built it, greedy, cut at the stop strings as HFLM cuts."""
    request = prepare_generation(lm, context, gen_kwargs)
    (choice,) = lm._timed(**request.body)
    return record_generation(lm, context, gen_kwargs, *finish_generation(lm, request, choice))


@dataclass
class GenerationRequest:
    """One generation item's completions request and what checking its answer needs."""

    body: dict
    context: str  # the prompt text as lm-eval built it
    reference: list[int]  # the prompt's token ids as the reference's wrapper encodes them
    prompt: Any  # the prompt sent: its text, or its token ids
    until: list[str]
    what: str  # the item, for messages


def prepare_generation(lm: Any, context: str, gen_kwargs: dict) -> GenerationRequest:
    """The completions request of one generation item (greedy; a sampling task is refused)."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

    eos = lm.twin.tok_decode(lm.eot_token_id, skip_special_tokens=False)
    kwargs = normalize_gen_kwargs(gen_kwargs, lm.twin.max_gen_toks)
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    max_gen_toks = int(kwargs.pop("max_gen_toks"))
    if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
        raise EndpointError(f"generation item {_preview(context)!r} asks for sampling ({gen_kwargs}); "
                            "an endpoint candidate is paired greedily: set the task to do_sample: false")
    what = f"generation item {_preview(context)!r}"
    reference, prompt, add_special = reference_prompt(lm, context, lm.max_length - max_gen_toks)
    lm._fits(len(reference) + max_gen_toks, what)
    body = dict(prompt=prompt, max_tokens=max_gen_toks, temperature=0, echo=True, logprobs=0,
                stop=[s for s in until if s], add_special_tokens=add_special, return_tokens_as_token_ids=True,
                skip_special_tokens=not getattr(lm.twin, "keep_special", False))
    return GenerationRequest(body, context, reference, prompt, until, what)


def finish_generation(lm: Any, request: GenerationRequest, choice: dict) -> tuple[str, int, int]:
    """(reply, prompt tokens, generated tokens) of one answered request, its prompt tokens checked against the
    reference's; the reply cut at the stop strings as HFLM cuts it."""
    from lm_eval.models.utils import postprocess_generated_text

    check_tokens(served_ids(choice, lm.tokenizer, len(request.reference)), request.reference, lm.tokenizer,
                 request.what)
    text = str(choice.get("text") or "")
    echoed = request.context if isinstance(request.prompt, str) else None
    if echoed is not None and not text.startswith(echoed):
        raise EndpointError(f"{request.what}: the server's echo does not start with the prompt text; it does not "
                            "echo prompts as the OpenAI completions API does")
    reply = text[len(echoed):] if echoed is not None else _after_tokens(choice, len(request.reference))
    reply = with_reasoning(choice, reply, getattr(lm.twin, "think_tags", None), request.what)
    reply = postprocess_generated_text(reply, request.until, None)  # with thinking on: end-of-turn stops only
    generated = max(0, len((choice.get("logprobs") or {}).get("tokens") or []) - len(request.reference))
    return reply, len(request.reference), generated


def with_reasoning(choice: dict, reply: str, think_tags: tuple[str, str] | None, what: str) -> str:
    """The reply as the model wrote it when the server split its trace off (``reasoning_content``, or
    ``reasoning``: vLLM's reasoning parsers): the trace put back between ``think_tags`` before the answer, or
    after the opening tag alone when the trace never ended (no answer, and the server stopped at the token cap), so
    the harness reads it as it reads an in-process reply (harness.evaluation.thinking). Refused without tags."""
    reasoning = choice.get("reasoning_content") or choice.get("reasoning")
    if not reasoning:
        return reply
    if think_tags is None:
        raise EndpointError(f"{what}: the server split off a reasoning trace (reasoning_content) but model.thinking="
                            "none; set model.thinking=tags (or harmony) so the trace is read and measured")
    start, end = think_tags
    if not reply and choice.get("finish_reason") == "length":
        return f"{start}{reasoning}"
    return f"{start}{reasoning}{end}{reply}"


def record_generation(lm: Any, context: str, gen_kwargs: dict, reply: str, prompt_tokens: int,
                      generated_tokens: int) -> str:
    """Count one answered generation item and keep its reply (lm-eval's cache: the job's checkpoint)."""
    lm.prompt_tokens += prompt_tokens
    lm.generated_tokens += generated_tokens
    lm.cache_hook.add_partial("generate_until", (context, gen_kwargs), reply)
    return reply


def _continuation_score(choice: dict, n_cont: int) -> tuple[float, bool]:
    """(sum of the last ``n_cont`` prompt log-probs, whether each was the top of its position)."""
    logprobs = choice.get("logprobs") or {}
    values = (logprobs.get("token_logprobs") or [])[-n_cont:] if n_cont else []
    tops = (logprobs.get("top_logprobs") or [])[-n_cont:] if n_cont else []
    if len(values) != n_cont or any(v is None for v in values):
        raise EndpointError("the server returned no log-prob for a scored prompt token (echo=true, logprobs): it "
                            "cannot score log-likelihood items")
    greedy = all(top and value >= max(top.values()) for value, top in zip(values, tops))
    return float(sum(values)), bool(greedy)


def _after_tokens(choice: dict, n_prompt: int) -> str:
    """The reply of a token-id prompt: the text of the echoed tokens after the prompt's."""
    logprobs = choice.get("logprobs") or {}
    offsets = logprobs.get("text_offset") or []
    text = str(choice.get("text") or "")
    return text[offsets[n_prompt]:] if len(offsets) > n_prompt else ""


# --------------------------------------------------------------------------- the engine
class OpenAIEndpoint(ServedEngine):
    """``candidate.endpoint``: a running OpenAI-compatible server, reached at its URL (see the module)."""

    capabilities = Capabilities(generate=True, loglikelihood=True, prompt_logprobs=True, top_k=None,
                                starts_server=False)

    def __init__(self, cfg: CandidateConfig, results_dir: Path) -> None:
        super().__init__(cfg, results_dir)
        self.client: Client | None = None  # connected by start()
        self.answering: Any = None  # the lm-eval model lm() made: it counts the items' tokens and seconds
        self.forced_tokens, self.forced_seconds = 0, 0.0  # what prompt_logprobs() sent, and its time

    @classmethod
    def serves(cls, cfg: CandidateConfig) -> bool:
        return bool(cfg.endpoint)

    @property
    def url(self) -> str:
        """The server's base URL."""
        return str(self.cfg.endpoint)

    @property
    def server(self) -> Server | None:
        """The server the harness started, asked how it ended when a request fails (None: not started here)."""
        return None

    def start(self) -> OpenAIEndpoint:
        """Connect: the served model's ``/v1/models`` entry (its name, context length and checkpoint directory)."""
        spec = EndpointSpec(url=self.url, model=self.cfg.endpoint_model, api_key_env=self.cfg.endpoint_api_key_env,
                            timeout_s=self.cfg.endpoint_timeout_s, batch_size=self.cfg.endpoint_batch_size,
                            concurrency=self.cfg.endpoint_concurrency,
                            max_requests_per_s=self.cfg.endpoint_max_requests_per_s, role=self.role)
        self.client = Client(spec, self.server)
        served = self.client.connect()
        limit, root = served.get("max_model_len"), served.get("root")
        self.model = ServedModel(str(self.client.model), int(limit) if limit else None, str(root) if root else None)
        return self

    def healthy(self) -> bool:
        return healthy(self.url)

    def lm(self, twin: Any) -> Any:
        self.answering = endpoint_lm(self._client(), twin)
        return self.answering

    def prompt_logprobs(self, texts: list[list[int]], k: int, tokenizer: Any) -> list[ServedLogprobs]:
        """:func:`teacher_forced` on this server."""
        start = time.perf_counter()
        try:
            served = teacher_forced(self._client(), texts, k, tokenizer, batch_size=self.cfg.endpoint_batch_size)
        finally:
            self.forced_seconds += time.perf_counter() - start
        self.forced_tokens += sum(len(ids) for ids in texts)
        return served

    def usage(self) -> dict[str, float]:
        lm = self.answering
        prompt, generated, seconds = (lm.prompt_tokens, lm.generated_tokens, lm.seconds) if lm else (0, 0, 0.0)
        return {"requests": self.client.requests if self.client else 0,
                "prompt_tokens": prompt + self.forced_tokens, "generated_tokens": generated,
                "seconds": round(seconds + self.forced_seconds, 3)}

    def _client(self) -> Client:
        if self.client is None:
            raise RuntimeError(f"{type(self).__name__}.start() was not called")
        return self.client


register_engine("openai", OpenAIEndpoint)
