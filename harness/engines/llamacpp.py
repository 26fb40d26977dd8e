"""The ``llama.cpp`` engines: a GGUF candidate served by llama-cpp-python's OpenAI-compatible server.

``quant=external candidate.serve=".venv-llamacpp/bin/python -m llama_cpp.server --model X.gguf --host 127.0.0.1
--port {port} --n_ctx 4096"`` (the ``llamacpp-serve`` engine: any serve command naming ``llama_cpp.server``) or
``candidate.endpoint=<url>`` of a running one (the ``llamacpp`` engine: the server's ``/v1/models`` entries say
``owned_by: me``, llama-cpp-python's signature) evaluate a GGUF as the candidate. Items, prompts and per-item
records are the ``openai`` engine's (:mod:`harness.engines.openai_endpoint`); what differs is how the requests
are made, because llama-cpp-python's server (0.3.x) differs from vLLM's:

* one prompt per request, and only text (a list of prompts fails, token ids are refused): every prompt is the
  reference's token ids decoded to text, and the server's own tokenization of that text (``/extras/tokenize``,
  ids) must equal the reference's ids, else the item is refused in one line;
* ``max_tokens=0`` means "until the context is full": echo requests ask for 1 token and read only the
  prompt's entries;
* echoed prompt log-probs (``echo=true, logprobs=k``) drop every BOS token (``tokenizer.ggml.bos_token_id``;
  SmolLM2's is ``<|im_start|>``, so each chat turn's opening token) and pair the i-th echoed token with the
  distribution *after* it unless the prompt starts with BOS (then the first is stripped and the rest line up).
  So log-probs are read only from prompts that start with BOS (a chat-templated SmolLM2 prompt does), each
  entry mapped back to its position; the first scored position (its log-prob is nulled, as the OpenAI API
  nulls position 0) and each BOS position have no entry, so the token divergence leaves those positions out.
  A prompt without a leading BOS (e.g. ``model.chat_template=false`` with a tokenizer that adds no BOS) cannot
  be scored: log-likelihood items are refused in one line at the first one, and the token divergence is
  replaced by one line that says why (accuracy and flips only);
* ``top_logprobs`` are keyed by each token's text (no ids, bytes of a partial character dropped, one value per
  text), the top-k of the full distribution plus the actual token: a text is read as the one reference id that
  renders to it (:class:`RenderedNames`; a text several ids render to is no cell), so
  the KL is the same top-k partition lower bound as vLLM's (:mod:`harness.divergence.topk_bound`); the server
  sorts the whole vocabulary per position in Python, so scoring costs ~10 ms per prompt token;
* no ``/health`` and no context length in ``/v1/models``: the context is the serve command's ``--n_ctx``
  (2048 when not given), the harness's ``max_model_len``;
* generation: ``temperature=0`` is greedy only with ``repeat_penalty=1.0``: the server's default is 1.1, applied
  before the greedy pick (measured on SmolLM2 Q8_0: it changed the digits of arithmetic answers), so every
  request sends ``repeat_penalty=1.0`` and no frequency/presence penalty; the task's stop strings; the reply is
  the server's text (no echo: an echo with log-probs would sort the vocabulary per prompt token).
  Requests are served one at a time (the server holds one model behind a lock), so
  ``candidate.endpoint_concurrency`` > 1 queues them rather than batching.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import re
import shlex
import time
from pathlib import Path
from typing import Any

import numpy as np

from harness.config import CandidateConfig
from harness.divergence.topk_bound import NoPromptLogprobs, ServedLogprobs
from harness.engines.base import Capabilities, ServedModel
from harness.engines.openai_endpoint import (
    OpenAIEndpoint,
    TokenNames,
    _endpoint_lm_class,
    _preview,
    check_tokens,
    reference_prompt,
    with_reasoning,
)
from harness.engines.openai_http import Client, EndpointError, EndpointSpec
from harness.engines.registry import register_engine
from harness.engines.vllm_serve import VLLMServe

log = logging.getLogger(__name__)

OWNER = "me"  # llama-cpp-python's /v1/models says owned_by "me" for each model
DEFAULT_N_CTX = 2048  # llama_cpp.server's n_ctx when the command gives none
NO_LEADING_BOS = ("llama-cpp-python's server returns echoed prompt log-probs aligned only for prompts that start with "
                  "BOS (it drops BOS and otherwise pairs each token with the distribution after it), and these "
                  "prompts do not")


def is_llamacpp_command(command: str | None) -> bool:
    """Whether ``candidate.serve`` starts llama-cpp-python's server (``python -m llama_cpp.server ...``)."""
    return bool(command) and "llama_cpp.server" in str(command)


