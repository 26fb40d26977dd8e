"""A candidate answered by a serving engine: any OpenAI-compatible ``/v1/completions`` endpoint.

``candidate.endpoint=<url>`` evaluates whatever that server serves (vLLM, SGLang, TensorRT-LLM,
llama.cpp's server, ...) as the candidate; ``candidate.serve="<command with {port}>"`` starts the
server first (:class:`harness.checkpoint.served.ServedProcess`: a free loopback port, wait for health,
stop at the end; :class:`Client` asks any such ``server`` how it ended when a request fails). The
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
  HFLM cuts it.

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

import json
import logging
import os
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from harness.errors import UserError

log = logging.getLogger(__name__)

# Checked once per connection (chat template, accents, CJK, an emoji, digits, code): a server with another
# tokenizer echoes other tokens for it.
PROBE_TEXT = "Quelle est la capitale de la France ? Ünïcödé → 東京タワー 😀 12345 `def f(x): return x**2`"
TOKEN_ID = re.compile(r"^token_id:(\d+)$")  # vLLM's return_tokens_as_token_ids form


class EndpointError(UserError, RuntimeError):
    """A server that cannot answer, or answers for another model; one line, with the fix."""


@dataclass(frozen=True)
class EndpointSpec:
    """Where the candidate is served and how to talk to it (``candidate.endpoint*`` in the config)."""

    url: str  # base URL, with or without /v1: http://127.0.0.1:8000
    model: str | None = None  # the served model's name; None: the server's only model
    api_key_env: str | None = None  # NAME of the environment variable holding the key (never the key)
    timeout_s: float = 600.0  # one request; longer counts as a hung server
    batch_size: int = 8  # prompts per log-likelihood request
    top_logprobs: int = 1  # k asked for per prompt token (1 decides greedy; vLLM allows up to 20)


def redact_url(url: str) -> str:
    """``url`` without any user:password part (a URL is logged; credentials must not be)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = host + (f":{parts.port}" if parts.port else "")
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return url


