"""The HTTP client of an OpenAI-compatible server: ``/v1/models`` and ``/v1/completions``, errors as one line.

Standard library only. A request that fails (a dead, hung or refusing server) raises
:class:`EndpointError` with one line; when the harness started the server, the line says how it ended
or its last log lines (the ``server``'s ``exit_line()`` and ``tail()``). The API key is read from the
environment variable ``api_key_env`` names at each request and is only ever put in the
``Authorization`` header: no attribute, message or log line holds it (:func:`scrub`, :func:`redact_url`).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Protocol

from harness.errors import UserError

log = logging.getLogger(__name__)


class EndpointError(UserError, RuntimeError):
    """A server that cannot answer, or answers for another model; one line, with the fix."""

    http_status: int | None = None  # the HTTP status of a refused request (None: no HTTP answer)
    detail: str = ""  # the server's own message for that refusal
    retry_after: float | None = None  # seconds a 429 answer asked the client to wait (its Retry-After header)


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    from email.utils import parsedate_to_datetime
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class RateLimit:
    """At most ``per_s`` request starts per second (None or 0: no limit), shared by the threads that call
    :meth:`wait`; ``clock`` and ``sleep`` are the time functions (a test passes its own)."""

    def __init__(self, per_s: float | None, clock: Any = time.monotonic, sleep: Any = time.sleep):
        self.interval = 1.0 / float(per_s) if per_s else 0.0
        self.clock, self.sleep = clock, sleep
        self._next = 0.0
        self._lock = threading.Lock()

    def wait(self) -> None:
        if not self.interval:
            return
        with self._lock:
            now = self.clock()
            start = max(now, self._next)
            self._next = start + self.interval
        if start > now:
            self.sleep(start - now)


@dataclass(frozen=True)
class EndpointSpec:
    """Where the candidate is served and how to talk to it (``candidate.endpoint*`` in the config)."""

    url: str  # base URL, with or without /v1: http://127.0.0.1:8000
    model: str | None = None  # the served model's name; None: the server's only model
    api_key_env: str | None = None  # NAME of the environment variable holding the key (never the key)
    timeout_s: float = 600.0  # one request; longer counts as a hung server
    batch_size: int = 8  # prompts per log-likelihood request
    concurrency: int = 1  # generation requests in flight at once (the engine batches them)
    top_logprobs: int = 1  # k asked for per prompt token (1 decides greedy; vLLM allows up to 20)
    max_requests_per_s: float | None = None  # requests started per second at most (the server's rate limit)
    role: str = "candidate"  # which side the server answers for, as messages and config keys name it
    retries_429: int = 6  # HTTP 429 (rate limited) answers waited out before the run ends
    # the config keys' prefix in messages (``judge.`` for the judge's server); None: ``<role>.endpoint_``
    settings: str | None = None
    retried: tuple[int, ...] = (429,)  # the statuses waited out (the judge also waits out 503, overloaded)
    resumes: bool = True  # a failure's line says the answers so far are kept (the judge's verdicts are not)

    @property
    def prefix(self) -> str:
        """How the config names this server's settings: ``candidate.endpoint_`` + ``timeout_s``, ``judge.`` + ..."""
        return self.settings if self.settings is not None else f"{self.role}.endpoint_"


RETRY_AFTER_MAX_S = 120.0  # the longest wait one 429 answer's Retry-After is granted


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


class Server(Protocol):
    """A server the harness started (:class:`harness.engines.vllm_serve.ServedProcess`)."""

    def exit_line(self) -> str | None:
        """None while it runs; else how it ended, with its last log lines."""

    def tail(self, lines: int = 5) -> str:
        """Its last log lines, as one line."""