def n_ctx_of(command: str) -> int:
    """The context length a ``llama_cpp.server`` command serves (``--n_ctx N``; the server's default otherwise)."""
    words = shlex.split(command)
    for index, word in enumerate(words):
        for flag in ("--n_ctx", "--n-ctx"):
            if word == flag and index + 1 < len(words):
                return int(words[index + 1])
            if word.startswith(flag + "="):
                return int(word.split("=", 1)[1])
    return DEFAULT_N_CTX


@functools.lru_cache(maxsize=16)
def answers_as_llamacpp(url: str, api_key_env: str | None = None) -> bool:
    """Whether the server at ``url`` is llama-cpp-python's (every ``/v1/models`` entry ``owned_by: me``)."""
    try:
        listed = Client(EndpointSpec(url=url, api_key_env=api_key_env, timeout_s=5.0)).call("/models").get("data")
    except EndpointError:
        return False
    return bool(listed) and all(isinstance(entry, dict) and entry.get("owned_by") == OWNER for entry in listed)


# --------------------------------------------------------------------------- requests
class LlamaCppClient:
    """The two calls the llama.cpp engine makes: the server's tokens of a text, and a completion's whole answer."""

    def __init__(self, client: Client):
        self.client = client
        self.extras = Client(client.spec, client.server)
        self.extras.base = re.sub(r"/v1$", "", client.base)  # /extras/* are not under /v1

    def tokens(self, text: str) -> list[int]:
        """The server's token ids of ``text`` as a completion prompt (special tokens parsed, BOS as it adds it)."""
        return [int(t) for t in self.extras.call("/extras/tokenize", {"input": text, "model": self.client.model})
                ["tokens"]]

    def complete(self, **body: Any) -> dict:
        """One ``/v1/completions`` call with one prompt: its answer (choices and usage)."""
        answer = self.client.call("/completions", {"model": self.client.model, **body})
        if len(answer.get("choices") or []) != 1:
            raise EndpointError(f"the server answered {len(answer.get('choices') or [])} choices to one prompt")
        return answer

    def text_of(self, ids: list[int], tokenizer: Any, what: str) -> str:
        """The text sent for the reference's ``ids``, refused unless the server tokenizes it back to exactly them."""
        text = tokenizer.decode(ids, skip_special_tokens=False)
        check_tokens(self.tokens(text), list(ids), tokenizer, what)
        return text