def _v1(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def scrub(text: str, secret_env: str | None) -> str:
    """``text`` with the value of the environment variable ``secret_env`` (an API key) replaced by ***."""
    secret = os.environ.get(secret_env) if secret_env else None
    return text.replace(secret, "***") if secret else text


# --------------------------------------------------------------------------- HTTP
class Client:
    """``/v1/models`` and ``/v1/completions`` over HTTP (standard library only), errors as one line."""

    def __init__(self, spec: EndpointSpec, server: Any = None):  # a ServedProcess: exit_line(), tail()
        self.spec, self.server = spec, server
        self.base = _v1(spec.url)
        self.model = spec.model
        self.requests = 0

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.spec.api_key_env:
            key = os.environ.get(self.spec.api_key_env)
            if not key:
                raise EndpointError(f"candidate.endpoint_api_key_env={self.spec.api_key_env}: that environment "
                                    "variable is not set; export it with the server's API key")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _fail(self, what: str) -> EndpointError:
        ended = self.server.exit_line() if self.server else None
        where = redact_url(self.base)
        tail = f"; last log lines: {self.server.tail()}" if self.server and not ended else ""
        text = f"candidate endpoint {where}: {ended or what}{tail}. Items answered so far are kept: the same " \
               "command resumes from them"
        return EndpointError(scrub(text.replace("\n", " "), self.spec.api_key_env))

    def call(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers=self._headers(),
                                         method="GET" if body is None else "POST")
        self.requests += 1
        try:
            with urllib.request.urlopen(request, timeout=self.spec.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            try:
                detail = json.loads(detail).get("error", {}).get("message", detail) if detail else detail
            except (ValueError, AttributeError):
                pass
            hint = " (a wrong or missing API key: set candidate.endpoint_api_key_env)" if exc.code in (401, 403) \
                else ""
            raise self._fail(f"HTTP {exc.code} on {path}{hint}: {detail}") from None
        except (TimeoutError, socket.timeout):
            raise self._fail(f"no reply to {path} within {self.spec.timeout_s:.0f} s (a hung server; "
                             "candidate.endpoint_timeout_s sets the limit)") from None
        except urllib.error.URLError as exc:
            reason = getattr(exc.reason, "strerror", None) or str(exc.reason)
            raise self._fail(f"cannot reach the server ({reason}); check the URL and that it is serving") from None
        except (ConnectionError, OSError) as exc:
            raise self._fail(f"the connection failed ({exc.__class__.__name__}: {exc})") from None
        except ValueError:
            raise self._fail(f"{path} answered with something that is not JSON") from None

    def connect(self) -> dict:
        """The served model's entry from ``/v1/models``; fixes :attr:`model` when the spec left it open."""
        listed = self.call("/models").get("data") or []
        names = [str(entry.get("id")) for entry in listed]
        if self.model is None:
            if len(names) != 1:
                raise EndpointError(f"candidate endpoint {redact_url(self.base)} serves {names or 'no models'}: "
                                    "name one with candidate.endpoint_model=<id>")
            self.model = names[0]
        elif self.model not in names:
            raise EndpointError(f"candidate.endpoint_model={self.model!r} is not served at "
                                f"{redact_url(self.base)}; it serves {names}")
        return next(entry for entry in listed if str(entry.get("id")) == self.model)

    def complete(self, **body: Any) -> list[dict]:
        """One ``/v1/completions`` call; its choices in prompt order."""
        answer = self.call("/completions", {"model": self.model, **body})
        choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
        return choices


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


# --------------------------------------------------------------------------- the lm-eval model
def endpoint_lm(spec: EndpointSpec, twin: Any, server: Any = None) -> Any:
    """An lm-eval ``LM`` answering through ``spec``'s server, with ``twin``'s prompts and tokens.

    ``twin`` is the reference's own lm-eval wrapper (``harness.evaluation.evaluate.make_lm`` on the
    reference): its tokenization, truncation and chat template make the prompts, so they are the
    reference's exactly; its model is never called.
    """
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs
    from lm_eval.models.utils import postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    client = Client(spec, server)
    served = client.connect()
    limit = served.get("max_model_len")

    class EndpointLM(TemplateLM):
        def __init__(self) -> None:
            super().__init__()
            self.client, self.twin, self.tokenizer = client, twin, twin.tokenizer
            self.served = served  # the server's /v1/models entry (vLLM names the checkpoint: "root")
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

        # -- log-likelihood: prompt log-probs of the reference's token ids
        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
            results: list[tuple[float, bool]] = []
            for start in range(0, len(requests), max(1, spec.batch_size)):
                chunk = requests[start:start + spec.batch_size]
                prompts = [(list(ctx) + list(cont))[-(self.max_length + 1):] for _, ctx, cont in chunk]
                for (key, _, _), prompt in zip(chunk, prompts):
                    self._fits(len(prompt), f"item {_preview(str(key[0]) if key else '')!r}")
                # token *texts* come back (no return_tokens_as_token_ids): echoed ids would only repeat the ids
                # sent, while their texts show which vocabulary the server scored them in
                choices = self._timed(prompt=prompts, max_tokens=0, echo=True, logprobs=max(1, spec.top_logprobs),
                                      temperature=0)
                if len(choices) != len(prompts):
                    raise EndpointError(f"the server answered {len(choices)} of {len(prompts)} prompts of one request")
                for (key, _, cont), prompt, choice in zip(chunk, prompts, choices):
                    check_tokens(served_ids(choice, self.tokenizer, len(prompt)), prompt, self.tokenizer,
                                 f"log-likelihood item {_preview(str(key[0]) if key else '')!r}")
                    answer = _continuation_score(choice, len(cont))
                    self.prompt_tokens += len(prompt)
                    results.append(answer)
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, answer)
            return results

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            totals = []
            for request in requests:
                (string,) = request.args
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)]
                scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
                total = sum(score for score, _ in scores)
                totals.append(total)
                self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            return totals

        # -- generation: the prompt text as lm-eval built it
        def _prompt(self, context: str, left_truncate_len: int) -> tuple[list[int], str | list[int], bool]:
            """(the reference's prompt ids as HFLM's generate_until makes them, what to send, add_special_tokens).

            The text is sent unless HFLM left-truncated it (then its ids are); ``add_special_tokens`` is
            HFLM's choice (False when the text already starts with BOS), passed on to servers that read it.
            """
            ids, _ = self.twin.tok_batch_encode([context], left_truncate_len=left_truncate_len)
            reference = ids[0].tolist()
            bos = getattr(self.tokenizer, "bos_token", None)
            add_special = False if has_bos_prefix(context, bos) else (
                self.twin.add_bos_token if self.twin.add_bos_token is not None else True)
            full = self.tok_encode(context, add_special_tokens=add_special)
            return reference, (context if len(full) == len(reference) else reference), add_special

        def probe(self) -> None:
            """Refuse a server whose tokenizer differs, before any item: one chat-templated text, echoed."""
            try:
                text = self.apply_chat_template([{"role": "user", "content": PROBE_TEXT}])
            except Exception:  # noqa: BLE001 - a tokenizer without a chat template: the plain text
                text = PROBE_TEXT
            reference, prompt, add_special = self._prompt(text, self.max_length)
            (choice,) = self._timed(prompt=prompt, max_tokens=0, echo=True, logprobs=0, temperature=0,
                                    add_special_tokens=add_special, return_tokens_as_token_ids=True)
            check_tokens(served_ids(choice, self.tokenizer, len(reference)), reference, self.tokenizer,
                         f"tokenizer probe {_preview(text)!r}")

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            eos = self.twin.tok_decode(self.eot_token_id, skip_special_tokens=False)
            replies = []
            for request in requests:
                context, gen_kwargs = request.args
                kwargs = normalize_gen_kwargs(gen_kwargs, self.twin.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_gen_toks = int(kwargs.pop("max_gen_toks"))
                if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
                    raise EndpointError(f"generation item {_preview(context)!r} asks for sampling ({gen_kwargs}); "
                                        "an endpoint candidate is paired greedily: set the task to do_sample: false")
                what = f"generation item {_preview(context)!r}"
                reference, prompt, add_special = self._prompt(context, self.max_length - max_gen_toks)
                self._fits(len(reference) + max_gen_toks, what)
                (choice,) = self._timed(prompt=prompt, max_tokens=max_gen_toks, temperature=0, echo=True,
                                        logprobs=0, stop=[s for s in until if s], add_special_tokens=add_special,
                                        return_tokens_as_token_ids=True, skip_special_tokens=True)
                check_tokens(served_ids(choice, self.tokenizer, len(reference)), reference, self.tokenizer, what)
                text = str(choice.get("text") or "")
                echoed = context if isinstance(prompt, str) else None
                if echoed is not None and not text.startswith(echoed):
                    raise EndpointError(f"{what}: the server's echo does not start with the prompt text; it does not "
                                        "echo prompts as the OpenAI completions API does")
                reply = text[len(echoed):] if echoed is not None else _after_tokens(choice, len(reference))
                reply = postprocess_generated_text(reply, until, None)
                self.prompt_tokens += len(reference)
                self.generated_tokens += max(0, len((choice.get("logprobs") or {}).get("tokens") or [])
                                             - len(reference))
                replies.append(reply)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), reply)
            return replies

    lm = EndpointLM()
    lm.probe()
    return lm


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