class Client:
    """``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` over HTTP (standard library only), errors
    as one line. Thread-safe: one client serves every request thread of an engine (or of the judge)."""

    def __init__(self, spec: EndpointSpec, server: Server | None = None, sleep: Any = time.sleep):
        self.spec, self.server, self.sleep = spec, server, sleep
        self.base = _v1(spec.url)
        self.model = spec.model
        self.served: dict | None = None  # the served model's /v1/models entry, once connected
        self.requests = 0
        self.rate_limited = 0  # answers in spec.retried (429, ...) waited out
        self.limit = RateLimit(spec.max_requests_per_s, sleep=sleep)  # max_requests_per_s, shared by every thread
        self._count = threading.Lock()

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.spec.api_key_env:
            key = os.environ.get(self.spec.api_key_env)
            if not key:
                raise EndpointError(f"{self.spec.prefix}api_key_env={self.spec.api_key_env}: that environment "
                                    f"variable is not set; export it with the {self.spec.role} server's API key")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _fail(self, what: str) -> EndpointError:
        ended = self.server.exit_line() if self.server else None
        where = redact_url(self.base)
        tail = f"; last log lines: {self.server.tail()}" if self.server and not ended else ""
        text = f"{self.spec.role} endpoint {where}: {ended or what}{tail}"
        if self.spec.resumes:
            text += ". Items answered so far are kept: the same command resumes from them"
        return EndpointError(scrub(text.replace("\n", " "), self.spec.api_key_env))

    def call(self, path: str, body: dict | None = None) -> dict:
        """One request; an answer in ``spec.retried`` (429: rate limited) is waited out (its Retry-After, else
        1, 2, 4 ... s) up to ``retries_429`` times, every other failure ends the run in one line."""
        retries = self.spec.retries_429
        for attempt in range(retries + 1):
            try:
                return self._call_once(path, body, last=attempt == retries)
            except EndpointError as error:
                if error.http_status not in self.spec.retried or attempt == retries:
                    raise
                wait = min(error.retry_after if error.retry_after is not None else 2.0 ** attempt,
                           RETRY_AFTER_MAX_S)
                log.info("%s endpoint answered HTTP %d; retrying in %.1f s", self.spec.role, error.http_status, wait)
                with self._count:
                    self.rate_limited += 1
                self.sleep(wait)
        raise AssertionError("unreachable")

    def _call_once(self, path: str, body: dict | None, last: bool = True) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers=self._headers(),
                                         method="GET" if body is None else "POST")
        self.limit.wait()
        with self._count:
            self.requests += 1
        settings = self.spec.prefix
        try:
            with urllib.request.urlopen(request, timeout=self.spec.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            try:
                detail = json.loads(detail).get("error", {}).get("message", detail) if detail else detail
            except (ValueError, AttributeError):
                pass
            hint = f" (a wrong or missing API key: set {settings}api_key_env)" if exc.code in (401, 403) else \
                f" (still HTTP {exc.code} after {self.spec.retries_429} retries: lower {settings}max_requests_per_s " \
                f"or {settings}concurrency)" if exc.code in self.spec.retried and last else ""
            error = self._fail(f"HTTP {exc.code} on {path}{hint}: {detail}")
            error.http_status, error.detail = exc.code, scrub(str(detail), self.spec.api_key_env)
            error.retry_after = retry_after(exc.headers.get("Retry-After") if exc.headers else None)
            raise error from None
        except (TimeoutError, socket.timeout):
            raise self._fail(f"no reply to {path} within {self.spec.timeout_s:.0f} s (a hung server; "
                             f"{settings}timeout_s sets the limit)") from None
        except urllib.error.URLError as exc:
            reason = getattr(exc.reason, "strerror", None) or str(exc.reason)
            raise self._fail(f"cannot reach the server ({reason}); check the URL and that it is serving") from None
        except (ConnectionError, OSError) as exc:
            raise self._fail(f"the connection failed ({exc.__class__.__name__}: {exc})") from None
        except ValueError:
            raise self._fail(f"{path} answered with something that is not JSON") from None

    def connect(self) -> dict:
        """The served model's entry from ``/v1/models`` (kept as :attr:`served`); fixes :attr:`model` when the spec
        left it open."""
        listed = self.call("/models").get("data") or []
        names = [str(entry.get("id")) for entry in listed]
        if self.model is None:
            if len(names) != 1:
                raise EndpointError(f"{self.spec.role} endpoint {redact_url(self.base)} serves {names or 'no models'}: "
                                    f"name one with {self.spec.prefix}model=<id>")
            self.model = names[0]
        elif self.model not in names:
            raise EndpointError(f"{self.spec.prefix}model={self.model!r} is not served at "
                                f"{redact_url(self.base)}; it serves {names}")
        self.served = next(entry for entry in listed if str(entry.get("id")) == self.model)
        return self.served

    def complete(self, **body: Any) -> list[dict]:
        """One ``/v1/completions`` call; its choices in prompt order."""
        answer = self.call("/completions", {"model": self.model, **body})
        choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
        return choices


def healthy(url: str) -> bool:
    """Whether the server at ``url`` answers ``/health`` (or, without one, ``/v1/models``) with 200."""
    for path in ("/health", "/v1/models"):
        try:
            with urllib.request.urlopen(url + path, timeout=5) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError, ValueError):
            continue
    return False