def echoed_logprobs(llama: LlamaCppClient, ids: list[int], k: int, tokenizer: Any, what: str
                    ) -> tuple[np.ndarray, list[dict | None]]:
    """Teacher-forced log-probs of ``ids`` from the server's echo: for positions 1..n-1, each actual token's
    log-prob (NaN where the server gives none) and its top-k as ``{text: log-prob}`` (None where none).

    Raises :class:`NoPromptLogprobs` for a prompt that does not start with BOS (module docstring)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if not ids or bos is None or ids[0] != bos:
        raise NoPromptLogprobs(NO_LEADING_BOS)
    text = llama.text_of(ids, tokenizer, what)
    answer = llama.complete(prompt=text, max_tokens=1, echo=True, logprobs=max(1, k), temperature=0)
    logprobs = answer["choices"][0].get("logprobs") or {}
    names, values, tops = logprobs.get("tokens") or [], logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
    positions = [p for p in range(1, len(ids)) if ids[p] != bos]  # the positions the echo has an entry for
    if values is None or tops is None or len(names) < len(positions):
        raise NoPromptLogprobs(f"the server returned {len(names)} echoed tokens for a {len(ids)}-token prompt "
                               f"(logprobs={k}): serve it with logits_all (llama_cpp.server's default)")
    special = set(getattr(tokenizer, "all_special_ids", None) or []) | {
        index for index, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
        if getattr(added, "special", False)}
    for entry, position in zip(names, positions):  # its layout, checked: entry j is the token at positions[j]
        expected = tokenizer.decode([ids[position]], skip_special_tokens=False)
        unrendered = ids[position] in special or "\ufffd" in expected  # a control token or part of a character
        if entry != expected and not (unrendered and entry in ("", expected.replace("\ufffd", ""))):
            raise NoPromptLogprobs(f"{what}: the server's echoed tokens do not line up with the prompt's (position "
                                   f"{position}: {entry!r} vs {expected!r}); its log-probs cannot be read")
    target = np.full(len(ids) - 1, np.nan)
    top: list[dict | None] = [None] * (len(ids) - 1)
    for j, position in enumerate(positions):
        if values[j] is not None and tops[j]:
            target[position - 1] = float(values[j])
            top[position - 1] = tops[j]
    return target, top


class RenderedNames(TokenNames):
    """A llama-cpp-python ``top_logprobs`` key read as one reference id, or None.

    The server renders each token's bytes with ``decode("utf-8", errors="ignore")``, so a token holding part of a
    character loses those bytes (``" \xe2"`` renders as ``" "``), and its dictionary keeps one value per text:
    the last of the tokens that render alike. A key is read as an id only when exactly one token of the
    reference's vocabulary renders to it; a shared key is no cell (measured on SmolLM2: the cell ``" "`` carried
    another token's log-prob, 5 nats off, and the bound exceeded the exact KL).
    """

    def render(self, token: int) -> str:
        """The text the server shows for ``token``."""
        return super().render(token).replace("\ufffd", "")

    def id(self, name: str) -> int | None:
        return self.by_text(name)  # the server names tokens by text only


def served_logprobs(target: np.ndarray, tops: list[dict | None], k: int, names: RenderedNames,
                    actual: list[int] | None = None) -> ServedLogprobs:
    """:class:`ServedLogprobs` of one text: the top dictionaries' texts read as reference ids (-1: no cell).

    ``actual[row]``: the token at that position; the key the server wrote it under holds its log-prob (the
    server writes the actual token last), so that key is read as it even when other tokens render alike."""
    width = max([len(t) for t in tops if t] + [1])
    top_ids = np.full((len(tops), width), -1, dtype=np.int64)
    top_values = np.full((len(tops), width), np.nan)
    for row, top in enumerate(tops):
        column = 0
        mine = names.render(actual[row]) if actual is not None and top else None
        for name, value in (top or {}).items():
            token = actual[row] if actual is not None and str(name) == mine else names.id(str(name))
            if token is None or value is None or token in top_ids[row, :column]:
                continue
            top_ids[row, column], top_values[row, column] = token, float(value)
            column += 1
    return ServedLogprobs(target, top_ids, top_values, k)


# --------------------------------------------------------------------------- the lm-eval model
def llamacpp_lm(client: Client, twin: Any, max_len: int | None) -> Any:
    """An lm-eval ``LM`` answering through llama-cpp-python's server with ``twin``'s prompts (probed once here)."""
    served = dict(client.served or client.connect())
    if max_len:
        served["max_model_len"] = max_len
    lm = _llamacpp_lm_class()(client, twin, served)
    lm.probe()
    return lm


@functools.cache
def _llamacpp_lm_class() -> type:
    base = _endpoint_lm_class()

    class LlamaCppLM(base):  # type: ignore[misc, valid-type]
        """The reference's prompts and tokens, llama-cpp-python's answers (module docstring)."""

        def __init__(self, client: Client, twin: Any, served: dict) -> None:
            super().__init__(client, twin, served)
            self.llama = LlamaCppClient(client)

        def _timed_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        def probe(self) -> None:
            """Refuse a server whose tokenizer differs, before any item: one chat-templated text, its ids compared."""
            from harness.engines.openai_endpoint import PROBE_TEXT

            try:
                text = self.apply_chat_template([{"role": "user", "content": PROBE_TEXT}])
            except Exception:  # noqa: BLE001 - a tokenizer without a chat template: the plain text
                text = PROBE_TEXT
            reference, _, _ = reference_prompt(self, text, self.max_length)
            self._timed_call(self.llama.text_of, reference, self.tokenizer, f"tokenizer probe {_preview(text)!r}")

        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
            return [self._score(key, ctx, cont) for key, ctx, cont in requests]

        def _score(self, key: Any, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
            prompt = (list(ctx) + list(cont))[-(self.max_length + 1):]
            what = f"log-likelihood item {_preview(str(key[0]) if key else '')!r}"
            self._fits(len(prompt), what)
            try:
                target, tops = self._timed_call(echoed_logprobs, self.llama, prompt, self.client.spec.top_logprobs,
                                                self.tokenizer, what)
            except NoPromptLogprobs as exc:
                raise EndpointError(f"{what}: {exc}; llama.cpp cannot score log-likelihood items here (serve it with "
                                    "vLLM, or set model.chat_template=true / a tokenizer that adds BOS, or drop "
                                    "the multiple-choice tasks)") from None
            n = len(cont)
            values, top = target[-n:], tops[-n:]
            if n == 0 or np.isnan(values).any() or any(t is None for t in top):
                raise EndpointError(f"{what}: the server returned no log-prob for a continuation token (the first "
                                    "position and BOS tokens have none on llama-cpp-python's echo)")
            greedy = all(value >= max(t.values()) for value, t in zip(values, top))
            answer = (float(values.sum()), bool(greedy))
            self.prompt_tokens += len(prompt)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            return answer

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

            totals = []
            for (string,) in (request.args for request in requests):
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)]
                total = sum(self._score(None, ctx, cont)[0] for ctx, cont in windows)
                self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
                totals.append(total)
            return totals

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            items = [request.args for request in requests]
            workers = max(1, int(self.client.spec.concurrency))
            prepared = [self._prepare(context, gen_kwargs) for context, gen_kwargs in items]
            start = time.perf_counter()
            replies = []
            try:
                if workers == 1 or len(items) < 2:
                    for (context, gen_kwargs), request in zip(items, prepared):
                        replies.append(self._record(context, gen_kwargs, request, self.llama.complete(**request[0])))
                else:
                    from concurrent.futures import ThreadPoolExecutor

                    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llamacpp") as pool:
                        futures = [pool.submit(self.llama.complete, **request[0]) for request in prepared]
                        try:
                            for (context, gen_kwargs), request, future in zip(items, prepared, futures):
                                replies.append(self._record(context, gen_kwargs, request, future.result()))
                        finally:
                            for future in futures:
                                future.cancel()
            finally:
                self.seconds += time.perf_counter() - start
            return replies

        def _prepare(self, context: str, gen_kwargs: dict) -> tuple[dict, list[int], list[str], str]:
            """(request body, the reference's prompt ids, stop strings, the item) of one generation item, its
            prompt checked against the server's tokens before any generation request."""
            from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

            eos = self.twin.tok_decode(self.eot_token_id, skip_special_tokens=False)
            kwargs = normalize_gen_kwargs(gen_kwargs, self.twin.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            what = f"generation item {_preview(context)!r}"
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
                raise EndpointError(f"{what} asks for sampling ({gen_kwargs}); an endpoint candidate is paired "
                                    "greedily: set the task to do_sample: false")
            reference, _, _ = reference_prompt(self, context, self.max_length - max_gen_toks)
            self._fits(len(reference) + max_gen_toks, what)
            text = self._timed_call(self.llama.text_of, reference, self.tokenizer, what)
            # temperature 0 is greedy only without penalties: the server's default repeat_penalty is 1.1
            body = dict(prompt=text, max_tokens=max_gen_toks, temperature=0, stop=[s for s in until if s],
                        repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
            return body, reference, until, what

        def _record(self, context: str, gen_kwargs: dict, request: tuple, answer: dict) -> str:
            from lm_eval.models.utils import postprocess_generated_text

            _, reference, until, what = request
            choice = answer["choices"][0]
            reply = with_reasoning(choice, str(choice.get("text") or ""), getattr(self.twin, "think_tags", None), what)
            reply = postprocess_generated_text(reply, until, None)
            usage = answer.get("usage") or {}
            self.prompt_tokens += len(reference)
            self.generated_tokens += int(usage.get("completion_tokens") or 0)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), reply)
            return reply

    return LlamaCppLM


# --------------------------------------------------------------------------- the engines
class LlamaCppMixin:
    """What the two llama.cpp engines share: one prompt a request, text prompts, the echo's layout."""

    cfg: CandidateConfig
    model: ServedModel | None
    client: Client | None
    answering: Any
    forced_tokens: int
    forced_seconds: float

    def _n_ctx(self) -> int | None:
        return n_ctx_of(str(self.cfg.serve)) if self.cfg.serve else None

    def _after_connect(self) -> None:
        assert self.client is not None and self.model is not None
        self.client.spec = dataclasses.replace(self.client.spec, batch_size=1)  # one prompt per request
        self.model = dataclasses.replace(self.model, max_len=self.model.max_len or self._n_ctx())

    def lm(self, twin: Any) -> Any:
        assert self.client is not None
        self.answering = llamacpp_lm(self.client, twin, self.model.max_len if self.model else None)
        return self.answering

    def prompt_logprobs(self, texts: list[list[int]], k: int, tokenizer: Any) -> list[ServedLogprobs]:
        """The echo's log-probs of each text (NaN at positions it gives none: the first and each BOS)."""
        assert self.client is not None
        llama, names = LlamaCppClient(self.client), RenderedNames(tokenizer)
        bos = getattr(tokenizer, "bos_token_id", None)
        if texts and not any(ids and ids[0] == bos for ids in texts):
            raise NoPromptLogprobs(NO_LEADING_BOS)
        start = time.perf_counter()
        out, missing, unscored = [], 0, 0
        try:
            for ids in texts:
                what = f"divergence text {_preview(tokenizer.decode(ids[:40], skip_special_tokens=False))!r}"
                if not ids or ids[0] != bos:  # e.g. a text cut from the left to divergence_max_tokens
                    target, tops = np.full(max(0, len(ids) - 1), np.nan), [None] * max(0, len(ids) - 1)
                    unscored += 1
                else:
                    target, tops = echoed_logprobs(llama, list(ids), k, tokenizer, what)
                missing += int(np.isnan(target).sum())
                out.append(served_logprobs(target, tops, k, names, list(ids[1:])))
        finally:
            self.forced_seconds += time.perf_counter() - start
        self.forced_tokens += sum(len(ids) for ids in texts)
        if missing:
            log.warning("llama.cpp: %d of %d divergence positions have no echoed log-prob and are left out (the "
                        "first scored position and BOS tokens of each text%s)", missing,
                        sum(max(0, len(ids) - 1) for ids in texts),
                        f"; {unscored} texts without a leading BOS, e.g. cut from the left" if unscored else "")
        return out


class LlamaCppEndpoint(LlamaCppMixin, OpenAIEndpoint):
    """``candidate.endpoint``: a running llama-cpp-python server (``/v1/models`` owned_by ``me``)."""

    capabilities = Capabilities(generate=True, loglikelihood=True, prompt_logprobs=True, top_k=None,
                                starts_server=False)

    @classmethod
    def serves(cls, cfg: CandidateConfig) -> bool:
        return bool(cfg.endpoint) and answers_as_llamacpp(str(cfg.endpoint), cfg.endpoint_api_key_env)

    def start(self) -> LlamaCppEndpoint:
        super().start()
        self._after_connect()
        return self


class LlamaCppServe(LlamaCppMixin, VLLMServe):
    """``candidate.serve`` naming ``llama_cpp.server``: started on a free loopback port, stopped at the end."""

    capabilities = Capabilities(generate=True, loglikelihood=True, prompt_logprobs=True, top_k=None,
                                starts_server=True)

    @classmethod
    def serves(cls, cfg: CandidateConfig) -> bool:
        return is_llamacpp_command(cfg.serve)

    def start(self) -> LlamaCppServe:
        super().start()
        self._after_connect()
        return self


def gguf_of(command: str) -> Path | None:
    """The GGUF file a ``llama_cpp.server`` command serves (``--model X``), when it names one."""
    words = shlex.split(command)
    for index, word in enumerate(words):
        if word == "--model" and index + 1 < len(words):
            return Path(words[index + 1])
        if word.startswith("--model="):
            return Path(word.split("=", 1)[1])
    return None


__all__ = ["LlamaCppEndpoint", "LlamaCppServe", "answers_as_llamacpp", "gguf_of", "is_llamacpp_command", "n_ctx_of"]

register_engine("llamacpp", LlamaCppEndpoint)
register_engine("llamacpp-serve", LlamaCppServe)
